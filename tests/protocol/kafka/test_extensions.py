"""metalog's extension messages (schemas_metalog/) in the generated codec, and
their bad frames answered with Kafka's error codes by a real listener."""

from __future__ import annotations

import asyncio
import struct
from types import SimpleNamespace

import pytest

from metalog.broker.net.kafka_conn import serve_kafka
from metalog.broker.server.kafka.dispatch import KafkaDispatch
from metalog.protocol import messages as m
from metalog.protocol.kafka import generate
from metalog.protocol.kafka import messages as km
from metalog.protocol.kafka import wire
from tests.net.helpers import ListLogger

EXAMPLES = [
    km.ControllerCommandRequest(cluster_id="c1", command="set_config", args='{"name":"x","value":null}',
                                timeout_ms=7),
    km.ControllerCommandResponse(error_code=6, error_message="not the leader", base_offset=-1, leader_epoch=9,
                                 result='{"acls":[]}', current_leader=km.ControllerCommandResponseLeaderIdAndEpoch(
                                     leader_id=2, leader_epoch=9)),
    km.ControllerCommandResponse(),
    km.ConsistencyCheckRequest(cluster_id="c1", leader_id=1, leader_epoch=3, start_offset=5, end_offset=1 << 40,
                               chunks=64),
    km.ConsistencyCheckResponse(start_offset=5, end_offset=9, chunks=[
        km.ConsistencyCheckResponseConsistencyChunk(start_offset=5, end_offset=9, digest=0xFFFFFFFF)]),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda x: type(x).__name__)
def test_extension_messages_round_trip_through_the_generated_codec(message):
    data = message.encode(0)
    assert type(message).decode(data, 0) == message
    with pytest.raises(km.KafkaDecodeError):
        type(message).decode(data[:-1], 0)


def test_extensions_are_ours_and_keep_out_of_kafkas_keys():
    assert km.METALOG_API_KEYS == {1000, 1001}
    assert km.REQUESTS[1000] is km.ControllerCommandRequest and km.RESPONSES[1001] is km.ConsistencyCheckResponse
    assert "metalog's" in km.ControllerCommandRequest.__doc__
    ours = [msg for msg in generate.load_all() if msg.source == "schemas_metalog"]
    assert sorted(msg.name for msg in ours) == ["ConsistencyCheckRequest", "ConsistencyCheckResponse",
                                                "ControllerCommandRequest", "ControllerCommandResponse"]
    # the current leader is a tagged field: absent (one byte of tags) when unknown
    assert km.ControllerCommandResponse().encode(0)[-1] == 0


def test_an_extension_reusing_a_kafka_key_is_refused(tmp_path):
    (tmp_path / "Bad.json").write_text('{"apiKey": 3, "type": "request", "name": "BadRequest", '
                                       '"validVersions": "0", "flexibleVersions": "0+", "fields": []}')
    with pytest.raises(SystemExit, match="api key 3"):
        generate.load_all((generate.SCHEMA_DIR, tmp_path))


class _Router:
    def __init__(self):
        self.asked = []

    def on_request(self, conn, header, body):
        self.asked.append(body)
        conn.send_response(header.correlation_id, m.ControllerCommandResponse())


def _frame(api_key: int, version: int, corr: int, body: bytes) -> bytes:
    head = struct.pack(">hhih", api_key, version, corr, -1) + b"\x00"  # header v2, null client id, no tags
    return struct.pack(">i", len(head) + len(body)) + head + body


async def test_bad_extension_frames_get_kafkas_error_codes():
    """A truncated body: INVALID_REQUEST (42); args that are not a JSON
    object: INVALID_REQUEST with the reason; the connection goes on and
    nothing reaches the router. A version beyond the schema's: closed, as
    Kafka closes it (its response has no such version to answer with)."""
    router = _Router()
    core = SimpleNamespace(voter_set=SimpleNamespace(endpoints={}), voters=[1])
    dispatch = KafkaDispatch(router, node_id=1, cluster_id="c1", listener_name="CONTROLLER", static_endpoints={},
                             core=core, logger=ListLogger())
    server = await serve_kafka("127.0.0.1", 0, dispatch, dispatch.supported(), logger=ListLogger())
    reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])

    async def exchange(frame: bytes) -> bytes:
        writer.write(frame)
        (size,) = struct.unpack(">i", await asyncio.wait_for(reader.readexactly(4), 10))
        return await asyncio.wait_for(reader.readexactly(size), 10)

    try:
        good = km.ControllerCommandRequest(cluster_id="c1", command="list_acls", args="[1]").encode(0)
        _, resp = wire.decode_response(await exchange(_frame(1000, 0, 1, good[:5])), 1000, 0)
        assert resp.error_code == 42
        _, resp = wire.decode_response(await exchange(_frame(1000, 0, 2, good)), 1000, 0)
        assert (resp.error_code, resp.error_message) == (42, "list_acls: args must be a JSON object, got list")
        check = km.ConsistencyCheckRequest(cluster_id="c1").encode(0)
        _, resp = wire.decode_response(await exchange(_frame(1001, 0, 3, check[:-2])), 1001, 0)
        assert resp.error_code == 42
        assert router.asked == []
        writer.write(_frame(1001, 1, 4, check))  # a version no schema has: no answer Kafka could encode
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, as Kafka closes it
    finally:
        writer.close()
        server.close()
