"""Authorization with real processes over mutual TLS (the default).

An attacker with a valid client certificate of the cluster CA, or with one
node's certificate, tries to act as a replica; a client without an ACL
tries to write; an admin grants the ACL; the ACL survives a snapshot and a
restart of the whole cluster.
"""

from __future__ import annotations

import asyncio
import os
import re

import pytest

from metalog.broker.client import AuthorizationError, MetalogClient
from metalog.broker.controller.state import load_latest
from metalog.broker.net.channel import PeerChannel, RequestTimeout
from metalog.broker.net.tls import TlsFiles, TlsPaths
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.protocol.errors import Errors
from metalog.storage.snapshot import SnapshotStore
from metalog.tools.cluster.certs import issue_user

pytestmark = pytest.mark.slow

FAST = dict(election_timeout_ms=500, fetch_timeout_ms=1000, request_timeout_ms=1000, fetch_max_wait_ms=200)


def user_tls(cluster, name: str) -> TlsFiles:
    d = cluster.cert_dir
    if not os.path.exists(os.path.join(d, f"{name}.crt")):
        issue_user(d, d, name)
    return TlsFiles(TlsPaths(f"{d}/ca.crt", f"{d}/{name}.crt", f"{d}/{name}.key"))


def node_tls(cluster, node_id: int) -> TlsFiles:
    d = cluster.cert_dir
    return TlsFiles(TlsPaths(f"{d}/ca.crt", f"{d}/node-{node_id}.crt", f"{d}/node-{node_id}.key"))


def auth_failures(cluster, node_id: int) -> list[dict]:
    return [e for e in cluster.read_log_lines(node_id) if e.get("event") == "authorization_failed"]


def metric(cluster, node_id: int, api: str) -> float:
    import urllib.request

    spec = cluster.nodes[node_id]
    url = f"https://{cluster.host}:{spec.admin_port}/metrics"
    with urllib.request.urlopen(url, timeout=5, context=cluster.client_tls().client()) as resp:
        text = resp.read().decode()
    match = re.search(rf'metalog_authorization_failures_total{{api="{api}"}} ([0-9.]+)', text)
    return float(match.group(1)) if match else 0.0


def test_client_and_stolen_node_certificates_cannot_act_as_replicas(make_cluster):
    """With both followers down, replica RPCs from a user certificate (and a
    node certificate claiming another id) are refused with
    CLUSTER_AUTHORIZATION_FAILED: the leader's HW and epoch do not move, a
    produce is not acknowledged, and after the followers return every
    acknowledged write is there."""
    cluster = make_cluster(voters=3, **FAST)
    leader, epoch = cluster.wait_for_leader()
    followers = [n for n in sorted(cluster.nodes) if n != leader]
    host, port = cluster.host, cluster.nodes[leader].port
    mallory = user_tls(cluster, "mallory")
    stolen = node_tls(cluster, followers[0])  # a real node certificate, used to claim the other id

    async def scenario():
        admin = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls())
        acked_offset, acked_epoch = await admin.produce([b"acked-before"])
        cluster.wait_for(lambda: (lambda q: q if q and q["high_watermark"] > acked_offset else None)(
            cluster.quorum(leader)), 10, "the acked write under the HW")
        for f in followers:
            cluster.kill(f)
        # A write the leader alone holds: must not be acknowledged.
        writer = PeerChannel(host, port, client_id="writer", tls=cluster.client_tls())
        pending = asyncio.ensure_future(writer.request(
            ApiKey.PRODUCE, m.ProduceRequest(cluster_id=cluster.cluster_id, records=[b"never-acked"],
                                             timeout_ms=4000), 4000))
        before = await asyncio.to_thread(cluster.wait_for, lambda: (lambda q: q if q and q["log_end_offset"]
                                         > acked_offset + 1 else None)(cluster.quorum(leader)), 10,
                                         "the leader to append the pending write")
        hw, leo, ep = before["high_watermark"], before["log_end_offset"], before["epoch"]
        assert hw <= acked_offset + 1 < leo and ep == epoch

        attacker = PeerChannel(host, port, client_id="attacker", tls=mallory)
        cid = cluster.cluster_id
        attacks = []
        for f in followers:
            attacks += [
                (ApiKey.FETCH, m.FetchRequest(cluster_id=cid, replica_id=f, max_wait_ms=0, current_leader_epoch=ep,
                                              fetch_offset=leo, last_fetched_epoch=ep)),
                (ApiKey.VOTE, m.VoteRequest(cluster_id=cid, candidate_epoch=ep + 1, candidate_id=f,
                                            last_offset_epoch=ep, last_offset=leo + 100)),
                (ApiKey.BEGIN_QUORUM_EPOCH, m.BeginQuorumEpochRequest(cluster_id=cid, leader_id=f,
                                                                       leader_epoch=ep + 1)),
                (ApiKey.FETCH_SNAPSHOT, m.FetchSnapshotRequest(cluster_id=cid, replica_id=f, current_leader_epoch=ep,
                                                               snapshot_id=m.SnapshotId(1, ep), position=0)),
                (ApiKey.OFFSET_FOR_LEADER_EPOCH, m.OffsetsForLeaderEpochRequest(
                    cluster_id=cid, replica_id=f, current_leader_epoch=ep, leader_epoch=ep)),
            ]
        attacks.append((ApiKey.END_QUORUM_EPOCH, m.EndQuorumEpochRequest(
            cluster_id=cid, leader_id=leader, leader_epoch=ep, preferred_successors=followers)))
        for _ in range(2):  # twice: logged once per connection
            for api, body in attacks:
                resp = await attacker.request(api, body, 3000)
                assert resp.error_code == Errors.CLUSTER_AUTHORIZATION_FAILED, (api, resp)

        impostor = PeerChannel(host, port, client_id="impostor", tls=stolen)
        claim = m.FetchRequest(cluster_id=cid, replica_id=followers[1], max_wait_ms=0, current_leader_epoch=ep,
                               fetch_offset=leo, last_fetched_epoch=ep)
        resp = await impostor.request(ApiKey.FETCH, claim, 3000)
        # (Kafka's Fetch answer has no error message: the reason is in the leader's log, checked below)
        assert resp.error_code == Errors.CLUSTER_AUTHORIZATION_FAILED
        vote = m.VoteRequest(cluster_id=cid, candidate_epoch=ep + 1, candidate_id=followers[1],
                             last_offset_epoch=ep, last_offset=leo + 100)
        assert (await impostor.request(ApiKey.VOTE, vote, 3000)).error_code == Errors.CLUSTER_AUTHORIZATION_FAILED

        after = cluster.quorum(leader)
        assert (after["role"], after["epoch"], after["high_watermark"]) == ("leader", ep, hw)
        try:
            resp = await pending
        except RequestTimeout:
            resp = None
        assert resp is None or resp.error_code != Errors.NONE, f"a write only the leader holds was acked: {resp}"

        for f in followers:
            cluster.start_node(f)
        await asyncio.to_thread(cluster.wait_for, lambda: (lambda q: q if q and q["high_watermark"] >= leo
                                else None)(cluster.quorum(leader)), 30, "the HW to pass the pending write")
        consumer = admin.consumer()
        consumer.seek(acked_offset)
        got = []
        while not got:
            got = await consumer.poll(max_wait_ms=500)
        assert (got[0].offset, got[0].value) == (acked_offset, b"acked-before")
        for ch in (writer, attacker, impostor):
            await ch.close()
        await admin.close()

    asyncio.run(scenario())

    failures = auth_failures(cluster, leader)
    mallory_lines = [e for e in failures if e["principal"] == "User:mallory"]
    # one line per kind of refusal on the attacker's one connection, despite two rounds
    assert len(mallory_lines) == len({(e["api"], e["reason"]) for e in mallory_lines}) == 11
    fetch_line = next(e for e in mallory_lines if e["api"] == "FETCH")
    assert fetch_line["operation"] == "ReplicaAction" and fetch_line["error"] == "CLUSTER_AUTHORIZATION_FAILED"
    assert fetch_line["peer"].startswith("127.0.0.1:") and fetch_line["resource"] == "Cluster:kafka-cluster"
    impostor_line = next(e for e in failures if e["principal"] == f"Node:{followers[0]}" and e["api"] == "FETCH")
    assert f"as replica {followers[1]}: the certificate is for node {followers[0]}" in impostor_line["reason"]


def test_a_client_needs_an_acl_and_acls_survive_a_snapshot_and_a_restart(make_cluster):
    """alice (a user certificate) is refused with TOPIC_AUTHORIZATION_FAILED
    (once: the client does not retry), may write after the admin adds an ACL,
    and still may after the ACL went into snapshots and every broker restarted."""
    cluster = make_cluster(voters=3, snapshot_min_records=5, **FAST)
    cluster.wait_for_leader()
    alice_tls = user_tls(cluster, "alice")
    grant = dict(principal="User:alice", operation="Write", permission="Allow", resource_type="topic",
                 resource_name="__cluster_metadata", pattern_type="literal", host="*")

    async def as_alice(values):
        alice = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=alice_tls, max_retries=3)
        try:
            return await alice.produce(values)
        finally:
            await alice.close()

    async def before_grant():
        with pytest.raises(AuthorizationError) as info:
            await as_alice([b"x"])
        return info.value

    exc = asyncio.run(before_grant())
    assert exc.error_code == Errors.TOPIC_AUTHORIZATION_FAILED
    # Kafka's InitProducerId answer carries no message: the reason is in the leader's log
    assert str(exc).startswith("not authorized (TOPIC_AUTHORIZATION_FAILED; the broker's authorization_failed")
    leader, _ = cluster.wait_for_leader()
    # Refused once, not retried: at InitProducerId, the idempotent producer's first
    # request, which needs what Produce needs; no Produce was sent.
    assert metric(cluster, leader, "INIT_PRODUCER_ID") == 1.0
    assert metric(cluster, leader, "PRODUCE") == 0.0

    async def grant_and_write():
        admin = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls())
        try:
            await admin.command("add_acl", **grant)
            acls = await admin.list_acls()
        finally:
            await admin.close()
        assert [(a["principal"], a["operation"], a["resource_name"]) for a in acls] == [
            ("User:alice", "Write", "__cluster_metadata")]
        for i in range(3):
            await as_alice([f"alice-{i}-{j}".encode() for j in range(4)])

    asyncio.run(grant_and_write())
    # Every broker snapshots past the ACL (snapshot_min_records=5).
    cluster.wait_for(lambda: all((cluster.quorum(n) or {}).get("snapshots") for n in cluster.nodes), 20,
                     "a snapshot on every broker")
    cluster.stop()
    for n in cluster.nodes:
        state, sid = load_latest(SnapshotStore(os.path.join(cluster.data_dir(n), "__cluster_metadata-0")))
        assert [a.principal for a in state.acls.values()] == ["User:alice"], (n, sid)
    cluster.start()
    cluster.wait_for_leader()
    offset, _ = asyncio.run(as_alice([b"after-restart"]))
    assert offset > 0


def _cli(*argv: str) -> "subprocess.CompletedProcess":
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "metalog.tools.cli", *argv], capture_output=True, text=True, timeout=60)


def test_cli_refusal_is_one_line_and_acls_commands_grant_and_list(make_cluster, tmp_path):
    """`metalog produce` as alice without an ACL: exit code 3 and exactly one
    stderr line naming principal, operation, resource and Kafka's error; the
    admin's `metalog acls add` grants it, `acls list` shows one line per ACL."""
    from metalog.broker.client.config import ClientConfig

    cluster = make_cluster(voters=3, **FAST)
    cluster.wait_for_leader()
    user_tls(cluster, "alice")
    d = cluster.cert_dir
    alice_cfg = str(tmp_path / "alice.yaml")
    ClientConfig(bootstrap=",".join(f"{h}:{p}" for h, p in cluster.bootstrap()), cluster_id=cluster.cluster_id,
                 ssl_ca_file=f"{d}/ca.crt", ssl_cert_file=f"{d}/alice.crt",
                 ssl_key_file=f"{d}/alice.key").write(alice_cfg)
    admin_cfg = cluster.client_config_path

    res = _cli("produce", "--client-config", alice_cfg, "hello")
    assert res.returncode == 3, res
    (line,) = res.stderr.splitlines()  # one line (InitProducerId's answer has no message: Kafka's has none)
    assert line.startswith("metalog: error: not authorized (TOPIC_AUTHORIZATION_FAILED;")
    res = _cli("acls", "add", "--client-config", alice_cfg, "--allow-principal", "User:alice",
               "--operation", "Write", "--topic", "__cluster_metadata")
    assert res.returncode == 3
    assert res.stderr.splitlines() == ["metalog: error: not authorized: User:alice may not Alter cluster "
                                       "kafka-cluster (CLUSTER_AUTHORIZATION_FAILED)"]

    res = _cli("acls", "add", "--client-config", admin_cfg, "--allow-principal", "User:alice",
               "--operation", "Write", "--operation", "Read", "--topic", "__cluster_metadata")
    assert res.returncode == 0, res.stderr
    res = _cli("acls", "list", "--client-config", admin_cfg)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == [
        "User:alice Allow Read from * on Topic:LITERAL:__cluster_metadata",
        "User:alice Allow Write from * on Topic:LITERAL:__cluster_metadata"]
    res = _cli("acls", "list", "-o", "json", "--client-config", admin_cfg)
    import json
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert sorted(r["operation"] for r in rows) == ["Read", "Write"] and all(r["principal"] == "User:alice"
                                                                             for r in rows)

    res = _cli("produce", "--client-config", alice_cfg, "hello")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["records"] == 1
    res = _cli("acls", "remove", "--client-config", admin_cfg, "--allow-principal", "User:alice",
               "--operation", "Write", "--topic", "__cluster_metadata")
    assert res.returncode == 0, res.stderr
    res = _cli("produce", "--client-config", alice_cfg, "again")
    assert res.returncode == 3 and "not authorized (TOPIC_AUTHORIZATION_FAILED" in res.stderr
    res = _cli("acls", "remove", "--client-config", admin_cfg, "--allow-principal", "User:alice",
               "--operation", "Write", "--topic", "__cluster_metadata")
    assert res.returncode == 1
    assert "no such ACL: User:alice has Allow permission for operation Write from host * on " \
           "Topic:LITERAL:__cluster_metadata" in res.stderr


def test_admin_http_api_needs_describe_except_health(make_cluster):
    """/health is open (and says authorization is on); /quorum, /metadata and
    /metrics answer alice 403 with CLUSTER_AUTHORIZATION_FAILED until she may
    Describe; node certificates and the super user may."""
    import json
    import urllib.error
    import urllib.request

    cluster = make_cluster(voters=1, **FAST)
    cluster.wait_for_leader()
    base = f"https://{cluster.host}:{cluster.nodes[1].admin_port}"

    def get(tls: TlsFiles, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(base + path, timeout=5, context=tls.client()) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    alice = user_tls(cluster, "alice")
    status, body = get(alice, "/health")
    assert status == 200 and json.loads(body)["authorization"] == "on" and "insecure" not in json.loads(body)
    for path in ("/quorum", "/metadata", "/metrics"):
        status, body = get(alice, path)
        assert status == 403, path
        assert json.loads(body) == {"error": "CLUSTER_AUTHORIZATION_FAILED", "message": (
            "not authorized: User:alice may not Describe cluster kafka-cluster (CLUSTER_AUTHORIZATION_FAILED)")}
        assert get(alice, path)[0] == 403  # again: counted, not logged again
        assert get(cluster.client_tls(), path)[0] == 200, path
        assert get(node_tls(cluster, 1), path)[0] == 200, path

    async def grant():
        admin = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls())
        try:
            await admin.command("add_acl", principal="User:alice", operation="Describe", resource_type="cluster")
        finally:
            await admin.close()

    asyncio.run(grant())
    status, body = get(alice, "/quorum")
    assert status == 200 and json.loads(body)["role"] == "leader"
    lines = [e for e in auth_failures(cluster, 1) if e["principal"] == "User:alice"]
    assert sorted(e["api"] for e in lines) == ["GET /metadata", "GET /metrics", "GET /quorum"]
    assert metric(cluster, 1, "ADMIN_HTTP") == 6.0


def test_insecure_mode_turns_authorization_off_loudly(make_cluster):
    """PLAINTEXT: /health says authorization is off, the broker warns
    `authorization_disabled` at start, and ANONYMOUS may do what a super user
    may (ACL changes included), since no identity can be checked."""
    cluster = make_cluster(voters=1, start=False, **FAST)
    cluster.insecure = True
    cluster.start()
    cluster.wait_for_leader(20)
    assert cluster.admin(1, "/health")["authorization"] == "off"
    cluster.wait_for(lambda: [e for e in cluster.read_log_lines(1) if e.get("event") == "authorization_disabled"],
                     10, "the authorization_disabled warning")
    warn = next(e for e in cluster.read_log_lines(1) if e.get("event") == "authorization_disabled")
    assert warn["level"] == "warning" and "User:ANONYMOUS with super-user rights" in warn["detail"]

    async def anonymous():
        client = MetalogClient(cluster.bootstrap(), cluster.cluster_id)
        try:
            await client.produce([b"x"])
            await client.command("add_acl", principal="User:alice", operation="Read", resource_type="topic",
                                 resource_name="__cluster_metadata")
            return await client.list_acls()
        finally:
            await client.close()

    assert [a["principal"] for a in asyncio.run(anonymous())] == ["User:alice"]
