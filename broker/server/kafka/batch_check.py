"""What a Kafka client's Produce must hold before its batch may enter the log.

A Kafka client builds its RecordBatch v2 itself (keys, values, headers,
timestamps, producer fields); metalog stores it as built. Everything that
reads the log later trusts what the append wrote: the controller decodes
each committed record, and a record it cannot parse is a fatal error on
every replica (the bytes are the same everywhere, CRC and all). So the
batch is checked whole here, once, before it is queued, as Kafka's
LogValidator does: exactly one v2 batch, its CRC, no compression (the
readers decode uncompressed records only), no transactional or control
batch, consistent producer fields, and every record well formed with its
offset delta equal to its index and a value (the controller's records are
values; Kafka's tombstone, a null value, has no meaning in a metadata log).

``check_batch`` answers with a ``PrebuiltProduce`` for the produce path or
with the Kafka error code and message to answer the partition with. It
walks the records over the frame's own bytes (memoryview indexing): no copy.
"""

from __future__ import annotations

import crc32c

from metalog.broker.server.produce import PrebuiltProduce
from metalog.protocol.errors import Errors
from metalog.storage.batch import CRC_START, HEADER, HEADER_SIZE, LOG_OVERHEAD, MAGIC

# Kafka error codes the data path answers that the broker's own table lacks.
UNSUPPORTED_COMPRESSION_TYPE = 76
INVALID_RECORD = 87

ATTR_COMPRESSION = 0x07
ATTR_TRANSACTIONAL = 0x10
ATTR_CONTROL = 0x20
SEQUENCE_MAX = 0x7FFFFFFF
_MAGIC_AT = 16

Problem = tuple[int, str]  # (Kafka error code, message)


def check_batch(records: bytes | memoryview | None) -> PrebuiltProduce | Problem:
    """The produce path's request for one partition's Records, or why not."""
    if records is None or len(records) == 0:
        return INVALID_RECORD, "a produce needs one record batch, got none"
    view = memoryview(records)
    size = len(view)
    if size < HEADER_SIZE:
        return Errors.CORRUPT_MESSAGE, f"{size} bytes are not a whole record batch"
    if view[_MAGIC_AT] != MAGIC:
        return INVALID_RECORD, f"record batch magic {view[_MAGIC_AT]}: Produce v3+ carries magic 2 only"
    (_base, length, _epoch, _magic, crc, attributes, last_delta, _first_ts, _max_ts, producer_id, producer_epoch,
     base_sequence, count) = HEADER.unpack_from(view, 0)
    if LOG_OVERHEAD + length > size:
        return Errors.CORRUPT_MESSAGE, f"the batch says {LOG_OVERHEAD + length} bytes, {size} were sent"
    if LOG_OVERHEAD + length < size:
        return INVALID_RECORD, "Produce v3+ carries exactly one record batch per partition"
    if crc32c.crc32c(view[CRC_START:]) != crc:
        return Errors.CORRUPT_MESSAGE, "record batch CRC mismatch"
    problem = _header_problem(attributes, last_delta, count, producer_id, producer_epoch, base_sequence)
    if problem is None:
        problem = _records_problem(view, count)
    if problem is not None:
        return problem
    return PrebuiltProduce(None, view, count, producer_id, producer_epoch, base_sequence)


def _header_problem(attributes: int, last_delta: int, count: int, producer_id: int, producer_epoch: int,
                    base_sequence: int) -> Problem | None:
    if attributes & ATTR_COMPRESSION:
        return UNSUPPORTED_COMPRESSION_TYPE, (f"compression codec {attributes & ATTR_COMPRESSION}: metalog "
                                              "stores uncompressed batches only (set compression.type=none)")
    if attributes & (ATTR_TRANSACTIONAL | ATTR_CONTROL):
        return INVALID_RECORD, "transactional and control batches are not accepted from clients"
    if count <= 0 or last_delta != count - 1:
        return INVALID_RECORD, f"{count} record(s) with last offset delta {last_delta}"
    if producer_id < 0:
        if base_sequence != -1:
            return INVALID_RECORD, f"base sequence {base_sequence} without a producer id"
    elif not (0 <= producer_epoch <= 0x7FFF and 0 <= base_sequence <= SEQUENCE_MAX - count + 1):
        return INVALID_RECORD, (f"producer {producer_id}: epoch {producer_epoch}, base sequence {base_sequence} "
                                f"out of range for {count} record(s)")
    return None


def _varint(view: memoryview, pos: int, end: int, bytes_max: int) -> tuple[int, int]:
    """Kafka's zig-zag varint at `pos`: (value, position after it)."""
    z = shift = 0
    for _ in range(bytes_max):
        if pos >= end:
            raise ValueError("a varint runs past its record")
        byte = view[pos]
        pos += 1
        z |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return (z >> 1) ^ -(z & 1), pos
        shift += 7
    raise ValueError(f"a varint longer than {bytes_max} bytes")


def _records_problem(view: memoryview, count: int) -> Problem | None:
    """Every record of the batch well formed (Kafka's DefaultRecord), in
    offset-delta order, each with a value, the last ending at the batch end.
    Per record, the varints of up to two bytes (lengths under 8 KiB, small
    deltas) are read inline, anything longer by _varint: this runs on every
    record a Kafka client produces."""
    end = len(view)
    pos = HEADER_SIZE
    index = 0
    varint = _varint
    try:
        for index in range(count):
            # length (the record's bytes after it)
            b = view[pos] if pos < end else 0xFF
            if b < 0x80:
                z, pos = b, pos + 1
            elif pos + 1 < end and view[pos + 1] < 0x80:
                z, pos = (b & 0x7F) | (view[pos + 1] << 7), pos + 2
            else:
                length, pos = varint(view, pos, end, 5)
                z = length << 1 if length >= 0 else 1
            length = (z >> 1) ^ -(z & 1)
            rend = pos + length
            if length <= 0 or rend > end:
                raise ValueError(f"length {length} runs past the batch")
            # attributes, timestamp delta (one byte, else a varlong), offset delta
            if pos + 1 < rend and view[pos + 1] < 0x80:
                pos += 2
            else:
                _ts_delta, pos = varint(view, pos + 1, rend, 10)
            b = view[pos] if pos < rend else 0xFF
            if b < 0x80:
                z, pos = b, pos + 1
            elif pos + 1 < rend and view[pos + 1] < 0x80:
                z, pos = (b & 0x7F) | (view[pos + 1] << 7), pos + 2
            else:
                delta, pos = varint(view, pos, rend, 5)
                z = delta << 1 if delta >= 0 else -1
            if z != index << 1:
                raise ValueError(f"offset delta {(z >> 1) ^ -(z & 1)}")
            pos = _field(view, pos, rend, "key", True)
            pos = _field(view, pos, rend, "value", False)
            if pos < rend and view[pos] == 0:
                pos += 1  # no headers
            else:
                pos = _headers(view, pos, rend)
            if pos != rend:
                raise ValueError(f"{rend - pos} bytes left inside it")
        if pos != end:
            raise ValueError(f"{end - pos} bytes after the last record")
    except (ValueError, IndexError) as exc:  # (IndexError: a bound check this walk missed, still a bad record)
        return INVALID_RECORD, f"record {index}: {exc}"
    return None


def _headers(view: memoryview, pos: int, rend: int) -> int:
    headers, pos = _varint(view, pos, rend, 5)
    if headers < 0:
        raise ValueError(f"header count {headers}")
    for _ in range(headers):
        pos = _field(view, pos, rend, "header key", False)
        pos = _field(view, pos, rend, "header value", True)
    return pos


def _field(view: memoryview, pos: int, rend: int, what: str, nullable: bool) -> int:
    """Skip a length-prefixed field (-1: null); the position after it."""
    b = view[pos] if pos < rend else 0xFF
    if b < 0x80:
        z, pos = b, pos + 1
    elif pos + 1 < rend and view[pos + 1] < 0x80:
        z, pos = (b & 0x7F) | (view[pos + 1] << 7), pos + 2
    else:
        n, pos = _varint(view, pos, rend, 5)
        z = n << 1 if n >= 0 else (-n << 1) - 1
    if z & 1:  # negative: null (-1) or bad
        if z != 1 or not nullable:
            raise ValueError(f"a null {what}" if z == 1 else f"bad {what} length {(z >> 1) ^ -1}")
        return pos
    pos += z >> 1
    if pos > rend:
        raise ValueError(f"{what} of {z >> 1} bytes runs past its record")
    return pos
