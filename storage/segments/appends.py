"""Checking a buffer of batches before append() writes it: each must be a
whole batch (CRC-checked unless the caller already verified the bytes),
starting exactly at the log end, with a leader epoch no older than the log's;
and the .index/.timeindex entries the write adds, computed on the way. Pure:
nothing is written here, so a rejected buffer leaves the log untouched.
"""

from __future__ import annotations

from typing import NamedTuple

from metalog.storage import batch as B
from metalog.storage.segments.layout import INDEX_ENTRY, TIME_ENTRY


class AppendStart(NamedTuple):
    """Where the buffer lands and what the segment holds before it."""

    seg_base: int  # base offset of the segment written to (a new one after a roll)
    file_start: int  # byte position of the buffer in that segment
    expected_offset: int  # the log end offset
    last_epoch: int  # the log's last batch epoch
    last_index_pos: int  # position of the segment's last .index entry
    max_ts_ms: int  # largest batch max timestamp of the segment so far, -1 if none
    max_rel: int  # relative last offset of its batch
    last_time_ts_ms: int  # timestamp of the segment's last .timeindex entry, -1 if none


class AppendPlan(NamedTuple):
    headers: list[B.BatchHeader]
    next_offset: int  # the log end after the write
    last_epoch: int
    index_entries: bytes  # to append to the .index
    index_rel: list[int]
    index_pos: list[int]
    last_index_pos: int
    time_entries: bytes  # to append to the .timeindex
    max_ts_ms: int
    max_rel: int


def plan_append(view: memoryview, start: AppendStart, index_interval_bytes: int, verify: bool) -> AppendPlan:
    """Check every batch of `view` (ValueError saying what is wrong with the
    buffer) and compute the index entries its write adds."""
    n = len(view)
    seg_base, file_start = start.seg_base, start.file_start
    last_index_pos, last_time_ts_ms = start.last_index_pos, start.last_time_ts_ms
    max_ts_ms, max_rel = start.max_ts_ms, start.max_rel
    expected, epoch = start.expected_offset, start.last_epoch
    new_index: list[bytes] = []
    new_rel: list[int] = []
    new_pos: list[int] = []
    new_time: list[bytes] = []
    headers: list[B.BatchHeader] = []
    pos = 0
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
        if h.max_timestamp_ms > max_ts_ms:
            max_ts_ms, max_rel = h.max_timestamp_ms, h.base_offset + h.last_offset_delta - seg_base
        if file_pos - last_index_pos >= index_interval_bytes:
            rel = h.base_offset + h.last_offset_delta - seg_base  # the batch's last offset
            new_index.append(INDEX_ENTRY.pack(rel, file_pos))
            new_rel.append(rel)
            new_pos.append(file_pos)
            last_index_pos = file_pos
            if max_ts_ms > last_time_ts_ms:
                new_time.append(TIME_ENTRY.pack(max_ts_ms, max_rel))
                last_time_ts_ms = max_ts_ms
        expected = h.next_offset
        epoch = h.leader_epoch
        headers.append(h)
        pos += h.size
    return AppendPlan(headers, expected, epoch, b"".join(new_index), new_rel, new_pos, last_index_pos,
                      b"".join(new_time), max_ts_ms, max_rel)
