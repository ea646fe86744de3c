"""One segment: a ``.log`` file with its ``.index`` and ``.timeindex``, their
entries held in memory, and the reads that need only this one segment
(walking batch headers, finding the batch of an offset). Kafka's LogSegment.

A Segment's fields are mutated by the log's owner thread under the
SegmentedLog's lock (see metalog.storage.segments.segment_table); reads of
its file by position are safe from any thread while its fd is open.
"""

from __future__ import annotations

import bisect
import itertools
import mmap
import os
from array import array
from typing import Callable, Iterator, NamedTuple

from metalog.storage import batch as B
from metalog.storage.errors import CorruptLogError
from metalog.storage.segments.layout import (
    ATTRIBUTES, ATTRIBUTES_POS, DELETED_SUFFIX, HDR_PREFIX, INDEX_ENTRY, INDEX_SUFFIX, LAST_DELTA,
    LAST_DELTA_POS, LOG_SUFFIX, SCAN_CHUNK_BYTES, TIME_ENTRY, TIMEINDEX_SUFFIX, segment_file_name, write_all)

_GENERATIONS = itertools.count()  # process-wide: next() is atomic under the GIL
CHANGING = -1  # generation of a segment the owner is truncating right now

# (position, base offset, size, epoch, next offset, attributes) of one batch.
HeaderWalk = tuple[int, int, int, int, int, int]

# The last batches appended by this process, remembered per segment: the
# reads of the log's tail (a replica's Fetch, the apply of what was just
# committed) find them without reading headers back (docs/bench.md: the
# locate's walk from the index entry was about 8% of a leader's CPU).
TAIL_BATCHES_MAX = 256


def new_generation() -> int:
    return next(_GENERATIONS)


class BatchInfo(NamedTuple):
    """Where one batch sits and what its header says (no payload)."""

    base_offset: int
    next_offset: int  # last offset + 1
    leader_epoch: int
    size_bytes: int  # on disk
    segment_base_offset: int
    position: int  # byte position inside the segment file
    is_control: bool = False  # the control bit of the batch's attributes


class SegmentRef(NamedTuple):
    """A sealed segment as the scrubber sees it: enough to read it by path and
    to check afterwards that the owner did not replace it meanwhile."""

    base_offset: int
    next_offset: int
    prev_epoch: int  # last epoch before this segment (-1 if none)
    log_path: str
    size_bytes: int
    inode: int
    generation: int  # bumped when the owner truncates it or makes it active again


class Segment:
    """One .log/.index/.timeindex triple and its in-memory index entries."""

    __slots__ = ("base_offset", "log_path", "index_path", "fd", "index_fd", "size_bytes",
                 "next_offset", "last_epoch", "index_rel", "index_pos", "last_index_pos", "generation",
                 "timeindex_path", "time_fd", "time_ts_ms", "time_rel", "max_ts_ms", "max_rel", "tail", "tail_next")

    def __init__(self, directory: str, base_offset: int):
        self.base_offset = base_offset
        self.log_path = os.path.join(directory, segment_file_name(base_offset, LOG_SUFFIX))
        self.index_path = os.path.join(directory, segment_file_name(base_offset, INDEX_SUFFIX))
        flags = os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
        self.fd = os.open(self.log_path, flags, 0o644)
        self.timeindex_path = os.path.join(directory, segment_file_name(base_offset, TIMEINDEX_SUFFIX))
        try:
            self.index_fd = os.open(self.index_path, flags, 0o644)
            try:
                self.time_fd = os.open(self.timeindex_path, flags, 0o644)
            except BaseException:
                os.close(self.index_fd)
                raise
        except BaseException:
            os.close(self.fd)
            raise
        self.size_bytes = os.fstat(self.fd).st_size
        self.next_offset = base_offset
        self.last_epoch = -1
        self.index_rel = array("I")
        self.index_pos = array("I")
        self.last_index_pos = 0
        # The .timeindex entries; max_ts_ms/max_rel: the largest batch max
        # timestamp (ms) of the segment and the relative last offset of its batch.
        self.time_ts_ms = array("q")
        self.time_rel = array("I")
        self.max_ts_ms = -1
        self.max_rel = 0
        # Unique per segment object and renewed whenever the content below
        # `size_bytes` may change (truncation), so the scrubber can tell "same
        # name, same size, even the same (reused) inode, other bytes" (ABA).
        self.generation = new_generation()
        # The batches this process appended last, ending at size_bytes, and
        # their next offsets (for bisect): see note_appended.
        self.tail: list[HeaderWalk] = []
        self.tail_next: list[int] = []

    def note_appended(self, headers: list[B.BatchHeader], file_start: int) -> None:
        """Remember where the batches just written at `file_start` sit (owner
        thread, under the log's lock, once size_bytes counts them)."""
        tail, tail_next = self.tail, self.tail_next
        if tail and tail[-1][0] + tail[-1][2] != file_start:
            tail.clear()
            tail_next.clear()
        pos = file_start
        for h in headers:
            size = B.LOG_OVERHEAD + h.length
            nxt = h.base_offset + h.last_offset_delta + 1
            tail.append((pos, h.base_offset, size, h.leader_epoch, nxt, h.attributes))
            tail_next.append(nxt)
            pos += size
        if len(tail) > TAIL_BATCHES_MAX:
            del tail[:TAIL_BATCHES_MAX // 2]
            del tail_next[:TAIL_BATCHES_MAX // 2]

    def _tail_index(self, offset: int) -> int:
        """Index in `tail` of the batch holding `offset`; -1 if the tail does not hold it."""
        tail = self.tail
        if not tail or offset < tail[0][1] or offset >= self.tail_next[-1]:
            return -1
        last = tail[-1]
        if last[0] + last[2] != self.size_bytes:
            return -1  # the file moved on without us (never expected): read the headers
        return bisect.bisect_right(self.tail_next, offset)

    def batches_from(self, offset: int) -> Iterator[HeaderWalk]:
        """Each batch from the one holding `offset` to the segment end (none
        if past it): from the tail in memory, else by reading headers."""
        i = self._tail_index(offset)
        if i >= 0:
            return iter(self.tail[i:])
        found = self.locate(offset)
        if found is None:
            return iter(())
        return self.walk(found[0], self.size_bytes)

    def set_index(self, rel: list[int] | array[int], pos: list[int] | array[int]) -> None:
        self.index_rel = array("I", rel)
        self.index_pos = array("I", pos)
        self.last_index_pos = self.index_pos[-1] if self.index_pos else 0

    def set_time_index(self, time_ts_ms: list[int], time_rel: list[int], max_ts_ms: int, max_rel: int) -> None:
        self.time_ts_ms = array("q", time_ts_ms)
        self.time_rel = array("I", time_rel)
        self.max_ts_ms, self.max_rel = max_ts_ms, max_rel

    def write_index_file(self) -> None:
        """Replace the .index and .timeindex content with the in-memory entries."""
        data = b"".join(INDEX_ENTRY.pack(r, p) for r, p in zip(self.index_rel, self.index_pos))
        os.ftruncate(self.index_fd, 0)
        write_all(self.index_fd, data)
        data = b"".join(TIME_ENTRY.pack(t, r) for t, r in zip(self.time_ts_ms, self.time_rel))
        os.ftruncate(self.time_fd, 0)
        write_all(self.time_fd, data)

    def sync_index_files(self) -> None:
        os.fsync(self.index_fd)
        os.fsync(self.time_fd)

    def close(self) -> None:
        for fd in (self.fd, self.index_fd, self.time_fd):
            try:
                os.close(fd)
            except OSError:
                pass

    def delete(self, unlink: Callable[[str], None] | None = None) -> None:
        """Remove the segment's files. `unlink`, if given, is handed each
        file renamed ``.deleted`` instead of unlinking it here (the runtime
        unlinks on a worker thread: freeing a 64 MB file's blocks is
        milliseconds on a disk mounted with discard); the rename keeps the
        name free for a new segment, and open() removes what a crash left."""
        self.close()
        for path in (self.log_path, self.index_path, self.timeindex_path):
            try:
                if unlink is None:
                    os.unlink(path)
                else:
                    os.rename(path, path + DELETED_SUFFIX)
                    unlink(path + DELETED_SUFFIX)
            except FileNotFoundError:
                pass

    def cut_files(self, cut: int) -> tuple[int, int]:
        """Truncate the files at byte `cut` (a batch boundary), keeping the
        index entries below it, and fdatasync the .log. Returns the number of
        .index and .timeindex entries kept, for `forget_past`."""
        n_keep = bisect.bisect_left(self.index_pos, cut)
        # Time entries stay while they name an offset the kept index covers.
        t_keep = bisect.bisect_right(self.time_rel, self.index_rel[n_keep - 1]) if n_keep else 0
        os.ftruncate(self.fd, cut)
        os.ftruncate(self.index_fd, n_keep * INDEX_ENTRY.size)
        os.ftruncate(self.time_fd, t_keep * TIME_ENTRY.size)
        os.fdatasync(self.fd)
        return n_keep, t_keep

    def forget_past(self, cut: int, n_keep: int, t_keep: int, next_offset: int) -> None:
        """In memory, after `cut_files` (under the log's lock): the segment ends at `cut`."""
        self.size_bytes = cut
        self.tail.clear()
        self.tail_next.clear()
        del self.index_rel[n_keep:]
        del self.index_pos[n_keep:]
        del self.time_ts_ms[t_keep:]
        del self.time_rel[t_keep:]
        self.last_index_pos = self.index_pos[-1] if self.index_pos else 0
        self.next_offset = next_offset

    def map(self) -> mmap.mmap | bytes:
        """The whole .log, read-only mapped (b"" when empty: mmap refuses 0 bytes)."""
        if self.size_bytes == 0:
            return b""
        return mmap.mmap(self.fd, self.size_bytes, access=mmap.ACCESS_READ)

    def walk(self, pos: int, end_pos: int) -> Iterator[HeaderWalk]:
        """(position, base offset, size, epoch, next offset, attributes) of each
        batch from `pos` to `end_pos`, reading headers in SCAN_CHUNK_BYTES preads."""
        buf = b""
        buf_start = pos
        while pos < end_pos:
            rel = pos - buf_start
            if rel + B.HEADER_SIZE > len(buf):
                buf = os.pread(self.fd, min(SCAN_CHUNK_BYTES, end_pos - pos), pos)
                buf_start, rel = pos, 0
                if len(buf) < B.HEADER_SIZE:
                    raise CorruptLogError(f"{self.log_path}: short read of a batch header at byte {pos}",
                                          self.log_path, pos, None)
            base, length, epoch = HDR_PREFIX.unpack_from(buf, rel)
            (delta,) = LAST_DELTA.unpack_from(buf, rel + LAST_DELTA_POS)
            (attributes,) = ATTRIBUTES.unpack_from(buf, rel + ATTRIBUTES_POS)
            size = B.LOG_OVERHEAD + length
            if length < B.HEADER_SIZE - B.LOG_OVERHEAD or pos + size > end_pos:
                raise CorruptLogError(f"{self.log_path}: bad batch length {length} at byte {pos}",
                                      self.log_path, pos, base)
            yield pos, base, size, epoch, base + delta + 1, attributes
            pos += size

    def locate(self, offset: int) -> HeaderWalk | None:
        """The batch containing `offset` (None if past the segment end)."""
        i = self._tail_index(offset)
        if i >= 0:
            return self.tail[i]
        i = bisect.bisect_right(self.index_rel, offset - self.base_offset) - 1
        expect: int | None
        if i >= 0:  # an entry names the LAST offset of the batch at its position
            pos, expect = self.index_pos[i], self.base_offset + self.index_rel[i]
        else:
            pos, expect = 0, None
        first = True
        for item in self.walk(pos, self.size_bytes):
            if first and (item[1] != self.base_offset if expect is None else item[4] - 1 != expect):
                got, want = (item[1], self.base_offset) if expect is None else (item[4] - 1, expect)
                what = "base" if expect is None else "last"
                raise CorruptLogError(f"{self.index_path}: entry points at byte {pos} holding {what} "
                                      f"offset {got}, expected {want}", self.log_path, pos, item[1])
            first = False
            if item[4] > offset:
                return item
        return None

    def tail_epoch(self) -> int:
        """Leader epoch of the last batch (walking from the last .index entry), -1 if none."""
        epoch = -1
        for _pos, _base, _size, e, _nxt, _attrs in self.walk(self.last_index_pos, self.size_bytes):
            epoch = e
        return epoch

    def max_timestamp(self) -> tuple[int, int]:
        """(largest batch max timestamp, its batch's relative last offset) of
        the segment: the last .timeindex entry's, then the batches after the
        last .index entry (which the entry does not cover)."""
        best = (self.time_ts_ms[-1], self.time_rel[-1]) if self.time_ts_ms else (-1, 0)
        tail = os.pread(self.fd, self.size_bytes - self.last_index_pos, self.last_index_pos)
        for _pos, h in B.iter_batches(tail, verify=False):
            if h.max_timestamp_ms > best[0]:
                best = (h.max_timestamp_ms, h.last_offset - self.base_offset)
        return best
