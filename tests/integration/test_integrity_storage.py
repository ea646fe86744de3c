"""Real processes, real files: a bit flipped in the middle of a sealed segment
of a stopped FOLLOWER (the exact reproduction of issue 12). Start-up's cheap
check after a clean stop trusts the segment body; the scrubber re-reads it and
the broker reports it: one corruption_detected event naming file, byte,
offset and both CRCs, /health degraded (503) with the reason, the metric
counts it, and consumers still read every acknowledged record."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.error
import urllib.request

import pytest

from metalog.broker.client import MetalogClient
from metalog.storage.batch import HEADER_SIZE, iter_batches

pytestmark = pytest.mark.slow

SEGMENT_BYTES = 16384  # several sealed segments, each with index entries (every 4096 bytes)


def http_get(cluster, node_id: int, path: str) -> tuple[int, str]:
    url = f"{cluster.admin_scheme}://{cluster.host}:{cluster.nodes[node_id].admin_port}{path}"
    tls = cluster.client_tls()
    try:
        with urllib.request.urlopen(url, timeout=2, context=tls.client() if tls else None) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def flip_mid_segment_bit(log_dir: str) -> tuple[str, int, int]:
    """Flip one bit inside the records of the third batch of the second
    sealed segment, before its first index entry (so before its last one:
    the part start-up's cheap check trusts); return (file, batch position,
    batch base offset)."""
    segments = sorted(n for n in os.listdir(log_dir) if n.endswith(".log"))
    assert len(segments) >= 3, segments
    path = os.path.join(log_dir, segments[1])
    data = open(path, "rb").read()
    pos, h = list(iter_batches(data))[2]
    assert 0 < pos and pos + h.size < 4096 < len(data)  # well inside the segment
    with open(path, "r+b") as f:
        f.seek(pos + HEADER_SIZE + 6)
        byte = f.read(1)[0]
        f.seek(pos + HEADER_SIZE + 6)
        f.write(bytes([byte ^ 0x10]))
    return path, pos, h.base_offset


async def test_bit_flip_in_a_sealed_segment_of_a_follower_is_found_and_reported(make_cluster):
    cluster = make_cluster(voters=3, segment_bytes_max=SEGMENT_BYTES, log_scrub_bytes_per_s=20_000_000)
    leader, _ = await asyncio.to_thread(cluster.wait_for_leader, 20)
    follower = next(n for n in cluster.nodes if n != leader)
    client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls(), request_timeout_ms=3000)
    values = [f"record-{i:05d}-".encode() * 6 for i in range(600)]
    try:
        for i in range(0, len(values), 5):  # one request at a time: ~9 batches per segment
            await client.produce(values[i:i + 5])
    finally:
        await client.close()
    end = (await asyncio.to_thread(cluster.quorum, leader))["log_end_offset"]
    await asyncio.to_thread(cluster.wait_for, lambda: (cluster.quorum(follower) or {}).get(
        "flushed_end_offset", -1) >= end, 20, "the follower to catch up")
    assert cluster.stop_node(follower) == 0  # a clean stop: the next start trusts sealed bodies
    assert any(ln.get("event") == "broker_stopped" for ln in cluster.read_log_lines(follower))
    log_dir = os.path.join(cluster.data_dir(follower), "__cluster_metadata-0")
    path, pos, offset = flip_mid_segment_bit(log_dir)
    cluster.start_node(follower)

    def degraded():
        code, body = http_get(cluster, follower, "/health")
        return (code, json.loads(body)) if code == 503 else None

    code, health = await asyncio.to_thread(cluster.wait_for, degraded, 30, "/health degraded")
    assert health["status"] == "degraded"
    (reason,) = [v for k, v in health["problems"].items() if path in k]
    events = [ln for ln in cluster.read_log_lines(follower) if ln.get("event") == "corruption_detected"]
    # Whichever reader meets the damage first reports it: the scrubber, or the
    # producer-state rebuild at boot (it reads the log with CRC checks).
    source = events[0]["source"]
    assert source in ("scrub", "producer_state")
    assert f"at byte {pos} (offset {offset}, found by {source})" in reason and "CRC mismatch" in reason
    assert events[0]["file"] == path and events[0]["position"] == pos and events[0]["offset"] == offset
    assert events[0]["expected_crc"] != events[0]["actual_crc"]
    code, metrics = http_get(cluster, follower, "/metrics")
    assert f'metalog_corrupt_batches_total{{source="{source}"}} 1.0' in metrics
    assert "metalog_scrub_bytes_total" in metrics

    # Consumers get every acknowledged record, in order, never a silent stop.
    client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls(), request_timeout_ms=3000)
    consumer = client.consumer(reset_policy="none")
    consumer.seek(0)
    got: list[bytes] = []
    try:
        for _ in range(200):
            got += [r.value for r in await consumer.poll(max_wait_ms=200)]
            if len(got) >= len(values):
                break
    finally:
        await client.close()
    assert got == values


async def test_bit_flip_in_quorum_state_refuses_to_start_naming_the_file(make_cluster):
    """A flipped digit in quorum-state would forge the vote: the broker exits 3
    and says which file is damaged and what to do, on stderr and in its log."""
    cluster = make_cluster(voters=1, log_scrub_bytes_per_s=0)
    await asyncio.to_thread(cluster.wait_for_leader, 20)
    assert cluster.stop_node(1) == 0
    path = os.path.join(cluster.data_dir(1), "__cluster_metadata-0", "quorum-state")
    raw = open(path, "rb").read()
    flipped = raw.replace(b'"leaderEpoch": 1', b'"leaderEpoch": 3')  # '1' ^ '3' is one bit
    assert flipped != raw
    open(path, "wb").write(flipped)
    proc = cluster.start_node(1)
    assert await asyncio.to_thread(proc.wait, 30) == 3
    stderr = open(os.path.join(cluster.node_dir(1), "stderr.log")).read()
    assert f"refusing to start: {path}: quorum-state checksum mismatch (stored 0x" in stderr
    assert "the file is damaged and its vote cannot be trusted" in stderr
