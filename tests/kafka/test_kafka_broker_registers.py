"""A real Apache Kafka 4.3.1 broker (``process.roles=broker``, node 100) with
a metalog quorum as its controllers (issue 32 item 4, issue 33 item 4):
Kafka's own broker code judges our BrokerRegistration and BrokerHeartbeat,
our Fetch and FetchSnapshot of the metadata log, and the records it replays.

One secured 3-voter metalog cluster per module (mutual TLS; its cluster id
in Kafka's form, since Kafka's StorageTool formats the broker's dir with
it), and one Kafka broker whose keystore holds a node certificate of the
metalog cluster's CA (``Node:100`` to metalog: it may register broker 100
only). The broker follows the metadata log as an observer, registers,
heartbeats and is unfenced (Kafka says so in its log; ``metalog`` shows it);
its idempotent producers' ids come from blocks metalog's leader allocates
(AllocateProducerIds);
killed with SIGKILL it is fenced by the leader after
``broker_session_timeout_ms``; restarted, it registers a new incarnation and
is unfenced again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from metalog.tools.cluster.launcher import REPO_ROOT, LocalCluster
from metalog.tools.kafka import quorum as kq
from metalog.tools.kafka.quorum import BROKER_ID, KafkaCluster, kafka_uuid
from tests.polling import await_value

FAST = dict(election_timeout_ms=300, fetch_timeout_ms=800, request_timeout_ms=800, fetch_max_wait_ms=100)
SESSION_TIMEOUT_MS = 4000  # below Kafka's 9000: the fence after kill -9 comes sooner
# Kafka's BrokerLifecycleManager, once a heartbeat answers is_fenced=false.
UNFENCED_LINE = "The broker has been unfenced. Transitioning from RECOVERY to RUNNING"
RUNNING_LINE = "Kafka Server started"
START_TIMEOUT_S = 120.0
# Kafka's BrokerLifecycleManager once a heartbeat answers should_shut_down.
SHUTDOWN_LINE = "The controller has asked us to exit"


def metalog(*args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "metalog.tools.cli", *args], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, f"metalog {' '.join(args)}: {out.stderr}"
    return out


class Setup:
    def __init__(self, cluster: LocalCluster, kafka_side: KafkaCluster):
        self.cluster = cluster
        self.kafka = kafka_side

    @property
    def broker(self):
        return self.kafka.nodes[BROKER_ID]

    def registration(self) -> dict | None:
        """Broker 100 as the leader's applied controller state shows it (its admin API)."""
        leader, _ = self.cluster.wait_for_leader(30)
        return self.cluster.admin(leader, f"/metadata/brokers/{BROKER_ID}")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("kafka_broker")
    cluster = LocalCluster.create(str(root / "metalog"), voters=3, observers=0, dynamic=True,
                                  cluster_id=kafka_uuid(),
                                  common=dict(FAST, broker_session_timeout_ms=SESSION_TIMEOUT_MS))
    side = None
    try:
        cluster.start()
        cluster.wait_for_leader(30)
        controllers = ",".join(f"{h}:{p}" for h, p in cluster.bootstrap())
        os.makedirs(root / "kafka")
        side = KafkaCluster(str(root / "kafka"), cluster.cluster_id, tls_dir=cluster.cert_dir, overrides={
            "controller.quorum.bootstrap.servers": controllers,
            "broker.session.timeout.ms": str(SESSION_TIMEOUT_MS),
            "super.users": "User:admin",
        })
        node = side.nodes[BROKER_ID] = side._node(BROKER_ID, "broker")
        side._write_props(node)
        side._format()
        side.launch([node])
        yield Setup(cluster, side)
    finally:
        if side is not None:
            side.kill()
        cluster.stop()


def _await(what: str, check, deadline_s: float = 60.0):
    """check() until truthy (its value), or fail naming `what` with the last value seen."""
    return await_value(what, check, deadline_s, interval_s=0.2)


def test_kafka_broker_registers_and_is_unfenced(setup):
    s = setup
    s.kafka.wait_for(lambda: UNFENCED_LINE in s.broker.output(), START_TIMEOUT_S,
                     "the Kafka broker to be unfenced", s.broker)
    s.kafka.wait_for(lambda: RUNNING_LINE in s.broker.output(), 60, "the Kafka broker to run", s.broker)
    br = _await("broker 100 unfenced in metalog's state", lambda: (s.registration() or {}).get("fenced") is False
                and s.registration())
    assert br["broker_id"] == BROKER_ID
    # Its SSL listener, as Kafka's broker registered it; its epoch is its registration record's offset.
    assert br["endpoints"] == [{"name": "SSL", "host": "127.0.0.1", "port": s.broker.port}], br
    assert br["broker_epoch"] > 0
    # What a user sees: `metalog brokers describe 100` (through a node's admin API).
    leader, _ = s.cluster.wait_for_leader(30)
    admin = f"https://{s.cluster.host}:{s.cluster.nodes[leader].admin_port}"
    out = metalog("brokers", "describe", str(BROKER_ID), "--client-config", s.cluster.client_config_path,
                  "--admin", admin)
    described = json.loads(out.stdout)
    assert (described["fenced"], described["endpoints"]) == (False, br["endpoints"]), described


def test_killed_broker_is_fenced_then_reregisters(setup):
    s = setup
    first = s.registration()
    assert first is not None and first["fenced"] is False
    killed_at = time.monotonic()
    s.broker.proc.send_signal(signal.SIGKILL)
    s.broker.proc.wait(30)
    _await("broker 100 fenced after its session expired", lambda: (s.registration() or {}).get("fenced") is True,
           SESSION_TIMEOUT_MS / 1000 + 30)
    # Not before its session ran out (the leader counts from its last heartbeat, <= 2 s before the kill).
    assert time.monotonic() - killed_at >= SESSION_TIMEOUT_MS / 1000 - 2.5
    s.kafka.launch([s.broker])
    s.kafka.wait_for(lambda: s.broker.output().count(UNFENCED_LINE) >= 2, START_TIMEOUT_S,
                     "the restarted Kafka broker to be unfenced", s.broker)
    again = _await("broker 100 unfenced again", lambda: (s.registration() or {}).get("fenced") is False
                   and s.registration())
    assert again["incarnation_id"] != first["incarnation_id"], (first, again)
    assert again["broker_epoch"] > first["broker_epoch"], (first, again)


def test_kafka_topics_through_the_kafka_broker_lands_in_metalog(setup):
    """kafka-topics --bootstrap-server <the Kafka broker> --create: the broker
    forwards CreateTopics to its controller, the metalog leader, inside an
    Envelope; the topic is placed on the one unfenced broker, 100."""
    s = setup
    s.kafka.wait_for(lambda: s.broker.proc is not None and UNFENCED_LINE in s.broker.output(), START_TIMEOUT_S,
                     "the Kafka broker to be unfenced", s.broker)
    _await("broker 100 unfenced", lambda: (s.registration() or {}).get("fenced") is False)
    admin = s.kafka.command_config()  # the admin user of metalog's CA, over SSL
    bootstrap = f"127.0.0.1:{s.broker.port}"
    s.kafka.tool(kq.TOPICS, ["--bootstrap-server", bootstrap, *admin, "--create",
                             "--topic", "through-kafka", "--partitions", "2", "--replication-factor", "1"])
    leader, _ = s.cluster.wait_for_leader(30)
    topic = _await("the topic in metalog's state",
                   lambda: s.cluster.admin(leader, "/metadata/topics/through-kafka"))
    assert [(p["partition"], p["replicas"], p["leader"]) for p in topic["partitions"]] == [
        (0, [BROKER_ID], BROKER_ID), (1, [BROKER_ID], BROKER_ID)], topic
    # Kafka's broker hosts it: its own Metadata says broker 100 leads both partitions.
    out = s.kafka.tool(kq.TOPICS, ["--bootstrap-server", bootstrap, *admin, "--describe",
                                   "--topic", "through-kafka"]).stdout
    assert out.count("Leader: 100") == 2, out


def test_librdkafka_produces_and_consumes_through_the_kafka_broker(setup):
    """The topic of the test above, served by the Kafka broker whose controller
    quorum is metalog: librdkafka produces (acks=all, not idempotent) and
    reads every record back, in order."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    s = setup
    certs = s.cluster.cert_dir
    conf = {"bootstrap.servers": f"127.0.0.1:{s.broker.port}", "security.protocol": "SSL",
            "ssl.ca.location": f"{certs}/ca.crt", "ssl.certificate.location": f"{certs}/admin.crt",
            "ssl.key.location": f"{certs}/admin.key"}
    producer = Producer({**conf, "acks": "all", "message.timeout.ms": 60000, "max.in.flight": 1})
    acked = []

    def delivered(err, msg):
        assert err is None, err
        acked.append((msg.partition(), msg.offset(), msg.value()))

    values = [f"record-{i}".encode() for i in range(50)]
    for v in values:
        producer.produce("through-kafka", v, partition=0, on_delivery=delivered)
    assert producer.flush(60) == 0
    assert [a[2] for a in acked] == values and [a[1] for a in acked] == list(range(50))
    consumer = Consumer({**conf, "group.id": "unused", "enable.auto.commit": False})
    try:
        consumer.assign([TopicPartition("through-kafka", 0, 0)])
        got = []
        end = time.monotonic() + 60
        while len(got) < len(values) and time.monotonic() < end:
            msg = consumer.poll(1.0)
            if msg is not None and msg.error() is None:
                got.append(msg.value())
        assert got == values
    finally:
        consumer.close()


def _producer_ids_in(log_dir: str) -> set[int]:
    """The producer ids of the batches in a Kafka partition's segment files (our own batch reader)."""
    from metalog.storage.batch import iter_batches

    ids = set()
    for name in sorted(os.listdir(log_dir)):
        if name.endswith(".log"):
            with open(os.path.join(log_dir, name), "rb") as f:
                ids |= {h.producer_id for _pos, h in iter_batches(f.read())}
    return ids


def test_librdkafka_idempotent_producer_through_the_kafka_broker(setup):
    """enable.idempotence=true: the Kafka broker answers librdkafka's
    InitProducerId from a block of producer ids it asks its controller for
    (AllocateProducerIds, api 67), and metalog's leader commits the block as
    a ProducerIdsRecord (next_producer_id moves by Kafka's 1000) before it
    answers. Every record is acknowledged once, in order, and Kafka's own log
    holds them under a producer id from that block."""
    from confluent_kafka import Producer

    s = setup
    _await("broker 100 unfenced", lambda: (s.registration() or {}).get("fenced") is False)
    leader, _ = s.cluster.wait_for_leader(30)
    before = s.cluster.admin(leader, "/metadata")["next_producer_id"]
    certs = s.cluster.cert_dir
    producer = Producer({"bootstrap.servers": f"127.0.0.1:{s.broker.port}", "security.protocol": "SSL",
                         "ssl.ca.location": f"{certs}/ca.crt", "ssl.certificate.location": f"{certs}/admin.crt",
                         "ssl.key.location": f"{certs}/admin.key", "enable.idempotence": True, "acks": "all",
                         "message.timeout.ms": 60000})
    acked = []

    def delivered(err, msg):
        assert err is None, err
        acked.append((msg.offset(), msg.value()))

    values = [f"idempotent-{i}".encode() for i in range(100)]
    for v in values:
        producer.produce("through-kafka", v, partition=1, on_delivery=delivered)
    assert producer.flush(60) == 0
    assert acked == list(enumerate(values))
    leader, _ = s.cluster.wait_for_leader(30)
    after = _await("the block in the leader's state",
                   lambda: (s.cluster.admin(leader, "/metadata") or {}).get("next_producer_id") != before
                   and s.cluster.admin(leader, "/metadata")["next_producer_id"])
    assert after == before + 1000, (before, after)
    ids = _producer_ids_in(os.path.join(s.broker.log_dir, "through-kafka-1"))
    assert len(ids) == 1 and before <= ids.pop() < after, ids


def test_sigterm_shuts_the_broker_down_through_its_controller(setup):
    """Kafka's orderly shutdown: heartbeats with want_shut_down; metalog's
    leader fences the broker and answers should_shut_down, and the broker
    exits (no controlled-shutdown state: it is fenced at once)."""
    s = setup
    _await("broker 100 unfenced", lambda: (s.registration() or {}).get("fenced") is False)
    s.broker.proc.send_signal(signal.SIGTERM)
    assert s.broker.proc.wait(60) in (0, 143), s.broker.output()[-3000:]
    assert SHUTDOWN_LINE in s.broker.output(), s.broker.output()[-3000:]
    assert (s.registration() or {}).get("fenced") is True
