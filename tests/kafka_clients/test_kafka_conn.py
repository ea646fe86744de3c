"""The Kafka connection alone (metalog.broker.net.kafka_conn), in process over
TCP on 127.0.0.1: answers in request order whatever order the handler
answers in, a bound on requests in flight, acks=0's silence, a handler bug
answered. Requests and answers are written and read with kio's classes."""

from __future__ import annotations

import asyncio
import datetime
import io
import struct

from metalog.broker.net.kafka_conn import serve_kafka
from metalog.protocol.kafka import messages as km
from tests.net.helpers import ListLogger, wait_for_condition

SUPPORTED = {18: (0, 4), 60: (0, 1)}


def _request(body, correlation_id: int) -> bytes:
    from kio.serial import entity_writer

    header_type = type(body).__header_schema__
    buf = io.BytesIO()
    entity_writer(header_type)(buf, header_type(request_api_key=type(body).__api_key__,
                                                request_api_version=type(body).__version__,
                                                correlation_id=correlation_id, client_id="t"))
    entity_writer(type(body))(buf, body)
    return struct.pack(">i", len(buf.getvalue())) + buf.getvalue()


async def _response(reader: asyncio.StreamReader, response_type):
    from kio.serial import entity_reader

    size = struct.unpack(">i", await asyncio.wait_for(reader.readexactly(4), 10))[0]
    frame = await asyncio.wait_for(reader.readexactly(size), 10)
    header, pos = entity_reader(response_type.__header_schema__)(frame, 0)  # (value, bytes read)
    body, size = entity_reader(response_type)(frame, pos)
    pos += size
    assert pos == len(frame), f"{len(frame) - pos} bytes left after the answer"
    return header.correlation_id, body


def _describe_cluster():
    from kio.schema.describe_cluster.v1.request import DescribeClusterRequest

    return DescribeClusterRequest(include_cluster_authorized_operations=False)


class Parking:
    def __init__(self):
        self.parked = []

    def __call__(self, ex):
        self.parked.append(ex)


async def _serve(handler, **kw):
    server = await serve_kafka("127.0.0.1", 0, handler, SUPPORTED, logger=ListLogger(), **kw)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    return server, reader, writer


async def test_answers_leave_in_request_order_and_acks0_sends_nothing():
    from kio.schema.describe_cluster.v1.response import DescribeClusterResponse

    parking = Parking()
    server, reader, writer = await _serve(parking)
    try:
        writer.write(b"".join(_request(_describe_cluster(), 10 + i) for i in range(6)))
        await wait_for_condition(lambda: len(parking.parked) == 6, what="six requests dispatched")
        # Answered last to first; the third is answered with nothing (as Produce acks=0 is).
        for ex in reversed(parking.parked):
            if ex.header.correlation_id == 12:
                ex.respond_nothing()
            else:
                ex.respond(km.DescribeClusterResponse(cluster_id=f"c{ex.header.correlation_id}", endpoint_type=1))
        got = [await _response(reader, DescribeClusterResponse) for _ in range(5)]
    finally:
        writer.close()
        server.close()
    assert [(cid, r.cluster_id) for cid, r in got] == [(c, f"c{c}") for c in (10, 11, 13, 14, 15)]


async def test_reading_stops_at_the_inflight_bound():
    from kio.schema.describe_cluster.v1.response import DescribeClusterResponse

    parking = Parking()
    server, reader, writer = await _serve(parking, max_inflight_per_conn=3)
    try:
        writer.write(b"".join(_request(_describe_cluster(), i) for i in range(8)))
        await wait_for_condition(lambda: len(parking.parked) == 3, what="three requests dispatched")
        await asyncio.sleep(0.1)  # give the connection every chance to read past its bound
        assert len(parking.parked) == 3
        parking.parked[0].respond(km.DescribeClusterResponse(cluster_id="x"))
        await wait_for_condition(lambda: len(parking.parked) == 4, what="one more after one answer")
        for ex in parking.parked[1:]:
            ex.respond(km.DescribeClusterResponse(cluster_id="x"))
        await wait_for_condition(lambda: len(parking.parked) == 7, what="three more")
        for ex in parking.parked[4:]:
            ex.respond(km.DescribeClusterResponse(cluster_id="x"))
        await wait_for_condition(lambda: len(parking.parked) == 8, what="the last")
        parking.parked[7].respond(km.DescribeClusterResponse(cluster_id="x"))
        got = [(await _response(reader, DescribeClusterResponse))[0] for _ in range(8)]
    finally:
        writer.close()
        server.close()
    assert got == list(range(8))


async def test_a_handler_that_raises_is_answered_and_the_connection_goes_on():
    from kio.schema.describe_cluster.v1.response import DescribeClusterResponse

    calls = []

    def handler(ex):
        calls.append(ex.header.correlation_id)
        if ex.header.correlation_id == 1:
            raise RuntimeError("a bug")
        ex.respond(km.DescribeClusterResponse(cluster_id="ok"))

    server, reader, writer = await _serve(handler)
    try:
        writer.write(_request(_describe_cluster(), 1) + _request(_describe_cluster(), 2))
        first = await _response(reader, DescribeClusterResponse)
        second = await _response(reader, DescribeClusterResponse)
    finally:
        writer.close()
        server.close()
    assert (first[0], first[1].error_code) == (1, -1)  # UNKNOWN_SERVER_ERROR
    assert (second[0], second[1].error_code, second[1].cluster_id) == (2, 0, "ok")


async def test_an_unreadable_header_closes_only_that_connection():
    parking = Parking()
    server, reader, writer = await _serve(parking)
    reader2, writer2 = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    try:
        writer.write(struct.pack(">i", 3) + b"\x00\x12\x00")  # three bytes: no correlation id
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed
        writer2.write(_request(_describe_cluster(), 5))
        await wait_for_condition(lambda: len(parking.parked) == 1, what="the other connection's request")
    finally:
        writer.close()
        writer2.close()
        server.close()
    assert parking.parked[0].header.correlation_id == 5


async def test_unserved_apis_and_versions_are_answered_as_kafka_does():
    """Api key 999, and CreateTopics (served by Kafka, not by this table), have
    no error code Kafka could answer with: the connection closes. DescribeCluster
    v2 (in Kafka's schema, above the v1 served here) is answered
    UNSUPPORTED_VERSION, and the connection goes on. One log line each."""
    from kio.schema.create_topics.v7.request import CreateTopicsRequest
    from kio.schema.describe_cluster.v1.response import DescribeClusterResponse
    from kio.schema.describe_cluster.v2.request import DescribeClusterRequest as DescribeClusterV2
    from kio.schema.describe_cluster.v2.response import DescribeClusterResponse as DescribeClusterResponseV2
    from kio.static.primitive import i32Timedelta

    logger = ListLogger()
    parking = Parking()
    server = await serve_kafka("127.0.0.1", 0, parking, SUPPORTED, logger=logger)
    port = server.sockets[0].getsockname()[1]
    try:
        for frame in (struct.pack(">ihhih", 10, 999, 0, 3, 0),  # header v1, empty client id, no body
                      _request(CreateTopicsRequest(topics=(), timeout=i32Timedelta.parse(datetime.timedelta(seconds=1)),
                                                   validate_only=False), 4)):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(frame)
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, nothing answered
            writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_request(DescribeClusterV2(include_cluster_authorized_operations=False,
                                                include_fenced_brokers=False), 5))
        writer.write(_request(_describe_cluster(), 6))
        cid, resp = await _response(reader, DescribeClusterResponseV2)
        assert (cid, resp.error_code) == (5, 35)  # UNSUPPORTED_VERSION
        await wait_for_condition(lambda: len(parking.parked) == 1, what="the v1 request after it")
        parking.parked[0].respond(km.DescribeClusterResponse(cluster_id="still here"))
        cid, resp = await _response(reader, DescribeClusterResponse)
        assert (cid, resp.cluster_id) == (6, "still here")
        writer.close()
    finally:
        server.close()
    assert [kw["api_key"] for level, e, kw in logger.events if e == "bad_request"] == [999, 19, 60]


async def test_a_request_answered_by_closing_closes_after_the_earlier_answers():
    """Kafka closes on an api it cannot answer; the answer to a request before
    it still arrives first, and nothing after it is read."""
    from kio.schema.describe_cluster.v1.response import DescribeClusterResponse

    parking = Parking()
    server, reader, writer = await _serve(parking)
    try:
        writer.write(_request(_describe_cluster(), 1) + struct.pack(">ihhih", 10, 999, 0, 2, 0)
                     + _request(_describe_cluster(), 3))
        await wait_for_condition(lambda: len(parking.parked) == 1, what="the first request")
        await asyncio.sleep(0.05)  # the third is never dispatched: nothing to wait for but time
        assert len(parking.parked) == 1
        parking.parked[0].respond(km.DescribeClusterResponse(cluster_id="first"))
        cid, resp = await _response(reader, DescribeClusterResponse)
        assert (cid, resp.cluster_id) == (1, "first")
        assert await asyncio.wait_for(reader.read(), 10) == b""  # then closed
    finally:
        writer.close()
        server.close()
    assert len(parking.parked) == 1


async def test_a_flood_of_garbage_is_logged_boundedly_with_a_summary_of_the_count():
    """What an operator sees when N connections each send garbage to the Kafka port:
    a few lines per kind of bad input, then one summary line carrying the count."""
    from metalog.broker.net.listener import ListenerLimits

    flood = 40  # connections per kind of garbage
    lines_max = 3
    log = ListLogger()
    # No back-off and no rate per address: every garbage connection is read (the log, not
    # admission, is under test); the interval is long so only close() ends it.
    limits = ListenerLimits(failed_connections_before_backoff=1_000_000, connection_creation_rate_per_ip=0,
                            max_connection_creation_rate=0, refusal_log_lines_max=lines_max,
                            refusal_log_interval_ms=600_000)
    server = await serve_kafka("127.0.0.1", 0, Parking(), SUPPORTED, logger=log, limits=limits,
                               max_frame_bytes=1 << 20)
    port = server.sockets[0].getsockname()[1]
    garbage = {
        "bad_frame": struct.pack(">i", 1 << 30),  # a size past max_frame_bytes
        "bad_header": struct.pack(">i", 3) + b"\x00\x12\x00",  # no correlation id
        "bad_request": struct.pack(">ihhih", 10, 999, 0, 3, 0),  # api 999: Kafka has no answer, closes
    }

    async def send_and_wait_for_close(data: bytes) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(data)
            assert await asyncio.wait_for(reader.read(), 30) == b""  # the broker closed it
        finally:
            writer.close()

    try:
        for data in garbage.values():
            await asyncio.gather(*(send_and_wait_for_close(data) for _ in range(flood)))
        stats = server.listener.stats
        assert {e: stats.failures_total[e] for e in garbage} == {e: flood for e in garbage}
    finally:
        server.close()  # ends the interval: the summaries are written
    for event in garbage:
        assert len(log.named(event)) == lines_max, event  # not one line per connection
        (summary,) = [s for s in log.named("connection_refusals_summary") if s["reason"] == event]
        assert (summary["count"], summary["not_logged"]) == (flood, flood - lines_max)
        assert summary["first_address"] == "127.0.0.1"
    # api 999 is also logged as the close it causes (no_error_answer), bounded the same way
    assert len(log.named("no_error_answer")) == lines_max
    # 120 bad connections, 16 lines in all: nothing else is logged per connection
    assert len(log.events) == (len(garbage) + 1) * (lines_max + 1), [e for _, e, _ in log.events]
