"""The broker's authorization gate: every request passes it before anything
else sees it (the quorum core included).

Decisions come from ``metalog.broker.controller.acl`` (pure policy); this module keeps them
cheap on the hot path and bounded: the view of the ACLs is rebuilt only when
the controller's committed ACLs change, each connection caches its decisions
under one view (a client's per (api, command), a replica's Fetch per (api,
claimed id)), a super user's client requests skip the ACL walk, and each
connection logs one ``authorization_failed`` event per distinct denial (at
most 64).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

from metalog.broker.controller import acl as authz
from metalog.broker.server.metrics import BrokerMetrics
from metalog.protocol import messages as m
from metalog.protocol.apis import APIS, ApiKey
from metalog.protocol.errors import Errors

MAX_CACHED_PER_CONNECTION = 64  # command names and claimed replica ids come from the client: bounded
# Replica claims judged by the one id in the body (acl._check_replica against
# the view), so cached per (api, id) like a client's decisions.
_REPLICA_ID_APIS = frozenset({ApiKey.FETCH, ApiKey.OFFSET_FOR_LEADER_EPOCH})


def peer_host(peer: str) -> str:
    """The address part of "host:port" (what an ACL's host field names)."""
    return peer.rpartition(":")[0] or peer


class Gate:
    def __init__(self, *, enabled: bool, voters: frozenset[int], super_users: frozenset[str],
                 controller_state: Callable[[], Any], metrics: BrokerMetrics, log):
        self.enabled = enabled
        self.voters = voters
        self.voters_in_log = False  # KIP-853 (kraft version 1): the runtime sets it
        self.super_users = super_users
        self._controller_state = controller_state  # the applied (committed) ControllerState
        self.metrics = metrics
        self.log = log
        self._view_cache: tuple[Any, int, authz.AuthzView] | None = None
        # Per connection: [is a super user, peer host, view the decisions were made
        # under, {(api, command): decision}], so a client's steady stream of the
        # same request costs one dict lookup, not an ACL walk.
        self._conn_facts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # Denials already logged, per connection: one log line per (api, operation, resource).
        self._denials_logged: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def view(self) -> authz.AuthzView:
        """ACLs from the controller's applied state, rebuilt only when they
        change (a new state object or an ACL record) or the voters do."""
        state = self._controller_state()
        cached = self._view_cache
        if (cached is None or cached[0] is not state or cached[1] != state.acl_version
                or cached[2].voters is not self.voters or cached[2].voters_in_log != self.voters_in_log):
            view = authz.AuthzView(enabled=self.enabled, voters=self.voters, super_users=self.super_users,
                                   acls=tuple(state.acls.values()), voters_in_log=self.voters_in_log)
            cached = self._view_cache = (state, state.acl_version, view)
        return cached[2]

    def _facts(self, conn) -> list:
        facts = self._conn_facts.get(conn)
        if facts is None:
            facts = self._conn_facts[conn] = [str(conn.principal) in self.super_users, peer_host(conn.peer), None, {}]
        return facts

    def may_describe_log(self, conn) -> bool:
        return authz.may_describe_log(conn.principal, self._facts(conn)[1], self.view())

    def check(self, conn, api_key: ApiKey, body: m.Body) -> authz.Denial | None:
        facts = self._facts(conn)
        is_super, host, decided_under, decisions = facts
        if api_key is ApiKey.CONTROLLER_COMMAND and authz.FORWARDED_FOR in body.args:
            # A node speaking for its client: judged per client, never cached per connection.
            return authz.authorize(conn.principal, host, api_key, body, self.view())
        claims_replica = api_key in authz.REPLICA_APIS and not (
            api_key in (ApiKey.FETCH, ApiKey.OFFSET_FOR_LEADER_EPOCH) and body.replica_id == m.CONSUMER_REPLICA_ID) or (
            api_key is ApiKey.CONTROLLER_COMMAND and body.command in authz.BROKER_LIFECYCLE_COMMANDS)
        if is_super and not claims_replica:
            return None  # the hot path of the admin/bench clients: no ACL walk
        view = self.view()
        if claims_replica and api_key not in _REPLICA_ID_APIS:  # elections, snapshots: judged each time
            return authz.authorize(conn.principal, host, api_key, body, view)
        if decided_under is not view:
            decisions.clear()
            facts[2] = view
        if claims_replica:
            # A replica's Fetch (its steady stream): the decision is the
            # certificate's against the one id claimed, under this view.
            key = (api_key, body.replica_id)
        else:
            key = (api_key, body.command if api_key is ApiKey.CONTROLLER_COMMAND else None)
        if key in decisions:
            return decisions[key]
        denial = authz.authorize(conn.principal, host, api_key, body, view)
        if len(decisions) < MAX_CACHED_PER_CONNECTION:
            decisions[key] = denial
        return denial

    def refuse(self, conn, correlation_id: int, api_key: ApiKey, denial: authz.Denial) -> None:
        self.metrics.authorization_failures.labels(api=api_key.name).inc()
        seen = self._denials_logged.setdefault(conn, set())
        key = (denial.api, denial.operation, denial.resource, denial.reason)
        if key not in seen and len(seen) < MAX_CACHED_PER_CONNECTION:  # a peer cannot grow this without limit
            seen.add(key)
            self.log.warning("authorization_failed", peer=conn.peer, principal=denial.principal, api=denial.api,
                             operation=denial.operation, resource=denial.resource, reason=denial.reason,
                             error=Errors(denial.error_code).name)
        response_type = APIS[api_key][1]
        extra = {"error_message": denial.message()} if "error_message" in response_type.__struct_fields__ else {}
        conn.send_response(correlation_id, response_type(error_code=denial.error_code, **extra))
