"""The record batch: the unit the log stores, replicates and checksums.

The header is Kafka's RecordBatch v2 layout (61 bytes, big-endian)::

    base_offset i64 | length i32 | leader_epoch i32 | magic i8 (=2) | crc u32 |
    attributes i16 | last_offset_delta i32 | first_timestamp_ms i64 |
    max_timestamp_ms i64 | producer_id i64 | producer_epoch i16 |
    base_sequence i32 | records_count i32

``length`` counts the bytes after the length field (as in Kafka), so a batch
occupies ``12 + length`` bytes. ``crc`` is CRC-32C over everything from
``attributes`` to the end of the batch.

The records after the header are Kafka's v2 records (DefaultRecord), with
zig-zag varints (``vi``, ``vl``)::

    length vi | attributes i8 (=0) | timestamp_delta vl | offset_delta vi |
    key_length vi (-1 = null) | key | value_length vi | value |
    header_count vi | headers (key_length vi, key, value_length vi, value)*

``length`` counts the bytes after itself. We write timestamp delta 0 (a batch
has one timestamp), offset delta = the record's index, no headers. A data
record has a null key and its value is a metadata record (opaque here: the
controller gives it meaning). A control record (batch control bit set) has
Kafka's 4-byte key ``version i16 | type i16`` and the record body as value;
in memory, everywhere above this module, a control record is that key
followed by its value (``metalog.storage.control_records`` builds and parses it):
encode_batch splits it at byte 4, decode_records joins it again.

Pure functions only: the broker, the quorum core, the simulator and the Spark
job all decode with this module.
"""

from __future__ import annotations

import mmap
import struct
from typing import Iterator, NamedTuple, Sequence

import crc32c

from metalog.protocol.invariants import InvariantViolation
from metalog.storage.errors import CorruptionReport

MAGIC = 2
# What the header readers take: any bytes-like object (a log read, an mmap of a segment).
Buffer = bytes | bytearray | memoryview | mmap.mmap

HEADER = struct.Struct(">qiibIhiqqqhii")
HEADER_SIZE = HEADER.size  # 61
LOG_OVERHEAD = 12  # base_offset + length: the bytes not counted by `length`
CRC_OFFSET = 17  # position of the crc field
CRC_START = 21  # the crc covers attributes .. end
ATTR_CONTROL = 0x20  # Kafka's isControlBatch bit
MAX_BATCH_BYTES = 64 << 20  # refuse to believe a length beyond this
CONTROL_KEY_SIZE = 4  # a control record's key: version i16 | type i16


def _zigzag_varint(n: int) -> bytes:
    """Kafka's signed varint (zig-zag, then 7 bits per byte, low first)."""
    z = (n << 1) ^ (n >> 63)
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


# Per-record cost matters (the leader encodes, the Spark job decodes millions
# of records), so the varints of small numbers are looked up, not computed.
_TABLE_N = 1 << 14
_VI = tuple(_zigzag_varint(i) for i in range(_TABLE_N))
# What a data record at index i holds between its length and its value
# length: attributes 0, timestamp delta 0, offset delta i, null key.
_DATA_MID = tuple(b"\x00\x00" + _VI[i] + b"\x01" for i in range(_TABLE_N))
_CONTROL_KEY_LEN = _zigzag_varint(CONTROL_KEY_SIZE)
_NO_HEADERS = b"\x00"


def _vi(n: int) -> bytes:
    return _VI[n] if 0 <= n < _TABLE_N else _zigzag_varint(n)


def data_mid(index: int) -> bytes:
    """The bytes between a common-shape data record's length and its value
    length at offset delta `index` (see _DATA_MID)."""
    return _DATA_MID[index] if index < _TABLE_N else b"\x00\x00" + _zigzag_varint(index) + b"\x01"


def _read_varint(buf: bytes, pos: int, end: int, bytes_max: int = 5) -> tuple[int, int]:
    """(value, new position) of the zig-zag varint at `pos`; ValueError when it
    runs past `end` or is longer than `bytes_max` (5 for an int, 10 for a long)."""
    z = shift = 0
    for i in range(bytes_max):
        if pos >= end:
            raise ValueError("varint runs past the record end")
        byte = buf[pos]
        pos += 1
        z |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return (z >> 1) ^ -(z & 1), pos
        shift += 7
    raise ValueError(f"varint longer than {bytes_max} bytes")


class Record(NamedTuple):
    """One v2 record, every field (what `metalog dump` and the checks read)."""

    offset_delta: int
    timestamp_delta: int
    attributes: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[bytes, bytes | None], ...]


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
    if not records or base_offset < 0 or leader_epoch < 0 or (producer_id < 0) != (base_sequence < 0):
        raise InvariantViolation(  # one test on the encode path; the message says which rule broke
            f"encode_batch: {len(records)} records (at least 1), base offset {base_offset} and leader epoch "
            f"{leader_epoch} (both >= 0), producer id {producer_id} and base sequence {base_sequence} "
            "(an idempotent batch has both)")
    parts: list[bytes] = []
    add = parts.extend
    n = len(records)
    if is_control:
        for i, rec in enumerate(records):
            if len(rec) < CONTROL_KEY_SIZE:
                raise InvariantViolation("a control record starts with its 4-byte key")
            value_len = _vi(len(rec) - CONTROL_KEY_SIZE)
            mid = b"\x00\x00" + _vi(i)
            add((_vi(len(mid) + 1 + len(rec) + len(value_len) + 1), mid, _CONTROL_KEY_LEN,
                 rec[:CONTROL_KEY_SIZE], value_len, rec[CONTROL_KEY_SIZE:], _NO_HEADERS))
    elif n <= _TABLE_N:
        vi, mids = _VI, _DATA_MID
        for i, value in enumerate(records):
            ln = len(value)
            value_len = vi[ln] if ln < _TABLE_N else _zigzag_varint(ln)
            mid = mids[i]
            rlen = len(mid) + len(value_len) + ln + 1
            add((vi[rlen] if rlen < _TABLE_N else _zigzag_varint(rlen), mid, value_len, value, _NO_HEADERS))
    else:
        for i, value in enumerate(records):
            mid = b"\x00\x00" + _vi(i) + b"\x01"
            value_len = _vi(len(value))
            add((_vi(len(mid) + len(value_len) + len(value) + 1), mid, value_len, value, _NO_HEADERS))
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


_unpack_header = HEADER.unpack_from
_new_tuple = tuple.__new__
_LENGTH_MIN = HEADER_SIZE - LOG_OVERHEAD


def _refused(t: tuple[int, ...]) -> bool:
    """The header rules, on an unpacked header tuple (base_offset, length,
    leader_epoch, magic, crc, attributes, last_offset_delta, timestamps (2),
    producer id/epoch, base sequence, count): magic, length, record count."""
    return t[3] != MAGIC or not _LENGTH_MIN <= t[1] <= MAX_BATCH_BYTES or t[12] < 1 or t[6] != t[12] - 1


def decode_header(buf: Buffer, pos: int = 0) -> BatchHeader:
    """Parse the header at `pos`. The caller checks that HEADER_SIZE bytes exist.

    Every batch a node appends, serves, applies or checks passes here, at
    1000 clients one per request several times over: the fields are checked
    on the unpacked tuple and the NamedTuple made from it without the
    generated __new__ (about 630 -> 380 ns a header here)."""
    t = _unpack_header(buf, pos)
    if _refused(t):
        h = BatchHeader(*t)
        if h.magic != MAGIC:
            raise CorruptBatchError(f"bad magic {h.magic} (expected {MAGIC})", pos, h.base_offset)
        if h.length < _LENGTH_MIN or h.length > MAX_BATCH_BYTES:
            raise CorruptBatchError(f"bad batch length {h.length}", pos, h.base_offset)
        raise CorruptBatchError(
            f"bad record count {h.records_count} / last offset delta {h.last_offset_delta}",
            pos, h.base_offset,
        )
    return _new_tuple(BatchHeader, t)


def verify_crc(buf: Buffer, pos: int, header: BatchHeader) -> None:
    end = pos + header.size
    actual = crc32c.crc32c(memoryview(buf)[pos + CRC_START:end])
    if actual != header.crc:
        raise CorruptBatchError(
            f"CRC mismatch: stored {header.crc:#010x}, computed {actual:#010x}",
            pos, header.base_offset, leader_epoch=header.leader_epoch,
            expected_crc=header.crc, actual_crc=actual,
        )


def batches_sound(buf: bytes | memoryview) -> bool:
    """True if `buf` is whole batches, each header sound (decode_header's
    rules) and each CRC right: verify_crc over every batch, without building
    the headers (about 0.55 us a batch against 0.97). False says only that
    something is wrong: decode_header and verify_crc say what."""
    view = memoryview(buf)
    n = len(view)
    pos = 0
    while pos < n:
        if n - pos < HEADER_SIZE:
            return False
        t = _unpack_header(view, pos)
        end = pos + LOG_OVERHEAD + t[1]
        if _refused(t) or end > n or crc32c.crc32c(view[pos + CRC_START:end]) != t[4]:
            return False
        pos = end
    return True


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


class BatchStream:
    """Whole batches out of bytes that arrive in pieces cut anywhere (a
    snapshot download's chunks): ``feed`` yields the batches each piece
    completes and keeps the unfinished tail (at most one batch) for the next.
    `position` is the stream position of the tail's first byte: every batch
    before it has been yielded."""

    __slots__ = ("verify", "position", "_tail")

    def __init__(self, verify: bool = True) -> None:
        self.verify = verify  # check each batch's CRC
        self.position = 0
        self._tail = b""

    def feed(self, data: bytes | memoryview) -> Iterator[tuple[int, BatchHeader, memoryview]]:
        """(stream position, header, bytes) of each batch `data` completes.
        Raises CorruptBatchError, positioned in the stream, at a bad header
        or CRC (the batches before it have been yielded)."""
        buf = self._tail + bytes(data)
        base = self.position
        end = 0
        try:
            for pos, h in iter_batches(buf, verify=self.verify):
                end = pos + h.size
                yield base + pos, h, memoryview(buf)[pos:end]
        except CorruptBatchError as exc:
            raise CorruptBatchError(str(exc), base + exc.position, exc.base_offset, leader_epoch=exc.leader_epoch,
                                    expected_crc=exc.expected_crc, actual_crc=exc.actual_crc) from None
        finally:
            self._tail = buf[end:]
            self.position = base + end


def decode_records(batch: bytes | memoryview, header: BatchHeader | None = None) -> list[bytes]:
    """The records of one whole batch (starting at position 0 of `batch`): the
    values of a data batch; key + value of each record of a control batch.

    Raises CorruptBatchError when a record does not parse, runs past the batch
    end, or its offset delta is not its index (offsets are derived from it)."""
    view = memoryview(batch)
    h = header or decode_header(view, 0)
    data = bytes(view[HEADER_SIZE:h.size])
    end = len(data)
    pos = 0
    if not h.attributes & ATTR_CONTROL:
        out = [b""] * h.records_count
        for i in range(h.records_count):
            out[i], pos = next_value(data, pos, end, i, h)
    else:
        out = []
        for i in range(h.records_count):
            if pos >= end:
                raise CorruptBatchError(f"record {i} runs past the batch end", HEADER_SIZE + pos, h.base_offset)
            rec, pos = _parse_record(data, pos, end, i, h)
            if rec.key is None or len(rec.key) != CONTROL_KEY_SIZE or rec.value is None:
                raise CorruptBatchError(f"control record {i} has no 4-byte key or no value",
                                        HEADER_SIZE + pos, h.base_offset)
            out.append(rec.key + rec.value)
    if pos != end:
        raise CorruptBatchError("trailing bytes after the last record", HEADER_SIZE + pos, h.base_offset)
    return out


def decode_full_records(batch: bytes | memoryview, header: BatchHeader | None = None) -> list[Record]:
    """Every field of every record of one whole batch (for dump and checks)."""
    view = memoryview(batch)
    h = header or decode_header(view, 0)
    data = bytes(view[HEADER_SIZE:h.size])
    out = []
    pos = 0
    for i in range(h.records_count):
        rec, pos = _parse_record(data, pos, len(data), i, h)
        out.append(rec)
    if pos != len(data):
        raise CorruptBatchError("trailing bytes after the last record", HEADER_SIZE + pos, h.base_offset)
    return out


def next_value(data: bytes, pos: int, end: int, index: int, h: BatchHeader) -> tuple[bytes, int]:
    """One data record's value at `pos` of a batch's record bytes `data`:
    (value, position after the record), as decode_records reads it (the
    common shape -- attributes and timestamp delta 0, offset delta `index`,
    null key, no headers, lengths under two varint bytes -- without the
    general parser). For readers that take a batch's records piecewise."""
    if pos >= end:
        raise CorruptBatchError(f"record {index} runs past the batch end", HEADER_SIZE + pos, h.base_offset)
    try:
        z = data[pos]
        if z < 0x80:
            p = pos + 1
        else:
            z = (z & 0x7F) | (data[pos + 1] << 7)
            p = pos + 2
        mid = _DATA_MID[index] if index < _TABLE_N else data_mid(index)
        q = p + len(mid)
        v = data[q]
        if v < 0x80:
            q += 1
        else:
            v = (v & 0x7F) | (data[q + 1] << 7)
            q += 2
        rend = p + (z >> 1)
        if not (z | v) & 1 and z < 0x4000 and v < 0x4000 and q + (v >> 1) + 1 == rend <= end \
                and not data[rend - 1] and data[p:p + len(mid)] == mid:
            return data[q:rend - 1], rend
    except IndexError:
        pass  # the general parser says where it ends
    rec, pos = _parse_record(data, pos, end, index, h)
    if rec.value is None:
        raise CorruptBatchError(f"record {index} has a null value", HEADER_SIZE + pos, h.base_offset)
    return rec.value, pos


def _parse_record(data: bytes, pos: int, end: int, index: int, h: BatchHeader) -> tuple[Record, int]:
    """The general v2 record parser: (record, position after it)."""
    start = pos
    try:
        length, pos = _read_varint(data, pos, end)
        rend = pos + length
        if length < 0 or rend > end:
            raise ValueError(f"length {length} runs past the batch end")
        if pos >= rend:
            raise ValueError("record ends before its attributes")
        attributes = data[pos]
        pos += 1
        ts_delta, pos = _read_varint(data, pos, rend, 10)
        offset_delta, pos = _read_varint(data, pos, rend)
        if offset_delta != index:
            raise ValueError(f"offset delta {offset_delta}, expected {index}")
        fields = []
        for _ in range(2):  # key, value
            n, pos = _read_varint(data, pos, rend)
            if n < -1 or pos + max(n, 0) > rend:
                raise ValueError(f"bad field length {n}")
            fields.append(None if n < 0 else data[pos:pos + n])
            pos += max(n, 0)
        count, pos = _read_varint(data, pos, rend)
        if count < 0:
            raise ValueError(f"negative header count {count}")
        headers = []
        for _ in range(count):
            kn, pos = _read_varint(data, pos, rend)
            if kn < 0 or pos + kn > rend:
                raise ValueError(f"bad header key length {kn}")
            hkey = data[pos:pos + kn]
            pos += kn
            vn, pos = _read_varint(data, pos, rend)
            if vn < -1 or pos + max(vn, 0) > rend:
                raise ValueError(f"bad header value length {vn}")
            headers.append((hkey, None if vn < 0 else data[pos:pos + vn]))
            pos += max(vn, 0)
        if pos != rend:
            raise ValueError(f"{rend - pos} bytes left inside the record")
    except (ValueError, IndexError) as exc:
        raise CorruptBatchError(f"record {index}: {exc}", HEADER_SIZE + start, h.base_offset) from None
    return Record(offset_delta, ts_delta, attributes, fields[0], fields[1], tuple(headers)), pos
