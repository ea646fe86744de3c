"""A real broker and a format-version-1 or -2 data dir: refused, upgraded with
`metalog storage upgrade`, started, every record read back by a client (and
for version 2, whose records are metadata, the controller state compared)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from metalog.broker.client import MetalogClient
from metalog.storage.snapshot import SnapshotId, snapshot_filename
from tests.formats.test_format_upgrade import PART, expected_state, v2_workload, value_v3, write_v1_dir, write_v2_dir
from metalog.tools.cluster.launcher import REPO_ROOT


@pytest.mark.slow

def read_values(cluster, count: int) -> list[bytes]:
    """At least `count` record values from offset 0, read by a real client (60 s at most)."""
    async def read_all() -> list[bytes]:
        client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls(),
                               request_timeout_ms=5000)
        try:
            consumer = client.consumer()
            got: list[bytes] = []
            while len(got) < count:
                got += [r.value for r in await consumer.poll(max_wait_ms=500)]
            return got
        finally:
            await client.close()

    return asyncio.run(asyncio.wait_for(read_all(), 60))

def test_format_old_upgrade_start_and_every_record_is_there(make_cluster):
    """A real broker refuses the version-1 dir (exit 3, the message on
    stderr), `metalog storage upgrade` converts it, the broker starts and a
    client reads every record back."""
    # Static voters: a version-1 dir comes from a build before the dynamic
    # quorum and holds no voter set.
    cluster = make_cluster(voters=1, start=False, dynamic=False, election_timeout_ms=300, fetch_timeout_ms=800)
    data = cluster.data_dir(1)
    values = write_v1_dir(data, cluster_id=cluster.cluster_id)
    os.remove(os.path.join(data, PART, snapshot_filename(SnapshotId(1, 1))))  # not this log's state
    proc = cluster.start_node(1)
    assert proc.wait(timeout=60) == 3
    with open(os.path.join(cluster.node_dir(1), "stderr.log")) as fh:
        assert f"metalog storage upgrade --data-dir {data}" in fh.read()
    up = subprocess.run([sys.executable, "-m", "metalog.tools.cli", "storage", "upgrade", "--data-dir", data],
                        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert up.returncode == 0, up.stderr
    assert "upgraded" in up.stdout and "2 file(s) rewritten" in up.stdout
    cluster.start_node(1)
    cluster.wait_for_leader(30)

    assert read_values(cluster, len(values)) == values


@pytest.mark.slow
def test_format_v2_upgrade_start_and_the_controller_state_is_the_same(make_cluster):
    """A real broker refuses the version-2 dir (exit 3, naming version 2 and
    the command); after `metalog storage upgrade` it starts, a client reads
    every record back in Kafka's metadata encoding, and the controller state
    it serves is the one the version-2 build had."""
    cluster = make_cluster(voters=1, start=False, dynamic=False, election_timeout_ms=300, fetch_timeout_ms=800)
    data = cluster.data_dir(1)
    items = v2_workload()
    write_v2_dir(data, items, cluster_id=cluster.cluster_id)
    proc = cluster.start_node(1)
    assert proc.wait(timeout=60) == 3
    with open(os.path.join(cluster.node_dir(1), "stderr.log")) as fh:
        err = fh.read()
    assert "is in metalog format version 2" in err and f"metalog storage upgrade --data-dir {data}" in err
    up = subprocess.run([sys.executable, "-m", "metalog.tools.cli", "storage", "upgrade", "--data-dir", data],
                        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert up.returncode == 0, up.stderr
    assert "upgraded" in up.stdout and "format version 3" in up.stdout
    cluster.start_node(1)
    cluster.wait_for_leader(30)
    want = [value_v3(x) for x in items]

    assert read_values(cluster, len(want))[:len(want)] == want
    expected = expected_state(items, len(items) + 1).to_json()
    served = cluster.wait_for(lambda: cluster.metadata_state(1), 30, "the controller state")
    expected.pop("offset")
    served.pop("offset")
    assert served == expected
