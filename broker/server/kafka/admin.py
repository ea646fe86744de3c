"""Administration through Kafka's own admin APIs (issue 32 item 4), each
mapped onto the controller commands our CLI sends (``metalog topics``,
``configs``, ``acls``: ``metalog.broker.controller.commands``), so a Kafka
admin client meets the same validation, the same ACL checks (the gate) and
the same results; nothing is decided here that the controller decides.

* CreateTopics -> ``create_topic`` (then ``set_config`` per config),
  DeleteTopics -> ``delete_topic``, CreatePartitions -> ``create_partitions``:
  topics of the controller's metadata, not logs (docs/kafka-listener.md,
  "Administration"). ``validate_only`` -> the command's ``validate_only``.
* DescribeConfigs -> ``describe_configs`` (read-only), IncrementalAlterConfigs
  -> ``set_config`` (SET; DELETE is a null value); topic (2) and broker (4)
  resources.
* CreateAcls / DescribeAcls / DeleteAcls -> ``add_acl`` / ``list_acls`` /
  ``remove_acl``: Kafka's codes of resource types, pattern types,
  operations and permissions are ours (``metalog.broker.controller.acl``);
  what our model cannot hold (a Group ACL, say) is refused with
  INVALID_REQUEST and a message naming it, never changed into something else.
* UpdateFeatures, AddRaftVoter, RemoveRaftVoter -> the quorum's own handlers.

Where: every controller command is answered by the leader. A node that is
not the leader forwards its client's command to the leader over the peers'
channel, in its own name but carrying the client's principal and host
(``forwarded_for``: Kafka's envelope), after its own gate let the client
through; the leader's gate judges the client again by its ACLs. Kafka's
admin clients send ACL and config requests to any node, so every node must
serve them. The quorum's voter and feature changes (UpdateFeatures,
AddRaftVoter, RemoveRaftVoter) go to the leader whole, in Kafka's Envelope
(KIP-590) with the client's principal and address: a node's certificate may
change its own voter entry, so a node must not ask for them in its own name.
Where no leader is known, or it cannot be reached, the answer is
NOT_CONTROLLER, which Kafka's clients retry.
"""

from __future__ import annotations

import functools
import time
import uuid
from typing import Any, Callable

from metalog.broker.controller import acl as authz
from metalog.broker.controller.commands import VALIDATE_ONLY
from metalog.broker.net.kafka_conn import KafkaExchange
from metalog.broker.server.kafka.api import KafkaApi, KafkaContext
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.protocol.errors import Errors
from metalog.protocol.kafka import messages as km
from metalog.protocol.kafka.edge_quorum import dir_from_kafka
from metalog.protocol.kafka.messages import ZERO_UUID, uuid_to_str
from metalog.storage.metadata_records import RESOURCE_BROKER, RESOURCE_TOPIC

UNKNOWN_TOPIC_ID = 100
COMMAND_TIMEOUT_MS_MAX = 60_000
ACL_PAGES_MAX = 1000  # list_acls pages of 1000: a million ACLs, far above any real cluster
CONFIG_PAGES_MAX = 100  # describe_configs pages of 1000 configs of one resource
# Kafka's codes the filters use besides ours (metalog.broker.controller.acl holds the concrete ones).
ANY, MATCH = 1, 2
# IncrementalAlterConfigs operations and DescribeConfigs' sources (Kafka's numbering).
OP_SET, OP_DELETE = 0, 1
SOURCE_TOPIC, SOURCE_BROKER, SOURCE_BROKER_DEFAULT = 1, 2, 3
KAFKA_DEFAULT_PARTITIONS = KAFKA_DEFAULT_REPLICATION_FACTOR = 1  # num.partitions, default.replication.factor

Answer = Callable[[m.ControllerCommandResponse], None]
# How long a node keeps trying to reach a leader for a Kafka admin request
# (LeaderWait): a few elections' worth, below the clients' request timeouts
# (librdkafka 60 s, Kafka's Admin 30 s).
LEADER_WAIT_MS = 15_000
LEADER_WAIT_TRIES_MAX = 100
_NO_LEADER_CODES = frozenset({Errors.NOT_LEADER_OR_FOLLOWER, Errors.NOT_CONTROLLER})


def _leaderless(resp: Any) -> Any:
    """Kafka's admin clients retry NOT_CONTROLLER at the controller; ours says NOT_LEADER_OR_FOLLOWER."""
    if resp.error_code == Errors.NOT_LEADER_OR_FOLLOWER:
        return type(resp)(error_code=Errors.NOT_CONTROLLER,
                          error_message=resp.error_message or "not the leader (the controller); retry there")
    return resp


def command(ctx: KafkaContext, ex: KafkaExchange, name: str, args: dict[str, Any], on_answer: Answer,
            timeout_ms: int = 5000) -> None:
    """Run controller command `name` for this Kafka request: through this
    node's gate, then at the leader (forwarded for the client if this node
    does not lead, waiting out a leader election: ``LeaderWait``);
    `on_answer` gets the ControllerCommandResponse, a not-the-leader answer
    as Kafka's NOT_CONTROLLER."""
    timeout_ms = min(max(timeout_ms, 1), COMMAND_TIMEOUT_MS_MAX)
    body = m.ControllerCommandRequest(cluster_id=ctx.cluster_id, command=name, args=args, timeout_ms=timeout_ms)
    run_command(ctx, ex, body, lambda resp: on_answer(_leaderless(resp)), wait_for_leader=True)


class LeaderWait:
    """Another attempt while no leader can be reached, as Kafka's brokers
    keep a forwarded request until the active controller is known and
    answers (KIP-590's forwarding manager): a leader killed -9 leaves the
    others without one for an election timeout or two, and the client's
    request, sent to a live node, should land at the next leader rather than
    fail NOT_CONTROLLER -- librdkafka's admin client does not retry that.
    Bounded by ``LEADER_WAIT_MS`` and ``LEADER_WAIT_TRIES_MAX``, backing off
    from 50 ms to 500 ms; never for a request forwarded to this node (its
    forwarder waits) or one whose client has gone."""

    def __init__(self, ctx: KafkaContext, ex: KafkaExchange, attempt: Callable[[], None]):
        self._ctx = ctx
        self._ex = ex
        self._attempt = attempt
        self._deadline_s = time.monotonic() + LEADER_WAIT_MS / 1000
        self._tries = 0

    def start(self) -> None:
        self._attempt()

    def again(self) -> bool:
        """Schedule another attempt (True), or say the wait is over (False)."""
        ex = self._ex
        if (self._tries >= LEADER_WAIT_TRIES_MAX or time.monotonic() >= self._deadline_s or ex.conn.closed
                or ex.answered or self._ctx.is_forwarded(ex)):
            return False
        self._tries += 1
        self._ctx.later(min(0.05 * self._tries, 0.5), self._attempt)
        return True


def run_command(ctx: KafkaContext, ex: KafkaExchange, body: m.ControllerCommandRequest, on_answer: Answer,
                wait_for_leader: bool = False) -> None:
    """``body`` through this node's gate, then at the leader: forwarded for
    the client (its principal and host in ``forwarded_for``) when this node
    does not lead. A command that is itself forwarded is never forwarded
    again: its leader moved, and its forwarder answers its client with ours
    (or, `wait_for_leader`, tries again: ``LeaderWait``)."""
    def settle(resp: m.ControllerCommandResponse) -> None:
        if resp.error_code not in _NO_LEADER_CODES or not (wait_for_leader and wait.again()):
            on_answer(resp)

    def local(resp: m.ControllerCommandResponse) -> None:
        leader = resp.current_leader.leader_id if resp.current_leader is not None else m.NO_LEADER
        if (resp.error_code != Errors.NOT_LEADER_OR_FOLLOWER or leader == ctx.node_id
                or authz.FORWARDED_FOR in body.args):
            on_answer(resp)
            return
        if leader == m.NO_LEADER:
            settle(resp)
            return
        client = {"principal": str(ex.conn.principal), "host": ex.conn.peer_host}
        forwarded = m.ControllerCommandRequest(cluster_id=body.cluster_id, command=body.command,
                                               timeout_ms=body.timeout_ms,
                                               args={**body.args, authz.FORWARDED_FOR: client})
        unreachable = m.ControllerCommandResponse(
            error_code=Errors.NOT_CONTROLLER, error_message=f"node {ctx.node_id} could not reach the leader, "
                                                            f"node {leader}; retry")
        ctx.forward(ex, leader, ApiKey.CONTROLLER_COMMAND, forwarded, settle, unreachable)

    wait = LeaderWait(ctx, ex, lambda: ctx.ask(ex, ApiKey.CONTROLLER_COMMAND, body, local))
    wait.start()


def _chain(ctx: KafkaContext, ex: KafkaExchange, steps: list[tuple[str, dict[str, Any]]], done: Answer,
           timeout_ms: int = 5000) -> None:
    """Run commands one after the other; `done` gets the first refusal, or the last answer."""
    def run(i: int) -> None:
        def next_step(resp: m.ControllerCommandResponse) -> None:
            if resp.error_code != Errors.NONE or i + 1 == len(steps):
                done(resp)
            else:
                run(i + 1)

        command(ctx, ex, steps[i][0], steps[i][1], next_step, timeout_ms)

    if steps:
        run(0)
    else:
        done(m.ControllerCommandResponse())


class _Slots:
    """One Kafka request's results in the request's order, answered once the
    last is in (each filled now, for an edge refusal, or by a command's answer)."""

    def __init__(self, ex: KafkaExchange, count: int, build: Callable[[list[Any]], Any]):
        self._ex = ex
        self._build = build
        self._results: list[Any] = [None] * count
        self._waiting = count
        if count == 0:
            ex.respond(build([]))

    def fill(self, i: int, result: Any) -> None:
        self._results[i] = result
        self._waiting -= 1
        if self._waiting == 0:
            self._ex.respond(self._build(self._results))


def _refusal(code: int, message: str) -> m.ControllerCommandResponse:
    return m.ControllerCommandResponse(error_code=code, error_message=message)


# ------------------------------------------------------------------ topics
def create_topics(ctx: KafkaContext, ex: KafkaExchange) -> None:
    req, version = ex.body, ex.version
    names = [t.name for t in req.topics]

    def build(results: list[Any]) -> Any:
        return km.CreateTopicsResponse(topics=results)

    slots = _Slots(ex, len(req.topics), build)
    for i, topic in enumerate(req.topics):
        _create_topic(ctx, ex, topic, names.count(topic.name) > 1, functools.partial(slots.fill, i))


def _create_topic(ctx: KafkaContext, ex: KafkaExchange, topic: Any, duplicate: bool,
                  fill: Callable[[Any], None]) -> None:
    req, version = ex.body, ex.version
    partitions = KAFKA_DEFAULT_PARTITIONS if topic.num_partitions == -1 else topic.num_partitions
    replication = KAFKA_DEFAULT_REPLICATION_FACTOR if topic.replication_factor == -1 else topic.replication_factor
    topic_id = uuid.uuid4()
    configs = {c.name: c.value for c in topic.configs}

    def result(resp: m.ControllerCommandResponse) -> None:
        out = km.CreateTopicsResponseCreatableTopicResult(name=topic.name, error_code=resp.error_code,
                                                          error_message=resp.error_message)
        if version >= 5 and resp.error_code == Errors.NONE:
            out.num_partitions, out.replication_factor = partitions, replication
            out.configs = [km.CreateTopicsResponseCreatableTopicConfigs(name=k, value=v, config_source=SOURCE_TOPIC)
                           for k, v in sorted(configs.items()) if v is not None]
        if version >= 7 and resp.error_code == Errors.NONE and not req.validate_only:
            out.topic_id = topic_id.bytes
        fill(out)

    if duplicate:
        result(_refusal(Errors.INVALID_REQUEST, f"topic {topic.name!r} is named more than once in the request"))
    elif topic.assignments:
        result(_refusal(Errors.INVALID_REQUEST, "manual replica assignment is not served: metalog places "
                                                "replicas itself (round robin over the live brokers)"))
    else:
        args: dict[str, Any] = {"name": topic.name, "partitions": partitions, "replication_factor": replication,
                                "topic_id": str(topic_id), VALIDATE_ONLY: bool(req.validate_only)}
        steps = [("create_topic", args)]
        if not req.validate_only:  # the configs follow the topic; a set_config cannot fail on a topic that exists
            steps += [("set_config", {"resource_type": RESOURCE_TOPIC, "resource_name": topic.name, "name": k,
                                      "value": v}) for k, v in sorted(configs.items()) if v is not None]
        _chain(ctx, ex, steps, result, req.timeout_ms)


def delete_topics(ctx: KafkaContext, ex: KafkaExchange) -> None:
    req, version = ex.body, ex.version
    asked = [(t.name, t.topic_id) for t in req.topics] if version >= 6 else [(n, ZERO_UUID) for n in req.topic_names]

    def build(results: list[Any]) -> Any:
        return km.DeleteTopicsResponse(responses=results)

    slots = _Slots(ex, len(asked), build)
    for i, (name, topic_id) in enumerate(asked):
        def result(resp: m.ControllerCommandResponse, i: int = i, name: str | None = name,
                   topic_id: bytes = topic_id) -> None:
            out = km.DeleteTopicsResponseDeletableTopicResult(name=name, error_code=resp.error_code)
            if version >= 5:
                out.error_message = resp.error_message
            if version >= 6:
                out.topic_id = topic_id
            slots.fill(i, out)

        if name is None:  # Kafka 2.8+'s delete by id: our commands name topics
            result(_refusal(UNKNOWN_TOPIC_ID, f"deleting by topic id is not served (topic id "
                                              f"{uuid_to_str(topic_id)}): name the topic"))
        else:
            command(ctx, ex, "delete_topic", {"name": name}, result, req.timeout_ms)


def create_partitions(ctx: KafkaContext, ex: KafkaExchange) -> None:
    req = ex.body

    def build(results: list[Any]) -> Any:
        return km.CreatePartitionsResponse(results=results)

    slots = _Slots(ex, len(req.topics), build)
    for i, topic in enumerate(req.topics):
        def result(resp: m.ControllerCommandResponse, i: int = i, name: str = topic.name) -> None:
            slots.fill(i, km.CreatePartitionsResponseCreatePartitionsTopicResult(
                name=name, error_code=resp.error_code, error_message=resp.error_message))

        if topic.assignments is not None:
            result(_refusal(Errors.INVALID_REQUEST, "manual replica assignment is not served: metalog places "
                                                    "replicas itself"))
        else:
            command(ctx, ex, "create_partitions",
                    {"name": topic.name, "count": topic.count, VALIDATE_ONLY: bool(req.validate_only)},
                    result, req.timeout_ms)


# ----------------------------------------------------------------- configs
def _config_resource_problem(resource_type: int) -> str | None:
    if resource_type in (RESOURCE_TOPIC, RESOURCE_BROKER):
        return None
    return f"config resource type {resource_type} is not served: metalog keeps topic (2) and broker (4) configs"


def describe_configs(ctx: KafkaContext, ex: KafkaExchange) -> None:
    req = ex.body

    def build(results: list[Any]) -> Any:
        return km.DescribeConfigsResponse(results=results)

    slots = _Slots(ex, len(req.resources), build)
    for i, res in enumerate(req.resources):
        _describe_resource(ctx, ex, res, functools.partial(slots.fill, i))


def _describe_resource(ctx: KafkaContext, ex: KafkaExchange, res: Any, fill: Callable[[Any], None]) -> None:
    version = ex.version
    keys = None if res.configuration_keys is None else set(res.configuration_keys)
    source = SOURCE_TOPIC if res.resource_type == RESOURCE_TOPIC else (
        SOURCE_BROKER if res.resource_name else SOURCE_BROKER_DEFAULT)
    found: dict[str, str] = {}

    def entry(name: str, value: str) -> Any:
        out = km.DescribeConfigsResponseDescribeConfigsResourceResult(name=name, value=value, read_only=False,
                                                                      is_sensitive=False, config_source=source)
        if version >= 1 and ex.body.include_synonyms:
            out.synonyms = [km.DescribeConfigsResponseDescribeConfigsSynonym(name=name, value=value, source=source)]
        return out

    def finish(resp: m.ControllerCommandResponse) -> None:
        out = km.DescribeConfigsResponseDescribeConfigsResult(
            error_code=resp.error_code, error_message=resp.error_message, resource_type=res.resource_type,
            resource_name=res.resource_name)
        if resp.error_code == Errors.NONE:
            out.configs = [entry(k, v) for k, v in sorted(found.items()) if keys is None or k in keys]
        fill(out)

    def page(after: str | None, pages_left: int) -> None:
        def answer(resp: m.ControllerCommandResponse) -> None:
            if resp.error_code != Errors.NONE:
                finish(resp)
                return
            found.update(resp.result["configs"])
            cursor = resp.result["next"]
            if cursor is None or pages_left <= 1:
                finish(resp if cursor is None else _refusal(Errors.INVALID_REQUEST, "too many configs to describe"))
            else:
                page(cursor, pages_left - 1)

        command(ctx, ex, "describe_configs", {"resource_type": res.resource_type, "resource_name": res.resource_name,
                                              "after": after}, answer)

    problem = _config_resource_problem(res.resource_type)
    if problem is not None:
        finish(_refusal(Errors.INVALID_REQUEST, problem))
    else:
        page(None, CONFIG_PAGES_MAX)


def incremental_alter_configs(ctx: KafkaContext, ex: KafkaExchange) -> None:
    req = ex.body

    def build(results: list[Any]) -> Any:
        return km.IncrementalAlterConfigsResponse(responses=results)

    slots = _Slots(ex, len(req.resources), build)
    for i, res in enumerate(req.resources):
        def result(resp: m.ControllerCommandResponse, i: int = i, res: Any = res) -> None:
            slots.fill(i, km.IncrementalAlterConfigsResponseAlterConfigsResourceResponse(
                error_code=resp.error_code, error_message=resp.error_message, resource_type=res.resource_type,
                resource_name=res.resource_name))

        problem = _config_resource_problem(res.resource_type) or _alter_problem(res.configs)
        if problem is not None:
            code = Errors.INVALID_REQUEST if res.resource_type not in (RESOURCE_TOPIC, RESOURCE_BROKER) \
                else Errors.INVALID_CONFIG
            result(_refusal(code, problem))
            continue
        # One set_config per entry, in order: a resource's changes are not one record batch
        # (docs/kafka-listener.md); the first refusal is the resource's answer.
        steps = [("set_config", {"resource_type": res.resource_type, "resource_name": res.resource_name,
                                 "name": c.name, "value": c.value if c.config_operation == OP_SET else None,
                                 VALIDATE_ONLY: bool(req.validate_only)}) for c in res.configs]
        _chain(ctx, ex, steps, result)


def _alter_problem(configs: list[Any]) -> str | None:
    for c in configs:
        if c.config_operation not in (OP_SET, OP_DELETE):
            return (f"{c.name}: operation {c.config_operation} (APPEND 2 / SUBTRACT 3) is not served: metalog "
                    f"keeps config values as text, not lists; SET the whole value")
        if c.config_operation == OP_SET and c.value is None:
            return f"{c.name}: SET needs a value"
    names = [c.name for c in configs]
    dup = next((n for n in names if names.count(n) > 1), None)
    return None if dup is None else f"{dup}: named more than once"


def _api(request_name: str, lo: int, hi: int, handle: Any) -> KafkaApi:
    request = getattr(km, request_name)
    return KafkaApi(request, max(lo, request.LOWEST_VERSION), min(hi, request.HIGHEST_VERSION), handle)


# -------------------------------------------------------------------- ACLs
# Kafka's names of the codes our model has no member for (in refusals' messages).
_KAFKA_NAMES = {
    authz.ResourceType: {0: "UNKNOWN", 1: "ANY", 3: "GROUP", 5: "TRANSACTIONAL_ID", 6: "DELEGATION_TOKEN",
                         7: "USER"},
    authz.PatternType: {0: "UNKNOWN", 1: "ANY", 2: "MATCH"},
    authz.Operation: {0: "UNKNOWN", 1: "ANY", 13: "CREATE_TOKENS", 14: "DESCRIBE_TOKENS", 15: "TWO_PHASE_COMMIT"},
    authz.Permission: {0: "UNKNOWN", 1: "ANY"},
}
AclCodes = tuple[int, str, int, str, str, int, int]  # resource type, name, pattern type, principal, host, op, permission


def _member(cls: Any, code: int) -> str:
    """Our member's name for Kafka's code; ValueError naming what our ACLs hold."""
    try:
        return str(cls(code).name)
    except ValueError:
        name = _KAFKA_NAMES[cls].get(code, "unknown")
        served = ", ".join(f"{authz.pretty_name(x)} ({int(x)})" for x in cls)
        raise ValueError(f"ACL {cls.__name__} {code} ({name}) is not served: metalog's ACLs hold {served}") from None


def _codes(acl: dict[str, Any]) -> AclCodes:
    """An ACL of list_acls (our names) as Kafka's codes."""
    return (int(authz.parse_enum(authz.ResourceType, acl["resource_type"])), acl["resource_name"],
            int(authz.parse_enum(authz.PatternType, acl["pattern_type"])), acl["principal"], acl["host"],
            int(authz.parse_enum(authz.Operation, acl["operation"])),
            int(authz.parse_enum(authz.Permission, acl["permission"])))


def create_acls(ctx: KafkaContext, ex: KafkaExchange) -> None:
    creations = ex.body.creations
    slots = _Slots(ex, len(creations), lambda results: km.CreateAclsResponse(results=results))
    for i, c in enumerate(creations):
        def result(resp: m.ControllerCommandResponse, i: int = i) -> None:
            slots.fill(i, km.CreateAclsResponseAclCreationResult(error_code=resp.error_code,
                                                                 error_message=resp.error_message))

        try:
            args = {"resource_type": _member(authz.ResourceType, c.resource_type), "resource_name": c.resource_name,
                    "pattern_type": _member(authz.PatternType, c.resource_pattern_type), "principal": c.principal,
                    "host": c.host, "operation": _member(authz.Operation, c.operation),
                    "permission": _member(authz.Permission, c.permission_type)}
        except ValueError as exc:
            result(_refusal(Errors.INVALID_REQUEST, str(exc)))
            continue
        command(ctx, ex, "add_acl", args, result)


def _all_acls(ctx: KafkaContext, ex: KafkaExchange,
              done: Callable[[m.ControllerCommandResponse, list[dict[str, Any]]], None]) -> None:
    """Every ACL, page by page of list_acls, from the leader."""
    acls: list[dict[str, Any]] = []

    def page(after: str | None, pages_left: int) -> None:
        def answer(resp: m.ControllerCommandResponse) -> None:
            if resp.error_code != Errors.NONE:
                done(resp, [])
                return
            acls.extend(resp.result["acls"])
            cursor = resp.result["next"]
            if cursor is None:
                done(resp, acls)
            elif pages_left <= 1:
                done(_refusal(Errors.INVALID_REQUEST, f"more than {ACL_PAGES_MAX} pages of ACLs"), [])
            else:
                page(cursor, pages_left - 1)

        command(ctx, ex, "list_acls", {} if after is None else {"after": after}, answer)

    page(None, ACL_PAGES_MAX)


def _filter(f: Any) -> tuple[int, str | None, int, str | None, str | None, int, int]:
    """Kafka's filter fields (DescribeAcls' request or a DeleteAcls filter) as one tuple."""
    return (f.resource_type_filter, f.resource_name_filter, f.pattern_type_filter, f.principal_filter,
            f.host_filter, f.operation, f.permission_type)


def _filter_problem(f: tuple[int, str | None, int, str | None, str | None, int, int]) -> str | None:
    if 0 in (f[0], f[2], f[5], f[6]):
        return "an ACL filter may not hold UNKNOWN (0)"
    return None


def _matches(f: tuple[int, str | None, int, str | None, str | None, int, int], acl: AclCodes) -> bool:
    """Kafka's AclBindingFilter.matches, over our ACLs."""
    rtype, name, ptype, principal, host, op, perm = acl
    f_rtype, f_name, f_ptype, f_principal, f_host, f_op, f_perm = f
    if f_ptype == MATCH:  # what applies to the named resource: itself, '*', or a prefix of it
        pattern_ok = f_name is None or (ptype == authz.PatternType.LITERAL and name in (f_name, authz.WILDCARD)) or (
            ptype == authz.PatternType.PREFIXED and f_name.startswith(name))
    else:
        pattern_ok = f_ptype in (ANY, ptype) and (f_name is None or f_name == name)
    return (pattern_ok and f_rtype in (ANY, rtype) and f_principal in (None, principal) and f_host in (None, host)
            and f_op in (ANY, op) and f_perm in (ANY, perm))


def describe_acls(ctx: KafkaContext, ex: KafkaExchange) -> None:
    f = _filter(ex.body)

    def answer(resp: m.ControllerCommandResponse, acls: list[dict[str, Any]]) -> None:
        out = km.DescribeAclsResponse(error_code=resp.error_code, error_message=resp.error_message)
        groups: dict[tuple[int, str, int], list[Any]] = {}
        for acl in map(_codes, acls):
            if _matches(f, acl):
                groups.setdefault(acl[:3], []).append(km.DescribeAclsResponseAclDescription(
                    principal=acl[3], host=acl[4], operation=acl[5], permission_type=acl[6]))
        out.resources = [km.DescribeAclsResponseDescribeAclsResource(resource_type=rt, resource_name=name,
                                                                     pattern_type=pt, acls=descs)
                         for (rt, name, pt), descs in groups.items()]
        ex.respond(out)

    problem = _filter_problem(f)
    if problem is not None:
        ex.respond(km.DescribeAclsResponse(error_code=Errors.INVALID_REQUEST, error_message=problem))
    else:
        _all_acls(ctx, ex, answer)


def delete_acls(ctx: KafkaContext, ex: KafkaExchange) -> None:
    """Every ACL matching any filter is removed (one remove_acl per binding,
    one after the other); each filter's result lists what it matched."""
    filters = [_filter(f) for f in ex.body.filters]

    def matched(resp: m.ControllerCommandResponse, acls: list[dict[str, Any]]) -> None:
        if resp.error_code != Errors.NONE:
            ex.respond(km.DeleteAclsResponse(filter_results=[km.DeleteAclsResponseDeleteAclsFilterResult(
                error_code=resp.error_code, error_message=resp.error_message) for _ in filters]))
            return
        per_filter = [[a for a in acls if _filter_problem(f) is None and _matches(f, _codes(a))] for f in filters]
        bindings = list({_codes(a): a for found in per_filter for a in found}.items())
        outcome: dict[AclCodes, m.ControllerCommandResponse] = {}

        def remove(i: int) -> None:
            if i == len(bindings):
                ex.respond(_delete_acls_response(filters, per_filter, outcome))
                return
            key, acl = bindings[i]

            def removed(r: m.ControllerCommandResponse) -> None:
                outcome[key] = r
                remove(i + 1)

            command(ctx, ex, "remove_acl", {k: v for k, v in acl.items() if k != "id"}, removed)

        remove(0)

    _all_acls(ctx, ex, matched)


def _delete_acls_response(filters: list[Any], per_filter: list[list[dict[str, Any]]],
                          outcome: dict[AclCodes, m.ControllerCommandResponse]) -> Any:
    results = []
    for f, found in zip(filters, per_filter):
        problem = _filter_problem(f)
        if problem is not None:
            results.append(km.DeleteAclsResponseDeleteAclsFilterResult(error_code=Errors.INVALID_REQUEST,
                                                                       error_message=problem))
            continue
        matching = []
        for acl in map(_codes, found):
            r = outcome[acl]
            matching.append(km.DeleteAclsResponseDeleteAclsMatchingAcl(
                error_code=r.error_code, error_message=r.error_message, resource_type=acl[0], resource_name=acl[1],
                pattern_type=acl[2], principal=acl[3], host=acl[4], operation=acl[5], permission_type=acl[6]))
        results.append(km.DeleteAclsResponseDeleteAclsFilterResult(matching_acls=matching))
    return km.DeleteAclsResponse(filter_results=results)


# ------------------------------------------------- features and voters (the core's handlers)
def _leader_code(code: int) -> int:
    return Errors.NOT_CONTROLLER if code == Errors.NOT_LEADER_OR_FOLLOWER else code


def _at_leader(ctx: KafkaContext, ex: KafkaExchange, api_key: ApiKey, body: m.Body,
               answer: Callable[[Any], None]) -> None:
    """One of the quorum's own admin requests: this node's answer, unless it
    does not lead. Then the client's request goes to the leader whole, in an
    Envelope with the client's principal and address
    (``KafkaContext.forward_request``), so the leader's gate judges the
    client -- a node's own certificate may change its own voter entry, so the
    node must not ask in its own name. While no leader can be reached it
    tries again (``LeaderWait``); then `answer` gets this node's answer
    (NOT_CONTROLLER, once mapped)."""
    def local(resp: Any) -> None:
        leader = ctx.leader_id() if resp.error_code == Errors.NOT_LEADER_OR_FOLLOWER else ctx.node_id
        if leader == ctx.node_id:
            answer(resp)
        elif leader == m.NO_LEADER:
            if not wait.again():
                answer(resp)
        else:
            ctx.forward_request(ex, leader, lambda: None if wait.again() else answer(resp))

    wait = LeaderWait(ctx, ex, lambda: ctx.ask(ex, api_key, body, local))
    wait.start()


def update_features(ctx: KafkaContext, ex: KafkaExchange) -> None:
    req, version = ex.body, ex.version
    updates = [m.FeatureUpdate(u.feature, u.max_version_level,
                               u.upgrade_type if version >= 1 else (2 if u.allow_downgrade else 1))
               for u in req.feature_updates]
    body = m.UpdateFeaturesRequest(cluster_id=ctx.cluster_id, feature_updates=updates, timeout_ms=req.timeout_ms,
                                   validate_only=bool(version >= 1 and req.validate_only))

    def answer(resp: m.UpdateFeaturesResponse) -> None:
        out = km.UpdateFeaturesResponse(error_code=_leader_code(resp.error_code), error_message=resp.error_message)
        if version < 2:  # v2 answers with the top-level error only
            out.results = [km.UpdateFeaturesResponseUpdatableFeatureResult(
                feature=r.feature, error_code=_leader_code(r.error_code), error_message=r.error_message)
                for r in resp.results]
        ex.respond(out)

    _at_leader(ctx, ex, ApiKey.UPDATE_FEATURES, body, answer)


def add_raft_voter(ctx: KafkaContext, ex: KafkaExchange) -> None:
    req = ex.body
    body = m.AddRaftVoterRequest(
        cluster_id=ctx.cluster_id if req.cluster_id is None else req.cluster_id, voter_id=req.voter_id,
        voter_directory_id=dir_from_kafka(req.voter_directory_id), timeout_ms=req.timeout_ms,
        listeners=[m.RaftListener(ln.name, ln.host, ln.port) for ln in req.listeners])
    _at_leader(ctx, ex, ApiKey.ADD_RAFT_VOTER, body, lambda resp: ex.respond(km.AddRaftVoterResponse(
        error_code=_leader_code(resp.error_code), error_message=resp.error_message)))


def remove_raft_voter(ctx: KafkaContext, ex: KafkaExchange) -> None:
    req = ex.body
    body = m.RemoveRaftVoterRequest(cluster_id=ctx.cluster_id if req.cluster_id is None else req.cluster_id,
                                    voter_id=req.voter_id, voter_directory_id=dir_from_kafka(req.voter_directory_id))
    _at_leader(ctx, ex, ApiKey.REMOVE_RAFT_VOTER, body, lambda resp: ex.respond(km.RemoveRaftVoterResponse(
        error_code=_leader_code(resp.error_code), error_message=resp.error_message)))


APIS: dict[int, KafkaApi] = {
    19: _api("CreateTopicsRequest", 2, 7, create_topics),
    20: _api("DeleteTopicsRequest", 1, 6, delete_topics),
    37: _api("CreatePartitionsRequest", 0, 3, create_partitions),
    32: _api("DescribeConfigsRequest", 1, 4, describe_configs),
    44: _api("IncrementalAlterConfigsRequest", 0, 1, incremental_alter_configs),
    30: _api("CreateAclsRequest", 1, 3, create_acls),
    29: _api("DescribeAclsRequest", 1, 3, describe_acls),
    31: _api("DeleteAclsRequest", 1, 3, delete_acls),
    57: _api("UpdateFeaturesRequest", 0, 2, update_features),
    80: _api("AddRaftVoterRequest", 0, 1, add_raft_voter),
    81: _api("RemoveRaftVoterRequest", 0, 0, remove_raft_voter),
}
