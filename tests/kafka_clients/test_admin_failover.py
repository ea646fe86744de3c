"""Kafka's admin APIs at any live node, through a leader's kill -9 (issue 32
item 4), judged by librdkafka (confluent-kafka's AdminClient) and by
requests encoded by kio.

Its own real 3-voter cluster (three broker processes, mutual TLS), because
the last test kills the leader. Metadata names the answering node as the
controller (it is alive and forwards to the leader), and a node that cannot
reach a leader keeps the request until one is elected (``admin.LeaderWait``),
so librdkafka's create_topics, sent right after the kill, lands at the next
leader instead of waiting on the dead one ("Failed while waiting for
controller": what it did when Metadata named the Raft leader) or failing
NOT_CONTROLLER (which librdkafka does not retry). UpdateFeatures at a
follower goes to the leader in an Envelope with the client's principal."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from metalog.tools.cluster.launcher import LocalCluster
from tests.kafka_clients.conftest import FAST, KafkaCluster, start_for_clients

DEADLINE_S = 30
NOT_CONTROLLER, INVALID_UPDATE_VERSION, CLUSTER_AUTHORIZATION_FAILED = 41, 95, 31


@pytest.fixture(scope="module")
def voters3(tmp_path_factory):
    root = tmp_path_factory.mktemp("admin_failover")
    cluster = LocalCluster.create(str(root / "cluster"), voters=3, observers=0, dynamic=True, common=dict(FAST))
    try:
        kc = start_for_clients(cluster)
        # create_topic places replicas on registered brokers: one is enough for replication factor 1.
        out = subprocess.run([sys.executable, "-m", "metalog.tools.cli", "brokers", "register", "1", "--bootstrap",
                              ",".join(f"{h}:{p}" for h, p in cluster.bootstrap()), "--cluster-id",
                              cluster.cluster_id, "--client-config", cluster.client_config_path, "--endpoint",
                              "SSL:127.0.0.1:9001"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        yield kc
    finally:
        cluster.stop()


def _update_features(kc: KafkaCluster, node_id: int, level: int, upgrade_type: int, cert_files=None):
    from kio.schema.update_features.v1.request import FeatureUpdateKey, UpdateFeaturesRequest
    from kio.schema.update_features.v1.response import UpdateFeaturesResponse
    from kio.static.primitive import i8, i16

    raw = kc.raw(node_id=node_id, cert_files=cert_files)
    try:
        _, resp = raw.ask(UpdateFeaturesRequest(feature_updates=(FeatureUpdateKey(
            feature="kraft.version", max_version_level=i16(level), upgrade_type=i8(upgrade_type)),),
            validate_only=True), UpdateFeaturesResponse)
    finally:
        raw.close()
    return resp


def test_the_controller_named_is_the_answering_node(voters3):
    """Metadata and DescribeCluster (brokers) at a follower name the
    follower; DescribeCluster for bootstrap.controllers (EndpointType 2)
    names the leader, as Kafka's controllers answer it."""
    from kio.schema.describe_cluster.v1.request import DescribeClusterRequest
    from kio.schema.describe_cluster.v1.response import DescribeClusterResponse
    from kio.schema.metadata.v12.request import MetadataRequest
    from kio.schema.metadata.v12.response import MetadataResponse
    from kio.static.primitive import i8

    leader, _ = voters3.leader()
    follower = max(n for n in (1, 2, 3) if n != leader)
    raw = voters3.raw(node_id=follower)
    try:
        _, meta = raw.ask(MetadataRequest(topics=None, allow_auto_topic_creation=False,
                                          include_topic_authorized_operations=False), MetadataResponse)
        _, brokers = raw.ask(DescribeClusterRequest(include_cluster_authorized_operations=False,
                                                    endpoint_type=i8(1)), DescribeClusterResponse)
        _, controllers = raw.ask(DescribeClusterRequest(include_cluster_authorized_operations=False,
                                                        endpoint_type=i8(2)), DescribeClusterResponse)
    finally:
        raw.close()
    assert (meta.controller_id, meta.topics[0].partitions[0].leader_id) == (follower, leader)
    assert (brokers.controller_id, controllers.controller_id) == (follower, leader)


def test_update_features_at_a_follower_is_answered_by_the_leader(voters3):
    """UpdateFeatures v1 (kio) at a follower: the leader's own verdicts come
    back (a follower used to answer NOT_CONTROLLER), and a user without ACLs
    is refused by the follower's gate before anything is forwarded."""
    leader, _ = voters3.leader()
    follower = min(n for n in (1, 2, 3) if n != leader)
    same = _update_features(voters3, follower, 1, 1)
    assert (same.error_code, [r.error_code for r in same.results]) == (0, [0])  # the leader: at 1 already
    down = _update_features(voters3, follower, 0, 2)
    assert down.error_code == INVALID_UPDATE_VERSION, down
    assert "cannot be downgraded from 1 to 0" in down.error_message  # the leader's check, not the follower's

    from metalog.tools.cluster.certs import issue_user

    issue_user(voters3.cluster.cert_dir, voters3.cluster.cert_dir, "mallory")
    refused = _update_features(voters3, follower, 1, 1, cert_files=(voters3.cert("mallory.crt"),
                                                                     voters3.cert("mallory.key")))
    assert refused.error_code == CLUSTER_AUTHORIZATION_FAILED, refused


def test_create_topics_right_after_the_leader_is_killed(voters3):
    """kill -9 of the leader, then librdkafka's create_topics through a client
    bootstrapped with every node (the dead one included): it succeeds well
    before the deadline, and the topic is there once, at the new leader."""
    cluster = voters3.cluster
    old_leader, _ = voters3.leader()
    cluster.kill(old_leader)
    started = time.monotonic()
    admin = AdminClient(voters3.librdkafka_conf())
    admin.create_topics([NewTopic("after-kill", 2, 1)], request_timeout=DEADLINE_S)["after-kill"].result(
        timeout=DEADLINE_S)
    took_s = time.monotonic() - started
    print(f"create_topics answered {took_s:.2f} s after the kill")
    assert took_s < DEADLINE_S

    new_leader, _ = cluster.wait_for_leader(DEADLINE_S, exclude={old_leader})
    topics = cluster.admin(new_leader, "/metadata/topics")
    assert [t["name"] for t in topics["topics"] if t["name"] == "after-kill"] == ["after-kill"], topics
    again = admin.create_topics([NewTopic("after-kill", 2, 1)], request_timeout=DEADLINE_S)["after-kill"]
    with pytest.raises(KafkaException) as info:
        again.result(timeout=DEADLINE_S)
    assert info.value.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS
