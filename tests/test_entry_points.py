"""The documented command lines keep working after tools/ was grouped by job:
the console script's module, ``python -m metalog.tools.cli``, and the old module and
script paths that README and docs name (thin shims that forward to the new
modules). Each is run with --help in a fresh interpreter from the repo root;
a broken shim would exit non-zero with an ImportError on stderr."""

from __future__ import annotations

import subprocess
import sys

import pytest

from metalog.tools.cluster.launcher import REPO_ROOT

ENTRY_POINTS = [
    (["-m", "metalog.tools.cli", "--help"], "usage: metalog"),
    (["-m", "metalog.tools.simulate", "--help"], "--seeds"),
    (["-m", "metalog.tools.bench", "--help"], "usage: metalog bench"),
    (["-m", "metalog.tools.bench_storage", "--help"], "--recovery-bytes"),
    (["-m", "metalog.tools.bench_snapshot", "--help"], "--records"),
    (["-m", "metalog.tools.bench_hostile", "--help"], "--hostile"),
    (["tools/bench_spark.py", "--help"], "--records"),
    (["tools/spark_job.py", "--help"], "{snapshot,audit,sql,package}"),
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
