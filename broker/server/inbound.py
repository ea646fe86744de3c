"""Requests from the wire, each to the one that handles it.

Every request is first refused if the broker cannot take it (a failed disk
refuses writes, a failed broker everything) or the authorization gate
denies it (before anything else sees it: a refused request has no effect
on votes, epochs, fetch positions or the high watermark). Then:

* ApiVersions, Metadata and ConsistencyCheck are answered here;
* Produce and InitProducerId go to the produce path (``produce.py``);
* ControllerCommand queues in ``metalog.broker.controller.commands``, whose
  appends the core commits like any client's;
* everything else (the quorum's RPCs, Fetch, DescribeQuorum ...) is fed to
  the core as ``RequestReceived``.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from metalog.broker.controller.commands import CommandQueue, CommandToken, LeaderView
from metalog.broker.controller.state import Controller
from metalog.broker.net.listener import ListenerLimits
from metalog.broker.quorum import api as qa
from metalog.broker.quorum.answers import api_versions_response, check_cluster_id
from metalog.broker.quorum.core import QuorumCore
from metalog.broker.server import consistency
from metalog.broker.server.answers import metadata_response
from metalog.broker.server.clocks import now_ms, wall_clock_ms
from metalog.broker.server.commit_trace import CommitTrace
from metalog.broker.server.config import BrokerConfig, Endpoint
from metalog.broker.server.consistency import LogDigest
from metalog.broker.server.gate import Gate
from metalog.broker.server.metrics import BrokerMetrics
from metalog.broker.server.produce import ProducePath, Requester
from metalog.protocol import messages as m
from metalog.protocol.apis import APIS, ApiKey
from metalog.protocol.errors import Errors
from metalog.protocol.invariants import InvariantViolation

TRACE_FETCHERS_MAX = 4096  # parked Fetch tokens remembered for the commit trace (answered ones are popped)
# Requests the runtime batches or runs itself (the core checks the cluster id of the others).
_RUNTIME_APIS = frozenset({ApiKey.PRODUCE, ApiKey.CONTROLLER_COMMAND, ApiKey.CONSISTENCY_CHECK,
                           ApiKey.INIT_PRODUCER_ID})
_WRITE_APIS = frozenset({ApiKey.PRODUCE, ApiKey.CONTROLLER_COMMAND, ApiKey.INIT_PRODUCER_ID})


def listener_limits(cfg: BrokerConfig) -> ListenerLimits:
    """The client listener's bounds on connections and handshakes."""
    net = cfg.network
    return ListenerLimits(
        ssl_handshake_timeout_ms=cfg.security.ssl_handshake_timeout_ms,
        connections_max_idle_ms=net.connections_max_idle_ms, max_connections=net.max_connections,
        max_connections_per_ip=net.max_connections_per_ip,
        failed_connections_before_backoff=net.failed_connections_before_backoff,
        failed_connection_backoff_ms=net.failed_connection_backoff_ms,
        failed_connection_backoff_max_ms=net.failed_connection_backoff_max_ms,
        failed_connection_backoff_drops_syns=net.failed_connection_backoff_drops_syns,
        max_connection_creation_rate=net.max_connection_creation_rate,
        connection_creation_rate_per_ip=net.connection_creation_rate_per_ip,
        ssl_handshake_loop_share=net.ssl_handshake_loop_share, max_delayed_connections=net.max_delayed_connections,
        exempt_hosts=frozenset([*(ep.host for ep in cfg.voter_endpoints().values()),
                                *net.connection_limits_exempt_hosts]),
        refusal_log_interval_ms=net.refusal_log_interval_ms, refusal_log_lines_max=net.refusal_log_lines_max)


class InboundHost(Protocol):
    """What the router reads of the driver's state, and how it steps the core."""

    @property
    def fatal(self) -> str | None: ...

    @property
    def storage_error(self) -> str | None: ...

    def step(self, event: qa.Event) -> None: ...


class RequestRouter:
    def __init__(self, host: InboundHost, cfg: BrokerConfig, core: QuorumCore, *, gate: Gate, authz_enabled: bool,
                 produce: ProducePath, commands: CommandQueue, controller: Controller, digest: LogDigest,
                 voters: dict[int, Endpoint], metrics: BrokerMetrics, trace: CommitTrace | None, logger: Any):
        self._host = host
        self._node_id = cfg.node_id
        self._cluster_id = cfg.cluster_id
        self._core = core
        self._gate = gate
        self._authz_enabled = authz_enabled
        self._produce = produce
        self.commands = commands
        self._controller = controller
        self._digest = digest
        self._voters = voters  # the config's (static) voters and their addresses
        self._metrics = metrics
        self._trace = trace
        self._log = logger
        self._trace_fetchers: dict[Any, int] = {}  # parked/served Fetch token -> replica id (trace only)

    def on_request(self, conn: Requester, header: Any, body: Any) -> None:
        """The network server's handler of every request."""
        api_key = ApiKey(header.api_key)
        self._metrics.count_request(api_key)
        cid = header.correlation_id
        host = self._host
        if host.storage_error is not None and api_key in _WRITE_APIS:
            conn.send_response(cid, APIS[api_key][1](
                error_code=Errors.KAFKA_STORAGE_ERROR,
                error_message=f"storage error on broker {self._node_id}: {host.storage_error}"))
            return
        if host.fatal is not None:
            conn.send_response(cid, APIS[api_key][1](error_code=Errors.BROKER_NOT_AVAILABLE))
            return
        if self._authz_enabled:
            # Before anything else sees the request (the core included).
            denial = self._gate.check(conn, api_key, body)
            if denial is not None:
                self._gate.refuse(conn, cid, api_key, denial)
                return
        if api_key in _RUNTIME_APIS:
            # The core runs the same check on every request it is handed.
            wrong_cluster = check_cluster_id(self._cluster_id, body, self._core.current_leader())
            if wrong_cluster is not None:
                self._log.warning("inconsistent_cluster_id", api=api_key.name, got=body.cluster_id, peer=conn.peer)
                conn.send_response(cid, wrong_cluster)
                return
        self._route(conn, cid, api_key, body)

    def _route(self, conn: Requester, cid: int, api_key: ApiKey, body: Any) -> None:
        token = (conn, cid)
        core = self._core
        if api_key is ApiKey.API_VERSIONS:
            conn.send_response(cid, api_versions_response(*core.finalized_kraft_version()))
        elif api_key is ApiKey.METADATA:
            resp = metadata_response(core, self._voters, self._node_id, core.config.listeners)
            if self._authz_enabled and not self._gate.may_describe_log(conn):
                # Routing only (leader, voters), as Kafka answers a client without Describe.
                resp = msgspec.structs.replace(resp, high_watermark=m.NO_OFFSET, log_start_offset=m.NO_OFFSET,
                                               observers=[])
            conn.send_response(cid, resp)
        elif api_key is ApiKey.PRODUCE:
            if self._trace is not None:
                self._trace.mark("produce_recv", -1)
            self._produce.enqueue(token, body)
        elif api_key is ApiKey.CONTROLLER_COMMAND:
            refusal = self.commands.offer(conn, cid, body)
            if refusal is not None:
                conn.send_response(cid, refusal)
            elif self.commands.runnable:
                self.pump_commands()
        elif api_key is ApiKey.INIT_PRODUCER_ID:
            self._produce.init_producer_id(conn, cid)
        elif api_key is ApiKey.CONSISTENCY_CHECK:
            conn.send_response(cid, consistency.answer(body, self._voters, core.flushed_end_offset, self._digest))
        else:
            if self._trace is not None and api_key is ApiKey.FETCH and body.replica_id >= 0:
                self._trace.mark("fetch_recv", body.fetch_offset, body.replica_id)
                if len(self._trace_fetchers) < TRACE_FETCHERS_MAX:
                    self._trace_fetchers[token] = body.replica_id
            self._host.step(qa.RequestReceived(now_ms(), token, body))

    # ------------------------------------------------------------- answers
    def trace_respond(self, token: Any, response: m.Body) -> None:
        """Marks of an answer just written (commit trace only)."""
        trace = self._trace
        if trace is None:
            return
        if type(response) is m.ProduceResponse and response.error_code == 0:
            trace.mark("produce_reply", response.base_offset)
        elif type(response) is m.FetchResponse:
            replica = self._trace_fetchers.pop(token, -1)
            if response.records:
                trace.mark("fetch_answer", self._core.log_end_offset, replica)

    # --------------------------------------------------- controller commands
    def pump_commands(self) -> None:
        """Run the queued commands the controller can take now (after each step)."""
        core = self._core
        answers, append = self.commands.pump(self._controller, LeaderView(
            is_leader=core.is_leader, epoch=core.epoch, log_end_offset=core.log_end_offset,
            leader_id=core.leader_id if core.leader_id is not None else m.NO_LEADER, now_ms=now_ms()))
        self._send_answers(answers)
        if append is not None:
            token, records = append
            self._host.step(qa.ClientAppend(now_ms(), [qa.AppendWaiter(token, len(records))], records,
                                            wall_clock_ms()))

    def command_done(self, token: CommandToken, response: m.Body) -> None:
        """The core answered a command's append."""
        if not isinstance(response, m.ProduceResponse):  # an append's waiter is answered as a Produce
            raise InvariantViolation(f"a controller command's append answered with {type(response).__name__}")
        self._send_answers([self.commands.done(token, response)])

    def fail_commands(self, message: str) -> None:
        """The disk failed: every queued command is answered KAFKA_STORAGE_ERROR."""
        self._send_answers(self.commands.fail_all(Errors.KAFKA_STORAGE_ERROR, message))

    @staticmethod
    def _send_answers(answers: Any) -> None:
        for token, response in answers:
            token.conn.send_response(token.correlation_id, response)
