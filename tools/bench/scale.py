"""``metalog bench --scale``: issue 19's scale goals in one command, and the
figures table in docs/bench.md.

Runs, at ``--scale-partitions`` (default 2,000,000, the issue's headline):

* ``metalog.tools.bench.snapshot`` in a fresh process (items 1 and 4 in-process:
  full log replay records/s, snapshot write and load, replay/load ratio,
  one-topic and one-broker read cost as view + JSON);
* ``metalog.tools.bench.catchup`` (real brokers over TLS: the voters' snapshot load
  time and RSS holding the state (item 1), commit p99 during snapshot
  generation vs idle (item 2), a new observer's catch-up by FetchSnapshot vs
  by log with its memory while downloading (item 3), admin API reads (item 4));

then replaces the section between ``SECTION_BEGIN`` and ``SECTION_END`` of
the docs file (appended at the end if the file has none) with one table row
per goal: the goal, the figure, pass or fail.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from metalog.storage.atomic import atomic_write
from metalog.tools.bench import catchup
from metalog.tools.cluster.launcher import REPO_ROOT

SECTION_BEGIN = "<!-- scale:begin -->"
SECTION_END = "<!-- scale:end -->"
DEFAULT_PARTITIONS = 2_000_000
DEFAULT_DOCS = os.path.join(REPO_ROOT, "docs", "bench.md")
DEFAULT_NOTE = ("measured once, on the shared 2-core machine while other jobs ran (loaded, not quiet): "
                "the figures are pessimistic")


@dataclass(frozen=True)
class Row:
    item: str  # the item number
    goal: str
    figure: str
    passed: bool | None  # None: printed, no pass/fail goal


class SectionError(ValueError):
    """The docs file's markers are not one begin followed by one end."""


# ------------------------------------------------------------------ rows
def _fmt(x, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}"


def rows_from(snap: dict, rep: dict) -> list[Row]:
    """One Row per goal from metalog.tools.bench.snapshot's JSON figures and
    metalog.tools.bench.catchup's report. A figure that is missing fails its goal
    (passed None only for rows that print a figure without a goal)."""
    rows: list[Row] = []
    cu = rep.get("catchup", {})
    by_snap, by_log = cu.get("by_snapshot", {}), cu.get("by_log", {})
    voters = by_snap.get("voters", {})
    loads = [v["snapshot_load_seconds"] for v in voters.values() if v.get("snapshot_load_seconds") is not None]
    rss = [v["rss_mib"] for v in voters.values() if v.get("rss_mib")]

    load_s = max(loads) if loads else None
    fresh = snap.get("fresh_load") or {}
    fresh_s = fresh.get("seconds")
    rows.append(Row("1", "snapshot load <= 2 s (a broker's boot: a fresh process)",
                    f"{_fmt(fresh_s)} s ({_fmt(fresh.get('cpu_seconds'))} s CPU); 3 voters booting at once on "
                    f"the same cores: slowest {_fmt(load_s)} s; in the bench process after its replay: "
                    f"{_fmt(snap.get('load_seconds'))} s", fresh_s is not None and fresh_s <= 2.0))
    replay_s = snap.get("replay_seconds")
    ratio = replay_s / fresh_s if replay_s and fresh_s else None
    rows.append(Row("1", "load >= 5x faster than replay (same run)",
                    f"{_fmt(ratio, 1)}x (replay {_fmt(replay_s)} s, fresh-process load {_fmt(fresh_s)} s; "
                    f"in the bench process {_fmt(snap.get('replay_over_load'), 1)}x)",
                    ratio is not None and ratio >= 5.0))
    top = max(rss) if rss else None
    rows.append(Row("1", "a broker holding the state in <= 512 MiB RSS (largest voter)",
                    f"{_fmt(top, 0)} MiB (a process that only loaded the snapshot: "
                    f"{_fmt(fresh.get('rss_mib'), 0)} MiB)", top is not None and top <= 512))
    rate = snap.get("replay_records_per_s")
    rows.append(Row("1", "replay >= 400k records/s", f"{_fmt(rate, 0)} records/s",
                    rate is not None and rate >= 400_000))

    k = rep.get("commit")
    if k:
        idle, during = k["idle"], k["during_snapshot"]
        rows.append(Row("2", "commit p99 during snapshot generation <= 2x idle (1 client)",
                        f"{_fmt(k.get('p99_ratio'))}x: idle p50 {idle['p50_ms']} / p99 {idle['p99_ms']} ms "
                        f"({idle['samples']} commits), during p50 {during['p50_ms']} / p99 {during['p99_ms']} ms "
                        f"({during['samples']} commits, {k['generation_window_seconds']} s)"
                        + (f"; generation {k['snapshot_write_seconds']} s by {k['snapshot_path']}"
                           if k.get("snapshot_path") else ""),
                        k.get("p99_ratio") is not None and k["p99_ratio"] <= 2.0))
    else:
        rows.append(Row("2", "commit p99 during snapshot generation <= 2x idle (1 client)", "not run", False))

    if by_snap:
        rows.append(Row("3", "catch-up by snapshot: time and MB/s printed",
                        f"{by_snap['catchup_seconds']} s from boot to the HW; {by_snap.get('snapshot_bytes', 0) / 1e6:.1f} MB "
                        f"at {by_snap.get('download_mb_per_s')} MB/s, install "
                        + ("(loaded while downloading; checks) " if by_snap.get("loaded_while_downloading")
                           else "(verify + load) ")
                        + f"{by_snap.get('install_seconds')} s", None))
        speed = cu.get("snapshot_speedup")
        rows.append(Row("3", "catch-up by snapshot >= 5x faster than by log",
                        f"{_fmt(speed)}x (by log {by_log.get('catchup_seconds')} s)",
                        speed is not None and speed >= 5.0))
        bounded = by_snap.get("download_memory_bounded")
        rows.append(Row("3", "memory bounded while downloading (chunks stream to disk)",
                        f"RSS {by_snap.get('download_rss_start_mib')} -> {by_snap.get('download_rss_peak_mib')} MiB "
                        f"while downloading and loading (bound +{by_snap.get('download_rss_bound_mib')} MiB: the "
                        f"loaded state's {by_snap.get('download_state_growth_mib')} MiB + buffers); peak "
                        f"{by_snap.get('observer_peak_rss_mib')} MiB once loaded ({by_snap.get('peak_rss_over_log_variant_mib')} "
                        f"MiB more than catching up by log)", bounded is True))

    reads = snap.get("reads", {})
    admin = by_snap.get("admin_reads", {})
    for what, label in (("topic", "one topic (configs + up to 1000 partitions)"), ("broker", "one broker")):
        api = admin.get(what, {})
        view = reads.get(label, {})
        worst = max([x for x in (api.get("p99_ms"), view.get("p99_ms")) if x is not None], default=None)
        rows.append(Row("4", f"a query for {what} answers in <= 5 ms (p99)",
                        f"admin API over TLS p50 {api.get('p50_ms', 'n/a')} / p99 {api.get('p99_ms', 'n/a')} ms; "
                        f"view + JSON p99 {_fmt(view.get('p99_ms'), 3)} ms",
                        worst is not None and worst <= 5.0))
    for what in ("topics page", "partitions page"):  # listings page: a page of 100 answers as fast
        api = admin.get(what)
        if api:
            rows.append(Row("4", f"a {what.replace(' page', '')} listing pages; a page of 100 answers in <= 5 ms (p99)",
                            f"admin API over TLS p50 {api.get('p50_ms', 'n/a')} / p99 {api.get('p99_ms', 'n/a')} ms",
                            api.get("p99_ms") is not None and api["p99_ms"] <= 5.0))
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_section(rows: list[Row], title: str, note: str) -> str:
    """The marked section: a heading, what was run and where, one row per goal."""
    verdict = {True: "pass", False: "**fail**", None: "printed"}
    out = [SECTION_BEGIN, f"## {title}", "", _cell(note), "",
           "| Item | Goal | Figure | Result |", "|---|---|---|---|"]
    out += [f"| {r.item} | {_cell(r.goal)} | {_cell(r.figure)} | {verdict[r.passed]} |" for r in rows]
    out.append(SECTION_END)
    return "\n".join(out) + "\n"


def replace_section(text: str, section: str) -> str:
    """`text` with its marked section replaced by `section` (which carries its
    own markers), or with `section` appended after a blank line if it has
    none. SectionError if the markers are unbalanced or out of order: the
    file is then left alone rather than guessed at."""
    begins, ends = text.count(SECTION_BEGIN), text.count(SECTION_END)
    if begins == 0 and ends == 0:
        return text.rstrip("\n") + "\n\n" + section
    if begins != 1 or ends != 1:
        raise SectionError(f"expected one {SECTION_BEGIN} and one {SECTION_END}, found {begins} and {ends}")
    start = text.index(SECTION_BEGIN)
    end = text.index(SECTION_END)
    if end < start:
        raise SectionError(f"{SECTION_END} comes before {SECTION_BEGIN}")
    # The old section's own newline stays with the text after it.
    return text[:start] + section.rstrip("\n") + text[end + len(SECTION_END):]


def write_docs(path: str, section: str) -> None:
    with open(path) as f:
        text = f.read()
    atomic_write(path, replace_section(text, section).encode())


# ------------------------------------------------------------------ running it
def run_snapshot_bench(partitions: int, out_dir: str) -> dict:
    """metalog.tools.bench.snapshot in a fresh process at the same shape as the cluster
    benches; its JSON figures."""
    topics, brokers, records = catchup.sizes_for(partitions)
    path = os.path.join(out_dir, "snapshot-bench.json")
    cmd = [sys.executable, "-m", "metalog.tools.bench.snapshot", "--records", str(records), "--topics", str(topics),
           "--partitions", str(catchup.PARTITIONS_PER_TOPIC), "--brokers", str(brokers), "--json", path]
    env = dict(os.environ)
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1800)
    sys.stderr.write(proc.stdout)
    if proc.returncode != 0:
        raise RuntimeError(f"metalog.tools.bench.snapshot failed ({proc.returncode}): {proc.stderr[-2000:]}")
    with open(path) as f:
        return json.load(f)


def cmd_scale(args) -> int:
    partitions = args.scale_partitions or DEFAULT_PARTITIONS
    root = args.dir or tempfile.mkdtemp(prefix="metalog-bench-scale-")
    os.makedirs(root, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    catchup.progress(f"metalog.tools.bench.snapshot at {partitions:,} partitions")
    snap = run_snapshot_bench(partitions, root)
    rep = catchup.run(partitions, ["catchup", "commit"], root=os.path.join(root, "clusters"), keep=args.keep)
    rows = rows_from(snap, rep)
    w = rep["workload"]
    note = (f"`metalog bench --scale --scale-partitions {partitions}`, {started}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}: {w['partitions']:,} partitions ({w['topics']:,} topics x "
            f"{catchup.PARTITIONS_PER_TOPIC}), {w['brokers']} brokers, {w['records']:,} records; "
            f"{args.scale_note or DEFAULT_NOTE}.")
    section = render_section(rows, "Scale figures (issue 19, `metalog bench --scale`)", note)
    print(catchup.format_report(rep))
    print(section)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"snapshot": snap, "cluster": rep, "rows": [r.__dict__ for r in rows]}, f, indent=2)
    docs = DEFAULT_DOCS if args.scale_docs is None else args.scale_docs
    if docs:
        write_docs(docs, section)
        print(f"figures table written to {docs}")
    return 0
