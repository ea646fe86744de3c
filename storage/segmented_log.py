"""The segmented log: the on-disk, append-only home of the replicated log.

One directory holds the log as a run of segments. Each segment is a pair

* ``<base offset, 20 digits>.log``   -- whole record batches (metalog.storage.batch format)
  back to back, the first one starting at the base offset;
* ``<base offset, 20 digits>.index`` -- a sparse offset index, Kafka's: 8-byte
  entries ``relative offset u32 | file position u32`` (big-endian), one for a
  batch roughly every ``index_interval_bytes`` of log data, where the
  relative offset is that of the batch's LAST offset and the position that
  of the batch's start (as Kafka's LogSegment indexes a batch by its largest
  offset). An offset is found by bisecting for the last entry at or below it
  and scanning headers forward from that entry's batch.
* ``<base offset, 20 digits>.timeindex`` -- Kafka's time index: 12-byte
  entries ``timestamp i64 | relative offset u32``: at each .index entry, the
  largest batch max timestamp so far in the segment and the (last) offset of
  the batch that holds it, appended only when that timestamp grew; and, as
  Kafka's LogSegment.onBecomeInactiveSegment does, one more entry when a roll
  seals the segment: (largest timestamp of the segment, last offset of its
  batch), unless the last entry already holds that timestamp. So only a
  sealed segment may end with an entry past its last .index entry, and only
  one; a segment made active again by a truncation loses it. Derived data
  like the .index: rebuilt by a full scan when missing or bad (a rebuilt
  sealed segment gets its final entry too).

Small files sit next to them: ``log-start-offset`` (JSON, written with
metalog.storage.atomic), ``.clean-shutdown`` (written by ``close()``, removed on
open), ``recovery-point-offset-checkpoint`` and, while a quarantine lasts,
``quarantine-state`` (both below). ``.lock`` holds an flock so two processes
never open one directory. Quarantined segments are kept as
``<name>.log.corrupt`` / ``<name>.index.corrupt``.

Crash recovery (``SegmentedLog.open``)
--------------------------------------
Without the clean-shutdown marker the last segment is scanned from its start,
verifying every batch's length, offsets and CRC-32C. A damaged *tail* (a torn
write of unflushed data: a partial batch, zeros, garbage with no valid batch
after it) is cut off at the last whole batch and reported with one structured
log line (``event="log_recovered"``). Damage *followed by* a valid batch, or
damage in any segment but the last, is not a torn tail: ``CorruptLogError``
names the file, byte position and base offset, and nothing is repaired.
Every other segment gets a cheap check (its index is sane and the batches
after its last index entry end exactly at the file end, at the next segment's
base offset); a missing or broken index is rebuilt by a full verified scan.
Trailing empty segments left by a crash right after a roll are removed.
After recovery everything on disk counts as flushed.

Recovery point and full verification (issue 12)
------------------------------------------------
``recovery-point-offset-checkpoint`` (named as in Kafka; written with
metalog.storage.atomic) holds the offset below which the log was flushed and verified.
It moves when a flush syncs a rolled (sealed) segment, at clean close and after
open's verification, and is lowered before a truncation below it: not on every
fsync, which would add a file write, an fsync and a directory fsync to the
commit path. After an UNCLEAN shutdown every segment holding records at or past
the recovery point is verified in full (header, length, magic, CRC-32C,
contiguous offsets, monotonic epochs), not only the last one and not only after
its last index entry; ``log_verified`` logs the bytes and seconds it took. After
a clean shutdown the cheap check stays (the scrubber, metalog.storage.scrub, re-reads
sealed data in the background).

Corruption that is not a torn tail is handled by ``on_corruption``: "raise"
(CorruptLogError naming file, position and offset) or "quarantine": persist a
``quarantine-state`` file (metalog.storage.errors.QuarantineState: the log end the
replica had, which it must re-replicate past before it may vote), rename the
damaged segment and every later one to ``<name>.log.corrupt`` /
``<name>.index.corrupt`` (never deleted), keep the verified prefix of the
damaged segment, and fsync the directory. ``quarantine_from()`` does the same at
run time for corruption found by the scrubber or a read.

Reads verify: ``read()`` checks the CRC of every batch it returns (unless
opened with ``verify_reads=False``) and raises metalog.storage.batch.CorruptBatchError
carrying a CorruptionReport instead of returning damaged bytes.

CRC coverage: as in Kafka, the CRC covers ``attributes .. end``; the base
offset is checked by offset continuity, the length by the CRC range and the
magic byte directly. A flipped leader-epoch bit is caught only when it breaks
the epochs' monotonic order.

Threading contract
------------------
All methods except ``flush()`` belong to one owner thread (the event loop).
``flush()`` may run at the same time on one other thread (``asyncio.to_thread``):
it captures ``(file descriptors, end offset)`` atomically under a lock, syncs
outside it, and reports exactly the offset captured (lowered if the owner
truncated meanwhile). Concurrent flushes are serialised by a second lock.
A third, ``_rp_lock``, orders recovery-point writes: a flush holds it while it
syncs and moves the point up; a truncation takes it to lower the point first
(so it may wait for a running fsync). Lock order: flush, rp, fields.
``sealed_segments()`` and ``segment_unchanged()`` may run on any thread (the
scrubber's).
"""

from __future__ import annotations

import bisect
import fcntl
import itertools
import json
import mmap
import os
import re
import struct
import threading
import time
from array import array
from typing import Any, Callable, Iterator, NamedTuple

import crc32c
import structlog

from metalog.storage import batch as B
from metalog.storage.atomic import atomic_write, fsync_dir, read_file_if_exists
from metalog.storage.errors import CorruptionReport, CorruptLogError, LogWriteError, QuarantineState

LOG_SUFFIX = ".log"
INDEX_SUFFIX = ".index"
TIMEINDEX_SUFFIX = ".timeindex"
CLEAN_SHUTDOWN_FILE = ".clean-shutdown"
LOG_START_FILE = "log-start-offset"
LOCK_FILE = ".lock"
RECOVERY_POINT_FILE = "recovery-point-offset-checkpoint"
QUARANTINE_FILE = "quarantine-state"
CORRUPT_SUFFIX = ".corrupt"
ON_CORRUPTION_MODES = ("raise", "quarantine")
# Kafka's checkpoint text format: version, entry count, "<topic> <partition> <offset>".
_RP_TOPIC = "__cluster_metadata"
DEFAULT_SEGMENT_BYTES_MAX = 64 << 20
DEFAULT_INDEX_INTERVAL_BYTES = 4096
SCAN_CHUNK_BYTES = 64 << 10  # one pread while walking headers
U32_MAX = (1 << 32) - 1
# A segment's relative offsets must fit the u32 index field; roll well before.
RELATIVE_OFFSET_ROLL = 1 << 31

_SEGMENT_RE = re.compile(r"^(\d{20})\.(log|index|timeindex)$")
DELETED_SUFFIX = ".deleted"  # a segment file on its way out (Segment.delete with an unlink)
_DELETED_SEGMENT_RE = re.compile(r"^\d{20}\.(log|index|timeindex)\.deleted$")
# Anything quarantined by the log, the snapshot store or the runtime: kept for
# the operator, never read, never warned about.
_CORRUPT_RE = re.compile(r"\.corrupt(\.\d+)?$")
# The partition directory is shared with the broker's other state files: the
# quorum-state, the leader-epoch checkpoint and snapshots (storage/snapshot.py's
# .checkpoint, .checkpoint.part, .checkpoint.deleted). Those are not ours to
# read, and warning about them on every restart would be noise.
SHARED_DIR_FILES = ("quorum-state", "leader-epoch-checkpoint")
_KNOWN_FILES = frozenset(f + t for f in (LOG_START_FILE, CLEAN_SHUTDOWN_FILE, RECOVERY_POINT_FILE, QUARANTINE_FILE,
                                         *SHARED_DIR_FILES)
                         for t in ("", ".tmp")) | {LOCK_FILE}
_SNAPSHOT_FILE_RE = re.compile(r"^\d{20}-\d{10}(-[^/]*)?\.checkpoint(\.part|\.deleted)?$")
_INDEX_ENTRY = struct.Struct(">II")
_TIME_ENTRY = struct.Struct(">qI")  # Kafka's TimeIndex entry: timestamp, relative offset
_HDR_PREFIX = struct.Struct(">qii")  # base_offset, length, leader_epoch
_LAST_DELTA = struct.Struct(">i")
_LAST_DELTA_POS = 23
_ATTRIBUTES = struct.Struct(">h")
_ATTRIBUTES_POS = 21
_MAGIC_POS = 16
_MAGIC_BYTE = bytes([B.MAGIC])


_GENERATIONS = itertools.count()  # process-wide: next() is atomic under the GIL
CHANGING = -1  # generation of a segment the owner is truncating right now


def segment_file_name(base_offset: int, suffix: str = LOG_SUFFIX) -> str:
    return f"{base_offset:020d}{suffix}"


class BatchInfo(NamedTuple):
    """Where one batch sits and what its header says (no payload)."""

    base_offset: int
    next_offset: int  # last offset + 1
    leader_epoch: int
    size: int  # bytes on disk
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
    size: int
    inode: int
    generation: int  # bumped when the owner truncates it or makes it active again


class _ScanResult(NamedTuple):
    end_pos: int  # position after the last good batch
    next_offset: int
    last_epoch: int
    index_rel: list[int]
    index_pos: list[int]
    last_index_pos: int
    time_ts: list[int]  # the .timeindex entries
    time_rel: list[int]
    max_ts: int  # the largest batch max timestamp scanned, -1 if none
    max_rel: int  # relative (last) offset of the batch holding it
    error_pos: int | None  # where the first bad byte run starts, None if clean
    error: str | None


class _Segment:
    """One .log/.index pair. Mutated by the owner thread under SegmentedLog._lock."""

    __slots__ = ("base_offset", "log_path", "index_path", "fd", "index_fd", "size",
                 "next_offset", "last_epoch", "index_rel", "index_pos", "last_index_pos", "generation",
                 "timeindex_path", "time_fd", "time_ts", "time_rel", "max_ts", "max_rel")

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
        self.size = os.fstat(self.fd).st_size
        self.next_offset = base_offset
        self.last_epoch = -1
        self.index_rel = array("I")
        self.index_pos = array("I")
        self.last_index_pos = 0
        self.time_ts = array("q")
        self.time_rel = array("I")
        self.max_ts = -1
        self.max_rel = 0
        # Unique per segment object and renewed whenever the content below
        # `size` may change (truncation), so the scrubber can tell "same name,
        # same size, even the same (reused) inode, other bytes" (ABA).
        self.generation = next(_GENERATIONS)

    def set_index(self, rel: list[int] | array, pos: list[int] | array) -> None:
        self.index_rel = array("I", rel)
        self.index_pos = array("I", pos)
        self.last_index_pos = self.index_pos[-1] if self.index_pos else 0

    def set_time_index(self, res: "_ScanResult") -> None:
        self.time_ts = array("q", res.time_ts)
        self.time_rel = array("I", res.time_rel)
        self.max_ts, self.max_rel = res.max_ts, res.max_rel

    def write_index_file(self) -> None:
        """Replace the .index and .timeindex content with the in-memory entries."""
        data = b"".join(_INDEX_ENTRY.pack(r, p) for r, p in zip(self.index_rel, self.index_pos))
        os.ftruncate(self.index_fd, 0)
        _write_all(self.index_fd, data)
        data = b"".join(_TIME_ENTRY.pack(t, r) for t, r in zip(self.time_ts, self.time_rel))
        os.ftruncate(self.time_fd, 0)
        _write_all(self.time_fd, data)

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


def corruption_report_at(path: str, buf: Any, pos: int, expected_offset: int, reason: str) -> CorruptionReport:
    """A CorruptionReport for damage at `pos` of `buf`, with whatever of the
    header can still be read (epoch, stored and computed CRC)."""
    epoch = expected_crc = actual_crc = None
    try:
        if buf is not None and len(buf) - pos >= B.HEADER_SIZE:
            h = B.HEADER.unpack_from(buf, pos)
            epoch, expected_crc, length = h[2], h[4], h[1]
            end = pos + B.LOG_OVERHEAD + length
            if B.HEADER_SIZE - B.LOG_OVERHEAD <= length and end <= len(buf):
                actual_crc = crc32c.crc32c(memoryview(buf)[pos + B.CRC_START:end])
    except (ValueError, struct.error):
        pass
    return CorruptionReport(path, pos, expected_offset, epoch, expected_crc, actual_crc, reason)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    written = os.write(fd, view)
    while written < len(view):  # short writes happen near a size limit
        written += os.write(fd, view[written:])


class SegmentedLog:
    """Append-only log of record batches in segment files (see module docstring)."""

    def __init__(self, directory: str, segment_bytes_max: int, index_interval_bytes: int,
                 logger: Any, lock_fd: int, verify_appends: bool, verify_reads: bool = True,
                 on_corruption: str = "raise"):
        # Use SegmentedLog.open(); the constructor only sets fields.
        self._dir = directory
        self._segment_bytes_max = segment_bytes_max
        self._index_interval_bytes = index_interval_bytes
        self._log = logger
        self._lock_fd = lock_fd
        self._verify_appends = verify_appends
        self._segments: list[_Segment] = []
        self._bases: list[int] = []
        self._log_start_offset = 0
        self._end_offset = 0
        self._flushed_end_offset = 0
        self._last_epoch = -1
        self._lock = threading.Lock()  # guards the fields flush() reads
        self._flush_lock = threading.Lock()  # one flush at a time
        self._flush_cap: int | None = None  # end offset the running flush will report
        self._unsynced_rolled: list[_Segment] = []
        self._dir_dirty = False
        self._failed: str | None = None
        self._closed = False
        self._verify_reads = verify_reads
        self._on_corruption = on_corruption
        self._quarantine: QuarantineState | None = None
        # Corruption open() found and quarantined (on_corruption="quarantine").
        self.startup_reports: list[CorruptionReport] = []
        # Recovery point: read and written under _rp_lock (flush() moves it on a
        # worker thread, truncations lower it on the owner thread).
        self._rp_lock = threading.Lock()
        self._recovery_point = 0
        # Called (owner thread, no lock held) after a roll sealed a segment;
        # must not block: the scrubber's only sets an Event (set_seal_listener).
        self._on_seal: Callable[[], None] | None = None

    # ------------------------------------------------------------------ open
    @classmethod
    def open(cls, directory: str | os.PathLike, *,
             segment_bytes_max: int = DEFAULT_SEGMENT_BYTES_MAX,
             index_interval_bytes: int = DEFAULT_INDEX_INTERVAL_BYTES,
             logger: Any = None, verify_appends: bool = True, verify_reads: bool = True,
             on_corruption: str = "raise") -> "SegmentedLog":
        """Open (creating if needed) the log in `directory`, recovering after a crash.

        `verify_appends` checks each appended batch's CRC; a caller that
        verified the bytes where they crossed the network (a follower's fetch
        answer) or encoded them itself (a leader) turns it off. The header,
        length, offset and epoch checks of append always run. `verify_reads` checks the CRC of every batch
        read() returns. `on_corruption` is "raise" or "quarantine" (see the
        module docstring).
        """
        if on_corruption not in ON_CORRUPTION_MODES:
            raise ValueError(f"on_corruption must be one of {ON_CORRUPTION_MODES}, got {on_corruption!r}")
        if not 0 < segment_bytes_max <= U32_MAX:
            raise ValueError(f"segment_bytes_max must be in 1..{U32_MAX}, got {segment_bytes_max}")
        if index_interval_bytes <= 0:
            raise ValueError(f"index_interval_bytes must be positive, got {index_interval_bytes}")
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        lock_fd = os.open(os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            raise RuntimeError(f"log directory {directory} is already open (another process or log object holds {LOCK_FILE})") from None
        log = cls(directory, segment_bytes_max, index_interval_bytes,
                  logger if logger is not None else structlog.get_logger("metalog.storage.segmented_log"),
                  lock_fd, verify_appends, verify_reads, on_corruption)
        try:
            log._load()
        except BaseException:
            for seg in log._segments:
                seg.close()
            os.close(lock_fd)
            raise
        return log

    def _load(self) -> None:
        d = self._dir
        bases: set[int] = set()
        index_only: set[int] = set()
        clean = False
        for name in sorted(os.listdir(d)):
            m = _SEGMENT_RE.match(name)
            if m:
                (bases if m.group(2) == "log" else index_only).add(int(m.group(1)))
            elif name == CLEAN_SHUTDOWN_FILE:
                clean = True
            elif _DELETED_SEGMENT_RE.match(name):  # renamed for a deferred unlink a crash cut off
                os.unlink(os.path.join(d, name))
                self._log.info("deleted_segment_file_removed", path=os.path.join(d, name))
            elif name in _KNOWN_FILES or _CORRUPT_RE.search(name) or _SNAPSHOT_FILE_RE.match(name):
                pass
            else:
                self._log.warning("unknown_file_ignored", path=os.path.join(d, name))
        for base in sorted(index_only - bases):  # left by a crash while deleting a segment
            for suffix in (INDEX_SUFFIX, TIMEINDEX_SUFFIX):
                name = segment_file_name(base, suffix)
                if os.path.exists(os.path.join(d, name)):
                    os.unlink(os.path.join(d, name))
                    self._log.info("orphan_index_removed", segment=name)

        start_state = self._read_log_start_file()
        log_start = start_state["log_start_offset"] if start_state else None
        if start_state and start_state.get("truncate_fully_pending"):
            # A truncate_fully() was interrupted: finish it.
            for base in sorted(bases):
                _Segment(d, base).delete()
            bases = set()
            self._log.warning("truncate_fully_completed_on_open", log_start_offset=log_start)
        if not bases:
            bases = {log_start or 0}
        ordered = sorted(bases)
        if log_start is not None:
            # Finish an interrupted advance_log_start(): whole segments below it go.
            while len(ordered) >= 2 and ordered[1] <= log_start:
                _Segment(d, ordered.pop(0)).delete()
        self._segments = [_Segment(d, base) for base in ordered]
        if not clean:
            # A segment created by a roll just before a crash may hold nothing.
            while len(self._segments) >= 2 and self._segments[-1].size == 0:
                seg = self._segments.pop()
                seg.delete()
                self._log.warning("empty_segment_removed", segment=seg.log_path)
        self._bases = [s.base_offset for s in self._segments]
        self._quarantine = self._read_quarantine_file()
        rp = self._read_recovery_point()
        self._recovery_point = rp
        t0 = time.perf_counter()
        verified_bytes = 0
        i = 0
        while i < len(self._segments):
            seg = self._segments[i]
            is_last = i == len(self._segments) - 1
            next_base = None if is_last else self._segments[i + 1].base_offset
            prev_epoch = self._prev_epoch(i)
            try:
                if is_last and not clean:
                    verified_bytes += seg.size
                    self._recover_last(seg, prev_epoch)
                elif not clean and next_base is not None and next_base > rp:
                    # Holds records at or past the recovery point: verify all of it.
                    verified_bytes += seg.size
                    self._rebuild_index(seg, next_base, prev_epoch, log_rebuilt=False)
                elif not self._quick_check(seg, next_base, prev_epoch):
                    if is_last:  # clean marker but the tail disagrees: recover anyway
                        self._recover_last(seg, prev_epoch)
                    else:
                        self._rebuild_index(seg, next_base, prev_epoch)
            except CorruptLogError as exc:
                if self._on_corruption == "raise":
                    raise
                self._quarantine_at_open(i, exc)
                break
            i += 1
        if not clean:
            self._log.info("log_verified", directory=d, from_offset=rp, bytes=verified_bytes,
                           seconds=round(time.perf_counter() - t0, 3))
        last = self._segments[-1]
        self._end_offset = last.next_offset
        self._last_epoch = next((s.last_epoch for s in reversed(self._segments) if s.size), -1)
        first_base = self._segments[0].base_offset
        self._log_start_offset = max(log_start if log_start is not None else first_base, first_base)
        if self._log_start_offset > self._end_offset:
            # Records below the log start are covered by a snapshot, so the
            # unflushed ones lost in the crash do not matter: restart empty there.
            self._log.warning("log_start_past_end", log_start_offset=self._log_start_offset,
                              log_end_offset=self._end_offset)
            self.truncate_fully(self._log_start_offset)
        self._flushed_end_offset = self._end_offset
        # Everything on disk is now verified (or was, before a clean close).
        if self._recovery_point != self._end_offset:
            self._raise_recovery_point(self._end_offset)
        if clean:
            # Durably gone before any append, or a later crash would skip recovery.
            os.unlink(os.path.join(d, CLEAN_SHUTDOWN_FILE))
        fsync_dir(d)

    def _prev_epoch(self, i: int) -> int:
        return next((s.last_epoch for s in reversed(self._segments[:i]) if s.size), -1)

    @staticmethod
    def _final_time_entry(seg: _Segment) -> tuple[int, int] | None:
        """The entry Kafka's TimeIndex.maybeAppend adds when the segment is
        sealed: (largest timestamp, relative offset of its batch), or None
        when the last entry already holds that timestamp (only a larger one
        is appended)."""
        if seg.max_ts <= (seg.time_ts[-1] if seg.time_ts else -1):
            return None
        if seg.time_rel and seg.max_rel < seg.time_rel[-1]:
            return None  # cannot happen from our own appends; never write a decreasing offset
        return seg.max_ts, seg.max_rel

    def _seal_time_index(self, seg: _Segment) -> None:
        """At a roll: append the final .timeindex entry of the segment being
        sealed. A failed write leaves the file as before (derived data; a
        sealed segment without the entry is valid), never fails the roll."""
        entry = self._final_time_entry(seg)
        if entry is None:
            return
        pre = len(seg.time_ts) * _TIME_ENTRY.size
        try:
            _write_all(seg.time_fd, _TIME_ENTRY.pack(*entry))
        except OSError as exc:
            try:
                os.ftruncate(seg.time_fd, pre)
            except OSError:
                pass  # a torn entry is caught at open, and the .timeindex rebuilt
            self._log.warning("timeindex_final_entry_failed", segment=seg.timeindex_path, error=exc.strerror)
            return
        with self._lock:
            seg.time_ts.append(entry[0])
            seg.time_rel.append(entry[1])

    def _unseal_time_index(self, seg: _Segment) -> None:
        """`seg` is the active segment again (a truncation or quarantine took
        every later one): drop its final entry, so that an active segment's
        entries all sit at .index entries."""
        keep = bisect.bisect_right(seg.time_rel, seg.index_rel[-1]) if seg.index_rel else 0
        if keep < len(seg.time_ts):
            os.ftruncate(seg.time_fd, keep * _TIME_ENTRY.size)
            with self._lock:
                del seg.time_ts[keep:]
                del seg.time_rel[keep:]

    # ------------------------------------------------------ recovery point
    def _read_recovery_point(self) -> int:
        """The checkpointed offset, 0 (verify everything) if missing or unreadable."""
        path = os.path.join(self._dir, RECOVERY_POINT_FILE)
        try:
            with open(path, "rb") as f:
                lines = f.read().decode("ascii").split("\n")
            if lines[0] != "0" or lines[1] != "1":
                raise ValueError(f"unknown version/count {lines[:2]}")
            offset = int(lines[2].split()[2])
            if offset < 0:
                raise ValueError(f"negative offset {offset}")
            return offset
        except FileNotFoundError:
            return 0
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            # Only costs a full verification: never trust it, never fail on it.
            self._log.warning("recovery_point_unreadable", path=path, error=str(exc))
            return 0

    def _write_recovery_point(self, offset: int) -> None:
        atomic_write(os.path.join(self._dir, RECOVERY_POINT_FILE),
                     f"0\n1\n{_RP_TOPIC} 0 {offset}\n".encode("ascii"))

    def _raise_recovery_point(self, offset: int) -> None:
        """Move the recovery point up. Best effort (a full disk must not stop an
        open or a flush): a stale, lower one only costs verification time."""
        try:
            self._write_recovery_point(offset)
        except OSError as exc:
            self._log.warning("recovery_point_not_written", offset=offset, error=exc.strerror)
            return
        self._recovery_point = offset

    def _lower_recovery_point(self, offset: int) -> None:
        """Durably lower the recovery point before data below it is replaced."""
        with self._rp_lock:
            if self._recovery_point > offset:
                self._recovery_point = offset
                self._write_recovery_point(offset)

    @property
    def recovery_point(self) -> int:
        """Offset below which the log is known flushed and verified."""
        return self._recovery_point

    # ------------------------------------------------------------ quarantine
    def _read_quarantine_file(self) -> QuarantineState | None:
        path = os.path.join(self._dir, QUARANTINE_FILE)
        raw = read_file_if_exists(path)
        if raw is None:
            return None
        try:
            return QuarantineState.from_bytes(raw)
        except (ValueError, KeyError, TypeError) as exc:
            # Never guess here: a wrong must_reach_offset could let this voter vote.
            raise CorruptLogError(f"{path}: malformed quarantine-state file: {exc}", path, 0, None) from exc

    @property
    def quarantine(self) -> QuarantineState | None:
        """Set while the replica has truncated corrupt data and not yet
        re-replicated past QuarantineState.must_reach_offset."""
        return self._quarantine

    def clear_quarantine(self) -> None:
        """Durably forget the quarantine (the replica re-replicated past
        must_reach_offset). The .corrupt files stay for the operator."""
        path = os.path.join(self._dir, QUARANTINE_FILE)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        fsync_dir(self._dir)
        self._quarantine = None

    def _persist_quarantine(self, must_reach_offset: int, report: CorruptionReport) -> QuarantineState:
        if self._quarantine is None:
            state = QuarantineState(must_reach_offset, (report,))
        else:
            state = self._quarantine.merge(must_reach_offset, report)
        atomic_write(os.path.join(self._dir, QUARANTINE_FILE), state.to_bytes())
        self._quarantine = state
        return state

    def _corrupt_name(self, path: str) -> str:
        target = path + CORRUPT_SUFFIX
        n = 0
        while os.path.exists(target):
            n += 1
            target = f"{path}{CORRUPT_SUFFIX}.{n}"
        return target

    def _last_readable_end(self, seg: _Segment) -> int:
        """The end offset of the last CRC-valid batch anywhere in `seg` (its
        base if none): what this replica had before the damage."""
        mm = self._map(seg)
        if not mm:
            return seg.base_offset
        view = memoryview(mm)
        try:
            best, pos, expected = seg.base_offset, 0, seg.base_offset
            while True:
                res = self._scan(view[pos:], expected, -1, seg.base_offset)
                best = max(best, res.next_offset)
                if res.error_pos is None:
                    return best
                later = self._valid_batch_after(mm, pos + res.error_pos, 0)
                if later is None:
                    return best
                pos = later
                expected = B.decode_header(view, later).base_offset
        finally:
            view.release()
            del view
            mm.close()

    def _quarantine_at_open(self, i: int, exc: CorruptLogError) -> None:
        """on_corruption="quarantine" at open: segment i is damaged at exc.position."""
        known_end = max(exc.base_offset or 0, self._segments[i].base_offset)
        if i + 1 < len(self._segments):
            known_end = max(known_end, self._segments[-1].base_offset)
        for seg in (self._segments[i], self._segments[-1]):
            known_end = max(known_end, self._last_readable_end(seg))
        self._log.error("corruption_detected", source="startup", **exc.report.as_log_fields())
        self.startup_reports.append(exc.report)
        self._persist_quarantine(known_end, exc.report)
        self._cut_and_rename(i, exc.position)

    def quarantine_from(self, report: CorruptionReport) -> QuarantineState:
        """Quarantine at run time (owner thread): corruption found by the
        scrubber or a read in the segment file report.path at report.position.
        Persists the quarantine state (must_reach_offset = the current log end,
        merged with an existing one), then renames that segment and all later
        ones .corrupt and truncates the log to the last good batch before
        report.position."""
        self._check_usable()
        k = next((j for j, s in enumerate(self._segments) if s.log_path == report.path), None)
        if k is None:
            raise ValueError(f"{report.path} is not a segment of the log in {self._dir} "
                             "(already quarantined or deleted?)")
        seg = self._segments[k]
        if not 0 <= report.position <= seg.size:
            raise ValueError(f"position {report.position} outside {seg.log_path} ({seg.size} bytes)")
        state = self._persist_quarantine(self._end_offset, report)
        self._cut_and_rename(k, report.position)
        if self._end_offset < self._log_start_offset:
            self.truncate_fully(self._log_start_offset)
        self._log.warning("log_quarantined", directory=self._dir, must_reach_offset=state.must_reach_offset,
                          log_end_offset=self._end_offset, corrupt_from=report.path)
        return state

    def _cut_and_rename(self, k: int, cut: int) -> None:
        """Rename segment k and every later one .corrupt; keep the whole
        batches of segment k before byte `cut` in a new segment file."""
        seg = self._segments[k]
        prefix = os.pread(seg.fd, cut, 0) if cut else b""
        prev_epoch = self._prev_epoch(k)
        res = self._scan(prefix, seg.base_offset, prev_epoch, seg.base_offset)
        prefix = prefix[:res.end_pos]  # whole verified batches only
        new_end = res.next_offset
        self._lower_recovery_point(new_end)
        with self._lock:
            doomed = self._segments[k:]
            del self._segments[k:]
            del self._bases[k:]
            # A flush running now must not report offsets that are going away.
            self._flushed_end_offset = min(self._flushed_end_offset, new_end)
            if self._flush_cap is not None:
                self._flush_cap = min(self._flush_cap, new_end)
            gone = {id(s) for s in doomed}
            self._unsynced_rolled = [s for s in self._unsynced_rolled if id(s) not in gone]
        renamed = []
        for s in doomed:
            s.close()
            for path in (s.log_path, s.index_path):
                if os.path.exists(path):
                    target = self._corrupt_name(path)
                    os.rename(path, target)
                    renamed.append(target)
            if os.path.exists(s.timeindex_path):
                os.unlink(s.timeindex_path)  # derived from the .log, which is kept
        if prefix or not self._segments:
            fresh = _Segment(self._dir, seg.base_offset)
            assert fresh.size == 0, f"{fresh.log_path} exists after the rename"
            if prefix:
                _write_all(fresh.fd, prefix)
                os.fsync(fresh.fd)
            fresh.size = len(prefix)
            fresh.set_index(res.index_rel, res.index_pos)
            fresh.set_time_index(res)
            fresh.next_offset = new_end
            fresh.last_epoch = res.last_epoch if prefix else -1
            fresh.write_index_file()
            os.fsync(fresh.index_fd)
            os.fsync(fresh.time_fd)
            with self._lock:
                self._segments.append(fresh)
                self._bases.append(fresh.base_offset)
        else:
            self._unseal_time_index(self._segments[-1])
        fsync_dir(self._dir)
        with self._lock:
            self._end_offset = self._segments[-1].next_offset
            self._last_epoch = next((s.last_epoch for s in reversed(self._segments) if s.size), -1)
        self._log.warning("segments_renamed_corrupt", files=renamed, log_end_offset=self._end_offset)

    def _read_log_start_file(self) -> dict | None:
        path = os.path.join(self._dir, LOG_START_FILE)
        raw = read_file_if_exists(path)
        if raw is None:
            return None
        try:
            state = json.loads(raw)
            if not isinstance(state, dict) or not isinstance(state.get("log_start_offset"), int) \
                    or state["log_start_offset"] < 0:
                raise ValueError("log_start_offset must be a non-negative integer")
        except ValueError as exc:
            raise CorruptLogError(f"{path}: malformed log-start-offset file: {exc}", path, 0, None) from exc
        return state

    def _write_log_start_file(self, offset: int, truncate_fully_pending: bool = False) -> None:
        state = {"data_version": 1, "log_start_offset": offset,
                 "truncate_fully_pending": truncate_fully_pending}
        atomic_write(os.path.join(self._dir, LOG_START_FILE), json.dumps(state).encode())

    # -------------------------------------------------------------- scanning
    def _scan(self, view: memoryview | bytes, start_offset: int, prev_epoch: int,
              seg_base: int, max_ts: int = -1, max_rel: int = 0) -> _ScanResult:
        """Verify batches (length, offsets, epoch order, CRC) from start_pos to
        the end of `view`; stop at the first problem and say where."""
        size = len(view)
        interval = self._index_interval_bytes
        pos, expected, epoch = 0, start_offset, prev_epoch
        last_index_pos = 0
        rel: list[int] = []
        positions: list[int] = []
        time_ts: list[int] = []
        time_rel: list[int] = []
        last_time_ts = max_ts  # a tail scan continues after an entry of this timestamp
        error = None
        while pos < size:
            if size - pos < B.HEADER_SIZE:
                error = f"{size - pos} trailing bytes, fewer than a batch header"
                break
            try:
                h = B.decode_header(view, pos)
            except B.CorruptBatchError as exc:
                error = str(exc)
                break
            if pos + h.size > size:
                error = f"batch of {h.size} bytes runs past the file end"
                break
            if h.base_offset != expected:
                error = f"base offset {h.base_offset}, expected {expected}"
                break
            if h.leader_epoch < epoch:
                error = f"leader epoch {h.leader_epoch} after epoch {epoch}"
                break
            try:
                B.verify_crc(view, pos, h)
            except B.CorruptBatchError as exc:
                error = str(exc)
                break
            if h.max_timestamp_ms > max_ts:
                max_ts, max_rel = h.max_timestamp_ms, h.base_offset + h.last_offset_delta - seg_base
            if pos - last_index_pos >= interval:
                rel.append(h.base_offset + h.last_offset_delta - seg_base)
                positions.append(pos)
                last_index_pos = pos
                if max_ts > last_time_ts:
                    time_ts.append(max_ts)
                    time_rel.append(max_rel)
                    last_time_ts = max_ts
            expected = h.next_offset
            epoch = h.leader_epoch
            pos += h.size
        return _ScanResult(pos, expected, epoch, rel, positions, last_index_pos, time_ts, time_rel,
                           max_ts, max_rel, pos if error else None, error)

    def _valid_batch_after(self, view: memoryview | mmap.mmap, pos: int, expected: int) -> int | None:
        """Position of a whole, CRC-valid batch with base offset >= expected
        somewhere after `pos`, else None. Candidates are found by the magic
        byte, so a zero-filled torn tail costs one C-level search."""
        size = len(view)
        search = pos + 1 + _MAGIC_POS
        while True:
            i = view.find(_MAGIC_BYTE, search)
            if i < 0:
                return None
            search = i + 1
            q = i - _MAGIC_POS
            if q + B.HEADER_SIZE > size:
                return None
            try:
                h = B.decode_header(view, q)
                if h.base_offset < expected or q + h.size > size:
                    continue
                B.verify_crc(view, q, h)
            except B.CorruptBatchError:
                continue
            return q

    def _map(self, seg: _Segment) -> mmap.mmap | bytes:
        if seg.size == 0:
            return b""
        return mmap.mmap(seg.fd, seg.size, access=mmap.ACCESS_READ)

    def _recover_last(self, seg: _Segment, prev_epoch: int) -> None:
        """Full verified scan of the last segment; cut a torn tail."""
        mm = self._map(seg)
        res = self._scan(memoryview(mm) if mm else b"", seg.base_offset, prev_epoch, seg.base_offset)
        if res.error_pos is not None:
            later = self._valid_batch_after(mm, res.error_pos, res.next_offset)
            if later is not None:
                raise CorruptLogError(
                    f"corrupt batch in {seg.log_path} at byte {res.error_pos} (base offset "
                    f"{res.next_offset}): {res.error}; a valid batch follows at byte {later}, "
                    "so this is not a torn tail", seg.log_path, res.error_pos, res.next_offset,
                    report=corruption_report_at(seg.log_path, mm, res.error_pos, res.next_offset, res.error))
        del mm
        seg.set_index(res.index_rel, res.index_pos)
        seg.set_time_index(res)
        seg.next_offset = res.next_offset
        seg.last_epoch = res.last_epoch if res.end_pos else -1
        if res.error_pos is not None:
            truncated = seg.size - res.end_pos
            os.ftruncate(seg.fd, res.end_pos)
            os.fsync(seg.fd)
            seg.size = res.end_pos
            self._log.warning("log_recovered", segment=seg.log_path, truncated_bytes=truncated,
                              from_offset=res.next_offset, position=res.end_pos, reason=res.error)
        seg.write_index_file()
        os.fsync(seg.index_fd)
        os.fsync(seg.time_fd)

    def _load_index(self, seg: _Segment, next_base: int | None) -> bool:
        """Read the .index file; False if it is missing, torn or inconsistent."""
        raw = os.pread(seg.index_fd, os.fstat(seg.index_fd).st_size, 0)
        if len(raw) % _INDEX_ENTRY.size:
            return False
        rel = array("I")
        pos = array("I")
        prev_r, prev_p = -1, 0
        for r, p in _INDEX_ENTRY.iter_unpack(raw):
            if r <= prev_r or p <= prev_p or p >= seg.size:
                return False
            rel.append(r)
            pos.append(p)
            prev_r, prev_p = r, p
        seg.set_index(rel, pos)
        return self._load_time_index(seg, next_base)

    def _load_time_index(self, seg: _Segment, next_base: int | None) -> bool:
        """Read the .timeindex; False if it is missing, torn or inconsistent
        with the .index: an entry at each .index entry where the timestamp
        grew (so one iff there is an .index entry), timestamps strictly and
        offsets never decreasing, none past the last .index entry's offset
        but, on a sealed segment (next_base given), one final entry within
        the segment (the roll's, checked against the data by _quick_check).
        Sets max_ts/max_rel to the last entry at an .index entry."""
        raw = os.pread(seg.time_fd, os.fstat(seg.time_fd).st_size, 0)
        if len(raw) % _TIME_ENTRY.size:
            return False
        ts = array("q")
        rel = array("I")
        prev_t, prev_r = -1, -1
        last_indexed = seg.index_rel[-1] if seg.index_rel else -1
        n_entries = len(raw) // _TIME_ENTRY.size
        at_index = n_entries
        for i, (t, r) in enumerate(_TIME_ENTRY.iter_unpack(raw)):
            if t <= prev_t or r < prev_r:
                return False
            if r > last_indexed:
                if next_base is None or i != n_entries - 1 or r >= next_base - seg.base_offset:
                    return False
                at_index = i  # the final entry of a sealed segment
            ts.append(t)
            rel.append(r)
            prev_t, prev_r = t, r
        if (at_index == 0) != (not seg.index_rel):
            return False
        seg.time_ts, seg.time_rel = ts, rel
        seg.max_ts, seg.max_rel = (ts[at_index - 1], rel[at_index - 1]) if at_index else (-1, 0)
        return True

    def _quick_check(self, seg: _Segment, next_base: int | None, prev_epoch: int) -> bool:
        """Trust the index, verify only the batches after its last entry: they
        must end exactly at the file end (and at the next segment's base)."""
        if not self._load_index(seg, next_base):
            return False
        final = ((seg.time_ts[-1], seg.time_rel[-1])
                 if seg.time_rel and seg.time_rel[-1] > (seg.index_rel[-1] if seg.index_rel else -1) else None)
        if not seg.index_rel and seg.size > self._index_interval_bytes:
            # An empty index on a big segment: probably lost. The scan below
            # covers the whole segment anyway, so rebuild it from that scan.
            tail = os.pread(seg.fd, seg.size, 0)
            res = self._scan(tail, seg.base_offset, prev_epoch, seg.base_offset)
            if res.error is not None or (next_base is not None and res.next_offset != next_base):
                return False
            seg.set_time_index(res)
            if next_base is not None and (entry := self._final_time_entry(seg)) is not None:
                seg.time_ts.append(entry[0])
                seg.time_rel.append(entry[1])
            if res.index_rel:
                seg.set_index(res.index_rel, res.index_pos)
                seg.write_index_file()
                os.fsync(seg.index_fd)
                os.fsync(seg.time_fd)
                self._log.warning("index_rebuilt", segment=seg.index_path, entries=len(seg.index_rel))
            seg.next_offset = res.next_offset
            seg.last_epoch = res.last_epoch
            return True
        start_pos = seg.last_index_pos
        start_offset = seg.base_offset
        if seg.index_rel:
            # The entry names the batch's last offset; the scan starts at its base.
            head = os.pread(seg.fd, B.HEADER_SIZE, start_pos)
            if len(head) < B.HEADER_SIZE:
                return False
            try:
                h = B.decode_header(head)
            except B.CorruptBatchError:
                return False
            if h.last_offset != seg.base_offset + seg.index_rel[-1]:
                return False
            start_offset = h.base_offset
        tail = os.pread(seg.fd, seg.size - start_pos, start_pos)
        # At the last .index entry the max timestamp so far is the last .timeindex entry's.
        res = self._scan(tail, start_offset, -1, seg.base_offset, seg.max_ts, seg.max_rel)
        if res.error is not None or (seg.size and res.end_pos == 0):
            return False
        if next_base is not None and res.next_offset != next_base:
            return False
        if final is not None and final != (res.max_ts, res.max_rel):
            return False  # the roll's entry must name the segment's largest timestamp and its batch
        seg.max_ts, seg.max_rel = res.max_ts, res.max_rel
        seg.next_offset = res.next_offset
        seg.last_epoch = res.last_epoch if seg.size else -1
        if seg.last_epoch >= 0 and seg.last_epoch < prev_epoch:
            return False
        return True

    def _rebuild_index(self, seg: _Segment, next_base: int, prev_epoch: int, log_rebuilt: bool = True) -> None:
        """A full verified scan of a non-last segment (it failed the quick
        check, or it is past the recovery point after an unclean stop): it must
        come out whole, or the log is corrupt."""
        mm = self._map(seg)
        res = self._scan(memoryview(mm) if mm else b"", seg.base_offset, prev_epoch, seg.base_offset)
        if res.error_pos is not None:
            report = corruption_report_at(seg.log_path, mm, res.error_pos, res.next_offset, res.error)
            del mm
            raise CorruptLogError(
                f"corrupt batch in {seg.log_path} at byte {res.error_pos} (base offset "
                f"{res.next_offset}): {res.error}; it is not the last segment, so this is "
                "not a torn tail", seg.log_path, res.error_pos, res.next_offset, report=report)
        del mm
        if res.next_offset != next_base:
            raise CorruptLogError(
                f"{seg.log_path} ends at offset {res.next_offset} (byte {res.end_pos}) but the "
                f"next segment starts at offset {next_base}", seg.log_path, res.end_pos, res.next_offset)
        seg.set_index(res.index_rel, res.index_pos)
        seg.set_time_index(res)
        if (entry := self._final_time_entry(seg)) is not None:  # sealed: as the roll wrote it
            seg.time_ts.append(entry[0])
            seg.time_rel.append(entry[1])
        seg.next_offset = res.next_offset
        seg.last_epoch = res.last_epoch if seg.size else -1
        seg.write_index_file()
        os.fsync(seg.index_fd)
        os.fsync(seg.time_fd)
        if log_rebuilt:
            self._log.warning("index_rebuilt", segment=seg.index_path, entries=len(seg.index_rel))

    # ------------------------------------------------------------- scrubbing
    def sealed_segments(self) -> list[SegmentRef]:
        """Every segment but the active one, as the scrubber reads them.
        Safe from any thread."""
        with self._lock:
            out = []
            for i, seg in enumerate(self._segments[:-1]):
                if seg.generation == CHANGING:
                    continue
                try:
                    inode = os.fstat(seg.fd).st_ino
                except OSError:  # closed by a concurrent truncation
                    continue
                out.append(SegmentRef(seg.base_offset, self._segments[i + 1].base_offset,
                                      self._prev_epoch(i), seg.log_path, seg.size, inode, seg.generation))
            return out

    def set_seal_listener(self, listener: Callable[[], None] | None) -> None:
        """`listener()` runs on the owner thread after each roll seals the
        active segment (the scrubber's wake-up: it must return at once);
        None removes it."""
        self._on_seal = listener

    def segment_unchanged(self, ref: SegmentRef) -> bool:
        """Whether `ref` is still a sealed segment of this log, the same file
        with the same size (not truncated, renamed or deleted since).
        Safe from any thread."""
        with self._lock:
            for seg in self._segments[:-1]:
                if seg.base_offset == ref.base_offset and seg.log_path == ref.log_path:
                    try:
                        return (seg.size == ref.size and seg.generation == ref.generation
                                and os.fstat(seg.fd).st_ino == ref.inode)
                    except OSError:
                        return False
            return False

    # ------------------------------------------------------------- properties
    @property
    def directory(self) -> str:
        return self._dir

    @property
    def log_start_offset(self) -> int:
        return self._log_start_offset

    @property
    def log_end_offset(self) -> int:
        return self._end_offset

    @property
    def flushed_end_offset(self) -> int:
        """Every offset below this has been fdatasync'ed."""
        return self._flushed_end_offset

    @property
    def last_batch_epoch(self) -> int:
        """Leader epoch of the last batch in the log, -1 if the log is empty."""
        return self._last_epoch

    @property
    def segment_base_offsets(self) -> list[int]:
        return list(self._bases)

    # ---------------------------------------------------------------- append
    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError(f"log {self._dir} is closed")
        if self._failed:
            raise LogWriteError(f"log {self._dir} is unusable: {self._failed}")

    def append(self, data: bytes) -> list[B.BatchHeader]:
        """Append whole batches starting exactly at the log end offset; returns
        their headers, parsed here once, so the caller need not parse them again.

        One write syscall (more only after a short write). On an OSError the
        file is cut back to its size before the call and LogWriteError is
        raised: no partial batch is visible and the end offset does not move.
        """
        self._check_usable()
        n = len(data)
        if n == 0:
            raise ValueError("append of an empty buffer: expected at least one batch")
        view = memoryview(data)
        active = self._segments[-1]
        roll = active.size > 0 and (
            active.size + n > self._segment_bytes_max
            or self._end_offset - active.base_offset >= RELATIVE_OFFSET_ROLL)
        seg_base = self._end_offset if roll else active.base_offset
        file_start = 0 if roll else active.size
        last_index_pos = 0 if roll else active.last_index_pos
        max_ts, max_rel = (-1, 0) if roll else (active.max_ts, active.max_rel)
        last_time_ts = -1 if roll or not active.time_ts else active.time_ts[-1]
        new_time: list[bytes] = []
        interval = self._index_interval_bytes
        expected, epoch = self._end_offset, self._last_epoch
        new_index: list[bytes] = []
        new_rel: list[int] = []
        new_pos: list[int] = []
        headers: list[B.BatchHeader] = []
        pos = 0
        verify = self._verify_appends
        while pos < n:  # per batch, never per record
            if n - pos < B.HEADER_SIZE:
                raise ValueError(f"append: {n - pos} trailing bytes at byte {pos} are not a whole batch")
            try:
                h = B.decode_header(view, pos)
                if pos + h.size > n:
                    raise ValueError(f"append: batch at byte {pos} needs {h.size} bytes, only {n - pos} given")
                if verify:
                    B.verify_crc(view, pos, h)
            except B.CorruptBatchError as exc:
                raise ValueError(f"append: invalid batch at byte {pos}: {exc}") from None
            if h.base_offset != expected:
                kind = "gap" if h.base_offset > expected else "overlap"
                raise ValueError(f"append: batch at byte {pos} has base offset {h.base_offset} but "
                                 f"the log end offset is {expected} ({kind})")
            if h.leader_epoch < epoch:
                raise ValueError(f"append: batch at offset {h.base_offset} has leader epoch "
                                 f"{h.leader_epoch}, older than the log's last epoch {epoch}")
            file_pos = file_start + pos
            if h.max_timestamp_ms > max_ts:
                max_ts, max_rel = h.max_timestamp_ms, h.base_offset + h.last_offset_delta - seg_base
            if file_pos - last_index_pos >= interval:
                rel = h.base_offset + h.last_offset_delta - seg_base  # the batch's last offset
                new_index.append(_INDEX_ENTRY.pack(rel, file_pos))
                new_rel.append(rel)
                new_pos.append(file_pos)
                last_index_pos = file_pos
                if max_ts > last_time_ts:
                    new_time.append(_TIME_ENTRY.pack(max_ts, max_rel))
                    last_time_ts = max_ts
            expected = h.next_offset
            epoch = h.leader_epoch
            headers.append(h)
            pos += h.size
        assert file_start + n <= U32_MAX, "segment positions must fit the u32 index"

        if roll:
            self._roll(seg_base)
            active = self._segments[-1]
        pre_size = active.size
        pre_index_bytes = len(active.index_rel) * _INDEX_ENTRY.size
        pre_time_bytes = len(active.time_ts) * _TIME_ENTRY.size
        try:
            _write_all(active.fd, view)
            if new_index:
                _write_all(active.index_fd, b"".join(new_index))
            if new_time:
                _write_all(active.time_fd, b"".join(new_time))
        except OSError as exc:
            try:
                os.ftruncate(active.fd, pre_size)
                os.ftruncate(active.index_fd, pre_index_bytes)
                os.ftruncate(active.time_fd, pre_time_bytes)
            except OSError as exc2:
                self._failed = f"rollback after a failed append failed: {exc2.strerror}"
            raise LogWriteError(f"append of {n} bytes at offset {self._end_offset} failed: "
                                f"{exc.strerror}") from exc
        with self._lock:
            active.size = pre_size + n
            active.next_offset = expected
            active.last_epoch = epoch
            if new_rel:
                active.index_rel.extend(new_rel)
                active.index_pos.extend(new_pos)
                active.last_index_pos = last_index_pos
            for t, r in _TIME_ENTRY.iter_unpack(b"".join(new_time)):
                active.time_ts.append(t)
                active.time_rel.append(r)
            active.max_ts, active.max_rel = max_ts, max_rel
            self._end_offset = expected
            self._last_epoch = epoch
        return headers

    def _roll(self, base_offset: int) -> None:
        self._seal_time_index(self._segments[-1])  # Kafka's onBecomeInactiveSegment
        seg = _Segment(self._dir, base_offset)
        assert seg.size == 0, f"{seg.log_path} already exists with {seg.size} bytes"
        with self._lock:
            self._unsynced_rolled.append(self._segments[-1])
            self._segments.append(seg)
            self._bases.append(base_offset)
            self._dir_dirty = True
        if self._on_seal is not None:
            self._on_seal()

    # ----------------------------------------------------------------- flush
    def flush(self) -> int:
        """fdatasync everything appended before the call; return the flushed
        end offset. Safe on a worker thread while the owner keeps appending."""
        with self._flush_lock, self._rp_lock:
            with self._lock:
                self._check_usable()
                target = self._end_offset
                rolled = list(self._unsynced_rolled)
                if target <= self._flushed_end_offset and not rolled and not self._dir_dirty:
                    return self._flushed_end_offset
                # dup: the owner may close a segment (truncation) while we sync.
                fds = ([os.dup(s.fd) for s in rolled] + [os.dup(s.index_fd) for s in rolled]
                       + [os.dup(s.time_fd) for s in rolled])
                fds.append(os.dup(self._segments[-1].fd))
                dir_dirty, self._dir_dirty = self._dir_dirty, False
                self._flush_cap = target
            try:
                for fd in fds:
                    os.fdatasync(fd)
                if dir_dirty:
                    fsync_dir(self._dir)
            except OSError as exc:
                with self._lock:
                    self._flush_cap = None
                    # After a failed fsync the page cache may have dropped the
                    # data; a retry could "succeed" falsely. Stop here.
                    self._failed = f"fdatasync failed: {exc.strerror}"
                raise LogWriteError(f"flush of {self._dir} up to offset {target} failed: "
                                    f"{exc.strerror}") from exc
            finally:
                for fd in fds:
                    os.close(fd)
            with self._lock:
                cap = self._flush_cap
                self._flush_cap = None
                assert cap is not None
                if cap > self._flushed_end_offset:
                    self._flushed_end_offset = cap
                synced = {id(s) for s in rolled}
                self._unsynced_rolled = [s for s in self._unsynced_rolled if id(s) not in synced]
                flushed = self._flushed_end_offset
            if rolled and flushed > self._recovery_point:
                # A segment was sealed and is now durable: move the recovery
                # point (once per roll, not per fsync). _rp_lock is held, so a
                # truncation lowering it waits and then lowers it again.
                self._raise_recovery_point(flushed)
            return flushed

    # ------------------------------------------------------------------ read
    def _segment_index_for(self, offset: int) -> int:
        return bisect.bisect_right(self._bases, offset) - 1

    def _walk(self, seg: _Segment, pos: int, limit: int) -> Iterator[tuple[int, int, int, int, int, int]]:
        """(position, base offset, size, epoch, next offset, attributes) of each
        batch from `pos` to `limit`, reading headers in SCAN_CHUNK_BYTES preads."""
        buf = b""
        buf_start = pos
        while pos < limit:
            rel = pos - buf_start
            if rel + B.HEADER_SIZE > len(buf):
                buf = os.pread(seg.fd, min(SCAN_CHUNK_BYTES, limit - pos), pos)
                buf_start, rel = pos, 0
                if len(buf) < B.HEADER_SIZE:
                    raise CorruptLogError(f"{seg.log_path}: short read of a batch header at byte {pos}",
                                          seg.log_path, pos, None)
            base, length, epoch = _HDR_PREFIX.unpack_from(buf, rel)
            (delta,) = _LAST_DELTA.unpack_from(buf, rel + _LAST_DELTA_POS)
            (attributes,) = _ATTRIBUTES.unpack_from(buf, rel + _ATTRIBUTES_POS)
            size = B.LOG_OVERHEAD + length
            if length < B.HEADER_SIZE - B.LOG_OVERHEAD or pos + size > limit:
                raise CorruptLogError(f"{seg.log_path}: bad batch length {length} at byte {pos}",
                                      seg.log_path, pos, base)
            yield pos, base, size, epoch, base + delta + 1, attributes
            pos += size

    def _locate(self, seg: _Segment, offset: int) -> tuple[int, int, int, int, int, int] | None:
        """The batch of `seg` containing `offset` (None if past the segment end)."""
        i = bisect.bisect_right(seg.index_rel, offset - seg.base_offset) - 1
        if i >= 0:  # an entry names the LAST offset of the batch at its position
            pos, expect = seg.index_pos[i], seg.base_offset + seg.index_rel[i]
        else:
            pos, expect = 0, None
        first = True
        for item in self._walk(seg, pos, seg.size):
            if first and (item[1] != seg.base_offset if expect is None else item[4] - 1 != expect):
                got, want = (item[1], seg.base_offset) if expect is None else (item[4] - 1, expect)
                what = "base" if expect is None else "last"
                raise CorruptLogError(f"{seg.index_path}: entry points at byte {pos} holding {what} "
                                      f"offset {got}, expected {want}", seg.log_path, pos, item[1])
            first = False
            if item[4] > offset:
                return item
        return None

    def read(self, start_offset: int, end_offset: int, max_bytes: int, verify: bool | None = None) -> bytes:
        """Whole batches from the one containing start_offset, none with an
        offset >= end_offset, at most max_bytes but always at least one batch
        when one qualifies; b"" when none does. Crosses segment boundaries.
        `verify` overrides verify_reads for this call (False only for callers
        that never serve the bytes: the consistency digest takes the stored CRCs)."""
        if start_offset < self._log_start_offset:
            raise ValueError(f"read at offset {start_offset} below the log start offset "
                             f"{self._log_start_offset}")
        end_offset = min(end_offset, self._end_offset)
        if start_offset >= end_offset:
            return b""
        k = self._segment_index_for(start_offset)
        parts: list[bytes] = []
        total = 0
        offset = start_offset
        while k < len(self._segments):
            seg = self._segments[k]
            found = self._locate(seg, offset)
            if found is None:
                k += 1
                continue
            first_pos = found[0]
            end_pos = first_pos
            stop = False
            for pos, _base, size, _epoch, nxt, _attrs in self._walk(seg, first_pos, seg.size):
                if nxt > end_offset or (total + size > max_bytes and total):
                    stop = True
                    break
                total += size
                end_pos = pos + size
                offset = nxt
            if end_pos > first_pos:
                data = os.pread(seg.fd, end_pos - first_pos, first_pos)
                if self._verify_reads if verify is None else verify:
                    self._verify_read(seg, data, first_pos)
                parts.append(data)
            if stop or offset >= end_offset:
                break
            k += 1
        if len(parts) == 1:
            return parts[0]
        return b"".join(parts)

    def _verify_read(self, seg: _Segment, data: bytes, file_pos: int) -> None:
        """CRC-check every batch of `data` (read from seg at file_pos); never
        let damaged bytes leave the log."""
        if B.batches_sound(data):
            return  # the common case, checked without building headers
        pos = 0
        n = len(data)
        while pos < n:
            try:
                if n - pos < B.HEADER_SIZE:
                    raise B.CorruptBatchError(f"{n - pos} bytes, fewer than a batch header", pos)
                h = B.decode_header(data, pos)
                if pos + h.size > n:
                    raise B.CorruptBatchError(f"batch of {h.size} bytes runs past the read", pos, h.base_offset)
                B.verify_crc(data, pos, h)
            except B.CorruptBatchError as exc:
                report = CorruptionReport(seg.log_path, file_pos + pos, exc.base_offset, exc.leader_epoch,
                                          exc.expected_crc, exc.actual_crc, str(exc))
                raise B.CorruptBatchError(
                    f"corrupt batch in {seg.log_path} at byte {file_pos + pos} (base offset "
                    f"{exc.base_offset}): {exc}", file_pos + pos, exc.base_offset,
                    leader_epoch=exc.leader_epoch, expected_crc=exc.expected_crc,
                    actual_crc=exc.actual_crc, report=report) from None
            pos += h.size

    def iter_batch_headers(self, start_offset: int | None = None) -> Iterator[BatchInfo]:
        """Header of every batch from the one containing start_offset (default:
        the log start) to the log end. Reads headers only."""
        offset = self._log_start_offset if start_offset is None else start_offset
        if offset >= self._end_offset:
            return
        k = self._segment_index_for(offset)
        for seg in self._segments[k:]:
            found = self._locate(seg, offset) if seg.base_offset <= offset else None
            pos = found[0] if found else 0
            for p, base, size, epoch, nxt, attrs in self._walk(seg, pos, seg.size):
                yield BatchInfo(base, nxt, epoch, size, seg.base_offset, p, bool(attrs & B.ATTR_CONTROL))

    def control_batches(self) -> Iterator[bytes]:
        """Every control batch from the log start, whole (LeaderChange, the
        KIP-853 voter records): found by header, read one by one."""
        for info in self.iter_batch_headers():
            if info.is_control and info.base_offset >= self._log_start_offset:
                yield self.read(info.base_offset, info.next_offset, info.size)

    def batch_epochs(self) -> list[tuple[int, int]]:
        """(epoch, start offset) at each epoch change from the log start, to
        rebuild a missing leader-epoch-checkpoint. The first entry starts at
        the log start offset even if its batch starts earlier."""
        out: list[tuple[int, int]] = []
        for info in self.iter_batch_headers():
            if not out or info.leader_epoch != out[-1][0]:
                out.append((info.leader_epoch, max(info.base_offset, self._log_start_offset)))
        return out

    # -------------------------------------------------------------- truncate
    def truncate_to(self, end_offset: int) -> None:
        """Remove every record with offset >= end_offset, in every segment.

        The core truncates at batch boundaries; if end_offset falls inside a
        batch, that whole batch goes too and the log ends at its base offset
        (check log_end_offset). A no-op when end_offset >= log_end_offset.
        """
        self._check_usable()
        if end_offset >= self._end_offset:
            return
        if end_offset < self._log_start_offset:
            raise ValueError(f"truncate_to({end_offset}) below the log start offset "
                             f"{self._log_start_offset}; use truncate_fully")
        self._lower_recovery_point(end_offset)
        k = self._segment_index_for(end_offset)
        seg = self._segments[k]
        if seg.base_offset == end_offset and k > 0:
            doomed, keep = self._segments[k:], k
            new_end = end_offset
            cut = None
        else:
            found = self._locate(seg, end_offset)
            assert found is not None, f"offset {end_offset} below the end must be in {seg.log_path}"
            cut, new_end = found[0], found[1]
            doomed, keep = self._segments[k + 1:], k + 1
        with self._lock:
            # Before the file changes: the scrubber must not list it, nor take
            # what it reads meanwhile for the sealed segment it listed before.
            self._segments[keep - 1].generation = CHANGING
        if cut is not None:
            n_keep = bisect.bisect_left(seg.index_pos, cut)
            # Time entries stay while they name an offset the kept index covers.
            t_keep = bisect.bisect_right(seg.time_rel, seg.index_rel[n_keep - 1]) if n_keep else 0
            os.ftruncate(seg.fd, cut)
            os.ftruncate(seg.index_fd, n_keep * _INDEX_ENTRY.size)
            os.ftruncate(seg.time_fd, t_keep * _TIME_ENTRY.size)
            os.fdatasync(seg.fd)
        with self._lock:
            if cut is not None:
                seg.size = cut
                del seg.index_rel[n_keep:]
                del seg.index_pos[n_keep:]
                del seg.time_ts[t_keep:]
                del seg.time_rel[t_keep:]
                seg.last_index_pos = seg.index_pos[-1] if seg.index_pos else 0
                seg.next_offset = new_end
            del self._segments[keep:]
            del self._bases[keep:]
            # Cut, or active again (it will grow): not the bytes a scrubber may be reading.
            self._segments[-1].generation = next(_GENERATIONS)
            gone = {id(s) for s in doomed}
            self._unsynced_rolled = [s for s in self._unsynced_rolled if id(s) not in gone]
            self._end_offset = new_end
            self._flushed_end_offset = min(self._flushed_end_offset, new_end)
            if self._flush_cap is not None:
                self._flush_cap = min(self._flush_cap, new_end)
        for s in doomed:
            s.delete()
        active = self._segments[-1]
        if cut is None:
            self._unseal_time_index(active)  # active again: the roll's entry goes
        if cut is not None:
            active.last_epoch = self._last_epoch_of(active)
            active.max_ts, active.max_rel = self._max_timestamp_of(active)
        self._last_epoch = next((s.last_epoch for s in reversed(self._segments) if s.size), -1)
        if doomed:
            fsync_dir(self._dir)

    def _max_timestamp_of(self, seg: _Segment) -> tuple[int, int]:
        """(largest batch max timestamp, its batch's relative last offset) of
        the segment: the last .timeindex entry's, then the batches after the
        last .index entry (which the entry does not cover)."""
        best = (seg.time_ts[-1], seg.time_rel[-1]) if seg.time_ts else (-1, 0)
        tail = os.pread(seg.fd, seg.size - seg.last_index_pos, seg.last_index_pos)
        for _pos, h in B.iter_batches(tail, verify=False):
            if h.max_timestamp_ms > best[0]:
                best = (h.max_timestamp_ms, h.last_offset - seg.base_offset)
        return best

    def _last_epoch_of(self, seg: _Segment) -> int:
        epoch = -1
        for _pos, _base, _size, e, _nxt, _attrs in self._walk(seg, seg.last_index_pos, seg.size):
            epoch = e
        return epoch

    def truncate_fully(self, new_start_offset: int) -> None:
        """Delete every segment and restart the log empty at new_start_offset
        (after installing a snapshot). Crash-safe: an interrupted call is
        finished by the next open()."""
        self._check_usable()
        if new_start_offset < 0:
            raise ValueError(f"truncate_fully({new_start_offset}): offset must be >= 0")
        self._write_log_start_file(new_start_offset, truncate_fully_pending=True)
        with self._rp_lock:
            self._recovery_point = new_start_offset
            self._write_recovery_point(new_start_offset)
        with self._lock:
            doomed = self._segments
            self._segments, self._bases = [], []
            self._unsynced_rolled = []
        for s in doomed:
            s.delete()
        seg = _Segment(self._dir, new_start_offset)
        assert seg.size == 0
        fsync_dir(self._dir)
        with self._lock:
            self._segments, self._bases = [seg], [new_start_offset]
            self._end_offset = new_start_offset
            self._flushed_end_offset = new_start_offset
            if self._flush_cap is not None:
                self._flush_cap = min(self._flush_cap, new_start_offset)
            self._log_start_offset = new_start_offset
            self._last_epoch = -1
        self._write_log_start_file(new_start_offset)

    def advance_log_start(self, offset: int, unlink: Callable[[str], None] | None = None) -> None:
        """Move the log start offset forward (durably) and delete whole
        segments all of whose records are below it (`unlink`: see
        _Segment.delete). Never moves backwards."""
        self._check_usable()
        if offset > self._end_offset:
            raise ValueError(f"advance_log_start({offset}) past the log end offset {self._end_offset}")
        if offset <= self._log_start_offset:
            return
        self._write_log_start_file(offset)
        with self._lock:
            self._log_start_offset = offset
            n = 0
            while n + 1 < len(self._segments) and self._segments[n + 1].base_offset <= offset:
                n += 1
            doomed = self._segments[:n]
            del self._segments[:n]
            del self._bases[:n]
            gone = {id(s) for s in doomed}
            self._unsynced_rolled = [s for s in self._unsynced_rolled if id(s) not in gone]
        for s in doomed:
            s.delete(unlink)
        if doomed:
            fsync_dir(self._dir)

    # ----------------------------------------------------------------- close
    def close(self) -> None:
        """Flush everything and leave a clean-shutdown marker (skips the scan
        on the next open). Idempotent."""
        if self._closed:
            return
        try:
            if not self._failed:
                self.flush()
                os.fsync(self._segments[-1].index_fd)
                with self._rp_lock:
                    self._raise_recovery_point(self._end_offset)
                atomic_write(os.path.join(self._dir, CLEAN_SHUTDOWN_FILE), b"")
        finally:
            self._closed = True
            for seg in self._segments:
                seg.close()
            os.close(self._lock_fd)

    def __enter__(self) -> "SegmentedLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"SegmentedLog({self._dir!r}, start={self._log_start_offset}, "
                f"end={self._end_offset}, flushed={self._flushed_end_offset}, "
                f"segments={len(self._segments)})")
