"""Existing data dirs keep booting after producer state moved into NoOp
records (docs/formats.md): a cluster whose every snapshot is rewritten as an
older build wrote it (ProducerState under metalog's key 1000, no
metadata.version record) restarts, every node loads its newest snapshot, and
the producer state those old records carry is in force: the log no longer
holds the producer's batch (the log start is past it), yet a retry of it is
answered with its original offset."""

from __future__ import annotations

import asyncio
import glob
import os

import pytest

from metalog.broker.client import MetalogClient
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.protocol.errors import Errors
from tests.integration.test_snapshots import SNAPSHOTTING, identical_metadata, part_dir
from tests.storage.helpers import rewrite_snapshot_the_old_way

pytestmark = pytest.mark.slow


def client_of(cluster) -> MetalogClient:
    return MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls(), request_timeout_ms=3000,
                         delivery_timeout_ms=60_000, max_retries=100)


async def test_a_cluster_with_snapshots_written_the_old_way_boots_and_keeps_its_producers(make_cluster):
    cluster = make_cluster(voters=3, **SNAPSHOTTING)
    await asyncio.to_thread(cluster.wait_for_leader, 20)
    producer, filler = client_of(cluster), client_of(cluster)
    try:
        await producer.produce([b"first"])
        base, epoch = await producer.produce([b"kept-1", b"kept-2"])  # sequences 1..2
        (idle,) = producer._idle_producers
        pid = idle.producer_id
        for i in range(0, 400, 50):  # another producer: the snapshots and log start move past `base`
            await filler.produce([f"filler-{j}".encode() for j in range(i, i + 50)])
    finally:
        await filler.close()

    def log_start_past_the_batch() -> bool:
        views = [cluster.quorum(n) for n in cluster.nodes]
        return all(v and v["log_start_offset"] > base + 1 and v["snapshots"] for v in views)

    try:
        await asyncio.to_thread(cluster.wait_for, log_start_past_the_batch, 40,
                                "every node's log start past the producer's batch")
        for n in sorted(cluster.nodes):
            cluster.stop_node(n)
        newest = {}
        for n in sorted(cluster.nodes):
            checkpoints = sorted(glob.glob(os.path.join(part_dir(cluster, n), "*.checkpoint")))
            rewritten = [rewrite_snapshot_the_old_way(p) for p in checkpoints]
            assert rewritten[-1] == 2, (n, rewritten)  # both producers, under key 1000
            newest[n] = os.path.basename(checkpoints[-1])
        for n in sorted(cluster.nodes):
            cluster.start_node(n)
        await asyncio.to_thread(cluster.wait_for_leader, 30)
        # The very request of the batch the log no longer holds: its original offset, from the old snapshot's state.
        resp = await producer._leader_request(
            ApiKey.PRODUCE, lambda: m.ProduceRequest(cluster_id=cluster.cluster_id, records=[b"kept-1", b"kept-2"],
                                                     producer_id=pid, producer_epoch=0, base_sequence=1), 3000)
        # Its original offset. Kafka's Produce answer says no epoch (the client library fills in
        # the answering leader's: see _written_epoch); the raw answer has none.
        assert (resp.error_code, resp.base_offset, resp.leader_epoch) == (Errors.NONE, base, m.NO_EPOCH)
        await asyncio.to_thread(cluster.wait_for, lambda: identical_metadata(cluster, cluster.nodes), 20,
                                "identical metadata on every node")
    finally:
        await producer.close()
    for n in sorted(cluster.nodes):
        events = cluster.read_log_lines(n)
        loaded = [e for e in events if e.get("event") == "snapshot_loaded"]
        assert loaded, n
        end_offset, snap_epoch = loaded[-1]["snapshot"]
        assert newest[n].startswith(f"{end_offset:020d}-{snap_epoch:010d}"), (n, loaded[-1], newest[n])
        assert not [e for e in events if e.get("event") == "snapshot_refused"], n
