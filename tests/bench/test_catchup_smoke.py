"""tools/bench/catchup.py at a tiny size, end to end on real brokers over TLS:
the offline-written voter dirs boot into a quorum holding the state, the new
observer catches up by FetchSnapshot in one variant and by the log in the
other, and the commit bench sees a snapshot generated. Works, not fast: no
speed is asserted (docs/bench.md has the figures)."""

from __future__ import annotations

import pytest

from metalog.tools.bench import catchup

pytestmark = pytest.mark.timeout(240)


def test_catchup_and_commit_sections_on_a_tiny_state(tmp_path):
    rep = catchup.run(5000, ["catchup", "commit"], root=str(tmp_path), commit_threshold_records=500,
                      commit_warmup_records=100)
    w = rep["workload"]
    assert w["partitions"] == 5000 and w["topics"] == 50 and w["records"] > 5000
    end = w["records"]  # build_log numbers records from 0: the generated state ends here

    snap, log = rep["catchup"]["by_snapshot"], rep["catchup"]["by_log"]
    # The snapshot variant's voters booted from their snapshot with the log cut
    # past it; the log variant's kept the whole log and never snapshotted.
    assert snap["leader_log_start_offset"] == end and log["leader_log_start_offset"] == 0
    for v in snap["voters"].values():
        assert v["snapshot_load_seconds"] is not None and v["rss_mib"] > 0
    assert all(v["snapshot_load_seconds"] is None for v in log["voters"].values())
    # The observer got the leader's snapshot, whole, through FetchSnapshot.
    assert snap["snapshot_bytes"] > 0 and snap["snapshot_records"] > 0
    assert snap["download_seconds"] > 0 and snap["download_mb_per_s"] > 0
    assert "snapshot_bytes" not in log
    for res in (snap, log):
        assert res["target_offset"] > end  # caught up past the state, to the leader's HW
        assert res["catchup_seconds"] > 0 and res["observer_peak_rss_mib"] > 0
    assert rep["catchup"]["snapshot_speedup"] == round(log["catchup_seconds"] / snap["catchup_seconds"], 2)
    reads = snap["admin_reads"]
    assert set(reads) == {"topic", "broker", "topics page", "partitions page"}
    assert all(r["samples"] == catchup.ADMIN_READ_QUERIES and r["p99_ms"] > 0 for r in reads.values())

    commit = rep["commit"]
    assert commit["threshold_records"] == 500
    # The leader's snapshot covers the loaded state and the threshold's records.
    assert commit["snapshot"][0] >= end + 500
    assert 0 < commit["idle"]["samples"] <= 500 - 100
    assert commit["generation_window_seconds"] >= 0
    # The brokers' default: a forked child wrote it, and the report says so.
    assert commit["snapshot_path"] == "fork" and commit["fork_ms"] >= 0
    assert commit["snapshot_write_seconds"] > 0 and commit["child_memory"]["vmhwm_kib"] > 0
    assert catchup.format_report(rep).count("\n") >= 8


def test_metalog_bench_only_scale_catchup_runs_the_cluster_bench(tmp_path, capsys):
    """`metalog bench --only scale-catchup` reaches metalog.tools.bench.catchup at
    --scale-partitions and prints its report under the usual table."""
    import json

    from metalog.tools.cli import main as metalog_main

    out = tmp_path / "report.json"
    rc = metalog_main(["bench", "--only", "scale-catchup", "--scale-partitions", "3000", "--dir",
                       str(tmp_path / "clusters"), "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert set(report["scale"]) == {"workload", "catchup"}  # commit was not asked for
    assert report["scale"]["workload"]["partitions"] == 3000
    assert report["scale"]["catchup"]["by_snapshot"]["snapshot_bytes"] > 0
    assert "by log / by snapshot:" in capsys.readouterr().out


def test_an_unknown_section_names_the_scale_sections(capsys):
    """A typo in --only: exit 2 and the list of sections, the scale ones included."""
    from metalog.tools.cli import main as metalog_main

    assert metalog_main(["bench", "--only", "scale-catchpu"]) == 2
    err = capsys.readouterr().err
    assert "unknown section(s) ['scale-catchpu']" in err and "scale-catchup, scale-commit" in err


def test_reads_section_alone_reads_the_leader_of_the_snapshot_voters(tmp_path):
    rep = catchup.run(5000, ["reads"], root=str(tmp_path))
    reads = rep["reads"]
    assert reads["leader"] in (1, 2, 3)
    assert set(reads["admin_reads"]) == {"topic", "broker", "topics page", "partitions page"}
    text = catchup.format_report(rep)
    assert "admin API GET one topic: p50" in text and "admin API GET partitions page: p50" in text
