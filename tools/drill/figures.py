"""Per fault kind, what a user felt (issue 35 item 5), each figure defined so it cannot mislead.

Every fault owns a window: from its start to the start of the next fault (the
last one: to the end of the load). Each figure is measured inside its own
fault's window only -- never credited to a later fault's election:

* ``acknowledged``: writes acknowledged in the window (by ack time);
* ``lost``: of those, writes not at their acknowledged offset in the committed
  log as the copies show it (final logs and archive; an offset no copy holds
  is ``unverifiable`` in the checker, not counted here); ``duplicated``: of
  those, values the committed log holds more than once. Goal 0 and 0;
* ``longest_no_ack_ms``: the longest stretch in the window with no write
  acknowledged, from the fault's start: what a writer waited at worst;
* ``new_leader_commit_ms``: for a fault that removed the leader (a newer epoch
  before the next fault, ``report.failovers``), fault start -> the new
  leader's first commit; faults that left the leader in place have none;
* ``heal_to_converged_ms``: the fault repaired (process restarted, network
  healed) -> every broker's high watermark at or past the highest high
  watermark seen up to the repair (from the /quorum samples, accurate to one
  poll); ``not_converged`` counts faults after which some broker had not got
  there before the next fault began;
* ``checkers``: the verdicts of both checkers. They judge the whole history,
  not one fault: a breach fails every kind, and the evidence names the offsets.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))], 1)


def _longest_gap_ms(start: float, ack_ts: list[float]) -> float:
    points = [start] + ack_ts
    return round(max((b - a for a, b in zip(points, points[1:])), default=0.0) * 1000, 1)


def _converged_ts(drill, heal_ts: float, until_ts: float) -> float | None:
    """First time after heal_ts by which every broker's HW reached the highest HW seen up to heal_ts."""
    target = max((s.hw for s in drill.samples if s.hw is not None and s.ts <= heal_ts), default=None)
    if target is None:
        return None
    reached = []
    for nid in drill.cluster.nodes:
        ts = next((s.ts for s in drill.samples if s.node == nid and heal_ts <= s.ts < until_ts
                   and s.hw is not None and s.hw >= target), None)
        if ts is None:
            return None
        reached.append(ts)
    return max(reached)


def per_fault(drill, result, failovers: list[dict], end_ts: float, commit_end: int) -> list[dict]:
    """One row per fault, its figures measured inside its own window."""
    acks = sorted(drill.history.acks, key=lambda a: a.ts)
    ack_ts = [a.ts for a in acks]
    log = getattr(result, "log", None) or {}  # the committed log as the copies show it
    counts = Counter(log.values())
    commit_by_ts = {f["ts"]: f.get("leader_commit_ms") for f in failovers}
    faults = sorted(drill.faults, key=lambda f: f.ts_start)
    out = []
    for i, f in enumerate(faults):
        until = faults[i + 1].ts_start if i + 1 < len(faults) else end_ts
        mine = acks[bisect.bisect_left(ack_ts, f.ts_start):bisect.bisect_left(ack_ts, until)]
        lost = sum(1 for a in mine if a.offset >= commit_end or (a.offset in log and log[a.offset] != a.value))
        converged = _converged_ts(drill, f.ts_end or f.ts_start, until)
        out.append({"kind": f.kind, "node": f.node, "t_s": round(f.ts_start - drill.t0, 3),
                    "acknowledged": len(mine), "lost": lost,
                    "duplicated": sum(1 for a in mine if counts[a.value] > 1),
                    "longest_no_ack_ms": _longest_gap_ms(f.ts_start, [a.ts for a in mine]),
                    "new_leader_commit_ms": commit_by_ts.get(f.ts_start),
                    "heal_to_converged_ms": None if converged is None
                    else round((converged - (f.ts_end or f.ts_start)) * 1000, 1)})
    return out


def by_kind(rows: list[dict], checkers: dict) -> dict[str, dict]:
    groups = defaultdict(list)
    for r in rows:
        groups[r["kind"]].append(r)
    out = {}
    for kind, mine in sorted(groups.items()):
        gaps = [r["longest_no_ack_ms"] for r in mine]
        commits = [r["new_leader_commit_ms"] for r in mine if r["new_leader_commit_ms"] is not None]
        heals = [r["heal_to_converged_ms"] for r in mine if r["heal_to_converged_ms"] is not None]
        out[kind] = {"faults": len(mine), "acknowledged": sum(r["acknowledged"] for r in mine),
                     "lost": sum(r["lost"] for r in mine), "duplicated": sum(r["duplicated"] for r in mine),
                     "checkers": checkers,
                     "longest_no_ack_ms_p50": _pct(gaps, 50), "longest_no_ack_ms_max": max(gaps, default=None),
                     "new_leader_commit_n": len(commits), "new_leader_commit_ms_p50": _pct(commits, 50),
                     "new_leader_commit_ms_max": max(commits, default=None),
                     "heal_to_converged_ms_p50": _pct(heals, 50), "heal_to_converged_ms_max": max(heals, default=None),
                     "not_converged": len(mine) - len(heals)}
    return out


def lines(kinds: dict[str, dict]) -> list[str]:
    """One line per fault kind for the drill's output."""
    out = []
    for kind, k in kinds.items():
        commit = (f"new leader's first commit p50 {k['new_leader_commit_ms_p50']} ms max "
                  f"{k['new_leader_commit_ms_max']} ms (n={k['new_leader_commit_n']})"
                  if k["new_leader_commit_n"] else "no leader removed")
        out.append(f"{kind} x{k['faults']}: acknowledged {k['acknowledged']}, lost {k['lost']}, duplicated "
                   f"{k['duplicated']}; longest without an ack p50 {k['longest_no_ack_ms_p50']} ms max "
                   f"{k['longest_no_ack_ms_max']} ms; {commit}; heal -> converged p50 "
                   f"{k['heal_to_converged_ms_p50']} ms max {k['heal_to_converged_ms_max']} ms"
                   + (f" ({k['not_converged']} not before the next fault)" if k["not_converged"] else ""))
    return out
