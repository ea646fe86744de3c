"""What a leader serves from its log: Fetch (with long-poll parking, snapshot
redirects and DivergingEpoch), FetchSnapshot, OffsetsForLeaderEpoch and
ListOffsets. The checks every role makes first (cluster id, validation,
KIP-320 fencing) are done by the core (metalog.broker.quorum.inbound) before a
request gets here; ``ReadsContext`` is what the reads use of it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from metalog.broker.quorum.api import CorruptionFound
from metalog.broker.quorum.progress import ParkedFetch, ReplicaProgress
from metalog.broker.quorum.roles import RoleContext, RoleState
from metalog.protocol import messages as m
from metalog.protocol.errors import Errors
from metalog.protocol.invariants import InvariantViolation
from metalog.storage.batch import CorruptBatchError, iter_batches
from metalog.storage.errors import StorageError

if TYPE_CHECKING:
    from metalog.broker.quorum.api import Action, LogReader
    from metalog.broker.quorum.leader import LeaderState

NO_EPOCH = m.NO_EPOCH
NO_OFFSET = m.NO_OFFSET
# Bound on the fetches a leader keeps parked (more are answered at once).
MAX_PARKED_FETCHES = 4096
# ListOffsets-by-timestamp reads the log in chunks of this size.
SCAN_CHUNK_BYTES = 1 << 20


def fetch_problem(req: m.FetchRequest, node_id: int) -> str | None:
    """Why a Fetch is malformed (INVALID_REQUEST), or None."""
    consumer = req.replica_id < 0
    if req.max_wait_ms < 0:
        return f"max_wait_ms {req.max_wait_ms} is negative"
    if req.fetch_offset < 0:
        return f"fetch_offset {req.fetch_offset} is negative"
    if req.last_fetched_epoch < 0 and not consumer:
        return f"last_fetched_epoch {req.last_fetched_epoch} is negative"
    if req.current_leader_epoch != NO_EPOCH and req.last_fetched_epoch > req.current_leader_epoch:
        return (f"last_fetched_epoch {req.last_fetched_epoch} is newer than "
                f"current_leader_epoch {req.current_leader_epoch}")
    if req.replica_id == node_id:
        return f"replica {req.replica_id} is this node"
    return None


class ReadsContext(RoleContext, Protocol):
    """What the leader's reads use of the core, beyond RoleContext."""

    @property
    def reader(self) -> LogReader:
        """The driver's synchronous reads of the local log and snapshots."""
        ...

    @property
    def read_stall_until_ms(self) -> int:
        """StallReads: no read is answered before this."""
        ...

    @property
    def state(self) -> RoleState:
        """The current role (an invariant checks it is still this leader)."""
        ...

    def emit(self, action: Action) -> None: ...

    def error_response(self, req: m.Body, code: int, message: str | None = None) -> m.Body: ...

    def handle_fetch(self, token: Any, req: m.FetchRequest, now_ms: int, completing: bool) -> None:
        """A parked Fetch, answered as the current role answers it (fenced
        again: the leader that parked it may be gone)."""
        ...


class LeaderReads:
    __slots__ = ("leader", "ctx", "parked")

    def __init__(self, leader: LeaderState):
        self.leader = leader
        self.ctx: ReadsContext = leader.ctx
        self.parked: list[ParkedFetch] = []

    def _storage_error(self, token: Any, req: m.Body, exc: Exception, message: str | None = None) -> None:
        """Never send bytes that failed verification; the driver quarantines
        and feeds LogQuarantined."""
        ctx = self.ctx
        ctx.emit(CorruptionFound(exc))
        ctx.respond(token, ctx.error_response(req, Errors.KAFKA_STORAGE_ERROR, message))

    # -- Fetch -----------------------------------------------------------------

    def serve_fetch(self, token: Any, req: m.FetchRequest, now_ms: int, completing: bool) -> None:
        leader = self.leader
        ctx = self.ctx
        log = ctx.log
        consumer = req.replica_id < 0
        hw = log.high_watermark
        lso = log.log_start_offset
        leo = log.log_end_offset
        fetch_offset = req.fetch_offset
        lfe = req.last_fetched_epoch
        cl = ctx.current_leader()
        progress = leader.progress

        if not consumer and not completing:
            # Done before the snapshot redirect and DivergingEpoch answers too, which
            # never update the fetch state: a wiped replica downloading a snapshot
            # must not keep its old offset.
            st = progress.get(req.replica_id, req.replica_directory_id)
            if st is not None:
                st.forget_position(fetch_offset)
        # Snapshot redirect (KIP-630, KAFKA-15078). Its epoch rules judge a
        # replica's log; a consumer reads the log from its start, so only an
        # offset below the log start, which just a snapshot still covers,
        # sends it there (the client calls that out of range).
        snap = log.snapshot_redirect(fetch_offset, lfe) if not consumer or fetch_offset < lso else None
        if snap is not None:
            ctx.respond(token, m.FetchResponse(
                high_watermark=hw, log_start_offset=lso, snapshot_id=snap, current_leader=cl))
            return
        # DivergingEpoch (the latest epoch is the hot path: no search).
        if fetch_offset > 0 and lfe >= 0:
            if lfe == log.epochs.latest_epoch:
                end_epoch, end_offset = lfe, leo
            else:
                end_epoch, end_offset = log.end_offset_for_epoch(lfe)
            if end_epoch != lfe or end_offset < fetch_offset:
                ctx.respond(token, m.FetchResponse(
                    high_watermark=hw, log_start_offset=lso, current_leader=cl,
                    diverging_epoch=m.EpochEndOffset(end_epoch, end_offset)))
                return
        if consumer and fetch_offset > leo:
            ctx.respond(token, ctx.error_response(
                req, Errors.OFFSET_OUT_OF_RANGE, f"fetch offset {fetch_offset} is past the log end offset {leo}"))
            return

        # A valid fetch: it updates the replica's state and may move the HW.
        st = None
        hw_before = log.high_watermark
        if not consumer:
            st = progress.progress_for(req.replica_id, req.replica_directory_id)
            if not completing:
                st.log_end_offset = fetch_offset
                st.last_fetch_ms = now_ms
                st.last_contact_ms = now_ms
                # Only the voter itself (its node id and directory id, KIP-853)
                # acknowledges our epoch and counts toward the HW.
                if progress.voter(req.replica_id, req.replica_directory_id) is st:
                    leader.notifier.unacked.discard(req.replica_id)  # a fetch acknowledges our epoch
                    leader.maybe_advance_hw(now_ms)
                    if ctx.state is not leader:  # every voter fetch: one identity test, no call
                        raise InvariantViolation("advancing the HW never changes the role")
            upper = log.log_end_offset
        else:
            upper = max(log.high_watermark, lso)

        has_data = fetch_offset < upper
        stalled = now_ms < ctx.read_stall_until_ms
        # Park an empty fetch. One that just moved the HW waits only
        # fetch_hw_linger_ms (the replica should learn the HW soon, not
        # max_wait_ms later), and a consumer's not at all.
        wait_ms = req.max_wait_ms
        if log.high_watermark != hw_before:
            wait_ms = 0 if consumer else min(wait_ms, ctx.config.fetch_hw_linger_ms)
        if not completing and (stalled or (not has_data and wait_ms > 0)):
            if len(self.parked) < MAX_PARKED_FETCHES:
                self._park(token, req, now_ms, has_data, st, wait_ms)
                return
        records = b""
        tail = log.step_tail_from(fetch_offset, req.max_bytes) if has_data and upper == log.log_end_offset else None
        if tail is not None:
            records = tail  # appended in this step: not readable through the LogReader yet
        elif has_data:
            try:
                records = ctx.reader.read(fetch_offset, upper, req.max_bytes)
            except (CorruptBatchError, StorageError) as exc:
                self._storage_error(token, req, exc, f"node {ctx.electorate.node_id} failed to read offset "
                                    f"{fetch_offset}: {exc}")
                return
        if st is not None:
            st.on_fetch_served(fetch_offset, log.log_end_offset, now_ms,
                               ctx.config.follower_fetch_pending_reads_insync_enable)
        ctx.respond(token, m.FetchResponse(
            high_watermark=log.high_watermark, log_start_offset=log.log_start_offset,
            records=records, current_leader=cl))

    def _park(self, token: Any, req: m.FetchRequest, now_ms: int, has_data: bool,
              st: ReplicaProgress | None, wait_ms: int) -> None:
        ctx = self.ctx
        stall_until_ms = ctx.read_stall_until_ms
        if st is not None:
            # One pending fetch per replica: answer an older one first.
            for p in list(self.parked):
                if p.request.replica_id == req.replica_id:
                    self.parked.remove(p)
                    ctx.handle_fetch(p.token, p.request, now_ms, completing=True)
            st.pending_offset = req.fetch_offset
            st.pending_prev_leo = st.leader_leo_at_last_read
        deadline_ms = now_ms if has_data else now_ms + wait_ms
        self.parked.append(ParkedFetch(token, req, now_ms, max(deadline_ms, stall_until_ms), stall_until_ms))

    def complete_parked(self, now_ms: int, which: Callable[[ParkedFetch], bool]) -> None:
        ctx = self.ctx
        keep: list[ParkedFetch] = []
        done: list[ParkedFetch] = []
        if ctx.log.appended_this_step:
            # Reads go through the LogReader, which will not see this step's
            # AppendBatches until the driver executes them. A replica parked
            # at the old log end is answered now with the step's own bytes
            # (LocalLog.step_tail_from: the usual commit, one step instead of
            # two); any other is woken and answered next step.
            log = ctx.log
            for p in self.parked:
                if not which(p):
                    keep.append(p)
                elif (p.not_before_ms <= now_ms and p.request.replica_id >= 0
                      and log.step_tail_from(p.request.fetch_offset, p.request.max_bytes) is not None):
                    done.append(p)  # serve_fetch reads it with the same call
                else:
                    p.woken = True
                    keep.append(p)
        else:
            for p in self.parked:
                (done if p.not_before_ms <= now_ms and which(p) else keep).append(p)
        if not done:
            return
        self.parked = keep
        for p in done:
            ctx.handle_fetch(p.token, p.request, now_ms, completing=True)

    def stall(self, until_ms: int) -> None:
        """StallReads: no parked fetch is read before `until_ms` either."""
        for p in self.parked:
            p.not_before_ms = max(p.not_before_ms, until_ms)
            p.deadline_ms = max(p.deadline_ms, until_ms)

    def on_hw_advanced(self, now_ms: int) -> None:
        """Consumers waiting for the HW read now; replicas learn it with the
        next records, or with the HW alone after fetch_hw_linger_ms: their
        Fetch stays parked for those records meanwhile, rather than being
        answered and sent again (a round trip racing the next append)."""
        linger_ms = self.ctx.config.fetch_hw_linger_ms
        if linger_ms > 0:
            due = now_ms + linger_ms
            for p in self.parked:
                if p.request.replica_id >= 0 and p.deadline_ms > due:
                    p.deadline_ms = max(due, p.not_before_ms)  # a stalled read stays stalled
            self.complete_parked(now_ms, lambda p: p.request.replica_id < 0)
        else:
            self.complete_parked(now_ms, lambda p: True)

    def fail_parked(self, now_ms: int) -> None:
        """Leadership is lost: every parked fetch is answered as the new role
        answers it (NOT_LEADER_OR_FOLLOWER or FENCED_LEADER_EPOCH)."""
        parked, self.parked = self.parked, []
        for p in parked:
            self.ctx.handle_fetch(p.token, p.request, now_ms, completing=True)

    # -- other reads -------------------------------------------------------------

    def serve_fetch_snapshot(self, token: Any, req: m.FetchSnapshotRequest, now_ms: int) -> None:
        ctx = self.ctx
        st = self.leader.progress.voter(req.replica_id, req.replica_directory_id)
        if st is not None:
            st.last_contact_ms = now_ms
        size_bytes = ctx.reader.snapshot_size(req.snapshot_id)
        if size_bytes is None:
            ctx.respond(token, ctx.error_response(req, Errors.SNAPSHOT_NOT_FOUND))
            return
        if req.position < 0 or req.position >= size_bytes:
            ctx.respond(token, ctx.error_response(req, Errors.POSITION_OUT_OF_RANGE))
            return
        max_bytes = max(1, min(req.max_bytes, ctx.config.snapshot_chunk_bytes))
        try:
            data = ctx.reader.read_snapshot(req.snapshot_id, req.position, max_bytes)
        except (CorruptBatchError, StorageError) as exc:
            self._storage_error(token, req, exc)
            return
        ctx.respond(token, m.FetchSnapshotResponse(
            snapshot_id=req.snapshot_id, size=size_bytes, position=req.position,
            unaligned_records=data, current_leader=ctx.current_leader()))

    def serve_offsets_for_epoch(self, token: Any, req: m.OffsetsForLeaderEpochRequest) -> None:
        ctx = self.ctx
        log = ctx.log
        epoch, end = log.end_offset_for_epoch(req.leader_epoch)
        # Consumers see no further than committed data. A new leader's HW is its follower's
        # stale view until a record of its epoch commits (Raft 5.4.2), below what the old
        # leader committed; every committed record is below our epoch's start (leader
        # completeness), so never cut below that: a cut there told consumers at a committed
        # position of a truncation that never happened (the drill's 809 < 811, docs/drills.md).
        visible = max(log.high_watermark, self.leader.epoch_start_offset)
        if req.replica_id < 0 and end > visible:
            end = max(visible, log.log_start_offset)
        # No current leader: Kafka's answer cannot carry one (see answers.py).
        ctx.respond(token, m.OffsetsForLeaderEpochResponse(leader_epoch=epoch, end_offset=end))

    def serve_list_offsets(self, token: Any, req: m.ListOffsetsRequest) -> None:
        ctx = self.ctx
        log = ctx.log
        if log.high_watermark < 0:
            # Our first record is not committed yet.
            ctx.respond(token, ctx.error_response(req, Errors.LEADER_NOT_AVAILABLE))
            return
        cl = ctx.current_leader()
        hw = log.high_watermark
        lso = log.log_start_offset
        if req.timestamp_ms == m.LIST_OFFSETS_EARLIEST:
            offset, timestamp_ms = lso, -1
        elif req.timestamp_ms == m.LIST_OFFSETS_LATEST:
            offset, timestamp_ms = hw, -1
        else:
            try:
                offset, timestamp_ms = self._offset_for_timestamp(req.timestamp_ms, lso, hw)
            except (CorruptBatchError, StorageError) as exc:
                self._storage_error(token, req, exc)
                return
            if offset < 0:
                ctx.respond(token, m.ListOffsetsResponse(current_leader=cl))
                return
        # The epoch of the last record before `offset` lets the client validate it.
        epoch = log.epochs.epoch_for_offset(offset - 1) if offset > lso else NO_EPOCH
        if epoch == NO_EPOCH:
            base = log.snapshot_at(lso)
            epoch = base.epoch if base is not None else log.epochs.epoch_for_offset(offset)
        ctx.respond(token, m.ListOffsetsResponse(
            offset=offset, timestamp_ms=timestamp_ms, leader_epoch=epoch, current_leader=cl))

    def _offset_for_timestamp(self, timestamp_ms: int, start: int, end: int) -> tuple[int, int]:
        """First committed batch whose max timestamp is >= timestamp_ms: (its base offset, its max timestamp)."""
        reader = self.ctx.reader
        pos = start
        while pos < end:
            data = reader.read(pos, end, SCAN_CHUNK_BYTES)
            last_next = pos
            for _, h in iter_batches(data, verify=False):
                if h.next_offset > pos and h.max_timestamp_ms >= timestamp_ms:
                    return max(h.base_offset, pos), h.max_timestamp_ms
                last_next = h.next_offset
            if last_next <= pos:
                break  # no progress: the reader returned nothing
            pos = last_next
        return NO_OFFSET, -1
