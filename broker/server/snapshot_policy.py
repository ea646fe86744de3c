"""When the broker writes a snapshot of the controller's applied state.

KIP-630: a replica snapshots its committed state once enough records have
been applied since the last snapshot (Kafka's
``metadata.log.max.record.bytes.between.snapshots``; here counted in records,
``snapshot_min_records``, as controller.snapshot.minimum.records), one
snapshot at a time, never twice for the same end offset. The snapshot ends at
the applied offset and carries the epoch of the last record it covers.

Pure: the runtime asks ``next_snapshot`` after applying records and writes
the snapshot it names (on a worker thread), then feeds SnapshotCreated.
"""

from __future__ import annotations

from typing import Callable

from metalog.protocol import messages as m
from metalog.protocol.invariants import invariant


class SnapshotPolicy:
    def __init__(self, min_records: int):
        if min_records <= 0:
            raise ValueError(f"snapshot_min_records must be > 0, got {min_records}")
        self.min_records = min_records

    def due(self, records_since_snapshot: int, busy: bool) -> bool:
        """Whether a snapshot may be wanted at all: cheap, so a caller asks
        it after every apply before building ``next_snapshot``'s arguments."""
        return not busy and records_since_snapshot >= self.min_records

    def next_snapshot(self, *, records_since_snapshot: int, applied_offset: int,
                      epoch_for_offset: Callable[[int], int], exists: Callable[[m.SnapshotId], bool],
                      busy: bool) -> m.SnapshotId | None:
        """The snapshot to write now, or None. `busy`: one is being written
        (or the broker is stopping); `exists`: that snapshot is on disk already."""
        if not self.due(records_since_snapshot, busy):
            return None
        invariant(applied_offset > 0, "%d records applied since the last snapshot, yet nothing applied",
                  records_since_snapshot)
        snap_id = m.SnapshotId(applied_offset, epoch_for_offset(applied_offset - 1))
        if exists(snap_id):
            return None
        return snap_id
