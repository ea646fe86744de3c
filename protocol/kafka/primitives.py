"""The wire's primitive types, shared by the generated ``messages`` module.

Kafka's messages are built from a few primitives (big-endian fixed-width
integers, unsigned varints, strings, bytes, arrays, UUIDs); flexible versions
(KIP-482) use "compact" forms whose length is an unsigned varint of length + 1
(0 = null) and end every struct with a tagged-field section. The generated
code packs fixed-width integers itself with the ``struct.Struct`` objects
below; everything of variable length goes through the functions here.

Reading never copies bytes or records: they come back as ``memoryview``
slices of the frame. Every reader checks a length against the bytes left
before it slices (a memoryview slice would silently come back short) and
raises ``Malformed`` (a private ValueError) with what is wrong; the generated
``read`` turns it into a ``KafkaDecodeError`` naming the message, the field
and the byte position.
"""

from __future__ import annotations

import base64
import struct
from typing import ClassVar, Final, Self

import msgspec

from metalog.protocol.kafka.errors import KafkaDecodeError, UnsupportedVersionError

BytesLike = bytes | bytearray | memoryview

ZERO_UUID: Final = bytes(16)

I8: Final = struct.Struct(">b")
I16: Final = struct.Struct(">h")
U16: Final = struct.Struct(">H")
I32: Final = struct.Struct(">i")
U32: Final = struct.Struct(">I")
I64: Final = struct.Struct(">q")
F64: Final = struct.Struct(">d")
BOOL: Final = struct.Struct(">?")

# Kafka refuses a varint longer than 5 bytes (32-bit values) or 10 (64-bit).
_UVARINT_BYTES_MAX: Final = 5


class Malformed(ValueError):
    """Raised by the readers here; located by the generated code (never escapes it)."""


# Text forms already made: the same few directory ids arrive in every replica
# Fetch (a few per request at one client, about 1% of a leader's CPU).
# Cleared whole when full, so it stays bounded whatever a peer sends.
_UUID_TEXT: dict[bytes, str] = {}
_UUID_TEXT_MAX: Final = 1024


def uuid_to_str(raw: BytesLike) -> str:
    """Kafka's text form of a UUID: base64url without padding (22 characters)."""
    key = bytes(raw)
    text = _UUID_TEXT.get(key)
    if text is None:
        if len(_UUID_TEXT) >= _UUID_TEXT_MAX:
            _UUID_TEXT.clear()
        text = _UUID_TEXT[key] = base64.urlsafe_b64encode(key).decode("ascii").rstrip("=")
    return text


_UUID_RAW: dict[str, bytes] = {}  # the reverse of _UUID_TEXT: a follower names its directory in every Fetch


def uuid_from_str(text: str) -> bytes:
    raw = _UUID_RAW.get(text)
    if raw is not None:
        return raw
    raw = base64.urlsafe_b64decode(text + "==")
    if len(raw) != 16:
        raise ValueError(f"{text!r} is not a Kafka UUID (22 base64url characters)")
    if len(_UUID_RAW) >= _UUID_TEXT_MAX:
        _UUID_RAW.clear()
    _UUID_RAW[text] = raw
    return raw


def write_uvarint(out: bytearray, value: int) -> None:
    if value < 0x80:
        out.append(value)
        return
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def read_uvarint(buf: memoryview, pos: int) -> tuple[int, int]:
    """An unsigned 32-bit varint: (value, position after it)."""
    byte = buf[pos]
    if byte < 0x80:
        return byte, pos + 1
    value = byte & 0x7F
    shift = 7
    end = pos + _UVARINT_BYTES_MAX
    pos += 1
    while pos < end:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            if value > 0xFFFFFFFF:
                raise Malformed(f"varint {value} overflows 32 bits")
            return value, pos
        shift += 7
    raise Malformed(f"varint longer than {_UVARINT_BYTES_MAX} bytes")


def _span(buf: memoryview, pos: int, length: int, what: str) -> int:
    end = pos + length
    if end > len(buf):
        raise Malformed(f"{what} of {length} bytes runs past the frame ({len(buf) - pos} left)")
    return end


# --- strings -------------------------------------------------------------------


def write_str(out: bytearray, value: str | None) -> None:
    if value is None:
        raise UnsupportedVersionError("null in a string that is not nullable in this version")
    raw = value.encode()
    out += I16.pack(len(raw))
    out += raw


def write_nstr(out: bytearray, value: str | None) -> None:
    if value is None:
        out += b"\xff\xff"
    else:
        write_str(out, value)


def write_cstr(out: bytearray, value: str | None) -> None:
    if value is None:
        raise UnsupportedVersionError("null in a string that is not nullable in this version")
    raw = value.encode()
    write_uvarint(out, len(raw) + 1)
    out += raw


def write_ncstr(out: bytearray, value: str | None) -> None:
    if value is None:
        out.append(0)
    else:
        write_cstr(out, value)


def read_str(buf: memoryview, pos: int) -> tuple[str, int]:
    (length,) = I16.unpack_from(buf, pos)
    if length < 0:
        raise Malformed(f"null (length {length}) in a non-nullable string")
    pos += 2
    end = _span(buf, pos, length, "string")
    return str(buf[pos:end], "utf-8"), end


def read_nstr(buf: memoryview, pos: int) -> tuple[str | None, int]:
    (length,) = I16.unpack_from(buf, pos)
    if length < 0:
        return None, pos + 2
    pos += 2
    end = _span(buf, pos, length, "string")
    return str(buf[pos:end], "utf-8"), end


def read_cstr(buf: memoryview, pos: int) -> tuple[str, int]:
    length, pos = read_uvarint(buf, pos)
    if length == 0:
        raise Malformed("null in a non-nullable compact string")
    end = _span(buf, pos, length - 1, "compact string")
    return str(buf[pos:end], "utf-8"), end


def read_ncstr(buf: memoryview, pos: int) -> tuple[str | None, int]:
    length, pos = read_uvarint(buf, pos)
    if length == 0:
        return None, pos
    end = _span(buf, pos, length - 1, "compact string")
    return str(buf[pos:end], "utf-8"), end


# --- bytes and records (zero-copy on read) -----------------------------------------


def write_bytes(out: bytearray, value: BytesLike | None) -> None:
    if value is None:
        raise UnsupportedVersionError("null in bytes that are not nullable in this version")
    out += I32.pack(len(value))
    out += value


def write_nbytes(out: bytearray, value: BytesLike | None) -> None:
    if value is None:
        out += b"\xff\xff\xff\xff"
    else:
        out += I32.pack(len(value))
        out += value


def write_cbytes(out: bytearray, value: BytesLike | None) -> None:
    if value is None:
        raise UnsupportedVersionError("null in bytes that are not nullable in this version")
    write_uvarint(out, len(value) + 1)
    out += value


def write_ncbytes(out: bytearray, value: BytesLike | None) -> None:
    if value is None:
        out.append(0)
    else:
        write_uvarint(out, len(value) + 1)
        out += value


def read_bytes(buf: memoryview, pos: int) -> tuple[memoryview, int]:
    (length,) = I32.unpack_from(buf, pos)
    if length < 0:
        raise Malformed(f"null (length {length}) in non-nullable bytes")
    pos += 4
    end = _span(buf, pos, length, "bytes")
    return buf[pos:end], end


def read_nbytes(buf: memoryview, pos: int) -> tuple[memoryview | None, int]:
    (length,) = I32.unpack_from(buf, pos)
    if length < 0:
        return None, pos + 4
    pos += 4
    end = _span(buf, pos, length, "bytes")
    return buf[pos:end], end


def read_cbytes(buf: memoryview, pos: int) -> tuple[memoryview, int]:
    length, pos = read_uvarint(buf, pos)
    if length == 0:
        raise Malformed("null in non-nullable compact bytes")
    end = _span(buf, pos, length - 1, "compact bytes")
    return buf[pos:end], end


def read_ncbytes(buf: memoryview, pos: int) -> tuple[memoryview | None, int]:
    length, pos = read_uvarint(buf, pos)
    if length == 0:
        return None, pos
    end = _span(buf, pos, length - 1, "compact bytes")
    return buf[pos:end], end


def read_uuid(buf: memoryview, pos: int) -> tuple[bytes, int]:
    end = _span(buf, pos, 16, "uuid")
    return bytes(buf[pos:end]), end


def write_uuid(out: bytearray, value: BytesLike) -> None:
    if len(value) != 16:
        raise ValueError(f"a uuid is 16 bytes, not {len(value)}")
    out += value


# --- array and tagged-section lengths --------------------------------------------------


def read_count(buf: memoryview, pos: int) -> tuple[int, int]:
    """A non-nullable array's int32 length, checked against the bytes left
    (every element takes at least one byte; Kafka makes the same check)."""
    (count,) = I32.unpack_from(buf, pos)
    pos += 4
    if count < 0:
        raise Malformed(f"null (length {count}) in a non-nullable array")
    if count > len(buf) - pos:
        raise Malformed(f"array of {count} elements runs past the frame ({len(buf) - pos} bytes left)")
    return count, pos


def read_ncount(buf: memoryview, pos: int) -> tuple[int, int]:
    """A nullable array's int32 length; -1 for null."""
    (count,) = I32.unpack_from(buf, pos)
    pos += 4
    if count < 0:
        return -1, pos
    if count > len(buf) - pos:
        raise Malformed(f"array of {count} elements runs past the frame ({len(buf) - pos} bytes left)")
    return count, pos


def read_ccount(buf: memoryview, pos: int) -> tuple[int, int]:
    count, pos = read_uvarint(buf, pos)
    if count == 0:
        raise Malformed("null in a non-nullable compact array")
    count -= 1
    if count > len(buf) - pos:
        raise Malformed(f"array of {count} elements runs past the frame ({len(buf) - pos} bytes left)")
    return count, pos


def read_nccount(buf: memoryview, pos: int) -> tuple[int, int]:
    count, pos = read_uvarint(buf, pos)
    count -= 1
    if count > len(buf) - pos:
        raise Malformed(f"array of {count} elements runs past the frame ({len(buf) - pos} bytes left)")
    return count, pos


def read_tag(buf: memoryview, pos: int) -> tuple[int, int, int]:
    """One tagged field's header: (tag, start of its data, end of its data)."""
    tag, pos = read_uvarint(buf, pos)
    size, pos = read_uvarint(buf, pos)
    end = pos + size
    if end > len(buf):  # (the message is formatted only here: this runs for every tagged field read)
        raise Malformed(f"tagged field {tag} of {size} bytes runs past the frame ({len(buf) - pos} left)")
    return tag, pos, end


def read_tag_count(buf: memoryview, pos: int) -> tuple[int, int]:
    count, pos = read_uvarint(buf, pos)
    # each tagged field takes at least two bytes (tag, size)
    if 2 * count > len(buf) - pos:
        raise Malformed(f"{count} tagged fields run past the frame ({len(buf) - pos} bytes left)")
    return count, pos


def check_tag_end(pos: int, end: int, tag: int) -> None:
    if pos != end:
        raise Malformed(f"tagged field {tag} ends at byte {pos}, its size says {end}")


def write_tagged(out: bytearray, tag: int, data: bytearray) -> None:
    if tag < 0x80 and len(data) < 0x80:  # the usual tagged field: two one-byte varints, no calls
        out.append(tag)
        out.append(len(data))
    else:
        write_uvarint(out, tag)
        write_uvarint(out, len(data))
    out += data


def skip_tags(buf: memoryview, pos: int) -> int:
    """Skip a tagged-field section none of whose tags this struct knows."""
    count, pos = read_tag_count(buf, pos)
    for _ in range(count):
        _tag, _start, pos = read_tag(buf, pos)
    return pos


def null_error(where: str, version: int) -> UnsupportedVersionError:
    return UnsupportedVersionError(f"{where} is null, which version {version} cannot carry")


def unsupported(where: str, version: int) -> UnsupportedVersionError:
    return UnsupportedVersionError(f"{where} is set, which version {version} cannot carry")


class Message(msgspec.Struct, kw_only=True):
    """What every generated message and struct offers (see messages.py)."""

    API_KEY: ClassVar[int] = -1
    LOWEST_VERSION: ClassVar[int] = 0
    HIGHEST_VERSION: ClassVar[int] = 0
    FLEXIBLE_MIN_VERSION: ClassVar[int] = 1 << 15

    def write(self, out: bytearray, version: int) -> None:
        """Append this message's encoding at ``version`` to ``out``."""
        raise NotImplementedError

    @classmethod
    def read(cls, buf: memoryview, pos: int, version: int) -> tuple[Self, int]:
        """Read one message at ``pos``: (message, position after it)."""
        raise NotImplementedError

    def encode(self, version: int) -> bytes:
        self.check_version(version)
        out = bytearray()
        self.write(out, version)
        return bytes(out)

    @classmethod
    def decode(cls, data: BytesLike, version: int) -> Self:
        """The message that is the whole of ``data`` (bytes left over are an error)."""
        cls.check_version(version)
        buf = memoryview(data)
        message, pos = cls.read(buf, 0, version)
        if pos != len(buf):
            raise KafkaDecodeError(f"{cls.__name__} v{version}: {len(buf) - pos} bytes left after the body")
        return message

    @classmethod
    def check_version(cls, version: int) -> None:
        if not cls.LOWEST_VERSION <= version <= cls.HIGHEST_VERSION:
            raise UnsupportedVersionError(
                f"{cls.__name__} has versions {cls.LOWEST_VERSION}-{cls.HIGHEST_VERSION}, not {version}"
            )


def located(exc: Exception, where: str, field: str, pos: int) -> KafkaDecodeError:
    """The decode error for a fault met reading ``where``.``field`` at ``pos``."""
    if isinstance(exc, struct.error) or isinstance(exc, IndexError):
        reason = "the frame ends inside it"
    else:
        reason = str(exc)
    return KafkaDecodeError(f"{where}.{field} at byte {pos}: {reason}")
