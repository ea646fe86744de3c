"""The handshake budget (metalog.broker.net.guard): measured handshake time paces new handshakes."""

from __future__ import annotations

import asyncio
import ssl

import pytest

from metalog.broker.net.channel import PeerChannel
from metalog.broker.net.guard import (FAILING_SHARE_MIN, HANDSHAKE_METER, HandshakeMeter, HandshakePacer,
                                      TimedSSLObject)
from metalog.broker.net.listener import ListenerLimits
from metalog.broker.net.tls import TlsFiles, TlsPaths
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.tools.cluster import certs
from tests.net.flat_server import serve_flat as serve
from tests.net.helpers import ListLogger, client_hello, wait_for_condition


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_starts_are_spaced_by_the_mean_cost_over_the_share():
    clock = Clock()
    meter = HandshakeMeter(clock)
    pacer = HandshakePacer(0.25, meter)
    for _ in range(10):  # measured: 2 ms a handshake, in two steps
        meter.started()
        meter.spent(0.0015, first=True)
        meter.spent(0.0005, first=False)
    clock.now_s += 10  # a while ago: the share has decayed, the mean (a ratio of decayed sums) stays
    assert meter.mean_cost_s() == pytest.approx(0.002)
    now = clock.now_s
    starts = []
    for _ in range(6):
        at = pacer.next_start_s(now)
        starts.append(at - now)
        pacer.took(at)
    # a burst of 2, then one per 2 ms / 0.25 = 8 ms
    assert starts == pytest.approx([0, 0, 0.008, 0.016, 0.024, 0.032], abs=1e-9)


def test_no_start_while_the_measured_share_is_above_the_budget():
    clock = Clock()
    meter = HandshakeMeter(clock)
    pacer = HandshakePacer(0.25, meter)
    meter.started()
    meter.spent(0.5, first=True)  # one handshake step that took half a second of the loop
    assert meter.share() == pytest.approx(0.5)
    wait_s = pacer.next_start_s(clock.now_s) - clock.now_s
    assert wait_s == pytest.approx(0.25)
    assert HandshakePacer(0, meter).next_start_s(clock.now_s) == clock.now_s  # 0: not paced


async def test_server_handshakes_are_measured_on_the_meter(tmp_path):
    d = str(tmp_path)
    certs.cluster_certs(d, {1: ["127.0.0.1"]}, users=("alice",))

    def files(name: str) -> TlsFiles:
        return TlsFiles(TlsPaths(f"{d}/ca.crt", f"{d}/{name}.crt", f"{d}/{name}.key"))

    server = await serve("127.0.0.1", 0,
                         lambda c, h, b: c.send_response(h.correlation_id, m.MetadataResponse(leader_id=1)),
                         tls=files("node-1"), limits=ListenerLimits(), logger=ListLogger())
    before_s, before_n = HANDSHAKE_METER.seconds_total, HANDSHAKE_METER.handshakes_total
    ch = PeerChannel("127.0.0.1", server.sockets[0].getsockname()[1], tls=files("alice"), connect_timeout_ms=10_000)
    try:
        assert (await ch.request(ApiKey.METADATA, m.MetadataRequest(), 10_000)).leader_id == 1
    finally:
        await ch.close()
        server.close()
    assert HANDSHAKE_METER.handshakes_total == before_n + 1
    assert HANDSHAKE_METER.seconds_total > before_s
    assert files("node-1").server().sslobject_class in (None, ssl.SSLObject)  # a fresh context is not touched
    assert issubclass(TimedSSLObject, ssl.SSLObject)


async def test_a_full_handshake_queue_refuses_strangers_at_once_and_a_peer_still_starts(tmp_path):
    """At a share that starts a handshake every few seconds the pacer's queue fills: the next
    stranger is closed at once (not held for a wait its client would give up on), and a peer
    (an exempt address) still completes its handshake, ahead of the queue."""
    d = str(tmp_path)
    certs.cluster_certs(d, {1: ["127.0.0.1"]}, users=("alice",))

    def files(name: str) -> TlsFiles:
        return TlsFiles(TlsPaths(f"{d}/ca.crt", f"{d}/{name}.crt", f"{d}/{name}.key"))

    limits = ListenerLimits(ssl_handshake_loop_share=0.0001, connection_creation_rate_per_ip=0,
                            max_connection_creation_rate=0, exempt_hosts=frozenset({"127.0.0.1"}))
    log = ListLogger()
    server = await serve("127.0.0.1", 0,
                         lambda c, h, b: c.send_response(h.correlation_id, m.MetadataResponse(leader_id=1)),
                         tls=files("node-1"), limits=limits, logger=log)
    port = server.sockets[0].getsockname()[1]
    listener = server.listener
    bound = listener.handshake_queue_max()
    assert bound is not None and bound >= 16
    strangers = []
    ch = PeerChannel("127.0.0.1", port, tls=files("alice"), connect_timeout_ms=10_000)
    try:
        async with asyncio.timeout(20):
            # two may start at once (the pacer's burst): the queue is full after at most bound + 2
            st = listener.stats
            while not st.refused_total["handshake_queue_full"]:
                strangers.append(await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.30", 0)))
                await wait_for_condition(  # the listener has taken this one (started, queued or refused)
                    lambda: st.accepted_total + st.delayed_now + sum(st.refused_total.values()) == len(strangers),
                    10, "the connection accepted")
            assert len(strangers) <= bound + 3
            assert await strangers[-1][0].read() == b""  # closed before anything was read
        assert listener.stats.delayed_now == bound
        assert log.named("connection_refused")[0]["limit"] == "handshake_queue_full"
        async with asyncio.timeout(10):  # queued behind the strangers it would wait minutes
            assert (await ch.request(ApiKey.METADATA, m.MetadataRequest(), 10_000)).leader_id == 1
    finally:
        await ch.close()
        for _, w in strangers:
            w.close()
        server.close()


async def test_a_stranger_leaving_after_our_answer_to_its_client_hello_counts_toward_its_back_off(tmp_path):
    """The cheap flood: a ClientHello, our costly answer, then gone. A bare connect and close
    (a port probe, a restart) costs us nothing and does not count."""
    d = str(tmp_path)
    certs.cluster_certs(d, {1: ["127.0.0.1"]})
    tls = TlsFiles(TlsPaths(f"{d}/ca.crt", f"{d}/node-1.crt", f"{d}/node-1.key"))
    limits = ListenerLimits(failed_connections_before_backoff=1, failed_connection_backoff_ms=60_000,
                            connection_creation_rate_per_ip=0, max_connection_creation_rate=0)
    log = ListLogger()
    server = await serve("127.0.0.1", 0, lambda c, h, b: None, tls=tls, limits=limits, logger=log)
    port = server.sockets[0].getsockname()[1]
    st = server.listener.stats
    try:
        _, w = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.31", 0))
        w.close()  # connect and close
        await wait_for_condition(lambda: st.failures_total["tls_handshake_failed"] == 1, 10, "the reset seen")
        assert "connection_backoff" not in st.failures_total, log.named("tls_handshake_failed")
        r, w = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.32", 0))
        w.write(client_hello())
        assert await r.read(1 << 16)  # the server's answer: a key exchange and a signature
        w.close()
        await wait_for_condition(lambda: st.failures_total["connection_backoff"] == 1, 10, "the back-off")
        failed = log.named("tls_handshake_failed")
        assert failed[-1]["reason"] == "the peer left after our answer to its ClientHello"
        assert server.listener.addresses.get("127.0.0.32").blocked_until_s > 0
        assert server.listener.addresses.get("127.0.0.31").failures == 0
    finally:
        server.close()


def test_the_share_shrinks_while_handshakes_fail_and_comes_back_as_they_succeed():
    """A flood's handshakes never complete: the pacer gives it a fifth of the share. A
    reconnect storm of real clients completes its handshakes and keeps the whole share."""
    clock = Clock()
    meter = HandshakeMeter(clock)
    pacer = HandshakePacer(0.25, meter, clock=clock)
    assert pacer.effective_share() == 0.25
    for _ in range(3):
        pacer.ended(False)
    assert pacer.effective_share() == 0.25  # too few to judge
    for _ in range(20):
        pacer.ended(False)
    assert pacer.effective_share() == pytest.approx(0.25 * FAILING_SHARE_MIN)
    rate_failing = pacer.rate_per_s()
    for _ in range(23):
        pacer.ended(True)
    assert pacer.effective_share() == pytest.approx(0.125)  # half of them completed
    assert pacer.rate_per_s() == pytest.approx(rate_failing * 0.5 / FAILING_SHARE_MIN)
    clock.now_s += 60  # long after: the outcomes are forgotten, the whole share again
    assert pacer.effective_share() == 0.25
