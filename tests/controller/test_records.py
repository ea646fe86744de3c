"""Metadata record encoding (Kafka's ApiMessageAndVersion framing and bodies):
round trips, golden bytes worked out by hand from Kafka's schemas, and clear
refusals."""

import uuid

import pytest
from hypothesis import given, settings, strategies as st

from metalog.storage import metadata_records as r

ids = st.integers(min_value=-1, max_value=2**31 - 1)
small = st.integers(min_value=0, max_value=1000)
text = st.text(max_size=20)
uuids = st.uuids().map(str)
int_tuples = st.lists(small, max_size=6).map(tuple)

records = st.one_of(
    st.builds(r.RegisterBroker, small, uuids, small,
              st.lists(st.builds(r.Endpoint, text, text, st.integers(0, 65535),
                                 st.sampled_from([-1, 0, 1, 2, 3])), max_size=3).map(tuple),
              st.none() | text, st.booleans()),
    st.builds(r.UnregisterBroker, small, small),
    st.builds(r.Topic, text, uuids),
    st.builds(r.Partition, uuids, small, int_tuples, int_tuples, ids, small, small),
    st.builds(r.Config, st.sampled_from([2, 4]), text, text, st.none() | text),
    st.builds(r.PartitionChange, uuids, small, st.none() | int_tuples, ids, st.none() | int_tuples),
    st.builds(r.FenceBroker, small, small),
    st.builds(r.UnfenceBroker, small, small),
    st.builds(r.RemoveTopic, uuids),
    st.builds(r.FeatureLevel, text, small),
    st.builds(r.AccessControlEntry, uuids, st.sampled_from([2, 4]), text, st.sampled_from([3, 4]), text, text,
              st.integers(0, 12), st.sampled_from([2, 3])),
    st.builds(r.RemoveAccessControlEntry, uuids),
    st.just(r.NoOp()),
    st.builds(r.ProducerState, small, small, small,
              st.lists(st.tuples(small, small, small, small, small), max_size=3).map(tuple)),
    st.builds(r.BrokerRegistrationChange, small, small, st.sampled_from([-1, 0, 1])),
    st.builds(r.UnknownRecord, st.sampled_from([15, 27]), st.integers(0, 3), st.binary(max_size=20)),
)


def _endpoint_equal(a: r.Endpoint, b: r.Endpoint) -> bool:
    return (a.name, a.host, a.port, a.protocol_id()) == (b.name, b.host, b.port, b.protocol_id())


@settings(max_examples=300, deadline=None)
@given(records)
def test_round_trip(rec):
    value = r.encode_record(rec)
    key, version, _ = r.decode_frame(value)
    if type(rec) is r.UnknownRecord:
        assert (key, version) == (rec.api_key, rec.version)
    else:
        assert key == r.API_KEY_OF[type(rec)] and version == 0
    back = r.decode_record(value)
    if type(rec) is r.RegisterBroker:
        # An explicit protocol id equal to the one the name implies comes back as -1 (implied).
        assert all(_endpoint_equal(a, b) for a, b in zip(back.endpoints, rec.endpoints))
        back = back.__class__(back.broker_id, back.incarnation_id, back.broker_epoch, rec.endpoints,
                              back.rack, back.fenced)
    assert back == rec
    assert r.encode_record(back) == value


U = "0f8e4a2c-5b1d-4c3e-9a7f-2d6b8c1e3f40"
UB = "0f8e4a2c5b1d4c3e9a7f2d6b8c1e3f40"  # its 16 bytes


@pytest.mark.parametrize("rec, golden", [
    # FenceBrokerRecord v0 (flexible): frame 1, key 7, version 0, Id i32, Epoch i64, no tagged fields.
    (r.FenceBroker(3, 7), "01 07 00" "00000003" "0000000000000007" "00"),
    (r.UnfenceBroker(300, 2**40), "01 08 00" "0000012c" "0000010000000000" "00"),
    (r.UnregisterBroker(1, 2), "01 01 00" "00000001" "0000000000000002" "00"),
    (r.NoOp(), "01 14 00" "00"),
    # TopicRecord: Name compact string ("t": length 1 + 1), TopicId 16 bytes.
    (r.Topic("t", U), "01 02 00" "02 74" + UB + "00"),
    (r.RemoveTopic(U), "01 09 00" + UB + "00"),
    # PartitionRecord v0: PartitionId, TopicId, Replicas [1,2], Isr [1], Removing [], Adding [],
    # Leader 1, LeaderEpoch 5, PartitionEpoch 6.
    (r.Partition(U, 2, (1, 2), (1,), 1, 5, 6),
     "01 03 00" "00000002" + UB + "03 00000001 00000002" "02 00000001" "01" "01"
     "00000001" "00000005" "00000006" "00"),
    # PartitionChangeRecord: only the changed fields, as tagged fields 0 (Isr) and 1 (Leader).
    (r.PartitionChange(U, 0, (3,), 3), "01 05 00" "00000000" + UB + "02" "00 05 02 00000003" "01 04 00000003"),
    (r.PartitionChange(U, 0), "01 05 00" "00000000" + UB + "00"),
    (r.PartitionChange(U, 0, replicas=(1,)), "01 05 00" "00000000" + UB + "01" "02 05 02 00000001"),
    # ConfigRecord: ResourceType i8, ResourceName, Name, Value (null = 0).
    (r.Config(2, "t", "a", None), "01 04 00" "02" "02 74" "02 61" "00" "00"),
    (r.Config(4, "", "a", "b"), "01 04 00" "04" "01" "02 61" "02 62" "00"),
    (r.FeatureLevel("m", 7), "01 0c 00" "02 6d" "0007" "00"),
    # AccessControlEntryRecord (key 18): Id, ResourceType, ResourceName, PatternType, Principal,
    # Host, Operation, PermissionType.
    (r.AccessControlEntry(U, 2, "t", 3, "U:a", "*", 4, 3),
     "01 12 00" + UB + "02" "02 74" "03" "04 553a61" "02 2a" "04" "03" "00"),
    (r.RemoveAccessControlEntry(U), "01 13 00" + UB + "00"),
    # RegisterBrokerRecord v0: BrokerId, IncarnationId, BrokerEpoch, EndPoints [Name, Host, Port u16,
    # SecurityProtocol i16 (SSL = 1, from the listener name)], Features [], Rack null, Fenced.
    (r.RegisterBroker(1, U, 2, (r.Endpoint("SSL", "h", 9093),), None, True),
     "01 00 00" "00000001" + UB + "0000000000000002" "02" "04 53534c" "02 68" "2385" "0001" "00"
     "01" "00" "01" "00"),
    # ProducerState, metalog's own, rides in a NoOpRecord (key 20, v0): its tag section holds one
    # field, tag 10000 (uvarint 90 4e), 20 bytes (14): ProducerId, ProducerEpoch, LastTimestampMs,
    # Batches [] (compact: 01), the body's own empty tag section.
    (r.ProducerState(5, 1, 9), "01 14 00" "01" "904e 14" "0000000000000005" "0001" "0000000000000009" "01" "00"),
])
def test_golden_bytes(rec, golden):
    value = r.encode_record(rec)
    assert value.hex() == golden.replace(" ", "")
    assert r.decode_record(value) == rec


def test_newer_kafka_versions_decode_and_drop_what_we_do_not_model():
    """RegisterBrokerRecord v3 (IsMigratingZkBroker, InControlledShutdown, a
    feature range, LogDirs as tag 0: kept, a Kafka broker needs its log dirs
    in its registration) and PartitionRecord v1 (Directories)."""
    v3 = bytes.fromhex(
        "01 00 03" "00000004" "00" + UB + "0000000000000009" "01"
        "02" "11 6d657461646174612e76657273696f6e" "0001" "0015" "00"  # Features [metadata.version 1..21]
        "04 723141" "00" "00"  # Rack "r1A", Fenced false, InControlledShutdown false
        "01" "00 11 02" + UB + "")  # tag 0 (LogDirs): one uuid
    rec = r.decode_record(v3)
    assert rec == r.RegisterBroker(4, U, 9, (), "r1A", False, (U,))
    # Written back as v3 with the same layout (no feature ranges: we do not model them).
    assert r.encode_record(rec).hex() == ("01 00 03" "00000004" "00" + UB + "0000000000000009" "01" "01"
                                          "04 723141" "00" "00" "01" "00 11 02" + UB).replace(" ", "")
    # RegisterBrokerRecord v4 (Kafka 4.3, metadata.version 4.3-IV0) as Kafka 4.3.1's generated code
    # writes it: v3 plus CordonedLogDirs, tag 1 (here LogDirs [(3, 4)], CordonedLogDirs [(5, 6)]).
    v4 = bytes.fromhex("01 00 04" "00000001" "00" "00000000000000010000000000000002" "0000000000000005" "01" "01"
                       "00" "00" "00" "02" "00 11 02 00000000000000030000000000000004"
                       "01 11 02 00000000000000050000000000000006")
    assert r.decode_record(v4) == r.RegisterBroker(1, "00000000-0000-0001-0000-000000000002", 5, (), None, False,
                                                   ("00000000-0000-0003-0000-000000000004",))
    p1 = bytes.fromhex("01 03 01" "00000000" + UB + "02 00000001" "02 00000001" "01" "01"
                       "00000001" "00000000" "00000000" "02" + UB + "00")
    assert r.decode_record(p1) == r.Partition(U, 0, (1,), (1,), 1, 0, 0)


def test_broker_registration_change_as_kafka_writes_it():
    """BrokerRegistrationChangeRecord (key 17), Kafka's fence and unfence:
    bytes Kafka 4.3.1 wrote (a broker fenced at its shutdown), and v1-v3
    with InControlledShutdown (tag 1) and LogDirs (tag 2)."""
    fenced = bytes.fromhex("01 11 00" "00000064" "0000000000000010" "01" "00 01 01")
    rec = r.decode_record(fenced)
    assert rec == r.BrokerRegistrationChange(100, 16, fenced=1)
    assert r.encode_record(rec) == fenced
    unfenced = r.BrokerRegistrationChange(100, 16, fenced=-1)
    assert r.encode_record(unfenced).hex() == "011100" "00000064" "0000000000000010" "01" "0001ff"
    v2 = bytes.fromhex("01 11 02" "00000001" "0000000000000002" "02" "01 01 01" "02 11 02" + UB)
    assert r.decode_record(v2) == r.BrokerRegistrationChange(1, 2, fenced=0, in_controlled_shutdown=1)
    with pytest.raises(ValueError, match="InControlledShutdown"):
        r.encode_record(r.decode_record(v2))


def test_kafka_api_keys():
    assert r.decode_frame(r.encode_record(r.FenceBroker(1, 2)))[:2] == (7, 0)
    assert r.decode_frame(r.encode_record(r.AccessControlEntry(U, 2, "t", 3, "User:a", "*", 4, 3)))[0] == 18
    assert r.decode_frame(r.encode_record(r.RemoveAccessControlEntry(U)))[0] == 19
    assert r.FENCE_BROKER_IMPLICIT > max(r.KAFKA_RECORD_NAMES)  # ours stay outside Kafka's keys
    # ProducerState is a NoOp to Kafka (its tag is skipped by Kafka's reader).
    assert r.decode_frame(r.encode_record(r.ProducerState(1, 0, 0)))[:2] == (r.NO_OP, 0)


# A ProducerState as snapshots wrote it before it rode in a NoOp: metalog's key 1000
# (uvarint e8 07), the same body. Read, never written.
LEGACY_PRODUCER_STATE = ("01 e807 00" "0000000000000005" "0001" "0000000000000009"
                         "02" "00000000" "00000002" "000000000000000a" "000000000000000c" "00000003" "00" "00")


def test_a_producer_state_of_an_old_snapshot_still_decodes():
    rec = r.ProducerState(5, 1, 9, ((0, 2, 10, 12, 3),))
    assert r.decode_record(bytes.fromhex(LEGACY_PRODUCER_STATE.replace(" ", ""))) == rec
    assert r.encode_record(rec)[:3] == bytes.fromhex("011400")  # written as a NoOp


def test_a_noop_with_other_tags_is_a_noop_and_a_bad_producer_tag_is_refused():
    # Tag 3 (someone else's, 2 bytes): skipped, as Kafka skips unknown tags.
    assert r.decode_record(bytes.fromhex("011400" "01" "03 02 abcd")) == r.NoOp()
    # Our tag holding a ProducerState body with a byte too many.
    body = r.encode_record(r.ProducerState(5, 1, 9))[7:] + b"\x00"
    bad = bytes.fromhex("011400" "01" "904e") + bytes([len(body)]) + body
    with pytest.raises(r.MetadataRecordError, match="1 byte\\(s\\) after its body"):
        r.decode_record(bad)


def test_uuids_are_16_bytes_and_canonical_text():
    tid = str(uuid.uuid4())
    value = r.encode_record(r.RemoveTopic(tid))
    assert value[3:19] == uuid.UUID(tid).bytes
    assert r.decode_record(value).topic_id == tid
    with pytest.raises(ValueError, match="not a uuid: 'T'"):
        r.encode_record(r.Topic("t", "T"))


def test_unknown_kafka_type_decodes_to_unknown_record():
    """ProducerIdsRecord (key 15) is not modelled: kept whole, named by Kafka's name."""
    body = bytes.fromhex("00000001" "0000000000000000" "0000000000000000" "00")
    rec = r.decode_record(bytes.fromhex("01 0f 00") + body)
    assert rec == r.UnknownRecord(15, 0, body)
    assert r.type_name(rec) == "ProducerIds"
    assert r.record_type_name(99) == "unknown(99)"


def test_frame_errors():
    with pytest.raises(r.MetadataRecordError, match="not a metadata record: frame version 0"):
        r.decode_record(b"\x00\x07\x00")
    with pytest.raises(r.MetadataRecordError, match="metadata record of 2 bytes ends inside its frame"):
        r.decode_record(b"\x01\x07")
    with pytest.raises(r.MetadataRecordError, match="must fit an int16"):
        r.decode_record(bytes.fromhex("01 ffff03 00"))


def test_unknown_version():
    value = bytearray(r.encode_record(r.FenceBroker(1, 2)))
    value[2] = 1
    with pytest.raises(r.MetadataRecordError,
                       match=r"unsupported version 1 of FenceBroker \(api key 7\); this build reads versions 0..0"):
        r.decode_record(bytes(value))


def test_undecodable_body():
    with pytest.raises(r.MetadataRecordError, match="undecodable FenceBroker v0 record: error"):
        r.decode_record(bytes.fromhex("01 07 00 c1"))
    with pytest.raises(r.MetadataRecordError, match="undecodable FenceBroker v0 record: 1 byte"):
        r.decode_record(r.encode_record(r.FenceBroker(1, 2)) + b"\x00")
    with pytest.raises(r.MetadataRecordError, match="undecodable Topic v0 record: null string"):
        r.decode_record(bytes.fromhex("01 02 00 00") + bytes(17))
    with pytest.raises(r.MetadataRecordError, match="undecodable Config v0 record: UnicodeDecodeError"):
        r.decode_record(bytes.fromhex("01 04 00 02 02 ff 02 61 00 00"))


def test_encode_refuses_non_record():
    with pytest.raises(TypeError, match="not a metadata record: int"):
        r.encode_record(5)


def test_the_zero_uuid_round_trips_and_empty_text_is_not_a_uuid():
    zero = "00000000-0000-0000-0000-000000000000"
    assert r.decode_record(r.encode_record(r.Topic("t", zero))) == r.Topic("t", zero)
    with pytest.raises(ValueError, match="not a uuid: ''"):
        r.encode_record(r.RemoveTopic(""))
    with pytest.raises(ValueError, match="want lower-case hex"):
        r.encode_record(r.RemoveTopic(zero.upper().replace("0", "A")))
