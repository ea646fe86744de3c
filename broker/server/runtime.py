"""The asyncio broker: a thin driver around the pure quorum core.

Everything that decides anything lives in ``metalog.broker.quorum.core``. This module
only moves bytes and time: it feeds the core events (requests from the wire,
responses from peers, ticks, flush completions, client appends) and executes
the actions the core returns, in order, following the rules in
``metalog.broker.quorum.api``:

    persist (quorum-state fsync, append, truncate)  ->  send / respond  ->
    flush (async, group commit)  ->  apply committed records to the controller

so nothing is acknowledged before it is durable (the core counts only
flushed offsets). Flushes run in a worker thread while the loop keeps
appending and a leader's records travel to the followers (a follower syncs
on the loop thread: see _start_flush); one fdatasync covers every append
that happened before it started (group commit). Client
Produce requests are batched adaptively: when the disk is idle they are
appended at the end of the loop turn they arrived in; while a flush runs
they wait and become one batch when it completes (or after
``append_linger_ms`` if that is set above 0).

The binary protocol is served by ``metalog.broker.net.server``; the HTTP admin API by
``metalog.broker.server.admin``. The parts that are not driving the core live beside it:
group commit's policy in ``metalog.storage.group_commit``, controller commands in
``metalog.broker.controller.commands``, snapshot timing in ``metalog.broker.server.snapshot_policy``
(downloads and writing in ``metalog.broker.server.snapshot_work``), boot-time recovery of the
data dir in ``metalog.broker.server.recovery``, the authorization gate in ``metalog.broker.server.gate``
and the leader's consistency check in ``metalog.broker.server.consistency_check``.

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
import concurrent.futures
import dataclasses
import os
import random
import time
import traceback
from typing import Any

import msgspec

from metalog.broker.controller import acl as authz
from metalog.broker.server import commit_trace
from metalog.broker.server import consistency
from metalog.broker.server.clocks import SystemClock, now_ms, wall_clock_ms
from metalog.broker.server.config import BrokerConfig
from metalog.broker.server.consistency import LogDigest
from metalog.broker.server.consistency_check import ConsistencyChecker
from metalog.broker.controller.commands import CommandQueue, CommandToken, LeaderView
from metalog.broker.server.gate import Gate
from metalog.broker.server.gc_watch import GcWatch
from metalog.broker.server.idempotence import ProducerGuard, ProducerIdAllocator, refusal, split_by_producer, validate_produce
from metalog.broker.server.recovery import no_copy_message, recover_local_state
from metalog.broker.server.metrics import IDLE_SAMPLE_S, BrokerMetrics, RaftView
from metalog.broker.net.channel import NetError, PeerPool
from metalog.broker.net.server import Connection, ListenerLimits, Server, serve
from metalog.broker.quorum import api as qa
from metalog.broker.quorum.answers import api_versions_response, check_cluster_id
from metalog.broker.quorum.core import QuorumCore
from metalog.broker.quorum.env import Environment
from metalog.broker.server.snapshot_work import SnapshotWork
from metalog.broker.net.tls import INSECURE_DETAIL
from metalog.protocol import messages as m
from metalog.protocol.apis import APIS, REQUEST_API_KEY, ApiKey
from metalog.protocol.codec import ProtocolError
from metalog.protocol.errors import Errors
from metalog.storage.batch import CorruptBatchError
from metalog.storage.epochs import EpochHistory, write_checkpoint
from metalog.storage.errors import CorruptionReport, LogWriteError, StorageError
from metalog.storage.group_commit import Arm, GroupCommit
from metalog.storage.producer_state import Check, Verdict
from metalog.storage.segments import SegmentedLog
from metalog.storage.scrub import Scrubber
from metalog.storage.snapshot import SnapshotStore

PARTITION_DIR = "__cluster_metadata-0"
APPLY_BYTES_PER_STEP = 4 << 20  # bound the committed bytes applied per loop turn
FETCHED_CORRUPT_WARN_INTERVAL_MS = 1000  # at most one fetched_batch_corrupt warning per second


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
        self.group_commit = GroupCommit(cfg.storage.append_linger_ms, cfg.storage.append_batch_records_max)
        # fdatasyncs run here, one at a time (group commit never overlaps them).
        self._flush_executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="flush")
        # Old snapshot and segment files, renamed .deleted on the loop, are
        # unlinked here: a 150 MB unlink held the loop about 30 ms. A few per
        # snapshot, so the queue is bounded by the files there are; boot
        # removes any left over.
        self._unlink_executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="unlink")
        self._ticking_now = False  # inside the immediate Tick of _schedule_timer
        self._flush_start_wanted = False  # a FlushLog of the current step, started when the step ends
        self._flushes_abandoned = False  # stop() is past its drain: completions are no longer fed
        self._linger_handle: asyncio.Handle | None = None  # group commit's linger timer or call_soon
        self.snapshot_work = SnapshotWork(self, cfg.storage.snapshot_min_records, now_ms, feed=self._snapshot_event,
                                          generation=cfg.storage.snapshot_generation,
                                          cpu_share=cfg.storage.snapshot_cpu_share)
        self._bg_tasks: set[asyncio.Task] = set()
        self._last_exposed: tuple | None = None
        self._voter_set_seen: Any = None  # the core's voter set the peers and the gate were last given
        self._leader_endpoints_seen: Any = None  # the core's leader_endpoints last applied to the peers
        self._idle_timer: asyncio.TimerHandle | None = None  # poll-idle-ratio sampling
        self._stopping = False
        self.commands = CommandQueue()
        self.fatal: str | None = None
        self._follow_up: list[qa.Event] = []  # fed right after the current step's actions
        self._executing = False  # inside the action loop of a step
        # Why /health answers "degraded" (503) while the broker still serves:
        # key -> human-readable reason (corruption found, quarantine, divergence ...).
        self.health_problems: dict[str, str] = {}
        self._corruption_seen: set[tuple[str, int]] = set()
        self._boot_corruption: CorruptionReport | None = None  # see _rebuild_producers
        # Warnings about damaged batches in fetch answers: rate-limited (_on_fetched_corrupt).
        self._fetched_corrupt_warned_ms = -FETCHED_CORRUPT_WARN_INTERVAL_MS
        self._fetched_corrupt_suppressed = 0
        # Set when a write or fsync failed: writes are answered KAFKA_STORAGE_ERROR.
        self.storage_error: str | None = None
        # Produce tokens handed to the core and not yet answered (bounded by
        # the connections' in-flight limits): answered KAFKA_STORAGE_ERROR if
        # the disk fails before the core acknowledges them.
        self._unanswered_produce: set = set()
        # Idempotent produce (metalog.broker.server.idempotence): the producer state at the log
        # end, the queued idempotent requests by token (each becomes its own
        # batch), and the producer ids this node hands out while it leads.
        self.producers = ProducerGuard(cfg.storage.producer_id_expiration_ms)
        self._idempotent: dict[Any, m.ProduceRequest] = {}
        self.producer_ids = ProducerIdAllocator()
        self._producers_expired_at_ms = 0
        self.scrubber: Scrubber | None = None
        self.gc_watch: GcWatch | None = None
        self._consistency_task: asyncio.Task | None = None
        self.stopped = asyncio.Event()
        self.server: Server | None = None
        self.admin_runner = None
        self.tls: Any = None  # metalog.broker.net.tls.TlsFiles, None in insecure mode
        # Authorization is on exactly when TLS is: without TLS every peer is
        # ANONYMOUS and no identity can be checked (insecure mode, opt-in).
        self.authz_enabled = cfg.tls_enabled
        self.super_users = frozenset(cfg.security.super_users)
        self.gate: Gate | None = None  # built at start, from authz_enabled then
        self.admin_denials_logged: set[tuple] = set()  # see metalog.broker.server.admin
        # Commit-path timestamps for `metalog bench --profile-commit`; None
        # (nothing recorded) unless the bench turned it on (metalog.broker.server.commit_trace).
        self.trace = commit_trace.from_env(cfg.node_id)
        self._trace_fetchers: dict[Any, int] = {}  # parked/served Fetch token -> replica id (trace only)

    # ------------------------------------------------------------------ boot
    async def start(self) -> None:
        cfg = self.cfg
        # An exception no one retrieves (a task, a loop callback) is a fatal
        # error, not a line on stderr.
        asyncio.get_running_loop().set_exception_handler(self._loop_exception)
        local = recover_local_state(cfg, self.part_dir, self.log, self.metrics)
        self.seg_log, self.snapshots, self.controller = local.seg_log, local.snapshots, local.controller
        self.qs_file = local.qs_file
        self._rebuild_producers()
        self.gate = Gate(enabled=self.authz_enabled, voters=frozenset(self.voters), super_users=self.super_users,
                         controller_state=lambda: self.controller.state, metrics=self.metrics, log=self.log)
        self.health_problems.update(local.health_problems)
        self._corruption_seen |= local.corruption_seen
        view, qs = local.view, local.qs
        t0 = time.perf_counter()
        self.digest = LogDigest.build(self.seg_log)
        self.log.info("log_digest_built", batches_from=self.digest.first_base, end_offset=self.digest.end_offset,
                      seconds=round(time.perf_counter() - t0, 4))
        self.directory_id = local.directory_id
        # The core knows this replica as (node id, directory id) (KIP-853).
        quorum_cfg = dataclasses.replace(cfg.quorum, directory_id=local.directory_id)
        self.core = QuorumCore(quorum_cfg, view, _Reader(self.seg_log, self.snapshots), qs,
                               Environment(SystemClock(), random.Random()))
        self.metrics.bind_raft_view(self._raft_view)
        self._sample_loop_idle()
        if cfg.tls_enabled:
            from metalog.broker.net.tls import TlsFiles

            # Raises TlsConfigError (a ValueError: "refusing to start") for unreadable or mismatched files.
            self.tls = TlsFiles(cfg.tls_paths(), check_interval_s=cfg.security.ssl_reload_check_ms / 1000,
                                logger=self.log)
        else:
            self.log.warning("insecure_mode", security_protocol=cfg.security.security_protocol,
                             detail=INSECURE_DETAIL)
        self.peers = PeerPool(
            {nid: (ep.host, ep.port) for nid, ep in self.voters.items() if nid != cfg.node_id},
            client_id=f"metalog-{cfg.node_id}",
            max_frame_bytes=cfg.network.max_frame_bytes,
            connect_timeout_ms=cfg.network.connect_timeout_ms,
            reconnect_backoff_max_ms=cfg.network.reconnect_backoff_max_ms,
            tls=self.tls,
        )
        self._react_to_boot_corruption()
        if self.fatal is not None:
            return  # no other copy of the damaged data: metalog.broker.server.main exits (the fatal event is logged)
        ep = cfg.listen_endpoint()
        limits = ListenerLimits(
            ssl_handshake_timeout_ms=cfg.security.ssl_handshake_timeout_ms,
            connections_max_idle_ms=cfg.network.connections_max_idle_ms,
            max_connections=cfg.network.max_connections,
            max_connections_per_ip=cfg.network.max_connections_per_ip,
            failed_connections_before_backoff=cfg.network.failed_connections_before_backoff,
            failed_connection_backoff_ms=cfg.network.failed_connection_backoff_ms,
            failed_connection_backoff_max_ms=cfg.network.failed_connection_backoff_max_ms,
        )
        self.server = await serve(ep.host, ep.port, self._on_request,
                                  max_frame_bytes=cfg.network.max_frame_bytes, logger=self.log, tls=self.tls,
                                  limits=limits)
        if cfg.admin_endpoint() is not None:
            from metalog.broker.server.admin import start_admin

            self.admin_runner = await start_admin(self, cfg.admin_endpoint())
        if not self.authz_enabled:
            self.log.warning("authorization_disabled", security_protocol="PLAINTEXT",
                             detail="every connection is User:ANONYMOUS with super-user rights: anyone who can "
                                    "reach the port can act as a replica, write and change ACLs")
        self.log.info(
            "broker_started", listen=str(ep), security_protocol=cfg.security.security_protocol,
            directory_id=self.directory_id,
            voters={k: str(v) for k, v in self.voters.items()},
            log_start_offset=self.seg_log.log_start_offset, log_end_offset=self.seg_log.log_end_offset,
            epoch=self.core.epoch, role=str(self.core.role),
        )
        self._step(qa.Tick(now_ms(), wall_clock_ms()))
        if cfg.storage.consistency_check_interval_ms > 0:
            self._consistency_task = asyncio.get_running_loop().create_task(ConsistencyChecker(self).run())
            self._consistency_task.add_done_callback(self._task_done)
        loop = asyncio.get_running_loop()
        self.scrubber = Scrubber(
            self.seg_log, self.snapshots, cfg.storage.log_scrub_bytes_per_s,
            # Called on the scrubber thread: the report is handled on the loop.
            lambda report: loop.call_soon_threadsafe(self._on_corruption, report, "scrub"),
            logger=self.log, metrics=self.metrics, idle_wait_ms=cfg.storage.log_scrub_idle_wait_ms)
        self.scrubber.start()
        self.gc_watch = GcWatch(self.metrics.gc_pause_seconds, self.log)
        self.gc_watch.install(young_threshold=cfg.gc_young_threshold)

    def _snapshot_event(self, event: qa.Event) -> None:
        """SnapshotWork's events to the core; a new snapshot file also wakes
        the scrubber, which reads it soon instead of at its next pass."""
        if type(event) is qa.SnapshotCreated and self.scrubber is not None:
            self.scrubber.notify()
        self._step(event)

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

    def _on_fetched_corrupt(self, a: qa.FetchedBatchCorrupt) -> None:
        """A fetch answer held a damaged batch (the core dropped it and
        fetches it again): counted every time, one warning per batch but at
        most one per FETCHED_CORRUPT_WARN_INTERVAL_MS, naming how many were
        not logged since -- a leader that keeps sending the same damage must
        not flood the log. Not a disk problem: no quarantine, /health unchanged."""
        self.metrics.corrupt_batches.labels(source="fetched").inc()
        now = now_ms()
        if now - self._fetched_corrupt_warned_ms < FETCHED_CORRUPT_WARN_INTERVAL_MS:
            self._fetched_corrupt_suppressed += 1
            return
        self.log.warning("fetched_batch_corrupt", leader_id=self.core.leader_id if self.core else None,
                         epoch=a.fetch_epoch, offset=a.base_offset, reason=a.reason,
                         suppressed=self._fetched_corrupt_suppressed, action="dropped; fetching it again")
        self._fetched_corrupt_warned_ms = now
        self._fetched_corrupt_suppressed = 0

    def _react_to_corruption(self, report: CorruptionReport, source: str) -> None:
        """Issue 12 item 4: quarantine through the storage and tell the core
        (LogQuarantined): a leader resigns, a voter abstains until it has
        re-replicated past the end it had. With no other copy (one voter) the
        broker stops instead: truncating would lose committed records."""
        if report.path.endswith(".checkpoint"):
            self._snapshot_corrupt(report)
            return
        if len(self.voters) == 1 and self.cfg.node_id in self.voters:
            self._fatal("corruption_no_other_copy", no_copy_message(report, self.cfg.data_dir),
                        **report.as_log_fields())
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
        self._rebuild_producers()
        self.health_problems["quarantine"] = (
            f"log cut to {self.seg_log.log_end_offset} after corruption; not voting until the log "
            f"reaches {state.must_reach_offset} again")
        self._feed(qa.LogQuarantined(now_ms(), self.seg_log.log_end_offset, state.must_reach_offset))

    def _snapshot_corrupt(self, report: CorruptionReport) -> None:
        """A snapshot failed verification: keep it for the operator as .corrupt
        (never deleted), never serve it; a leader steps down (a LogQuarantined
        that cuts nothing: it resigns and votes again at once) so that a replica
        with a sound snapshot leads."""
        try:
            os.replace(report.path, report.path + ".corrupt")
        except FileNotFoundError:
            pass
        if self.core.is_leader:
            end = self.core.log_end_offset
            self._feed(qa.LogQuarantined(now_ms(), end, end))

    @property
    def stopping(self) -> bool:
        return self._stopping

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
            await self._drain_background(timeout_s=min(1.0, self.cfg.quorum.request_timeout_ms / 1000))
        if self._timer:
            self._timer.cancel()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        if self.server is not None:
            self.server.close()
        if self.admin_runner is not None:
            await self.admin_runner.cleanup()
        self._flushes_abandoned = True
        me = asyncio.current_task()
        for task in list(self._bg_tasks):
            if task is not me:  # stop() itself runs as a background task after a failure
                task.cancel()
        if self._consistency_task is not None:
            self._consistency_task.cancel()
        await self.snapshot_work.wait(timeout_s=10)
        await self.peers.close()
        if self.scrubber is not None:
            await asyncio.to_thread(self.scrubber.stop)
        if self.gc_watch is not None:
            self.gc_watch.remove()
        if graceful and self.fatal is None:
            await asyncio.to_thread(self.seg_log.flush)
            self.seg_log.close()
        self._flush_executor.shutdown(wait=False)
        self._unlink_executor.shutdown(wait=False)  # a file not unlinked yet is boot's to remove
        self.log.info("broker_stopped", graceful=graceful)
        if self.trace is not None:
            try:
                self.trace.dump()
            except OSError as exc:
                self.log.warning("commit_trace_not_written", path=self.trace.path, error=str(exc))

    async def _drain_background(self, timeout_s: float) -> None:
        if self._bg_tasks:
            await asyncio.wait(list(self._bg_tasks), timeout=timeout_s)

    # ------------------------------------------------------------- the step
    def _step(self, event: qa.Event) -> None:
        self._step_once(event)
        if self._flush_start_wanted and self.fatal is None:
            # FlushLog of this step (see _request_flush): the step's sends are out.
            self._flush_start_wanted = False
            self._start_flush()

    def _step_once(self, event: qa.Event) -> None:
        if self.fatal is not None or self.core is None:
            return
        trace = self.trace
        if trace is not None:
            hw_before = self.core.high_watermark
        try:
            actions = self.core.step(event)
        except Exception as exc:  # noqa: BLE001 - any refusal is fatal, never swallowed
            # A driver bug the core refused (it validates its inputs): stop
            # rather than run on with a core and a disk that may disagree.
            self._fatal("core_step_failed", f"core refused {type(event).__name__}: {exc}",
                        event_type=type(event).__name__, exc=exc)
            return
        if trace is not None and self.core.is_leader and self.core.high_watermark != hw_before:
            trace.mark("hw", self.core.high_watermark)
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

    def _feed(self, event: qa.Event) -> None:
        """Step the core now, or, if it is mid-step, right after its actions."""
        if self._executing:
            self._follow_up.append(event)
        else:
            self._step(event)

    def _fatal(self, cause: str, reason: str, exc: BaseException | None = None, **fields) -> None:
        """Fail-stop: ONE structured `fatal` event, then exit code 4 (metalog.broker.server.main).
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
            self._send_now(a)
        elif t is qa.Respond:
            token = a.token
            self._unanswered_produce.discard(token)
            if type(token) is CommandToken:
                self._send_answers([self.commands.done(token, a.response)])
            else:
                conn, correlation_id = token
                response = a.response
                if type(response) is m.DescribeQuorumResponse and response.error_code == 0:
                    response = msgspec.structs.replace(response, nodes=self._voter_nodes())
                conn.send_response(correlation_id, response)
                if self.trace is not None:
                    self._trace_respond(token, response)
        elif t is qa.AppendBatches:
            if self.snapshot_work.downloading:
                self.snapshot_work.abandon_downloads()
            try:
                headers = self.seg_log.append(a.data)
            except LogWriteError as exc:
                # The core already counts these records: we cannot go on with a
                # log that disagrees with it. Fail-stop (Kafka takes the log dir
                # offline); the log itself holds no partial batch.
                self._storage_failed(f"append failed: {exc}", exc)
                return
            if self.trace is not None:
                self.trace.mark("append", a.next_offset, a.base_offset)
            # The log-end table the leader checks produces against. Each batch
            # is applied once more, on purpose, to a second table: the
            # controller's committed copy (ControllerState.producers, at apply),
            # which snapshots carry and a truncation rebuilds this one from
            # (_rebuild_producers) -- the log end may be cut, the committed copy never.
            self.producers.on_append(headers)
            self.metrics.appended_bytes.inc(len(a.data))
            self.metrics.raft.on_append(self.core.is_leader, a.base_offset, a.next_offset)
            self.digest.append_headers(headers)
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
            self._rebuild_producers()  # batches past the cut no longer count
        elif t is qa.WriteEpochCheckpoint:
            write_checkpoint(os.path.join(self.part_dir, "leader-epoch-checkpoint"), EpochHistory(a.entries))
        elif t is qa.WriteSnapshotChunk:
            try:
                self.snapshot_work.write_chunk(a)
            except OSError as exc:
                # A full disk (ENOSPC, EFBIG) or a failing one: fail-stop as for
                # an append, after deleting the partial so that its space is
                # free for the restart, which downloads again.
                self.snapshot_work.abandon_downloads()
                self._storage_failed(f"snapshot download {a.snapshot_id.end_offset}-{a.snapshot_id.epoch}: "
                                     f"write of {len(a.data)} bytes at position {a.position} failed: "
                                     f"{exc.strerror or exc}", exc)
                return
        elif t is qa.InstallSnapshot:
            failed = self.snapshot_work.install(a)
            if failed is not None:
                self._follow_up.append(failed)  # the contract: before any other event
            else:
                self._rebuild_producers()  # the snapshot's producers, nothing after it
                if self.scrubber is not None:
                    self.scrubber.notify()  # a new snapshot file: read it soon
        elif t is qa.AdvanceLogStart:
            self.seg_log.advance_log_start(a.log_start_offset, unlink=self.unlink_later)
            self.digest.advance_start(a.log_start_offset)
            covering = [sid for sid in self.snapshots.list() if sid.end_offset <= a.log_start_offset]
            if covering:
                self.snapshots.delete_before(covering[-1], unlink=self.unlink_later)
            self.log.info("log_start_advanced", log_start_offset=a.log_start_offset)
        elif t is qa.Fatal:
            self._fatal("invariant_breach", a.reason)
        elif t is qa.ClearQuarantine:
            self.seg_log.clear_quarantine()
            self.health_problems.pop("quarantine", None)
            self.log.info("quarantine_cleared", must_reach_offset=a.must_reach_offset,
                          log_end_offset=self.seg_log.log_end_offset)
        elif t is qa.FetchedBatchCorrupt:
            self._on_fetched_corrupt(a)
        elif t is qa.CorruptionFound:
            report = getattr(a.error, "report", None)
            if report is None:
                report = CorruptionReport("", -1, None, None, None, None, str(a.error))
            self._on_corruption(report, "fetch")
        else:  # pragma: no cover - the contract is closed
            raise AssertionError(f"unknown action {a!r}")

    def _after_step(self) -> None:
        if self._flush_start_wanted and self.fatal is None and not self.core.is_leader:
            # A follower syncs on this thread, and its next Fetch (which is
            # what lets the leader commit) waits for the sync: sync before
            # applying what this step's HW committed, not after.
            self._flush_start_wanted = False
            self._start_flush()
        core = self.core
        if core.voter_set is not self._voter_set_seen:
            self._on_voter_set(core.voter_set)
            self._leader_endpoints_seen = None  # the set's endpoints were just applied: re-apply the leader's
        hint = core.leader_endpoints
        if hint is not None and hint is not self._leader_endpoints_seen:
            # KIP-853: our leader told us where it listens (BeginQuorumEpoch);
            # its entry in our voter set may still name an old address.
            self._leader_endpoints_seen = hint
            leader_id, _epoch, endpoints = hint
            if leader_id != self.cfg.node_id and endpoints:
                _name, host, port = endpoints[0]
                self.peers.set_endpoint(leader_id, host, port)
        exposed = (str(core.role), core.epoch, core.leader_id)
        if exposed != self._last_exposed:
            self._last_exposed = exposed
            self.log.info("role_changed", role=exposed[0], epoch=core.epoch, leader_id=core.leader_id,
                          high_watermark=core.high_watermark)
            self.metrics.set_role(exposed[0], core.epoch)
            self.metrics.raft.on_role(exposed[0])
        hw = core.high_watermark
        if core.is_leader:
            self.metrics.raft.on_high_watermark(hw)
        if hw is not None and hw > self.controller.applied_offset:
            self._apply_committed(hw)
        if self.commands.runnable:
            self._pump_commands()
        self._release_duplicates()
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
                # The read checked every CRC (the disk boundary): not again here.
                self.controller.apply_batches(data, end_offset=hw, verify=False)
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
        self.snapshot_work.maybe_start()

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
        # Queued here, or handed to the core and not acknowledged (their batch
        # may not be durable): none of them will be acknowledged by this process.
        tokens = self.group_commit.drop_all() + list(self._unanswered_produce) + self.producers.drop_parked()
        self._unanswered_produce.clear()
        self._idempotent.clear()
        for conn, cid in tokens:
            conn.send_response(cid, m.ProduceResponse(error_code=Errors.KAFKA_STORAGE_ERROR, error_message=message))
        self._send_answers(self.commands.fail_all(Errors.KAFKA_STORAGE_ERROR, message))

    # ------------------------------------------------------------ metrics
    def _raft_view(self) -> RaftView | None:
        """Kafka's instantaneous raft metrics, read at scrape time."""
        core = self.core
        if core is None:
            return None
        role = str(core.role)
        if role in ("leader", "candidate"):
            vote = self.cfg.node_id  # Kafka: a leader or candidate has voted for itself
        elif role == "voted":
            vote = core.voted_id
        else:
            vote = -1
        known = set(self.voters)
        return RaftView(
            state=role, leader_id=core.leader_id if core.leader_id >= 0 else -1, voted_id=vote,
            epoch=core.epoch, high_watermark=core.high_watermark, log_end_offset=core.log_end_offset,
            log_end_epoch=core.log.last_epoch(),
            unknown_voter_connections=sum(1 for v in core.config.voters if v != self.cfg.node_id and v not in known))

    def _sample_loop_idle(self) -> None:
        """Sample the loop thread's CPU time for poll-idle-ratio-avg (metalog.broker.server.metrics)."""
        self.metrics.loop_idle.sample()
        if not self._stopping:
            self._idle_timer = asyncio.get_running_loop().call_later(IDLE_SAMPLE_S, self._sample_loop_idle)

    # ------------------------------------------------------------ timers
    def _schedule_timer(self) -> None:
        deadline = self.core.next_deadline_ms
        if deadline is None or self._stopping:
            return
        if self._timer is not None and self._timer_deadline == deadline:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        delay_ms = deadline - now_ms()
        if delay_ms <= 0 and not self._ticking_now:
            # Due already -- typically replica fetches parked at the old log
            # end, woken by this step's append: tick now rather than a timer
            # hop later, so the records reach the followers while our own
            # fsync runs (Kafka's and etcd's leaders write to followers in
            # parallel with their disk write; the HW still counts our log only
            # up to its flushed end). One immediate tick per step at most: a
            # deadline that stays due goes through the timer below.
            self._timer_deadline = None
            self._ticking_now = True
            try:
                self._step(qa.Tick(now_ms(), wall_clock_ms()))
            finally:
                self._ticking_now = False
            return
        loop = asyncio.get_running_loop()
        delay_s = max(0.0, delay_ms / 1000)
        self._timer_deadline = deadline
        self._timer = loop.call_later(delay_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_deadline = None
        self._step(qa.Tick(now_ms(), wall_clock_ms()))

    # ------------------------------------------------------------ flushing
    def _request_flush(self) -> None:
        if self.group_commit.request_flush():
            if self._executing:
                # Started at the end of this step, after its sends (and the
                # immediate Tick's, which answers the parked replica fetches
                # this append woke): the flush thread's start then does not
                # compete for the GIL with the encryption of those answers.
                self._flush_start_wanted = True
            else:
                self._start_flush()

    def _start_flush(self) -> None:
        """Start one fdatasync now, in this loop turn (not a task that starts
        a turn later).

        A leader hands it to the flush thread: it runs while the records
        travel to the followers and new produces are read, and its completion
        comes back with one call_soon_threadsafe (_flush_done). A follower or
        observer syncs on the loop thread, as Kafka's raft thread does: its
        next Fetch reports the flushed end, so it has nothing to do on the
        commit path until the sync ends, and the two thread hand-offs cost
        more than they overlap (issue 19 item 6: docs/bench.md)."""
        gc = self.group_commit
        gc.flush_starting()
        if self.trace is not None:
            self.trace.mark("flush_start", self.seg_log.log_end_offset)
        started_s = time.perf_counter()
        if not self.core.is_leader:
            done: concurrent.futures.Future = concurrent.futures.Future()
            try:
                done.set_result(self.seg_log.flush())
            except (OSError, StorageError) as exc:
                done.set_exception(exc)  # _flush_done's fail-stop, as from the thread
            except Exception as exc:  # noqa: BLE001 - as from the thread: fatal, never swallowed
                gc.flush_stopped()
                self._fatal("flush_failed", f"flush raised {type(exc).__name__}: {exc}", exc=exc)
                return
            self._flush_done(done, started_s)
            return
        loop = asyncio.get_running_loop()

        def completed(fut) -> None:  # on the flush thread (or here, if already done)
            if not loop.is_closed():
                loop.call_soon_threadsafe(self._flush_done, fut, started_s)

        self._flush_executor.submit(self.seg_log.flush).add_done_callback(completed)

    def unlink_later(self, path: str) -> None:
        """Unlink a file already out of every store's view (renamed .deleted) on the unlink thread."""
        log = self.log

        def unlink() -> None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:  # left for boot's cleanup; the file is out of use already
                log.error("unlink_failed", path=path, error=str(exc), action="boot removes it")

        self._unlink_executor.submit(unlink)

    def _flush_done(self, fut, started_s: float) -> None:
        gc = self.group_commit
        if self._flushes_abandoned or self.fatal is not None:
            gc.flush_stopped()  # stop() flushes on its own; a failed broker acknowledges nothing
            return
        try:
            flushed = fut.result()
        except (OSError, StorageError) as exc:
            gc.flush_stopped()
            self._storage_failed(f"flush failed: {exc}", exc)
            return
        # Anything else escapes to the loop's exception handler: fatal.
        self.metrics.flush_seconds.observe(time.perf_counter() - started_s)
        if self.trace is not None:
            self.trace.mark("flush_done", flushed)
        self._step(qa.FlushCompleted(now_ms(), flushed))
        if gc.flush_completed():
            self._flush_produce()  # writes that waited for this flush: one batch
        if self.fatal is None and gc.flush_again():
            self._start_flush()
        elif self.fatal is not None:
            gc.flush_stopped()

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

    def _on_voter_set(self, voter_set) -> None:
        """KIP-853: the core's voter set changed (or is first seen). Voters
        named by a VotersRecord are reached at the first endpoint it gives
        them; the gate's voter-only RPCs follow the set."""
        self._voter_set_seen = voter_set
        for nid, endpoints in voter_set.endpoints.items():
            if nid != self.cfg.node_id and endpoints:
                _name, host, port = endpoints[0]
                self.peers.set_endpoint(nid, host, port)
        if self.gate is not None:
            self.gate.voters = frozenset(voter_set.ids)
            self.gate.voters_in_log = voter_set.kraft_version == 1
        if voter_set.kraft_version > 0:
            self.log.info("voter_set", voters=list(voter_set.ids), kraft_version=voter_set.kraft_version,
                          directory_ids=dict(voter_set.directory_ids),
                          endpoints={nid: [f"{name}={host}:{port}" for name, host, port in eps]
                                     for nid, eps in voter_set.endpoints.items()})

    def _send_now(self, a: qa.SendRequest) -> None:
        """Write the request now if its connection is up (a follower's next
        Fetch leaves before this turn applies committed records or answers
        anyone else); the answer is awaited by a background task."""
        api_key = REQUEST_API_KEY[type(a.request)]
        trace = self.trace
        if trace is not None and api_key is ApiKey.FETCH:
            trace.mark("fetch_action", a.request.fetch_offset, a.destination)
        try:
            channel = self.peers.channel(a.destination)
        except KeyError:
            answer = None
        else:
            answer = channel.request_eager(api_key, a.request, a.timeout_ms)
            if trace is not None and api_key is ApiKey.FETCH:
                trace.mark("fetch_sent", a.request.fetch_offset, a.destination)
        self._spawn(self._send(a, answer))

    async def _send(self, a: qa.SendRequest, answer) -> None:
        if answer is None:
            # A voter the log names without an endpoint we know: nothing to send
            # to, as if it were unreachable (the core retries or gives up).
            self._step(qa.RequestFailed(now_ms(), a.request_id, a.destination,
                                        f"no address known for node {a.destination}"))
            return
        trace = self.trace
        try:
            response = await answer
        except (NetError, ProtocolError, OSError, asyncio.TimeoutError) as exc:
            # timeouts, refused connections, resets, a peer's garbled answer;
            # anything else is a bug and escapes to _task_done (fatal).
            self._step(qa.RequestFailed(now_ms(), a.request_id, a.destination, f"{type(exc).__name__}: {exc}"))
            return
        if isinstance(response, m.ErrorResponse) and response.error_code != Errors.UNSUPPORTED_VERSION:
            # (UNSUPPORTED_VERSION reaches the core: a peer of an older build
            # refusing Vote v2 makes a prospective stand at once, KIP-996.)
            self._step(qa.RequestFailed(now_ms(), a.request_id, a.destination,
                                        f"peer answered error {response.error_code}: {response.error_message}"))
            return
        if trace is not None and type(response) is m.FetchResponse and response.records:
            received_ns = time.monotonic_ns()
            self._step(qa.ResponseReceived(now_ms(), a.request_id, a.destination, response))
            trace.mark("fetch_resp", self.core.log_end_offset, a.destination, ns=received_ns)
            return
        self._step(qa.ResponseReceived(now_ms(), a.request_id, a.destination, response))

    # ------------------------------------------------------------ inbound
    def _on_request(self, conn: Connection, header, body: m.Body) -> None:
        api_key = ApiKey(header.api_key)
        self.metrics.requests.labels(api=api_key.name).inc()
        token = (conn, header.correlation_id)
        if self.storage_error is not None and api_key in (ApiKey.PRODUCE, ApiKey.CONTROLLER_COMMAND,
                                                          ApiKey.INIT_PRODUCER_ID):
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
            denial = self.gate.check(conn, api_key, body)
            if denial is not None:
                self.gate.refuse(conn, header.correlation_id, api_key, denial)
                return
        if api_key in (ApiKey.PRODUCE, ApiKey.CONTROLLER_COMMAND, ApiKey.CONSISTENCY_CHECK,
                       ApiKey.INIT_PRODUCER_ID):
            # The core runs the same check on every request it is handed; these
            # the runtime batches or runs itself.
            wrong_cluster = check_cluster_id(self.cfg.cluster_id, body, self.core.current_leader())
            if wrong_cluster is not None:
                self.log.warning("inconsistent_cluster_id", api=api_key.name, got=body.cluster_id, peer=conn.peer)
                conn.send_response(header.correlation_id, wrong_cluster)
                return
        if api_key is ApiKey.API_VERSIONS:
            conn.send_response(header.correlation_id, api_versions_response(*self.core.finalized_kraft_version()))
        elif api_key is ApiKey.METADATA:
            resp = self.metadata_response()
            if self.authz_enabled and not self.gate.may_describe_log(conn):
                # Routing only (leader, voters), as Kafka answers a client without Describe.
                resp = msgspec.structs.replace(resp, high_watermark=m.NO_OFFSET, log_start_offset=m.NO_OFFSET,
                                               observers=[])
            conn.send_response(header.correlation_id, resp)
        elif api_key is ApiKey.PRODUCE:
            if self.trace is not None:
                self.trace.mark("produce_recv", -1)
            self._enqueue_produce(token, body)
        elif api_key is ApiKey.CONTROLLER_COMMAND:
            self._enqueue_command(token, body)
        elif api_key is ApiKey.INIT_PRODUCER_ID:
            self._init_producer_id(conn, header.correlation_id)
        elif api_key is ApiKey.CONSISTENCY_CHECK:
            conn.send_response(header.correlation_id, consistency.answer(
                body, self.voters, self.core.flushed_end_offset, self.digest))
        else:
            if self.trace is not None and api_key is ApiKey.FETCH and body.replica_id >= 0:
                self.trace.mark("fetch_recv", body.fetch_offset, body.replica_id)
                if len(self._trace_fetchers) < 4096:  # bounded; answered tokens are popped
                    self._trace_fetchers[token] = body.replica_id
            self._step(qa.RequestReceived(now_ms(), token, body))

    def _trace_respond(self, token, response) -> None:
        """Marks of an answer just written (commit trace only)."""
        t = type(response)
        if t is m.ProduceResponse and response.error_code == 0:
            self.trace.mark("produce_reply", response.base_offset)
        elif t is m.FetchResponse:
            replica = self._trace_fetchers.pop(token, -1)
            if response.records:
                self.trace.mark("fetch_answer", self.core.log_end_offset, replica)

    def authz_view(self) -> authz.AuthzView:
        """The gate's view of the committed ACLs (also the admin API's)."""
        return self.gate.view()

    def _voter_nodes(self) -> list[m.DescribeQuorumNode]:
        """DescribeQuorum's Nodes: each voter's listeners from the log's voter set
        (KIP-853), else the config's address (static voters, name CONTROLLER)."""
        voter_set = getattr(self.core, "voter_set", None)
        listeners = getattr(voter_set, "endpoints", None) or {}
        nodes = []
        for nid in sorted(self.core.voters):
            if listeners.get(nid):
                eps = [m.RaftListener(name, host, port) for name, host, port in listeners[nid]]
            elif nid in self.voters:
                eps = [m.RaftListener("CONTROLLER", self.voters[nid].host, self.voters[nid].port)]
            else:
                eps = []
            nodes.append(m.DescribeQuorumNode(nid, eps))
        return nodes

    def metadata_response(self) -> m.MetadataResponse:
        # Built by the core (metalog.broker.quorum.answers), with our voters' endpoints:
        # the config's, then (KIP-853) the log's voter set's, then where our
        # leader said it listens -- a voter added online is in no config.
        endpoints = {nid: (ep.host, ep.port) for nid, ep in self.voters.items()}
        core = self.core
        for nid, eps in core.voter_set.endpoints.items():
            if eps:
                endpoints[nid] = (eps[0][1], eps[0][2])
        if core.leader_endpoints is not None and core.leader_endpoints[2]:
            _name, host, port = core.leader_endpoints[2][0]
            endpoints[core.leader_endpoints[0]] = (host, port)
        if core.config.listeners and self.cfg.node_id in endpoints:
            # Ourselves: where we listen now (our entry may still be the old one).
            _name, host, port = core.config.listeners[0]
            endpoints[self.cfg.node_id] = (host, port)
        return core.metadata(endpoints)

    # ------------------------------------------------ group commit of writes
    def _enqueue_produce(self, token, body: m.ProduceRequest) -> None:
        if not body.records:
            conn, cid = token
            conn.send_response(cid, m.ProduceResponse(error_code=Errors.INVALID_REQUEST,
                                                      error_message="a produce request needs at least one record"))
            return
        problem = validate_produce(body)
        if problem is not None:
            conn, cid = token
            conn.send_response(cid, m.ProduceResponse(error_code=Errors.INVALID_REQUEST, error_message=problem))
            return
        if body.producer_id >= 0:
            # Judged against the producer state when its batch is formed
            # (_flush_produce), after every batch queued before it.
            self._idempotent[token] = body
        arm = self.group_commit.offer(token, body.records)
        if arm is Arm.APPEND_NOW:
            self._flush_produce()
        elif arm is Arm.LINGER:
            self._linger_handle = asyncio.get_running_loop().call_later(
                self.group_commit.linger_ms / 1000, self._flush_produce)
        elif arm is Arm.END_OF_TURN:
            self._linger_handle = asyncio.get_running_loop().call_soon(self._flush_produce)

    def _flush_produce(self) -> None:
        if self._linger_handle is not None:  # a TimerHandle or a call_soon Handle
            self._linger_handle.cancel()
            self._linger_handle = None
        batch = self.group_commit.take()
        if batch is None:
            return
        waiters, records = batch
        if self._idempotent:
            self._append_group(waiters, records)
            return
        self._unanswered_produce.update(token for token, _n in waiters)
        self.metrics.appended_records.inc(len(records))
        self._step(qa.ClientAppend(now_ms(), waiters, records, wall_clock_ms()))

    # ------------------------------------------------- idempotent produce
    def _append_group(self, waiters: list, records: list[bytes]) -> None:
        """One group commit holding idempotent requests: ONE core step (one
        append, one flush) with one batch per idempotent request (its producer
        fields in the header) and one per run of plain requests, every
        idempotent request judged against the producer state before the step.
        A producer id appears at most once per step (split_by_producer): a
        group holding two requests of one producer takes one step more."""
        core = self.core
        if self.fatal is not None or core is None:
            for token, _n in waiters:
                self._idempotent.pop(token, None)
                conn, cid = token
                conn.send_response(cid, m.ProduceResponse(error_code=Errors.BROKER_NOT_AVAILABLE))
            return
        # Every token counts as handed to the core until answered here, so a
        # storage failure in one of the steps answers the rest too.
        self._unanswered_produce.update(token for token, _n in waiters)
        records_of: dict[Any, list[bytes]] = {}
        pos = 0
        for token, n in waiters:
            records_of[token] = records[pos:pos + n]
            pos += n
        bodies = self._idempotent
        runs = split_by_producer(waiters, lambda token: bodies[token].producer_id if token in bodies else None)
        parked = False
        for run in runs:
            if self.fatal is not None:
                return  # _storage_failed answered every unanswered token
            parked |= self._append_run(run, records_of)
        if parked and self.fatal is None:
            self._release_duplicates()  # an original may be committed already

    def _append_run(self, run: list, records_of: dict[Any, list[bytes]]) -> bool:
        """One step of _append_group; True if a duplicate was parked."""
        now_wall = wall_clock_ms()
        is_leader = self.core.is_leader
        step_waiters: list = []
        step_records: list[bytes] = []
        step_producers: list[tuple[int, int, int] | None] = []
        parked = False
        for token, n in run:
            body = self._idempotent.pop(token, None)
            if body is not None and is_leader:
                check = self.producers.check(body, now_wall)
                if check.verdict is not Verdict.APPEND:
                    parked |= self._answer_unappended(token, body, check)
                    continue
                producer = (body.producer_id, body.producer_epoch, body.base_sequence)
            else:
                # Plain; or not the leader, and the core answers every waiter
                # NOT_LEADER_OR_FOLLOWER (the client retries at the leader).
                producer = None
            step_waiters.append((token, n))
            step_records.extend(records_of[token])
            step_producers.append(producer)
        if step_waiters:
            self.metrics.appended_records.inc(len(step_records))
            idempotent = any(p is not None for p in step_producers)
            self._step(qa.ClientAppend(now_ms(), step_waiters, step_records, wall_clock_ms(),
                                       producers=step_producers if idempotent else None))
        return parked

    def _answer_unappended(self, token, body: m.ProduceRequest, check: Check) -> bool:
        """A duplicate (parked until its original is committed) or a refusal;
        True if parked."""
        self._unanswered_produce.discard(token)
        conn, cid = token
        if check.verdict is Verdict.DUPLICATE:
            self.log.info("produce_duplicate", producer_id=body.producer_id, producer_epoch=body.producer_epoch,
                          base_sequence=body.base_sequence, original_base_offset=check.original.base_offset)
            if self.producers.park_duplicate(token, check.original):
                return True
            conn.send_response(cid, m.ProduceResponse(error_code=Errors.REQUEST_TIMED_OUT,
                                                      error_message="too many duplicate produces waiting"))
            return False
        self.log.warning("produce_refused", producer_id=body.producer_id, verdict=check.verdict.value,
                         reason=check.message)
        conn.send_response(cid, refusal(check))
        return False

    def _release_duplicates(self) -> None:
        core = self.core
        for (conn, cid), response in self.producers.release(core.high_watermark, core.is_leader,
                                                            core.current_leader()):
            conn.send_response(cid, response)
        now = wall_clock_ms()
        if now - self._producers_expired_at_ms >= 60_000:  # memory only: check() ignores expired ones anyway
            self._producers_expired_at_ms = now
            self.producers.table.expire(now)
            self.controller.state.producers.expire(now)

    def _init_producer_id(self, conn: Connection, correlation_id: int) -> None:
        """InitProducerId: a new id from this leader's epoch (metalog.broker.server.idempotence)."""
        core = self.core
        if not core.is_leader:
            conn.send_response(correlation_id, m.InitProducerIdResponse(
                error_code=Errors.NOT_LEADER_OR_FOLLOWER, current_leader=core.current_leader(),
                error_message=f"node {self.cfg.node_id} is not the leader"))
            return
        conn.send_response(correlation_id, self.producer_ids.allocate(core.epoch, core.current_leader()))

    def _rebuild_producers(self) -> None:
        """The producer state at the log end: the controller's committed copy
        plus the log after it (after a start, a truncation, a snapshot install).

        A read from disk, so every CRC is checked (integrity.md: every read);
        a header that looks sane in a batch whose CRC fails must not become a
        producer's last sequence. On a damaged batch the table stops before
        the chunk that holds it (it never names a batch the quarantine cut
        will drop: a retry would be answered with an offset that is gone), and
        the usual reaction follows: corruption_detected, quarantine from the
        damage, re-fetch; that cut rebuilds the table again from what is left.
        While booting the core does not exist yet: the reaction waits for it
        (_react_to_boot_corruption)."""
        log = self.seg_log
        damaged: list[CorruptBatchError] = []

        def read(offset: int) -> bytes:
            try:
                return log.read(max(offset, log.log_start_offset), log.log_end_offset, 1 << 20)
            except CorruptBatchError as exc:
                damaged.append(exc)
                return b""  # rebuild stops here

        self.producers.rebuild(self.controller.state.producers, read, log.log_end_offset)
        if damaged:
            if self.core is None:
                self._boot_corruption = damaged[0].report
            else:
                self._on_corruption(damaged[0].report, "producer_state")

    def _react_to_boot_corruption(self) -> None:
        """Damage the boot-time producer rebuild found: reported and reacted to
        (quarantine, or fail-stop with no other copy) once the core and the
        peers exist, before the broker serves anything."""
        report, self._boot_corruption = self._boot_corruption, None
        if report is not None:
            self._on_corruption(report, "producer_state")

    # ------------------------------------------------- controller commands
    def _enqueue_command(self, token, body: m.ControllerCommandRequest) -> None:
        conn, cid = token
        refusal = self.commands.offer(conn, cid, body)
        if refusal is not None:
            conn.send_response(cid, refusal)
        elif self.commands.runnable:
            self._pump_commands()

    def _pump_commands(self) -> None:
        core = self.core
        answers, append = self.commands.pump(self.controller, LeaderView(
            is_leader=core.is_leader, epoch=core.epoch, log_end_offset=core.log_end_offset,
            leader_id=core.leader_id if core.leader_id is not None else m.NO_LEADER))
        self._send_answers(answers)
        if append is not None:
            token, records = append
            self._step(qa.ClientAppend(now_ms(), [(token, len(records))], records, wall_clock_ms()))

    @staticmethod
    def _send_answers(answers) -> None:
        for token, response in answers:
            token.conn.send_response(token.correlation_id, response)
