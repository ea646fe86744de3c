"""HTTP admin API of a broker (aiohttp): read-only views for people and drills.

Served over mutual TLS like the binary port (security_protocol SSL): a client
certificate signed by the cluster CA is required; ``request_principal``
names the caller for the authorizer.

    GET /health    200 while serving; 503 after a fatal invariant breach, or
                   {"status": "degraded", "problems": {...}} while the broker
                   serves but found something wrong (corruption, quarantine);
                   "insecure": "..." in PLAINTEXT mode
    GET /quorum    role, epoch, leader, HW, LEO, log start, snapshots, replicas
    GET /metadata  a summary of the controller state: the offset it reflects,
                   counts, features, and the paths below (never the whole
                   state: at 2M partitions it would be hundreds of MB)
    GET /metadata/brokers[?after=ID&limit=N]           brokers by id, paged
    GET /metadata/brokers/{id}                         one broker and its configs
    GET /metadata/topics[?after=NAME&limit=N]          topics by name, paged
    GET /metadata/topics/{name}[?limit=N]              one topic: configs, partitions
    GET /metadata/topics/{name}/partitions[?after=P&limit=N]
    GET /metadata/acls[?after=ID&limit=N]
    GET /metadata/configs?type=topic|broker&name=NAME[&after=KEY&limit=N]
                   one resource's configs by key (name '' for the brokers'
                   cluster-wide defaults)
                   Pages hold at most 1000 items (default 100) and carry
                   "next": the cursor for `after`, null on the last page; a
                   topic or a broker carries its first 1000 configs and
                   "next_config" (a topic: its first `limit`, default 1000,
                   partitions and "next_partition"). An unknown broker or
                   topic is a 404, a bad argument a 400, each with
                   {"error": ..., "message": ...}. Bodies are encoded by
                   msgspec; no answer holds more than one page of anything.
    GET /metrics   Prometheus text format

With authorization on (TLS), /health stays open; /quorum, /metadata and
/metrics need Describe on the cluster (as DescribeQuorum and Metadata do on
the binary port): super users, node certificates, or an ACL. A refusal is a
403 with ``{"error": "CLUSTER_AUTHORIZATION_FAILED", "message": ...}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from metalog.broker.controller import acl as authz
from metalog.broker.controller import views
from metalog.broker.controller.state import Controller, ControllerState
from metalog.broker.net.principal import ANONYMOUS, Principal, principal_from_cert
from metalog.broker.net.tls import INSECURE_DETAIL
from metalog.broker.quorum.core import QuorumCore
from metalog.broker.server.clocks import now_ms
from metalog.broker.server.config import Endpoint
from metalog.broker.server.metrics import BrokerMetrics
from metalog.protocol.errors import Errors
from metalog.storage.snapshot import SnapshotStore

# Admin denials are logged once per (client address, principal, path); HTTP
# has no long-lived connection to key on. Bounded so a flood cannot grow it.
MAX_LOGGED_ADMIN_DENIALS = 1024
OPEN_PATHS = frozenset({"/health"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class AdminSource(Protocol):
    """What the admin API reads of the broker, afresh at every request."""

    @property
    def core(self) -> QuorumCore: ...

    @property
    def snapshots(self) -> SnapshotStore: ...

    @property
    def controller(self) -> Controller: ...

    @property
    def directory_id(self) -> str: ...

    @property
    def fatal(self) -> str | None: ...

    @property
    def health_problems(self) -> dict[str, str]: ...


@dataclass(frozen=True)
class AdminSetup:
    """What the admin API is set up with, fixed for the process's life."""

    node_id: int
    cluster_id: str
    authz_enabled: bool
    tls: Any  # metalog.broker.net.tls.TlsFiles, None in insecure mode
    metrics: BrokerMetrics
    log: Any
    authz_view: Callable[[], authz.AuthzView]  # the committed ACLs, as the binary port's gate sees them


def request_principal(request: web.Request) -> Principal:
    """Who sent this admin request: the verified client certificate's principal,
    ``ANONYMOUS`` on a plaintext listener (insecure mode)."""
    transport = request.transport
    if transport is None or transport.get_extra_info("sslcontext") is None:
        return ANONYMOUS
    return principal_from_cert(transport.get_extra_info("peercert"))


def quorum_view(broker: AdminSource, setup: AdminSetup) -> dict[str, Any]:
    core = broker.core
    view: dict[str, Any] = {
        "node_id": setup.node_id,
        "cluster_id": setup.cluster_id,
        "role": str(core.role),
        "epoch": core.epoch,
        "leader_id": core.leader_id,
        "voted_id": core.voted_id,
        "high_watermark": core.high_watermark,
        "log_end_offset": core.log_end_offset,
        "flushed_end_offset": core.flushed_end_offset,
        "log_start_offset": core.log_start_offset,
        "snapshots": [[s.end_offset, s.epoch] for s in broker.snapshots.list()],
        # The core's voter set (KIP-853: the log's latest, else the config's).
        "voters": sorted(core.voters),
        "kraft_version": core.voter_set.kraft_version,
        "directory_id": broker.directory_id,
        "applied_offset": broker.controller.applied_offset,
        # -1, or the log end a quarantined voter must reach again before it votes
        "must_reach_offset": core.must_reach_offset,
        "fatal": broker.fatal,
    }
    if core.is_leader:
        resp = core.describe_quorum(now_ms())
        view["replicas"] = {
            "voters": [_replica(r) for r in resp.voters],
            "observers": [_replica(r) for r in resp.observers],
        }
        # Who holds a long-poll Fetch on this leader right now: such a fetch is
        # answered with the next append, even if its sender has since stopped.
        view["parked_fetches"] = core.parked_fetch_replicas
    return view


def _replica(r: Any) -> dict[str, Any]:
    return {
        "replica_id": r.replica_id,
        "directory_id": r.replica_directory_id or None,
        "log_end_offset": r.log_end_offset,
        "last_fetch_timestamp_ms": r.last_fetch_timestamp_ms,
        "last_caught_up_timestamp_ms": r.last_caught_up_timestamp_ms,
        "in_sync": r.in_sync,
    }


def admin_denial(setup: AdminSetup, request: web.Request) -> authz.Denial | None:
    """None if the request may proceed; the same rules as the binary port."""
    if not setup.authz_enabled or request.path in OPEN_PATHS:
        return None
    peer = request.remote or "?"
    try:
        principal = request_principal(request)
    except ValueError as exc:  # no usable certificate: cannot be anyone
        return authz.Denial(Errors.CLUSTER_AUTHORIZATION_FAILED, "(none)", f"GET {request.path}", "Describe",
                            f"Cluster:{authz.CLUSTER_RESOURCE_NAME}", str(exc))
    return authz.authorize_operation(principal, peer, authz.Operation.DESCRIBE, authz.ResourceType.CLUSTER,
                                     authz.CLUSTER_RESOURCE_NAME, setup.authz_view(), f"GET {request.path}")


class _Api:
    """The admin API's handlers."""

    def __init__(self, broker: AdminSource, setup: AdminSetup):
        self._broker = broker
        self._setup = setup
        self._denials_logged: set[tuple[Any, ...]] = set()  # at most MAX_LOGGED_ADMIN_DENIALS

    @web.middleware
    async def authorize(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        setup = self._setup
        denial = admin_denial(setup, request)
        if denial is None:
            return await handler(request)
        setup.metrics.authorization_failures.labels(api="ADMIN_HTTP").inc()
        key = (request.remote, denial.principal, request.path)
        logged = self._denials_logged
        if key not in logged and len(logged) < MAX_LOGGED_ADMIN_DENIALS:
            logged.add(key)
            setup.log.warning("authorization_failed", peer=request.remote, principal=denial.principal,
                              api=denial.api, operation=denial.operation, resource=denial.resource,
                              reason=denial.reason, error="CLUSTER_AUTHORIZATION_FAILED")
        return web.json_response({"error": "CLUSTER_AUTHORIZATION_FAILED", "message": denial.message()},
                                 status=403)

    async def health(self, _request: web.Request) -> web.Response:
        broker, setup = self._broker, self._setup
        if broker.fatal is not None:
            return web.json_response({"status": "fatal", "reason": broker.fatal}, status=503)
        role, epoch = str(broker.core.role), broker.core.epoch
        body: dict[str, Any] = {"status": "ok", "role": role, "epoch": epoch}
        status = 200
        if broker.health_problems:
            body = {"status": "degraded", "problems": dict(broker.health_problems), "role": role, "epoch": epoch}
            status = 503
        body["authorization"] = "on" if setup.authz_enabled else "off"
        if setup.tls is None:
            body["insecure"] = INSECURE_DETAIL + " (authorization is off: every client is ANONYMOUS, a super user)"
        return web.json_response(body, status=status)

    async def quorum(self, _request: web.Request) -> web.Response:
        return web.json_response(quorum_view(self._broker, self._setup))

    async def metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self._setup.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    # -- /metadata: the controller's committed state, a page at a time -----------
    def _state(self) -> ControllerState:
        return self._broker.controller.state

    async def metadata(self, _request: web.Request) -> web.Response:
        return _ok(views.summary(self._state()))

    def brokers(self, request: web.Request, limit: int) -> web.Response:
        after = views.int_cursor(request.query.get("after"), "after")
        return _ok(views.brokers_page(self._state(), after, limit))

    async def one_broker(self, request: web.Request) -> web.Response:
        try:
            broker_id = int(request.match_info["id"])
        except ValueError:
            return _error(400, "INVALID_REQUEST", f"broker id must be an integer, got {request.match_info['id']!r}")
        body = views.broker(self._state(), broker_id)
        return _error(404, "NOT_FOUND", f"no broker {broker_id}") if body is None else _ok(body)

    def topics(self, request: web.Request, limit: int) -> web.Response:
        return _ok(views.topics_page(self._state(), request.query.get("after") or None, limit))

    def one_topic(self, request: web.Request, limit: int) -> web.Response:
        name = request.match_info["name"]
        body = views.topic(self._state(), name, limit if "limit" in request.query else views.PAGE_LIMIT_MAX)
        return _error(404, "NOT_FOUND", f"no topic {name!r}") if body is None else _ok(body)

    def partitions(self, request: web.Request, limit: int) -> web.Response:
        name = request.match_info["name"]
        state = self._state()
        if name not in state.topic_ids:
            return _error(404, "NOT_FOUND", f"no topic {name!r}")
        after = views.int_cursor(request.query.get("after"), "after")
        return _ok(views.partitions_page(state, name, after, limit))

    def configs(self, request: web.Request, limit: int) -> web.Response:
        kinds = {v: k for k, v in views.RESOURCE_NAMES.items()}
        kind = request.query.get("type")
        if kind not in kinds or "name" not in request.query:
            return _error(400, "INVALID_REQUEST", "give type=topic|broker and name=NAME")
        name = request.query["name"]
        state = self._state()
        page, after = views.configs_page(state, kinds[kind], name, request.query.get("after") or None, limit)
        return _ok({"offset": state.offset, "type": kind, "name": name, "configs": page, "next": after})

    def acls(self, request: web.Request, limit: int) -> web.Response:
        return _ok(views.acls_page(self._state(), request.query.get("after") or None, limit))


def _ok(view: Any) -> web.Response:
    return web.Response(body=views.encode(view), content_type="application/json", charset="utf-8")


def _error(status: int, error: str, message: str) -> web.Response:
    return web.json_response({"error": error, "message": message}, status=status)


def _paged(build: Callable[[web.Request, int], web.Response]) -> Handler:
    """A handler of a paged view: `limit` checked (a bad one is a 400), then `build`."""
    async def handler(request: web.Request) -> web.Response:
        try:
            return build(request, views.page_limit(request.query.get("limit")))
        except views.PageError as exc:
            return _error(400, "INVALID_REQUEST", str(exc))
    return handler


def admin_app(broker: AdminSource, setup: AdminSetup) -> web.Application:
    """The admin API's routes (see the module's docstring)."""
    api = _Api(broker, setup)
    app = web.Application(middlewares=[api.authorize])
    app.router.add_get("/health", api.health)
    app.router.add_get("/quorum", api.quorum)
    app.router.add_get("/metadata", api.metadata)
    app.router.add_get("/metadata/brokers", _paged(api.brokers))
    app.router.add_get("/metadata/brokers/{id}", api.one_broker)
    app.router.add_get("/metadata/topics", _paged(api.topics))
    app.router.add_get("/metadata/topics/{name}", _paged(api.one_topic))
    app.router.add_get("/metadata/topics/{name}/partitions", _paged(api.partitions))
    app.router.add_get("/metadata/acls", _paged(api.acls))
    app.router.add_get("/metadata/configs", _paged(api.configs))
    app.router.add_get("/metrics", api.metrics)
    return app


async def start_admin(broker: AdminSource, setup: AdminSetup, endpoint: Endpoint) -> web.AppRunner:
    """Serve the admin API at `endpoint` (over TLS when the broker has it)."""
    runner = web.AppRunner(admin_app(broker, setup), access_log=None)
    await runner.setup()
    ssl_context = setup.tls.server() if setup.tls is not None else None
    site = web.TCPSite(runner, endpoint.host, endpoint.port, reuse_address=True, ssl_context=ssl_context)
    await site.start()
    return runner
