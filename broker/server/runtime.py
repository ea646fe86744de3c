"""The asyncio broker: the driver around the pure quorum core.

Everything that decides anything lives in ``metalog.broker.quorum.core``. The
driver (``Broker``) only moves bytes and time: it feeds the core events
(requests from the wire, responses from peers, ticks, flush completions,
client appends) and executes the actions the core returns, in order,
following the rules in ``metalog.broker.quorum.api``:

    persist (quorum-state fsync, append, truncate)  ->  send / respond  ->
    flush (async, group commit)  ->  apply committed records to the controller

so nothing is acknowledged before it is durable (the core counts only
flushed offsets). ``Broker._execute`` is the one switch over the core's
actions; it ends in ``assert_never``, so an action type it does not handle
is a type error (tests/test_types.py).

The driver's collaborators, each in its own module and each handed only what
it uses (a Protocol or the few objects it needs):

    recovery.py           boot: the data dir recovered into what the core is built from
    inbound.py            requests from the wire, each to the one that handles it
    produce.py            Produce requests: group commit, idempotence, InitProducerId
    outbound.py           SendRequest to the peers, and where the peers are
    flushing.py           the log's fsyncs (on the loop; a thread with leader_flush_thread), the unlink thread
    timers.py             the core's next deadline, the loop-idle sampler
    corruption.py         damaged data found while running: quarantine, re-fetch, fail-stop
    snapshot_work.py      snapshot downloads and installs, our own snapshots
    maintenance.py        the scrubber, the consistency check (consistency_check.py), GC watch
    supervision.py        background tasks and the loop's exception handler (fail-stop)
    answers.py            Metadata and DescribeQuorum completed with endpoints
    admin.py              the HTTP admin API; gate.py: the authorization gate

Both ports speak Kafka's wire protocol (``metalog.broker.net.kafka_conn``,
dispatched by ``metalog.broker.server.kafka.dispatch``): ``listen`` is the
controller listener (peers, our client and CLI, --bootstrap-controller),
``kafka_listen`` the client listener; controller commands queue in
``metalog.broker.controller.commands``.

Fail-stop (issue 12): whatever this process cannot go on from safely -- an
invariant breach the core reports, a failed append or fsync, an error
applying committed records, an exception escaping any background task or
loop callback -- ends in ONE structured ``fatal`` log event (``cause``,
``reason`` and context fields) and exit code 4 (``Broker.fail``). Where a
clean rollback exists it is taken instead: a snapshot download that fails
verification is deleted, the log kept and the download retried.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import traceback
from typing import Any, assert_never

import msgspec

from metalog.broker.controller.commands import CommandQueue, CommandToken
from metalog.broker.controller.state import Controller
from metalog.broker.net.channel import PeerPool
from metalog.broker.net.guard import HANDSHAKE_METER
from metalog.broker.net.kafka_conn import answer_writes
from metalog.broker.net.listener import Server
from metalog.broker.quorum import api as qa
from metalog.broker.quorum.core import QuorumCore
from metalog.broker.quorum.env import Environment
from metalog.broker.server import commit_trace
from metalog.broker.server.answers import voter_nodes
from metalog.broker.server.clocks import SystemClock, now_ms, wall_clock_ms
from metalog.broker.server.config import BrokerConfig
from metalog.broker.server.consistency import LogDigest
from metalog.broker.server.consistency_check import ConsistencyChecker
from metalog.broker.server.corruption import CorruptionHandler
from metalog.broker.server.flushing import Flusher, Unlinker
from metalog.broker.server.gate import Gate
from metalog.broker.server.idempotence import ProducerGuard
from metalog.broker.server.inbound import RequestRouter, listener_limits
from metalog.broker.server.leader_slice import LeaderSlice
from metalog.broker.server.kafka.dispatch import start_controller_listener, start_kafka_listener
from metalog.broker.server.maintenance import Maintenance
from metalog.broker.server.metrics import BrokerMetrics, raft_view
from metalog.broker.server.outbound import Outbound, peer_pool, tls_files
from metalog.broker.server.produce import ProducePath, leader_asker, rebuild_producer_state
from metalog.broker.server.role_changes import RoleChanges
from metalog.broker.server.recovery import (PARTITION_DIR, LocalState, StartupError, no_copy_message,
                                            recover_local_state)
from metalog.broker.server.snapshot_work import SnapshotWork
from metalog.broker.server.supervision import BackgroundTasks, loop_exception_handler
from metalog.broker.server.timers import CoreTimer, IdleSampler
from metalog.protocol import messages as m
from metalog.protocol.invariants import InvariantViolation, invariant
from metalog.storage.batch import CorruptBatchError
from metalog.storage.epochs import EpochHistory, write_checkpoint
from metalog.storage.errors import CorruptionReport, LogWriteError
from metalog.storage.group_commit import GroupCommit
from metalog.storage.quorum_state import QuorumStateFile
from metalog.storage.segments import SegmentedLog
from metalog.storage.snapshot import SnapshotStore

APPLY_BYTES_PER_STEP = 4 << 20  # bound the committed bytes applied per loop turn


class _Reader:
    """The core's read-only view of the local log and snapshots (api.LogReader)."""

    def __init__(self, seg_log: SegmentedLog, snapshots: SnapshotStore):
        self.read = seg_log.read
        self.snapshot_size = snapshots.size
        self.read_snapshot = snapshots.read_chunk


def _command_queue(cfg: BrokerConfig, logger: Any) -> CommandQueue:
    """The leader's controller command queue; it logs each broker it fences for an expired session."""
    def fenced(broker_id: int, error_code: int) -> None:
        logger.info("broker_session_expired", broker_id=broker_id, fenced=error_code == 0,
                    session_timeout_ms=cfg.broker_session_timeout_ms, error_code=error_code)

    return CommandQueue(session_timeout_ms=cfg.broker_session_timeout_ms, on_session_fenced=fenced)


class Broker:
    # Built by start() from the recovered data dir; a request, a step or a
    # timer only ever runs after start() built them.
    core: QuorumCore
    seg_log: SegmentedLog
    snapshots: SnapshotStore
    controller: Controller
    qs_file: QuorumStateFile
    digest: LogDigest
    directory_id: str
    gate: Gate
    peers: PeerPool
    produce: ProducePath
    corruption: CorruptionHandler
    flusher: Flusher
    inbound: RequestRouter
    outbound: Outbound
    _timer: CoreTimer
    _idle: IdleSampler
    _maintenance: Maintenance  # started once the broker serves
    _unanswered_produce: set[Any]  # the produce path's: a Respond answers one

    def __init__(self, cfg: BrokerConfig, logger: Any):
        self.cfg = cfg
        self.cluster_id = cfg.cluster_id
        self.log = logger.bind(node=cfg.node_id)
        self.metrics = BrokerMetrics(cfg.node_id)
        self.part_dir = os.path.join(cfg.data_dir, PARTITION_DIR)
        self.voters = cfg.voter_endpoints()
        self.booted = False  # start() built the core and its collaborators
        self.group_commit = GroupCommit(cfg.storage.append_linger_ms, cfg.storage.append_batch_records_max)
        # The producer state at the log end (metalog.broker.server.idempotence), fed every append.
        self.producers = ProducerGuard(cfg.storage.producer_id_expiration_ms)
        self._unlinker = Unlinker(self.log)
        self.unlink_later = self._unlinker.unlink_later
        self.snapshot_work = SnapshotWork(self, cfg.storage.snapshot_min_records, now_ms, feed=self._snapshot_event,
                                          generation=cfg.storage.snapshot_generation,
                                          cpu_share=cfg.storage.snapshot_cpu_share)
        self._tasks = BackgroundTasks(self.fail)
        self._roles = RoleChanges(self.log, self.metrics, LeaderSlice(cfg.leader_slice_us, self.log))
        self.stopping = False
        self.fatal: str | None = None
        self._follow_up: list[qa.Event] = []  # fed right after the current step's actions
        self._executing = False  # inside the action loop of a step
        self.health_problems: dict[str, str] = {}  # why /health answers "degraded" (503): key -> reason
        # Set when a write or fsync failed: writes are answered KAFKA_STORAGE_ERROR.
        self.storage_error: str | None = None
        self.stopped = asyncio.Event()
        self.server: Server | None = None
        self.kafka_server: Server | None = None  # cfg.kafka_listen's (metalog.broker.server.kafka)
        self.admin_runner: Any = None  # aiohttp's AppRunner when the admin API is on
        self.tls: Any = None  # metalog.broker.net.tls.TlsFiles, None in insecure mode
        # Authorization is on exactly when TLS is: without TLS every peer is
        # ANONYMOUS and no identity can be checked (insecure mode, opt-in).
        self.authz_enabled = cfg.tls_enabled
        # Commit-path timestamps for `metalog bench --profile-commit`; None
        # (nothing recorded) unless the bench turned it on (metalog.broker.server.commit_trace).
        self.trace = commit_trace.from_env(cfg.node_id)

    # ------------------------------------------------------------------ boot
    async def start(self) -> None:
        # An exception no one retrieves (a task, a loop callback) is a fatal
        # error, not a line on stderr.
        asyncio.get_running_loop().set_exception_handler(loop_exception_handler(self.log, self.fail))
        local = recover_local_state(self.cfg, self.part_dir, self.log, self.metrics)
        boot_damage = self._open(local)
        if boot_damage is not None and len(self.voters) == 1 and self.cfg.node_id in self.voters:
            # No other copy, found before serving: refused as at the log's open (exit 3).
            raise StartupError(no_copy_message(boot_damage, self.cfg.data_dir))
        self._build_core(local)
        self._connect_peers()
        if boot_damage is not None:
            # Damage the boot-time producer rebuild found: quarantined now that
            # the core and the peers exist, before the broker serves anything.
            self.corruption.report(boot_damage, "producer_state")
        if self.fatal is not None:
            return  # the quarantine failed (storage_failed): metalog.broker.server.main exits with 4
        await self._serve()
        self._tick()
        self._maintenance.start(ConsistencyChecker(self, self.cfg, self.core, self.digest, self.peers, self.seg_log,
                                                   self.metrics, self.log, self.health_problems))

    def _open(self, local: LocalState) -> CorruptionReport | None:
        """Take over the recovered data dir; the producer state's damage, if any."""
        self.seg_log, self.snapshots, self.controller = local.seg_log, local.snapshots, local.controller
        self.qs_file = local.qs_file
        boot_damage = rebuild_producer_state(self.producers, self.controller.state.producers, self.seg_log)
        self.gate = Gate(enabled=self.authz_enabled, voters=frozenset(self.voters),
                         super_users=frozenset(self.cfg.security.super_users),
                         controller_state=lambda: self.controller.state, metrics=self.metrics, log=self.log)
        self.health_problems.update(local.health_problems)
        self.digest = LogDigest.build(self.seg_log, logger=self.log)
        self.directory_id = local.directory_id
        return boot_damage

    def _build_core(self, local: LocalState) -> None:
        """The core, and the collaborators that read it."""
        cfg = self.cfg
        # The core knows this replica as (node id, directory id) (KIP-853).
        quorum_cfg = dataclasses.replace(cfg.quorum, directory_id=local.directory_id)
        core = self.core = QuorumCore(quorum_cfg, local.view, _Reader(self.seg_log, self.snapshots), local.qs,
                                      Environment(SystemClock(), random.Random()))
        self.booted = True
        self.produce = ProducePath(cfg.node_id, core, self.group_commit, self.producers, self.metrics, self.log,
                                   step=self.step, failed=lambda: self.fatal is not None, ask_leader=leader_asker(self),
                                   committed_producers=lambda: self.controller.state.producers, forwards=self._tasks)
        self._unanswered_produce = self.produce.unanswered
        self.inbound = RequestRouter(self, cfg, core, gate=self.gate, authz_enabled=self.authz_enabled,
                                     produce=self.produce, commands=_command_queue(cfg, self.log), controller=self.controller,
                                     digest=self.digest, voters=self.voters, metrics=self.metrics, trace=self.trace,
                                     logger=self.log)
        self.corruption = CorruptionHandler(
            self, core, self.seg_log, self.digest, sole_voter=len(self.voters) == 1 and cfg.node_id in self.voters,
            data_dir=cfg.data_dir, metrics=self.metrics, logger=self.log, health_problems=self.health_problems,
            seen=set(local.corruption_seen))
        self.flusher = Flusher(self, self.group_commit, self.seg_log.flush, lambda: self.seg_log.log_end_offset,
                               lambda: cfg.storage.leader_flush_thread and core.is_leader, self.metrics, self.trace)
        self._timer = CoreTimer(core, self._tick, stopping=lambda: self.stopping)
        self.metrics.bind_raft_view(lambda: raft_view(core, cfg.node_id, self.voters))
        self._idle = IdleSampler(self.metrics.loop_idle, stopping=lambda: self.stopping)
        self._idle.sample()
        self._maintenance = Maintenance(cfg, self.seg_log, self.snapshots, self.metrics, self.log,
                                        corruption_found=self.corruption.report, task_done=self._tasks.done)

    def _connect_peers(self) -> None:
        cfg = self.cfg
        self.tls = tls_files(cfg, self.log)
        self.peers = peer_pool(cfg, self.voters, self.tls)
        self.outbound = Outbound(self.core, self.peers, cfg.node_id, self.gate, self.trace, self.log,
                                 step=self.step, spawn=self._tasks.spawn, fail=self.fail)
        # The gate's voters are the log's (KIP-853) before the listener serves: a voter the
        # config does not name (added later) is not refused as "not a voter" meanwhile --
        # a Kafka controller takes that CLUSTER_AUTHORIZATION_FAILED for a fatal error.
        self.outbound.follow_core()

    async def _serve(self) -> None:
        cfg = self.cfg
        # `listen`: Kafka's CONTROLLER listener (its metrics keep the label "binary")
        self.server = await start_controller_listener(self, listener_limits(cfg))
        self.metrics.bind_listener("binary", self.server.listener.stats, HANDSHAKE_METER)
        self.kafka_server = await start_kafka_listener(self, listener_limits(cfg))
        admin_ep = cfg.admin_endpoint()
        if admin_ep is not None:
            from metalog.broker.server.admin import AdminSetup, start_admin

            self.admin_runner = await start_admin(self, AdminSetup(
                cfg.node_id, cfg.cluster_id, self.authz_enabled, self.tls, self.metrics, self.log, self.gate.view),
                admin_ep)
        _log_serving(self)

    # ------------------------------------------------------------------ stop
    async def stop(self, graceful: bool = True) -> None:
        """Graceful: resign leadership (EndQuorumEpoch), flush, close."""
        if self.stopping:
            return
        self.stopping = True
        try:
            await self._stop(graceful)
        finally:
            self.stopped.set()  # whatever failed on the way out, the process ends

    async def _stop(self, graceful: bool) -> None:
        if graceful and self.booted and self.fatal is None:
            self.step(qa.Shutdown(now_ms()))
            # Give the EndQuorumEpoch requests a moment to leave, bounded.
            await self._tasks.drain(timeout_s=min(1.0, self.cfg.quorum.request_timeout_ms / 1000))
        if self.booted:
            self._timer.cancel()
            self._idle.cancel()
        if self.server is not None:
            self.server.close()
        if self.kafka_server is not None:
            self.kafka_server.close()
        if self.admin_runner is not None:
            await self.admin_runner.cleanup()
        if self.booted:
            self.flusher.abandon()
        self.outbound.stop()  # peers' answers no longer step the core, as the tasks below no longer do
        self._tasks.cancel()
        if self.booted:
            self._maintenance.cancel_check()
        await self.snapshot_work.wait(timeout_s=10)
        await self.peers.close()
        if self.booted:
            await self._maintenance.stop()
        if graceful and self.fatal is None:
            await asyncio.to_thread(self.seg_log.flush)
            self.seg_log.close()
        if self.booted:
            self.flusher.close()
        self._unlinker.close()
        self.log.info("broker_stopped", graceful=graceful)
        if self.trace is not None:
            self.trace.dump_or_warn(self.log)

    # ------------------------------------------------------------- the step
    def step(self, event: qa.Event) -> None:
        with answer_writes:  # the step's answers leave before its fdatasync starts
            self._step_once(event)
        if self.flusher.start_wanted:
            # FlushLog of this step (Flusher.request), once its answers are
            # written: a step nested in another (an immediate Tick that answers
            # woken replica fetches) or in a connection's reading leaves
            # the start to the outermost scope's end.
            answer_writes.after_writes(self.flusher.start_if_wanted)

    def _step_once(self, event: qa.Event) -> None:
        failed = self.fatal is not None  # (a local: an action may set self.fatal, checked again below)
        if failed:
            return
        core = self.core
        trace = self.trace
        hw_before = core.high_watermark if trace is not None else 0
        try:
            actions = core.step(event)
        except Exception as exc:  # noqa: BLE001 - any refusal is fatal, never swallowed
            # A driver bug the core refused (it validates its inputs): stop
            # rather than run on with a core and a disk that may disagree.
            self.fail("core_step_failed", f"core refused {type(event).__name__}: {exc}",
                      event_type=type(event).__name__, exc=exc)
            return
        if trace is not None and core.is_leader and core.high_watermark != hw_before:
            trace.mark("hw", core.high_watermark)
        self._executing = True
        try:
            for action in actions:
                self._execute(action)
                if self.fatal is not None:
                    return
        finally:
            self._executing = False
        answer_writes.write_pending()  # the actions' answers leave before the step's bookkeeping
        if self._follow_up:
            # Events the contract says come before any other (SnapshotInstallFailed).
            follow_up, self._follow_up = self._follow_up, []
            for ev in follow_up:
                self.step(ev)
            return  # the nested step ran _after_step
        self._after_step()

    def feed(self, event: qa.Event) -> None:
        """Step the core now, or, if it is mid-step, right after its actions."""
        if self._executing:
            self._follow_up.append(event)
        else:
            self.step(event)

    def _tick(self) -> None:
        self.step(qa.Tick(now_ms(), wall_clock_ms()))

    def _execute(self, a: qa.Action) -> None:
        """One action of the core. The commit path's four first, by exact type (an isinstance
        miss also looks up __class__: a chain of them cost 1.3x, a `match` 2.2x); then isinstance,
        which mypy narrows both ways, ending in assert_never: an unhandled action type is a type error."""
        if type(a) is qa.Respond:
            token = a.token
            self._unanswered_produce.discard(token)
            if type(token) is CommandToken:
                self.inbound.command_done(token, a.response)
                return
            conn, correlation_id = token
            response = a.response
            if type(response) is m.DescribeQuorumResponse and response.error_code == 0:
                response = msgspec.structs.replace(response, nodes=voter_nodes(self.core, self.voters))
            conn.send_response(correlation_id, response)
            if self.trace is not None:
                self.inbound.trace_respond(token, response)
        elif type(a) is qa.SendRequest:
            self.outbound.send_now(a)
        elif type(a) is qa.AppendBatches:
            self._append(a)
        elif type(a) is qa.FlushLog:
            self.flusher.request(self._executing)
        elif isinstance(a, (qa.Respond, qa.SendRequest, qa.AppendBatches, qa.FlushLog)):
            raise InvariantViolation(f"the core emitted {type(a).__name__}, a subclass of an action type")
        elif isinstance(a, qa.PersistQuorumState):
            s = a.state
            self.qs_file.write(leader_epoch=s.leader_epoch, leader_id=s.leader_id, voted_id=s.voted_id,
                               voters=list(s.voters))
        elif isinstance(a, qa.TruncateLog):
            self._truncate(a.end_offset)
        elif isinstance(a, qa.WriteEpochCheckpoint):
            write_checkpoint(os.path.join(self.part_dir, "leader-epoch-checkpoint"), EpochHistory(a.entries))
        elif isinstance(a, qa.WriteSnapshotChunk):
            self.snapshot_work.write_chunk(a)
        elif isinstance(a, qa.InstallSnapshot):
            self._install_snapshot(a)
        elif isinstance(a, qa.AdvanceLogStart):
            self._advance_log_start(a.log_start_offset)
        elif isinstance(a, qa.Fatal):
            self.fail("invariant_breach", a.reason)
        elif isinstance(a, qa.ClearQuarantine):
            self.corruption.quarantine_cleared(a.must_reach_offset)
        elif isinstance(a, qa.FetchedBatchCorrupt):
            self.corruption.fetched_corrupt(a)
        elif isinstance(a, qa.CorruptionFound):
            self.corruption.found_by_read(a.error)
        else:
            assert_never(a)

    # -------------------------------------------------- persisting actions
    def _append(self, a: qa.AppendBatches) -> None:
        if self.snapshot_work.downloading:
            self.snapshot_work.abandon_downloads()
        try:
            headers = self.seg_log.append(a.data)
        except LogWriteError as exc:
            # The core already counts these records: we cannot go on with a
            # log that disagrees with it. Fail-stop (Kafka takes the log dir
            # offline); the log itself holds no partial batch.
            self.storage_failed(f"append failed: {exc}", exc)
            return
        if self.trace is not None:
            self.trace.mark("append", a.next_offset, a.base_offset)
        # The log-end table the leader checks produces against. Each batch
        # is applied once more, on purpose, to a second table: the
        # controller's committed copy (ControllerState.producers, at apply),
        # which snapshots carry and a truncation rebuilds this one from
        # (rebuild_producers) -- the log end may be cut, the committed copy never.
        self.producers.on_append(headers)
        self.metrics.appended_bytes.inc(len(a.data))
        self.metrics.raft.on_append(self.core.is_leader, a.base_offset, a.next_offset)
        self.digest.append_headers(headers)

    def _truncate(self, end_offset: int) -> None:
        self.log.warning("log_truncated", end_offset=end_offset, log_end_offset=self.seg_log.log_end_offset)
        invariant(end_offset >= self.controller.applied_offset,
                  "truncating to %d, below the applied (committed) offset %d", end_offset,
                  self.controller.applied_offset)
        self.seg_log.truncate_to(end_offset)
        self.digest.truncate(end_offset)
        self.rebuild_producers()  # batches past the cut no longer count

    def _install_snapshot(self, a: qa.InstallSnapshot) -> None:
        failed = self.snapshot_work.install(a)
        if failed is not None:
            self._follow_up.append(failed)  # the contract: before any other event
            return
        self.rebuild_producers()  # the snapshot's producers, nothing after it
        self._maintenance.new_snapshot()

    def _advance_log_start(self, log_start_offset: int) -> None:
        self.seg_log.advance_log_start(log_start_offset, unlink=self.unlink_later)
        self.digest.advance_start(log_start_offset)
        covering = [sid for sid in self.snapshots.list() if sid.end_offset <= log_start_offset]
        if covering:
            self.snapshots.delete_before(covering[-1], unlink=self.unlink_later)
        self.log.info("log_start_advanced", log_start_offset=log_start_offset)

    def rebuild_producers(self) -> None:
        """The producer state at the log end, after a truncation, a quarantine
        cut or a snapshot install; damage met on the way is reported."""
        damage = rebuild_producer_state(self.producers, self.controller.state.producers, self.seg_log)
        if damage is not None:
            self.corruption.report(damage, "producer_state")

    # ------------------------------------------------------ after the step
    def _after_step(self) -> None:
        core = self.core
        if self.flusher.start_wanted and not core.is_leader:
            # A follower syncs on this thread, and its next Fetch (which is
            # what lets the leader commit) waits for the sync: sync before
            # applying what this step's HW committed, not after.
            if self.flusher.start_if_wanted():
                return  # the sync's own step (FlushCompleted) ended with all of the below, for the newer state
        self.outbound.follow_core()
        self._roles.observe(core)  # the log line, the role metrics, the leader's scheduler slice
        hw = core.high_watermark
        if core.is_leader:
            self.metrics.raft.on_high_watermark(hw)
        if hw is not None and hw > self.controller.applied_offset:
            self._apply_committed(hw)
        commands = self.inbound.commands
        if commands.runnable or commands.sessions_due(core.is_leader, now_ms()):
            self.inbound.pump_commands()
        self.produce.release_duplicates()
        self._timer.schedule()

    def _apply_committed(self, hw: int) -> None:
        controller = self.controller
        start = max(controller.applied_offset, self.seg_log.log_start_offset)
        try:
            data = self.seg_log.read(start, hw, APPLY_BYTES_PER_STEP)
        except CorruptBatchError as exc:
            # Never apply damaged bytes: quarantine, re-fetch, apply later.
            self.corruption.report(exc.report, "apply")
            return
        if data:
            try:
                # The read checked every CRC (the disk boundary): not again here.
                controller.apply_batches(data, end_offset=hw, verify=False)
            except Exception as exc:  # noqa: BLE001 - committed records we cannot apply: fail-stop
                # Every replica holds these same bytes (their CRC is valid): going
                # on would serve a state that skipped committed records.
                self.fail("apply_failed", f"cannot apply committed records from offset "
                          f"{controller.applied_offset}: {type(exc).__name__}: {exc}",
                          exc=exc, applied_offset=controller.applied_offset, high_watermark=hw)
                return
        self.metrics.high_watermark.set(hw)
        if controller.applied_offset < hw:
            # More than one step's worth: continue on the next loop turn.
            asyncio.get_running_loop().call_soon(self._after_step)
        self.snapshot_work.maybe_start()

    # ------------------------------------------------- flusher's callbacks
    def flushed(self, flushed_end_offset: int) -> None:
        self.step(qa.FlushCompleted(now_ms(), flushed_end_offset))

    def release_writes(self) -> None:
        self.produce.flush()  # writes that waited for this flush: one batch

    def _snapshot_event(self, event: qa.Event) -> None:
        """SnapshotWork's events to the core; a new snapshot file also wakes
        the scrubber, which reads it soon instead of at its next pass."""
        if type(event) is qa.SnapshotCreated:
            self._maintenance.new_snapshot()
        self.step(event)

    # ------------------------------------------------------------- failure
    def fail(self, cause: str, reason: str, exc: BaseException | None = None, **fields: Any) -> None:
        """Fail-stop: ONE structured `fatal` event, then exit code 4 (metalog.broker.server.main).
        Later failures while stopping add nothing: the first cause is the story."""
        if self.fatal is not None:
            return
        self.fatal = reason
        if exc is not None:
            fields["error_type"] = type(exc).__name__
            fields["traceback"] = "".join(traceback.format_exception(exc)).rstrip()
        self.log.critical("fatal", cause=cause, reason=reason, data_dir=self.cfg.data_dir, **fields)
        self._tasks.spawn(self.stop(graceful=False))

    def storage_failed(self, reason: str, exc: BaseException | None = None) -> None:
        """Fail-stop at the first failed write or fsync (issue 12 item 8): the
        data may be gone from the page cache, so nothing past the last good
        sync is acknowledged and fsync is never retried; writes still queued
        here get KAFKA_STORAGE_ERROR, recovery is at restart from the log
        (torn tail cut, verified from the recovery point) and the leader."""
        self.storage_error = reason
        message = f"storage error on broker {self.cfg.node_id}: {reason}"
        self.produce.reject_pending(message)
        self.inbound.fail_commands(message)
        self.fail("storage_failed", reason, exc=exc)


def _log_serving(b: Broker) -> None:
    """The broker serves: one line saying how (and a loud one if unauthenticated)."""
    if not b.authz_enabled:
        b.log.warning("authorization_disabled", security_protocol="PLAINTEXT",
                      detail="every connection is User:ANONYMOUS with super-user rights: anyone who can "
                             "reach the port can act as a replica, write and change ACLs")
    b.log.info(
        "broker_started", listen=str(b.cfg.listen_endpoint()), security_protocol=b.cfg.security.security_protocol,
        directory_id=b.directory_id, voters={k: str(v) for k, v in b.voters.items()},
        log_start_offset=b.seg_log.log_start_offset, log_end_offset=b.seg_log.log_end_offset,
        epoch=b.core.epoch, role=str(b.core.role))
