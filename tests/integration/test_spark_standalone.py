"""The Spark job on a real standalone Spark cluster: a Master and two Workers
started with spark-class on loopback (small memory), the job submitted with
spark-submit --master spark://127.0.0.1:PORT. The checkpoint it publishes is
byte-identical to the one a local-mode run writes from the same logs."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.spark.workload import random_records, write_log
from metalog.tools.cluster.launcher import REPO_ROOT

pytestmark = pytest.mark.slow

START_DEADLINE_S = 90
RUN_TIMEOUT_S = 240


def _free_ports(count: int) -> list[int]:
    """`count` distinct free ports: all bound at once, so that no two are the
    same (one port at a time, CI once gave a worker's web UI the master's UI
    port, and /json/ answered the worker's HTML)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _spark_home() -> str:
    import pyspark

    return os.path.dirname(pyspark.__file__)


@pytest.fixture
def standalone(tmp_path):
    """(master URL, env) of a Master + 2 Workers; always stopped afterwards."""
    home = _spark_home()
    env = dict(os.environ, SPARK_HOME=home, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable,
               PYSPARK_DRIVER_PYTHON=sys.executable, SPARK_LOG_DIR=str(tmp_path / "spark-logs"),
               SPARK_WORKER_DIR=str(tmp_path / "spark-work"), TMPDIR=str(tmp_path / "tmp"))
    env.pop("PYSPARK_SUBMIT_ARGS", None)
    os.makedirs(env["TMPDIR"], exist_ok=True)
    port, ui_port, *worker_ui_ports = _free_ports(4)
    url = f"spark://127.0.0.1:{port}"
    spark_class = os.path.join(home, "bin", "spark-class")
    procs: list[subprocess.Popen] = []
    logs = []

    def start(name: str, *argv: str) -> None:
        log = open(tmp_path / f"{name}.log", "wb")
        logs.append(log)
        procs.append(subprocess.Popen([spark_class, *argv], env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))

    try:
        start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
              "--port", str(port), "--webui-port", str(ui_port))
        for i in (1, 2):
            start(f"worker{i}", "org.apache.spark.deploy.worker.Worker", url, "--host", "127.0.0.1",
                  "--cores", "1", "--memory", "700m", "--webui-port", str(worker_ui_ports[i - 1]),
                  "--work-dir", str(tmp_path / f"work{i}"))
        deadline = time.monotonic() + START_DEADLINE_S
        alive = -1
        while time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), "a Spark daemon exited early (see its log)"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=2) as r:
                    alive = json.load(r).get("aliveworkers", 0)
            except OSError:
                alive = -1
            if alive == 2:
                break
            time.sleep(0.5)  # polling the Master's status page for a condition, bounded by the deadline
        assert alive == 2, f"2 workers did not register within {START_DEADLINE_S}s (alive: {alive})"
        yield url, env
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        for log in logs:
            log.close()


def test_spark_submit_on_a_standalone_cluster_equals_local_mode(standalone, tmp_path):
    url, env = standalone
    values = random_records(random.Random(12), 400)
    dirs = [str(tmp_path / f"n{i}") for i in (1, 2, 3)]
    for i, d in enumerate(dirs):
        write_log(d, values, node_id=i + 1, seed=9)
    pkg = tmp_path / "metalog_code.zip"
    subprocess.run([sys.executable, "-m", "metalog.tools.cli", "spark", "package", "--out", str(pkg)],
                   cwd=REPO_ROOT, check=True, capture_output=True, timeout=60)
    log4j = os.path.join(REPO_ROOT, "tools", "spark", "log4j2.properties")
    cluster_out = tmp_path / "cluster-out"
    proc = subprocess.run(
        [os.path.join(_spark_home(), "bin", "spark-submit"), "--master", url,
         "--driver-memory", "600m", "--executor-memory", "512m", "--total-executor-cores", "2",
         "--conf", "spark.driver.host=127.0.0.1", "--py-files", str(pkg),
         "--driver-java-options", f"-Dlog4j.configurationFile=file:{log4j}",
         "tools/spark/job.py", "snapshot", *dirs, "--out", str(cluster_out), "--shuffle-partitions", "2"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rep = json.loads((cluster_out / "report.json").read_text())
    assert rep["master"] == url and rep["spark_submit"] is True  # not silently local mode
    assert "records/s" in proc.stderr

    local_out = tmp_path / "local-out"
    proc = subprocess.run([sys.executable, "-m", "metalog.tools.cli", "spark", "snapshot", *dirs, "--out",
                           str(local_out), "--master", "local[1]", "--driver-memory", "600m",
                           "--shuffle-partitions", "2", "--quiet"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [name] = [p.name for p in cluster_out.iterdir() if p.name.endswith(".checkpoint")]
    assert (cluster_out / name).read_bytes() == (local_out / name).read_bytes()
    # The Parquet tables the cluster's executors wrote read back equal to local mode's.
    import pyarrow.parquet as pq

    def rows(out, view, key):
        return sorted(pq.read_table(str(out / "tables" / view)).to_pylist(), key=lambda x: x[key])

    for view, key in (("topics", "topic_id"), ("brokers", "broker_id"), ("history", "offset")):
        assert rows(cluster_out, view, key) == rows(local_out, view, key), view
    assert len(rows(cluster_out, "history", "offset")) == rep["hw"]
    assert [a["verdict"] for a in rows(cluster_out, "audit", "replica")] == ["agrees"] * len(dirs)
    assert not [p for p in os.listdir(env["TMPDIR"]) if p.startswith("metalog-spark-")]
