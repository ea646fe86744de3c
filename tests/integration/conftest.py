"""Fixtures for real-process tests: brokers are separate OS processes talking
TCP on loopback, with real files and fsync."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from metalog.tools.cluster.launcher import LocalCluster


@pytest.fixture
def make_cluster(tmp_path):
    """make_cluster(voters=3, observers=0, dynamic=True, **config) -> a started LocalCluster
    (dynamic: a KIP-853 quorum formatted as Kafka 4.x does; False: static voters);
    every cluster is stopped at the end of the test, and its broker logs are
    printed on failure by pytest's captured output."""
    clusters: list[LocalCluster] = []

    def make(voters: int = 3, observers: int = 0, start: bool = True, dynamic: bool = True,
             **common) -> LocalCluster:
        cluster = LocalCluster.create(str(tmp_path / f"cluster{len(clusters)}"), voters=voters,
                                      observers=observers, common=common, dynamic=dynamic)
        clusters.append(cluster)
        if start:
            cluster.start()
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop()


def limit_file_size(cluster: LocalCluster, node: int, limit_bytes: int) -> None:
    """Run broker `node` under RLIMIT_FSIZE: a write past `limit_bytes` in
    any file fails with EFBIG, as on a full disk (before cluster.start())."""
    path = cluster.write_config(node)
    cluster.nodes[node].command = [
        sys.executable, "-c",
        "import resource, sys; "
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit_bytes}, {limit_bytes})); "
        "from metalog.broker.server.main import main; "
        f"sys.exit(main(['--config', {path!r}]))",
    ]


@pytest.fixture
def detached(tmp_path):
    """tmp_path/c, for a cluster `metalog cluster up --detach` starts there;
    whatever broker still runs from it at the end is killed (SIGCONT first,
    in case a test paused it)."""
    root = str(tmp_path / "c")
    yield root
    try:
        cluster = LocalCluster.load(root)
    except FileNotFoundError:
        return
    for nid in cluster.nodes:
        pid = cluster.running_pid(nid)
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
