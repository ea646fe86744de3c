"""Real processes, real files: a bit flipped in the middle of a sealed segment
of a FOLLOWER. Two ways in, each with exactly one finder:

* while the follower runs (the segment sealed after boot, damaged under the
  running broker, nothing reading it): the background scrubber finds it,
  within one pass and a pause at its rate;
* while the follower is stopped (the exact reproduction of issue 12): start-up's
  cheap check after a clean stop trusts the segment body, and the boot-time
  producer-state rebuild, which reads the log with CRC checks, finds it.

Either way the broker reports it: one corruption_detected event naming file,
byte, offset, both CRCs and the finder; /health degraded (503) with the
reason; the metric counts it under the finder; and consumers still read
every acknowledged record."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.error
import time
import urllib.request

import pytest

from metalog.broker.client import MetalogClient
from metalog.storage.batch import HEADER_SIZE, iter_batches
from metalog.storage.scrub import PASS_PAUSE_S

pytestmark = pytest.mark.slow

SEGMENT_BYTES = 16384  # several sealed segments, each with index entries (every 4096 bytes)
SCRUB_BYTES_PER_S = 100_000  # slow enough that a pass over the sealed segments takes a measurable time
# Beyond the scrubber's own time: its thread hands the find to the event
# loop, the event reaches broker.log, this test polls the file (50 ms).
HANDOFF_SLACK_S = 2.0


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


async def produce_values(cluster) -> list[bytes]:
    """600 records, 5 per request, one request at a time (~9 batches per
    segment): several sealed segments. Returns the acknowledged values."""
    client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls(), request_timeout_ms=3000)
    values = [f"record-{i:05d}-".encode() * 6 for i in range(600)]
    try:
        for i in range(0, len(values), 5):
            await client.produce(values[i:i + 5])
    finally:
        await client.close()
    return values


async def follower_caught_up(cluster, leader: int) -> int:
    """A follower that has flushed and applied everything the leader holds:
    from then on nothing of its own reads its sealed segments."""
    end = (await asyncio.to_thread(cluster.quorum, leader))["log_end_offset"]
    follower = next(n for n in cluster.nodes if n != leader)

    def caught_up():
        q = cluster.quorum(follower) or {}
        return q.get("flushed_end_offset", -1) >= end and q.get("applied_offset", -1) >= end

    await asyncio.to_thread(cluster.wait_for, caught_up, 20, "the follower to flush and apply everything")
    return follower


async def check_reported(cluster, follower: int, path: str, pos: int, offset: int, source: str,
                         values: list[bytes]) -> None:
    """What the user sees once `source` found the flip: the event, /health,
    the metric; and a consumer reads every acknowledged record."""
    events = [ln for ln in cluster.read_log_lines(follower) if ln.get("event") == "corruption_detected"]
    assert [(e["source"], e["file"], e["position"], e["offset"]) for e in events] == [(source, path, pos, offset)]
    assert events[0]["expected_crc"] != events[0]["actual_crc"]

    def degraded():
        code, body = http_get(cluster, follower, "/health")
        return json.loads(body) if code == 503 else None

    health = await asyncio.to_thread(cluster.wait_for, degraded, 10, "/health degraded")
    assert health["status"] == "degraded"
    (reason,) = [v for k, v in health["problems"].items() if path in k]
    assert f"at byte {pos} (offset {offset}, found by {source})" in reason and "CRC mismatch" in reason
    code, metrics = http_get(cluster, follower, "/metrics")
    assert f'metalog_corrupt_batches_total{{source="{source}"}} 1.0' in metrics

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


def scrub_bytes(cluster, node_id: int) -> float:
    _, text = http_get(cluster, node_id, "/metrics")
    line = next(ln for ln in text.splitlines() if ln.startswith("metalog_scrub_bytes_total "))
    return float(line.split()[1])


async def test_bit_flip_in_a_sealed_segment_of_a_running_follower_is_found_by_the_scrubber_in_bounded_time(
        make_cluster):
    """No restart, so start-up's checks and the producer-state rebuild never
    see the damage; the follower has flushed and applied everything and no
    consumer reads until the damage is reported, so no read meets it either.
    Only the scrubber can find it, and it must within the time its rate
    allows: the rest of a pass, the pause between passes and the next pass
    up to the damaged segment, each pass reading every sealed byte."""
    cluster = make_cluster(voters=3, segment_bytes_max=SEGMENT_BYTES, log_scrub_bytes_per_s=SCRUB_BYTES_PER_S)
    leader, _ = await asyncio.to_thread(cluster.wait_for_leader, 20)
    values = await produce_values(cluster)
    follower = await follower_caught_up(cluster, leader)
    log_dir = os.path.join(cluster.data_dir(follower), "__cluster_metadata-0")
    # A pass reads every sealed segment and every snapshot (the bootstrap one too).
    names = os.listdir(log_dir)
    scrubbed = sorted(n for n in names if n.endswith(".log"))[:-1] + [n for n in names if n.endswith(".checkpoint")]
    pass_bytes = sum(os.path.getsize(os.path.join(log_dir, n)) for n in scrubbed)
    await asyncio.to_thread(cluster.wait_for, lambda: scrub_bytes(cluster, follower) >= pass_bytes, 20,
                            "the scrubber to have read the sealed segments once")
    assert not [ln for ln in cluster.read_log_lines(follower) if ln.get("event") == "corruption_detected"]

    path, pos, offset = flip_mid_segment_bit(log_dir)
    flipped_at = time.monotonic()
    deadline_s = 2 * pass_bytes / SCRUB_BYTES_PER_S + PASS_PAUSE_S + HANDOFF_SLACK_S
    found = await asyncio.to_thread(
        cluster.wait_for, lambda: [ln for ln in cluster.read_log_lines(follower)
                                   if ln.get("event") == "corruption_detected"],
        deadline_s, f"the scrubber to find the flip within {deadline_s:.1f} s")
    took_s = time.monotonic() - flipped_at
    print(f"found by {found[0]['source']} {took_s:.2f} s after the flip ({pass_bytes} bytes a pass at "
          f"{SCRUB_BYTES_PER_S} B/s; bound {deadline_s:.2f} s)")
    assert any(ln.get("event") == "scrub_found_corruption" and ln.get("file") == path
               for ln in cluster.read_log_lines(follower))
    await check_reported(cluster, follower, path, pos, offset, "scrub", values)


async def test_bit_flip_in_a_sealed_segment_of_a_stopped_follower_is_found_by_the_boot_rebuild(make_cluster):
    """Issue 12's reproduction: the flip lands while the follower is stopped
    cleanly, before the segment's last index entry, so the cheap check at
    start trusts it. The producer-state rebuild reads the whole log with CRC
    checks before the broker serves: it finds the flip. The scrubber is off
    (log_scrub_bytes_per_s=0), so no other reader can stand in for it."""
    cluster = make_cluster(voters=3, segment_bytes_max=SEGMENT_BYTES, log_scrub_bytes_per_s=0)
    leader, _ = await asyncio.to_thread(cluster.wait_for_leader, 20)
    values = await produce_values(cluster)
    follower = await follower_caught_up(cluster, leader)
    assert cluster.stop_node(follower) == 0  # a clean stop: the next start trusts sealed bodies
    assert any(ln.get("event") == "broker_stopped" for ln in cluster.read_log_lines(follower))
    log_dir = os.path.join(cluster.data_dir(follower), "__cluster_metadata-0")
    path, pos, offset = flip_mid_segment_bit(log_dir)
    cluster.start_node(follower)
    await asyncio.to_thread(cluster.wait_for, lambda: [ln for ln in cluster.read_log_lines(follower)
                                                       if ln.get("event") == "corruption_detected"],
                            30, "the boot rebuild to report the flip")
    await check_reported(cluster, follower, path, pos, offset, "producer_state", values)


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
