"""Metadata record encoding: round trips and clear refusals."""

import struct

import pytest
from hypothesis import given, settings, strategies as st

from storage import metadata_records as r

ids = st.integers(min_value=-1, max_value=2**31 - 1)
small = st.integers(min_value=0, max_value=1000)
text = st.text(max_size=20)
int_tuples = st.lists(small, max_size=6).map(tuple)

records = st.one_of(
    st.builds(r.RegisterBroker, small, text, small,
              st.lists(st.builds(r.Endpoint, text, text, st.integers(0, 65535)), max_size=3).map(tuple),
              st.none() | text, st.booleans()),
    st.builds(r.UnregisterBroker, small, small),
    st.builds(r.Topic, text, text),
    st.builds(r.Partition, text, small, int_tuples, int_tuples, ids, small, small),
    st.builds(r.Config, st.sampled_from([2, 4]), text, text, st.none() | text),
    st.builds(r.PartitionChange, text, small, st.none() | int_tuples, ids, st.none() | int_tuples),
    st.builds(r.FenceBroker, small, small),
    st.builds(r.UnfenceBroker, small, small),
    st.builds(r.RemoveTopic, text),
    st.builds(r.FeatureLevel, text, small),
    st.builds(r.AccessControlEntry, text, st.sampled_from([2, 4]), text, st.sampled_from([3, 4]), text, text,
              st.integers(0, 12), st.sampled_from([2, 3])),
    st.builds(r.RemoveAccessControlEntry, text),
    st.just(r.NoOp()),
)


@settings(max_examples=200, deadline=None)
@given(records)
def test_round_trip(rec):
    value = r.encode_record(rec)
    key, version = struct.unpack_from(">hh", value)
    assert key == r.API_KEY_OF[type(rec)] and version == 0
    assert r.decode_record(value) == rec


def test_kafka_api_keys():
    assert r.encode_record(r.FenceBroker(1, 2))[:4] == struct.pack(">hh", 7, 0)
    assert r.encode_record(r.NoOp())[:2] == struct.pack(">h", 20)
    assert r.encode_record(r.PartitionChange("t", 0)).startswith(struct.pack(">h", 5))
    assert r.encode_record(r.AccessControlEntry("i", 2, "t", 3, "User:a", "*", 4, 3))[:2] == struct.pack(">h", 6)
    assert r.encode_record(r.RemoveAccessControlEntry("i"))[:2] == struct.pack(">h", 16)


def test_partition_change_defaults_mean_no_change():
    rec = r.decode_record(r.encode_record(r.PartitionChange("t", 3)))
    assert rec.leader == -2 and rec.isr is None and rec.replicas is None


def test_too_short():
    with pytest.raises(r.MetadataRecordError, match="3 bytes is too short"):
        r.decode_record(b"\x00\x01\x00")


def test_unknown_key():
    with pytest.raises(r.MetadataRecordError, match="unknown metadata record api key 11"):
        r.decode_record(struct.pack(">hh", 11, 0) + b"\x90")


def test_unknown_version():
    value = bytearray(r.encode_record(r.FenceBroker(1, 2)))
    value[3] = 1
    with pytest.raises(r.MetadataRecordError, match="unsupported version 1 of FenceBroker"):
        r.decode_record(bytes(value))


def test_undecodable_body():
    value = struct.pack(">hh", 7, 0) + b"\xc1"
    with pytest.raises(r.MetadataRecordError, match="undecodable FenceBroker v0 record"):
        r.decode_record(value)
    wrong_type = struct.pack(">hh", 7, 0) + r._ENCODER.encode(["x", 1])
    with pytest.raises(r.MetadataRecordError, match="undecodable FenceBroker"):
        r.decode_record(wrong_type)


def test_encode_refuses_non_record():
    with pytest.raises(TypeError, match="not a metadata record: int"):
        r.encode_record(5)
