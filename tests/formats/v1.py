"""Format version 1 files, written the way builds before issue 17 wrote them:
the same v2 batch header, records framed ``u32 length | value``, control
records ``type i16 | version i16 | body`` with msgpack array bodies for
LeaderChange, SnapshotHeader and SnapshotFooter. Only for the upgrade tests."""

from __future__ import annotations

import struct

import crc32c
import msgspec

from metalog.storage import batch as b


def v1_batch(base_offset: int, epoch: int, values: list[bytes], ts: int, control: bool = False) -> bytes:
    body = b"".join(struct.pack(">I", len(v)) + v for v in values)
    n = len(values)
    header = bytearray(b.HEADER.pack(base_offset, b.HEADER_SIZE - b.LOG_OVERHEAD + len(body), epoch, 2, 0,
                                     b.ATTR_CONTROL if control else 0, n - 1, ts, ts, -1, -1, -1, n))
    crc = crc32c.crc32c(body, crc32c.crc32c(bytes(header[b.CRC_START:])))
    struct.pack_into(">I", header, b.CRC_OFFSET, crc)
    return bytes(header) + body


def v1_control(rtype: int, *fields) -> bytes:
    return struct.pack(">hh", rtype, 0) + msgspec.msgpack.encode(list(fields))


# Metadata record values of format versions 1 and 2: api key i16 | version i16
# (0) | msgpack array of the fields, with ACLs under keys 6 and 16.
_V2_KEYS = {"RegisterBroker": 0, "UnregisterBroker": 1, "Topic": 2, "Partition": 3, "Config": 4,
            "PartitionChange": 5, "AccessControlEntry": 6, "FenceBroker": 7, "UnfenceBroker": 8,
            "RemoveTopic": 9, "FeatureLevel": 12, "RemoveAccessControlEntry": 16, "NoOp": 20,
            "ProducerState": 1000}


def v2_metadata_value(rec) -> bytes:
    """`rec` as builds of format versions 1 and 2 wrote it (an Endpoint had 3 fields)."""
    fields = msgspec.to_builtins(rec)
    if type(rec).__name__ == "RegisterBroker":
        fields[3] = [ep[:3] for ep in fields[3]]
    return struct.pack(">hh", _V2_KEYS[type(rec).__name__], 0) + msgspec.msgpack.encode(fields)
