"""metalog.tools.bench.snapshot end to end at a tiny size: the figures it prints
and writes as JSON, the fresh-process load among them (what a broker's
boot pays: time, CPU, RSS holding the state), and --load-only's answer for
a directory without a loadable snapshot."""

from __future__ import annotations

import json
import subprocess
import sys

from metalog.tools.bench import snapshot as bench


def test_tiny_run_prints_and_writes_the_fresh_process_load(tmp_path, capsys):
    out_json = tmp_path / "fig.json"
    snap_dir = tmp_path / "snap"
    assert bench.main(["--records", "3000", "--topics", "20", "--partitions", "100", "--brokers", "5",
                       "--dir", str(snap_dir), "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "snapshot load in a fresh process (a broker's boot)" in printed
    fig = json.loads(out_json.read_text())
    fresh = fig["fresh_load"]
    assert fresh["partitions"] == fig["partitions"] == 2000
    assert 0 < fresh["cpu_seconds"] and 0 < fresh["seconds"]
    assert fresh["rss_before_mib"] < fresh["rss_mib"] <= fresh["peak_rss_mib"]
    # --load-only on the directory the run left reads the same state again
    again = bench.fresh_process_load(str(snap_dir))
    assert again["partitions"] == 2000


def test_load_only_without_a_snapshot_says_so_and_fails(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "metalog.tools.bench.snapshot", "--load-only", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert f"no snapshot loads from {tmp_path}" in proc.stderr


def test_a_failed_fresh_process_load_shows_the_childs_error(tmp_path):
    """What the bench's user sees when the load fails: the loader's message,
    not a bare CalledProcessError."""
    import pytest

    with pytest.raises(SystemExit, match=f"failed \\(exit 1\\): no snapshot loads from {tmp_path}"):
        bench.fresh_process_load(str(tmp_path))
