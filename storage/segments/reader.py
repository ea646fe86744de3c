"""Reading whole batches across segment boundaries: the byte ranges Fetch
serves (CRC-checked, so damaged bytes never leave the log) and the header
walks over the whole log. Owner thread only, like every read of the table.
"""

from __future__ import annotations

import os
from typing import Iterator

from metalog.storage import batch as B
from metalog.storage.errors import CorruptionReport
from metalog.storage.segments.segment import BatchInfo, Segment
from metalog.storage.segments.segment_table import SegmentTable


def read_range(table: SegmentTable, start_offset: int, end_offset: int, bytes_max: int, verify: bool) -> bytes:
    """Whole batches from the one containing start_offset, none with an
    offset >= end_offset (which the caller clamped to the log end), at most
    bytes_max but always at least one batch when one qualifies."""
    segments = table.segments
    k = table.index_for(start_offset)
    parts: list[bytes] = []
    total = 0
    offset = start_offset
    while k < len(segments):
        seg = segments[k]
        first_pos = end_pos = -1  # nothing of this segment yet
        stop = False
        for pos, _base, size, _epoch, nxt, _attrs in seg.batches_from(offset):
            if first_pos < 0:
                first_pos = end_pos = pos
            if nxt > end_offset or (total + size > bytes_max and total):
                stop = True
                break
            total += size
            end_pos = pos + size
            offset = nxt
        if end_pos > first_pos:
            data = os.pread(seg.fd, end_pos - first_pos, first_pos)
            if verify:
                verify_read(seg, data, first_pos)
            parts.append(data)
        if stop or offset >= end_offset:
            break
        k += 1
    if len(parts) == 1:
        return parts[0]
    return b"".join(parts)


def verify_read(seg: Segment, data: bytes, file_pos: int) -> None:
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


def iter_headers(table: SegmentTable, offset: int) -> Iterator[BatchInfo]:
    """Header of every batch from the one containing `offset` (below the log
    end) to the log end. Reads headers only."""
    k = table.index_for(offset)
    for seg in table.segments[k:]:
        found = seg.locate(offset) if seg.base_offset <= offset else None
        pos = found[0] if found else 0
        for p, base, size, epoch, nxt, attrs in seg.walk(pos, seg.size_bytes):
            yield BatchInfo(base, nxt, epoch, size, seg.base_offset, p, bool(attrs & B.ATTR_CONTROL))
