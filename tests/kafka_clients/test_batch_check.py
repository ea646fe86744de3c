"""A Kafka client's RecordBatch, as kafka-python's own builder makes it (code
we did not write), judged by the Kafka data path's check before it may enter
the log (metalog.broker.server.kafka.batch_check): accepted as built, or
refused with the code Kafka answers. No cluster: milliseconds."""

from __future__ import annotations

import random
import struct

import crc32c
import pytest
from kafka.record.default_records import DefaultRecordBatchBuilder

from metalog.broker.server.kafka.batch_check import INVALID_RECORD, UNSUPPORTED_COMPRESSION_TYPE, check_batch
from metalog.broker.server.produce import PrebuiltProduce
from metalog.protocol.errors import Errors
from metalog.storage.batch import CorruptBatchError, decode_full_records, decode_header

GZIP = 1


def kafka_batch(records, producer=(-1, -1, -1), compression=0) -> bytes:
    pid, epoch, seq = producer
    builder = DefaultRecordBatchBuilder(magic=2, compression_type=compression, is_transactional=False,
                                        producer_id=pid, producer_epoch=epoch, base_sequence=seq, batch_size=1 << 20)
    for i, (key, value, headers) in enumerate(records):
        builder.append(i, timestamp=1_700_000_000_000 + i, key=key, value=value, headers=headers)
    return bytes(builder.build())


RECORDS = [(b"k0", b"v0", [("h", b"x")]), (None, b"v1", []), (b"k2", b"", [("a", b"1"), ("b", None)])]


def test_a_client_batch_is_accepted_as_built():
    data = kafka_batch(RECORDS, producer=(7, 2, 40))
    got = check_batch(memoryview(data))
    assert isinstance(got, PrebuiltProduce)
    assert (got.record_count, got.producer_id, got.producer_epoch, got.base_sequence) == (3, 7, 2, 40)
    assert bytes(got.batch) == data  # the client's bytes, not a re-encoding
    records = decode_full_records(data, decode_header(data, 0))
    assert [(r.key, r.value, r.headers) for r in records] == [
        (b"k0", b"v0", ((b"h", b"x"),)), (None, b"v1", ()), (b"k2", b"", ((b"a", b"1"), (b"b", None)))]


def test_a_flipped_crc_is_corrupt_message():
    data = bytearray(kafka_batch(RECORDS))
    data[17] ^= 0x01
    assert check_batch(bytes(data))[0] == Errors.CORRUPT_MESSAGE


def test_a_flipped_record_byte_is_corrupt_message():
    data = bytearray(kafka_batch(RECORDS))
    data[-2] ^= 0x40
    assert check_batch(bytes(data))[0] == Errors.CORRUPT_MESSAGE


@pytest.mark.parametrize("cut", [1, 30])
def test_a_truncated_batch_is_corrupt_message(cut):
    data = kafka_batch(RECORDS)
    assert check_batch(data[:-cut])[0] == Errors.CORRUPT_MESSAGE


def test_two_batches_in_one_partition_are_refused():
    data = kafka_batch(RECORDS)
    assert check_batch(data + data)[0] == INVALID_RECORD


def test_compression_is_refused_with_kafkas_code():
    # (kafka-python sends a batch uncompressed when gzip would not shrink it)
    data = kafka_batch([(None, b"metadata " * 200, [])], compression=GZIP)
    assert decode_header(data, 0).attributes & 0x07 == GZIP
    assert check_batch(data)[0] == UNSUPPORTED_COMPRESSION_TYPE


def test_a_null_value_is_refused_the_controller_reads_values():
    code, message = check_batch(kafka_batch([(b"k", None, [])]))
    assert (code, "null value" in message) == (INVALID_RECORD, True)


def test_nothing_to_produce_is_refused():
    assert check_batch(None)[0] == INVALID_RECORD
    assert check_batch(b"")[0] == INVALID_RECORD


def _with_crc(data: bytearray) -> bytes:
    """`data` with its CRC recomputed: damage the CRC cannot catch (a client's bug)."""
    struct.pack_into(">I", data, 17, crc32c.crc32c(bytes(data[21:])))
    return bytes(data)


def test_records_that_do_not_parse_are_invalid_record_even_with_a_good_crc():
    data = bytearray(kafka_batch([(None, b"v0", []), (None, b"v1", [])]))
    assert isinstance(check_batch(_with_crc(data)), PrebuiltProduce)
    twice = bytearray(data)
    second = 61 + 1 + data[61] // 2  # the second record starts after the first (one-byte length)
    twice[second + 3] = 0  # its offset delta 1 -> 0 (zig-zag 2 -> 0)
    code, message = check_batch(_with_crc(twice))
    assert (code, "offset delta 0" in message) == (INVALID_RECORD, True)
    longer = bytearray(data)
    longer[61] += 2  # the first record's length past its bytes
    assert check_batch(_with_crc(longer))[0] == INVALID_RECORD


def test_the_check_accepts_exactly_what_our_reader_parses():
    """Bytes changed at random inside the records (CRC recomputed, as a buggy
    client would send them): the check accepts a batch exactly when our own
    storage reader parses every record with a value -- what the controller
    needs of every committed record."""
    rng = random.Random(32)
    base = bytearray(kafka_batch(RECORDS + [(b"k" * 70, b"v" * 200, [("x" * 65, b"y" * 130)])]))
    accepted = refused = 0
    for _ in range(3000):
        data = bytearray(base)
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(61, len(data))] = rng.choice((0, 1, 2, 0x7F, 0x80, 0xFF, rng.randrange(256)))
        data = bytearray(_with_crc(data))
        try:
            reader_ok = all(r.value is not None for r in decode_full_records(bytes(data), decode_header(data, 0)))
        except CorruptBatchError:
            reader_ok = False
        got = check_batch(bytes(data))
        assert isinstance(got, PrebuiltProduce) == reader_ok, (bytes(data).hex(), got)
        accepted += reader_ok
        refused += not reader_ok
    assert accepted > 500 and refused > 200  # both sides met
