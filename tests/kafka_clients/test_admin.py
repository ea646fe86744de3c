"""Administration through Kafka's admin APIs (issue 32 item 4), judged by
clients we did not write -- confluent-kafka's AdminClient (librdkafka) and
Apache Kafka 4.3.1's own AclCommand (Java) -- and checked against our own
view of the controller's state (the leader's admin API, our CLI). The
module shares conftest's secured 4-node cluster; librdkafka sends ACL and
config requests to any node, so followers forward them (tested explicitly
at a follower with kio, too)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (AclBinding, AclBindingFilter, AclOperation, AclPermissionType, AdminClient,
                                   AlterConfigOpType, ConfigEntry, ConfigResource, NewPartitions, NewTopic,
                                   ResourcePatternType, ResourceType)

from tests.kafka_clients.test_kafka_clients import _java_client_config
from tests.polling import await_value

DEADLINE_S = 30


def _metalog(kafka_cluster, *args: str) -> subprocess.CompletedProcess:
    """Our own CLI against the cluster (the admin user's client config; a
    listing reads the leader's admin API)."""
    c = kafka_cluster.cluster
    if args[1] == "list" and args[0] == "topics":
        where = ["--admin", f"https://127.0.0.1:{c.nodes[kafka_cluster.leader()[0]].admin_port}"]
    else:
        where = ["--bootstrap", ",".join(f"{h}:{p}" for h, p in c.bootstrap()), "--cluster-id", c.cluster_id]
    return subprocess.run([sys.executable, "-m", "metalog.tools.cli", *args[:2], *where, "--client-config",
                           c.client_config_path, *args[2:]], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def admin(kafka_cluster):
    """confluent-kafka's AdminClient as User:admin, with brokers 1-3 registered
    in the controller (create_topic places replicas on registered brokers)."""
    for broker_id in (1, 2, 3):
        out = _metalog(kafka_cluster, "brokers", "register", str(broker_id), "--endpoint",
                       f"SSL:127.0.0.1:{9000 + broker_id}")
        assert out.returncode == 0, out.stderr
    return AdminClient(kafka_cluster.librdkafka_conf())


def _state(kafka_cluster, path: str):
    """The leader's applied controller state at `path` of its admin API."""
    leader, _ = kafka_cluster.leader()
    return kafka_cluster.cluster.admin(leader, path)


def _await(what: str, check, deadline_s: float = DEADLINE_S):
    return await_value(what, check, deadline_s)


def _error(future) -> int:
    with pytest.raises(KafkaException) as info:
        future.result(timeout=DEADLINE_S)
    return info.value.args[0].code()


def test_topics_created_grown_and_deleted(kafka_cluster, admin):
    futures = admin.create_topics([NewTopic("orders", 3, 2, config={"retention.ms": "1000"})],
                                  request_timeout=DEADLINE_S)
    futures["orders"].result(timeout=DEADLINE_S)
    topic = _await("orders in the controller's state", lambda: _state(kafka_cluster, "/metadata/topics/orders"))
    assert topic["partition_count"] == 3 and topic["configs"] == {"retention.ms": "1000"}
    assert all(len(p["replicas"]) == 2 for p in topic["partitions"])

    dup = admin.create_topics([NewTopic("orders", 1, 1)], request_timeout=DEADLINE_S)["orders"]
    assert _error(dup) == KafkaError.TOPIC_ALREADY_EXISTS
    too_wide = admin.create_topics([NewTopic("wide", 1, 4)], request_timeout=DEADLINE_S)["wide"]
    assert _error(too_wide) == KafkaError.INVALID_REPLICATION_FACTOR
    admin.create_topics([NewTopic("ghost", 1, 1)], validate_only=True)["ghost"].result(timeout=DEADLINE_S)

    admin.create_partitions([NewPartitions("orders", 5)])["orders"].result(timeout=DEADLINE_S)
    _await("orders at 5 partitions",
           lambda: (_state(kafka_cluster, "/metadata/topics/orders") or {}).get("partition_count") == 5)
    fewer = admin.create_partitions([NewPartitions("orders", 2)])["orders"]
    assert _error(fewer) == KafkaError.INVALID_PARTITIONS
    unknown = admin.create_partitions([NewPartitions("nope", 2)])["nope"]
    assert _error(unknown) == KafkaError.UNKNOWN_TOPIC_OR_PART

    admin.delete_topics(["orders"], operation_timeout=DEADLINE_S)["orders"].result(timeout=DEADLINE_S)
    _await("orders gone", lambda: _state(kafka_cluster, "/metadata/topics/orders") is None)
    again = admin.delete_topics(["orders"], operation_timeout=DEADLINE_S)["orders"]
    assert _error(again) == KafkaError.UNKNOWN_TOPIC_OR_PART
    listed = _metalog(kafka_cluster, "topics", "list", "--all")
    assert listed.returncode == 0, listed.stderr
    names = [json.loads(line)["name"] for line in listed.stdout.splitlines()]
    assert "orders" not in names and "ghost" not in names and "wide" not in names  # validate_only wrote nothing


def test_configs_described_and_altered(kafka_cluster, admin):
    admin.create_topics([NewTopic("cfg", 1, 1, config={"cleanup.policy": "compact"})])["cfg"].result(
        timeout=DEADLINE_S)
    resource = ConfigResource(ResourceType.TOPIC, "cfg", incremental_configs=[
        ConfigEntry("retention.ms", "2000", incremental_operation=AlterConfigOpType.SET),
        ConfigEntry("cleanup.policy", None, incremental_operation=AlterConfigOpType.DELETE)])
    admin.incremental_alter_configs([resource])[resource].result(timeout=DEADLINE_S)
    _await("cfg's configs", lambda: (_state(kafka_cluster, "/metadata/topics/cfg") or {}).get("configs")
           == {"retention.ms": "2000"})
    described = admin.describe_configs([ConfigResource(ResourceType.TOPIC, "cfg")])
    entries = next(iter(described.values())).result(timeout=DEADLINE_S)
    assert {k: e.value for k, e in entries.items()} == {"retention.ms": "2000"}

    broker = ConfigResource(ResourceType.BROKER, "2", incremental_configs=[
        ConfigEntry("log.retention.ms", "5000", incremental_operation=AlterConfigOpType.SET)])
    admin.incremental_alter_configs([broker])[broker].result(timeout=DEADLINE_S)  # librdkafka asks node 2 itself
    entries = admin.describe_configs([ConfigResource(ResourceType.BROKER, "2")])
    assert {k: e.value for k, e in next(iter(entries.values())).result(timeout=DEADLINE_S).items()} == {
        "log.retention.ms": "5000"}
    assert _state(kafka_cluster, "/metadata/brokers/2")["configs"] == {"log.retention.ms": "5000"}

    append = ConfigResource(ResourceType.TOPIC, "cfg", incremental_configs=[
        ConfigEntry("cleanup.policy", "delete", incremental_operation=AlterConfigOpType.APPEND)])
    assert _error(admin.incremental_alter_configs([append])[append]) == KafkaError.INVALID_CONFIG
    missing = admin.describe_configs([ConfigResource(ResourceType.TOPIC, "nope")])
    assert _error(next(iter(missing.values()))) == KafkaError.UNKNOWN_TOPIC_OR_PART


def _bob_read() -> AclBinding:
    return AclBinding(ResourceType.TOPIC, "__cluster_metadata", ResourcePatternType.LITERAL, "User:bob", "*",
                      AclOperation.READ, AclPermissionType.ALLOW)


def _acls_listed(kafka_cluster) -> list[dict]:
    out = _metalog(kafka_cluster, "acls", "list", "-o", "json")
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_acls_created_described_listed_by_kafkas_tool_and_deleted(kafka_cluster, admin, tmp_path):
    from metalog.tools import kafka

    group = AclBinding(ResourceType.GROUP, "g", ResourcePatternType.LITERAL, "User:bob", "*", AclOperation.READ,
                       AclPermissionType.ALLOW)
    futures = admin.create_acls([_bob_read(), group])
    futures[_bob_read()].result(timeout=DEADLINE_S)
    assert _error(futures[group]) == KafkaError.INVALID_REQUEST  # our ACLs hold topics and the cluster only
    bob = [a for a in _acls_listed(kafka_cluster) if a["principal"] == "User:bob"]
    assert [(a["operation"], a["permission"], a["resource_type"], a["resource_name"], a["pattern_type"])
            for a in bob] == [("Read", "Allow", "Topic", "__cluster_metadata", "LITERAL")]

    bob_filter = AclBindingFilter(ResourceType.ANY, None, ResourcePatternType.ANY, "User:bob", None,
                                  AclOperation.ANY, AclPermissionType.ANY)
    assert admin.describe_acls(bob_filter).result(timeout=DEADLINE_S) == [_bob_read()]

    leader, _ = kafka_cluster.leader()
    follower = min(n for n in (1, 2, 3) if n != leader)
    host, port = kafka_cluster.kafka_ports[follower]
    listed = kafka.run_class("org.apache.kafka.tools.AclCommand", [
        "--bootstrap-server", f"{host}:{port}", "--command-config", _java_client_config(kafka_cluster, tmp_path),
        "--list", "--topic", "__cluster_metadata"], timeout_s=120)
    assert listed.returncode == 0, listed.stderr
    assert "principal=User:bob, host=*, operation=READ, permissionType=ALLOW" in listed.stdout, listed.stdout

    deleted = admin.delete_acls([bob_filter])[bob_filter].result(timeout=DEADLINE_S)
    assert deleted == [_bob_read()]
    assert not [a for a in _acls_listed(kafka_cluster) if a["principal"] == "User:bob"]
    assert admin.describe_acls(bob_filter).result(timeout=DEADLINE_S) == []


def test_a_follower_forwards_a_command_for_its_client(kafka_cluster, admin):
    """CreateAcls v3 sent to a follower (kio): forwarded to the leader with
    the client's principal, judged there, committed."""
    from kio.schema.create_acls.v3.request import AclCreation, CreateAclsRequest
    from kio.schema.create_acls.v3.response import CreateAclsResponse
    from kio.static.primitive import i8

    topic, prefixed, write, allow = 2, 4, 4, 3  # Kafka's codes
    leader, _ = kafka_cluster.leader()
    follower = max(n for n in (1, 2, 3) if n != leader)
    raw = kafka_cluster.raw(node_id=follower)
    try:
        _, resp = raw.ask(CreateAclsRequest(creations=(AclCreation(
            resource_type=i8(topic), resource_name="t", resource_pattern_type=i8(prefixed), principal="User:carol",
            host="*", operation=i8(write), permission_type=i8(allow)),)), CreateAclsResponse)
    finally:
        raw.close()
    assert [(r.error_code, r.error_message) for r in resp.results] == [(0, None)]
    carol = [a for a in _acls_listed(kafka_cluster) if a["principal"] == "User:carol"]
    assert [(a["operation"], a["resource_name"], a["pattern_type"]) for a in carol] == [("Write", "t", "PREFIXED")]


def test_a_user_without_acls_changes_nothing(kafka_cluster, admin, tmp_path):
    from metalog.tools.cluster.certs import issue_user

    issue_user(kafka_cluster.cluster.cert_dir, str(tmp_path), "mallory")
    mallory = AdminClient(kafka_cluster.librdkafka_conf(**{
        "ssl.certificate.location": str(tmp_path / "mallory.crt"), "ssl.key.location": str(tmp_path / "mallory.key")}))
    acls_before = _acls_listed(kafka_cluster)

    topic = mallory.create_topics([NewTopic("evil", 1, 1)], request_timeout=DEADLINE_S)["evil"]
    assert _error(topic) == KafkaError.CLUSTER_AUTHORIZATION_FAILED
    # librdkafka's BROKER is Kafka's Cluster resource type (4)
    acl = AclBinding(ResourceType.BROKER, "kafka-cluster", ResourcePatternType.LITERAL, "User:mallory", "*",
                     AclOperation.ALL, AclPermissionType.ALLOW)
    assert _error(mallory.create_acls([acl])[acl]) == KafkaError.CLUSTER_AUTHORIZATION_FAILED
    resource = ConfigResource(ResourceType.BROKER, "1", incremental_configs=[
        ConfigEntry("x", "1", incremental_operation=AlterConfigOpType.SET)])
    assert _error(mallory.incremental_alter_configs([resource])[resource]) == KafkaError.CLUSTER_AUTHORIZATION_FAILED

    assert _state(kafka_cluster, "/metadata/topics/evil") is None
    assert _acls_listed(kafka_cluster) == acls_before
    assert "x" not in _state(kafka_cluster, "/metadata/brokers/1")["configs"]


def test_only_a_node_may_forward_and_the_leader_judges_the_client():
    """The envelope rule of the gate (metalog.broker.controller.acl), alone."""
    from metalog.broker.controller import acl as authz
    from metalog.broker.net.principal import Principal
    from metalog.protocol import messages as m
    from metalog.protocol.apis import ApiKey

    bob_alters = authz.new_acl("User:bob", authz.Operation.ALTER, authz.Permission.ALLOW, authz.ResourceType.CLUSTER,
                               authz.CLUSTER_RESOURCE_NAME, host="10.0.0.7")
    view = authz.AuthzView(enabled=True, voters=frozenset({1, 2, 3}), super_users=frozenset({"User:admin"}),
                           acls=(bob_alters,))

    def forwarded(client: str, host: str, command: str = "add_acl") -> m.ControllerCommandRequest:
        return m.ControllerCommandRequest(cluster_id="c", command=command, args={
            "principal": "User:x", authz.FORWARDED_FOR: {"principal": client, "host": host}})

    def decide(sender: str, body: m.ControllerCommandRequest):
        return authz.authorize(Principal.parse(sender), "127.0.0.1", ApiKey.CONTROLLER_COMMAND, body, view)

    assert decide("Node:2", forwarded("User:bob", "10.0.0.7")) is None
    assert decide("Node:2", forwarded("User:admin", "10.0.0.9")) is None  # a super user, as itself
    denied = decide("Node:2", forwarded("User:bob", "10.0.0.8"))  # bob's ACL names another host
    assert denied is not None and denied.principal == "User:bob"
    assert decide("Node:2", forwarded("User:bob", "10.0.0.7", command="create_topic")) is not None  # Write, not Alter
    # A user certificate never speaks for another, not even a super user's.
    assert decide("User:admin", forwarded("User:bob", "10.0.0.7")) is not None
    assert decide("Node:2", m.ControllerCommandRequest(cluster_id="c", command="add_acl", args={
        authz.FORWARDED_FOR: {"host": "10.0.0.7"}})) is not None  # no principal named
