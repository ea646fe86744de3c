"""``metalog drill``: kill, pause, partition and wipe a real cluster under load, then check it.

The drill starts a local cluster (``LocalCluster``: 3 voters + 1 observer by
default, or the broker services of a compose file with ``--compose``), as root
each broker in its own network namespace (``metalog.tools.cluster.netns``;
faults as nftables rules and tc inside them, ``metalog.tools.drill.netfaults``),
else with a ``FaultProxy`` between every pair of brokers (``--network``), and
runs for ``--duration-s``. Every fault is verified to have taken effect
(``metalog.tools.drill.verify``): one that did not stops the drill with one
line naming it (exit 1).

* writers produce unique values (``d<writer>-<seq>``); every acknowledged
  write is recorded with its offset and epoch. Writers are idempotent
  producers (the client's default, KIP-98) and retry a produce up to
  ``WRITE_RETRIES`` times with the same producer id and sequence, so a retry
  after a lost answer must be answered with the original offset: any value
  stored twice is a ``duplicated_write`` breach. A produce that still fails
  is abandoned, never resent as a new write;
* consumers tail the log from offset 0 with KIP-320 truncation detection
  (reset policy "none": a truncation is recorded, then the consumer seeks on;
  an out-of-range answer -- a snapshot moved the log start past the consumer --
  is recorded as a reset, then the consumer seeks to the log start);
* every broker's segment files are hard-linked into ``<dir>/archive`` as they
  appear (``metalog.tools.drill.archive``), so the records a snapshot later removes
  from every log stay checkable;
* a monitor thread per broker polls its admin ``/quorum`` (role, epoch, HW)
  per broker process (incarnation); a separate thread scans the data dirs
  for the archive every few milliseconds, so slow HTTP never delays it;
* faults come from ``--schedule kill_leader,pause_leader,...`` (cycled) or are
  drawn from ``--seed``; see ``FAULTS`` (the table at the end of ``--help``).
  The compound faults (``metalog.tools.drill.compound``: a kill -9, SIGSTOP or
  wipe inside a network fault, a partition healed during a snapshot download)
  need network namespaces. Each fault is held ``--hold-s``, then
  repaired, and the next one waits until writes are being acknowledged again.

``--dynamic`` runs a KIP-853 quorum (the launcher's dynamic format). On
network namespaces every network fault is available; without them the
partition faults (isolate_leader, cut_one_way, split_majority) are not (a
VotersRecord gives each voter one address for everyone, so the fault proxy's
per-broker addresses cannot be routed). ``reconfigure`` removes a voter (the leader half of the time)
and adds it back under load, and ``wipe_follower`` becomes a disk
replacement: the wiped voter comes back as an observer under a new
directory id, its old identity is removed, the new one added.

At the end every fault is repaired, writers stop, the cluster is left to
converge (every broker at the leader's HW), stopped gracefully, and each
broker's log is read back from its data dir for ``metalog.tools.drill.checker``.
``metalog.tools.drill.report`` writes ``<report>.json`` and ``<report>.png``.
Exit code 0 = clean, 1 = a checker breach (printed with evidence), 2 = the
drill itself could not run (e.g. no leader ever elected).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import signal
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, field

from metalog.broker.client import LogTruncationError, MetalogClient, MetalogError, OffsetOutOfRangeError
from metalog.broker.server.logging_setup import configure_logging
from metalog.protocol.messages import LIST_OFFSETS_EARLIEST
from metalog.tools.cluster.compose import cluster_from_compose
from metalog.tools.cluster import membership
from metalog.tools.cluster.launcher import LocalCluster
from metalog.tools.drill.archive import SegmentArchive
from metalog.tools.drill.checker import (Ack, History, HwSample, Reset, RoleEvent, Seen, Truncation, check,
                                         read_replica, written_by_quorum)
from metalog.tools.drill.faultproxy import FaultProxy
from metalog.tools.drill.history import PORCUPINE_BIN, HistoryFile, run_porcupine, text
from metalog.tools.drill import compound, netfaults
from metalog.tools.drill.compound import COMPOUND_FAULTS
from metalog.tools.drill.netfaults import LINK_FAULTS, NET_FAULTS, PACKET_FAULTS, NetnsFaults, ProxyFaults
from metalog.tools.drill.verify import lagging, must_follow, why_not_bitten
from metalog.tools.cluster.netns import NetnsError, NetnsHosts, unavailable as netns_unavailable
from metalog.tools.drill.figures import lines as fault_lines
from metalog.tools.drill.report import build_report, failover_lines, write_report
from metalog.tools.extras import PLOT_MODULES, missing

FAULTS = {
    "kill_leader": "kill -9 the leader, restart it after the hold",
    "kill_follower": "kill -9 a voter that is not the leader, restart it after the hold",
    "kill_observer": "kill -9 an observer, restart it after the hold",
    "term_restart": "SIGTERM a random voter (graceful stop), restart it",
    "pause_leader": "SIGSTOP the leader (a zombie leader, KAFKA-6880), SIGCONT after the hold",
    "isolate_leader": "cut the leader off from every broker, both directions, then heal",
    "cut_one_way": "drop what the leader sends to one follower (one direction), then heal",
    "split_majority": "partition {leader, observer} | {other voters}: the leader is in the minority",
    "loss_10": "(namespaces only) 10% random packet loss each way on the link leader <-> a follower",
    "loss_30": "(namespaces only) 30% random packet loss each way on the link leader <-> a follower",
    "bandwidth_cap": "(namespaces only) cap the leader's egress at 200 kbit/s (a tc token bucket)",
    "mtu_blackhole": "(namespaces only) the leader's link drops every packet over 1,200 bytes; meanwhile one "
                     "more writer sends 4,000-byte records, held until the heal",
    "wipe_follower": "kill -9 a follower, delete its data dir, restart it: it must rejoin by snapshot",
    "reconfigure": "(--dynamic only) remove a voter, the leader half of the time, and add it back (KIP-853)",
    **compound.DESCRIPTIONS,
}
PROXY_FAULTS = netfaults.PROXY_NET_FAULTS  # on the proxy: static quorums only
DYNAMIC_ONLY_FAULTS = ("reconfigure",)
# A voter change waits for a caught-up observer and a commit: give it room on a loaded machine.
MEMBERSHIP_TIMEOUT_S = 60.0
# The only settings a drill changes: snapshots and segments far smaller than the product's
# (20000 records, 64 MiB), so that snapshots, log-start moves, segment deletion and a wiped
# follower's rejoin by snapshot all happen many times in a drill of minutes. Election, fetch
# and request timeouts are the product defaults: the drill measures the failover users get.
# A segment (~1500 drill records at 64 KiB) still goes at nearly every snapshot, but lives
# seconds, not a fraction of one, after its records commit: long enough for the archive to
# see a bracketed HW that covers it even on a loaded machine (16 KiB segments were missed).
# A snapshot answer of 2 KiB (the product's: 1 MiB) makes a download span many FetchSnapshot
# answers, so that partition_snapshot can cut one mid-way (compound.BALLAST_CONFIGS).
DRILL_BROKER_SETTINGS = {
    "snapshot_min_records": 3000,
    "segment_bytes_max": 65536,
    "snapshot_chunk_bytes": 2048,
}
MONITOR_INTERVAL_S = 0.05  # per broker, between /quorum polls
# A slow answer still counts (it is bracketed by its send and receive times) and stalls no other broker.
QUORUM_TIMEOUT_S = 1.0
ARCHIVE_SCAN_INTERVAL_S = 0.02  # between archive scans of all brokers (a few directory listings)
WRITE_TIMEOUT_MS = 1500
# Before a fault, between checks that its targets follow the leader (verify.must_follow).
FOLLOW_POLL_S = 0.1
# Retries of one produce (same producer id and sequence: idempotent), bounded in time.
WRITE_RETRIES = 5
WRITE_DELIVERY_TIMEOUT_MS = 8000
MAX_WRITERS = 32
# While an MTU black hole is on, one more writer sends records this large (the others' stay
# small): a produce of one spans full-size TCP segments, the packets the black hole drops,
# as a user's large message would. (The drill's own records never fill a 1,200-byte packet.)
LARGE_VALUE_BYTES = 4000


@dataclass
class FaultRecord:
    kind: str
    node: int | None
    ts_start: float
    ts_end: float | None = None
    leader_before: int | None = None
    epoch_before: int | None = None
    detail: dict = field(default_factory=dict)


@dataclass
class Sample:
    ts: float
    node: int
    incarnation: int
    role: str | None  # None: no answer (down or paused)
    epoch: int | None = None
    leader_id: int | None = None
    hw: int | None = None
    log_start: int | None = None
    snapshots: int = 0
    sent_ts: float | None = None  # when the /quorum request went out (ts: when its answer came)


class Drill:
    def __init__(self, cluster: LocalCluster, *, duration_s: float, seed: int, schedule: list[str] | None,
                 writers: int = 3, consumers: int = 2, hold_s: float = 2.0, settle_timeout_s: float = 20.0,
                 broker_settings: dict | None = None, log=print, network: str = "proxy",
                 faults_max: int | None = None):
        assert 1 <= writers <= MAX_WRITERS
        if faults_max is not None and faults_max < 1:
            raise ValueError(f"--faults must be at least 1, not {faults_max}")
        for kind in schedule or []:
            if kind not in FAULTS:
                raise ValueError(f"unknown fault {kind!r}; choose from {', '.join(FAULTS)}")
            if (kind in PACKET_FAULTS or kind in COMPOUND_FAULTS) and network != "netns":
                raise ValueError(f"fault {kind!r} needs network namespaces (--network netns, as root)")
            if cluster.dynamic and kind in PROXY_FAULTS and network != "netns":
                raise ValueError(f"fault {kind!r} needs the fault proxy, which a --dynamic drill cannot use")
            if not cluster.dynamic and kind in DYNAMIC_ONLY_FAULTS:
                raise ValueError(f"fault {kind!r} changes the voter set: run the drill with --dynamic")
        self.cluster = cluster
        self.addr_map: dict = {}  # proxy listener -> broker address (static drills, wire_proxy)
        self.membership_errors: list[str] = []
        # applied to compose services' command lines; a local cluster gets them at creation
        self.broker_settings = dict(DRILL_BROKER_SETTINGS if broker_settings is None else broker_settings)
        self.duration_s = duration_s
        # Stop after this many faults, however long they take (a fault may wait for a broker
        # still booting, verify.must_follow), instead of after duration_s.
        self.faults_max = faults_max
        self.rng = random.Random(seed)
        self.seed = seed
        self.schedule = schedule
        self.n_writers = writers
        self.n_consumers = consumers
        self.hold_s = hold_s
        self.settle_timeout_s = settle_timeout_s
        self.log = log
        self.history = History()
        # Every produce and read as invoke/ok/fail/info lines, for Porcupine (metalog.tools.drill.history).
        self.hist: HistoryFile | None = None
        self.faults: list[FaultRecord] = []
        self.samples: list[Sample] = []
        self.write_errors = 0
        self.incarnation = {nid: 0 for nid in cluster.nodes}
        self.proxy: FaultProxy | None = None
        self.network = network  # "netns" or "proxy": where the network faults are made
        self.net: netfaults.NetworkFaults | None = None
        # Hard links of every segment every broker ever had: the checker reads the offsets a
        # snapshot removed from every log there (see metalog.tools.drill.archive).
        self.archive = SegmentArchive(os.path.join(cluster.root, "archive"),
                                      {nid: cluster.data_dir(nid) for nid in cluster.nodes})
        self._stop_monitor = threading.Event()
        self._stop_load = asyncio.Event()
        self.ballast_end: int | None = None  # the last ballast config's offset (compound.ensure_ballast)
        self._fault_tasks: list[asyncio.Task] = []  # load a fault adds (the large writer): awaited at the end
        self.t0 = time.time()

    # ---------------------------------------------------------- set up
    def wire_proxy(self) -> None:
        c = self.cluster
        voters = {nid: (c.host, s.port) for nid, s in c.nodes.items() if s.voter}
        self.proxy = FaultProxy(voters, sources=list(c.nodes)).start()
        self.net = ProxyFaults(self.proxy)
        for nid, spec in c.nodes.items():
            value = self.proxy.voters_for(nid)
            if spec.command:  # a compose service: its own command line, plus overrides
                spec.command = spec.command + ["--set", f"voters={value}"] + [
                    a for k, v in self.broker_settings.items() for a in ("--set", f"{k}={v}")]
            else:
                spec.extra["voters"] = value
        # Clients must not ride a broker's proxy listener (Metadata names the addresses
        # the answering broker dials): map every listener back to its real broker.
        self.addr_map = {self.proxy.addr(s, d): voters[d] for s, d in self.proxy.pairs()}

    def start_node(self, nid: int) -> None:
        self.incarnation[nid] += 1
        self.cluster.start_node(nid)

    # ---------------------------------------------------------- monitor
    def _scan_archive(self) -> None:
        """Link every broker's new segments and close HW brackets, every ARCHIVE_SCAN_INTERVAL_S.

        Its own thread, free of HTTP: a small segment may live well under a second between
        its last commit and its deletion, and a monitor round stalled by /quorum timeouts on
        paused or isolated brokers (slower still on a loaded machine) used to miss it."""
        c = self.cluster
        while not self._stop_monitor.is_set():
            for nid in sorted(c.nodes):
                self.archive.scan(nid, self.incarnation[nid])
            self._stop_monitor.wait(ARCHIVE_SCAN_INTERVAL_S)

    def _monitor(self, nid: int) -> None:
        """Poll one broker's /quorum: samples, HW history, and HW answers for the archive.

        One thread per broker, so a timeout on a paused or dead broker never delays the others."""
        c = self.cluster
        while not self._stop_monitor.is_set():
            inc = self.incarnation[nid]
            sent_wall_ts = time.time()
            sent_ts = time.monotonic()
            q = c.admin(nid, "/quorum", timeout_s=QUORUM_TIMEOUT_S) if c.alive(nid) else None
            received_ts = time.monotonic()
            ts = time.time()
            if inc != self.incarnation[nid]:
                pass  # restarted under us: the answer may belong to either process
            elif q is None:
                self.samples.append(Sample(ts, nid, inc, None))
            else:
                hw = q.get("high_watermark")
                if hw is not None:
                    # The archive's scans bracket the answer: it learns which segments this HW vouches for.
                    self.archive.vouch(nid, hw, sent_ts, received_ts)
                    self.history.hw.append(HwSample(nid, inc, ts, hw))
                self.samples.append(Sample(ts, nid, inc, q.get("role"), q.get("epoch"), q.get("leader_id"),
                                           hw, q.get("log_start_offset"), len(q.get("snapshots") or []),
                                           sent_wall_ts))
            self._stop_monitor.wait(MONITOR_INTERVAL_S)

    # ---------------------------------------------------------- workload
    def _client(self, **kw):
        return MetalogClient(self.cluster.bootstrap(), self.cluster.cluster_id, tls=self.cluster.client_tls(),
                             resolve_address=lambda addr: self.addr_map.get(addr, addr), **kw)

    async def _writer(self, wid: int, until: asyncio.Event | None = None, pad_bytes: int = 0) -> None:
        """Produce unique values until the load stops (or `until` is set), each padded to
        `pad_bytes` (the large writer of an MTU black hole)."""
        client = self._client(request_timeout_ms=WRITE_TIMEOUT_MS, max_retries=WRITE_RETRIES,
                              delivery_timeout_ms=WRITE_DELIVERY_TIMEOUT_MS)
        seq = 0
        try:
            while not self._stop_load.is_set() and not (until is not None and until.is_set()):
                n = 1 + seq % 3  # batches of 1-3 records
                values = [f"d{wid}-{seq + i}".encode().ljust(pad_bytes, b".") for i in range(n)]
                seq += n
                self.history.attempted.update(values)
                op = {"values": [text(v) for v in values]}
                self.hist.invoke(f"w{wid}", "append", op)
                try:
                    base, epoch = await client.produce(values)
                except Exception as exc:  # any failure: outcome unknown, never resent
                    self.hist.complete(f"w{wid}", "append", "info", op, error=repr(exc))
                    self.write_errors += 1
                    await asyncio.sleep(0.05)  # pace retries against a leaderless cluster
                    continue
                self.hist.complete(f"w{wid}", "append", "ok", {**op, "offset": base, "epoch": epoch})
                ts = time.time()
                for i, v in enumerate(values):
                    self.history.acks.append(Ack(v, base + i, epoch, ts, wid))
        finally:
            await client.close()

    async def _consumer(self, cid: int) -> None:
        client = self._client(request_timeout_ms=800, retry_backoff_ms=50)
        consumer = client.consumer(reset_policy="none")
        consumer.seek(0)
        try:
            while not self._stop_load.is_set():
                start = consumer.position
                self.hist.invoke(f"c{cid}", "read", {"from": start})
                try:
                    records = await consumer.poll(max_wait_ms=300)
                except Exception as exc:  # a read that failed claims nothing
                    self.hist.complete(f"c{cid}", "read", "fail", {"from": start}, error=repr(exc))
                    await self._consumer_error(client, consumer, cid, exc)
                    continue
                self.hist.complete(f"c{cid}", "read", "ok", {
                    "from": start, "next": consumer.position,
                    "records": [[r.offset, text(r.value), r.leader_epoch] for r in records
                                if not written_by_quorum(r.value)]})
                ts = time.time()
                for r in records:
                    self.history.seen.append(Seen(cid, r.offset, r.leader_epoch, r.value, ts))
        finally:
            await client.close()

    async def _consumer_error(self, client, consumer, cid: int, exc: Exception) -> None:
        """Record a consumer's truncation or reset and seek on; wait out any other error."""
        if isinstance(exc, LogTruncationError):
            self.history.truncations.append(Truncation(cid, time.time(), exc.first_diverging_offset))
            consumer.seek(exc.first_diverging_offset, exc.epoch)
        elif isinstance(exc, OffsetOutOfRangeError):
            # A snapshot moved the log start past us (KIP-630): resume at the log start, as
            # reset_policy="earliest" would, but record the jump so the checker can tell
            # the offsets skipped here from a record the client dropped.
            try:
                resp = await client.list_offsets(LIST_OFFSETS_EARLIEST)
            except Exception:
                await asyncio.sleep(0.05)
                return
            self.history.resets.append(Reset(cid, time.time(), exc.position, resp.offset))
            consumer.seek(resp.offset, resp.leader_epoch)
        else:
            await asyncio.sleep(0.05)

    # ---------------------------------------------------------- faults
    async def _leader(self, timeout_s: float = 20.0, exclude: set[int] = frozenset()) -> tuple[int, int]:
        """(leader id, epoch)."""
        return await asyncio.to_thread(self.cluster.wait_for_leader, timeout_s, exclude)

    async def _wait_progress(self, after_ts: float, timeout_s: float) -> float | None:
        """Wait until some write is acknowledged after `after_ts`; its ts, or None on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            acks = self.history.acks
            if acks and acks[-1].ts > after_ts:
                return next(a.ts for a in reversed(acks) if a.ts > after_ts)
            await asyncio.sleep(0.05)
        return None

    def _voters_caught_up(self, voters: list[int], timeout_s: float) -> bool:
        """Wait until every voter's log end reaches the leader's high watermark; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.cluster.leader()
            if found:
                views = {nid: self.cluster.quorum(nid) for nid in voters}
                hw = (views.get(found[0]) or {}).get("high_watermark")
                if hw is not None and all(v and v.get("log_end_offset", -1) >= hw for v in views.values()):
                    return True
            time.sleep(0.1)
        return False

    def _pick_kind(self, i: int) -> str:
        if self.schedule:
            return self.schedule[i % len(self.schedule)]
        excluded = set() if self.cluster.dynamic else set(DYNAMIC_ONLY_FAULTS)
        if self.network != "netns":
            excluded |= set(PACKET_FAULTS) | set(COMPOUND_FAULTS) | (set(PROXY_FAULTS) if self.cluster.dynamic else set())
        return self.rng.choice([k for k in FAULTS if k not in excluded])

    async def _membership(self, rec: FaultRecord, step: str, fn, *args) -> str | None:
        """Run one voter change (a thread: it polls and blocks); a refusal or a
        timeout is recorded as a drill problem, not raised."""
        try:
            return await asyncio.to_thread(fn, self.cluster, *args, MEMBERSHIP_TIMEOUT_S)
        except (membership.MembershipError, MetalogError, TimeoutError) as exc:
            rec.detail.setdefault("errors", []).append(f"{step}: {exc}")
            self.membership_errors.append(f"{rec.kind} of node {rec.node}, {step}: {exc}")
            return None

    def _await_observable(self, kind: str, voters: list[int], draw: float) -> tuple[int, int, int | None, dict]:
        """(leader, epoch, the far end of a link fault, the delay for the report) once the
        brokers fault `kind`'s verification reads can show its effect: they answer /quorum and
        follow the leader with a HW past the leader's at the first look (verify.must_follow).
        A fault right after a kill, restart or wipe waits here for the broker still booting.
        `draw` picks the link's far end among the followers, the same one while we wait.
        Raises FaultNotObservable after settle_timeout_s: a fault whose effect cannot be
        seen is never injected (verify would only say "cannot tell")."""
        c = self.cluster
        started = time.monotonic()
        deadline = started + self.settle_timeout_s
        hw_from: tuple[int, int, int] | None = None  # (leader, epoch, its HW at the first look)
        delayed_for = None
        while True:
            leader, epoch = c.wait_for_leader(max(0.5, deadline - time.monotonic()))
            followers = sorted(n for n in voters if n != leader)
            other = followers[int(draw * len(followers))] if kind in LINK_FAULTS else None
            nodes = must_follow(kind, followers, other)
            if not nodes:
                return leader, epoch, other, {}
            if hw_from is not None and hw_from[:2] == (leader, epoch):
                why = lagging(c.quorum, nodes, leader, epoch, hw_from[2])
            else:  # a first look (or a new leader): where the leader's HW is now; never enough
                hw = (c.quorum(leader) or {}).get("high_watermark")
                hw_from = (leader, epoch, hw) if hw is not None else None
                why = "" if hw is not None else f"leader {leader} gives no high watermark"
            if why is None:
                detail = {} if delayed_for is None else {
                    "delayed_s": round(time.monotonic() - started, 2), "delayed_for": delayed_for}
                return leader, epoch, other, detail
            if why and delayed_for is None:
                delayed_for = why
            if time.monotonic() > deadline:
                raise FaultNotObservable(f"{kind} not injected: its targets could not show its effect within "
                                         f"{self.settle_timeout_s:.0f}s: {why or delayed_for}")
            time.sleep(FOLLOW_POLL_S)

    async def inject(self, kind: str) -> FaultRecord:
        c = self.cluster
        voters = [n for n, s in c.nodes.items() if s.voter]
        leader, epoch, other, delay = await asyncio.to_thread(self._await_observable, kind, voters,
                                                              self.rng.random())
        followers = [n for n in voters if n != leader]
        observers = [n for n, s in c.nodes.items() if not s.voter]
        rec = FaultRecord(kind, None, time.time(), leader_before=leader, epoch_before=epoch, detail=delay)
        self.faults.append(rec)
        if kind == "kill_leader":
            rec.node = leader
            await asyncio.to_thread(c.kill, leader)
            rec.detail["killed_at"] = time.time()
            rec.detail["exit_code"] = c.procs[leader].returncode
            await asyncio.sleep(self.hold_s)
            self.start_node(leader)
        elif kind in ("kill_follower", "kill_observer"):
            pool = followers if kind == "kill_follower" else (observers or followers)
            rec.node = self.rng.choice(pool)
            await asyncio.to_thread(c.kill, rec.node)
            rec.detail["exit_code"] = c.procs[rec.node].returncode
            await asyncio.sleep(self.hold_s)
            self.start_node(rec.node)
        elif kind == "term_restart":
            rec.node = self.rng.choice(voters)
            rec.detail["exit_code"] = await asyncio.to_thread(c.stop_node, rec.node)
            self.start_node(rec.node)
        elif kind == "pause_leader":
            rec.node = leader
            c.signal(leader, signal.SIGSTOP)
            rec.detail["stopped"] = await asyncio.to_thread(self._seen_stopped, leader)
            await asyncio.sleep(self.hold_s * 1.5)
            c.signal(leader, signal.SIGCONT)
        elif kind in COMPOUND_FAULTS:
            await compound.inject(self, kind, rec, leader, followers, voters, other)
        elif kind in NET_FAULTS:
            rec.node = leader
            before = self.net.counters()
            rec.detail.update(netfaults.apply(kind, self.net, leader, followers, observers, other))
            large_done = asyncio.Event()
            if kind == "mtu_blackhole":  # what the black hole bites on: large records (see LARGE_VALUE_BYTES)
                wid = MAX_WRITERS + len(self.faults)  # a writer id of its own (the history's process)
                self._fault_tasks.append(asyncio.create_task(self._writer(wid, large_done, LARGE_VALUE_BYTES)))
                rec.detail["large_writer"] = {"writer": wid, "value_bytes": LARGE_VALUE_BYTES}
            await asyncio.sleep(self.hold_s * 1.5)
            large_done.set()  # its produce in flight finishes (or is given up) in the background
            after = self.net.counters()  # before heal: the namespaces' counters go with their rules
            rec.detail["net"] = {k: v - before.get(k, 0) for k, v in after.items()}
            # The cut ends when the heal begins (ts_end comes after it, a few nft calls later):
            # what the verification reads "while cut" must come before this.
            rec.detail["heal_ts"] = time.time()
            self.net.heal()
        elif kind == "wipe_follower":
            # A static voter set survives one lost disk only while every other voter holds the
            # committed log: the wiped voter has forgotten its vote and its log, so a stale voter
            # (one just restarted) could win its vote and truncate committed records (Raft's
            # disk-loss case, which KIP-853's directory ids remove). The drill stays inside that
            # fault model: wipe only when every voter has caught up, and let the wiped one
            # catch up again before the next fault.
            rec.detail["voters_caught_up_before"] = await asyncio.to_thread(
                self._voters_caught_up, voters, self.settle_timeout_s)
            rec.node = self.rng.choice(followers)
            await asyncio.to_thread(c.kill, rec.node)
            self.archive.scan(rec.node, self.incarnation[rec.node])  # the last bytes before the wipe
            shutil.rmtree(c.data_dir(rec.node), ignore_errors=True)
            rec.detail["wiped"] = not os.path.exists(c.data_dir(rec.node))
            self.archive.forget_live(rec.node)
            self.start_node(rec.node)
            if c.dynamic:
                # KIP-853: the new disk is a new replica (an observer); replace the old
                # identity in the voter set by the new one, one change at a time.
                rec.detail["removed_dir"] = await self._membership(rec, "remove old identity",
                                                                   membership.remove_voter, rec.node)
                rec.detail["added_dir"] = await self._membership(rec, "add new identity",
                                                                 membership.add_voter, rec.node)
            rec.detail["wiped_caught_up"] = await asyncio.to_thread(
                self._voters_caught_up, voters, self.settle_timeout_s)
        elif kind == "reconfigure":
            rec.node = leader if self.rng.random() < 0.5 else self.rng.choice(followers)
            rec.detail["was_leader"] = rec.node == leader
            rec.detail["removed_dir"] = await self._membership(rec, "remove", membership.remove_voter, rec.node)
            if rec.detail["removed_dir"] is not None:
                await asyncio.sleep(self.hold_s)  # a smaller quorum for the hold, as other faults last
                rec.detail["added_dir"] = await self._membership(rec, "add back", membership.add_voter, rec.node)
        else:
            raise AssertionError(kind)
        rec.ts_end = time.time()
        return rec

    def _seen_stopped(self, nid: int, timeout_s: float = 2.0) -> bool:
        """Whether the kernel shows the process stopped (SIGSTOP is delivered asynchronously)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.cluster.paused(nid):
                return True
            time.sleep(0.01)
        return False

    # ---------------------------------------------------------- run
    async def run(self) -> dict:
        c = self.cluster
        self.t0 = time.time()
        self.hist = HistoryFile(os.path.join(c.root, "history.jsonl"))
        for nid in sorted(c.nodes):
            self.start_node(nid)
        await self._leader(timeout_s=30)
        monitors = [threading.Thread(target=self._scan_archive, name="drill-archive", daemon=True)]
        monitors += [threading.Thread(target=self._monitor, args=(nid,), name=f"drill-monitor-{nid}", daemon=True)
                     for nid in sorted(c.nodes)]
        for t in monitors:
            t.start()
        tasks = [asyncio.create_task(self._writer(w)) for w in range(self.n_writers)]
        tasks += [asyncio.create_task(self._consumer(k)) for k in range(self.n_consumers)]
        problems: list[str] = []
        try:
            if await self._wait_progress(0, self.settle_timeout_s) is None:
                raise DrillAborted("no write was acknowledged after the cluster came up")
            end = time.monotonic() + self.duration_s
            i = 0
            while i < self.faults_max if self.faults_max is not None else time.monotonic() < end:
                kind = self._pick_kind(i)
                i += 1
                try:
                    rec = await self.inject(kind)
                except FaultNotObservable as exc:
                    problems.append(str(exc))
                    self.log(f"  !! {problems[-1]}")
                    break
                if "delayed_s" in rec.detail:
                    self.log(f"  {kind} waited {rec.detail['delayed_s']}s for its targets: "
                             f"{rec.detail['delayed_for']}")
                self.log(f"[{rec.ts_start - self.t0:7.2f}s] {kind} node {rec.node} "
                         f"(leader was {rec.leader_before}) {rec.detail or ''}")
                if await self._wait_progress(rec.ts_end, self.settle_timeout_s) is None:
                    problems.append(f"no write acknowledged within {self.settle_timeout_s}s after {kind} "
                                    f"of node {rec.node}")
                    self.log(f"  !! {problems[-1]}")
                    break
                why = why_not_bitten(self, rec, time.time())
                rec.detail["took_effect"] = why is None
                if why is not None:
                    problems.append(f"fault did not take effect: {kind} of node {rec.node} at "
                                    f"{rec.ts_start - self.t0:.1f}s on the {self.network}: {why}")
                    self.log(f"  !! {problems[-1]}")
                    break
        finally:
            self._stop_load.set()
            await asyncio.gather(*tasks, *self._fault_tasks, return_exceptions=True)
        problems += self.membership_errors
        converged = await asyncio.to_thread(self._converge)
        self._stop_monitor.set()
        for t in monitors:
            t.join(5)
        commit_end = converged.get("high_watermark")
        if commit_end is None:  # no converged leader: the best known committed offset
            commit_end = max((h.hw for h in self.history.hw), default=0)
        c.stop()
        if self.proxy:
            self.proxy.stop()
        self._collect_roles()
        replicas = [read_replica(nid, c.data_dir(nid)) for nid in sorted(c.nodes)]
        result = check(self.history, replicas, commit_end, self.archive.list())
        porcupine = self._independent_check(result, commit_end)
        if not converged.get("ok"):
            problems.append(f"cluster did not converge: {converged.get('why')}")
        return {"result": result, "porcupine": porcupine, "problems": problems, "commit_end": commit_end,
                "converged": converged,
                "archive": self.archive.stats(),
                "replicas": {r.node: {"log_start": r.log_start, "log_end": r.log_end} for r in replicas}}

    def _independent_check(self, result, commit_end: int):
        """Porcupine's verdict on the history, the committed log read back from the files
        appended as the last reads (an acknowledged write no consumer read is checked too)."""
        self.hist.final_reads(result.log, result.control, commit_end)
        self.hist.close()
        return run_porcupine(self.hist.path, vis_path=os.path.join(self.cluster.root, "porcupine.html"))

    def _converge(self) -> dict:
        """Repair everything and wait until every broker is at the leader's HW."""
        c = self.cluster
        if self.net:
            self.net.heal()
        for nid in c.nodes:
            c.signal(nid, signal.SIGCONT)
            if not c.alive(nid):
                self.start_node(nid)
        state: dict = {"ok": False, "why": "no leader"}

        def converged():
            found = c.leader()
            if not found:
                return False
            views = {nid: c.quorum(nid) for nid in c.nodes}
            lq = views[found[0]]
            if not lq or lq.get("high_watermark") is None:
                state["why"] = "leader has no HW yet"
                return False
            hw, leo = lq["high_watermark"], lq["log_end_offset"]
            lagging = {nid: (v or {}).get("high_watermark") for nid, v in views.items()
                       if not v or v.get("high_watermark") != hw or v.get("log_end_offset") != leo}
            if hw != leo or lagging:
                state["why"] = f"leader {found[0]} hw {hw} leo {leo}; lagging {lagging}"
                return False
            state.update(ok=True, why="", leader=found[0], epoch=found[1], high_watermark=hw)
            return True

        try:
            c.wait_for(converged, self.settle_timeout_s * 2, "convergence", poll_s=0.2)
        except TimeoutError:
            pass
        return state

    def _collect_roles(self) -> None:
        for nid in sorted(self.cluster.nodes):
            for i, line in enumerate(self.cluster.read_log_lines(nid)):
                if line.get("event") == "role_changed":
                    self.history.roles.append(RoleEvent(
                        nid, float(line.get("ts", 0)), str(line.get("role")), int(line.get("epoch", -1)),
                        line.get("leader_id"), source=f"node-{nid}/broker.log:{i + 1}",
                        hw=line.get("high_watermark")))


class DrillAborted(Exception):
    pass


class FaultNotObservable(Exception):
    """A fault's targets never got where they could show its effect (the drill stops, exit 1)."""


# ------------------------------------------------------------------ CLI
def drill_broker_settings(args) -> dict:
    return dict(DRILL_BROKER_SETTINGS, snapshot_min_records=args.snapshot_min_records)


def build_cluster(args) -> LocalCluster:
    if args.compose:
        if args.dynamic:
            raise ValueError("--dynamic starts a local cluster formatted by the launcher; it cannot run a compose file")
        return cluster_from_compose(args.compose, args.dir, port_offset=args.port_offset)
    # Static voters (kraft.version 0): the fault proxy gives every broker its own
    # address for each peer in `voters`, and a VotersRecord's single endpoint
    # per voter would route around it.
    # --dynamic: a KIP-853 quorum, and no fault proxy (see the module docstring).
    return LocalCluster.create(args.dir, voters=args.voters, observers=args.observers,
                               common=drill_broker_settings(args), cluster_id="metalog-drill",
                               dynamic=args.dynamic)


def choose_network(args) -> str:
    """"netns" or "proxy" for --network auto|netns|proxy; auto says in one line why it falls back."""
    if args.network == "proxy":
        return "proxy"
    why = "a compose file's services bring their own addresses" if args.compose else netns_unavailable()
    if why is None:
        return "netns"
    if args.network == "netns":
        raise ValueError(f"--network netns: {why}")
    print(f"metalog drill: no network namespaces ({why}): network faults go through the user-space "
          f"proxy, each verified to take effect", file=sys.stderr)
    return "proxy"


def place_on_hosts(cluster: LocalCluster, hosts: NetnsHosts) -> None:
    """Every broker on its own namespace: listen, advertised and certificate address, command prefix."""
    for nid, spec in cluster.nodes.items():
        spec.host = hosts.addr(nid)
        spec.exec_prefix = hosts.exec_prefix(nid)
    cluster.voter_addrs = {nid: (spec.host, spec.port) for nid, spec in cluster.nodes.items() if spec.voter}


def run_drill(args) -> tuple[int, dict]:
    if os.path.exists(args.dir):
        shutil.rmtree(args.dir)
    os.makedirs(args.dir, exist_ok=True)
    # Client and storage-reader log lines go to a file, not over the drill's output.
    configure_logging("info", open(os.path.join(args.dir, "drill-clients.log"), "a", buffering=1))
    network = choose_network(args)
    cluster = build_cluster(args)
    schedule = [s.strip() for s in args.schedule.split(",") if s.strip()] if args.schedule else None
    drill = Drill(cluster, duration_s=args.duration_s, seed=args.seed, schedule=schedule,
                  broker_settings=drill_broker_settings(args),
                  writers=args.writers, consumers=args.consumers, hold_s=args.hold_s,
                  log=(lambda *_: None) if args.quiet else print, network=network, faults_max=args.faults)
    hosts = None
    try:
        if network == "netns":
            try:
                hosts = NetnsHosts(sorted(cluster.nodes)).create()
            except NetnsError as exc:
                raise ValueError(f"could not make the network namespaces: {exc}") from None
            place_on_hosts(cluster, hosts)
            drill.net = NetnsFaults(hosts, {nid: s.admin_port for nid, s in cluster.nodes.items()})
        elif not cluster.dynamic:
            drill.wire_proxy()
        try:
            # The drill's clients (writers, consumers, monitor) live on their own host too.
            with hosts.client_namespace() if hosts else contextlib.nullcontext():
                out = asyncio.run(drill.run())
        except (DrillAborted, TimeoutError) as exc:
            cluster.stop()
            print(f"metalog drill: could not run: {exc}; see {cluster.root}/node-*/broker.log", file=sys.stderr)
            return 2, {}
    finally:
        if drill.proxy:
            drill.proxy.stop()
        if hosts:
            cluster.stop()
            hosts.remove()
    report = build_report(drill, out)
    paths = write_report(report, drill, args.report)
    res, porcupine = out["result"], out["porcupine"]
    print(res.summary())
    for line in porcupine.output or [porcupine.summary]:  # its verdict and any failing window
        print(line)
    for p in out["problems"]:
        print(f"problem: {p}")
    s = report["summary"]
    print(f"writes acknowledged {s['writes_acknowledged']}, lost {s['writes_lost']}, duplicated "
          f"{s['writes_duplicated']}, unverifiable {s['writes_unverifiable']}, faults {s['faults']} "
          f"({s['kill_restart_cycles']} kill/restart cycles), "
          f"failover p50 {s['failover_ms_p50']} ms, p99 {s['failover_ms_p99']} ms")
    print(f"faults verified to take effect: {s['faults_verified']} of {s['faults']} (network faults on the "
          f"{s['network']}; {s['faults_delayed']} delayed until their targets followed the leader)")
    for line in failover_lines(s["failover_by_kind"]):
        print(line)
    for line in fault_lines(s["fault_kinds"]):
        print(line)
    print(f"report: {paths['json']}  timeline: {paths['png']}")
    return (0 if report["ok"] else 1), report


def cmd_drill(args) -> int:
    absent = missing(PLOT_MODULES, "bench")
    if absent is not None:  # found out now, not after the drill when the report is drawn
        print(f"metalog drill: the report's timeline picture needs matplotlib; {absent}", file=sys.stderr)
        return 2
    if not os.access(PORCUPINE_BIN, os.X_OK):  # found out now, not after the drill
        print(f"metalog drill: the independent checker {PORCUPINE_BIN} is missing: build it with "
              f"`bash run.sh setup` (needs Go)", file=sys.stderr)
        return 2
    try:
        rc, _ = run_drill(args)
    except ValueError as exc:
        print(f"metalog drill: {exc}", file=sys.stderr)
        return 2
    return rc


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration-s", type=float, default=60.0, help="how long to inject faults")
    p.add_argument("--faults", type=int, default=None,
                   help="inject exactly this many faults, however long they take (instead of --duration-s): "
                        "with a schedule that long, every fault of it once")
    p.add_argument("--seed", type=int, default=1, help="seeds the fault choice when no --schedule is given")
    p.add_argument("--schedule", help="comma-separated faults, cycled: " + ", ".join(FAULTS))
    p.add_argument("--hold-s", type=float, default=2.0, help="how long a fault lasts before it is repaired")
    p.add_argument("--writers", type=int, default=3)
    p.add_argument("--consumers", type=int, default=2)
    p.add_argument("--voters", type=int, default=3)
    p.add_argument("--observers", type=int, default=1)
    p.add_argument("--compose", help="run this compose file's broker services instead of a default cluster")
    p.add_argument("--port-offset", type=int, default=None, help="with --compose: local port = container port + this")
    p.add_argument("--dir", default="run/drill", help="node dirs (wiped at start)")
    p.add_argument("--report", default="run/drill-report", help="writes REPORT.json and REPORT.png")
    p.add_argument("--snapshot-min-records", type=int, default=DRILL_BROKER_SETTINGS["snapshot_min_records"],
                   help="brokers snapshot after this many records (a short drill on a slow machine "
                        "needs fewer to see snapshots, segment deletion and a rejoin by snapshot)")
    p.add_argument("--dynamic", action="store_true",
                   help="a dynamic quorum (KIP-853) with the reconfigure fault; every network fault on "
                        "network namespaces, but without namespaces (the fault proxy cannot route a dynamic "
                        "quorum) not " + ", ".join(PROXY_FAULTS))
    p.add_argument("--network", choices=("auto", "netns", "proxy"), default="auto",
                   help="where network faults are made: each broker in its own network namespace (netns: "
                        "root; nftables for the packet faults), the user-space proxy, or netns when it can "
                        "be made (auto)")
    p.add_argument("--quiet", action="store_true")


def fault_table(width: int = 100) -> str:
    """`metalog drill --help`'s table of the schedule's faults: each kind and what it does."""
    name_w = max(map(len, FAULTS)) + 2
    rows = ["faults (--schedule):"]
    for kind, what in FAULTS.items():
        lines = textwrap.wrap(what, width - name_w - 2) or [""]
        rows.append(f"  {kind:<{name_w}}{lines[0]}")
        rows += [" " * (name_w + 2) + line for line in lines[1:]]
    return "\n".join(rows)


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("drill", help="fault drill: kill/pause/partition/wipe brokers under load, then check",
                              description=__doc__, epilog=fault_table(),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=cmd_drill)
