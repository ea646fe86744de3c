"""Our metadata record bytes checked field by field against Kafka's published
schemas (tests/formats/schemas/*.json, read by a schema interpreter that does
not use storage/metadata_records.py): every type we share with Kafka, read
back with Kafka's field names, types and order; written from the schema,
byte-identical to ours; and every version Kafka defines, with the fields we do
not model filled in, decodes with our codec."""

from __future__ import annotations

import uuid

import pytest

from metalog.storage import metadata_records as mr
from tests.formats.schemas import kafka_schema as ks

T = "5c9d1f2e-3a4b-4c5d-8e6f-708192a3b4c5"
I = "0a1b2c3d-4e5f-4061-9273-8495a6b7c8d9"


def ub(text: str) -> bytes:
    return uuid.UUID(text).bytes


# (our record, Kafka schema name, the fields Kafka's schema gives them at version 0)
CASES = [
    (mr.RegisterBroker(7, I, 42, (mr.Endpoint("PLAINTEXT", "10.0.0.7", 9092),
                                  mr.Endpoint("INTERNAL", "h7", 9093, 1)), "rack-a", False),
     "RegisterBrokerRecord",
     {"BrokerId": 7, "IncarnationId": ub(I), "BrokerEpoch": 42,
      "EndPoints": [{"Name": "PLAINTEXT", "Host": "10.0.0.7", "Port": 9092, "SecurityProtocol": 0},
                    {"Name": "INTERNAL", "Host": "h7", "Port": 9093, "SecurityProtocol": 1}],
      "Features": [], "Rack": "rack-a", "Fenced": False}),
    (mr.RegisterBroker(8, I, 1, (), None, True), "RegisterBrokerRecord",
     {"BrokerId": 8, "IncarnationId": ub(I), "BrokerEpoch": 1, "EndPoints": [], "Features": [], "Rack": None,
      "Fenced": True}),
    (mr.UnregisterBroker(7, 42), "UnregisterBrokerRecord", {"BrokerId": 7, "BrokerEpoch": 42}),
    (mr.Topic("orders", T), "TopicRecord", {"Name": "orders", "TopicId": ub(T)}),
    (mr.Partition(T, 3, (1, 2, 3), (2, 3), 2, 5, 9), "PartitionRecord",
     {"PartitionId": 3, "TopicId": ub(T), "Replicas": [1, 2, 3], "Isr": [2, 3], "RemovingReplicas": [],
      "AddingReplicas": [], "Leader": 2, "LeaderRecoveryState": 0, "LeaderEpoch": 5, "PartitionEpoch": 9}),
    (mr.PartitionChange(T, 3, (2,), 2, None), "PartitionChangeRecord",
     {"PartitionId": 3, "TopicId": ub(T), "Isr": [2], "Leader": 2}),
    (mr.PartitionChange(T, 0, None, mr.NO_LEADER, (4, 5)), "PartitionChangeRecord",
     {"PartitionId": 0, "TopicId": ub(T), "Leader": -1, "Replicas": [4, 5]}),
    (mr.PartitionChange(T, 1), "PartitionChangeRecord", {"PartitionId": 1, "TopicId": ub(T)}),
    (mr.Config(mr.RESOURCE_TOPIC, "orders", "retention.ms", "1000"), "ConfigRecord",
     {"ResourceType": 2, "ResourceName": "orders", "Name": "retention.ms", "Value": "1000"}),
    (mr.Config(mr.RESOURCE_BROKER, "", "x", None), "ConfigRecord",
     {"ResourceType": 4, "ResourceName": "", "Name": "x", "Value": None}),
    (mr.FenceBroker(7, 42), "FenceBrokerRecord", {"Id": 7, "Epoch": 42}),
    (mr.UnfenceBroker(7, 43), "UnfenceBrokerRecord", {"Id": 7, "Epoch": 43}),
    (mr.RemoveTopic(T), "RemoveTopicRecord", {"TopicId": ub(T)}),
    (mr.FeatureLevel("metadata.version", 21), "FeatureLevelRecord",
     {"Name": "metadata.version", "FeatureLevel": 21}),
    (mr.AccessControlEntry(I, 2, "orders", 3, "User:alice", "*", 4, 3), "AccessControlEntryRecord",
     {"Id": ub(I), "ResourceType": 2, "ResourceName": "orders", "PatternType": 3, "Principal": "User:alice",
      "Host": "*", "Operation": 4, "PermissionType": 3}),
    (mr.RemoveAccessControlEntry(I), "RemoveAccessControlEntryRecord", {"Id": ub(I)}),
    (mr.NoOp(), "NoOpRecord", {}),
]


def _full(schema: dict, fields: dict, version: int) -> dict:
    out = {f["name"]: ks.default_of(f) for f in schema["fields"] if ks.in_range(f["versions"], version)}
    out.update(fields)
    return out


@pytest.mark.parametrize("rec, name, fields", CASES, ids=[f"{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_our_bytes_follow_kafkas_schema_field_by_field(rec, name, fields):
    schema = ks.load(name)
    value = mr.encode_record(rec)
    version, got = ks.read(schema, value)
    assert version == 0
    assert got == _full(schema, fields, 0)
    assert ks.write(schema, fields, 0) == value
    assert mr.API_KEY_OF[type(rec)] == schema["apiKey"]


# Fields of later versions that we read and drop (not modelled).
LATER = {
    "RegisterBrokerRecord": {"IsMigratingZkBroker": False, "InControlledShutdown": True,
                             "LogDirs": [bytes(range(16))],
                             "Features": [{"Name": "metadata.version", "MinSupportedVersion": 1,
                                           "MaxSupportedVersion": 21}]},
    "PartitionRecord": {"Directories": [bytes(range(16))] * 3, "EligibleLeaderReplicas": [1],
                        "LastKnownElr": [3], "LeaderRecoveryState": 1},
    "PartitionChangeRecord": {"Directories": [bytes(range(16))], "EligibleLeaderReplicas": [1],
                              "LeaderRecoveryState": 0, "RemovingReplicas": [3], "AddingReplicas": [5]},
}


@pytest.mark.parametrize("rec, name, fields", CASES, ids=[f"{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_every_version_kafka_defines_decodes(rec, name, fields):
    schema = ks.load(name)
    for version in ks.versions(schema):
        value = ks.write(schema, {**fields, **LATER.get(name, {})}, version)
        back = mr.decode_record(value)
        if type(rec) is mr.RegisterBroker:  # the protocol id comes back explicit or implied
            assert [e.protocol_id() for e in back.endpoints] == [e.protocol_id() for e in rec.endpoints]
            back = mr.RegisterBroker(back.broker_id, back.incarnation_id, back.broker_epoch, rec.endpoints,
                                     back.rack, back.fenced)
        assert back == rec, version


def test_a_version_past_kafkas_is_refused():
    schema = ks.load("PartitionRecord")
    top = max(ks.versions(schema))
    value = bytearray(ks.write(schema, dict(CASES[4][2]), top))
    value[2] = top + 1
    with pytest.raises(mr.MetadataRecordError, match=f"unsupported version {top + 1} of Partition"):
        mr.decode_record(bytes(value))


def test_types_we_do_not_model_decode_whole_as_unknown_records():
    schema = ks.load("ProducerIdsRecord")
    value = ks.write(schema, {"BrokerId": 1, "BrokerEpoch": 5, "NextProducerId": 2000})
    rec = mr.decode_record(value)
    assert type(rec) is mr.UnknownRecord and mr.type_name(rec) == "ProducerIds"
    assert mr.encode_record(rec) == value
    schema = ks.load("BrokerRegistrationChangeRecord")
    value = ks.write(schema, {"BrokerId": 1, "BrokerEpoch": 5, "Fenced": 1}, 2)
    assert mr.type_name(mr.decode_record(value)) == "BrokerRegistrationChange"
