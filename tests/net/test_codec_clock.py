"""metalog.broker.net.codec_clock: with a meter set (the broker's commit trace
does it), both sides of a real connection time every decode and encode of a
Kafka frame by api; with none, nothing is timed."""

from __future__ import annotations

import pytest

from metalog.broker.net import codec_clock
from metalog.broker.net.channel import PeerChannel
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from tests.net.flat_server import serve_flat as serve
from tests.net.flat_server import values_of
from tests.net.helpers import ListLogger


class Recorder:
    def __init__(self) -> None:
        self.samples: list[tuple[str, int, int]] = []

    def codec_sample(self, op: str, api_key: int, ns: int) -> None:
        self.samples.append((op, api_key, ns))


@pytest.fixture
def recorder():
    rec = Recorder()
    codec_clock.set_meter(rec)
    yield rec
    codec_clock.set_meter(None)


async def _produce_twice() -> list[int]:
    def handler(conn, header, body):
        conn.send_response(header.correlation_id, m.ProduceResponse(base_offset=int(values_of(body)[0])))

    server = await serve("127.0.0.1", 0, handler, logger=ListLogger())
    ch = PeerChannel("127.0.0.1", server.sockets[0].getsockname()[1], client_id="t")
    try:
        answers = [await ch.request(ApiKey.PRODUCE, m.ProduceRequest(cluster_id="c", records=[str(i).encode()]), 5000)
                   for i in (7, 8)]
    finally:
        await ch.close()
        server.close()
    return [a.base_offset for a in answers]


async def test_each_decode_and_encode_of_both_sides_is_timed_by_api(recorder):
    assert await _produce_twice() == [7, 8]
    by_op: dict[str, list[int]] = {}
    for op, api_key, ns in recorder.samples:
        assert ns > 0
        by_op.setdefault(op, []).append(api_key)
    # The connection's ApiVersions handshake, if any, is timed too; each of the
    # two Produces is timed once per side and direction.
    for op in (codec_clock.ENCODE_REQUEST, codec_clock.DECODE_REQUEST, codec_clock.ENCODE_RESPONSE,
               codec_clock.DECODE_RESPONSE):
        assert by_op[op].count(ApiKey.PRODUCE) == 2, (op, by_op)


async def test_the_meter_is_read_per_frame_so_unsetting_it_stops_the_timing(recorder):
    """Set, then unset, with the connection open: only the frames while it was set are timed."""
    def handler(conn, header, body):
        conn.send_response(header.correlation_id, m.ProduceResponse(base_offset=int(values_of(body)[0])))

    server = await serve("127.0.0.1", 0, handler, logger=ListLogger())
    ch = PeerChannel("127.0.0.1", server.sockets[0].getsockname()[1], client_id="t")
    try:
        await ch.request(ApiKey.PRODUCE, m.ProduceRequest(cluster_id="c", records=[b"1"]), 5000)
        timed = len(recorder.samples)
        assert timed >= 4
        codec_clock.set_meter(None)
        answer = await ch.request(ApiKey.PRODUCE, m.ProduceRequest(cluster_id="c", records=[b"2"]), 5000)
    finally:
        await ch.close()
        server.close()
    assert answer.base_offset == 2
    assert len(recorder.samples) == timed
