"""The Spark job's picture report: PNG plots and one small HTML page.

* ``records_per_type.png``: committed records per record type over time
  (batch timestamps in buckets), from the ``history`` table, aggregated in
  Spark so only (bucket, type, count) rows reach the driver;
* ``replicas.png``: per replica its log range (start to end), the HW, how
  far it lags behind the HW, and the first offset where it differs from the
  majority (divergence), from the audit rows;
* ``report.html``: both pictures and the audit as a table.

matplotlib is in the [spark] extra; without it the job still succeeds and
says in one line that the plots were skipped.
"""

from __future__ import annotations

import html
import os

from metalog.tools.extras import PLOT_MODULES, missing

TIME_BUCKETS = 100
TYPES_PLOTTED_MAX = 12  # the rest are summed into "other"


def plots_unavailable() -> str | None:
    """None when matplotlib can be imported, else the one-line reason."""
    return missing(PLOT_MODULES, "spark")


def type_counts(hist_df) -> tuple[list[tuple[int, str, int]], int]:
    """(bucket start ms, record type, count) rows and the bucket width in ms."""
    from pyspark.sql import functions as f

    lo, hi = hist_df.agg(f.min("timestamp_ms"), f.max("timestamp_ms")).first()
    if lo is None:
        return [], 1
    width = max(1, -(-(hi - lo + 1) // TIME_BUCKETS))
    rows = (hist_df.groupBy(((f.col("timestamp_ms") - lo) / width).cast("long").alias("b"), "record_type")
            .count().collect())
    return sorted((lo + x["b"] * width, x["record_type"], x["count"]) for x in rows), width


def type_series(rows, width_ms: int) -> tuple[list[int], dict[str, list[int]]]:
    """Bucket starts from the first to the last bucket (empty ones included,
    so a line drops to 0 where nothing was committed instead of slanting
    across the gap) and per type (the TYPES_PLOTTED_MAX biggest, the rest as
    "other") its count in each bucket; types with no records are left out."""
    totals: dict[str, int] = {}
    for _b, t, n in rows:
        totals[t] = totals.get(t, 0) + n
    kept = [t for t, _ in sorted(totals.items(), key=lambda kv: (-kv[1], kv[0]))[:TYPES_PLOTTED_MAX]]
    if not rows:
        return [], {}
    first, last = min(b for b, _t, _n in rows), max(b for b, _t, _n in rows)
    buckets = list(range(first, last + 1, width_ms))
    series = {t: [0] * len(buckets) for t in kept + ["other"]}
    for b, t, n in rows:
        series[t if t in kept else "other"][(b - first) // width_ms] += n
    return buckets, {t: counts for t, counts in series.items() if any(counts)}


def _plot_types(rows, width_ms: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    buckets, series = type_series(rows, width_ms)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    colors = plt.get_cmap("tab20").colors  # 13 lines at most: no colour used twice
    t0 = buckets[0] if buckets else 0
    xs = [(b - t0) / 1000 for b in buckets]
    for i, (t, counts) in enumerate(series.items()):
        ax.plot(xs, counts, label=f"{t} ({sum(counts):,})", linewidth=1.2, color=colors[i % len(colors)])
    ax.set_xlabel(f"seconds since the first committed batch (buckets of {width_ms / 1000:g} s)")
    ax.set_ylabel("records per bucket")
    ax.set_title("Committed records per type over time")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def replica_labels(audit: list[dict]) -> list[str]:
    """One y-axis label per replica that tells them apart: the shortest path
    tail unique among the replicas (a cluster's dirs all end in "data"), with
    the node id from meta.properties."""
    paths = [a["replica"].rstrip("/") for a in audit]
    parts = [p.split("/") for p in paths]
    depth = 1
    while depth < max((len(x) for x in parts), default=1) and \
            len({"/".join(x[-depth:]) for x in parts}) < len(parts):
        depth += 1
    labels = []
    for a, x, p in zip(audit, parts, paths):
        tail = "/".join(x[-depth:]) or p
        labels.append(f"{tail} (node {a['node_id']})" if a.get("node_id") not in (None, "") else tail)
    return labels


def _plot_replicas(audit: list[dict], hw: int | None, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.6 * max(1, len(audit))))
    for i, a in enumerate(audit):
        start, end = a["log_start_offset"], a["log_end_offset"]
        if start is None or end is None:
            continue
        color = "tab:gray" if not a["in_vote"] else "tab:blue"
        ax.barh(i, end - start, left=start, color=color, height=0.5)
        if a["lag_records"]:
            ax.barh(i, a["lag_records"], left=end, color="tab:orange", height=0.5, alpha=0.6)
        label = f"end {end:,}" + (f", {a['lag_records']:,} behind the HW" if a["lag_records"] else "")
        if a["first_diff_offset"] is not None:
            ax.plot([a["first_diff_offset"]], [i], marker="x", color="tab:red", markersize=12, mew=3)
            label += f"; differs at {a['first_diff_offset']:,} ({a['category']})"
        ax.text(start, i + 0.32, label, fontsize=7)
    if hw is not None:
        ax.axvline(hw, color="black", linestyle="--", linewidth=1)
        ax.text(hw, len(audit) - 0.4, f" HW {hw:,}", fontsize=8)
    ax.set_yticks(range(len(audit)), replica_labels(audit), fontsize=8)
    ax.set_ylim(-0.6, len(audit) - 0.2)
    ax.set_xlabel("offset (blue: log, orange: lag behind the HW, red x: first difference, gray: excluded)")
    ax.set_title("Replicas: log range, lag and divergence")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(local_dir: str, hist_df, audit: list[dict], report: dict) -> list[str]:
    """Writes the PNGs and report.html into local_dir; returns the file names."""
    files = []
    title = f"metalog spark {report.get('command')}: {report.get('result', '')}"
    parts = [f"<!doctype html><meta charset='utf-8'><title>{html.escape(title)}</title>",
             f"<h1>{html.escape(title)}</h1>",
             f"<p>cluster {html.escape(str(report.get('cluster_id')))}, HW {report.get('hw')}, "
             f"majority agrees up to {report.get('majority_end_offset')}</p>"]
    failure = report.get("first_failure")
    if failure:
        parts.append(f"<p><b>first failing check</b>: {html.escape(str(failure.get('category')))}: "
                     f"{html.escape(str(failure.get('check')))} ({html.escape(str(failure.get('where')))})</p>")
    if hist_df is not None:
        rows, width = type_counts(hist_df)
        _plot_types(rows, width, os.path.join(local_dir, "records_per_type.png"))
        files.append("records_per_type.png")
        parts.append("<h2>Records per type over time</h2><img src='records_per_type.png'>")
    _plot_replicas(audit, report.get("hw"), os.path.join(local_dir, "replicas.png"))
    files.append("replicas.png")
    parts.append("<h2>Replicas</h2><img src='replicas.png'>")
    cols = ["replica", "node_id", "in_vote", "log_start_offset", "log_end_offset", "lag_records",
            "verdict", "first_diff_offset"]
    parts.append("<table border=1 cellspacing=0 cellpadding=3><tr>"
                 + "".join(f"<th>{c}</th>" for c in cols) + "</tr>")
    for a in audit:
        parts.append("<tr>" + "".join(f"<td>{html.escape(str(a[c]))}</td>" for c in cols) + "</tr>")
    parts.append("</table>")
    with open(os.path.join(local_dir, "report.html"), "w") as fh:
        fh.write("\n".join(parts) + "\n")
    files.append("report.html")
    return files
