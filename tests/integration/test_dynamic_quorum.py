"""KIP-853 through real broker processes over TLS: format a standalone voter
and an observer (`metalog storage format`), grow the quorum with
`metalog quorum add-voter`, refuse a duplicate with one line, shrink it with
`metalog quorum remove-voter`."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from tools.cluster.launcher import REPO_ROOT

pytestmark = pytest.mark.slow

FAST = dict(election_timeout_ms=300, fetch_timeout_ms=800, request_timeout_ms=800, fetch_max_wait_ms=100)


def metalog(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=90)


def directory_id(data_dir: str) -> str:
    with open(os.path.join(data_dir, "meta.properties")) as f:
        return dict(line.split("=", 1) for line in f.read().splitlines() if "=" in line)["directory.id"]


async def test_add_and_remove_a_voter_with_the_cli(make_cluster):
    cluster = make_cluster(voters=1, observers=1, start=False, dynamic_voters=True, **FAST)
    cluster.ensure_certs()
    for nid, how in ((1, "--standalone"), (2, "--no-initial-controllers")):
        out = metalog("storage", "format", "--config", cluster.write_config(nid), how)
        assert out.returncode == 0, out.stderr
    cluster.start()
    leader, epoch = await asyncio.to_thread(cluster.wait_for_leader, 20)
    assert leader == 1
    q = cluster.quorum(1)
    assert (q["voters"], q["kraft_version"]) == ([1], 1), q
    cc = ["--client-config", cluster.client_config_path]
    d2 = directory_id(cluster.data_dir(2))
    port2 = cluster.nodes[2].port
    add = ["quorum", "add-voter", *cc, "--controller-id", "2", "--controller-directory-id", d2,
           "--listener", f"127.0.0.1:{port2}"]
    out = await asyncio.to_thread(metalog, *add)
    assert out.returncode == 0, out.stderr

    def follower_2():
        q2 = cluster.quorum(2)
        return q2 if q2 and q2["role"] == "follower" and q2["voters"] == [1, 2] else None

    await asyncio.to_thread(cluster.wait_for, follower_2, 20, "node 2 a voter")
    assert cluster.quorum(1)["voters"] == [1, 2]

    out = await asyncio.to_thread(metalog, *add)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert lines[0].startswith("metalog: error: DUPLICATE_VOTER: node 2 is already a voter"), lines

    out = await asyncio.to_thread(metalog, "quorum", "remove-voter", *cc, "--controller-id", "2",
                                  "--controller-directory-id", d2)
    assert out.returncode == 0, out.stderr

    def observer_2():
        q2 = cluster.quorum(2)
        return q2 if q2 and q2["role"] == "observer" and q2["voters"] == [1] else None

    await asyncio.to_thread(cluster.wait_for, observer_2, 20, "node 2 an observer again")
    out = await asyncio.to_thread(metalog, "produce", *cc, "after")
    assert out.returncode == 0, out.stderr
