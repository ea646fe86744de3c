"""The leader: per-replica progress, the high watermark, client appends,
check-quorum, BeginQuorumEpoch notifications and the log start (KIP-630).
Serving reads (Fetch, FetchSnapshot, OffsetsForLeaderEpoch, ListOffsets) is
in metalog.broker.quorum.leader_reads."""

from __future__ import annotations

import struct
from collections import deque
from typing import TYPE_CHECKING, Protocol

from metalog.broker.quorum import membership
from metalog.broker.quorum.leader_reads import LeaderReads, ReadsContext
from metalog.broker.quorum.notify import Notifier, NotifyingRole
from metalog.broker.quorum.outbox import RequestKind
from metalog.broker.quorum.progress import ProduceWaiter, ProgressTable, ReplicaProgress
from metalog.broker.quorum.roles import Role, RoleState
from metalog.broker.quorum.voters import VoterSet, voters_record
from metalog.protocol import messages as m
from metalog.protocol.errors import Errors
from metalog.protocol.invariants import InvariantViolation, invariant
from metalog.storage.batch import LOG_OVERHEAD, encode_batch
from metalog.storage.control_records import KRaftVersionRecord, LeaderChange, encode_control

if TYPE_CHECKING:
    from metalog.broker.quorum.api import AppendWaiter

# A prebuilt batch's first 16 bytes: base offset, length, partition leader
# epoch -- what the leader stamps (the CRC covers none of it).
STAMP = struct.Struct(">qii")


def stamp_batches(base_offset: int, epoch: int, waiters: list[AppendWaiter], batches: list[bytes]) -> bytes:
    """Whole prebuilt batches (one per waiter, a waiter's record count each)
    at `base_offset` on, under `epoch`: one join, the only copy of their
    bytes, as encode_batch's is for plain records."""
    parts: list[bytes | memoryview] = []
    offset = base_offset
    pack = STAMP.pack
    for (_token, n), batch in zip(waiters, batches):
        parts.append(pack(offset, len(batch) - LOG_OVERHEAD, epoch))
        parts.append(memoryview(batch)[STAMP.size:])
        offset += n
    return b"".join(parts)


class LeaderContext(ReadsContext, Protocol):
    """What the leader may use of its owner, beyond RoleContext and what its
    reads use (ReadsContext)."""

    def timestamp_ms(self, now_ms: int) -> int:
        """The wall clock to stamp a batch with."""
        ...

    def resign(self, now_ms: int) -> RoleState:
        """Step down, keeping the epoch; the role in place after it."""
        ...


class LeaderState(NotifyingRole, RoleState):
    __slots__ = ("progress", "reads", "waiters", "notifier", "check_quorum_deadline_ms", "lbo_wait",
                 "epoch_start_offset", "granted", "pending_change")
    is_leader = True
    ctx: LeaderContext

    def __init__(self, ctx: LeaderContext, epoch: int, voted_id: int, granted: list[int], now_ms: int):
        me = ctx.electorate
        super().__init__(ctx, Role.LEADER, epoch, me.node_id, voted_id)
        self.granted = granted  # the voters that elected us (LeaderChange)
        self.progress = ProgressTable(me.others, me.voter_set, now_ms)
        self.reads = LeaderReads(self)
        self.waiters: deque[ProduceWaiter] = deque()
        self.notifier = Notifier(RequestKind.BEGIN, me.others, now_ms)
        self.lbo_wait: tuple[int, int] | None = None  # (candidate LBO, since ms)
        # The HW may not pass the start of our epoch (KAFKA-12619).
        self.epoch_start_offset = ctx.log.log_end_offset
        self.check_quorum_deadline_ms: int | None = None
        self.update_check_quorum_deadline()
        # KIP-853: the voter change waiting for its VotersRecord to commit.
        self.pending_change: membership.PendingChange | None = None

    def on_enter(self, now_ms: int) -> None:
        ctx = self.ctx
        log = ctx.log
        # The epoch's first record: LeaderChange. The HW may not move until it is
        # committed (KAFKA-12619), which is what makes the HW safe to expose.
        me = ctx.electorate
        value = encode_control(LeaderChange(me.node_id, list(me.voters), self.granted))
        self.append(encode_batch(log.log_end_offset, self.epoch, [value], ctx.timestamp_ms(now_ms),
                                 is_control=True), 1, now_ms)
        vs = me.voter_set
        if vs.kraft_version == 1 and not log.voters.entries and log.log_start_offset == 0:
            # A freshly formatted dynamic cluster: the set is only in the
            # bootstrap checkpoint. Put it in the log, as Kafka's first leader
            # does, so that every replica and snapshot gets it from there.
            self._append_kraft_v1(vs, now_ms)

    def on_exit(self, now_ms: int) -> None:
        """Answer everyone who waited on us as leader: we no longer are."""
        ctx = self.ctx
        cl = ctx.current_leader()
        waiters = self.waiters
        while waiters:
            w = waiters.popleft()
            ctx.respond(w.token, m.ProduceResponse(
                error_code=Errors.NOT_LEADER_OR_FOLLOWER, current_leader=cl,
                error_message="leadership lost before the records were committed",
            ))
        self.reads.fail_parked(now_ms)
        pc = self.pending_change
        if pc is not None:
            self.pending_change = None
            membership.answer(ctx, pc.token, pc.request, Errors.NOT_LEADER_OR_FOLLOWER,
                              "leadership lost before the voter change was committed")

    # -- time ----------------------------------------------------------------

    def before_event(self, now_ms: int) -> None:
        if self.reads.parked:
            # The driver has applied the appends that woke these: read them now.
            self.reads.complete_parked(now_ms, lambda p: p.woken)

    def deadlines(self, now_ms: int) -> list[int]:
        ds = []
        if self.check_quorum_deadline_ms is not None:
            ds.append(self.check_quorum_deadline_ms)
        for p in self.reads.parked:
            ds.append(max(p.not_before_ms, now_ms) if p.woken else p.deadline_ms)
        if self.lbo_wait is not None:
            ds.append(self.lbo_wait[1] + self.ctx.config.max_replication_lag_ms)
        if self.pending_change is not None:
            ds.append(self.pending_change.deadline_ms)
        ds.extend(self.notifier.deadlines(now_ms))
        return ds

    def poll(self, now_ms: int) -> None:
        ctx = self.ctx
        entries = ctx.log.voters.entries
        if not ctx.electorate.is_voter and entries and entries[-1][0] < ctx.log.high_watermark:
            # The set that removed us is committed: step down to an observer
            # (KIP-853); the voters elect a leader among themselves.
            ctx.become_observer(now_ms)
            return
        if self.check_quorum_deadline_ms is not None and now_ms >= self.check_quorum_deadline_ms:
            self.update_check_quorum_deadline()
            if now_ms >= self.check_quorum_deadline_ms:
                ctx.resign(now_ms).poll(now_ms)  # a majority has gone quiet: step down
                return
        if self.reads.parked:
            self.reads.complete_parked(now_ms, lambda p: p.deadline_ms <= now_ms)
        pc = self.pending_change
        if pc is not None and now_ms >= pc.deadline_ms:
            # Kafka's answer; the VotersRecord stays and still commits (or is
            # truncated) like any record: a retry then sees what happened.
            self.pending_change = None
            membership.answer(ctx, pc.token, pc.request, Errors.REQUEST_TIMED_OUT,
                              f"the voter change at offset {pc.offset} was not committed in time")
        self.notifier.send_due(now_ms, self._begin_epoch_request, ctx.send)
        self.maybe_advance_log_start(now_ms)
        self.maybe_update_own_endpoints(now_ms)

    def maybe_update_own_endpoints(self, now_ms: int) -> None:
        """KIP-853 (Kafka's leader does this when it takes an epoch): if our
        advertised endpoints differ from our entry in a kraft version 1 set,
        record them with a VotersRecord -- as an UpdateRaftVoter from us would,
        under the same rules: our epoch committed, no change pending, every
        VotersRecord committed. The membership is unchanged."""
        ctx = self.ctx
        me = ctx.electorate
        vs = me.voter_set
        listeners = ctx.config.listeners
        if (not listeners or vs.kraft_version != 1 or not me.is_voter
                or tuple(vs.endpoints.get(me.node_id, ())) == listeners or self.pending_change is not None):
            return
        hw = ctx.log.high_watermark
        entries = ctx.log.voters.entries
        if hw <= self.epoch_start_offset or (entries and entries[-1][0] >= hw):
            return
        endpoints = dict(vs.endpoints)
        endpoints[me.node_id] = listeners
        self.append_voters(VoterSet(dict(vs.directory_ids), kraft_version=1, endpoints=endpoints,
                                    kraft_ranges=dict(vs.kraft_ranges)), now_ms)

    def _begin_epoch_request(self, voter: int) -> m.BeginQuorumEpochRequest:
        ctx = self.ctx
        return m.BeginQuorumEpochRequest(cluster_id=ctx.config.cluster_id, leader_id=ctx.electorate.node_id,
                                         leader_epoch=self.epoch, voter_id=voter,
                                         voter_directory_id=ctx.electorate.voter_set.directory_id_of(voter),
                                         leader_endpoints=[m.RaftListener(*ln) for ln in ctx.config.listeners])

    def update_check_quorum_deadline(self) -> None:
        ctx = self.ctx
        # Other voters needed besides ourselves (all of a majority if a
        # pending change removed us: KIP-853).
        need = len(ctx.electorate.voters) // 2 + (0 if ctx.electorate.is_voter else 1)
        if need == 0:
            self.check_quorum_deadline_ms = None
            return
        voters = self.progress.voters
        contacts = sorted((voters[v].last_contact_ms for v in ctx.electorate.others), reverse=True)
        self.check_quorum_deadline_ms = contacts[need - 1] + (3 * ctx.config.fetch_timeout_ms) // 2

    def on_shutdown(self, now_ms: int) -> None:
        self.ctx.resign(now_ms)

    def grant_pre_vote(self, req: m.VoteRequest, now_ms: int) -> bool:
        return False  # we are the leader the voters have heard from

    def uncommitted_from(self) -> int | None:
        # Only the leader commits in its epoch, and once it has committed in it
        # every earlier epoch's committed record lies below its high watermark:
        # nothing at or past the high watermark is committed yet.
        hw = self.ctx.log.high_watermark
        return hw if hw > self.epoch_start_offset else None

    def on_log_cut(self, now_ms: int) -> None:
        # It may no longer hold records it served or counted, and must not append
        # at an offset its followers may already hold under this epoch.
        self.ctx.resign(now_ms)

    # -- writes and the high watermark ---------------------------------------

    def client_append(self, waiters: list[AppendWaiter], records: list[bytes], now_ms: int,
                      producers: list[tuple[int, int, int] | None] | None = None, prebuilt: bool = False) -> None:
        ctx = self.ctx
        if ctx.shutting_down:
            super().client_append(waiters, records, now_ms)
            return
        base = ctx.log.log_end_offset
        epoch = self.epoch
        timestamp_ms = ctx.timestamp_ms(now_ms)
        count = len(records)
        if prebuilt:  # one client-built batch per waiter: kept as built (api.ClientAppend)
            data = stamp_batches(base, epoch, waiters, records)
            count = sum(n for _token, n in waiters)
        elif producers is None:
            data = encode_batch(base, epoch, records, timestamp_ms)
        else:
            data = self._encode_mixed(base, epoch, timestamp_ms, waiters, records, producers)
        offset = base
        for token, n in waiters:
            self.waiters.append(ProduceWaiter(offset + n, token, offset, epoch))
            offset += n
        self.append(data, count, now_ms)

    @staticmethod
    def _encode_mixed(base: int, epoch: int, timestamp_ms: int, waiters: list[AppendWaiter], records: list[bytes],
                      producers: list[tuple[int, int, int] | None]) -> bytes:
        """Whole batches for one append: each idempotent waiter's records in a
        batch of their own (its producer fields in the header), each run of
        plain waiters' records in one batch, in waiter order."""
        parts: list[bytes] = []
        offset = base
        pos = 0
        plain_from = 0  # first record of the current run of plain waiters
        for (_token, n), producer in zip(waiters, producers):
            if producer is None:
                pos += n
                continue
            if plain_from < pos:
                parts.append(encode_batch(offset, epoch, records[plain_from:pos], timestamp_ms))
                offset += pos - plain_from
            pid, pepoch, seq = producer
            parts.append(encode_batch(offset, epoch, records[pos:pos + n], timestamp_ms, producer_id=pid,
                                      producer_epoch=pepoch, base_sequence=seq))
            offset += n
            pos += n
            plain_from = pos
        if plain_from < pos:
            parts.append(encode_batch(offset, epoch, records[plain_from:pos], timestamp_ms))
            offset += pos - plain_from
        invariant(offset == base + len(records), "batches end at %d, not %d", offset, base + len(records))
        return b"".join(parts)

    def append(self, batch: bytes, count: int, now_ms: int) -> None:
        """Append at the log end under our epoch."""
        self.ctx.log.append_own(batch, count, self.epoch)
        if self.reads.parked:
            # Replicas waiting at the old end have data now; consumers wait for the HW.
            self.reads.complete_parked(now_ms, lambda p: p.request.replica_id >= 0)

    def on_flushed(self, now_ms: int) -> None:
        self.maybe_advance_hw(now_ms)

    def maybe_advance_hw(self, now_ms: int) -> None:
        ctx = self.ctx
        log = ctx.log
        me = ctx.electorate
        # Our own unflushed tail never counts (KAFKA-10533); nor our log at all
        # once a VotersRecord removed us (KIP-853).
        leos = [log.flushed_end_offset] if me.is_voter else []
        voters = self.progress.voters
        for v in me.others:
            leos.append(voters[v].log_end_offset)
        leos.sort(reverse=True)
        new_hw = leos[me.hw_index]
        if new_hw > self.epoch_start_offset and new_hw > log.high_watermark:
            invariant(new_hw <= log.log_end_offset, "high watermark %d past the log end %d",
                      new_hw, log.log_end_offset)
            log.high_watermark = new_hw
            self._on_hw_advanced(now_ms)

    def _on_hw_advanced(self, now_ms: int) -> None:
        ctx = self.ctx
        hw = ctx.log.high_watermark
        cl = None
        waiters = self.waiters
        while waiters and waiters[0].end_offset <= hw:
            w = waiters.popleft()
            cl = cl or ctx.current_leader()
            ctx.respond(w.token, m.ProduceResponse(base_offset=w.base_offset, leader_epoch=w.epoch,
                                                    current_leader=cl))
        if self.reads.parked:
            self.reads.on_hw_advanced(now_ms)
        pc = self.pending_change
        if pc is not None and pc.offset < hw:
            self.pending_change = None
            membership.answer(ctx, pc.token, pc.request, Errors.NONE)

    # -- voter changes (KIP-853, metalog.broker.quorum.membership) --------------------

    def append_voters(self, voter_set: VoterSet, now_ms: int) -> int:
        """Append a VotersRecord of `voter_set`; it counts from now on. Returns its offset."""
        ctx = self.ctx
        offset = ctx.log.log_end_offset
        rec = voters_record(voter_set)
        if rec is None:
            raise InvariantViolation("static voters are never written")
        batch = encode_batch(offset, self.epoch, [encode_control(rec)], ctx.timestamp_ms(now_ms), is_control=True)
        self.append(batch, 1, now_ms)
        ctx.log.add_voter_set(offset, voter_set)
        return offset

    def append_kraft_upgrade(self, voter_set: VoterSet, now_ms: int) -> int:
        """kraft.version 0 -> 1 (membership.handle_update_features): one
        control batch, KRaftVersionRecord(1) then the VotersRecord of the
        static voters, as a freshly formatted cluster's first leader writes
        it; the set counts from now on. Returns the VotersRecord's offset."""
        old_version = self.ctx.electorate.voter_set.kraft_version
        invariant(old_version == 0 and voter_set.kraft_version == 1,
                  "kraft.version upgrade from %d to %d", old_version, voter_set.kraft_version)
        return self._append_kraft_v1(voter_set, now_ms)

    def _append_kraft_v1(self, voter_set: VoterSet, now_ms: int) -> int:
        """KRaftVersionRecord(1) and the VotersRecord of `voter_set` in one
        control batch; the set counts from now on. The VotersRecord's offset."""
        ctx = self.ctx
        rec = voters_record(voter_set)
        if rec is None:
            raise InvariantViolation("a kraft version 1 set has a VotersRecord")
        base = ctx.log.log_end_offset
        self.append(encode_batch(base, self.epoch, [encode_control(KRaftVersionRecord(1)), encode_control(rec)],
                                 ctx.timestamp_ms(now_ms), is_control=True), 2, now_ms)
        ctx.log.add_voter_set(base + 1, voter_set)
        return base + 1

    def on_voters_changed(self, now_ms: int) -> None:
        """End of a step in which the latest voter set changed."""
        self.sync_progress(now_ms)
        self.update_check_quorum_deadline()
        self.maybe_advance_hw(now_ms)

    def sync_progress(self, now_ms: int) -> None:
        """The latest voter set changed (our own VotersRecord, or a quarantine
        cut that took one back), at once: progress per the new voters, each
        keeping what we knew of it as an observer or a voter; a voter that
        left is an observer to us from now on. Idempotent."""
        ctx = self.ctx
        old = self.progress
        new = ProgressTable(ctx.electorate.others, ctx.electorate.voter_set, now_ms)
        carried: dict[tuple[int, str], ReplicaProgress] = dict(old.observers)
        for v, st in old.voters.items():
            carried[(v, st.directory_id)] = st
        for v in ctx.electorate.others:
            kept = carried.pop((v, ctx.electorate.voter_set.directory_id_of(v)), None)
            if kept is not None:
                kept.last_contact_ms = max(kept.last_contact_ms, kept.last_fetch_ms)
                new.voters[v] = kept
        new.observers.update(carried)
        self.progress = new
        self.notifier.unacked &= set(ctx.electorate.others)

    def maybe_advance_log_start(self, now_ms: int) -> None:
        """KIP-630: the leader moves its LBO to a snapshot once every live replica
        has it, or once it has waited max_replication_lag_ms."""
        log = self.ctx.log
        if not log.snapshots:
            return
        target = log.snapshots[-1].end_offset
        if target <= log.log_start_offset or target > log.high_watermark:
            self.lbo_wait = None
            return
        if self.lbo_wait is None or self.lbo_wait[0] != target:
            self.lbo_wait = (target, now_ms)
        cfg = self.ctx.config
        lag_max_ms = cfg.replica_lag_time_max_ms
        all_have = all(
            st.log_end_offset >= target
            for st in self.progress.all()
            if st.last_fetch_ms >= 0 and now_ms - st.last_fetch_ms <= lag_max_ms
        )
        if all_have or now_ms - self.lbo_wait[1] >= cfg.max_replication_lag_ms:
            self.lbo_wait = None
            log.advance_log_start(target)

    # -- exposure ------------------------------------------------------------

    def successors(self) -> list[int]:
        """The other voters, most caught up first (EndQuorumEpoch's order)."""
        voters = self.progress.voters
        return sorted(self.ctx.electorate.others, key=lambda v: (-voters[v].log_end_offset, v))

    def is_in_sync(self, replica_id: int, now_ms: int) -> bool:
        ctx = self.ctx
        if replica_id == ctx.electorate.node_id:
            return True
        st = self.progress.voters.get(replica_id) or next(
            (o for (rid, _), o in self.progress.observers.items() if rid == replica_id), None)
        if st is None:
            return False
        return st.in_sync(ctx.log.log_end_offset, now_ms, ctx.config)

    def describe_quorum(self, now_ms: int) -> m.DescribeQuorumResponse:
        ctx = self.ctx
        me = ctx.electorate
        voters = []
        for v in me.voters:
            if v == me.node_id:
                voters.append(m.ReplicaState(v, ctx.log.log_end_offset, now_ms, now_ms, True, me.directory_id))
            else:
                voters.append(self._replica_state(self.progress.voters[v], now_ms))
        observers = [self._replica_state(st, now_ms) for st in self.progress.observers.values()]
        return m.DescribeQuorumResponse(
            leader_id=ctx.electorate.node_id, leader_epoch=self.epoch,
            high_watermark=ctx.log.high_watermark, voters=voters, observers=observers,
        )

    def _replica_state(self, st: ReplicaProgress, now_ms: int) -> m.ReplicaState:
        in_sync = st.in_sync(self.ctx.log.log_end_offset, now_ms, self.ctx.config)
        return m.ReplicaState(st.replica_id, st.log_end_offset, st.last_fetch_ms, st.last_caught_up_ms,
                              in_sync, st.directory_id)

    def replica_states(self) -> dict[int, ReplicaProgress]:
        """By node id; a voter's entry wins over an observer of the same node
        id fetching from another directory (a wiped voter)."""
        out = {st.replica_id: st.copy() for st in self.progress.observers.values()}
        out.update((v, st.copy()) for v, st in self.progress.voters.items())
        return out

    def observer_ids(self) -> list[int]:
        return sorted({rid for rid, _ in self.progress.observers})

    def parked_fetch_replicas(self) -> list[int]:
        return sorted(p.request.replica_id for p in self.reads.parked)
