"""Opening a log directory at boot and recovering it after a crash (Kafka's
LogLoader): list the files, finish what a crash interrupted, and check every
segment before the log serves a byte.

Without the clean-shutdown marker the last segment is scanned from its start,
verifying every batch's length, offsets and CRC-32C. A damaged *tail* (a torn
write of unflushed data: a partial batch, zeros, garbage with no valid batch
after it) is cut off at the last whole batch and reported with one structured
log line (``event="log_recovered"``). Damage *followed by* a valid batch, or
damage in any segment but the last, is not a torn tail: ``CorruptLogError``
names the file, byte position and base offset, and nothing is repaired (the
caller then raises or quarantines, metalog.storage.segments.quarantine).

After an unclean shutdown every segment holding records at or past the
recovery point is verified in full (header, length, magic, CRC-32C,
contiguous offsets, monotonic epochs). Every other segment gets a cheap
check: its index is sane and the batches after its last index entry end
exactly at the file end, at the next segment's base offset; a missing or
broken index is rebuilt by a full verified scan. Trailing empty segments left
by a crash right after a roll are removed.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from metalog.storage import batch as B
from metalog.storage.errors import CorruptLogError
from metalog.storage.event_logger import EventLogger
from metalog.storage.segments.checkpoints import read_log_start_file
from metalog.storage.segments.indexes import add_final_time_entry, load_offset_index
from metalog.storage.segments.layout import (
    CLEAN_SHUTDOWN_FILE, CORRUPT_RE, DELETED_SEGMENT_RE, INDEX_SUFFIX, KNOWN_FILES, SEGMENT_RE,
    SNAPSHOT_FILE_RE, TIMEINDEX_SUFFIX, segment_file_name)
from metalog.storage.segments.scan import corruption_report_at, scan, valid_batch_after
from metalog.storage.segments.segment import Segment
from metalog.storage.segments.segment_table import SegmentTable


class FoundSegments(NamedTuple):
    segments: list[Segment]  # open, in offset order, not yet checked
    log_start_offset: int | None  # from the log-start-offset file, if any
    clean: bool  # the clean-shutdown marker was there


class LogLoader:
    """The boot phases of one directory: `open_segments`, then `verify`."""

    def __init__(self, directory: str, index_interval_bytes: int, logger: EventLogger):
        self._dir = directory
        self._interval = index_interval_bytes
        self._log = logger

    # ------------------------------------------------------------ the files
    def open_segments(self) -> FoundSegments:
        """Open every segment, after removing what a crash left half done:
        renamed-for-deletion files, orphan index files, the segments of an
        interrupted truncate_fully() or advance_log_start(), and (after an
        unclean stop) empty segments at the end."""
        bases, index_only, clean = self._list_files()
        d = self._dir
        for base in sorted(index_only - bases):  # left by a crash while deleting a segment
            for suffix in (INDEX_SUFFIX, TIMEINDEX_SUFFIX):
                name = segment_file_name(base, suffix)
                if os.path.exists(os.path.join(d, name)):
                    os.unlink(os.path.join(d, name))
                    self._log.info("orphan_index_removed", segment=name)
        start_state = read_log_start_file(d)
        log_start = start_state.log_start_offset if start_state else None
        if start_state and start_state.truncate_fully_pending:
            # A truncate_fully() was interrupted: finish it.
            for base in sorted(bases):
                Segment(d, base).delete()
            bases = set()
            self._log.warning("truncate_fully_completed_on_open", log_start_offset=log_start)
        if not bases:
            bases = {log_start or 0}
        ordered = sorted(bases)
        if log_start is not None:
            # Finish an interrupted advance_log_start(): whole segments below it go.
            while len(ordered) >= 2 and ordered[1] <= log_start:
                Segment(d, ordered.pop(0)).delete()
        segments = [Segment(d, base) for base in ordered]
        try:
            if not clean:
                # A segment created by a roll just before a crash may hold nothing.
                while len(segments) >= 2 and segments[-1].size_bytes == 0:
                    seg = segments.pop()
                    seg.delete()
                    self._log.warning("empty_segment_removed", segment=seg.log_path)
        except BaseException:
            for seg in segments:
                seg.close()
            raise
        return FoundSegments(segments, log_start, clean)

    def _list_files(self) -> tuple[set[int], set[int], bool]:
        """(bases with a .log, bases with only index files, clean marker
        present); removes files a deferred unlink left, warns of strangers."""
        d = self._dir
        bases: set[int] = set()
        index_only: set[int] = set()
        clean = False
        for name in sorted(os.listdir(d)):
            m = SEGMENT_RE.match(name)
            if m:
                (bases if m.group(2) == "log" else index_only).add(int(m.group(1)))
            elif name == CLEAN_SHUTDOWN_FILE:
                clean = True
            elif DELETED_SEGMENT_RE.match(name):  # renamed for a deferred unlink a crash cut off
                os.unlink(os.path.join(d, name))
                self._log.info("deleted_segment_file_removed", path=os.path.join(d, name))
            elif name in KNOWN_FILES or CORRUPT_RE.search(name) or SNAPSHOT_FILE_RE.match(name):
                pass
            else:
                self._log.warning("unknown_file_ignored", path=os.path.join(d, name))
        return bases, index_only, clean

    # ------------------------------------------------------- the segments
    def verify(self, table: SegmentTable, clean: bool, recovery_point: int,
               raise_on_corruption: bool) -> tuple[int, tuple[int, CorruptLogError] | None]:
        """Check every segment of `table` in order, as the module docstring
        says. Returns (bytes verified in full, None) or, when corruption is
        found and not raised, (bytes, (index of the damaged segment, error));
        the segments after it are left unchecked."""
        segments = table.segments
        verified_bytes = 0
        for i, seg in enumerate(segments):
            is_last = i == len(segments) - 1
            next_base = None if is_last else segments[i + 1].base_offset
            prev_epoch = table.prev_epoch(i)
            try:
                if is_last and not clean:
                    verified_bytes += seg.size_bytes
                    self.recover_last(seg, prev_epoch)
                elif not clean and next_base is not None and next_base > recovery_point:
                    # Holds records at or past the recovery point: verify all of it.
                    verified_bytes += seg.size_bytes
                    self.rebuild_index(seg, next_base, prev_epoch, log_rebuilt=False)
                elif not self.quick_check(seg, next_base, prev_epoch):
                    if next_base is None:  # clean marker but the tail disagrees: recover anyway
                        self.recover_last(seg, prev_epoch)
                    else:
                        self.rebuild_index(seg, next_base, prev_epoch)
            except CorruptLogError as exc:
                if raise_on_corruption:
                    raise
                return verified_bytes, (i, exc)
        return verified_bytes, None

    def recover_last(self, seg: Segment, prev_epoch: int) -> None:
        """Full verified scan of the last segment; cut a torn tail."""
        mm = seg.map()
        res = scan(memoryview(mm) if mm else b"", seg.base_offset, prev_epoch, seg.base_offset, self._interval)
        if res.error_pos is not None:
            later = valid_batch_after(mm, res.error_pos, res.next_offset)
            if later is not None:
                raise CorruptLogError(
                    f"corrupt batch in {seg.log_path} at byte {res.error_pos} (base offset "
                    f"{res.next_offset}): {res.error}; a valid batch follows at byte {later}, "
                    "so this is not a torn tail", seg.log_path, res.error_pos, res.next_offset,
                    report=corruption_report_at(seg.log_path, mm, res.error_pos, res.next_offset,
                                                res.error or ""))
        del mm
        seg.set_index(res.index_rel, res.index_pos)
        seg.set_time_index(res.time_ts_ms, res.time_rel, res.max_ts_ms, res.max_rel)
        seg.next_offset = res.next_offset
        seg.last_epoch = res.last_epoch if res.end_pos else -1
        if res.error_pos is not None:
            truncated = seg.size_bytes - res.end_pos
            os.ftruncate(seg.fd, res.end_pos)
            os.fsync(seg.fd)
            seg.size_bytes = res.end_pos
            self._log.warning("log_recovered", segment=seg.log_path, truncated_bytes=truncated,
                              from_offset=res.next_offset, position=res.end_pos, reason=res.error)
        seg.write_index_file()
        seg.sync_index_files()

    def quick_check(self, seg: Segment, next_base: int | None, prev_epoch: int) -> bool:
        """Trust the index, verify only the batches after its last entry: they
        must end exactly at the file end (and at the next segment's base)."""
        if not load_offset_index(seg, next_base):
            return False
        final = ((seg.time_ts_ms[-1], seg.time_rel[-1])
                 if seg.time_rel and seg.time_rel[-1] > (seg.index_rel[-1] if seg.index_rel else -1) else None)
        if not seg.index_rel and seg.size_bytes > self._interval:
            return self._check_unindexed(seg, next_base, prev_epoch)
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
        tail = os.pread(seg.fd, seg.size_bytes - start_pos, start_pos)
        # At the last .index entry the max timestamp so far is the last .timeindex entry's.
        res = scan(tail, start_offset, -1, seg.base_offset, self._interval, seg.max_ts_ms, seg.max_rel)
        if res.error is not None or (seg.size_bytes and res.end_pos == 0):
            return False
        if next_base is not None and res.next_offset != next_base:
            return False
        if final is not None and final != (res.max_ts_ms, res.max_rel):
            return False  # the roll's entry must name the segment's largest timestamp and its batch
        seg.max_ts_ms, seg.max_rel = res.max_ts_ms, res.max_rel
        seg.next_offset = res.next_offset
        seg.last_epoch = res.last_epoch if seg.size_bytes else -1
        if seg.last_epoch >= 0 and seg.last_epoch < prev_epoch:
            return False
        return True

    def _check_unindexed(self, seg: Segment, next_base: int | None, prev_epoch: int) -> bool:
        """An empty index on a big segment: probably lost. The quick check's
        scan would cover the whole segment anyway, so rebuild it from that scan."""
        tail = os.pread(seg.fd, seg.size_bytes, 0)
        res = scan(tail, seg.base_offset, prev_epoch, seg.base_offset, self._interval)
        if res.error is not None or (next_base is not None and res.next_offset != next_base):
            return False
        seg.set_time_index(res.time_ts_ms, res.time_rel, res.max_ts_ms, res.max_rel)
        if next_base is not None:
            add_final_time_entry(seg)
        if res.index_rel:
            seg.set_index(res.index_rel, res.index_pos)
            seg.write_index_file()
            seg.sync_index_files()
            self._log.warning("index_rebuilt", segment=seg.index_path, entries=len(seg.index_rel))
        seg.next_offset = res.next_offset
        seg.last_epoch = res.last_epoch
        return True

    def rebuild_index(self, seg: Segment, next_base: int, prev_epoch: int, log_rebuilt: bool = True) -> None:
        """A full verified scan of a non-last segment (it failed the quick
        check, or it is past the recovery point after an unclean stop): it must
        come out whole, or the log is corrupt."""
        mm = seg.map()
        res = scan(memoryview(mm) if mm else b"", seg.base_offset, prev_epoch, seg.base_offset, self._interval)
        if res.error_pos is not None:
            report = corruption_report_at(seg.log_path, mm, res.error_pos, res.next_offset, res.error or "")
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
        seg.set_time_index(res.time_ts_ms, res.time_rel, res.max_ts_ms, res.max_rel)
        add_final_time_entry(seg)  # sealed: as the roll wrote it
        seg.next_offset = res.next_offset
        seg.last_epoch = res.last_epoch if seg.size_bytes else -1
        seg.write_index_file()
        seg.sync_index_files()
        if log_rebuilt:
            self._log.warning("index_rebuilt", segment=seg.index_path, entries=len(seg.index_rel))
