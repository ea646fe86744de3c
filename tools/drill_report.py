"""The drill report: ``<path>.json`` (every number) and ``<path>.png`` (the picture).

The PNG has three panels over one time axis (seconds since the drill began):

1. one lane per broker coloured by role (leader / follower / candidate /
   observer-or-unattached / no answer: down or paused), the leader's epoch
   written on its bars, and a labelled marker for every fault;
2. each broker's epoch over time;
3. acknowledged writes per second, unavailability windows (no ack for longer
   than ``UNAVAILABLE_GAP_S``) shaded, and for every fault that took the
   leader away the measured time to the next commit in a newer epoch.
"""

from __future__ import annotations

import json
import os
from collections import Counter

UNAVAILABLE_GAP_S = 0.5
THROUGHPUT_BIN_S = 0.5
LEADER_FAULTS = ("kill_leader", "pause_leader", "isolate_leader", "split_majority")
ROLE_COLORS = {"leader": "#d62728", "follower": "#1f77b4", "candidate": "#ff7f0e",
               "prospective": "#ffbb78", "unattached": "#9e9e9e", "observer": "#17becf", "resigned": "#8c564b"}
DOWN_COLOR = "#222222"


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return round(s[k], 1)


def failovers(drill) -> list[dict]:
    """For each fault that took the leader away: ms from the fault to the first ack in a newer epoch."""
    out = []
    acks = sorted(drill.history.acks, key=lambda a: a.ts)
    for f in drill.faults:
        if f.kind not in LEADER_FAULTS or f.epoch_before is None:
            continue
        nxt = next((a for a in acks if a.ts > f.ts_start and a.epoch > f.epoch_before), None)
        out.append({"kind": f.kind, "node": f.node, "ts": f.ts_start,
                    "next_commit_ts": nxt.ts if nxt else None,
                    "failover_ms": round((nxt.ts - f.ts_start) * 1000, 1) if nxt else None,
                    "new_epoch": nxt.epoch if nxt else None})
    return out


def unavailability(drill, t_start: float, t_end: float) -> list[tuple[float, float]]:
    ts = sorted(a.ts for a in drill.history.acks)
    windows, prev = [], None
    for t in ts:
        if prev is not None and t - prev > UNAVAILABLE_GAP_S:
            windows.append((prev, t))
        prev = t
    if prev is not None and t_end - prev > UNAVAILABLE_GAP_S:
        windows.append((prev, t_end))
    return windows


def build_report(drill, out: dict) -> dict:
    res = out["result"]
    fo = failovers(drill)
    fo_ms = [f["failover_ms"] for f in fo if f["failover_ms"] is not None]
    t_end = max([s.ts for s in drill.samples] + [drill.t0])
    windows = unavailability(drill, drill.t0, t_end)
    lost = sum(len(b.evidence) for b in res.breaches if b.kind in ("lost_write", "moved_write"))
    dup = sum(len(b.evidence) for b in res.breaches if b.kind == "duplicated_write")
    kinds = Counter(f.kind for f in drill.faults)
    restarts = sum(v for k, v in kinds.items() if k in ("kill_leader", "kill_follower", "kill_observer",
                                                          "term_restart", "wipe_follower"))
    wipes = []
    for f in drill.faults:
        if f.kind == "wipe_follower":
            later = [s for s in drill.samples if s.node == f.node and s.ts > f.ts_end and s.role]
            wipes.append({"node": f.node, "ts": f.ts_start,
                          "rejoined": bool(later),
                          "snapshot_seen": any(s.snapshots > 0 for s in later),
                          "log_start_after": max((s.log_start or 0 for s in later), default=None)})
    return {
        "ok": res.ok and not out["problems"],
        "seed": drill.seed,
        "duration_s": round(t_end - drill.t0, 1),
        "summary": {
            "writes_acknowledged": len(drill.history.acks),
            "writes_attempted": len(drill.history.attempted),
            "write_errors": drill.write_errors,
            "writes_lost": lost,
            "writes_duplicated": dup,
            "faults": len(drill.faults),
            "kill_restart_cycles": restarts,
            "faults_by_kind": dict(kinds),
            "failover_ms_p50": _pct(fo_ms, 50),
            "failover_ms_p99": _pct(fo_ms, 99),
            "failover_ms_max": max(fo_ms) if fo_ms else None,
            "unavailable_s_total": round(sum(b - a for a, b in windows), 2),
            "records_consumed": len(drill.history.seen),
            "truncations_told": len(drill.history.truncations),
            "consumer_resets": len(drill.history.resets),
            "writes_unverifiable": res.stats.get("unverifiable"),
            "committed_end": out["commit_end"],
        },
        "checker": res.to_json(),
        "problems": out["problems"],
        "converged": out["converged"],
        "replicas": out["replicas"],
        "archive": out.get("archive"),
        "faults": [{"kind": f.kind, "node": f.node, "t_s": round(f.ts_start - drill.t0, 3),
                    "held_s": round((f.ts_end or f.ts_start) - f.ts_start, 3), "leader_before": f.leader_before,
                    "epoch_before": f.epoch_before, **f.detail} for f in drill.faults],
        "failovers": [{**f, "t_s": round(f["ts"] - drill.t0, 3)} for f in fo],
        "unavailable_windows_s": [[round(a - drill.t0, 3), round(b - drill.t0, 3)] for a, b in windows],
        "wipes": wipes,
        "proxy": {"dropped_bytes": drill.proxy.dropped_bytes if drill.proxy else 0,
                  "forwarded_bytes": drill.proxy.forwarded_bytes if drill.proxy else 0},
    }


def write_report(report: dict, drill, path: str) -> dict:
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    json_path, png_path = path + ".json", path + ".png"
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2, default=str)
    render_png(report, drill, png_path)
    return {"json": json_path, "png": png_path}


def _role_segments(samples, node, t0):
    """[(start, end, role or None, epoch)] for one node from its samples."""
    segs = []
    pts = sorted((s for s in samples if s.node == node), key=lambda s: s.ts)
    for a, b in zip(pts, pts[1:] + [None]):
        end = b.ts if b else a.ts + 0.1
        key = (a.role, a.epoch if a.role else None)
        if segs and (segs[-1][2], segs[-1][3]) == key and abs(segs[-1][1] - (a.ts - t0)) < 1.0:
            segs[-1][1] = end - t0
        else:
            segs.append([a.ts - t0, end - t0, a.role, a.epoch if a.role else None])
    return segs


def render_png(report: dict, drill, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = drill.t0
    nodes = sorted(drill.cluster.nodes)
    voters = {n for n, s in drill.cluster.nodes.items() if s.voter}
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(15, 9), sharex=True,
                                        gridspec_kw={"height_ratios": [2.2, 1.2, 1.6]})
    s = report["summary"]
    status = "CLEAN" if report["ok"] else "FAILED"
    fig.suptitle(f"metalog drill (seed {report['seed']}): {status} -- {s['writes_acknowledged']} writes acked, "
                 f"{s['writes_lost']} lost, {s['faults']} faults, failover p50 {s['failover_ms_p50']} ms "
                 f"/ p99 {s['failover_ms_p99']} ms", fontsize=12, fontweight="bold",
                 color="#2ca02c" if report["ok"] else "#d62728")

    # 1. roles per broker
    for i, n in enumerate(nodes):
        for start, end, role, epoch in _role_segments(drill.samples, n, t0):
            color = ROLE_COLORS.get(role or "", "#bbbbbb") if role else DOWN_COLOR
            ax1.broken_barh([(start, max(end - start, 0.05))], (i - 0.35, 0.7), facecolors=color,
                            hatch=None if role else "////", edgecolor="none")
            if role == "leader" and end - start > 1.2:
                ax1.text((start + end) / 2, i, f"e{epoch}", ha="center", va="center", fontsize=8, color="white",
                         fontweight="bold")
    ax1.set_yticks(range(len(nodes)), [f"node {n}" + ("" if n in voters else " (obs)") for n in nodes])
    ax1.set_ylim(len(nodes) - 0.5, -1.5)  # room above lane 0 for the fault labels
    for j, f in enumerate(report["faults"]):
        ax1.axvline(f["t_s"], color="#555555", lw=0.8, ls="--")
        ax2.axvline(f["t_s"], color="#555555", lw=0.6, ls="--")
        ax3.axvline(f["t_s"], color="#555555", lw=0.6, ls="--")
        label = f["kind"].replace("_", " ") + (f" n{f['node']}" if f["node"] is not None else "")
        ax1.text(f["t_s"] + 0.05, -0.6 - 0.3 * (j % 3), label, rotation=0, fontsize=7, ha="left", va="center",
                 color="#333333", clip_on=True)
    legend = [Patch(facecolor=c, label=r) for r, c in ROLE_COLORS.items() if r != "prospective"]
    legend.append(Patch(facecolor=DOWN_COLOR, hatch="////", label="no answer (down / paused)"))
    ax1.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax1.set_title("role per broker (leader bars carry the epoch); dashed lines = faults", fontsize=9, loc="left")

    # 2. epoch per broker
    for n in nodes:
        pts = sorted((x for x in drill.samples if x.node == n and x.epoch is not None), key=lambda x: x.ts)
        if pts:
            ax2.step([p.ts - t0 for p in pts], [p.epoch for p in pts], where="post", label=f"node {n}", lw=1.2)
    ax2.set_ylabel("epoch")
    ax2.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)

    # 3. throughput, unavailability, failover
    acks = sorted(a.ts - t0 for a in drill.history.acks)
    if acks:
        end = max(acks[-1], report["duration_s"]) + THROUGHPUT_BIN_S
        nbins = max(1, int(end / THROUGHPUT_BIN_S) + 1)
        counts = [0] * nbins
        for t in acks:
            counts[min(int(t / THROUGHPUT_BIN_S), nbins - 1)] += 1
        xs = [k * THROUGHPUT_BIN_S for k in range(nbins)]
        ax3.fill_between(xs, [c / THROUGHPUT_BIN_S for c in counts], step="post", color="#2ca02c", alpha=0.6,
                         label="acknowledged writes/s")
    for a, b in report["unavailable_windows_s"]:
        ax3.axvspan(a, b, color="#d62728", alpha=0.15, lw=0)
    ymax = ax3.get_ylim()[1]
    for f in report["failovers"]:
        if f["failover_ms"] is not None:
            x0, x1 = f["t_s"], f["t_s"] + f["failover_ms"] / 1000
            ax3.annotate("", xy=(x1, ymax * 0.85), xytext=(x0, ymax * 0.85),
                         arrowprops=dict(arrowstyle="->", color="#d62728", lw=1.2))
            ax3.text(x0, ymax * 0.9, f"{f['failover_ms']:.0f} ms", fontsize=7, color="#d62728")
    ax3.set_ylabel("writes/s")
    ax3.set_xlabel("seconds since drill start")
    ax3.set_title("write throughput; red shading = no write acknowledged for > "
                  f"{UNAVAILABLE_GAP_S}s; arrows = leader loss -> next commit in a newer epoch",
                  fontsize=9, loc="left")
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
