"""Outbound request channels: one reusable TCP (and TLS) connection per peer.

``PeerChannel`` carries many concurrent requests over one connection, with
per-request timeouts, reconnect with exponential backoff (``metalog.broker.net.backoff``)
and a bounded number of outstanding requests; ``PeerPool`` maps node ids to
channels. The brokers use it for their peers, the client library for the
cluster. The serving side is ``metalog.broker.net.server``.

Built on ``asyncio.Protocol`` (not streams), as the server is: see that
module's docstring for why. Works on the default loop and on uvloop.

Kafka's protocol: a caller hands a flat request (``metalog.protocol.messages``);
the request that leaves is Kafka's, built by ``metalog.protocol.kafka.edge``'s
``encode_request`` (request header v1/v2 by the api's flexible versions),
and its answer is read by ``edge.decode_response`` (response header v0/v1)
back into the flat response the caller awaits. A Kafka server answers in
request order on a connection; answers are still matched by correlation id.
A request that times out closes its connection, as Kafka's clients do: the
answers behind it would otherwise wait for one that may never come, and the
other requests on it fail with ConnectionLost (their callers retry). In
order also means that an answer the server holds (a long-polling Fetch)
holds every later answer on the same connection: a caller that must not
wait behind one uses a channel of its own.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import ssl
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from metalog.broker.net import codec_clock
from metalog.broker.net.backoff import Backoff
from metalog.broker.net.library_logging import library_logger
from metalog.broker.net.server import DEFAULT_WRITE_HIGH_WATER_BYTES
from metalog.protocol import messages as m
from metalog.protocol.invariants import InvariantViolation
from metalog.protocol.kafka import edge
from metalog.protocol.kafka.framing import (DEFAULT_FRAME_BYTES_MAX, NEED_DATA, FrameDecoder, ProtocolError,
                                            response_correlation_id)

_MAX_CORRELATION_ID = (1 << 31) - 1


def _retrieve_exception(task: asyncio.Future) -> None:
    """A shared connection attempt whose requesters all gave up (timed out)
    still fails: its awaiters got the error, the failure is logged as
    connect_failed; mark it retrieved so asyncio does not print "Task
    exception was never retrieved" on stderr."""
    if not task.cancelled():
        task.exception()


class NetError(Exception):
    pass


class RequestTimeout(NetError):
    pass


class ConnectionLost(NetError):
    pass


class Overloaded(NetError):
    pass


_REFUSED_DURING_HANDSHAKE = ("the broker closed the connection during the TLS handshake (certificate from "
                             "another CA, expired or revoked, or this address is backed off; the broker's log "
                             "event tls_handshake_failed says which)")


class TlsHandshakeError(ConnectionLost):
    """The TLS handshake with a peer failed; the message is one line for people."""


class _ClientProtocol(asyncio.Protocol):
    def __init__(self, channel: PeerChannel):
        self._channel = channel
        self.transport: Any = None  # asyncio or uvloop transport
        self.decoder = FrameDecoder(channel.max_frame_bytes)
        self.can_write = asyncio.Event()
        self.can_write.set()
        self.lost = False
        self.got_frame = False  # anything received yet (a close before that, over TLS, is a refusal)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=DEFAULT_WRITE_HIGH_WATER_BYTES)

    def data_received(self, data: bytes) -> None:
        ch = self._channel
        self.got_frame = True
        try:
            self.decoder.feed(data)
            while True:
                frame = self.decoder.next_frame()
                if frame is NEED_DATA:
                    return
                ch._on_frame(self, frame)
        except ProtocolError as exc:
            ch._log.warning("bad_response_stream", peer=ch.peer, error=type(exc).__name__,
                            detail=str(exc), action="close")
            self.lost = True
            if self.transport is None:
                raise InvariantViolation("a frame arrived on a connection without a transport")
            self.transport.abort()
            ch._on_lost(self, f"bad response stream from {ch.peer}: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.can_write.set()  # wake writers; they will see the loss
        ch = self._channel
        if ch.tls is not None and not self.got_frame and (exc is None or isinstance(exc, ConnectionResetError)):
            # TLS 1.3: the broker checks our certificate after our side of the
            # handshake is done; refusing, it closes before answering anything
            # (asyncio and uvloop send no alert saying why).
            ch._log.warning("tls_handshake_failed", peer=ch.peer, reason=_REFUSED_DURING_HANDSHAKE)
            ch._on_lost(self, f"TLS handshake with {ch.peer} failed: {_REFUSED_DURING_HANDSHAKE}", tls_failure=True)
            return
        if isinstance(exc, ssl.SSLError):
            # TLS 1.3: the server checks our certificate after our side of the
            # handshake is done, so its refusal arrives as the first read.
            from metalog.broker.net.tls import handshake_failure_reason

            reason = handshake_failure_reason(exc)
            ch._log.warning("tls_handshake_failed", peer=ch.peer, reason=reason)
            ch._on_lost(self, f"TLS handshake with {ch.peer} failed: {reason}", tls_failure=True)
            return
        ch._on_lost(self, f"connection to {ch.peer} lost: {exc or 'closed by peer'}")

    def pause_writing(self) -> None:
        self.can_write.clear()

    def resume_writing(self) -> None:
        self.can_write.set()


class _Answer(Protocol):
    """Where a request's answer goes: an asyncio Future (``request``) or a
    ``_CallbackAnswer`` (``request_now``)."""

    def done(self) -> bool: ...

    def set_result(self, result: Any) -> None: ...

    def set_exception(self, exception: BaseException) -> None: ...


class _CallbackAnswer:
    """``request_now``'s answer: the callback, run at once with the answer,
    a loop turn later with a failure; once."""

    __slots__ = ("_channel", "_loop", "_on_answer", "_done", "timer")

    def __init__(self, channel: PeerChannel, loop: asyncio.AbstractEventLoop,
                 on_answer: Callable[[m.Body | None, BaseException | None], None]):
        self._channel = channel
        self._loop = loop
        self._on_answer = on_answer
        self._done = False
        self.timer: asyncio.TimerHandle | None = None

    def done(self) -> bool:
        return self._done

    def _finish(self) -> None:
        self._done = True
        self._channel._outstanding -= 1
        if self.timer is not None:
            self.timer.cancel()

    def set_result(self, result: Any) -> None:
        self._finish()
        self._on_answer(result, None)

    def set_exception(self, exception: BaseException) -> None:
        self._finish()
        self._loop.call_soon(self._on_answer, None, exception)


class PeerChannel:
    """Requests to one peer over one reused TCP connection.

    ``await request(api_key, body, timeout_ms)`` returns the flat response
    body (``edge.decode_response``; an answer that does not decode or map
    raises ``edge.ResponseDecodeError``).
    Failures: ``RequestTimeout`` (this request only; timeout_ms covers waiting
    for a connection and for the answer), ``ConnectionLost`` (every request in
    flight when the connection broke, or connecting failed), ``Overloaded``
    (``max_queued_requests`` already outstanding). After a loss the next request
    reconnects, waiting out an exponential backoff (``reconnect_backoff_ms``
    doubling per consecutive failure up to ``reconnect_backoff_max_ms``, ±20%
    jitter) within its own timeout.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        client_id: str | None = None,
        max_frame_bytes: int = DEFAULT_FRAME_BYTES_MAX,
        connect_timeout_ms: int = 1000,
        reconnect_backoff_ms: int = 50,
        reconnect_backoff_max_ms: int = 1000,
        max_queued_requests: int = 1024,
        logger: Any = None,
        tls: Any = None,
        server_hostname: str | None = None,
    ):
        if max_queued_requests <= 0 or connect_timeout_ms <= 0:
            raise ValueError(f"need max_queued_requests > 0 and connect_timeout_ms > 0, got "
                             f"{max_queued_requests} and {connect_timeout_ms}")
        # tls: a metalog.broker.net.tls.TlsFiles (its client context, reloaded on rotation) or an ssl.SSLContext.
        self.tls = tls
        self.server_hostname = server_hostname or host
        self.host = host
        self.port = port
        self.peer = f"{host}:{port}"
        self.client_id = client_id
        self.max_frame_bytes = max_frame_bytes
        self.connect_timeout_ms = connect_timeout_ms
        self.reconnect_backoff_ms = reconnect_backoff_ms
        self.reconnect_backoff_max_ms = reconnect_backoff_max_ms
        self._backoff = Backoff(min(reconnect_backoff_ms, reconnect_backoff_max_ms), reconnect_backoff_max_ms)
        self.max_queued_requests = max_queued_requests
        self._log = logger if logger is not None else library_logger("metalog.net")
        self._proto: _ClientProtocol | None = None
        self._connecting: asyncio.Future | None = None
        self._failures = 0  # consecutive failed connects / losses, drives the backoff
        self._next_connect_at_s = 0.0  # loop.time() before which we do not connect
        # correlation id -> (its future or callback, the request's edge: what reads the answer)
        self._pending: dict[int, tuple[_Answer, edge.Edge]] = {}
        self._outstanding = 0  # requests inside request(), connected or not
        self._ids = itertools.count(1)
        self._closed = False

    @property
    def connected(self) -> bool:
        return self._proto is not None and not self._proto.lost

    @property
    def outstanding(self) -> int:
        return self._outstanding

    def request_now(self, api_key: int, body: m.Body, timeout_ms: int,
                    on_answer: Callable[[m.Body | None, BaseException | None], None]) -> bool:
        """Write the request now and hand its answer to `on_answer(body, None)`
        in the turn that reads it, with no task or future in between (a
        follower's Fetch answer is on the commit path). Failures (timeout,
        loss, a garbled answer) come as `on_answer(None, exc)` a loop turn
        later, never inside the call that caused them. False, with nothing
        written, when the connection is not up and writable now: then use
        ``request``, which connects and waits."""
        proto = self._proto
        if (self._closed or self._outstanding >= self.max_queued_requests or proto is None or proto.lost
                or not proto.can_write.is_set() or proto.transport is None or proto.transport.is_closing()):
            return False
        loop = asyncio.get_running_loop()
        answer = _CallbackAnswer(self, loop, on_answer)
        self._outstanding += 1
        try:
            corr = self._write_entry(proto, api_key, body, answer)
        except BaseException:
            self._outstanding -= 1
            raise
        answer.timer = loop.call_at(loop.time() + timeout_ms / 1000, self._expire, corr, api_key, timeout_ms)
        return True

    def _write_entry(self, proto: _ClientProtocol, api_key: int, body: m.Body, answer: _Answer) -> int:
        """Encode and write one request; `answer` gets its result. Returns the correlation id."""
        corr = next(self._ids)
        if corr > _MAX_CORRELATION_ID:
            self._ids = itertools.count(1)
            corr = next(self._ids)
        meter = codec_clock.meter
        started_ns = 0 if meter is None else time.perf_counter_ns()
        how, frame = edge.encode_request(body, corr, self.client_id)  # raises before anything is pending
        if meter is not None:
            meter.codec_sample(codec_clock.ENCODE_REQUEST, how.api_key, time.perf_counter_ns() - started_ns)
        if how.api_key != api_key:
            raise InvariantViolation(f"{type(body).__name__} travels as api {how.api_key}, asked as {api_key}")
        self._pending[corr] = (answer, how)
        proto.transport.write(frame)
        return corr

    async def request(self, api_key: int, body: m.Body, timeout_ms: int) -> m.Body:
        if self._closed:
            raise ConnectionLost(f"channel to {self.peer} is closed")
        if self._outstanding >= self.max_queued_requests:
            raise Overloaded(
                f"{self._outstanding} requests outstanding to {self.peer} "
                f"(max_queued_requests={self.max_queued_requests})"
            )
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + timeout_ms / 1000
        self._outstanding += 1
        try:
            proto = self._proto
            if proto is None or proto.lost:
                proto = await self._wait(self._connect(), deadline_s, api_key, timeout_ms)
            if not proto.can_write.is_set():
                await self._wait(proto.can_write.wait(), deadline_s, api_key, timeout_ms)
                if proto.lost:
                    raise ConnectionLost(f"connection to {self.peer} lost while waiting to write")
            if proto.transport is None:
                raise InvariantViolation(f"connection to {self.peer} made without a transport")
            if proto.lost or proto.transport.is_closing():
                # Closed under us (reset, closed by the peer) before connection_lost
                # ran: uvloop would raise RuntimeError on write.
                if self.tls is not None and not proto.got_frame:
                    # A fresh TLS connection the broker closed before answering anything: the
                    # TLS 1.3 refusal of our certificate (see connection_lost), seen first here.
                    raise TlsHandshakeError(f"TLS handshake with {self.peer} failed: {_REFUSED_DURING_HANDSHAKE}")
                raise ConnectionLost(f"connection to {self.peer} closed before the request was written")
            fut = loop.create_future()
            corr = self._write_entry(proto, api_key, body, fut)
            timer = loop.call_at(deadline_s, self._expire, corr, api_key, timeout_ms)
            try:
                return await fut
            finally:
                timer.cancel()
                self._pending.pop(corr, None)
        finally:
            self._outstanding -= 1

    async def close(self) -> None:
        self._closed = True
        proto = self._proto
        if proto is not None and proto.transport is not None:
            proto.transport.close()
        self._fail_all("channel closed")

    # internals ---------------------------------------------------------------

    async def _wait(self, aw: Any, deadline_s: float, api_key: int, timeout_ms: int) -> Any:
        try:
            async with asyncio.timeout_at(deadline_s):
                return await aw
        except TimeoutError:
            raise RequestTimeout(
                f"api key {api_key} to {self.peer}: no connection within timeout_ms={timeout_ms}"
            ) from None

    async def _connect(self) -> _ClientProtocol:
        # Concurrent requesters share one connection attempt.
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.ensure_future(self._do_connect())
            self._connecting.add_done_callback(_retrieve_exception)
        return await asyncio.shield(self._connecting)

    async def _do_connect(self) -> _ClientProtocol:
        loop = asyncio.get_running_loop()
        delay_s = self._next_connect_at_s - loop.time()
        if delay_s > 0:
            await asyncio.sleep(delay_s)  # reconnect backoff, not a stand-in for a condition
        ctx = None
        if self.tls is not None:
            ctx = self.tls if isinstance(self.tls, ssl.SSLContext) else self.tls.client()
            problem = None if isinstance(self.tls, ssl.SSLContext) else self.tls.own_cert_problem()
            if problem is not None:
                self._schedule_backoff(loop)
                self._log.warning("tls_handshake_failed", peer=self.peer, reason=problem, failures=self._failures)
                raise TlsHandshakeError(f"TLS handshake with {self.peer} failed: {problem}")
        try:
            async with asyncio.timeout(self.connect_timeout_ms / 1000):
                if ctx is None:
                    _, proto = await loop.create_connection(
                        lambda: _ClientProtocol(self), self.host, self.port
                    )
                else:
                    _, proto = await loop.create_connection(
                        lambda: _ClientProtocol(self), self.host, self.port, ssl=ctx,
                        server_hostname=self.server_hostname,
                    )
        except (ssl.SSLError, ConnectionResetError) as exc:
            if ctx is None:
                self._schedule_backoff(loop)
                raise ConnectionLost(f"cannot connect to {self.peer}: {exc!r}") from None
            from metalog.broker.net.tls import handshake_failure_reason

            self._schedule_backoff(loop)
            reason = handshake_failure_reason(exc)
            if isinstance(exc, ConnectionResetError):
                reason = _REFUSED_DURING_HANDSHAKE
            self._log.warning("tls_handshake_failed", peer=self.peer, reason=reason, failures=self._failures)
            raise TlsHandshakeError(f"TLS handshake with {self.peer} failed: {reason}") from None
        except (OSError, TimeoutError) as exc:
            self._schedule_backoff(loop)
            self._log.info("connect_failed", peer=self.peer, error=repr(exc), failures=self._failures)
            raise ConnectionLost(f"cannot connect to {self.peer}: {exc!r}") from None
        if self._closed:
            proto.transport.close()
            raise ConnectionLost(f"channel to {self.peer} is closed")
        self._failures = 0
        self._proto = proto
        return proto

    def _schedule_backoff(self, loop: asyncio.AbstractEventLoop) -> None:
        self._failures += 1
        self._next_connect_at_s = loop.time() + self._backoff.delay_ms(self._failures, random) / 1000

    def _expire(self, corr: int, api_key: int, timeout_ms: int) -> None:
        entry = self._pending.pop(corr, None)
        if entry is None or entry[0].done():
            return
        entry[0].set_exception(
            RequestTimeout(f"api key {api_key} to {self.peer}: no answer within timeout_ms={timeout_ms}")
        )
        # Kafka's answers leave in request order: every later answer on this
        # connection now queues behind one that may never come (a produce the
        # leader cannot commit holds up the Metadata that would find the new
        # leader). Kafka's clients disconnect on a request timeout (Java's
        # NetworkClient, librdkafka); so do we, and the others on it are retried.
        proto = self._proto
        if proto is not None and not proto.lost and proto.transport is not None:
            proto.lost = True
            proto.transport.abort()
            self._on_lost(proto, f"request to {self.peer} timed out (api key {api_key}, timeout_ms={timeout_ms}): "
                                 "answers come in order, so the connection is closed")

    def _on_frame(self, proto: _ClientProtocol, frame: bytes | bytearray) -> None:
        corr = response_correlation_id(frame)
        entry = self._pending.pop(corr, None)
        if entry is None:
            return  # the request timed out already
        fut, how = entry
        if fut.done():
            return
        meter = codec_clock.meter
        started_ns = 0 if meter is None else time.perf_counter_ns()
        try:
            body = edge.decode_response(how, frame)
        except edge.ResponseDecodeError as exc:
            fut.set_exception(exc)
            return
        if meter is not None:
            meter.codec_sample(codec_clock.DECODE_RESPONSE, how.api_key, time.perf_counter_ns() - started_ns)
        fut.set_result(body)

    def _on_lost(self, proto: _ClientProtocol, reason: str, tls_failure: bool = False) -> None:
        if proto is not self._proto:
            return
        self._proto = None
        if not self._closed:
            self._schedule_backoff(asyncio.get_running_loop())
            self._log.info("connection_lost", peer=self.peer, reason=reason,
                           inflight=len(self._pending))
        self._fail_all(reason, TlsHandshakeError if tls_failure else ConnectionLost)

    def _fail_all(self, reason: str, error: type[ConnectionLost] = ConnectionLost) -> None:
        pending, self._pending = self._pending, {}
        for fut, _ in pending.values():
            if not fut.done():
                fut.set_exception(error(reason))


QUORUM_LANE = "quorum"  # the quorum's own requests (Vote, Fetch, ...) and short asks
FORWARD_LANE = "forward"  # admin requests forwarded to the leader, answered after a commit


class PeerPool:
    """One PeerChannel per node id and lane, created on first use.

    Answers on a channel come in order, and a request that times out closes
    its connection with every request in flight on it. A forwarded admin
    request (answered once its records commit) therefore has a connection of
    its own, as Kafka's brokers forward on a channel apart from replication:
    a replica Fetch timing out under load must not cut it, leaving its client
    to retry a command the leader may already have written (a second
    CreateTopics then meets TOPIC_ALREADY_EXISTS)."""

    def __init__(self, endpoints: dict[int, tuple[str, int]], **channel_kwargs: Any):
        self._endpoints = dict(endpoints)
        self._channel_kwargs = channel_kwargs
        self._channels: dict[tuple[int, str], PeerChannel] = {}  # bounded: nodes x the two lanes

    def channel(self, node_id: int, lane: str = QUORUM_LANE) -> PeerChannel:
        key = (node_id, lane)
        ch = self._channels.get(key)
        if ch is None:
            if node_id not in self._endpoints:
                raise KeyError(f"unknown node id {node_id} (known: {sorted(self._endpoints)})")
            host, port = self._endpoints[node_id]
            ch = self._channels[key] = PeerChannel(host, port, **self._channel_kwargs)
        return ch

    def set_endpoint(self, node_id: int, host: str, port: int) -> None:
        """Add or move a node; a moved node's old channels are closed in the background."""
        if self._endpoints.get(node_id) == (host, port):
            return
        self._endpoints[node_id] = (host, port)
        for key in [k for k in self._channels if k[0] == node_id]:
            asyncio.ensure_future(self._channels.pop(key).close())

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for ch in channels.values():
            await ch.close()

