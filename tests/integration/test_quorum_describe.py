"""`metalog quorum describe --status|--replication` (Kafka's kafka-metadata-quorum
describe views) against real brokers over TLS: the columns Kafka prints, and a
stopped follower's lag showing up in both views."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from metalog.tools.cluster.launcher import REPO_ROOT

pytestmark = pytest.mark.slow

FAST = dict(election_timeout_ms=300, fetch_timeout_ms=800, request_timeout_ms=800, fetch_max_wait_ms=100)


def metalog(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "metalog.tools.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60)


async def test_describe_status_and_replication_show_a_stopped_followers_lag(make_cluster):
    cluster = make_cluster(voters=3, observers=1, **FAST)
    leader, epoch = await asyncio.to_thread(cluster.wait_for_leader, 20)
    cc = ["--client-config", cluster.client_config_path]
    follower = min(n for n in (1, 2, 3) if n != leader)
    await asyncio.to_thread(cluster.kill, follower)
    out = await asyncio.to_thread(metalog, "produce", *cc, *[f"r{i}" for i in range(5)])
    assert out.returncode == 0, out.stderr

    out = await asyncio.to_thread(metalog, "quorum", "describe", "--status", "-o", "json", *cc)
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert list(status) == ["ClusterId", "LeaderId", "LeaderEpoch", "HighWatermark", "MaxFollowerLag",
                            "MaxFollowerLagTimeMs", "CurrentVoters", "CurrentObservers"]
    assert status["ClusterId"] == cluster.cluster_id
    assert (status["LeaderId"], status["LeaderEpoch"]) == (leader, epoch)
    # Kafka 3.9's shape (KIP-853): id, directory id, and for voters where they listen.
    dirs = {}
    for nid in (1, 2, 3, 4):
        with open(os.path.join(cluster.data_dir(nid), "meta.properties")) as f:
            dirs[nid] = dict(line.split("=", 1) for line in f.read().splitlines() if "=" in line)["directory.id"]
    assert status["CurrentVoters"] == [{"id": n, "directoryId": dirs[n],
                                        "endpoints": [f"CONTROLLER://127.0.0.1:{cluster.nodes[n].port}"]}
                                       for n in (1, 2, 3)], status
    assert status["CurrentObservers"] == [{"id": 4, "directoryId": dirs[4]}]
    assert status["MaxFollowerLag"] >= 5, "the killed follower misses the 5 records produced"

    out = await asyncio.to_thread(metalog, "quorum", "describe", "--replication", "-o", "json", *cc)
    assert out.returncode == 0, out.stderr
    rows = {r["NodeId"]: r for r in json.loads(out.stdout)}
    assert [r["Status"] for r in json.loads(out.stdout)][:1] == ["Leader"]
    assert rows[leader]["Lag"] == 0 and rows[4]["Status"] == "Observer"
    assert rows[follower]["Lag"] == status["MaxFollowerLag"]
    assert rows[follower]["LogEndOffset"] == rows[leader]["LogEndOffset"] - rows[follower]["Lag"]
    # KIP-853: each replica is shown with the directory id its data dir's meta.properties holds.
    for nid, row in rows.items():
        with open(os.path.join(cluster.data_dir(nid), "meta.properties")) as f:
            props = dict(line.split("=", 1) for line in f.read().splitlines() if "=" in line)
        assert row["DirectoryId"] == props["directory.id"] and len(row["DirectoryId"]) == 22, (nid, row)

    out = await asyncio.to_thread(metalog, "quorum", "describe", "--replication", *cc)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["NodeId", "DirectoryId", "LogEndOffset", "Lag", "LastFetchTimestamp",
                                "LastCaughtUpTimestamp", "Status"]
    assert [line.split()[0] for line in lines[1:]][0] == str(leader) and len(lines) == 5
    out = await asyncio.to_thread(metalog, "quorum", "describe", "--status", *cc)
    assert f"LeaderId:             {leader}" in out.stdout.splitlines()
    voters_line = next(line for line in out.stdout.splitlines() if line.startswith("CurrentVoters:"))
    assert json.loads(voters_line.split(":", 1)[1]) == status["CurrentVoters"]


def test_describe_needs_status_or_replication():
    """Like Kafka's tool: one of the two views must be named (argparse usage error, exit 2)."""
    out = metalog("quorum", "describe", "--insecure")
    assert out.returncode == 2
    assert "one of the arguments --status --replication is required" in out.stderr
