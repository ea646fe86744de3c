"""Scale benchmarks on real processes (issue 19 items 2 and 3, and the broker
side of items 1 and 4).

    .venv/bin/python -m metalog.tools.bench.catchup [--partitions 200000] [--only catchup,commit]
    .venv/bin/metalog bench --only scale-catchup --scale-partitions 2000000

A 3-voter cluster (real brokers, mutual TLS as by default) holding a large
metadata state whose data dirs are written offline, through the storage APIs
(the log by ``metalog.tools.bench.snapshot.build_log``, the same log on every voter;
for the snapshot variant a controller snapshot at the log end, the log
emptied past it, as a leader that has snapshotted and cleaned):

* catch-up (item 3): a new observer starts with an empty dir. Measured: time
  until its applied offset reaches the leader's high watermark (from spawn
  and from its ``broker_started``), the snapshot's bytes and download MB/s,
  the observer's RSS while it downloads (must stay flat: chunks stream to a
  ``.part`` file) and its peak RSS (VmHWM) once the state is loaded. The same
  state with the whole log and no snapshot gives catch-up by log; the ratio
  is printed (goal: by snapshot at least 5x faster).
* commit (item 2): one client commits small records to the snapshot
  variant's cluster with ``snapshot_min_records`` set so that every voter
  writes a snapshot of the large state after a few seconds; commit latency
  p50/p99 while idle and while the snapshot is generated (from the moment the
  threshold is crossed to the leader's ``snapshot_created``), and the ratio
  (goal: p99 during at most 2x idle).
* on the way: every voter's snapshot load time (its ``snapshot_loaded``) and
  RSS holding the state (item 1), and the admin API's latency for one topic,
  one broker, a page of topics and a page of a topic's partitions at this
  size, over a kept-alive TLS connection (item 4).
* reads (item 4 alone, ``--only reads``): the snapshot variant's voters
  only, and the same admin reads on the leader.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from metalog.broker.client import MetalogClient
from metalog.broker.controller.state import Controller, write_controller_snapshot
from metalog.broker.server.recovery import PARTITION_DIR
from metalog.broker.server.logging_setup import configure_logging
from metalog.protocol.messages import SnapshotId
from metalog.storage import batch as b
from metalog.storage.segments import SegmentedLog
from metalog.storage.snapshot import PART_SUFFIX, SnapshotStore
from metalog.tools.bench.common import CLUSTER_ID, latency_summary_ms, metalog_cluster
from metalog.tools.bench.snapshot import build_log
from metalog.tools.cluster.launcher import LocalCluster

PARTITIONS_PER_TOPIC = 100
DEFAULT_PARTITIONS = 200_000  # about a minute for both sections here; 2,000,000 is the headline
BROKERS = 300
OBSERVER = 4
# Never snapshot on their own during catch-up: the snapshot variant's voters
# already have theirs, the log variant's must keep the whole log.
NO_SNAPSHOTS = 1 << 40
# The download may grow the observer's RSS by at most this much, or by a
# quarter of the snapshot if that is more: chunks are written to disk as they
# come, so the download itself should cost a chunk or two, not the snapshot.
DOWNLOAD_GROWTH_FLOOR_BYTES = 32 << 20
MIB = 1 << 20


# ------------------------------------------------------------------ the state, written offline
@dataclass
class Workload:
    """The metadata log every voter holds: n_records records, batch by batch."""
    partitions: int
    topics: int
    brokers: int
    records: int
    batches: list[bytes]
    log_bytes: int
    end_offset: int
    build_seconds: float
    state: Any = None  # ControllerState at end_offset (for the snapshot), built on demand

    def controller_state(self):
        if self.state is None:
            c = Controller()
            for batch in self.batches:
                c.apply_batches(batch)
            self.state = c.state
        return self.state


def sizes_for(partitions: int) -> tuple[int, int, int]:
    """(topics, brokers, records) for `partitions` partitions: the issue's
    headline shape (20,000 topics x 100 partitions, 300 brokers, 2.2M records
    at 2M partitions: every broker, topic and partition once, then ISR,
    leader and config changes for another ~9%)."""
    topics = max(1, partitions // PARTITIONS_PER_TOPIC)
    brokers = min(BROKERS, max(3, topics))
    records = brokers + topics + topics * PARTITIONS_PER_TOPIC
    return topics, brokers, records + records // 10


def split_batches(data: bytes) -> list[bytes]:
    """Cut a run of encoded RecordBatches into one bytes per batch."""
    out = []
    pos = 0
    n = len(data)
    while pos < n:
        length = b.LOG_OVERHEAD + int.from_bytes(data[pos + 8:pos + 12], "big")
        out.append(data[pos:pos + length])
        pos += length
    assert pos == n, f"the batches end at byte {pos}, the data at byte {n}"
    return out


def build_workload(partitions: int) -> Workload:
    topics, brokers, records = sizes_for(partitions)
    t0 = time.perf_counter()
    data, end = build_log(records, topics, PARTITIONS_PER_TOPIC, brokers)
    batches = split_batches(data)
    return Workload(partitions=topics * PARTITIONS_PER_TOPIC, topics=topics, brokers=brokers, records=records,
                    batches=batches, log_bytes=len(data), end_offset=end,
                    build_seconds=time.perf_counter() - t0)


def write_voter_dirs(cluster: LocalCluster, work: Workload, by_snapshot: bool) -> dict:
    """Format every voter (dynamic quorum, as `metalog cluster up` does), then
    write node 1's metadata partition through the storage APIs and copy it
    to the other voters: identical logs (and snapshot) on all three.

    by_snapshot: a snapshot at the log end (carrying the bootstrap voter set)
    and an empty log starting there. Else: the whole log from offset 0."""
    cluster.save_state()
    voters = sorted(n for n, spec in cluster.nodes.items() if spec.voter)
    for nid in voters:
        cluster.format_node(nid)
    part = os.path.join(cluster.data_dir(voters[0]), PARTITION_DIR)
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    log = SegmentedLog.open(part, verify_appends=False)
    try:
        if by_snapshot:
            store = SnapshotStore(part)
            res = write_controller_snapshot(store, work.controller_state(), SnapshotId(work.end_offset, 1),
                                            1_700_000_000_000, CLUSTER_ID, voters=store.bootstrap_voters())
            log.truncate_fully(work.end_offset)
            out["snapshot_bytes"] = res.size_bytes
            out["snapshot_records"] = res.records
        else:
            for batch in work.batches:
                log.append(batch)
            log.flush()
    finally:
        log.close()
    for nid in voters[1:]:
        dest = os.path.join(cluster.data_dir(nid), PARTITION_DIR)
        shutil.rmtree(dest)
        shutil.copytree(part, dest)
    out["write_seconds"] = round(time.perf_counter() - t0, 2)
    return out


# ------------------------------------------------------------------ process and log observations
def proc_status_bytes(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a process, in bytes; {} once it is gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":", 1)
                    out[key] = int(value.split()[0]) * 1024  # the kernel says kB
    except (FileNotFoundError, ProcessLookupError):
        return {}
    return out


def first_event(cluster: LocalCluster, node: int, event: str) -> dict | None:
    for line in cluster.read_log_lines(node):
        if line.get("event") == event:
            return line
    return None


def wait_event(cluster: LocalCluster, node: int, event: str, timeout_s: float, after_ts: float = 0.0) -> dict:
    """The node's first log line `event` stamped after `after_ts`."""
    found: list[dict] = []

    def seen() -> bool:
        found[:] = [ln for ln in cluster.read_log_lines(node)
                    if ln.get("event") == event and float(ln.get("ts", 0)) > after_ts]
        return bool(found)

    cluster.wait_for(seen, timeout_s, f"node {node} to log {event}", poll_s=0.1)
    return found[0]


class Sampler:
    """A thread sampling one process's RSS and the size of its snapshot
    download (.part files) every `interval_s`, until stopped."""

    def __init__(self, pid: int, part_dir: str, interval_s: float = 0.02):
        self.pid = pid
        self.part_glob = os.path.join(part_dir, "*" + PART_SUFFIX)
        self.interval_s = interval_s
        self.samples: list[tuple[float, int, int, int]] = []  # (wall ts, rss, hwm, part bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set() and len(self.samples) < 1_000_000:
            st = proc_status_bytes(self.pid)
            if not st:
                return
            part = 0
            for path in glob.glob(self.part_glob):
                try:
                    part += os.path.getsize(path)
                except FileNotFoundError:
                    pass
            self.samples.append((time.time(), st.get("VmRSS", 0), st.get("VmHWM", 0), part))
            self._stop.wait(self.interval_s)

    def download_rss(self, size: int) -> tuple[int, int] | None:
        """(RSS when the download began, highest RSS while it ran): samples
        with a .part file of fewer than `size` bytes (once it is whole, the
        install's check and load begin)."""
        during = [s for s in self.samples if 0 < s[3] < size]
        if not during:
            return None
        return during[0][1], max(s[1] for s in during)


def voter_rss_and_load(cluster: LocalCluster, voters: list[int]) -> dict:
    out = {}
    for nid in voters:
        proc = cluster.procs.get(nid)
        st = proc_status_bytes(proc.pid) if proc else {}
        loaded = first_event(cluster, nid, "snapshot_loaded")
        out[str(nid)] = {"rss_mib": round(st.get("VmRSS", 0) / MIB, 1),
                         "hwm_mib": round(st.get("VmHWM", 0) / MIB, 1),
                         "snapshot_load_seconds": None if loaded is None else loaded.get("seconds")}
    return out


ADMIN_READ_QUERIES = 500  # per case: p99 is then the 6th worst, not the 2nd


def admin_read_latency(cluster: LocalCluster, node: int, work: Workload, queries: int = ADMIN_READ_QUERIES) -> dict:
    """GET one topic (its 100 partitions and configs) / one broker / a page
    of 100 topics / a page of 100 of a topic's partitions from the admin API
    over a kept-alive TLS connection (LocalCluster.admin): the request, the
    view and its JSON, the HTTP round trip and the client's JSON decode;
    p50/p99 in ms."""
    import random

    rng = random.Random(3)
    out = {}
    cases = {"topic": lambda: f"/metadata/topics/topic-{rng.randrange(work.topics)}",
             "broker": lambda: f"/metadata/brokers/{rng.randrange(work.brokers)}",
             "topics page": lambda: f"/metadata/topics?limit=100&after=topic-{rng.randrange(work.topics)}",
             "partitions page": lambda: (f"/metadata/topics/topic-{rng.randrange(work.topics)}/partitions"
                                         f"?limit=100&after={rng.randrange(-1, PARTITIONS_PER_TOPIC // 2)}")}
    for name, path in cases.items():
        if cluster.admin(node, path(), timeout_s=10) is None:  # warm the connection, check it answers
            raise RuntimeError(f"admin API of node {node} did not answer GET {name}")
        lat_us = []
        for _ in range(queries):
            t0 = time.perf_counter()
            body = cluster.admin(node, path(), timeout_s=10)
            lat_us.append(int((time.perf_counter() - t0) * 1e6))
            if body is None:
                raise RuntimeError(f"admin API of node {node} failed a GET {name}")
        out[name] = latency_summary_ms(lat_us)
    return out


# ------------------------------------------------------------------ item 3: catch-up
def _boot_timeout_s(work: Workload) -> float:
    # Voters replaying 2.2M records each on 2 shared cores: about a minute.
    return 60.0 + work.records / 20_000


def catchup_once(root: str, work: Workload, by_snapshot: bool, with_reads: bool = False) -> dict:
    name = "snapshot" if by_snapshot else "log"
    cluster = metalog_cluster(os.path.join(root, f"catchup-{name}"), voters=3, observers=1,
                              snapshot_min_records=NO_SNAPSHOTS, log_level="info")
    voters = [1, 2, 3]
    gen = write_voter_dirs(cluster, work, by_snapshot)
    try:
        t0 = time.perf_counter()
        cluster.start(voters)
        leader, _ = cluster.wait_for_leader(timeout_s=_boot_timeout_s(work))
        # The leader's HW covers the generated state once its first record in
        # its own epoch is committed.
        cluster.wait_for(lambda: ((cluster.quorum(leader) or {}).get("high_watermark") or 0) > work.end_offset,
                         _boot_timeout_s(work), "the leader to commit past the generated state", poll_s=0.1)
        voters_up_s = time.perf_counter() - t0
        lq = cluster.quorum(leader)
        target = lq["high_watermark"]
        result: dict[str, Any] = {"by": name, **gen, "voters_up_seconds": round(voters_up_s, 2),
                                  "leader_log_start_offset": lq["log_start_offset"], "target_offset": target,
                                  "voters": voter_rss_and_load(cluster, voters)}
        if with_reads:
            result["admin_reads"] = admin_read_latency(cluster, leader, work)
        t_spawn = time.time()
        proc = cluster.start_node(OBSERVER)
        obs_part = os.path.join(cluster.data_dir(OBSERVER), PARTITION_DIR)
        with Sampler(proc.pid, obs_part) as sampler:
            cluster.wait_for(lambda: ((cluster.quorum(OBSERVER) or {}).get("applied_offset") or 0) >= target,
                             600, "the observer to apply up to the leader's high watermark", poll_s=0.02)
            t_done = time.time()
        final = proc_status_bytes(proc.pid)
        started = first_event(cluster, OBSERVER, "broker_started")
        installed = first_event(cluster, OBSERVER, "snapshot_installed")
    finally:
        cluster.stop()
    if by_snapshot and installed is None:
        raise RuntimeError("catch-up by snapshot finished without installing a snapshot")
    if not by_snapshot and installed is not None:
        raise RuntimeError("catch-up by log installed a snapshot: the voters were meant to keep the whole log")
    started_ts = float(started["ts"]) if started else t_spawn
    result.update({
        "wall_seconds_from_spawn": round(t_done - t_spawn, 3),
        "process_boot_seconds": round(started_ts - t_spawn, 3),
        "catchup_seconds": round(t_done - started_ts, 3),
        "observer_peak_rss_mib": round(final.get("VmHWM", 0) / MIB, 1),
        "observer_rss_mib": round(final.get("VmRSS", 0) / MIB, 1),
    })
    if installed is not None:
        size = int(installed["size"])
        # Download: from the broker being up to the install starting (the
        # install's own seconds are its checks, plus the load if it was not
        # made while downloading).
        download_s = float(installed["ts"]) - float(installed.get("seconds", 0)) - started_ts
        result.update({"snapshot_bytes": size, "download_seconds": round(download_s, 3),
                       "download_mb_per_s": round(size / 1e6 / download_s, 1) if download_s > 0 else None,
                       "install_seconds": installed.get("seconds"),
                       # the install's parts (brokers that log them): check + fsync, load
                       "install_check_seconds": installed.get("check_s"),
                       "install_load_seconds": installed.get("load_s"),
                       "loaded_while_downloading": installed.get("loaded_while_downloading")})
        rss = sampler.download_rss(size)
        if rss is not None:
            # The state is loaded as the chunks arrive: the download may grow
            # by what the caught-up observer holds, plus bounded buffers (a
            # whole snapshot held in memory would exceed it by its size).
            growth = rss[1] - rss[0]
            state_growth = max(0, final.get("VmRSS", 0) - rss[0])
            bound = state_growth + max(DOWNLOAD_GROWTH_FLOOR_BYTES, size // 4)
            result.update({"download_rss_start_mib": round(rss[0] / MIB, 1),
                           "download_rss_peak_mib": round(rss[1] / MIB, 1),
                           "download_rss_growth_mib": round(growth / MIB, 1),
                           "download_state_growth_mib": round(state_growth / MIB, 1),
                           "download_rss_bound_mib": round(bound / MIB, 1),
                           "download_memory_bounded": growth <= bound})
    return result


def bench_reads(root: str, work: Workload) -> dict:
    """Admin reads on the leader of the snapshot variant's voters (no observer)."""
    cluster = metalog_cluster(os.path.join(root, "reads"), voters=3, observers=0,
                              snapshot_min_records=NO_SNAPSHOTS, log_level="info")
    write_voter_dirs(cluster, work, by_snapshot=True)
    try:
        cluster.start([1, 2, 3])
        leader, _ = cluster.wait_for_leader(timeout_s=_boot_timeout_s(work))
        cluster.wait_for(lambda: ((cluster.quorum(leader) or {}).get("high_watermark") or 0) > work.end_offset,
                         _boot_timeout_s(work), "the leader to commit past the generated state", poll_s=0.1)
        return {"leader": leader, "admin_reads": admin_read_latency(cluster, leader, work)}
    finally:
        cluster.stop()


def bench_catchup(root: str, work: Workload) -> dict:
    by_snap = catchup_once(root, work, by_snapshot=True, with_reads=True)
    progress(f"catch-up by snapshot: {by_snap['catchup_seconds']} s, {by_snap.get('snapshot_bytes', 0) / 1e6:.1f} MB "
             f"at {by_snap.get('download_mb_per_s')} MB/s, observer peak RSS {by_snap['observer_peak_rss_mib']} MiB")
    by_log = catchup_once(root, work, by_snapshot=False)
    progress(f"catch-up by log: {by_log['catchup_seconds']} s")
    ratio = by_log["catchup_seconds"] / by_snap["catchup_seconds"] if by_snap["catchup_seconds"] > 0 else None
    # The same state held by the same process either way: what the snapshot
    # path costs at its peak beyond that (the install's buffers).
    by_snap["peak_rss_over_log_variant_mib"] = round(by_snap["observer_peak_rss_mib"] - by_log["observer_peak_rss_mib"], 1)
    return {"by_snapshot": by_snap, "by_log": by_log,
            "snapshot_speedup": None if ratio is None else round(ratio, 2)}


# ------------------------------------------------------------------ item 2: commit latency vs snapshot generation
async def _commit_loop(cluster: LocalCluster, stop_when, value_bytes: int, deadline_s: float) -> list:
    """One client committing one small record at a time until stop_when()
    (polled between commits, at most every 0.2 s) or deadline_s; returns
    [(sent wall ts, acked wall ts, base offset)]."""
    client = MetalogClient(cluster.bootstrap(), CLUSTER_ID, tls=cluster.client_tls(), request_timeout_ms=10000,
                           max_retries=20)
    await client.metadata()
    ops: list[tuple[float, float, int]] = []
    pad = b"c" * value_bytes
    t_end = time.monotonic() + deadline_s
    next_check = 0.0
    seq = 0
    try:
        while time.monotonic() < t_end and len(ops) < 2_000_000:
            seq += 1
            sent = time.time()
            base, _ = await client.produce([(f"commit-{seq}-".encode() + pad)[:value_bytes]])
            ops.append((sent, time.time(), base))
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + 0.2
                if await asyncio.to_thread(stop_when):
                    break
    finally:
        await client.close()
    return ops


def bench_commit_during_snapshot(root: str, work: Workload, threshold_records: int, warmup_records: int,
                                 value_bytes: int = 100, generation: str = "fork", after_s: float = 8.0) -> dict:
    """The snapshot variant's cluster with snapshot_min_records=threshold_records:
    the voters load their snapshot at boot (0 records since), then one client
    commits; after threshold_records applied records each voter copies and
    writes a snapshot of the whole state. Idle: commits acknowledged before
    the threshold (after warmup_records); during: acknowledged between the
    threshold and the leader's snapshot_created. After: for after_s once
    every voter's snapshot_created is logged (the same idle again: a control
    for the machine's own noise over the longer run), and only commits below
    the next snapshot's threshold (the first snapshot's end + threshold_records):
    with a threshold shorter than the generation's commits, the "after" phase
    was a second generation, not a control."""
    assert threshold_records > warmup_records + 100, "too few idle commits to measure"
    cluster = metalog_cluster(os.path.join(root, "commit"), voters=3, observers=0,
                              snapshot_min_records=threshold_records, snapshot_generation=generation,
                              log_level="info")
    voters = [1, 2, 3]
    write_voter_dirs(cluster, work, by_snapshot=True)
    try:
        cluster.start(voters)
        leader, _ = cluster.wait_for_leader(timeout_s=_boot_timeout_s(work))
        cluster.wait_for(lambda: ((cluster.quorum(leader) or {}).get("high_watermark") or 0) > work.end_offset,
                         _boot_timeout_s(work), "the leader to commit past the generated state", poll_s=0.1)
        base_end = work.end_offset
        t_start = time.time()
        leader_pid = cluster.procs[leader].pid
        rss_before = proc_status_bytes(leader_pid).get("VmRSS", 0)
        rss_seen = [rss_before]

        all_done: list[float] = []

        def snapshot_written() -> bool:
            # Polled every 0.2 s: also the leader's RSS (the copy-on-write
            # pages the broker copies while its snapshot child runs are its own).
            rss_seen.append(proc_status_bytes(leader_pid).get("VmRSS", 0))
            if not all_done:
                ts = [max((float(ln["ts"]) for ln in cluster.read_log_lines(v)
                           if ln.get("event") == "snapshot_created" and float(ln.get("ts", 0)) > t_start),
                          default=None) for v in voters]
                if all(t is not None for t in ts):
                    all_done.append(max(ts))
            return bool(all_done) and time.time() >= all_done[0] + after_s

        import uvloop

        ops = uvloop.run(_commit_loop(cluster, snapshot_written, value_bytes,
                                      deadline_s=120 + after_s + threshold_records / 100))
        created = wait_event(cluster, leader, "snapshot_created", 30, after_ts=t_start)
        first_ends = [wait_event(cluster, v, "snapshot_created", 30, after_ts=t_start)["snapshot"][0] for v in voters]
        still_leader = (cluster.quorum(leader) or {}).get("role") == "leader"
    finally:
        cluster.stop()
    if not still_leader:
        raise RuntimeError(f"node {leader} lost the leadership during the commit bench: the figures mix two leaders")
    # The snapshot is due once threshold_records records are applied past the
    # loaded snapshot: the first commit at or past that offset marks it.
    trigger = base_end + threshold_records
    t_trigger = next((acked for _, acked, off in ops if off >= trigger), None)
    t_created = float(created["ts"])
    if t_trigger is None or t_created < t_trigger:
        raise RuntimeError(f"snapshot_created at {t_created} before the threshold commit ({t_trigger}): "
                           f"cannot tell idle from generation")
    idle = [int((a - s) * 1e6) for s, a, off in ops if off >= base_end + warmup_records and a < t_trigger]
    during = [int((a - s) * 1e6) for s, a, _ in ops if t_trigger <= a <= t_created]
    idle_sum, during_sum = latency_summary_ms(idle), latency_summary_ms(during)
    next_trigger = min(first_ends) + threshold_records  # a voter's second snapshot is due from here
    after = [int((a - s) * 1e6) for s, a, off in ops if all_done and s > all_done[0] and off < next_trigger]
    after_sum = latency_summary_ms(after) if after else None
    # Where the slow ones fall (seconds after the threshold commit): the
    # fork, the write-back, the end of the write tell themselves apart.
    slowest = sorted(((a - s, a - t_trigger) for s, a, _ in ops if t_trigger <= a <= t_created), reverse=True)[:5]
    ratio = (during_sum["p99_ms"] / idle_sum["p99_ms"]) if idle_sum["p99_ms"] and during_sum["p99_ms"] else None
    return {"threshold_records": threshold_records, "idle": idle_sum, "during_snapshot": during_sum,
            "after_snapshot": after_sum,
            "generation_window_seconds": round(t_created - t_trigger, 3),
            "snapshot": created.get("snapshot"), "snapshot_bytes": created.get("size"),
            "snapshot_write_seconds": created.get("seconds"),
            "snapshot_path": created.get("path"), "fork_ms": created.get("fork_ms"),
            "child_memory": created.get("child_memory"),
            "during_slowest": [{"ms": round(lat * 1000, 2), "at_s": round(at, 3)} for lat, at in slowest],
            "leader_rss_mib": {"before": round(rss_before / MIB, 1), "peak_while_committing": round(max(rss_seen) / MIB, 1)},
            "p99_ratio": None if ratio is None else round(ratio, 2)}


# ------------------------------------------------------------------ report
def progress(text: str) -> None:
    print(f"[scale] {text}", file=sys.stderr, flush=True)


def _read_lines(reads: dict) -> list[str]:
    return [f"admin API GET {'one ' if what in ('topic', 'broker') else ''}{what}: p50 {r['p50_ms']} ms, "
            f"p99 {r['p99_ms']} ms, max {r['max_ms']} ms ({r['samples']} queries)" for what, r in reads.items()]


def format_report(rep: dict) -> str:
    lines = []
    w = rep["workload"]
    lines.append(f"state: {w['partitions']:,} partitions ({w['topics']:,} topics x {PARTITIONS_PER_TOPIC}), "
                 f"{w['brokers']} brokers, {w['records']:,} records, log {w['log_bytes'] / 1e6:.1f} MB")
    c = rep.get("catchup")
    if c:
        s, g = c["by_snapshot"], c["by_log"]
        lines.append(f"catch-up by snapshot: {s['catchup_seconds']} s after boot ({s['process_boot_seconds']} s boot); "
                     f"snapshot {s.get('snapshot_bytes', 0) / 1e6:.1f} MB downloaded in {s.get('download_seconds')} s "
                     f"({s.get('download_mb_per_s')} MB/s), install {s.get('install_seconds')} s (check + fsync "
                     f"{s.get('install_check_seconds')} s, "
                     + ("loaded while downloading; read-back check + " if s.get("loaded_while_downloading") else "")
                     + f"load {s.get('install_load_seconds')} s)")
        lines.append(f"catch-up by log: {g['catchup_seconds']} s after boot ({g['process_boot_seconds']} s boot)")
        lines.append(f"by log / by snapshot: {c['snapshot_speedup']}x (goal >= 5x)")
        if "download_rss_growth_mib" in s:
            lines.append(f"observer RSS while downloading: {s['download_rss_start_mib']} -> "
                         f"{s['download_rss_peak_mib']} MiB (growth {s['download_rss_growth_mib']} MiB, bound "
                         f"{s['download_rss_bound_mib']} MiB = the loaded state's {s['download_state_growth_mib']} MiB "
                         f"+ buffers: {'bounded' if s['download_memory_bounded'] else 'NOT bounded'}); "
                         f"peak RSS once caught up {s['observer_peak_rss_mib']} MiB (log variant: "
                         f"{g['observer_peak_rss_mib']} MiB, difference {s['peak_rss_over_log_variant_mib']} MiB)")
        for nid, v in s["voters"].items():
            lines.append(f"voter {nid} holding the state: RSS {v['rss_mib']} MiB (peak {v['hwm_mib']} MiB), "
                         f"snapshot load at boot {v['snapshot_load_seconds']} s")
        lines += _read_lines(s.get("admin_reads", {}))
    if rep.get("reads"):
        lines += _read_lines(rep["reads"]["admin_reads"])
    k = rep.get("commit")
    if k:
        lines.append(f"commit latency, one client: idle p50 {k['idle']['p50_ms']} ms, p99 {k['idle']['p99_ms']} ms "
                     f"({k['idle']['samples']}); during snapshot generation p50 {k['during_snapshot']['p50_ms']} ms, "
                     f"p99 {k['during_snapshot']['p99_ms']} ms ({k['during_snapshot']['samples']}, "
                     f"{k['generation_window_seconds']} s window); p99 ratio {k['p99_ratio']} (goal <= 2)")
        a = k.get("after_snapshot")
        if a:
            lines.append(f"after every voter's snapshot (control, same idle again): p50 {a['p50_ms']} ms, "
                         f"p99 {a['p99_ms']} ms ({a['samples']})")
        mem = k.get("child_memory") or {}
        lines.append(f"snapshot generation on the leader: {k['snapshot_write_seconds']} s by {k['snapshot_path']}, "
                     f"{(k['snapshot_bytes'] or 0) / 1e6:.1f} MB"
                     + (f"; fork {k['fork_ms']} ms, child peak RSS {mem.get('vmhwm_kib', 0) / 1024:.0f} MiB, "
                        f"pages copied (child's private) {mem.get('private_kib', 0) / 1024:.0f} MiB"
                        if k["snapshot_path"] == "fork" else ""))
        lines.append(f"leader RSS: {k['leader_rss_mib']['before']} MiB before, peak "
                     f"{k['leader_rss_mib']['peak_while_committing']} MiB while committing (0.2 s samples)")
        lines.append("slowest commits during generation (ms at s after the threshold): " +
                     ", ".join(f"{x['ms']} at {x['at_s']}" for x in k["during_slowest"]))
    return "\n".join(lines)


def run(partitions: int, sections: list[str], root: str | None = None, keep: bool = False,
        commit_threshold_records: int = 25_000, commit_warmup_records: int = 300,
        snapshot_generation: str = "fork") -> dict:
    """Build the workload once, run the sections; the report as a dict."""
    work_root = root or tempfile.mkdtemp(prefix="metalog-scale-")
    os.makedirs(work_root, exist_ok=True)
    try:
        work = build_workload(partitions)
        progress(f"built {work.records:,} records ({work.log_bytes / 1e6:.1f} MB) in {work.build_seconds:.1f} s")
        rep: dict[str, Any] = {"workload": {"partitions": work.partitions, "topics": work.topics,
                                            "brokers": work.brokers, "records": work.records,
                                            "log_bytes": work.log_bytes, "build_seconds": round(work.build_seconds, 2)}}
        if "reads" in sections:
            rep["reads"] = bench_reads(work_root, work)
        if "catchup" in sections:
            rep["catchup"] = bench_catchup(work_root, work)
        if "commit" in sections:
            rep["commit"] = bench_commit_during_snapshot(work_root, work, commit_threshold_records,
                                                         commit_warmup_records, generation=snapshot_generation)
            progress(f"commit p99 idle {rep['commit']['idle']['p99_ms']} ms, during snapshot "
                     f"{rep['commit']['during_snapshot']['p99_ms']} ms")
        return rep
    finally:
        if not keep and root is None:
            shutil.rmtree(work_root, ignore_errors=True)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--partitions", type=int, default=DEFAULT_PARTITIONS,
                    help="partitions in the state (100 per topic); 2000000 for the issue's headline")
    ap.add_argument("--only", default="catchup,commit",
                    help="comma list: catchup, commit, reads (reads alone: the admin reads, no observer)")
    ap.add_argument("--commit-threshold-records", type=int, default=25_000,
                    help="snapshot_min_records of the commit bench: commits before the snapshot starts")
    ap.add_argument("--snapshot-generation", choices=("fork", "thread"), default="fork",
                    help="the brokers' storage.snapshot_generation in the commit bench")
    ap.add_argument("--dir", default=None, help="where the clusters live (default: a temp dir, removed)")
    ap.add_argument("--json", default=None, help="write the report here as JSON")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    configure_logging("warning", sys.stderr)  # the storage APIs log at info; stdout carries the report
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(sections) - {"catchup", "commit", "reads"}
    if unknown:
        print(f"metalog.tools.bench.catchup: unknown section(s) {sorted(unknown)}; choose from catchup, commit, reads",
              file=sys.stderr)
        return 2
    rep = run(args.partitions, sections, root=args.dir, commit_threshold_records=args.commit_threshold_records,
              snapshot_generation=args.snapshot_generation)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=2)
    print(format_report(rep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
