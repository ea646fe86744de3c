"""A TCP fault proxy between brokers: partitions without root.

A proxy sees connections, not node ids, so it learns the source from *where*
a connection arrives: there is one listener per (source node, destination
voter) pair. Node S is configured with a ``voters`` string in which every
other voter V's address is the listener for (S, V) (``voters_for(S)``), so
every byte on that listener's connections travels S -> V (requests S makes)
or V -> S (V's answers). A broker ignores its own entry in ``voters``; an
observer dials voters through its own listeners the same way. Client
connections do not go through the proxy.

Faults are per direction: ``block(a, b)`` drops everything node a sends to
node b -- a's requests on connections a dialled, and a's answers on
connections b dialled -- like a one-way cut in the network. ``isolate(n)``
blocks both directions between n and everyone; ``partition(groups)`` blocks
every pair across groups; ``heal()`` lifts every block.

Dropped bytes are discarded silently (peers see timeouts, as in a real
partition, not resets). A connection that lost bytes has a hole in its byte
stream, so once the block on it is lifted the proxy closes it and the peer
reconnects cleanly; connections opened while a direction was blocked behave
the same way.

The proxy runs its own event loop in a daemon thread (``start()``), so a drill
whose main thread blocks on subprocesses never stalls traffic. Control calls
are thread-safe.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

CHUNK_BYTES = 64 << 10
MAX_CONNECTIONS_PER_PAIR = 64  # a broker keeps one or two per peer
CONNECT_TIMEOUT_S = 2.0


@dataclass(eq=False)
class _Conn:
    src: int
    dst: int
    tainted: bool = False  # lost bytes in some direction: close once healed
    writers: list = field(default_factory=list)

    def close(self) -> None:
        for w in self.writers:
            try:
                w.transport.abort()
            except Exception:
                pass


class FaultProxy:
    def __init__(self, targets: dict[int, tuple[str, int]], sources: list[int], host: str = "127.0.0.1"):
        """targets: voter id -> its real listen address; sources: every node id that dials voters."""
        self.targets = dict(targets)
        self.sources = sorted(set(sources))
        self.host = host
        self._blocked: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._listen: dict[tuple[int, int], tuple[str, int]] = {}
        self._servers: list[asyncio.base_events.Server] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.dropped_bytes = 0
        self.forwarded_bytes = 0
        self.events: list[dict] = []  # (ts, action, pairs) for the drill report

    # ---------------------------------------------------------------- setup
    def pairs(self) -> list[tuple[int, int]]:
        return [(s, d) for s in self.sources for d in sorted(self.targets) if s != d]

    def start(self) -> "FaultProxy":
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._bind())
            except BaseException as exc:  # surfaced to the caller below
                errors.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            for srv in self._servers:
                srv.close()
            loop.run_until_complete(asyncio.sleep(0))
            loop.close()

        self._thread = threading.Thread(target=run, name="faultproxy", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fault proxy did not start within 10 s")
        if errors:
            raise errors[0]
        return self

    async def _bind(self) -> None:
        for src, dst in self.pairs():
            srv = await asyncio.start_server(
                lambda r, w, s=src, d=dst: self._handle(s, d, r, w), self.host, 0)
            self._servers.append(srv)
            self._listen[(src, dst)] = srv.sockets[0].getsockname()[:2]

    def stop(self) -> None:
        if self._loop is None:
            return
        loop = self._loop

        def shutdown() -> None:
            for c in list(self._conns):
                c.close()
            loop.stop()

        loop.call_soon_threadsafe(shutdown)
        if self._thread:
            self._thread.join(10)
        self._loop = None

    # ----------------------------------------------------------- addresses
    def addr(self, src: int, dst: int) -> tuple[str, int]:
        """Where node src must dial voter dst."""
        return self._listen[(src, dst)]

    def voters_for(self, src: int) -> str:
        """The `voters` config value for node src: every other voter via its proxy listener."""
        parts = []
        for vid in sorted(self.targets):
            host, port = self.targets[vid] if vid == src else self.addr(src, vid)
            parts.append(f"{vid}@{host}:{port}")
        return ",".join(parts)

    # ------------------------------------------------------------- control
    def blocked(self) -> set[tuple[int, int]]:
        with self._lock:
            return set(self._blocked)

    def is_blocked(self, a: int, b: int) -> bool:
        with self._lock:
            return (a, b) in self._blocked

    def _set(self, action: str, add: set[tuple[int, int]] | None = None, clear: bool = False) -> None:
        with self._lock:
            if clear:
                lifted = bool(self._blocked)
                self._blocked.clear()
            else:
                lifted = False
            if add:
                self._blocked |= {(a, b) for a, b in add if a != b}
            snapshot = sorted(self._blocked)
        self.events.append({"ts": time.time(), "action": action, "blocked": [list(p) for p in snapshot]})
        if lifted and self._loop is not None:
            self._loop.call_soon_threadsafe(self._close_healed)

    def block(self, a: int, b: int) -> None:
        """Drop everything node a sends to node b (one direction)."""
        self._set(f"cut {a}->{b}", {(a, b)})

    def isolate(self, node: int) -> None:
        others = set(self.sources) | set(self.targets)
        self._set(f"isolate {node}", {(node, o) for o in others} | {(o, node) for o in others})

    def partition(self, groups: list[set[int]]) -> None:
        """Block every pair of nodes in different groups (nodes in no group keep talking)."""
        pairs = set()
        for i, g in enumerate(groups):
            for h in groups[i + 1:]:
                pairs |= {(a, b) for a in g for b in h} | {(b, a) for a in g for b in h}
        self._set("partition " + "|".join(",".join(map(str, sorted(g))) for g in groups), pairs)

    def heal(self) -> None:
        self._set("heal", clear=True)

    def _close_healed(self) -> None:
        for c in list(self._conns):
            if c.tainted and not self.is_blocked(c.src, c.dst) and not self.is_blocked(c.dst, c.src):
                c.close()

    # --------------------------------------------------------------- pumps
    async def _handle(self, src: int, dst: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if sum(1 for c in self._conns if (c.src, c.dst) == (src, dst)) >= MAX_CONNECTIONS_PER_PAIR:
            writer.transport.abort()
            return
        host, port = self.targets[dst]
        try:
            up_r, up_w = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError):
            writer.transport.abort()  # destination down: the dialler sees a refused/reset connection
            return
        conn = _Conn(src, dst, writers=[writer, up_w])
        self._conns.add(conn)
        try:
            await asyncio.gather(self._pump(conn, reader, up_w, src, dst),
                                 self._pump(conn, up_r, writer, dst, src))
        finally:
            self._conns.discard(conn)
            conn.close()

    async def _pump(self, conn: _Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    frm: int, to: int) -> None:
        try:
            while True:
                data = await reader.read(CHUNK_BYTES)
                if not data:
                    break
                if self.is_blocked(frm, to):
                    conn.tainted = True
                    self.dropped_bytes += len(data)
                    continue
                if conn.tainted and not self.is_blocked(to, frm):
                    break  # healed but holed: close so both ends reconnect cleanly
                self.forwarded_bytes += len(data)
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            conn.close()
