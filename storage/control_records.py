"""Control records: LeaderChange (2), SnapshotHeader (3), SnapshotFooter (4),
KRaftVersionRecord (5), VotersRecord (6).

A control record lives in a batch whose control bit is set
(``storage.batch.ATTR_CONTROL``). Its value is ``type i16 | version i16`` and
then the body: for types 2-4 a msgpack array with the fields below; for the
KIP-853 records (5, 6) Kafka's own flexible-version encoding of their JSON
schemas (``storage.kafka_flexible``), byte for byte, so that only the framing
remains to change when every control record moves to Kafka's encoding. Data
batches never hold control records, so consumers and the controller skip
control batches by the header bit alone.
"""

from __future__ import annotations

import struct

import msgspec

from storage import kafka_flexible as kf

LEADER_CHANGE = 2
SNAPSHOT_HEADER = 3
SNAPSHOT_FOOTER = 4
KRAFT_VERSION = 5
KRAFT_VOTERS = 6

_PREFIX = struct.Struct(">hh")


class LeaderChange(msgspec.Struct, array_like=True, frozen=True):
    leader_id: int
    voters: list[int]
    granting_voters: list[int] = []


class SnapshotHeader(msgspec.Struct, array_like=True, frozen=True):
    last_contained_log_timestamp_ms: int
    cluster_id: str = ""


class SnapshotFooter(msgspec.Struct, array_like=True, frozen=True):
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


# The KIP-853 records' bodies in Kafka's encoding: (encode, decode).
_KAFKA_BODIES = {
    KRAFT_VERSION: (_encode_kraft_version, _decode_kraft_version),
    KRAFT_VOTERS: (_encode_voters, _decode_voters),
}


_TYPES: dict[int, type[msgspec.Struct]] = {
    LEADER_CHANGE: LeaderChange,
    SNAPSHOT_HEADER: SnapshotHeader,
    SNAPSHOT_FOOTER: SnapshotFooter,
    KRAFT_VERSION: KRaftVersionRecord,
    KRAFT_VOTERS: VotersRecord,
}
_TYPE_OF = {cls: key for key, cls in _TYPES.items()}
_ENCODER = msgspec.msgpack.Encoder()


class ControlRecordError(ValueError):
    pass


ControlRecord = LeaderChange | SnapshotHeader | SnapshotFooter | KRaftVersionRecord | VotersRecord


def encode_control(record: ControlRecord, version: int = 0) -> bytes:
    rtype = _TYPE_OF[type(record)]
    kafka = _KAFKA_BODIES.get(rtype)
    body = kafka[0](record) if kafka is not None else _ENCODER.encode(record)
    return _PREFIX.pack(rtype, version) + body


def decode_control(value: bytes) -> ControlRecord:
    if len(value) < _PREFIX.size:
        raise ControlRecordError(f"control record of {len(value)} bytes is too short")
    rtype, version = _PREFIX.unpack_from(value)
    cls = _TYPES.get(rtype)
    if cls is None:
        raise ControlRecordError(f"unknown control record type {rtype}")
    kafka = _KAFKA_BODIES.get(rtype)
    if kafka is not None:
        reader = kf.Reader(bytes(value[_PREFIX.size:]))
        try:
            rec = kafka[1](reader)
            reader.end()
        except kf.FlexibleDecodeError as exc:
            raise ControlRecordError(f"undecodable control record type {rtype} v{version}: {exc}") from exc
        return rec
    try:
        return msgspec.msgpack.decode(value[_PREFIX.size:], type=cls)
    except msgspec.DecodeError as exc:
        raise ControlRecordError(f"undecodable control record type {rtype} v{version}: {exc}") from exc
