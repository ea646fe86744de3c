"""Control records: LeaderChange (2), SnapshotHeader (3), SnapshotFooter (4).

A control record lives alone in a batch whose control bit is set
(``storage.batch.ATTR_CONTROL``). Its value is ``type i16 | version i16`` and
then a msgpack array with the fields below. Data batches never hold control
records, so consumers and the controller skip control batches by the header
bit alone.
"""

from __future__ import annotations

import struct

import msgspec

LEADER_CHANGE = 2
SNAPSHOT_HEADER = 3
SNAPSHOT_FOOTER = 4

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


_TYPES: dict[int, type[msgspec.Struct]] = {
    LEADER_CHANGE: LeaderChange,
    SNAPSHOT_HEADER: SnapshotHeader,
    SNAPSHOT_FOOTER: SnapshotFooter,
}
_TYPE_OF = {cls: key for key, cls in _TYPES.items()}
_ENCODER = msgspec.msgpack.Encoder()


class ControlRecordError(ValueError):
    pass


def encode_control(record: LeaderChange | SnapshotHeader | SnapshotFooter, version: int = 0) -> bytes:
    return _PREFIX.pack(_TYPE_OF[type(record)], version) + _ENCODER.encode(record)


def decode_control(value: bytes) -> LeaderChange | SnapshotHeader | SnapshotFooter:
    if len(value) < _PREFIX.size:
        raise ControlRecordError(f"control record of {len(value)} bytes is too short")
    rtype, version = _PREFIX.unpack_from(value)
    cls = _TYPES.get(rtype)
    if cls is None:
        raise ControlRecordError(f"unknown control record type {rtype}")
    try:
        return msgspec.msgpack.decode(value[_PREFIX.size:], type=cls)
    except msgspec.DecodeError as exc:
        raise ControlRecordError(f"undecodable control record type {rtype} v{version}: {exc}") from exc
