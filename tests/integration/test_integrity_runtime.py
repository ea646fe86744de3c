"""Real processes: fail-stop and in-sync truth (issue 12 items 6 and 7), and
the runtime's reaction to corruption (item 4).

Each test says what the user sees (exit code, the one `fatal` line in
broker.log, /quorum) and that no acknowledged record is lost.
"""

from __future__ import annotations

import asyncio
import glob
import os
import struct

import crc32c
import pytest

from metalog.broker.client import MetalogClient
from metalog.storage.batch import CRC_OFFSET, CRC_START, HEADER_SIZE, iter_batches
from tests.integration.test_cluster import FAST, committed_values, produce_all

pytestmark = pytest.mark.slow

PART = "__cluster_metadata-0"


def _ctx(cluster):
    """The client TLS context of the cluster (None when it runs the insecure mode)."""
    tls = cluster.client_tls()
    return tls.client() if tls else None


def segments(data_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(data_dir, PART, "*.log")))


def rewrite_batch(path: str, pick, mutate) -> int:
    """Change the first data batch `pick(header)` accepts in segment `path` with
    `mutate(bytearray of the batch)`, then recompute its CRC-32C, so storage
    finds a valid batch (a software bug, not bit rot). Returns its base offset."""
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        for pos, h in iter_batches(bytes(data)):
            if h.is_control or not pick(h):
                continue
            raw = bytearray(data[pos:pos + h.size])
            mutate(raw)
            assert len(raw) == h.size
            struct.pack_into(">I", raw, CRC_OFFSET, crc32c.crc32c(bytes(raw[CRC_START:])))
            f.seek(pos)
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
            return h.base_offset
    raise AssertionError(f"no batch to rewrite in {path}")


async def produce_and_catch_up_a_follower(cluster, leader: int, values: list[bytes]):
    """Produce `values` (acknowledged), then wait until a follower's HW reaches
    the cluster's: (acked, hw, that follower's id)."""
    client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls(), request_timeout_ms=5000)
    try:
        acked = await produce_all(client, values, concurrency=8)
        hw = (await client.metadata()).high_watermark
    finally:
        await client.close()
    victim = next(n for n in cluster.nodes if n != leader)
    await asyncio.to_thread(cluster.wait_for, lambda: (cluster.quorum(victim) or {}).get("high_watermark", -1) >= hw,
                            20, "the follower to reach the HW")
    return acked, hw, victim


async def test_an_error_applying_committed_records_is_one_fatal_event_and_exit_4(make_cluster):
    """A committed batch whose CRC is valid but whose records the controller
    cannot decode (the first record's length runs past the batch): the follower
    holding it exits with code 4 after exactly ONE `fatal` event (cause
    apply_failed, naming the offset), no "Task exception was never retrieved"
    on stderr; the other brokers keep every acknowledged record."""
    cluster = make_cluster(voters=3, **FAST)
    leader, _ = await asyncio.to_thread(cluster.wait_for_leader, 20)
    acked, hw, victim = await produce_and_catch_up_a_follower(
        cluster, leader, [f"v-{i:04d}".encode() for i in range(200)])
    assert cluster.stop_node(victim) == 0

    def bad_length(raw: bytearray) -> None:
        # The first record's length (a one-byte zigzag varint) becomes 63 bytes,
        # more than this one-record batch holds: same size, valid CRC.
        assert raw[HEADER_SIZE] < 0x80 and len(raw) - HEADER_SIZE < 63
        raw[HEADER_SIZE] = 63 << 1

    bad_offset = rewrite_batch(segments(cluster.data_dir(victim))[0],
                               lambda h: h.base_offset >= 50 and h.records_count == 1, bad_length)
    cluster.start_node(victim)
    code = await asyncio.to_thread(cluster.procs[victim].wait, 30)
    assert code == 4
    fatal = [line for line in cluster.read_log_lines(victim) if line.get("event") == "fatal"]
    assert len(fatal) == 1, fatal
    assert fatal[0]["cause"] == "apply_failed"
    assert f"from offset {bad_offset}" in fatal[0]["reason"] and "length 63 runs past the batch end" in fatal[0]["reason"]
    stderr = open(os.path.join(cluster.node_dir(victim), "stderr.log")).read()
    assert "Task exception was never retrieved" not in stderr and "Traceback" not in stderr
    cluster.stop()
    for n in cluster.nodes:
        if n == victim:
            continue
        records = {v: (off, ep) for off, ep, v in committed_values(cluster.data_dir(n), hw)}
        assert all(records.get(v) == acked[v] for v in acked), f"broker {n} lost acknowledged records"


async def test_a_wiped_follower_is_not_in_sync_until_it_has_caught_up(make_cluster):
    """/quorum on the leader (DescribeQuorum) reports a follower whose data dir
    was wiped as out of sync from its first fetch after the restart until it
    reaches the leader's log end -- not in sync on the strength of its
    caught-up time from before the wipe. The wiped follower fetches 2 KiB at a
    time so catching up takes many round trips; it then holds every acked record."""
    cluster = make_cluster(voters=3, **FAST)
    leader, _ = await asyncio.to_thread(cluster.wait_for_leader, 20)
    client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls(), request_timeout_ms=5000)
    try:
        acked = await produce_all(client, [(f"w-{i:05d}-".encode() * 20) for i in range(3000)], concurrency=32)
        hw = (await client.metadata()).high_watermark
    finally:
        await client.close()
    victim = next(n for n in cluster.nodes if n != leader)

    def replica(q: dict | None) -> dict | None:
        if not q or "replicas" not in q:
            return None
        return next(r for r in q["replicas"]["voters"] if r["replica_id"] == victim)

    await asyncio.to_thread(cluster.wait_for, lambda: (replica(cluster.quorum(leader)) or {}).get("in_sync")
                            and replica(cluster.quorum(leader))["log_end_offset"] >= hw, 20,
                            "the follower to be caught up before the wipe")
    cluster.kill(victim)
    import shutil
    shutil.rmtree(os.path.join(cluster.data_dir(victim), PART))
    cluster.nodes[victim].extra["fetch_max_bytes"] = 2048
    cluster.start_node(victim)
    samples = []

    def watch():
        q = cluster.quorum(leader)
        r = replica(q)
        if r is None:
            return False
        if not samples and r["log_end_offset"] >= hw:
            return False  # its first fetch after the restart has not arrived yet
        samples.append((r["log_end_offset"], r["in_sync"], q["log_end_offset"]))
        return r["log_end_offset"] >= q["log_end_offset"] and r["in_sync"]

    await asyncio.to_thread(cluster.wait_for, watch, 60, "the wiped follower to catch up and be in sync",
                            poll_s=0.01)
    behind = [s for s in samples if s[0] < s[2]]
    assert len(behind) >= 3, f"too few samples while catching up: {samples[:5]}"
    assert not [s for s in behind if s[1]], f"reported in sync while behind: {[s for s in behind if s[1]][:5]}"
    cluster.stop()
    records = {v: (off, ep) for off, ep, v in committed_values(cluster.data_dir(victim), hw)}
    assert all(records.get(v) == acked[v] for v in acked)


async def test_a_replica_whose_committed_data_differs_raises_the_divergence_alarm(make_cluster):
    """A follower's committed batch is rewritten while it is stopped: same
    offsets and length, one byte of a record changed, CRC recomputed, so the
    follower's storage accepts it. Within a few consistency-check intervals
    the leader logs ONE kind of error event, `divergence_detected`, naming the
    follower and an offset range containing the batch, counts it in
    metalog_divergence_detected_total and reports /health 503 "degraded". The
    leader and the other follower still hold every acknowledged record."""
    cluster = make_cluster(voters=3, segment_bytes_max=4096, consistency_check_interval_ms=300, **FAST)
    leader, _ = await asyncio.to_thread(cluster.wait_for_leader, 20)
    acked, hw, victim = await produce_and_catch_up_a_follower(
        cluster, leader, [f"d-{i:05d}".encode() * 4 for i in range(600)])
    assert not [x for x in cluster.read_log_lines(leader) if x.get("event") == "divergence_detected"]
    assert cluster.stop_node(victim) == 0
    segs = segments(cluster.data_dir(victim))
    assert len(segs) >= 4, "several sealed segments"

    def flip_a_value_byte(raw: bytearray) -> None:
        # The first record: length, attributes, timestamp delta, offset delta,
        # key length (-1), value length -- one byte each for these small
        # records -- then the value. (Offset +4 is the key length: flipping it
        # made the record undecodable, and the restarted follower then stopped
        # on apply_failed, racing the leader's check.)
        value_at = HEADER_SIZE + 6
        assert raw[value_at] == ord("d"), bytes(raw[HEADER_SIZE:HEADER_SIZE + 12])
        raw[value_at] ^= 0x20  # 'd' -> 'D': still a valid record, with other content

    bad_offset = rewrite_batch(segs[len(segs) // 2], lambda h: True, flip_a_value_byte)
    cluster.start_node(victim)

    def alarm():
        found = [x for x in cluster.read_log_lines(leader) if x.get("event") == "divergence_detected"]
        return found or None

    found = await asyncio.to_thread(cluster.wait_for, alarm, 30, "the divergence alarm")
    ev = found[0]
    assert ev["replica"] == victim and ev["level"] == "error"
    assert ev["first_diverging_start_offset"] <= bad_offset < ev["first_diverging_end_offset"]
    assert ev["leader_segment"].endswith(".log")
    health = cluster.admin(leader, "/health")  # urllib raises on 503: read it raw
    import urllib.error
    import urllib.request
    spec = cluster.nodes[leader]
    try:
        urllib.request.urlopen(f"{cluster.admin_scheme}://{cluster.host}:{spec.admin_port}/health", timeout=2, context=_ctx(cluster))
        raise AssertionError("/health answered 200 after a divergence")
    except urllib.error.HTTPError as exc:
        assert exc.code == 503
        body = __import__("json").loads(exc.read())
    assert health is None and body["status"] == "degraded"
    assert f"divergence_replica_{victim}" in body["problems"]
    metrics = urllib.request.urlopen(f"{cluster.admin_scheme}://{cluster.host}:{spec.admin_port}/metrics", timeout=2, context=_ctx(cluster)).read().decode()
    assert f'metalog_divergence_detected_total{{replica="{victim}"}}' in metrics
    cluster.stop()
    for n in cluster.nodes:
        if n == victim:
            continue
        records = {v: (off, ep) for off, ep, v in committed_values(cluster.data_dir(n), hw)}
        assert all(records.get(v) == acked[v] for v in acked), f"broker {n} lost acknowledged records"
