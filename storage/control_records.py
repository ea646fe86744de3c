"""Control records: LeaderChange (2), SnapshotHeader (3), SnapshotFooter (4),
KRaftVersionRecord (5), VotersRecord (6), byte for byte as Kafka writes them.

A control record lives in a batch whose control bit is set
(``metalog.storage.batch.ATTR_CONTROL``). As in Kafka, its record key is
``version i16 (=0) | type i16`` and its value is the body in Kafka's
flexible-version encoding (``metalog.storage.kafka_flexible``) of the schemas
LeaderChangeMessage, SnapshotHeaderRecord, SnapshotFooterRecord,
KRaftVersionRecord and VotersRecord (each body starts with its own Version
int16). In memory a control record is its 4-byte key followed by its value
(what encode_control returns and decode_control takes); metalog.storage.batch puts the
two into the record's key and value fields. Data batches never hold control
records, so consumers and the controller skip control batches by the header
bit alone.

One departure: SnapshotHeader carries the cluster id (Kafka's has none) as a
tagged field with tag CLUSTER_ID_TAG, which Kafka's readers keep as an
unknown tagged field and otherwise ignore.
"""

from __future__ import annotations

import struct
from typing import Any, Callable

import msgspec

from metalog.storage import kafka_flexible as kf

LEADER_CHANGE = 2
SNAPSHOT_HEADER = 3
SNAPSHOT_FOOTER = 4
KRAFT_VERSION = 5
KRAFT_VOTERS = 6

KEY_VERSION = 0  # ControlRecordType's key version
_KEY = struct.Struct(">hh")
_I64 = struct.Struct(">q")
# Our tag for the cluster id in SnapshotHeader: far above the small tags
# Kafka's schemas number from 0, so a future Kafka field never collides.
CLUSTER_ID_TAG = 10_000


class LeaderChange(msgspec.Struct, frozen=True):
    leader_id: int
    voters: list[int]
    granting_voters: list[int] = []


class SnapshotHeader(msgspec.Struct, frozen=True):
    last_contained_log_timestamp_ms: int
    cluster_id: str = ""


class SnapshotFooter(msgspec.Struct, frozen=True):
    pass


class KRaftVersionRecord(msgspec.Struct, frozen=True):
    """kraft.version: 0 = static voters from the config, 1 = the voter set
    lives in the log (VotersRecord)."""

    kraft_version: int


class VoterEndpoint(msgspec.Struct, frozen=True):
    name: str  # the listener name
    host: str
    port: int


class Voter(msgspec.Struct, frozen=True):
    voter_id: int
    directory_id: str  # Kafka's Uuid string; "" is ZERO_UUID (unknown)
    endpoints: list[VoterEndpoint]
    min_kraft_version: int = 0  # the kraft versions this replica supports
    max_kraft_version: int = 1


class VotersRecord(msgspec.Struct, frozen=True):
    """The whole voter set; the latest one in the log counts (KIP-853)."""

    voters: list[Voter]


def _encode_leader_change(rec: LeaderChange) -> bytes:
    w = kf.Writer()
    w.int16(0)  # Version
    w.int32(rec.leader_id)
    for ids in (rec.voters, rec.granting_voters):
        w.compact_array_length(len(ids))
        for voter_id in ids:
            w.int32(voter_id)
            w.no_tagged_fields()
    w.no_tagged_fields()
    return w.bytes()


def _decode_leader_change(r: kf.Reader) -> LeaderChange:
    r.int16()  # Version
    leader_id = r.int32()
    lists = []
    for _ in range(2):
        ids = []
        for _ in range(r.compact_array_length()):
            ids.append(r.int32())
            r.skip_tagged_fields()
        lists.append(ids)
    r.skip_tagged_fields()
    return LeaderChange(leader_id, lists[0], lists[1])


def _encode_snapshot_header(rec: SnapshotHeader) -> bytes:
    w = kf.Writer()
    w.int16(0)  # Version
    w.out += _I64.pack(rec.last_contained_log_timestamp_ms)
    if rec.cluster_id:
        tagged = kf.Writer()
        tagged.compact_string(rec.cluster_id)
        w.uvarint(1)  # one tagged field
        w.uvarint(CLUSTER_ID_TAG)
        w.uvarint(len(tagged.out))
        w.out += tagged.out
    else:
        w.no_tagged_fields()
    return w.bytes()


def _decode_snapshot_header(r: kf.Reader) -> SnapshotHeader:
    r.int16()  # Version
    ts = _I64.unpack(r.take(8))[0]
    cluster_id = ""
    for tag, raw in r.tagged_fields():
        if tag == CLUSTER_ID_TAG:
            cluster_id = kf.Reader(raw).compact_string()
    return SnapshotHeader(ts, cluster_id)


def _encode_snapshot_footer(rec: SnapshotFooter) -> bytes:
    return b"\x00\x00\x00"  # Version 0, no tagged fields


def _decode_snapshot_footer(r: kf.Reader) -> SnapshotFooter:
    r.int16()  # Version
    r.skip_tagged_fields()
    return SnapshotFooter()


def _encode_kraft_version(rec: KRaftVersionRecord) -> bytes:
    w = kf.Writer()
    w.int16(0)  # Version
    w.int16(rec.kraft_version)
    w.no_tagged_fields()
    return w.bytes()


def _decode_kraft_version(r: kf.Reader) -> KRaftVersionRecord:
    r.int16()  # Version
    rec = KRaftVersionRecord(r.int16())
    r.skip_tagged_fields()
    return rec


def _encode_voters(rec: VotersRecord) -> bytes:
    w = kf.Writer()
    w.int16(0)  # Version
    w.compact_array_length(len(rec.voters))
    for v in rec.voters:
        w.int32(v.voter_id)
        w.uuid(v.directory_id)
        w.compact_array_length(len(v.endpoints))
        for ep in v.endpoints:
            w.compact_string(ep.name)
            w.compact_string(ep.host)
            w.uint16(ep.port)
            w.no_tagged_fields()
        w.int16(v.min_kraft_version)  # KRaftVersionFeature
        w.int16(v.max_kraft_version)
        w.no_tagged_fields()
        w.no_tagged_fields()
    w.no_tagged_fields()
    return w.bytes()


def _decode_voters(r: kf.Reader) -> VotersRecord:
    r.int16()  # Version
    voters = []
    for _ in range(r.compact_array_length()):
        voter_id = r.int32()
        directory_id = r.uuid()
        endpoints = []
        for _ in range(r.compact_array_length()):
            name, host, port = r.compact_string(), r.compact_string(), r.uint16()
            r.skip_tagged_fields()
            endpoints.append(VoterEndpoint(name, host, port))
        lo, hi = r.int16(), r.int16()
        r.skip_tagged_fields()
        r.skip_tagged_fields()
        voters.append(Voter(voter_id, directory_id, endpoints, lo, hi))
    r.skip_tagged_fields()
    return VotersRecord(voters)


ControlRecord = LeaderChange | SnapshotHeader | SnapshotFooter | KRaftVersionRecord | VotersRecord


# Every control record's body in Kafka's encoding: (encode, decode). An
# encoder takes the one record type of its row; a table of them can only say
# "some control record" for the argument.
_KAFKA_BODIES: dict[int, tuple[Callable[[Any], bytes], Callable[[kf.Reader], ControlRecord]]] = {
    LEADER_CHANGE: (_encode_leader_change, _decode_leader_change),
    SNAPSHOT_HEADER: (_encode_snapshot_header, _decode_snapshot_header),
    SNAPSHOT_FOOTER: (_encode_snapshot_footer, _decode_snapshot_footer),
    KRAFT_VERSION: (_encode_kraft_version, _decode_kraft_version),
    KRAFT_VOTERS: (_encode_voters, _decode_voters),
}


_TYPES: dict[int, type[ControlRecord]] = {
    LEADER_CHANGE: LeaderChange,
    SNAPSHOT_HEADER: SnapshotHeader,
    SNAPSHOT_FOOTER: SnapshotFooter,
    KRAFT_VERSION: KRaftVersionRecord,
    KRAFT_VOTERS: VotersRecord,
}
_TYPE_OF = {cls: key for key, cls in _TYPES.items()}


class ControlRecordError(ValueError):
    pass




def encode_control(record: ControlRecord) -> bytes:
    """Key (version, type) followed by the value, Kafka's bytes."""
    rtype = _TYPE_OF[type(record)]
    return _KEY.pack(KEY_VERSION, rtype) + _KAFKA_BODIES[rtype][0](record)


def control_type(record: bytes) -> int:
    """The type in a control record's key (ControlRecordError if it has none)."""
    if len(record) < _KEY.size:
        raise ControlRecordError(f"control record of {len(record)} bytes is too short for its key")
    rtype: int = _KEY.unpack_from(record)[1]
    return rtype


def decode_control(record: bytes) -> ControlRecord:
    """Parse key + value (what encode_control returns)."""
    rtype = control_type(record)
    version = _KEY.unpack_from(record)[0]
    if version != KEY_VERSION:
        raise ControlRecordError(f"control record key version {version} (expected {KEY_VERSION})")
    codec = _KAFKA_BODIES.get(rtype)
    if codec is None:
        raise ControlRecordError(f"unknown control record type {rtype}")
    reader = kf.Reader(bytes(record[_KEY.size:]))
    try:
        rec = codec[1](reader)
        reader.end()
    except kf.FlexibleDecodeError as exc:
        raise ControlRecordError(f"undecodable control record type {rtype} v0: {exc}") from exc
    return rec
