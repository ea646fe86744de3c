"""Kafka brokers' apis at the controller listener: BrokerRegistration and
BrokerHeartbeat mapped to their controller commands and back, and Envelope (api 58)
(metalog.broker.server.kafka.brokers.envelope): who may send one, what a bad
one gets, and that the inner request runs as the forwarded client and its
answer travels back inside the EnvelopeResponse. The handlers are driven
with a recording context; tests/kafka/test_kafka_broker_registers.py has a
real Kafka broker send them."""

from __future__ import annotations

import struct

from metalog.broker.net.kafka_conn import KafkaExchange
from metalog.broker.net.principal import Principal
from metalog.broker.server.kafka import brokers
from metalog.broker.server.kafka.dispatch import served_apis
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.protocol.errors import Errors
from metalog.protocol.kafka import messages as km
from metalog.protocol.kafka import wire
from metalog.protocol.kafka.primitives import write_cstr

SUPPORTED = {key: (api.min_version, api.max_version) for key, api in served_apis().items()}


def principal_data(kind: str, name: str) -> bytes:
    out = bytearray(struct.pack(">h", 0))
    write_cstr(out, kind)
    write_cstr(out, name)
    out += b"\x00\x00"  # TokenAuthenticated false, no tags
    return bytes(out)


class Conn:
    def __init__(self, principal: str):
        self.principal = Principal.parse(principal)
        self.closed = False
        self.peer = self.peer_host = "127.0.0.1"
        self.context = None
        self.sent: list[bytes] = []

    def finish(self, ex, data):
        ex.answer, ex.answered = data, True
        self.sent.append(data)

    def add_close_callback(self, cb):
        pass


class Ctx:
    """A leader's context that records the controller commands asked."""

    cluster_id = "c"
    node_id = 1
    listener_name = "CONTROLLER"

    def __init__(self):
        self.asked = []

    def supported(self):
        return SUPPORTED

    def ask(self, ex, api_key, body, on_answer):
        self.asked.append((ex.conn, api_key, body, on_answer))


def envelope(conn: Conn, inner: bytes, principal: bytes, address: bytes = bytes([10, 0, 0, 7])) -> KafkaExchange:
    body = km.EnvelopeRequest(request_data=inner, request_principal=principal, client_host_address=address)
    return KafkaExchange(conn, wire.RequestHeader(58, 0, 99, "broker-100"), body)


def answer(conn: Conn) -> km.EnvelopeResponse:
    _cid, resp = wire.decode_response(conn.sent[-1][4:], 58, 0)
    return resp


def create_topics(correlation_id: int = 5) -> bytes:
    body = km.CreateTopicsRequest(topics=[km.CreateTopicsRequestCreatableTopic(
        name="orders", num_partitions=2, replication_factor=1)], timeout_ms=5000)
    return wire.encode_request(wire.RequestHeader(19, 7, correlation_id, "adminclient-1"), body)[4:]


def test_the_inner_request_runs_as_the_forwarded_client_and_answers_inside():
    conn, ctx = Conn("Node:100"), Ctx()
    brokers.envelope(ctx, envelope(conn, create_topics(), principal_data("User", "admin")))
    (face_conn, api_key, body, on_answer), = ctx.asked
    assert api_key is ApiKey.CONTROLLER_COMMAND and body.command == "create_topic" and body.args["name"] == "orders"
    # The gate sees the client, from the client's address, not the forwarding broker.
    assert str(face_conn.principal) == "User:admin" and face_conn.peer_host == "10.0.0.7"
    on_answer(m.ControllerCommandResponse(base_offset=12))
    resp = answer(conn)
    assert resp.error_code == Errors.NONE
    cid, inner = wire.decode_response(bytes(resp.response_data), 19, 7)
    assert cid == 5 and [(t.name, t.error_code) for t in inner.topics] == [("orders", Errors.NONE)]


def test_only_a_node_certificate_may_send_one():
    conn, ctx = Conn("User:admin"), Ctx()
    brokers.envelope(ctx, envelope(conn, create_topics(), principal_data("User", "admin")))
    assert answer(conn).error_code == Errors.CLUSTER_AUTHORIZATION_FAILED and not ctx.asked


def test_bad_principal_bad_address_and_unforwardable_requests():
    for principal, address, code in [
        (b"\x00\x01garbage", bytes([10, 0, 0, 7]), Errors.PRINCIPAL_DESERIALIZATION_FAILURE),
        (principal_data("Group", "x"), bytes([10, 0, 0, 7]), Errors.PRINCIPAL_DESERIALIZATION_FAILURE),
        (principal_data("User", "admin"), b"\x01\x02", Errors.PRINCIPAL_DESERIALIZATION_FAILURE),
    ]:
        conn, ctx = Conn("Node:100"), Ctx()
        brokers.envelope(ctx, envelope(conn, create_topics(), principal, address))
        assert answer(conn).error_code == code and not ctx.asked
    # Not an admin api (ApiVersions), and an Envelope inside an Envelope: INVALID_REQUEST.
    versions = wire.encode_request(wire.RequestHeader(18, 3, 1, "x"), km.ApiVersionsRequest())[4:]
    nested = wire.encode_request(wire.RequestHeader(58, 0, 1, "x"), km.EnvelopeRequest())[4:]
    for inner in (versions, nested, b"\x00\x13"):
        conn, ctx = Conn("Node:100"), Ctx()
        brokers.envelope(ctx, envelope(conn, inner, principal_data("User", "admin")))
        assert answer(conn).error_code == Errors.INVALID_REQUEST and not ctx.asked


def test_a_kafka_node_principal_is_our_node_principal():
    assert brokers.forwarded_principal(principal_data("User", "node-7")) == Principal("Node", "7")
    assert brokers.forwarded_principal(principal_data("User", "alice")) == Principal("User", "alice")


def _registration(cluster_id: str = "c") -> km.BrokerRegistrationRequest:
    return km.BrokerRegistrationRequest(
        broker_id=100, cluster_id=cluster_id, incarnation_id=bytes(range(16)),
        listeners=[km.BrokerRegistrationRequestListener(name="SSL", host="h", port=9093, security_protocol=1)],
        features=[km.BrokerRegistrationRequestFeature(name="metadata.version", min_supported_version=7,
                                                      max_supported_version=27)],
        log_dirs=[bytes([9] * 16)])


def _kafka_answer(conn: Conn, api_key: int, version: int):
    return wire.decode_response(conn.sent[-1][4:], api_key, version)[1]


def test_broker_registration_maps_to_the_command_and_back():
    conn, ctx = Conn("Node:100"), Ctx()
    brokers.broker_registration(ctx, KafkaExchange(conn, wire.RequestHeader(62, 4, 3, "b"), _registration()))
    (_face, _key, body, on_answer), = ctx.asked
    assert body.command == "broker_registration" and body.args["listeners"] == [["SSL", "h", 9093, 1]]
    assert body.args["incarnation_id"] == "00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert body.args["features"] == {"metadata.version": [7, 27]}
    on_answer(m.ControllerCommandResponse(result={"broker_epoch": 42}))
    resp = _kafka_answer(conn, 62, 4)
    assert (resp.error_code, resp.broker_epoch) == (Errors.NONE, 42)


def test_registration_of_another_cluster_and_at_a_follower():
    conn, ctx = Conn("Node:100"), Ctx()
    brokers.broker_registration(ctx, KafkaExchange(conn, wire.RequestHeader(62, 4, 3, "b"), _registration("x")))
    assert _kafka_answer(conn, 62, 4).error_code == Errors.INCONSISTENT_CLUSTER_ID and not ctx.asked
    heartbeat = km.BrokerHeartbeatRequest(broker_id=100, broker_epoch=42, current_metadata_offset=50)
    brokers.broker_heartbeat(ctx, KafkaExchange(conn, wire.RequestHeader(63, 2, 4, "b"), heartbeat))
    (_face, _key, body, on_answer), = ctx.asked
    assert body.args == {"broker_id": 100, "broker_epoch": 42, "current_metadata_offset": 50,
                         "want_fence": False, "want_shut_down": False}
    on_answer(m.ControllerCommandResponse(error_code=Errors.NOT_LEADER_OR_FOLLOWER))
    resp = _kafka_answer(conn, 63, 2)
    assert resp.error_code == Errors.NOT_CONTROLLER and resp.is_fenced  # Kafka's broker retries at the leader
