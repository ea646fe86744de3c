"""Real processes: what a replica does when its data is corrupt (issue 12
item 4). A bit flips in the middle of a sealed segment of a follower, of the
leader while it leads, of every copy; a zeroed tail. Each test says what the
user sees (events in broker.log, /health) and checks that every acknowledged
record is still readable from the cluster (except where every copy is bad,
which is documented in docs/integrity.md)."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import urllib.error
import urllib.request

import pytest

from metalog.broker.client import MetalogClient
from metalog.storage.batch import HEADER_SIZE, iter_batches
from tests.integration.test_cluster import FAST, committed_values, produce_all

pytestmark = pytest.mark.slow

PART = "__cluster_metadata-0"


def _ctx(cluster):
    """The client TLS context of the cluster (None when it runs the insecure mode)."""
    tls = cluster.client_tls()
    return tls.client() if tls else None
SMALL = dict(FAST, segment_bytes_max=4096)


def segments(data_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(data_dir, PART, "*.log")))


def flip_bit_in_sealed_segment(data_dir: str, base_offset: int | None = None) -> tuple[str, int]:
    """Flip one bit in the payload of a batch in the middle of a sealed segment
    in the middle of the log (or of the batch at `base_offset`). Returns
    (segment path, batch base offset)."""
    segs = segments(data_dir)[:-1]  # sealed ones only
    assert len(segs) >= 3, "several sealed segments"
    for path in ([segs[len(segs) // 2]] if base_offset is None else segs):
        with open(path, "r+b") as f:
            data = f.read()
            found = [(pos, h) for pos, h in iter_batches(data) if h.size > HEADER_SIZE + 6]
            if base_offset is not None:
                found = [(pos, h) for pos, h in found if h.base_offset == base_offset]
            if not found:
                continue
            pos, h = found[len(found) // 2]
            f.seek(pos + HEADER_SIZE + 6)
            byte = data[pos + HEADER_SIZE + 6]
            f.write(bytes([byte ^ 0x04]))
            f.flush()
            os.fsync(f.fileno())
            return path, h.base_offset
    raise AssertionError(f"no batch at {base_offset} in {data_dir}")


def health(cluster, node: int) -> tuple[int, dict]:
    spec = cluster.nodes[node]
    try:
        with urllib.request.urlopen(f"{cluster.admin_scheme}://{cluster.host}:{spec.admin_port}/health", timeout=2, context=_ctx(cluster)) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def events(cluster, node: int, name: str) -> list[dict]:
    return [x for x in cluster.read_log_lines(node) if x.get("event") == name]


async def produce_records(cluster, n: int, prefix: str) -> dict[bytes, tuple[int, int]]:
    client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls(), request_timeout_ms=5000, max_retries=50)
    try:
        return await produce_all(client, [f"{prefix}-{i:05d}".encode() * 3 for i in range(n)], concurrency=8)
    finally:
        await client.close()


async def read_all_from_cluster(cluster, hw: int, start: int = 0) -> dict[bytes, tuple[int, int]]:
    """Every record in [start, hw), read by a consumer from the cluster's leader."""
    client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls(), request_timeout_ms=5000, max_retries=50)
    out: dict[bytes, tuple[int, int]] = {}
    try:
        if start == 0:
            consumer = client.consumer(reset_policy="none")
            consumer.seek(0)
        else:
            consumer = client.consumer(reset_policy="earliest")  # the log start, with its epoch
        while consumer.position is None or consumer.position < hw:
            for r in await consumer.poll(max_wait_ms=200):
                out[r.value] = (r.offset, r.leader_epoch)
    finally:
        await client.close()
    return out


def caught_up(cluster, node: int, hw: int):
    return lambda: (cluster.quorum(node) or {}).get("high_watermark", -1) >= hw


async def assert_refused_to_start(cluster, path: str, bad: int) -> None:
    """What a sole voter with damaged data shows at start (docs/integrity.md):
    exit 3, ONE `fatal` event (refused_to_start) and the stderr line naming
    the file, the offset and the recover command; nothing cut."""
    assert await asyncio.to_thread(cluster.procs[1].wait, 30) == 3
    fatal = events(cluster, 1, "fatal")
    assert len(fatal) == 1 and fatal[0]["cause"] == "refused_to_start"
    want = f"metalog storage recover --data-dir {cluster.data_dir(1)} --truncate-at-corruption"
    assert want in fatal[0]["reason"] and path in fatal[0]["reason"] and f"offset {bad}" in fatal[0]["reason"]
    (line,) = [ln for ln in open(os.path.join(cluster.node_dir(1), "stderr.log")) if "refusing to start" in ln]
    assert want in line and path in line and f"offset {bad}" in line
    assert os.path.exists(path) and not os.path.exists(path + ".corrupt"), "nothing cut without consent"


async def test_bit_flip_in_a_sealed_segment_of_a_follower_is_quarantined_and_refetched(make_cluster):
    """The user sees, on the follower: one `corruption_detected` error event
    with source "startup" (file, byte position, offset, expected and actual
    CRC) and `started_quarantined`, never `log_quarantined` (which is run
    time's): SMALL's 4 KiB segments hold no index entry (one is written every
    4096 bytes), so even the cheap check after a clean stop verifies each of
    them whole and the log's open finds the flip before anything reads it.
    Then the bad segment and later ones kept as *.corrupt, /health 503
    "degraded" naming the file; then `quarantine_cleared` once it
    re-replicated past the end it had. Every acknowledged record is readable
    from the cluster and from the follower's own log."""
    cluster = make_cluster(voters=3, **SMALL)
    leader, _ = await asyncio.to_thread(cluster.wait_for_leader, 20)
    acked = await produce_records(cluster, 600, "f")
    hw = max(off for off, _ in acked.values()) + 1
    victim = next(n for n in cluster.nodes if n != leader)
    await asyncio.to_thread(cluster.wait_for, caught_up(cluster, victim, hw), 20, "the follower at the HW")
    assert cluster.stop_node(victim) == 0
    path, bad = flip_bit_in_sealed_segment(cluster.data_dir(victim))
    cluster.start_node(victim)
    found = await asyncio.to_thread(cluster.wait_for, lambda: events(cluster, victim, "corruption_detected"), 20,
                                    "the corruption to be found")
    (ev,) = found
    assert ev["level"] == "error" and ev["source"] == "startup" and ev["file"] == path and ev["offset"] == bad
    assert ev["expected_crc"] != ev["actual_crc"] and ev["position"] > 0
    # Logged a moment after corruption_detected, once the open is done: await it.
    (started,) = await asyncio.to_thread(cluster.wait_for, lambda: events(cluster, victim, "started_quarantined"),
                                         20, "the broker to start quarantined")
    assert [r["file"] for r in started["reports"]] == [path] and started["log_end_offset"] == bad
    assert not events(cluster, victim, "log_quarantined"), "found at open, not at run time"
    await asyncio.to_thread(cluster.wait_for, lambda: events(cluster, victim, "quarantine_cleared"), 30,
                            "the follower to re-replicate past its old end")
    assert cluster.quorum(victim)["must_reach_offset"] == -1
    assert os.path.exists(path + ".corrupt")
    code, body = health(cluster, victim)
    assert code == 503 and body["status"] == "degraded" and any(path in v for v in body["problems"].values())
    assert not events(cluster, victim, "fatal")
    got = await read_all_from_cluster(cluster, hw)
    assert all(got.get(v) == acked[v] for v in acked)
    await asyncio.to_thread(cluster.wait_for, caught_up(cluster, victim, hw), 20, "the follower at the HW again")
    cluster.stop()
    mine = {v: (off, ep) for off, ep, v in committed_values(cluster.data_dir(victim), hw)}
    assert all(mine.get(v) == acked[v] for v in acked), "the follower's log lacks acknowledged records"


async def test_bit_flip_in_a_sealed_segment_of_the_leader_makes_it_resign(make_cluster):
    """While it leads, a bit flips in one of the leader's sealed segments; a
    consumer reading from offset 0 makes the leader read it. The consumer never
    gets the damaged bytes (the leader answers KAFKA_STORAGE_ERROR and the
    client retries elsewhere); the user sees `corruption_detected` (source
    fetch) on the leader, which resigns (EndQuorumEpoch): another broker leads
    a newer epoch, the old leader quarantines, re-replicates and leaves
    quarantine. Every acknowledged record is read back, and writes go on.
    The scrubber is off, so the read answering the Fetch is the one finder."""
    cluster = make_cluster(voters=3, **SMALL, log_scrub_bytes_per_s=0)
    leader, epoch = await asyncio.to_thread(cluster.wait_for_leader, 20)
    acked = await produce_records(cluster, 600, "l")
    hw = max(off for off, _ in acked.values()) + 1
    path, bad = flip_bit_in_sealed_segment(cluster.data_dir(leader))
    got = await read_all_from_cluster(cluster, hw)
    assert all(got.get(v) == acked[v] for v in acked)
    new_leader, new_epoch = await asyncio.to_thread(cluster.wait_for_leader, 30, {leader})
    assert new_epoch > epoch
    (ev,) = events(cluster, leader, "corruption_detected")
    assert (ev["source"], ev["offset"], ev["file"]) == ("fetch", bad, path)
    await asyncio.to_thread(cluster.wait_for, lambda: events(cluster, leader, "quarantine_cleared"), 30,
                            "the old leader to leave quarantine")
    acked.update(await produce_records(cluster, 50, "after"))
    hw = max(off for off, _ in acked.values()) + 1
    got = await read_all_from_cluster(cluster, hw)
    assert all(got.get(v) == acked[v] for v in acked)
    assert not events(cluster, leader, "fatal")


async def test_bit_flip_in_every_copy_leaves_no_leader_and_says_so(make_cluster):
    """The same batch is damaged on every voter while they are down. Each finds
    it at open (4 KiB segments are verified whole), starts quarantined and
    abstains, so no leader is elected (no voter can prove
    it holds what it acknowledged): every /health is 503 "degraded" naming the
    quarantine, and no broker exits with a traceback. Recovery needs the
    operator (docs/integrity.md: metalog storage recover --truncate-at-corruption)."""
    cluster = make_cluster(voters=3, log_scrub_bytes_per_s=2_000_000, **SMALL)
    leader, _ = await asyncio.to_thread(cluster.wait_for_leader, 20)
    acked = await produce_records(cluster, 600, "e")
    hw = max(off for off, _ in acked.values()) + 1
    for n in cluster.nodes:
        await asyncio.to_thread(cluster.wait_for, caught_up(cluster, n, hw), 20, f"broker {n} at the HW")
    for n in cluster.nodes:
        assert cluster.stop_node(n) == 0
    _, bad = flip_bit_in_sealed_segment(cluster.data_dir(1))
    for n in (2, 3):
        flip_bit_in_sealed_segment(cluster.data_dir(n), base_offset=bad)
    cluster.start()

    def all_quarantined():
        return all(events(cluster, n, "started_quarantined") for n in cluster.nodes)

    await asyncio.to_thread(cluster.wait_for, all_quarantined, 30, "every voter to quarantine")
    await asyncio.sleep(3)  # several election timeouts: nobody may win
    views = [cluster.quorum(n) for n in cluster.nodes]
    assert all(v is not None and v["role"] != "leader" for v in views), views
    for n in cluster.nodes:
        code, body = health(cluster, n)
        assert code == 503 and "quarantine" in body["problems"]
        assert cluster.alive(n)
        assert "Traceback" not in open(os.path.join(cluster.node_dir(n), "stderr.log")).read()


async def test_a_zeroed_tail_is_cut_and_refetched(make_cluster):
    """A follower killed with -9 whose last segment ends in zeros (a torn write):
    at start the tail is cut (`log_recovered`), it fetches the rest and holds
    every acknowledged record; /health is ok (a torn tail is not corruption)."""
    cluster = make_cluster(voters=3, **SMALL)
    leader, _ = await asyncio.to_thread(cluster.wait_for_leader, 20)
    acked = await produce_records(cluster, 300, "z")
    hw = max(off for off, _ in acked.values()) + 1
    victim = next(n for n in cluster.nodes if n != leader)
    await asyncio.to_thread(cluster.wait_for, caught_up(cluster, victim, hw), 20, "the follower at the HW")
    cluster.kill(victim)
    last = segments(cluster.data_dir(victim))[-1]
    size = os.path.getsize(last)
    with open(last, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\0" * (size - size // 2))
    cluster.start_node(victim)
    await asyncio.to_thread(cluster.wait_for, caught_up(cluster, victim, hw), 20, "the follower at the HW again")
    assert events(cluster, victim, "log_recovered")
    assert not events(cluster, victim, "corruption_detected")
    code, body = health(cluster, victim)
    assert code == 200, body
    cluster.stop()
    mine = {v: (off, ep) for off, ep, v in committed_values(cluster.data_dir(victim), hw)}
    assert all(mine.get(v) == acked[v] for v in acked)


async def test_a_sole_voter_with_corruption_refuses_and_names_the_recover_command(make_cluster):
    """One voter: no other copy exists, so a damaged sealed segment is not cut
    away silently. The log's open finds the flip (SMALL's 4 KiB segments have
    no index entry, so the cheap check verifies them whole) and the broker
    refuses to start: exit 3 (docs/integrity.md; 4 is for damage found while
    it runs), ONE `fatal` event and a stderr line naming the file, the offset
    and the exact command that truncates there with the operator's consent."""
    cluster = make_cluster(voters=1, **SMALL)
    await asyncio.to_thread(cluster.wait_for_leader, 20)
    await produce_records(cluster, 400, "s")
    assert cluster.stop_node(1) == 0
    path, bad = flip_bit_in_sealed_segment(cluster.data_dir(1))
    cluster.start_node(1)
    await assert_refused_to_start(cluster, path, bad)


async def test_a_sole_voter_whose_boot_rebuild_meets_corruption_refuses_to_start_the_same_way(make_cluster):
    """The flip where the log's open does not look: 16 KiB segments carry
    index entries, a clean stop makes the open trust what lies before a
    segment's last entry, and the boot-time producer-state rebuild is the
    reader that meets the damage. That is still before the broker serves
    anything, so it is the same refusal to start (docs/integrity.md): exit 3,
    ONE `fatal` event (refused_to_start) and the stderr line naming the file,
    the offset and the recover command; nothing cut."""
    from tests.integration.test_integrity_storage import SEGMENT_BYTES, flip_mid_segment_bit, produce_values

    cluster = make_cluster(voters=1, **dict(FAST, segment_bytes_max=SEGMENT_BYTES), log_scrub_bytes_per_s=0)
    await asyncio.to_thread(cluster.wait_for_leader, 20)
    await produce_values(cluster)
    assert cluster.stop_node(1) == 0  # a clean stop: the next open trusts sealed bodies
    path, _pos, bad = flip_mid_segment_bit(os.path.join(cluster.data_dir(1), PART))
    cluster.start_node(1)
    await assert_refused_to_start(cluster, path, bad)


async def test_a_sole_voter_whose_scrubber_finds_corruption_stops_naming_the_recover_command(make_cluster):
    """Damage found while a sole voter runs (the scrubber reads a segment
    flipped under it) is no refusal to start: the broker stops with exit 4
    and ONE `fatal` event of cause corruption_no_other_copy naming the file,
    the offset and the recover command; nothing cut."""
    cluster = make_cluster(voters=1, **SMALL, log_scrub_bytes_per_s=2_000_000)
    await asyncio.to_thread(cluster.wait_for_leader, 20)
    await produce_records(cluster, 400, "r")
    path, bad = flip_bit_in_sealed_segment(cluster.data_dir(1))
    assert await asyncio.to_thread(cluster.procs[1].wait, 30) == 4
    fatal = events(cluster, 1, "fatal")
    assert len(fatal) == 1 and fatal[0]["cause"] == "corruption_no_other_copy", fatal
    want = f"metalog storage recover --data-dir {cluster.data_dir(1)} --truncate-at-corruption"
    assert want in fatal[0]["reason"] and path in fatal[0]["reason"] and f"offset {bad}" in fatal[0]["reason"]
    (found,) = events(cluster, 1, "corruption_detected")
    assert (found["source"], found["file"], found["offset"]) == ("scrub", path, bad)
    assert os.path.exists(path) and not os.path.exists(path + ".corrupt"), "nothing cut without consent"


async def test_damaged_quorum_state_is_a_clear_refusal_and_a_damaged_epoch_checkpoint_is_rebuilt(make_cluster):
    """quorum-state holds this voter's vote: a bit flip that breaks it makes the
    broker refuse to start (exit 3, one `fatal` event, stderr says why and what
    to do), never a traceback. The leader-epoch-checkpoint is derived data: a
    damaged one is kept as .corrupt and rebuilt from the log
    (`epoch_checkpoint_unreadable`); the broker catches up with every acked record."""
    cluster = make_cluster(voters=3, **SMALL)
    leader, _ = await asyncio.to_thread(cluster.wait_for_leader, 20)
    acked = await produce_records(cluster, 300, "q")
    hw = max(off for off, _ in acked.values()) + 1
    a, b = [n for n in cluster.nodes if n != leader]
    for n in (a, b):
        await asyncio.to_thread(cluster.wait_for, caught_up(cluster, n, hw), 20, f"broker {n} at the HW")
    assert cluster.stop_node(a) == 0 and cluster.stop_node(b) == 0
    qs = os.path.join(cluster.data_dir(a), PART, "quorum-state")
    raw = bytearray(open(qs, "rb").read())
    raw[raw.index(b'"') + 1] ^= 0x01  # a bit of the first key's first letter
    open(qs, "wb").write(raw)
    ckpt = os.path.join(cluster.data_dir(b), PART, "leader-epoch-checkpoint")
    raw = bytearray(open(ckpt, "rb").read())
    raw[0] ^= 0x01  # the version line
    open(ckpt, "wb").write(raw)
    cluster.start_node(a)
    cluster.start_node(b)
    assert await asyncio.to_thread(cluster.procs[a].wait, 30) == 3
    fatal = events(cluster, a, "fatal")
    assert len(fatal) == 1 and fatal[0]["cause"] == "refused_to_start" and "quorum-state" in fatal[0]["reason"]
    stderr = open(os.path.join(cluster.node_dir(a), "stderr.log")).read()
    assert "refusing to start" in stderr and "vote twice" in stderr and "Traceback" not in stderr
    await asyncio.to_thread(cluster.wait_for, caught_up(cluster, b, hw), 20, "the rebuilt broker at the HW")
    assert events(cluster, b, "epoch_checkpoint_unreadable") and os.path.exists(ckpt + ".corrupt")
    got = await read_all_from_cluster(cluster, hw)
    assert all(got.get(v) == acked[v] for v in acked)


async def test_a_bit_flip_in_a_follower_snapshot_is_kept_as_corrupt_and_fetched_again(make_cluster):
    """A follower's snapshot (the one its log starts at) gets a flipped bit
    while it is down. At start the snapshot is kept as .corrupt, never loaded;
    the broker starts over and fetches the snapshot and log from the leader,
    then holds the same metadata as the leader; no traceback, no fatal event.
    Every acknowledged record is readable from the cluster."""
    from tests.integration.test_snapshots import SNAPSHOTTING, identical_metadata, write_metadata

    cluster = make_cluster(voters=3, **SNAPSHOTTING)
    await asyncio.to_thread(cluster.wait_for_leader, 20)
    await write_metadata(cluster, brokers=3, topics=5, filler=400)
    acked = await produce_records(cluster, 100, "snap")
    hw = max(off for off, _ in acked.values()) + 1
    leader, _ = cluster.leader()
    victim = next(n for n in cluster.nodes if n != leader)

    def has_snapshot():
        q = cluster.quorum(victim)
        return q and q["snapshots"] and q["log_start_offset"] > 0 and q["high_watermark"] >= hw

    await asyncio.to_thread(cluster.wait_for, has_snapshot, 30, "a snapshot on the follower")
    assert cluster.stop_node(victim) == 0
    snaps = sorted(glob.glob(os.path.join(cluster.data_dir(victim), PART, "*.checkpoint")))
    assert snaps
    with open(snaps[-1], "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0x10
        f.seek(0)
        f.write(data)
    cluster.start_node(victim)
    await asyncio.to_thread(cluster.wait_for, caught_up(cluster, victim, hw), 30, "the follower at the HW again")
    await asyncio.to_thread(cluster.wait_for, lambda: identical_metadata(cluster, [leader, victim]), 20,
                            "the same metadata as the leader")
    assert glob.glob(os.path.join(cluster.data_dir(victim), PART, "*.corrupt*"))
    assert not events(cluster, victim, "fatal")
    assert "Traceback" not in open(os.path.join(cluster.node_dir(victim), "stderr.log")).read()
    # Records below the leader's log start live on as the snapshot's state (KIP-630).
    start = cluster.quorum(cluster.leader()[0])["log_start_offset"]
    got = await read_all_from_cluster(cluster, hw, start)
    assert all(got.get(v) == acked[v] for v in acked if acked[v][0] >= start)
