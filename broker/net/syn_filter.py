"""Connections turned away by the kernel, before accept (issue 34): the
addresses in back-off always, and every stranger while the handshake queue
is full.

A listener's back-off (``metalog.broker.net.backoff.AddressPolicy``) lets
one connection of an address that keeps failing wait out the period and
refuses the rest at accept. Under a flood that refusal is the whole cost:
an accept, a close with the unread ClientHello (a reset) and the Python
between them, about 0.1 ms each on the loop the commits run on, a
thousand times a second. ``SynBans`` moves it into the kernel: a
classic BPF program on the listening socket (``SO_ATTACH_FILTER``) drops
every packet from the addresses in back-off, so their SYNs are never
answered and their connections never reach the accept queue. The client's
SYN retransmissions (1 s, then 3 s, 7 s ...) are its wait: KIP-612's
throttling by delaying accept, at no cost to us.

* Linux and IPv4 listeners only (elsewhere, and on IPv6 listeners, the
  refusal stays at accept). The program compares the source address
  (``SKF_NET_OFF + 12``) with each banned address in turn: two
  instructions per address, at most ``ADDRESSES_MAX`` of them (the most
  recently banned), far below the kernel's 4,096.
* An accepted socket inherits its listener's program: ``detach()`` takes
  it off, so established connections never run the list.
* The list changes as back-offs start and end; the program is rebuilt at
  most once per ``REBUILD_INTERVAL_S`` (``program()`` is pure; the
  listener schedules ``attach``).
* The exempt hosts (the voters) are never banned: the listener never
  puts them in back-off.
* **Shedding**: a stranger that finds the handshake queue full would cost
  an accept and a close too. For ``SHED_HOLD_S`` after one did (the queue
  drains meanwhile) the program turns around: it keeps the packets of the
  exempt hosts and of the addresses that last completed a handshake (the
  listener's ``known``, at most 512), and drops everyone else's, so a
  flood's new connections wait in their SYN retries while known clients
  and peers still connect.
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import socket
import struct
import sys
from typing import Any, Callable

ADDRESSES_MAX = 1024  # banned addresses in one program: 2 instructions each, under BPF_MAXINSNS (4096)
REBUILD_INTERVAL_S = 0.1  # at most this often a new program is attached
SHED_HOLD_S = 0.25  # strangers dropped this long after the handshake queue was full (it drains meanwhile)

SO_ATTACH_FILTER = getattr(socket, "SO_ATTACH_FILTER", 26)
SO_DETACH_FILTER = getattr(socket, "SO_DETACH_FILTER", 27)
_SKF_NET_OFF = -0x100000  # classic BPF: offsets from the network header
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
_INSN = struct.Struct("<HBBI")  # struct sock_filter: code, jt, jf, k
_KEEP = 0xFFFF_FFFF  # return value: keep the whole packet
_DROP = 0


def supported(sock: socket.socket) -> bool:
    """Whether this listening socket can carry a program (Linux, IPv4)."""
    return sys.platform.startswith("linux") and sock.family == socket.AF_INET


def program(addresses: list[str], keep_listed: bool = False) -> bytes:
    """The instructions dropping every packet from `addresses` (IPv4, at most
    ADDRESSES_MAX) or, `keep_listed`, every packet from any other address."""
    if len(addresses) > ADDRESSES_MAX:
        raise ValueError(f"{len(addresses)} addresses, at most {ADDRESSES_MAX} in one program")
    listed, other = (_KEEP, _DROP) if keep_listed else (_DROP, _KEEP)
    parts = [_INSN.pack(_LD_W_ABS, 0, 0, (_SKF_NET_OFF + 12) & 0xFFFF_FFFF)]  # A = source address
    for host in addresses:
        k = int.from_bytes(socket.inet_aton(host), "big")
        parts.append(_INSN.pack(_JEQ_K, 0, 1, k))  # equal: the next instruction, else skip it
        parts.append(_INSN.pack(_RET_K, 0, 0, listed))
    parts.append(_INSN.pack(_RET_K, 0, 0, other))
    return b"".join(parts)


def attach(sock: socket.socket, addresses: list[str], keep_listed: bool = False) -> None:
    """Put the program for `addresses` on `sock` (no addresses to drop: take it off). Raises OSError."""
    if not addresses and not keep_listed:
        detach(sock)
        return
    code = program(addresses, keep_listed)
    buf = ctypes.create_string_buffer(code, len(code))
    # struct sock_fprog: unsigned short len; (padding); struct sock_filter *filter
    fprog = struct.pack("HL", len(code) // _INSN.size, ctypes.addressof(buf))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)


def detach(sock: socket.socket) -> None:
    """Take a program off `sock` (none there: nothing happens)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_DETACH_FILTER, 0)
    except OSError:  # ENOENT: no program on it
        pass


def _ipv4(host: str) -> bool:
    try:
        socket.inet_aton(host)
    except OSError:
        return False
    return True


class SynBans:
    """What a listener's IPv4 sockets drop in the kernel: the addresses in
    back-off (``ban``) and, for ``SHED_HOLD_S`` after a stranger found the
    handshake queue full (``shed``), every address but the exempt and the
    known ones (a completed handshake). Programs are rebuilt at
    most once per ``REBUILD_INTERVAL_S`` and again when the earliest
    back-off or the shedding ends (times are the running loop's)."""

    def __init__(self, on_error: Callable[[str, OSError], None], stats: Any, always: set[str],
                 known: dict[str, None]):
        self._on_error = on_error  # attaching failed (then no more programs: the refusals stay at accept)
        self._stats = stats  # ListenerStats: syn_banned_now, syn_sheds_total
        self._always = always  # the exempt addresses (the listener's set, filled as names resolve)
        self._known = known  # addresses with a completed handshake (the listener's, least recent first)
        self.sockets: list[socket.socket] = []
        self.until_s: dict[str, float] = {}  # banned address -> end of its back-off; oldest ban first
        self.shed_until_s = -math.inf
        self.shed_hold_s = SHED_HOLD_S
        self.used = False  # a program was attached once: accepted sockets are detached
        self._timer: asyncio.TimerHandle | None = None
        self._timer_s = math.inf
        self._last_s = -math.inf

    def add_socket(self, sock: socket.socket) -> None:
        if supported(sock):
            self.sockets.append(sock)

    def ban(self, host: str, until_s: float) -> None:
        if not self.sockets or not _ipv4(host):
            return
        self.until_s.pop(host, None)
        self.until_s[host] = until_s
        self._soon()

    def shed(self) -> None:
        """A stranger found the handshake queue full: strangers' SYNs are dropped for a while."""
        now_s = asyncio.get_running_loop().time()
        if not self.sockets or self.shed_until_s > now_s:
            return
        self.shed_until_s = now_s + self.shed_hold_s
        self._stats.syn_sheds_total += 1
        # At once, not at the rebuild rate: every millisecond until then is another accept and
        # close of the flood's. At most one such rebuild per window.
        self.close()
        self._refresh()

    def close(self) -> None:
        """Cancel the pending rebuild (the listener closes; or shed rebuilds now)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _soon(self) -> None:
        self._schedule(max(asyncio.get_running_loop().time(), self._last_s + REBUILD_INTERVAL_S))

    def _schedule(self, at_s: float) -> None:
        if self._timer is not None:
            if self._timer_s <= at_s:
                return
            self._timer.cancel()
        self._timer_s = at_s
        self._timer = asyncio.get_running_loop().call_at(at_s, self._refresh)

    def _refresh(self) -> None:
        self._timer = None
        now_s = asyncio.get_running_loop().time()
        for host in [h for h, u in self.until_s.items() if u <= now_s]:
            del self.until_s[host]
        shedding = self.shed_until_s > now_s
        if shedding:  # the exempt addresses first: never cut
            hosts = [h for h in self._always if _ipv4(h)][:ADDRESSES_MAX]
            known = [h for h in self._known if _ipv4(h)]
            hosts += known[max(0, len(known) - (ADDRESSES_MAX - len(hosts))):]  # the most recent
        else:
            hosts = list(self.until_s)[-ADDRESSES_MAX:]
        for sock in self.sockets:
            if sock.fileno() < 0:
                continue
            try:
                attach(sock, hosts, keep_listed=shedding)
            except OSError as exc:  # a kernel or sandbox without socket filters: logged once, then off
                self._off(sock, exc)
                return
        self.used = self.used or shedding or bool(hosts)
        self._stats.syn_banned_now = min(len(self.until_s), ADDRESSES_MAX)
        self._last_s = now_s
        ends = [self.shed_until_s] if shedding else []
        if self.until_s:
            ends.append(min(self.until_s.values()))
        if ends:
            self._schedule(max(min(ends), now_s + REBUILD_INTERVAL_S))

    def _off(self, sock: socket.socket, exc: OSError) -> None:
        self._on_error(f"{sock.getsockname()}", exc)
        for s in self.sockets:
            detach(s)
        self.sockets.clear()
        self.until_s.clear()
        self._stats.syn_banned_now = 0
