"""The hostile bench's rounds (metalog.tools.bench.hostile): the report is the round with the
median commits share, every round's ratios beside it, on the figures the windows measured."""

from __future__ import annotations

from metalog.tools.bench import hostile


def a_round(idle_per_s: float, attacked_per_s: float, idle_p99_ms: float, attacked_p99_ms: float) -> dict:
    window = dict(p50_ms=1.0, errors=0, leader_cpu=0.5)
    return hostile._ratios({
        "attack": "flood", "amount": 1000,
        "idle": dict(window, commits_per_s=idle_per_s, p99_ms=idle_p99_ms),
        "under_attack": dict(window, commits_per_s=attacked_per_s, p99_ms=attacked_p99_ms),
        "leader_handshake_loop_share": 0.05, "leader_log_lines": {"tls_handshake_failed": 3},
        "leader_refused": {}, "leader_kernel_drops": {}, "attacker": {"cpu_per_s": 0.1}})


def test_the_median_round_by_commits_share_and_every_rounds_ratios():
    rounds = [a_round(400, 260, 5.0, 9.0), a_round(330, 300, 6.0, 8.0), a_round(350, 290, 5.0, 12.0)]
    assert [r["commits_share"] for r in rounds] == [0.65, 0.91, 0.83]
    m = hostile.median_round(rounds)
    assert m["commits_share"] == 0.83 and m["idle"]["commits_per_s"] == 350  # the middle round itself
    assert m["rounds"] == [[1.8, 0.65], [1.33, 0.91], [2.4, 0.83]]
    assert m["p99_ratio_median"] == 1.8
    report = hostile.format_report({"attacks": [m], "load_average": (1.0, 1.0, 1.0)})
    assert "commits 0.83 of idle" in report and "the median of 3 rounds" in report


def test_one_round_is_reported_as_before_and_an_even_count_takes_the_lower_middle():
    one = hostile.median_round([a_round(300, 270, 5.0, 7.5)])
    assert one["commits_share"] == 0.9 and one["p99_ratio"] == 1.5
    assert "median of" not in hostile.format_report({"attacks": [one], "load_average": (1.0, 1.0, 1.0)})
    two = hostile.median_round([a_round(300, 270, 5.0, 7.5), a_round(300, 210, 5.0, 7.5)])
    assert two["commits_share"] == 0.7
