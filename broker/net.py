"""The asyncio network layer: a request server and outbound request channels.

* ``serve()`` accepts connections and turns each decoded request into a call
  ``handler(conn, header, body)``; the handler answers whenever it likes with
  ``conn.send_response(header.correlation_id, response_body)`` (responses may
  go out in any order, the correlation id matches them up). Bad input is
  answered with an ErrorResponse where the header was readable and closes the
  connection otherwise (see ``protocol.codec``); either way one structured log
  line, and the server keeps serving everyone else.
* ``PeerChannel`` is one reusable TCP connection to one peer carrying many
  concurrent requests, with per-request timeouts, reconnect with exponential
  backoff, and a bounded number of outstanding requests.
* ``PeerPool`` maps node ids to channels.

Both sides use ``asyncio.Protocol`` (not streams): it gives direct control of
pause/resume reading for the bounds below and dispatches requests without a
task per connection. Throughput against a stream-based server was about equal
in ``python -m tests.net.bench_net [--streams] [--uvloop]`` (the client side
dominates). Works on the default loop and on uvloop.

Security (docs/security.md): with a ``tls`` provider (``broker.tls.TlsFiles``)
every accepted connection does a mutual-TLS handshake (``loop.start_tls``,
bounded by ``handshake_timeout_ms``) before its first request is read;
``conn.principal`` is then the peer certificate's principal (``ANONYMOUS``
without TLS) and ``conn.peer`` its address. A ``Listener`` decides before
the handshake whether to take a connection at all: a cap per listener and per
address, and a back-off for addresses that keep failing (handshakes, bad
frames, idle half-frames), and it closes connections idle longer than
``connections_max_idle_ms``, a half-sent frame included.

Bounds: a connection dispatches at most ``max_inflight_per_conn`` requests
that have not been answered yet; above that it stops reading (TCP pushes back
on the peer). When the socket's write buffer passes its high-water mark the
connection also stops reading, so unsent response bytes stay below the
high-water mark plus the answers to the requests already in flight.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import itertools
import random
import ssl
from dataclasses import dataclass
from collections.abc import Coroutine
from typing import Any, Callable

import structlog

from broker.backoff import Backoff
from broker.principal import ANONYMOUS, Principal, principal_from_cert

from protocol import codec
from protocol import messages as m
from protocol.apis import APIS
from protocol.codec import NEED_DATA, RequestHeader
from protocol.errors import Errors

Handler = Callable[["Connection", RequestHeader, m.Body], Any]

DEFAULT_WRITE_HIGH_WATER_BYTES = 1 << 20
_MAX_CORRELATION_ID = (1 << 31) - 1


# --------------------------------------------------------------------------
# Server side


class Connection(asyncio.Protocol):
    """One accepted connection. Handlers answer through ``send_response``."""

    def __init__(self, handler: Handler, max_frame_bytes: int, max_inflight: int, logger: Any,
                 listener: "Listener | None" = None):
        assert max_inflight > 0
        self._listener = listener
        self.principal: Principal = ANONYMOUS  # set before the first request is dispatched
        self.ready = False  # handshake done (always, without TLS); requests are dispatched only then
        self.last_active = 0.0  # loop.time() of the last byte in or out, for the idle timeout
        self._counted = False  # holds a slot in the listener's connection counts
        self._handler = handler
        self._decoder = codec.FrameDecoder(max_frame_bytes)
        self._max_inflight = max_inflight
        self._log = logger
        self._transport: Any = None  # asyncio or uvloop transport
        self.peer: str = "?"
        self.peer_host: str = "?"
        self._raw_transport: Any = None  # the TCP transport while the TLS handshake runs
        self.inflight = 0
        self.closed = False
        self._read_paused = False
        self._write_paused = False
        self._processing = False  # guards _process against re-entry from send_response
        self._close_callbacks: list[Callable[[Connection], None]] = []

    # asyncio.Protocol ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        self.peer_host = peer[0] if peer else "?"
        self.last_active = asyncio.get_running_loop().time()
        listener = self._listener
        if listener is None:
            self._ready(transport, ANONYMOUS)
            return
        if not listener.admit(self):
            self.closed = True
            transport.abort()
            return
        self._counted = True
        if listener.tls is None:
            self._ready(transport, ANONYMOUS)
            return
        self._raw_transport = transport
        # start_tls must take the transport over now, inside connection_made:
        # uvloop starts reading right after connection_made returns, and a
        # ClientHello read by this protocol would be lost to the handshake.
        started = _Started(asyncio.get_running_loop().start_tls(
            transport, self, listener.tls.server(), server_side=True,
            ssl_handshake_timeout=listener.handshake_timeout_ms / 1000,
        ))
        listener.spawn(self._handshake(transport, started, listener))

    async def _handshake(self, transport: Any, started: "_Started", listener: "Listener") -> None:
        try:
            ssl_transport = await started
        except (OSError, TimeoutError, EOFError) as exc:  # ssl.SSLError is an OSError
            from broker.tls import handshake_failure_reason, is_handshake_timeout

            # Resets and EOFs also come from restarts and fault proxies; only
            # protocol errors and stalls count toward the address's back-off.
            listener.failed(self, "tls_handshake_failed",
                            count=isinstance(exc, ssl.SSLError) or is_handshake_timeout(exc),
                            reason=handshake_failure_reason(exc))
            # close, not abort: the TLS alert (unknown CA, expired...) reaches the
            # client, which can then tell its user why.
            transport.close()
            self._closed_before_ready()
            return
        except asyncio.CancelledError:
            transport.abort()
            self._closed_before_ready()
            raise
        if self.closed:
            ssl_transport.abort()
            return
        try:
            principal = principal_from_cert(ssl_transport.get_extra_info("peercert"))
        except ValueError as exc:
            listener.failed(self, "tls_handshake_failed", reason=str(exc))
            ssl_transport.abort()
            self._closed_before_ready()
            return
        self._ready(ssl_transport, principal)

    def _ready(self, transport: Any, principal: Principal) -> None:
        self._transport = transport
        self.principal = principal
        self.ready = True
        transport.set_write_buffer_limits(high=DEFAULT_WRITE_HIGH_WATER_BYTES)
        if self._listener is not None:
            self._listener.succeeded(self)
        self._process()  # bytes that arrived with the end of the handshake

    def _closed_before_ready(self) -> None:
        self.closed = True
        if self._counted:
            self._counted = False
            assert self._listener is not None
            self._listener.release(self)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self.last_active = asyncio.get_running_loop().time()
        try:
            self._decoder.feed(data)
        except codec.FrameError as exc:
            self._abort("bad_frame", exc)
            return
        if self.ready:
            self._process()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._transport = None
        if self._counted:
            self._counted = False
            assert self._listener is not None
            self._listener.release(self)
        callbacks, self._close_callbacks = self._close_callbacks, []
        for cb in callbacks:
            try:
                cb(self)
            except Exception:
                self._log.exception("close_callback_failed", peer=self.peer)

    def pause_writing(self) -> None:
        self._write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._update_reading()
        if not self.closed:
            self._process()

    # public -----------------------------------------------------------------

    def send_response(self, correlation_id: int, body: m.Body) -> bool:
        """Answer one request. Returns False (and drops the answer) if the connection is gone."""
        assert self.inflight > 0, "send_response without a request in flight"
        self.inflight -= 1
        if self.closed or self._transport is None:
            return False
        self.last_active = asyncio.get_running_loop().time()
        self._transport.write(codec.encode_response(correlation_id, body))
        # Reading is paused exactly when frames may wait in the decoder.
        if self._read_paused and not self._processing and self.inflight < self._max_inflight:
            self._process()
        return True

    def add_close_callback(self, cb: Callable[[Connection], None]) -> None:
        """Call `cb(conn)` once when the connection closes (e.g. to drop parked requests)."""
        if self.closed:
            cb(self)
        else:
            self._close_callbacks.append(cb)

    def close(self) -> None:
        if self._transport is not None and not self.closed:
            self._transport.close()

    def idle_close(self, idle_ms: int) -> None:
        """Cut a connection idle past the limit (half-sent frame or not)."""
        partial = self._decoder.buffered_bytes
        self._log.info("connection_idle_closed", peer=self.peer, principal=str(self.principal),
                       idle_ms=idle_ms, partial_frame_bytes=partial)
        if partial and self._listener is not None:
            self._listener.record_failure(self.peer_host)
        self.closed = True
        transport = self._transport if self._transport is not None else self._raw_transport
        if transport is not None:
            transport.abort()

    # internals ---------------------------------------------------------------

    def _update_reading(self) -> None:
        if self._transport is None or self.closed:
            return
        want_pause = self._write_paused or self.inflight >= self._max_inflight
        if want_pause and not self._read_paused:
            self._transport.pause_reading()
            self._read_paused = True
        elif not want_pause and self._read_paused:
            self._transport.resume_reading()
            self._read_paused = False

    def _process(self) -> None:
        """Dispatch buffered frames while the inflight and write bounds allow."""
        if self._processing:
            return
        self._processing = True
        try:
            self._process_frames()
        finally:
            self._processing = False
        self._update_reading()

    def _process_frames(self) -> None:
        decoder = self._decoder
        while not self.closed and not self._write_paused and self.inflight < self._max_inflight:
            try:
                frame = decoder.next_frame()
            except codec.FrameError as exc:
                self._abort("bad_frame", exc)
                return
            if frame is NEED_DATA:
                break
            try:
                header, body = codec.decode_request(frame)
            except codec.RequestError as exc:
                self._log.warning(
                    "bad_request", peer=self.peer, api_key=exc.header.api_key,
                    api_version=exc.header.api_version, correlation_id=exc.header.correlation_id,
                    error=type(exc).__name__, detail=str(exc),
                )
                self.inflight += 1
                self.send_response(exc.header.correlation_id, exc.error_response())
                continue
            except codec.HeaderDecodeError as exc:
                self._abort("bad_header", exc)
                return
            self.inflight += 1
            self._dispatch(header, body)

    def _dispatch(self, header: RequestHeader, body: m.Body) -> None:
        try:
            result = self._handler(self, header, body)
        except Exception as exc:
            self._handler_failed(header, exc)
            return
        if result is not None and inspect.isawaitable(result):  # most handlers answer inline
            task = asyncio.ensure_future(result)
            task.add_done_callback(lambda t, h=header: self._async_done(t, h))

    def _async_done(self, task: asyncio.Future, header: RequestHeader) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._handler_failed(header, exc)

    def _handler_failed(self, header: RequestHeader, exc: BaseException) -> None:
        # A handler bug must not leave the requester waiting until its timeout.
        self._log.error(
            "handler_failed", peer=self.peer, api_key=header.api_key,
            correlation_id=header.correlation_id, error=repr(exc),
        )
        if self.inflight > 0:
            self.send_response(
                header.correlation_id,
                m.ErrorResponse(error_code=Errors.UNKNOWN_SERVER_ERROR, error_message=repr(exc)),
            )

    def _abort(self, event: str, exc: Exception) -> None:
        self._log.warning(
            event, peer=self.peer, principal=str(self.principal), error=type(exc).__name__,
            detail=str(exc), action="close"
        )
        if self._listener is not None:
            self._listener.record_failure(self.peer_host)
        self.closed = True
        if self._transport is not None:
            self._transport.abort()


class _Started:
    """A coroutine run now up to its first suspension; awaiting it runs the rest.

    (Python 3.11 has no eager tasks; this gives one coroutine that property.)"""

    __slots__ = ("_coro", "_yielded", "_done", "_result")

    def __init__(self, coro: Any):
        self._coro = coro
        self._done = False
        self._result: Any = None
        try:
            self._yielded = coro.send(None)
        except StopIteration as stop:
            self._done, self._result, self._yielded = True, stop.value, None

    def __await__(self) -> Any:
        if self._done:
            return self._result
        coro, value = self._coro, self._yielded
        while True:
            try:
                sent = yield value
            except BaseException as exc:  # e.g. CancelledError thrown into the task
                try:
                    value = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
                continue
            try:
                value = coro.send(sent)
            except StopIteration as stop:
                return stop.value


@dataclass(frozen=True)
class ListenerLimits:
    """Connection hygiene of one listener (the broker config's keys, same names)."""

    ssl_handshake_timeout_ms: int = 5000
    connections_max_idle_ms: int = 600_000
    max_connections: int = 4096
    max_connections_per_ip: int = 1024
    failed_connections_before_backoff: int = 5
    failed_connection_backoff_ms: int = 1000
    failed_connection_backoff_max_ms: int = 60_000
    max_tracked_addresses: int = 10_000  # bound on the per-address failure table


class _AddressState:
    __slots__ = ("failures", "blocked_until", "backoff_ms", "refused")

    def __init__(self) -> None:
        self.failures = 0
        self.blocked_until = 0.0
        self.backoff_ms = 0
        self.refused = 0  # connections refused in the current back-off period


class Listener:
    """Admission, TLS and idle policing shared by the connections of one server."""

    def __init__(self, tls: Any, limits: ListenerLimits, logger: Any):
        self.tls = tls  # broker.tls.TlsFiles or None (plaintext)
        self.limits = limits
        self.handshake_timeout_ms = limits.ssl_handshake_timeout_ms
        self._log = logger
        self.connections: set[Connection] = set()
        self.per_ip: collections.Counter[str] = collections.Counter()
        self._addresses: collections.OrderedDict[str, _AddressState] = collections.OrderedDict()
        self._tasks: set[asyncio.Task] = set()
        self._sweeper: asyncio.Task | None = None
        self._cap_logged_at = 0.0
        self.refused_total = 0

    def start(self) -> None:
        self._sweeper = asyncio.ensure_future(self._sweep())

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for t in list(self._tasks):
            t.cancel()

    def spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # admission ------------------------------------------------------------
    def admit(self, conn: Connection) -> bool:
        loop_now = asyncio.get_running_loop().time()
        host = conn.peer_host
        st = self._addresses.get(host)
        if st is not None and loop_now < st.blocked_until:
            st.refused += 1
            self.refused_total += 1
            return False  # logged once, when the back-off period started
        lim = self.limits
        if len(self.connections) >= lim.max_connections or self.per_ip[host] >= lim.max_connections_per_ip:
            self.refused_total += 1
            if loop_now - self._cap_logged_at >= 1.0:  # at most one line per second under a flood
                self._cap_logged_at = loop_now
                self._log.warning("connection_refused", peer=conn.peer, reason="connection limit",
                                  connections=len(self.connections), from_this_address=self.per_ip[host],
                                  max_connections=lim.max_connections,
                                  max_connections_per_ip=lim.max_connections_per_ip)
            return False
        self.connections.add(conn)
        self.per_ip[host] += 1
        return True

    def release(self, conn: Connection) -> None:
        self.connections.discard(conn)
        host = conn.peer_host
        self.per_ip[host] -= 1
        if self.per_ip[host] <= 0:
            del self.per_ip[host]

    def succeeded(self, conn: Connection) -> None:
        st = self._addresses.get(conn.peer_host)
        if st is not None:
            st.failures = 0

    def failed(self, conn: Connection, event: str, count: bool = True, **fields: Any) -> None:
        """A failed handshake: logged once per connection; `count`s toward back-off."""
        self._log.warning(event, peer=conn.peer, **fields)
        if count:
            self.record_failure(conn.peer_host)

    def record_failure(self, host: str) -> None:
        lim = self.limits
        st = self._addresses.get(host)
        if st is None:
            st = self._addresses[host] = _AddressState()
            while len(self._addresses) > lim.max_tracked_addresses:
                self._addresses.popitem(last=False)
        else:
            self._addresses.move_to_end(host)
        st.failures += 1
        if st.failures < lim.failed_connections_before_backoff:
            return
        st.backoff_ms = min(max(st.backoff_ms * 2, lim.failed_connection_backoff_ms),
                            lim.failed_connection_backoff_max_ms)
        st.blocked_until = asyncio.get_running_loop().time() + st.backoff_ms / 1000
        self._log.warning("connection_backoff", address=host, failures=st.failures,
                          backoff_ms=st.backoff_ms, refused_in_previous_period=st.refused)
        st.refused = 0

    # idle ------------------------------------------------------------------
    async def _sweep(self) -> None:
        idle_ms = self.limits.connections_max_idle_ms
        interval_s = min(max(idle_ms / 4000, 0.05), 1.0)
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval_s)  # a periodic timer, not a stand-in for a condition
            if self.tls is not None:
                self.tls.maybe_reload()  # rotation is noticed (and logged) without waiting for a handshake
            cutoff = loop.time() - idle_ms / 1000
            for conn in [c for c in self.connections if c.ready and c.last_active < cutoff and c.inflight == 0]:
                if not conn.closed:
                    conn.idle_close(idle_ms)


async def serve(
    host: str,
    port: int,
    handler: Handler,
    *,
    max_frame_bytes: int = codec.DEFAULT_MAX_FRAME_BYTES,
    max_inflight_per_conn: int = 1024,
    logger: Any = None,
    tls: Any = None,
    limits: ListenerLimits | None = None,
) -> "Server":
    """Listen on (host, port); port 0 picks a free one (see ``server.sockets``).

    `handler(conn, header, body)` is called once per well-formed request; it
    may return a coroutine (run as a task). Exactly one ``conn.send_response``
    per request is expected; if the handler raises, the request is answered
    with UNKNOWN_SERVER_ERROR. `tls` (a ``broker.tls.TlsFiles``) turns on
    mutual TLS; `limits` the connection hygiene (defaults otherwise). The
    listener is ``server.listener``.
    """
    log = logger if logger is not None else structlog.get_logger("metalog.net")
    loop = asyncio.get_running_loop()
    listener = Listener(tls, limits or ListenerLimits(), log)
    server = await loop.create_server(
        lambda: Connection(handler, max_frame_bytes, max_inflight_per_conn, log, listener), host, port
    )
    listener.start()
    return Server(server, listener)


class Server:
    """The listening server (asyncio's or uvloop's) with its ``Listener``."""

    def __init__(self, server: asyncio.AbstractServer, listener: Listener):
        self._server = server
        self.listener = listener

    @property
    def sockets(self) -> Any:
        return self._server.sockets

    def close(self) -> None:
        self.listener.close()
        self._server.close()

    async def wait_closed(self) -> None:
        await self._server.wait_closed()


# --------------------------------------------------------------------------
# Client side


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
        self.decoder = codec.FrameDecoder(channel.max_frame_bytes)
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
        except codec.ProtocolError as exc:
            ch._log.warning("bad_response_stream", peer=ch.peer, error=type(exc).__name__,
                            detail=str(exc), action="close")
            self.lost = True
            assert self.transport is not None
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
            from broker.tls import handshake_failure_reason

            reason = handshake_failure_reason(exc)
            ch._log.warning("tls_handshake_failed", peer=ch.peer, reason=reason)
            ch._on_lost(self, f"TLS handshake with {ch.peer} failed: {reason}", tls_failure=True)
            return
        ch._on_lost(self, f"connection to {ch.peer} lost: {exc or 'closed by peer'}")

    def pause_writing(self) -> None:
        self.can_write.clear()

    def resume_writing(self) -> None:
        self.can_write.set()


class PeerChannel:
    """Requests to one peer over one reused TCP connection.

    ``await request(api_key, body, timeout_ms)`` returns the response body (of
    the api's response type, or ``ErrorResponse`` per the codec's rule).
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
        max_frame_bytes: int = codec.DEFAULT_MAX_FRAME_BYTES,
        connect_timeout_ms: int = 1000,
        reconnect_backoff_ms: int = 50,
        reconnect_backoff_max_ms: int = 1000,
        max_queued_requests: int = 1024,
        logger: Any = None,
        tls: Any = None,
        server_hostname: str | None = None,
    ):
        assert max_queued_requests > 0 and connect_timeout_ms > 0
        # tls: a broker.tls.TlsFiles (its client context, reloaded on rotation) or an ssl.SSLContext.
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
        self._log = logger if logger is not None else structlog.get_logger("metalog.net")
        self._proto: _ClientProtocol | None = None
        self._connecting: asyncio.Future | None = None
        self._failures = 0  # consecutive failed connects / losses, drives the backoff
        self._next_connect_at = 0.0  # loop.time() before which we do not connect
        # correlation id -> (future, response type)
        self._pending: dict[int, tuple[asyncio.Future, type[m.Body]]] = {}
        self._outstanding = 0  # requests inside request(), connected or not
        self._ids = itertools.count(1)
        self._closed = False

    @property
    def connected(self) -> bool:
        return self._proto is not None and not self._proto.lost

    @property
    def outstanding(self) -> int:
        return self._outstanding

    def request_eager(self, api_key: int, body: m.Body, timeout_ms: int) -> Coroutine[Any, Any, m.Body]:
        """As ``request``, but when the connection is up and writable the
        request is written NOW, before this returns, rather than when the
        returned coroutine first runs (a loop turn later if it is made a task):
        a follower's next Fetch leaves as soon as its flush completes, ahead of
        whatever else that loop turn does. Otherwise it is ``request`` itself.
        Await (or close) the result: it holds the request's slot."""
        proto = self._proto
        if (self._closed or self._outstanding >= self.max_queued_requests or proto is None or proto.lost
                or not proto.can_write.is_set() or proto.transport is None or proto.transport.is_closing()):
            return self.request(api_key, body, timeout_ms)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_ms / 1000
        self._outstanding += 1
        try:
            corr, fut = self._write(loop, proto, api_key, body)
        except BaseException:
            self._outstanding -= 1
            raise
        return self._answer(fut, corr, deadline, api_key, timeout_ms)

    async def _answer(self, fut: asyncio.Future, corr: int, deadline: float, api_key: int,
                      timeout_ms: int) -> m.Body:
        """The answer to a request request_eager wrote."""
        loop = asyncio.get_running_loop()
        timer = loop.call_at(deadline, self._expire, corr, api_key, timeout_ms)
        try:
            return await fut
        finally:
            timer.cancel()
            self._pending.pop(corr, None)
            self._outstanding -= 1

    def _write(self, loop: asyncio.AbstractEventLoop, proto: _ClientProtocol, api_key: int,
               body: m.Body) -> tuple[int, asyncio.Future]:
        """Write one request on a live connection: (correlation id, answer future)."""
        corr = next(self._ids)
        if corr > _MAX_CORRELATION_ID:
            self._ids = itertools.count(1)
            corr = next(self._ids)
        fut = loop.create_future()
        self._pending[corr] = (fut, APIS[api_key][1])
        proto.transport.write(codec.encode_request(api_key, corr, self.client_id, body))
        return corr, fut

    async def request(self, api_key: int, body: m.Body, timeout_ms: int) -> m.Body:
        if self._closed:
            raise ConnectionLost(f"channel to {self.peer} is closed")
        if self._outstanding >= self.max_queued_requests:
            raise Overloaded(
                f"{self._outstanding} requests outstanding to {self.peer} "
                f"(max_queued_requests={self.max_queued_requests})"
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_ms / 1000
        self._outstanding += 1
        try:
            proto = self._proto
            if proto is None or proto.lost:
                proto = await self._wait(self._connect(), deadline, api_key, timeout_ms)
            if not proto.can_write.is_set():
                await self._wait(proto.can_write.wait(), deadline, api_key, timeout_ms)
                if proto.lost:
                    raise ConnectionLost(f"connection to {self.peer} lost while waiting to write")
            assert proto.transport is not None
            if proto.lost or proto.transport.is_closing():
                # Closed under us (reset, closed by the peer) before connection_lost
                # ran: uvloop would raise RuntimeError on write.
                if self.tls is not None and not proto.got_frame:
                    # A fresh TLS connection the broker closed before answering anything: the
                    # TLS 1.3 refusal of our certificate (see connection_lost), seen first here.
                    raise TlsHandshakeError(f"TLS handshake with {self.peer} failed: {_REFUSED_DURING_HANDSHAKE}")
                raise ConnectionLost(f"connection to {self.peer} closed before the request was written")
            corr, fut = self._write(loop, proto, api_key, body)
            timer = loop.call_at(deadline, self._expire, corr, api_key, timeout_ms)
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

    async def _wait(self, aw: Any, deadline: float, api_key: int, timeout_ms: int) -> Any:
        try:
            async with asyncio.timeout_at(deadline):
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
        delay = self._next_connect_at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)  # reconnect backoff, not a stand-in for a condition
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
            from broker.tls import handshake_failure_reason

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
        self._next_connect_at = loop.time() + self._backoff.delay_ms(self._failures, random) / 1000

    def _expire(self, corr: int, api_key: int, timeout_ms: int) -> None:
        entry = self._pending.pop(corr, None)
        if entry is not None and not entry[0].done():
            entry[0].set_exception(
                RequestTimeout(f"api key {api_key} to {self.peer}: no answer within timeout_ms={timeout_ms}")
            )

    def _on_frame(self, proto: _ClientProtocol, frame: bytes | bytearray) -> None:
        corr = codec.response_correlation_id(frame)
        entry = self._pending.pop(corr, None)
        if entry is None:
            return  # the request timed out already
        fut, resp_type = entry
        if fut.done():
            return
        try:
            fut.set_result(codec.decode_response(frame, resp_type))
        except codec.ResponseDecodeError as exc:
            fut.set_exception(exc)

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


class PeerPool:
    """One PeerChannel per node id, created on first use."""

    def __init__(self, endpoints: dict[int, tuple[str, int]], **channel_kwargs: Any):
        self._endpoints = dict(endpoints)
        self._channel_kwargs = channel_kwargs
        self._channels: dict[int, PeerChannel] = {}

    def channel(self, node_id: int) -> PeerChannel:
        ch = self._channels.get(node_id)
        if ch is None:
            if node_id not in self._endpoints:
                raise KeyError(f"unknown node id {node_id} (known: {sorted(self._endpoints)})")
            host, port = self._endpoints[node_id]
            ch = self._channels[node_id] = PeerChannel(host, port, **self._channel_kwargs)
        return ch

    def set_endpoint(self, node_id: int, host: str, port: int) -> None:
        """Add or move a node; a moved node's old channel is closed in the background."""
        if self._endpoints.get(node_id) == (host, port):
            return
        self._endpoints[node_id] = (host, port)
        old = self._channels.pop(node_id, None)
        if old is not None:
            asyncio.ensure_future(old.close())

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for ch in channels.values():
            await ch.close()

