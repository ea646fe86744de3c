"""The quorum's peer apis at the sending edge: flat bodies <-> Kafka's messages.

Registers, with ``metalog.protocol.kafka.edge``, how each flat request of
the peers (and the consumer's Fetch) travels in Kafka's protocol, with
Kafka's field semantics (KIP-595, KIP-630, KIP-853, KIP-996), so that the
bytes are the ones a Kafka controller sends and reads:

* Vote v2: ``VoterId`` (top level) and ``VoterDirectoryId`` name the voter
  addressed, ``ReplicaId``/``ReplicaDirectoryId`` the candidate,
  ``PreVote`` KIP-996's. A pre-vote's ``ReplicaEpoch`` is the prospective
  candidate's *current* epoch (Kafka does not bump it before a pre-vote);
  our flat ``candidate_epoch`` names the epoch it would stand in (current +
  1): the edge subtracts one on the way out, the server adds it back.
* BeginQuorumEpoch v1: ``VoterId``/``VoterDirectoryId`` and the leader's
  ``LeaderEndpoints``.
* EndQuorumEpoch v1: ``PreferredCandidates`` (id + directory id; our flat
  body has ids only: their directory ids travel as the zero Uuid, Kafka's
  "unknown") and ``LeaderEndpoints`` (empty: the flat body has none; Kafka
  then takes the leader's listeners from its voter set).
* Fetch v17, for replicas and consumers alike (one flat type): replica id in
  ``ReplicaState`` (ReplicaEpoch -1, as Kafka's raft client sends it),
  ``ReplicaDirectoryId``, ``LastFetchedEpoch``; the metadata topic by its
  fixed id; sessionless (SessionId 0, SessionEpoch -1). ``MinBytes`` 1 so
  that a consumer's ``max_wait_ms`` is a long poll (a raft leader ignores
  MinBytes). The answer's ``DivergingEpoch``, ``SnapshotId`` and
  ``CurrentLeader`` are absent when both their fields are -1 (Kafka's test,
  KafkaRaftClient), ``None`` in the flat body. Records are a ``memoryview``
  slice of the response frame: never copied here.
* FetchSnapshot v1 (``ReplicaDirectoryId``), OffsetForLeaderEpoch v4 (v3+:
  ``ReplicaId``), UpdateRaftVoter v0.

Directory ids: flat bodies carry Kafka's text form (22 characters of
base64url), "" for the zero Uuid; on the wire they are 16 bytes. The mapping
is lossless both ways (``dir_to_kafka``/``dir_from_kafka``, used by the
serving side too). Errors: Kafka answers some errors at the top level (the
request as a whole: cluster id, authorization, shutdown, a bad request) and
the rest per partition; the flat body has one ``error_code``. The sender
reads the top level first, then the partition; the server puts a code of
``TOP_LEVEL_ERRORS`` at the top level (and still sends the partition with
its leader fields, so nothing is lost).
"""

from __future__ import annotations

from typing import Any, Final, cast

from metalog.protocol import messages as m
from metalog.protocol.errors import Errors
from metalog.protocol.kafka import messages as km
from metalog.protocol.kafka.edge import Edge, ResponseDecodeError, register
from metalog.protocol.kafka.primitives import ZERO_UUID, uuid_from_str, uuid_to_str

METADATA_TOPIC: Final = "__cluster_metadata"
METADATA_TOPIC_ID: Final = bytes(15) + b"\x01"  # Kafka's Uuid.METADATA_TOPIC_ID
METADATA_PARTITION: Final = 0

VOTE_VERSION: Final = 2
BEGIN_QUORUM_EPOCH_VERSION: Final = 1
END_QUORUM_EPOCH_VERSION: Final = 1
FETCH_VERSION: Final = 17
FETCH_SNAPSHOT_VERSION: Final = 1
OFFSET_FOR_LEADER_EPOCH_VERSION: Final = 4
UPDATE_RAFT_VOTER_VERSION: Final = 0

# Errors about the request as a whole: Kafka's top-level error code.
TOP_LEVEL_ERRORS: Final = frozenset({
    Errors.INCONSISTENT_CLUSTER_ID, Errors.CLUSTER_AUTHORIZATION_FAILED, Errors.BROKER_NOT_AVAILABLE,
    Errors.INVALID_REQUEST, Errors.UNSUPPORTED_VERSION, Errors.UNKNOWN_SERVER_ERROR, Errors.KAFKA_STORAGE_ERROR,
})


def dir_to_kafka(directory_id: str) -> bytes:
    """A flat directory id as Kafka's 16 bytes ("" is the zero Uuid)."""
    return ZERO_UUID if directory_id == m.NO_DIRECTORY_ID else uuid_from_str(directory_id)


def dir_from_kafka(raw: bytes) -> str:
    return m.NO_DIRECTORY_ID if raw == ZERO_UUID else uuid_to_str(raw)


def pre_vote_epoch_to_kafka(candidate_epoch: int, pre_vote: bool) -> int:
    """Kafka's ReplicaEpoch of a flat Vote (see the module docstring)."""
    return candidate_epoch - 1 if pre_vote else candidate_epoch


def pre_vote_epoch_from_kafka(replica_epoch: int, pre_vote: bool) -> int:
    return replica_epoch + 1 if pre_vote else replica_epoch


def error_of(top_level: int, partition: int | None) -> int:
    """The flat error code of a Kafka answer."""
    return top_level if top_level != Errors.NONE else (partition if partition is not None else Errors.NONE)


def _only(items: list[Any], what: str) -> Any:
    """The one topic or partition of an answer about our log; None if there is none."""
    if not items:
        return None
    if len(items) != 1:
        raise ResponseDecodeError(f"{what}: {len(items)} entries where one (the metadata log) was asked")
    return items[0]


def _partition(top_error: int, topics: list[Any], what: str) -> Any:
    """The answer's one partition, or None when a top-level error stands alone."""
    topic = _only(topics, what)
    part = None if topic is None else _only(topic.partitions, what)
    if part is None and top_error == Errors.NONE:
        raise ResponseDecodeError(f"{what}: no partition and no error")
    return part


def _leader_or_none(leader_id: int, leader_epoch: int) -> m.LeaderIdAndEpoch | None:
    return None if leader_id == -1 and leader_epoch == -1 else m.LeaderIdAndEpoch(leader_id, leader_epoch)


# --------------------------------------------------------------------- Vote
def vote_to_kafka(body: m.Body) -> km.VoteRequest:
    b = cast(m.VoteRequest, body)
    return km.VoteRequest(cluster_id=b.cluster_id, voter_id=b.voter_id, topics=[km.VoteRequestTopicData(
        topic_name=METADATA_TOPIC, partitions=[km.VoteRequestPartitionData(
            partition_index=METADATA_PARTITION,
            replica_epoch=pre_vote_epoch_to_kafka(b.candidate_epoch, b.pre_vote),
            replica_id=b.candidate_id, replica_directory_id=dir_to_kafka(b.candidate_directory_id),
            voter_directory_id=dir_to_kafka(b.voter_directory_id),
            last_offset_epoch=b.last_offset_epoch, last_offset=b.last_offset, pre_vote=b.pre_vote)])])


def vote_from_kafka(resp: Any, version: int) -> m.Body:
    r = cast(km.VoteResponse, resp)
    p = _partition(r.error_code, r.topics, "VoteResponse")
    if p is None:
        return m.VoteResponse(error_code=r.error_code)
    return m.VoteResponse(error_code=error_of(r.error_code, p.error_code), leader_id=p.leader_id,
                          leader_epoch=p.leader_epoch, vote_granted=p.vote_granted)


# --------------------------------------------------------- BeginQuorumEpoch
def begin_to_kafka(body: m.Body) -> km.BeginQuorumEpochRequest:
    b = cast(m.BeginQuorumEpochRequest, body)
    return km.BeginQuorumEpochRequest(
        cluster_id=b.cluster_id, voter_id=b.voter_id,
        topics=[km.BeginQuorumEpochRequestTopicData(topic_name=METADATA_TOPIC, partitions=[
            km.BeginQuorumEpochRequestPartitionData(
                partition_index=METADATA_PARTITION, voter_directory_id=dir_to_kafka(b.voter_directory_id),
                leader_id=b.leader_id, leader_epoch=b.leader_epoch)])],
        leader_endpoints=[km.BeginQuorumEpochRequestLeaderEndpoint(name=ln.name, host=ln.host, port=ln.port)
                          for ln in b.leader_endpoints])


def begin_from_kafka(resp: Any, version: int) -> m.Body:
    r = cast(km.BeginQuorumEpochResponse, resp)
    p = _partition(r.error_code, r.topics, "BeginQuorumEpochResponse")
    if p is None:
        return m.BeginQuorumEpochResponse(error_code=r.error_code)
    return m.BeginQuorumEpochResponse(error_code=error_of(r.error_code, p.error_code), leader_id=p.leader_id,
                                      leader_epoch=p.leader_epoch)


# ----------------------------------------------------------- EndQuorumEpoch
def end_to_kafka(body: m.Body) -> km.EndQuorumEpochRequest:
    b = cast(m.EndQuorumEpochRequest, body)
    return km.EndQuorumEpochRequest(cluster_id=b.cluster_id, topics=[km.EndQuorumEpochRequestTopicData(
        topic_name=METADATA_TOPIC, partitions=[km.EndQuorumEpochRequestPartitionData(
            partition_index=METADATA_PARTITION, leader_id=b.leader_id, leader_epoch=b.leader_epoch,
            preferred_candidates=[km.EndQuorumEpochRequestReplicaInfo(candidate_id=c)
                                  for c in b.preferred_successors])])])


def end_from_kafka(resp: Any, version: int) -> m.Body:
    r = cast(km.EndQuorumEpochResponse, resp)
    p = _partition(r.error_code, r.topics, "EndQuorumEpochResponse")
    if p is None:
        return m.EndQuorumEpochResponse(error_code=r.error_code)
    return m.EndQuorumEpochResponse(error_code=error_of(r.error_code, p.error_code), leader_id=p.leader_id,
                                    leader_epoch=p.leader_epoch)


# -------------------------------------------------------------------- Fetch
def fetch_to_kafka(body: m.Body) -> km.FetchRequest:
    b = cast(m.FetchRequest, body)
    return km.FetchRequest(
        cluster_id=b.cluster_id, replica_state=km.FetchRequestReplicaState(replica_id=b.replica_id),
        max_wait_ms=b.max_wait_ms, min_bytes=1, max_bytes=b.max_bytes,
        topics=[km.FetchRequestFetchTopic(topic=METADATA_TOPIC, topic_id=METADATA_TOPIC_ID, partitions=[
            km.FetchRequestFetchPartition(
                partition=METADATA_PARTITION, current_leader_epoch=b.current_leader_epoch,
                fetch_offset=b.fetch_offset, last_fetched_epoch=b.last_fetched_epoch,
                log_start_offset=b.log_start_offset, partition_max_bytes=b.max_bytes,
                replica_directory_id=dir_to_kafka(b.replica_directory_id))])])


def fetch_from_kafka(resp: Any, version: int) -> m.Body:
    r = cast(km.FetchResponse, resp)
    p = _partition(r.error_code, r.responses, "FetchResponse")
    if p is None:
        return m.FetchResponse(error_code=r.error_code)
    div, leader, snap = p.diverging_epoch, p.current_leader, p.snapshot_id
    records = p.records if p.records is not None else b""
    return m.FetchResponse(
        error_code=error_of(r.error_code, p.error_code), high_watermark=p.high_watermark,
        log_start_offset=p.log_start_offset,
        records=cast(bytes, records),  # a read-only memoryview slice of the frame: no copy
        diverging_epoch=None if div.epoch == -1 and div.end_offset == -1 else m.EpochEndOffset(div.epoch,
                                                                                                div.end_offset),
        current_leader=_leader_or_none(leader.leader_id, leader.leader_epoch),
        snapshot_id=None if snap.epoch == -1 and snap.end_offset == -1 else m.SnapshotId(snap.end_offset, snap.epoch))


# ------------------------------------------------------------ FetchSnapshot
def fetch_snapshot_to_kafka(body: m.Body) -> km.FetchSnapshotRequest:
    b = cast(m.FetchSnapshotRequest, body)
    return km.FetchSnapshotRequest(
        cluster_id=b.cluster_id, replica_id=b.replica_id, max_bytes=b.max_bytes,
        topics=[km.FetchSnapshotRequestTopicSnapshot(name=METADATA_TOPIC, partitions=[
            km.FetchSnapshotRequestPartitionSnapshot(
                partition=METADATA_PARTITION, current_leader_epoch=b.current_leader_epoch,
                snapshot_id=km.FetchSnapshotRequestSnapshotId(end_offset=b.snapshot_id.end_offset,
                                                              epoch=b.snapshot_id.epoch),
                position=b.position, replica_directory_id=dir_to_kafka(b.replica_directory_id))])])


# FetchSnapshot's tagged CurrentLeader has no default in Kafka's schema
# (zeros): "absent" is that default here, a leader never elected at epoch 0.
_NO_SNAPSHOT_LEADER: Final = km.FetchSnapshotResponseLeaderIdAndEpoch()


def fetch_snapshot_from_kafka(resp: Any, version: int) -> m.Body:
    r = cast(km.FetchSnapshotResponse, resp)
    p = _partition(r.error_code, r.topics, "FetchSnapshotResponse")
    if p is None:
        return m.FetchSnapshotResponse(error_code=r.error_code)
    snap, leader = p.snapshot_id, p.current_leader
    return m.FetchSnapshotResponse(
        error_code=error_of(r.error_code, p.error_code),
        snapshot_id=None if snap.end_offset < 0 and snap.epoch < 0 else m.SnapshotId(snap.end_offset, snap.epoch),
        size=p.size, position=p.position,
        unaligned_records=cast(bytes, p.unaligned_records),  # a memoryview slice of the frame: no copy
        current_leader=None if leader == _NO_SNAPSHOT_LEADER else m.LeaderIdAndEpoch(leader.leader_id,
                                                                                      leader.leader_epoch))


# ----------------------------------------------------- OffsetForLeaderEpoch
def epoch_to_kafka(body: m.Body) -> km.OffsetForLeaderEpochRequest:
    b = cast(m.OffsetsForLeaderEpochRequest, body)
    return km.OffsetForLeaderEpochRequest(
        replica_id=b.replica_id,
        topics=[km.OffsetForLeaderEpochRequestOffsetForLeaderTopic(topic=METADATA_TOPIC, partitions=[
            km.OffsetForLeaderEpochRequestOffsetForLeaderPartition(
                partition=METADATA_PARTITION, current_leader_epoch=b.current_leader_epoch,
                leader_epoch=b.leader_epoch)])])


def epoch_from_kafka(resp: Any, version: int) -> m.Body:
    r = cast(km.OffsetForLeaderEpochResponse, resp)
    topic = _only(r.topics, "OffsetForLeaderEpochResponse")
    p = None if topic is None else _only(topic.partitions, "OffsetForLeaderEpochResponse")
    if p is None:
        raise ResponseDecodeError("OffsetForLeaderEpochResponse: no partition")
    return m.OffsetsForLeaderEpochResponse(error_code=p.error_code, leader_epoch=p.leader_epoch,
                                           end_offset=p.end_offset)


# ---------------------------------------------------------- UpdateRaftVoter
def update_voter_to_kafka(body: m.Body) -> km.UpdateRaftVoterRequest:
    b = cast(m.UpdateRaftVoterRequest, body)
    return km.UpdateRaftVoterRequest(
        cluster_id=b.cluster_id, current_leader_epoch=b.current_leader_epoch, voter_id=b.voter_id,
        voter_directory_id=dir_to_kafka(b.voter_directory_id),
        listeners=[km.UpdateRaftVoterRequestListener(name=ln.name, host=ln.host, port=ln.port)
                   for ln in b.listeners],
        k_raft_version_feature=km.UpdateRaftVoterRequestKRaftVersionFeature(
            min_supported_version=b.kraft_version_min, max_supported_version=b.kraft_version_max))


def update_voter_from_kafka(resp: Any, version: int) -> m.Body:
    r = cast(km.UpdateRaftVoterResponse, resp)
    leader = r.current_leader
    return m.UpdateRaftVoterResponse(error_code=r.error_code,
                                     current_leader=_leader_or_none(leader.leader_id, leader.leader_epoch))


register(m.VoteRequest, Edge(52, VOTE_VERSION, vote_to_kafka, vote_from_kafka))
register(m.BeginQuorumEpochRequest, Edge(53, BEGIN_QUORUM_EPOCH_VERSION, begin_to_kafka, begin_from_kafka))
register(m.EndQuorumEpochRequest, Edge(54, END_QUORUM_EPOCH_VERSION, end_to_kafka, end_from_kafka))
register(m.FetchRequest, Edge(1, FETCH_VERSION, fetch_to_kafka, fetch_from_kafka))
register(m.FetchSnapshotRequest, Edge(59, FETCH_SNAPSHOT_VERSION, fetch_snapshot_to_kafka, fetch_snapshot_from_kafka))
register(m.OffsetsForLeaderEpochRequest, Edge(23, OFFSET_FOR_LEADER_EPOCH_VERSION, epoch_to_kafka, epoch_from_kafka))
register(m.UpdateRaftVoterRequest, Edge(82, UPDATE_RAFT_VOTER_VERSION, update_voter_to_kafka, update_voter_from_kafka))
