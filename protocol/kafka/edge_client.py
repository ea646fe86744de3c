"""The client's apis at the sending edge: flat bodies <-> Kafka's messages.

Registers, with ``metalog.protocol.kafka.edge``, how each flat request our
client library, CLI, drill and bench send (and the brokers' consistency
check and forwarded controller commands) travels in Kafka's protocol:

* ApiVersions v3: the features (v3's tagged fields) are what
  ``metalog features describe`` prints.
* Metadata v12, asking for ``__cluster_metadata`` by name. The brokers'
  list and partition 0's replicas give the flat answer's endpoints:
  ``voters`` are the brokers among the replicas (the server lists the voters
  as replicas), ``observers`` the other brokers; ``leader_id``/
  ``leader_epoch`` are the partition's, ``cluster_id`` v2+'s. Kafka's
  Metadata says nothing of the high watermark, the log start or which node
  answered: they stay -1 here, and ``MetalogClient.metadata()`` asks the
  leader's ListOffsets for the first two (where Kafka has them). A partition
  answered LEADER_NOT_AVAILABLE is a flat answer without a leader (error
  NONE, ``leader_id`` -1): that is how the flat Metadata says it.
* Produce v10, acks -1: the flat request's values become ONE RecordBatch v2
  built by the log's own encoder (``metalog.storage.batch``: uncompressed,
  no keys or headers, one CreateTime for the batch, the producer id, epoch
  and base sequence of an idempotent producer in its header), which the
  broker stores as built (its base offset and partition leader epoch are
  assigned on append: 0 here). Kafka's answer has no leader epoch: the flat
  ``leader_epoch`` is -1 and the client fills in the epoch of the leader it
  sent to. ``CurrentLeader`` (v10's tag) is the flat ``current_leader``.
* ListOffsets v7 (timestamps -2 earliest, -1 latest = the high watermark;
  ``LeaderEpoch``), InitProducerId v4 (no transactional id), DescribeQuorum
  v2 (``Nodes``: each voter's listeners; the timestamps are the leader's
  wall clock, Kafka's, and keep their differences; Kafka has no ``in_sync``:
  False here, the admin API's /quorum reports it), AddRaftVoter v0 (answered
  once committed, as v1's default), RemoveRaftVoter v0 (Kafka's has no
  timeout: the server waits its default), UpdateFeatures v1 (per-feature
  results; the flat error is the top level's, else the first failing
  feature's).
* metalog's extensions (``schemas_metalog/``): ControllerCommand v0 (the
  arguments and result as JSON text) and ConsistencyCheck v0.

Errors: a Kafka answer's error code and message become the flat answer's
(the top level first, then the partition's). An answer about our log that
carries no partition and no error raises ``ResponseDecodeError``.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Final, TypeVar, cast

from metalog.protocol import messages as m
from metalog.protocol.errors import Errors
from metalog.protocol.kafka import messages as km
from metalog.protocol.kafka.edge import Edge, ResponseDecodeError, register
from metalog.protocol.kafka.edge_quorum import (
    METADATA_PARTITION,
    METADATA_TOPIC,
    dir_from_kafka,
    dir_to_kafka,
    error_of,
)
from metalog.storage.batch import encode_batch

API_VERSIONS_VERSION: Final = 3
METADATA_VERSION: Final = 12
PRODUCE_VERSION: Final = 10
LIST_OFFSETS_VERSION: Final = 7
INIT_PRODUCER_ID_VERSION: Final = 4
DESCRIBE_QUORUM_VERSION: Final = 2
ADD_RAFT_VOTER_VERSION: Final = 0
REMOVE_RAFT_VOTER_VERSION: Final = 0
UPDATE_FEATURES_VERSION: Final = 1
CONTROLLER_COMMAND_VERSION: Final = 0
CONSISTENCY_CHECK_VERSION: Final = 0

ACKS_ALL: Final = -1
CLIENT_SOFTWARE_VERSION: Final = "0.1.0"  # metalog's version (pyproject), as ApiVersions v3 tells it
ISOLATION_READ_COMMITTED: Final = 1  # our log hands out committed records only
# The partition leader epoch a client writes in its batch: the leader sets its own on append.
CLIENT_BATCH_LEADER_EPOCH: Final = 0

B = TypeVar("B", bound=m.Body)


def _edge(flat: type[B], api_key: int, version: int, to_kafka: Callable[[B], Any],
          from_kafka: Callable[[Any, int], m.Body]) -> None:
    # Each mapping takes its own flat type; the registry holds them as taking any body.
    register(flat, Edge(api_key, version, cast(Callable[[m.Body], Any], to_kafka), from_kafka))


def _ours(topics: list[Any], name_of: Callable[[Any], str | None], partitions_of: Callable[[Any], list[Any]],
          index_of: Callable[[Any], int]) -> Any:
    """The answer's partition 0 of ``__cluster_metadata``, or None when there is none."""
    for topic in topics:
        if name_of(topic) == METADATA_TOPIC:
            for part in partitions_of(topic):
                if index_of(part) == METADATA_PARTITION:
                    return part
    return None


def _missing(what: str) -> ResponseDecodeError:
    return ResponseDecodeError(f"{what}: no partition {METADATA_PARTITION} of {METADATA_TOPIC} and no error")


def _leader_or_none(leader_id: int, leader_epoch: int) -> m.LeaderIdAndEpoch | None:
    return None if leader_id == -1 and leader_epoch == -1 else m.LeaderIdAndEpoch(leader_id, leader_epoch)


# -------------------------------------------------------------- ApiVersions
def api_versions_to_kafka(body: m.ApiVersionsRequest) -> km.ApiVersionsRequest:
    return km.ApiVersionsRequest(client_software_name=body.client_software_name,
                                 client_software_version=CLIENT_SOFTWARE_VERSION)


def api_versions_from_kafka(resp: Any, version: int) -> m.Body:
    r = cast(km.ApiVersionsResponse, resp)
    return m.ApiVersionsResponse(
        error_code=r.error_code,
        api_keys=[m.ApiVersionRange(k.api_key, k.min_version, k.max_version) for k in r.api_keys],
        supported_features=[m.SupportedFeature(f.name, f.min_version, f.max_version) for f in r.supported_features],
        finalized_features_epoch=r.finalized_features_epoch,
        finalized_features=[m.FinalizedFeature(f.name, f.max_version_level, f.min_version_level)
                            for f in r.finalized_features])


# ----------------------------------------------------------------- Metadata
def metadata_to_kafka(body: m.MetadataRequest) -> km.MetadataRequest:
    return km.MetadataRequest(topics=[km.MetadataRequestMetadataRequestTopic(name=METADATA_TOPIC)],
                              allow_auto_topic_creation=False)


def metadata_from_kafka(resp: Any, version: int) -> m.Body:
    r = cast(km.MetadataResponse, resp)
    topic = next((t for t in r.topics if t.name == METADATA_TOPIC), None)
    if topic is not None and topic.error_code != Errors.NONE:
        return m.MetadataResponse(error_code=topic.error_code, cluster_id=r.cluster_id or "")
    part = None if topic is None else next(
        (p for p in topic.partitions if p.partition_index == METADATA_PARTITION), None)
    if part is None:
        raise _missing("Metadata")
    code = part.error_code
    if code == Errors.LEADER_NOT_AVAILABLE:
        code = Errors.NONE  # no leader: the flat answer says it with leader_id -1
    replicas = set(part.replica_nodes)
    brokers = sorted(r.brokers, key=lambda b: b.node_id)
    return m.MetadataResponse(
        error_code=code, cluster_id=r.cluster_id or "", leader_id=part.leader_id, leader_epoch=part.leader_epoch,
        voters=[m.NodeEndpoint(b.node_id, b.host, b.port) for b in brokers if b.node_id in replicas],
        observers=[m.NodeEndpoint(b.node_id, b.host, b.port) for b in brokers if b.node_id not in replicas])


# ------------------------------------------------------------------ Produce
def produce_to_kafka(body: m.ProduceRequest) -> km.ProduceRequest:
    batch = encode_batch(0, CLIENT_BATCH_LEADER_EPOCH, body.records, int(time.time() * 1000),
                         producer_id=body.producer_id, producer_epoch=body.producer_epoch,
                         base_sequence=body.base_sequence)
    return km.ProduceRequest(acks=ACKS_ALL, timeout_ms=body.timeout_ms, topic_data=[
        km.ProduceRequestTopicProduceData(name=METADATA_TOPIC, partition_data=[
            km.ProduceRequestPartitionProduceData(index=METADATA_PARTITION, records=batch)])])


def produce_from_kafka(resp: Any, version: int) -> m.Body:
    r = cast(km.ProduceResponse, resp)
    part = _ours(r.responses, lambda t: t.name, lambda t: t.partition_responses, lambda p: p.index)
    if part is None:
        raise _missing("Produce")
    p = cast(km.ProduceResponsePartitionProduceResponse, part)
    leader = p.current_leader
    return m.ProduceResponse(error_code=p.error_code, base_offset=p.base_offset if p.error_code == 0 else -1,
                             error_message=p.error_message,
                             current_leader=_leader_or_none(leader.leader_id, leader.leader_epoch))


# -------------------------------------------------------------- ListOffsets
def list_offsets_to_kafka(body: m.ListOffsetsRequest) -> km.ListOffsetsRequest:
    return km.ListOffsetsRequest(replica_id=-1, isolation_level=ISOLATION_READ_COMMITTED, topics=[
        km.ListOffsetsRequestListOffsetsTopic(name=METADATA_TOPIC, partitions=[
            km.ListOffsetsRequestListOffsetsPartition(partition_index=METADATA_PARTITION,
                                                      current_leader_epoch=body.current_leader_epoch,
                                                      timestamp=body.timestamp_ms)])])


def list_offsets_from_kafka(resp: Any, version: int) -> m.Body:
    r = cast(km.ListOffsetsResponse, resp)
    part = _ours(r.topics, lambda t: t.name, lambda t: t.partitions, lambda p: p.partition_index)
    if part is None:
        raise _missing("ListOffsets")
    p = cast(km.ListOffsetsResponseListOffsetsPartitionResponse, part)
    if p.error_code != Errors.NONE:
        return m.ListOffsetsResponse(error_code=p.error_code)
    return m.ListOffsetsResponse(offset=p.offset, timestamp_ms=p.timestamp, leader_epoch=p.leader_epoch)


# ----------------------------------------------------------- InitProducerId
def init_producer_id_to_kafka(body: m.InitProducerIdRequest) -> km.InitProducerIdRequest:
    return km.InitProducerIdRequest(transactional_id=body.transactional_id,
                                    transaction_timeout_ms=body.transaction_timeout_ms,
                                    producer_id=body.producer_id, producer_epoch=body.producer_epoch)


def init_producer_id_from_kafka(resp: Any, version: int) -> m.Body:
    r = cast(km.InitProducerIdResponse, resp)
    if r.error_code != Errors.NONE:  # no id: the flat answer's -1s, not Kafka's default epoch 0
        return m.InitProducerIdResponse(error_code=r.error_code)
    return m.InitProducerIdResponse(error_code=r.error_code, producer_id=r.producer_id,
                                    producer_epoch=r.producer_epoch)


# ----------------------------------------------------------- DescribeQuorum
def describe_quorum_to_kafka(body: m.DescribeQuorumRequest) -> km.DescribeQuorumRequest:
    return km.DescribeQuorumRequest(topics=[km.DescribeQuorumRequestTopicData(
        topic_name=METADATA_TOPIC, partitions=[km.DescribeQuorumRequestPartitionData(
            partition_index=METADATA_PARTITION)])])


def _replica(r: km.DescribeQuorumResponseReplicaState) -> m.ReplicaState:
    return m.ReplicaState(replica_id=r.replica_id, log_end_offset=r.log_end_offset,
                          last_fetch_timestamp_ms=r.last_fetch_timestamp,
                          last_caught_up_timestamp_ms=r.last_caught_up_timestamp,
                          replica_directory_id=dir_from_kafka(r.replica_directory_id))


def describe_quorum_from_kafka(resp: Any, version: int) -> m.Body:
    r = cast(km.DescribeQuorumResponse, resp)
    if r.error_code != Errors.NONE:
        return m.DescribeQuorumResponse(error_code=r.error_code, error_message=r.error_message)
    part = _ours(r.topics, lambda t: t.topic_name, lambda t: t.partitions, lambda p: p.partition_index)
    if part is None:
        raise _missing("DescribeQuorum")
    p = cast(km.DescribeQuorumResponsePartitionData, part)
    return m.DescribeQuorumResponse(
        error_code=error_of(r.error_code, p.error_code), error_message=p.error_message, leader_id=p.leader_id,
        leader_epoch=p.leader_epoch, high_watermark=p.high_watermark,
        voters=[_replica(v) for v in p.current_voters], observers=[_replica(o) for o in p.observers],
        nodes=[m.DescribeQuorumNode(n.node_id, [m.RaftListener(ln.name, ln.host, ln.port) for ln in n.listeners])
               for n in r.nodes])


# ------------------------------------------ AddRaftVoter, RemoveRaftVoter, UpdateFeatures
def add_voter_to_kafka(body: m.AddRaftVoterRequest) -> km.AddRaftVoterRequest:
    return km.AddRaftVoterRequest(
        cluster_id=body.cluster_id, timeout_ms=body.timeout_ms, voter_id=body.voter_id,
        voter_directory_id=dir_to_kafka(body.voter_directory_id),
        listeners=[km.AddRaftVoterRequestListener(name=ln.name, host=ln.host, port=ln.port) for ln in body.listeners])


def add_voter_from_kafka(resp: Any, version: int) -> m.Body:
    r = cast(km.AddRaftVoterResponse, resp)
    return m.AddRaftVoterResponse(error_code=r.error_code, error_message=r.error_message)


def remove_voter_to_kafka(body: m.RemoveRaftVoterRequest) -> km.RemoveRaftVoterRequest:
    return km.RemoveRaftVoterRequest(cluster_id=body.cluster_id, voter_id=body.voter_id,
                                     voter_directory_id=dir_to_kafka(body.voter_directory_id))


def remove_voter_from_kafka(resp: Any, version: int) -> m.Body:
    r = cast(km.RemoveRaftVoterResponse, resp)
    return m.RemoveRaftVoterResponse(error_code=r.error_code, error_message=r.error_message)


def update_features_to_kafka(body: m.UpdateFeaturesRequest) -> km.UpdateFeaturesRequest:
    return km.UpdateFeaturesRequest(timeout_ms=body.timeout_ms, validate_only=body.validate_only, feature_updates=[
        km.UpdateFeaturesRequestFeatureUpdateKey(feature=u.feature, max_version_level=u.max_version_level,
                                                 upgrade_type=u.upgrade_type) for u in body.feature_updates])


def update_features_from_kafka(resp: Any, version: int) -> m.Body:
    r = cast(km.UpdateFeaturesResponse, resp)
    results = [m.UpdatableFeatureResult(x.feature, x.error_code, x.error_message) for x in r.results]
    failed = next((x for x in results if x.error_code != Errors.NONE), None)
    if r.error_code != Errors.NONE or failed is None:
        return m.UpdateFeaturesResponse(error_code=r.error_code, error_message=r.error_message, results=results)
    return m.UpdateFeaturesResponse(error_code=failed.error_code, error_message=failed.error_message,
                                    results=results)


# ------------------------------------------------- metalog's extensions (schemas_metalog/)
def controller_command_to_kafka(body: m.ControllerCommandRequest) -> km.ControllerCommandRequest:
    return km.ControllerCommandRequest(cluster_id=body.cluster_id, command=body.command,
                                       args=json.dumps(body.args, separators=(",", ":")),
                                       timeout_ms=body.timeout_ms)


def controller_command_from_kafka(resp: Any, version: int) -> m.Body:
    r = cast(km.ControllerCommandResponse, resp)
    try:
        result = None if r.result is None else json.loads(r.result)
    except ValueError as exc:
        raise ResponseDecodeError(f"ControllerCommand result is not JSON: {exc}") from None
    leader = r.current_leader
    return m.ControllerCommandResponse(error_code=r.error_code, error_message=r.error_message,
                                       base_offset=r.base_offset, leader_epoch=r.leader_epoch,
                                       current_leader=_leader_or_none(leader.leader_id, leader.leader_epoch),
                                       result=result)


def consistency_check_to_kafka(body: m.ConsistencyCheckRequest) -> km.ConsistencyCheckRequest:
    return km.ConsistencyCheckRequest(cluster_id=body.cluster_id, leader_id=body.leader_id,
                                      leader_epoch=body.leader_epoch, start_offset=body.start_offset,
                                      end_offset=body.end_offset, chunks=body.chunks)


def consistency_check_from_kafka(resp: Any, version: int) -> m.Body:
    r = cast(km.ConsistencyCheckResponse, resp)
    return m.ConsistencyCheckResponse(
        error_code=r.error_code, error_message=r.error_message, start_offset=r.start_offset,
        end_offset=r.end_offset,
        chunks=[m.ConsistencyChunk(c.start_offset, c.end_offset, c.digest) for c in r.chunks])


_edge(m.ApiVersionsRequest, 18, API_VERSIONS_VERSION, api_versions_to_kafka, api_versions_from_kafka)
_edge(m.MetadataRequest, 3, METADATA_VERSION, metadata_to_kafka, metadata_from_kafka)
_edge(m.ProduceRequest, 0, PRODUCE_VERSION, produce_to_kafka, produce_from_kafka)
_edge(m.ListOffsetsRequest, 2, LIST_OFFSETS_VERSION, list_offsets_to_kafka, list_offsets_from_kafka)
_edge(m.InitProducerIdRequest, 22, INIT_PRODUCER_ID_VERSION, init_producer_id_to_kafka, init_producer_id_from_kafka)
_edge(m.DescribeQuorumRequest, 55, DESCRIBE_QUORUM_VERSION, describe_quorum_to_kafka, describe_quorum_from_kafka)
_edge(m.AddRaftVoterRequest, 80, ADD_RAFT_VOTER_VERSION, add_voter_to_kafka, add_voter_from_kafka)
_edge(m.RemoveRaftVoterRequest, 81, REMOVE_RAFT_VOTER_VERSION, remove_voter_to_kafka, remove_voter_from_kafka)
_edge(m.UpdateFeaturesRequest, 57, UPDATE_FEATURES_VERSION, update_features_to_kafka, update_features_from_kafka)
_edge(m.ControllerCommandRequest, 1000, CONTROLLER_COMMAND_VERSION, controller_command_to_kafka,
      controller_command_from_kafka)
_edge(m.ConsistencyCheckRequest, 1001, CONSISTENCY_CHECK_VERSION, consistency_check_to_kafka,
      consistency_check_from_kafka)
