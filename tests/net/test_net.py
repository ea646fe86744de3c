"""PeerChannel against a real Kafka listener (serve_kafka + KafkaDispatch, tests.net.flat_server) over TCP on 127.0.0.1:
concurrency on one connection, timeouts, overload, the in-flight bound, reconnects, bad input."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import pytest
import uvloop

from metalog.broker.net.channel import FORWARD_LANE, ConnectionLost, Overloaded, PeerChannel, PeerPool, RequestTimeout
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.protocol.errors import Errors
from metalog.protocol.kafka import messages as km
from metalog.protocol.kafka import wire
from metalog.protocol.kafka.framing import NEED_DATA, FrameDecoder, response_correlation_id
from tests.net.flat_server import serve_flat as serve
from tests.net.flat_server import values_of
from tests.net.helpers import ListLogger, start_server_process, wait_for_condition


class ParkingHandler:
    """Records requests and lets the test answer them whenever and in any order."""

    def __init__(self) -> None:
        self.parked: list[tuple] = []  # (conn, header, body)
        self.connections: set = set()

    def __call__(self, conn, header, body):
        self.connections.add(conn)
        self.parked.append((conn, header, body))


def port_of(server) -> int:
    return server.sockets[0].getsockname()[1]


def produce(i: int) -> m.ProduceRequest:
    return m.ProduceRequest(cluster_id="c", records=[str(i).encode()])


async def open_raw(port: int):
    return await asyncio.open_connection("127.0.0.1", port)


async def read_eof(reader: asyncio.StreamReader, timeout_s: float = 5.0) -> bytes:
    """Everything until the server closes the connection (fails if it never does)."""
    async with asyncio.timeout(timeout_s):
        return await reader.read()


@pytest.fixture
async def parking_server():
    handler = ParkingHandler()
    log = ListLogger()
    server = await serve("127.0.0.1", 0, handler, max_inflight_per_conn=64, logger=log)
    yield server, handler, log
    server.close()


async def test_concurrent_requests_on_one_connection_each_get_their_own_answer(parking_server):
    server, handler, _ = parking_server
    ch = PeerChannel("127.0.0.1", port_of(server), client_id="t")
    tasks = [asyncio.ensure_future(ch.request(ApiKey.PRODUCE, produce(i), 5000)) for i in range(20)]
    await wait_for_condition(lambda: len(handler.parked) == 20, what="20 parked requests")
    assert len(handler.connections) == 1
    # The handler answers in reverse arrival order (the answers leave in request
    # order, as Kafka's do); each requester must still get its own answer.
    for conn, header, body in reversed(handler.parked):
        assert header.client_id == "t"
        conn.send_response(header.correlation_id, m.ProduceResponse(base_offset=int(values_of(body)[0])))
    results = await asyncio.gather(*tasks)
    assert [r.base_offset for r in results] == list(range(20))
    await ch.close()


async def test_a_timeout_closes_the_connection_as_kafkas_clients_do(parking_server):
    """Kafka's answers leave in request order, so an answer that never comes
    holds up every later one on its connection. On a request timeout the
    channel closes the connection (as Java's NetworkClient and librdkafka do):
    the timed-out request fails with RequestTimeout, the others on it with
    ConnectionLost naming the timeout (callers retry), and the next request
    opens a new connection."""
    server, handler, _ = parking_server
    ch = PeerChannel("127.0.0.1", port_of(server))
    slow = asyncio.ensure_future(ch.request(ApiKey.PRODUCE, produce(-1), 100))
    fast = asyncio.ensure_future(ch.request(ApiKey.PRODUCE, produce(1), 5000))
    await wait_for_condition(lambda: len(handler.parked) == 2)
    with pytest.raises(RequestTimeout, match="api key 0 to 127.0.0.1:.*no answer within timeout_ms=100"):
        await slow
    with pytest.raises(ConnectionLost, match="timed out \\(api key 0, timeout_ms=100\\): answers come in order"):
        await fast
    assert not ch.connected
    again = asyncio.ensure_future(ch.request(ApiKey.PRODUCE, produce(2), 5000))
    await wait_for_condition(lambda: len(handler.parked) == 3)
    conn, header, body = handler.parked[2]
    conn.send_response(header.correlation_id, m.ProduceResponse(base_offset=int(values_of(body)[0])))
    assert (await again).base_offset == 2
    assert len(handler.connections) == 2 and ch.connected
    await ch.close()


async def test_overloaded_when_queue_is_full(parking_server):
    server, handler, _ = parking_server
    ch = PeerChannel("127.0.0.1", port_of(server), max_queued_requests=2)
    tasks = [asyncio.ensure_future(ch.request(ApiKey.PRODUCE, produce(i), 5000)) for i in range(2)]
    await wait_for_condition(lambda: len(handler.parked) == 2)
    with pytest.raises(Overloaded, match="2 requests outstanding to .* \\(max_queued_requests=2\\)"):
        await ch.request(ApiKey.PRODUCE, produce(3), 5000)
    for conn, header, _ in handler.parked:
        conn.send_response(header.correlation_id, m.ProduceResponse())
    await asyncio.gather(*tasks)
    # Room again once answered.
    t = asyncio.ensure_future(ch.request(ApiKey.PRODUCE, produce(4), 5000))
    await wait_for_condition(lambda: len(handler.parked) == 3)
    conn, header, _ = handler.parked[2]
    conn.send_response(header.correlation_id, m.ProduceResponse(base_offset=4))
    assert (await t).base_offset == 4
    await ch.close()


async def test_inflight_bound_pauses_reading():
    handler = ParkingHandler()
    server = await serve("127.0.0.1", 0, handler, max_inflight_per_conn=3, logger=ListLogger())
    ch = PeerChannel("127.0.0.1", port_of(server))
    tasks = [asyncio.ensure_future(ch.request(ApiKey.PRODUCE, produce(i), 5000)) for i in range(8)]
    await wait_for_condition(lambda: len(handler.parked) == 3)
    await asyncio.sleep(0.05)  # give a wrongly unbounded server time to dispatch more
    assert len(handler.parked) == 3
    answered = 0
    while answered < 8:
        await wait_for_condition(lambda: len(handler.parked) > answered)
        conn, header, body = handler.parked[answered]
        assert len(handler.parked) - answered <= 3  # never more than the bound read and unanswered
        conn.send_response(header.correlation_id, m.ProduceResponse(base_offset=int(values_of(body)[0])))
        answered += 1
    assert [r.base_offset for r in await asyncio.gather(*tasks)] == list(range(8))
    await ch.close()
    server.close()


async def test_handler_exception_answers_unknown_server_error():
    log = ListLogger()

    def handler(conn, header, body):
        raise RuntimeError("boom")

    server = await serve("127.0.0.1", 0, handler, logger=log)
    ch = PeerChannel("127.0.0.1", port_of(server))
    resp = await ch.request(ApiKey.DESCRIBE_QUORUM, m.DescribeQuorumRequest(), 5000)
    assert resp.error_code == Errors.UNKNOWN_SERVER_ERROR  # Kafka's error answer, on a connection that goes on
    assert log.named("handler_failed")[0]["error"] == "RuntimeError('boom')"
    assert (await ch.request(ApiKey.DESCRIBE_QUORUM, m.DescribeQuorumRequest(), 5000)).error_code == \
        Errors.UNKNOWN_SERVER_ERROR and ch.connected
    await ch.close()
    server.close()


async def test_async_handler_is_run_as_task():
    async def handler(conn, header, body):
        await asyncio.sleep(0)
        conn.send_response(header.correlation_id, m.MetadataResponse(leader_id=header.correlation_id))

    server = await serve("127.0.0.1", 0, handler, logger=ListLogger())
    ch = PeerChannel("127.0.0.1", port_of(server))
    results = await asyncio.gather(*(ch.request(ApiKey.METADATA, m.MetadataRequest(), 5000) for _ in range(5)))
    assert sorted(r.leader_id for r in results) == [1, 2, 3, 4, 5]
    await ch.close()
    server.close()


async def test_server_killed_then_restarted():
    proc, port = await start_server_process()
    ch = PeerChannel("127.0.0.1", port, reconnect_backoff_ms=20, reconnect_backoff_max_ms=100)
    try:
        first = await ch.request(ApiKey.METADATA, m.MetadataRequest(), 5000)
        assert first.leader_id == proc.pid
        parked = [asyncio.ensure_future(ch.request(ApiKey.DESCRIBE_QUORUM, m.DescribeQuorumRequest(), 10_000))
                  for _ in range(3)]
        await asyncio.sleep(0)
        proc.kill()
        await proc.wait()
        for t in parked:
            with pytest.raises(ConnectionLost, match="connection to 127.0.0.1:.* lost"):
                await t
        # Nothing listens now: connecting fails fast with ConnectionLost.
        with pytest.raises(ConnectionLost, match="cannot connect to 127.0.0.1"):
            await ch.request(ApiKey.METADATA, m.MetadataRequest(), 5000)
        proc, port2 = await start_server_process(port)
        assert port2 == port
        again = await ch.request(ApiKey.METADATA, m.MetadataRequest(), 5000)
        assert again.leader_id == proc.pid
    finally:
        await ch.close()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_peer_pool():
    handler = ParkingHandler()
    s1 = await serve("127.0.0.1", 0, lambda c, h, b: c.send_response(h.correlation_id, m.MetadataResponse(leader_id=1)))
    s2 = await serve("127.0.0.1", 0, lambda c, h, b: c.send_response(h.correlation_id, m.MetadataResponse(leader_id=2)))
    pool = PeerPool({1: ("127.0.0.1", port_of(s1)), 2: ("127.0.0.1", port_of(s2))}, client_id="pool")
    assert pool.channel(1) is pool.channel(1)
    for node in (1, 2):
        resp = await pool.channel(node).request(ApiKey.METADATA, m.MetadataRequest(), 5000)
        assert resp.leader_id == node
    with pytest.raises(KeyError, match=r"unknown node id 3 \(known: \[1, 2\]\)"):
        pool.channel(3)
    await pool.close()
    s1.close()
    s2.close()
    del handler


async def test_a_forward_lane_request_outlives_a_timeout_on_the_quorum_lane(parking_server):
    """The pool's lanes are separate connections to the same node: a quorum
    request timing out closes its own connection only, and the forwarded
    request parked at the node (as a command waits for its commit) is
    still answered on the forward lane."""
    server, handler, _ = parking_server
    pool = PeerPool({1: ("127.0.0.1", port_of(server))}, client_id="pool")
    assert pool.channel(1, FORWARD_LANE) is not pool.channel(1)
    forwarded = asyncio.ensure_future(pool.channel(1, FORWARD_LANE).request(ApiKey.PRODUCE, produce(7), 10_000))
    fetch = asyncio.ensure_future(pool.channel(1).request(ApiKey.PRODUCE, produce(-1), 100))
    await wait_for_condition(lambda: len(handler.parked) == 2, what="both requests parked")
    assert len(handler.connections) == 2
    with pytest.raises(RequestTimeout):
        await fetch
    assert not pool.channel(1).connected and pool.channel(1, FORWARD_LANE).connected
    conn, header, body = next(p for p in handler.parked if values_of(p[2]) == [b"7"])
    conn.send_response(header.correlation_id, m.ProduceResponse(base_offset=7))
    assert (await forwarded).base_offset == 7
    await pool.close()


# --------------------------------------------------------------------------
# Bad input on a live server


@pytest.fixture
async def answering_server():
    log = ListLogger()

    def handler(conn, header, body):
        conn.send_response(header.correlation_id, m.MetadataResponse(leader_id=7))

    server = await serve("127.0.0.1", 0, handler, max_frame_bytes=1024, logger=log)
    yield server, log
    server.close()


@pytest.mark.parametrize(
    "garbage, event, detail",
    [
        (b"\xff\xff\xff\xf0junk", "bad_frame", "negative frame length -16"),
        (struct.pack(">i", 5000), "bad_frame", "peer announced a frame of 5000 bytes, above max_frame_bytes=1024"),
        (struct.pack(">i", 3) + b"abc", "bad_header", "a request header takes at least 10 bytes, the frame has 3"),
    ],
)
async def test_garbage_peer_is_closed_and_others_unaffected(answering_server, garbage, event, detail):
    server, log = answering_server
    good = PeerChannel("127.0.0.1", port_of(server))
    assert (await good.request(ApiKey.METADATA, m.MetadataRequest(), 5000)).leader_id == 7
    reader, writer = await open_raw(port_of(server))
    writer.write(garbage)
    assert await read_eof(reader) == b""  # closed without an answer
    writer.close()
    assert log.named(event)[0]["detail"] == detail
    assert log.named(event)[0]["action"] == "close"
    assert (await good.request(ApiKey.METADATA, m.MetadataRequest(), 5000)).leader_id == 7
    assert good.connected
    await good.close()


@pytest.mark.parametrize(
    "frame, answer_version, code",
    [
        # ApiVersions v9: Kafka's fallback, a v0 answer with UNSUPPORTED_VERSION (and our ranges)
        (struct.pack(">hhih", 18, 9, 41, -1), 0, Errors.UNSUPPORTED_VERSION),
        (struct.pack(">hhih", 52, 2, 41, -1) + b"\x00\x05", 2, Errors.INVALID_REQUEST),  # Vote v2, truncated body
    ],
)
async def test_readable_header_gets_error_answer_and_connection_stays(answering_server, frame, answer_version, code):
    server, log = answering_server
    reader, writer = await open_raw(port_of(server))
    writer.write(struct.pack(">i", len(frame)) + frame)
    # then a good request on the same connection
    writer.write(wire.encode_request(wire.RequestHeader(3, 12, 42, None), km.MetadataRequest(topics=None)))
    dec = FrameDecoder(1 << 20)
    frames = []
    async with asyncio.timeout(5):
        while len(frames) < 2:
            dec.feed(await reader.read(4096))
            while (f := dec.next_frame()) is not NEED_DATA:
                frames.append(f)
    assert response_correlation_id(frames[0]) == 41
    _, err = wire.decode_response(frames[0], struct.unpack(">h", frame[:2])[0], answer_version)
    assert err.error_code == code
    _, md = wire.decode_response(frames[1], 3, 12)
    assert response_correlation_id(frames[1]) == 42 and md.topics[0].partitions[0].leader_id == 7
    assert log.named("bad_request")[0]["correlation_id"] == 41
    writer.close()


def test_works_on_uvloop():
    async def main():
        handler = ParkingHandler()
        server = await serve("127.0.0.1", 0, handler, logger=ListLogger())
        ch = PeerChannel("127.0.0.1", port_of(server))
        tasks = [asyncio.ensure_future(ch.request(ApiKey.PRODUCE, produce(i), 5000)) for i in range(10)]
        await wait_for_condition(lambda: len(handler.parked) == 10)
        for conn, header, body in reversed(handler.parked):
            conn.send_response(header.correlation_id, m.ProduceResponse(base_offset=int(values_of(body)[0])))
        results = await asyncio.gather(*tasks)
        slow = ch.request(ApiKey.PRODUCE, produce(99), 50)
        with pytest.raises(RequestTimeout):
            await slow
        await ch.close()
        server.close()
        return [r.base_offset for r in results], type(asyncio.get_running_loop())

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        offsets, loop_type = runner.run(main())
    assert loop_type is uvloop.Loop
    assert offsets == list(range(10))


async def test_request_now_writes_at_once_and_answers_in_the_turn_that_reads(parking_server):
    """On a live connection request_now puts the request on the wire before it
    returns (a follower's next Fetch is not a loop turn late) and hands the
    answer to its callback from the read itself, with no task between; the
    slot is freed first. A timeout reaches the callback as an error, a loop
    turn after the timer, and closes the connection (answers come in order).
    Without a connection it refuses and writes nothing: the caller uses
    request(), which connects."""
    server, handler, _ = parking_server
    fresh = PeerChannel("127.0.0.1", port_of(server))
    assert not fresh.request_now(ApiKey.PRODUCE, produce(8), 5000, lambda body, exc: None)
    assert fresh.outstanding == 0
    await fresh.close()

    ch = PeerChannel("127.0.0.1", port_of(server), client_id="t")
    first = asyncio.ensure_future(ch.request(ApiKey.PRODUCE, produce(0), 5000))  # connects
    await wait_for_condition(lambda: len(handler.parked) == 1, what="the first request")
    conn, header, _ = handler.parked[0]
    conn.send_response(header.correlation_id, m.ProduceResponse(base_offset=0))
    assert (await first).base_offset == 0

    answers: list[tuple[Any, Any, int]] = []
    assert ch.request_now(ApiKey.PRODUCE, produce(7), 5000,
                          lambda body, exc: answers.append((body, exc, ch.outstanding)))
    assert ch.outstanding == 1 and answers == []  # written and waiting
    await wait_for_condition(lambda: len(handler.parked) == 2, what="the request to arrive")
    conn, header, body = handler.parked[1]
    assert values_of(body) == [b"7"]
    conn.send_response(header.correlation_id, m.ProduceResponse(base_offset=7))
    await wait_for_condition(lambda: answers, what="the callback")
    (resp, exc, outstanding), = answers
    assert resp.base_offset == 7 and exc is None and outstanding == 0

    answers.clear()
    assert ch.request_now(ApiKey.PRODUCE, produce(9), 50, lambda body, exc: answers.append((body, exc, 0)))
    await wait_for_condition(lambda: answers, what="the timeout")
    (resp, exc, _), = answers
    assert resp is None and isinstance(exc, RequestTimeout) and "no answer within timeout_ms=50" in str(exc)
    assert ch.outstanding == 0 and not ch.connected  # the connection closed behind it
    await ch.close()
