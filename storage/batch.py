"""The record batch: the unit the log stores, replicates and checksums.

The header is Kafka's RecordBatch v2 layout (61 bytes, big-endian)::

    base_offset i64 | length i32 | leader_epoch i32 | magic i8 (=2) | crc u32 |
    attributes i16 | last_offset_delta i32 | first_timestamp_ms i64 |
    max_timestamp_ms i64 | producer_id i64 | producer_epoch i16 |
    base_sequence i32 | records_count i32

``length`` counts the bytes after the length field (as in Kafka), so a batch
occupies ``12 + length`` bytes. ``crc`` is CRC-32C over everything from
``attributes`` to the end of the batch. Records are our own simple framing,
``u32 length + value`` each: metadata records are opaque bytes here (the
controller gives them meaning).

Pure functions only: the broker, the quorum core, the simulator and the Spark
job all decode with this module.
"""

from __future__ import annotations

import struct
from typing import Iterator, NamedTuple, Sequence

import crc32c

from storage.errors import CorruptionReport

MAGIC = 2
HEADER = struct.Struct(">qiibIhiqqqhii")
HEADER_SIZE = HEADER.size  # 61
LOG_OVERHEAD = 12  # base_offset + length: the bytes not counted by `length`
CRC_OFFSET = 17  # position of the crc field
CRC_START = 21  # the crc covers attributes .. end
ATTR_CONTROL = 0x20  # Kafka's isControlBatch bit
RECORD_LEN = struct.Struct(">I")
MAX_BATCH_BYTES = 64 << 20  # refuse to believe a length beyond this


class CorruptBatchError(Exception):
    """A batch whose bytes cannot be trusted: bad length, magic or CRC."""

    def __init__(self, message: str, position: int, base_offset: int | None = None, *,
                 leader_epoch: int | None = None, expected_crc: int | None = None,
                 actual_crc: int | None = None, report: CorruptionReport | None = None):
        super().__init__(message)
        self.position = position
        self.base_offset = base_offset
        self.leader_epoch = leader_epoch
        self.expected_crc = expected_crc
        self.actual_crc = actual_crc
        # Where it was found: the log sets a report naming its file; bytes
        # decoded from memory get one with an empty path.
        self.report = report if report is not None else CorruptionReport(
            "", position, base_offset, leader_epoch, expected_crc, actual_crc, message)


class BatchHeader(NamedTuple):
    base_offset: int
    length: int
    leader_epoch: int
    magic: int
    crc: int
    attributes: int
    last_offset_delta: int
    first_timestamp_ms: int
    max_timestamp_ms: int
    producer_id: int
    producer_epoch: int
    base_sequence: int
    records_count: int

    @property
    def size(self) -> int:
        """Total bytes the batch occupies."""
        return LOG_OVERHEAD + self.length

    @property
    def last_offset(self) -> int:
        return self.base_offset + self.last_offset_delta

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.last_offset_delta + 1

    @property
    def is_control(self) -> bool:
        return bool(self.attributes & ATTR_CONTROL)


def encode_batch(
    base_offset: int,
    leader_epoch: int,
    records: Sequence[bytes],
    timestamp_ms: int,
    is_control: bool = False,
    producer_id: int = -1,
    producer_epoch: int = -1,
    base_sequence: int = -1,
) -> bytes:
    """Encode one batch holding `records` at offsets base_offset.. .

    The producer fields are Kafka's (KIP-98): -1 for a batch of no idempotent
    producer; else the producer's id, epoch and the sequence of its first record."""
    assert records, "a batch holds at least one record"
    assert base_offset >= 0 and leader_epoch >= 0
    assert (producer_id < 0) == (base_sequence < 0), "an idempotent batch has both id and sequence"
    parts = []
    for value in records:
        parts.append(RECORD_LEN.pack(len(value)))
        parts.append(value)
    body = b"".join(parts)
    n = len(records)
    length = HEADER_SIZE - LOG_OVERHEAD + len(body)
    header = bytearray(
        HEADER.pack(
            base_offset, length, leader_epoch, MAGIC, 0,
            ATTR_CONTROL if is_control else 0, n - 1, timestamp_ms, timestamp_ms,
            producer_id, producer_epoch, base_sequence, n,
        )
    )
    crc = crc32c.crc32c(body, crc32c.crc32c(bytes(header[CRC_START:])))
    struct.pack_into(">I", header, CRC_OFFSET, crc)
    return bytes(header) + body


def decode_header(buf: bytes | memoryview, pos: int = 0) -> BatchHeader:
    """Parse the header at `pos`. The caller checks that HEADER_SIZE bytes exist."""
    h = BatchHeader(*HEADER.unpack_from(buf, pos))
    if h.magic != MAGIC:
        raise CorruptBatchError(f"bad magic {h.magic} (expected {MAGIC})", pos, h.base_offset)
    if h.length < HEADER_SIZE - LOG_OVERHEAD or h.length > MAX_BATCH_BYTES:
        raise CorruptBatchError(f"bad batch length {h.length}", pos, h.base_offset)
    if h.records_count < 1 or h.last_offset_delta != h.records_count - 1:
        raise CorruptBatchError(
            f"bad record count {h.records_count} / last offset delta {h.last_offset_delta}",
            pos, h.base_offset,
        )
    return h


def verify_crc(buf: bytes | memoryview, pos: int, header: BatchHeader) -> None:
    end = pos + header.size
    actual = crc32c.crc32c(memoryview(buf)[pos + CRC_START:end])
    if actual != header.crc:
        raise CorruptBatchError(
            f"CRC mismatch: stored {header.crc:#010x}, computed {actual:#010x}",
            pos, header.base_offset, leader_epoch=header.leader_epoch,
            expected_crc=header.crc, actual_crc=actual,
        )


def iter_batches(
    buf: bytes | memoryview, verify: bool = True, start: int = 0
) -> Iterator[tuple[int, BatchHeader]]:
    """Yield (position, header) of each whole batch in `buf`.

    Stops silently at an incomplete tail (fewer bytes than a header or than the
    batch's length): callers that must see the tail compare the last position
    they got with len(buf). Raises CorruptBatchError on a bad header or CRC.
    """
    view = memoryview(buf)
    pos = start
    n = len(view)
    while pos + HEADER_SIZE <= n:
        h = decode_header(view, pos)
        if pos + h.size > n:
            return
        if verify:
            verify_crc(view, pos, h)
        yield pos, h
        pos += h.size


def decode_records(batch: bytes | memoryview, header: BatchHeader | None = None) -> list[bytes]:
    """The record values of one whole batch (starting at position 0 of `batch`)."""
    view = memoryview(batch)
    h = header or decode_header(view, 0)
    out: list[bytes] = []
    pos = HEADER_SIZE
    end = h.size
    for _ in range(h.records_count):
        if pos + 4 > end:
            raise CorruptBatchError("record runs past the batch end", pos, h.base_offset)
        (ln,) = RECORD_LEN.unpack_from(view, pos)
        pos += 4
        if pos + ln > end:
            raise CorruptBatchError("record runs past the batch end", pos, h.base_offset)
        out.append(bytes(view[pos:pos + ln]))
        pos += ln
    if pos != end:
        raise CorruptBatchError("trailing bytes after the last record", pos, h.base_offset)
    return out
