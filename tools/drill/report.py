"""The drill report: ``<path>.json`` (every number) and ``<path>.png`` (the picture).

The PNG has three panels over one time axis (seconds since the drill began):

1. one lane per broker coloured by role (leader / follower / candidate /
   observer-or-unattached / no answer: down or paused), the leader's epoch
   written on its bars, and a labelled marker for every fault;
2. each broker's epoch over time;
3. acknowledged writes per second, unavailability windows (no ack for longer
   than ``UNAVAILABLE_GAP_S``) shaded, and for every fault that took the
   leader away the measured time to the next commit in a newer epoch.

A failover figure belongs to a fault that removed the leader: one of
``LEADER_FAULTS`` (killed, paused, isolated, left in a minority) after which a
newer epoch showed before the next fault began. A leader that rode its fault
out (a pause shorter than an election, an isolation its followers did not
notice) gets no figure, only ``leader_changed: false``: timed to whatever
later fault changed the leader, the figure would be that fault's, not its own.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections import Counter
from types import SimpleNamespace

from metalog.tools.drill import figures

UNAVAILABLE_GAP_S = 0.5
THROUGHPUT_BIN_S = 0.5
LEADER_FAULTS = ("kill_leader", "pause_leader", "isolate_leader", "split_majority", "kill_under_partition",
                 "pause_under_loss")
ROLE_COLORS = {"leader": "#d62728", "follower": "#1f77b4", "candidate": "#ff7f0e",
               "prospective": "#ffbb78", "unattached": "#9e9e9e", "observer": "#17becf", "resigned": "#8c564b"}
DOWN_COLOR = "#222222"
# Fault markers: a short code and a colour per kind, so ~200 faults in a long drill stay legible.
FAULT_STYLE = {
    "kill_leader": ("KL", "#d62728"), "kill_follower": ("KF", "#1f77b4"), "kill_observer": ("KO", "#17becf"),
    "term_restart": ("TR", "#9467bd"), "pause_leader": ("PL", "#8c564b"), "isolate_leader": ("IL", "#e377c2"),
    "cut_one_way": ("C1", "#7f7f7f"), "split_majority": ("SM", "#bcbd22"), "wipe_follower": ("WF", "#ff7f0e"),
    "reconfigure": ("RC", "#2ca02c"), "partition_snapshot": ("PS", "#aec7e8"),
    "kill_under_partition": ("KP", "#98df8a"), "pause_under_loss": ("PU", "#c49c94"), "wipe_under_cut": ("WC", "#f7b6d2"),
}
FULL_LABELS_MAX_FAULTS = 30  # beyond this, labels are the short codes
LABEL_ROWS = 4


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return round(s[k], 1)


def first_commit_ts(drill, after_ts: float, epoch_before: int) -> float | None:
    """When a leader of a newer epoch than `epoch_before` first committed
    (issue 15's failover end): the first /quorum sample of the first such
    leader whose HW passed the HW it had when it became leader (its broker.log
    role change). Accurate to one monitor poll."""
    ev = next((r for r in sorted(drill.history.roles, key=lambda r: r.ts)
               if r.ts > after_ts and r.role == "leader" and r.epoch > epoch_before and r.hw is not None), None)
    if ev is None:
        return None
    s = next((s for s in sorted(drill.samples, key=lambda s: s.ts)
              if s.node == ev.node and s.ts >= ev.ts and s.role == "leader" and s.epoch == ev.epoch
              and s.hw is not None and s.hw > ev.hw), None)
    return s.ts if s else None


def newer_epoch_ts(drill, after_ts: float, before_ts: float, epoch_before: int) -> float | None:
    """When an epoch newer than `epoch_before` first showed in (after_ts,
    before_ts): a broker's /quorum sample, a role change in its broker.log, or
    a write acknowledged in it. None: the leader of `epoch_before` kept its job."""
    seen = [s.ts for s in drill.samples if s.epoch is not None and s.epoch > epoch_before]
    seen += [r.ts for r in drill.history.roles if r.epoch > epoch_before]
    seen += [a.ts for a in drill.history.acks if a.epoch > epoch_before]
    return min((ts for ts in seen if after_ts < ts < before_ts), default=None)


def failovers(drill) -> list[dict]:
    """For each leader fault: did it remove the leader (a newer epoch before
    the next fault began), and if so ms from the fault to the first ack in a
    newer epoch (what a writer sees, client rediscovery included) and to the
    new leader's first commit, both before the next fault began."""
    out = []
    acks = sorted(drill.history.acks, key=lambda a: a.ts)
    faults = sorted(drill.faults, key=lambda f: f.ts_start)
    for i, f in enumerate(faults):
        if f.kind not in LEADER_FAULTS or f.epoch_before is None:
            continue
        window_end = faults[i + 1].ts_start if i + 1 < len(faults) else math.inf
        changed = newer_epoch_ts(drill, f.ts_start, window_end, f.epoch_before) is not None
        nxt = next((a for a in acks if f.ts_start < a.ts < window_end and a.epoch > f.epoch_before), None)
        commit = first_commit_ts(drill, f.ts_start, f.epoch_before)
        if not changed:
            nxt = commit = None
        if commit is not None and commit >= window_end:
            commit = None
        out.append({"kind": f.kind, "node": f.node, "ts": f.ts_start, "leader_changed": changed,
                    "next_commit_ts": nxt.ts if nxt else None,
                    "failover_ms": round((nxt.ts - f.ts_start) * 1000, 1) if nxt else None,
                    "leader_commit_ms": round((commit - f.ts_start) * 1000, 1) if commit else None,
                    "new_epoch": nxt.epoch if nxt else None})
    return out


def failover_by_kind(fo: list[dict]) -> dict[str, dict]:
    """Per leader fault kind: how many faults, after how many the leader did
    not change (``leader_kept``: no figure), and p50 / p99 / max of the
    failover of the others (ms from the fault to the first ack in a newer
    epoch, and to the new leader's first commit: ``commit_*``). pause_leader is
    the silent case (a frozen process: no reset, its followers must time out)."""
    out = {}
    for kind in sorted({f["kind"] for f in fo}):
        mine = [f for f in fo if f["kind"] == kind]
        ms = [f["failover_ms"] for f in mine if f["failover_ms"] is not None]
        cm = [f["leader_commit_ms"] for f in mine if f.get("leader_commit_ms") is not None]
        out[kind] = {"faults": len(mine), "leader_kept": sum(1 for f in mine if f.get("leader_changed") is False),
                     "n": len(ms), "p50": _pct(ms, 50), "p99": _pct(ms, 99), "max": max(ms) if ms else None,
                     "commit_n": len(cm), "commit_p50": _pct(cm, 50), "commit_p99": _pct(cm, 99),
                     "commit_max": max(cm) if cm else None}
    return out


def failover_lines(by_kind: dict[str, dict]) -> list[str]:
    """The drill's failover lines, one per leader fault kind: the figures of
    the faults that removed the leader, and how many did not."""
    lines = []
    for kind, k in by_kind.items():
        kept = k.get("leader_kept", 0)
        if kept == k.get("faults", k["n"]) and kept:
            lines.append(f"after {kind}: the leader did not change (no newer epoch before the next fault) after "
                         f"any of its {kept} fault(s): no failover figure")
            continue
        line = (f"failover after {kind} (to the first write acknowledged in a newer epoch): n={k['n']} "
                f"p50 {k['p50']} ms, p99 {k['p99']} ms, max {k['max']} ms; to the new leader's first commit: "
                f"n={k['commit_n']} p50 {k['commit_p50']} ms, p99 {k['commit_p99']} ms, max {k['commit_max']} ms")
        if kept:
            line += f"; the leader did not change after {kept} of its {k['faults']} fault(s) (no figure for those)"
        lines.append(line)
    return lines


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
                                                          "term_restart", "wipe_follower",
                                                          "partition_snapshot", "kill_under_partition",
                                                          "wipe_under_cut"))
    wipes = []
    for f in drill.faults:
        if f.kind == "wipe_follower":
            later = [s for s in drill.samples if s.node == f.node and s.ts > f.ts_end and s.role]
            # Rejoined by snapshot: the wiped node installed the leader's snapshot (its
            # broker.log says so), not merely took one of its own after re-replicating from 0.
            installs = [line for line in drill.cluster.read_log_lines(f.node)
                        if line.get("event") == "snapshot_installed" and float(line.get("ts", 0)) > f.ts_start]
            wipes.append({"node": f.node, "ts": f.ts_start,
                          "rejoined": bool(later),
                          "snapshot_seen": any(s.snapshots > 0 for s in later),
                          "snapshot_installed": bool(installs),
                          "log_start_after": max((s.log_start or 0 for s in later), default=None),
                          "voters_caught_up_before": f.detail.get("voters_caught_up_before"),
                          "caught_up_after": f.detail.get("wiped_caught_up")})
    porcupine = out.get("porcupine")
    rows = figures.per_fault(drill, res, fo, t_end, out["commit_end"])
    checkers = {"ours": res.ok, "porcupine": porcupine.ok if porcupine is not None else None}
    return {
        "ok": res.ok and not out["problems"] and (porcupine is None or porcupine.ok),
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
            "network": getattr(drill, "network", None),
            "faults_verified": sum(1 for f in drill.faults if f.detail.get("took_effect")),
            # held back until their targets could show the effect (a broker still booting)
            "faults_delayed": sum(1 for f in drill.faults if "delayed_s" in f.detail),
            "failover_ms_p50": _pct(fo_ms, 50),
            "failover_ms_p99": _pct(fo_ms, 99),
            "failover_ms_max": max(fo_ms) if fo_ms else None,
            "failover_by_kind": failover_by_kind(fo),
            "fault_kinds": figures.by_kind(rows, checkers),
            "unavailable_s_total": round(sum(b - a for a, b in windows), 2),
            "records_consumed": len(drill.history.seen),
            "truncations_told": len(drill.history.truncations),
            "consumer_resets": len(drill.history.resets),
            "writes_unverifiable": res.stats.get("unverifiable"),
            "committed_end": out["commit_end"],
        },
        "checker": res.to_json(),
        "porcupine": porcupine.to_json() if porcupine is not None else None,
        "problems": out["problems"],
        "converged": out["converged"],
        "replicas": out["replicas"],
        "archive": out.get("archive"),
        "faults": [{"kind": f.kind, "node": f.node, "t_s": round(f.ts_start - drill.t0, 3),
                    "held_s": round((f.ts_end or f.ts_start) - f.ts_start, 3), "leader_before": f.leader_before,
                    "epoch_before": f.epoch_before, **f.detail} for f in drill.faults],
        "failovers": [{**f, "t_s": round(f["ts"] - drill.t0, 3)} for f in fo],
        "fault_windows": rows,
        "unavailable_windows_s": [[round(a - drill.t0, 3), round(b - drill.t0, 3)] for a, b in windows],
        "wipes": wipes,
        "consumer_resets": [{"consumer": r.consumer, "t_s": round(r.ts - drill.t0, 3), "from_offset": r.from_offset,
                             "to_offset": r.to_offset} for r in drill.history.resets],
        "proxy": {"dropped_bytes": drill.proxy.dropped_bytes if drill.proxy else 0,
                  "forwarded_bytes": drill.proxy.forwarded_bytes if drill.proxy else 0},
    }


def write_report(report: dict, drill, path: str) -> dict:
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    json_path, png_path, timeline_path = path + ".json", path + ".png", path + ".timeline.json"
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2, default=str)
    with open(timeline_path, "w") as f:
        json.dump(timeline(drill), f)
    render_png(report, drill, png_path)
    return {"json": json_path, "png": png_path, "timeline": timeline_path}


def timeline(drill) -> dict:
    """What the picture is drawn from, so it can be redrawn without rerunning the drill."""
    return {"t0": drill.t0, "voters": {str(n): s.voter for n, s in drill.cluster.nodes.items()},
            "samples": [[s.ts, s.node, s.role, s.epoch] for s in drill.samples],
            "acks": [[a.ts, a.epoch] for a in drill.history.acks]}


def load_timeline(path: str) -> SimpleNamespace:
    """A drill-shaped object from ``timeline()``'s file, enough for ``render_png``."""
    with open(path) as f:
        t = json.load(f)
    return SimpleNamespace(
        t0=t["t0"],
        cluster=SimpleNamespace(nodes={int(n): SimpleNamespace(voter=v) for n, v in t["voters"].items()}),
        samples=[SimpleNamespace(ts=ts, node=n, role=r, epoch=e) for ts, n, r, e in t["samples"]],
        history=SimpleNamespace(acks=[SimpleNamespace(ts=ts, epoch=e) for ts, e in t["acks"]]))


def rerender(path: str) -> str:
    """Redraw ``<path>.png`` from ``<path>.json`` and ``<path>.timeline.json``."""
    with open(path + ".json") as f:
        report = json.load(f)
    render_png(report, load_timeline(path + ".timeline.json"), path + ".png")
    return path + ".png"


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


def layout_labels(xs: list[float], widths: list[float], rows: int) -> list[int | None]:
    """Row for each label (x sorted ascending) so no two labels in a row overlap; None: no room."""
    assert len(xs) == len(widths) and rows >= 1
    ends = [float("-inf")] * rows
    out: list[int | None] = []
    for x, w in zip(xs, widths):
        row = next((r for r in range(rows) if ends[r] <= x), None)
        if row is not None:
            ends[row] = x + w
        out.append(row)
    return out


def render_png(report: dict, drill, path: str) -> None:
    # matplotlib is imported here, not at the top: it costs ~0.5 s, and every
    # `metalog` command imports this module (through the drill's subcommand).
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    t0 = drill.t0
    nodes = sorted(drill.cluster.nodes)
    voters = {n for n, s in drill.cluster.nodes.items() if s.voter}
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(16, 9.5), sharex=True,
                                        gridspec_kw={"height_ratios": [2.2, 1.2, 1.6]})
    s = report["summary"]
    status = "CLEAN" if report["ok"] else "FAILED"
    fig.suptitle(f"metalog drill (seed {report['seed']}): {status} -- {s['writes_acknowledged']} writes acked, "
                 f"{s['writes_lost']} lost, {s['writes_duplicated']} duplicated, {s.get('writes_unverifiable')} unverifiable, "
                 f"{s['faults']} faults, failover p50 {s['failover_ms_p50']} ms "
                 f"/ p99 {s['failover_ms_p99']} ms", fontsize=12, fontweight="bold",
                 color="#2ca02c" if report["ok"] else "#d62728")

    faults = sorted(report["faults"], key=lambda f: f["t_s"])
    # Text width in seconds: ~0.75 em per character of bold 7 pt text, on the axis' width in points.
    span_s = max((report["duration_s"] or 1.0), faults[-1]["t_s"] if faults else 1.0) * 1.05
    axis_pt = ax1.get_position().width * fig.get_figwidth() * 72
    char_s = span_s * 7 * 0.75 / axis_pt

    # 1. roles per broker
    for i, n in enumerate(nodes):
        for start, end, role, epoch in _role_segments(drill.samples, n, t0):
            color = ROLE_COLORS.get(role or "", "#bbbbbb") if role else DOWN_COLOR
            ax1.broken_barh([(start, max(end - start, 0.05))], (i - 0.35, 0.7), facecolors=color,
                            hatch=None if role else "////", edgecolor="none")
            label = f"e{epoch}"
            if role == "leader" and end - start > (len(label) + 2) * char_s * 8 / 7:  # only where it fits
                ax1.text((start + end) / 2, i, label, ha="center", va="center", fontsize=8, color="white",
                         fontweight="bold")
    ax1.set_yticks(range(len(nodes)), [f"node {n}" + ("" if n in voters else " (obs)") for n in nodes])
    full = len(faults) <= FULL_LABELS_MAX_FAULTS
    labels = []
    for f in faults:
        code, color = FAULT_STYLE.get(f["kind"], (f["kind"], "#555555"))
        text = f["kind"].replace("_", " ") if full else code
        labels.append((text + (f" n{f['node']}" if f["node"] is not None else ""), color))
        ax1.axvline(f["t_s"], color=color, lw=0.8, ls="--", alpha=0.8 if full else 0.45)
        for ax in (ax2, ax3):
            ax.axvline(f["t_s"], color=color, lw=0.5, ls="--", alpha=0.35)
    rows = layout_labels([f["t_s"] for f in faults], [(len(t) + 1) * char_s for t, _c in labels], LABEL_ROWS)
    for f, (text, color), row in zip(faults, labels, rows):
        if row is not None:
            ax1.text(f["t_s"] + char_s * 0.3, -0.6 - 0.28 * row, text, fontsize=7, ha="left", va="center",
                     color=color, fontweight="bold", clip_on=True)
    ax1.set_ylim(len(nodes) - 0.5, -0.75 - 0.28 * LABEL_ROWS)  # room above lane 0 for the fault labels
    legend = [Patch(facecolor=c, label=r) for r, c in ROLE_COLORS.items() if r != "prospective"]
    legend.append(Patch(facecolor=DOWN_COLOR, hatch="////", label="no answer (down / paused)"))
    kinds = {f["kind"] for f in faults}
    legend += [Line2D([0], [0], color=c, ls="--", label=f"{code} {k.replace('_', ' ')}")
               for k, (code, c) in FAULT_STYLE.items() if k in kinds]
    ax1.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.05), fontsize=7, frameon=False)
    ax1.set_title("role per broker (leader bars carry the epoch); dashed lines = faults, coloured by kind"
                  + ("" if full else " (labels that do not fit are left out)"), fontsize=9, loc="left")

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
            if full:  # a long drill has too many to label; the arrows and the p50/p99 say enough
                ax3.text(x0, ymax * 0.9, f"{f['failover_ms']:.0f} ms", fontsize=7, color="#d62728")
    ax3.set_ylabel("writes/s")
    ax3.set_xlabel("seconds since drill start")
    ax3.set_title("write throughput; red shading = no write acknowledged for > "
                  f"{UNAVAILABLE_GAP_S}s; arrows = leader loss -> next commit in a newer epoch",
                  fontsize=9, loc="left")
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":  # python -m metalog.tools.drill.report REPORT: redraw REPORT.png
    if len(sys.argv) != 2:
        sys.exit("usage: python -m metalog.tools.drill.report REPORT  (redraws REPORT.png from REPORT.json "
                 "and REPORT.timeline.json)")
    print(rerender(sys.argv[1]))
