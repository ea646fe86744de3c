"""Each Kafka exchange to its handler; the handlers' way into the broker.

``KafkaDispatch`` is the handler ``metalog.broker.net.kafka_conn.serve_kafka``
calls for every decoded request. It looks the api up in the served table
(``cluster.APIS`` and ``data.APIS`` merged) and calls its handler with
itself as the ``KafkaContext``.

``ask`` is how a handler reaches the broker's existing request router
(``metalog.broker.server.inbound.RequestRouter``) with one of our own flat
requests: the router sees a ``_Face`` of the Kafka connection -- the
connection's principal and address, so the authorization gate decides and
caches per connection -- and answers it with
``send_response(id, internal_response)`` as it answers any connection
(directly, from the produce path or from the core's Respond). The face
numbers its questions itself: a Kafka client's correlation ids are its own
business and may repeat.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Collection, Mapping, Protocol

from metalog.broker.net.channel import FORWARD_LANE
from metalog.broker.net.kafka_conn import KafkaConnection, KafkaExchange
from metalog.broker.quorum.voters import VoterSet
from metalog.broker.server.kafka import admin, brokers, cluster, data, extensions, quorum
from metalog.broker.server.kafka.api import CONTROLLER_LISTENER, KafkaApi
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.protocol.errors import Errors
from metalog.protocol.kafka import messages as km
from metalog.protocol.kafka.wire import RequestHeader, decode_response

# Questions a face may have open at once (one Kafka request may ask a few);
# the connection's own bound on requests in flight keeps it far below.
ASKED_PER_CONN_MAX = 4096


class Router(Protocol):
    """The broker's request router, as the dispatch uses it."""

    def on_request(self, conn: Any, header: Any, body: Any) -> None: ...


class VoterSetView(Protocol):
    """Where the quorum core says its voters listen (KIP-853)."""

    @property
    def voter_set(self) -> VoterSet: ...

    @property
    def voters(self) -> Collection[int]: ...

    @property
    def leader_id(self) -> int: ...


def served_apis(listener_name: str = CONTROLLER_LISTENER) -> dict[int, KafkaApi]:
    """The apis a listener serves: the quorum's own (Vote, BeginQuorumEpoch,
    EndQuorumEpoch, FetchSnapshot, UpdateRaftVoter) and Kafka brokers'
    BrokerRegistration and BrokerHeartbeat on the controller listener only,
    as a Kafka broker's listeners do not serve them."""
    peers = {**quorum.APIS, **brokers.APIS} if listener_name == CONTROLLER_LISTENER else {}
    table = dict(cluster.APIS)
    for key, api in (*data.APIS.items(), *admin.APIS.items(), *peers.items(), *extensions.APIS.items()):
        table.setdefault(key, api)
    return table


class _Face:
    """A Kafka connection as the request router sees it (see the module doc)."""

    def __init__(self, conn: KafkaConnection, logger: Any):
        self._conn = conn
        self._log = logger
        self.principal = conn.principal
        self.peer = conn.peer
        self.peer_host = conn.peer_host
        self._asked: dict[int, tuple[KafkaExchange, Callable[[Any], None]]] = {}
        self._next_id = 0
        conn.add_close_callback(lambda _conn: self._asked.clear())  # answers to a closed connection go nowhere

    @property
    def closed(self) -> bool:
        return self._conn.closed

    def ask(self, router: Router, ex: KafkaExchange, api_key: ApiKey, body: m.Body,
            on_answer: Callable[[Any], None]) -> None:
        if len(self._asked) >= ASKED_PER_CONN_MAX:
            ex.fail(Errors.UNKNOWN_SERVER_ERROR)  # a handler leaking questions: refuse, do not grow
            self._log.error("kafka_asked_overflow", peer=self.peer, asked=len(self._asked))
            return
        self._next_id = (self._next_id + 1) & 0x7FFFFFFF
        ask_id = self._next_id
        self._asked[ask_id] = (ex, on_answer)
        router.on_request(self, RequestHeader(int(api_key), 0, ask_id, ex.header.client_id), body)

    def send_response(self, ask_id: int, response: m.Body) -> bool:
        asked = self._asked.pop(ask_id, None)
        if asked is None or self._conn.closed:
            return False
        ex, on_answer = asked
        try:
            on_answer(response)
        except Exception as exc:  # a mapping bug: this request's error, never the router's
            self._log.error("kafka_answer_failed", peer=self.peer, api_key=ex.header.api_key,
                            api_version=ex.header.api_version, error=repr(exc))
            ex.fail(Errors.UNKNOWN_SERVER_ERROR)
        return True

    def add_close_callback(self, cb: Callable[[Any], None]) -> None:
        self._conn.add_close_callback(lambda _conn: cb(self))


class KafkaDispatch:
    """The Kafka listener's handler and the handlers' ``KafkaContext``."""

    def __init__(self, router: Router, *, node_id: int, cluster_id: str, listener_name: str,
                 static_endpoints: Mapping[int, tuple[str, int]], core: VoterSetView, logger: Any,
                 ask_node: Callable[[int, int, m.Body], Awaitable[m.Body]] | None = None,
                 features: Callable[[], Mapping[str, int]] = dict):
        self._router = router
        self._node_id = node_id
        self._cluster_id = cluster_id
        self._listener_name = listener_name
        self._static = dict(static_endpoints)
        self._core = core
        self._log = logger
        self._ask_node = ask_node
        self._features = features  # the controller state's finalized features (metadata.version)
        self._forwards: set[asyncio.Future[m.Body]] = set()  # bounded: one per request in flight
        self.apis = served_apis(listener_name)
        # endpoints() as last built, and the voter set it was built from (a
        # frozen VoterSet, replaced when the log's voters change): a replica's
        # Fetch answer names the leader's endpoint every time.
        self._endpoints_of: VoterSet | None = None
        self._endpoints: dict[int, tuple[str, int]] = {}
        self._supported = {key: (api.min_version, api.max_version) for key, api in self.apis.items()}

    # the listener's handler ----------------------------------------------------
    def __call__(self, ex: KafkaExchange) -> None:
        api = self.apis.get(ex.header.api_key)
        if api is None:  # decode_request checked `supported`: only a table changed under us
            ex.fail(Errors.UNSUPPORTED_VERSION)
            return
        api.handle(self, ex)

    # KafkaContext ----------------------------------------------------------------
    @property
    def node_id(self) -> int:
        return self._node_id

    @property
    def cluster_id(self) -> str:
        return self._cluster_id

    @property
    def listener_name(self) -> str:
        return self._listener_name

    def supported(self) -> dict[int, tuple[int, int]]:
        return self._supported

    def finalized_features(self) -> Mapping[str, int]:
        return self._features()

    def ask(self, ex: KafkaExchange, api_key: ApiKey, body: m.Body, on_answer: Callable[[Any], None]) -> None:
        conn = ex.conn
        face = conn.context
        if face is None:
            face = conn.context = _Face(conn, self._log)
        face.ask(self._router, ex, api_key, body, on_answer)

    def forward(self, ex: KafkaExchange, node_id: int, api_key: int, body: m.Body,
                on_answer: Callable[[Any], None], fallback: m.Body | None) -> None:
        """Ask node `node_id` (the leader) over the peers' channel, in this
        node's name, as a Kafka broker forwards to its controller: only after
        this node's own gate let the client's request through. On any failure
        `on_answer(fallback)` (this node's own answer)."""
        if self._ask_node is None:
            on_answer(fallback)
            return
        future = asyncio.ensure_future(self._ask_node(node_id, api_key, body))
        self._forwards.add(future)
        future.add_done_callback(lambda f: self._forwarded(f, ex, on_answer, fallback))

    def is_forwarded(self, ex: KafkaExchange) -> bool:
        return brokers.is_forwarded(ex)

    def later(self, delay_s: float, fn: Callable[[], None]) -> None:
        asyncio.get_running_loop().call_later(delay_s, fn)

    def leader_id(self) -> int:
        """The leader this node knows of (-1: none)."""
        return int(self._core.leader_id)

    def forward_request(self, ex: KafkaExchange, node_id: int, unreachable: Callable[[], None]) -> None:
        """``ex`` as the client sent it, in an Envelope to node `node_id` (the
        leader) carrying the client's principal and address (KIP-590), so the
        leader's gate judges the client, not this node; the leader's answer
        goes back to the client as it is. A request that came in an Envelope
        is never forwarded again, and any failure (unreachable leader, an
        Envelope error) is `unreachable()`: this node's own answer."""
        try:
            body = None if brokers.is_forwarded(ex) else brokers.envelope_of(ex)
        except ValueError:
            body = None
        if body is None:
            unreachable()
            return

        def answered(resp: brokers.EnvelopeResponse | None) -> None:
            if resp is None or resp.error_code != Errors.NONE or not resp.response_data:
                if resp is not None:
                    self._log.info("kafka_envelope_refused", peer=ex.conn.peer, api_key=ex.header.api_key,
                                   leader=node_id, error_code=resp.error_code)
                unreachable()
                return
            _corr, inner = decode_response(resp.response_data, ex.header.api_key, ex.version)
            ex.respond(inner)

        self.forward(ex, node_id, km.EnvelopeRequest.API_KEY, body, answered, None)

    def _forwarded(self, future: "asyncio.Future[m.Body]", ex: KafkaExchange, on_answer: Callable[[Any], None],
                   fallback: m.Body | None) -> None:
        self._forwards.discard(future)
        if ex.conn.closed or ex.answered:
            return
        exc = None if future.cancelled() else future.exception()
        answer = fallback if future.cancelled() or exc is not None else future.result()
        if exc is not None:
            self._log.info("kafka_forward_failed", peer=ex.conn.peer, api_key=ex.header.api_key, error=repr(exc))
        try:
            on_answer(answer)
        except Exception as err:  # a mapping bug: this request's error
            self._log.error("kafka_answer_failed", peer=ex.conn.peer, api_key=ex.header.api_key, error=repr(err))
            ex.fail(Errors.UNKNOWN_SERVER_ERROR)

    def endpoints(self) -> dict[int, tuple[str, int]]:
        """Every node's Kafka listener: the static map of the config
        (``kafka_endpoints``), overridden by a listener of our name that a
        voter advertises in the log's voter set (KIP-853). Shared: read it, never change it."""
        voter_set = self._core.voter_set
        if voter_set is self._endpoints_of:
            return self._endpoints
        out = dict(self._static)
        for nid, listeners in voter_set.endpoints.items():
            for name, host, port in listeners:
                if name == self._listener_name:
                    out[nid] = (host, port)
        self._endpoints_of, self._endpoints = voter_set, out
        return out


class KafkaHost(Protocol):
    """What the Kafka listener takes from the broker (metalog.broker.server.runtime.Broker)."""

    @property
    def cfg(self) -> Any: ...  # BrokerConfig

    @property
    def inbound(self) -> Router: ...

    @property
    def core(self) -> VoterSetView: ...

    @property
    def tls(self) -> Any: ...  # metalog.broker.net.tls.TlsFiles or None

    @property
    def log(self) -> Any: ...

    @property
    def metrics(self) -> Any: ...  # BrokerMetrics: bind_listener

    @property
    def peers(self) -> Any: ...  # metalog.broker.net.channel.PeerPool: channel(node_id).request(...)

    @property
    def controller(self) -> Any: ...  # metalog.broker.controller.state.Controller: .state.features


async def start_kafka_listener(host: KafkaHost, limits: Any) -> Any:
    """The Kafka listener of ``host.cfg.kafka_listen`` (None when unset): its
    own accept loop, `limits` (the same values as the controller listener's), the broker's TLS
    provider, its counters exported as listener "kafka". Returns the
    ``metalog.broker.net.listener.Server``."""
    cfg, logger = host.cfg, host.log
    ep = cfg.kafka_endpoint()
    if ep is None:
        return None
    static = {nid: (e.host, e.port) for nid, e in cfg.kafka_node_endpoints().items()}
    server, dispatch = await _start(host, limits, ep, cfg.security.security_protocol, static)
    host.metrics.bind_listener("kafka", server.listener.stats, None)
    tls_off = host.tls is None
    if tls_off:  # as loud as the listen port's authorization_disabled
        logger.warning("kafka_listener_insecure", kafka_listen=str(ep), security_protocol="PLAINTEXT",
                       detail="Kafka clients connect without TLS as User:ANONYMOUS with super-user rights")
    logger.info("kafka_listener_started", kafka_listen=str(ep), security_protocol=cfg.security.security_protocol,
                tls=not tls_off,
                apis={key: list(rng) for key, rng in sorted(dispatch.supported().items())})
    return server


async def start_controller_listener(host: KafkaHost, limits: Any) -> Any:
    """The ``listen`` port (issue 34 item 1): Kafka's CONTROLLER listener, for the quorum's peers, our client
    and CLI and admin tools bootstrapped with --bootstrap-controller. Its own
    accept loop and `limits`; the endpoints it advertises (Metadata,
    NodeEndpoints, DescribeCluster) are every node's ``listen`` endpoint: the
    config's voters, overridden by the CONTROLLER listeners of the log's voter
    set. The caller exports its counters. Returns the ``Server``."""
    cfg = host.cfg
    ep = cfg.listen_endpoint()
    static = {nid: (e.host, e.port) for nid, e in cfg.voter_endpoints().items()}
    if ep.host not in ("", "0.0.0.0", "::"):
        static.setdefault(cfg.node_id, (ep.host, ep.port))  # an observer is in no voters list
    server, _dispatch = await _start(host, limits, ep, CONTROLLER_LISTENER, static)
    return server


# A forwarded request in an Envelope (UpdateFeatures, Add/RemoveRaftVoter)
# waits at the leader for its commit; Kafka's brokers give a forwarded
# request their request.timeout.ms, 30 s by default.
ENVELOPE_FORWARD_TIMEOUT_MS = 30_000


def forward_timeout_ms(body: m.Body, request_timeout_ms: int) -> int:
    """How long a forward waits for the leader's answer: past the time the
    leader itself takes to answer (a command's own timeout), so the forward
    does not give up on a command the leader may still write and answer."""
    if isinstance(body, m.ControllerCommandRequest):
        return int(body.timeout_ms) + request_timeout_ms
    return max(request_timeout_ms, ENVELOPE_FORWARD_TIMEOUT_MS)


async def _start(host: KafkaHost, limits: Any, ep: Any, listener_name: str,
                 static: Mapping[int, tuple[str, int]]) -> tuple[Any, KafkaDispatch]:
    """A listener on `ep` served by a KafkaDispatch of its own."""
    from metalog.broker.net.kafka_conn import serve_kafka

    cfg, logger = host.cfg, host.log
    timeout_ms = cfg.quorum.request_timeout_ms

    def ask_node(node_id: int, api_key: int, body: m.Body) -> Awaitable[m.Body]:
        channel = host.peers.channel(node_id, FORWARD_LANE)
        return channel.request(api_key, body, forward_timeout_ms(body, timeout_ms))  # type: ignore[no-any-return]

    dispatch = KafkaDispatch(host.inbound, node_id=cfg.node_id, cluster_id=cfg.cluster_id,
                             listener_name=listener_name, static_endpoints=static, core=host.core, logger=logger,
                             ask_node=ask_node, features=lambda: host.controller.state.features)
    server = await serve_kafka(ep.host, ep.port, dispatch, dispatch.supported(),
                               max_frame_bytes=cfg.network.max_frame_bytes, logger=logger, tls=host.tls,
                               limits=limits)
    return server, dispatch
