"""Issue 19 item 2 on real processes: a broker writes its own snapshots in a
forked child (storage.snapshot_generation = fork, the default), over mutual
TLS. The snapshot is valid and equals a replay of the log; the log event and
the metrics say the fork path wrote it. A child whose write fails (the
broker's file size limit, as a full disk) gives one error event, leaves no
partial file, and the broker goes on committing and tries again later."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from metalog.broker.client import MetalogClient
from metalog.broker.controller.state import Controller, load_snapshot
from metalog.protocol.messages import SnapshotId
from metalog.storage.segments import SegmentedLog
from metalog.storage.snapshot import PART_SUFFIX, SnapshotStore
from tests.integration.conftest import limit_file_size
from tests.integration.test_metrics import scrape
from tests.integration.test_snapshots import part_dir, write_metadata

pytestmark = pytest.mark.slow

QUICK = dict(election_timeout_ms=400, fetch_timeout_ms=1000, request_timeout_ms=1000, fetch_max_wait_ms=100)


def events(cluster, node_id: int, name: str) -> list[dict]:
    return [ln for ln in cluster.read_log_lines(node_id) if ln.get("event") == name]


@pytest.mark.parametrize("generation", ["fork", "thread"])
async def test_a_snapshot_written_by_either_path_equals_the_log_replay(make_cluster, generation):
    """fork is the default; thread is the fallback where fork() is missing."""
    # max_replication_lag_ms: the leader moves its log start past a snapshot
    # only once every live replica has it (KIP-630), so the observer never
    # falls behind it and needs a snapshot of its own.
    cluster = make_cluster(voters=1, observers=1, start=False, snapshot_min_records=150,
                           snapshot_generation=generation, max_replication_lag_ms=60_000, **QUICK)
    voter, observer = 1, 2
    assert not cluster.nodes[observer].voter
    # The observer never snapshots, so it keeps the whole log from offset 0: the replay.
    cluster.nodes[observer].extra["snapshot_min_records"] = 1 << 40
    cluster.start()
    await asyncio.to_thread(cluster.wait_for_leader, 20)
    # The observer fetching before the first snapshot: a replica the leader
    # has not heard from yet would not hold its log start back.
    def observer_caught_up() -> bool:
        applied = (cluster.quorum(observer) or {}).get("applied_offset") or 0
        hw = (cluster.quorum(voter) or {}).get("high_watermark") or 0
        return 0 < hw <= applied

    await asyncio.to_thread(cluster.wait_for, observer_caught_up, 20, "the observer to fetch and catch up")
    await write_metadata(cluster, brokers=5, topics=10, filler=400)
    created = await asyncio.to_thread(cluster.wait_for, lambda: events(cluster, voter, "snapshot_created"),
                                      30, "the voter's first snapshot_created")
    broker_pid = cluster.procs[voter].pid
    other = "thread" if generation == "fork" else "fork"
    for ev in created:
        assert ev["path"] == generation
        if generation == "fork":
            assert ev["pid"] != broker_pid and ev["fork_ms"] >= 0
            assert ev["child_memory"]["vmhwm_kib"] > 0
        else:
            assert "pid" not in ev
    assert not events(cluster, voter, "snapshot_write_failed")
    m = await asyncio.to_thread(scrape, cluster, voter)
    assert m[("metalog_snapshot_generations_total", (("path", generation),))] >= len(created)
    assert m[("metalog_snapshot_generations_total", (("path", other),))] == 0
    assert m[("metalog_snapshot_generation_failures_total", (("path", generation),))] == 0
    target = cluster.quorum(voter)["high_watermark"]
    await asyncio.to_thread(cluster.wait_for,
                            lambda: ((cluster.quorum(observer) or {}).get("applied_offset") or 0) >= target,
                            30, "the observer to apply what the voter committed")
    cluster.stop()

    store = SnapshotStore(part_dir(cluster, voter))
    newest = store.list()[-1]
    assert [newest.end_offset, newest.epoch] in [ev["snapshot"] for ev in events(cluster, voter, "snapshot_created")]
    assert not [n for n in os.listdir(store.directory) if n.endswith(PART_SUFFIX)]
    snap_state = load_snapshot(store, newest)  # checks every batch's CRC and the footer

    log = SegmentedLog.open(part_dir(cluster, observer))
    try:
        assert log.log_start_offset == 0
        replay = Controller()
        replay.apply_batches(log.read(0, log.log_end_offset, 1 << 30), end_offset=newest.end_offset)
    finally:
        log.close()
    assert replay.state.offset == newest.end_offset
    assert snap_state.to_json() == replay.state.to_json()
    assert len(snap_state.partitions) == 40  # 10 topics x 4: the metadata is in it


LIMIT_BYTES = 128 * 1024  # the broker's file size limit: its snapshot (~220 KB) cannot fit


async def test_a_failing_snapshot_child_is_one_error_event_and_leaves_no_partial(make_cluster):
    """The broker runs with RLIMIT_FSIZE (a full disk for files past 128 KiB);
    its log segments stay small, its snapshot of 3000 partitions does not:
    the child's write fails with EFBIG. What the operator sees: one
    `snapshot_write_failed` error event per attempt (path fork, the child's
    exit, "File too large"), no .part and no .checkpoint for it, the failure
    counter, and a broker that keeps committing and tries again at the next
    due point."""
    cluster = make_cluster(voters=1, start=False, snapshot_min_records=2500, segment_bytes_max=16384, **QUICK)
    limit_file_size(cluster, 1, LIMIT_BYTES)
    cluster.start()
    await asyncio.to_thread(cluster.wait_for_leader, 20)
    client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls(),
                           request_timeout_ms=3000, max_retries=20)
    try:
        await client.command("register_broker", broker_id=1, endpoints=[["PLAINTEXT", "127.0.0.1", 9001]])
        for t in range(30):
            await client.command("create_topic", name=f"topic-{t}", partitions=100, replication_factor=1)
        failed = await asyncio.to_thread(cluster.wait_for, lambda: events(cluster, 1, "snapshot_write_failed"),
                                         30, "the snapshot child's failure")
        first = failed[0]
        assert first["level"] == "error" and first["path"] == "fork"
        assert first["child_exit"] == "exit 3"
        assert first["error"].startswith("OSError: [Errno 27] File too large"), first["error"]
        assert first["action"] == "partial file removed; the next due point tries again"
        sid = SnapshotId(*first["snapshot"])
        store_dir = part_dir(cluster, 1)
        assert not [n for n in os.listdir(store_dir) if n.endswith(PART_SUFFIX)]
        assert SnapshotStore(store_dir).size(sid) is None
        assert not events(cluster, 1, "snapshot_created")
        # The broker goes on: commits succeed, and the next due point tries again.
        for i in range(0, 2600, 100):
            await client.produce([f"after-{j}".encode() for j in range(i, i + 100)])
    finally:
        await client.close()
    again = await asyncio.to_thread(
        cluster.wait_for, lambda: [e for e in events(cluster, 1, "snapshot_write_failed")
                                   if e["snapshot"][0] > sid.end_offset], 30, "a second attempt")
    assert again[0]["path"] == "fork" and "File too large" in again[0]["error"]
    assert cluster.procs[1].poll() is None
    assert not events(cluster, 1, "fatal")
    m = await asyncio.to_thread(scrape, cluster, 1)
    assert m[("metalog_snapshot_generation_failures_total", (("path", "fork"),))] >= 2
    assert not [n for n in os.listdir(store_dir) if n.endswith(PART_SUFFIX)]
