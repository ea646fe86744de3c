"""The drill report's picture: fault labels never overlap, and a long drill's PNG can be redrawn from its files."""

import json
import random

from metalog.tools.drill.report import FAULT_STYLE, layout_labels, rerender, timeline, write_report
from types import SimpleNamespace


def test_labels_in_one_row_never_overlap_and_the_ones_without_room_are_dropped():
    rng = random.Random(3)
    xs = sorted(rng.uniform(0, 420) for _ in range(200))
    widths = [rng.uniform(2, 8) for _ in xs]
    rows = layout_labels(xs, widths, 4)
    for r in range(4):
        placed = [(x, x + w) for x, w, row in zip(xs, widths, rows) if row == r]
        assert all(a[1] <= b[0] for a, b in zip(placed, placed[1:]))
    assert None in rows  # 200 labels over 420 s do not all fit in 4 rows
    assert layout_labels([0.0, 1.0, 2.0], [0.5, 0.5, 0.5], 1) == [0, 0, 0]
    assert layout_labels([0.0, 1.0], [5.0, 5.0], 1) == [0, None]


def fake_drill(n_faults: int, duration_s: float):
    t0 = 1000.0
    samples, acks = [], []
    for k in range(int(duration_s * 10)):
        ts = t0 + k / 10
        epoch = 1 + k // 40
        leader = 1 + epoch % 3
        for node in (1, 2, 3, 4):
            role = "observer" if node == 4 else ("leader" if node == leader else "follower")
            samples.append(SimpleNamespace(ts=ts, node=node, role=role if k % 40 > 3 else None, epoch=epoch))
        acks += [SimpleNamespace(ts=ts + i / 50, epoch=epoch) for i in range(5)]
    nodes = {n: SimpleNamespace(voter=n < 4) for n in (1, 2, 3, 4)}
    drill = SimpleNamespace(t0=t0, cluster=SimpleNamespace(nodes=nodes), samples=samples,
                            history=SimpleNamespace(acks=acks))
    kinds = list(FAULT_STYLE)
    faults = [{"kind": kinds[i % len(kinds)], "node": 1 + i % 3, "t_s": (i + 0.5) * duration_s / n_faults}
              for i in range(n_faults)]
    report = {"ok": True, "seed": 11, "duration_s": duration_s, "faults": faults,
              "summary": {"writes_acknowledged": len(acks), "writes_lost": 0, "writes_duplicated": 0,
                          "writes_unverifiable": 0, "faults": n_faults, "failover_ms_p50": 700.0,
                          "failover_ms_p99": 3000.0},
              "unavailable_windows_s": [[f["t_s"], f["t_s"] + 0.4] for f in faults],
              "failovers": [{"t_s": f["t_s"], "failover_ms": 400.0 + 10 * i} for i, f in enumerate(faults)]}
    return drill, report


def test_long_drill_png_is_written_and_redrawn_from_its_files(tmp_path):
    drill, report = fake_drill(200, 420.0)
    paths = write_report(report, drill, str(tmp_path / "long"))
    first = (tmp_path / "long.png").stat().st_size
    assert first > 20_000
    with open(paths["timeline"]) as f:
        t = json.load(f)
    assert len(t["acks"]) == len(drill.history.acks) and t["voters"] == {"1": True, "2": True, "3": True, "4": False}
    (tmp_path / "long.png").unlink()
    assert rerender(str(tmp_path / "long")) == str(tmp_path / "long.png")
    assert (tmp_path / "long.png").stat().st_size > 20_000
    assert timeline(drill)["t0"] == 1000.0


def test_failover_is_reported_per_fault_kind_with_its_percentiles():
    from metalog.tools.drill.report import failover_by_kind
    fo = [{"kind": "pause_leader", "failover_ms": ms} for ms in (900.0, 1100.0, 1300.0)]
    fo += [{"kind": "kill_leader", "failover_ms": 300.0}, {"kind": "kill_leader", "failover_ms": None}]
    for f, commit in zip(fo, (700.0, 800.0, 1000.0, 200.0, None)):
        f["leader_commit_ms"] = commit
    got = failover_by_kind(fo)
    assert got["pause_leader"] == {"faults": 3, "leader_kept": 0, "n": 3, "p50": 1100.0, "p99": 1300.0, "max": 1300.0,
                                   "commit_n": 3, "commit_p50": 800.0, "commit_p99": 1000.0, "commit_max": 1000.0}
    # A fault after which no newer epoch ever acknowledged a write (or committed) is not a sample.
    assert got["kill_leader"] == {"faults": 2, "leader_kept": 0, "n": 1, "p50": 300.0, "p99": 300.0, "max": 300.0,
                                  "commit_n": 1, "commit_p50": 200.0, "commit_p99": 200.0, "commit_max": 200.0}


def test_the_new_leaders_first_commit_is_its_hw_passing_the_hw_it_was_elected_with():
    from types import SimpleNamespace as NS

    from metalog.tools.drill.checker import History, RoleEvent
    from metalog.tools.drill.drill import Sample
    from metalog.tools.drill.report import first_commit_ts
    h = History()
    h.roles = [RoleEvent(1, 9.0, "leader", 4, 1, hw=90),  # before the fault: not it
               RoleEvent(2, 10.9, "candidate", 5, -1, hw=100), RoleEvent(2, 11.0, "leader", 5, 2, hw=100)]
    samples = [Sample(11.02, 2, 1, "leader", 5, 2, hw=100),  # elected, nothing committed yet
               Sample(11.05, 3, 1, "follower", 5, 2, hw=101),  # a follower: not the leader's commit
               Sample(11.07, 2, 1, "leader", 5, 2, hw=101)]
    drill = NS(history=h, samples=samples)
    assert first_commit_ts(drill, after_ts=10.0, epoch_before=4) == 11.07
    assert first_commit_ts(drill, after_ts=10.0, epoch_before=5) is None  # no newer leader
