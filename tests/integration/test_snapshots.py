"""KIP-630 on real processes: snapshots are generated, the log start moves
past 0, a wiped broker rejoins through FetchSnapshot (also when killed in
the middle of the download), and a restarted broker boots from snapshot +
log tail into identical controller state."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from metalog.broker.client import MetalogClient
from metalog.tools.cluster.launcher import REPO_ROOT

pytestmark = pytest.mark.slow

SNAPSHOTTING = dict(election_timeout_ms=400, fetch_timeout_ms=1000, request_timeout_ms=1000,
                    fetch_max_wait_ms=100, snapshot_min_records=150, max_replication_lag_ms=500)


async def write_metadata(cluster, brokers: int, topics: int, filler: int) -> None:
    client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls(), request_timeout_ms=3000, max_retries=50)
    try:
        for b in range(1, brokers + 1):
            await client.command("register_broker", broker_id=b, endpoints=[["PLAINTEXT", "127.0.0.1", 9000 + b]])
        for t in range(topics):
            await client.command("create_topic", name=f"topic-{t}", partitions=4, replication_factor=min(3, brokers))
            await client.command("set_config", resource_type=2, resource_name=f"topic-{t}",
                                 name="retention.ms", value=str(1000 * t))
        await client.command("fence_broker", broker_id=1)
        for i in range(0, filler, 50):
            await client.produce([f"filler-{j}".encode() for j in range(i, min(filler, i + 50))])
    finally:
        await client.close()


def part_dir(cluster, node_id: int) -> str:
    return os.path.join(cluster.data_dir(node_id), "__cluster_metadata-0")


def log_start_past_zero_everywhere(cluster, nodes):
    views = [cluster.quorum(n) for n in nodes]
    return all(v and v["log_start_offset"] > 0 and v["snapshots"] for v in views)


def identical_metadata(cluster, nodes):
    views = [cluster.metadata_state(n) for n in nodes]
    return views if all(v and v == views[0] for v in views) else None


async def snapshotted_cluster(make_cluster, brokers: int, topics: int, filler: int, **extra):
    """3 voters with metadata written, a snapshot and a log start past 0 on every broker."""
    cluster = make_cluster(voters=3, **SNAPSHOTTING, **extra)
    await asyncio.to_thread(cluster.wait_for_leader, 20)
    await write_metadata(cluster, brokers=brokers, topics=topics, filler=filler)
    await asyncio.to_thread(cluster.wait_for, lambda: log_start_past_zero_everywhere(cluster, cluster.nodes),
                            30, "snapshots and a log start offset past 0 on every broker")
    return cluster


async def test_wiped_broker_rejoins_through_fetch_snapshot_when_log_start_is_past_zero(make_cluster):
    cluster = await snapshotted_cluster(make_cluster, brokers=5, topics=10, filler=600)
    leader, _ = cluster.leader()
    follower = next(n for n in cluster.nodes if n != leader)
    cluster.kill(follower)
    shutil.rmtree(cluster.data_dir(follower))
    cluster.start_node(follower)

    def rejoined():
        q, lq = cluster.quorum(follower), cluster.quorum(leader)
        return q and lq and q["snapshots"] and q["log_end_offset"] >= lq["high_watermark"] \
            and q["high_watermark"] == lq["high_watermark"]

    await asyncio.to_thread(cluster.wait_for, rejoined, 30, "the wiped broker to catch up")
    installed = [line for line in cluster.read_log_lines(follower) if line.get("event") == "snapshot_installed"]
    assert installed, "the wiped broker caught up without installing a snapshot"
    views = await asyncio.to_thread(cluster.wait_for, lambda: identical_metadata(cluster, cluster.nodes),
                                    15, "identical /metadata")
    assert len(views[0]["topics"]) == 10


async def test_broker_killed_during_snapshot_download_recovers(make_cluster):
    cluster = await snapshotted_cluster(make_cluster, brokers=5, topics=30, filler=400, snapshot_chunk_bytes=64)
    leader, _ = cluster.leader()
    follower = next(n for n in cluster.nodes if n != leader)
    cluster.kill(follower)
    shutil.rmtree(cluster.data_dir(follower))
    cluster.start_node(follower)
    # A download's partial file (storage.snapshot: <id>-fetch.checkpoint.part); the broker's
    # own snapshot generation writes <id>-<uuid>.checkpoint.part, which may rightly exist
    # at any moment once it has caught up, so it is not counted.
    partials = lambda: glob.glob(os.path.join(part_dir(cluster, follower), "*-fetch.checkpoint.part"))  # noqa: E731
    await asyncio.to_thread(cluster.wait_for, partials, 30, "a snapshot download in progress", 0.005)
    cluster.kill(follower)
    assert partials(), "the .part file of the cut-off download should be on disk"
    cluster.start_node(follower)

    def recovered():
        q, lq = cluster.quorum(follower), cluster.quorum(leader)
        return q and lq and q["log_end_offset"] >= lq["high_watermark"] and q["snapshots"]

    await asyncio.to_thread(cluster.wait_for, recovered, 30, "the broker to finish a fresh download")
    assert not partials(), "a finished download left its .part file behind"
    boot_lines = [line for line in cluster.read_log_lines(follower) if line.get("event") == "snapshot_boot_cleanup"]
    assert any(line.get("removed_leftovers") for line in boot_lines), "the .part leftover was not deleted on boot"
    await asyncio.to_thread(cluster.wait_for, lambda: identical_metadata(cluster, cluster.nodes),
                            15, "identical /metadata")


async def test_restarted_broker_boots_from_snapshot_and_tail_with_identical_metadata(make_cluster):
    cluster = await snapshotted_cluster(make_cluster, brokers=4, topics=8, filler=500)
    # A tail after the latest snapshot.
    client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls(), request_timeout_ms=3000, max_retries=50)
    try:
        await client.command("create_topic", name="after-snapshot", partitions=2, replication_factor=2)
    finally:
        await client.close()
    before = await asyncio.to_thread(cluster.wait_for, lambda: identical_metadata(cluster, cluster.nodes),
                                     15, "identical /metadata")
    node = 1
    cluster.stop_node(node)
    cluster.start_node(node)
    lines = []

    def without_offset(state: dict | None) -> dict | None:
        # If the stopped node led, its successor's LeaderChange record moves
        # every broker's applied offset by one: the state itself must not change.
        return None if state is None else {k: v for k, v in state.items() if k != "offset"}

    def booted():
        lines[:] = [line for line in cluster.read_log_lines(node) if line.get("event") == "snapshot_loaded"]
        return lines and identical_metadata(cluster, cluster.nodes) \
            and without_offset(cluster.metadata_state(node)) == without_offset(before[0])

    await asyncio.to_thread(cluster.wait_for, booted, 20, "the restarted broker to load its snapshot")
    assert "after-snapshot" in str(cluster.metadata_state(node)["topics"])


async def test_cli_consume_from_earliest_starts_at_the_log_start_once_it_is_past_zero(make_cluster):
    """A user's `metalog consume --from earliest` on a cluster whose log start
    moved past 0 (snapshot taken, old segments deleted): it reads from the log
    start, the first record it prints is at that offset, and it exits 0 --
    not "consumer position N is out of range: offset below the log start"
    for the log start itself (the snapshot redirect replicas get)."""
    cluster = await snapshotted_cluster(make_cluster, brokers=3, topics=4, filler=400)
    leader, _ = cluster.leader()
    # Records past the log start that no snapshot will cover while the CLI
    # reads: a snapshot may end at the log end (the log start then moves
    # there, and a consumer from the earliest offset waits for new records).
    # One is due, or being written, while log end - its last end >= the
    # threshold, and the log start follows a new one a moment after it is
    # listed. Produce one record at a time until the leader's log start is at
    # its newest snapshot, 5 records lie past it, and no snapshot is due.
    threshold = SNAPSHOTTING["snapshot_min_records"]

    def settled() -> bool:
        q = cluster.quorum(leader)
        last_end = max(end for end, _ in q["snapshots"])
        return (q["log_start_offset"] == last_end and q["log_end_offset"] - last_end >= 5
                and q["log_end_offset"] - last_end < threshold - 10)

    client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls(), request_timeout_ms=3000)
    try:
        for i in range(2 * threshold):
            if settled():
                break
            await client.produce([f"after-{i}".encode()])
        assert settled(), cluster.quorum(leader)
    finally:
        await client.close()
    log_start = cluster.quorum(leader)["log_start_offset"]
    boot = ",".join(f"{h}:{p}" for h, p in cluster.bootstrap())
    out = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "metalog.tools.cli", "consume", "--bootstrap", boot, "--cluster-id", cluster.cluster_id,
         "--client-config", cluster.client_config_path, "--from", "earliest", "--max-records", "5"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    offsets = [json.loads(line)["offset"] for line in out.stdout.splitlines()]
    assert len(offsets) == 5 and offsets[0] >= log_start, (offsets, log_start)
    # Nothing committed at or past the log start is skipped: the first record
    # printed is the first non-control record from there.
    assert offsets == sorted(offsets)
