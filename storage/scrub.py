"""Background scrubber: re-reads sealed log segments and snapshot files at a
bounded rate and reports corruption (issue 12, item 2; beyond Kafka, which
never re-reads sealed data).

It runs on its own thread, so the event loop never waits on its reads, and it
reads by path through its own file descriptors: the owner of the log may
truncate, delete or rename (quarantine) segments meanwhile. A segment that
changed under the scrubber (``SegmentedLog.segment_unchanged`` is False after
the read) is skipped, never reported: only damage in a file that is still the
same sealed segment, with the same size, counts.

Each batch is checked as at open: header, length, magic, CRC-32C, contiguous
offsets from the segment's base to the next segment's base, monotonic epochs.
Snapshots are verified whole, a chunk at a time (storage.snapshot.verify_snapshot_fd).

Found corruption goes to ``on_corruption(report)`` ON THE SCRUBBER THREAD: the
runtime hands it to the event loop (``loop.call_soon_threadsafe``).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, NamedTuple

import structlog

from storage import batch as B
from storage.errors import CorruptionReport
from storage.log import SegmentRef, SegmentedLog, corruption_report_at
from storage.snapshot import CorruptSnapshotError, SnapshotStore, verify_snapshot_fd

DEFAULT_CHUNK_BYTES = 1 << 20  # one pread; the rate limiter waits between them
IDLE_WAIT_S = 60.0  # nothing sealed to scrub: look again after this
PASS_PAUSE_S = 1.0  # between two passes (so a tiny log is not re-read in a loop)


class ScrubPass(NamedTuple):
    bytes_read: int
    segments: int
    snapshots: int
    skipped: int  # files that changed under the scrubber
    corrupt: list[CorruptionReport]
    complete: bool  # False if stopped mid-pass


class Scrubber:
    """Re-reads sealed segments and snapshots at `bytes_per_s` (0 = disabled)."""

    def __init__(self, log: SegmentedLog, snapshots: SnapshotStore | None, bytes_per_s: int,
                 on_corruption: Callable[[CorruptionReport], None], *, logger: Any = None,
                 metrics: Any = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        if bytes_per_s < 0:
            raise ValueError(f"bytes_per_s must be >= 0 (0 disables), got {bytes_per_s}")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self._log = log
        self._snapshots = snapshots
        self._rate = bytes_per_s
        self._on_corruption = on_corruption
        self._logger = logger if logger is not None else structlog.get_logger("storage.scrub")
        self._metrics = metrics
        self._chunk = chunk_bytes
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Token bucket state of the rate limiter.
        self._budget_t0 = 0.0
        self._budget_bytes = 0
        # Reported (path, position) pairs: a damaged file not yet quarantined
        # is reported once, not on every pass.
        self._reported: set[tuple[str, int]] = set()

    # ------------------------------------------------------------ lifecycle
    @property
    def enabled(self) -> bool:
        return self._rate > 0

    def start(self) -> None:
        if not self.enabled or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="metalog-scrubber", daemon=True)
        self._thread.start()
        self._logger.info("scrubber_started", bytes_per_s=self._rate)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop and join (bounded: a pread in flight finishes first)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self._logger.warning("scrubber_stop_timed_out", timeout_s=timeout_s)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                result = self.scrub_pass()
            except (OSError, ValueError) as exc:
                # An IO error reading (EIO) is not a CRC verdict; say so loudly
                # and try again later rather than kill the broker from here.
                self._logger.error("scrub_failed", error=str(exc), error_type=type(exc).__name__)
                self._stop.wait(IDLE_WAIT_S)
                continue
            if result.complete:
                self._logger.info("scrub_pass_complete", bytes=result.bytes_read, segments=result.segments,
                                  snapshots=result.snapshots, skipped=result.skipped,
                                  corrupt=len(result.corrupt))
            self._stop.wait(IDLE_WAIT_S if result.bytes_read == 0 else PASS_PAUSE_S)

    # ------------------------------------------------------------ one pass
    def scrub_pass(self) -> ScrubPass:
        """Re-read every sealed segment and snapshot once (rate-limited when
        bytes_per_s > 0). Callable directly (tests, the CLI)."""
        self._budget_t0 = time.monotonic()
        self._budget_bytes = 0
        total = segments = snaps = skipped = 0
        corrupt: list[CorruptionReport] = []
        for ref in self._log.sealed_segments():
            if self._stop.is_set():
                return ScrubPass(total, segments, snaps, skipped, corrupt, False)
            n, report, changed = self._scrub_segment(ref)
            total += n
            segments += 1
            skipped += changed
            if report is not None:
                corrupt.append(report)
        if self._snapshots is not None:
            for sid in self._snapshots.list():
                if self._stop.is_set():
                    return ScrubPass(total, segments, snaps, skipped, corrupt, False)
                n, report, changed = self._scrub_snapshot(self._snapshots.path(sid), sid)
                total += n
                snaps += 1
                skipped += changed
                if report is not None:
                    corrupt.append(report)
        if self._metrics is not None:
            self._metrics.scrub_last_complete_pass.set(time.time())
        return ScrubPass(total, segments, snaps, skipped, corrupt, True)

    def _throttle(self, n: int) -> None:
        if self._metrics is not None:
            self._metrics.scrub_bytes.inc(n)
        if self._rate <= 0:
            return
        self._budget_bytes += n
        due = self._budget_t0 + self._budget_bytes / self._rate
        wait_s = due - time.monotonic()
        if wait_s > 0:
            self._stop.wait(wait_s)  # the rate limit; returns early on stop()

    def _found(self, report: CorruptionReport) -> CorruptionReport | None:
        key = (report.path, report.position)
        if key in self._reported:
            return None
        self._reported.add(key)
        self._logger.error("scrub_found_corruption", **report.as_log_fields())
        self._on_corruption(report)
        return report

    def _scrub_segment(self, ref: SegmentRef) -> tuple[int, CorruptionReport | None, int]:
        """(bytes read, report or None, 1 if the segment changed under us)."""
        try:
            fd = os.open(ref.log_path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return 0, None, 1
        try:
            if os.fstat(fd).st_ino != ref.inode:
                return 0, None, 1
            check = verify_segment_fd(fd, ref.log_path, ref.size, ref.base_offset, ref.next_offset,
                                      ref.prev_epoch, self._chunk, self._throttle, self._stop)
        finally:
            os.close(fd)
        if check.report is None or check.stopped:
            return check.bytes_read, None, 0
        if not self._log.segment_unchanged(ref):
            return check.bytes_read, None, 1  # truncated/renamed/deleted meanwhile: not corruption
        return check.bytes_read, self._found(check.report), 0

    def _scrub_snapshot(self, path: str, sid) -> tuple[int, CorruptionReport | None, int]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return 0, None, 1  # deleted (log start moved on) meanwhile
        try:
            st = os.fstat(fd)
            read = [0]

            def on_read(n: int) -> None:
                read[0] += n
                self._throttle(n)

            # A chunk at a time, never the whole file in RAM (a 2M-partition
            # snapshot is 150 MB, on every broker, every pass).
            try:
                verify_snapshot_fd(fd, sid, path, block_bytes=self._chunk, on_read=on_read, stop=self._stop)
            except CorruptSnapshotError as exc:
                pos = read[0]
                try:
                    same = os.stat(path).st_ino == st.st_ino
                except FileNotFoundError:
                    same = False
                if not same:
                    return pos, None, 1
                return pos, self._found(exc.report), 0
            return read[0], None, 0
        finally:
            os.close(fd)


class SegmentCheck(NamedTuple):
    bytes_read: int
    next_offset: int  # after the last good batch
    last_epoch: int
    report: CorruptionReport | None
    stopped: bool


def verify_segment_fd(fd: int, path: str, size: int, base_offset: int, next_offset: int | None,
                      prev_epoch: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                      on_read: Callable[[int], None] | None = None,
                      stop: threading.Event | None = None) -> SegmentCheck:
    """Verify every batch of one segment file (the first `size` bytes of fd)
    in chunk_bytes preads: header, length, magic, CRC-32C, offsets contiguous
    from base_offset (and ending at next_offset when given), epochs monotonic
    from prev_epoch. Stops at the first problem and reports it."""
    buf = b""
    buf_pos = 0  # file position of buf[0]
    read_pos = 0
    expected, epoch = base_offset, prev_epoch
    problem: tuple[int, str] | None = None
    while read_pos < size and problem is None:
        if stop is not None and stop.is_set():
            return SegmentCheck(read_pos, expected, epoch, None, True)
        chunk = os.pread(fd, min(chunk_bytes, size - read_pos), read_pos)
        if not chunk:
            problem = (read_pos, f"short read at byte {read_pos} of {size}")
            break
        read_pos += len(chunk)
        if on_read is not None:
            on_read(len(chunk))
        buf = buf + chunk if buf else chunk  # the leftover of a batch cut by the chunk, then the chunk
        view = memoryview(buf)
        pos = 0
        while len(buf) - pos >= B.HEADER_SIZE:
            try:
                h = B.decode_header(view, pos)
            except B.CorruptBatchError as exc:
                problem = (buf_pos + pos, str(exc))
                break
            if pos + h.size > len(buf):
                break  # the rest of this batch is in the next chunk
            if h.base_offset != expected:
                problem = (buf_pos + pos, f"base offset {h.base_offset}, expected {expected}")
                break
            if h.leader_epoch < epoch:
                problem = (buf_pos + pos, f"leader epoch {h.leader_epoch} after epoch {epoch}")
                break
            try:
                B.verify_crc(view, pos, h)
            except B.CorruptBatchError as exc:
                problem = (buf_pos + pos, str(exc))
                break
            expected, epoch = h.next_offset, h.leader_epoch
            pos += h.size
        view.release()
        if problem is None:
            buf = buf[pos:]
            buf_pos += pos
    if problem is None and buf:
        problem = (buf_pos, f"{len(buf)} bytes at the end are not a whole batch")
    if problem is None and next_offset is not None and expected != next_offset:
        problem = (size, f"segment ends at offset {expected} but the next segment starts at {next_offset}")
    if problem is None:
        return SegmentCheck(read_pos, expected, epoch, None, False)
    pos, reason = problem
    rel = pos - buf_pos
    r = corruption_report_at(path, buf if 0 <= rel < len(buf) else None, rel, expected, reason)
    report = CorruptionReport(path, pos, r.base_offset, r.leader_epoch, r.expected_crc, r.actual_crc, reason)
    return SegmentCheck(read_pos, expected, epoch, report, False)
