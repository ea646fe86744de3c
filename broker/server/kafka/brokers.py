"""What a Kafka broker (``process.roles=broker``) asks of its controllers
besides its Fetch of the metadata log (issue 32 item 4), served on the
controller listener as a KRaft controller serves them: BrokerRegistration
(api 62), BrokerHeartbeat (api 63), AllocateProducerIds (api 67, a block of
producer ids for its idempotent producers) and the Envelope (api 58,
KIP-590) both ways.

The first three become controller commands (``broker_registration``,
``broker_heartbeat``: ``metalog.broker.controller.brokers`` holds Kafka's
rules; ``allocate_producer_ids``: ``metalog.broker.controller
.producer_blocks``), each run through this node's gate (ClusterAction on the
cluster; a node certificate only for its own broker id) and the leader's command queue,
so its records commit through the quorum like any command's, and its answer
leaves once they are committed. A node that is not the leader answers
NOT_CONTROLLER, as Kafka's controllers do: a broker sends these to the
leader it learnt from the metadata log, never through a forwarder.

The Envelope carries a client's request, its principal and its address from
the node the client asked to the leader: ``envelope`` unwraps one (from a
node certificate only) and runs the admin api inside as that client;
``EnvelopeRequest``/``envelope_of`` are the sending side, with which a node
that is not the leader forwards the quorum's own admin requests
(UpdateFeatures, AddRaftVoter, RemoveRaftVoter) so that the leader judges
the client and not the forwarding node (``admin``).
"""

from __future__ import annotations

import ipaddress
import re
import struct
import uuid
from typing import Any, Callable, cast

from metalog.broker.net.kafka_conn import KafkaExchange
from metalog.broker.net.principal import Principal
from metalog.broker.server.kafka import admin
from metalog.broker.server.kafka.api import KafkaApi, KafkaContext
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.protocol.errors import Errors
from metalog.protocol.kafka import messages as km
from metalog.protocol.kafka import wire
from metalog.protocol.kafka.errors import KafkaDecodeError
from metalog.protocol.kafka.edge import Edge, register
from metalog.protocol.kafka.primitives import read_cstr, write_cstr

REGISTRATION = "broker_registration"
HEARTBEAT = "broker_heartbeat"
ALLOCATE_PRODUCER_IDS = "allocate_producer_ids"
# A registration or heartbeat waits at most this long for its records to commit
# (Kafka brokers time these requests out after their request timeout, 30 s by default).
COMMAND_TIMEOUT_MS = 10_000


def _uuid(raw: bytes) -> str:
    return str(uuid.UUID(bytes=bytes(raw)))


def _code(resp: m.ControllerCommandResponse) -> int:
    """Our leaderless answer as Kafka's controllers give it."""
    return Errors.NOT_CONTROLLER if resp.error_code == Errors.NOT_LEADER_OR_FOLLOWER else resp.error_code


def _ask(ctx: KafkaContext, ex: KafkaExchange, command: str, args: dict[str, Any],
         on_answer: Callable[[m.ControllerCommandResponse], None]) -> None:
    body = m.ControllerCommandRequest(cluster_id=ctx.cluster_id, command=command, args=args,
                                      timeout_ms=COMMAND_TIMEOUT_MS)
    ctx.ask(ex, ApiKey.CONTROLLER_COMMAND, body, on_answer)


def registration_args(req: km.BrokerRegistrationRequest) -> dict[str, Any]:
    """The ``broker_registration`` command's arguments of a Kafka request."""
    return {
        "broker_id": req.broker_id,
        "incarnation_id": _uuid(req.incarnation_id),
        "listeners": [[ls.name, ls.host, ls.port, ls.security_protocol] for ls in req.listeners],
        "features": {f.name: [f.min_supported_version, f.max_supported_version] for f in req.features},
        "rack": req.rack,
        "log_dirs": [_uuid(d) for d in req.log_dirs],
    }


def broker_registration(ctx: KafkaContext, ex: KafkaExchange) -> None:
    req: km.BrokerRegistrationRequest = ex.body
    if req.cluster_id != ctx.cluster_id:
        ex.respond(km.BrokerRegistrationResponse(error_code=Errors.INCONSISTENT_CLUSTER_ID))
        return
    if req.is_migrating_zk_broker:
        ex.respond(km.BrokerRegistrationResponse(error_code=Errors.BROKER_ID_NOT_REGISTERED))
        return

    def answer(resp: m.ControllerCommandResponse) -> None:
        epoch = int(resp.result["broker_epoch"]) if resp.error_code == Errors.NONE and resp.result else -1
        ex.respond(km.BrokerRegistrationResponse(error_code=_code(resp), broker_epoch=epoch))

    _ask(ctx, ex, REGISTRATION, registration_args(req), answer)


def broker_heartbeat(ctx: KafkaContext, ex: KafkaExchange) -> None:
    req: km.BrokerHeartbeatRequest = ex.body
    args = {"broker_id": req.broker_id, "broker_epoch": req.broker_epoch,
            "current_metadata_offset": req.current_metadata_offset, "want_fence": req.want_fence,
            "want_shut_down": req.want_shut_down}

    def answer(resp: m.ControllerCommandResponse) -> None:
        result = resp.result if resp.error_code == Errors.NONE and resp.result else {}
        ex.respond(km.BrokerHeartbeatResponse(
            error_code=_code(resp), is_caught_up=bool(result.get("is_caught_up", False)),
            is_fenced=bool(result.get("is_fenced", True)), should_shut_down=bool(result.get("should_shut_down"))))

    _ask(ctx, ex, HEARTBEAT, args, answer)


def allocate_producer_ids(ctx: KafkaContext, ex: KafkaExchange) -> None:
    """AllocateProducerIds (api 67): a block of producer ids for the asking
    broker's idempotent producers, committed as a ProducerIdsRecord before
    the answer (``metalog.broker.controller.producer_blocks``)."""
    req: km.AllocateProducerIdsRequest = ex.body

    def answer(resp: m.ControllerCommandResponse) -> None:
        result = resp.result if resp.error_code == Errors.NONE and resp.result else {}
        ex.respond(km.AllocateProducerIdsResponse(
            error_code=_code(resp), producer_id_start=int(result.get("producer_id_start", -1)),
            producer_id_len=int(result.get("producer_id_len", 0))))

    _ask(ctx, ex, ALLOCATE_PRODUCER_IDS, {"broker_id": req.broker_id, "broker_epoch": req.broker_epoch}, answer)


# --------------------------------------------------------------------- Envelope
_NODE_USER = re.compile(r"node-(\d+)")


def forwarded_principal(raw: bytes) -> Principal:
    """DefaultPrincipalData v0 after its int16 version: Type, Name (compact
    strings), TokenAuthenticated, tags. ValueError if it is not one we know."""
    buf = memoryview(raw)
    (version,) = struct.unpack_from(">h", buf, 0)
    if version != 0:
        raise ValueError(f"DefaultPrincipalData version {version}")
    kind, pos = read_cstr(buf, 2)
    name, pos = read_cstr(buf, pos)
    node = _NODE_USER.fullmatch(name)
    if kind == "User" and node is not None:
        return Principal("Node", str(int(node.group(1))))
    return Principal.parse(f"{kind}:{name}")


def principal_data(principal: Principal) -> bytes:
    """``forwarded_principal``'s inverse: Kafka's DefaultPrincipalData v0, a
    node as Kafka names it (User:node-N), not token-authenticated, no tags."""
    node = principal.node_id
    kind, name = ("User", f"node-{node}") if node is not None else (principal.kind, principal.name)
    out = bytearray(struct.pack(">h", 0))
    write_cstr(out, kind)
    write_cstr(out, name)
    out += b"\x00\x00"  # TokenAuthenticated false, no tagged fields
    return bytes(out)


class EnvelopeRequest(m.Body, frozen=True):
    """The sending side's flat Envelope: the inner request frame (no length
    prefix), the client's DefaultPrincipalData and its address's bytes."""

    request_data: bytes
    request_principal: bytes
    client_host_address: bytes


class EnvelopeResponse(m.Body, frozen=True):
    error_code: int = 0
    response_data: bytes | None = None  # the inner response frame, no length prefix


def _envelope_to_kafka(body: m.Body) -> km.EnvelopeRequest:
    b = cast(EnvelopeRequest, body)  # the edge of EnvelopeRequest is given nothing else
    return km.EnvelopeRequest(request_data=b.request_data, request_principal=b.request_principal,
                              client_host_address=b.client_host_address)


def _envelope_from_kafka(resp: Any, version: int) -> m.Body:
    data = resp.response_data
    return EnvelopeResponse(error_code=resp.error_code, response_data=None if data is None else bytes(data))


register(EnvelopeRequest, Edge(km.EnvelopeRequest.API_KEY, 0, _envelope_to_kafka, _envelope_from_kafka))


def envelope_of(ex: KafkaExchange) -> EnvelopeRequest:
    """``ex``'s request as the client sent it (re-encoded at its version, its
    own correlation id kept), wrapped for the leader with its principal and
    host. ValueError if the client's address is not an IP address (the
    leader's ACLs may name hosts: never forward it as some other address)."""
    frame = wire.encode_request(ex.header, ex.body)
    return EnvelopeRequest(request_data=frame[4:], request_principal=principal_data(ex.conn.principal),
                           client_host_address=ipaddress.ip_address(ex.conn.peer_host).packed)


def is_forwarded(ex: KafkaExchange) -> bool:
    """Whether ``ex`` came inside an Envelope (never to be forwarded again)."""
    return isinstance(ex.conn, _Forwarded)


class _Forwarded:
    """The client's connection, as the inner request's handler and the gate see
    it: the forwarded principal and address; its one answer goes back inside
    the envelope's."""

    def __init__(self, outer: KafkaExchange, principal: Principal, host: str):
        self._outer = outer
        self.principal = principal
        self.peer_host = host
        self.peer = f"{host}:0"
        self.context: Any = None

    @property
    def closed(self) -> bool:
        return bool(self._outer.conn.closed)

    def add_close_callback(self, cb: Callable[[Any], None]) -> None:
        self._outer.conn.add_close_callback(lambda _conn: cb(self))

    def finish(self, inner: KafkaExchange, data: bytes) -> None:
        inner.answer, inner.answered = data, True
        if self._outer.answered:
            return
        if data:  # a whole frame: its length prefix off, the response header and body in
            self._outer.respond(km.EnvelopeResponse(response_data=data[4:]))
        else:  # Kafka would close the client's connection: the forwarding broker gets the error
            self._outer.respond(km.EnvelopeResponse(error_code=inner.close_after or Errors.INVALID_REQUEST))


def envelope(ctx: KafkaContext, ex: KafkaExchange) -> None:
    req: km.EnvelopeRequest = ex.body
    if ex.conn.principal.node_id is None:
        ex.respond(km.EnvelopeResponse(error_code=Errors.CLUSTER_AUTHORIZATION_FAILED))
        return
    try:
        principal = forwarded_principal(bytes(req.request_principal or b""))
        host = str(ipaddress.ip_address(bytes(req.client_host_address)))
    except (ValueError, struct.error, KafkaDecodeError, IndexError):
        ex.respond(km.EnvelopeResponse(error_code=Errors.PRINCIPAL_DESERIALIZATION_FAILURE))
        return
    try:
        header, body = wire.decode_request(req.request_data, ctx.supported())
    except KafkaDecodeError:
        ex.respond(km.EnvelopeResponse(error_code=Errors.INVALID_REQUEST))
        return
    api = admin.APIS.get(header.api_key)
    if api is None:  # only what a broker forwards; never an Envelope in an Envelope
        ex.respond(km.EnvelopeResponse(error_code=Errors.INVALID_REQUEST))
        return
    api.handle(ctx, KafkaExchange(_Forwarded(ex, principal, host), header, body))  # type: ignore[arg-type]


APIS: dict[int, KafkaApi] = {
    km.EnvelopeRequest.API_KEY: KafkaApi(km.EnvelopeRequest, 0, 0, envelope),
    km.BrokerRegistrationRequest.API_KEY: KafkaApi(km.BrokerRegistrationRequest, 0, 4, broker_registration),
    km.BrokerHeartbeatRequest.API_KEY: KafkaApi(km.BrokerHeartbeatRequest, 0, 2, broker_heartbeat),
    km.AllocateProducerIdsRequest.API_KEY: KafkaApi(km.AllocateProducerIdsRequest, 0, 0, allocate_producer_ids),
}
