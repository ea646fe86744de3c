"""Splitting a byte stream into Kafka's frames (sans-IO), and the errors of a broken stream.

Every message of Kafka's protocol, request or response, travels as one frame::

    frame = length i32 (big-endian) | payload (length bytes)

``FrameDecoder`` is fed the bytes a socket delivers and hands out whole
payloads; ``metalog.protocol.kafka.wire`` reads the header and body inside
one. Both broker ports (``listen``, the controller listener, and
``kafka_listen``, the client listener: ``metalog.broker.net.kafka_conn``) and
every outbound channel (``metalog.broker.net.channel``) frame this way.

A ``FrameError`` means the stream cannot be resynchronised (a negative
length, or one above ``frame_bytes_max``, the broker setting
``network.max_frame_bytes``): the only answer is to close the connection.
The announced length is checked as soon as its four bytes arrive, so a
hostile length never makes us buffer or allocate the body.
"""

from __future__ import annotations

import enum
import struct
from typing import Final

from metalog.protocol.invariants import invariant

__all__ = [
    "DEFAULT_FRAME_BYTES_MAX",
    "FrameDecoder",
    "FrameError",
    "FrameTooLarge",
    "LENGTH",
    "LENGTH_SIZE",
    "MalformedFrame",
    "NEED_DATA",
    "NeedData",
    "ProtocolError",
    "response_correlation_id",
]

LENGTH: Final = struct.Struct(">i")
LENGTH_SIZE: Final = LENGTH.size
_CORRELATION: Final = struct.Struct(">i")  # the first field of every response header (v0 and v1)

DEFAULT_FRAME_BYTES_MAX: Final = 8 << 20
# Compact the decoder buffer once this many consumed bytes sit in front of it
# (and they are at least half of the buffer), so each byte moves O(1) times.
_COMPACT_BYTES: Final = 64 << 10


class NeedData(enum.Enum):
    """The type of NEED_DATA: a one-member enum, so that a type checker
    narrows ``frame is NEED_DATA`` (an ``object()`` sentinel would not)."""

    NEED_DATA = "NEED_DATA"

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Final = NeedData.NEED_DATA
"""Returned by ``FrameDecoder.next_frame`` when no whole frame is buffered."""


class ProtocolError(Exception):
    """Base of the errors of a broken byte stream."""


class FrameError(ProtocolError):
    """The byte stream itself is broken: the connection must be closed."""


class FrameTooLarge(FrameError):
    def __init__(self, length: int, frame_bytes_max: int):
        super().__init__(  # names the broker setting an operator raises (network.max_frame_bytes)
            f"peer announced a frame of {length} bytes, above max_frame_bytes={frame_bytes_max}"
        )
        self.length = length
        self.frame_bytes_max = frame_bytes_max


class MalformedFrame(FrameError):
    pass


def response_correlation_id(frame: bytes | bytearray | memoryview) -> int:
    """The correlation id of a response frame (the payload after the length
    prefix): a frame too short to hold one breaks the stream."""
    if len(frame) < _CORRELATION.size:
        raise MalformedFrame(f"response of {len(frame)} bytes has no correlation id")
    correlation_id: int = _CORRELATION.unpack_from(frame, 0)[0]
    return correlation_id


class FrameDecoder:
    """Splits a byte stream into frames: ``feed`` bytes, then ``next_frame`` until NEED_DATA.

    After a FrameError the decoder is broken for good: the caller closes the
    connection.
    """

    __slots__ = ("frame_bytes_max", "_buf", "_pos", "_error")

    def __init__(self, frame_bytes_max: int = DEFAULT_FRAME_BYTES_MAX):
        invariant(frame_bytes_max > 0, "frame_bytes_max %r must be positive", frame_bytes_max)
        self.frame_bytes_max = frame_bytes_max
        self._buf = bytearray()
        self._pos = 0  # start of the unconsumed bytes in _buf
        self._error: FrameError | None = None

    @property
    def buffered_bytes(self) -> int:
        return len(self._buf) - self._pos

    def feed(self, data: bytes) -> None:
        if self._error is not None:
            raise self._error
        self._buf += data

    def next_frame(self) -> bytes | bytearray | NeedData:
        """The next whole frame's payload (without length prefix), or NEED_DATA.

        The payload is a fresh bytearray (one copy out of the buffer).
        """
        if self._error is not None:
            raise self._error
        buf = self._buf
        pos = self._pos
        avail = len(buf) - pos
        if avail < LENGTH_SIZE:
            return NEED_DATA
        (length,) = LENGTH.unpack_from(buf, pos)
        if length < 0:
            self._error = MalformedFrame(f"negative frame length {length}")
            raise self._error
        if length > self.frame_bytes_max:
            self._error = FrameTooLarge(length, self.frame_bytes_max)
            raise self._error
        end = pos + LENGTH_SIZE + length
        if end > len(buf):
            return NEED_DATA
        frame = buf[pos + LENGTH_SIZE:end]
        if end == len(buf):
            buf.clear()
            self._pos = 0
        elif end >= _COMPACT_BYTES and end * 2 >= len(buf):
            del buf[:end]
            self._pos = 0
        else:
            self._pos = end
        return frame
