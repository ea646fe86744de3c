"""SegmentedLog: the on-disk, append-only home of the replicated log, and the
one class the rest of metalog uses to append, read, flush, truncate and
delete it. It holds the directory lock and composes the parts of this
package: the segments (segment), their indexes (indexes), the boot-time
recovery (loader), the quarantine of damaged data (quarantine), the small
state files (checkpoints) and the reads across segments (reader).

Reads verify: ``read()`` checks the CRC of every batch it returns (unless
opened with ``verify_reads=False``) and raises metalog.storage.batch.CorruptBatchError
carrying a CorruptionReport instead of returning damaged bytes.

Threading contract
------------------
All methods except ``flush()`` belong to one owner thread (the event loop).
``flush()`` may run at the same time on one other thread (``asyncio.to_thread``):
it captures ``(file descriptors, end offset)`` atomically under the table's
lock, syncs outside it, and reports exactly the offset captured (lowered if
the owner truncated meanwhile). Concurrent flushes are serialised by a second
lock. A third, the recovery point's, orders recovery-point writes: a flush
holds it while it syncs and moves the point up; a truncation takes it to
lower the point first (so it may wait for a running fsync). Lock order:
flush, recovery point, table. ``sealed_segments()`` and
``segment_unchanged()`` may run on any thread (the scrubber's).
"""

from __future__ import annotations

import collections
import fcntl
import os
import threading
import time
from typing import Callable, Iterator

import structlog

from metalog.protocol.invariants import InvariantViolation, invariant
from metalog.storage import batch as B
from metalog.storage.atomic import atomic_write, fsync_dir
from metalog.storage.errors import CorruptionReport, LogWriteError, QuarantineState
from metalog.storage.event_logger import EventLogger
from metalog.storage.segments.appends import AppendPlan, AppendStart, plan_append
from metalog.storage.segments import truncation
from metalog.storage.segments.checkpoints import RecoveryPoint
from metalog.storage.segments.indexes import seal_time_index
from metalog.storage.segments.layout import (
    CLEAN_SHUTDOWN_FILE, DEFAULT_INDEX_INTERVAL_BYTES, DEFAULT_SEGMENT_BYTES_MAX, INDEX_ENTRY, LOCK_FILE,
    ON_CORRUPTION_MODES, RELATIVE_OFFSET_ROLL, TIME_ENTRY, U32_MAX, write_all)
from metalog.storage.segments.loader import FoundSegments, LogLoader
from metalog.storage.segments.quarantine import Quarantine
from metalog.storage.segments.reader import iter_headers, read_range
from metalog.storage.segments.segment import BatchInfo, Segment, SegmentRef
from metalog.storage.segments.segment_table import SegmentTable


# The appends a read may be served from memory: the last (a leader's apply of
# what it just committed) and the one before (a follower learns that commit
# with the next records, appended in the same step, then applies it); a read
# of several of them in a row (a follower learning two commits at once).
RECENT_APPENDS_MAX = 4


class _Recent:
    """One recent append's batches."""

    __slots__ = ("base_offset", "next_offset", "data", "_sound")

    def __init__(self, base_offset: int, next_offset: int, data: bytes):
        self.base_offset = base_offset
        self.next_offset = next_offset
        self.data = data
        self._sound: bool | None = None  # CRCs checked yet? (once, at the first read that verifies)

    def sound(self) -> bool:
        if self._sound is None:
            self._sound = B.batches_sound(self.data)
        return self._sound


class RecentAppends:
    """The last few appends of a log, oldest first, contiguous, ending it
    (the log clears them when it cuts its end): a read of one or several of
    them, whole (every replica applying what it just committed), is served
    from memory, CRC-checked once rather than read back and checked again. A
    disk that later damages the copy on it is the scrubber's, and later
    reads', to find."""

    def __init__(self) -> None:
        self._appends: collections.deque[_Recent] = collections.deque(maxlen=RECENT_APPENDS_MAX)

    def add(self, base_offset: int, next_offset: int, data: bytes) -> None:
        self._appends.append(_Recent(base_offset, next_offset, data))

    def clear(self) -> None:
        self._appends.clear()

    def read(self, start_offset: int, end_offset: int, bytes_max: int, verify: bool) -> bytes | None:
        """[start_offset, end_offset) from appends that tile it exactly, at
        most bytes_max, or None: the file's read then. With `verify`, only
        appends whose CRCs checked out (a read of damaged bytes goes to the
        file, whose read says where)."""
        parts: list[bytes] = []
        size = 0
        for recent in self._appends:
            if not parts and recent.base_offset != start_offset:
                continue
            size += len(recent.data)
            if size > bytes_max or (verify and not recent.sound()):
                return None
            parts.append(recent.data)
            if recent.next_offset >= end_offset:
                if recent.next_offset != end_offset:
                    return None
                return parts[0] if len(parts) == 1 else b"".join(parts)
        return None


class SegmentedLog:
    """Append-only log of record batches in segment files (see module docstring)."""

    def __init__(self, directory: str, segment_bytes_max: int, index_interval_bytes: int,
                 logger: EventLogger, lock_fd: int, verify_appends: bool, verify_reads: bool = True,
                 on_corruption: str = "raise"):
        # Use SegmentedLog.open(); the constructor only sets fields.
        self._dir = directory
        self._segment_bytes_max = segment_bytes_max
        self._index_interval_bytes = index_interval_bytes
        self._log = logger
        self._lock_fd = lock_fd
        self._verify_appends = verify_appends
        self._table = SegmentTable()
        self._flush_lock = threading.Lock()  # one flush at a time
        self._failed: str | None = None
        self._closed = False
        self._verify_reads = verify_reads
        self._on_corruption = on_corruption
        self._rp = RecoveryPoint(directory, logger)
        self._quarantine = Quarantine(directory, self._table, self._rp, index_interval_bytes, logger)
        # Corruption open() found and quarantined (on_corruption="quarantine").
        self.startup_reports: list[CorruptionReport] = []
        # Called (owner thread, no lock held) after a roll sealed a segment;
        # must not block: the scrubber's only sets an Event (set_seal_listener).
        self._on_seal: Callable[[], None] | None = None
        self._recent = RecentAppends()  # the last few appends, read from memory

    # ------------------------------------------------------------------ open
    @classmethod
    def open(cls, directory: str | os.PathLike[str], *,
             segment_bytes_max: int = DEFAULT_SEGMENT_BYTES_MAX,
             index_interval_bytes: int = DEFAULT_INDEX_INTERVAL_BYTES,
             logger: EventLogger | None = None, verify_appends: bool = True, verify_reads: bool = True,
             on_corruption: str = "raise") -> "SegmentedLog":
        """Open (creating if needed) the log in `directory`, recovering after a crash.

        `verify_appends` checks each appended batch's CRC; a caller that
        verified the bytes where they crossed the network (a follower's fetch
        answer) or encoded them itself (a leader) turns it off. The header,
        length, offset and epoch checks of append always run. `verify_reads` checks the CRC of every batch
        read() returns. `on_corruption` is "raise" or "quarantine" (see
        metalog.storage.segments.quarantine).
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
                  logger if logger is not None else structlog.get_logger("metalog.storage.segments"),
                  lock_fd, verify_appends, verify_reads, on_corruption)
        try:
            log._load()
        except BaseException:
            for seg in log._table.segments:
                seg.close()
            os.close(lock_fd)
            raise
        return log

    def _load(self) -> None:
        loader = LogLoader(self._dir, self._index_interval_bytes, self._log)
        found = loader.open_segments()
        self._table.set_segments(found.segments)
        self._quarantine.load()
        rp = self._rp.read()
        self._rp.offset = rp
        t0 = time.perf_counter()
        verified_bytes, corrupt = loader.verify(self._table, found.clean, rp,
                                                raise_on_corruption=self._on_corruption == "raise")
        if corrupt is not None:
            self.startup_reports.append(self._quarantine.at_open(*corrupt))
        if not found.clean:
            self._log.info("log_verified", directory=self._dir, from_offset=rp, bytes=verified_bytes,
                           seconds=round(time.perf_counter() - t0, 3))
        self._finish_open(found)

    def _finish_open(self, found: FoundSegments) -> None:
        """The offsets from the checked segments; then everything on disk
        counts as flushed and verified, and the clean marker goes."""
        t = self._table
        t.end_offset = t.active.next_offset
        t.last_epoch = t.epoch_of_last_batch()
        first_base = t.segments[0].base_offset
        log_start = found.log_start_offset
        self._table.log_start_offset = max(log_start if log_start is not None else first_base, first_base)
        if self._table.log_start_offset > t.end_offset:
            # Records below the log start are covered by a snapshot, so the
            # unflushed ones lost in the crash do not matter: restart empty there.
            self._log.warning("log_start_past_end", log_start_offset=self._table.log_start_offset,
                              log_end_offset=t.end_offset)
            self.truncate_fully(self._table.log_start_offset)
        t.flushed_end_offset = t.end_offset
        # Everything on disk is now verified (or was, before a clean close).
        if self._rp.offset != t.end_offset:
            self._rp.raise_to(t.end_offset)
        if found.clean:
            # Durably gone before any append, or a later crash would skip recovery.
            os.unlink(os.path.join(self._dir, CLEAN_SHUTDOWN_FILE))
        fsync_dir(self._dir)

    # ------------------------------------------------------------ quarantine
    @property
    def recovery_point(self) -> int:
        """Offset below which the log is known flushed and verified."""
        return self._rp.offset

    @property
    def quarantine(self) -> QuarantineState | None:
        """Set while the replica has truncated corrupt data and not yet
        re-replicated past QuarantineState.must_reach_offset."""
        return self._quarantine.state

    def clear_quarantine(self) -> None:
        """Durably forget the quarantine (the replica re-replicated past
        must_reach_offset). The .corrupt files stay for the operator."""
        self._quarantine.clear()

    def quarantine_from(self, report: CorruptionReport) -> QuarantineState:
        """Quarantine at run time (owner thread): corruption found by the
        scrubber or a read in the segment file report.path at report.position.
        Persists the quarantine state (must_reach_offset = the current log end,
        merged with an existing one), then renames that segment and all later
        ones .corrupt and truncates the log to the last good batch before
        report.position."""
        self._check_usable()
        self._recent.clear()
        state = self._quarantine.at_run_time(report)
        if self._table.end_offset < self._table.log_start_offset:
            self.truncate_fully(self._table.log_start_offset)
        self._log.warning("log_quarantined", directory=self._dir, must_reach_offset=state.must_reach_offset,
                          log_end_offset=self._table.end_offset, corrupt_from=report.path)
        return state

    # ------------------------------------------------------------- scrubbing
    def sealed_segments(self) -> list[SegmentRef]:
        """Every segment but the active one, as the scrubber reads them.
        Safe from any thread."""
        return self._table.sealed_refs()

    def set_seal_listener(self, listener: Callable[[], None] | None) -> None:
        """`listener()` runs on the owner thread after each roll seals the
        active segment (the scrubber's wake-up: it must return at once);
        None removes it."""
        self._on_seal = listener

    def segment_unchanged(self, ref: SegmentRef) -> bool:
        """Whether `ref` is still a sealed segment of this log, the same file
        with the same size (not truncated, renamed or deleted since).
        Safe from any thread."""
        return self._table.unchanged(ref)

    # ------------------------------------------------------------- properties
    @property
    def directory(self) -> str:
        return self._dir

    @property
    def log_start_offset(self) -> int:
        return self._table.log_start_offset

    @property
    def log_end_offset(self) -> int:
        return self._table.end_offset

    @property
    def flushed_end_offset(self) -> int:
        """Every offset below this has been fdatasync'ed."""
        return self._table.flushed_end_offset

    @property
    def last_batch_epoch(self) -> int:
        """Leader epoch of the last batch in the log, -1 if the log is empty."""
        return self._table.last_epoch

    @property
    def segment_base_offsets(self) -> list[int]:
        return list(self._table.bases)

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
        t = self._table
        active = t.segments[-1]
        end = t.end_offset
        roll = active.size_bytes > 0 and (
            active.size_bytes + n > self._segment_bytes_max or end - active.base_offset >= RELATIVE_OFFSET_ROLL)
        if roll:
            start = AppendStart(end, 0, end, t.last_epoch, 0, -1, 0, -1)
        else:
            start = AppendStart(active.base_offset, active.size_bytes, end, t.last_epoch, active.last_index_pos,
                                active.max_ts_ms, active.max_rel, active.time_ts_ms[-1] if active.time_ts_ms else -1)
        plan = plan_append(view, start, self._index_interval_bytes, self._verify_appends)
        # A roll happens before a segment passes segment_bytes_max (<= U32_MAX).
        invariant(start.file_start + n <= U32_MAX, "segment positions must fit the u32 index")
        if roll:
            self._roll(start.seg_base)
            active = t.segments[-1]
        self._write_or_roll_back(active, view, plan)
        with t.lock:
            active.size_bytes += n
            active.next_offset = plan.next_offset
            active.last_epoch = plan.last_epoch
            if plan.index_rel:
                active.index_rel.extend(plan.index_rel)
                active.index_pos.extend(plan.index_pos)
                active.last_index_pos = plan.last_index_pos
            for ts, r in TIME_ENTRY.iter_unpack(plan.time_entries):
                active.time_ts_ms.append(ts)
                active.time_rel.append(r)
            active.max_ts_ms, active.max_rel = plan.max_ts_ms, plan.max_rel
            active.note_appended(plan.headers, active.size_bytes - n)
            t.end_offset = plan.next_offset
            t.last_epoch = plan.last_epoch
        self._recent.add(end, plan.next_offset, data if type(data) is bytes else bytes(data))
        return plan.headers

    def _write_or_roll_back(self, active: Segment, view: memoryview, plan: AppendPlan) -> None:
        """Write the batches and their index entries; on an OSError cut every
        file back to its size before and raise LogWriteError."""
        pre_size = active.size_bytes
        pre_index_bytes = len(active.index_rel) * INDEX_ENTRY.size
        pre_time_bytes = len(active.time_ts_ms) * TIME_ENTRY.size
        try:
            write_all(active.fd, view)
            if plan.index_entries:
                write_all(active.index_fd, plan.index_entries)
            if plan.time_entries:
                write_all(active.time_fd, plan.time_entries)
        except OSError as exc:
            try:
                os.ftruncate(active.fd, pre_size)
                os.ftruncate(active.index_fd, pre_index_bytes)
                os.ftruncate(active.time_fd, pre_time_bytes)
            except OSError as exc2:
                self._failed = f"rollback after a failed append failed: {exc2.strerror}"
            raise LogWriteError(f"append of {len(view)} bytes at offset {self._table.end_offset} failed: "
                                f"{exc.strerror}") from exc

    def _roll(self, base_offset: int) -> None:
        t = self._table
        seal_time_index(t.segments[-1], t.lock, self._log)  # Kafka's onBecomeInactiveSegment
        seg = Segment(self._dir, base_offset)
        if seg.size_bytes != 0:
            raise InvariantViolation(f"{seg.log_path} already exists with {seg.size_bytes} bytes")
        with t.lock:
            t.unsynced_rolled.append(t.segments[-1])
            t.segments.append(seg)
            t.bases.append(base_offset)
            t.dir_dirty = True
        if self._on_seal is not None:
            self._on_seal()

    # ----------------------------------------------------------------- flush
    def flush(self) -> int:
        """fdatasync everything appended before the call; return the flushed
        end offset. Safe on a worker thread while the owner keeps appending."""
        t = self._table
        with self._flush_lock, self._rp.lock:
            with t.lock:
                self._check_usable()
                target = t.end_offset
                rolled = list(t.unsynced_rolled)
                if target <= t.flushed_end_offset and not rolled and not t.dir_dirty:
                    return t.flushed_end_offset
                # dup: the owner may close a segment (truncation) while we sync.
                fds = ([os.dup(s.fd) for s in rolled] + [os.dup(s.index_fd) for s in rolled]
                       + [os.dup(s.time_fd) for s in rolled])
                fds.append(os.dup(t.segments[-1].fd))
                dir_dirty, t.dir_dirty = t.dir_dirty, False
                t.flush_cap = target
            try:
                for fd in fds:
                    os.fdatasync(fd)
                if dir_dirty:
                    fsync_dir(self._dir)
            except OSError as exc:
                with t.lock:
                    t.flush_cap = None
                    # After a failed fsync the page cache may have dropped the
                    # data; a retry could "succeed" falsely. Stop here.
                    self._failed = f"fdatasync failed: {exc.strerror}"
                raise LogWriteError(f"flush of {self._dir} up to offset {target} failed: "
                                    f"{exc.strerror}") from exc
            finally:
                for fd in fds:
                    os.close(fd)
            with t.lock:
                cap = t.flush_cap
                t.flush_cap = None
                if cap is None:
                    raise InvariantViolation("flush_cap cleared while a flush held the flush lock")
                if cap > t.flushed_end_offset:
                    t.flushed_end_offset = cap
                t.forget_unsynced(rolled)
                flushed = t.flushed_end_offset
            if rolled and flushed > self._rp.offset:
                # A segment was sealed and is now durable: move the recovery
                # point (once per roll, not per fsync). The recovery point's lock
                # is held, so a truncation lowering it waits and then lowers it again.
                self._rp.raise_to(flushed)
            return flushed

    # ------------------------------------------------------------------ read
    def read(self, start_offset: int, end_offset: int, bytes_max: int, verify: bool | None = None) -> bytes:
        """Whole batches from the one containing start_offset, none with an
        offset >= end_offset, at most bytes_max but always at least one batch
        when one qualifies; b"" when none does. Crosses segment boundaries.
        `verify` overrides verify_reads for this call (False only for callers
        that never serve the bytes: the consistency digest takes the stored CRCs)."""
        if start_offset < self._table.log_start_offset:
            raise ValueError(f"read at offset {start_offset} below the log start offset "
                             f"{self._table.log_start_offset}")
        end_offset = min(end_offset, self._table.end_offset)
        if start_offset >= end_offset:
            return b""
        verify = self._verify_reads if verify is None else verify
        data = self._recent.read(start_offset, end_offset, bytes_max, verify)
        if data is not None:
            return data
        return read_range(self._table, start_offset, end_offset, bytes_max, verify)

    def iter_batch_headers(self, start_offset: int | None = None) -> Iterator[BatchInfo]:
        """Header of every batch from the one containing start_offset (default:
        the log start) to the log end. Reads headers only."""
        offset = self._table.log_start_offset if start_offset is None else start_offset
        if offset >= self._table.end_offset:
            return
        yield from iter_headers(self._table, offset)

    def control_batches(self) -> Iterator[bytes]:
        """Every control batch from the log start, whole (LeaderChange, the
        KIP-853 voter records): found by header, read one by one."""
        for info in self.iter_batch_headers():
            if info.is_control and info.base_offset >= self._table.log_start_offset:
                yield self.read(info.base_offset, info.next_offset, info.size_bytes)

    def batch_epochs(self) -> list[tuple[int, int]]:
        """(epoch, start offset) at each epoch change from the log start, to
        rebuild a missing leader-epoch-checkpoint. The first entry starts at
        the log start offset even if its batch starts earlier."""
        out: list[tuple[int, int]] = []
        for info in self.iter_batch_headers():
            if not out or info.leader_epoch != out[-1][0]:
                out.append((info.leader_epoch, max(info.base_offset, self._table.log_start_offset)))
        return out

    # -------------------------------------------------------------- truncate
    def truncate_to(self, end_offset: int) -> None:
        """Remove every record with offset >= end_offset, in every segment.

        The core truncates at batch boundaries; if end_offset falls inside a
        batch, that whole batch goes too and the log ends at its base offset
        (check log_end_offset). A no-op when end_offset >= log_end_offset.
        """
        self._check_usable()
        self._recent.clear()
        if end_offset >= self._table.end_offset:
            return
        if end_offset < self._table.log_start_offset:
            raise ValueError(f"truncate_to({end_offset}) below the log start offset "
                             f"{self._table.log_start_offset}; use truncate_fully")
        truncation.cut_tail(self._table, self._rp, self._dir, end_offset)

    def truncate_fully(self, new_start_offset: int) -> None:
        """Delete every segment and restart the log empty at new_start_offset
        (after installing a snapshot). Crash-safe: an interrupted call is
        finished by the next open()."""
        self._check_usable()
        self._recent.clear()
        if new_start_offset < 0:
            raise ValueError(f"truncate_fully({new_start_offset}): offset must be >= 0")
        truncation.restart_empty(self._table, self._rp, self._dir, new_start_offset)

    def advance_log_start(self, offset: int, unlink: Callable[[str], None] | None = None) -> None:
        """Move the log start offset forward (durably) and delete whole
        segments all of whose records are below it (`unlink`: see
        Segment.delete). Never moves backwards."""
        self._check_usable()
        if offset > self._table.end_offset:
            raise ValueError(f"advance_log_start({offset}) past the log end offset {self._table.end_offset}")
        if offset > self._table.log_start_offset:
            truncation.cut_head(self._table, self._dir, offset, unlink)

    # ----------------------------------------------------------------- close
    def close(self) -> None:
        """Flush everything and leave a clean-shutdown marker (skips the scan
        on the next open). Idempotent."""
        if self._closed:
            return
        try:
            if not self._failed:
                self.flush()
                os.fsync(self._table.segments[-1].index_fd)
                with self._rp.lock:
                    self._rp.raise_to(self._table.end_offset)
                atomic_write(os.path.join(self._dir, CLEAN_SHUTDOWN_FILE), b"")
        finally:
            self._closed = True
            for seg in self._table.segments:
                seg.close()
            os.close(self._lock_fd)

    def __enter__(self) -> "SegmentedLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        t = self._table
        return (f"SegmentedLog({self._dir!r}, start={self._table.log_start_offset}, "
                f"end={t.end_offset}, flushed={t.flushed_end_offset}, "
                f"segments={len(t.segments)})")
