"""metalog.tools.bench.commit_profile: following writes through broker commit traces,
and metalog.broker.server.commit_trace being off unless asked for."""

from __future__ import annotations

import json

from metalog.broker.net import codec_clock
from metalog.broker.server import commit_trace
from metalog.tools.bench import commit_profile


def write_trace(path, marks, codec=None) -> None:
    path.write_text(json.dumps({"marks": marks, "codec": codec or {}, "dropped": 0}))


def one_commit(t0: int, base: int) -> tuple[list, list, list, tuple]:
    """Marks of one write at offset `base` (leader 1, followers 2 and 3),
    every step 10 µs (10_000 ns) apart except where noted; returns
    (leader marks, follower 2 marks, follower 3 marks, client op)."""
    end = base + 1
    us = 1000
    leader = [
        [t0 + 10 * us, "produce_recv", -1, -1],
        [t0 + 20 * us, "append", end, base],
        [t0 + 25 * us, "flush_start", end, -1],
        [t0 + 30 * us, "fetch_answer", end, 2],
        [t0 + 32 * us, "fetch_answer", end, 3],
        [t0 + 300 * us, "flush_done", end, -1],   # the leader's fsync: 280 µs after the append
        [t0 + 400 * us, "fetch_recv", end, 2],    # follower 2 reports first
        [t0 + 410 * us, "hw", end, -1],
        [t0 + 420 * us, "produce_reply", base, -1],
        [t0 + 500 * us, "fetch_recv", end, 3],
    ]
    f2 = [
        [t0 + 40 * us, "fetch_resp", end, 1],
        [t0 + 50 * us, "append", end, base],
        [t0 + 350 * us, "flush_done", end, -1],
        [t0 + 360 * us, "fetch_action", end, 1],
        [t0 + 370 * us, "fetch_sent", end, 1],
    ]
    f3 = [
        [t0 + 45 * us, "fetch_resp", end, 1],
        [t0 + 55 * us, "append", end, base],
        [t0 + 450 * us, "flush_done", end, -1],
        [t0 + 460 * us, "fetch_action", end, 1],
        [t0 + 470 * us, "fetch_sent", end, 1],
    ]
    return leader, f2, f3, (t0, t0 + 430 * us, base)


def test_follow_times_each_stage_through_the_follower_that_advanced_the_hw(tmp_path):
    leader, f2, f3, ops = [], [], [], []
    n = commit_profile.SKIP_FIRST_OPS + 10
    for i in range(n):
        lm, m2, m3, op = one_commit(1_000_000_000 + i * 10_000_000, 100 + i)
        leader += lm
        f2 += m2
        f3 += m3
        ops.append(op)
    write_trace(tmp_path / "node-1.json", leader)
    write_trace(tmp_path / "node-2.json", f2)
    write_trace(tmp_path / "node-3.json", f3)
    followed = commit_profile.follow(str(tmp_path), ops)
    assert followed["leader"] == 1 and followed["followed"] == 10 and followed["skipped"] == 0
    assert commit_profile.summarize_codec(followed) == {"rows": [], "per_commit_p50_us": None}
    assert followed["leader_fsync_on_critical_path"] == 0  # 300 µs < follower 2's Fetch at 400 µs
    rows = {r["stage"]: r["p50_us"] for r in commit_profile.summarize(followed)}
    assert rows["client send -> leader read Produce"] == 10
    assert rows["appended -> leader fsync done"] == 280
    assert rows["appended -> Fetch answer written"] == 10          # follower 2's answer, not 3's
    assert rows["follower appended -> fsync done"] == 300          # follower 2: 50 -> 350
    assert rows["next Fetch written -> leader read it"] == 30      # 370 -> 400
    assert rows["HW advanced -> Produce answer written"] == 10
    assert rows["total (client send -> answer)"] == 430
    table = commit_profile.format_profile(followed)
    assert "10 writes followed" in table and "leader node 1" in table


def test_trace_is_off_unless_the_environment_names_a_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(codec_clock, "meter", None)  # restored after the test: from_env sets it
    monkeypatch.delenv(commit_trace.ENV_VAR, raising=False)
    assert commit_trace.from_env(1) is None
    assert codec_clock.meter is None
    monkeypatch.setenv(commit_trace.ENV_VAR, str(tmp_path))
    trace = commit_trace.from_env(7)
    assert codec_clock.meter is trace  # the trace is the process's codec meter too
    trace.mark("append", 5, 4)
    trace.dump()
    marks = commit_trace.load(str(tmp_path / "node-7.json"))
    assert [(e, o, p) for _ns, e, o, p in marks] == [("append", 5, 4)]


def test_codec_rows_by_node_role_and_the_sum_over_one_commits_path(tmp_path):
    """The leader's and the followers' codec timings (ns) become rows by
    (leader|follower, operation, api), the followers pooled; the six frames a
    commit's path goes through are summed from their p50s."""
    leader, f2, f3, op = one_commit(1_000_000_000, 100)
    write_trace(tmp_path / "node-1.json", leader, {
        "decode request:0": [20_000] * 3,           # Produce
        "encode answer:0": [10_000] * 3,
        "decode request:1": [30_000] * 9 + [90_000],  # Fetch: p50 30, p99 90
        "encode answer:1": [15_000] * 3,
        "decode request:18": [50_000],             # ApiVersions: a row, not on the path
    })
    write_trace(tmp_path / "node-2.json", f2, {"decode answer:1": [40_000], "encode request:1": [25_000]})
    write_trace(tmp_path / "node-3.json", f3, {"decode answer:1": [60_000], "encode request:1": [25_000]})
    followed = commit_profile.follow(str(tmp_path), [op])
    codec = commit_profile.summarize_codec(followed)
    rows = {(r["node"], r["op"], r["api"]): r for r in codec["rows"]}
    assert rows[("leader", "decode request", "Fetch")] == {
        "node": "leader", "op": "decode request", "api": "Fetch", "api_key": 1, "count": 10,
        "p50_us": 30.0, "p99_us": 90.0}
    assert rows[("follower", "decode answer", "Fetch")]["count"] == 2  # both followers, pooled
    assert rows[("leader", "decode request", "ApiVersions")]["p50_us"] == 50.0
    # 20 + 15 + 40 (the lower of the followers' 40 and 60) + 25 + 30 + 10
    assert codec["per_commit_p50_us"] == 140.0
    table = commit_profile.format_profile(followed)
    assert "the codec on one commit's path" in table and "140.0 us" in table
    # Rows seen fewer than CODEC_ROW_COUNT_MIN times are in the JSON only, and the table says so.
    assert "leader decode request Fetch" in table and "leader encode answer Fetch" not in table
    assert "6 rows of frames seen fewer than 10 times" in table
