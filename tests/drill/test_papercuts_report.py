"""Issue 36: the drill's failover figures belong to faults that removed the
leader. On a constructed timeline: an isolation the leader rode out (writes
never paused in its epoch) and a short pause get no figure and are said to
have kept the leader, instead of being timed to a later fault's election."""

from __future__ import annotations

from types import SimpleNamespace

from metalog.tools.drill.checker import Ack, History, RoleEvent
from metalog.tools.drill.drill import FaultRecord, Sample
from metalog.tools.drill.report import build_report, failover_by_kind, failover_lines, failovers

T0 = 1000.0


def timeline():
    """Leader 1 in epoch 3; isolate_leader at +1 s changes nothing; kill_leader at
    +10 s: node 2 leads epoch 4 from +11 s (first ack +11.2 s); pause_leader at +20 s:
    node 3 leads epoch 5 from +21.5 s (first ack +21.6 s); a short pause_leader at
    +30 s changes nothing before kill_follower at +40 s; epoch 6 comes at +45 s."""
    epochs = [(T0, 3, 1), (T0 + 11.0, 4, 2), (T0 + 21.5, 5, 3), (T0 + 45.0, 6, 1)]

    def at(ts):
        return [(e, leader) for start, e, leader in epochs if start <= ts][-1]

    samples, acks = [], []
    for k in range(500):  # a /quorum poll of every voter and an ack every 0.1 s for 50 s
        ts = T0 + k / 10
        epoch, leader = at(ts)
        for node in (1, 2, 3):
            samples.append(Sample(ts, node, 1, "leader" if node == leader else "follower", epoch, leader, hw=k))
        if not (T0 + 10.0 <= ts < T0 + 11.2 or T0 + 20.0 <= ts < T0 + 21.6):  # writes stall only in real failovers
            acks.append(Ack(b"v%d" % k, k, epoch, ts + 0.01))
    history = History(acks=acks)
    history.roles = [RoleEvent(leader, start, "leader", e, leader, hw=round((start - T0) * 10))
                     for start, e, leader in epochs[1:]]
    faults = [FaultRecord("isolate_leader", 1, T0 + 1.0, T0 + 4.0, leader_before=1, epoch_before=3),
              FaultRecord("kill_leader", 1, T0 + 10.0, T0 + 12.0, leader_before=1, epoch_before=3),
              FaultRecord("pause_leader", 2, T0 + 20.0, T0 + 23.0, leader_before=2, epoch_before=4),
              FaultRecord("pause_leader", 3, T0 + 30.0, T0 + 30.5, leader_before=3, epoch_before=5),
              FaultRecord("kill_follower", 2, T0 + 40.0, T0 + 42.0, leader_before=3, epoch_before=5)]
    nodes = {n: SimpleNamespace(voter=True) for n in (1, 2, 3)}
    return SimpleNamespace(t0=T0, seed=7, faults=faults, samples=samples, history=history, write_errors=0,
                           proxy=None, cluster=SimpleNamespace(nodes=nodes))


def test_only_a_fault_that_removed_the_leader_gets_a_failover_figure():
    fo = failovers(timeline())
    assert [(f["kind"], f["leader_changed"], f["failover_ms"], f["new_epoch"]) for f in fo] == [
        ("isolate_leader", False, None, None),  # was 10210 ms: timed to kill_leader's election
        ("kill_leader", True, 1210.0, 4),
        ("pause_leader", True, 1610.0, 5),
        ("pause_leader", False, None, None),  # was 15010 ms: timed to epoch 6, after kill_follower
    ]
    assert [f["leader_commit_ms"] for f in fo] == [None, 1100.0, 1600.0, None]

    by_kind = failover_by_kind(fo)
    assert by_kind["isolate_leader"] == {"faults": 1, "leader_kept": 1, "n": 0, "p50": None, "p99": None,
                                         "max": None, "commit_n": 0, "commit_p50": None, "commit_p99": None,
                                         "commit_max": None}
    assert (by_kind["pause_leader"]["faults"], by_kind["pause_leader"]["leader_kept"],
            by_kind["pause_leader"]["p99"]) == (2, 1, 1610.0)
    assert failover_lines(by_kind) == [
        "after isolate_leader: the leader did not change (no newer epoch before the next fault) after any of "
        "its 1 fault(s): no failover figure",
        "failover after kill_leader (to the first write acknowledged in a newer epoch): n=1 p50 1210.0 ms, "
        "p99 1210.0 ms, max 1210.0 ms; to the new leader's first commit: n=1 p50 1100.0 ms, p99 1100.0 ms, "
        "max 1100.0 ms",
        "failover after pause_leader (to the first write acknowledged in a newer epoch): n=1 p50 1610.0 ms, "
        "p99 1610.0 ms, max 1610.0 ms; to the new leader's first commit: n=1 p50 1600.0 ms, p99 1600.0 ms, "
        "max 1600.0 ms; the leader did not change after 1 of its 2 fault(s) (no figure for those)",
    ]


def test_the_json_report_carries_the_same_figures():
    drill = timeline()
    result = SimpleNamespace(ok=True, breaches=[], stats={"unverifiable": 0}, to_json=lambda: {})
    report = build_report(drill, {"result": result, "problems": [], "commit_end": 499, "converged": {},
                                  "replicas": {}})
    summary = report["summary"]
    assert (summary["failover_ms_p50"], summary["failover_ms_p99"], summary["failover_ms_max"]) == \
        (1210.0, 1610.0, 1610.0)
    assert summary["failover_by_kind"]["isolate_leader"]["leader_kept"] == 1
    assert [(f["kind"], f["leader_changed"], f["t_s"]) for f in report["failovers"]] == [
        ("isolate_leader", False, 1.0), ("kill_leader", True, 10.0), ("pause_leader", True, 20.0),
        ("pause_leader", False, 30.0)]
