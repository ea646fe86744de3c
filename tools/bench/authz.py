"""Cost of the authorization gate per request: ``python -m metalog.tools.bench.authz``.

Measures ``metalog.broker.controller.acl.authorize`` (what a connection's first request of a
kind, and every replica RPC, costs) for a user with 1, 10 and 100 ACLs in the
view, and a replica Fetch by a node. The runtime caches decisions per
connection and kind of request, and lets super users skip the ACL walk, so a
client's steady stream of the same request costs one dict lookup.
"""

from __future__ import annotations

import timeit

from metalog.broker.controller import acl as a
from metalog.broker.net.principal import Principal, node_principal
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey


def _acls(n: int) -> tuple:
    others = [a.new_acl(f"User:u{i}", a.Operation.WRITE, a.Permission.ALLOW, a.ResourceType.TOPIC,
                        a.METADATA_TOPIC) for i in range(n - 1)]
    mine = a.new_acl("User:alice", a.Operation.WRITE, a.Permission.ALLOW, a.ResourceType.TOPIC, a.METADATA_TOPIC)
    return tuple(others + [mine])


def _us(fn, number: int = 100_000) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def main() -> None:
    produce = m.ProduceRequest(cluster_id="c", records=[b"x"])
    alice = Principal("User", "alice")
    for n in (1, 10, 100):
        view = a.AuthzView(True, frozenset({1, 2, 3}), frozenset({"User:admin"}), _acls(n))
        assert a.authorize(alice, "127.0.0.1", ApiKey.PRODUCE, produce, view) is None
        print(f"authorize Produce, user with {n:>3} ACL(s) in the view: "
              f"{_us(lambda: a.authorize(alice, '127.0.0.1', ApiKey.PRODUCE, produce, view)):6.2f} us")
    fetch = m.FetchRequest(cluster_id="c", replica_id=2, max_wait_ms=0, current_leader_epoch=1, fetch_offset=0,
                           last_fetched_epoch=0)
    view = a.AuthzView(True, frozenset({1, 2, 3}), frozenset({"User:admin"}), ())
    node2 = node_principal(2)
    print(f"authorize replica Fetch by Node:2:                  "
          f"{_us(lambda: a.authorize(node2, '127.0.0.1', ApiKey.FETCH, fetch, view)):6.2f} us")
    decisions = {(ApiKey.PRODUCE, None): None}
    key = (ApiKey.PRODUCE, None)
    print(f"cached decision (a connection's later requests):    {_us(lambda: decisions[key]):6.2f} us")


if __name__ == "__main__":
    main()
