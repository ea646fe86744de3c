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

from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from metalog.broker.controller import acl as authz
from metalog.broker.controller import views
from metalog.broker.server.clocks import now_ms
from metalog.broker.net.principal import ANONYMOUS, Principal, principal_from_cert
from metalog.broker.net.tls import INSECURE_DETAIL
from metalog.protocol.errors import Errors

# Admin denials are logged once per (client address, principal, path); HTTP
# has no long-lived connection to key on. Bounded so a flood cannot grow it.
MAX_LOGGED_ADMIN_DENIALS = 1024

if TYPE_CHECKING:
    from metalog.broker.server.config import Endpoint
    from metalog.broker.server.runtime import Broker


def request_principal(request: web.Request) -> Principal:
    """Who sent this admin request: the verified client certificate's principal,
    ``ANONYMOUS`` on a plaintext listener (insecure mode)."""
    transport = request.transport
    if transport is None or transport.get_extra_info("sslcontext") is None:
        return ANONYMOUS
    return principal_from_cert(transport.get_extra_info("peercert"))


def quorum_view(broker: "Broker") -> dict:
    core = broker.core
    view = {
        "node_id": broker.cfg.node_id,
        "cluster_id": broker.cfg.cluster_id,
        "role": str(core.role),
        "epoch": core.epoch,
        "leader_id": core.leader_id,
        "voted_id": getattr(core, "voted_id", None),
        "high_watermark": core.high_watermark,
        "log_end_offset": core.log_end_offset,
        "flushed_end_offset": core.flushed_end_offset,
        "log_start_offset": core.log_start_offset,
        "snapshots": [[s.end_offset, s.epoch] for s in broker.snapshots.list()],
        # The core's voter set (KIP-853: the log's latest, else the config's).
        "voters": sorted(getattr(core, "voters", broker.voters)),
        "kraft_version": getattr(getattr(core, "voter_set", None), "kraft_version", 0),
        "directory_id": getattr(broker, "directory_id", None),
        "applied_offset": broker.controller.applied_offset,
        # -1, or the log end a quarantined voter must reach again before it votes
        "must_reach_offset": getattr(core, "must_reach_offset", -1),
        "fatal": broker.fatal,
    }
    describe = getattr(core, "describe_quorum", None)
    if describe is not None and core.is_leader:
        resp = describe(now_ms())
        view["replicas"] = {
            "voters": [_replica(r) for r in resp.voters],
            "observers": [_replica(r) for r in resp.observers],
        }
        # Who holds a long-poll Fetch on this leader right now: such a fetch is
        # answered with the next append, even if its sender has since stopped.
        view["parked_fetches"] = core.parked_fetch_replicas
    return view


def _replica(r) -> dict:
    return {
        "replica_id": r.replica_id,
        "directory_id": r.replica_directory_id or None,
        "log_end_offset": r.log_end_offset,
        "last_fetch_timestamp_ms": r.last_fetch_timestamp_ms,
        "last_caught_up_timestamp_ms": r.last_caught_up_timestamp_ms,
        "in_sync": r.in_sync,
    }


OPEN_PATHS = frozenset({"/health"})


def admin_denial(broker: "Broker", request: web.Request) -> authz.Denial | None:
    """None if the request may proceed; the same rules as the binary port."""
    if not broker.authz_enabled or request.path in OPEN_PATHS:
        return None
    peer = request.remote or "?"
    try:
        principal = request_principal(request)
    except ValueError as exc:  # no usable certificate: cannot be anyone
        return authz.Denial(Errors.CLUSTER_AUTHORIZATION_FAILED, "(none)", f"GET {request.path}", "Describe",
                            f"Cluster:{authz.CLUSTER_RESOURCE_NAME}", str(exc))
    return authz.authorize_operation(principal, peer, authz.Operation.DESCRIBE, authz.ResourceType.CLUSTER,
                                     authz.CLUSTER_RESOURCE_NAME, broker.authz_view(), f"GET {request.path}")


async def start_admin(broker: "Broker", endpoint: "Endpoint") -> web.AppRunner:
    @web.middleware
    async def authorize(request: web.Request, handler):
        denial = admin_denial(broker, request)
        if denial is None:
            return await handler(request)
        broker.metrics.authorization_failures.labels(api="ADMIN_HTTP").inc()
        key = (request.remote, denial.principal, request.path)
        logged = broker.admin_denials_logged
        if key not in logged and len(logged) < MAX_LOGGED_ADMIN_DENIALS:
            logged.add(key)
            broker.log.warning("authorization_failed", peer=request.remote, principal=denial.principal,
                               api=denial.api, operation=denial.operation, resource=denial.resource,
                               reason=denial.reason, error="CLUSTER_AUTHORIZATION_FAILED")
        return web.json_response({"error": "CLUSTER_AUTHORIZATION_FAILED", "message": denial.message()},
                                 status=403)

    async def health(_request: web.Request) -> web.Response:
        if broker.fatal is not None:
            return web.json_response({"status": "fatal", "reason": broker.fatal}, status=503)
        body = {"status": "ok", "role": str(broker.core.role), "epoch": broker.core.epoch}
        status = 200
        if broker.health_problems:
            body = {"status": "degraded", "problems": dict(broker.health_problems),
                    "role": str(broker.core.role), "epoch": broker.core.epoch}
            status = 503
        body["authorization"] = "on" if broker.authz_enabled else "off"
        if broker.tls is None:
            body["insecure"] = INSECURE_DETAIL + " (authorization is off: every client is ANONYMOUS, a super user)"
        return web.json_response(body, status=status)

    async def quorum(_request: web.Request) -> web.Response:
        return web.json_response(quorum_view(broker))

    def state():
        return broker.controller.state

    def ok(view) -> web.Response:
        return web.Response(body=views.encode(view), content_type="application/json", charset="utf-8")

    def not_found(what: str) -> web.Response:
        return web.json_response({"error": "NOT_FOUND", "message": what}, status=404)

    def paged(build):
        async def handler(request: web.Request) -> web.Response:
            try:
                return build(request, views.page_limit(request.query.get("limit")))
            except views.PageError as exc:
                return web.json_response({"error": "INVALID_REQUEST", "message": str(exc)}, status=400)
        return handler

    async def metadata(_request: web.Request) -> web.Response:
        return ok(views.summary(state()))

    def brokers(request: web.Request, limit: int) -> web.Response:
        after = views.int_cursor(request.query.get("after"), "after")
        return ok(views.brokers_page(state(), after, limit))

    async def one_broker(request: web.Request) -> web.Response:
        try:
            broker_id = int(request.match_info["id"])
        except ValueError:
            return web.json_response({"error": "INVALID_REQUEST",
                                      "message": f"broker id must be an integer, got {request.match_info['id']!r}"},
                                     status=400)
        body = views.broker(state(), broker_id)
        return not_found(f"no broker {broker_id}") if body is None else ok(body)

    def topics(request: web.Request, limit: int) -> web.Response:
        return ok(views.topics_page(state(), request.query.get("after") or None, limit))

    def one_topic(request: web.Request, limit: int) -> web.Response:
        name = request.match_info["name"]
        body = views.topic(state(), name, limit if "limit" in request.query else views.PAGE_LIMIT_MAX)
        return not_found(f"no topic {name!r}") if body is None else ok(body)

    def partitions(request: web.Request, limit: int) -> web.Response:
        name = request.match_info["name"]
        if name not in state().topic_ids:
            return not_found(f"no topic {name!r}")
        after = views.int_cursor(request.query.get("after"), "after")
        return ok(views.partitions_page(state(), name, after, limit))

    def configs(request: web.Request, limit: int) -> web.Response:
        kinds = {v: k for k, v in views.RESOURCE_NAMES.items()}
        kind = request.query.get("type")
        if kind not in kinds or "name" not in request.query:
            return web.json_response({"error": "INVALID_REQUEST",
                                      "message": "give type=topic|broker and name=NAME"}, status=400)
        name = request.query["name"]
        page, after = views.configs_page(state(), kinds[kind], name, request.query.get("after") or None, limit)
        return ok({"offset": state().offset, "type": kind, "name": name, "configs": page, "next": after})

    def acls(request: web.Request, limit: int) -> web.Response:
        return ok(views.acls_page(state(), request.query.get("after") or None, limit))

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(broker.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application(middlewares=[authorize])
    app.router.add_get("/health", health)
    app.router.add_get("/quorum", quorum)
    app.router.add_get("/metadata", metadata)
    app.router.add_get("/metadata/brokers", paged(brokers))
    app.router.add_get("/metadata/brokers/{id}", one_broker)
    app.router.add_get("/metadata/topics", paged(topics))
    app.router.add_get("/metadata/topics/{name}", paged(one_topic))
    app.router.add_get("/metadata/topics/{name}/partitions", paged(partitions))
    app.router.add_get("/metadata/acls", paged(acls))
    app.router.add_get("/metadata/configs", paged(configs))
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    ssl_context = broker.tls.server() if broker.tls is not None else None
    site = web.TCPSite(runner, endpoint.host, endpoint.port, reuse_address=True, ssl_context=ssl_context)
    await site.start()
    return runner
