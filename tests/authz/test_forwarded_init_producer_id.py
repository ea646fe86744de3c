"""A follower asks the leader for a client's producer id in its own name
(metalog.broker.server.produce, as Kafka's brokers ask their controller): a
node certificate may send InitProducerId without an ACL; a user's still
needs Write on the log, and a node's certificate gains nothing else."""

from __future__ import annotations

from metalog.broker.controller import acl as a
from metalog.broker.net.principal import Principal, node_principal
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey

HOST = "10.0.0.5"


def view() -> a.AuthzView:
    return a.AuthzView(enabled=True, voters=frozenset({1, 2, 3}), super_users=frozenset({"User:admin"}), acls=())


def test_a_node_may_ask_for_a_producer_id_a_user_may_not_without_write():
    init = m.InitProducerIdRequest(cluster_id="c")
    for node in (node_principal(2), node_principal(4)):  # a voter, an observer
        assert a.authorize(node, HOST, ApiKey.INIT_PRODUCER_ID, init, view()) is None
        produce = m.ProduceRequest(cluster_id="c", records=[b"x"])
        assert a.authorize(node, HOST, ApiKey.PRODUCE, produce, view()).error_code == 29
    denied = a.authorize(Principal("User", "alice"), HOST, ApiKey.INIT_PRODUCER_ID, init, view())
    assert denied is not None and denied.error_code == 29
