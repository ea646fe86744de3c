"""The client's apis in Kafka's protocol, judged by kio and by our own server.

* The exact frame ``metalog.protocol.kafka.edge`` sends for each flat request
  of our client is read by kio (header and body): Kafka's message at
  Kafka's version (the extensions, which kio does not know, by our codec).
* Each request goes through a real ``KafkaDispatch`` on a TCP listener (the
  handlers of cluster.py, data.py, admin.py, extensions.py) to a stand-in
  router: the router sees the flat request the client meant, and what the
  client reads back is the router's flat answer, except where Kafka's
  message cannot carry a field (said per case).
* kio's encoding of the server's answer decodes, through the edge, to the
  same flat answer: we read Kafka's bytes, not only our own.
"""

from __future__ import annotations

import asyncio
import struct
from types import SimpleNamespace

import pytest
from kio.serial import entity_reader

from metalog.broker.net.kafka_conn import serve_kafka
from metalog.broker.server.kafka.dispatch import KafkaDispatch
from metalog.broker.server.produce import PrebuiltProduce
from metalog.protocol import messages as m
from metalog.protocol.kafka import edge, edge_client
from metalog.protocol.kafka import messages as km
from metalog.protocol.kafka import wire
from metalog.storage.batch import decode_full_records, decode_header
from tests.net.helpers import ListLogger
from tests.protocol.kafka.kio_bridge import kio_class, kio_encode, to_ours

DIR = "AAECAwQFBgcICQoLDA0ODw"  # a directory id: Kafka's text form of bytes 0..15
LEADER = m.LeaderIdAndEpoch(2, 7)
ENDPOINTS = {1: ("h1", 9091), 2: ("h2", 9092), 3: ("h3", 9093), 4: ("h4", 9094)}
LISTENERS = [m.RaftListener("CONTROLLER", "h4", 9094)]


def _describe_quorum_answer() -> m.DescribeQuorumResponse:
    # the leader's own entry: its "now" (the server turns ages into wall-clock times)
    return m.DescribeQuorumResponse(
        leader_id=2, leader_epoch=7, high_watermark=40,
        voters=[m.ReplicaState(2, 41, 5000, 5000, True, DIR), m.ReplicaState(1, 40, 4900, 4800, True)],
        observers=[m.ReplicaState(4, 12, 4000, -1, False)],
        nodes=[m.DescribeQuorumNode(2, [m.RaftListener("CONTROLLER", "h2", 9092)])])


# (flat request, the router's flat answer, what the client reads back: None = the router's answer)
CASES = [
    (m.ApiVersionsRequest(),
     m.ApiVersionsResponse(supported_features=[m.SupportedFeature("kraft.version", 0, 1)],
                           finalized_features_epoch=12, finalized_features=[m.FinalizedFeature("kraft.version", 1, 1)]),
     "api_versions"),
    (m.MetadataRequest(),
     m.MetadataResponse(cluster_id="c1", node_id=3, leader_id=2, leader_epoch=7, high_watermark=40,
                        log_start_offset=0, voters=[m.NodeEndpoint(n, "x", 1) for n in (1, 2, 3)]),
     # Kafka's Metadata: endpoints of the listener, no high watermark, log start or answering node
     m.MetadataResponse(cluster_id="c1", leader_id=2, leader_epoch=7,
                        voters=[m.NodeEndpoint(n, *ENDPOINTS[n]) for n in (1, 2, 3)],
                        observers=[m.NodeEndpoint(4, *ENDPOINTS[4])])),
    (m.ProduceRequest(cluster_id="c1", records=[b"a", b"bb" * 300], timeout_ms=900, producer_id=77,
                      producer_epoch=3, base_sequence=10),
     m.ProduceResponse(base_offset=40, leader_epoch=7),
     m.ProduceResponse(base_offset=40)),  # Kafka's answer has no epoch: the client fills it in
    (m.ProduceRequest(cluster_id="c1", records=[b"x"]),
     m.ProduceResponse(error_code=6, current_leader=LEADER, error_message="not the leader"),
     None),
    (m.ListOffsetsRequest(cluster_id="c1", current_leader_epoch=7, timestamp_ms=m.LIST_OFFSETS_LATEST),
     m.ListOffsetsResponse(offset=40, timestamp_ms=-1, leader_epoch=7), None),
    (m.ListOffsetsRequest(cluster_id="c1", current_leader_epoch=9, timestamp_ms=m.LIST_OFFSETS_EARLIEST),
     m.ListOffsetsResponse(error_code=75, current_leader=LEADER),
     m.ListOffsetsResponse(error_code=75)),  # Kafka's ListOffsets carries no leader hint
    (m.InitProducerIdRequest(cluster_id="c1"), m.InitProducerIdResponse(producer_id=1 << 40, producer_epoch=0),
     None),
    (m.InitProducerIdRequest(cluster_id="c1"), m.InitProducerIdResponse(error_code=6, current_leader=LEADER),
     m.InitProducerIdResponse(error_code=15)),  # COORDINATOR_NOT_AVAILABLE, as Kafka's follower says
    (m.DescribeQuorumRequest(), _describe_quorum_answer(), "describe_quorum"),
    (m.AddRaftVoterRequest(cluster_id="c1", voter_id=4, voter_directory_id=DIR, listeners=LISTENERS,
                           timeout_ms=2500),
     m.AddRaftVoterResponse(error_code=126, error_message="already a voter"), None),
    (m.RemoveRaftVoterRequest(cluster_id="c1", voter_id=4, voter_directory_id=DIR),
     m.RemoveRaftVoterResponse(), None),
    (m.UpdateFeaturesRequest(cluster_id="c1", feature_updates=[m.FeatureUpdate("kraft.version", 1)],
                             timeout_ms=3000, validate_only=True),
     m.UpdateFeaturesResponse(error_code=95, error_message="no", results=[m.UpdatableFeatureResult(
         "kraft.version", 95, "no")]), None),
    (m.ControllerCommandRequest(cluster_id="c1", command="create_topic",
                                args={"name": "t", "partitions": 3, "validate_only": False}, timeout_ms=4000),
     m.ControllerCommandResponse(base_offset=41, leader_epoch=7), None),
    (m.ControllerCommandRequest(cluster_id="c1", command="list_acls", args={}),
     m.ControllerCommandResponse(result={"acls": [{"principal": "User:a", "id": 1}], "next": None}), None),
    (m.ConsistencyCheckRequest(cluster_id="c1", leader_id=2, leader_epoch=7, start_offset=0, end_offset=40,
                               chunks=2),
     m.ConsistencyCheckResponse(start_offset=0, end_offset=40, chunks=[
         m.ConsistencyChunk(0, 20, 0xFFFFFFFF), m.ConsistencyChunk(20, 40, 7)]), None),
]
IDS = [f"{type(req).__name__}-{i}" for i, (req, _, _) in enumerate(CASES)]


def _kio_read(cls, frame: bytes, pos: int):
    entity, size = entity_reader(cls)(frame, pos)
    return entity, pos + size


@pytest.mark.parametrize("request_body,_answer,_read", CASES, ids=IDS)
def test_the_frames_our_client_sends_are_kafkas(request_body, _answer, _read, monkeypatch):
    # A Produce's batch carries the wall clock's ms, and this builds the request twice
    # (the frame, then `meant`): one clock for both, or a tick between them differs.
    monkeypatch.setattr(edge_client, "time", SimpleNamespace(time=lambda: 1_764_000_000.123))
    e, frame = edge.encode_request(request_body, 4242, "metalog-client")
    assert struct.unpack_from(">i", frame)[0] == len(frame) - 4
    meant = e.request_to_kafka(request_body)
    if e.api_key in km.METALOG_API_KEYS:  # kio knows Kafka's apis only: our codec reads ours
        header, body = wire.decode_request(frame[4:], {e.api_key: (e.version, e.version)})
        assert (header.api_key, header.api_version, header.correlation_id) == (e.api_key, e.version, 4242)
        assert body == meant
        return
    cls = kio_class(km.REQUESTS[e.api_key], e.version)
    header, pos = _kio_read(cls.__header_schema__, frame, 4)
    body, pos = _kio_read(cls, frame, pos)
    assert pos == len(frame), f"{len(frame) - pos} bytes left after kio's read"
    assert (header.request_api_key, header.request_api_version, header.correlation_id, header.client_id) == (
        e.api_key, e.version, 4242, "metalog-client")
    assert to_ours(body, km.REQUESTS[e.api_key]) == type(meant).decode(meant.encode(e.version), e.version)


def test_a_produce_carries_one_record_batch_v2_with_the_producer_fields():
    request = CASES[2][0]
    body = edge.edge_for(request).request_to_kafka(request)
    (topic,) = body.topic_data
    (part,) = topic.partition_data
    assert (body.acks, body.timeout_ms, topic.name, part.index) == (-1, 900, "__cluster_metadata", 0)
    h = decode_header(part.records)
    assert h.size == len(part.records) and (h.producer_id, h.producer_epoch, h.base_sequence) == (77, 3, 10)
    assert [r.value for r in decode_full_records(part.records)] == request.records


class _Router:
    """Stands in for the RequestRouter: records each flat request, answers the case's flat response."""

    def __init__(self):
        self.asked = []
        self.answer = None

    def on_request(self, conn, header, body):
        self.asked.append(body)
        conn.send_response(header.correlation_id, self.answer)


@pytest.fixture
async def served():
    router = _Router()
    forwarded = []

    async def ask_node(node_id, api_key, body):
        forwarded.append((node_id, body))
        return m.ControllerCommandResponse(base_offset=99, leader_epoch=7)

    core = SimpleNamespace(voter_set=SimpleNamespace(endpoints={}), voters=[1, 2, 3])
    dispatch = KafkaDispatch(router, node_id=3, cluster_id="c1", listener_name="CONTROLLER",
                             static_endpoints=ENDPOINTS, core=core, logger=ListLogger(), ask_node=ask_node)
    server = await serve_kafka("127.0.0.1", 0, dispatch, dispatch.supported(), logger=ListLogger())
    reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    yield SimpleNamespace(router=router, reader=reader, writer=writer, forwarded=forwarded)
    writer.close()
    server.close()


async def _exchange(s, frame: bytes) -> bytes:
    s.writer.write(frame)
    (size,) = struct.unpack(">i", await asyncio.wait_for(s.reader.readexactly(4), 10))
    return await asyncio.wait_for(s.reader.readexactly(size), 10)


def _as_sent(router_saw):
    """The router's request as the flat request a client could have sent (a produce arrives as built)."""
    if isinstance(router_saw, PrebuiltProduce):
        h = decode_header(router_saw.batch)
        return [r.value for r in decode_full_records(bytes(router_saw.batch))], (
            h.producer_id, h.producer_epoch, h.base_sequence)
    return router_saw


def _check_special(kind: str, answer, got) -> None:
    if kind == "api_versions":  # our served table and features, not the router's
        ranges = {k.api_key: (k.min_version, k.max_version) for k in got.api_keys}
        assert got.error_code == 0 and ranges[18] == (0, 4) and ranges[1000] == ranges[1001] == (0, 0)
        assert got.finalized_features == answer.finalized_features
        assert got.finalized_features_epoch == 12
        assert {f.name for f in got.supported_features} == {"kraft.version", "metadata.version"}
        return
    # describe_quorum: wall-clock times, the same differences; no in_sync in Kafka's message
    leader = got.voters[0]
    assert leader.last_fetch_timestamp_ms - got.voters[1].last_caught_up_timestamp_ms == 200
    assert got.observers[0].last_caught_up_timestamp_ms == -1
    assert [(r.replica_id, r.log_end_offset, r.replica_directory_id) for r in got.voters + got.observers] == [
        (2, 41, DIR), (1, 40, ""), (4, 12, "")]
    assert (got.leader_id, got.leader_epoch, got.high_watermark) == (2, 7, 40)
    assert [n.node_id for n in got.nodes] == [2] and got.nodes[0].listeners[0] == m.RaftListener(
        "CONTROLLER", "h2", 9092)


@pytest.mark.parametrize("request_body,answer,read", CASES, ids=IDS)
async def test_our_server_answers_what_the_client_reads(served, request_body, answer, read):
    served.router.answer = answer
    e, frame = edge.encode_request(request_body, 77, "metalog-client")
    response = await _exchange(served, frame)
    got = edge.decode_response(e, response)
    saw = served.router.asked[-1]
    if isinstance(request_body, m.ProduceRequest):
        assert _as_sent(saw) == (request_body.records, (request_body.producer_id, request_body.producer_epoch,
                                                        request_body.base_sequence))
    elif isinstance(request_body, (m.AddRaftVoterRequest, m.ControllerCommandRequest, m.ConsistencyCheckRequest,
                                   m.ListOffsetsRequest, m.UpdateFeaturesRequest)):
        assert saw == request_body  # every field the client meant reached the router
    elif isinstance(request_body, m.RemoveRaftVoterRequest):
        assert (saw.voter_id, saw.voter_directory_id) == (4, DIR)  # Kafka's has no timeout: the server's
    if isinstance(read, str):
        _check_special(read, answer, got)
    else:
        assert got == (answer if read is None else read)
    if e.api_key not in km.METALOG_API_KEYS:  # kio's encoding of the same answer reads the same
        cls = kio_class(km.RESPONSES[e.api_key], e.version)
        header, pos = _kio_read(cls.__header_schema__, response, 0)
        body, pos = _kio_read(cls, response, pos)
        assert pos == len(response)
        again = response[:len(response) - len(kio_encode(body))] + kio_encode(body)
        assert edge.decode_response(e, again) == got


async def test_a_follower_forwards_a_command_once_with_its_clients_identity(served):
    served.router.answer = m.ControllerCommandResponse(error_code=6, current_leader=LEADER)
    request = CASES[12][0]
    e, frame = edge.encode_request(request, 5, None)
    got = edge.decode_response(e, await _exchange(served, frame))
    assert got == m.ControllerCommandResponse(base_offset=99, leader_epoch=7)  # the leader's answer
    ((node, body),) = served.forwarded
    assert node == 2 and body.args["forwarded_for"]["principal"] == "User:ANONYMOUS"
    assert {k: v for k, v in body.args.items() if k != "forwarded_for"} == request.args
    # a command forwarded to us is not forwarded again: the forwarder gets our answer
    again = m.ControllerCommandRequest(cluster_id="c1", command="create_topic", args=body.args)
    e, frame = edge.encode_request(again, 6, None)
    assert edge.decode_response(e, await _exchange(served, frame)) == served.router.answer
    assert len(served.forwarded) == 1
