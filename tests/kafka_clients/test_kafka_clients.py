"""Kafka clients we did not write bootstrap against the Kafka listener over
mutual TLS (issue 32 items 1, 3, 4, 5): kcat, confluent-kafka (librdkafka),
kafka-python; and bad input answered as Kafka answers it, checked with kio's
classes (generated from Kafka's schemas by others), not ours."""

from __future__ import annotations

import json
import shutil
import ssl
import struct
import subprocess

import pytest

METADATA_TOPIC = "__cluster_metadata"
METADATA_TOPIC_ID = bytes(15) + b"\x01"


def test_kcat_lists_brokers_and_the_metadata_partition(kafka_cluster):
    kcat = shutil.which("kcat")
    assert kcat, "kcat is not installed: bash run.sh setup installs it (Debian package kcat)"
    leader, epoch = kafka_cluster.leader()
    out = subprocess.run([kcat, "-F", kafka_cluster.cluster.kafka_properties_path, "-L", "-J", "-m", "20"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    meta = json.loads(out.stdout)
    assert {b["id"]: b["name"] for b in meta["brokers"]} == {
        nid: f"{h}:{p}" for nid, (h, p) in kafka_cluster.kafka_ports.items()}
    (topic,) = meta["topics"]
    assert topic["topic"] == METADATA_TOPIC
    (partition,) = topic["partitions"]
    assert partition["partition"] == 0
    assert partition["leader"] == leader
    assert sorted(r["id"] for r in partition["replicas"]) == [1, 2, 3]


def test_confluent_admin_lists_topics_and_describes_the_cluster(kafka_cluster):
    from confluent_kafka.admin import AdminClient

    leader, _ = kafka_cluster.leader()
    admin = AdminClient(kafka_cluster.librdkafka_conf())
    md = admin.list_topics(timeout=20)
    assert md.cluster_id == kafka_cluster.cluster.cluster_id
    # The controller is the node that answered (alive; it forwards to the leader), as Kafka's brokers name
    # a live broker: librdkafka's admin client must not wait on a dead leader (test_admin_failover.py).
    assert md.controller_id in kafka_cluster.kafka_ports
    assert {b.id: (b.host, b.port) for b in md.brokers.values()} == kafka_cluster.kafka_ports
    assert list(md.topics) == [METADATA_TOPIC]
    partition = md.topics[METADATA_TOPIC].partitions[0]
    assert (partition.leader, sorted(partition.replicas), partition.error) == (leader, [1, 2, 3], None)

    described = admin.describe_cluster(request_timeout=20).result(timeout=30)
    assert described.cluster_id == kafka_cluster.cluster.cluster_id
    assert described.controller.id in kafka_cluster.kafka_ports
    assert {n.id: (n.host, n.port) for n in described.nodes} == kafka_cluster.kafka_ports


def test_confluent_asks_for_an_unknown_topic_and_creates_nothing(kafka_cluster):
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(kafka_cluster.librdkafka_conf(**{"allow.auto.create.topics": "true"}))
    md = admin.list_topics(topic="no-such-topic", timeout=20)
    assert md.topics["no-such-topic"].error.code() == 3  # UNKNOWN_TOPIC_OR_PARTITION
    assert list(admin.list_topics(timeout=20).topics) == [METADATA_TOPIC]


def test_kafka_python_admin_and_consumer_bootstrap(kafka_cluster):
    from kafka import KafkaAdminClient, KafkaConsumer

    leader, _ = kafka_cluster.leader()
    tls = dict(bootstrap_servers=kafka_cluster.bootstrap.split(","), security_protocol="SSL",
               ssl_cafile=kafka_cluster.cert("ca.crt"), ssl_certfile=kafka_cluster.cert("admin.crt"),
               ssl_keyfile=kafka_cluster.cert("admin.key"), request_timeout_ms=20000)
    admin = KafkaAdminClient(**tls)
    try:
        described = admin.describe_cluster()
        assert described["cluster_id"] == kafka_cluster.cluster.cluster_id
        assert described["controller_id"] in kafka_cluster.kafka_ports
        assert {b["broker_id"]: (b["host"], b["port"]) for b in described["brokers"]} == kafka_cluster.kafka_ports
        (topic,) = admin.describe_topics([METADATA_TOPIC])
        assert (topic["error_code"], topic["is_internal"]) == (0, False)  # clients produce to it
        assert [(p["partition_index"], p["leader_id"]) for p in topic["partitions"]] == [(0, leader)]
    finally:
        admin.close()
    consumer = KafkaConsumer(**tls)
    try:
        assert consumer.partitions_for_topic(METADATA_TOPIC) == {0}
    finally:
        consumer.close()


def test_describe_cluster_for_bootstrap_controllers_echoes_endpoint_type_2(kafka_cluster):
    """KIP-919: an admin client bootstrapped with bootstrap.controllers sends
    EndpointType 2 and must get it back, with the voters and the leader."""
    from kio.schema.describe_cluster.v1.request import DescribeClusterRequest
    from kio.schema.describe_cluster.v1.response import DescribeClusterResponse
    from kio.static.primitive import i8

    leader, _ = kafka_cluster.leader()
    raw = kafka_cluster.raw(node_id=4)  # an observer answers too: the leader is what it names
    try:
        cid, resp = raw.ask(DescribeClusterRequest(include_cluster_authorized_operations=False,
                                                   endpoint_type=i8(2)), DescribeClusterResponse, 11)
    finally:
        raw.close()
    assert (cid, resp.error_code, resp.endpoint_type, resp.controller_id) == (11, 0, 2, leader)
    assert {b.broker_id: (b.host, b.port) for b in resp.brokers} == {
        nid: ep for nid, ep in kafka_cluster.kafka_ports.items() if nid in (1, 2, 3)}


def test_describe_quorum_nests_the_metadata_partition(kafka_cluster):
    from kio.schema.describe_quorum.v2.request import DescribeQuorumRequest, PartitionData, TopicData
    from kio.schema.describe_quorum.v2.response import DescribeQuorumResponse

    leader, epoch = kafka_cluster.leader()
    raw = kafka_cluster.raw(node_id=leader)
    try:
        _, resp = raw.ask(DescribeQuorumRequest(topics=(TopicData(topic_name=METADATA_TOPIC, partitions=(
            PartitionData(partition_index=0),)),)), DescribeQuorumResponse)
    finally:
        raw.close()
    assert resp.error_code == 0
    (topic,) = resp.topics
    (part,) = topic.partitions
    assert (topic.topic_name, part.partition_index, part.error_code, part.leader_id) == (METADATA_TOPIC, 0, 0, leader)
    assert part.leader_epoch >= epoch
    assert sorted(v.replica_id for v in part.current_voters) == [1, 2, 3]
    assert [o.replica_id for o in part.observers] == [4]
    listeners = {n.node_id: {ln.name: (ln.host, ln.port) for ln in n.listeners} for n in resp.nodes}
    assert sorted(listeners) == [1, 2, 3]
    for nid, by_name in listeners.items():
        assert by_name["SSL"] == kafka_cluster.kafka_ports[nid]
        assert by_name["CONTROLLER"][1] == kafka_cluster.cluster.nodes[nid].port


def test_an_unsupported_api_versions_version_gets_the_v0_fallback(kafka_cluster):
    from kio.schema.api_versions.v0.response import ApiVersionsResponse

    raw = kafka_cluster.raw()
    try:
        # ApiVersions v127, header v2 (flexible): api key, version, correlation id,
        # client id (int16 length), an empty tagged-field section; a body we never read.
        client_id = b"future-client"
        raw.send_frame(struct.pack(">hhih", 18, 127, 42, len(client_id)) + client_id + b"\x00" + b"\x00\x00")
        cid, resp = raw.read_response(ApiVersionsResponse)
        assert (cid, resp.error_code) == (42, 35)  # UNSUPPORTED_VERSION
        ranges = {k.api_key: (k.min_version, k.max_version) for k in resp.api_keys}
        assert ranges[18] == (0, 4)
        assert ranges[3][0] == 0 and ranges[3][1] >= 12
        assert ranges[60] == (0, 1) and ranges[55] == (0, 2)
    finally:
        raw.close()


def test_garbage_after_a_valid_header_gets_kafkas_error_and_the_connection_goes_on(kafka_cluster):
    from kio.schema.describe_cluster.v1.request import DescribeClusterRequest
    from kio.schema.describe_cluster.v1.response import DescribeClusterResponse

    leader, _ = kafka_cluster.leader()
    raw = kafka_cluster.raw()
    try:
        valid = raw.request_bytes(DescribeClusterRequest(include_cluster_authorized_operations=False), 5)
        header_only = valid[:-3]  # bool, int8, empty tagged fields: the body
        raw.send_frame(header_only + b"\x01\x02\xff\xff\xff\xff\xff\xff\xff\xff\x7f")  # a varint that overflows
        cid, resp = raw.read_response(DescribeClusterResponse)
        assert (cid, resp.error_code) == (5, 42)  # INVALID_REQUEST, to this request
        cid, resp = raw.ask(DescribeClusterRequest(include_cluster_authorized_operations=False),
                            DescribeClusterResponse, 6)
        assert (cid, resp.error_code, resp.controller_id) == (6, 0, leader)
    finally:
        raw.close()


def test_answers_leave_in_request_order(kafka_cluster):
    """Pipelined requests of different apis come back in the order sent."""
    from kio.schema.api_versions.v3.request import ApiVersionsRequest
    from kio.schema.api_versions.v3.response import ApiVersionsResponse
    from kio.schema.describe_cluster.v1.request import DescribeClusterRequest
    from kio.schema.describe_cluster.v1.response import DescribeClusterResponse
    from kio.schema.describe_quorum.v2.request import DescribeQuorumRequest, PartitionData, TopicData
    from kio.schema.describe_quorum.v2.response import DescribeQuorumResponse

    leader, _ = kafka_cluster.leader()
    raw = kafka_cluster.raw(node_id=leader)
    quorum = DescribeQuorumRequest(topics=(TopicData(topic_name=METADATA_TOPIC,
                                                     partitions=(PartitionData(partition_index=0),)),))
    plan = [(quorum, DescribeQuorumResponse),
            (ApiVersionsRequest(client_software_name="t", client_software_version="1"), ApiVersionsResponse),
            (DescribeClusterRequest(include_cluster_authorized_operations=False), DescribeClusterResponse)] * 10
    try:
        raw.sock.sendall(b"".join(struct.pack(">i", len(p)) + p for p in (
            raw.request_bytes(body, 100 + i) for i, (body, _) in enumerate(plan))))
        got = [raw.read_response(response_type)[0] for _, response_type in plan]
    finally:
        raw.close()
    assert got == [100 + i for i in range(len(plan))]


def test_a_client_without_a_certificate_is_refused(kafka_cluster):
    from kio.schema.api_versions.v0.request import ApiVersionsRequest
    from kio.schema.api_versions.v0.response import ApiVersionsResponse

    raw = None
    with pytest.raises((ssl.SSLError, ConnectionError, EOFError, OSError)):
        raw = kafka_cluster.raw(certificate=False)
        raw.ask(ApiVersionsRequest(), ApiVersionsResponse)
    if raw is not None:
        raw.close()
    # ... while a client with one still gets its answer.
    raw = kafka_cluster.raw()
    try:
        _, resp = raw.ask(ApiVersionsRequest(), ApiVersionsResponse)
        assert resp.error_code == 0
    finally:
        raw.close()


def _java_client_config(kafka_cluster, tmp_path) -> str:
    """Kafka's Java clients read PEM files: the admin key and certificate in one keystore file."""
    pem = tmp_path / "admin.pem"
    pem.write_text(open(kafka_cluster.cert("admin.key")).read() + open(kafka_cluster.cert("admin.crt")).read())
    props = tmp_path / "java-client.properties"
    props.write_text(f"security.protocol=SSL\nssl.truststore.type=PEM\nssl.truststore.location="
                     f"{kafka_cluster.cert('ca.crt')}\nssl.keystore.type=PEM\nssl.keystore.location={pem}\n"
                     "default.api.timeout.ms=30000\n")
    return str(props)


def test_kafkas_metadata_quorum_tool_describes_the_quorum(kafka_cluster, tmp_path):
    """Kafka's own kafka-metadata-quorum (Java, Apache Kafka 4.3.1's jars from
    bash run.sh setup): --bootstrap-controller (DescribeCluster with
    EndpointType 2, then DescribeQuorum v2 to the leader) and
    --bootstrap-server (DescribeQuorum to any node, forwarded to the leader)."""
    from metalog.tools import kafka

    leader, _ = kafka_cluster.leader()
    props = _java_client_config(kafka_cluster, tmp_path)
    follower = min(n for n in (1, 2, 3) if n != leader)
    host, port = kafka_cluster.kafka_ports[follower]
    status = kafka.run_class("org.apache.kafka.tools.MetadataQuorumCommand", [
        "--bootstrap-controller", f"{host}:{port}", "--command-config", props, "describe", "--status"], timeout_s=120)
    assert status.returncode == 0, status.stderr
    fields = dict(line.split(":", 1) for line in status.stdout.splitlines() if ":" in line)
    assert fields["ClusterId"].strip() == kafka_cluster.cluster.cluster_id
    assert int(fields["LeaderId"]) == leader
    voters = json.loads(fields["CurrentVoters"])
    assert sorted(v["id"] for v in voters) == [1, 2, 3]
    for v in voters:
        h, p = kafka_cluster.kafka_ports[v["id"]]
        assert f"SSL://{h}:{p}" in v["endpoints"]
    assert [o["id"] for o in json.loads(fields["CurrentObservers"])] == [4]

    replication = kafka.run_class("org.apache.kafka.tools.MetadataQuorumCommand", [
        "--bootstrap-server", f"{host}:{port}", "--command-config", props, "describe", "--replication"],
        timeout_s=120)
    assert replication.returncode == 0, replication.stderr
    rows = [line.split() for line in replication.stdout.splitlines()[1:] if line.strip()]
    assert sorted((int(r[0]), r[-1]) for r in rows) == sorted(
        [(n, "Leader" if n == leader else "Follower") for n in (1, 2, 3)] + [(4, "Observer")])


def test_a_user_without_acls_gets_routing_but_not_the_quorum(kafka_cluster, tmp_path):
    """The gate of the listen port holds here too: User:alice (a valid certificate,
    no ACL) may learn where the leader is, not describe the quorum."""
    from kio.schema.describe_quorum.v2.request import DescribeQuorumRequest, PartitionData, TopicData
    from kio.schema.describe_quorum.v2.response import DescribeQuorumResponse
    from kio.schema.metadata.v12.request import MetadataRequest
    from kio.schema.metadata.v12.response import MetadataResponse

    from metalog.tools.cluster.certs import issue_user

    issue_user(kafka_cluster.cluster.cert_dir, str(tmp_path), "alice")
    leader, _ = kafka_cluster.leader()
    raw = kafka_cluster.raw(node_id=leader, cert_files=(str(tmp_path / "alice.crt"), str(tmp_path / "alice.key")))
    try:
        _, quorum = raw.ask(DescribeQuorumRequest(topics=(TopicData(topic_name=METADATA_TOPIC, partitions=(
            PartitionData(partition_index=0),)),)), DescribeQuorumResponse)
        _, meta = raw.ask(MetadataRequest(topics=None, allow_auto_topic_creation=False,
                                          include_topic_authorized_operations=False), MetadataResponse)
    finally:
        raw.close()
    assert (quorum.error_code, quorum.topics) == (31, ())  # CLUSTER_AUTHORIZATION_FAILED, nothing else
    (topic,) = meta.topics
    assert (topic.name, topic.partitions[0].leader_id, meta.controller_id) == (METADATA_TOPIC, leader, leader)


@pytest.mark.parametrize("version", [0, 1, 2, 3, 4])
def test_api_versions_at_every_version(kafka_cluster, version):
    """Our ranges at every ApiVersions version; from v3, the features as our
    own ApiVersions reports them (kraft.version finalized at 1: a dynamic quorum) and
    metadata.version as the controller state holds it."""
    import importlib

    req = importlib.import_module(f"kio.schema.api_versions.v{version}.request").ApiVersionsRequest
    resp_type = importlib.import_module(f"kio.schema.api_versions.v{version}.response").ApiVersionsResponse
    body = req(client_software_name="t", client_software_version="1") if version >= 3 else req()
    raw = kafka_cluster.raw()
    try:
        cid, resp = raw.ask(body, resp_type, 40 + version)
    finally:
        raw.close()
    ranges = {k.api_key: (k.min_version, k.max_version) for k in resp.api_keys}
    assert (cid, resp.error_code) == (40 + version, 0)
    assert {18: (0, 4), 60: (0, 1), 55: (0, 2)}.items() <= ranges.items()
    assert ranges[3] == (0, 13)
    if version >= 3:
        finalized = {f.name: (f.min_version_level, f.max_version_level) for f in resp.finalized_features}
        # metadata.version from the controller state: 3.9-IV0 (21), as our snapshots write it.
        assert finalized == {"kraft.version": (1, 1), "metadata.version": (21, 21)}
        supported = {f.name: (f.min_version, f.max_version) for f in resp.supported_features}
        assert supported == {"kraft.version": (0, 1), "metadata.version": (7, 21)}
