"""The import contracts in .importlinter hold: layers protocol -> storage ->
broker -> sim -> tools -> tests with no upward imports (so nothing imports
tests); the simulator imports nothing of broker/ but the quorum core; each
room of broker/ keeps to itself (the quorum core and the controller are pure:
no asyncio or sockets; the network knows no server; the client no server);
and no package has an import cycle between its modules.

`lint-imports` (import-linter, the [dev] extra) is run as a user runs it; on
failure its report, naming the offending import and line, is the assertion
message."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from metalog.tools.cluster.launcher import REPO_ROOT

LINT_IMPORTS = os.path.join(os.path.dirname(sys.executable), "lint-imports")
PACKAGES = ("protocol", "storage", "broker", "sim", "tools")


def lint_imports(cwd: str) -> subprocess.CompletedProcess:
    assert os.path.exists(LINT_IMPORTS), f"{LINT_IMPORTS} missing: pip install -e '.[dev]' installs import-linter"
    env = dict(os.environ, PYTHONPATH=cwd, NO_COLOR="1")
    return subprocess.run([LINT_IMPORTS, "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_import_contracts_are_kept():
    proc = lint_imports(REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


def _copy_tree(tmp_path) -> None:
    """The repo's packages laid out as the installed namespace: tmp/metalog/<folder>,
    `metalog` a namespace package as installed. On PYTHONPATH the copy comes
    before the editable install's finder."""
    (tmp_path / "metalog").mkdir()
    for pkg in PACKAGES:
        shutil.copytree(os.path.join(REPO_ROOT, pkg), tmp_path / "metalog" / pkg,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copytree(os.path.join(REPO_ROOT, "tests"), tmp_path / "tests",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(os.path.join(REPO_ROOT, ".importlinter"), tmp_path / ".importlinter")


@pytest.mark.parametrize("module, line, contract, reported", [
    ("sim/network.py", "import metalog.broker.server.runtime",
     "of broker/ it imports only metalog.broker.quorum BROKEN",
     "metalog.sim.network -> metalog.broker.server.runtime"),
    ("broker/quorum/roles.py", "import asyncio",
     "no asyncio, sockets, threads or clocks BROKEN", "metalog.broker.quorum.roles -> asyncio"),
    ("broker/controller/views.py", "import metalog.broker.server.metrics",
     "of the network only the principal BROKEN",
     "metalog.broker.controller.views -> metalog.broker.server.metrics"),
    ("broker/client/config.py", "import metalog.broker.server.config",
     "nothing of the server, the quorum or the controller BROKEN",
     "metalog.broker.client.config -> metalog.broker.server.config"),
    ("broker/net/tls.py", "import metalog.broker.controller.state",
     "the controller, the server or the client BROKEN",
     "metalog.broker.net.tls -> metalog.broker.controller.state"),
])
def test_a_forbidden_import_breaks_the_contract(tmp_path, module, line, contract, reported):
    """The contracts really bite: in a copy of the tree, one forbidden import
    is reported as a broken contract naming that import, and lint-imports
    exits 1."""
    _copy_tree(tmp_path)
    with open(tmp_path / "metalog" / module, "a") as f:
        f.write(f"\n{line}  # noqa: E402,F401\n")
    proc = lint_imports(str(tmp_path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert contract in " ".join(proc.stdout.split()), proc.stdout
    assert reported in proc.stdout
