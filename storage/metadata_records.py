"""Metadata records: the values the controller writes into the metadata log.

Each record value is ``api_key i16 | version i16 | msgpack array body`` (big
endian prefix), with Kafka's metadata record api keys::

    RegisterBroker 0, UnregisterBroker 1, Topic 2, Partition 3, Config 4,
    PartitionChange 5, AccessControlEntry 6, FenceBroker 7, UnfenceBroker 8,
    RemoveTopic 9, FeatureLevel 12, RemoveAccessControlEntry 16, NoOp 20,
    and metalog's own ProducerState 1000 (snapshots only)

The body is a msgspec Struct encoded ``array_like`` (fields by position), so
adding an optional field at the end is a compatible change; anything else gets
a new version. Every record type is at version 0 today; a decoder refuses a
version it does not know rather than guessing.

Pure module (no asyncio, no I/O): the broker, the snapshot code, the dump tool
and the Spark job all decode with it. Records are frozen and hold tuples, so
they are hashable and can be shared between a live state and a snapshot copy.
"""

from __future__ import annotations

import struct
from typing import Union

import msgspec

REGISTER_BROKER = 0
UNREGISTER_BROKER = 1
TOPIC = 2
PARTITION = 3
CONFIG = 4
PARTITION_CHANGE = 5
ACCESS_CONTROL_ENTRY = 6
FENCE_BROKER = 7
UNFENCE_BROKER = 8
REMOVE_TOPIC = 9
FEATURE_LEVEL = 12
REMOVE_ACCESS_CONTROL_ENTRY = 16
NO_OP = 20
PRODUCER_STATE = 1000  # metalog's own (Kafka keeps producer state in separate files)

# Config resource types (Kafka's ConfigResource.Type ids).
RESOURCE_TOPIC = 2
RESOURCE_BROKER = 4

# PartitionChange.leader sentinels, as in Kafka's PartitionChangeRecord.
LEADER_NO_CHANGE = -2
NO_LEADER = -1

_PREFIX = struct.Struct(">hh")
PREFIX_SIZE = _PREFIX.size


class _Rec(msgspec.Struct, array_like=True, frozen=True):
    """Base of every metadata record."""


class Endpoint(msgspec.Struct, array_like=True, frozen=True):
    name: str
    host: str
    port: int


class RegisterBroker(_Rec):
    broker_id: int
    incarnation_id: str
    broker_epoch: int
    endpoints: tuple[Endpoint, ...] = ()
    rack: str | None = None
    fenced: bool = True


class UnregisterBroker(_Rec):
    broker_id: int
    broker_epoch: int


class Topic(_Rec):
    name: str
    topic_id: str  # uuid, as text


class Partition(_Rec):
    topic_id: str
    partition_id: int
    replicas: tuple[int, ...]
    isr: tuple[int, ...]
    leader: int  # NO_LEADER (-1) when offline
    leader_epoch: int = 0
    partition_epoch: int = 0


class Config(_Rec):
    resource_type: int  # RESOURCE_TOPIC or RESOURCE_BROKER
    resource_name: str  # topic name, broker id as text, or "" for the cluster default
    name: str
    value: str | None  # None deletes the key


class PartitionChange(_Rec):
    topic_id: str
    partition_id: int
    isr: tuple[int, ...] | None = None  # None: unchanged
    leader: int = LEADER_NO_CHANGE  # -2 unchanged, -1 no leader
    replicas: tuple[int, ...] | None = None  # None: unchanged


class FenceBroker(_Rec):
    id: int
    epoch: int


class UnfenceBroker(_Rec):
    id: int
    epoch: int


class RemoveTopic(_Rec):
    topic_id: str


class FeatureLevel(_Rec):
    name: str
    feature_level: int  # 0 removes the feature


class AccessControlEntry(_Rec):
    """Kafka's AccessControlEntryRecord; the codes are Kafka's (see broker.authz)."""

    id: str  # uuid, as text: what a RemoveAccessControlEntry names
    resource_type: int  # 2 topic, 4 cluster
    resource_name: str
    pattern_type: int  # 3 literal, 4 prefixed
    principal: str  # "User:alice", "Node:2", "User:*"
    host: str  # "*" or an IP address
    operation: int  # 2 All, 3 Read, 4 Write, 7 Alter, 8 Describe, ...
    permission_type: int  # 2 deny, 3 allow


class RemoveAccessControlEntry(_Rec):
    id: str


class NoOp(_Rec):
    pass


class ProducerState(_Rec):
    """One producer's idempotence state, in controller snapshots only
    (storage.producer_state). Batches are (first_seq, last_seq, base_offset,
    last_offset, leader_epoch), oldest first."""

    producer_id: int
    producer_epoch: int
    last_timestamp_ms: int
    batches: tuple[tuple[int, int, int, int, int], ...] = ()


MetadataRecord = Union[
    RegisterBroker, UnregisterBroker, Topic, Partition, Config, PartitionChange,
    FenceBroker, UnfenceBroker, RemoveTopic, FeatureLevel, AccessControlEntry,
    RemoveAccessControlEntry, NoOp, ProducerState,
]

# api key -> (class, highest version we can decode)
RECORD_TYPES: dict[int, tuple[type[_Rec], int]] = {
    REGISTER_BROKER: (RegisterBroker, 0),
    UNREGISTER_BROKER: (UnregisterBroker, 0),
    TOPIC: (Topic, 0),
    PARTITION: (Partition, 0),
    CONFIG: (Config, 0),
    PARTITION_CHANGE: (PartitionChange, 0),
    FENCE_BROKER: (FenceBroker, 0),
    UNFENCE_BROKER: (UnfenceBroker, 0),
    REMOVE_TOPIC: (RemoveTopic, 0),
    FEATURE_LEVEL: (FeatureLevel, 0),
    ACCESS_CONTROL_ENTRY: (AccessControlEntry, 0),
    REMOVE_ACCESS_CONTROL_ENTRY: (RemoveAccessControlEntry, 0),
    NO_OP: (NoOp, 0),
    PRODUCER_STATE: (ProducerState, 0),
}
API_KEY_OF: dict[type, int] = {cls: key for key, (cls, _) in RECORD_TYPES.items()}
_PREFIX_OF: dict[type, bytes] = {
    cls: _PREFIX.pack(key, version) for key, (cls, version) in RECORD_TYPES.items()
}
_DECODERS = {key: msgspec.msgpack.Decoder(cls) for key, (cls, _) in RECORD_TYPES.items()}
_ENCODER = msgspec.msgpack.Encoder()


class MetadataRecordError(ValueError):
    """A record value we cannot decode: too short, unknown key or version, bad body."""


def record_type_name(api_key: int) -> str:
    entry = RECORD_TYPES.get(api_key)
    return entry[0].__name__ if entry else f"unknown({api_key})"


def encode_record(rec: MetadataRecord) -> bytes:
    prefix = _PREFIX_OF.get(type(rec))
    if prefix is None:
        raise TypeError(f"not a metadata record: {type(rec).__name__}")
    return prefix + _ENCODER.encode(rec)


def decode_record(value: bytes | memoryview) -> MetadataRecord:
    if len(value) < PREFIX_SIZE:
        raise MetadataRecordError(
            f"metadata record of {len(value)} bytes is too short (need {PREFIX_SIZE})")
    key, version = _PREFIX.unpack_from(value)
    entry = RECORD_TYPES.get(key)
    if entry is None:
        raise MetadataRecordError(f"unknown metadata record api key {key}")
    if version < 0 or version > entry[1]:
        raise MetadataRecordError(
            f"unsupported version {version} of {entry[0].__name__} (api key {key}); "
            f"this build reads versions 0..{entry[1]}")
    try:
        return _DECODERS[key].decode(memoryview(value)[PREFIX_SIZE:])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MetadataRecordError(
            f"undecodable {entry[0].__name__} v{version} record: {exc}") from exc


def record_to_dict(rec: MetadataRecord) -> dict:
    """Fields by name (for dumps and JSON)."""
    return msgspec.to_builtins(msgspec.structs.asdict(rec))
