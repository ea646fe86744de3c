"""Verifying scans over the bytes of a segment: every batch's header, length,
contiguous offsets, monotonic leader epochs and CRC-32C, stopping at the
first problem and saying where; the search for a valid batch after damage
(which tells a torn tail from corruption); and the CorruptionReport for a
damaged position. Pure functions over buffers: no files, no state.

CRC coverage: as in Kafka, the CRC covers ``attributes .. end``; the base
offset is checked by offset continuity, the length by the CRC range and the
magic byte directly. A flipped leader-epoch bit is caught only when it breaks
the epochs' monotonic order.
"""

from __future__ import annotations

import mmap
import struct
from typing import NamedTuple

import crc32c

from metalog.storage import batch as B
from metalog.storage.errors import CorruptionReport
from metalog.storage.segments.layout import MAGIC_BYTE, MAGIC_POS

Buffer = bytes | memoryview | mmap.mmap


class ScanResult(NamedTuple):
    end_pos: int  # position after the last good batch
    next_offset: int
    last_epoch: int
    index_rel: list[int]
    index_pos: list[int]
    last_index_pos: int
    time_ts_ms: list[int]  # the .timeindex entries
    time_rel: list[int]
    max_ts_ms: int  # the largest batch max timestamp scanned, -1 if none
    max_rel: int  # relative (last) offset of the batch holding it
    error_pos: int | None  # where the first bad byte run starts, None if clean
    error: str | None


def scan(view: memoryview | bytes, start_offset: int, prev_epoch: int, seg_base: int,
         index_interval_bytes: int, max_ts_ms: int = -1, max_rel: int = 0) -> ScanResult:
    """Verify batches (length, offsets, epoch order, CRC) from the start to
    the end of `view`; stop at the first problem and say where. Index and
    time-index entries are computed as append() would have written them."""
    size = len(view)
    pos, expected, epoch = 0, start_offset, prev_epoch
    last_index_pos = 0
    rel: list[int] = []
    positions: list[int] = []
    time_ts_ms: list[int] = []
    time_rel: list[int] = []
    last_time_ts_ms = max_ts_ms  # a tail scan continues after an entry of this timestamp
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
        if h.max_timestamp_ms > max_ts_ms:
            max_ts_ms, max_rel = h.max_timestamp_ms, h.base_offset + h.last_offset_delta - seg_base
        if pos - last_index_pos >= index_interval_bytes:
            rel.append(h.base_offset + h.last_offset_delta - seg_base)
            positions.append(pos)
            last_index_pos = pos
            if max_ts_ms > last_time_ts_ms:
                time_ts_ms.append(max_ts_ms)
                time_rel.append(max_rel)
                last_time_ts_ms = max_ts_ms
        expected = h.next_offset
        epoch = h.leader_epoch
        pos += h.size
    return ScanResult(pos, expected, epoch, rel, positions, last_index_pos, time_ts_ms, time_rel,
                      max_ts_ms, max_rel, pos if error else None, error)


def valid_batch_after(view: mmap.mmap | bytes, pos: int, expected: int) -> int | None:
    """Position of a whole, CRC-valid batch with base offset >= expected
    somewhere after `pos`, else None. Candidates are found by the magic
    byte, so a zero-filled torn tail costs one C-level search."""
    size = len(view)
    search = pos + 1 + MAGIC_POS
    while True:
        i = view.find(MAGIC_BYTE, search)
        if i < 0:
            return None
        search = i + 1
        q = i - MAGIC_POS
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


def corruption_report_at(path: str, buf: Buffer | None, pos: int, expected_offset: int,
                         reason: str) -> CorruptionReport:
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
