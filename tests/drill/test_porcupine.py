"""Porcupine, a checker we did not write, over the drill's history (tools/drill/porcupine).

It must accept a real drill's history and reject the three ways a log breaks
its promise -- an acknowledged write a later read passes over, one offset read
with two values, one value acknowledged at two offsets -- printing the failing
window; an append of unknown outcome (info) is accepted whether it happened or not.
"""

import gzip
import json
import os
import shutil

from metalog.tools.drill.history import FORMAT, PORCUPINE_BIN, run_porcupine

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "drill_history.jsonl.gz")
MS = 1_000_000  # history times are ns


def write_history(path, ops):
    """ops: (process, f, invoke value, completion type, completion value, invoke ms, completion ms or None)."""
    events = []
    for proc, f, inv, kind, done, t0, t1 in ops:
        events.append((t0 * MS, {"type": "invoke", "process": proc, "f": f, "value": inv}))
        if t1 is not None:  # None: never completed (the drill stopped first)
            events.append((t1 * MS, {"type": kind, "process": proc, "f": f, "value": done}))
    with open(path, "w") as fh:
        fh.write(json.dumps({"type": "meta", "format": FORMAT}) + "\n")
        for t, ev in sorted(events, key=lambda e: e[0]):
            fh.write(json.dumps({**ev, "time": t}) + "\n")
    return str(path)


def append(proc, values, offset, t0, t1, kind="ok"):
    done = {"values": values, "offset": offset, "epoch": 1} if kind == "ok" else {"values": values}
    return (proc, "append", {"values": values}, kind, done, t0, t1)


def read(proc, start, nxt, records, t0, t1):
    return (proc, "read", {"from": start}, "ok",
            {"from": start, "next": nxt, "records": [[o, v, 1] for o, v in records]}, t0, t1)


def verdict(tmp_path, ops):
    return run_porcupine(write_history(tmp_path / "history.jsonl", ops), vis_path=str(tmp_path / "vis.html"))


def test_the_checker_is_built():
    assert os.access(PORCUPINE_BIN, os.X_OK), f"{PORCUPINE_BIN} missing: bash run.sh setup builds it (Go)"


def test_a_real_drills_history_is_linearizable(tmp_path):
    """Recorded from `metalog drill --duration-s 10 --schedule kill_leader,isolate_leader`
    on network namespaces: 713 appends, 909 reads (two told of a truncation), the final log."""
    path = tmp_path / "history.jsonl"
    with gzip.open(FIXTURE, "rb") as src, open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    v = run_porcupine(str(path))
    assert v.ok and v.rc == 0, v.output
    assert v.summary.startswith("porcupine: linearizable: 1624 operations (713 appends acknowledged"), v.summary


def test_a_lost_acknowledged_write_is_caught(tmp_path):
    """'a' acknowledged at 0; a read from 0 afterwards returns only 'b' at 1: it passed over 0."""
    v = verdict(tmp_path, [append("w0", ["a"], 0, 0, 10), append("w1", ["b"], 1, 11, 20),
                           read("c0", 0, 2, [(1, "b")], 30, 40)])
    assert not v.ok and v.rc == 1, v.output
    assert v.summary.startswith("porcupine: NOT linearizable: 1 of 4 registers"), v.summary
    text = "\n".join(v.output)
    assert "offset 0: not linearizable; minimal failing window, 2 of its 2 operations" in text, text
    assert 'append put "a" at 0' in text and "read passed 0 (control)" in text, text
    assert os.path.getsize(tmp_path / "vis.html") > 1000  # Porcupine's own picture of it


def test_one_offset_read_with_two_values_is_caught(tmp_path):
    """Offset 0 holds 'a' for one consumer and 'x' for another ('x' from an append of unknown outcome)."""
    v = verdict(tmp_path, [append("w0", ["a"], 0, 0, 10), append("w1", ["x"], None, 0, None, kind="info"),
                           read("c0", 0, 1, [(0, "a")], 20, 30), read("c1", 0, 1, [(0, "x")], 40, 50)])
    assert not v.ok and v.rc == 1, v.output
    text = "\n".join(v.output)
    assert "offset 0: not linearizable" in text and "1 of 3 registers" in v.summary, text
    assert 'read 0 -> "x"' in text and 'append put "a" at 0' in text, text


def test_a_value_acknowledged_at_two_offsets_is_caught(tmp_path):
    """'a' acknowledged at 0 and again at 1: a duplicate, though each offset alone is consistent."""
    v = verdict(tmp_path, [append("w0", ["a"], 0, 0, 10), append("w0", ["a"], 1, 20, 30),
                           read("c0", 0, 2, [(0, "a"), (1, "a")], 40, 50)])
    assert not v.ok and v.rc == 1, v.output
    text = "\n".join(v.output)
    assert 'value "a": not linearizable' in text and "1 of 3 registers" in v.summary, text
    assert 'append "a" acknowledged at 0' in text and 'append "a" acknowledged at 1' in text, text


def test_an_append_of_unknown_outcome_is_accepted_both_ways(tmp_path):
    """An info append ('b', timed out) that did happen -- a later read finds it -- and one that did not."""
    happened = verdict(tmp_path, [append("w0", ["a"], 0, 0, 10), append("w1", ["b"], None, 5, 15, kind="info"),
                                  read("c0", 0, 2, [(0, "a"), (1, "b")], 40, 50)])
    assert happened.ok, happened.output
    never = verdict(tmp_path, [append("w0", ["a"], 0, 0, 10), append("w1", ["b"], None, 5, 15, kind="info"),
                               read("c0", 0, 1, [(0, "a")], 40, 50)])
    assert never.ok, never.output
    # but not anything at all: a read that finished before the append was invoked cannot have seen it
    too_early = verdict(tmp_path, [append("w0", ["a"], 0, 0, 10), read("c0", 0, 2, [(0, "a"), (1, "b")], 20, 30),
                                   append("w1", ["b"], None, 40, 45, kind="info")])
    assert not too_early.ok and "offset 1: not linearizable" in "\n".join(too_early.output), too_early.output


def test_a_missing_checker_fails_in_one_line(tmp_path):
    path = write_history(tmp_path / "history.jsonl", [append("w0", ["a"], 0, 0, 10)])
    v = run_porcupine(path, binary=str(tmp_path / "no-such-binary"))
    assert not v.ok and v.rc is None
    assert v.summary.startswith(f"porcupine: {tmp_path / 'no-such-binary'} is missing: build it with "
                                "`bash run.sh setup`"), v.summary


def test_the_drill_refuses_to_start_without_the_checker(tmp_path, capsys, monkeypatch):
    import argparse

    from metalog.tools.drill import drill

    monkeypatch.setattr(drill, "PORCUPINE_BIN", str(tmp_path / "no-such-binary"))
    p = argparse.ArgumentParser()
    drill.add_arguments(p)
    assert drill.cmd_drill(p.parse_args(["--dir", str(tmp_path / "run"), "--duration-s", "1"])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the independent checker" in err and "is missing" in err, err
    assert not os.path.exists(tmp_path / "run" / "node-1")


def test_per_fault_figures_stay_in_their_own_window():
    """Item 5's figures on a constructed run: a kill at +0 s (writes stall 1.5 s, node 2 lags
    until +3.2 s after the restart at +2 s), a cut at +5 s; an ack of the cut's window is lost."""
    from types import SimpleNamespace

    from metalog.tools.drill.checker import Ack, History
    from metalog.tools.drill.drill import FaultRecord, Sample
    from metalog.tools.drill.figures import by_kind, per_fault

    t0 = 100.0
    acks = [Ack(b"v%d" % k, k, 1, t0 + k / 10) for k in range(100) if not 0 <= k < 15]
    samples = [Sample(t0 + k / 10, n, 1, "follower", 1, 1, hw=(k if n != 2 or k >= 32 else min(k, 10)))
               for k in range(100) for n in (1, 2, 3)]
    faults = [FaultRecord("kill_leader", 1, t0, t0 + 2.0, leader_before=1, epoch_before=1),
              FaultRecord("cut_one_way", 1, t0 + 5.0, t0 + 8.0, leader_before=1, epoch_before=1)]
    drill = SimpleNamespace(t0=t0, faults=faults, samples=samples, history=History(acks=acks),
                            cluster=SimpleNamespace(nodes={1: None, 2: None, 3: None}))
    log = {a.offset: a.value for a in acks if a.offset != 60}  # offset 60 (acked at +6 s) holds another value
    log[60] = b"other"
    rows = per_fault(drill, SimpleNamespace(log=log), [{"ts": t0, "leader_commit_ms": 1400.0}], t0 + 10, 100)
    assert [(r["acknowledged"], r["lost"], r["duplicated"]) for r in rows] == [(35, 0, 0), (50, 1, 0)]
    assert rows[0]["longest_no_ack_ms"] == 1500.0 and rows[1]["longest_no_ack_ms"] == 100.0
    assert rows[0]["new_leader_commit_ms"] == 1400.0 and rows[1]["new_leader_commit_ms"] is None
    assert rows[0]["heal_to_converged_ms"] == 1200.0  # node 2 reached the HW of the restart at +3.2 s
    kinds = by_kind(rows, {"ours": False, "porcupine": False})
    assert kinds["cut_one_way"]["lost"] == 1 and kinds["kill_leader"]["lost"] == 0
