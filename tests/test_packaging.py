"""The broker and the CLI work without the optional extras (pyspark, pyarrow,
pandas, matplotlib: [spark]; matplotlib, grpcio: [bench]), and the commands that need one
say which, in one line, before doing any work.

Each check runs in a fresh interpreter where a meta-path finder makes those
packages fail to import exactly as if they were not installed."""

from __future__ import annotations

import subprocess
import sys

from metalog.tools.cluster.launcher import REPO_ROOT

BLOCKER = """
import sys
BLOCKED = {"pyspark", "pyarrow", "pandas", "matplotlib", "grpc"}
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Block())
"""


def run_without_extras(code: str, cwd: str = REPO_ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER + code], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def metalog_without_extras(*argv: str, cwd: str = REPO_ROOT) -> subprocess.CompletedProcess:
    return run_without_extras(f"from metalog.tools.cli import main\nsys.exit(main({list(argv)!r}))", cwd=cwd)


def test_broker_and_every_cli_module_import_without_the_extras():
    proc = run_without_extras(
        "import metalog.broker.server.runtime, metalog.broker.server.main, metalog.broker.server.admin\n"
        "import metalog.tools.cli.app, metalog.tools.drill.drill, metalog.tools.drill.report, metalog.tools.bench.bench, metalog.tools.bench.etcd\n"
        "import metalog.tools.spark.job, metalog.tools.simulate, metalog.sim.random_run\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in BLOCKED)\n"
        "print('loaded:', loaded)\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "loaded: []"


def test_metalog_help_and_broker_help_run_without_the_extras():
    proc = metalog_without_extras("--help")
    assert proc.returncode == 0, proc.stderr
    assert "spark" in proc.stdout and "drill" in proc.stdout
    proc = metalog_without_extras("broker", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "--config" in proc.stdout


def test_metalog_spark_without_pyspark_says_which_extra_and_exits_3(tmp_path):
    """What the user sees: exit 3 (environment) and one line on stderr,
    "metalog spark: pyspark is not installed: pip install 'metalog[spark]'"."""
    (tmp_path / "data").mkdir()
    proc = metalog_without_extras("spark", "snapshot", str(tmp_path / "data"), "--out", str(tmp_path / "out"))
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "metalog spark: pyspark is not installed: pip install 'metalog[spark]'"]
    assert not list((tmp_path / "out").glob("*.checkpoint"))


def test_metalog_drill_without_matplotlib_says_which_extra_before_starting(tmp_path):
    """What the user sees: exit 2 (could not run) and one line naming
    pip install 'metalog[bench]'; no broker was started, no dir created."""
    proc = metalog_without_extras("drill", "--duration-s", "1", "--dir", str(tmp_path / "run"),
                                  "--report", str(tmp_path / "report"))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "metalog drill: the report's timeline picture needs matplotlib; matplotlib is not installed: "
        "pip install 'metalog[bench]'"]
    assert not (tmp_path / "run").exists() and not list(tmp_path.glob("report*"))


def test_pyproject_lists_every_package_folder_under_the_metalog_namespace():
    """pyproject.toml names each package (setuptools cannot find packages
    through a package-dir mapping): a new folder missing from the list would
    be left out of the wheel, and the installed CLI would fail with
    ModuleNotFoundError. The list and the folders must agree."""
    import tomllib
    from pathlib import Path

    with open(Path(REPO_ROOT) / "pyproject.toml", "rb") as f:
        setuptools_cfg = tomllib.load(f)["tool"]["setuptools"]
    folders = {"metalog." + ".".join(init.parent.relative_to(REPO_ROOT).parts)
               for root in ("broker", "protocol", "storage", "sim", "tools")
               for init in (Path(REPO_ROOT) / root).rglob("__init__.py")}
    assert sorted(setuptools_cfg["packages"]) == sorted(folders)
    assert setuptools_cfg["package-dir"] == {f"metalog.{r}": r for r in ("broker", "protocol", "storage", "sim", "tools")}
