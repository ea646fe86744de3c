"""Wire codec of the metalog protocol: bytes in, frames and bodies out (sans-IO).

No sockets, no asyncio: ``metalog.broker.net.server`` feeds received bytes into a
``FrameDecoder`` and hands each frame to ``decode_request`` /
``decode_response``; the simulator can use the same functions.

Framing (all integers big-endian)::

    frame    = length i32 | payload (length bytes)
    request  = api_key i16 | api_version i16 | correlation_id i32 |
               client_id (i16 length, then utf-8; length -1 = null) | body
    response = correlation_id i32 | body

The body is the msgspec msgpack encoding of an ``array_like`` Struct from
``metalog.protocol.messages``. A request's api key selects its type (``metalog.protocol.apis``);
a response carries no type: the requester knows it from its pending request.

Who is at fault, and what happens, for each kind of bad input:

* ``FrameTooLarge`` / ``MalformedFrame`` (raised by ``FrameDecoder``): the byte
  stream cannot be resynchronised. Close the connection.
* ``HeaderDecodeError``: the request header is unreadable, so there is no
  correlation id to answer to. Close the connection.
* ``UnknownApiKey`` / ``UnsupportedVersion``: the header was read; answer
  ``ErrorResponse(UNSUPPORTED_VERSION)`` to ``exc.header.correlation_id``.
* ``BodyDecodeError``: the header was read; answer
  ``ErrorResponse(INVALID_REQUEST)``.

The ErrorResponse rule. A requester decoding a response expects its own
response type, but a request whose header was readable and whose body was not
is answered with ``messages.ErrorResponse``. ``decode_response(frame,
expected_type)`` therefore first decodes ``expected_type`` and, if that fails,
decodes ``ErrorResponse`` and returns it; the caller checks
``isinstance(body, ErrorResponse)`` or simply ``body.error_code`` (every
response type starts with ``error_code``). Caveat: an ErrorResponse
``[code, message]`` also decodes as a response type whose second field is a
string (``MetadataResponse``: cluster_id); the caller then still sees the
non-zero ``error_code``, which is all it may rely on in an error answer.
If neither decodes, ``ResponseDecodeError`` is raised (the peer's fault).
"""

from __future__ import annotations

import enum
import struct
from typing import Final, NamedTuple

import msgspec

from metalog.protocol.invariants import invariant
from metalog.protocol import messages as m
from metalog.protocol.apis import APIS, ApiKey, request_version, version_problem

LENGTH = struct.Struct(">i")
LENGTH_SIZE = LENGTH.size
_REQ_FIXED = struct.Struct(">hhih")  # api_key, api_version, correlation_id, client_id length
_REQ_FRAME = struct.Struct(">ihhih")  # length + _REQ_FIXED, for encoding in one pack
_RESP_FRAME = struct.Struct(">ii")  # length, correlation_id
_CORRELATION = struct.Struct(">i")

DEFAULT_FRAME_BYTES_MAX = 8 << 20
# Compact the decoder buffer once this many consumed bytes sit in front of it
# (and they are at least half of the buffer), so each byte moves O(1) times.
_COMPACT_BYTES = 64 << 10


class NeedData(enum.Enum):
    """The type of NEED_DATA: a one-member enum, so that a type checker
    narrows ``frame is NEED_DATA`` (an ``object()`` sentinel would not)."""

    NEED_DATA = "NEED_DATA"

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Final = NeedData.NEED_DATA
"""Returned by ``FrameDecoder.next_frame`` when no whole frame is buffered."""


class RequestHeader(NamedTuple):
    api_key: int
    api_version: int
    correlation_id: int
    client_id: str | None


# --------------------------------------------------------------------------
# Errors


class ProtocolError(Exception):
    """Base of every codec error."""


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


class HeaderDecodeError(ProtocolError):
    """The request header is unreadable: no correlation id, close the connection."""


class RequestError(ProtocolError):
    """The header was read; the request gets an ErrorResponse with `error_code`."""

    error_code: int = 0

    def __init__(self, header: RequestHeader, message: str):
        super().__init__(message)
        self.header = header

    def error_response(self) -> m.ErrorResponse:
        return m.ErrorResponse(error_code=self.error_code, error_message=str(self))


class UnknownApiKey(RequestError):
    error_code = 35  # UNSUPPORTED_VERSION

    def __init__(self, header: RequestHeader):
        super().__init__(header, f"unknown api key {header.api_key}")


class UnsupportedVersion(RequestError):
    error_code = 35  # UNSUPPORTED_VERSION

    def __init__(self, header: RequestHeader, min_version: int, max_version: int):
        super().__init__(
            header,
            f"api key {header.api_key} version {header.api_version} is not supported "
            f"(supported {min_version}..{max_version})",
        )


class BodyDecodeError(RequestError):
    error_code = 42  # INVALID_REQUEST

    def __init__(self, header: RequestHeader, message: str):
        super().__init__(header, message)


class ResponseDecodeError(ProtocolError):
    """A response body decodes neither as the expected type nor as ErrorResponse."""


# --------------------------------------------------------------------------
# Cached encoder and decoders: building them is the expensive part.

_ENCODER = msgspec.msgpack.Encoder()
_REQUEST_TYPES: dict[int, tuple[msgspec.msgpack.Decoder[m.Body], int, int]] = {}
_DECODERS: dict[type[m.Body], msgspec.msgpack.Decoder[m.Body]] = {}


def decoder_for(body_type: type[m.Body]) -> msgspec.msgpack.Decoder[m.Body]:
    dec = _DECODERS.get(body_type)
    if dec is None:
        dec = _DECODERS[body_type] = msgspec.msgpack.Decoder(body_type)
    return dec


for _key, (_req, _resp, _lo, _hi) in APIS.items():
    _REQUEST_TYPES[int(_key)] = (decoder_for(_req), _lo, _hi)
    decoder_for(_resp)
_ERROR_DECODER = decoder_for(m.ErrorResponse)


# --------------------------------------------------------------------------
# Encoding


def encode_request(
    api_key: int, correlation_id: int, client_id: str | None, body: m.Body, api_version: int | None = None
) -> bytes:
    """One whole request frame, length prefix included; the version defaults
    to the lowest that carries the body (``metalog.protocol.apis.request_version``)."""
    if api_version is None:
        api_version = request_version(body)
    if client_id is None:
        cid = b""
        cid_len = -1
    else:
        cid = client_id.encode()
        cid_len = len(cid)
    payload = _ENCODER.encode(body)
    length = _REQ_FIXED.size + len(cid) + len(payload)
    return _REQ_FRAME.pack(length, api_key, api_version, correlation_id, cid_len) + cid + payload


def encode_response(correlation_id: int, body: m.Body) -> bytes:
    """One whole response frame, length prefix included."""
    payload = _ENCODER.encode(body)
    return _RESP_FRAME.pack(_CORRELATION.size + len(payload), correlation_id) + payload


def encode_body(body: m.Body) -> bytes:
    return _ENCODER.encode(body)


# --------------------------------------------------------------------------
# Decoding


def decode_request_header(frame: bytes | bytearray) -> tuple[RequestHeader, int]:
    """The header of a request frame (without length prefix) and where its body starts."""
    n = len(frame)
    if n < _REQ_FIXED.size:
        raise HeaderDecodeError(
            f"request of {n} bytes is shorter than the {_REQ_FIXED.size}-byte fixed header"
        )
    api_key, api_version, correlation_id, cid_len = _REQ_FIXED.unpack_from(frame, 0)
    pos = _REQ_FIXED.size
    if cid_len == -1:
        client_id = None
    elif cid_len < -1:
        raise HeaderDecodeError(f"negative client_id length {cid_len}")
    else:
        end = pos + cid_len
        if end > n:
            raise HeaderDecodeError(
                f"client_id length {cid_len} runs past the end of a {n}-byte request"
            )
        try:
            client_id = frame[pos:end].decode()
        except UnicodeDecodeError as exc:
            raise HeaderDecodeError(f"client_id is not valid utf-8: {exc}") from None
        pos = end
    return RequestHeader(api_key, api_version, correlation_id, client_id), pos


def decode_request(frame: bytes | bytearray) -> tuple[RequestHeader, m.Body]:
    """Header and body of one request frame (the payload after the length prefix).

    Raises HeaderDecodeError, UnknownApiKey, UnsupportedVersion or
    BodyDecodeError (see the module docstring for what each one means).
    """
    header, pos = decode_request_header(frame)
    entry = _REQUEST_TYPES.get(header.api_key)
    if entry is None:
        raise UnknownApiKey(header)
    dec, lo, hi = entry
    if not lo <= header.api_version <= hi:
        raise UnsupportedVersion(header, lo, hi)
    try:
        body = dec.decode(memoryview(frame)[pos:])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        name = ApiKey(header.api_key).name
        raise BodyDecodeError(header, f"undecodable {name} request body: {exc}") from None
    problem = version_problem(header.api_version, body)
    if problem is not None:
        raise BodyDecodeError(header, problem)
    return header, body


def response_correlation_id(frame: bytes | bytearray) -> int:
    """The correlation id of a response frame (the payload after the length prefix)."""
    if len(frame) < _CORRELATION.size:
        raise ResponseDecodeError(f"response of {len(frame)} bytes has no correlation id")
    correlation_id: int = _CORRELATION.unpack_from(frame, 0)[0]
    return correlation_id


def decode_response(frame: bytes | bytearray, expected_type: type[m.Body]) -> m.Body:
    """The body of a response frame: `expected_type`, or the ErrorResponse fallback."""
    view = memoryview(frame)[_CORRELATION.size:]
    try:
        return decoder_for(expected_type).decode(view)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        try:
            return _ERROR_DECODER.decode(view)
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise ResponseDecodeError(
                f"response decodes neither as {expected_type.__name__} nor as ErrorResponse: {exc}"
            ) from None


# --------------------------------------------------------------------------
# Framing


class FrameDecoder:
    """Splits a byte stream into frames: ``feed`` bytes, then ``next_frame`` until NEED_DATA.

    The announced length is checked against ``frame_bytes_max`` as soon as its
    four bytes arrive, before the body is waited for, so a hostile length never
    makes us buffer (or allocate) the body. After a FrameError the decoder is
    broken for good: the caller closes the connection.
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

        The payload is a fresh bytearray (one copy out of the buffer); every
        decode function here accepts it.
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
