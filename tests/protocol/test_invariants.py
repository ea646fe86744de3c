"""Invariants raise under python -O too, with their message formatted only on failure."""

from __future__ import annotations

import subprocess
import sys

import pytest

from metalog.protocol.invariants import InvariantViolation, invariant


def test_a_failed_invariant_raises_with_its_formatted_message():
    with pytest.raises(InvariantViolation, match="^epoch would go back from 5 to 4$"):
        invariant(4 >= 5, "epoch would go back from %d to %d", 5, 4)
    invariant(True, "never formatted %d", "not a number")  # formatting a holding check would raise TypeError


def test_invariants_survive_python_dash_O():
    code = ("from metalog.protocol.invariants import invariant\n"
            "assert False, 'asserts are gone under -O'\n"
            "invariant(False, 'still %s', 'checked')\n")
    proc = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == "metalog.protocol.invariants.InvariantViolation: still checked"
