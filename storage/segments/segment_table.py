"""The live segments of one log, in offset order, with the offsets that
flush() shares across threads and the lock that guards them. Kafka keeps the
same state in LocalLog's segment map and its recovery/flush offsets.

Threading contract: every field is written by the log's owner thread (the
event loop) under `lock`; flush() reads and writes the flush fields under it
from one other thread; the scrubber's two views (`sealed_refs`,
`unchanged`) may run on any thread.
"""

from __future__ import annotations

import bisect
import os
import threading

from metalog.storage.segments.segment import CHANGING, Segment, SegmentRef


class SegmentTable:
    """Segments, their base offsets (bisected on every read) and the log's
    start, end, flushed end and last epoch."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # guards the fields flush() reads
        self.segments: list[Segment] = []
        self.bases: list[int] = []
        self.log_start_offset = 0
        self.end_offset = 0
        self.flushed_end_offset = 0
        self.last_epoch = -1
        self.flush_cap: int | None = None  # end offset the running flush will report
        self.unsynced_rolled: list[Segment] = []  # sealed by a roll, not yet fdatasync'ed
        self.dir_dirty = False  # a roll created a file the directory's fsync has not covered

    def set_segments(self, segments: list[Segment]) -> None:
        self.segments = segments
        self.bases = [s.base_offset for s in segments]

    @property
    def active(self) -> Segment:
        return self.segments[-1]

    def index_for(self, offset: int) -> int:
        """Index of the segment holding `offset` (by base offset)."""
        return bisect.bisect_right(self.bases, offset) - 1

    def prev_epoch(self, i: int) -> int:
        """Epoch of the last batch before segment i, -1 if none."""
        return next((s.last_epoch for s in reversed(self.segments[:i]) if s.size_bytes), -1)

    def epoch_of_last_batch(self) -> int:
        return next((s.last_epoch for s in reversed(self.segments) if s.size_bytes), -1)

    def forget_unsynced(self, doomed: list[Segment]) -> None:
        """Under `lock`: a flush must not sync segments that are going away."""
        gone = {id(s) for s in doomed}
        self.unsynced_rolled = [s for s in self.unsynced_rolled if id(s) not in gone]

    def cap_flushed(self, new_end: int) -> None:
        """Under `lock`: a flush running now must not report offsets at or past
        `new_end`, which are going away."""
        self.flushed_end_offset = min(self.flushed_end_offset, new_end)
        if self.flush_cap is not None:
            self.flush_cap = min(self.flush_cap, new_end)

    def sealed_refs(self) -> list[SegmentRef]:
        """Every segment but the active one, as the scrubber reads them.
        Safe from any thread."""
        with self.lock:
            out = []
            for i, seg in enumerate(self.segments[:-1]):
                if seg.generation == CHANGING:
                    continue
                try:
                    inode = os.fstat(seg.fd).st_ino
                except OSError:  # closed by a concurrent truncation
                    continue
                out.append(SegmentRef(seg.base_offset, self.segments[i + 1].base_offset,
                                      self.prev_epoch(i), seg.log_path, seg.size_bytes, inode, seg.generation))
            return out

    def unchanged(self, ref: SegmentRef) -> bool:
        """Whether `ref` is still a sealed segment, the same file with the
        same size (not truncated, renamed or deleted since). Safe from any thread."""
        with self.lock:
            for seg in self.segments[:-1]:
                if seg.base_offset == ref.base_offset and seg.log_path == ref.log_path:
                    try:
                        return (seg.size_bytes == ref.size_bytes and seg.generation == ref.generation
                                and os.fstat(seg.fd).st_ino == ref.inode)
                    except OSError:
                        return False
            return False
