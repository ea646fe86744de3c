"""The accepting side of the request server: listeners, admission, ``serve``.

``serve()`` opens a listening socket whose accepted connections are
``metalog.broker.net.server.Connection``s (or a subclass, e.g. the Kafka
protocol's), all sharing one ``Listener``: the policy of one listener, i.e.
which connections it takes at all (a cap per listener and per address, a
back-off for addresses that keep failing: handshakes, bad frames, idle
half-frames), the TLS settings of their handshakes, and the idle sweep that
closes connections idle longer than ``connections_max_idle_ms``.

A connection's own life (framing, dispatch, bounds, the handshake itself)
is ``metalog.broker.net.server``.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass
from typing import Any

from metalog.broker.net.library_logging import library_logger
from metalog.broker.net.server import Connection, Handler
from metalog.protocol import codec


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
    __slots__ = ("failures", "blocked_until_s", "backoff_ms", "refused")

    def __init__(self) -> None:
        self.failures = 0
        self.blocked_until_s = 0.0
        self.backoff_ms = 0
        self.refused = 0  # connections refused in the current back-off period


class Listener:
    """Admission, TLS and idle policing shared by the connections of one server."""

    def __init__(self, tls: Any, limits: ListenerLimits, logger: Any):
        self.tls = tls  # metalog.broker.net.tls.TlsFiles or None (plaintext)
        self.limits = limits
        self.handshake_timeout_ms = limits.ssl_handshake_timeout_ms
        self._log = logger
        self.connections: set[Connection] = set()
        self.per_ip: collections.Counter[str] = collections.Counter()
        self._addresses: collections.OrderedDict[str, _AddressState] = collections.OrderedDict()
        self._tasks: set[asyncio.Task] = set()
        self._sweeper: asyncio.Task | None = None
        self._cap_logged_at_s = 0.0
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
        now_s = asyncio.get_running_loop().time()
        host = conn.peer_host
        st = self._addresses.get(host)
        if st is not None and now_s < st.blocked_until_s:
            st.refused += 1
            self.refused_total += 1
            return False  # logged once, when the back-off period started
        lim = self.limits
        if len(self.connections) >= lim.max_connections or self.per_ip[host] >= lim.max_connections_per_ip:
            self.refused_total += 1
            if now_s - self._cap_logged_at_s >= 1.0:  # at most one line per second under a flood
                self._cap_logged_at_s = now_s
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
        st.blocked_until_s = asyncio.get_running_loop().time() + st.backoff_ms / 1000
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
            cutoff_s = loop.time() - idle_ms / 1000
            for conn in [c for c in self.connections if c.ready and c.last_active_s < cutoff_s and c.inflight == 0]:
                if not conn.closed:
                    conn.idle_close(idle_ms)


async def serve(
    host: str,
    port: int,
    handler: Handler,
    *,
    max_frame_bytes: int = codec.DEFAULT_FRAME_BYTES_MAX,
    max_inflight_per_conn: int = 1024,
    logger: Any = None,
    tls: Any = None,
    limits: ListenerLimits | None = None,
) -> "Server":
    """Listen on (host, port); port 0 picks a free one (see ``server.sockets``).

    `handler(conn, header, body)` is called once per well-formed request; it
    may return a coroutine (run as a task). Exactly one ``conn.send_response``
    per request is expected; if the handler raises, the request is answered
    with UNKNOWN_SERVER_ERROR. `tls` (a ``metalog.broker.net.tls.TlsFiles``) turns on
    mutual TLS; `limits` the connection hygiene (defaults otherwise). The
    listener is ``server.listener``.
    """
    log = logger if logger is not None else library_logger("metalog.net")
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
