"""The core's view of its local log, shared by every role: offsets (start,
end, flushed end), the epoch history, snapshots, the high watermark and the
quarantine mark. Every change it makes is emitted as an action (AppendBatches,
TruncateLog, WriteEpochCheckpoint, ...) into the step's Outbox; the driver
executes them in order."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from metalog.broker.quorum.api import (
    AdvanceLogStart,
    AppendBatches,
    ClearQuarantine,
    FetchedBatchCorrupt,
    FlushLog,
    InstallSnapshot,
    LogView,
    TruncateLog,
    WriteEpochCheckpoint,
)
from metalog.broker.quorum.outbox import Outbox
from metalog.broker.quorum.voters import VoterSet, VoterSetHistory, voter_sets_in
from metalog.protocol import messages as m
from metalog.protocol.invariants import InvariantViolation, invariant
from metalog.storage.batch import CorruptBatchError, iter_batches
from metalog.storage.epochs import EpochEntry, EpochHistory

NO_OFFSET = m.NO_OFFSET


class _PreInstall(NamedTuple):
    """Our log as it was before an InstallSnapshot, until the install is
    known to have succeeded (SnapshotInstallFailed rolls back to it)."""

    snapshot_id: m.SnapshotId
    log_start_offset: int
    log_end_offset: int
    flushed_end_offset: int
    epochs: list[EpochEntry]
    snapshots: list[m.SnapshotId]
    high_watermark: int
    voters: VoterSetHistory


class LocalLog:
    __slots__ = ("outbox", "fail", "log_start_offset", "log_end_offset", "flushed_end_offset", "epochs",
                 "snapshots", "high_watermark", "must_reach_offset", "must_reach_epoch", "pre_install", "voters",
                 "static_voters", "voters_changed", "appended_this_step", "step_tail_base", "step_tail")

    def __init__(self, view: LogView, outbox: Outbox, fail: Callable[[str], None],
                 static_voters: VoterSet | None = None, voters_changed: Callable[[], None] = lambda: None):
        if view.log_start_offset > view.log_end_offset:
            raise ValueError(
                f"log start offset {view.log_start_offset} is past the log end offset {view.log_end_offset}")
        self.outbox = outbox
        self.fail = fail  # an invariant breach: the core stops (Fatal)
        self.log_start_offset = view.log_start_offset
        self.log_end_offset = view.log_end_offset
        self.flushed_end_offset = view.log_end_offset  # recovery: all on disk counts
        self.epochs = EpochHistory(view.epochs)
        self.snapshots: list[m.SnapshotId] = sorted(view.snapshots)
        self.high_watermark = NO_OFFSET
        # Quarantine (issue 12): the log end this voter had before corruption cut
        # it, which it may have acknowledged. Until the flushed end reaches it,
        # the voter neither grants votes nor stands. -1: not quarantined.
        self.must_reach_offset = view.must_reach_offset
        # The epoch of the last record below must_reach_offset, or an upper
        # bound of it (after a restart: the quorum epoch; set by the core).
        self.must_reach_epoch = -1
        # Our log as it was before the last InstallSnapshot, until it is known
        # to have succeeded (rolled back by SnapshotInstallFailed).
        self.pre_install: _PreInstall | None = None
        # KIP-853: the voter set as of each offset (VotersRecords in the log,
        # over the snapshot's or the config's set). The latest one counts
        # once appended; `voters_changed` tells the core when it changes.
        self.static_voters = static_voters
        base = view.voter_set or static_voters
        if base is None:
            raise InvariantViolation("a voter set: from the log view or the config")
        for offset, _ in view.voter_history:
            if not view.log_start_offset <= offset < view.log_end_offset:
                raise ValueError(f"voter set at offset {offset} is outside the log "
                                 f"[{view.log_start_offset}, {view.log_end_offset})")
        self.voters = VoterSetHistory(base, view.voter_history)
        self.voters_changed = voters_changed
        # The leader appended in this step (the core clears it at each step):
        # the LogReader will not see those records until the driver has
        # executed the step's AppendBatches.
        self.appended_this_step = False
        # What this step appended, from its first base offset to the log end:
        # the bytes the core itself hands the driver, so a replica's fetch at
        # that offset can be answered in the same step (step_tail_from).
        self.step_tail_base = NO_OFFSET
        self.step_tail: list[bytes] = []

    def _checkpoint(self) -> None:
        self.outbox.actions.append(WriteEpochCheckpoint(tuple(self.epochs.entries)))

    # -- reading -----------------------------------------------------------

    def step_tail_from(self, offset: int, max_bytes: int) -> bytes | None:
        """This step's own appends, `offset` to the log end, when `offset` is where the
        first of them starts and they fit in `max_bytes` (None otherwise: the LogReader's
        rules apply, a whole first batch past max_bytes among them): the bytes of the
        step's AppendBatches, which the LogReader sees only once the driver has executed them."""
        if not self.appended_this_step or offset != self.step_tail_base:
            return None
        tail = self.step_tail
        data = tail[0] if len(tail) == 1 else b"".join(tail)
        return data if len(data) <= max_bytes else None

    def vote_position(self) -> tuple[int, int]:
        """(last epoch, end offset) a candidate's log must reach for our vote:
        our log's, or, while quarantined, that of the log we had (what we may
        have acknowledged), so a vote never depends on the records we lost."""
        own = (self.last_epoch(), self.log_end_offset)
        if self.must_reach_offset < 0:
            return own
        return max(own, (self.must_reach_epoch, self.must_reach_offset))

    def up_to_date(self, last_epoch: int, end_offset: int) -> bool:
        """Is a candidate's log (its last epoch, its end) at least as up to date
        as ours, for a vote (Raft's election restriction)?"""
        return (last_epoch, end_offset) >= self.vote_position()

    def last_epoch(self) -> int:
        """Epoch of the last record we hold: from the epoch history, or, when
        the log is empty past a snapshot, the snapshot's epoch (as Kafka's
        lastFetchedEpoch). Fetch, OffsetsForLeaderEpoch and Vote all use it."""
        epoch = self.epochs.latest_epoch
        if epoch < 0 and self.snapshots and self.snapshots[-1].end_offset == self.log_end_offset:
            return self.snapshots[-1].epoch
        return epoch

    def end_offset_for_epoch(self, epoch: int) -> tuple[int, int]:
        """Kafka's endOffsetForEpoch with KRaft's override (KafkaMetadataLog): an
        epoch older than our whole history, when the log starts at a snapshot,
        is answered with that snapshot's id. The history was cut at the log start
        (truncate_from_start), so we do not know where such an epoch really ended:
        the plain answer (epoch, log start) would claim the asker's records of
        that epoch up to our log start match ours -- untrue, and not even a batch
        boundary of the asker's log (sim finding 4). The answer's epoch is then
        newer than the one asked, which tells the asker to fetch and be sent the
        snapshot."""
        e, end = self.epochs.end_offset_for_epoch(epoch, self.log_end_offset)
        lso = self.log_start_offset
        if lso > 0 and e == epoch and end == lso and epoch != self.epochs.latest_epoch:
            base = self.snapshot_at(lso)
            first = self.epochs.entries[0] if self.epochs.entries else None
            if base is not None and (first is None or epoch < first.epoch):
                return base.epoch, base.end_offset
        return e, end

    def snapshot_redirect(self, fetch_offset: int, lfe: int) -> m.SnapshotId | None:
        if not self.snapshots:
            return None
        latest = self.snapshots[-1]
        lso = self.log_start_offset
        if fetch_offset == 0 and latest.end_offset > 0:
            return latest  # KAFKA-15078: an empty replica starts from the snapshot
        if lso > 0:
            base = self.snapshot_at(lso)
            base_epoch = base.epoch if base is not None else latest.epoch
            if fetch_offset < lso or (fetch_offset == lso and lfe != base_epoch) or lfe < base_epoch:
                return latest
        return None

    def finalized_kraft_version(self) -> tuple[int, int]:
        """(kraft.version, the offset of the record that set it; -1 for
        static voters) as committed: the voter set below our HW."""
        hw = max(self.high_watermark, 0)
        at = [off for off, _ in self.voters.entries if off < hw]
        return self.voters.at(hw).kraft_version, (at[-1] if at else -1)

    def snapshot_at(self, end_offset: int) -> m.SnapshotId | None:
        for s in self.snapshots:
            if s.end_offset == end_offset:
                return s
        return None

    # -- writing -------------------------------------------------------------

    def append_own(self, batch: bytes, count: int, epoch: int) -> None:
        """Leader append at the log end under its epoch: `batch` is one or more
        whole batches holding `count` records (one write, one flush)."""
        base = self.log_end_offset
        actions = self.outbox.actions
        if self.appended_this_step:
            self.step_tail.append(batch)
        else:
            self.appended_this_step = True
            self.step_tail_base, self.step_tail = base, [batch]
        actions.append(AppendBatches(batch, base, base + count))
        self.log_end_offset = base + count
        if self.epochs.assign(epoch, base):
            self._checkpoint()
        actions.append(FlushLog())

    def append_fetched(self, records: bytes, epoch: int) -> bool:
        """Append the whole batches of a fetch answer; False if it does not fit our log."""
        leo = self.log_end_offset
        expect = leo
        end_pos = 0
        changed = False
        epochs = self.epochs
        controls = []  # (position, size) of control batches: they may hold a VotersRecord
        try:
            for pos, h in iter_batches(records):
                if h.base_offset != expect:
                    if end_pos == 0:
                        return False  # not at our end: a stale or misaligned answer
                    break
                if h.leader_epoch > epoch:
                    self.fail(f"fetched a batch of epoch {h.leader_epoch} while in epoch {epoch}")
                    return False
                if h.leader_epoch < epochs.latest_epoch:
                    self.fail(f"fetched a batch of epoch {h.leader_epoch} at offset {h.base_offset} "
                              f"after epoch {epochs.latest_epoch}")
                    return False
                changed |= epochs.assign(h.leader_epoch, h.base_offset)
                expect = h.next_offset
                end_pos = pos + h.size
                if h.is_control:
                    controls.append((pos, end_pos))
        except CorruptBatchError as exc:
            self.outbox.actions.append(FetchedBatchCorrupt(exc.base_offset, epoch, str(exc)))
            if end_pos == 0:
                return False  # keep what was sound before the corrupt batch
        if end_pos == 0:
            return False
        self.outbox.actions.append(AppendBatches(bytes(records[:end_pos]), leo, expect))
        self.log_end_offset = expect
        if changed:
            self._checkpoint()
        self.outbox.actions.append(FlushLog())
        self._note_voter_sets(b"".join(bytes(records[a:b]) for a, b in controls))
        return True

    def add_voter_set(self, offset: int, voter_set: VoterSet) -> None:
        """The leader appended a VotersRecord of `voter_set` at `offset`."""
        self.voters.add(offset, voter_set)
        self.voters_changed()

    def _note_voter_sets(self, control_batches: bytes) -> None:
        found = voter_sets_in(control_batches) if control_batches else []
        for offset, vs in found:
            self.voters.add(offset, vs)
        if found:
            self.voters_changed()

    def on_flushed(self, flushed_end_offset: int) -> bool:
        """FlushCompleted: True if the flushed end moved."""
        new = min(flushed_end_offset, self.log_end_offset)
        if new > self.flushed_end_offset:
            self.flushed_end_offset = new
            return True
        return False

    def truncate_to_leader(self, leader_epoch: int, leader_end: int, why: str) -> None:
        """Kafka's truncateToEndOffset: cut to the largest offset both logs agree on."""
        if leader_epoch < 0 or leader_end < 0:
            target = self.log_start_offset  # the leader has nothing we could share
        else:
            local_epoch, local_end = self.epochs.end_offset_for_epoch(leader_epoch, self.log_end_offset)
            if local_end < 0:
                target = self.log_start_offset
            elif local_epoch == leader_epoch:
                target = min(local_end, leader_end)
            else:
                target = local_end
        target = min(target, self.log_end_offset)
        if target < self.high_watermark or target < self.log_start_offset:
            self.fail(
                f"{why} ({leader_epoch}, {leader_end}) asks to truncate to {target}, below our "
                f"high watermark {self.high_watermark} / log start {self.log_start_offset}")
            return
        if target < self.log_end_offset:
            self.outbox.actions.append(TruncateLog(target))
            self.log_end_offset = target
            self.flushed_end_offset = min(self.flushed_end_offset, target)
            if self.epochs.truncate_from_end(target):
                self._checkpoint()
            if self.voters.truncate_from(target):
                self.voters_changed()  # the set goes back with the log (KIP-853)

    def follower_hw(self, leader_hw: int) -> None:
        new = min(self.log_end_offset, leader_hw)
        if new > self.high_watermark:
            self.high_watermark = new

    def follower_log_start(self, leader_lso: int) -> None:
        """KIP-630: follow the leader's LBO up to our newest snapshot below it."""
        if leader_lso <= self.log_start_offset:
            return
        best = None
        for s in self.snapshots:
            if self.log_start_offset < s.end_offset <= leader_lso and s.end_offset <= self.high_watermark:
                best = s.end_offset
        if best is not None and best <= self.log_end_offset:
            self.advance_log_start(best)

    def advance_log_start(self, target: int) -> None:
        invariant(self.log_start_offset < target <= self.log_end_offset,
                  "log start %d -> %d, not in (%d, log end %d]", self.log_start_offset, target,
                  self.log_start_offset, self.log_end_offset)
        self.outbox.actions.append(AdvanceLogStart(target))
        self.log_start_offset = target
        if self.epochs.truncate_from_start(target):
            self._checkpoint()
        self.snapshots = [s for s in self.snapshots if s.end_offset >= target]
        self.voters.trim_before(target)

    # -- snapshots -----------------------------------------------------------

    def add_snapshot(self, sid: m.SnapshotId) -> None:
        """SnapshotCreated: the driver wrote a snapshot of the committed state."""
        if sid.end_offset < self.log_start_offset or sid.end_offset > self.high_watermark:
            raise ValueError(
                f"snapshot {sid.end_offset}-{sid.epoch} is outside [log start "
                f"{self.log_start_offset}, high watermark {self.high_watermark}]")
        if sid.end_offset > self.log_start_offset:
            epoch = self.epochs.epoch_for_offset(sid.end_offset - 1)
            if epoch != sid.epoch:
                raise ValueError(
                    f"snapshot {sid.end_offset}-{sid.epoch}: the record at offset "
                    f"{sid.end_offset - 1} has epoch {epoch}")
        if sid not in self.snapshots:
            self.snapshots.append(sid)
            self.snapshots.sort()

    def install_snapshot(self, sid: m.SnapshotId, size_bytes: int, voter_set: VoterSet | None) -> None:
        """A downloaded snapshot replaces the whole log (kept for a rollback);
        `voter_set` is the one it holds (None: static voters, kraft version 0)."""
        self.pre_install = _PreInstall(sid, self.log_start_offset, self.log_end_offset, self.flushed_end_offset,
                                       list(self.epochs.entries), list(self.snapshots), self.high_watermark,
                                       self.voters.copy())
        before = self.voters.latest
        base = voter_set or self.static_voters
        if base is None:
            raise InvariantViolation(f"snapshot {sid} holds no voter set and there are no static voters")
        self.voters.reset(base)
        if self.voters.latest != before:
            self.voters_changed()
        self.outbox.actions.append(InstallSnapshot(sid, size_bytes))
        # The log now starts and ends at the snapshot; its epoch is our last epoch
        # (KIP-630: the snapshot stands for every record below end_offset).
        self.log_start_offset = sid.end_offset
        self.log_end_offset = sid.end_offset
        self.flushed_end_offset = sid.end_offset
        self.epochs = EpochHistory([(sid.epoch, sid.end_offset)])
        self._checkpoint()
        self.snapshots = [sid]
        if sid.end_offset > self.high_watermark:
            self.high_watermark = sid.end_offset  # a snapshot only holds committed data

    def rollback_install(self, sid: m.SnapshotId) -> None:
        """The driver rejected the download and kept its log: so do we."""
        pre = self.pre_install
        if pre is None or pre.snapshot_id != sid:
            raise ValueError(f"SnapshotInstallFailed for {sid} without a matching InstallSnapshot")
        self.pre_install = None
        before = self.voters.latest
        self.log_start_offset, self.log_end_offset = pre.log_start_offset, pre.log_end_offset
        self.flushed_end_offset = pre.flushed_end_offset
        self.snapshots, self.voters = pre.snapshots, pre.voters
        if self.voters.latest != before:
            self.voters_changed()
        self.epochs = EpochHistory(pre.epochs)
        self._checkpoint()
        # Back to the HW we had: the snapshot's end was committed, but the old
        # log past our old HW may hold records that diverge from it.
        self.high_watermark = pre.high_watermark

    # -- quarantine (issue 12) ----------------------------------------------

    def cut_for_quarantine(self, end: int, must_reach_offset: int, uncommitted_from: int | None,
                           epoch_bound: int) -> None:
        """The driver cut our log to `end`; we may vote again for candidates at
        least as up to date as our log up to `must_reach_offset` (whose last
        epoch we read before the cut; `epoch_bound`, the quorum epoch, bounds
        it when the mark is past what we hold). `uncommitted_from`: where no
        record can have been committed, if our role knows it (a leader)."""
        if uncommitted_from is not None:
            # A leader that lost only records nobody can have committed has
            # forgotten nothing a vote depends on: it needs to re-replicate only
            # up to its high watermark. Otherwise, if the only other copy of the
            # lost tail is on a replica that never stands (a voter whose removal
            # is in that tail), no leader could ever be elected (sim seed 1127).
            must_reach_offset = min(must_reach_offset, uncommitted_from)
        if end < self.log_start_offset or end > self.log_end_offset:
            raise ValueError(f"quarantine cut the log to {end}, outside [log start "
                             f"{self.log_start_offset}, log end {self.log_end_offset}]")
        if must_reach_offset > self.must_reach_offset:
            # Read before the cut: the epoch of the record the mark follows.
            if must_reach_offset > self.log_end_offset:
                epoch = epoch_bound
            elif must_reach_offset - 1 < self.log_start_offset:
                epoch = self.snapshots[-1].epoch if self.snapshots else epoch_bound
            else:
                epoch = self.epochs.epoch_for_offset(must_reach_offset - 1)
            self.must_reach_epoch = max(self.must_reach_epoch, epoch)
            self.must_reach_offset = must_reach_offset
        self.log_end_offset = end
        self.flushed_end_offset = min(self.flushed_end_offset, end)
        # What we can still serve as committed is what we still hold.
        self.high_watermark = min(self.high_watermark, end)
        if self.epochs.truncate_from_end(end):
            self._checkpoint()
        if self.voters.truncate_from(end):
            self.voters_changed()

    def maybe_clear_quarantine(self, may_vote: bool) -> None:
        must = self.must_reach_offset
        if must >= 0 and (must <= self.flushed_end_offset or not may_vote):
            # (a static observer's log never counts toward a vote or a commit;
            # with a voter set in the log a node may become a voter by
            # replicating: it keeps the quarantine until it has re-replicated)
            self.outbox.actions.append(ClearQuarantine(must))
            self.must_reach_offset = -1
            self.must_reach_epoch = -1
