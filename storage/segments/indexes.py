"""A segment's two index files, Kafka's OffsetIndex and TimeIndex: reading
and checking them at open, and the time index's final entry at a roll.

``.index``: 8-byte entries ``relative offset u32 | file position u32``, one
for a batch roughly every ``index_interval_bytes``; the offset is the
batch's LAST offset, the position its start. An offset is found by
bisecting for the last entry at or below it and scanning headers forward
from that entry's batch (Segment.locate).

``.timeindex``: 12-byte entries ``timestamp i64 | relative offset u32``: at
each .index entry, the largest batch max timestamp so far in the segment and
the (last) offset of the batch that holds it, appended only when that
timestamp grew; and, as Kafka's LogSegment.onBecomeInactiveSegment does, one
more entry when a roll seals the segment: (largest timestamp of the segment,
last offset of its batch), unless the last entry already holds that
timestamp. So only a sealed segment may end with an entry past its last
.index entry, and only one; a segment made active again by a truncation
loses it. Both files are derived data: rebuilt by a full scan when missing
or bad (a rebuilt sealed segment gets its final entry too).
"""

from __future__ import annotations

import bisect
import os
import threading
from array import array

from metalog.storage.segments.layout import INDEX_ENTRY, TIME_ENTRY, write_all
from metalog.storage.segments.segment import Segment
from metalog.storage.event_logger import EventLogger


def load_offset_index(seg: Segment, next_base: int | None) -> bool:
    """Read the .index file (then the .timeindex); False if either is
    missing, torn or inconsistent."""
    raw = os.pread(seg.index_fd, os.fstat(seg.index_fd).st_size, 0)
    if len(raw) % INDEX_ENTRY.size:
        return False
    rel = array("I")
    pos = array("I")
    prev_r, prev_p = -1, 0
    for r, p in INDEX_ENTRY.iter_unpack(raw):
        if r <= prev_r or p <= prev_p or p >= seg.size_bytes:
            return False
        rel.append(r)
        pos.append(p)
        prev_r, prev_p = r, p
    seg.set_index(rel, pos)
    return load_time_index(seg, next_base)


def load_time_index(seg: Segment, next_base: int | None) -> bool:
    """Read the .timeindex; False if it is missing, torn or inconsistent
    with the .index: an entry at each .index entry where the timestamp
    grew (so one iff there is an .index entry), timestamps strictly and
    offsets never decreasing, none past the last .index entry's offset
    but, on a sealed segment (next_base given), one final entry within
    the segment (the roll's, checked against the data by the loader's quick
    check). Sets max_ts_ms/max_rel to the last entry at an .index entry."""
    raw = os.pread(seg.time_fd, os.fstat(seg.time_fd).st_size, 0)
    if len(raw) % TIME_ENTRY.size:
        return False
    ts = array("q")
    rel = array("I")
    prev_t, prev_r = -1, -1
    last_indexed = seg.index_rel[-1] if seg.index_rel else -1
    n_entries = len(raw) // TIME_ENTRY.size
    at_index = n_entries
    for i, (t, r) in enumerate(TIME_ENTRY.iter_unpack(raw)):
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
    seg.time_ts_ms, seg.time_rel = ts, rel
    seg.max_ts_ms, seg.max_rel = (ts[at_index - 1], rel[at_index - 1]) if at_index else (-1, 0)
    return True


def final_time_entry(seg: Segment) -> tuple[int, int] | None:
    """The entry Kafka's TimeIndex.maybeAppend adds when the segment is
    sealed: (largest timestamp, relative offset of its batch), or None
    when the last entry already holds that timestamp (only a larger one
    is appended)."""
    if seg.max_ts_ms <= (seg.time_ts_ms[-1] if seg.time_ts_ms else -1):
        return None
    if seg.time_rel and seg.max_rel < seg.time_rel[-1]:
        return None  # cannot happen from our own appends; never write a decreasing offset
    return seg.max_ts_ms, seg.max_rel


def add_final_time_entry(seg: Segment) -> None:
    """In memory only: the sealed segment's final entry, as the roll wrote it."""
    entry = final_time_entry(seg)
    if entry is not None:
        seg.time_ts_ms.append(entry[0])
        seg.time_rel.append(entry[1])


def seal_time_index(seg: Segment, lock: threading.Lock, logger: EventLogger) -> None:
    """At a roll: append the final .timeindex entry of the segment being
    sealed. A failed write leaves the file as before (derived data; a
    sealed segment without the entry is valid), never fails the roll."""
    entry = final_time_entry(seg)
    if entry is None:
        return
    pre = len(seg.time_ts_ms) * TIME_ENTRY.size
    try:
        write_all(seg.time_fd, TIME_ENTRY.pack(*entry))
    except OSError as exc:
        try:
            os.ftruncate(seg.time_fd, pre)
        except OSError:
            pass  # a torn entry is caught at open, and the .timeindex rebuilt
        logger.warning("timeindex_final_entry_failed", segment=seg.timeindex_path, error=exc.strerror)
        return
    with lock:
        seg.time_ts_ms.append(entry[0])
        seg.time_rel.append(entry[1])


def unseal_time_index(seg: Segment, lock: threading.Lock) -> None:
    """`seg` is the active segment again (a truncation or quarantine took
    every later one): drop its final entry, so that an active segment's
    entries all sit at .index entries."""
    keep = bisect.bisect_right(seg.time_rel, seg.index_rel[-1]) if seg.index_rel else 0
    if keep < len(seg.time_ts_ms):
        os.ftruncate(seg.time_fd, keep * TIME_ENTRY.size)
        with lock:
            del seg.time_ts_ms[keep:]
            del seg.time_rel[keep:]
