"""The authorization gate: who may send which request, decided in one place.

``authorize(principal, host, api_key, body, view)`` is a pure function (no
I/O, no clock) that the runtime calls for every request before anything
else sees it, including the requests the quorum core handles. It returns
``None`` (allowed) or a ``Denial`` saying what was refused and with which
Kafka error code. Two kinds of rules:

* **Replica identity binding.** A replica RPC (Vote, BeginQuorumEpoch,
  EndQuorumEpoch, Fetch or OffsetsForLeaderEpoch with a replica id >= 0,
  FetchSnapshot, UpdateRaftVoter) is accepted only from the principal
  ``Node:<that very id>``,
  and for Vote/BeginQuorumEpoch/EndQuorumEpoch only if that id is a voter
  (Vote: of the static set only; with the set in the log, KIP-853, the
  quorum core checks the candidate, as our set may lag its)
  (Fetch and FetchSnapshot: any node certificate of the cluster CA, so
  observers can replicate). No ACL and no ``super_users`` entry can grant
  this: a user certificate never acts as a replica. Refused with
  CLUSTER_AUTHORIZATION_FAILED.
* **ACLs** (Kafka's model, default deny). Resource types Topic and Cluster,
  patterns LITERAL (``*`` matches every name) and PREFIXED, operations
  incl. All, permission Allow/Deny with Deny winning, host ``*`` or an
  address, principal ``User:<name>``, ``Node:<id>`` or ``User:*``. Read,
  Write and Alter imply Describe (as in Kafka). ``super_users`` bypass ACLs;
  node principals may Describe the cluster without an ACL.

  ======================================  =========  ==================
  request                                 operation  resource
  ======================================  =========  ==================
  Produce                                 Write      topic metadata log
  Fetch (replica id -1), ListOffsets,     Read       topic metadata log
  OffsetsForLeaderEpoch (replica id -1)
  DescribeQuorum                          Describe   cluster
  AddRaftVoter, RemoveRaftVoter,          Alter      cluster
  UpdateFeatures                          (a node's own certificate may add or
                                          remove its own node id: KIP-1186)
  ControllerCommand add_acl/remove_acl    Alter      cluster
  ControllerCommand list_acls,            Describe   cluster
  describe_configs
  any other ControllerCommand             Write      cluster
  ApiVersions, Metadata                   (open to every authenticated peer)
  ======================================  =========  ==================

A ControllerCommand whose args hold ``forwarded_for`` ({"principal", "host"})
is a node forwarding its client's command to the leader (the Kafka
listener, metalog.broker.server.kafka.admin; Kafka's envelope, KIP-590):
only a node certificate may send one, and the leader judges the named
client principal and host by the rule above, with its own ACLs.

Metadata is open as in Kafka, where any authenticated client learns the
brokers and the controller: a client must find the leader before it can be
told what it may do there. The log's own figures in it (high watermark, log
start, observers) are blanked unless the principal may Describe the topic or
the cluster (``may_describe_log``); Read and Write on the topic imply that.

With authorization off (the opt-in PLAINTEXT mode, where every connection is
``User:ANONYMOUS``) everything is allowed: ANONYMOUS is treated as a super
user and no identity can be bound. The runtime says so loudly.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable

from metalog.broker.net.principal import Principal
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.protocol.errors import Errors
from metalog.protocol.invariants import InvariantViolation
from metalog.storage import metadata_records as r

METADATA_TOPIC = "__cluster_metadata"
CLUSTER_RESOURCE_NAME = "kafka-cluster"  # Kafka's name for the one cluster resource
WILDCARD = "*"


class ResourceType(enum.IntEnum):  # Kafka's ResourceType codes
    TOPIC = 2
    CLUSTER = 4


class PatternType(enum.IntEnum):  # Kafka's PatternType codes
    LITERAL = 3
    PREFIXED = 4


class Operation(enum.IntEnum):  # Kafka's AclOperation codes
    ALL = 2
    READ = 3
    WRITE = 4
    CREATE = 5
    DELETE = 6
    ALTER = 7
    DESCRIBE = 8
    CLUSTER_ACTION = 9
    DESCRIBE_CONFIGS = 10
    ALTER_CONFIGS = 11
    IDEMPOTENT_WRITE = 12


class Permission(enum.IntEnum):  # Kafka's AclPermissionType codes
    DENY = 2
    ALLOW = 3


# An Allow for any of these also allows Describe (Kafka's implication rule).
_IMPLIES_DESCRIBE = frozenset({Operation.READ, Operation.WRITE, Operation.DELETE, Operation.ALTER})

# Requests that may carry a replica claim: checked even for super users.
REPLICA_APIS = frozenset({ApiKey.VOTE, ApiKey.BEGIN_QUORUM_EPOCH, ApiKey.END_QUORUM_EPOCH, ApiKey.FETCH_SNAPSHOT,
                          ApiKey.FETCH, ApiKey.OFFSET_FOR_LEADER_EPOCH, ApiKey.CONSISTENCY_CHECK,
                          ApiKey.UPDATE_RAFT_VOTER})

# ControllerCommand args key: the client a node forwards the command for (see the module doc).
FORWARDED_FOR = "forwarded_for"

# ControllerCommand name -> the cluster operation it needs.
ACL_COMMANDS_ALTER = frozenset({"add_acl", "remove_acl"})
ACL_COMMANDS_DESCRIBE = frozenset({"list_acls", "describe_configs"})
# Kafka brokers' BrokerRegistration and BrokerHeartbeat (commands.LIFECYCLE): ClusterAction on
# the cluster as in Kafka, and a node certificate (Node:<id>) acts for broker <id> only.
BROKER_LIFECYCLE_COMMANDS = frozenset({"broker_registration", "broker_heartbeat", "allocate_producer_ids"})


def pretty_name(enum_value: enum.IntEnum) -> str:
    """``Operation.CLUSTER_ACTION`` -> ``ClusterAction`` (the spelling Kafka's tools use)."""
    return "".join(part.capitalize() for part in enum_value.name.split("_"))


def parse_enum(cls: type[enum.IntEnum], text: str) -> enum.IntEnum:
    """Case-insensitive, with or without underscores: ``Write``, ``cluster-action``."""
    norm = text.replace("-", "").replace("_", "").lower()
    for member in cls:
        if member.name.replace("_", "").lower() == norm:
            return member
    choices = ", ".join(pretty_name(x) for x in cls)
    raise ValueError(f"unknown {cls.__name__} {text!r}; one of: {choices}")


# ---------------------------------------------------------------- ACL records


def acl_problem(rec: r.AccessControlEntry) -> str | None:
    """Why an ACL record is malformed (then the controller ignores it), or None."""
    if not rec.id:
        return "empty id"
    if rec.resource_type not in ResourceType._value2member_map_:
        return f"unknown resource type {rec.resource_type}"
    if rec.pattern_type not in PatternType._value2member_map_:
        return f"unknown pattern type {rec.pattern_type}"
    if rec.operation not in Operation._value2member_map_:
        return f"unknown operation {rec.operation}"
    if rec.permission_type not in Permission._value2member_map_:
        return f"unknown permission type {rec.permission_type}"
    if not rec.resource_name:
        return "empty resource name"
    if rec.resource_type == ResourceType.CLUSTER and rec.resource_name != CLUSTER_RESOURCE_NAME:
        return f"the cluster resource is named {CLUSTER_RESOURCE_NAME!r}, got {rec.resource_name!r}"
    if not rec.host:
        return "empty host (use '*' for any host)"
    if rec.principal != "User:*":
        try:
            Principal.parse(rec.principal)
        except ValueError as exc:
            return str(exc)
    return None


def new_acl(principal: str, operation: Operation, permission: Permission, resource_type: ResourceType,
            resource_name: str, pattern_type: PatternType = PatternType.LITERAL, host: str = WILDCARD,
            acl_id: str | None = None) -> r.AccessControlEntry:
    """A validated ACL record; ValueError names the bad field."""
    rec = r.AccessControlEntry(acl_id or str(uuid.uuid4()), int(resource_type), resource_name,
                               int(pattern_type), principal, host, int(operation), int(permission))
    problem = acl_problem(rec)
    if problem:
        raise ValueError(f"bad ACL: {problem}")
    return rec


def same_binding(a: r.AccessControlEntry, b: r.AccessControlEntry) -> bool:
    """Equal in everything but the id."""
    return (a.resource_type, a.resource_name, a.pattern_type, a.principal, a.host, a.operation,
            a.permission_type) == (b.resource_type, b.resource_name, b.pattern_type, b.principal,
                                   b.host, b.operation, b.permission_type)


def acl_to_dict(rec: r.AccessControlEntry) -> dict:
    return {
        "id": rec.id, "principal": rec.principal, "host": rec.host,
        "operation": pretty_name(Operation(rec.operation)),
        "permission": pretty_name(Permission(rec.permission_type)),
        "resource_type": pretty_name(ResourceType(rec.resource_type)),
        "resource_name": rec.resource_name,
        "pattern_type": PatternType(rec.pattern_type).name,
    }


def acl_to_text(rec: r.AccessControlEntry) -> str:
    """One line, in the words of Kafka's kafka-acls tool."""
    d = acl_to_dict(rec)
    return (f"{d['principal']} has {d['permission']} permission for operation {d['operation']} "
            f"from host {d['host']} on {d['resource_type']}:{d['pattern_type']}:{d['resource_name']}")


# ---------------------------------------------------------------- decisions


@dataclass(frozen=True)
class AuthzView:
    """What the gate needs to know about the cluster, taken from the config
    and the controller's applied (committed) state."""

    enabled: bool
    voters: frozenset[int]
    super_users: frozenset[str] = frozenset()
    # KIP-853: the voter set lives in the log, and ours may lag a candidate's
    # (a voter just added asks for votes before we replicated its record).
    voters_in_log: bool = False
    acls: Iterable[r.AccessControlEntry] = field(default_factory=tuple)


@dataclass(frozen=True)
class Denial:
    error_code: int
    principal: str
    api: str
    operation: str  # "Write", or "ReplicaAction" for identity binding
    resource: str  # "Topic:__cluster_metadata", "Cluster:kafka-cluster"
    reason: str

    def message(self) -> str:
        """What the client sees (the CLI prints it after ``error:``)."""
        rtype, _, name = self.resource.partition(":")
        return (f"not authorized: {self.principal} may not {self.operation} {rtype.lower()} {name}"
                f" ({self.reason})")


def _name_matches(rec: r.AccessControlEntry, name: str) -> bool:
    if rec.pattern_type == PatternType.PREFIXED:
        return name.startswith(rec.resource_name)
    return rec.resource_name == name or rec.resource_name == WILDCARD


def _principal_matches(acl_principal: str, principal: Principal, principal_text: str) -> bool:
    return acl_principal == principal_text or (acl_principal == "User:*" and principal.kind == "User")


def acl_allows(acls: Iterable[r.AccessControlEntry], principal: Principal, host: str, operation: Operation,
               resource_type: ResourceType, resource_name: str) -> bool:
    """Kafka's rule: denied if any matching Deny ACL covers the operation (or
    All); else allowed if a matching Allow covers it (or All, or implies it);
    else denied (default deny)."""
    text = str(principal)
    allowed = False
    for rec in acls:
        if rec.resource_type != resource_type or not _principal_matches(rec.principal, principal, text):
            continue
        if rec.host != WILDCARD and rec.host != host:
            continue
        if not _name_matches(rec, resource_name):
            continue
        op = rec.operation
        if rec.permission_type == Permission.DENY:
            if op == operation or op == Operation.ALL:
                return False
        elif op == operation or op == Operation.ALL or (
                operation == Operation.DESCRIBE and op in _IMPLIES_DESCRIBE):
            allowed = True
    return allowed


def _deny_replica(principal: Principal, api: ApiKey, claimed_id: int, reason: str) -> Denial:
    return Denial(Errors.CLUSTER_AUTHORIZATION_FAILED, str(principal), api.name, "ReplicaAction",
                  f"Cluster:{CLUSTER_RESOURCE_NAME}", f"as replica {claimed_id}: {reason}")


def _check_replica(principal: Principal, api: ApiKey, claimed_id: int, view: AuthzView,
                   voter_only: bool) -> Denial | None:
    node_id = principal.node_id
    if node_id is None:
        return _deny_replica(principal, api, claimed_id, "a user certificate cannot act as a replica")
    if node_id != claimed_id:
        return _deny_replica(principal, api, claimed_id, f"the certificate is for node {node_id}")
    if voter_only and claimed_id not in view.voters:
        return _deny_replica(principal, api, claimed_id, "not a voter of this cluster")
    return None


def _required(api_key: ApiKey, body: m.Body) -> tuple[Operation, ResourceType, str] | None:
    """The (operation, resource) a client request needs; None for ApiVersions."""
    if api_key in (ApiKey.PRODUCE, ApiKey.INIT_PRODUCER_ID):
        # InitProducerId needs what Produce needs: Write on the log. (Kafka also
        # accepts IdempotentWrite on the cluster; with one log, Write on it is
        # exactly "may produce", so one ACL covers both.)
        return Operation.WRITE, ResourceType.TOPIC, METADATA_TOPIC
    if api_key in (ApiKey.FETCH, ApiKey.LIST_OFFSETS, ApiKey.OFFSET_FOR_LEADER_EPOCH):
        return Operation.READ, ResourceType.TOPIC, METADATA_TOPIC
    if api_key is ApiKey.DESCRIBE_QUORUM:
        return Operation.DESCRIBE, ResourceType.CLUSTER, CLUSTER_RESOURCE_NAME
    if api_key in (ApiKey.ADD_RAFT_VOTER, ApiKey.REMOVE_RAFT_VOTER, ApiKey.UPDATE_FEATURES):
        return Operation.ALTER, ResourceType.CLUSTER, CLUSTER_RESOURCE_NAME  # as Kafka (KIP-853, KIP-584)
    if api_key is ApiKey.CONTROLLER_COMMAND:
        if body.command in BROKER_LIFECYCLE_COMMANDS:
            return Operation.CLUSTER_ACTION, ResourceType.CLUSTER, CLUSTER_RESOURCE_NAME
        if body.command in ACL_COMMANDS_ALTER:
            return Operation.ALTER, ResourceType.CLUSTER, CLUSTER_RESOURCE_NAME
        if body.command in ACL_COMMANDS_DESCRIBE:
            return Operation.DESCRIBE, ResourceType.CLUSTER, CLUSTER_RESOURCE_NAME
        return Operation.WRITE, ResourceType.CLUSTER, CLUSTER_RESOURCE_NAME
    if api_key in (ApiKey.API_VERSIONS, ApiKey.METADATA):
        return None
    raise InvariantViolation(f"no authorization rule for {api_key!r}")  # a new api must get one


def authorize_operation(principal: Principal, host: str, operation: Operation, resource_type: ResourceType,
                        resource_name: str, view: AuthzView, api: str) -> Denial | None:
    """The ACL half of the gate (also used by the admin HTTP API)."""
    if not view.enabled:
        return None
    text = str(principal)
    if text in view.super_users:
        return None
    if principal.kind == "Node" and operation == Operation.DESCRIBE and resource_type == ResourceType.CLUSTER:
        return None
    if acl_allows(view.acls, principal, host, operation, resource_type, resource_name):
        return None
    code = Errors.TOPIC_AUTHORIZATION_FAILED if resource_type == ResourceType.TOPIC \
        else Errors.CLUSTER_AUTHORIZATION_FAILED
    return Denial(code, text, api, pretty_name(operation), f"{pretty_name(resource_type)}:{resource_name}",
                  Errors(code).name)


def may_describe_log(principal: Principal, host: str, view: AuthzView) -> bool:
    """Whether Metadata may show the log's figures (HW, log start, observers)."""
    return any(authorize_operation(principal, host, Operation.DESCRIBE, rtype, name, view, "METADATA") is None
               for rtype, name in ((ResourceType.TOPIC, METADATA_TOPIC),
                                   (ResourceType.CLUSTER, CLUSTER_RESOURCE_NAME)))


def authorize(principal: Principal, host: str, api_key: ApiKey, body: m.Body, view: AuthzView) -> Denial | None:
    """None if `principal` (connected from `host`) may send this request."""
    if not view.enabled:
        return None
    if api_key is ApiKey.VOTE:
        # With the set in the log, the core judges the candidate against it
        # (a node id the set names with another directory is refused there).
        return _check_replica(principal, api_key, body.candidate_id, view, voter_only=not view.voters_in_log)
    if api_key is ApiKey.CONSISTENCY_CHECK:
        # Only the leader asks; the answer describes this voter's log to that voter alone.
        return _check_replica(principal, api_key, body.leader_id, view, voter_only=True)
    if api_key in (ApiKey.BEGIN_QUORUM_EPOCH, ApiKey.END_QUORUM_EPOCH):
        denial = _check_replica(principal, api_key, body.leader_id, view, voter_only=True)
        if denial is None and api_key is ApiKey.END_QUORUM_EPOCH:
            strangers = [x for x in body.preferred_successors if x not in view.voters]
            if strangers:
                return _deny_replica(principal, api_key, body.leader_id,
                                     f"preferred successors {strangers} are not voters")
        return denial
    if api_key is ApiKey.FETCH_SNAPSHOT:
        return _check_replica(principal, api_key, body.replica_id, view, voter_only=False)
    if (api_key in (ApiKey.ADD_RAFT_VOTER, ApiKey.REMOVE_RAFT_VOTER) and principal.node_id is not None
            and principal.node_id == body.voter_id):
        # KIP-1186 auto-join: a node adds itself, or removes its own stale
        # identity (its wiped disk), with its node certificate; any other
        # voter change needs Alter on the cluster.
        return None
    if api_key is ApiKey.UPDATE_RAFT_VOTER:
        # Kafka: CLUSTER_ACTION, i.e. a replica RPC: a voter updates its own entry only.
        return _check_replica(principal, api_key, body.voter_id, view, voter_only=True)
    if api_key in (ApiKey.FETCH, ApiKey.OFFSET_FOR_LEADER_EPOCH) and body.replica_id != m.CONSUMER_REPLICA_ID:
        # Any other id (even a negative one other than the consumer's) is a replica claim.
        return _check_replica(principal, api_key, body.replica_id, view, voter_only=False)
    if api_key is ApiKey.INIT_PRODUCER_ID and principal.node_id is not None:
        # A node asks the leader for a producer id on behalf of a client its own
        # gate admitted (metalog.broker.server.produce: as Kafka's brokers ask
        # their controller); an id is no data, and no write follows from it.
        return None
    if api_key is ApiKey.CONTROLLER_COMMAND and body.command in BROKER_LIFECYCLE_COMMANDS:
        return _authorize_broker_lifecycle(principal, host, body, view)
    if api_key is ApiKey.CONTROLLER_COMMAND and FORWARDED_FOR in body.args:
        return _authorize_forwarded(principal, body, view)
    need = _required(api_key, body)
    if need is None:
        return None
    operation, resource_type, name = need
    return authorize_operation(principal, host, operation, resource_type, name, view, api_key.name)


def _authorize_broker_lifecycle(principal: Principal, host: str, body: Any, view: AuthzView) -> Denial | None:
    """A broker's registration, heartbeat or request for producer ids: from the broker itself (its node
    certificate names its id; the replica-identity binding) or from a
    principal with ClusterAction on the cluster; never forwarded."""
    api = ApiKey.CONTROLLER_COMMAND
    try:
        broker_id = int(body.args["broker_id"])
    except (KeyError, TypeError, ValueError):
        broker_id = -1
    if FORWARDED_FOR in body.args:
        return _deny_replica(principal, api, broker_id, "a broker's registration is never forwarded")
    if principal.node_id is not None:
        return _check_replica(principal, api, broker_id, view, voter_only=False)
    return authorize_operation(principal, host, Operation.CLUSTER_ACTION, ResourceType.CLUSTER,
                               CLUSTER_RESOURCE_NAME, view, api.name)


def _authorize_forwarded(principal: Principal, body: Any, view: AuthzView) -> Denial | None:
    """A node speaks for a client its own gate admitted (Kafka's envelope):
    the client's principal and host are judged here, by this node's ACLs."""
    api = ApiKey.CONTROLLER_COMMAND
    if principal.node_id is None:
        return _deny_replica(principal, api, -1, "only a node certificate may forward a client's command")
    client = body.args[FORWARDED_FOR]
    try:
        client_principal = Principal.parse(str(client["principal"]))
        client_host = str(client["host"])
    except (KeyError, TypeError, ValueError) as exc:
        return _deny_replica(principal, api, principal.node_id, f"bad {FORWARDED_FOR}: {exc}")
    operation, resource_type, name = _required(api, body) or (Operation.WRITE, ResourceType.CLUSTER,
                                                                CLUSTER_RESOURCE_NAME)
    return authorize_operation(client_principal, client_host, operation, resource_type, name, view, api.name)
