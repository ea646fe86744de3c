"""A broker whose disk fills up fail-stops with a clear error and loses no
acknowledged record: after a restart with space again, every record it
acknowledged is there and no partial batch is visible.

The "full disk" is a real file-size limit (RLIMIT_FSIZE) on the broker
process: its write() fails with EFBIG exactly as it would with ENOSPC."""

from __future__ import annotations

import asyncio
import glob
import os
import shutil
import signal
import subprocess
import sys

import pytest

from metalog.broker.client import ClusterUnavailable, MetalogClient, MetalogError
from metalog.storage.batch import iter_batches
from tests.integration.conftest import limit_file_size
from metalog.storage.segments import SegmentedLog

pytestmark = pytest.mark.slow

LIMIT_BYTES = 256 * 1024


async def test_full_disk_stops_the_broker_with_a_clear_error_and_keeps_acked_records(make_cluster):
    cluster = make_cluster(voters=1, start=False, election_timeout_ms=300, fetch_timeout_ms=800,
                           request_timeout_ms=800, fetch_max_wait_ms=100)
    limit_file_size(cluster, 1, LIMIT_BYTES)
    cluster.start()
    await asyncio.to_thread(cluster.wait_for_leader, 20)
    client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls(), request_timeout_ms=2000, max_retries=1)
    acked: dict[bytes, int] = {}
    try:
        with pytest.raises((ClusterUnavailable, MetalogError)):
            for i in range(100_000):
                value = f"{i:08d}".encode() * 64  # 512 bytes: the limit is hit after ~500 records
                offset, _ = await client.produce([value])
                acked[value] = offset
    finally:
        await client.close()
    assert 100 < len(acked) < 1000
    proc = cluster.procs[1]
    assert await asyncio.to_thread(proc.wait, 30) == 4  # fail-stop after a storage error
    failures = [line for line in cluster.read_log_lines(1) if line.get("event") == "fatal"]
    assert len(failures) == 1 and failures[0]["cause"] == "storage_failed"
    assert "File too large" in failures[0]["reason"]
    assert "append failed" in failures[0]["reason"]

    # With space again the broker recovers: whole batches only, nothing acked lost.
    part = os.path.join(cluster.data_dir(1), "__cluster_metadata-0")
    log = SegmentedLog.open(part)
    data = log.read(0, log.log_end_offset, 1 << 30)
    end = log.log_end_offset
    log.close()
    positions = list(iter_batches(data))
    assert positions and positions[-1][1].next_offset == end
    await _restart_and_check_acked(cluster, acked)


def _tmpfs_mountable() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


async def test_enospc_on_a_real_small_filesystem_answers_storage_error_and_recovers(make_cluster):
    """The data dir is a real 2 MiB tmpfs (a mount namespace; where the machine
    refuses one, RLIMIT_FSIZE stands in so the test still runs). What the user
    sees: the write that hit the full disk is answered KAFKA_STORAGE_ERROR (56)
    naming the cause, the broker logs ONE fatal event and exits 4; after a
    restart with space (the data moved to a bigger disk) every acknowledged
    record is there."""
    # Static voters: the tmpfs mounted over the data dir would hide the
    # bootstrap checkpoint the launcher formats a dynamic quorum with.
    cluster = make_cluster(voters=1, start=False, dynamic=False, election_timeout_ms=300, fetch_timeout_ms=800,
                           request_timeout_ms=800, fetch_max_wait_ms=100, log_scrub_bytes_per_s=0)
    path = cluster.write_config(1)
    data = cluster.data_dir(1)
    os.makedirs(data, exist_ok=True)
    saved = data + ".saved"
    os.makedirs(saved)
    if _tmpfs_mountable():
        reason = "No space left on device"
        script = (f'mount -t tmpfs -o size=2m tmpfs "$1" && {sys.executable} -m metalog.broker.server.main --config "$2"; '
                  'rc=$?; cp -a "$1/." "$3/"; exit $rc')
        cluster.nodes[1].command = ["unshare", "-rm", "sh", "-c", script, "sh", data, path, saved]
    else:
        reason = "File too large"
        limit_file_size(cluster, 1, 2 << 20)
    cluster.start()
    proc = cluster.procs[1]
    try:
        await asyncio.to_thread(cluster.wait_for_leader, 20)
        client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls(), request_timeout_ms=2000, max_retries=0)
        acked: dict[bytes, int] = {}
        try:
            with pytest.raises(ClusterUnavailable) as err:
                for i in range(100_000):
                    value = f"{i:08d}".encode() * 128  # 1 KiB: the 2 MiB disk is full after ~2000
                    offset, _ = await client.produce([value])
                    acked[value] = offset
        finally:
            await client.close()
        cause = err.value.__cause__
        assert isinstance(cause, MetalogError) and cause.error_name == "KAFKA_STORAGE_ERROR", repr(err.value)
        assert reason in str(cause) and "storage error on broker 1" in str(cause)
        assert 500 < len(acked) < 2100
        assert await asyncio.to_thread(proc.wait, 30) == 4
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the shell and the broker under it
            proc.wait(30)
    lines = cluster.read_log_lines(1)
    fatal = [ln for ln in lines if ln.get("event") in ("fatal", "storage_failed")]
    assert len(fatal) == 1 and reason in fatal[0]["reason"]
    if cluster.nodes[1].command[0] == "unshare":
        shutil.rmtree(data)  # the mount is gone with its namespace: restore the copy taken inside it
        os.rename(saved, data)
    await _restart_and_check_acked(cluster, acked)


async def _restart_and_check_acked(cluster, acked: dict[bytes, int]) -> None:
    """Restart node 1 as a plain broker and read every acknowledged record at its acknowledged offset."""
    cluster.nodes[1].command = None
    cluster.start_node(1)
    await asyncio.to_thread(cluster.wait_for_leader, 20)
    client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls(), request_timeout_ms=3000)
    consumer = client.consumer(reset_policy="none")
    consumer.seek(0)
    seen: dict[bytes, int] = {}
    try:
        while len(seen) < len(acked):
            records = await consumer.poll(max_wait_ms=200)
            if not records:
                break
            seen.update((r.value, r.offset) for r in records)
    finally:
        await client.close()
    assert all(seen.get(v) == off for v, off in acked.items()), "an acknowledged record was lost"


async def test_full_disk_during_a_snapshot_download_stops_the_broker_and_frees_the_partial(make_cluster):
    """A wiped follower catching up by FetchSnapshot under a file-size limit
    smaller than the snapshot: what the operator sees is one `fatal` event,
    cause storage_failed, naming the download and "File too large", exit
    code 4, and no .part file left; with space again it downloads afresh."""
    from tests.integration.test_snapshots import SNAPSHOTTING, part_dir, write_metadata

    cluster = make_cluster(voters=3, **SNAPSHOTTING)
    await asyncio.to_thread(cluster.wait_for_leader, 20)
    await write_metadata(cluster, brokers=3, topics=120, filler=300)
    leader, _ = cluster.leader()

    def snapshot_bytes():
        q = cluster.quorum(leader)
        if not (q and q["log_start_offset"] > 0 and q["snapshots"]):
            return None
        sizes = [os.path.getsize(p) for p in glob.glob(os.path.join(part_dir(cluster, leader), "*.checkpoint"))]
        return max(sizes, default=None)

    size = await asyncio.to_thread(cluster.wait_for, snapshot_bytes, 30, "a snapshot and a log start past 0")
    limit = 16 * 1024
    assert size > 2 * limit, size
    follower = next(n for n in cluster.nodes if n != leader)
    cluster.kill(follower)
    shutil.rmtree(cluster.data_dir(follower))
    limit_file_size(cluster, follower, limit)
    cluster.start_node(follower)
    assert await asyncio.to_thread(cluster.procs[follower].wait, 60) == 4
    fatal = [line for line in cluster.read_log_lines(follower) if line.get("event") == "fatal"]
    assert len(fatal) == 1 and fatal[0]["cause"] == "storage_failed", fatal
    assert "snapshot download" in fatal[0]["reason"] and "File too large" in fatal[0]["reason"]
    assert not glob.glob(os.path.join(part_dir(cluster, follower), "*.part"))

    cluster.nodes[follower].command = None  # space again: the usual command line
    cluster.start_node(follower)

    def caught_up():
        q, lq = cluster.quorum(follower), cluster.quorum(leader)
        return q and lq and q["snapshots"] and q["high_watermark"] == lq["high_watermark"]

    await asyncio.to_thread(cluster.wait_for, caught_up, 30, "the follower to download again and catch up")
