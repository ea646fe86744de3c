"""Kafka's "flexible version" message encoding, the primitives only.

What Kafka's generated message classes write for a flexible version (KIP-482):
fixed-width big-endian integers, uuids as 16 raw bytes, compact strings and
arrays (unsigned varint length + 1, 0 for null), and a tagged-field section
(an unsigned varint count, then tag/size/bytes) at the end of every struct.
We write no tagged fields and skip the ones we read (a newer writer's). Used
by the KRaft control records (metalog.storage.control_records: VotersRecord,
KRaftVersionRecord), whose bodies must be byte for byte what Kafka writes.
"""

from __future__ import annotations

import base64
import struct

from metalog.protocol.invariants import invariant

_I16 = struct.Struct(">h")
_U16 = struct.Struct(">H")
_I32 = struct.Struct(">i")
UUID_BYTES = 16
# Bound on what one record may claim (a corrupt length must not allocate GBs).
MAX_LENGTH = 1 << 20


class FlexibleDecodeError(ValueError):
    """The bytes are not a valid message of the expected schema."""


def uuid_to_bytes(text: str) -> bytes:
    """Kafka's Uuid string (22 chars of url-safe base64) to its 16 bytes; ""
    (unknown) is Kafka's ZERO_UUID."""
    if text == "":
        return bytes(UUID_BYTES)
    raw = base64.urlsafe_b64decode(text + "==")
    if len(raw) != UUID_BYTES:
        raise ValueError(f"not a uuid: {text!r}")
    return raw


def uuid_from_bytes(raw: bytes) -> str:
    if raw == bytes(UUID_BYTES):
        return ""
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


class Writer:
    __slots__ = ("out",)

    def __init__(self) -> None:
        self.out = bytearray()

    def int16(self, v: int) -> None:
        self.out += _I16.pack(v)

    def uint16(self, v: int) -> None:
        self.out += _U16.pack(v)

    def int32(self, v: int) -> None:
        self.out += _I32.pack(v)

    def uvarint(self, v: int) -> None:
        invariant(v >= 0, "uvarint of a negative number %d", v)
        while v >= 0x80:
            self.out.append((v & 0x7F) | 0x80)
            v >>= 7
        self.out.append(v)

    def uuid(self, text: str) -> None:
        self.out += uuid_to_bytes(text)

    def compact_string(self, s: str) -> None:
        raw = s.encode()
        self.uvarint(len(raw) + 1)
        self.out += raw

    def compact_array_length(self, n: int) -> None:
        self.uvarint(n + 1)

    def no_tagged_fields(self) -> None:
        self.uvarint(0)

    def bytes(self) -> bytes:
        return bytes(self.out)


class Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if n < 0 or end > len(self.data):
            raise FlexibleDecodeError(f"truncated: need {n} bytes at {self.pos}, have {len(self.data) - self.pos}")
        raw = self.data[self.pos:end]
        self.pos = end
        return raw

    def int16(self) -> int:
        value: int = _I16.unpack(self.take(2))[0]
        return value

    def uint16(self) -> int:
        value: int = _U16.unpack(self.take(2))[0]
        return value

    def int32(self) -> int:
        value: int = _I32.unpack(self.take(4))[0]
        return value

    def uvarint(self) -> int:
        v = shift = 0
        while True:
            b = self.take(1)[0]
            v |= (b & 0x7F) << shift
            if not b & 0x80:
                return v
            shift += 7
            if shift > 28:
                raise FlexibleDecodeError(f"unsigned varint too long at {self.pos}")

    def uuid(self) -> str:
        return uuid_from_bytes(self.take(UUID_BYTES))

    def compact_string(self) -> str:
        n = self.uvarint()
        if n == 0:
            raise FlexibleDecodeError(f"null string at {self.pos} where the schema has a non-null one")
        if n - 1 > MAX_LENGTH:
            raise FlexibleDecodeError(f"string of {n - 1} bytes at {self.pos}")
        try:
            return self.take(n - 1).decode()
        except UnicodeDecodeError as exc:
            raise FlexibleDecodeError(f"string is not UTF-8: {exc}") from None

    def compact_array_length(self) -> int:
        n = self.uvarint()
        if n == 0:
            raise FlexibleDecodeError(f"null array at {self.pos} where the schema has a non-null one")
        if n - 1 > MAX_LENGTH:
            raise FlexibleDecodeError(f"array of {n - 1} elements at {self.pos}")
        return n - 1

    def skip_tagged_fields(self) -> None:
        for _ in range(self.uvarint()):
            self.uvarint()  # tag
            self.take(self.uvarint())

    def tagged_fields(self) -> list[tuple[int, bytes]]:
        """The tagged-field section: (tag, raw bytes) each, in file order."""
        fields = []
        for _ in range(self.uvarint()):
            tag = self.uvarint()
            n = self.uvarint()
            if n > MAX_LENGTH:
                raise FlexibleDecodeError(f"tagged field of {n} bytes at {self.pos}")
            fields.append((tag, self.take(n)))
        return fields

    def end(self) -> None:
        if self.pos != len(self.data):
            raise FlexibleDecodeError(f"{len(self.data) - self.pos} bytes left after the message")
