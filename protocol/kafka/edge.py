"""The sending side's edge between our flat bodies and Kafka's messages.

metalog's core, request router and client library think in **flat bodies**
(``metalog.protocol.messages``): one struct per request or response, one
log, no topic/partition arrays, directory ids as Kafka's 22-character Uuid
strings ("" for the zero Uuid). On the wire every message is **Kafka's**
(``metalog.protocol.kafka.messages``, generated from Kafka's JSON schemas):
topics and partitions nested, directory ids as 16 raw bytes, fields that
depend on the version. This module is the one place where a sender (a
``metalog.broker.net.channel.PeerChannel``, used by the brokers for their
peers and by the client library) turns one into the other:

* ``Edge(api_key, version, request_to_kafka, response_from_kafka)``: how one
  flat request type travels -- under which api key and version, how the flat
  request becomes Kafka's request struct, and how Kafka's response (decoded at
  that version) becomes the flat response the caller awaits. A Kafka response
  that carries no partition for our log (or only a top-level error) must map
  to a flat response with an error code, or raise ``ResponseDecodeError``.
* ``register(flat_request_type, edge)``: done once per type, at import, by
  the edge modules (``edge_quorum``: the peers' apis; ``edge_client``: the
  client's), which this module imports on the first ``edge_for``.
* ``encode_request`` / ``decode_response``: whole frames (request header v1
  or v2, response header v0 or v1, by the api's flexible versions).

The server side maps the other way in its handlers
(``metalog.broker.server.kafka``). Record bytes are not copied on the way in:
a decoded Fetch response's records are a ``memoryview`` slice of the frame.
"""

from __future__ import annotations

import importlib
import struct
from typing import Any, Callable, Final, NamedTuple

from metalog.protocol import messages as m
from metalog.protocol.invariants import invariant
from metalog.protocol.kafka.errors import KafkaDecodeError, UnsupportedVersionError
from metalog.protocol.kafka.messages import REQUESTS, request_header_version
from metalog.protocol.kafka.primitives import I32, Message, write_nstr
from metalog.protocol.kafka.wire import decode_response as _decode_kafka_response

__all__ = [
    "Edge",
    "ResponseDecodeError",
    "decode_response",
    "edge_for",
    "encode_request",
    "register",
]

_HEADER_FIXED: Final = struct.Struct(">hhi")  # api key, api version, correlation id


class ResponseDecodeError(KafkaDecodeError):
    """A response frame that does not decode as the answer to our request, or
    whose Kafka body does not map onto the flat response (the peer's fault)."""


class Edge(NamedTuple):
    api_key: int
    version: int  # the version the sender uses
    request_to_kafka: Callable[[m.Body], Any]  # flat request -> generated Kafka request struct
    response_from_kafka: Callable[[Any, int], m.Body]  # (generated Kafka response, version) -> flat response


_EDGES: dict[type[m.Body], Edge] = {}


def register(flat_request_type: type[m.Body], edge: Edge) -> None:
    """Say how ``flat_request_type`` travels; once per type."""
    invariant(flat_request_type not in _EDGES, "%s has an edge already", flat_request_type.__name__)
    kafka_type = REQUESTS.get(edge.api_key)
    invariant(kafka_type is not None, "api key %d has no Kafka request type", edge.api_key)
    if kafka_type is not None:
        invariant(kafka_type.LOWEST_VERSION <= edge.version <= kafka_type.HIGHEST_VERSION,
                  "%s: %s has no version %d", flat_request_type.__name__, kafka_type.__name__, edge.version)
    _EDGES[flat_request_type] = edge


# The edge modules: each registers its types when imported. They import this
# module (and edge_client imports edge_quorum's helpers), so they are loaded
# on the first look-up rather than at the end of this module: whichever of
# them a program imports first, no import cycle can find one half-made.
_EDGE_MODULES: Final = ("metalog.protocol.kafka.edge_quorum",  # the peers' apis
                        "metalog.protocol.kafka.edge_client")  # the client's apis and our extensions
_loaded = False


def _load_edges() -> None:
    global _loaded
    if not _loaded:
        for name in _EDGE_MODULES:
            importlib.import_module(name)
        _loaded = True


def edge_for(body: m.Body) -> Edge:
    """The edge of ``body``'s type; a ValueError naming it when there is none."""
    edge = _EDGES.get(type(body))
    if edge is None:
        _load_edges()
        edge = _EDGES.get(type(body))
    if edge is None:
        known = ", ".join(sorted(t.__name__ for t in _EDGES))
        raise ValueError(f"{type(body).__name__} cannot be sent in Kafka's protocol (registered: {known})")
    return edge


def encode_request(body: m.Body, correlation_id: int, client_id: str | None) -> tuple[Edge, bytes]:
    """The whole request frame of ``body`` (length prefix included) and its edge.

    A flat value the chosen version cannot carry raises ValueError
    (``UnsupportedVersionError``), before anything is written."""
    edge = edge_for(body)
    kafka_body = edge.request_to_kafka(body)
    if not isinstance(kafka_body, Message):
        raise TypeError(f"the edge of {type(body).__name__} built {type(kafka_body).__name__}, not a Kafka message")
    out = bytearray(4)
    out += _HEADER_FIXED.pack(edge.api_key, edge.version, correlation_id)
    write_nstr(out, client_id)  # a non-compact nullable string even in header v2
    if request_header_version(edge.api_key, edge.version) >= 2:
        out.append(0)  # no tagged fields in our request headers
    try:
        kafka_body.write(out, edge.version)
    except UnsupportedVersionError as exc:
        raise UnsupportedVersionError(f"{type(body).__name__} as api {edge.api_key} v{edge.version}: {exc}") from None
    I32.pack_into(out, 0, len(out) - 4)
    return edge, bytes(out)


def decode_response(edge: Edge, frame: bytes | bytearray | memoryview) -> m.Body:
    """The flat response in ``frame`` (without its length prefix), the answer
    to a request sent through ``edge``. Raises ``ResponseDecodeError``."""
    try:
        _correlation_id, kafka_body = _decode_kafka_response(frame, edge.api_key, edge.version)
    except KafkaDecodeError as exc:
        raise ResponseDecodeError(f"api {edge.api_key} v{edge.version} response: {exc}") from None
    try:
        return edge.response_from_kafka(kafka_body, edge.version)
    except ResponseDecodeError:
        raise
    except (ValueError, IndexError, KeyError, TypeError, AttributeError) as exc:
        raise ResponseDecodeError(f"api {edge.api_key} v{edge.version} response does not map: {exc!r}") from None

