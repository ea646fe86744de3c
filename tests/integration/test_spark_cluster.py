"""The Spark job on logs produced by a real cluster run (local[2], UI off):
the Spark-built snapshot equals the brokers' state, a broker boots from it
and serves identical /metadata, and audit catches a replica with a planted
divergence and one with a flipped bit."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys

import pytest

from metalog.broker.client import MetalogClient
from metalog.broker.server.recovery import format_data_dir
from metalog.storage.batch import encode_batch, iter_batches
from metalog.storage.segments import SegmentedLog
from metalog.storage.snapshot import read_snapshot_voters
from metalog.tools.cluster.launcher import REPO_ROOT, LocalCluster, NodeSpec

pytestmark = pytest.mark.slow

FAST = dict(election_timeout_ms=400, fetch_timeout_ms=1000, request_timeout_ms=1000, fetch_max_wait_ms=100,
            snapshot_min_records=40)
PART = "__cluster_metadata-0"


def spark(*args: str) -> tuple[int, dict, str]:
    report = args[args.index("--report") + 1]
    proc = subprocess.run([sys.executable, "-m", "metalog.tools.cli", "spark", *args, "--master", "local[2]",
                           "--shuffle-partitions", "2"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=600)
    with open(report) as f:
        return proc.returncode, json.load(f), proc.stderr


def without_offset(state: dict) -> dict:
    return {k: v for k, v in state.items() if k != "offset"}


async def test_spark_snapshot_of_a_real_cluster_boots_a_broker_and_audit_catches_damage(make_cluster, tmp_path):
    cluster = make_cluster(voters=3, **FAST)
    await asyncio.to_thread(cluster.wait_for_leader, 20)
    client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls(), request_timeout_ms=3000, max_retries=50)
    try:
        for b in (1, 2, 3, 4):
            await client.command("register_broker", broker_id=b, endpoints=[["PLAINTEXT", "127.0.0.1", 9000 + b]])
        for t in range(12):
            await client.command("create_topic", name=f"t{t}", partitions=3, replication_factor=3)
            await client.command("set_config", resource_type=2, resource_name=f"t{t}", name="cleanup.policy",
                                 value="compact" if t % 2 else "delete")
        await client.command("fence_broker", broker_id=2)
        await client.command("delete_topic", name="t3")
        await client.command("create_topic", name="t3", partitions=2, replication_factor=2)
    finally:
        await client.close()

    def settled():
        views = [cluster.metadata_state(n) for n in cluster.nodes]
        return views[0] if all(v and v == views[0] for v in views) else None

    expected = await asyncio.to_thread(cluster.wait_for, settled, 15, "identical /metadata on all brokers")
    cluster.stop()
    data_dirs = [cluster.data_dir(n) for n in sorted(cluster.nodes)]
    assert any(f.endswith(".checkpoint") for f in os.listdir(os.path.join(data_dirs[0], PART))), \
        "the brokers should have written snapshots of their own"

    # 1. Snapshot: equals the brokers' state and their own snapshots.
    out = tmp_path / "spark-out"
    code, rep, err = await asyncio.to_thread(spark, "snapshot", *data_dirs, "--out", str(out),
                                             "--report", str(tmp_path / "snap.json"))
    assert code == 0, err
    assert rep["comparisons"] and all(c["equal"] for c in rep["comparisons"])
    checkpoint = rep["snapshot"]["path"]
    assert os.path.basename(checkpoint).endswith(".checkpoint")

    # 2. The cluster is dynamic (KIP-853): the checkpoint carries its voter set
    # (KRaftVersionRecord 1 + VotersRecord right after the SnapshotHeader), so
    # brokers restored from that checkpoint alone (meta.properties with their
    # directory ids, nothing else) know who votes, elect a leader among
    # themselves and serve the same /metadata.
    voters = read_snapshot_voters(checkpoint)
    assert voters is not None
    assert {v.voter_id: v.directory_id for v in voters.voters} == {
        n: cluster.nodes[n].directory_id for n in (1, 2, 3)}
    assert {v.voter_id: v.endpoints[0].port for v in voters.voters} == {n: cluster.nodes[n].port for n in (1, 2, 3)}
    assert rep["snapshot"]["voters"] == {str(n): cluster.nodes[n].directory_id for n in (1, 2, 3)}
    fresh = LocalCluster(str(tmp_path / "fresh"), [
        NodeSpec(n, s.port, s.admin_port, voter=True, directory_id=s.directory_id, formatted=True)
        for n, s in sorted(cluster.nodes.items())], cluster_id=cluster.cluster_id, common=FAST, dynamic=True)
    for n in fresh.nodes:
        format_data_dir(fresh.data_dir(n), cluster.cluster_id, n, fresh.nodes[n].directory_id, None)
        os.makedirs(os.path.join(fresh.data_dir(n), PART), exist_ok=True)
        shutil.copy(checkpoint, os.path.join(fresh.data_dir(n), PART))
    fresh.start()
    try:
        leader, _ = await asyncio.to_thread(fresh.wait_for_leader, 30)
        q = fresh.quorum(leader)
        assert sorted(q["voters"]) == [1, 2, 3] and q["kraft_version"] == 1
        served = await asyncio.to_thread(
            fresh.wait_for, lambda: fresh.metadata_state(leader), 10, "/metadata of the fresh broker")
        assert without_offset(served) == without_offset(expected)
        assert served["offset"] >= int(os.path.basename(checkpoint).split("-")[0])
        assert any(line.get("event") == "snapshot_loaded" for line in fresh.read_log_lines(leader))
    finally:
        fresh.stop()

    # 3. Audit: flip a bit in node 2's log, plant a divergence in node 3's.
    seg2 = sorted(f for f in os.listdir(os.path.join(data_dirs[1], PART)) if f.endswith(".log"))[-1]
    path2 = os.path.join(data_dirs[1], PART, seg2)
    raw = bytearray(open(path2, "rb").read())
    pos, header = list(iter_batches(bytes(raw)))[-3]
    raw[pos + header.size - 1] ^= 0x01
    open(path2, "wb").write(bytes(raw))
    log3 = SegmentedLog.open(os.path.join(data_dirs[2], PART))
    headers = list(log3.iter_batch_headers())
    cut = headers[-2].base_offset
    log3.truncate_to(cut)
    log3.append(encode_batch(cut, headers[-1].leader_epoch + 5, [b"not what the majority holds"], 0))
    log3.close()
    code, rep, err = await asyncio.to_thread(spark, "audit", *data_dirs, "--report", str(tmp_path / "audit.json"))
    assert code == 1, err
    audit = {v["node_id"]: v for v in rep["audit"].values()}
    assert audit["2"]["why"].startswith("corrupt") and audit["2"]["below_hw"]
    assert audit["3"]["first_diff_offset"] == cut
    assert any(e["file"] == seg2 and "CRC mismatch" in e["error"] for e in rep["errors"])
