"""The transport half of an accepted connection (the protocol half is ``metalog.broker.net.kafka_conn``).

``Connection`` is the base of ``KafkaConnection``, the connection of both
broker ports (``listen``, Kafka's controller listener, and ``kafka_listen``,
its client listener). It owns what does not depend on the protocol: the
mutual-TLS handshake, admission by its ``Listener``, the frame decoder
(``metalog.protocol.kafka.framing``), the idle timeout, the bounds on reading,
and the bounded logging of bad input. A subclass says what happens to one
whole frame (``_take``) and how it is answered. The outbound side
(``PeerChannel``, one reusable connection to one peer carrying many
concurrent requests, and ``PeerPool``) is ``metalog.broker.net.channel``.

Both sides use ``asyncio.Protocol`` (not streams): it gives direct control of
pause/resume reading for the bounds below and dispatches requests without a
task per connection. Works on the default loop and on uvloop.

Security (docs/security.md): with a ``tls`` provider (``metalog.broker.net.tls.TlsFiles``)
every accepted connection does a mutual-TLS handshake (bounded by
``handshake_timeout_ms``) before its first request is read: in a handshake
thread on a transport of our own (``metalog.broker.net.tls_transport``) for
connections of our ``Listener``'s accept loop, ``loop.start_tls`` for a
transport made by another (``loop.create_server``);
``conn.principal`` is then the peer certificate's principal (``ANONYMOUS``
without TLS) and ``conn.peer`` its address. A ``Listener``
(``metalog.broker.net.listener``) decides before
the handshake whether to take a connection at all: a cap per listener and per
address, and a back-off for addresses that keep failing (handshakes, bad
frames, idle half-frames), and it closes connections idle longer than
``connections_max_idle_ms``, a half-sent frame included.

Bounds: a connection reads at most ``max_inflight`` requests that have not
been answered yet (``inflight``, kept by the subclass); above that it stops
reading (TCP pushes back on the peer). When the socket's write buffer passes
its high-water mark the connection also stops reading, so unsent response
bytes stay below the high-water mark plus the answers to the requests already
in flight.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import struct
from typing import TYPE_CHECKING, Any, Callable

from metalog.broker.net.principal import ANONYMOUS, Principal, principal_from_cert
from metalog.broker.net.tls_transport import TlsSocketTransport
from metalog.protocol.invariants import InvariantViolation
from metalog.protocol.kafka.framing import NEED_DATA, FrameDecoder, FrameError

if TYPE_CHECKING:  # the listener imports this module: a name for annotations only
    from metalog.broker.net.listener import Listener

DEFAULT_WRITE_HIGH_WATER_BYTES = 1 << 20
TCP_INFO_BYTES = 256  # room for Linux's struct tcp_info
TCPI_BYTES_ACKED_OFFSET = 120  # its tcpi_bytes_acked (Linux 4.2 and later), a u64
LEFT_AFTER_ANSWER = "the peer left after our answer to its ClientHello"
_SSL_EOFS = (ssl.SSLEOFError, ssl.SSLZeroReturnError)  # the peer left: no protocol error of its own


def _dup_fd(transport: Any) -> int:
    """A duplicate of `transport`'s socket (-1 without one): still readable after uvloop closes its own."""
    sock = transport.get_extra_info("socket")
    if sock is None or not hasattr(socket, "TCP_INFO"):
        return -1
    try:
        return os.dup(sock.fileno())
    except OSError:
        return -1


# --------------------------------------------------------------------------
# Server side


class Connection(asyncio.Protocol):
    """One accepted connection, up to whole frames; a subclass reads them (``_take``)."""

    def __init__(self, max_frame_bytes: int, max_inflight: int, logger: Any, listener: "Listener | None" = None):
        if max_inflight <= 0:
            raise ValueError(f"max_inflight must be > 0, got {max_inflight}")
        self._listener = listener
        self.principal: Principal = ANONYMOUS  # set before the first request is dispatched
        self.ready = False  # handshake done (always, without TLS); requests are dispatched only then
        self.last_active_s = 0.0  # loop.time() of the last byte in or out, for the idle timeout
        self._counted = False  # holds a slot in the listener's connection counts
        self._proven = False  # the address's run of failures is over (handshake done, or a good request)
        self._decoder = FrameDecoder(max_frame_bytes)
        self._max_inflight = max_inflight
        self._log = logger
        self._transport: Any = None  # asyncio or uvloop transport
        self.peer: str = "?"
        self.peer_host: str = "?"
        self._raw_transport: Any = None  # the TCP transport while the TLS handshake runs
        self._probe_fd = -1  # a stranger's socket while it handshakes (a dup: it outlives a reset)
        self.inflight = 0
        self.closed = False
        self._read_paused = False
        self._write_paused = False
        self._processing = False  # guards _process against re-entry from an answer sent while it runs
        self._close_callbacks: list[Callable[[Connection], None]] = []

    # asyncio.Protocol ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        self.peer_host = peer[0] if peer else "?"
        self.last_active_s = asyncio.get_running_loop().time()
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
        if self.peer_host not in listener.exempt:
            self._probe_fd = _dup_fd(transport)
        timeout_s = listener.handshake_timeout_ms / 1000
        if isinstance(transport, TlsSocketTransport):  # our listener's: the handshake runs in a thread
            started: Any = transport.handshake(timeout_s)
        else:
            # start_tls must take the transport over now, inside connection_made:
            # uvloop starts reading right after connection_made returns, and a
            # ClientHello read by this protocol would be lost to the handshake.
            started = _Started(asyncio.get_running_loop().start_tls(
                transport, self, listener.server_context(), server_side=True, ssl_handshake_timeout=timeout_s))
        listener.spawn(self._handshake(transport, started, listener))

    async def _handshake(self, transport: Any, started: Any, listener: "Listener") -> None:
        try:
            ssl_transport = await started
        except (OSError, TimeoutError, EOFError) as exc:  # ssl.SSLError is an OSError
            from metalog.broker.net.tls import handshake_failure_reason, is_handshake_timeout

            # Resets and EOFs also come from restarts and fault proxies; they count toward
            # the address's back-off only once the peer has had our answer to its
            # ClientHello (what a handshake flood does: costly for us, free for it), as
            # protocol errors and stalls do.
            # An EOF reaches us as an SSLEOFError or SSLZeroReturnError on some Python
            # builds (Debian's 3.11.2), as an error that is no SSLError on others.
            timed_out = is_handshake_timeout(exc)
            protocol_error = isinstance(exc, ssl.SSLError) and not isinstance(exc, _SSL_EOFS)
            left = not protocol_error and not timed_out and self._peer_had_our_answer()
            listener.failed(self, "tls_handshake_failed",
                            count=protocol_error or timed_out or left,
                            reason=LEFT_AFTER_ANSWER if left else handshake_failure_reason(exc))
            # close, not abort: the TLS alert (unknown CA, expired...) reaches the
            # client, which can then tell its user why.
            transport.close()
            self._closed_before_ready()
            return
        except asyncio.CancelledError:
            transport.abort()
            self._closed_before_ready()
            raise
        finally:
            self._close_probe()
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

    def _peer_had_our_answer(self) -> bool:
        """Whether the peer acknowledged bytes we sent (our answer to its ClientHello)."""
        fd, self._probe_fd = self._probe_fd, -1
        if fd < 0:
            return False
        with socket.socket(fileno=fd) as sock:
            try:
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BYTES)
            except OSError:
                return False
        if len(info) < TCPI_BYTES_ACKED_OFFSET + 8:
            return False
        return struct.unpack_from("=Q", info, TCPI_BYTES_ACKED_OFFSET)[0] > 1  # 1: our SYN

    def _close_probe(self) -> None:
        if self._probe_fd >= 0:
            os.close(self._probe_fd)
            self._probe_fd = -1

    def _ready(self, transport: Any, principal: Principal) -> None:
        self._transport = transport
        self.principal = principal
        self.ready = True
        transport.set_write_buffer_limits(high=DEFAULT_WRITE_HIGH_WATER_BYTES)
        if self._listener is not None and self._listener.tls is not None:
            # A completed handshake ends the address's run of failures (without TLS: its
            # first well-formed request does, see _process_frames).
            self._proven = True
            self._listener.succeeded(self)
        self._process()  # bytes that arrived with the end of the handshake

    def _closed_before_ready(self) -> None:
        self.closed = True
        self._close_probe()
        if self._counted:
            self._counted = False
            if self._listener is None:
                raise InvariantViolation("a connection counted without a listener")
            self._listener.release(self)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self.last_active_s = asyncio.get_running_loop().time()
        try:
            self._decoder.feed(data)
        except FrameError as exc:
            self._abort("bad_frame", exc)
            return
        if self.ready:
            self._process()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._close_probe()
        self._transport = None
        if self._counted:
            self._counted = False
            if self._listener is None:
                raise InvariantViolation("a connection counted without a listener")
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
        fields = dict(peer=self.peer, principal=str(self.principal), idle_ms=idle_ms, partial_frame_bytes=partial)
        if self._listener is None:
            self._log.info("connection_idle_closed", **fields)
        else:  # an attacker can open idle connections at will: bounded logging
            self._listener.refused("connection_idle_closed", self.peer_host, **fields)
            if partial:
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

    def _reading(self) -> bool:
        """Whether another buffered frame may be read now."""
        return not self.closed and not self._write_paused and self.inflight < self._max_inflight

    def _process_frames(self) -> None:
        decoder = self._decoder
        while self._reading():
            try:
                frame = decoder.next_frame()
            except FrameError as exc:
                self._abort("bad_frame", exc)
                return
            if frame is NEED_DATA:
                break
            self._take(frame)

    def _take(self, frame: bytes | bytearray) -> None:
        """One whole request frame: decode it, count it in ``inflight``, hand it on."""
        raise NotImplementedError

    def _abort(self, event: str, exc: Exception) -> None:
        self._refused(event, peer=self.peer, principal=str(self.principal), error=type(exc).__name__,
                      detail=str(exc), action="close")
        if self._listener is not None:
            self._listener.record_failure(self.peer_host)
        self.closed = True
        if self._transport is not None:
            self._transport.abort()

    def _prove(self) -> None:
        self._proven = True
        if self._listener is not None:
            self._listener.succeeded(self)

    def _refused(self, event: str, **fields: Any) -> None:
        """Bad input: through the listener's bounded log (an attacker repeats it at will)."""
        if self._listener is not None:
            self._listener.refused(event, self.peer_host, **fields)
        else:
            self._log.warning(event, **fields)


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
