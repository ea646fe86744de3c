"""Kafka's request and response frames, around the generated bodies (sans-IO).

A connection's byte stream is split into frames by
``metalog.protocol.kafka.framing.FrameDecoder`` (int32 length, then the payload);
this module reads and writes what is inside a frame::

    request  = api_key i16 | api_version i16 | correlation_id i32
               | client_id (int16 length, -1 = null: even in header v2)
               | [tagged fields, header v2: flexible versions] | body
    response = correlation_id i32 | [tagged fields, header v1] | body

What a server does with each failure of ``decode_request``:

* ``HeaderError``: the header is unreadable, so there is nobody to answer
  (no correlation id): close the connection.
* ``UnsupportedApi`` / ``UnsupportedVersion``: the header was read. An
  ApiVersions request gets ``api_versions_fallback`` (Kafka's v0-encoded
  answer with UNSUPPORTED_VERSION and our ranges, so the client steps down);
  anything else gets ``error_answer(header, UNSUPPORTED_VERSION)``, or, where
  that is None, the connection is closed.
* ``RequestBodyError``: the header was read, the body was not:
  ``error_answer(header, INVALID_REQUEST)`` or close.

All four are ``KafkaDecodeError``s: nothing else leaves ``decode_request``.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Final, NamedTuple

from metalog.protocol.kafka.errors import KafkaDecodeError
from metalog.protocol.kafka.messages import (
    REQUESTS,
    RESPONSES,
    ApiVersionsResponse,
    ApiVersionsResponseApiVersion,
    request_header_version,
    response_header_version,
)
from metalog.protocol.kafka.primitives import I16, I32, Malformed, Message, skip_tags, write_nstr

__all__ = [
    "HeaderError",
    "RequestBodyError",
    "RequestHeader",
    "UnsupportedApi",
    "UnsupportedVersion",
    "api_versions_fallback",
    "decode_request",
    "decode_response",
    "encode_request",
    "encode_response",
    "encode_response_buffer",
    "error_answer",
]

UNSUPPORTED_VERSION: Final = 35
API_VERSIONS_KEY: Final = 18
_HEADER: Final = struct.Struct(">hhih")  # api key, version, correlation id, client id length
_HEADER_FIXED: Final = struct.Struct(">hhi")
_HEADER_BYTES_MIN: Final = _HEADER.size


class RequestHeader(NamedTuple):
    api_key: int
    api_version: int
    correlation_id: int
    client_id: str | None


class HeaderError(KafkaDecodeError):
    """The request header cannot be read: no correlation id to answer to."""


class _HeaderRead(KafkaDecodeError):
    """A failure after the header was read: the request can be answered."""

    def __init__(self, header: RequestHeader, message: str) -> None:
        super().__init__(message)
        self.header = header


class UnsupportedApi(_HeaderRead):
    def __init__(self, header: RequestHeader) -> None:
        super().__init__(header, f"api key {header.api_key} is not supported")


class UnsupportedVersion(_HeaderRead):
    def __init__(self, header: RequestHeader) -> None:
        super().__init__(header, f"api key {header.api_key} version {header.api_version} is not supported")


class RequestBodyError(_HeaderRead):
    """The header was read, the body was not."""


def read_request_header(buf: memoryview) -> tuple[RequestHeader, int]:
    """The header's fixed part and client id: (header, position after the client id)."""
    if len(buf) < _HEADER_BYTES_MIN:
        raise HeaderError(f"a request header takes at least {_HEADER_BYTES_MIN} bytes, the frame has {len(buf)}")
    api_key, version, correlation_id, length = _HEADER.unpack_from(buf, 0)
    pos = _HEADER_BYTES_MIN
    client_id: str | None = None
    if length >= 0:
        end = pos + length
        if end > len(buf):
            raise HeaderError(f"client id of {length} bytes runs past the frame ({len(buf) - pos} left)")
        try:
            client_id = str(buf[pos:end], "utf-8")
        except UnicodeDecodeError as exc:
            raise HeaderError(f"client id is not UTF-8: {exc}") from None
        pos = end
    return RequestHeader(api_key, version, correlation_id, client_id), pos


def decode_request(
    frame: bytes | bytearray | memoryview, supported: Mapping[int, tuple[int, int]]
) -> tuple[RequestHeader, Message]:
    """A request frame's payload (without its length prefix): (header, body).

    ``supported`` maps the api keys we serve to their (lowest, highest)
    versions. The body's bytes and records are slices of ``frame``.
    """
    buf = memoryview(frame)
    header, pos = read_request_header(buf)
    body_type = REQUESTS.get(header.api_key)
    versions = supported.get(header.api_key)
    if body_type is None or versions is None:
        raise UnsupportedApi(header)
    version = header.api_version
    if not (versions[0] <= version <= versions[1] and body_type.LOWEST_VERSION <= version <= body_type.HIGHEST_VERSION):
        raise UnsupportedVersion(header)
    if version >= body_type.FLEXIBLE_MIN_VERSION:
        if pos < len(buf) and buf[pos] == 0:  # no tagged field in the header: the common case, no call
            pos += 1
        else:
            try:
                pos = skip_tags(buf, pos)
            except (Malformed, IndexError) as exc:
                raise HeaderError(
                    f"request header's tagged fields at byte {pos}: {exc or 'the frame ends inside them'}")
    try:
        body, _end = body_type.read(buf, pos, version)
    except KafkaDecodeError as exc:
        raise RequestBodyError(header, f"{body_type.__name__} v{version}: {exc}") from None
    # Bytes after the body are ignored, as Kafka's parser ignores them
    # (RequestContext.parseRequest), for librdkafka's sake. Its Metadata
    # request for all topics at a flexible version (v9+: librdkafka 2.1 to at
    # least 2.16, e.g. AdminClient.list_topics) is `00 00 00 00 01 00 00`
    # after the header: rd_kafka_MetadataRequest0 (src/rdkafka_request.c)
    # reserves the topic count with rd_kafka_buf_write_arraycnt_pos, an i32
    # placeholder (src/rdkafka_buf.h), and on that path ("v9+: keep 0,
    # varint encoded null, all topics") never calls
    # rd_kafka_buf_finalize_arraycnt, which would shrink it to one varint. So
    # four zero bytes stand where one (null Topics) belongs; then come its
    # real AllowAutoTopicCreation (01), IncludeTopicAuthorizedOperations (00)
    # and the body's empty tagged fields (00). Read as Kafka reads it: Topics
    # null, AllowAutoTopicCreation false, IncludeTopicAuthorizedOperations
    # false, no tags -- the three bytes left are librdkafka's own fields, not
    # a tagged-field section. The header is read right (request header v2:
    # ClientId a non-compact nullable string, then tags; RequestHeader.json
    # gives ClientId "flexibleVersions": "none"), which librdkafka writes the
    # same way (rd_kafka_buf_new_request0). The misread flag changes nothing:
    # no topic is ever created here, and Kafka auto-creates named topics only.
    return header, body


def encode_response_buffer(header: RequestHeader, body: Message) -> bytearray:
    """``encode_response`` without its final copy: the frame as a bytearray
    (what a transport's write takes), for the paths that carry records."""
    out = bytearray(8)
    I32.pack_into(out, 4, header.correlation_id)
    if response_header_version(header.api_key, header.api_version) >= 1:
        out.append(0)  # no tagged fields in our response headers
    body.write(out, header.api_version)
    I32.pack_into(out, 0, len(out) - 4)
    return out


def encode_response(header: RequestHeader, body: Message) -> bytes:
    """The whole response frame: length prefix, response header v0/v1, body."""
    return bytes(encode_response_buffer(header, body))


def encode_request(header: RequestHeader, body: Message) -> bytes:
    """The whole request frame: length prefix, request header v1/v2, body."""
    out = bytearray(4)
    out += _HEADER_FIXED.pack(header.api_key, header.api_version, header.correlation_id)
    write_nstr(out, header.client_id)
    if request_header_version(header.api_key, header.api_version) >= 2:
        out.append(0)
    body.write(out, header.api_version)
    I32.pack_into(out, 0, len(out) - 4)
    return bytes(out)


def decode_response(frame: bytes | bytearray | memoryview, api_key: int, api_version: int) -> tuple[int, Message]:
    """A response frame's payload: (correlation id, body).

    An ApiVersions answer carrying UNSUPPORTED_VERSION is read as v0, as
    Kafka's clients do: that is how a server says which versions it has.
    """
    buf = memoryview(frame)
    body_type = RESPONSES.get(api_key)
    if body_type is None:
        raise KafkaDecodeError(f"no response type for api key {api_key}")
    if len(buf) < 4:
        raise KafkaDecodeError(f"a response header takes 4 bytes, the frame has {len(buf)}")
    (correlation_id,) = I32.unpack_from(buf, 0)
    pos = 4
    if response_header_version(api_key, api_version) >= 1:
        if len(buf) > pos and buf[pos] == 0:
            pos += 1  # no tagged field in the header: the common case, no call
        else:
            try:
                pos = skip_tags(buf, pos)
            except (Malformed, IndexError) as exc:
                raise KafkaDecodeError(f"response header's tagged fields: {exc or 'the frame ends inside them'}")
    if api_key == API_VERSIONS_KEY and len(buf) >= pos + 2 and I16.unpack_from(buf, pos)[0] == UNSUPPORTED_VERSION:
        api_version = 0
    body = body_type.decode(buf[pos:], api_version)
    return correlation_id, body


def api_versions_fallback(header: RequestHeader, supported: Mapping[int, tuple[int, int]]) -> bytes:
    """Kafka's answer to an ApiVersions request of a version we lack: a v0
    ApiVersionsResponse with UNSUPPORTED_VERSION and our ranges, in a v0
    response header, so that the client retries with a version we have."""
    body = ApiVersionsResponse(
        error_code=UNSUPPORTED_VERSION,
        api_keys=[
            ApiVersionsResponseApiVersion(api_key=key, min_version=lo, max_version=hi)
            for key, (lo, hi) in sorted(supported.items())
        ],
    )
    out = bytearray(8)
    I32.pack_into(out, 4, header.correlation_id)
    body.write(out, 0)
    I32.pack_into(out, 0, len(out) - 4)
    return bytes(out)


def error_answer(header: RequestHeader, error_code: int) -> bytes | None:
    """The response to a request whose header was read but whose body was not
    (or whose api or version we do not serve): that api's response at that
    version, all defaults but a top-level error code. None where the response
    has no top-level error code at that version (Produce, Metadata, ...) or the
    version is not one we can encode: Kafka closes the connection then."""
    body_type = RESPONSES.get(header.api_key)
    if body_type is None:
        return None
    version = header.api_version
    if not body_type.LOWEST_VERSION <= version <= body_type.HIGHEST_VERSION:
        return None
    if "error_code" not in body_type.__struct_fields__:
        return None
    body = body_type()
    try:
        plain = encode_response(header, body)
        setattr(body, "error_code", error_code)
        answer = encode_response(header, body)
    except ValueError:  # error_code is not in this version and not ignorable
        return None
    # an ignorable error_code absent from this version is dropped silently
    return answer if answer != plain else None
