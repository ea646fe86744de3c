"""The asyncio broker: a thin driver around the pure quorum core.

Everything that decides anything lives in ``broker.quorum.core``. This module
only moves bytes and time: it feeds the core events (requests from the wire,
responses from peers, ticks, flush completions, client appends) and executes
the actions the core returns, in order, following the rules in
``broker.quorum.api``:

    persist (quorum-state fsync, append, truncate)  ->  flush (async, group
    commit)  ->  send / respond  ->  apply committed records to the controller

so nothing is acknowledged before it is durable. Flushes run in a worker
thread while the loop keeps appending; one fdatasync covers every append
that happened before it started (group commit). Client Produce requests are
batched adaptively: when the disk is idle they are appended at the end of the
loop turn they arrived in; while a flush runs they wait and become one batch
when it completes (or after ``append_linger_ms`` if that is set above 0).

The binary protocol is served by ``broker.net``; the HTTP admin API by
``broker.admin``.

Fail-stop (issue 12): whatever this process cannot go on from safely -- an
invariant breach the core reports, a failed append or fsync, an error
applying committed records, an exception escaping any background task or
loop callback -- ends in ONE structured ``fatal`` log event (``cause``,
``reason`` and context fields) and exit code 4 (``Broker._fatal``). Where a
clean rollback exists it is taken instead: a snapshot download that fails
verification is deleted, the log kept and the download retried.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import time
import traceback
import weakref
from typing import Any

import msgspec

from broker import authz
from broker.clocks import now_ms, wall_clock_ms
from broker.config import BrokerConfig
from broker.consistency import LogDigest, compare
from broker.controller import CommandError, Controller, load_latest, load_snapshot, write_controller_snapshot
from broker.metrics import BrokerMetrics
from broker.net import Connection, ListenerLimits, NetError, PeerPool, Server, serve
from broker.quorum import api as qa
from broker.quorum.core import QuorumCore
from broker.tls import INSECURE_DETAIL
from protocol import messages as m
from protocol.apis import APIS, REQUEST_API_KEY, ApiKey
from protocol.codec import ProtocolError
from protocol.errors import Errors
from storage.epochs import EpochCheckpointError, EpochHistory, read_checkpoint, write_checkpoint
from storage.batch import CorruptBatchError
from storage.errors import CorruptionReport, CorruptLogError, LogWriteError, StorageError
from storage.log import SegmentedLog
from storage.quorum_state import QuorumStateError, QuorumStateFile
from storage.scrub import Scrubber
from storage.snapshot import PartialSnapshot, SnapshotInvariantError, SnapshotStore

PARTITION_DIR = "__cluster_metadata-0"
META_FILE = "meta.properties"
APPLY_BYTES_PER_STEP = 4 << 20  # bound the committed bytes applied per loop turn
MAX_QUEUED_COMMANDS = 1024


class StartupError(Exception):
    """The broker refuses to start; the message says why and what to do."""


class _Reader:
    """The core's read-only view of the local log and snapshots (api.LogReader)."""

    def __init__(self, log: SegmentedLog, snapshots: SnapshotStore):
        self.log = log
        self.snapshots = snapshots

    def read(self, start_offset: int, end_offset: int, max_bytes: int) -> bytes:
        return self.log.read(start_offset, end_offset, max_bytes)

    def snapshot_size(self, snapshot_id: m.SnapshotId) -> int | None:
        return self.snapshots.size(snapshot_id)

    def read_snapshot(self, snapshot_id: m.SnapshotId, position: int, max_bytes: int) -> bytes:
        return self.snapshots.read_chunk(snapshot_id, position, max_bytes)


def check_meta(data_dir: str, cluster_id: str, node_id: int) -> None:
    """Bind a data dir to one cluster and node: refuse a mismatch at boot."""
    path = os.path.join(data_dir, META_FILE)
    if os.path.exists(path):
        props = dict(
            line.split("=", 1) for line in open(path).read().splitlines() if "=" in line and not line.startswith("#")
        )
        if props.get("cluster.id") != cluster_id:
            raise StartupError(
                f"data dir {data_dir} belongs to cluster {props.get('cluster.id')!r} but the config says "
                f"{cluster_id!r}: refusing to start (point data_dir elsewhere or fix cluster_id)"
            )
        if props.get("node.id") != str(node_id):
            raise StartupError(
                f"data dir {data_dir} belongs to node {props.get('node.id')} but the config says node {node_id}"
            )
        return
    from storage.atomic import atomic_write

    atomic_write(path, f"version=1\ncluster.id={cluster_id}\nnode.id={node_id}\n".encode())


class Broker:
    def __init__(self, cfg: BrokerConfig, logger):
        self.cfg = cfg
        self.log = logger.bind(node=cfg.node_id)
        self.metrics = BrokerMetrics(cfg.node_id)
        self.part_dir = os.path.join(cfg.data_dir, PARTITION_DIR)
        self.voters = cfg.voter_endpoints()
        self.core: QuorumCore | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_deadline: int | None = None
        self._flush_running = False
        self._flush_wanted = False
        self._pending_produce: list[tuple[Any, list[bytes]]] = []
        self._pending_records = 0
        self._linger_handle: asyncio.Handle | None = None  # linger timer or call_soon
        self._partials: dict[m.SnapshotId, PartialSnapshot] = {}
        self._snapshot_task: asyncio.Task | None = None
        self._bg_tasks: set[asyncio.Task] = set()
        self._last_exposed: tuple | None = None
        self._stopping = False
        self._commands: collections.deque = collections.deque()
        self._command_in_flight: _CommandToken | None = None
        self.fatal: str | None = None
        self._follow_up: list[qa.Event] = []  # fed right after the current step's actions
        self._executing = False  # inside the action loop of a step
        # Why /health answers "degraded" (503) while the broker still serves:
        # key -> human-readable reason (corruption found, quarantine, divergence ...).
        self.health_problems: dict[str, str] = {}
        self._corruption_seen: set[tuple[str, int]] = set()
        # Set when a write or fsync failed: writes are answered KAFKA_STORAGE_ERROR.
        self.storage_error: str | None = None
        # Produce tokens handed to the core and not yet answered (bounded by
        # the connections' in-flight limits): answered KAFKA_STORAGE_ERROR if
        # the disk fails before the core acknowledges them.
        self._unanswered_produce: set = set()
        self.scrubber: Scrubber | None = None
        self._consistency_task: asyncio.Task | None = None
        self.stopped = asyncio.Event()
        self.server: Server | None = None
        self.admin_runner = None
        self.tls: Any = None  # broker.tls.TlsFiles, None in insecure mode
        # Authorization is on exactly when TLS is: without TLS every peer is
        # ANONYMOUS and no identity can be checked (insecure mode, opt-in).
        self.authz_enabled = cfg.tls_enabled
        self.super_users = frozenset(cfg.super_users)
        self._voter_ids = frozenset(self.voters)
        # Denials already logged, per connection: one log line per (api, operation, resource).
        self._denials_logged: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # Per connection: [is a super user, peer host, view the decisions were made
        # under, {(api, command): decision}], so a client's steady stream of the
        # same request costs one dict lookup, not an ACL walk.
        self._conn_authz: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._view_cache: tuple[Any, int, authz.AuthzView] | None = None
        self.admin_denials_logged: set[tuple] = set()  # see broker.admin

    # ------------------------------------------------------------------ boot
    async def start(self) -> None:
        cfg = self.cfg
        # An exception no one retrieves (a task, a loop callback) is a fatal
        # error, not a line on stderr.
        asyncio.get_running_loop().set_exception_handler(self._loop_exception)
        view, qs = self._recover_local_state()
        t0 = time.perf_counter()
        self.digest = LogDigest.build(self.seg_log)
        self.log.info("log_digest_built", batches_from=self.digest.first_base, end_offset=self.digest.end_offset,
                      seconds=round(time.perf_counter() - t0, 4))
        self.core = QuorumCore(cfg.quorum_config(), view, _Reader(self.seg_log, self.snapshots), qs, random.Random())
        if cfg.tls_enabled:
            from broker.tls import TlsFiles

            # Raises TlsConfigError (a ValueError: "refusing to start") for unreadable or mismatched files.
            self.tls = TlsFiles(cfg.tls_paths(), check_interval_s=cfg.ssl_reload_check_ms / 1000, logger=self.log)
        else:
            self.log.warning("insecure_mode", security_protocol=cfg.security_protocol,
                             detail=INSECURE_DETAIL)
        self.peers = PeerPool(
            {nid: (ep.host, ep.port) for nid, ep in self.voters.items() if nid != cfg.node_id},
            client_id=f"metalog-{cfg.node_id}",
            max_frame_bytes=cfg.max_frame_bytes,
            connect_timeout_ms=cfg.connect_timeout_ms,
            reconnect_backoff_max_ms=cfg.reconnect_backoff_max_ms,
            tls=self.tls,
        )
        ep = cfg.listen_endpoint()
        limits = ListenerLimits(
            ssl_handshake_timeout_ms=cfg.ssl_handshake_timeout_ms,
            connections_max_idle_ms=cfg.connections_max_idle_ms,
            max_connections=cfg.max_connections,
            max_connections_per_ip=cfg.max_connections_per_ip,
            failed_connections_before_backoff=cfg.failed_connections_before_backoff,
            failed_connection_backoff_ms=cfg.failed_connection_backoff_ms,
            failed_connection_backoff_max_ms=cfg.failed_connection_backoff_max_ms,
        )
        self.server = await serve(ep.host, ep.port, self._on_request, max_frame_bytes=cfg.max_frame_bytes,
                                  logger=self.log, tls=self.tls, limits=limits)
        if cfg.admin_endpoint() is not None:
            from broker.admin import start_admin

            self.admin_runner = await start_admin(self, cfg.admin_endpoint())
        if not self.authz_enabled:
            self.log.warning("authorization_disabled", security_protocol="PLAINTEXT",
                             detail="every connection is User:ANONYMOUS with super-user rights: anyone who can "
                                    "reach the port can act as a replica, write and change ACLs")
        self.log.info(
            "broker_started", listen=str(ep), security_protocol=cfg.security_protocol, voters={k: str(v) for k, v in self.voters.items()},
            log_start_offset=self.seg_log.log_start_offset, log_end_offset=self.seg_log.log_end_offset,
            epoch=self.core.epoch, role=str(self.core.role),
        )
        self._step(qa.Tick(now_ms(), wall_clock_ms()))
        if cfg.consistency_check_interval_ms > 0:
            self._consistency_task = asyncio.get_running_loop().create_task(self._consistency_loop())
            self._consistency_task.add_done_callback(self._task_done)
        loop = asyncio.get_running_loop()
        self.scrubber = Scrubber(
            self.seg_log, self.snapshots, cfg.log_scrub_bytes_per_s,
            # Called on the scrubber thread: the report is handled on the loop.
            lambda report: loop.call_soon_threadsafe(self._on_corruption, report, "scrub"),
            logger=self.log, metrics=self.metrics)
        self.scrubber.start()

    def _on_corruption(self, report: CorruptionReport, source: str = "scrub") -> None:
        """Corruption found (by the scrubber, a read, a fetch): one structured
        error event, the metric, /health degraded with the reason. Reported
        once per (file, position)."""
        key = (report.path, report.position)
        if key in self._corruption_seen:
            return
        self._corruption_seen.add(key)
        self.log.error("corruption_detected", source=source, **report.as_log_fields())
        self.metrics.corrupt_batches.labels(source=source).inc()
        self.health_problems[f"corruption:{report.path}"] = (
            f"corrupt data in {report.path} at byte {report.position} (offset {report.base_offset}, "
            f"found by {source}): {report.reason}")
        if self.fatal is None and self.core is not None:
            self._react_to_corruption(report, source)

    def _react_to_corruption(self, report: CorruptionReport, source: str) -> None:
        """Issue 12 item 4: quarantine through the storage and tell the core
        (LogQuarantined): a leader resigns, a voter abstains until it has
        re-replicated past the end it had. With no other copy (one voter) the
        broker stops instead: truncating would lose committed records."""
        if report.path.endswith(".checkpoint"):
            self._snapshot_corrupt(report)
            return
        if len(self.voters) == 1 and self.cfg.node_id in self.voters:
            self._fatal("corruption_no_other_copy", self._no_copy_message(report), **report.as_log_fields())
            return
        try:
            state = self.seg_log.quarantine_from(report)
        except ValueError as exc:
            # Not a live segment any more (deleted by a log-start move, or already
            # cut by an earlier report): nothing of the current log is affected.
            self.log.warning("corruption_not_in_current_log", error=str(exc), file=report.path)
            return
        except (StorageError, OSError) as exc:
            self._storage_failed(f"quarantine failed: {exc}", exc)
            return
        self.digest.truncate(self.seg_log.log_end_offset)
        self.health_problems["quarantine"] = (
            f"log cut to {self.seg_log.log_end_offset} after corruption; not voting until the log "
            f"reaches {state.must_reach_offset} again")
        ev = qa.LogQuarantined(now_ms(), self.seg_log.log_end_offset, state.must_reach_offset)
        if self._executing:
            self._follow_up.append(ev)  # the core is mid-step: right after its actions
        else:
            self._step(ev)

    def _snapshot_corrupt(self, report: CorruptionReport) -> None:
        """A snapshot failed verification: keep it for the operator as .corrupt
        (never deleted), never serve it; a leader steps down (a LogQuarantined
        that cuts nothing: it resigns and votes again at once) so that a replica
        with a sound snapshot leads."""
        try:
            os.replace(report.path, report.path + ".corrupt")
        except FileNotFoundError:
            pass
        if str(self.core.role) == "leader":
            end = self.core.log_end_offset
            ev = qa.LogQuarantined(now_ms(), end, end)
            if self._executing:
                self._follow_up.append(ev)
            else:
                self._step(ev)

    def _no_copy_message(self, report: CorruptionReport) -> str:
        return (f"corrupt data in {report.path} at byte {report.position} (offset {report.base_offset}): "
                f"{report.reason}; this is the only voter, so no other copy exists to re-replicate from. "
                f"To truncate the log at the corruption (records from offset {report.base_offset} on are "
                f"lost), run: metalog storage recover --data-dir {self.cfg.data_dir} --truncate-at-corruption")

    def _recover_local_state(self) -> tuple[qa.LogView, qa.QuorumStateData | None]:
        """Open the log (crash recovery), clean up and load snapshots (KIP-630
        boot rules), rebuild the epoch history if needed, read the quorum
        state: everything the core is built from."""
        cfg = self.cfg
        os.makedirs(cfg.data_dir, exist_ok=True)
        check_meta(cfg.data_dir, cfg.cluster_id, cfg.node_id)  # before writing anything there
        os.makedirs(self.part_dir, exist_ok=True)
        # Another copy can exist (more than one voter, or we are an observer):
        # corruption found at open is quarantined and re-replicated. A single
        # voter has no other copy: refuse to start and say what to do.
        sole_voter = len(self.voters) == 1 and cfg.node_id in self.voters
        try:
            self.seg_log = SegmentedLog.open(self.part_dir, segment_bytes_max=cfg.segment_bytes_max,
                                             logger=self.log, on_corruption="raise" if sole_voter else "quarantine")
        except CorruptLogError as exc:
            raise StartupError(self._no_copy_message(exc.report)) from None
        for report in self.seg_log.startup_reports:  # already logged by the log (corruption_detected)
            self._corruption_seen.add((report.path, report.position))
            self.metrics.corrupt_batches.labels(source="startup").inc()
        if self.seg_log.quarantine is not None:
            q = self.seg_log.quarantine
            self.health_problems["quarantine"] = (
                f"log cut to {self.seg_log.log_end_offset} after corruption "
                f"({', '.join(r.path for r in q.reports)}); not voting until the log reaches "
                f"{q.must_reach_offset} again")
            for r in q.reports:  # stays for this process's life, as run-time finds do
                self.health_problems[f"corruption:{r.path}"] = (
                    f"corrupt data in {r.path} at byte {r.position} (offset {r.base_offset}, found at "
                    f"start): {r.reason}; kept as .corrupt")
            self.log.warning("started_quarantined", must_reach_offset=q.must_reach_offset,
                             log_end_offset=self.seg_log.log_end_offset,
                             reports=[r.as_log_fields() for r in q.reports])
        self.snapshots = SnapshotStore(self.part_dir)
        try:
            boot = self.snapshots.boot_cleanup(self.seg_log.log_start_offset)
            if boot is not None:
                self.log.info("snapshot_boot_cleanup", **{k: v for k, v in vars(boot).items() if v})
        except SnapshotInvariantError as exc:
            # KIP-630's boot invariant failed: no snapshot covers the log start.
            # Treat the log as empty and bootstrap from the leader.
            self.log.warning("log_reset_no_covering_snapshot", error=str(exc),
                             log_start_offset=self.seg_log.log_start_offset)
            self.seg_log.truncate_fully(0)
            for sid in self.snapshots.list():
                self.snapshots.delete(sid)
        self.controller = Controller()
        t0 = time.perf_counter()
        loaded = load_latest(self.snapshots)
        if loaded is not None:
            state, snap_id = loaded
            self.controller.load(state)
            self.controller.snapshot_taken(snap_id.end_offset)
            self.metrics.snapshot_load_seconds.observe(time.perf_counter() - t0)
            self.log.info("snapshot_loaded", snapshot=[snap_id.end_offset, snap_id.epoch],
                          seconds=round(time.perf_counter() - t0, 4))
            if self.seg_log.log_end_offset < snap_id.end_offset or self.seg_log.log_start_offset > snap_id.end_offset:
                # The snapshot is ahead of the log (installed, then crashed before
                # the log was reset) or the log starts past it: restart the log there.
                self.seg_log.truncate_fully(snap_id.end_offset)
        elif self.seg_log.log_start_offset > 0:
            self.log.warning("log_reset_no_loadable_snapshot", log_start_offset=self.seg_log.log_start_offset)
            self.seg_log.truncate_fully(0)
        checkpoint = os.path.join(self.part_dir, "leader-epoch-checkpoint")
        try:
            epochs = read_checkpoint(checkpoint)
        except EpochCheckpointError as exc:
            # Derived data: the batches carry their epochs. Rebuild it from the
            # log (below) and keep the damaged file for the operator.
            self.log.warning("epoch_checkpoint_unreadable", file=checkpoint, error=str(exc),
                             action="rebuilt from the log's batch headers; the damaged file is kept as .corrupt")
            os.replace(checkpoint, checkpoint + ".corrupt")
            epochs = EpochHistory()
        if not epochs.entries and self.seg_log.log_end_offset > self.seg_log.log_start_offset:
            epochs = EpochHistory(self.seg_log.batch_epochs())
        epochs.truncate_from_end(self.seg_log.log_end_offset)
        epochs.truncate_from_start(self.seg_log.log_start_offset)
        if loaded is not None and not epochs.entries:
            epochs.assign(loaded[1].epoch, loaded[1].end_offset)
        self.qs_file = QuorumStateFile(os.path.join(self.part_dir, "quorum-state"))
        try:
            qs_raw = self.qs_file.read()
        except QuorumStateError as exc:
            raise StartupError(
                f"{exc}. This file holds the epoch and the vote this voter cast; starting without it "
                f"could let it vote twice in one epoch, so the broker will not guess. If this broker has "
                f"been down for longer than an election takes (its epoch is over), move the file aside "
                f"(mv {self.qs_file.path} {self.qs_file.path}.corrupt): it then starts without a vote in "
                f"the epoch of its log's last batch and learns the current one from the leader") from None
        qs = None
        if qs_raw is not None:
            qs = qa.QuorumStateData(
                leader_epoch=qs_raw["leader_epoch"], leader_id=qs_raw["leader_id"],
                voted_id=qs_raw["voted_id"], voters=tuple(qs_raw.get("voters", ())),
            )
        view = qa.LogView(
            log_start_offset=self.seg_log.log_start_offset,
            log_end_offset=self.seg_log.log_end_offset,
            epochs=[tuple(e) for e in epochs.entries],
            snapshots=self.snapshots.list(),
            must_reach_offset=self.seg_log.quarantine.must_reach_offset if self.seg_log.quarantine else -1,
        )
        return view, qs

    async def stop(self, graceful: bool = True) -> None:
        """Graceful: resign leadership (EndQuorumEpoch), flush, close."""
        if self._stopping:
            return
        self._stopping = True
        try:
            await self._stop(graceful)
        finally:
            self.stopped.set()  # whatever failed on the way out, the process ends

    async def _stop(self, graceful: bool) -> None:
        if graceful and self.core is not None and self.fatal is None:
            self._step(qa.Shutdown(now_ms()))
            # Give the EndQuorumEpoch requests a moment to leave, bounded.
            await self._drain_background(timeout_s=min(1.0, self.cfg.request_timeout_ms / 1000))
        if self._timer:
            self._timer.cancel()
        if self.server is not None:
            self.server.close()
        if self.admin_runner is not None:
            await self.admin_runner.cleanup()
        me = asyncio.current_task()
        for task in list(self._bg_tasks):
            if task is not me:  # stop() itself runs as a background task after a failure
                task.cancel()
        if self._consistency_task is not None:
            self._consistency_task.cancel()
        if self._snapshot_task is not None:
            # The task logs its own failure (snapshot_write_failed); just bound the wait.
            await asyncio.wait([self._snapshot_task], timeout=10)
        await self.peers.close()
        if self.scrubber is not None:
            await asyncio.to_thread(self.scrubber.stop)
        if graceful and self.fatal is None:
            await asyncio.to_thread(self.seg_log.flush)
            self.seg_log.close()
        self.log.info("broker_stopped", graceful=graceful)

    async def _drain_background(self, timeout_s: float) -> None:
        if self._bg_tasks:
            await asyncio.wait(list(self._bg_tasks), timeout=timeout_s)

    # ------------------------------------------------------------- the step
    def _step(self, event: qa.Event) -> None:
        if self.fatal is not None or self.core is None:
            return
        try:
            actions = self.core.step(event)
        except Exception as exc:  # noqa: BLE001 - any refusal is fatal, never swallowed
            # A driver bug the core refused (it validates its inputs): stop
            # rather than run on with a core and a disk that may disagree.
            self._fatal("core_step_failed", f"core refused {type(event).__name__}: {exc}",
                        event_type=type(event).__name__, exc=exc)
            return
        self._executing = True
        try:
            for action in actions:
                self._execute(action)
                if self.fatal is not None:
                    return
        finally:
            self._executing = False
        if self._follow_up:
            # Events the contract says come before any other (SnapshotInstallFailed).
            follow_up, self._follow_up = self._follow_up, []
            for ev in follow_up:
                self._step(ev)
            return  # the nested step ran _after_step
        self._after_step()

    def _fatal(self, cause: str, reason: str, exc: BaseException | None = None, **fields) -> None:
        """Fail-stop: ONE structured `fatal` event, then exit code 4 (broker.main).
        Later failures while stopping add nothing: the first cause is the story."""
        if self.fatal is not None:
            return
        self.fatal = reason
        if exc is not None:
            fields["error_type"] = type(exc).__name__
            fields["traceback"] = "".join(traceback.format_exception(exc)).rstrip()
        self.log.critical("fatal", cause=cause, reason=reason, data_dir=self.cfg.data_dir, **fields)
        self._spawn(self.stop(graceful=False))

    def _loop_exception(self, loop, context: dict) -> None:
        """asyncio's handler for exceptions nobody retrieved."""
        exc = context.get("exception")
        message = context.get("message", "")
        if isinstance(exc, (ConnectionError, NetError, ProtocolError, asyncio.CancelledError)):
            # A peer going away under a transport: the connection code owns it.
            self.log.warning("loop_connection_error", message=message, error=repr(exc))
            return
        if "protocol" in context or "transport" in context:
            # One connection's error (e.g. a malformed frame under TLS, which
            # uvloop reports here): that transport is closed; the broker goes on.
            self.log.error("connection_error", message=message, error=repr(exc),
                           error_type=type(exc).__name__ if exc else None)
            return
        self._fatal("unhandled_exception", f"{message}: {exc!r}" if exc else message, exc=exc)

    def _execute(self, a: qa.Action) -> None:
        t = type(a)
        if t is qa.SendRequest:
            self._spawn(self._send(a))
        elif t is qa.Respond:
            token = a.token
            self._unanswered_produce.discard(token)
            if type(token) is _CommandToken:
                self._command_done(token, a.response)
            else:
                conn, correlation_id = token
                conn.send_response(correlation_id, a.response)
        elif t is qa.AppendBatches:
            try:
                self.seg_log.append(a.data)
            except LogWriteError as exc:
                # The core already counts these records: we cannot go on with a
                # log that disagrees with it. Fail-stop (Kafka takes the log dir
                # offline); the log itself holds no partial batch.
                self._storage_failed(f"append failed: {exc}", exc)
                return
            self.metrics.appended_bytes.inc(len(a.data))
            self.digest.append(a.data)
        elif t is qa.FlushLog:
            self._request_flush()
        elif t is qa.PersistQuorumState:
            s = a.state
            self.qs_file.write(leader_epoch=s.leader_epoch, leader_id=s.leader_id, voted_id=s.voted_id,
                               voters=list(s.voters))
        elif t is qa.TruncateLog:
            self.log.warning("log_truncated", end_offset=a.end_offset, log_end_offset=self.seg_log.log_end_offset)
            assert a.end_offset >= self.controller.applied_offset, "truncating below applied (committed) records"
            self.seg_log.truncate_to(a.end_offset)
            self.digest.truncate(a.end_offset)
        elif t is qa.WriteEpochCheckpoint:
            write_checkpoint(os.path.join(self.part_dir, "leader-epoch-checkpoint"), EpochHistory(a.entries))
        elif t is qa.WriteSnapshotChunk:
            part = self._partials.get(a.snapshot_id)
            if part is None or a.position == 0:
                if part is not None:
                    part.abort()
                part = self._partials[a.snapshot_id] = self.snapshots.partial(a.snapshot_id)
            part.write_at(a.position, a.data)
        elif t is qa.InstallSnapshot:
            self._install_snapshot(a)
        elif t is qa.AdvanceLogStart:
            self.seg_log.advance_log_start(a.log_start_offset)
            self.digest.advance_start(a.log_start_offset)
            covering = [sid for sid in self.snapshots.list() if sid.end_offset <= a.log_start_offset]
            if covering:
                self.snapshots.delete_before(covering[-1])
            self.log.info("log_start_advanced", log_start_offset=a.log_start_offset)
        elif t is qa.Fatal:
            self._fatal("invariant_breach", a.reason)
        elif t is qa.ClearQuarantine:
            self.seg_log.clear_quarantine()
            self.health_problems.pop("quarantine", None)
            self.log.info("quarantine_cleared", must_reach_offset=a.must_reach_offset,
                          log_end_offset=self.seg_log.log_end_offset)
        elif t is qa.CorruptionFound:
            report = getattr(a.error, "report", None)
            if report is None:
                report = CorruptionReport("", -1, None, None, None, None, str(a.error))
            self._on_corruption(report, "fetch")
        else:  # pragma: no cover - the contract is closed
            raise AssertionError(f"unknown action {a!r}")

    def _after_step(self) -> None:
        core = self.core
        exposed = (str(core.role), core.epoch, core.leader_id)
        if exposed != self._last_exposed:
            self._last_exposed = exposed
            self.log.info("role_changed", role=exposed[0], epoch=core.epoch, leader_id=core.leader_id,
                          high_watermark=core.high_watermark)
            self.metrics.set_role(exposed[0], core.epoch)
        hw = core.high_watermark
        if hw is not None and hw > self.controller.applied_offset:
            self._apply_committed(hw)
        if self._commands and self._command_in_flight is None:
            self._pump_commands()
        self._schedule_timer()

    def _apply_committed(self, hw: int) -> None:
        start = max(self.controller.applied_offset, self.seg_log.log_start_offset)
        try:
            data = self.seg_log.read(start, hw, APPLY_BYTES_PER_STEP)
        except CorruptBatchError as exc:
            # Never apply damaged bytes: quarantine, re-fetch, apply later.
            self._on_corruption(exc.report, "apply")
            return
        if data:
            try:
                self.controller.apply_batches(data, end_offset=hw)
            except Exception as exc:  # noqa: BLE001 - committed records we cannot apply: fail-stop
                # Every replica holds these same bytes (their CRC is valid): going
                # on would serve a state that skipped committed records.
                self._fatal("apply_failed", f"cannot apply committed records from offset "
                            f"{self.controller.applied_offset}: {type(exc).__name__}: {exc}",
                            exc=exc, applied_offset=self.controller.applied_offset, high_watermark=hw)
                return
        self.metrics.high_watermark.set(hw)
        if self.controller.applied_offset < hw:
            # More than one step's worth: continue on the next loop turn.
            asyncio.get_running_loop().call_soon(self._after_step)
        self._maybe_snapshot()

    def _storage_failed(self, reason: str, exc: BaseException | None = None) -> None:
        # Fail-stop at the first failed write or fsync (issue 12 item 8): the
        # data may be gone from the page cache, so nothing past the last good
        # sync is acknowledged and fsync is never retried; writes still queued
        # here get KAFKA_STORAGE_ERROR, recovery is at restart from the log
        # (torn tail cut, verified from the recovery point) and the leader.
        self.storage_error = reason
        self._reject_pending_writes(reason)
        self._fatal("storage_failed", reason, exc=exc)

    def _reject_pending_writes(self, reason: str) -> None:
        message = f"storage error on broker {self.cfg.node_id}: {reason}"
        pending, self._pending_produce = self._pending_produce, []
        self._pending_records = 0
        # Queued here, or handed to the core and not acknowledged (their batch
        # may not be durable): none of them will be acknowledged by this process.
        tokens = [token for token, _records in pending] + list(self._unanswered_produce)
        self._unanswered_produce.clear()
        for conn, cid in tokens:
            conn.send_response(cid, m.ProduceResponse(error_code=Errors.KAFKA_STORAGE_ERROR, error_message=message))
        if self._command_in_flight is not None:
            token, self._command_in_flight = self._command_in_flight, None
            token.conn.send_response(token.correlation_id, m.ControllerCommandResponse(
                error_code=Errors.KAFKA_STORAGE_ERROR, error_message=message))
        while self._commands:
            token, _ = self._commands.popleft()
            token.conn.send_response(token.correlation_id, m.ControllerCommandResponse(
                error_code=Errors.KAFKA_STORAGE_ERROR, error_message=message))

    # ------------------------------------------------------------ timers
    def _schedule_timer(self) -> None:
        deadline = self.core.next_deadline_ms
        if deadline is None or self._stopping:
            return
        if self._timer is not None and self._timer_deadline == deadline:
            return
        if self._timer is not None:
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        delay_s = max(0.0, (deadline - now_ms()) / 1000)
        self._timer_deadline = deadline
        self._timer = loop.call_later(delay_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_deadline = None
        self._step(qa.Tick(now_ms(), wall_clock_ms()))

    # ------------------------------------------------------------ flushing
    def _request_flush(self) -> None:
        if self._flush_running:
            self._flush_wanted = True
            return
        self._flush_running = True
        self._spawn(self._flush_loop())

    async def _flush_loop(self) -> None:
        try:
            while True:
                self._flush_wanted = False
                t0 = time.perf_counter()
                try:
                    flushed = await asyncio.to_thread(self.seg_log.flush)
                except (OSError, StorageError) as exc:
                    self._storage_failed(f"flush failed: {exc}", exc)
                    return
                self.metrics.flush_seconds.observe(time.perf_counter() - t0)
                self._step(qa.FlushCompleted(now_ms(), flushed))
                if self._pending_produce and self._linger_handle is None:
                    self._flush_produce()  # writes that waited for this flush: one batch
                if not self._flush_wanted:
                    return
        finally:
            self._flush_running = False

    # ------------------------------------------------------------ outbound
    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._bg_tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        """Every background task's end: an exception escaping one is fatal."""
        self._bg_tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._fatal("task_failed", f"background task {task.get_coro().__qualname__} failed: "
                        f"{type(exc).__name__}: {exc}", exc=exc)

    async def _send(self, a: qa.SendRequest) -> None:
        api_key = REQUEST_API_KEY[type(a.request)]
        try:
            channel = self.peers.channel(a.destination)
            response = await channel.request(api_key, a.request, a.timeout_ms)
        except (NetError, ProtocolError, OSError, asyncio.TimeoutError) as exc:
            # timeouts, refused connections, resets, a peer's garbled answer;
            # anything else is a bug and escapes to _task_done (fatal).
            self._step(qa.RequestFailed(now_ms(), a.request_id, a.destination, f"{type(exc).__name__}: {exc}"))
            return
        if isinstance(response, m.ErrorResponse):
            self._step(qa.RequestFailed(now_ms(), a.request_id, a.destination,
                                        f"peer answered error {response.error_code}: {response.error_message}"))
            return
        self._step(qa.ResponseReceived(now_ms(), a.request_id, a.destination, response))

    # ------------------------------------------------------------ inbound
    def _on_request(self, conn: Connection, header, body: m.Body) -> None:
        api_key = ApiKey(header.api_key)
        self.metrics.requests.labels(api=api_key.name).inc()
        token = (conn, header.correlation_id)
        if self.storage_error is not None and api_key in (ApiKey.PRODUCE, ApiKey.CONTROLLER_COMMAND):
            conn.send_response(header.correlation_id, APIS[api_key][1](
                error_code=Errors.KAFKA_STORAGE_ERROR,
                error_message=f"storage error on broker {self.cfg.node_id}: {self.storage_error}"))
            return
        if self.fatal is not None or self.core is None:
            conn.send_response(header.correlation_id, APIS[api_key][1](error_code=Errors.BROKER_NOT_AVAILABLE))
            return
        if self.authz_enabled:
            # Before anything else sees the request (the core included): a refused
            # request has no effect on votes, epochs, fetch positions or the HW.
            denial = self._authorize(conn, api_key, body)
            if denial is not None:
                self._refuse(conn, header.correlation_id, api_key, denial)
                return
        if (api_key in (ApiKey.PRODUCE, ApiKey.CONTROLLER_COMMAND, ApiKey.CONSISTENCY_CHECK)
                and body.cluster_id != self.cfg.cluster_id):
            # The core validates the cluster id (and the voter set) of every request
            # it is handed; these two the runtime batches or runs itself.
            self.log.warning("inconsistent_cluster_id", api=api_key.name, got=body.cluster_id, peer=conn.peer)
            conn.send_response(header.correlation_id, APIS[api_key][1](error_code=Errors.INCONSISTENT_CLUSTER_ID))
            return
        if api_key is ApiKey.API_VERSIONS:
            conn.send_response(header.correlation_id, m.ApiVersionsResponse(
                api_keys=[m.ApiVersionRange(int(k), lo, hi) for k, (_, _, lo, hi) in APIS.items()]))
        elif api_key is ApiKey.METADATA:
            resp = self.metadata_response()
            if self.authz_enabled and not authz.may_describe_log(conn.principal, self._conn_authz[conn][1],
                                                                 self.authz_view()):
                # Routing only (leader, voters), as Kafka answers a client without Describe.
                resp = msgspec.structs.replace(resp, high_watermark=m.NO_OFFSET, log_start_offset=m.NO_OFFSET,
                                               observers=[])
            conn.send_response(header.correlation_id, resp)
        elif api_key is ApiKey.PRODUCE:
            self._enqueue_produce(token, body)
        elif api_key is ApiKey.CONTROLLER_COMMAND:
            self._enqueue_command(token, body)
        elif api_key is ApiKey.CONSISTENCY_CHECK:
            conn.send_response(header.correlation_id, self._answer_consistency(body))
        else:
            self._step(qa.RequestReceived(now_ms(), token, body))

    def authz_view(self) -> authz.AuthzView:
        """The gate's view: ACLs from the controller's applied (committed) state,
        rebuilt only when they change (a new state object or an ACL record)."""
        state = self.controller.state
        cached = self._view_cache
        if cached is None or cached[0] is not state or cached[1] != state.acl_version:
            view = authz.AuthzView(enabled=self.authz_enabled, voters=self._voter_ids,
                                   super_users=self.super_users, acls=tuple(state.acls.values()))
            cached = self._view_cache = (state, state.acl_version, view)
        return cached[2]

    def _authorize(self, conn: Connection, api_key: ApiKey, body: m.Body) -> authz.Denial | None:
        facts = self._conn_authz.get(conn)
        if facts is None:
            facts = self._conn_authz[conn] = [str(conn.principal) in self.super_users, peer_host(conn.peer), None, {}]
        is_super, host, decided_under, decisions = facts
        claims_replica = api_key in authz.REPLICA_APIS and not (
            api_key in (ApiKey.FETCH, ApiKey.OFFSET_FOR_LEADER_EPOCH) and body.replica_id == m.CONSUMER_REPLICA_ID)
        if is_super and not claims_replica:
            return None  # the hot path of the admin/bench clients: no ACL walk
        view = self.authz_view()
        if claims_replica:  # depends on the ids in the body: decided each time
            return authz.authorize(conn.principal, host, api_key, body, view)
        if decided_under is not view:
            decisions.clear()
            facts[2] = view
        key = (api_key, body.command if api_key is ApiKey.CONTROLLER_COMMAND else None)
        if key in decisions:
            return decisions[key]
        denial = authz.authorize(conn.principal, host, api_key, body, view)
        if len(decisions) < 64:  # command names come from the client: bounded
            decisions[key] = denial
        return denial

    def _refuse(self, conn: Connection, correlation_id: int, api_key: ApiKey, denial: authz.Denial) -> None:
        self.metrics.authorization_failures.labels(api=api_key.name).inc()
        seen = self._denials_logged.setdefault(conn, set())
        key = (denial.api, denial.operation, denial.resource, denial.reason)
        if key not in seen and len(seen) < 64:  # bounded: a peer cannot grow this without limit
            seen.add(key)
            self.log.warning("authorization_failed", peer=conn.peer, principal=denial.principal, api=denial.api,
                             operation=denial.operation, resource=denial.resource, reason=denial.reason,
                             error=Errors(denial.error_code).name)
        response_type = APIS[api_key][1]
        extra = {"error_message": denial.message()} if "error_message" in response_type.__struct_fields__ else {}
        conn.send_response(correlation_id, response_type(error_code=denial.error_code, **extra))

    # ------------------------------------------------ consistency check
    def _answer_consistency(self, req: m.ConsistencyCheckRequest) -> m.ConsistencyCheckResponse:
        if req.leader_id not in self.voters:
            return m.ConsistencyCheckResponse(error_code=Errors.INCONSISTENT_VOTER_SET,
                                              error_message=f"node {req.leader_id} is not a voter")
        if req.start_offset < 0 or req.end_offset < req.start_offset:
            return m.ConsistencyCheckResponse(error_code=Errors.INVALID_REQUEST,
                                              error_message=f"bad range [{req.start_offset}, {req.end_offset})")
        # Never vouch for data we have not flushed: cap at our flushed end.
        end = min(req.end_offset, self.core.flushed_end_offset)
        return self.digest.answer(m.ConsistencyCheckRequest(
            cluster_id=req.cluster_id, leader_id=req.leader_id, leader_epoch=req.leader_epoch,
            start_offset=req.start_offset, end_offset=end, chunks=req.chunks))

    async def _consistency_loop(self) -> None:
        interval_s = self.cfg.consistency_check_interval_ms / 1000
        while not self._stopping:
            await asyncio.sleep(interval_s)
            if self.fatal is None and not self._stopping and str(self.core.role) == "leader":
                await self.check_consistency()

    async def check_consistency(self) -> dict[int, str]:
        """Leader: compare the committed prefix both hold with every voter.
        Returns voter -> match | mismatch | skipped | failed."""
        core = self.core
        results: dict[int, str] = {}
        for voter in sorted(self.voters):
            if voter == self.cfg.node_id or str(core.role) != "leader":
                continue
            results[voter] = result = await self._check_voter(voter)
            self.metrics.consistency_checks.labels(result=result).inc()
        return results

    async def _check_voter(self, voter: int) -> str:
        core = self.core
        st = core.replica_states.get(voter)
        hw = core.high_watermark
        if st is None or hw <= 0 or st.log_end_offset <= 0:
            return "skipped"
        start = self.digest.first_base
        end = self.digest.floor_boundary(min(hw, st.log_end_offset))
        if end <= start:
            return "skipped"
        req = m.ConsistencyCheckRequest(cluster_id=self.cfg.cluster_id, leader_id=self.cfg.node_id,
                                        leader_epoch=core.epoch, start_offset=start, end_offset=end)
        try:
            resp = await self.peers.channel(voter).request(ApiKey.CONSISTENCY_CHECK, req,
                                                           self.cfg.request_timeout_ms)
        except (NetError, ProtocolError, OSError, asyncio.TimeoutError) as exc:
            self.log.info("consistency_check_failed", replica=voter, error=f"{type(exc).__name__}: {exc}")
            return "failed"
        if not isinstance(resp, m.ConsistencyCheckResponse) or resp.error_code != Errors.NONE:
            self.log.info("consistency_check_skipped", replica=voter, error_code=getattr(resp, "error_code", None),
                          error=getattr(resp, "error_message", None))
            return "skipped"
        d = self.digest
        if (resp.start_offset < d.first_base or resp.end_offset > min(d.end_offset, core.high_watermark)
                or not d.boundary(resp.start_offset) or not d.boundary(resp.end_offset)):
            # Our log moved (log start advanced) or the voter's boundaries are not
            # ours: a different batch boundary inside the range shows as a mismatch.
            return "skipped"
        mine = d.digest_chunks(resp.start_offset, resp.end_offset, req.chunks)
        bad = compare(mine, resp.chunks)
        if bad is None:
            self.log.debug("consistency_check_passed", replica=voter, start_offset=resp.start_offset,
                           end_offset=resp.end_offset)
            return "match"
        self._divergence(voter, bad, mine, resp)
        return "mismatch"

    def _divergence(self, voter: int, bad: m.ConsistencyChunk, mine: list[m.ConsistencyChunk],
                    resp: m.ConsistencyCheckResponse) -> None:
        ours = next((c for c in mine if c.start_offset == bad.start_offset), None)
        bases = [b for b in self.seg_log.segment_base_offsets if b <= bad.start_offset]
        segment = f"{bases[-1]:020d}.log" if bases else None
        reason = (f"voter {voter} holds different committed data than this leader in offsets "
                  f"[{bad.start_offset}, {bad.end_offset}) (leader segment {segment})")
        self.metrics.divergence_detected.labels(replica=str(voter)).inc()
        self.health_problems[f"divergence_replica_{voter}"] = reason
        self.log.error("divergence_detected", replica=voter, first_diverging_start_offset=bad.start_offset,
                       first_diverging_end_offset=bad.end_offset, leader_segment=segment,
                       leader_digest=ours.digest if ours else None, replica_digest=bad.digest,
                       checked_start_offset=resp.start_offset, checked_end_offset=resp.end_offset,
                       reason=reason, action="compare the range on both replicas (metalog dump); "
                       "the replica whose copy is wrong must be wiped and re-replicated")

    def metadata_response(self) -> m.MetadataResponse:
        core = self.core
        observers = []
        if str(core.role) == "leader":
            # Observers are known to the leader only, by their fetches (no endpoints).
            observers = [m.NodeEndpoint(r.replica_id, "", 0) for r in core.describe_quorum(now_ms()).observers]
        return m.MetadataResponse(
            cluster_id=self.cfg.cluster_id,
            node_id=self.cfg.node_id,
            leader_id=core.leader_id if core.leader_id is not None else m.NO_LEADER,
            leader_epoch=core.epoch,
            high_watermark=core.high_watermark if core.high_watermark is not None else m.NO_OFFSET,
            log_start_offset=core.log_start_offset,
            voters=[m.NodeEndpoint(nid, ep.host, ep.port) for nid, ep in sorted(self.voters.items())],
            observers=observers,
        )

    # ------------------------------------------------ group commit of writes
    def _enqueue_produce(self, token, body: m.ProduceRequest) -> None:
        if not body.records:
            conn, cid = token
            conn.send_response(cid, m.ProduceResponse(error_code=Errors.INVALID_REQUEST,
                                                      error_message="a produce request needs at least one record"))
            return
        self._pending_produce.append((token, body.records))
        self._pending_records += len(body.records)
        if self._pending_records >= self.cfg.append_batch_records_max:
            self._flush_produce()
        elif self._linger_handle is not None:
            return
        elif self.cfg.append_linger_ms > 0:
            self._linger_handle = asyncio.get_running_loop().call_later(
                self.cfg.append_linger_ms / 1000, self._flush_produce)
        elif not self._flush_running:
            # Adaptive group commit: the disk is idle, so append at the end of
            # this loop turn (everything read in this turn joins the batch).
            # While a flush runs, writes wait for it and go out as one batch
            # when it completes (see _flush_loop): no fixed linger.
            self._linger_handle = asyncio.get_running_loop().call_soon(self._flush_produce)

    def _flush_produce(self) -> None:
        if self._linger_handle is not None:  # a TimerHandle or a call_soon Handle
            self._linger_handle.cancel()
            self._linger_handle = None
        if not self._pending_produce:
            return
        pending, self._pending_produce = self._pending_produce, []
        self._pending_records = 0
        records: list[bytes] = []
        waiters = []
        for token, recs in pending:
            waiters.append((token, len(recs)))
            self._unanswered_produce.add(token)
            records.extend(recs)
        self.metrics.appended_records.inc(len(records))
        self._step(qa.ClientAppend(now_ms(), waiters, records, wall_clock_ms()))

    # ------------------------------------------------- controller commands
    def _enqueue_command(self, token, body: m.ControllerCommandRequest) -> None:
        conn, cid = token
        if len(self._commands) >= MAX_QUEUED_COMMANDS:
            conn.send_response(cid, m.ControllerCommandResponse(
                error_code=Errors.REQUEST_TIMED_OUT, error_message="controller command queue is full"))
            return
        self._commands.append((_CommandToken(conn, cid), body))
        if self._command_in_flight is None:
            self._pump_commands()

    def _pump_commands(self) -> None:
        """Run queued commands one at a time, each validated against a state
        that reflects every record in the log (so two commands never both pass
        against the same stale state)."""
        core = self.core
        while self._commands and self._command_in_flight is None:
            if str(core.role) != "leader":
                leader = m.LeaderIdAndEpoch(core.leader_id if core.leader_id is not None else m.NO_LEADER,
                                            core.epoch)
                while self._commands:
                    token, _ = self._commands.popleft()
                    token.conn.send_response(token.correlation_id, m.ControllerCommandResponse(
                        error_code=Errors.NOT_LEADER_OR_FOLLOWER, current_leader=leader))
                return
            if self.controller.applied_offset < core.log_end_offset:
                return  # earlier records not applied yet: retried after the next step
            token, body = self._commands.popleft()
            if body.command in authz.ACL_COMMANDS_DESCRIBE:  # read-only: answered from the applied state
                token.conn.send_response(token.correlation_id, m.ControllerCommandResponse(
                    base_offset=self.controller.applied_offset, leader_epoch=core.epoch,
                    result=self.controller.list_acls()))
                continue
            try:
                records = build_command(self.controller, body.command, body.args)
            except CommandError as exc:
                token.conn.send_response(token.correlation_id, m.ControllerCommandResponse(
                    error_code=exc.error_code, error_message=str(exc)))
                continue
            except (KeyError, TypeError, ValueError) as exc:
                token.conn.send_response(token.correlation_id, m.ControllerCommandResponse(
                    error_code=Errors.INVALID_REQUEST,
                    error_message=f"bad arguments for {body.command!r}: {type(exc).__name__}: {exc}"))
                continue
            if not records:
                token.conn.send_response(token.correlation_id, m.ControllerCommandResponse(
                    base_offset=core.log_end_offset, leader_epoch=core.epoch))
                continue
            self._command_in_flight = token
            self._step(qa.ClientAppend(now_ms(), [(token, len(records))], records, wall_clock_ms()))

    def _command_done(self, token: "_CommandToken", response: m.ProduceResponse) -> None:
        assert token is self._command_in_flight
        self._command_in_flight = None
        token.conn.send_response(token.correlation_id, m.ControllerCommandResponse(
            error_code=response.error_code, error_message=response.error_message,
            base_offset=response.base_offset, leader_epoch=response.leader_epoch,
            current_leader=response.current_leader))

    # ------------------------------------------------------------ snapshots
    def _install_snapshot(self, a: qa.InstallSnapshot) -> None:
        part = self._partials.pop(a.snapshot_id, None)
        if part is None:
            self.log.error("snapshot_install_without_download", snapshot=[a.snapshot_id.end_offset, a.snapshot_id.epoch])
            return
        t0 = time.perf_counter()
        try:
            part.complete(a.size)
        except (StorageError, OSError, ValueError) as exc:
            # Clean rollback: the partial goes, the log stays, the core goes back
            # to it and downloads again (api.SnapshotInstallFailed).
            part.abort()
            self.log.error("snapshot_download_rejected", snapshot=[a.snapshot_id.end_offset, a.snapshot_id.epoch],
                           error=str(exc), action="partial deleted, log kept, downloading again")
            self._follow_up.append(qa.SnapshotInstallFailed(now_ms(), a.snapshot_id, str(exc)))
            return
        self.seg_log.truncate_fully(a.snapshot_id.end_offset)
        self.digest.reset(a.snapshot_id.end_offset)
        self.snapshots.delete_before(a.snapshot_id)
        self.controller.load(load_snapshot(self.snapshots, a.snapshot_id))
        self.metrics.snapshot_load_seconds.observe(time.perf_counter() - t0)
        self.log.info("snapshot_installed", snapshot=[a.snapshot_id.end_offset, a.snapshot_id.epoch], size=a.size,
                      seconds=round(time.perf_counter() - t0, 4))

    def _maybe_snapshot(self) -> None:
        if self._snapshot_task is not None or self._stopping:
            return
        if self.controller.records_since_snapshot < self.cfg.snapshot_min_records:
            return
        end_offset = self.controller.applied_offset
        epoch = self.core.epochs.epoch_for_offset(end_offset - 1)
        snap_id = m.SnapshotId(end_offset, epoch)
        if self.snapshots.size(snap_id) is not None:
            return
        frozen = self.controller.state.copy()  # taken on the loop; records inside are immutable
        self.controller.snapshot_taken(end_offset)
        self._snapshot_task = asyncio.get_running_loop().create_task(self._write_snapshot(snap_id, frozen))

    async def _write_snapshot(self, snap_id: m.SnapshotId, frozen) -> None:
        t0 = time.perf_counter()
        try:
            result = await asyncio.to_thread(write_controller_snapshot, self.snapshots, frozen, snap_id,
                                             int(time.time() * 1000), self.cfg.cluster_id)
            size = result.size_bytes
        except Exception as exc:
            self.log.error("snapshot_write_failed", snapshot=[snap_id.end_offset, snap_id.epoch], error=str(exc))
            return
        finally:
            self._snapshot_task = None
        seconds = time.perf_counter() - t0
        self.metrics.snapshot_generation_seconds.observe(seconds)
        self.metrics.snapshot_bytes.set(size)
        self.log.info("snapshot_created", snapshot=[snap_id.end_offset, snap_id.epoch], size=size, seconds=round(seconds, 4))
        self._step(qa.SnapshotCreated(now_ms(), snap_id))


def peer_host(peer: str) -> str:
    """The address part of "host:port" (what an ACL's host field names)."""
    return peer.rpartition(":")[0] or peer


class _CommandToken:
    __slots__ = ("conn", "correlation_id")

    def __init__(self, conn, correlation_id: int):
        self.conn = conn
        self.correlation_id = correlation_id


def build_command(controller: Controller, command: str, args: dict) -> list[bytes]:
    """Records for one controller command; CommandError if the state refuses it."""
    if command == "create_topic":
        return controller.create_topic(str(args["name"]), int(args["partitions"]), int(args["replication_factor"]))
    if command == "delete_topic":
        return controller.delete_topic(str(args["name"]))
    if command == "register_broker":
        endpoints = [(str(n), str(h), int(p)) for n, h, p in args.get("endpoints", [])]
        return controller.register_broker(int(args["broker_id"]), endpoints, args.get("rack"))
    if command == "unregister_broker":
        return controller.unregister_broker(int(args["broker_id"]))
    if command == "fence_broker":
        return controller.fence_broker(int(args["broker_id"]))
    if command == "unfence_broker":
        return controller.unfence_broker(int(args["broker_id"]))
    if command == "add_acl":
        return controller.add_acl(args)
    if command == "remove_acl":
        return controller.remove_acl(args)
    if command == "set_config":
        value = args.get("value")
        return controller.set_config(int(args["resource_type"]), str(args["resource_name"]), str(args["name"]),
                                     None if value is None else str(value))
    raise CommandError(f"unknown controller command {command!r}")
