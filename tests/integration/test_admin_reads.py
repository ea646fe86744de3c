"""The admin API's reads over real TLS against a real broker (issue 19 item
4): listings page with a bounded size and a cursor, a page boundary and the
last page say so, a bad cursor or limit is a 400 that says what is wrong."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from metalog.broker.client import MetalogClient

pytestmark = pytest.mark.slow

FAST = dict(election_timeout_ms=300, fetch_timeout_ms=800, request_timeout_ms=800, fetch_max_wait_ms=100)


async def test_listings_page_and_bad_cursors_are_a_400(make_cluster):
    cluster = make_cluster(voters=1, **FAST)
    leader, _ = cluster.wait_for_leader(20)
    client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls())
    try:
        for bid in (1, 2):
            await client.command("register_broker", broker_id=bid, endpoints=[["PLAINTEXT", "127.0.0.1", 9000 + bid]])
        await client.command("create_topic", name="orders", partitions=7, replication_factor=2)
        for i in range(5):
            await client.command("set_config", resource_type=2, resource_name="orders", name=f"k{i}", value=str(i))
    finally:
        await client.close()
    base = f"https://{cluster.host}:{cluster.nodes[leader].admin_port}"
    tls = cluster.client_tls().client()

    def get(path: str) -> tuple[int, str, dict]:
        try:
            with urllib.request.urlopen(base + path, timeout=5, context=tls) as resp:
                return resp.status, resp.headers["Content-Type"], json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, exc.headers["Content-Type"], json.loads(exc.read())

    def applied() -> bool:
        status, _, body = get("/metadata/configs?type=topic&name=orders&limit=10")
        return status == 200 and len(body["configs"]) == 5

    cluster.wait_for(applied, 10, "the leader to apply the configs")

    # A topic's partitions: a full page carries its last id as the cursor, the
    # page that ends exactly at the last partition and the short last page say next null.
    status, ctype, page = get("/metadata/topics/orders/partitions?limit=3")
    assert (status, ctype) == (200, "application/json; charset=utf-8")
    assert [p["partition"] for p in page["partitions"]] == [0, 1, 2] and page["next"] == 2
    assert set(page["partitions"][0]) == {"topic", "topic_id", "partition", "replicas", "isr", "leader",
                                          "leader_epoch", "partition_epoch"}
    _, _, page = get("/metadata/topics/orders/partitions?limit=3&after=2")
    assert [p["partition"] for p in page["partitions"]] == [3, 4, 5] and page["next"] == 5
    _, _, page = get("/metadata/topics/orders/partitions?limit=3&after=5")
    assert [p["partition"] for p in page["partitions"]] == [6] and page["next"] is None
    _, _, page = get("/metadata/topics/orders/partitions?limit=7")
    assert len(page["partitions"]) == 7 and page["next"] is None

    # One topic: its first `limit` partitions and its configs, with both cursors.
    _, _, topic = get("/metadata/topics/orders?limit=4")
    assert topic["partition_count"] == 7 and topic["next_partition"] == 3 and topic["next_config"] is None
    assert topic["configs"] == {f"k{i}": str(i) for i in range(5)}

    # Configs page by key.
    _, _, page = get("/metadata/configs?type=topic&name=orders&limit=2")
    assert page["configs"] == {"k0": "0", "k1": "1"} and page["next"] == "k1"
    _, _, page = get("/metadata/configs?type=topic&name=orders&limit=2&after=k3")
    assert page["configs"] == {"k4": "4"} and page["next"] is None

    # Brokers and topics page the same way.
    _, _, page = get("/metadata/brokers?limit=1")
    assert [b["broker_id"] for b in page["brokers"]] == [1] and page["next"] == 1
    _, _, page = get("/metadata/brokers?limit=1&after=1")
    assert [b["broker_id"] for b in page["brokers"]] == [2] and page["next"] is None
    _, _, page = get("/metadata/topics?limit=1")
    assert [t["name"] for t in page["topics"]] == ["orders"] and page["next"] is None

    # What a user sees for a bad cursor or limit: 400 and the reason.
    bad = {
        "/metadata/topics/orders/partitions?after=abc": "after must be an integer, got 'abc'",
        "/metadata/brokers?after=one": "after must be an integer, got 'one'",
        "/metadata/topics?limit=0": "limit must be between 1 and 1000, got 0",
        "/metadata/acls?limit=1001": "limit must be between 1 and 1000, got 1001",
        "/metadata/configs?type=topic&name=orders&limit=x": "limit must be an integer, got 'x'",
        "/metadata/configs?type=cluster&name=x": "give type=topic|broker and name=NAME",
    }
    for path, message in bad.items():
        assert get(path)[::2] == (400, {"error": "INVALID_REQUEST", "message": message}), path
    assert get("/metadata/topics/nope/partitions")[::2] == (404, {"error": "NOT_FOUND", "message": "no topic 'nope'"})
