"""The quorum in Kafka's protocol (issue 32: metalog's only protocol): every
peer request is Kafka's, and `listen` is Kafka's controller listener (issue
34 item 1). Three voters as processes,
mutual TLS on; records are written with librdkafka on the client listener.

* a leader is elected through KIP-996's pre-vote (a prospective first);
  writes commit and reach every voter's log;
* kill -9 of the leader: a new one is elected, writes go on;
* a voter that fell behind the leader's log start installs a snapshot
  (FetchSnapshot), and ends with the same high watermark;
* `listen` answers Kafka's ApiVersions; a peer api from a certificate that is
  not the node's is refused (CLUSTER_AUTHORIZATION_FAILED).
"""

from __future__ import annotations

import datetime
import socket
import ssl
import uuid

import pytest

from metalog.tools.cluster.launcher import LocalCluster
from tests.kafka_clients.conftest import KafkaCluster, RawKafka

pytestmark = pytest.mark.slow

FAST = dict(election_timeout_ms=300, fetch_timeout_ms=800, request_timeout_ms=800, fetch_max_wait_ms=100,
            snapshot_min_records=150, max_replication_lag_ms=500)


@pytest.fixture(scope="module")
def kafka_wire_cluster(tmp_path_factory):
    cluster = LocalCluster.create(str(tmp_path_factory.mktemp("kafka_wire") / "cluster"), voters=3,
                                  dynamic=True, common=dict(FAST))
    try:
        cluster.start()
        yield KafkaCluster(cluster)
    finally:
        cluster.stop()


def _produce(kc: KafkaCluster, count: int, tag: str) -> None:
    from confluent_kafka import Producer

    producer = Producer(kc.librdkafka_conf(**{"acks": "all", "enable.idempotence": "true", "linger.ms": "5"}))
    failures: list = []
    for i in range(count):
        producer.produce("__cluster_metadata", f"{tag}-{i}".encode(), partition=0,
                         on_delivery=lambda err, _msg: err is not None and failures.append(err))
        producer.poll(0)
    assert producer.flush(60) == 0, "records left undelivered"
    assert failures == []


def _views(cluster: LocalCluster, nodes) -> list:
    return [cluster.quorum(n) for n in nodes]


def _caught_up(cluster: LocalCluster, nodes, at_least: int):
    views = _views(cluster, nodes)
    if not all(views):
        return None
    hws = {v["high_watermark"] for v in views}
    return views if len(hws) == 1 and min(hws) >= at_least and all(
        v["log_end_offset"] >= v["high_watermark"] for v in views) else None


def _raw_to_listen(kc: KafkaCluster, node_id: int, cert: str) -> RawKafka:
    spec = kc.cluster.nodes[node_id]
    host, port = kc.cluster.host, spec.port
    ctx = ssl.create_default_context(cafile=kc.cert("ca.crt"))
    ctx.load_cert_chain(kc.cert(f"{cert}.crt"), kc.cert(f"{cert}.key"))
    return RawKafka(ctx.wrap_socket(socket.create_connection((host, port), timeout=10), server_hostname=host))


def test_election_by_pre_vote_and_writes_replicate(kafka_wire_cluster):
    kc = kafka_wire_cluster
    cluster = kc.cluster
    leader, epoch = cluster.wait_for_leader(30)
    roles = [ln.get("role") for ln in cluster.read_log_lines(leader) if ln.get("event") == "role_changed"]
    assert "prospective" in roles and roles.index("prospective") < roles.index("leader"), roles
    _produce(kc, 50, "first")
    cluster.wait_for(lambda: _caught_up(cluster, cluster.nodes, 50), 30, "every voter to hold the 50 records")


def test_kill_9_of_the_leader_elects_another_and_writes_go_on(kafka_wire_cluster):
    kc = kafka_wire_cluster
    cluster = kc.cluster
    old, old_epoch = cluster.wait_for_leader(30)
    hw = cluster.quorum(old)["high_watermark"]
    cluster.kill(old)
    new, new_epoch = cluster.wait_for_leader(30, exclude={old})
    assert new != old and new_epoch > old_epoch
    _produce(kc, 20, "after-kill")
    alive = [n for n in cluster.nodes if n != old]
    cluster.wait_for(lambda: _caught_up(cluster, alive, hw + 20), 30, "the two voters to commit the new records")
    cluster.start_node(old)
    cluster.wait_for(lambda: _caught_up(cluster, cluster.nodes, hw + 20), 30, "the killed voter to catch up")


def test_a_voter_behind_the_log_start_installs_a_snapshot(kafka_wire_cluster):
    kc = kafka_wire_cluster
    cluster = kc.cluster
    leader, _ = cluster.wait_for_leader(30)
    behind = next(n for n in cluster.nodes if n != leader)
    cluster.kill(behind)
    start_view = cluster.quorum(leader)
    start, hw_before = start_view["log_start_offset"], start_view["high_watermark"]
    _produce(kc, 400, "while-down")  # past snapshot_min_records (150): snapshots, the log start moves
    others = [n for n in cluster.nodes if n != behind]
    cluster.wait_for(lambda: all(v and v["log_start_offset"] > start and v["snapshots"]
                                 for v in _views(cluster, others)), 60, "a snapshot and a later log start")
    cluster.start_node(behind)
    views = cluster.wait_for(lambda: _caught_up(cluster, cluster.nodes, 0), 60, "the voter to catch up")
    assert views[0]["high_watermark"] >= hw_before + 400
    installed = [ln for ln in cluster.read_log_lines(behind) if ln.get("event") == "snapshot_installed"]
    assert installed, "the voter caught up without a snapshot"


def _vote_of(kc: KafkaCluster, leader: int, candidate: int, epoch: int):
    """kio's Vote v2: `candidate` asks `leader` for its vote in the next epoch."""
    from kio.schema.vote.v2.request import PartitionData, TopicData, VoteRequest
    from kio.static.primitive import i32, i64

    return VoteRequest(cluster_id=kc.cluster.cluster_id, voter_id=i32(leader), topics=(TopicData(
        topic_name="__cluster_metadata", partitions=(PartitionData(
            partition_index=i32(0), replica_epoch=i32(epoch + 1), replica_id=i32(candidate),
            replica_directory_id=uuid.UUID(int=0), voter_directory_id=None, last_offset_epoch=i32(epoch),
            last_offset=i64(10**9), pre_vote=False),)),))


def test_listen_speaks_kafka_and_binds_replicas_to_their_certificates(kafka_wire_cluster):
    from kio.schema.api_versions.v3.request import ApiVersionsRequest
    from kio.schema.api_versions.v3.response import ApiVersionsResponse
    from kio.schema.vote.v2.response import VoteResponse

    kc = kafka_wire_cluster
    leader, epoch = kc.cluster.wait_for_leader(30)
    raw = _raw_to_listen(kc, leader, "admin")
    try:
        _, versions = raw.ask(ApiVersionsRequest(client_software_name="t", client_software_version="1"),
                              ApiVersionsResponse, 1)
        served = {k.api_key: (k.min_version, k.max_version) for k in versions.api_keys}
        assert served[52] == (0, 2) and served[1][1] >= 17 and served[59] == (0, 1)
        other = next(n for n in kc.cluster.nodes if n != leader)
        _, answer = raw.ask(_vote_of(kc, leader, other, epoch), VoteResponse, 2)
        assert answer.error_code.value == 31  # CLUSTER_AUTHORIZATION_FAILED: admin is not node `other`
    finally:
        raw.close()
    assert kc.cluster.wait_for_leader(30)[1] == epoch  # and it changed nothing


def test_the_client_listener_serves_no_quorum_request(kafka_wire_cluster):
    """Issue 34 item 1: the quorum's own requests are served on the
    controller listener only, so an operator can firewall `listen` to the
    voters and observers. On the client listener, with a node's own
    certificate: ApiVersions lists none of them, a Vote is answered
    UNSUPPORTED_VERSION (35), and a replica's Fetch of the metadata log gets
    UNKNOWN_TOPIC_OR_PARTITION (3), as from a Kafka broker; the same Fetch
    on `listen` is served."""
    from kio.schema.api_versions.v3.request import ApiVersionsRequest
    from kio.schema.api_versions.v3.response import ApiVersionsResponse
    from kio.schema.fetch.v17.request import FetchPartition, FetchRequest, FetchTopic, ReplicaState
    from kio.schema.fetch.v17.response import FetchResponse
    from kio.schema.vote.v2.response import VoteResponse
    from kio.static.primitive import i8, i32, i32Timedelta, i64

    kc = kafka_wire_cluster
    leader, epoch = kc.cluster.wait_for_leader(30)
    other = next(n for n in kc.cluster.nodes if n != leader)
    node_cert = (kc.cert(f"node-{other}.crt"), kc.cert(f"node-{other}.key"))
    fetch = FetchRequest(
        cluster_id=kc.cluster.cluster_id, replica_state=ReplicaState(replica_id=i32(other), replica_epoch=i64(-1)),
        max_wait=i32Timedelta.parse(datetime.timedelta(0)), min_bytes=i32(0), max_bytes=i32(1 << 20), isolation_level=i8(0),
        session_id=i32(0), session_epoch=i32(-1), rack_id="", forgotten_topics_data=(), topics=(FetchTopic(
            topic_id=uuid.UUID(int=1), partitions=(FetchPartition(
                partition=i32(0), current_leader_epoch=i32(epoch), fetch_offset=i64(0), last_fetched_epoch=i32(0),
                log_start_offset=i64(-1), partition_max_bytes=i32(1 << 20), replica_directory_id=uuid.UUID(int=0)),)),))
    raw = kc.raw(leader, cert_files=node_cert)
    try:
        _, versions = raw.ask(ApiVersionsRequest(client_software_name="t", client_software_version="1"),
                              ApiVersionsResponse, 1)
        served = {k.api_key for k in versions.api_keys}
        assert served.isdisjoint({52, 53, 54, 59, 82}) and {0, 1, 3, 55} <= served
        _, answer = raw.ask(_vote_of(kc, leader, other, epoch), VoteResponse, 2)
        assert answer.error_code.value == 35
        _, fetched = raw.ask(fetch, FetchResponse, 3)
        assert fetched.responses[0].partitions[0].error_code.value == 3
    finally:
        raw.close()
    listen = _raw_to_listen(kc, leader, f"node-{other}")
    try:
        _, fetched = listen.ask(fetch, FetchResponse, 4)
        part = fetched.responses[0].partitions[0]
        assert part.error_code.value == 0 and part.high_watermark > 0
    finally:
        listen.close()
    assert kc.cluster.wait_for_leader(30)[1] == epoch  # none of it moved the quorum
