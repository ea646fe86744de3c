"""The Spark job as real processes: run directly (the job starts the JVM with
its own defaults) and under spark-submit (whose --master and conf win), plus
the environment failure and the code package. Each run is a fresh JVM."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import zipfile

import pytest

from tests.spark.workload import random_records, write_log
from metalog.tools.cluster.launcher import REPO_ROOT

pytestmark = pytest.mark.slow

RUN_TIMEOUT_S = 300
OUR_STDERR = ("[metalog spark", "metalog spark:", "WARNING: Using incubator modules: jdk.incubator.vector")


def spark_submit_path() -> str:
    import pyspark

    return os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-submit")


def job_env(tmp_path, **extra) -> dict:
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
               TMPDIR=str(tmp_path / "tmp"), **extra)
    env.pop("PYSPARK_SUBMIT_ARGS", None)  # the job's own, not a leftover of this test process
    os.makedirs(env["TMPDIR"], exist_ok=True)
    return env


def data_dir(tmp_path) -> tuple[str, int]:
    d = str(tmp_path / "n1")
    recs = write_log(d, random_records(random.Random(4), 150), node_id=1)
    return d, recs[-1][0] + 1


def test_no_java_exits_3_with_one_clear_line(tmp_path):
    """No java on PATH and no JAVA_HOME: exit 3 (environment), one line on stderr, a report."""
    d, _end = data_dir(tmp_path)
    env = job_env(tmp_path, PATH="/nonexistent")
    env.pop("JAVA_HOME", None)
    report = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "metalog.tools.cli", "spark", "snapshot", d, "--out",
                           str(tmp_path / "out"), "--report", str(report)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "metalog spark: no Java found: install a JDK (17 or 21) or set JAVA_HOME")
    rep = json.loads(report.read_text())
    assert rep["result"] == "environment failure" and rep["errors"][0]["category"] == "environment"
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.checkpoint"))


def test_jvm_that_does_not_start_names_the_master_and_where_its_reason_is(tmp_path):
    """Run directly with a heap the JVM refuses: exit 3; the JVM's own reason on
    stderr, then one line naming the master the job used (not "spark-submit")."""
    d, _end = data_dir(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "metalog.tools.cli", "spark", "snapshot", d, "--out",
                           str(tmp_path / "out"), "--conf", "spark.driver.memory=lots"],
                          cwd=REPO_ROOT, env=job_env(tmp_path), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 3, proc.stderr
    assert "Invalid maximum heap size: -Xmxlots" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("metalog spark: cannot start Spark (local[*]): ") and "JAVA_GATEWAY_EXITED" in last
    assert last.endswith("(the JVM's own message is on the lines above; check --driver-memory and --conf)")
    assert not list((tmp_path / "out").glob("*.checkpoint"))


def test_verbose_shows_sparks_own_warnings(tmp_path):
    """--verbose leaves Spark's own log4j2 defaults (warnings on) instead of the
    quiet file, whose org.apache.spark/hadoop loggers at error hid them all."""
    proc = subprocess.run([sys.executable, "-m", "metalog.tools.cli", "spark", "sql", "--verbose", "--out",
                           str(tmp_path / "nothing"), "SELECT 1"],
                          cwd=REPO_ROOT, env=job_env(tmp_path), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 2, proc.stderr
    assert 'Setting default log level to "WARN".' in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("metalog spark sql: no tables under ")


def test_package_holds_the_executor_code(tmp_path):
    out = tmp_path / "pkg" / "metalog_code.zip"
    proc = subprocess.run([sys.executable, "-m", "metalog.tools.cli", "spark", "package", "--out", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"wrote {out} (") and f"--py-files {out}" in proc.stdout
    names = set(zipfile.ZipFile(out).namelist())
    # laid out as installed: metalog/<package>/..., with the namespace's directory entry
    assert {"metalog/tools/spark/job.py", "metalog/tools/spark/decode.py", "metalog/tools/spark/fold.py",
            "metalog/storage/snapshot.py", "metalog/broker/controller/state.py",
            "metalog/protocol/messages.py", "metalog/"} <= names
    assert not [n for n in names if n != "metalog/" and not (n.startswith("metalog/") and n.endswith(".py"))]
    assert "metalog/__init__.py" not in names  # a namespace: an executor's own install may hold other parts


def test_direct_run_starts_the_jvm_with_its_defaults(tmp_path):
    """Run directly: --master, --driver-memory and --conf take effect in a JVM
    the job starts (the heap the JVM reports is the one asked for)."""
    d, end = data_dir(tmp_path)
    report = tmp_path / "out" / "r.json"
    proc = subprocess.run([sys.executable, "-m", "metalog.tools.cli", "spark", "snapshot", d, "--out",
                           str(tmp_path / "out"), "--report", str(report), "--master", "local[1]",
                           "--driver-memory", "700m", "--conf", "spark.metalog.probe=yes",
                           "--shuffle-partitions", "2"],
                          cwd=REPO_ROOT, env=job_env(tmp_path), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(report.read_text())
    assert rep["master"] == "local[1]" and rep["spark_submit"] is False
    assert rep["spark_conf"]["spark.driver.memory"] == "700m"
    assert rep["spark_conf"]["spark.metalog.probe"] == "yes"
    assert 400 < rep["driver_heap_mb"] <= 700
    assert rep["hw"] == end
    # Progress on stderr, the summary on stdout; Spark's WARN lines kept quiet.
    assert "[metalog spark" in proc.stderr and "[metalog spark" not in proc.stdout
    assert "records in" in proc.stderr and "records/s" in proc.stderr
    assert proc.stdout.startswith("metalog spark snapshot: ok")
    assert " WARN " not in proc.stderr
    # Quiet by default: no "Setting default log level" banner, no pandas
    # FutureWarning; only the JVM's own incubator-module notice (printed by
    # the JVM itself, before any logging) besides the job's lines.
    assert not [line for line in proc.stderr.splitlines() if not line.startswith(OUR_STDERR)], proc.stderr
    assert os.listdir(tmp_path / "tmp") == [] or not [
        p for p in os.listdir(tmp_path / "tmp") if p.startswith("metalog-spark-")]


def test_spark_submit_master_and_conf_win(tmp_path):
    """Under spark-submit its --master and --driver-memory apply; the job's own
    --master is ignored with a warning; nothing of ours is left in the temp dir."""
    d, end = data_dir(tmp_path)
    pkg = tmp_path / "metalog_code.zip"
    subprocess.run([sys.executable, "-m", "metalog.tools.cli", "spark", "package", "--out", str(pkg)],
                   cwd=REPO_ROOT, check=True, capture_output=True, timeout=60)
    report = tmp_path / "out" / "r.json"
    log4j = os.path.join(REPO_ROOT, "tools", "spark", "log4j2.properties")
    proc = subprocess.run([spark_submit_path(), "--master", "local[1]", "--driver-memory", "600m",
                           "--driver-java-options", f"-Dlog4j.configurationFile=file:{log4j}",
                           "--conf", "spark.metalog.probe=submitted", "--py-files", str(pkg),
                           "tools/spark/job.py", "snapshot", d, "--out", str(tmp_path / "out"),
                           "--report", str(report), "--master", "local[2]", "--shuffle-partitions", "2"],
                          cwd=REPO_ROOT, env=job_env(tmp_path), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(report.read_text())
    assert rep["master"] == "local[1]" and rep["spark_submit"] is True
    assert rep["spark_conf"]["spark.driver.memory"] == "600m"
    assert 300 < rep["driver_heap_mb"] <= 600
    assert "metalog spark: warning: --master local[2] ignored: under spark-submit" in proc.stderr, proc.stderr
    assert " INFO " not in proc.stderr  # the shipped log4j2 file keeps Spark quiet
    assert "[metalog spark" not in proc.stdout and "records/s" in proc.stderr
    # The Python driver's stderr is merged into spark-submit's stdout: no
    # Python warning may land there before the summary.
    assert proc.stdout.startswith("metalog spark snapshot: ok"), proc.stdout[:2000]
    assert rep["hw"] == end and rep["snapshot"]["published"]
    assert not [p for p in os.listdir(tmp_path / "tmp") if p.startswith("metalog-spark-")]


SHIP_SNIPPET = """
import os, sys, tempfile
from metalog.tools.spark import job as spark_job
setup = spark_job.SparkSetup()
spark = spark_job.get_spark("local[1]", shuffle_partitions=1, ship_code=True, setup=setup)
[d] = [p for p in os.listdir(tempfile.gettempdir()) if p.startswith("metalog-spark-")]
print("zip", os.path.exists(os.path.join(tempfile.gettempdir(), d, "metalog_code.zip")))
def where(_):
    import metalog.tools.spark.decode as m
    yield m.__file__
print("executor imports", spark.sparkContext.parallelize([0], 1).mapPartitions(where).collect()[0])
spark.stop()
setup.cleanup()
print("left", [p for p in os.listdir(tempfile.gettempdir()) if p.startswith("metalog-spark-")])
"""


def test_shipped_code_is_used_and_removed(tmp_path):
    """The zip a non-local master gets: executors import from it, and the job's
    cleanup removes its temp dir (no metalog-spark-*/ left)."""
    env = job_env(tmp_path)
    proc = subprocess.run([sys.executable, "-c", SHIP_SNIPPET], cwd=tmp_path, env=dict(
        env, PYSPARK_PYTHON=sys.executable), capture_output=True, text=True,
        timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert "zip True" in lines
    [imp] = [x for x in lines if x.startswith("executor imports ")]
    assert "metalog_code.zip" in imp  # not the repo checkout: the shipped archive
    assert lines[-1] == "left []"
