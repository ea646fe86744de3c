"""The core's invariants hold in production: ``python -O`` strips every
``assert``, so the transition table and the other invariants of
broker/quorum raise InvariantViolation instead (metalog.protocol.invariants).
Here a core runs in a child interpreter under -O and is asked for a
transition the table forbids."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap

QUORUM_DIR = pathlib.Path(__file__).resolve().parents[2] / "broker" / "quorum"
REPO_ROOT = QUORUM_DIR.parents[1]

CHILD = textwrap.dedent("""
    import sys
    from metalog.broker.quorum import api as a
    from metalog.broker.quorum.follower import FollowerState
    from metalog.broker.quorum.leader import LeaderState
    from metalog.protocol.invariants import InvariantViolation
    from tests.quorum.harness import Node

    assert False, "asserts run: this child is not under -O"  # stripped by -O
    print("optimize", sys.flags.optimize)
    n = Node(1)
    n.step(a.Tick(0))
    follower = FollowerState(n.core, 3, 2, -1)
    n.core.transition(follower, 0)  # unattached -> follower: in the table
    try:
        n.core.transition(LeaderState(n.core, 3, -1, [1], 0), 0)  # follower -> leader: not
    except InvariantViolation as exc:
        print("raised", exc)
    print("role", n.core.role)
""")


def test_a_forbidden_transition_raises_under_python_O():
    proc = subprocess.run([sys.executable, "-O", "-c", CHILD], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "optimize 1", proc.stdout
    assert "raised no transition from follower to leader" in lines, proc.stdout
    assert "role follower" in lines, proc.stdout  # refused before the role changed


def test_no_assert_statement_is_left_in_the_core():
    """Every invariant of broker/quorum survives -O: none is an `assert`."""
    found = []
    for path in sorted(QUORUM_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assert):
                found.append(f"{path.name}:{node.lineno}")
    assert found == []
