"""A Kafka client's RecordBatch, as kafka-python's own builder makes it (code
we did not write), judged by the Kafka data path's check before it may enter
the log (metalog.broker.server.kafka.batch_check): accepted as built, or
refused with the code Kafka answers. No cluster: milliseconds."""

from __future__ import annotations

import pytest
from kafka.record.default_records import DefaultRecordBatchBuilder

from metalog.broker.server.kafka.batch_check import INVALID_RECORD, UNSUPPORTED_COMPRESSION_TYPE, check_batch
from metalog.broker.server.produce import PrebuiltProduce
from metalog.protocol.errors import Errors
from metalog.storage.batch import decode_full_records, decode_header

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
