"""A real Apache Kafka 4.3.1 controller (``process.roles=controller``, node 4)
as a VOTER of a secure metalog quorum (issue 33 item 5, the other way).

One metalog cluster per module (3 voters, mutual TLS, ACLs; its cluster id
in Kafka's form), and one Kafka controller formatted by Kafka's StorageTool
with ``--no-initial-controllers`` (KIP-853), its keystore holding a node
certificate of the metalog cluster's CA (``Node:4`` to metalog). It starts
as an observer fetching from our leader, replays our metadata records, and
Kafka's ``kafka-metadata-quorum add-controller`` makes it the fourth voter.
The log holds metadata records only (ACLs written through Kafka's own
kafka-acls with ``--bootstrap-controller``): Kafka's controller replays
every record.

The elections are steered by timeouts, said here because the outcome
depends on them: metalog node 1 has the tests' short election timeout, so it
leads first; nodes 2 and 3 wait long before they stand (``SLOW``); the Kafka
controller's fetch timeout is 1 s. Of 4 voters a majority is 3: after a
kill -9 of node 1 the three left (2, 3 and Kafka) must agree, and Kafka
stands first, so Kafka leads and metalog's followers Fetch from it. Then
node 1 comes back (a follower of Kafka), and a kill -9 of the Kafka
controller leaves 1, 2 and 3: a metalog node leads again (node 1 stands
first) and the restarted Kafka controller follows it.

After each step the committed logs are compared byte for byte: every batch
below the high watermark, read raw from Kafka's segment files and ours
(CRCs included), is the same at the same offset.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys

import pytest

from metalog.broker.controller.state import Controller, ControllerState
from metalog.storage import batch as b
from metalog.tools.cluster.launcher import REPO_ROOT, LocalCluster
from metalog.tools.kafka import quorum as kq
from metalog.tools.kafka.quorum import KafkaCluster, KafkaNode, kafka_uuid
from tests.polling import await_value

FAST = dict(election_timeout_ms=300, fetch_timeout_ms=800, request_timeout_ms=800, fetch_max_wait_ms=100)
# Nodes 2 and 3: they stand only long after a leader dies (see the module doc).
SLOW = dict(election_timeout_ms=20_000, fetch_timeout_ms=20_000)
KAFKA_ID = 4
KAFKA_TIMEOUTS = {"controller.quorum.fetch.timeout.ms": "1000", "controller.quorum.election.timeout.ms": "500"}
LEADER_LINE = re.compile(r"Completed transition to Leader\(.*?, epoch=(\d+)")
# KafkaRaftClient's follower line once it follows a leader: "FollowerState(fetchTimeoutMs=..., epoch=N, leader=L,".
FOLLOWER_LINE = re.compile(r"Completed transition to FollowerState\(fetchTimeoutMs=\d+, epoch=(\d+), leader=(\d+),")
# Kafka's QuorumController, replaying an ACL record it read from the log.
REPLAYED_ACL = "Replayed AccessControlEntryRecord"
# Kafka's ControllerRegistrationManager once its RegisterControllerRecord is committed.
REGISTERED = "Our registration has been persisted to the metadata log"
WAIT_S = 60.0


def metalog(*args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "metalog.tools.cli", *args], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, f"metalog {' '.join(args)}: {out.stderr}"
    return out


def raw_batches(part_dir: str) -> dict[int, tuple[bytes, b.BatchHeader]]:
    """Every whole batch of a __cluster_metadata-0 dir's segments, raw, by base offset."""
    out: dict[int, tuple[bytes, b.BatchHeader]] = {}
    for path in sorted(glob.glob(os.path.join(part_dir, "*.log"))):
        with open(path, "rb") as f:
            data = f.read()
        for pos, h in b.iter_batches(data, verify=False):  # a live segment's tail may be half written
            out[h.base_offset] = (data[pos:pos + h.size], h)
    return out


def committed(part_dir: str, hw: int) -> dict[int, bytes]:
    """The batches of `part_dir` wholly below the high watermark `hw`."""
    return {base: data for base, (data, h) in raw_batches(part_dir).items() if h.next_offset <= hw}


def replay(part_dir: str, hw: int) -> ControllerState:
    """Our controller's state from a log dir's committed batches (no snapshot: the log starts at 0)."""
    controller = Controller()
    for _base, data in sorted(committed(part_dir, hw).items()):
        controller.apply_batches(data, end_offset=b.decode_header(data).next_offset)
    return controller.state


class Mixed:
    """The module's metalog cluster and its Kafka controller."""

    def __init__(self, cluster: LocalCluster, side: KafkaCluster, root: str):
        self.cluster = cluster
        self.side = side
        self.root = root
        # Whether Kafka's tools may bootstrap from the Kafka controller too: only while it
        # leads. A Kafka controller answers DescribeCluster with the controllers that
        # registered (RegisterControllerRecord); metalog's voters never do, so while it
        # follows it names no node at all ("Timed out waiting for a node assignment").
        self.kafka_leading = False

    @property
    def kafka(self) -> KafkaNode:
        return self.side.nodes[KAFKA_ID]

    def kafka_dir(self) -> str:
        return self.kafka.metadata_dir

    def our_dir(self, node_id: int) -> str:
        return os.path.join(self.cluster.data_dir(node_id), "__cluster_metadata-0")

    def bootstrap(self, with_kafka: bool = True) -> str:
        addrs = [f"{h}:{p}" for h, p in self.cluster.bootstrap()]
        return ",".join(addrs + ([f"127.0.0.1:{self.kafka.port}"] if with_kafka else []))

    def kafka_tool(self, main_class: str, *args: str) -> str:
        """One of Kafka's tools against the quorum's controllers, as the admin user."""
        return self.side.tool(main_class, ["--bootstrap-controller", self.bootstrap(self.kafka_leading),
                                           *self.side.command_config(), *args]).stdout

    def status(self) -> dict[str, str]:
        """kafka-metadata-quorum describe --status, through Kafka's admin client."""
        return kq.describe_status(self.kafka_tool(kq.METADATA_QUORUM, "describe", "--status"))

    def kafka_leads(self) -> int:
        """The highest epoch the Kafka controller announced itself leader in (0: never)."""
        return max((int(e) for e in LEADER_LINE.findall(self.kafka.output())), default=0)

    def follower_status(self, node_id: int) -> tuple[int, int, int] | None:
        """(leader id, epoch, high watermark) a live metalog node reports."""
        q = self.cluster.quorum(node_id)
        return None if q is None else (q.get("leader_id", -1), q.get("epoch", -1), q.get("high_watermark", -1))

    def add_acl(self, principal: str) -> None:
        self.kafka_tool(kq.ACLS, "--add", "--allow-principal", principal, "--operation", "Read",
                        "--topic", "kafka-voter")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, kafka_jars):
    root = str(tmp_path_factory.mktemp("kafka_voter"))
    cluster = LocalCluster.create(os.path.join(root, "metalog"), voters=3, observers=0, dynamic=True,
                                  cluster_id=kafka_uuid(), common=dict(FAST))
    for slow in (2, 3):
        cluster.nodes[slow].extra.update(SLOW)
    side = None
    try:
        cluster.start()
        assert cluster.wait_for_leader(30)[0] == 1  # the only node with a short election timeout
        controllers = ",".join(f"{h}:{p}" for h, p in cluster.bootstrap())
        os.makedirs(os.path.join(root, "kafka"))
        side = KafkaCluster(os.path.join(root, "kafka"), cluster.cluster_id, tls_dir=cluster.cert_dir, overrides={
            "controller.quorum.bootstrap.servers": controllers, **KAFKA_TIMEOUTS,
            # Every metalog node's certificate is User:node-<id> to Kafka: its peers.
            "super.users": ";".join(["User:admin"] + [f"User:node-{n}" for n in (1, 2, 3, KAFKA_ID)])})
        mixed = Mixed(cluster, side, root)
        node = side.nodes[KAFKA_ID] = side._node(KAFKA_ID, "observer")  # formatted --no-initial-controllers
        side._write_props(node)
        side._format()
        yield mixed
    finally:
        if side is not None:
            side.kill()
        cluster.stop()


def _directory_id(log_dir: str) -> str:
    with open(os.path.join(log_dir, "meta.properties")) as f:
        return dict(line.split("=", 1) for line in f.read().splitlines() if "=" in line)["directory.id"]


def _same_committed(m: Mixed, node_ids: list[int], hw: int) -> int:
    """Kafka's committed batches and each metalog node's, byte for byte below `hw`; returns the batch count."""
    theirs = committed(m.kafka_dir(), hw)
    assert theirs and max(b.decode_header(d).next_offset for d in theirs.values()) == hw, (sorted(theirs), hw)
    for nid in node_ids:
        ours = committed(m.our_dir(nid), hw)
        assert ours.keys() == theirs.keys(), (nid, sorted(ours), sorted(theirs))
        for base in ours:
            assert ours[base] == theirs[base], f"node {nid}: the batch at offset {base} differs from Kafka's"
    return len(theirs)


def _settled_hw(m: Mixed, node_ids: list[int]) -> int:
    """A high watermark every listed metalog node and the Kafka controller hold
    whole (their logs reach it): the leader's, as `describe --status` reports it."""
    def reached():
        hw = int(m.status()["HighWatermark"])
        ends = [max((h.next_offset for _, h in raw_batches(d).values()), default=0)
                for d in [m.kafka_dir()] + [m.our_dir(n) for n in node_ids]]
        return hw if min(ends) >= hw else None
    return await_value("every replica to hold the high watermark", reached, WAIT_S, interval_s=0.5)


def test_a_kafka_controller_joins_as_an_observer_then_a_voter(mixed):
    m = mixed
    # A metadata record before Kafka starts: it replays it from our log.
    metalog("acls", "add", "--client-config", m.cluster.client_config_path, "--allow-principal", "User:before",
            "--operation", "Read", "--topic", "kafka-voter")
    m.side.launch([m.kafka])
    m.side.wait_for(lambda: kq.STARTED in m.kafka.output(), kq.START_TIMEOUT_S, "the Kafka controller to start",
                    m.kafka)
    m.side.wait_for(lambda: REPLAYED_ACL in m.kafka.output(), WAIT_S, "Kafka to replay our ACL record", m.kafka)
    directory_id = _directory_id(m.kafka.log_dir)
    # Kafka's own tool adds it (AddRaftVoter at our leader), reading the node's config and dir (its
    # id, directory id, listener); the client is SSL with the node's keystore: a node certificate
    # may add its own node (KIP-1186's rule), no admin rights needed.
    node_config = os.path.join(m.root, "controller-4-client.properties")
    with open(m.kafka.props_path) as src, open(node_config, "w") as out:
        out.write(src.read() + "security.protocol=SSL\n")
    m.side.tool(kq.METADATA_QUORUM, ["--bootstrap-controller", m.bootstrap(False), "--command-config", node_config,
                                     "add-controller"])
    status = m.status()
    assert status["LeaderId"] == "1", status
    assert sorted(int(v) for v in re.findall(r'"id": ?(\d+)', status["CurrentVoters"])) == [1, 2, 3, KAFKA_ID], status
    # Kafka's own replication view: node 4 a Follower, with its directory id.
    replication = m.kafka_tool(kq.METADATA_QUORUM, "describe", "--replication")
    row = next(line.split() for line in replication.splitlines() if line.split()[:1] == [str(KAFKA_ID)])
    assert row[1] == directory_id and row[-1] == "Follower", replication
    # Written through Kafka's kafka-acls at our leader, replayed by Kafka's controller as a voter.
    m.add_acl("User:as-voter")
    m.side.wait_for(lambda: m.kafka.output().count(REPLAYED_ACL) >= 2, WAIT_S, "Kafka to replay the second ACL",
                    m.kafka)


def test_committed_logs_are_byte_identical_with_metalog_leading(mixed):
    m = mixed
    hw = _settled_hw(m, [1, 2, 3])
    batches = _same_committed(m, [1, 2, 3], hw)
    assert batches >= 5, batches  # LeaderChange, voters, metadata.version + ACL, the voter change, the second ACL


def test_kill_9_of_the_metalog_leader_kafka_leads_and_metalog_follows(mixed):
    m = mixed
    epoch_before = m.follower_status(2)[1]
    m.cluster.kill(1)
    epoch = await_value("the Kafka controller to lead", lambda: m.kafka_leads() > epoch_before and m.kafka_leads(),
                        WAIT_S, interval_s=0.2)
    for nid in (2, 3):
        await_value(f"metalog node {nid} to follow Kafka", lambda n=nid: (m.follower_status(n) or (0, 0))[:2] == (
            KAFKA_ID, epoch), WAIT_S, interval_s=0.2)
    # Kafka's controller registers itself (ControllerRegistration) with the active
    # controller; metalog does not serve that api, so it does once it leads.
    m.side.wait_for(lambda: REGISTERED in m.kafka.output(), WAIT_S, "the Kafka controller to register itself",
                    m.kafka)
    m.kafka_leading = True
    # Written through Kafka's tool, the Kafka controller leading: committed by 2 of 3 metalog followers.
    m.add_acl("User:kafka-led")
    status = m.status()
    assert status["LeaderId"] == str(KAFKA_ID), status
    hw = _settled_hw(m, [2, 3])
    _same_committed(m, [2, 3], hw)
    # Our controller replays what Kafka's wrote (its LeaderChange, NoOps, its own registration): nothing refused.
    state = replay(m.our_dir(2), hw)
    assert state.invalid_records == 0, state.last_invalid
    assert "User:kafka-led" in {acl.principal for acl in state.acls.values()}
    # The one type we do not model: Kafka's controller registering itself with itself.
    assert state.unknown_records == {"RegisterController": 1}, state.unknown_records
    await_value("node 2 to apply Kafka's ACL", lambda: "User:kafka-led" in str(m.cluster.admin(2, "/metadata/acls")),
                WAIT_S, interval_s=0.2)
    # Node 1 comes back: a follower of Kafka's, its log the same again.
    m.cluster.start([1])
    await_value("metalog node 1 to follow Kafka", lambda: (m.follower_status(1) or (0, 0))[:2] == (KAFKA_ID, epoch),
                WAIT_S, interval_s=0.2)
    m.add_acl("User:after-restart")
    _same_committed(m, [1, 2, 3], _settled_hw(m, [1, 2, 3]))


def test_kill_9_of_the_kafka_controller_metalog_leads_on(mixed):
    m = mixed
    kafka_epoch = m.kafka_leads()
    m.kafka.proc.send_signal(signal.SIGKILL)
    m.kafka.proc.wait(30)
    m.kafka_leading = False
    leader, epoch = m.cluster.wait_for_leader(WAIT_S)
    assert leader in (1, 2, 3) and epoch > kafka_epoch
    metalog("acls", "add", "--client-config", m.cluster.client_config_path, "--allow-principal", "User:kafka-dead",
            "--operation", "Read", "--topic", "kafka-voter")
    # The Kafka controller restarts from its dir and catches up as a follower of ours.
    m.side.launch([m.kafka])
    m.side.wait_for(lambda: any(int(e) >= epoch and int(l) == leader
                                for e, l in FOLLOWER_LINE.findall(m.kafka.output())),
                    kq.START_TIMEOUT_S, "the restarted Kafka controller to follow our leader", m.kafka)
    m.add_acl("User:kafka-back")
    _same_committed(m, [1, 2, 3], _settled_hw(m, [1, 2, 3]))
