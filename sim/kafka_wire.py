"""The simulator's peer messages through Kafka's wire, as the brokers send them.

The brokers' cores talk in flat bodies (``metalog.protocol.messages``); on
the network every one of them is a Kafka request or response (issue 32):
the sender maps it with ``metalog.protocol.kafka.edge`` (flat -> Kafka's
message -> bytes), the receiver's controller listener decodes the frame and
its handler (``metalog.broker.server.kafka``: the same ``served_apis`` table
and functions the brokers run) maps it back onto a flat body for its core;
the answer goes the same way back. With ``SimConfig.kafka_wire`` every
message between simulated nodes takes that path, so the seeds exercise the
mapping (pre-vote epochs, directory ids, top-level errors, diverging epochs,
snapshot ids, the voter set's endpoints) under every schedule the simulator
draws, not only the cases the edge's unit tests name. A message the mapping
cannot carry, or maps to something else, is a failure of the run.

Only what a handler uses of its listener is simulated here (``_Context``):
no gate (the simulator's nodes are who they say), no sockets, no forwarding
(the quorum's apis are never forwarded). Each mapping is deterministic, so
a seed replays as before.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from metalog.broker.server.kafka.api import CONTROLLER_LISTENER
from metalog.broker.server.kafka.dispatch import served_apis
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.protocol.invariants import InvariantViolation, invariant
from metalog.protocol.kafka import edge, wire

Endpoints = Callable[[], Mapping[int, tuple[str, int]]]

# Requests a node has received and not answered yet: bounded by the cores'
# own bound on requests in flight (each answered or forgotten with its node).
PENDING_MAX = 100_000


class _Exchange:
    """One received request, as a handler sees it (KafkaExchange's surface)."""

    __slots__ = ("header", "body", "answer")

    def __init__(self, header: wire.RequestHeader, body: Any):
        self.header = header
        self.body = body
        self.answer: bytes | None = None

    @property
    def version(self) -> int:
        return int(self.header.api_version)

    def respond(self, body: Any) -> None:
        invariant(self.answer is None, "api %d answered twice", self.header.api_key)
        self.answer = wire.encode_response(self.header, body)

    def fail(self, error_code: int) -> None:
        data = wire.error_answer(self.header, error_code)
        if data is None:
            raise InvariantViolation(f"api {self.header.api_key}: Kafka closes the connection on error {error_code}")
        self.answer = data


class _Context:
    """What the quorum's handlers use of their listener (KafkaContext)."""

    def __init__(self, node_id: int, cluster_id: str, endpoints: Endpoints, supported: dict[int, tuple[int, int]]):
        self.node_id = node_id
        self.cluster_id = cluster_id
        self.listener_name = CONTROLLER_LISTENER
        self._endpoints = endpoints
        self._supported = supported
        self.asked: list[tuple[ApiKey, m.Body, Callable[[Any], None]]] = []

    def ask(self, ex: Any, api_key: ApiKey, body: m.Body, on_answer: Callable[[Any], None]) -> None:
        self.asked.append((api_key, body, on_answer))

    def forward(self, *_args: Any) -> None:
        raise InvariantViolation("the quorum's apis are never forwarded")

    def endpoints(self) -> dict[int, tuple[str, int]]:
        return dict(self._endpoints())

    def supported(self) -> dict[int, tuple[int, int]]:
        return self._supported

    def finalized_features(self) -> Mapping[str, int]:
        return {}


class KafkaWire:
    """Requests and answers between simulated nodes, through Kafka's bytes."""

    def __init__(self, cluster_id: str):
        self._cluster_id = cluster_id
        self._apis = served_apis(CONTROLLER_LISTENER)
        self._supported = {key: (api.min_version, api.max_version) for key, api in self._apis.items()}
        # token -> (the exchange, the handler's answer path, the sender's edge)
        self._pending: dict[Any, tuple[_Exchange, Callable[[Any], None], edge.Edge]] = {}
        self.requests = 0  # carried, for the run's summary
        self.answered_at_the_edge = 0  # answered by the handler without the core (e.g. INVALID_REQUEST)

    def arrive(self, node_id: int, endpoints: Endpoints, token: Any, sender: int, correlation_id: int,
               request: m.Body) -> tuple[m.Body | None, m.Body | None]:
        """A request reaches `node_id`: (the flat body for its core, None), or
        (None, the flat answer) when the handler answered it itself."""
        # The channel numbers its requests; the core's request ids are wider than int32.
        sent_edge, frame = edge.encode_request(request, correlation_id & 0x7FFFFFFF, f"node-{sender}")
        header, body = wire.decode_request(memoryview(frame)[4:], self._supported)
        ctx = _Context(node_id, self._cluster_id, endpoints, self._supported)
        ex = _Exchange(header, body)
        self._apis[header.api_key].handle(ctx, ex)  # type: ignore[arg-type]
        self.requests += 1
        if not ctx.asked:
            if ex.answer is None:
                raise InvariantViolation(f"api {header.api_key}: the handler neither asked nor answered")
            self.answered_at_the_edge += 1
            return None, edge.decode_response(sent_edge, memoryview(ex.answer)[4:])
        invariant(len(ctx.asked) == 1, "api %d asked %d questions", header.api_key, len(ctx.asked))
        invariant(len(self._pending) < PENDING_MAX, "%d requests unanswered", len(self._pending))
        _api_key, flat, on_answer = ctx.asked[0]
        self._pending[token] = (ex, on_answer, sent_edge)
        return flat, None

    def leave(self, token: Any, response: m.Body) -> m.Body:
        """The core answers `token`: the flat answer as its requester decodes it."""
        ex, on_answer, sent_edge = self._pending.pop(token)
        on_answer(response)
        if ex.answer is None:
            raise InvariantViolation(f"api {ex.header.api_key}: the answer was not mapped")
        return edge.decode_response(sent_edge, memoryview(ex.answer)[4:])

    def forget(self, tokens: Any) -> None:
        """A node lost its open requests (a crash): their exchanges go."""
        for token in tokens:
            self._pending.pop(token, None)
