"""Removing records: from the end (a follower's log diverged from the
leader's), all of them (a snapshot was installed) and from the start (the
snapshot covers them). Each keeps the flush thread's view consistent (the
table's lock), lowers the recovery point before data below it changes, and
fsyncs the directory when files go. The caller (SegmentedLog) has checked
the arguments and that the log is usable.
"""

from __future__ import annotations

from typing import Callable

from metalog.protocol.invariants import InvariantViolation
from metalog.storage.atomic import fsync_dir
from metalog.storage.segments.checkpoints import RecoveryPoint, write_log_start_file
from metalog.storage.segments.indexes import unseal_time_index
from metalog.storage.segments.segment import CHANGING, Segment, new_generation
from metalog.storage.segments.segment_table import SegmentTable


def cut_tail(table: SegmentTable, rp: RecoveryPoint, directory: str, end_offset: int) -> None:
    """Remove every record with offset >= end_offset (log start <= end_offset
    < log end); a batch containing end_offset goes whole."""
    rp.lower_to(end_offset)
    k = table.index_for(end_offset)
    seg = table.segments[k]
    cut: int | None
    if seg.base_offset == end_offset and k > 0:
        doomed, keep, new_end, cut = table.segments[k:], k, end_offset, None
    else:
        found = seg.locate(end_offset)
        if found is None:
            raise InvariantViolation(f"offset {end_offset} below the log end is not in {seg.log_path}")
        cut, new_end = found[0], found[1]
        doomed, keep = table.segments[k + 1:], k + 1
    with table.lock:
        # Before the file changes: the scrubber must not list it, nor take
        # what it reads meanwhile for the sealed segment it listed before.
        table.segments[keep - 1].generation = CHANGING
    n_keep = t_keep = 0
    if cut is not None:
        n_keep, t_keep = seg.cut_files(cut)
    with table.lock:
        if cut is not None:
            seg.forget_past(cut, n_keep, t_keep, new_end)
        del table.segments[keep:]
        del table.bases[keep:]
        # Cut, or active again (it will grow): not the bytes a scrubber may be reading.
        table.segments[-1].generation = new_generation()
        table.forget_unsynced(doomed)
        table.end_offset = new_end
        table.cap_flushed(new_end)
    for s in doomed:
        s.delete()
    active = table.segments[-1]
    if cut is None:
        unseal_time_index(active, table.lock)  # active again: the roll's entry goes
    else:
        active.last_epoch = active.tail_epoch()
        active.max_ts_ms, active.max_rel = active.max_timestamp()
    table.last_epoch = table.epoch_of_last_batch()
    if doomed:
        fsync_dir(directory)


def restart_empty(table: SegmentTable, rp: RecoveryPoint, directory: str, new_start_offset: int) -> None:
    """Delete every segment and restart the log empty at new_start_offset.
    The log-start file says "pending" first, so open() finishes a crashed call."""
    write_log_start_file(directory, new_start_offset, truncate_fully_pending=True)
    rp.reset(new_start_offset)
    with table.lock:
        doomed = table.segments
        table.segments, table.bases = [], []
        table.unsynced_rolled = []
    for s in doomed:
        s.delete()
    seg = Segment(directory, new_start_offset)
    if seg.size_bytes != 0:
        raise InvariantViolation(f"{seg.log_path} exists with {seg.size_bytes} bytes after every segment was deleted")
    fsync_dir(directory)
    with table.lock:
        table.segments, table.bases = [seg], [new_start_offset]
        table.end_offset = new_start_offset
        table.flushed_end_offset = new_start_offset
        if table.flush_cap is not None:
            table.flush_cap = min(table.flush_cap, new_start_offset)
        table.log_start_offset = new_start_offset
        table.last_epoch = -1
    write_log_start_file(directory, new_start_offset)


def cut_head(table: SegmentTable, directory: str, offset: int,
             unlink: Callable[[str], None] | None) -> None:
    """Move the log start forward to `offset` (durably first) and delete the
    whole segments below it (`unlink`: see Segment.delete)."""
    write_log_start_file(directory, offset)
    with table.lock:
        table.log_start_offset = offset
        n = 0
        while n + 1 < len(table.segments) and table.segments[n + 1].base_offset <= offset:
            n += 1
        doomed = table.segments[:n]
        del table.segments[:n]
        del table.bases[:n]
        table.forget_unsynced(doomed)
    for s in doomed:
        s.delete(unlink)
    if doomed:
        fsync_dir(directory)
