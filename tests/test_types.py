"""The type checker holds: mypy, strict on the sans-IO rooms (the quorum core,
protocol, storage), and the two executors of the core's actions (the
runtime's and the simulator's ``_execute``) end in ``assert_never`` on the
``Action`` union, so a new action type that one of them does not handle is a
type error, named with its file and line.

mypy cannot follow setuptools' editable-install finder, so each run lays the
folders out as the installed namespace (``metalog/<folder>`` links) and
checks that tree with the repo's pyproject.toml."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from metalog.tools.cluster.launcher import REPO_ROOT

MYPY = os.path.join(os.path.dirname(sys.executable), "mypy")
FOLDERS = ("broker", "protocol", "storage", "sim", "tools")
TARGETS = ["-p", "metalog.broker.quorum", "-p", "metalog.protocol", "-p", "metalog.storage",
           "-m", "metalog.broker.server.runtime", "-m", "metalog.sim.cluster"]


def run_mypy(root) -> subprocess.CompletedProcess:
    assert os.path.exists(MYPY), f"{MYPY} missing: pip install -e '.[dev]' installs mypy"
    return subprocess.run([MYPY, "--config-file", os.path.join(REPO_ROOT, "pyproject.toml"),
                           "--cache-dir", str(root / ".mypy_cache"), *TARGETS],
                          cwd=root, capture_output=True, text=True, timeout=600)


def test_mypy_strict_on_the_core_protocol_and_storage(tmp_path):
    (tmp_path / "metalog").mkdir()
    for folder in FOLDERS:
        os.symlink(os.path.join(REPO_ROOT, folder), tmp_path / "metalog" / folder)
    proc = run_mypy(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("Success: no issues found"), proc.stdout


def test_an_action_no_executor_handles_is_a_type_error(tmp_path):
    """In a copy of the tree, a new action type joins the Action union: mypy
    fails and names both executors' assert_never."""
    (tmp_path / "metalog").mkdir()
    for folder in FOLDERS:
        shutil.copytree(os.path.join(REPO_ROOT, folder), tmp_path / "metalog" / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    api = tmp_path / "metalog" / "broker" / "quorum" / "api.py"
    text = api.read_text()
    assert "\nAction = (" in text
    text = text.replace("\nAction = (", "\n@dataclass(frozen=True, slots=True)\nclass Unhandled:\n"
                                         "    why: str\n\n\nAction = (Unhandled | ", 1)
    api.write_text(text)
    proc = run_mypy(tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failing = {line.split(":")[0] for line in proc.stdout.splitlines() if "assert_never" in line or "Unhandled" in line}
    assert os.path.join("metalog", "broker", "server", "runtime.py") in failing, proc.stdout
    assert os.path.join("metalog", "sim", "cluster.py") in failing, proc.stdout
