"""The documented command lines work: the console script's module
(``python -m metalog.tools.cli``), the benches and the simulator as modules
of the ``metalog`` namespace, and the Spark job as a script for spark-submit.
Each is run with --help in a fresh interpreter from the repo root; a broken
entry point exits non-zero with an ImportError on stderr."""

from __future__ import annotations

import subprocess
import sys

import pytest

from metalog.tools.cluster.launcher import REPO_ROOT

ENTRY_POINTS = [
    (["-m", "metalog.tools.cli", "--help"], "usage: metalog"),
    (["-m", "metalog.tools.simulate", "--help"], "--seeds"),
    (["-m", "metalog.tools.bench", "--help"], "usage: metalog bench"),
    (["-m", "metalog.tools.bench.storage_engine", "--help"], "--recovery-bytes"),
    (["-m", "metalog.tools.bench.snapshot", "--help"], "--records"),
    (["-m", "metalog.tools.bench.hostile", "--help"], "--hostile"),
    (["-m", "metalog.tools.bench.spark", "--help"], "--records"),
    (["tools/spark/job.py", "--help"], "{snapshot,audit,sql,package}"),
]


@pytest.mark.parametrize("argv,expected", ENTRY_POINTS, ids=[" ".join(a[:2]) for a, _ in ENTRY_POINTS])
def test_documented_entry_point_runs(argv, expected):
    proc = subprocess.run([sys.executable, *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert expected in proc.stdout, proc.stdout


def test_drill_report_redraw_without_a_report_prints_its_usage():
    """`python -m metalog.tools.drill.report` (docs/drills.md) with no REPORT: exit 1 and its usage line."""
    proc = subprocess.run([sys.executable, "-m", "metalog.tools.drill.report"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.startswith("usage: python -m metalog.tools.drill.report REPORT"), proc.stderr
