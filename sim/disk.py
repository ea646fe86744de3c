"""SimDisk: an in-memory log with a crash model, the storage under a simulated node.

It implements ``metalog.broker.quorum.api.LogReader`` over a list of encoded batches
(``metalog.storage.batch`` format) and applies the core's storage actions the way
``broker/quorum/api.py`` demands. What survives ``crash()``:

* every batch below ``flushed_end_offset`` (fsync'ed by a completed flush);
* a random prefix of the unflushed batches (the page cache may have written
  some of them before the power went), never a torn batch: recovery would drop
  it by CRC, so we model the result of recovery directly;
* quorum state, the leader-epoch checkpoint, installed snapshots and the log
  start offset: they are written tmp + fsync + rename, durable on return;
* truncation is durable on return (the runtime fsyncs after truncating), so
  truncated data never comes back;
* ``.part`` snapshot downloads are lost (boot deletes them).
* the quarantine state (``must_reach_offset``), written before the log is cut.

Corruption faults (issue 12), applied while the node is down and found by the
storage at the next open, which is modelled directly as its result (as torn
batches are): the log is cut at the first bad batch and the quarantine state
records the end it had before.

* ``bit_flip``: a flipped bit in any durable batch (the full verification at
  open, or the scrubber, finds it);
* ``lost_fsync``: the last flushed batches vanish although their fsync
  reported success, and the node knows (the recovery point it persisted says
  the log was flushed further). An UNdetected lost fsync is not survivable
  even on one voter (docs/integrity.md), so it is not injected.

``corrupt_live`` is the same found at run time (scrubber or a failed read):
the driver then feeds the core ``LogQuarantined``.

After a crash, ``log_view()`` describes the recovered log the way the runtime
would at boot: everything on disk counts as flushed, and the epoch history is
the checkpoint cut to the recovered log end.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass

from metalog.broker.quorum.api import LogView, QuorumStateData
from metalog.broker.quorum.voters import VoterSet, voter_sets_in
from metalog.protocol import messages as m
from metalog.storage.batch import BatchHeader, decode_records, iter_batches
from metalog.storage.epochs import EpochHistory


@dataclass(frozen=True, slots=True)
class StoredBatch:
    base_offset: int
    next_offset: int
    epoch: int
    is_control: bool
    data: bytes


class SimDiskError(AssertionError):
    """The core asked the disk for something the contract forbids."""


def split_batches(data: bytes) -> list[StoredBatch]:
    out = []
    end_pos = 0
    for pos, h in iter_batches(data):
        out.append(_stored(data[pos:pos + h.size], h))
        end_pos = pos + h.size
    if end_pos != len(data):
        raise SimDiskError(f"AppendBatches data has {len(data) - end_pos} trailing bytes that are not a whole batch")
    return out


def _stored(raw: bytes, h: BatchHeader) -> StoredBatch:
    return StoredBatch(h.base_offset, h.next_offset, h.leader_epoch, h.is_control, raw)


class SimDisk:
    def __init__(self) -> None:
        self.batches: list[StoredBatch] = []
        self._bases: list[int] = []  # base offsets of self.batches, for bisect
        self.log_start_offset = 0
        self._empty_end_offset = 0  # log end when there are no batches (after a snapshot)
        self.flushed_end_offset = 0
        self.quorum_state: QuorumStateData | None = None
        # meta.properties' directory.id (KIP-853); the cluster names it, and
        # gives a new one when the whole disk is replaced (wipe "all").
        self.directory_id = ""
        # KIP-853: the bootstrap checkpoint `storage format --initial-controllers`
        # writes (a dynamic cluster's initial voters); None: static voters, or
        # formatted with --no-initial-controllers, or lost with a wiped disk.
        self.bootstrap_voters: VoterSet | None = None
        self.epoch_checkpoint: tuple[tuple[int, int], ...] = ()
        self.snapshots: dict[m.SnapshotId, bytes] = {}  # complete snapshots
        self.partial_snapshots: dict[m.SnapshotId, bytearray] = {}
        self.version = 0  # bumped whenever existing records change (truncate, install, wipe)
        self.must_reach_offset = -1  # persisted quarantine state; -1: none
        # The simulator's own memory of the batches a quarantine cut (not part
        # of the modelled disk): what a quarantined voter's votes are checked against.
        self.lost_batches: list[StoredBatch] = []

    # -- LogReader ---------------------------------------------------------
    def read(self, start_offset: int, end_offset: int, max_bytes: int) -> bytes:
        if start_offset < self.log_start_offset:
            raise SimDiskError(f"read from {start_offset} below the log start offset {self.log_start_offset}")
        i = self._index_of(start_offset)
        if i is None:
            return b""
        out: list[bytes] = []
        size_bytes = 0
        while i < len(self.batches):
            b = self.batches[i]
            if b.next_offset > end_offset:
                break
            if out and size_bytes + len(b.data) > max_bytes:
                break
            out.append(b.data)
            size_bytes += len(b.data)
            i += 1
        return b"".join(out)

    def snapshot_size(self, snapshot_id: m.SnapshotId) -> int | None:
        data = self.snapshots.get(snapshot_id)
        return None if data is None else len(data)

    def read_snapshot(self, snapshot_id: m.SnapshotId, position: int, max_bytes: int) -> bytes:
        data = self.snapshots.get(snapshot_id)
        if data is None:
            raise SimDiskError(f"read of snapshot {snapshot_id} that does not exist")
        if position < 0 or position >= len(data):
            raise SimDiskError(f"snapshot read at {position} outside 0..{len(data)}")
        return data[position:position + max_bytes]

    # -- queries used by the driver and the invariant checkers ---------------
    @property
    def log_end_offset(self) -> int:
        return self.batches[-1].next_offset if self.batches else self._empty_end_offset

    def _index_of(self, offset: int) -> int | None:
        """Index of the batch holding `offset`, None if no batch holds it."""
        i = bisect.bisect_right(self._bases, offset) - 1
        if i < 0 or offset >= self.batches[i].next_offset:
            return None
        return i

    def batch_at(self, offset: int) -> StoredBatch | None:
        i = self._index_of(offset)
        return None if i is None else self.batches[i]

    def record_at(self, offset: int) -> tuple[int, bytes] | None:
        """(epoch, value) of the record at `offset` in the log, None if absent."""
        b = self.batch_at(offset)
        if b is None:
            return None
        return b.epoch, decode_records(b.data)[offset - b.base_offset]

    def snapshot_record_at(self, offset: int) -> tuple[int, bytes] | None:
        """(epoch, value) of `offset` from the newest snapshot holding it."""
        for sid in sorted(self.snapshots, reverse=True):
            if offset < sid.end_offset:
                for b in split_batches(self.snapshots[sid]):
                    if b.base_offset <= offset < b.next_offset:
                        return b.epoch, decode_records(b.data)[offset - b.base_offset]
                return None
        return None

    def any_record_at(self, offset: int) -> tuple[int, bytes] | None:
        if offset >= self.log_start_offset:
            return self.record_at(offset)
        return self.snapshot_record_at(offset)

    def epoch_at(self, offset: int) -> int | None:
        b = self.batch_at(offset)
        return None if b is None else b.epoch

    # -- actions -------------------------------------------------------------
    def persist_quorum_state(self, state: QuorumStateData) -> None:
        self.quorum_state = state

    def append(self, data: bytes, base_offset: int, next_offset: int) -> None:
        new = split_batches(data)
        if not new:
            raise SimDiskError("AppendBatches with no batch")
        if base_offset != self.log_end_offset:
            raise SimDiskError(f"AppendBatches at {base_offset} but the log ends at {self.log_end_offset}")
        expect = base_offset
        for b in new:
            if b.base_offset != expect:
                raise SimDiskError(f"batch at {b.base_offset} where {expect} was expected (offsets not contiguous)")
            expect = b.next_offset
        if expect != next_offset:
            raise SimDiskError(f"AppendBatches says next_offset {next_offset} but the batches end at {expect}")
        self.batches.extend(new)
        self._bases.extend(b.base_offset for b in new)

    def truncate(self, end_offset: int) -> None:
        if end_offset < self.log_start_offset:
            raise SimDiskError(f"truncate to {end_offset} below the log start offset {self.log_start_offset}")
        if end_offset >= self.log_end_offset:
            return
        i = bisect.bisect_left(self._bases, end_offset)
        if i > 0 and self.batches[i - 1].next_offset > end_offset:
            raise SimDiskError(f"truncate to {end_offset} falls inside the batch at {self.batches[i - 1].base_offset}")
        del self.batches[i:]
        del self._bases[i:]
        if not self.batches:
            self._empty_end_offset = end_offset
        self.flushed_end_offset = min(self.flushed_end_offset, end_offset)
        self.version += 1

    def write_epoch_checkpoint(self, entries: tuple[tuple[int, int], ...]) -> None:
        self.epoch_checkpoint = tuple(tuple(e) for e in entries)

    def flush(self, target_end_offset: int) -> int:
        """A flush issued when the log ended at `target_end_offset` completed."""
        self.flushed_end_offset = max(self.flushed_end_offset, min(target_end_offset, self.log_end_offset))
        return self.flushed_end_offset

    def write_snapshot_chunk(self, snapshot_id: m.SnapshotId, position: int, data: bytes) -> None:
        if position == 0:
            # A download begins: every other partial is superseded, as the runtime deletes
            # them (broker/server/snapshot_work.py): one download on disk at most.
            self.partial_snapshots.clear()
            self.partial_snapshots[snapshot_id] = bytearray()
        part = self.partial_snapshots.get(snapshot_id)
        if part is None or len(part) != position:
            have = None if part is None else len(part)
            raise SimDiskError(f"snapshot chunk at {position} of {snapshot_id} but the .part file holds {have} bytes")
        part.extend(data)

    def install_snapshot(self, snapshot_id: m.SnapshotId, size_bytes: int) -> bool:
        part = self.partial_snapshots.pop(snapshot_id, None)
        if part is None or len(part) != size_bytes:
            return False  # verification failed: the core re-fetches later
        self.snapshots = {sid: d for sid, d in self.snapshots.items() if sid > snapshot_id}
        self.snapshots[snapshot_id] = bytes(part)
        self.batches.clear()
        self._bases.clear()
        self.log_start_offset = snapshot_id.end_offset
        self._empty_end_offset = snapshot_id.end_offset
        self.flushed_end_offset = snapshot_id.end_offset
        self.version += 1
        return True

    def create_snapshot(self, end_offset: int) -> m.SnapshotId | None:
        """Snapshot the log below `end_offset` (a batch boundary) as a copy of
        every batch there, the newest snapshot's content first. None when the
        log cannot produce it (records missing)."""
        if end_offset <= self.log_start_offset or end_offset > self.log_end_offset:
            return None
        last = self.batch_at(end_offset - 1)
        if last is None or last.next_offset != end_offset:
            return None
        prefix = b""
        if self.log_start_offset > 0:
            base = [s for s in self.snapshots if s.end_offset == self.log_start_offset]
            if not base:
                return None
            prefix = self.snapshots[base[0]]
        i = self._index_of(self.log_start_offset) if self.batches else None
        if i is None:
            return None
        body = b"".join(b.data for b in self.batches[i:] if b.next_offset <= end_offset)
        sid = m.SnapshotId(end_offset=end_offset, epoch=last.epoch)
        self.snapshots[sid] = prefix + body
        return sid

    def advance_log_start(self, log_start_offset: int) -> None:
        if log_start_offset <= self.log_start_offset:
            return
        # Only whole batches below the new start go (our "segments" are batches).
        keep = [b for b in self.batches if b.next_offset > log_start_offset]
        self.batches = keep
        self._bases = [b.base_offset for b in keep]
        if not keep:
            self._empty_end_offset = max(self._empty_end_offset, log_start_offset)
        self.log_start_offset = log_start_offset
        covering = [s for s in self.snapshots if s.end_offset <= log_start_offset]
        if covering:
            newest = max(covering)
            self.snapshots = {s: d for s, d in self.snapshots.items() if s >= newest}

    # -- faults --------------------------------------------------------------
    def crash(self, rng: random.Random) -> None:
        """Power loss: keep the flushed prefix and a random prefix of the rest."""
        i = bisect.bisect_left(self._bases, self.flushed_end_offset)
        unflushed = len(self.batches) - i
        keep = i + (rng.randint(0, unflushed) if unflushed else 0)
        if keep < len(self.batches):
            if keep == 0:
                self._empty_end_offset = max(self.log_start_offset, self.batches[0].base_offset)
            del self.batches[keep:]
            del self._bases[keep:]
            self.version += 1
        self.flushed_end_offset = self.log_end_offset
        self.partial_snapshots.clear()

    def quarantine(self, cut_index: int) -> tuple[int, int] | None:
        """Corruption found in batch `cut_index`: persist the quarantine state
        (the end we had, which we may have acknowledged), then cut the log to
        the last good batch. Returns (new end, must_reach) or None if no batch."""
        if not self.batches:
            return None
        cut_index = max(0, min(cut_index, len(self.batches) - 1))
        old_end = self.log_end_offset
        self.must_reach_offset = max(self.must_reach_offset, old_end)  # persisted first
        new_end = self.batches[cut_index].base_offset
        self.lost_batches = self.batches[cut_index:] + [b for b in self.lost_batches if b.base_offset >= old_end]
        del self.batches[cut_index:]
        del self._bases[cut_index:]
        if not self.batches:
            self._empty_end_offset = new_end
        self.flushed_end_offset = min(self.flushed_end_offset, new_end)
        self.version += 1
        return new_end, self.must_reach_offset

    def bit_flip(self, rng: random.Random) -> tuple[int, int] | None:
        if not self.batches:
            return None
        return self.quarantine(rng.randrange(len(self.batches)))

    def lost_fsync(self, rng: random.Random) -> tuple[int, int] | None:
        if not self.batches:
            return None
        return self.quarantine(len(self.batches) - rng.randint(1, min(3, len(self.batches))))

    def epoch_before(self, offset: int) -> int | None:
        """The epoch of the record at offset - 1, held or lost to a quarantine."""
        e = self.epoch_at(offset - 1)
        if e is not None:
            return e
        return next((b.epoch for b in self.lost_batches if b.base_offset < offset <= b.next_offset), None)

    def clear_quarantine(self, must_reach_offset: int, is_voter: bool = True) -> None:
        if self.must_reach_offset < 0:
            raise SimDiskError("ClearQuarantine while not quarantined")
        # The driver checks a mark below ours (a leader's high watermark); the
        # log must have reached the mark the core clears at.
        must = min(self.must_reach_offset, must_reach_offset)
        if is_voter and self.flushed_end_offset < must:
            raise SimDiskError(f"ClearQuarantine with the flushed end at {self.flushed_end_offset}, "
                               f"below must_reach_offset {must}")
        self.must_reach_offset = -1
        self.lost_batches = []

    def wipe_log(self) -> None:
        """Lose the log, epochs and snapshots (a replaced disk); quorum state is kept."""
        self.must_reach_offset = -1  # the quarantine-state file lived in the log dir
        self.lost_batches = []
        self.batches.clear()
        self._bases.clear()
        self.log_start_offset = 0
        self._empty_end_offset = 0
        self.flushed_end_offset = 0
        self.epoch_checkpoint = ()
        self.snapshots.clear()
        self.partial_snapshots.clear()
        self.version += 1

    def wipe_all(self) -> None:
        self.wipe_log()
        self.quorum_state = None
        self.bootstrap_voters = None  # a new disk: formatted with --no-initial-controllers

    def _snapshot_voter_set(self):
        """The latest voter set in the snapshot the log starts at (a sim
        snapshot is a copy of the log's batches); None: static voters."""
        if self.log_start_offset == 0:
            return None
        base = [d for sid, d in self.snapshots.items() if sid.end_offset == self.log_start_offset]
        found = voter_sets_in(base[0]) if base else []
        return found[-1][1] if found else None

    def log_view(self) -> LogView:
        end_offset = self.log_end_offset
        history = EpochHistory(self.epoch_checkpoint)
        history.truncate_from_end(end_offset)
        # Recovery rebuilds epochs the checkpoint missed from the batches (as Kafka does).
        for b in self.batches:
            if b.epoch > history.latest_epoch:
                history.assign(b.epoch, b.base_offset)
        return LogView(
            log_start_offset=self.log_start_offset,
            log_end_offset=end_offset,
            epochs=[(e.epoch, e.start_offset) for e in history.entries],
            snapshots=sorted(self.snapshots),
            must_reach_offset=self.must_reach_offset,
            # KIP-853: the voter set of the snapshot the log starts at, and the
            # VotersRecords the recovered log holds, as the runtime finds them.
            voter_set=self._snapshot_voter_set() or (self.bootstrap_voters if self.log_start_offset == 0 else None),
            voter_history=voter_sets_in(b"".join(
                b.data for b in self.batches if b.is_control and b.base_offset >= self.log_start_offset)),
        )
