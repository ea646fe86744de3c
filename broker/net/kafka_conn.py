"""A connection that speaks Kafka's wire protocol (issue 32), and its listener.

Kafka's protocol is metalog's only protocol: both broker ports are served by
``KafkaConnection`` (``listen``, Kafka's controller listener, and
``kafka_listen``, the client listener), each with its own accept loop,
limits and dispatcher (``metalog.broker.server.kafka.dispatch``). The accept
loop, admission, mutual-TLS handshake, idle sweep and back-off are the
transport's (``metalog.broker.net.server.Connection`` and its ``Listener``);
``KafkaConnection`` subclasses that connection and says what happens to a
frame once it is whole:

* decode it with ``metalog.protocol.kafka.wire.decode_request`` against the
  served ``supported`` ranges (api key -> (min, max) version);
* wrap it in a ``KafkaExchange`` (header, decoded body, the slot of its
  answer) and call ``handler(exchange)``; the handler answers now or later
  with ``exchange.respond(kafka_response_body)``, or ``respond_nothing()``
  for a request Kafka never answers (Produce with acks=0);
* answers leave **in request order**: an answer that is ready before an
  earlier one waits in its slot (Java clients and librdkafka treat an
  out-of-order answer as a broken connection). At most ``max_inflight``
  requests are read and not yet answered; above that the connection stops
  reading and TCP pushes back on the client. A write buffer past its
  high-water mark also stops reading.

Bad input, each logged through the listener's bounded log (one line, or
one summary line per interval under a flood) and nothing else disturbed:

* an unreadable frame or header (no correlation id to answer): close;
* a known header with an api or version we do not serve: Kafka's answer --
  ``api_versions_fallback`` for ApiVersions (a v0 answer with
  UNSUPPORTED_VERSION and our ranges, so the client steps down), otherwise
  ``error_answer(header, UNSUPPORTED_VERSION)``;
* a known header with an unreadable body: ``error_answer(header,
  INVALID_REQUEST)``;
* where Kafka has no answer (``error_answer`` returns None): close.

A handler that raises is answered with UNKNOWN_SERVER_ERROR the same way.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any, Callable, Mapping

from metalog.broker.net import codec_clock
from metalog.broker.net.library_logging import library_logger
from metalog.broker.net.listener import Listener, ListenerLimits, Server, listen
from metalog.broker.net.server import Connection
from metalog.protocol.errors import Errors
from metalog.protocol.invariants import InvariantViolation
from metalog.protocol.kafka import wire
from metalog.protocol.kafka.errors import KafkaDecodeError
from metalog.protocol.kafka.framing import DEFAULT_FRAME_BYTES_MAX

KafkaHandler = Callable[["KafkaExchange"], None]  # answers now or later through the exchange

# Requests read and not yet answered, per connection. librdkafka pipelines up
# to max.in.flight (default 1,000,000), Java clients 5: above this bound we
# stop reading instead of buffering without limit.
KAFKA_INFLIGHT_PER_CONN_MAX = 256
API_VERSIONS_KEY = 18  # Kafka's ApiVersions: its own fallback answer


class AnswerWrites:
    """Answers given inside this scope leave at its end: one write per
    connection, before anything the caller does next.

    The broker's step (one core step and its actions) and a connection's
    reading of its buffered frames are scopes; a step also writes its
    answers as soon as its actions are done (``write_pending``), before the
    work after it (applying what it committed). A step that commits answers
    hundreds of produces at once, and one write per connection for all of
    them is what keeps a saturated leader's loop free (issue 32 item 8); the
    answers also leave before the step's fdatasync starts, instead of a loop
    turn later behind it (the one-client commit path). Answers given outside
    any scope (a forwarded request's answer arriving on its own) leave at the
    end of the loop turn. Scopes nest; the outermost one writes."""

    __slots__ = ("depth", "dirty", "_then")

    def __init__(self) -> None:
        self.depth = 0
        self.dirty: list[KafkaConnection] = []  # bounded: one entry per connection answered in the scope
        self._then: list[Callable[[], object]] = []  # bounded: distinct callables, one per broker in a process

    def __enter__(self) -> None:
        self.depth += 1

    def __exit__(self, *exc_info: object) -> None:
        self.depth -= 1
        if self.depth:
            return
        self.write_pending()
        if self._then:
            then, self._then = self._then, []
            for fn in then:
                fn()

    def write_pending(self) -> None:
        """Write what the scope has answered so far, now: a step's answers
        leave once its actions are done, before the bookkeeping after it
        (applying what it committed) delays them."""
        if self.dirty:
            dirty, self.dirty = self.dirty, []
            for conn in dirty:
                conn._write_out()

    def after_writes(self, fn: Callable[[], object]) -> None:
        """Call `fn` once the scope's answers are written (now, outside any
        scope): a leader's fdatasync starts after the answers that carry its
        records to the followers, not before them."""
        if not self.depth:
            fn()
        elif fn not in self._then:
            self._then.append(fn)


# One per process: a broker runs one event loop.
answer_writes = AnswerWrites()


class KafkaExchange:
    """One request and the slot of its answer, in the connection's order."""

    __slots__ = ("conn", "header", "body", "answer", "answered", "close_after")

    def __init__(self, conn: "KafkaConnection", header: wire.RequestHeader, body: Any):
        self.conn = conn
        self.header = header
        self.body = body  # a metalog.protocol.kafka.messages struct of header.api_version
        self.answer: bytes = b""
        self.answered = False
        self.close_after: int | None = None  # an error code: close once the earlier answers have left

    @property
    def version(self) -> int:
        return int(self.header.api_version)

    def respond(self, body: Any) -> None:
        """Answer with a response struct of this request's api, at its version."""
        meter = codec_clock.meter
        if meter is None:
            self.conn.finish(self, wire.encode_response(self.header, body))
            return
        started_ns = time.perf_counter_ns()
        data = wire.encode_response(self.header, body)
        meter.codec_sample(codec_clock.ENCODE_RESPONSE, self.header.api_key, time.perf_counter_ns() - started_ns)
        self.conn.finish(self, data)

    def respond_nothing(self) -> None:
        """No answer goes out (Produce with acks=0); later answers may leave."""
        self.conn.finish(self, b"")

    def fail(self, error_code: int) -> None:
        """Kafka's error answer to this request; closes where Kafka would."""
        if self.answered:
            return
        data = wire.error_answer(self.header, error_code)
        if data is None:  # Kafka closes instead: after the answers to earlier requests
            self.close_after = error_code
            self.conn.finish(self, b"")
        else:
            self.conn.finish(self, data)


class KafkaConnection(Connection):
    """An accepted connection speaking Kafka's protocol; see the module doc."""

    def __init__(self, handler: KafkaHandler, supported: Mapping[int, tuple[int, int]], max_frame_bytes: int,
                 max_inflight: int, logger: Any, listener: Listener | None = None):
        super().__init__(max_frame_bytes, max_inflight, logger, listener)
        self._kafka_handler = handler
        self._supported = supported
        self._queue: collections.deque[KafkaExchange] = collections.deque()  # request order
        self._closing = False  # a request Kafka answers by closing is queued: read nothing more
        self.context: Any = None  # the dispatcher's state for this connection (metalog.broker.server.kafka)
        # Answers that left the queue and wait for this loop turn's one write
        # (bounded by max_inflight: each was a queued request).
        self._out: list[bytes] = []
        self._write_scheduled = False

    # answers, in order ---------------------------------------------------------
    def finish(self, exchange: KafkaExchange, data: bytes) -> None:
        """`exchange` is answered with `data` (b"": nothing to send); every
        answer at the head of the queue leaves now."""
        if exchange.answered:
            raise InvariantViolation(f"api {exchange.header.api_key} correlation id "
                                     f"{exchange.header.correlation_id} answered twice")
        exchange.answer, exchange.answered = data, True
        if exchange.close_after is not None:
            self._closing = True  # nothing after it is read
        queue = self._queue
        out = self._out
        while queue and queue[0].answered:
            head = queue.popleft()
            if head.answer:
                out.append(head.answer)
            head.answer = b""
            if head.close_after is not None:
                self._write_out()  # the earlier answers are delivered before the close
                self.close_now("no_error_answer", api_key=head.header.api_key, api_version=head.header.api_version,
                               correlation_id=head.header.correlation_id, error_code=head.close_after)
                break
        self.inflight = len(queue)
        if self._out and not self._write_scheduled:
            self._write_scheduled = True
            if answer_writes.depth:
                answer_writes.dirty.append(self)
            else:
                asyncio.get_running_loop().call_soon(self._write_out)
        # Reading is paused exactly when frames may wait in the decoder.
        if self._read_paused and not self._processing and self.inflight < self._max_inflight:
            self._process()

    def _write_out(self) -> None:
        """One write for every answer that left the queue in this scope or loop turn.

        One step of the core answers hundreds of produces at once (one
        commit); a TLS record and a send per answer took a third of a
        saturated leader's loop (issue 32 item 8: 1000 clients, py-spy)."""
        self._write_scheduled = False
        out = self._out
        if not out:
            return
        self._out = []
        transport = None if self.closed else self._transport
        if transport is None:
            return
        transport.write(out[0] if len(out) == 1 else b"".join(out))
        self.last_active_s = asyncio.get_running_loop().time()

    def close_now(self, event: str, **fields: Any) -> None:
        """Close after what was written (a TLS close, so the written answers are delivered)."""
        self._refused(event, peer=self.peer, principal=str(self.principal), action="close", **fields)
        self.closed = True
        if self._transport is not None:
            self._transport.close()

    # reading ---------------------------------------------------------------------
    def _process(self) -> None:
        with answer_writes:  # the answers to every frame read now leave in one write
            super()._process()

    def _reading(self) -> bool:
        return not self._closing and super()._reading()  # nothing is read after a request Kafka closes on

    def _take(self, frame: Any) -> None:
        meter = codec_clock.meter
        started_ns = 0 if meter is None else time.perf_counter_ns()
        try:
            header, body = wire.decode_request(frame, self._supported)
        except wire.HeaderError as exc:
            self._abort("bad_header", exc)
            return
        except (wire.UnsupportedApi, wire.UnsupportedVersion) as exc:
            self._refuse(exc.header, exc, Errors.UNSUPPORTED_VERSION)
            return
        except wire.RequestBodyError as exc:
            self._refuse(exc.header, exc, Errors.INVALID_REQUEST)
            return
        except KafkaDecodeError as exc:  # the codec's promise is the four above; a fifth must not reach the loop
            self._abort("bad_header", exc)
            return
        if meter is not None:
            meter.codec_sample(codec_clock.DECODE_REQUEST, header.api_key, time.perf_counter_ns() - started_ns)
        exchange = self._open(header, body)
        if not self._proven:  # a well-formed request ends the address's run of failures
            self._prove()
        try:
            self._kafka_handler(exchange)
        except Exception as exc:  # a handler bug: answered, logged, the connection goes on
            self._handler_failed_kafka(exchange, exc)

    def _open(self, header: wire.RequestHeader, body: Any) -> KafkaExchange:
        exchange = KafkaExchange(self, header, body)
        self._queue.append(exchange)
        self.inflight = len(self._queue)
        return exchange

    def _refuse(self, header: wire.RequestHeader, exc: Exception, error_code: int) -> None:
        self._refused("bad_request", peer=self.peer, principal=str(self.principal), api_key=header.api_key,
                      api_version=header.api_version, correlation_id=header.correlation_id,
                      error=type(exc).__name__, detail=str(exc), protocol="kafka")
        exchange = self._open(header, None)
        if error_code == Errors.UNSUPPORTED_VERSION and header.api_key == API_VERSIONS_KEY:
            self.finish(exchange, wire.api_versions_fallback(header, self._supported))
        else:
            exchange.fail(error_code)
            if exchange.close_after is not None:  # bad input we close on counts toward the address's back-off
                self._record_failure()

    def _handler_failed_kafka(self, exchange: KafkaExchange, exc: Exception) -> None:
        self._log.error("handler_failed", peer=self.peer, api_key=exchange.header.api_key,
                        api_version=exchange.header.api_version,
                        correlation_id=exchange.header.correlation_id, error=repr(exc), protocol="kafka")
        exchange.fail(Errors.UNKNOWN_SERVER_ERROR)

    def _record_failure(self) -> None:
        if self._listener is not None:
            self._listener.record_failure(self.peer_host)


async def serve_kafka(host: str, port: int, handler: KafkaHandler, supported: Mapping[int, tuple[int, int]], *,
                      max_frame_bytes: int = DEFAULT_FRAME_BYTES_MAX,
                      max_inflight_per_conn: int = KAFKA_INFLIGHT_PER_CONN_MAX, logger: Any = None,
                      tls: Any = None, limits: ListenerLimits | None = None) -> Server:
    """Listen on (host, port) for Kafka clients (port 0: a free one). The
    listener is its own (own limits, own accept loop); `tls` (a
    ``metalog.broker.net.tls.TlsFiles``) turns on mutual TLS. `supported` may grow after the call (the
    dispatcher's table is read per request)."""
    log = logger if logger is not None else library_logger("metalog.net")
    listener = Listener(tls, limits or ListenerLimits(), log)
    return await listen(host, port, lambda: KafkaConnection(handler, supported, max_frame_bytes,
                                                            max_inflight_per_conn, log, listener), listener)
