"""The listener's connection limits (issue 34): rates delay, caps refuse, peers are exempt, logs stay bounded.

Each test starts an in-process listener on 127.0.0.1 and opens plain TCP
connections from other loopback addresses (127.0.0.x); "started" is the
loop time at which the listener let a connection begin (its Connection made).
"""

from __future__ import annotations

import asyncio

from metalog.broker.net.listener import Listener, ListenerLimits, listen
from metalog.broker.net.kafka_conn import KafkaConnection
from metalog.broker.net.server import Connection
from tests.net.helpers import ListLogger, wait_for_condition

NO_RATES = dict(connection_creation_rate_per_ip=0, max_connection_creation_rate=0)


def answer(exchange):
    exchange.fail(35)  # these tests send no well-formed request


async def start(limits: ListenerLimits):
    """A plaintext listener whose connections record when they started."""
    log = ListLogger()
    listener = Listener(None, limits, log)
    started: list[tuple[float, Connection]] = []
    loop = asyncio.get_running_loop()

    def make() -> Connection:
        conn = KafkaConnection(answer, {}, 1 << 20, 16, log, listener)
        started.append((loop.time(), conn))
        return conn

    starting = listener.starting
    listener.start_log = []  # type: ignore[attr-defined]  # (loop time, host) of each start, for start_times

    def record(host: str, now_s: float, arrived_s: float) -> None:
        listener.start_log.append((now_s, host))  # type: ignore[attr-defined]
        starting(host, now_s, arrived_s)

    listener.starting = record  # type: ignore[method-assign]
    server = await listen("127.0.0.1", 0, make, listener)
    return server, server.sockets[0].getsockname()[1], started, log


def start_times(server, host: str | None = None) -> list[float]:
    """The loop times at which the listener let connections start (from `host`), sorted:
    its own decisions, not when the loop later got round to making each Connection (which a
    loaded machine delays by milliseconds, unevenly)."""
    return sorted(t for t, h in server.listener.start_log if host is None or h == host)


def made(started) -> int:
    """How many connections the listener has begun: a Connection is created
    one loop turn before connection_made gives it its peer address, so count
    those with one (counting objects let a check read a connection whose
    peer_host was still "?")."""
    return sum(c.peer_host != "?" for _, c in started)


async def connect(port: int, source: str):
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def closed_by_server(reader: asyncio.StreamReader, timeout_s: float = 5.0) -> bool:
    async with asyncio.timeout(timeout_s):
        return await reader.read() == b""


async def test_a_burst_above_the_per_address_rate_is_delayed_not_refused():
    server, port, started, _ = await start(ListenerLimits(connection_creation_rate_per_ip=10,
                                                          max_connection_creation_rate=0))
    try:
        conns = await asyncio.gather(*(connect(port, "127.0.0.7") for _ in range(30)))
        other = await connect(port, "127.0.0.8")  # another address is not slowed by the first one's burst
        await wait_for_condition(lambda: made(started) == 31, 20, "all 31 connections started")
        times = start_times(server, "127.0.0.7")
        other_t = start_times(server, "127.0.0.8")[0]
        assert other_t < times[-1]  # it went ahead of 127.0.0.7's waiting ones
        # a burst of 10 (one second's worth) at once, then 10 a second: the 30th 2 s after the first
        for k in range(10, 30):
            assert times[k] - times[0] >= (k - 9) / 10 - 0.01
        assert server.listener.stats.delayed_total["rate_per_ip"] == 20
        assert not server.listener.stats.refused_total  # delayed, never refused
        for _, w in [*conns, other]:
            w.close()
    finally:
        server.close()


async def test_the_listener_rate_spaces_connections_from_many_addresses():
    server, port, started, _ = await start(ListenerLimits(connection_creation_rate_per_ip=0,
                                                          max_connection_creation_rate=10))
    try:
        conns = await asyncio.gather(*(connect(port, f"127.0.1.{i + 1}") for i in range(25)))
        await wait_for_condition(lambda: made(started) == 25, 20, "all 25 started")
        times = start_times(server)
        for k in range(10, 25):
            assert times[k] - times[0] >= (k - 9) / 10 - 0.01
        assert server.listener.stats.delayed_total["rate_listener"] == 15
        assert not server.listener.stats.refused_total
        for _, w in conns:
            w.close()
    finally:
        server.close()


async def test_above_max_connections_per_ip_a_connection_is_refused_before_anything_is_read():
    server, port, started, log = await start(ListenerLimits(max_connections_per_ip=3, **NO_RATES))
    try:
        held = [await connect(port, "127.0.0.9") for _ in range(3)]
        await wait_for_condition(lambda: made(started) == 3, 5, "3 started")
        reader, writer = await connect(port, "127.0.0.9")
        assert await closed_by_server(reader)
        assert server.listener.stats.refused_total == {"max_connections_per_ip": 1}
        assert log.named("connection_refused")[0]["limit"] == "max_connections_per_ip"
        _, w = await connect(port, "127.0.0.10")  # another address: fine
        await wait_for_condition(lambda: made(started) == 4, 5, "the other address started")
        for _, x in [*held, (None, writer), (None, w)]:
            x.close()
    finally:
        server.close()


async def test_a_peers_address_is_exempt_from_rates_caps_and_back_off():
    limits = ListenerLimits(connection_creation_rate_per_ip=2, max_connection_creation_rate=2,
                            max_connections_per_ip=2, failed_connections_before_backoff=1,
                            exempt_hosts=frozenset({"127.0.0.11"}))
    server, port, started, _ = await start(limits)
    try:
        t0 = asyncio.get_running_loop().time()
        bad_r, bad_w = await connect(port, "127.0.0.11")
        bad_w.write(b"\xff\xff\xff\xf0")  # a bad frame: would start a back-off for anyone else
        assert await closed_by_server(bad_r)
        conns = await asyncio.gather(*(connect(port, "127.0.0.11") for _ in range(10)))
        await wait_for_condition(lambda: made(started) == 11, 5, "all 11 started")
        # at once, though 2/s and 2 per address are the limits (10 at 2/s would take 4.5 s)
        assert max(t for t, _ in started) - t0 < 3.0
        st = server.listener.stats
        assert not st.refused_total and not st.delayed_total and "connection_backoff" not in st.failures_total
        for _, w in conns:
            w.close()
    finally:
        server.close()


async def test_an_address_that_keeps_failing_is_delayed_for_its_back_off():
    """Its next connection waits (accepted, nothing read); a second one meanwhile is closed."""
    limits = ListenerLimits(failed_connections_before_backoff=2, failed_connection_backoff_ms=1000,
                            failed_connection_backoff_drops_syns=False, **NO_RATES)  # kernel drops: test_syn_filter
    server, port, started, log = await start(limits)
    try:
        for _ in range(2):
            r, w = await connect(port, "127.0.0.12")
            w.write(b"\xff\xff\xff\xf0")
            assert await closed_by_server(r)
            w.close()
        await wait_for_condition(lambda: log.named("connection_backoff"), 5, "the back-off line")
        t0 = asyncio.get_running_loop().time()
        r, w = await connect(port, "127.0.0.12")  # accepted by the kernel, then held by the listener
        await wait_for_condition(lambda: server.listener.stats.delayed_total["backoff"] == 1, 5, "held")
        # one connection of an address in back-off waits it out; more from it are closed, not piled up
        r2, w2 = await connect(port, "127.0.0.12")
        assert await closed_by_server(r2)
        assert server.listener.stats.refused_total == {"backoff": 1}
        await wait_for_condition(lambda: made(started) == 3, 10, "the third connection started")
        assert start_times(server)[-1] - t0 >= 0.8
        w.close()
        w2.close()
    finally:
        server.close()


async def test_a_flood_of_refusals_logs_a_bounded_number_of_lines_with_the_count():
    limits = ListenerLimits(failed_connections_before_backoff=1_000_000, refusal_log_interval_ms=60_000,
                            refusal_log_lines_max=3, **NO_RATES)
    server, port, _, log = await start(limits)
    n = 200
    try:
        for i in range(n):
            r, w = await connect(port, f"127.0.2.{1 + i % 200}")
            w.write(b"\xff\xff\xff\xf0")
            assert await closed_by_server(r)
            w.close()
        assert server.listener.stats.failures_total["bad_frame"] == n  # every one counted (the metric)
    finally:
        server.close()  # ends the interval: its summary is written
    # within one interval: 3 full lines, then one summary line with the count and the first offender
    assert len(log.named("bad_frame")) == 3
    summaries = log.named("connection_refusals_summary")
    assert [(x["reason"], x["count"], x["not_logged"], x["first_address"]) for x in summaries] == [
        ("bad_frame", n, n - 3, "127.0.2.1")]


async def test_refusals_of_the_next_interval_are_logged_and_summarized_again():
    limits = ListenerLimits(failed_connections_before_backoff=1_000_000, refusal_log_interval_ms=200,
                            refusal_log_lines_max=1, **NO_RATES)
    server, port, _, log = await start(limits)
    try:
        for round_ in range(2):
            for i in range(5):
                r, w = await connect(port, f"127.0.3.{1 + round_}")
                w.write(b"\xff\xff\xff\xf0")
                assert await closed_by_server(r)
                w.close()
            await wait_for_condition(lambda: len(log.named("connection_refusals_summary")) == round_ + 1, 10,
                                     "the interval's summary (written by the sweeper)")
    finally:
        server.close()
    assert len(log.named("bad_frame")) == 2  # one full line per interval
    assert [(x["count"], x["first_address"]) for x in log.named("connection_refusals_summary")] == [
        (5, "127.0.3.1"), (5, "127.0.3.2")]


def test_the_brokers_listener_exempts_the_voters_hosts_and_the_configured_ones():
    from metalog.broker.server.config import BrokerConfig, NetworkConfig
    from metalog.broker.server.inbound import listener_limits

    cfg = BrokerConfig(node_id=1, cluster_id="c", data_dir="d", listen="10.0.0.1:9000",
                       voters="1@10.0.0.1:9000,2@node-b:9000,3@10.0.0.3:9000",
                       network=NetworkConfig(connection_limits_exempt_hosts=["observer-1"],
                                             max_connection_creation_rate=50, connection_creation_rate_per_ip=5))
    limits = listener_limits(cfg)
    assert limits.exempt_hosts == {"10.0.0.1", "node-b", "10.0.0.3", "observer-1"}
    assert (limits.max_connection_creation_rate, limits.connection_creation_rate_per_ip) == (50, 5)


async def test_exempt_host_names_are_resolved_to_addresses():
    listener = Listener(None, ListenerLimits(exempt_hosts=frozenset({"localhost", "no-such-host.invalid"})),
                        log := ListLogger())
    await listener.resolve_exempt()
    assert "127.0.0.1" in listener.exempt
    assert log.named("exempt_host_unresolved")[0]["host"] == "no-such-host.invalid"


async def test_a_waiting_connection_whose_client_gave_up_is_dropped_without_a_start():
    limits = ListenerLimits(failed_connections_before_backoff=1, failed_connection_backoff_ms=60_000,
                            failed_connection_backoff_drops_syns=False,
                            connections_max_idle_ms=400, **NO_RATES)  # the sweep runs every 0.1 s
    server, port, started, log = await start(limits)
    try:
        r, w = await connect(port, "127.0.0.13")
        w.write(b"\xff\xff\xff\xf0")
        assert await closed_by_server(r)
        r, w = await connect(port, "127.0.0.13")  # held for a minute
        await wait_for_condition(lambda: server.listener.stats.delayed_now == 1, 5, "held")
        w.close()  # the client gives up
        await wait_for_condition(lambda: server.listener.stats.refused_total["abandoned"] == 1, 5, "dropped")
        assert len(started) == 1 and not server.listener.per_ip and server.listener.stats.delayed_now == 0
    finally:
        server.close()
