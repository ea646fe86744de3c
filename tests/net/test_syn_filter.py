"""Addresses in back-off are dropped by the kernel before accept (issue 34,
metalog.broker.net.syn_filter): their SYNs go unanswered while the back-off
lasts, every other address connects, and the listener accepts nothing of
theirs. Real sockets on loopback addresses (127.0.0.x)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from metalog.broker.net import syn_filter
from metalog.broker.net.guard import ListenerStats
from metalog.broker.net.listener import ListenerLimits
from metalog.broker.net.tls import TlsFiles, TlsPaths
from metalog.tools.cluster import certs
from tests.net.flat_server import serve_flat as serve
from tests.net.helpers import ListLogger, wait_for_condition
from tests.net.test_listener_limits import NO_RATES, closed_by_server, connect, made, start

SO_LOCK_FILTER = 44  # Linux: the socket's filter can no longer be changed
CONNECT_WAIT_S = 0.5  # a SYN the kernel drops is retried after 1 s: no answer within this


def try_connect(port: int, source: str) -> str:
    """'connected', or why not (a dropped SYN: 'timeout')."""
    with socket.socket() as s:
        s.bind((source, 0))
        s.settimeout(CONNECT_WAIT_S)
        try:
            s.connect(("127.0.0.1", port))
        except TimeoutError:
            return "timeout"
        except OSError as exc:
            return type(exc).__name__
        return "connected"


def test_the_program_drops_the_banned_addresses_syns_and_no_other():
    with socket.socket() as lsock:
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(16)
        port = lsock.getsockname()[1]
        assert syn_filter.supported(lsock)
        syn_filter.attach(lsock, ["127.0.0.51", *(f"10.9.{i // 250}.{i % 250}" for i in range(1000))])
        assert try_connect(port, "127.0.0.51") == "timeout"
        assert try_connect(port, "127.0.0.52") == "connected"
        syn_filter.attach(lsock, [])  # no addresses: the program comes off
        assert try_connect(port, "127.0.0.51") == "connected"


def test_a_program_is_bounded_and_ipv6_listeners_get_none():
    with pytest.raises(ValueError, match="at most 1024"):
        syn_filter.program([f"10.0.{i // 250}.{i % 250}" for i in range(syn_filter.ADDRESSES_MAX + 1)])
    assert len(syn_filter.program(["10.0.0.1"])) == 4 * 8  # load, compare, drop, keep
    with socket.socket(socket.AF_INET6) as s6:
        assert not syn_filter.supported(s6)


async def test_an_address_in_back_off_is_dropped_by_the_kernel_until_the_back_off_ends():
    limits = ListenerLimits(failed_connections_before_backoff=1, failed_connection_backoff_ms=1500, **NO_RATES)
    server, port, started, log = await start(limits)
    st = server.listener.stats
    try:
        r, w = await connect(port, "127.0.0.41")
        w.write(b"\xff\xff\xff\xf0")  # a bad frame: one failure starts the back-off
        assert await closed_by_server(r)
        w.close()
        await wait_for_condition(lambda: st.syn_banned_now == 1, 5, "the address in the filter")
        before = len(started)
        assert await asyncio.to_thread(try_connect, port, "127.0.0.41") == "timeout"
        _, w2 = await connect(port, "127.0.0.42")  # another address: accepted and started at once
        await wait_for_condition(lambda: made(started) == before + 1, 5, "the other address's connection")
        assert started[-1][1].peer_host == "127.0.0.42"
        assert not st.refused_total and not st.delayed_total  # the banned one never reached accept
        w2.close()
        await wait_for_condition(lambda: st.syn_banned_now == 0, 5, "the back-off over")
        assert await asyncio.to_thread(try_connect, port, "127.0.0.41") == "connected"
        assert log.named("connection_backoff")[0]["address"] == "127.0.0.41"
    finally:
        server.close()


async def test_with_the_setting_off_the_address_is_held_at_accept_instead():
    limits = ListenerLimits(failed_connections_before_backoff=1, failed_connection_backoff_ms=60_000,
                            failed_connection_backoff_drops_syns=False, **NO_RATES)
    server, port, started, log = await start(limits)
    st = server.listener.stats
    try:
        r, w = await connect(port, "127.0.0.43")
        w.write(b"\xff\xff\xff\xf0")
        assert await closed_by_server(r)
        w.close()
        await wait_for_condition(lambda: log.named("connection_backoff"), 5, "the back-off line")
        assert await asyncio.to_thread(try_connect, port, "127.0.0.43") == "connected"  # accepted, then held
        await wait_for_condition(lambda: st.delayed_total["backoff"] == 1, 5, "held")
        assert st.syn_banned_now == 0 and not server.listener.bans.sockets
    finally:
        server.close()



async def test_a_kernel_that_refuses_the_program_leaves_the_refusals_at_accept_and_says_so_once():
    errors: list[OSError] = []
    stats = ListenerStats()
    bans = syn_filter.SynBans(lambda where, exc: errors.append(exc), stats, set(), {})
    with socket.socket() as lsock:
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(4)
        syn_filter.attach(lsock, ["10.0.0.1"])
        lsock.setsockopt(socket.SOL_SOCKET, SO_LOCK_FILTER, 1)  # now no program may change: EPERM
        bans.add_socket(lsock)
        bans.ban("127.0.0.44", asyncio.get_running_loop().time() + 60)
        await wait_for_condition(lambda: errors, 5, "the refresh")
        assert isinstance(errors[0], PermissionError) and not bans.sockets and stats.syn_banned_now == 0
        bans.ban("127.0.0.45", asyncio.get_running_loop().time() + 60)  # off now: no refresh, nothing to say
        assert not bans.until_s and bans._timer is None and len(errors) == 1
    bans.close()


async def test_a_full_handshake_queue_sheds_strangers_in_the_kernel_but_not_peers_or_known_clients(tmp_path):
    """While the queue is full a stranger costs an accept and a close; for a while after, the
    kernel drops strangers' SYNs instead, and the exempt and known addresses still connect (a
    known one waits for the handshake budget ahead of the strangers, not refused by the full queue)."""
    d = str(tmp_path)
    certs.cluster_certs(d, {1: ["127.0.0.1"]})
    tls = TlsFiles(TlsPaths(f"{d}/ca.crt", f"{d}/node-1.crt", f"{d}/node-1.key"))
    limits = ListenerLimits(ssl_handshake_loop_share=0.0001, exempt_hosts=frozenset({"127.0.0.1"}), **NO_RATES)
    server = await serve("127.0.0.1", 0, lambda c, h, b: None, tls=tls, limits=limits, logger=ListLogger())
    port = server.sockets[0].getsockname()[1]
    listener, st = server.listener, server.listener.stats
    listener.bans.shed_hold_s = 3.0  # long enough to check while it lasts, on a loaded machine too
    listener.known["127.0.0.63"] = None  # as a completed handshake would
    strangers = []
    try:
        async with asyncio.timeout(20):
            while not st.refused_total["handshake_queue_full"]:
                strangers.append(await connect(port, "127.0.0.60"))
        await wait_for_condition(lambda: listener.bans.used, 5, "the shedding program")
        assert st.syn_sheds_total == 1
        assert await asyncio.to_thread(try_connect, port, "127.0.0.62") == "timeout"  # a stranger
        assert await asyncio.to_thread(try_connect, port, "127.0.0.1") == "connected"  # a peer
        refused, waiting = st.refused_total["handshake_queue_full"], st.delayed_now
        strangers.append(await connect(port, "127.0.0.63"))  # a known client: through the kernel...
        await wait_for_condition(lambda: st.delayed_now == waiting + 1, 5, "the known client queued")
        assert st.refused_total["handshake_queue_full"] == refused  # ...and queued ahead, not refused
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + 10
        while await asyncio.to_thread(try_connect, port, "127.0.0.62") != "connected":  # the window ends
            assert loop.time() < deadline_s, "strangers still shed"
    finally:
        for _, w in strangers:
            w.close()
        server.close()
