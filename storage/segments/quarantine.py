"""Moving damaged segments aside (``on_corruption="quarantine"``): persist a
``quarantine-state`` file (the log end the replica had, which it must
re-replicate past before it may vote), rename the damaged segment and every
later one to ``<name>.log.corrupt`` / ``<name>.index.corrupt`` (never
deleted), keep the verified prefix of the damaged segment, and fsync the
directory. Used at open for corruption the loader found, and at run time
for corruption found by the scrubber or a read.
"""

from __future__ import annotations

import mmap
import os

from metalog.protocol.invariants import InvariantViolation
from metalog.storage import batch as B
from metalog.storage.atomic import fsync_dir
from metalog.storage.errors import CorruptionReport, CorruptLogError, QuarantineState
from metalog.storage.event_logger import EventLogger
from metalog.storage.segments.checkpoints import (
    RecoveryPoint, read_quarantine_file, remove_quarantine_file, write_quarantine_file)
from metalog.storage.segments.indexes import unseal_time_index
from metalog.storage.segments.layout import CORRUPT_SUFFIX, write_all
from metalog.storage.segments.scan import ScanResult, scan, valid_batch_after
from metalog.storage.segments.segment import Segment
from metalog.storage.segments.segment_table import SegmentTable


class Quarantine:
    """The quarantine state of one log and the cut that starts one."""

    def __init__(self, directory: str, table: SegmentTable, recovery_point: RecoveryPoint,
                 index_interval_bytes: int, logger: EventLogger):
        self._dir = directory
        self._table = table
        self._rp = recovery_point
        self._interval = index_interval_bytes
        self._log = logger
        self.state: QuarantineState | None = None

    def load(self) -> None:
        self.state = read_quarantine_file(self._dir)

    def persist(self, must_reach_offset: int, report: CorruptionReport) -> QuarantineState:
        if self.state is None:
            state = QuarantineState(must_reach_offset, (report,))
        else:
            state = self.state.merge(must_reach_offset, report)
        write_quarantine_file(self._dir, state)
        self.state = state
        return state

    def clear(self) -> None:
        remove_quarantine_file(self._dir)
        self.state = None

    def at_open(self, i: int, exc: CorruptLogError) -> CorruptionReport:
        """on_corruption="quarantine" at open: the loader found segment i
        damaged at exc.position. Returns the report, for startup_reports."""
        known_end = self.known_end_at_open(i, exc)
        self._log.error("corruption_detected", source="startup", **exc.report.as_log_fields())
        self.persist(known_end, exc.report)
        self.cut_and_rename(i, exc.position)
        return exc.report

    def at_run_time(self, report: CorruptionReport) -> QuarantineState:
        """Corruption found by the scrubber or a read at report.position of
        the segment file report.path: persist the state (must_reach_offset =
        the current log end), then cut and rename from there."""
        segments = self._table.segments
        k = next((j for j, s in enumerate(segments) if s.log_path == report.path), None)
        if k is None:
            raise ValueError(f"{report.path} is not a segment of the log in {self._dir} "
                             "(already quarantined or deleted?)")
        seg = segments[k]
        if not 0 <= report.position <= seg.size_bytes:
            raise ValueError(f"position {report.position} outside {seg.log_path} ({seg.size_bytes} bytes)")
        state = self.persist(self._table.end_offset, report)
        self.cut_and_rename(k, report.position)
        return state

    def known_end_at_open(self, i: int, exc: CorruptLogError) -> int:
        """What this replica had before the damage the loader found in
        segment i: the largest end offset any evidence on disk shows."""
        segments = self._table.segments
        known_end = max(exc.base_offset or 0, segments[i].base_offset)
        if i + 1 < len(segments):
            known_end = max(known_end, segments[-1].base_offset)
        for seg in (segments[i], segments[-1]):
            known_end = max(known_end, self._last_readable_end(seg))
        return known_end

    def _last_readable_end(self, seg: Segment) -> int:
        """The end offset of the last CRC-valid batch anywhere in `seg` (its
        base if none)."""
        mm = seg.map()
        if not isinstance(mm, mmap.mmap):  # b"": an empty segment
            return seg.base_offset
        view = memoryview(mm)
        try:
            best, pos, expected = seg.base_offset, 0, seg.base_offset
            while True:
                res = scan(view[pos:], expected, -1, seg.base_offset, self._interval)
                best = max(best, res.next_offset)
                if res.error_pos is None:
                    return best
                later = valid_batch_after(mm, pos + res.error_pos, 0)
                if later is None:
                    return best
                pos = later
                expected = B.decode_header(view, later).base_offset
        finally:
            view.release()
            del view
            mm.close()

    def cut_and_rename(self, k: int, cut: int) -> None:
        """Rename segment k and every later one .corrupt; keep the whole
        batches of segment k before byte `cut` in a new segment file."""
        table = self._table
        seg = table.segments[k]
        prefix, res = self._verified_prefix(seg, cut, table.prev_epoch(k))
        new_end = res.next_offset
        self._rp.lower_to(new_end)
        with table.lock:
            doomed = table.segments[k:]
            del table.segments[k:]
            del table.bases[k:]
            table.cap_flushed(new_end)
            table.forget_unsynced(doomed)
        renamed = _rename_corrupt(doomed)
        if prefix or not table.segments:
            fresh = self._segment_of_prefix(seg.base_offset, prefix, res)
            with table.lock:
                table.segments.append(fresh)
                table.bases.append(fresh.base_offset)
        else:
            unseal_time_index(table.segments[-1], table.lock)
        fsync_dir(self._dir)
        with table.lock:
            table.end_offset = table.segments[-1].next_offset
            table.last_epoch = table.epoch_of_last_batch()
        self._log.warning("segments_renamed_corrupt", files=renamed, log_end_offset=table.end_offset)

    def _verified_prefix(self, seg: Segment, cut: int, prev_epoch: int) -> tuple[bytes, ScanResult]:
        """The whole verified batches of `seg` before byte `cut`, and their scan."""
        prefix = os.pread(seg.fd, cut, 0) if cut else b""
        res = scan(prefix, seg.base_offset, prev_epoch, seg.base_offset, self._interval)
        return prefix[:res.end_pos], res

    def _segment_of_prefix(self, base_offset: int, prefix: bytes, res: ScanResult) -> Segment:
        """A new segment file at `base_offset` holding `prefix`, synced, with its indexes."""
        fresh = Segment(self._dir, base_offset)
        if fresh.size_bytes != 0:
            raise InvariantViolation(f"{fresh.log_path} exists after the rename")
        if prefix:
            write_all(fresh.fd, prefix)
            os.fsync(fresh.fd)
        fresh.size_bytes = len(prefix)
        fresh.set_index(res.index_rel, res.index_pos)
        fresh.set_time_index(res.time_ts_ms, res.time_rel, res.max_ts_ms, res.max_rel)
        fresh.next_offset = res.next_offset
        fresh.last_epoch = res.last_epoch if prefix else -1
        fresh.write_index_file()
        fresh.sync_index_files()
        return fresh


def corrupt_name(path: str) -> str:
    """`path`.corrupt, or .corrupt.1, .2 ... when an earlier quarantine took it."""
    target = path + CORRUPT_SUFFIX
    n = 0
    while os.path.exists(target):
        n += 1
        target = f"{path}{CORRUPT_SUFFIX}.{n}"
    return target


def _rename_corrupt(doomed: list[Segment]) -> list[str]:
    """Close each segment and rename its .log and .index .corrupt (kept for
    the operator); its .timeindex is derived from the .log and goes."""
    renamed = []
    for s in doomed:
        s.close()
        for path in (s.log_path, s.index_path):
            if os.path.exists(path):
                target = corrupt_name(path)
                os.rename(path, target)
                renamed.append(target)
        if os.path.exists(s.timeindex_path):
            os.unlink(s.timeindex_path)
    return renamed
