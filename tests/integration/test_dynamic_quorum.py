"""KIP-853 through real broker processes over TLS: format a standalone voter
and an observer (`metalog storage format`), grow the quorum with
`metalog quorum add-voter`, refuse a duplicate with one line, shrink it with
`metalog quorum remove-voter`."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from metalog.tools.cluster.launcher import REPO_ROOT, free_ports

pytestmark = pytest.mark.slow

FAST = dict(election_timeout_ms=300, fetch_timeout_ms=800, request_timeout_ms=800, fetch_max_wait_ms=100)


def metalog(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "metalog.tools.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=90)


def directory_id(data_dir: str) -> str:
    with open(os.path.join(data_dir, "meta.properties")) as f:
        return dict(line.split("=", 1) for line in f.read().splitlines() if "=" in line)["directory.id"]


def format_and_start(cluster, nodes: int) -> None:
    """Node 1 formatted --standalone, the others --no-initial-controllers
    (observers until added), then every node started."""
    for nid in range(1, nodes + 1):
        how = "--standalone" if nid == 1 else "--no-initial-controllers"
        out = metalog("storage", "format", "--config", cluster.write_config(nid), how)
        assert out.returncode == 0, out.stderr
    cluster.start()


async def test_add_and_remove_a_voter_with_the_cli(make_cluster):
    cluster = make_cluster(voters=1, observers=1, start=False, dynamic_voters=True, **FAST)
    cluster.ensure_certs()
    format_and_start(cluster, 2)
    leader, epoch = await asyncio.to_thread(cluster.wait_for_leader, 20)
    assert leader == 1
    q = cluster.quorum(1)
    assert (q["voters"], q["kraft_version"]) == ([1], 1), q
    cc = ["--client-config", cluster.client_config_path]
    d2 = directory_id(cluster.data_dir(2))
    port2 = cluster.nodes[2].port
    add = ["quorum", "add-voter", *cc, "--controller-id", "2", "--controller-directory-id", d2,
           "--listener", f"127.0.0.1:{port2}"]
    out = await asyncio.to_thread(metalog, *add)
    assert out.returncode == 0, out.stderr

    def follower_2():
        q2 = cluster.quorum(2)
        return q2 if q2 and q2["role"] == "follower" and q2["voters"] == [1, 2] else None

    await asyncio.to_thread(cluster.wait_for, follower_2, 20, "node 2 a voter")
    assert cluster.quorum(1)["voters"] == [1, 2]

    out = await asyncio.to_thread(metalog, *add)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert lines[0].startswith("metalog: error: DUPLICATE_VOTER: node 2 is already a voter"), lines

    out = await asyncio.to_thread(metalog, "quorum", "remove-voter", *cc, "--controller-id", "2",
                                  "--controller-directory-id", d2)
    assert out.returncode == 0, out.stderr

    def observer_2():
        q2 = cluster.quorum(2)
        return q2 if q2 and q2["role"] == "observer" and q2["voters"] == [1] else None

    await asyncio.to_thread(cluster.wait_for, observer_2, 20, "node 2 an observer again")
    out = await asyncio.to_thread(metalog, "produce", *cc, "after")
    assert out.returncode == 0, out.stderr


async def test_static_voters_upgrade_to_kraft_version_1_online_then_add_a_voter(make_cluster):
    """A cluster of static voters (kraft.version 0, voters from the config)
    upgrades online with `metalog features upgrade --kraft-version 1`; before
    it add-voter fails with one line (UNSUPPORTED_VERSION), after it the
    observer is added with `metalog quorum add-voter`, and writes go on."""
    cluster = make_cluster(voters=3, observers=1, dynamic=False, **FAST)  # static voters: kraft.version 0 to upgrade
    leader, _ = await asyncio.to_thread(cluster.wait_for_leader, 20)
    cc = ["--client-config", cluster.client_config_path]
    out = await asyncio.to_thread(metalog, "features", "describe", *cc)
    assert out.returncode == 0, out.stderr
    # Kafka's ApiVersions answer (what our CLI reads now) names metadata.version too, as kafka-features does
    assert out.stdout.strip().splitlines() == [
        "Feature: kraft.version\tSupportedMinVersion: 0\tSupportedMaxVersion: 1\tFinalizedVersionLevel: 0\tEpoch: -1",
        "Feature: metadata.version\tSupportedMinVersion: 7\tSupportedMaxVersion: 21\tFinalizedVersionLevel: 21\t"
        "Epoch: -1"], out.stdout
    d4 = directory_id(cluster.data_dir(4))
    add = ["quorum", "add-voter", *cc, "--controller-id", "4", "--controller-directory-id", d4,
           "--listener", f"127.0.0.1:{cluster.nodes[4].port}"]
    out = await asyncio.to_thread(metalog, *add)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert lines[0].startswith("metalog: error: UNSUPPORTED_VERSION: the cluster runs kraft.version 0"), lines

    def every_voter_fetched():
        # The leader learns each voter's directory id from its fetches.
        for nid in (1, 2, 3):
            q = cluster.quorum(nid)
            if q and q["role"] == "leader":
                ids = {r["replica_id"]: r["directory_id"] for r in q["replicas"]["voters"]}
                want = {n: directory_id(cluster.data_dir(n)) for n in (1, 2, 3)}
                return q if ids == want else None
        return None

    await asyncio.to_thread(cluster.wait_for, every_voter_fetched, 20, "the leader knows every directory id")
    out = await asyncio.to_thread(metalog, "features", "upgrade", *cc, "--kraft-version", "1")
    assert out.returncode == 0, out.stderr

    def all_dynamic():
        qs = [cluster.quorum(n) for n in (1, 2, 3, 4)]
        return qs if all(q and q["kraft_version"] == 1 and q["voters"] == [1, 2, 3] for q in qs) else None

    await asyncio.to_thread(cluster.wait_for, all_dynamic, 20, "every node on kraft.version 1")
    out = await asyncio.to_thread(metalog, "features", "describe", *cc, "-o", "json")
    assert out.returncode == 0, out.stderr
    row, metadata_version = json.loads(out.stdout)
    assert row["Feature"] == "kraft.version" and row["FinalizedVersionLevel"] == 1 and row["Epoch"] > 0, row
    assert metadata_version["Feature"] == "metadata.version", metadata_version
    out = await asyncio.to_thread(metalog, "features", "upgrade", *cc, "--kraft-version", "0")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and lines == [
        "metalog: error: INVALID_UPDATE_VERSION: kraft.version cannot be downgraded from 1 to 0"], out.stderr

    out = await asyncio.to_thread(metalog, *add)
    assert out.returncode == 0, out.stderr

    def voter_4():
        q4 = cluster.quorum(4)
        return q4 if q4 and q4["role"] == "follower" and q4["voters"] == [1, 2, 3, 4] else None

    await asyncio.to_thread(cluster.wait_for, voter_4, 20, "node 4 a voter")
    out = await asyncio.to_thread(metalog, "produce", *cc, "after-upgrade")
    assert out.returncode == 0, out.stderr


async def test_a_voter_restarted_on_a_new_port_tells_the_leader_with_update_raft_voter(make_cluster):
    """KIP-853: voter 3 of {1, 2, 3} comes back listening on another port;
    once it follows the leader it sends UpdateRaftVoter, and the leader's
    voter set (logged as `voter_set`) names the new endpoint -- no operator
    step. (Voters 1 and 2 keep the leader meanwhile.)"""
    cluster = make_cluster(voters=1, observers=2, start=False, dynamic_voters=True, **FAST)
    cluster.ensure_certs()
    format_and_start(cluster, 3)
    await asyncio.to_thread(cluster.wait_for_leader, 20)
    cc = ["--client-config", cluster.client_config_path]
    d3 = directory_id(cluster.data_dir(3))
    for nid in (2, 3):
        out = await asyncio.to_thread(
            metalog, "quorum", "add-voter", *cc, "--controller-id", str(nid), "--controller-directory-id",
            directory_id(cluster.data_dir(nid)), "--listener", f"127.0.0.1:{cluster.nodes[nid].port}")
        assert out.returncode == 0, out.stderr
    assert await asyncio.to_thread(cluster.stop_node, 3) == 0
    (new_port,) = free_ports(1)
    cluster.nodes[3].port = new_port
    cluster.start_node(3)

    def leader_knows_new_port():
        lead = cluster.leader()
        if lead is None:
            return None
        sets = [e for e in cluster.read_log_lines(lead[0]) if e.get("event") == "voter_set"]
        return sets[-1] if sets and sets[-1]["endpoints"].get("3") == [f"CONTROLLER=127.0.0.1:{new_port}"] else None

    got = await asyncio.to_thread(cluster.wait_for, leader_knows_new_port, 30, "the leader has node 3's new port")
    assert got["voters"] == [1, 2, 3] and got["directory_ids"]["3"] == d3
    assert got["endpoints"]["2"] == [f"CONTROLLER=127.0.0.1:{cluster.nodes[2].port}"], "only node 3's entry changed"
    out = await asyncio.to_thread(metalog, "produce", *cc, "after-move")
    assert out.returncode == 0, out.stderr


async def test_auto_join_an_observer_becomes_a_voter_by_itself(make_cluster):
    """KIP-1186 (`auto_join_enable: true`, Kafka's controller.quorum.auto.join.enable):
    node 2, formatted with --no-initial-controllers, adds itself once caught up
    -- over mutual TLS with its own node certificate, no operator request."""
    cluster = make_cluster(voters=1, observers=1, start=False, dynamic_voters=True, auto_join_enable=True, **FAST)
    cluster.ensure_certs()
    format_and_start(cluster, 2)
    await asyncio.to_thread(cluster.wait_for_leader, 20)

    def voter_2():
        q2 = cluster.quorum(2)
        return q2 if q2 and q2["role"] == "follower" and q2["voters"] == [1, 2] else None

    await asyncio.to_thread(cluster.wait_for, voter_2, 30, "node 2 a voter by itself")
    leader_sets = [e for e in cluster.read_log_lines(1) if e.get("event") == "voter_set"]
    assert leader_sets[-1]["directory_ids"]["2"] == directory_id(cluster.data_dir(2))
    out = await asyncio.to_thread(metalog, "produce", "--client-config", cluster.client_config_path, "joined")
    assert out.returncode == 0, out.stderr


async def test_two_voters_one_restarted_on_a_new_port_keep_a_quorum(make_cluster):
    """The hard case of a moved voter: with two voters the moved one is
    needed for every majority, and may well be elected itself while the other
    still has its old address. The new leader tells where it listens in
    BeginQuorumEpoch (KAFKA-16927), the other reaches it there, and the leader
    records its own new endpoint (KAFKA-16533): writes go on."""
    cluster = make_cluster(voters=1, observers=1, start=False, dynamic_voters=True, **FAST)
    cluster.ensure_certs()
    format_and_start(cluster, 2)
    await asyncio.to_thread(cluster.wait_for_leader, 20)
    cc = ["--client-config", cluster.client_config_path]
    out = await asyncio.to_thread(metalog, "quorum", "add-voter", *cc, "--controller-id", "2",
                                  "--controller-directory-id", directory_id(cluster.data_dir(2)),
                                  "--listener", f"127.0.0.1:{cluster.nodes[2].port}")
    assert out.returncode == 0, out.stderr
    assert await asyncio.to_thread(cluster.stop_node, 2) == 0
    (new_port,) = free_ports(1)
    cluster.nodes[2].port = new_port
    cluster.start_node(2)

    def everyone_knows_new_port():
        for nid in (1, 2):
            sets = [e for e in cluster.read_log_lines(nid) if e.get("event") == "voter_set"]
            if not sets or sets[-1]["endpoints"].get("2") != [f"CONTROLLER=127.0.0.1:{new_port}"]:
                return None
        return cluster.leader()

    await asyncio.to_thread(cluster.wait_for, everyone_knows_new_port, 40, "both voters have node 2's new port")
    out = await asyncio.to_thread(metalog, "produce", *cc, "after-move")
    assert out.returncode == 0, out.stderr
