"""We follow Kafka live (issue 33, item 5).

One real Apache Kafka 4.3.1 cluster per module (metalog.tools.kafka.quorum:
three controllers as a dynamic quorum, one broker), written to with Kafka's
own tools (kafka-topics, kafka-configs, kafka-acls). ``metalog kafka follow``
replicates its metadata log as an observer (Fetch/FetchSnapshot as Kafka's
own observers send them) into our segmented log:

1. from an empty dir with ``--until-caught-up``: the leader answers offset 0
   with its newest snapshot's id (KAFKA-15078), which we download by
   Position in small chunks, then the log from the snapshot's end up to the
   high watermark kafka-metadata-quorum reported; our snapshot file and
   every batch we hold equal the leader's own files byte for byte (read raw,
   CRCs included), and Kafka lists us as an observer with our directory id;
2. then running on, through a kill -9 of Kafka's leader controller and more
   writes through Kafka's tools: the follower finds the new leader through
   Kafka's answers and again matches it byte for byte up to the high
   watermark kafka-metadata-quorum reports;
3. ``metalog storage verify`` finds our copy whole, and our controller state
   from our copy (snapshot + log) holds the topics kafka-topics describes;
4. an answer we cannot use (a broker's listener: no FetchSnapshot) or a dir
   of another cluster is one line on stderr, no traceback;
5. ``metalog spark audit`` over our copy and Kafka's three controllers' dirs
   (Kafka stopped) finds Kafka's voters, a high watermark at or past the one
   kafka-metadata-quorum reported, and our copy (an observer, not voting)
   equal to Kafka's below it.

Secure as a user runs it: every Kafka listener is SSL with client
certificates required and Kafka's StandardAuthorizer with
``allow.everyone.if.no.acl.found=false``; the follower dials with the CA,
checks the controllers' host names, and presents a node certificate whose
principal Kafka lets replicate (a super user, as Kafka's own brokers are).
A wrong CA, a certificate of another CA, and a principal Kafka does not
authorize are each one line and exit 1.
"""

from __future__ import annotations

import base64
import glob
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

import pytest

from metalog.broker.controller.state import Controller, ControllerState, load_snapshot
from metalog.storage import batch as b
from metalog.storage.snapshot import SnapshotStore
from metalog.tools import kafka
from metalog.tools.cluster.launcher import REPO_ROOT
from metalog.tools.kafka import quorum as kq

pytestmark = pytest.mark.slow

OBSERVER_ID = 9001
CHUNK_BYTES = 512  # FetchSnapshot MaxBytes: a snapshot of ~2 KB comes in several chunks
WAIT_S = 90.0


def metalog(*args: str, timeout_s: float = 180.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "metalog.tools.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout_s)


def tls_args(c: kq.KafkaCluster, name: str = f"node-{OBSERVER_ID}") -> list[str]:
    """The follower's TLS flags: the cluster's CA, and a certificate of it for `name`
    (node-<id>: a node certificate, User:node-<id> to Kafka; else a user's)."""
    from metalog.tools.cluster import certs

    out = os.path.join(c.tls_dir, "follower")
    if not os.path.exists(os.path.join(out, f"{name}.crt")):
        if name.startswith("node-"):
            certs.issue_node(c.tls_dir, out, int(name.removeprefix("node-")), ["127.0.0.1"])
        else:
            certs.issue_user(c.tls_dir, out, name)
    return ["--tls-ca", os.path.join(c.tls_dir, "ca.crt"), "--tls-cert", os.path.join(out, f"{name}.crt"),
            "--tls-key", os.path.join(out, f"{name}.key")]


def follow_args(c: kq.KafkaCluster, data_dir: str, *extra: str) -> list[str]:
    return ["kafka", "follow", "--bootstrap-controller", c.bootstrap_controllers(), "--data-dir", data_dir,
            "--node-id", str(OBSERVER_ID), "--snapshot-chunk-bytes-max", str(CHUNK_BYTES), *tls_args(c), *extra]


def events(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def status(c: kq.KafkaCluster) -> dict[str, str]:
    return kq.describe_status(c.quorum("describe", "--status").stdout)


def raw_batches(part_dir: str) -> dict[int, bytes]:
    """Every whole batch of a __cluster_metadata-0 dir's segments, raw, by base offset."""
    out: dict[int, bytes] = {}
    for path in sorted(glob.glob(os.path.join(part_dir, "*.log"))):
        with open(path, "rb") as f:
            data = f.read()
        for pos, h in b.iter_batches(data, verify=False):  # a live segment's tail may be half written
            out[h.base_offset] = data[pos:pos + h.size]
    return out


def assert_same_bytes(ours_dir: str, theirs_dir: str, up_to: int) -> int:
    """Every batch of ours equals Kafka's at the same offset; ours reach
    `up_to` (our log, or our snapshot when the log after it is still empty).
    Returns our batch count."""
    ours, theirs = raw_batches(ours_dir), raw_batches(theirs_dir)
    for base, data in ours.items():
        assert theirs.get(base) == data, f"batch at offset {base}: ours differs from Kafka's"
    snapshot_end = SnapshotStore(ours_dir).list()[-1].end_offset
    end = b.decode_header(ours[max(ours)]).next_offset if ours else snapshot_end
    assert end >= up_to, (end, up_to)
    if ours:
        assert min(ours) == snapshot_end  # the log goes on where the snapshot ends
    return len(ours)


@dataclass
class Followed:
    cluster: kq.KafkaCluster
    ours: str  # our data dir
    first: list[dict] = field(default_factory=list)  # phase 1's events
    hw_before: int = -1  # kafka-metadata-quorum's HW before phase 1
    leader_before: int = -1
    second: list[dict] = field(default_factory=list)  # the long run's events
    hw_after: int = -1  # ... after the failover and the later writes
    leader_after: int = -1
    replication: str = ""  # describe --replication while we followed
    topics: str = ""  # kafka-topics --describe at the end
    timings_s: dict[str, float] = field(default_factory=dict)

    @property
    def part_dir(self) -> str:
        return os.path.join(self.ours, "__cluster_metadata-0")


class Background:
    """`metalog kafka follow` running on; its JSON lines gathered by a thread."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "metalog.tools.cli", *args], cwd=REPO_ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[dict] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.append(json.loads(line))

    def wait_for(self, cond, what: str, timeout_s: float = WAIT_S) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for e in list(self.lines):
                if cond(e):
                    return e
            assert self.proc.poll() is None, f"follow exited {self.proc.returncode}: {self.proc.stderr.read()}"
            time.sleep(0.1)
        raise TimeoutError(f"waiting for the follower: {what}; last lines {self.lines[-5:]}")

    def stop(self) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(10)
        self._thread.join(10)
        return code, self.proc.stderr.read() if self.proc.stderr else ""


def _write_first(c: kq.KafkaCluster) -> None:
    for name, partitions in (("follow-alpha", 3), ("follow-beta", 1), ("follow-gone", 1)):
        c.admin(kq.TOPICS, "--create", "--topic", name, "--partitions", str(partitions), "--replication-factor", "1")
    c.admin(kq.TOPICS, "--delete", "--topic", "follow-gone")
    c.admin(kq.CONFIGS, "--alter", "--entity-type", "topics", "--entity-name", "follow-alpha",
            "--add-config", "retention.ms=3600000")
    c.admin(kq.ACLS, "--add", "--allow-principal", "User:follow-alice", "--operation", "Read",
            "--topic", "follow-alpha")


def _snapshot_ends(node: kq.KafkaNode) -> list[int]:
    return [sid.end_offset for sid in SnapshotStore(node.metadata_dir).list()]


def _phase_one(c: kq.KafkaCluster, f: Followed) -> None:
    """From nothing to Kafka's HW with --until-caught-up (a snapshot first)."""
    st = status(c)
    f.hw_before, f.leader_before = int(st["HighWatermark"]), int(st["LeaderId"])
    leader = c.nodes[f.leader_before]
    c.wait_for(lambda: any(e > 0 for e in _snapshot_ends(leader)), 60, "a snapshot on Kafka's leader")
    out = metalog(*follow_args(c, f.ours, "--until-caught-up", "--timeout-s", str(WAIT_S)))
    assert out.returncode == 0, out.stderr
    f.first = events(out.stdout)


def _phase_two(c: kq.KafkaCluster, f: Followed) -> None:
    """Following on through a kill -9 of Kafka's leader and more writes."""
    follower = Background(follow_args(c, f.ours))
    try:
        follower.wait_for(lambda e: e["event"] == "caught_up", "caught up again after its restart")
        f.replication = c.quorum("describe", "--replication").stdout
        old = c.nodes[int(status(c)["LeaderId"])]
        assert old.proc is not None
        old.proc.kill()  # SIGKILL: no orderly resignation
        old.proc.wait(30)
        c.admin(kq.TOPICS, "--create", "--topic", "follow-after", "--partitions", "2", "--replication-factor", "1")
        c.admin(kq.CONFIGS, "--alter", "--entity-type", "topics", "--entity-name", "follow-beta",
                "--add-config", "cleanup.policy=compact")
        f.topics = c.admin(kq.TOPICS, "--describe").stdout
        st = kq.describe_status(c.tool(kq.METADATA_QUORUM, ["--bootstrap-controller", ",".join(
            f"127.0.0.1:{n.port}" for n in c.controllers if n is not old), *c.command_config(),
            "describe", "--status"]).stdout)
        f.hw_after, f.leader_after = int(st["HighWatermark"]), int(st["LeaderId"])
        assert f.leader_after != old.node_id
        follower.wait_for(lambda e: e["event"] == "progress" and e["leader_id"] == f.leader_after
                          and e["log_end_offset"] >= f.hw_after, f"log end >= {f.hw_after} from {f.leader_after}")
    finally:
        code, err = follower.stop()
        f.second = follower.lines
    assert code == 0, err


@pytest.fixture(scope="module")
def followed(tmp_path_factory) -> Followed:
    try:
        kafka.classpath()
        kafka.java()
    except kafka.KafkaMissing as exc:
        pytest.fail(str(exc))
    root = tmp_path_factory.mktemp("follow")
    t0 = time.monotonic()
    supers = ["User:admin", *(f"User:node-{n}" for n in (*kq.CONTROLLER_IDS, kq.BROKER_ID, OBSERVER_ID))]
    c = kq.KafkaCluster.create(str(root / "kafka"), tls_dir=str(root / "ca"), overrides={
        "allow.everyone.if.no.acl.found": "false", "super.users": ";".join(supers)})
    f = Followed(c, str(root / "ours"))
    try:
        c.start()
        f.timings_s["format_and_start"] = round(time.monotonic() - t0, 1)
        _write_first(c)
        f.timings_s["first_writes"] = round(time.monotonic() - t0, 1)
        _phase_one(c, f)
        f.timings_s["phase_one"] = round(time.monotonic() - t0, 1)
        # Byte for byte with the leader of phase one while it lives (it is killed next).
        f.timings_s["phase_one_batches"] = assert_same_bytes(f.part_dir, c.nodes[f.leader_before].metadata_dir,
                                                             f.hw_before)
        _phase_two(c, f)
        f.timings_s["phase_two"] = round(time.monotonic() - t0, 1)
    except BaseException:
        c.stop()
        raise
    yield f
    c.stop()
    print(f"\nfollow timings (s, cumulative): {f.timings_s}")


def test_from_nothing_a_snapshot_by_chunks_then_the_log_byte_for_byte(followed):
    f = followed
    kinds = [e["event"] for e in f.first]
    [snap] = [e for e in f.first if e["event"] == "snapshot"]
    assert kinds.index("snapshot") < kinds.index("caught_up")
    assert snap["chunks"] >= 2 and snap["chunks"] >= snap["bytes"] // CHUNK_BYTES  # by Position, chunk by chunk
    connected = [e for e in f.first if e["event"] == "connected"]
    assert connected and all(e["fetch_version"] >= 17 and e["fetch_snapshot_version"] == 1 for e in connected)
    assert connected[0]["cluster_id"] == status(f.cluster)["ClusterId"]
    [caught] = [e for e in f.first if e["event"] == "caught_up"]
    assert caught["log_end_offset"] >= f.hw_before and caught["log_start_offset"] == snap["end_offset"]
    # Our snapshot file is the one Kafka's leader holds under the same name, byte for byte.
    name = f"{snap['end_offset']:020d}-{snap['epoch']:010d}.checkpoint"
    served_by = f.cluster.nodes[snap["leader_id"]]
    with open(os.path.join(f.part_dir, name), "rb") as ours, open(os.path.join(served_by.metadata_dir, name),
                                                                   "rb") as theirs:
        assert ours.read() == theirs.read()
    # Kafka saw an observer: our node id, our directory id (meta.properties).
    with open(os.path.join(f.ours, "meta.properties")) as meta:
        directory_id = dict(line.split("=", 1) for line in meta.read().splitlines())["directory.id"]
    rows = [line.split() for line in f.replication.splitlines()]
    assert [str(OBSERVER_ID), directory_id] in [r[:2] for r in rows], f.replication
    assert [r for r in rows if r[0] == str(OBSERVER_ID)][0][-1] == "Observer"


def test_through_a_kill_9_of_kafkas_leader_byte_for_byte_with_the_new_one(followed):
    f = followed
    leaders = [e for e in f.second if e["event"] == "leader"]
    assert leaders[-1]["leader_id"] == f.leader_after != f.leader_before
    assert any(e["event"] in ("disconnected", "retry") for e in f.second)  # the old leader went away
    n = assert_same_bytes(f.part_dir, f.cluster.nodes[f.leader_after].metadata_dir, f.hw_after)
    assert n >= 10  # minutes of Kafka's writes and NoOps after the snapshot
    # The old leader's committed batches are the new one's too (what we copied before the kill).
    old = raw_batches(f.cluster.nodes[f.leader_before].metadata_dir)
    ours = raw_batches(f.part_dir)
    assert all(old[base] == ours[base] for base in ours if base < f.hw_before)
    print(f"\n{n} batches equal to Kafka's; HW {f.hw_before} -> {f.hw_after}, leader {f.leader_before} -> "
          f"{f.leader_after}")


def test_storage_verify_finds_our_copy_whole(followed):
    out = metalog("storage", "verify", "--data-dir", followed.ours)
    assert out.returncode == 0 and "no corruption found" in out.stdout, out.stdout + out.stderr


def kafka_uuid_text(b64: str) -> str:
    return str(uuid.UUID(bytes=base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4))))


def described_topics(text: str) -> dict[str, tuple[str, dict[int, tuple]]]:
    """kafka-topics --describe: name -> (id, {partition: (leader, replicas, isr)})."""
    out: dict[str, tuple[str, dict[int, tuple]]] = {}
    for line in text.splitlines():
        fields = dict(re.findall(r"(\w+): (\S*)", line))
        if "TopicId" in fields:
            out[fields["Topic"]] = (kafka_uuid_text(fields["TopicId"]), {})
        elif "Partition" in fields:
            ints = tuple(tuple(int(x) for x in fields[k].split(",") if x) for k in ("Replicas", "Isr"))
            out[fields["Topic"]][1][int(fields["Partition"])] = (int(fields["Leader"]), *ints)
    return out


def our_state(part_dir: str) -> ControllerState:
    """Our snapshot, then our log on top, through our controller."""
    store = SnapshotStore(part_dir)
    controller = Controller(load_snapshot(store, store.list()[-1]))
    for path in sorted(glob.glob(os.path.join(part_dir, "*.log"))):
        with open(path, "rb") as fh:
            controller.apply_batches(fh.read())
    return controller.state


def test_our_state_from_our_copy_holds_the_topics_kafka_describes(followed):
    state = our_state(followed.part_dir)
    assert state.invalid_records == 0, state.last_invalid
    ours = {t.name: (t.topic_id, {pid: (p.leader, tuple(p.replicas), tuple(p.isr))
                                  for pid in state.partition_ids(t.topic_id)
                                  for p in [state.partitions[(t.topic_id, pid)]]})
            for t in state.topics.values() if not t.name.startswith("__")}
    theirs = {k: v for k, v in described_topics(followed.topics).items() if not k.startswith("__")}
    assert set(theirs) == {"follow-alpha", "follow-beta", "follow-after"}
    assert ours == theirs
    assert {k: v for (t, n, k), v in state.configs.items() if n == "follow-beta"} == {"cleanup.policy": "compact"}
    assert {a.principal for a in state.acls.values()} == {"User:follow-alice"}


def test_an_answer_we_cannot_use_is_one_line(followed, tmp_path):
    c = followed.cluster
    # A broker's listener serves Fetch to consumers, not FetchSnapshot: it is no controller.
    out = metalog("kafka", "follow", "--bootstrap-controller", c.bootstrap_servers(), "--data-dir",
                  str(tmp_path / "broker"), "--until-caught-up", "--timeout-s", "30", *tls_args(c))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    [line] = out.stderr.strip().splitlines()
    assert "FetchSnapshot" in line and "api key 59" in line, line
    # Our copy of this cluster is not to be mixed with another cluster's log.
    other = tmp_path / "other"
    other.mkdir()
    (other / "meta.properties").write_text(f"version=1\nnode.id={OBSERVER_ID}\ncluster.id=AnotherClusterIdAAAAAA\n")
    live = [n for n in c.controllers if n.proc is not None and n.proc.poll() is None]
    out = metalog("kafka", "follow", "--bootstrap-controller", f"127.0.0.1:{live[0].port}", "--data-dir",
                  str(other), "--node-id", str(OBSERVER_ID), "--until-caught-up", "--timeout-s", "30",
                  *tls_args(c))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    [line] = out.stderr.strip().splitlines()
    assert "AnotherClusterIdAAAAAA" in line and c.cluster_id in line, line


def one_line_refusal(c: kq.KafkaCluster, data_dir: str, *flags: str) -> str:
    """`metalog kafka follow` with these TLS flags at a live controller: exit 1 with one line."""
    live = [n for n in c.controllers if n.proc is not None and n.proc.poll() is None]
    out = metalog("kafka", "follow", "--bootstrap-controller", f"127.0.0.1:{live[0].port}", "--data-dir", data_dir,
                  "--until-caught-up", "--timeout-s", "60", *flags)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    [line] = out.stderr.strip().splitlines()
    return line


def test_tls_and_authorization_refusals_are_one_line(followed, tmp_path):
    from metalog.tools.cluster import certs

    c = followed.cluster
    other = str(tmp_path / "other-ca")
    certs.init_ca(other, name="another-ca")
    certs.issue_node(other, other, OBSERVER_ID, ["127.0.0.1"])
    ours = tls_args(c)
    theirs_unverified = one_line_refusal(c, str(tmp_path / "a"), "--tls-ca", os.path.join(other, "ca.crt"),
                                         *ours[2:])
    ours_refused = one_line_refusal(c, str(tmp_path / "b"), *ours[:2],
                                    "--tls-cert", os.path.join(other, f"node-{OBSERVER_ID}.crt"),
                                    "--tls-key", os.path.join(other, f"node-{OBSERVER_ID}.key"))
    not_authorized = one_line_refusal(c, str(tmp_path / "c"), *tls_args(c, "stranger"))
    print("\n" + "\n".join((theirs_unverified, ours_refused, not_authorized)))
    # Their certificate is not of the CA we were given.
    assert theirs_unverified.startswith("metalog: error: TLS with 127.0.0.1:"), theirs_unverified
    assert "certificate verify failed" in theirs_unverified, theirs_unverified
    # Ours is not of the CA Kafka trusts: Kafka refuses it with an alert.
    assert ours_refused.startswith("metalog: error: TLS with 127.0.0.1:") and "alert" in ours_refused, ours_refused
    # A certificate of the right CA whose principal Kafka's authorizer does not let replicate.
    assert "CLUSTER_AUTHORIZATION_FAILED" in not_authorized, not_authorized


def test_spark_audit_of_our_copy_agrees_with_kafkas_high_watermark(followed, tmp_path):
    """Last in the module: it stops Kafka (the job reads files at rest)."""
    f, c = followed, followed.cluster
    c.stop()
    report = str(tmp_path / "audit.json")
    out = metalog("spark", "audit", f.ours, *(n.log_dir for n in c.controllers), "--report", report,
                  "--master", "local[2]", "--shuffle-partitions", "2", timeout_s=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with open(report) as fh:
        rep = json.load(fh)
    assert rep["voters"] == sorted(kq.CONTROLLER_IDS) and not rep["errors"]
    # At or past what kafka-metadata-quorum reported live (NoOps came after), within the voters' logs.
    assert rep["hw"] >= f.hw_after
    [(name, mine)] = [(n, a) for n, a in rep["audit"].items() if int(a["node_id"]) == OBSERVER_ID]
    assert not mine["in_vote"] and mine["log_end_offset"] >= f.hw_after
    # Equal to Kafka's below the HW: the copy may end short of it (we stopped first), never differ.
    assert mine["status"] in ("agrees", "behind"), (name, mine)
    assert mine.get("first_diff_offset") is None
    for n, a in rep["audit"].items():
        assert a.get("first_diff_offset") is None or a["first_diff_offset"] >= rep["hw"], (n, a)



def test_diverging_epoch_truncates_as_kafkas_truncate_to_end_offset(tmp_path):
    """No Kafka needed: LocalReplica's DivergingEpoch rule is Kafka's
    ReplicatedLog.truncateToEndOffset (ours for that epoch, or the leader's
    end offset if smaller), and never goes below our high watermark."""
    from metalog.tools.kafka.follow import KafkaAnswerError, LocalReplica

    replica = LocalReplica(str(tmp_path / "d"), OBSERVER_ID)
    data = b"".join(b.encode_batch(offset, epoch, [b"x", b"y"], 0)
                    for offset, epoch in ((0, 1), (2, 1), (4, 3), (6, 3)))
    assert replica.append(memoryview(data)) == (4, len(data))
    assert replica.append(memoryview(data)) == (0, 0)  # batches we hold already are skipped
    assert replica.truncate_to_end_offset(3, 7) == 6  # epoch 3 is ours: the leader's end (batch boundary)
    assert replica.truncate_to_end_offset(2, 5) == 4  # epoch 2 unknown here: where our epoch 1 ends
    assert replica.last_fetched_epoch() == 1
    replica.high_watermark = 4
    with pytest.raises(KafkaAnswerError, match="below our high watermark 4"):
        replica.truncate_to_end_offset(1, 2)
    replica.close()
