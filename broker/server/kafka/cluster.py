"""ApiVersions, Metadata, DescribeCluster and DescribeQuorum in Kafka's
protocol: each asks the broker's own handler (``KafkaContext.ask``) and maps
its flat answer to Kafka's nesting (docs/kafka-listener.md).

* ApiVersions: the served table's ranges; supported and finalized features
  (v3+: tagged): kraft.version as our own ApiVersions reports it,
  metadata.version as the node's controller state holds it.
* Metadata: one topic, ``__cluster_metadata`` (Kafka's fixed topic id),
  partition 0: leader = the raft leader and its epoch, replicas and ISR =
  the voters; brokers = every node with its Kafka listener; controller id =
  this node (below). Any other topic is UNKNOWN_TOPIC_OR_PARTITION (by id:
  UNKNOWN_TOPIC_ID); nothing is ever auto-created.
* DescribeCluster: the same nodes, controller id = this node; EndpointType 2
  (a client bootstrapped with ``bootstrap.controllers``, KIP-919) is echoed
  and gets the voters only, controller id = the leader, as Kafka's
  controllers answer it.

Why "this node" as the controller: Kafka's brokers name a random live broker
(KIP-590: every broker forwards the controller's requests), and every node
here forwards every admin request to the leader (``admin``). The node that
answers is the one a client is sure is alive; naming the Raft leader left
librdkafka's admin client waiting on a killed leader ("Failed while waiting
for controller") until its next metadata refresh, minutes later.
* DescribeQuorum: our DescribeQuorum answer nested topic -> partition, each
  node with its listeners (ours, and the Kafka one); a node that is not the
  leader forwards it to the leader, as a Kafka broker forwards it to the
  active controller.
"""

from __future__ import annotations

from typing import Any, Callable

from metalog.broker.net.kafka_conn import KafkaExchange
from metalog.broker.server.clocks import now_ms, wall_clock_ms
from metalog.broker.server.kafka.api import (METADATA_PARTITION, METADATA_TOPIC, METADATA_TOPIC_ID, KafkaApi,
                                             KafkaContext)
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.protocol.errors import Errors
from metalog.protocol.kafka import messages as km
from metalog.protocol.kafka.messages import ZERO_UUID, uuid_from_str
from metalog.storage.metadata_records import METADATA_VERSION, METADATA_VERSION_LEVEL, METADATA_VERSION_LEVEL_MIN

UNKNOWN_TOPIC_ID = 100
UNSUPPORTED_ENDPOINT_TYPE = 115
ENDPOINT_BROKERS, ENDPOINT_CONTROLLERS = 1, 2
_AUTHORIZATION_ERRORS = frozenset({Errors.CLUSTER_AUTHORIZATION_FAILED, Errors.TOPIC_AUTHORIZATION_FAILED})


# ---------------------------------------------------------------- ApiVersions
def api_versions(ctx: KafkaContext, ex: KafkaExchange) -> None:
    def answer(resp: m.ApiVersionsResponse) -> None:
        out = km.ApiVersionsResponse(
            error_code=resp.error_code,
            api_keys=[km.ApiVersionsResponseApiVersion(api_key=key, min_version=lo, max_version=hi)
                      for key, (lo, hi) in sorted(ctx.supported().items())])
        if ex.version >= 3:  # the features are v3's tagged fields
            supported, finalized = _features(ctx, resp)
            out.supported_features = [km.ApiVersionsResponseSupportedFeatureKey(
                name=name, min_version=lo, max_version=hi) for name, (lo, hi) in supported]
            out.finalized_features_epoch = resp.finalized_features_epoch
            out.finalized_features = [km.ApiVersionsResponseFinalizedFeatureKey(
                name=name, max_version_level=level, min_version_level=level) for name, level in finalized]
        ex.respond(out)

    ctx.ask(ex, ApiKey.API_VERSIONS, m.ApiVersionsRequest(), answer)


def _features(ctx: KafkaContext, resp: m.ApiVersionsResponse) -> tuple[list[tuple[str, tuple[int, int]]],
                                                                        list[tuple[str, int]]]:
    """Supported ranges and finalized levels, by name: kraft.version as the
    quorum core reports it, metadata.version (and any other feature a
    FeatureLevelRecord finalized) as this node's controller state applied it
    from the log -- what Kafka's ApiVersions reports, and what
    ``kafka-features describe`` prints. metalog writes the records of
    metadata.version 3.9-IV0 (level 21) and reads Kafka's from 3.3-IV3 (7) on."""
    supported = {f.name: (f.min_version, f.max_version) for f in resp.supported_features}
    supported.setdefault(METADATA_VERSION, (METADATA_VERSION_LEVEL_MIN, METADATA_VERSION_LEVEL))
    finalized = {name: level for name, level in ctx.finalized_features().items() if level > 0}
    finalized.update((f.name, f.max_version_level) for f in resp.finalized_features)  # the core's kraft.version
    return sorted(supported.items()), sorted(finalized.items())


# ------------------------------------------------------------------- Metadata
def metadata(ctx: KafkaContext, ex: KafkaExchange) -> None:
    ctx.ask(ex, ApiKey.METADATA, m.MetadataRequest(), lambda resp: ex.respond(_metadata(ctx, ex, resp)))


def _metadata(ctx: KafkaContext, ex: KafkaExchange, resp: m.MetadataResponse) -> Any:
    version = ex.version
    requested = ex.body.topics
    if requested is None or (version == 0 and not requested):  # v0's empty list and v1+'s null: all
        topics = [_metadata_topic(resp, version)]
    else:
        topics = [_requested_topic(t, resp, version) for t in requested]
    out = km.MetadataResponse(
        brokers=[km.MetadataResponseMetadataResponseBroker(node_id=nid, host=host, port=port)
                 for nid, (host, port) in sorted(ctx.endpoints().items())],
        topics=topics)
    if version >= 1:
        out.controller_id = ctx.node_id  # alive, and it forwards to the leader (module doc)
    if version >= 2:
        out.cluster_id = resp.cluster_id or ctx.cluster_id
    return out


def _requested_topic(t: Any, resp: m.MetadataResponse, version: int) -> Any:
    topic_id = getattr(t, "topic_id", ZERO_UUID) if version >= 10 else ZERO_UUID
    if t.name == METADATA_TOPIC or (t.name is None and topic_id == METADATA_TOPIC_ID):
        return _metadata_topic(resp, version)
    out = km.MetadataResponseMetadataResponseTopic(
        error_code=Errors.UNKNOWN_TOPIC_OR_PARTITION if t.name is not None else UNKNOWN_TOPIC_ID,
        name=t.name if t.name is not None or version >= 12 else "", partitions=[])
    if version >= 10:
        out.topic_id = topic_id
    return out


def _metadata_topic(resp: m.MetadataResponse, version: int) -> Any:
    voters = [v.node_id for v in resp.voters]
    error = resp.error_code
    if error in _AUTHORIZATION_ERRORS:  # Kafka says it of the topic
        return km.MetadataResponseMetadataResponseTopic(
            error_code=Errors.TOPIC_AUTHORIZATION_FAILED, name=METADATA_TOPIC, partitions=[])
    if error == Errors.NONE and resp.leader_id < 0:
        error = Errors.LEADER_NOT_AVAILABLE
    partition = km.MetadataResponseMetadataResponsePartition(
        error_code=error, partition_index=METADATA_PARTITION, leader_id=resp.leader_id,
        replica_nodes=voters, isr_nodes=voters)
    if version >= 7:
        partition.leader_epoch = resp.leader_epoch
    topic = km.MetadataResponseMetadataResponseTopic(error_code=Errors.NONE, name=METADATA_TOPIC,
                                                     partitions=[partition])
    # Not internal (v1+'s IsInternal stays false): Kafka clients produce to it
    # here, and kafka-python's producer refuses a topic marked internal.
    if version >= 10:
        topic.topic_id = METADATA_TOPIC_ID
    return topic


# ------------------------------------------------------------ DescribeCluster
def describe_cluster(ctx: KafkaContext, ex: KafkaExchange) -> None:
    endpoint_type = ex.body.endpoint_type if ex.version >= 1 else ENDPOINT_BROKERS

    def answer(resp: m.MetadataResponse) -> None:
        controller = resp.leader_id if endpoint_type == ENDPOINT_CONTROLLERS else ctx.node_id  # module doc
        out = km.DescribeClusterResponse(cluster_id=resp.cluster_id or ctx.cluster_id, controller_id=controller)
        if ex.version >= 1:
            out.endpoint_type = endpoint_type
        if resp.error_code != Errors.NONE:
            out.error_code = resp.error_code
            out.error_message = resp.error_message
        elif endpoint_type not in (ENDPOINT_BROKERS, ENDPOINT_CONTROLLERS):
            out.error_code = UNSUPPORTED_ENDPOINT_TYPE
            out.error_message = f"endpoint type {endpoint_type} is not served (1 brokers, 2 controllers)"
        else:
            endpoints = ctx.endpoints()
            ids = sorted(endpoints) if endpoint_type == ENDPOINT_BROKERS else sorted(
                v.node_id for v in resp.voters if v.node_id in endpoints)
            out.brokers = [km.DescribeClusterResponseDescribeClusterBroker(
                broker_id=nid, host=endpoints[nid][0], port=endpoints[nid][1]) for nid in ids]
        ex.respond(out)

    ctx.ask(ex, ApiKey.METADATA, m.MetadataRequest(), answer)


# ------------------------------------------------------------- DescribeQuorum
def describe_quorum(ctx: KafkaContext, ex: KafkaExchange) -> None:
    asked = [(t.topic_name, p.partition_index) for t in ex.body.topics for p in t.partitions]
    if asked != [(METADATA_TOPIC, METADATA_PARTITION)]:
        ex.respond(_describe_quorum_unknown(ex))
        return
    def answer(resp: m.DescribeQuorumResponse) -> None:
        ex.respond(_describe_quorum(ctx, ex.version, resp))

    def local(resp: m.DescribeQuorumResponse) -> None:
        if resp.error_code == Errors.NOT_LEADER_OR_FOLLOWER and resp.leader_id not in (-1, ctx.node_id):
            # As a Kafka broker forwards to the active controller (kafka-metadata-quorum
            # --bootstrap-server asks any broker); our own gate has let the client through.
            ctx.forward(ex, resp.leader_id, ApiKey.DESCRIBE_QUORUM, m.DescribeQuorumRequest(), answer, resp)
        else:
            answer(resp)

    ctx.ask(ex, ApiKey.DESCRIBE_QUORUM, m.DescribeQuorumRequest(), local)


def _describe_quorum_unknown(ex: KafkaExchange) -> Any:
    return km.DescribeQuorumResponse(topics=[km.DescribeQuorumResponseTopicData(topic_name=t.topic_name, partitions=[
        km.DescribeQuorumResponsePartitionData(partition_index=p.partition_index,
                                               error_code=Errors.UNKNOWN_TOPIC_OR_PARTITION)
        for p in t.partitions]) for t in ex.body.topics])


def _describe_quorum(ctx: KafkaContext, version: int, resp: m.DescribeQuorumResponse) -> Any:
    if resp.error_code in _AUTHORIZATION_ERRORS:  # Kafka: a top-level error, no topics
        out = km.DescribeQuorumResponse(error_code=resp.error_code)
        if version >= 2:
            out.error_message = resp.error_message
        return out
    to_wall = _to_wall_clock(resp)
    partition = km.DescribeQuorumResponsePartitionData(
        partition_index=METADATA_PARTITION, error_code=resp.error_code, leader_id=resp.leader_id,
        leader_epoch=resp.leader_epoch, high_watermark=resp.high_watermark,
        current_voters=[_replica(r, version, to_wall) for r in resp.voters],
        observers=[_replica(r, version, to_wall) for r in resp.observers])
    out = km.DescribeQuorumResponse(topics=[km.DescribeQuorumResponseTopicData(
        topic_name=METADATA_TOPIC, partitions=[partition])])
    if version >= 2:
        partition.error_message = resp.error_message
        out.nodes = _nodes(ctx, resp)
    return out


def _to_wall_clock(resp: m.DescribeQuorumResponse) -> Callable[[int], int]:
    """The core's timestamps are its monotonic clock (its timers survive
    wall-clock jumps); Kafka's are wall-clock epoch ms, which
    kafka-metadata-quorum prints as "N ms ago". The leader's own entry
    carries the leader's now (Kafka's leader reports itself as fetched now),
    so each timestamp is turned into an age on the leader's clock and put
    before our wall clock: right also for an answer forwarded from a leader on
    another host, whose monotonic clock has another origin. Without a leader
    entry the answer is this node's own, on this node's clock. -1 stays -1."""
    leader_now_ms = next((r.last_fetch_timestamp_ms for r in resp.voters if r.replica_id == resp.leader_id), -1)
    if leader_now_ms < 0:
        leader_now_ms = now_ms()
    wall_now_ms = wall_clock_ms()
    return lambda ts_ms: ts_ms if ts_ms < 0 else wall_now_ms - (leader_now_ms - ts_ms)


def _replica(r: m.ReplicaState, version: int, to_wall: Callable[[int], int]) -> Any:
    out = km.DescribeQuorumResponseReplicaState(replica_id=r.replica_id, log_end_offset=r.log_end_offset)
    if version >= 1:
        out.last_fetch_timestamp = to_wall(r.last_fetch_timestamp_ms)
        out.last_caught_up_timestamp = to_wall(r.last_caught_up_timestamp_ms)
    if version >= 2 and r.replica_directory_id:
        out.replica_directory_id = uuid_from_str(r.replica_directory_id)
    return out


def _nodes(ctx: KafkaContext, resp: m.DescribeQuorumResponse) -> list[Any]:
    """Each voter's listeners as the quorum names them, plus its Kafka one."""
    endpoints = ctx.endpoints()
    nodes = []
    for node in resp.nodes:
        listeners = [(ln.name, ln.host, ln.port) for ln in node.listeners]
        kafka = endpoints.get(node.node_id)
        if kafka is not None and not any(name == ctx.listener_name for name, _, _ in listeners):
            listeners.append((ctx.listener_name, kafka[0], kafka[1]))
        nodes.append(km.DescribeQuorumResponseNode(node_id=node.node_id, listeners=[
            km.DescribeQuorumResponseListener(name=name, host=host, port=port) for name, host, port in listeners]))
    return nodes


def _api(request_name: str, lo: int, hi: int, handle: Any) -> KafkaApi:
    request = getattr(km, request_name)
    return KafkaApi(request, max(lo, request.LOWEST_VERSION), min(hi, request.HIGHEST_VERSION), handle)


APIS: dict[int, KafkaApi] = {
    18: _api("ApiVersionsRequest", 0, 4, api_versions),
    3: _api("MetadataRequest", 0, 13, metadata),
    60: _api("DescribeClusterRequest", 0, 1, describe_cluster),
    55: _api("DescribeQuorumRequest", 0, 2, describe_quorum),
}
