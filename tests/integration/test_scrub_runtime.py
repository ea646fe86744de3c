"""Real processes, real files, no restart: the background scrubber is the one
that finds a bit flipped in a segment sealed while the broker runs (issue 12;
the boot-time producer-state rebuild cannot be the finder, since nothing
restarts, and no reader touches the sealed segment: the followers are caught
up and no consumer reads until the damage is reported)."""

from __future__ import annotations

import asyncio
import os

import pytest

from metalog.broker.client import MetalogClient
from metalog.storage.batch import HEADER_SIZE, iter_batches
from metalog.storage.segments import SegmentedLog
from tests.integration.test_cluster import FAST
from tests.integration.test_corruption_runtime import PART, caught_up, events, health, segments
from tests.integration.test_integrity_storage import http_get

pytestmark = pytest.mark.slow

RECORDS_PER_BATCH = 5


async def produce_batches(cluster, count: int) -> dict[int, bytes]:
    """`count` batches of RECORDS_PER_BATCH records, one request at a time;
    returns {offset: value} of every acknowledged record."""
    client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls(),
                           request_timeout_ms=5000, max_retries=50)
    acked: dict[int, bytes] = {}
    try:
        for b in range(count):
            values = [f"scrub-{b:04d}-{i}-".encode() * 8 for i in range(RECORDS_PER_BATCH)]
            base, _epoch = await client.produce(values)
            acked.update((base + i, v) for i, v in enumerate(values))
    finally:
        await client.close()
    return acked


def flip_in_middle_sealed_segment(data_dir: str) -> tuple[str, int, int, bytes]:
    """Flip one bit in the records of a middle batch of a middle sealed
    segment (of the running broker: the file it keeps open). Returns (file,
    batch position, batch base offset, the batch's bytes before the flip)."""
    segs = segments(data_dir)[:-1]
    assert len(segs) >= 3, segs
    path = segs[len(segs) // 2]
    data = open(path, "rb").read()
    batches = [(pos, h) for pos, h in iter_batches(data) if not h.is_control]
    pos, h = batches[len(batches) // 2]
    assert h.last_offset - h.base_offset == RECORDS_PER_BATCH - 1
    with open(path, "r+b") as f:
        f.seek(pos + HEADER_SIZE + 6)
        f.write(bytes([data[pos + HEADER_SIZE + 6] ^ 0x08]))
        f.flush()
        os.fsync(f.fileno())
    return path, pos, h.base_offset, data[pos:pos + h.size]


async def test_the_scrubber_finds_a_flip_in_a_segment_sealed_while_running_and_it_is_never_served(make_cluster):
    """The user sees on the damaged leader, with no restart: one
    `corruption_detected` error event with source "scrub" naming the file,
    byte, offset and both CRCs; /health 503 "degraded" whose reason says
    "found by scrub"; `metalog_corrupt_batches_total{source="scrub"} 1.0`;
    `log_quarantined`, then `quarantine_cleared` once it re-fetched the batch
    from a peer. A consumer fetching from an offset inside the damaged batch
    gets the acknowledged records, and the old leader's own log ends up with
    the batch byte-identical to what it was before the flip."""
    cluster = make_cluster(voters=3, **dict(FAST, segment_bytes_max=4096), log_scrub_bytes_per_s=20_000_000,
                           log_scrub_idle_wait_ms=600_000)
    leader, epoch = await asyncio.to_thread(cluster.wait_for_leader, 20)
    acked = await produce_batches(cluster, 60)  # several sealed 4 KiB segments
    hw = max(acked) + 1
    for node in cluster.nodes:
        await asyncio.to_thread(cluster.wait_for, caught_up(cluster, node, hw), 20, f"node {node} at the HW")
    assert len(segments(cluster.data_dir(leader))) >= 4
    assert not events(cluster, leader, "corruption_detected")

    path, pos, bad, original = flip_in_middle_sealed_segment(cluster.data_dir(leader))
    found = await asyncio.to_thread(cluster.wait_for, lambda: events(cluster, leader, "corruption_detected"), 30,
                                    "the scrubber to find the flip")
    ev = found[0]
    assert ev["level"] == "error" and ev["source"] == "scrub"
    assert (ev["file"], ev["position"], ev["offset"]) == (path, pos, bad)
    assert ev["expected_crc"] != ev["actual_crc"]
    assert any(x.get("event") == "scrub_found_corruption" and x.get("file") == path
               for x in cluster.read_log_lines(leader))
    code, body = health(cluster, leader)
    assert code == 503 and body["status"] == "degraded"
    (reason,) = [v for k, v in body["problems"].items() if path in k]
    assert f"at byte {pos} (offset {bad}, found by scrub)" in reason and "CRC mismatch" in reason
    _, metrics = http_get(cluster, leader, "/metrics")
    assert 'metalog_corrupt_batches_total{source="scrub"} 1.0' in metrics

    # Quarantined: the leader resigns, another leads a newer epoch, the old
    # leader re-fetches the batch from it and leaves quarantine.
    assert await asyncio.to_thread(cluster.wait_for, lambda: events(cluster, leader, "log_quarantined"), 20,
                                   "the quarantine")
    new_leader, new_epoch = await asyncio.to_thread(cluster.wait_for_leader, 30, {leader})
    assert new_leader != leader and new_epoch > epoch
    await asyncio.to_thread(cluster.wait_for, lambda: events(cluster, leader, "quarantine_cleared"), 30,
                            "the old leader to re-fetch past its old end")
    assert os.path.exists(path + ".corrupt")

    # A Fetch from inside the damaged batch returns the acknowledged records.
    client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls(),
                           request_timeout_ms=5000, max_retries=50)
    got: dict[int, bytes] = {}
    try:
        consumer = client.consumer(reset_policy="none")
        consumer.seek(bad + 2)
        while consumer.position < bad + 2 * RECORDS_PER_BATCH:
            for r in await consumer.poll(max_wait_ms=200):
                got[r.offset] = r.value
    finally:
        await client.close()
    assert all(got[o] == acked[o] for o in range(bad + 2, bad + 2 * RECORDS_PER_BATCH))
    assert not events(cluster, leader, "fatal")

    await asyncio.to_thread(cluster.wait_for, caught_up(cluster, leader, hw), 20, "the old leader at the HW")
    cluster.stop()
    log = SegmentedLog.open(os.path.join(cluster.data_dir(leader), PART))
    try:
        data = log.read(bad, bad + RECORDS_PER_BATCH, 1 << 20)
    finally:
        log.close()
    assert data == original, "the re-fetched batch differs from the one before the flip"


def _scrub_bytes(cluster, node: int) -> float:
    _, text = http_get(cluster, node, "/metrics")
    line = next(ln for ln in text.splitlines() if ln.startswith("metalog_scrub_bytes_total "))
    return float(line.split()[1])


async def test_a_new_snapshot_wakes_the_idle_scrubber(make_cluster):
    """Nothing sealed at start (one big segment), so the scrubber goes idle
    for log_scrub_idle_wait_ms (10 minutes here) after an empty first pass.
    The broker writes a snapshot: `snapshot_created` wakes the scrubber,
    which reads the new .checkpoint whole within seconds
    (metalog_scrub_bytes_total reaches its size) -- only the wake-up can
    explain that."""
    from tests.integration.test_snapshots import SNAPSHOTTING, write_metadata

    cluster = make_cluster(voters=1, **SNAPSHOTTING, log_scrub_bytes_per_s=20_000_000,
                           log_scrub_idle_wait_ms=600_000)
    await asyncio.to_thread(cluster.wait_for_leader, 20)
    await asyncio.to_thread(cluster.wait_for, lambda: [x for x in cluster.read_log_lines(1)
                                                       if x.get("event") == "scrub_pass_complete"], 10,
                            "the first, empty scrub pass")
    assert _scrub_bytes(cluster, 1) == 0
    await write_metadata(cluster, brokers=1, topics=3, filler=300)
    created = await asyncio.to_thread(cluster.wait_for, lambda: events(cluster, 1, "snapshot_created"), 30,
                                      "a snapshot")
    end, epoch = created[0]["snapshot"]
    path = os.path.join(cluster.data_dir(1), PART, f"{end:020d}-{epoch:010d}.checkpoint")
    size = os.path.getsize(path)
    assert size > 0 and not [s for s in os.listdir(os.path.join(cluster.data_dir(1), PART))
                             if s.endswith(".log")][1:], "no sealed segment: only the snapshot is new"
    await asyncio.to_thread(cluster.wait_for, lambda: _scrub_bytes(cluster, 1) >= size, 10,
                            "the scrubber to read the new snapshot")
