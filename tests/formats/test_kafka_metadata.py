"""Kafka's ApiMessageAndVersion framing and the first metadata record bodies,
byte for byte from Kafka's schemas (FenceBrokerRecord and UnfenceBrokerRecord
v0: Id int32, Epoch int64, not flexible; NoOpRecord v0: flexible, no fields)."""

from __future__ import annotations

import pytest

from storage import metadata_records as mr
from storage.kafka_metadata import KafkaMetadataError, decode_frame, decode_kafka_record, encode_kafka_record


@pytest.mark.parametrize("rec, golden", [
    (mr.FenceBroker(3, 7), "01" "07" "00" "00000003" "0000000000000007"),
    (mr.UnfenceBroker(300, 2**40), "01" "08" "00" "0000012c" "0000010000000000"),
    (mr.NoOp(), "01" "14" "00" "00"),
])
def test_golden_bytes(rec, golden):
    value = encode_kafka_record(rec)
    assert value.hex() == golden
    assert decode_kafka_record(value) == rec


def test_an_api_key_past_127_takes_two_varint_bytes():
    assert decode_frame(bytes.fromhex("01 e807 00") + b"x") == (1000, 0, b"x")


@pytest.mark.parametrize("value, why", [
    (bytes.fromhex("02 07 00"), "frame version 2 \\(expected 1\\)"),
    (bytes.fromhex("01"), "bad ApiMessageAndVersion frame: truncated"),
    (bytes.fromhex("01 07 01") + bytes(12), "unsupported version 1 of api key 7"),
    (bytes.fromhex("01 07 00") + bytes(11), "FenceBroker body of 11 bytes \\(expected 12\\)"),
    (bytes.fromhex("01 14 00 00 ff"), "bad NoOpRecord body: 1 bytes left"),
    (bytes.fromhex("01 02 00"), "api key 2 has no Kafka decoding here yet"),
])
def test_bad_bytes_are_named(value, why):
    """The reader says what is wrong (KafkaMetadataError)."""
    with pytest.raises(KafkaMetadataError, match=why):
        decode_kafka_record(value)
