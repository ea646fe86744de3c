"""The accepting side of the request server: listening sockets and admission.

``listen()`` with a ``Connection`` factory (``metalog.broker.net.kafka_conn.serve_kafka``
passes ``KafkaConnection``'s) opens listening sockets whose connections share one
``Listener``: the policy of that listener. It decides, for each accepted
socket and before its TLS handshake, whether and when it starts:

* **refused** (closed at once, before any handshake) above
  ``max_connections`` open-or-waiting connections on the listener or
  ``max_connections_per_ip`` from one address, and a stranger while the
  handshake queue is full: as many connections wait for the handshake
  pacer as it starts in ``HANDSHAKE_QUEUE_WAIT_S`` (a flood's connections
  cost an accept and a close instead of a wait the client gives up on, and
  a peer never waits behind them: holding them in the kernel's backlog
  would hold the peers too). Addresses that completed a handshake lately
  (``known``) wait in a queue of their own that goes first and is never
  full;
* **delayed** (held, accepted but not read from, no handshake, as KIP-612
  throttles) until its address's slot comes up: at most
  ``connection_creation_rate_per_ip`` new connections a second from one
  address, none during an address's back-off after
  ``failed_connections_before_backoff`` failures (handshakes, bad frames,
  idle half-frames; ``metalog.broker.net.backoff.AddressPolicy``), at most
  ``max_connection_creation_rate`` a second on the whole listener, and TLS
  handshakes paced to at most ``ssl_handshake_loop_share`` of a core
  (``metalog.broker.net.guard``; they run in a handshake thread,
  ``metalog.broker.net.tls_transport``, not on the loop). When
  ``max_delayed_connections`` wait, the listener stops accepting: the rest
  wait in the kernel's backlog, then in the peer's SYN retries;
* **dropped by the kernel** (never accepted): while an address is in
  back-off, a socket filter on the listening socket drops its packets, so
  its new connections wait in its own SYN retries instead of costing an
  accept and a close each (``failed_connection_backoff_drops_syns``;
  Linux, IPv4: ``metalog.broker.net.syn_filter``). A connection of it that
  arrived before the filter is held as above. And for a while after a
  stranger found the handshake queue full, the filter drops every address
  but the exempt and known ones;
* the ``exempt_hosts`` (the quorum's own peers) are never delayed or
  refused.

Refusals an attacker can repeat are logged through ``guard.RefusalLog`` (a
few lines per reason per interval, then one summary line with the count)
and counted in ``Listener.stats`` (the broker's metrics). The idle sweep
closes connections idle longer than ``connections_max_idle_ms``.

A connection's own life (framing, bounds, the handshake itself) is
``metalog.broker.net.server``; its protocol, ``metalog.broker.net.kafka_conn``.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import heapq
import itertools
import math
import os
import socket
import ssl
from dataclasses import dataclass
from typing import Any, Callable

from metalog.broker.net.backoff import AddressPolicy, RateSlots
from metalog.broker.net.guard import HandshakePacer, ListenerStats, RefusalLog, meter_handshakes
from metalog.broker.net.library_logging import library_logger
from metalog.broker.net.server import Connection
from metalog.broker.net.syn_filter import SynBans, detach as detach_filter
from metalog.broker.net.tls_transport import TlsSocketTransport

ACCEPT_BATCH_MAX = 64  # sockets accepted per readiness callback: other callbacks run between batches
STARTS_PER_TURN_MAX = 16  # delayed connections started per timer callback
KNOWN_ADDRESSES_MAX = 512  # addresses remembered for a completed handshake (the most recent)
ACCEPT_RETRY_S = 0.1  # after accept() fails (out of file descriptors): try again this much later
LISTEN_BACKLOG = 1024  # the kernel's queue of connections we have not accepted yet (capped by somaxconn)
TCP_ESTABLISHED = 1  # tcp_info.tcpi_state of a connection its peer has not closed (Linux)
HANDSHAKE_QUEUE_WAIT_S = 0.25  # the handshake queue holds what the pacer starts in this long...
HANDSHAKE_QUEUE_MIN = 16  # ...and at least this many
# Handshakes in a handshake thread on our own transport (tls_transport); "0" in the environment
# keeps them in uvloop's transport on the loop thread: the benches' A/B switch, not a setting.
HANDSHAKE_THREADS_ON = os.environ.get("METALOG_TLS_HANDSHAKE_THREADS", "1") != "0"


@dataclass(frozen=True)
class ListenerLimits:
    """Connection hygiene of one listener (the broker config's keys, same names)."""

    ssl_handshake_timeout_ms: int = 5000
    connections_max_idle_ms: int = 600_000
    max_connections: int = 4096
    max_connections_per_ip: int = 1024
    max_connection_creation_rate: float = 1000.0  # new connections a second on this listener; 0: no limit
    connection_creation_rate_per_ip: float = 100.0  # ... from one address (a burst of as many); 0: no limit
    failed_connections_before_backoff: int = 5
    failed_connection_backoff_ms: int = 1000
    failed_connection_backoff_max_ms: int = 60_000
    failed_connection_backoff_drops_syns: bool = True  # the kernel drops their SYNs meanwhile (syn_filter)
    ssl_handshake_loop_share: float = 0.25  # of a core for handshakes (the handshake thread's); 0: not paced
    max_delayed_connections: int = 1024  # accepted and waiting; above it accepting stops
    exempt_hosts: frozenset[str] = frozenset()  # names or addresses never delayed or refused (the peers)
    refusal_log_interval_ms: int = 10_000
    refusal_log_lines_max: int = 5  # full lines per reason per interval, then one summary line
    max_tracked_addresses: int = 10_000  # bound on the per-address table (rates, failures)


class _Waiting:
    """An accepted socket waiting for its turn (nothing read, no handshake yet)."""

    __slots__ = ("sock", "host", "peer", "arrived_s", "due_s", "listener_slot", "paced", "seq")

    def __init__(self, sock: socket.socket, host: str, peer: str, arrived_s: float, due_s: float, seq: int):
        self.sock = sock
        self.host = host
        self.peer = peer
        self.arrived_s = arrived_s
        self.due_s = due_s
        self.listener_slot = False  # its slot of the listener's rate is taken
        self.paced = False  # it waited for the handshake pacer (counted once)
        self.seq = seq

    def __lt__(self, other: "_Waiting") -> bool:
        return (self.due_s, self.seq) < (other.due_s, other.seq)


class Listener:
    """Admission, pacing, TLS and idle policing shared by the connections of one listener."""

    def __init__(self, tls: Any, limits: ListenerLimits, logger: Any):
        self.tls = tls  # metalog.broker.net.tls.TlsFiles or None (plaintext)
        self.limits = limits
        self.handshake_timeout_ms = limits.ssl_handshake_timeout_ms
        self._log = logger
        self.refusals = RefusalLog(logger, limits.refusal_log_interval_ms, limits.refusal_log_lines_max)
        self.stats = ListenerStats()
        self.exempt: set[str] = set(limits.exempt_hosts)  # resolved to addresses by resolve_exempt()
        self.connections: set[Connection] = set()
        self.per_ip: collections.Counter[str] = collections.Counter()  # open and waiting, per address
        self.waiting_per_ip: collections.Counter[str] = collections.Counter()  # accepted, not started yet
        self.acceptors: list[_Acceptor] = []  # registered by listen(): their waiting rooms are swept
        self.addresses = AddressPolicy(
            limits.connection_creation_rate_per_ip, max(1, int(limits.connection_creation_rate_per_ip)),
            limits.failed_connections_before_backoff, limits.failed_connection_backoff_ms,
            limits.failed_connection_backoff_max_ms, limits.max_tracked_addresses)
        rate = limits.max_connection_creation_rate
        self._listener_slots = RateSlots(rate, max(1, int(rate)))
        self.pacer = HandshakePacer(limits.ssl_handshake_loop_share if tls is not None else 0.0)
        self._arrived: set[str] = set()  # peers counted at accept whose Connection is not made yet
        # Addresses that completed a handshake lately (least recent first, at most KNOWN_ADDRESSES_MAX):
        # they go ahead of strangers for the handshake budget, and through while the kernel sheds.
        self.known: dict[str, None] = {}
        # What the kernel drops before accept (metalog.broker.net.syn_filter): addresses in
        # back-off, and strangers for a while after one found the handshake queue full.
        self.bans = SynBans(lambda where, exc: self._log.warning(
            "syn_filter_failed", listener=where, error=str(exc),
            action="refusals stay at accept"), self.stats, self.exempt, self.known)
        self._tasks: set[asyncio.Task] = set()
        self._sweeper: asyncio.Task | None = None

    async def resolve_exempt(self) -> None:
        """Add the addresses of the exempt host names (a name that does not resolve is logged)."""
        loop = asyncio.get_running_loop()
        for name in self.limits.exempt_hosts:
            try:
                infos = await loop.getaddrinfo(name, None, type=socket.SOCK_STREAM)
            except OSError as exc:
                self._log.warning("exempt_host_unresolved", host=name, error=str(exc))
                continue
            self.exempt.update(str(info[4][0]) for info in infos)

    def start(self) -> None:
        self._sweeper = asyncio.ensure_future(self._sweep())

    def close(self) -> None:
        self.bans.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        for t in list(self._tasks):
            t.cancel()
        self.refusals.flush(force=True)

    def spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def server_context(self) -> ssl.SSLContext:
        """The TLS context of a new handshake, its cost measured (``guard.HANDSHAKE_METER``)."""
        return meter_handshakes(self.tls.server())

    # admission at accept ----------------------------------------------------
    def refuse_at_accept(self, host: str, peer: str) -> str | None:
        """Why a just-accepted socket is refused (None: it is counted, to start now or later)."""
        if host in self.exempt:
            return None
        lim = self.limits
        pace = self.addresses.get(host)
        if len(self.connections) + len(self._arrived) >= lim.max_connections:
            why = "max_connections"
        elif self.per_ip[host] >= lim.max_connections_per_ip:
            why = "max_connections_per_ip"
        elif (self.waiting_per_ip[host] and pace is not None
              and pace.blocked_until_s > asyncio.get_running_loop().time()):
            # An address in back-off has proven hostile: one of its connections may wait out
            # the period, the others would only fill the waiting room (max_delayed_connections).
            why = "backoff"
        else:
            return None
        self.stats.refused_total[why] += 1
        self.refusals.event("connection_refused", host, peer=peer, reason="connection limit", limit=why,
                            connections=len(self.connections), from_this_address=self.per_ip[host],
                            max_connections=lim.max_connections, max_connections_per_ip=lim.max_connections_per_ip)
        return why

    def refuse_queue_full(self, host: str, peer: str) -> None:
        """A stranger arriving while the handshake queue is full: closed at once, and the
        kernel drops the strangers' SYNs for a while (``SynBans.shed``)."""
        self.stats.refused_total["handshake_queue_full"] += 1
        self.bans.shed()
        self.refusals.event("connection_refused", host, peer=peer, reason="handshake queue full",
                            limit="handshake_queue_full", waiting=self.stats.delayed_now)

    def count_arrival(self, host: str, peer: str) -> None:
        self.per_ip[host] += 1
        self.waiting_per_ip[host] += 1
        self._arrived.add(peer)

    def uncount_arrival(self, host: str, peer: str, started: bool = False) -> None:
        """A counted socket that never became a Connection (dropped while waiting, or failed to start)."""
        if not started:
            self._unwait(host)
        self._arrived.discard(peer)
        self._release_host(host)

    def _unwait(self, host: str) -> None:
        self.waiting_per_ip[host] -= 1
        if self.waiting_per_ip[host] <= 0:
            del self.waiting_per_ip[host]

    def address_due_s(self, host: str, now_s: float) -> float:
        """When a new connection from `host` may start (its rate and back-off)."""
        if host in self.exempt:
            return now_s
        due_s = self.addresses.reserve(host, now_s)
        if due_s > now_s:
            pace = self.addresses.get(host)
            why = "backoff" if pace is not None and pace.blocked_until_s > now_s else "rate_per_ip"
            self.stats.delayed_total[why] += 1
        return due_s

    def listener_due_s(self, now_s: float) -> float:
        due_s = self._listener_slots.reserve(now_s)
        if due_s > now_s:
            self.stats.delayed_total["rate_listener"] += 1
        return due_s

    def handshake_due_s(self, host: str, now_s: float) -> float:
        return now_s if host in self.exempt else self.pacer.next_start_s(now_s)

    def handshake_queue_max(self) -> int | None:
        """How many due connections may wait for the pacer (None: not paced)."""
        rate_per_s = self.pacer.rate_per_s()
        if math.isinf(rate_per_s):
            return None
        return max(HANDSHAKE_QUEUE_MIN, int(rate_per_s * HANDSHAKE_QUEUE_WAIT_S))

    def starting(self, host: str, now_s: float, arrived_s: float) -> None:
        """A counted connection starts (its handshake, or its first read without TLS)."""
        self._unwait(host)
        self.stats.accepted_total += 1
        if arrived_s < now_s:
            self.stats.delay_seconds_total += now_s - arrived_s
        if self.tls is not None:
            self.pacer.took(now_s)

    # a connection's life ------------------------------------------------------
    def admit(self, conn: Connection) -> bool:
        """Called by ``Connection.connection_made``: takes the slot counted at accept.

        A connection made by another accept loop (``loop.create_server``) is
        checked against the caps here instead (no rates, no delay)."""
        if conn.peer in self._arrived:
            self._arrived.discard(conn.peer)
        elif self.refuse_at_accept(conn.peer_host, conn.peer) is not None:
            return False
        else:
            self.per_ip[conn.peer_host] += 1
        self.connections.add(conn)
        self.stats.connections_now = len(self.connections)
        return True

    def release(self, conn: Connection) -> None:
        self.connections.discard(conn)
        self.stats.connections_now = len(self.connections)
        self._release_host(conn.peer_host)

    def _release_host(self, host: str) -> None:
        self.per_ip[host] -= 1
        if self.per_ip[host] <= 0:
            del self.per_ip[host]

    def succeeded(self, conn: Connection) -> None:
        host = conn.peer_host
        self.addresses.succeeded(host)
        if host in self.exempt:
            return
        if host in self.known:
            del self.known[host]  # to the end: the most recent
        elif len(self.known) >= KNOWN_ADDRESSES_MAX:
            del self.known[next(iter(self.known))]
        self.known[host] = None
        if self.tls is not None:
            self.pacer.ended(True)

    def failed(self, conn: Connection, event: str, count: bool = True, **fields: Any) -> None:
        """A failed handshake: logged (boundedly); `count`s toward the address's back-off."""
        self.refused(event, conn.peer_host, peer=conn.peer, **fields)
        if count:
            self.record_failure(conn.peer_host)
            if conn.peer_host not in self.exempt:
                self.pacer.ended(False)

    def refused(self, event: str, host: str, /, **fields: Any) -> None:
        """Bad input or a failure from `host`: counted, and logged within the log's bounds."""
        self.stats.failures_total[event] += 1
        self.refusals.event(event, host, **fields)

    def record_failure(self, host: str) -> None:
        if host in self.exempt:
            return
        backoff_ms = self.addresses.failed(host, asyncio.get_running_loop().time())
        if backoff_ms is not None:
            pace = self.addresses.get(host)
            if pace is not None:
                self.bans.ban(host, pace.blocked_until_s)
            self.stats.failures_total["connection_backoff"] += 1
            self.refusals.event("connection_backoff", host, address=host, backoff_ms=backoff_ms,
                                failures=pace.failures if pace is not None else 0)

    # idle ------------------------------------------------------------------
    async def _sweep(self) -> None:
        idle_ms = self.limits.connections_max_idle_ms
        interval_s = min(max(idle_ms / 4000, 0.05), 1.0)
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval_s)  # a periodic timer, not a stand-in for a condition
            if self.tls is not None:
                self.tls.maybe_reload()  # rotation is noticed (and logged) without waiting for a handshake
            self.refusals.flush()
            for acceptor in self.acceptors:
                acceptor.drop_abandoned()
            cutoff_s = loop.time() - idle_ms / 1000
            for conn in [c for c in self.connections if c.ready and c.last_active_s < cutoff_s and c.inflight == 0]:
                if not conn.closed:
                    conn.idle_close(idle_ms)


class _Acceptor:
    """The accept loop of one listening socket, and the connections waiting for their turn."""

    def __init__(self, sock: socket.socket, make_connection: Callable[[], Connection], listener: Listener):
        self.sock = sock
        self._make = make_connection
        self._listener = listener
        self._loop = asyncio.get_running_loop()
        self._waiting: list[_Waiting] = []  # heap by due time: the address's or the listener's slot
        self._ready: collections.deque[_Waiting] = collections.deque()  # due, waiting for the handshake pacer
        self._ready_known: collections.deque[_Waiting] = collections.deque()  # ... of known addresses: first
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_s = 0.0
        self._accepting = False
        self._closed = False

    @property
    def delayed(self) -> int:
        return len(self._waiting) + len(self._ready) + len(self._ready_known)

    def resume(self) -> None:
        if not self._accepting and not self._closed:
            self._loop.add_reader(self.sock.fileno(), self._on_readable)
            self._accepting = True

    def pause(self) -> None:
        if self._accepting:
            self._loop.remove_reader(self.sock.fileno())
            self._accepting = False

    def close(self) -> None:
        self.pause()
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        for w in [*self._waiting, *self._ready, *self._ready_known]:
            w.sock.close()
            self._listener.uncount_arrival(w.host, w.peer)
        self._waiting.clear()
        self._ready.clear()
        self._ready_known.clear()
        self.sock.close()

    def drop_abandoned(self) -> None:
        """Close the waiting sockets whose clients gave up (a back-off holds one for up to a minute)."""
        kept = []
        for w in self._waiting:
            if _abandoned(w.sock):
                self._drop(w)
            else:
                kept.append(w)
        if len(kept) != len(self._waiting):
            heapq.heapify(kept)
            self._waiting = kept
            self._listener.stats.delayed_now = self.delayed
            if self.delayed < self._listener.limits.max_delayed_connections:
                self.resume()

    def _drop(self, w: _Waiting) -> None:
        self._listener.stats.refused_total["abandoned"] += 1
        w.sock.close()
        self._listener.uncount_arrival(w.host, w.peer)

    def _queue_full(self) -> bool:
        """Whether as many due connections wait for the pacer as it starts in HANDSHAKE_QUEUE_WAIT_S."""
        bound = self._listener.handshake_queue_max()
        return bound is not None and len(self._ready) >= bound

    def _on_readable(self) -> None:
        for _ in range(ACCEPT_BATCH_MAX):
            try:
                sock, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: back off instead of spinning on a ready socket
                self._listener.refused("accept_failed", "-", error=str(exc), retry_in_ms=ACCEPT_RETRY_S * 1000)
                self.pause()
                self._loop.call_later(ACCEPT_RETRY_S, self.resume)
                return
            self._arrive(sock, addr)
            if self.delayed >= self._listener.limits.max_delayed_connections:
                self._listener.stats.accept_pauses_total += 1
                self.pause()
                return

    def _arrive(self, sock: socket.socket, addr: Any) -> None:
        host = str(addr[0]) if isinstance(addr, tuple) else "?"
        peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else "?"
        listener = self._listener
        if listener.bans.used:  # it inherited the listening socket's program: established ones never run it
            detach_filter(sock)
        if listener.refuse_at_accept(host, peer) is not None:
            sock.close()
            return
        if host not in listener.exempt and host not in listener.known and self._queue_full():
            listener.refuse_queue_full(host, peer)
            sock.close()
            return
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        listener.count_arrival(host, peer)
        now_s = self._loop.time()
        w = _Waiting(sock, host, peer, now_s, listener.address_due_s(host, now_s), next(self._seq))
        if host in listener.exempt:
            self._start(w, now_s)
        elif w.due_s <= now_s:
            self._due(w, now_s)  # the usual case: starts at once (unless others wait for the pacer)
            self._pump_ready(now_s)
            self._schedule()
        else:
            heapq.heappush(self._waiting, w)
            self._schedule()

    def _due(self, w: _Waiting, now_s: float) -> None:
        """`w`'s address slot has come: take its listener slot, then wait for the pacer."""
        if not w.listener_slot:
            w.listener_slot = True
            due_s = self._listener.listener_due_s(now_s)
            if due_s > now_s:
                w.due_s = due_s
                heapq.heappush(self._waiting, w)
                return
        (self._ready_known if w.host in self._listener.known else self._ready).append(w)

    def _pump(self) -> None:
        self._timer = None
        if self._closed:
            return
        now_s = self._loop.time()
        for _ in range(len(self._waiting)):
            if not self._waiting or self._waiting[0].due_s > now_s:
                break
            self._due(heapq.heappop(self._waiting), now_s)
        self._pump_ready(now_s)
        self._schedule()
        if self.delayed < self._listener.limits.max_delayed_connections:
            self.resume()

    def _pump_ready(self, now_s: float) -> None:
        listener = self._listener
        for _ in range(STARTS_PER_TURN_MAX):
            ready = self._ready_known or self._ready  # known addresses go ahead of strangers
            if not ready:
                return
            w = ready[0]
            if listener.handshake_due_s(w.host, now_s) > now_s:
                if not w.paced:
                    w.paced = True
                    listener.stats.delayed_total["handshake_budget"] += 1
                return
            ready.popleft()
            if _abandoned(w.sock):  # its peer gave up while it waited: no handshake for nobody
                self._drop(w)
                continue
            self._start(w, now_s)

    def _schedule(self) -> None:
        self._listener.stats.delayed_now = self.delayed
        now_s = self._loop.time()
        ready = self._ready_known or self._ready
        if ready:
            at_s = max(self._listener.handshake_due_s(ready[0].host, now_s), now_s + 0.0005)
        elif self._waiting:
            at_s = self._waiting[0].due_s
        else:
            return
        if self._timer is not None:
            if self._timer_s <= at_s:
                return
            self._timer.cancel()
        self._timer_s = at_s
        self._timer = self._loop.call_at(at_s, self._pump)

    def _start(self, w: _Waiting, now_s: float) -> None:
        listener = self._listener
        listener.starting(w.host, now_s, w.arrived_s)
        listener.stats.delayed_now = self.delayed
        if listener.tls is not None and HANDSHAKE_THREADS_ON:
            self._start_tls(w)
            return
        task = self._loop.create_task(self._loop.connect_accepted_socket(self._make, w.sock))
        task.add_done_callback(functools.partial(self._started, w))

    def _start_tls(self, w: _Waiting) -> None:
        """A TLS connection on our own transport: its handshake runs in a handshake thread."""
        listener = self._listener
        try:
            transport = TlsSocketTransport.accept(w.sock, listener.server_context(), w.sock.getpeername(),
                                                  exempt=w.host in listener.exempt)
        except (OSError, ValueError) as exc:  # the peer already left (ENOTCONN), or the context is unusable
            listener.refused("connection_start_failed", w.host, peer=w.peer, error=repr(exc))
            w.sock.close()
            listener.uncount_arrival(w.host, w.peer, started=True)
            return
        conn = self._make()
        transport.set_protocol(conn)
        conn.connection_made(transport)

    def _started(self, w: _Waiting, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is not None:
            self._listener.refused("connection_start_failed", w.host, peer=w.peer,
                                   error="cancelled" if task.cancelled() else repr(task.exception()))
            w.sock.close()
            if w.peer in self._listener._arrived:  # never reached connection_made
                self._listener.uncount_arrival(w.host, w.peer, started=True)


def _abandoned(sock: socket.socket) -> bool:
    """Whether the peer closed (or reset) a connection we have not read from."""
    if not hasattr(socket, "TCP_INFO"):
        return False
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] != TCP_ESTABLISHED
    except OSError:
        return True


class Server:
    """The listening sockets of one listener, with its ``Listener``."""

    def __init__(self, acceptors: list[_Acceptor], listener: Listener):
        self._acceptors = acceptors
        self.listener = listener

    @property
    def sockets(self) -> list[socket.socket]:
        return [a.sock for a in self._acceptors]

    def close(self) -> None:
        """Stop accepting (connections already open stay open, as asyncio's servers do)."""
        for a in self._acceptors:
            a.close()
        self.listener.close()

    async def wait_closed(self) -> None:
        await asyncio.sleep(0)


async def _listening_sockets(host: str, port: int) -> list[socket.socket]:
    """Bound, listening, non-blocking sockets for (host, port), as ``loop.create_server`` makes them."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    try:
        for family, type_, proto, _, sockaddr in dict.fromkeys(infos):
            sock = socket.socket(family, type_, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(sockaddr)
            except OSError as exc:  # name the address, as loop.create_server does: the user sees this line
                raise OSError(exc.errno, f"error while attempting to bind on address {sockaddr!r}: "
                                         f"{(exc.strerror or str(exc)).lower()}") from None
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


async def listen(host: str, port: int, make_connection: Callable[[], Connection], listener: Listener) -> Server:
    """Accept on (host, port) (port 0: a free one) connections made by
    `make_connection()` (whose listener is `listener`), admitted by it."""
    await listener.resolve_exempt()
    acceptors = [_Acceptor(sock, make_connection, listener) for sock in await _listening_sockets(host, port)]
    listener.acceptors.extend(acceptors)
    if listener.limits.failed_connection_backoff_drops_syns:
        for a in acceptors:
            listener.bans.add_socket(a.sock)
    for a in acceptors:
        a.resume()
    listener.start()
    return Server(acceptors, listener)
