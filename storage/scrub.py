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
Snapshots are verified whole, a chunk at a time (metalog.storage.snapshot.verify_snapshot_fd).

Found corruption goes to ``on_corruption(report)`` ON THE SCRUBBER THREAD: the
runtime hands it to the event loop (``loop.call_soon_threadsafe``).

New files first: a roll of the log (``SegmentedLog.set_seal_listener``) and a
new snapshot (``notify()``, called by the runtime) wake the scrubber, which
then reads every sealed segment and snapshot it has not read since it
appeared before it goes on with its full pass (it looks at every chunk it
reads, so a fresh file waits at most for one chunk of the file being read,
DEFAULT_CHUNK_BYTES / bytes_per_s: about 3.5 s at the default rate). With nothing to
read it sleeps at most ``idle_wait_ms`` (the storage setting
``log_scrub_idle_wait_ms``) before listing the files again, which bounds the
delay for a file nothing announced. The rate limit covers all reads.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, NamedTuple, Protocol

import structlog

from metalog.protocol.messages import SnapshotId
from metalog.storage import batch as B
from metalog.storage.errors import CorruptionReport
from metalog.storage.event_logger import EventLogger
from metalog.storage.segments import SegmentRef, SegmentedLog, corruption_report_at
from metalog.storage.snapshot import CorruptSnapshotError, SnapshotStore, verify_snapshot_fd

# What the scrubber remembers of a file it read: a segment by (path,
# generation), a snapshot by (path, inode, size).
_FileKey = tuple[str, int] | tuple[str, int, int]


class _Gauge(Protocol):
    def set(self, value: float) -> None: ...


class _Counter(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class ScrubMetrics(Protocol):
    """The two metrics the scrubber keeps (prometheus_client's types fit)."""

    @property
    def scrub_bytes(self) -> _Counter: ...

    @property
    def scrub_last_complete_pass(self) -> _Gauge: ...

DEFAULT_CHUNK_BYTES = 1 << 20  # one pread; the rate limiter waits between them
DEFAULT_IDLE_WAIT_MS = 60_000  # nothing sealed to scrub: list the files again after this
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
                 on_corruption: Callable[[CorruptionReport], None], *, logger: EventLogger | None = None,
                 metrics: ScrubMetrics | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 idle_wait_ms: int = DEFAULT_IDLE_WAIT_MS):
        if bytes_per_s < 0:
            raise ValueError(f"bytes_per_s must be >= 0 (0 disables), got {bytes_per_s}")
        if idle_wait_ms <= 0:
            raise ValueError(f"idle_wait_ms must be positive, got {idle_wait_ms}")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self._log = log
        self._snapshots = snapshots
        self._rate = bytes_per_s
        self._on_corruption = on_corruption
        self._logger = logger if logger is not None else structlog.get_logger("metalog.storage.scrub")
        self._metrics = metrics
        self._chunk = chunk_bytes
        self._idle_wait_s = idle_wait_ms / 1000
        self._stop = threading.Event()
        # Set by notify() (a roll, a new snapshot) and by stop(): the thread
        # waits on it instead of sleeping out its pause.
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        # Token bucket state of the rate limiter.
        self._budget_t0 = 0.0
        self._budget_bytes = 0
        # Reported (path, position) pairs: a damaged file not yet quarantined
        # is reported once, not on every pass.
        self._reported: set[tuple[str, int]] = set()
        # Files read (whole) since they appeared, so a wake-up reads only the
        # new ones: a segment by (path, generation), a snapshot by (path,
        # inode, size). Pruned to the files that exist at each look: bounded.
        self._seen: set[_FileKey] = set()
        self._reading_new = False  # inside scrub_new: no nested wake-up handling
        # Keys (as in _seen) of the files being read now: a wake-up in the
        # middle of one does not read it again, the read under way finishes it.
        self._in_progress: set[_FileKey] = set()

    # ------------------------------------------------------------ lifecycle
    @property
    def enabled(self) -> bool:
        return self._rate > 0

    def notify(self) -> None:
        """A new sealed segment or snapshot exists: read it soon. Any thread;
        never blocks."""
        self._wake.set()

    def start(self) -> None:
        if not self.enabled or self._thread is not None:
            return
        self._log.set_seal_listener(self.notify)
        self._thread = threading.Thread(target=self._run, name="metalog-scrubber", daemon=True)
        self._thread.start()
        self._logger.info("scrubber_started", bytes_per_s=self._rate, idle_wait_ms=round(self._idle_wait_s * 1000))

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop and join (bounded: a pread in flight finishes first)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._log.set_seal_listener(None)
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
                self._stop.wait(self._idle_wait_s)
                continue
            if result.complete:
                self._logger.info("scrub_pass_complete", bytes=result.bytes_read, segments=result.segments,
                                  snapshots=result.snapshots, skipped=result.skipped,
                                  corrupt=len(result.corrupt))
            self._pause(self._idle_wait_s if result.bytes_read == 0 else PASS_PAUSE_S)

    def _pause(self, wait_s: float) -> None:
        """Wait `wait_s` before the next full pass; a notify() meanwhile has
        the new files read at once (then the wait goes on)."""
        deadline = time.monotonic() + wait_s
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self._wake.wait(left):
                self._wake.clear()
                if self._stop.is_set():
                    return
                self._reset_budget()
                self._reading_new = True
                try:
                    fresh = self.scrub_new()
                except (OSError, ValueError) as exc:
                    self._logger.error("scrub_failed", error=str(exc), error_type=type(exc).__name__)
                    return
                finally:
                    self._reading_new = False
                if fresh.bytes_read:
                    # Sealed data exists now: the idle wait no longer applies,
                    # full passes go on (damage after this read is found there).
                    deadline = min(deadline, time.monotonic() + PASS_PAUSE_S)

    # ------------------------------------------------------------ one pass
    def scrub_pass(self) -> ScrubPass:
        """Re-read every sealed segment and snapshot once (rate-limited when
        bytes_per_s > 0). Callable directly (tests, the CLI). Between two
        files, a pending notify() has the new files read first."""
        self._reset_budget()
        total = segments = snaps = skipped = 0
        corrupt: list[CorruptionReport] = []
        refs = self._log.sealed_segments()
        for ref in refs:
            self._new_files_first()
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
                self._new_files_first()
                if self._stop.is_set():
                    return ScrubPass(total, segments, snaps, skipped, corrupt, False)
                n, report, changed = self._scrub_snapshot(self._snapshots.path(sid), sid)
                total += n
                snaps += 1
                skipped += changed
                if report is not None:
                    corrupt.append(report)
        # Forget segments no longer sealed as listed and snapshots gone, so the
        # set stays bounded even with no wake-ups (scrub_new prunes too).
        listed = {(r.log_path, r.generation) for r in refs}
        self._seen = {k for k in self._seen if k in listed or (len(k) == 3 and os.path.exists(k[0]))}
        if self._metrics is not None:
            self._metrics.scrub_last_complete_pass.set(time.time())
        return ScrubPass(total, segments, snaps, skipped, corrupt, True)

    def scrub_new(self) -> ScrubPass:
        """Read the sealed segments and snapshots not read since they
        appeared (a roll, a new snapshot); the rate limit applies."""
        total = segments = snaps = skipped = 0
        corrupt: list[CorruptionReport] = []
        refs = self._log.sealed_segments()
        store = self._snapshots
        paths = [(sid, store.path(sid)) for sid in store.list()] if store is not None else []
        snap_keys: dict[SnapshotId, tuple[str, int, int]] = {}
        for sid, path in paths:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            snap_keys[sid] = (path, st.st_ino, st.st_size)
        # Forget files that are gone (bounded); remember the rest.
        self._seen &= {(r.log_path, r.generation) for r in refs} | set(snap_keys.values())
        for ref in refs:
            if (ref.log_path, ref.generation) in self._seen | self._in_progress:
                continue
            if self._stop.is_set():
                return ScrubPass(total, segments, snaps, skipped, corrupt, False)
            n, report, changed = self._scrub_segment(ref)
            total, segments, skipped = total + n, segments + 1, skipped + changed
            if report is not None:
                corrupt.append(report)
        for sid, key in snap_keys.items():
            if key in self._seen or key in self._in_progress:
                continue
            if self._stop.is_set():
                return ScrubPass(total, segments, snaps, skipped, corrupt, False)
            n, report, changed = self._scrub_snapshot(key[0], sid)
            total, snaps, skipped = total + n, snaps + 1, skipped + changed
            if report is not None:
                corrupt.append(report)
        return ScrubPass(total, segments, snaps, skipped, corrupt, True)

    def _new_files_first(self) -> None:
        """Between two files and two chunks: read what a wake-up announced
        first, then go on where we were."""
        if self._wake.is_set() and not self._reading_new and not self._stop.is_set():
            self._wake.clear()
            self._reading_new = True
            try:
                self.scrub_new()
            finally:
                self._reading_new = False

    def _reset_budget(self) -> None:
        self._budget_t0 = time.monotonic()
        self._budget_bytes = 0

    def _throttle(self, n: int) -> None:
        """After each chunk read: count it, keep to the rate, and read newly
        announced files first."""
        if self._metrics is not None:
            self._metrics.scrub_bytes.inc(n)
        self._new_files_first()
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
            key = (ref.log_path, ref.generation)
            self._in_progress.add(key)
            try:
                check = verify_segment_fd(fd, ref.log_path, ref.size_bytes, ref.base_offset, ref.next_offset,
                                          ref.prev_epoch, self._chunk, self._throttle, self._stop)
            finally:
                self._in_progress.discard(key)
        finally:
            os.close(fd)
        if check.stopped:
            return check.bytes_read, None, 0
        self._seen.add((ref.log_path, ref.generation))
        if check.report is None:
            return check.bytes_read, None, 0
        if not self._log.segment_unchanged(ref):
            return check.bytes_read, None, 1  # truncated/renamed/deleted meanwhile: not corruption
        return check.bytes_read, self._found(check.report), 0

    def _scrub_snapshot(self, path: str, sid: SnapshotId) -> tuple[int, CorruptionReport | None, int]:
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
            key = (path, st.st_ino, st.st_size)
            self._in_progress.add(key)
            try:
                layout = verify_snapshot_fd(fd, sid, path, block_bytes=self._chunk, on_read=on_read,
                                            stop=self._stop)
            except CorruptSnapshotError as exc:
                pos = read[0]
                try:
                    same = os.stat(path).st_ino == st.st_ino
                except FileNotFoundError:
                    same = False
                if not same:
                    return pos, None, 1
                self._seen.add(key)
                return pos, self._found(exc.report), 0
            finally:
                self._in_progress.discard(key)
            if layout is None:
                return read[0], None, 0  # stopped
            self._seen.add(key)
            return read[0], None, 0
        finally:
            os.close(fd)


class SegmentCheck(NamedTuple):
    bytes_read: int
    next_offset: int  # after the last good batch
    last_epoch: int
    report: CorruptionReport | None
    stopped: bool


def verify_segment_fd(fd: int, path: str, size_bytes: int, base_offset: int, next_offset: int | None,
                      prev_epoch: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                      on_read: Callable[[int], None] | None = None,
                      stop: threading.Event | None = None) -> SegmentCheck:
    """Verify every batch of one segment file (the first `size_bytes` bytes of fd)
    in chunk_bytes preads: header, length, magic, CRC-32C, offsets contiguous
    from base_offset (and ending at next_offset when given), epochs monotonic
    from prev_epoch. Stops at the first problem and reports it."""
    buf = b""
    buf_pos = 0  # file position of buf[0]
    read_pos = 0
    expected, epoch = base_offset, prev_epoch
    problem: tuple[int, str] | None = None
    while read_pos < size_bytes and problem is None:
        if stop is not None and stop.is_set():
            return SegmentCheck(read_pos, expected, epoch, None, True)
        chunk = os.pread(fd, min(chunk_bytes, size_bytes - read_pos), read_pos)
        if not chunk:
            problem = (read_pos, f"short read at byte {read_pos} of {size_bytes}")
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
        problem = (size_bytes, f"segment ends at offset {expected} but the next segment starts at {next_offset}")
    if problem is None:
        return SegmentCheck(read_pos, expected, epoch, None, False)
    pos, reason = problem
    rel = pos - buf_pos
    r = corruption_report_at(path, buf if 0 <= rel < len(buf) else None, rel, expected, reason)
    report = CorruptionReport(path, pos, r.base_offset, r.leader_epoch, r.expected_crc, r.actual_crc, reason)
    return SegmentCheck(read_pos, expected, epoch, report, False)
