"""A real broker and a format-version-1 data dir: refused, upgraded with
`metalog storage upgrade`, started, every record read back by a client."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from broker.client import MetalogClient
from storage.snapshot import SnapshotId, snapshot_filename
from tests.formats.test_format_upgrade import PART, write_v1_dir
from tools.cluster.launcher import REPO_ROOT


@pytest.mark.slow
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
    up = subprocess.run([sys.executable, "-m", "tools.cli", "storage", "upgrade", "--data-dir", data],
                        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert up.returncode == 0, up.stderr
    assert "upgraded" in up.stdout and "2 file(s) rewritten" in up.stdout
    cluster.start_node(1)
    cluster.wait_for_leader(30)

    async def read_all() -> list[bytes]:
        client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls(),
                               request_timeout_ms=5000)
        try:
            consumer = client.consumer()
            got: list[bytes] = []
            while len(got) < len(values):
                got += [r.value for r in await consumer.poll(max_wait_ms=500)]
            return got
        finally:
            await client.close()

    assert asyncio.run(asyncio.wait_for(read_all(), 60)) == values
