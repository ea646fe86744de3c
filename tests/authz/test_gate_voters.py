"""The gate follows the voter set (KIP-853): its cached authorization view
must not keep the voters it was first built with."""

from __future__ import annotations

from types import SimpleNamespace

from metalog.broker.server.gate import Gate
from metalog.broker.net.principal import node_principal
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.protocol.errors import Errors


class Conn:
    """What the gate reads of a connection (it keys per-connection facts weakly)."""

    def __init__(self, principal, peer: str):
        self.principal = principal
        self.peer = peer


def test_a_voter_added_later_may_send_begin_quorum_epoch_once_the_gate_has_the_new_set():
    """Found on a real cluster: after voters 1-3 were replaced by 4-6, node 4
    refused BeginQuorumEpoch from the new leader 5 with
    CLUSTER_AUTHORIZATION_FAILED ("as replica 5: not a voter of this
    cluster") for good, because the view cached with the config's voters
    survived the runtime setting the log's set."""
    state = SimpleNamespace(acl_version=0, acls={})
    gate = Gate(enabled=True, voters=frozenset({1, 2, 3}), super_users=frozenset(), controller_state=lambda: state,
                metrics=None, log=None)
    conn = Conn(node_principal(5), "127.0.0.1:4000")
    begin = m.BeginQuorumEpochRequest(cluster_id="c", leader_id=5, leader_epoch=3)
    denial = gate.check(conn, ApiKey.BEGIN_QUORUM_EPOCH, begin)
    assert denial is not None and denial.error_code == Errors.CLUSTER_AUTHORIZATION_FAILED
    gate.voters = frozenset({4, 5, 6})  # what the runtime does when the log's voter set changes
    assert gate.check(conn, ApiKey.BEGIN_QUORUM_EPOCH, begin) is None
    gate.voters = frozenset({4, 6})
    assert gate.check(conn, ApiKey.BEGIN_QUORUM_EPOCH, begin) is not None
