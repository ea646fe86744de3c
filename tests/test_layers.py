"""The import contracts in .importlinter hold: layers protocol -> storage ->
broker -> sim -> tools -> tests with no upward imports (so nothing imports
tests), the simulator and the quorum core import nothing of broker/ outside
broker.quorum, and no package has an import cycle between its modules.

`lint-imports` (import-linter, the [dev] extra) is run as a user runs it; on
failure its report, naming the offending import and line, is the assertion
message."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from tools.cluster.launcher import REPO_ROOT

LINT_IMPORTS = os.path.join(os.path.dirname(sys.executable), "lint-imports")
PACKAGES = ("protocol", "storage", "broker", "sim", "tools", "tests")


def lint_imports(cwd: str) -> subprocess.CompletedProcess:
    assert os.path.exists(LINT_IMPORTS), f"{LINT_IMPORTS} missing: pip install -e '.[dev]' installs import-linter"
    env = dict(os.environ, PYTHONPATH=cwd, NO_COLOR="1")
    return subprocess.run([LINT_IMPORTS, "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_import_contracts_are_kept():
    proc = lint_imports(REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


def test_a_forbidden_import_breaks_the_contract(tmp_path):
    """The contracts really bite: in a copy of the tree, the simulator importing
    the asyncio runtime is reported as a broken contract naming that import,
    and lint-imports exits 1."""
    for pkg in PACKAGES:
        shutil.copytree(os.path.join(REPO_ROOT, pkg), tmp_path / pkg,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(os.path.join(REPO_ROOT, ".importlinter"), tmp_path / ".importlinter")
    with open(tmp_path / "sim" / "network.py", "a") as f:
        f.write("\nimport broker.runtime  # noqa: E402,F401\n")
    proc = lint_imports(str(tmp_path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "of broker/ it imports only broker.quorum BROKEN" in " ".join(proc.stdout.split())
    assert "sim.network -> broker.runtime" in proc.stdout
