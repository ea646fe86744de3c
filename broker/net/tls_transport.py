"""Server-side TLS handshakes off the event-loop thread, and the transport that serves the connection after.

Why (issue 34): uvloop and asyncio run every step of a server-side handshake
inside their own SSL transport, on the loop thread. Answering a ClientHello is
a key exchange and a signature (about 1 ms): a flood of replayed ClientHellos
took that time from the commit path of the same loop. CPython's ``ssl``
releases the GIL inside ``SSL_do_handshake``, so a thread takes the
handshakes to the machine's other core while the loop keeps running.

How:

* the accepted socket becomes a non-blocking ``ssl.SSLSocket``; the loop waits
  for its readiness (``add_reader``/``add_writer``) and hands each
  ``do_handshake`` step to a handshake thread (``HandshakeThreads``: one
  thread for the listener's exempt peers, one for everybody else, so a peer
  never waits behind a stranger's handshakes). The loop itself never calls
  into OpenSSL's handshake; a step's thread CPU time goes to the handshake
  meter (``guard.HANDSHAKE_METER``) on the loop, where the pacer reads it.
* once the handshake is done, ``TlsSocketTransport`` serves the connection on
  the loop: ``recv`` and ``send`` on the same ``SSLSocket`` (one C call per
  TLS record read, one per write), readiness callbacks, write-buffer limits
  with ``pause_writing``/``resume_writing`` to the protocol, ``eof_received``
  and ``connection_lost``, and a TLS close_notify on ``close()``.

OpenSSL runs in its default non-partial write mode: a write that meets a full
socket buffer (``SSLWantWriteError``) must be retried with the same bytes, so
the first buffered chunk is only ever retried whole, never re-sliced.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import os
import socket
import ssl
import threading
import time
from typing import Any

from metalog.broker.net.guard import HANDSHAKE_METER, HandshakeMeter

HANDSHAKE_STEPS_MAX = 16  # a TLS 1.2 or 1.3 server handshake takes 2-4 steps; more is a peer playing games
TLS_RECORD_BYTES_MAX = 16 * 1024  # plaintext bytes of a full TLS record
# Per recv call: one record's plaintext, the most one SSL_read returns. Not more: CPython
# allocates the whole size before the read and shrinks it after, and while glibc's mmap
# threshold is at its initial 128 KiB a larger buffer costs an mmap, a page fault, an mremap
# and a munmap on every read (256 KiB: 35 us a read against 11 us, docs/bench.md).
RECV_BYTES = TLS_RECORD_BYTES_MAX
READ_BYTES_PER_CALL_MAX = 1 << 20  # per readiness callback: other callbacks run between such batches
DEFAULT_HIGH_WATER_BYTES = 64 * 1024  # asyncio's defaults for a transport's write buffer
# Strangers' handshakes yield the CPU to the loop and to the other processes of a busy machine
# (a quorum's peers, its clients): off the loop, the scheduler can tell them apart. Peers' are not
# lowered. Raising a nice value needs no privilege.
STRANGERS_THREAD_NICE = int(os.environ.get("METALOG_TLS_HANDSHAKE_NICE", "10"))
_DONE, _WANT_READ, _WANT_WRITE = "done", "want_read", "want_write"


def _step(sock: ssl.SSLSocket) -> tuple[str, float, BaseException | None]:
    """One handshake step, in a handshake thread: (outcome, thread CPU seconds, error)."""
    t0 = time.thread_time()
    outcome, error = _DONE, None
    try:
        sock.do_handshake()
    except ssl.SSLWantReadError:
        outcome = _WANT_READ
    except ssl.SSLWantWriteError:
        outcome = _WANT_WRITE
    except BaseException as exc:  # handed to the loop, which decides what it means
        error = exc
    return outcome, time.thread_time() - t0, error


class HandshakeThreads:
    """The handshake threads of a process: one for exempt peers, one for strangers.

    One thread each: a flood cannot take more than one core from the rest
    (the pacer bounds it further), and a peer's step never queues behind a
    stranger's. The queue of each is bounded by the handshakes in progress
    (one step at a time per handshake; the listener bounds those)."""

    def __init__(self) -> None:
        self._pools: dict[bool, concurrent.futures.ThreadPoolExecutor] = {}
        self.thread_names: set[str] = set()  # of the threads that ran steps (at most two; tests check them)

    def pool(self, exempt: bool) -> concurrent.futures.ThreadPoolExecutor:
        pool = self._pools.get(exempt)
        if pool is None:
            name = "metalog-tls-peers" if exempt else "metalog-tls"
            nice = 0 if exempt else STRANGERS_THREAD_NICE
            pool = self._pools[exempt] = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=name, initializer=_lower_priority, initargs=(nice,))
        return pool


def _lower_priority(nice: int) -> None:
    """Make the calling thread `nice` steps less favoured by the scheduler (Linux: per thread)."""
    if nice and hasattr(os, "setpriority") and hasattr(threading, "get_native_id"):
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
        except OSError:
            pass  # not allowed here: the handshakes run at the process's priority


HANDSHAKE_THREADS = HandshakeThreads()


def _set_ready(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class TlsSocketTransport(asyncio.Transport):
    """A server-side TLS connection on a non-blocking ``SSLSocket``: handshake in a thread, then served on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: ssl.SSLSocket, peername: Any,
                 exempt: bool, threads: HandshakeThreads = HANDSHAKE_THREADS,
                 meter: HandshakeMeter = HANDSHAKE_METER):
        super().__init__()
        self._loop = loop
        self._sock = sock
        self._fd = sock.fileno()
        self._peername = peername
        self._pool = threads.pool(exempt)
        self._threads = threads
        self._meter = meter
        self._protocol: Any = None
        self._out: collections.deque[bytes] = collections.deque()
        self._out_bytes = 0
        self._high = DEFAULT_HIGH_WATER_BYTES
        self._low = DEFAULT_HIGH_WATER_BYTES // 4
        self._protocol_paused = False  # we told the protocol to pause writing
        self._ready = False  # handshake done: reading and writing through TLS
        self._reading = False  # our reader is registered
        self._read_paused = False  # the protocol paused reading
        self._writer = False  # our writer is registered
        self._read_wants_write = False  # a read needs the socket writable (a TLS key update's answer)
        self._closing = False
        self._closed = False  # the socket is closed (or will be, once a running step returns)
        self._step_future: concurrent.futures.Future | None = None
        self._waiter: asyncio.Future | None = None  # readiness awaited by the handshake

    @classmethod
    def accept(cls, sock: socket.socket, context: ssl.SSLContext, peername: Any, exempt: bool) -> "TlsSocketTransport":
        """Wrap an accepted non-blocking socket (nothing is read or sent until ``handshake``)."""
        ssl_sock = context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return cls(asyncio.get_running_loop(), ssl_sock, peername, exempt)

    # the handshake -----------------------------------------------------------
    async def handshake(self, timeout_s: float) -> "TlsSocketTransport":
        """Run the handshake (its steps in a handshake thread); raises as ``loop.start_tls`` would."""
        first = True
        async with asyncio.timeout(timeout_s):
            await self._ready_for(False)  # the ClientHello (a port probe that sends nothing costs no thread step)
            for _ in range(HANDSHAKE_STEPS_MAX):
                outcome, seconds, error = await self._run_step()
                self._meter.spent(seconds, first, on_loop=False)
                first = False
                if self._closed:
                    raise ConnectionAbortedError("the connection was closed during its handshake")
                if error is not None:
                    raise _handshake_error(error)
                if outcome is _DONE:
                    break
                await self._ready_for(outcome is _WANT_WRITE)
            else:
                raise ssl.SSLError(f"the handshake took more than {HANDSHAKE_STEPS_MAX} steps")
        self._ready = True
        self._start_reading()
        self._loop.call_soon(self._on_readable)  # a request sent with the client's Finished may wait in OpenSSL
        return self

    async def _run_step(self) -> tuple[str, float, BaseException | None]:
        cf = self._pool.submit(self._step_in_thread)
        self._step_future = cf
        try:
            return await asyncio.wrap_future(cf)
        finally:
            if cf.done():
                self._step_future = None

    def _step_in_thread(self) -> tuple[str, float, BaseException | None]:
        self._threads.thread_names.add(threading.current_thread().name)
        return _step(self._sock)

    async def _ready_for(self, writable: bool) -> None:
        fut = self._waiter = self._loop.create_future()
        add, remove = (self._loop.add_writer, self._loop.remove_writer) if writable else \
            (self._loop.add_reader, self._loop.remove_reader)
        add(self._fd, _set_ready, fut)
        try:
            await fut
        finally:
            self._waiter = None
            if not self._closed:
                remove(self._fd)

    # asyncio.Transport -------------------------------------------------------
    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "peername":
            return self._peername
        if self._closed:
            return default
        sock = self._sock
        if name in ("socket", "ssl_object"):
            return sock
        if name == "sslcontext":
            return sock.context
        try:
            if name == "sockname":
                return sock.getsockname()
            if name == "peercert" and self._ready:
                return sock.getpeercert()
            if name == "cipher" and self._ready:
                return sock.cipher()
        except (OSError, ValueError):
            pass
        return default

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol

    def is_closing(self) -> bool:
        return self._closing or self._closed

    def is_reading(self) -> bool:
        return self._ready and not self._read_paused and not self.is_closing()

    def pause_reading(self) -> None:
        self._read_paused = True
        self._stop_reading()

    def resume_reading(self) -> None:
        if not self._read_paused:
            return
        self._read_paused = False
        if self._ready and not self.is_closing():
            self._start_reading()
            self._loop.call_soon(self._on_readable)  # records OpenSSL may hold already

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        high = DEFAULT_HIGH_WATER_BYTES if high is None else high
        low = high // 4 if low is None else low
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._high, self._low = high, low
        self._maybe_pause_protocol()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._low, self._high

    def get_write_buffer_size(self) -> int:
        return self._out_bytes

    def can_write_eof(self) -> bool:
        return False  # TLS has no half-close

    def write_eof(self) -> None:
        raise NotImplementedError("TLS has no half-close")

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.is_closing() or not data:
            return
        if not self._ready:
            raise RuntimeError("write before the TLS handshake is done")
        if not self._out:
            try:
                n = self._sock.send(data)  # the whole of it, or SSLWantWriteError (non-partial mode)
            except (ssl.SSLWantWriteError, ssl.SSLWantReadError):
                n = 0
            except OSError as exc:
                self._fatal(exc)
                return
            if n >= len(data):
                return
            if n:  # only with partial writes (not OpenSSL's default): the rest is a new write
                data = data[n:]
        chunk = bytes(data)
        self._out.append(chunk)
        self._out_bytes += len(chunk)
        self._want_writable()
        self._maybe_pause_protocol()

    def writelines(self, list_of_data: Any) -> None:
        self.write(b"".join(list_of_data))

    def close(self) -> None:
        """Stop reading; once the buffered bytes are sent, a close_notify, then the socket is closed."""
        if self.is_closing():
            return
        self._closing = True
        self._stop_reading()
        if not self._out:
            self._shut_down(None)

    def abort(self) -> None:
        if self._closed:
            return
        self._closing = True
        self._out.clear()
        self._out_bytes = 0
        self._close_socket(None)

    # internals ---------------------------------------------------------------
    def _start_reading(self) -> None:
        if not self._reading and not self._read_paused and not self.is_closing():
            self._loop.add_reader(self._fd, self._on_readable)
            self._reading = True

    def _stop_reading(self) -> None:
        if self._reading:
            self._loop.remove_reader(self._fd)
            self._reading = False

    def _want_writable(self) -> None:
        if not self._writer and not self._closed:
            self._loop.add_writer(self._fd, self._on_writable)
            self._writer = True

    def _on_readable(self) -> None:
        if self._closed or self._closing or self._read_paused:
            return
        chunks: list[bytes] = []
        got = 0
        eof, error = False, None
        sock = self._sock
        while got < READ_BYTES_PER_CALL_MAX:
            try:
                data = sock.recv(RECV_BYTES)
            except ssl.SSLWantReadError:
                break
            except ssl.SSLWantWriteError:
                self._read_wants_write = True
                self._want_writable()
                break
            except OSError as exc:  # ssl.SSLError included: a broken record, a reset
                error = exc
                break
            if not data:
                eof = True
                break
            chunks.append(data)
            got += len(data)
            if len(data) < TLS_RECORD_BYTES_MAX:
                # The end of what the peer wrote, most likely (a write's last record is a short
                # one): if more came, the loop calls again, and the usual one-record request costs
                # one recv instead of a second that raises SSLWantReadError.
                break
        else:
            if self._sock.pending():  # stopped at the bound with records decrypted: come back
                self._loop.call_soon(self._on_readable)
        if chunks:
            self._protocol.data_received(chunks[0] if len(chunks) == 1 else b"".join(chunks))
        if error is not None:
            self._fatal(error)
        elif eof and not self._closed:
            self._stop_reading()
            if not self._protocol.eof_received():
                self.close()

    def _on_writable(self) -> None:
        if self._read_wants_write:
            self._read_wants_write = False
            self._loop.call_soon(self._on_readable)
        out = self._out
        while out:
            chunk = out[0]
            try:
                n = self._sock.send(chunk)
            except (ssl.SSLWantWriteError, ssl.SSLWantReadError):
                return  # the writer stays registered; the same chunk is retried whole
            except OSError as exc:
                self._fatal(exc)
                return
            if n < len(chunk):
                out[0] = chunk[n:]
            else:
                out.popleft()
            self._out_bytes -= n
        if self._writer:
            self._loop.remove_writer(self._fd)
            self._writer = False
        if self._protocol_paused and self._out_bytes <= self._low:
            self._protocol_paused = False
            self._protocol.resume_writing()
        if self._closing and not self._closed:
            self._shut_down(None)

    def _maybe_pause_protocol(self) -> None:
        if not self._protocol_paused and self._out_bytes > self._high and self._protocol is not None:
            self._protocol_paused = True
            self._protocol.pause_writing()

    def _shut_down(self, exc: BaseException | None) -> None:
        """The TLS close: our close_notify (not waiting for the peer's), then the socket."""
        if self._ready and not self._closed:
            try:
                self._sock.unwrap()
            except (OSError, ValueError):  # the peer's close_notify has not come (we do not wait), or it left
                pass
        self._close_socket(exc)

    def _fatal(self, exc: BaseException) -> None:
        self._closing = True
        self._out.clear()
        self._out_bytes = 0
        self._close_socket(exc)

    def _close_socket(self, exc: BaseException | None) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_reading()
        if self._writer:
            self._loop.remove_writer(self._fd)
            self._writer = False
        waiter = self._waiter
        if waiter is not None:  # a handshake waiting for readiness: it learns at once
            self._loop.remove_reader(self._fd)
            self._loop.remove_writer(self._fd)
            if not waiter.done():
                waiter.set_exception(ConnectionAbortedError("the connection was closed during its handshake"))
        step = self._step_future
        if step is not None and not step.done():
            # A handshake thread is inside this socket: close it once the step returns.
            step.add_done_callback(lambda _: self._loop.call_soon_threadsafe(self._sock.close))
        else:
            self._sock.close()
        if self._protocol is not None:
            self._loop.call_soon(self._protocol.connection_lost, exc)


def _handshake_error(exc: BaseException) -> BaseException:
    """What ``loop.start_tls`` would raise: a peer that left is a reset, not a protocol error.

    (``Connection`` counts a reset toward an address's back-off only once the
    peer has had our answer to its ClientHello: a port probe costs nothing.)"""
    if isinstance(exc, ssl.SSLEOFError) or (isinstance(exc, ssl.SSLError) and exc.reason == "UNEXPECTED_EOF_WHILE_READING"):
        return ConnectionResetError("the peer closed the connection during the handshake")
    return exc
