"""One real metalog cluster per module, driven to write every record type we
write, then stopped, so that Apache Kafka's own tools judge its files
(metalog.tools.kafka; the jars come from `bash run.sh setup`).

What the cluster is made to write, in order: broker registrations, topics
with partitions, a deleted topic, topic / broker / cluster-default configs,
ACLs through `metalog acls add` (one removed with `acls remove`), a fence, an
unfence and an unregistration (with their PartitionChange records), batches
of an idempotent producer, a voter change (`metalog cluster add-node --node 4`
then `metalog quorum remove-voter`), then enough topics for every node to
write a snapshot after the voter change (`snapshot_min_records` is small).
Segments roll at 8 KiB, so several segments, indexes and time indexes exist.
"""

from __future__ import annotations

import asyncio
import glob
import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from metalog.broker.client import MetalogClient
from metalog.tools import kafka
from metalog.tools.cluster.launcher import REPO_ROOT, LocalCluster

FAST = dict(election_timeout_ms=300, fetch_timeout_ms=800, request_timeout_ms=800, fetch_max_wait_ms=100)
SNAPSHOT_MIN_RECORDS = 40
LATE_TOPICS = 12  # created after the voter change: 4 records each, past SNAPSHOT_MIN_RECORDS on every node


@dataclass
class Written:
    """What the module's cluster was made to write, and where its files are."""

    cluster: LocalCluster
    part_dirs: dict[int, str]  # node id -> its __cluster_metadata-0
    topics: list[str]  # every topic alive at the end
    deleted_topic: str
    brokers: list[int]  # registered at the end
    unregistered_broker: int
    principals: list[str]  # of the ACLs still in force
    produced: list[tuple[int, list[bytes]]] = field(default_factory=list)  # (base offset, values) per acked produce
    voter_added_offset: int = -1  # a log offset after which node 4 was a voter
    voter_removed_offset: int = -1  # a log offset after which it was not any more

    def files(self, suffix: str) -> list[str]:
        """Every file of the cluster ending in `suffix`, node by node, in offset order."""
        return [path for part in self.part_dirs.values()
                for path in sorted(glob.glob(os.path.join(part, "*" + suffix)))]


def metalog(*args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "metalog.tools.cli", *args], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, f"metalog {' '.join(args)}: {out.stderr}"
    return out


def directory_id(data_dir: str) -> str:
    with open(os.path.join(data_dir, "meta.properties")) as f:
        return dict(line.split("=", 1) for line in f.read().splitlines() if "=" in line)["directory.id"]


async def _command(client: MetalogClient, command: str, **args) -> int:
    offset, _ = await client.command(command, **args)
    return offset


async def _drive_metadata(client: MetalogClient, w: Written) -> None:
    for broker in (101, 102, 103):
        await _command(client, "register_broker", broker_id=broker, rack=f"rack-{broker % 2}",
                       endpoints=[["PLAINTEXT", "127.0.0.1", 9000 + broker], ["SSL", "127.0.0.1", 9100 + broker]])
    await _command(client, "create_topic", name="judge-alpha", partitions=3, replication_factor=3)
    await _command(client, "create_topic", name="judge-beta", partitions=1, replication_factor=2)
    await _command(client, "create_topic", name=w.deleted_topic, partitions=2, replication_factor=1)
    await _command(client, "delete_topic", name=w.deleted_topic)
    await _command(client, "set_config", resource_type=2, resource_name="judge-alpha", name="retention.ms",
                   value="3600000")
    await _command(client, "set_config", resource_type=4, resource_name="101", name="log.cleaner.threads", value="2")
    await _command(client, "set_config", resource_type=4, resource_name="", name="num.io.threads", value="16")
    await _command(client, "set_config", resource_type=2, resource_name="judge-beta", name="retention.ms",
                   value="1000")
    await _command(client, "set_config", resource_type=2, resource_name="judge-beta", name="retention.ms", value=None)


async def _drive_brokers_and_produce(client: MetalogClient, w: Written) -> None:
    await _command(client, "fence_broker", broker_id=102)
    await _command(client, "unfence_broker", broker_id=102)
    await _command(client, "unregister_broker", broker_id=w.unregistered_broker)
    for batch in range(4):  # one idempotent producer: sequences 0, 3, 6, 9
        values = [f"judge-value-{batch}-{i}".encode() for i in range(3)]
        base_offset, _ = await client.produce(values)
        w.produced.append((base_offset, values))


def _acls(cc: list[str]) -> None:
    metalog("acls", "add", *cc, "--allow-principal", "User:judge-alice", "--operation", "Read",
            "--operation", "Write", "--topic", "judge-alpha")
    metalog("acls", "add", *cc, "--deny-principal", "User:judge-mallory", "--operation", "All", "--cluster")
    metalog("acls", "add", *cc, "--allow-principal", "User:judge-bob", "--operation", "Describe",
            "--topic", "judge-", "--resource-pattern-type", "prefixed")
    metalog("acls", "add", *cc, "--allow-principal", "User:judge-temp", "--operation", "Read", "--topic", "judge-beta")
    metalog("acls", "remove", *cc, "--allow-principal", "User:judge-temp", "--operation", "Read",
            "--topic", "judge-beta")


def _snapshot_ends(part_dir: str) -> list[int]:
    return sorted(int(os.path.basename(p).split("-")[0]) for p in glob.glob(os.path.join(part_dir, "*.checkpoint")))


def _drive(cluster: LocalCluster, w: Written) -> None:
    cc = ["--client-config", cluster.client_config_path]

    async def go(step) -> int:
        client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls(),
                               request_timeout_ms=3000, delivery_timeout_ms=60_000, max_retries=1000)
        try:
            await step(client)
            # A mark: every record before its offset is committed.
            offset, _ = await client.produce([b"judge-mark"])
            w.produced.append((offset, [b"judge-mark"]))
            return offset
        finally:
            await client.close()

    asyncio.run(go(lambda c: _drive_metadata(c, w)))
    _acls(cc)
    asyncio.run(go(lambda c: _drive_brokers_and_produce(c, w)))
    metalog("cluster", "add-node", "--node", "4", "--dir", cluster.root)
    w.voter_added_offset = asyncio.run(go(lambda c: asyncio.sleep(0)))
    metalog("quorum", "remove-voter", *cc, "--controller-id", "4",
            "--controller-directory-id", directory_id(cluster.data_dir(4)))
    w.voter_removed_offset = asyncio.run(go(lambda c: asyncio.sleep(0)))

    async def late_topics(client: MetalogClient) -> None:
        for i in range(LATE_TOPICS):
            await _command(client, "create_topic", name=f"judge-late-{i:02d}", partitions=3, replication_factor=2)

    asyncio.run(go(late_topics))
    w.topics += [f"judge-late-{i:02d}" for i in range(LATE_TOPICS)]

    def snapshotted_after_the_voter_change() -> bool:
        return all(any(end > w.voter_removed_offset for end in _snapshot_ends(part)) for part in w.part_dirs.values())

    cluster.wait_for(snapshotted_after_the_voter_change, 60, "a snapshot past the voter change on every node")


@pytest.fixture(scope="module")
def kafka_jars() -> str:
    """The Kafka release the harness runs; fails (never skips) without the jars."""
    try:
        kafka.classpath()
        kafka.java()
    except kafka.KafkaMissing as exc:
        pytest.fail(str(exc))
    return kafka.kafka_version()


@pytest.fixture(scope="module")
def written(tmp_path_factory, kafka_jars) -> Written:
    root = tmp_path_factory.mktemp("judged")
    cluster = LocalCluster.create(str(root / "cluster"), voters=3, observers=1, dynamic=True,
                                  common=dict(FAST, snapshot_min_records=SNAPSHOT_MIN_RECORDS, segment_bytes_max=8192,
                                              snapshot_cpu_share=1.0))
    w = Written(cluster=cluster, part_dirs={n: os.path.join(cluster.data_dir(n), "__cluster_metadata-0")
                                            for n in sorted(cluster.nodes)},
                topics=["judge-alpha", "judge-beta"], deleted_topic="judge-gone", brokers=[101, 102],
                unregistered_broker=103, principals=["User:judge-alice", "User:judge-mallory", "User:judge-bob"])
    try:
        cluster.start()
        cluster.wait_for_leader(30)
        _drive(cluster, w)
    finally:
        cluster.stop()  # Kafka judges files at rest: no batch half written
    return w


@pytest.fixture(scope="session")
def reported(tmp_path_factory):
    """One real Kafka 4.3.1 cluster driven by Kafka's tools, then stopped, for
    every module that judges its files (test_we_judge_kafka: our readers,
    test_spark_judges_kafka: the Spark job): it takes minutes, so once."""
    from tests.kafka.test_we_judge_kafka import run_and_report

    return run_and_report(tmp_path_factory)
