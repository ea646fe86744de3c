"""Did each fault take effect? The drill's check that its faults are not no-ops.

A fault injected is not a fault suffered: until issue 35 every partition of
the drill went through a proxy the brokers had learned to dial around, and
the drill reported success over faults that changed nothing. So after every
fault (once writes are acknowledged again) ``why_not_bitten`` looks for the
fault's effect in what the drill observed, and the drill stops with one line
naming the fault when it is missing:

* kill (leader, follower, observer): the process exited by SIGKILL; for the
  leader, also a newer epoch (a new leader) before the next fault;
* term_restart: the process exited; pause_leader: the process was seen
  stopped (state T) and a newer epoch showed;
* isolate_leader, split_majority: the network dropped packets, the cut-off
  leader's high watermark did not move while it was cut off (after
  ``GRACE_S`` for answers in flight), and a newer epoch showed: the majority
  elected a new leader;
* cut_one_way (leader -> follower F): packets dropped, and F's high
  watermark did not move while cut (its fetches got no answers) in the
  leader's epoch (F may win a newer one);
* loss_10 / loss_30: packets on that link dropped and some passed (loss, not
  a cut); bandwidth_cap: the token bucket held packets back (overlimits);
  mtu_blackhole: large packets dropped;
* wipe_follower: the data dir was deleted; reconfigure: the voter was removed;
* the compound faults (``metalog.tools.drill.compound``), both halves: packets
  dropped, and kill_under_partition: the isolated leader's HW frozen, the
  majority follower dead by SIGKILL, a majority leader of a newer epoch
  elected while the isolation held; pause_under_loss: the leader seen
  stopped, a newer epoch; wipe_under_cut: the dir deleted and the follower
  caught up after the heal; partition_snapshot: the follower's download was
  on its disk, unfinished, when the cut was in force, no snapshot appeared
  under a real name while cut, it installed a snapshot after the heal and
  caught up, and its dir then holds only whole snapshots and no partial.

High watermarks come from the drill's /quorum samples of each broker, which
travel on the admin port the network faults leave alone.

A check that cannot be made is a failure ("cannot tell"), so the drill must not
inject a fault whose effect its targets cannot show: ``must_follow`` names,
per fault, the brokers that have to answer /quorum and follow the current
leader with a fresh high watermark before the fault starts (a leader killed
2 s earlier and restarted 0.1 s before a one-way cut to it answered nothing
while cut, and a follower still booting cannot show a frozen HW, nor help
elect the leader a pause or an isolation must produce). The drill waits for
them, with a deadline, and records the delay in the fault's report.
"""

from __future__ import annotations

from metalog.tools.drill import compound
from metalog.tools.drill.report import newer_epoch_ts

GRACE_S = 0.5  # answers in flight when a cut begins may still land
MIN_SAMPLES = 2  # /quorum answers needed to say a high watermark stood still


def _hw_moved(drill, node: int, t_from: float, t_to: float, epoch: int | None) -> tuple[int, int] | str | None:
    """(first, last) HW of node's samples asked and answered within [t_from, t_to], in the
    fault's `epoch`, if it moved; None if it stood still, or a reason it cannot be told
    (too few samples). An answer asked for before t_from may tell the state before the
    cut (a slow answer on a loaded machine); one that came after t_to, the state after
    the heal; one of a newer epoch, a new leader's commits (cut off from the old leader,
    a follower may win an election: that is the cut biting, not a path around it)."""
    hws = [s.hw for s in sorted(drill.samples, key=lambda s: s.ts)
           if s.node == node and t_from <= (s.sent_ts if s.sent_ts is not None else s.ts) and s.ts <= t_to
           and s.hw is not None and (epoch is None or s.epoch == epoch)]
    if len(hws) < MIN_SAMPLES:
        return f"only {len(hws)} /quorum answer(s) from node {node} while it was cut, cannot tell"
    return (hws[0], hws[-1]) if hws[-1] != hws[0] else None


def _dropped(rec) -> str | None:
    net = rec.detail.get("net") or {}
    if net.get("dropped_packets", 0) > 0 or net.get("dropped_bytes", 0) > 0:
        return None
    return f"the network dropped nothing ({net})"


def _new_epoch(drill, rec, now_ts: float) -> str | None:
    if rec.epoch_before is None or newer_epoch_ts(drill, rec.ts_start, now_ts, rec.epoch_before) is not None:
        return None
    return f"no newer epoch than {rec.epoch_before} appeared: no new leader was elected"


def _frozen(drill, rec, node: int, who: str) -> str | None:
    cut_end = rec.detail.get("heal_ts") or rec.ts_end or rec.ts_start  # the heal began: no longer cut
    moved = _hw_moved(drill, node, rec.ts_start + GRACE_S, cut_end, rec.epoch_before)
    if moved is None:
        return None
    if isinstance(moved, str):
        return moved
    return f"{who}'s high watermark moved {moved[0]} -> {moved[1]} while it was cut off"


def must_follow(kind: str, followers: list[int], other: int | None) -> list[int]:
    """The brokers that must follow the leader with a fresh HW before fault `kind` can show
    its effect: the far end of a loss link (packets must flow on it for loss to drop some);
    for a one-way cut its far end (its HW must be moving to be seen frozen) and every
    other follower (with one still booting, the leader has no majority without the cut-off
    follower, which then wins an election with the booting voter's vote: its HW moves as
    a leader's, CI 2026-11-28); every follower for a fault that must end in a new leader
    (a majority able to elect) or whose effect is the leader's replication traffic (a
    bandwidth cap, an MTU black hole). Kills, restarts and wipes need none: their effect
    is the process's exit."""
    if kind in ("loss_10", "loss_30"):
        return [] if other is None else [other]
    if kind == "cut_one_way":
        return [] if other is None else [other] + [n for n in followers if n != other]
    if kind in ("isolate_leader", "split_majority", "pause_leader", "bandwidth_cap", "mtu_blackhole",
                *compound.COMPOUND_FAULTS):
        return list(followers)
    return []


def lagging(quorum, nodes: list[int], leader: int, epoch: int, hw_from: int) -> str | None:
    """None if every node in `nodes` follows `leader` in `epoch` with a HW past `hw_from`
    (it got a fetch answer since then), else why the first one does not. `quorum(node)`
    is its /quorum answer or None."""
    for nid in nodes:
        q = quorum(nid)
        if not q:
            return f"node {nid} does not answer /quorum"
        if q.get("epoch") != epoch or q.get("leader_id") != leader:
            return f"node {nid} follows leader {q.get('leader_id')} in epoch {q.get('epoch')}, not {leader} in {epoch}"
        hw = q.get("high_watermark")
        if hw is None or hw <= hw_from:
            return f"node {nid}'s high watermark {hw} has not passed the leader's {hw_from}"
    return None


def why_not_bitten(drill, rec, now_ts: float) -> str | None:
    """None if fault `rec` took effect, else one line saying what did not happen."""
    k, d = rec.kind, rec.detail
    checks: list[str | None] = []
    if k in ("kill_leader", "kill_follower", "kill_observer"):
        checks.append(None if d.get("exit_code") == -9 else f"the process did not die by SIGKILL "
                                                              f"(exit code {d.get('exit_code')})")
        if k == "kill_leader":
            checks.append(_new_epoch(drill, rec, now_ts))
    elif k == "term_restart":
        checks.append(None if d.get("exit_code") is not None else "the process did not exit")
    elif k == "pause_leader":
        checks.append(None if d.get("stopped") else "the process was never seen stopped (state T)")
        checks.append(_new_epoch(drill, rec, now_ts))
    elif k in ("isolate_leader", "split_majority"):
        checks += [_dropped(rec), _frozen(drill, rec, rec.node, "the cut-off leader"),
                   _new_epoch(drill, rec, now_ts)]
    elif k == "cut_one_way":
        checks += [_dropped(rec), _frozen(drill, rec, d["to"], f"follower {d['to']}")]
    elif k in ("loss_10", "loss_30"):
        net = d.get("net") or {}
        checks.append(_dropped(rec))
        # Loss, not a cut: some packets passed. (Not a ratio: a fetch every half second is a
        # few packets a second, too few for a rate to be told from chance in a 3 s fault.)
        checks.append(None if net.get("matched_packets", 0) > net.get("dropped_packets", 0) else
                      f"the link lost every packet, not {d.get('loss_pct')}% ({net})")
    elif k == "bandwidth_cap":
        net = d.get("net") or {}
        checks.append(None if net.get("overlimits", 0) > 0 else f"the token bucket never held a packet ({net})")
    elif k == "mtu_blackhole":
        checks.append(_dropped(rec))
    elif k == "wipe_follower":
        checks.append(None if d.get("wiped") else "the data dir was not deleted")
    elif k in compound.COMPOUND_FAULTS:
        checks.append(_dropped(rec))
        if k == "kill_under_partition":
            checks.append(_frozen(drill, rec, rec.node, "the isolated leader"))
        checks.append(compound.why_not_bitten(rec))
        if k in ("kill_under_partition", "pause_under_loss"):
            checks.append(_new_epoch(drill, rec, now_ts))
    elif k == "reconfigure":
        checks.append(None if d.get("removed_dir") is not None else "the voter was not removed")
    return next((c for c in checks if c is not None), None)
