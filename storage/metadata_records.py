"""Metadata records: the values the controller writes into the metadata log.

Every value is framed as Kafka's ApiMessageAndVersion (MetadataRecordSerde)::

    frame version uvarint (=1) | api key uvarint | version uvarint | body

and every body is Kafka's "flexible version" encoding of that record's schema
(Kafka's metadata/*.json): fixed-width big-endian integers, uuids as 16 raw
bytes, compact strings and arrays (uvarint length + 1, 0 for null) and a
tagged-field section at the end of each struct. The api keys are Kafka's::

    RegisterBroker 0, UnregisterBroker 1, Topic 2, Partition 3, Config 4,
    PartitionChange 5, FenceBroker 7, UnfenceBroker 8, RemoveTopic 9,
    FeatureLevel 12, BrokerRegistrationChange 17 (read: Kafka's fence and
    unfence), AccessControlEntry 18, RemoveAccessControlEntry 19, NoOp 20

plus metalog's own FenceBrokerImplicit 1001 (old logs' fences, converted by
the upgrade), outside the keys Kafka uses (0..27 today). metalog's
ProducerState (controller snapshots only) is written as a NoOpRecord whose
tagged-field section holds it under tag 10000: Kafka skips a tag it does not
know (KIP-482) and replays a NoOpRecord as nothing, so its tools read our
snapshots whole; we decode that NoOp as the ProducerState it carries. Older
snapshots carried it as a record of its own, api key 1000, which this build
still reads (never writes). We write version 0 of each Kafka type and read every
version Kafka defines (newer fields we do not model are read and dropped); a
version past those is refused with MetadataRecordError. A record type Kafka
has and we do not model (ProducerIds 15, RegisterController 27, ...)
decodes to ``UnknownRecord`` carrying its bytes, so replay can count it by
type instead of failing or dropping it silently.

In memory, uuids (topic ids, incarnation ids, ACL ids) are canonical
lower-case hyphenated text (``str(uuid.UUID(...))``); encoding a record whose
id is not a uuid raises ValueError. Broker ids, epochs and the like are ints.

Pure module (no asyncio, no I/O): the broker, the snapshot code, the dump tool
and the Spark job all decode with it. Records are frozen and hold tuples, so
they are hashable and can be shared between a live state and a snapshot copy.
Decoding is one precompiled function per type over ``struct`` and inline
varints: replay and snapshot load are dominated by it.
"""

from __future__ import annotations

import struct
from typing import Any, Callable, Protocol, Sequence, TypeVar, Union

import msgspec

REGISTER_BROKER = 0
UNREGISTER_BROKER = 1
TOPIC = 2
PARTITION = 3
CONFIG = 4
PARTITION_CHANGE = 5
FENCE_BROKER = 7
UNFENCE_BROKER = 8
REMOVE_TOPIC = 9
BROKER_REGISTRATION_CHANGE = 17
FEATURE_LEVEL = 12
ACCESS_CONTROL_ENTRY = 18
REMOVE_ACCESS_CONTROL_ENTRY = 19
NO_OP = 20
# A NoOpRecord's tag that carries one ProducerState (docs/formats.md): a high
# number, clear of the tags Kafka may one day give NoOpRecord (it counts from 0).
PRODUCER_STATE_TAG = 10000
# metalog's own key of a ProducerState before it rode in a NoOp: read, never written.
LEGACY_PRODUCER_STATE = 1000
FENCE_BROKER_IMPLICIT = 1001  # metalog's own: a FenceBroker of format versions 1-2 (see below)

# Kafka's metadata.version feature (a FeatureLevelRecord). A Kafka controller
# writes it at bootstrap; a metalog cluster is born at METADATA_VERSION_LEVEL
# without a record (the controller state starts with it) and writes it first
# in every snapshot, where Kafka's loaders need it. 21 is 3.9-IV0, the first
# level Kafka allows kraft.version 1 at (KRaftVersion.KRAFT_VERSION_1's
# bootstrap level), and a static quorum of ours can upgrade to kraft.version 1
# online; Kafka 4.3.1 accepts levels 7 (3.3-IV3) to 31. At 21 Kafka writes
# later versions of three records than our v0 (RegisterBroker v3, Partition v1
# and PartitionChange v1: directories); it reads v0 at any level.
METADATA_VERSION = "metadata.version"
METADATA_VERSION_LEVEL = 21
METADATA_VERSION_LEVEL_MIN = 7  # Kafka's lowest (MetadataVersion.MINIMUM_VERSION, 3.3-IV3)

# Config resource types (Kafka's ConfigResource.Type ids).
RESOURCE_TOPIC = 2
RESOURCE_BROKER = 4

# Kafka's SecurityProtocol ids (BrokerEndpoint.SecurityProtocol).
SECURITY_PROTOCOLS = {"PLAINTEXT": 0, "SSL": 1, "SASL_PLAINTEXT": 2, "SASL_SSL": 3}

# PartitionChange.leader sentinels, as in Kafka's PartitionChangeRecord.
LEADER_NO_CHANGE = -2
NO_LEADER = -1

# gc=False: a state of 2M partitions is 2M records that the cyclic GC would
# otherwise walk on every full collection (pauses of up to a second at that
# size) and that carry a 16-byte GC header each. No cycle can pass through
# them: they are frozen and hold only str, int, bytes, None and tuples built
# before the record (of ints, of Endpoints, of int tuples).
class _Rec(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Base of every metadata record."""


class Endpoint(msgspec.Struct, array_like=True, frozen=True, gc=False):
    name: str  # the listener name
    host: str
    port: int
    security_protocol: int = -1  # Kafka's SecurityProtocol id; -1: derived from the name

    def protocol_id(self) -> int:
        """What Kafka's BrokerEndpoint.SecurityProtocol holds: the explicit id,
        else the id of a listener named after a protocol, else PLAINTEXT (0)."""
        if self.security_protocol >= 0:
            return self.security_protocol
        return SECURITY_PROTOCOLS.get(self.name.upper(), 0)


class RegisterBroker(_Rec, frozen=True):
    broker_id: int
    incarnation_id: str
    broker_epoch: int
    endpoints: tuple[Endpoint, ...] = ()
    rack: str | None = None
    fenced: bool = True
    # Directory ids (uuid text) a Kafka broker registered (BrokerRegistration v2+): written as
    # RegisterBrokerRecord v3's LogDirs, which a Kafka broker at metadata.version 3.7-IV2 or
    # later must find in its registration (else it registers again). Empty: written as v0.
    log_dirs: tuple[str, ...] = ()


class UnregisterBroker(_Rec, frozen=True):
    broker_id: int
    broker_epoch: int


class Topic(_Rec, frozen=True):
    name: str
    topic_id: str  # uuid, as text


class Partition(_Rec, frozen=True):
    topic_id: str
    partition_id: int
    replicas: tuple[int, ...]
    isr: tuple[int, ...]
    leader: int  # NO_LEADER (-1) when offline
    leader_epoch: int = 0
    partition_epoch: int = 0


class Config(_Rec, frozen=True):
    resource_type: int  # RESOURCE_TOPIC or RESOURCE_BROKER
    resource_name: str  # topic name, broker id as text, or "" for the cluster default
    name: str
    value: str | None  # None deletes the key


class PartitionChange(_Rec, frozen=True):
    topic_id: str
    partition_id: int
    isr: tuple[int, ...] | None = None  # None: unchanged
    leader: int = LEADER_NO_CHANGE  # -2 unchanged, -1 no leader
    replicas: tuple[int, ...] | None = None  # None: unchanged


class FenceBroker(_Rec, frozen=True):
    id: int
    epoch: int


class BrokerRegistrationChange(_Rec, frozen=True):
    """Kafka's fence and unfence since metadata.version 3.3
    (BrokerRegistrationChangeRecord; its FenceBroker/UnfenceBroker records are
    for older levels): `fenced` 1 fences the broker, -1 unfences it, 0 leaves
    it; `in_controlled_shutdown` 1 says it is shutting down (Kafka's
    BrokerRegistrationInControlledShutdownChange), which we read and do not
    model. metalog's controller never writes one; Kafka's logs hold them."""

    broker_id: int
    broker_epoch: int
    fenced: int = 0
    in_controlled_shutdown: int = 0


class FenceBrokerImplicit(_Rec, frozen=True):
    """metalog's own (key 1001): a FenceBroker written by format versions 1
    and 2, whose apply also shrinks ISRs and moves leaders (metalog.broker.controller.state).
    `metalog storage upgrade` turns each old FenceBroker into one so that an
    old log replays to the same state; new logs hold Kafka's FenceBroker plus
    the explicit PartitionChange records Kafka's controller writes."""

    id: int
    epoch: int


class UnfenceBroker(_Rec, frozen=True):
    id: int
    epoch: int


class RemoveTopic(_Rec, frozen=True):
    topic_id: str


class FeatureLevel(_Rec, frozen=True):
    name: str
    feature_level: int  # 0 removes the feature


class AccessControlEntry(_Rec, frozen=True):
    """Kafka's AccessControlEntryRecord; the codes are Kafka's (see metalog.broker.controller.acl)."""

    id: str  # uuid, as text: what a RemoveAccessControlEntry names
    resource_type: int  # 2 topic, 4 cluster
    resource_name: str
    pattern_type: int  # 3 literal, 4 prefixed
    principal: str  # "User:alice", "Node:2", "User:*"
    host: str  # "*" or an IP address
    operation: int  # 2 All, 3 Read, 4 Write, 7 Alter, 8 Describe, ...
    permission_type: int  # 2 deny, 3 allow


class RemoveAccessControlEntry(_Rec, frozen=True):
    id: str


class NoOp(_Rec, frozen=True):
    pass


class ProducerState(_Rec, frozen=True):
    """One producer's idempotence state, in controller snapshots only
    (metalog.storage.producer_state). Batches are (first_seq, last_seq, base_offset,
    last_offset, leader_epoch), oldest first."""

    producer_id: int
    producer_epoch: int
    last_timestamp_ms: int
    batches: tuple[tuple[int, int, int, int, int], ...] = ()


class UnknownRecord(_Rec, frozen=True):
    """A framed record of a type this build does not model (a Kafka type such
    as ProducerIds 15 or RegisterController 27): kept whole so that
    replay counts it by type and dump shows it, never dropped or guessed at."""

    api_key: int
    version: int
    raw: bytes  # the body, after the frame


MetadataRecord = Union[
    RegisterBroker, UnregisterBroker, Topic, Partition, Config, PartitionChange,
    FenceBroker, UnfenceBroker, RemoveTopic, FeatureLevel, AccessControlEntry,
    RemoveAccessControlEntry, NoOp, ProducerState, FenceBrokerImplicit, BrokerRegistrationChange, UnknownRecord,
]

# Kafka's metadata record types by api key (its metadata/*.json), with the
# highest version Kafka defines: names for the ones we do not model.
KAFKA_RECORD_NAMES: dict[int, str] = {
    0: "RegisterBroker", 1: "UnregisterBroker", 2: "Topic", 3: "Partition", 4: "Config",
    5: "PartitionChange", 7: "FenceBroker", 8: "UnfenceBroker", 9: "RemoveTopic",
    10: "DelegationToken", 11: "UserScramCredential", 12: "FeatureLevel", 14: "ClientQuota",
    15: "ProducerIds", 17: "BrokerRegistrationChange", 18: "AccessControlEntry",
    19: "RemoveAccessControlEntry", 20: "NoOp", 21: "ZkMigration", 22: "RemoveUserScramCredential",
    23: "BeginTransaction", 24: "EndTransaction", 25: "AbortTransaction",
    26: "RemoveDelegationToken", 27: "RegisterController",
}
FRAME_VERSION = 1


class MetadataRecordError(ValueError):
    """A record value we cannot decode: bad frame, unknown version, bad body."""


# ----------------------------------------------------------------- primitives

_I8 = struct.Struct(">b")
_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_I64 = struct.Struct(">q")
_I32_I64 = struct.Struct(">iq")
_I32_UUID = struct.Struct(">i16s")
_I32X3 = struct.Struct(">iii")
_U16_I16 = struct.Struct(">Hh")


# Topic ids repeat in nearly every partition record: both conversions are
# memoized (which also shares one str per topic id across a 2M-partition
# state). Bounded: cleared when full.
_UUID_CACHE_MAX = 1 << 16
_uuid_text_cache: dict[bytes, str] = {}
_uuid_bytes_cache: dict[str, bytes] = {}


def uuid_bytes(text: str) -> bytes:
    """Canonical uuid text to Kafka's 16 bytes (Kafka's ZERO_UUID is
    "00000000-0000-0000-0000-000000000000", like any other)."""
    raw = _uuid_bytes_cache.get(text)
    if raw is not None:
        return raw
    if len(text) != 36 or text[8] != "-" or text[13] != "-" or text[18] != "-" or text[23] != "-":
        raise ValueError(f"not a uuid: {text!r} (want the 36-character hyphenated form)")
    try:
        raw = bytes.fromhex(text[:8] + text[9:13] + text[14:18] + text[19:23] + text[24:])
    except ValueError:
        raise ValueError(f"not a uuid: {text!r}") from None
    if uuid_text(raw) != text:  # upper case, or whitespace fromhex skipped: not canonical
        raise ValueError(f"not a uuid: {text!r} (want lower-case hex)")
    if len(_uuid_bytes_cache) >= _UUID_CACHE_MAX:
        _uuid_bytes_cache.clear()
    _uuid_bytes_cache[text] = raw
    return raw


def uuid_text(raw: bytes) -> str:
    text = _uuid_text_cache.get(raw)
    if text is not None:
        return text
    if len(raw) != 16:
        raise IndexError("uuid runs past the end")
    h = raw.hex()
    text = f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
    if len(_uuid_text_cache) >= _UUID_CACHE_MAX:
        _uuid_text_cache.clear()
    _uuid_text_cache[raw] = text
    return text


# Struct per small array length: ">{n}i" formatted once, not per record.
_I32_ARRAYS = [struct.Struct(f">{n}i") for n in range(127)]

# Replica lists repeat across partitions (an assignment spreads a topic's
# partitions over a few broker orders) and an ISR usually equals its replica
# list: decoding returns one shared tuple per distinct list, which at 2M
# partitions saves two tuples (2 x 64 bytes) per partition. Bounded: cleared
# when full (a state of all-distinct lists just stops sharing).
_TUPLE_CACHE_MAX = 1 << 16
_tuple_cache: dict[tuple[int, ...], tuple[int, ...]] = {}


def shared_ints(t: tuple[int, ...]) -> tuple[int, ...]:
    """The one shared tuple equal to `t` (see _tuple_cache)."""
    got = _tuple_cache.get(t)
    if got is not None:
        return got
    if len(_tuple_cache) >= _TUPLE_CACHE_MAX:
        _tuple_cache.clear()
    _tuple_cache[t] = t
    return t


def _w_uv(out: bytearray, v: int) -> None:
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)


def _w_str(out: bytearray, s: str) -> None:
    raw = s.encode()
    _w_uv(out, len(raw) + 1)
    out += raw


def _w_nstr(out: bytearray, s: str | None) -> None:
    if s is None:
        out.append(0)
    else:
        _w_str(out, s)


def _w_i32s(out: bytearray, xs: Sequence[int]) -> None:
    n = len(xs)
    if n < 126:
        out.append(n + 1)
        out += _I32_ARRAYS[n].pack(*xs)
    else:
        _w_uv(out, n + 1)
        out += struct.pack(f">{n}i", *xs)


def _uv(buf: bytes, pos: int) -> tuple[int, int]:
    b = buf[pos]
    if b < 0x80:
        return b, pos + 1
    v, shift = b & 0x7F, 7
    while True:
        pos += 1
        b = buf[pos]
        v |= (b & 0x7F) << shift
        if b < 0x80:
            return v, pos + 1
        shift += 7
        if shift > 28:
            raise MetadataRecordError(f"unsigned varint too long at byte {pos}")


def _str(buf: bytes, pos: int) -> tuple[str, int]:
    n, pos = _uv(buf, pos)
    if n == 0:
        raise MetadataRecordError(f"null string at byte {pos - 1} where the schema has a non-null one")
    end = pos + n - 1
    if end > len(buf):
        raise IndexError("string runs past the end")
    return buf[pos:end].decode(), end


def _nstr(buf: bytes, pos: int) -> tuple[str | None, int]:
    if buf[pos] == 0:
        return None, pos + 1
    return _str(buf, pos)


def _i32s(buf: bytes, pos: int) -> tuple[tuple[int, ...], int]:
    n = buf[pos]
    if 0 < n < 0x80:  # an array of up to 126 elements: one length byte
        return _I32_ARRAYS[n - 1].unpack_from(buf, pos + 1), pos + 4 * n - 3
    n, pos = _uv(buf, pos)
    if n == 0:
        raise MetadataRecordError(f"null array at byte {pos - 1} where the schema has a non-null one")
    n -= 1
    end = pos + 4 * n
    if end > len(buf):
        raise IndexError("array runs past the end")
    return struct.unpack_from(f">{n}i", buf, pos), end


def _ni32s(buf: bytes, pos: int) -> tuple[tuple[int, ...] | None, int]:
    if buf[pos] == 0:
        return None, pos + 1
    return _i32s(buf, pos)


def _tags(buf: bytes, pos: int) -> tuple[dict[int, bytes], int]:
    """The tagged-field section: {tag: raw bytes}."""
    n, pos = _uv(buf, pos)
    if n == 0:
        return {}, pos
    out = {}
    for _ in range(n):
        tag, pos = _uv(buf, pos)
        size, pos = _uv(buf, pos)
        end = pos + size
        if end > len(buf):
            raise IndexError("tagged field runs past the end")
        out[tag] = buf[pos:end]
        pos = end
    return out, pos


def _skip_tags(buf: bytes, pos: int) -> int:
    if buf[pos] == 0:
        return pos + 1
    return _tags(buf, pos)[1]


def _w_tag(out: bytearray, tag: int, raw: bytes) -> None:
    _w_uv(out, tag)
    _w_uv(out, len(raw))
    out += raw


def _i32s_bytes(xs: Sequence[int]) -> bytes:
    out = bytearray()
    _w_i32s(out, xs)
    return bytes(out)


# The record types one body decoder serves (each constructor takes the same fields).
_BrokerEpochRec = TypeVar("_BrokerEpochRec", UnregisterBroker, FenceBroker, UnfenceBroker, FenceBrokerImplicit)
_UuidRec = TypeVar("_UuidRec", RemoveTopic, RemoveAccessControlEntry)
_R_co = TypeVar("_R_co", covariant=True)


class _Decoder(Protocol[_R_co]):
    """Reads a body of `version` at `pos`: the record and where it ends."""

    def __call__(self, buf: bytes, pos: int, version: int, /) -> tuple[_R_co, int]: ...


# An encoder appends the body of the one record type its _CODECS row names;
# a table of them can only say "some record" for the argument.
_Encoder = Callable[[bytearray, Any], None]


# ------------------------------------------------------------ per-type bodies
# Each encoder appends version-0 bytes to `out`; each decoder reads the body of
# any version up to the highest Kafka defines and returns (record, end).


def _enc_register_broker(out: bytearray, rec: RegisterBroker) -> None:
    # RegisterBrokerRecord v0: BrokerId, IncarnationId, BrokerEpoch, EndPoints
    # [Name, Host, Port u16, SecurityProtocol i16], Features [], Rack?, Fenced;
    # v3 (with log_dirs, see encode_record): IsMigratingZkBroker after BrokerId,
    # InControlledShutdown after Fenced, LogDirs as tag 0.
    v3 = bool(rec.log_dirs)
    out += _I32.pack(rec.broker_id)
    if v3:
        out.append(0)  # IsMigratingZkBroker
    out += uuid_bytes(rec.incarnation_id)
    out += _I64.pack(rec.broker_epoch)
    _w_uv(out, len(rec.endpoints) + 1)
    for ep in rec.endpoints:
        _w_str(out, ep.name)
        _w_str(out, ep.host)
        out += _U16_I16.pack(ep.port, ep.protocol_id())
        out.append(0)
    out.append(1)  # no features (compact array of 0)
    _w_nstr(out, rec.rack)
    out.append(1 if rec.fenced else 0)
    if not v3:
        out.append(0)
        return
    out.append(0)  # InControlledShutdown
    dirs = bytearray()
    _w_uv(dirs, len(rec.log_dirs) + 1)
    for d in rec.log_dirs:
        dirs += uuid_bytes(d)
    out.append(1)
    _w_tag(out, 0, bytes(dirs))


def _dec_register_broker(buf: bytes, pos: int, version: int) -> tuple[RegisterBroker, int]:
    (broker_id,) = _I32.unpack_from(buf, pos)
    pos += 4
    if version >= 2:
        pos += 1  # IsMigratingZkBroker
    incarnation = uuid_text(buf[pos:pos + 16])
    (epoch,) = _I64.unpack_from(buf, pos + 16)
    pos += 24
    n, pos = _uv(buf, pos)
    eps = []
    for _ in range(n - 1):
        name, pos = _str(buf, pos)
        host, pos = _str(buf, pos)
        port, proto = _U16_I16.unpack_from(buf, pos)
        pos = _skip_tags(buf, pos + 4)
        if proto == SECURITY_PROTOCOLS.get(name.upper(), 0):
            proto = -1  # derived from the name: keeps records equal across a round trip
        eps.append(Endpoint(name, host, port, proto))
    n, pos = _uv(buf, pos)
    for _ in range(n - 1):  # Features: supported ranges, which we do not model
        _, pos = _str(buf, pos)
        pos = _skip_tags(buf, pos + 4)
    rack, pos = _nstr(buf, pos)
    fenced = buf[pos] != 0
    pos += 1
    if version >= 1:
        pos += 1  # InControlledShutdown
    # v3: LogDirs (tag 0); v4 (Kafka 4.3): CordonedLogDirs (tag 1, skipped).
    tags, pos = _tags(buf, pos)
    raw = tags.get(0)
    dirs: tuple[str, ...] = ()
    if raw is not None:
        count, at = _uv(raw, 0)
        dirs = tuple(uuid_text(raw[at + 16 * i:at + 16 * (i + 1)]) for i in range(count - 1))
    return RegisterBroker(broker_id, incarnation, epoch, tuple(eps), rack, fenced, dirs), pos


def _enc_broker_epoch(out: bytearray, rec: UnregisterBroker | FenceBroker | UnfenceBroker | FenceBrokerImplicit) -> None:
    # UnregisterBroker / FenceBroker / UnfenceBroker v0: int32, int64.
    if isinstance(rec, UnregisterBroker):
        out += _I32_I64.pack(rec.broker_id, rec.broker_epoch)
    else:
        out += _I32_I64.pack(rec.id, rec.epoch)
    out.append(0)


def _dec_broker_epoch(cls: type[_BrokerEpochRec]) -> _Decoder[_BrokerEpochRec]:
    def dec(buf: bytes, pos: int, version: int) -> tuple[_BrokerEpochRec, int]:
        a, e = _I32_I64.unpack_from(buf, pos)
        return cls(a, e), _skip_tags(buf, pos + 12)
    return dec


def _enc_broker_registration_change(out: bytearray, rec: BrokerRegistrationChange) -> None:
    # v0: BrokerId, BrokerEpoch, Fenced int8 as tag 0 when not 0. InControlledShutdown
    # is a v1 field (tag 1): version 0 cannot carry it, as Kafka's writer refuses it there.
    if rec.in_controlled_shutdown:
        raise ValueError("BrokerRegistrationChange v0 cannot carry InControlledShutdown")
    out += _I32_I64.pack(rec.broker_id, rec.broker_epoch)
    if rec.fenced:
        out.append(1)
        _w_tag(out, 0, _I8.pack(rec.fenced))
    else:
        out.append(0)


def _dec_broker_registration_change(buf: bytes, pos: int, version: int) -> tuple[BrokerRegistrationChange, int]:
    # Tags: 0 Fenced int8, 1 InControlledShutdown int8 (v1+), 2 LogDirs (v2+), 3 CordonedLogDirs (v3+).
    broker_id, epoch = _I32_I64.unpack_from(buf, pos)
    tags, end = _tags(buf, pos + 12)
    fenced = _I8.unpack(tags[0])[0] if 0 in tags else 0
    shutdown = _I8.unpack(tags[1])[0] if 1 in tags else 0
    return BrokerRegistrationChange(broker_id, epoch, fenced, shutdown), end


def _enc_topic(out: bytearray, rec: Topic) -> None:
    _w_str(out, rec.name)
    out += uuid_bytes(rec.topic_id)
    out.append(0)


def _dec_topic(buf: bytes, pos: int, version: int) -> tuple[Topic, int]:
    name, pos = _str(buf, pos)
    tid = uuid_text(buf[pos:pos + 16])
    if pos + 16 > len(buf):
        raise IndexError("uuid runs past the end")
    return Topic(name, tid), _skip_tags(buf, pos + 16)


def _enc_partition(out: bytearray, rec: Partition) -> None:
    # PartitionRecord v0: PartitionId, TopicId, Replicas, Isr, RemovingReplicas,
    # AddingReplicas, Leader, LeaderEpoch, PartitionEpoch; LeaderRecoveryState
    # (tag 0) left at its default (RECOVERED).
    out += _I32_UUID.pack(rec.partition_id, uuid_bytes(rec.topic_id))
    _w_i32s(out, rec.replicas)
    _w_i32s(out, rec.isr)
    out += b"\x01\x01"  # no removing, no adding replicas
    out += _I32X3.pack(rec.leader, rec.leader_epoch, rec.partition_epoch)
    out.append(0)


def _dec_partition(buf: bytes, pos: int, version: int) -> tuple[Partition, int]:
    # The hot path of replay and snapshot load: the common shape (arrays under
    # 127 elements, empty removing/adding, no tagged fields) read inline.
    pid, raw_tid = _I32_UUID.unpack_from(buf, pos)
    pos += 20
    n = buf[pos]
    if 0 < n < 0x80:
        replicas = _I32_ARRAYS[n - 1].unpack_from(buf, pos + 1)
        pos += 4 * n - 3
    else:
        replicas, pos = _i32s(buf, pos)
    n = buf[pos]
    if 0 < n < 0x80:
        isr = _I32_ARRAYS[n - 1].unpack_from(buf, pos + 1)
        pos += 4 * n - 3
    else:
        isr, pos = _i32s(buf, pos)
    if buf[pos] == 1 and buf[pos + 1] == 1:
        pos += 2
    else:
        _, pos = _i32s(buf, pos)  # RemovingReplicas: reassignment, not modelled
        _, pos = _i32s(buf, pos)  # AddingReplicas
    leader, leader_epoch, partition_epoch = _I32X3.unpack_from(buf, pos)
    pos += 12
    if version >= 1:  # Directories []uuid (KIP-858)
        n, pos = _uv(buf, pos)
        pos += 16 * (n - 1)
    pos = pos + 1 if buf[pos] == 0 else _tags(buf, pos)[1]
    replicas = _tuple_cache.get(replicas) or shared_ints(replicas)
    isr = replicas if isr == replicas else (_tuple_cache.get(isr) or shared_ints(isr))
    return Partition(uuid_text(raw_tid), pid, replicas, isr, leader, leader_epoch, partition_epoch), pos


def _enc_partition_change(out: bytearray, rec: PartitionChange) -> None:
    # PartitionChangeRecord v0: PartitionId, TopicId, then tagged fields in tag
    # order, each written only when not at its default: Isr (0, null),
    # Leader (1, -2), Replicas (2, null).
    out += _I32_UUID.pack(rec.partition_id, uuid_bytes(rec.topic_id))
    tags = []
    if rec.isr is not None:
        tags.append((0, _i32s_bytes(rec.isr)))
    if rec.leader != LEADER_NO_CHANGE:
        tags.append((1, _I32.pack(rec.leader)))
    if rec.replicas is not None:
        tags.append((2, _i32s_bytes(rec.replicas)))
    _w_uv(out, len(tags))
    for tag, raw in tags:
        _w_tag(out, tag, raw)


def _tag_i32s(raw: bytes, what: str) -> tuple[int, ...] | None:
    value, end = _ni32s(raw, 0)
    if end != len(raw):
        raise MetadataRecordError(f"tagged field {what} has {len(raw) - end} trailing byte(s)")
    return value


def _dec_partition_change(buf: bytes, pos: int, version: int) -> tuple[PartitionChange, int]:
    pid, raw_tid = _I32_UUID.unpack_from(buf, pos)
    pos += 20
    isr = replicas = None
    leader = LEADER_NO_CHANGE
    count = buf[pos]
    if count == 1 and buf[pos + 1] == 1 and buf[pos + 2] == 4:  # only Leader: the common change
        (leader,) = _I32.unpack_from(buf, pos + 3)
        return PartitionChange(uuid_text(raw_tid), pid, None, leader, None), pos + 7
    tags, pos = _tags(buf, pos)
    if tags:
        if 0 in tags:
            isr = _tag_i32s(tags[0], "Isr")
        if 1 in tags:
            if len(tags[1]) != 4:
                raise MetadataRecordError(f"tagged field Leader of {len(tags[1])} bytes (expected 4)")
            (leader,) = _I32.unpack(tags[1])
        if 2 in tags:
            replicas = _tag_i32s(tags[2], "Replicas")
    return PartitionChange(uuid_text(raw_tid), pid, isr, leader, replicas), pos


def _enc_config(out: bytearray, rec: Config) -> None:
    out += _I8.pack(rec.resource_type)
    _w_str(out, rec.resource_name)
    _w_str(out, rec.name)
    _w_nstr(out, rec.value)
    out.append(0)


def _dec_config(buf: bytes, pos: int, version: int) -> tuple[Config, int]:
    (rtype,) = _I8.unpack_from(buf, pos)
    rname, pos = _str(buf, pos + 1)
    name, pos = _str(buf, pos)
    value, pos = _nstr(buf, pos)
    return Config(rtype, rname, name, value), _skip_tags(buf, pos)


def _enc_remove_topic(out: bytearray, rec: RemoveTopic) -> None:
    out += uuid_bytes(rec.topic_id)
    out.append(0)


def _dec_uuid_only(cls: type[_UuidRec]) -> _Decoder[_UuidRec]:
    def dec(buf: bytes, pos: int, version: int) -> tuple[_UuidRec, int]:
        if pos + 16 > len(buf):
            raise IndexError("uuid runs past the end")
        return cls(uuid_text(buf[pos:pos + 16])), _skip_tags(buf, pos + 16)
    return dec


def _enc_feature_level(out: bytearray, rec: FeatureLevel) -> None:
    _w_str(out, rec.name)
    out += _I16.pack(rec.feature_level)
    out.append(0)


def _dec_feature_level(buf: bytes, pos: int, version: int) -> tuple[FeatureLevel, int]:
    name, pos = _str(buf, pos)
    (level,) = _I16.unpack_from(buf, pos)
    return FeatureLevel(name, level), _skip_tags(buf, pos + 2)


def _enc_acl(out: bytearray, rec: AccessControlEntry) -> None:
    # AccessControlEntryRecord v0: Id, ResourceType i8, ResourceName, PatternType i8,
    # Principal, Host, Operation i8, PermissionType i8.
    out += uuid_bytes(rec.id)
    out += _I8.pack(rec.resource_type)
    _w_str(out, rec.resource_name)
    out += _I8.pack(rec.pattern_type)
    _w_str(out, rec.principal)
    _w_str(out, rec.host)
    out += struct.pack(">bb", rec.operation, rec.permission_type)
    out.append(0)


def _dec_acl(buf: bytes, pos: int, version: int) -> tuple[AccessControlEntry, int]:
    if pos + 17 > len(buf):
        raise IndexError("uuid runs past the end")
    acl_id = uuid_text(buf[pos:pos + 16])
    (rtype,) = _I8.unpack_from(buf, pos + 16)
    rname, pos = _str(buf, pos + 17)
    (pattern,) = _I8.unpack_from(buf, pos)
    principal, pos = _str(buf, pos + 1)
    host, pos = _str(buf, pos)
    op, perm = struct.unpack_from(">bb", buf, pos)
    return (AccessControlEntry(acl_id, rtype, rname, pattern, principal, host, op, perm),
            _skip_tags(buf, pos + 2))


def _enc_remove_acl(out: bytearray, rec: RemoveAccessControlEntry) -> None:
    out += uuid_bytes(rec.id)
    out.append(0)


def _enc_no_op(out: bytearray, rec: NoOp) -> None:
    out.append(0)


_PRODUCER_HEAD = struct.Struct(">qhq")
_PRODUCER_BATCH = struct.Struct(">iiqqi")


def _enc_producer_state_body(out: bytearray, rec: ProducerState) -> None:
    # metalog's own, in Kafka's flexible style: ProducerId i64, ProducerEpoch
    # i16, LastTimestampMs i64, Batches [FirstSeq i32, LastSeq i32, BaseOffset
    # i64, LastOffset i64, LeaderEpoch i32], a (empty) tag section per struct.
    out += _PRODUCER_HEAD.pack(rec.producer_id, rec.producer_epoch, rec.last_timestamp_ms)
    _w_uv(out, len(rec.batches) + 1)
    for meta in rec.batches:
        out += _PRODUCER_BATCH.pack(*meta)
        out.append(0)
    out.append(0)


def _enc_producer_state(out: bytearray, rec: ProducerState) -> None:
    # NoOpRecord v0 has no fields: its body is its tag section, here one
    # field, PRODUCER_STATE_TAG, whose bytes are the ProducerState body.
    body = bytearray()
    _enc_producer_state_body(body, rec)
    out.append(1)
    _w_tag(out, PRODUCER_STATE_TAG, bytes(body))


def _dec_producer_state(buf: bytes, pos: int, version: int) -> tuple[ProducerState, int]:
    pid, epoch, ts = _PRODUCER_HEAD.unpack_from(buf, pos)
    n, pos = _uv(buf, pos + _PRODUCER_HEAD.size)
    batches = []
    for _ in range(n - 1):
        batches.append(_PRODUCER_BATCH.unpack_from(buf, pos))
        pos = _skip_tags(buf, pos + _PRODUCER_BATCH.size)
    return ProducerState(pid, epoch, ts, tuple(batches)), _skip_tags(buf, pos)


def _dec_no_op(buf: bytes, pos: int, version: int) -> tuple[NoOp | ProducerState, int]:
    """A NoOp, or the ProducerState one carries in its PRODUCER_STATE_TAG field
    (other tags, Kafka's or anyone's, are skipped as Kafka skips them)."""
    if buf[pos] == 0:
        return NoOp(), pos + 1
    tags, end = _tags(buf, pos)
    raw = tags.get(PRODUCER_STATE_TAG)
    if raw is None:
        return NoOp(), end
    rec, used = _dec_producer_state(raw, 0, 0)
    if used != len(raw):
        raise MetadataRecordError(f"ProducerState in NoOp tag {PRODUCER_STATE_TAG}: "
                                  f"{len(raw) - used} byte(s) after its body")
    return rec, end


# api key -> (class, highest version we can decode, encoder, decoder). The
# highest versions are Kafka's (metadata/*.json validVersions).
_CODECS: dict[int, tuple[type[_Rec], int, _Encoder, _Decoder[MetadataRecord]]] = {
    REGISTER_BROKER: (RegisterBroker, 4, _enc_register_broker, _dec_register_broker),
    UNREGISTER_BROKER: (UnregisterBroker, 0, _enc_broker_epoch, _dec_broker_epoch(UnregisterBroker)),
    TOPIC: (Topic, 0, _enc_topic, _dec_topic),
    PARTITION: (Partition, 2, _enc_partition, _dec_partition),
    CONFIG: (Config, 0, _enc_config, _dec_config),
    PARTITION_CHANGE: (PartitionChange, 2, _enc_partition_change, _dec_partition_change),
    FENCE_BROKER: (FenceBroker, 0, _enc_broker_epoch, _dec_broker_epoch(FenceBroker)),
    UNFENCE_BROKER: (UnfenceBroker, 0, _enc_broker_epoch, _dec_broker_epoch(UnfenceBroker)),
    REMOVE_TOPIC: (RemoveTopic, 0, _enc_remove_topic, _dec_uuid_only(RemoveTopic)),
    FEATURE_LEVEL: (FeatureLevel, 0, _enc_feature_level, _dec_feature_level),
    ACCESS_CONTROL_ENTRY: (AccessControlEntry, 0, _enc_acl, _dec_acl),
    REMOVE_ACCESS_CONTROL_ENTRY: (RemoveAccessControlEntry, 0, _enc_remove_acl,
                                  _dec_uuid_only(RemoveAccessControlEntry)),
    NO_OP: (NoOp, 0, _enc_no_op, _dec_no_op),
    # Read only (old snapshots): ProducerState is written as a NoOp (API_KEY_OF).
    LEGACY_PRODUCER_STATE: (ProducerState, 0, _enc_producer_state, _dec_producer_state),
    # FenceBroker's body under our own key.
    BROKER_REGISTRATION_CHANGE: (BrokerRegistrationChange, 3, _enc_broker_registration_change,
                                 _dec_broker_registration_change),
    FENCE_BROKER_IMPLICIT: (FenceBrokerImplicit, 0, _enc_broker_epoch, _dec_broker_epoch(FenceBrokerImplicit)),
}
RECORD_TYPES: dict[int, tuple[type[_Rec], int]] = {k: (c[0], c[1]) for k, c in _CODECS.items()}
# The key each type is written under: its own, but ProducerState rides in a NoOp.
API_KEY_OF: dict[type, int] = {c[0]: k for k, c in _CODECS.items() if k != LEGACY_PRODUCER_STATE}
API_KEY_OF[ProducerState] = NO_OP


def _frame(api_key: int, version: int) -> bytes:
    out = bytearray()
    _w_uv(out, FRAME_VERSION)
    _w_uv(out, api_key)
    _w_uv(out, version)
    return bytes(out)


# class -> (frame prefix, encoder)
_ENCODERS = {c[0]: (_frame(API_KEY_OF[c[0]], 0), c[2]) for k, c in _CODECS.items()}
# 3-byte frame prefix (frame 1, key < 128, version < 128) -> (class, decoder, version)
_FAST = {bytes((FRAME_VERSION, k, v)): (c[0], c[3], v)
         for k, c in _CODECS.items() if k < 0x80 for v in range(c[1] + 1)}
_DECODE_ERRORS = (IndexError, struct.error, UnicodeDecodeError, ValueError)


def record_type_name(api_key: int) -> str:
    entry = _CODECS.get(api_key)
    if entry is not None:
        return entry[0].__name__
    name = KAFKA_RECORD_NAMES.get(api_key)
    return name if name else f"unknown({api_key})"


def type_name(rec: MetadataRecord) -> str:
    """The record's type name; an UnknownRecord's is Kafka's name for its key."""
    if type(rec) is UnknownRecord:
        return record_type_name(rec.api_key)
    return type(rec).__name__


def encode_record(rec: MetadataRecord) -> bytes:
    """Kafka's ApiMessageAndVersion bytes of `rec` (version 0 of its type).
    ValueError if an id that must be a uuid is not one."""
    if type(rec) is UnknownRecord:
        return _frame(rec.api_key, rec.version) + rec.raw
    entry = _ENCODERS.get(type(rec))
    if entry is None:
        raise TypeError(f"not a metadata record: {type(rec).__name__}")
    prefix, enc = entry
    if type(rec) is RegisterBroker and rec.log_dirs:
        prefix = _frame(REGISTER_BROKER, 3)  # LogDirs is a v3 field
    out = bytearray(prefix)
    enc(out, rec)
    return bytes(out)


def decode_frame(value: bytes) -> tuple[int, int, int]:
    """(api key, version, body position) of a framed value; MetadataRecordError
    if it is not an ApiMessageAndVersion frame (e.g. a produced record)."""
    try:
        frame, pos = _uv(value, 0)
        if frame != FRAME_VERSION:
            raise MetadataRecordError(
                f"not a metadata record: frame version {frame} (only {FRAME_VERSION} exists)")
        api_key, pos = _uv(value, pos)
        version, pos = _uv(value, pos)
    except IndexError:
        raise MetadataRecordError(
            f"metadata record of {len(value)} bytes ends inside its frame") from None
    if api_key > 0x7FFF or version > 0x7FFF:
        raise MetadataRecordError(f"metadata record frame with api key {api_key} version {version} "
                                  "(both must fit an int16)")
    return api_key, version, pos


def decode_record(value: bytes | memoryview) -> MetadataRecord:
    if type(value) is not bytes:
        value = bytes(value)
    fast = _FAST.get(value[:3])
    if fast is not None:
        cls, dec, version = fast
        pos = 3
    else:
        api_key, version, pos = decode_frame(value)
        entry = _CODECS.get(api_key)
        if entry is None:
            return UnknownRecord(api_key, version, value[pos:])
        cls, top, _, dec = entry
        if version > top:
            raise MetadataRecordError(
                f"unsupported version {version} of {cls.__name__} (api key {api_key}); "
                f"this build reads versions 0..{top}")
    try:
        rec, end = dec(value, pos, version)
    except MetadataRecordError as exc:
        raise MetadataRecordError(f"undecodable {cls.__name__} v{version} record: {exc}") from None
    except _DECODE_ERRORS as exc:
        raise MetadataRecordError(
            f"undecodable {cls.__name__} v{version} record: {type(exc).__name__}: {exc}") from None
    if end != len(value):
        raise MetadataRecordError(
            f"undecodable {cls.__name__} v{version} record: {len(value) - end} byte(s) after the body")
    return rec


def record_to_dict(rec: MetadataRecord) -> dict[str, Any]:
    """Fields by name (for dumps and JSON); an UnknownRecord's body as hex."""
    if type(rec) is UnknownRecord:
        return {"api_key": rec.api_key, "version": rec.version, "raw": rec.raw.hex()}
    fields: dict[str, Any] = msgspec.to_builtins(msgspec.structs.asdict(rec))
    return fields
