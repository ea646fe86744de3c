"""The quorum's peer apis in Kafka's protocol, served (issue 32 item 2).

Vote v0-2, BeginQuorumEpoch v0-1, EndQuorumEpoch v0-1, FetchSnapshot v0-1
and UpdateRaftVoter v0 from a peer are mapped onto our flat bodies and asked
of the broker's ``RequestRouter`` (``KafkaContext.ask``) as every request
is: the same refusals, the same authorization gate -- a
replica's request only from a node certificate of that node id (the
replica-identity binding), Vote/BeginQuorumEpoch/EndQuorumEpoch only from a
voter -- and the same core. A replica's Fetch (ReplicaState.ReplicaId >= 0)
and OffsetForLeaderEpoch come through ``data.py``'s handlers, which call
``replica_fetch`` here. The sending side's mapping, the reverse of this one,
is ``metalog.protocol.kafka.edge_quorum`` (the field semantics are described
there: a pre-vote's ReplicaEpoch, directory ids, top-level errors).

Kafka's own checks at the edge, before anything is asked: a request that
does not name exactly ``__cluster_metadata`` partition 0 is INVALID_REQUEST
at the top level, as KafkaRaftClient answers it (``hasValidTopicPartition``);
a null ClusterId is taken as ours (Kafka accepts it from old peers), any
other is checked by the core (INCONSISTENT_CLUSTER_ID). Answers name the
leader's endpoint on this listener (NodeEndpoints, v1+) when there is one.
"""

from __future__ import annotations

from typing import Any, Callable

from metalog.broker.net.kafka_conn import KafkaExchange
from metalog.broker.server.kafka.api import METADATA_PARTITION, METADATA_TOPIC, KafkaApi, KafkaContext
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.protocol.errors import Errors
from metalog.protocol.kafka import messages as km
from metalog.protocol.kafka.edge_quorum import TOP_LEVEL_ERRORS, dir_from_kafka, pre_vote_epoch_from_kafka


def split_error(code: int) -> tuple[int, int]:
    """A flat error code as Kafka's (top level, partition)."""
    return (code, Errors.NONE) if code in TOP_LEVEL_ERRORS else (Errors.NONE, code)


def _one(topics: list[Any], name_of: Callable[[Any], str], index_of: Callable[[Any], int]) -> Any:
    """The request's one partition, if it is exactly our log's; else None."""
    if len(topics) != 1 or name_of(topics[0]) != METADATA_TOPIC or len(topics[0].partitions) != 1:
        return None
    part = topics[0].partitions[0]
    return part if index_of(part) == METADATA_PARTITION else None


def _cluster(ctx: KafkaContext, cluster_id: str | None) -> str:
    return ctx.cluster_id if cluster_id is None else cluster_id


def _leader_endpoints(ctx: KafkaContext, leader_id: int, make: Callable[..., Any]) -> list[Any]:
    ep = ctx.endpoints().get(leader_id) if leader_id >= 0 else None
    return [] if ep is None else [make(node_id=leader_id, host=ep[0], port=ep[1])]


def _code(resp: Any) -> int:
    return int(getattr(resp, "error_code", Errors.UNKNOWN_SERVER_ERROR))


# --------------------------------------------------------------------- Vote
def vote(ctx: KafkaContext, ex: KafkaExchange) -> None:
    req = ex.body
    p = _one(req.topics, lambda t: t.topic_name, lambda p: p.partition_index)
    if p is None:
        ex.respond(km.VoteResponse(error_code=Errors.INVALID_REQUEST))
        return
    body = m.VoteRequest(
        cluster_id=_cluster(ctx, req.cluster_id), candidate_epoch=pre_vote_epoch_from_kafka(p.replica_epoch, p.pre_vote),
        candidate_id=p.replica_id, last_offset_epoch=p.last_offset_epoch, last_offset=p.last_offset,
        pre_vote=p.pre_vote, candidate_directory_id=dir_from_kafka(p.replica_directory_id), voter_id=req.voter_id,
        voter_directory_id=dir_from_kafka(p.voter_directory_id))

    def answer(resp: Any) -> None:
        top, part = split_error(_code(resp))
        leader_id, epoch = getattr(resp, "leader_id", m.NO_LEADER), getattr(resp, "leader_epoch", m.NO_EPOCH)
        out = km.VoteResponse(error_code=top, topics=[km.VoteResponseTopicData(
            topic_name=METADATA_TOPIC, partitions=[km.VoteResponsePartitionData(
                partition_index=METADATA_PARTITION, error_code=part, leader_id=leader_id, leader_epoch=epoch,
                vote_granted=bool(getattr(resp, "vote_granted", False)))])])
        if ex.version >= 1:
            out.node_endpoints = _leader_endpoints(ctx, leader_id, km.VoteResponseNodeEndpoint)
        ex.respond(out)

    ctx.ask(ex, ApiKey.VOTE, body, answer)


# --------------------------------------------------------- BeginQuorumEpoch
def begin_quorum_epoch(ctx: KafkaContext, ex: KafkaExchange) -> None:
    req = ex.body
    p = _one(req.topics, lambda t: t.topic_name, lambda p: p.partition_index)
    if p is None:
        ex.respond(km.BeginQuorumEpochResponse(error_code=Errors.INVALID_REQUEST))
        return
    body = m.BeginQuorumEpochRequest(
        cluster_id=_cluster(ctx, req.cluster_id), leader_id=p.leader_id, leader_epoch=p.leader_epoch,
        voter_id=req.voter_id, voter_directory_id=dir_from_kafka(p.voter_directory_id),
        leader_endpoints=[m.RaftListener(ln.name, ln.host, ln.port) for ln in req.leader_endpoints])

    def answer(resp: Any) -> None:
        top, part = split_error(_code(resp))
        leader_id, epoch = getattr(resp, "leader_id", m.NO_LEADER), getattr(resp, "leader_epoch", m.NO_EPOCH)
        out = km.BeginQuorumEpochResponse(error_code=top, topics=[km.BeginQuorumEpochResponseTopicData(
            topic_name=METADATA_TOPIC, partitions=[km.BeginQuorumEpochResponsePartitionData(
                partition_index=METADATA_PARTITION, error_code=part, leader_id=leader_id, leader_epoch=epoch)])])
        if ex.version >= 1:
            out.node_endpoints = _leader_endpoints(ctx, leader_id, km.BeginQuorumEpochResponseNodeEndpoint)
        ex.respond(out)

    ctx.ask(ex, ApiKey.BEGIN_QUORUM_EPOCH, body, answer)


# ----------------------------------------------------------- EndQuorumEpoch
def end_quorum_epoch(ctx: KafkaContext, ex: KafkaExchange) -> None:
    req = ex.body
    p = _one(req.topics, lambda t: t.topic_name, lambda p: p.partition_index)
    if p is None:
        ex.respond(km.EndQuorumEpochResponse(error_code=Errors.INVALID_REQUEST))
        return
    # v0 names the successors by id, v1 by id and directory id (ours are ids only).
    successors = (list(p.preferred_successors) if ex.version == 0
                  else [c.candidate_id for c in p.preferred_candidates])
    body = m.EndQuorumEpochRequest(cluster_id=_cluster(ctx, req.cluster_id), leader_id=p.leader_id,
                                   leader_epoch=p.leader_epoch, preferred_successors=successors)

    def answer(resp: Any) -> None:
        top, part = split_error(_code(resp))
        leader_id, epoch = getattr(resp, "leader_id", m.NO_LEADER), getattr(resp, "leader_epoch", m.NO_EPOCH)
        out = km.EndQuorumEpochResponse(error_code=top, topics=[km.EndQuorumEpochResponseTopicData(
            topic_name=METADATA_TOPIC, partitions=[km.EndQuorumEpochResponsePartitionData(
                partition_index=METADATA_PARTITION, error_code=part, leader_id=leader_id, leader_epoch=epoch)])])
        if ex.version >= 1:
            out.node_endpoints = _leader_endpoints(ctx, leader_id, km.EndQuorumEpochResponseNodeEndpoint)
        ex.respond(out)

    ctx.ask(ex, ApiKey.END_QUORUM_EPOCH, body, answer)


# ----------------------------------------------------- Fetch of a replica
def replica_fetch_body(ctx: KafkaContext, req: Any, p: Any, replica_id: int, version: int) -> m.FetchRequest:
    """A replica's Fetch (data.py's handler routes ReplicaId >= 0 here):
    raft's long poll is MaxWaitMs whatever MinBytes says, as Kafka's leader
    waits (KafkaRaftClient), and the replica's cluster id is checked."""
    return m.FetchRequest(
        cluster_id=_cluster(ctx, req.cluster_id if version >= 12 else None), replica_id=replica_id,
        max_wait_ms=max(req.max_wait_ms, 0), current_leader_epoch=p.current_leader_epoch,
        fetch_offset=p.fetch_offset, last_fetched_epoch=p.last_fetched_epoch if version >= 12 else m.NO_EPOCH,
        log_start_offset=p.log_start_offset, max_bytes=max(1, min(p.partition_max_bytes, req.max_bytes)),
        replica_directory_id=dir_from_kafka(p.replica_directory_id) if version >= 17 else m.NO_DIRECTORY_ID)


def replica_fetch_fill(slot: km.FetchResponsePartitionData, version: int,
                       leaders: dict[int, m.LeaderIdAndEpoch] | None = None) -> Callable[[Any], None]:
    """Fills a replica's partition from our answer: records as the log holds
    them (not copied), DivergingEpoch, SnapshotId and CurrentLeader as Kafka's
    raft leader answers them (absent: both fields -1). A leader it names goes
    into `leaders`, for the response's NodeEndpoints: a Kafka observer that
    bootstrapped from a follower knows no voter, and its raft client dies on a
    leader id without an endpoint ("Unknown leader endpoints")."""
    def fill(resp: Any) -> None:
        slot.error_code = _code(resp)
        if not isinstance(resp, m.FetchResponse):
            return
        slot.high_watermark = resp.high_watermark
        slot.last_stable_offset = resp.high_watermark
        slot.log_start_offset = resp.log_start_offset
        slot.records = resp.records
        if version >= 12:
            if resp.diverging_epoch is not None:
                slot.diverging_epoch = km.FetchResponseEpochEndOffset(epoch=resp.diverging_epoch.epoch,
                                                                      end_offset=resp.diverging_epoch.end_offset)
            if resp.current_leader is not None:
                slot.current_leader = km.FetchResponseLeaderIdAndEpoch(
                    leader_id=resp.current_leader.leader_id, leader_epoch=resp.current_leader.leader_epoch)
                if leaders is not None and resp.current_leader.leader_id >= 0:
                    leaders[resp.current_leader.leader_id] = resp.current_leader
            if resp.snapshot_id is not None:
                slot.snapshot_id = km.FetchResponseSnapshotId(end_offset=resp.snapshot_id.end_offset,
                                                              epoch=resp.snapshot_id.epoch)

    return fill


# ------------------------------------------------------------ FetchSnapshot
def fetch_snapshot(ctx: KafkaContext, ex: KafkaExchange) -> None:
    req = ex.body
    p = _one(req.topics, lambda t: t.name, lambda p: p.partition)
    if p is None:
        ex.respond(km.FetchSnapshotResponse(error_code=Errors.INVALID_REQUEST))
        return
    body = m.FetchSnapshotRequest(
        cluster_id=_cluster(ctx, req.cluster_id), replica_id=req.replica_id,
        current_leader_epoch=p.current_leader_epoch,
        snapshot_id=m.SnapshotId(p.snapshot_id.end_offset, p.snapshot_id.epoch), position=p.position,
        max_bytes=max(1, req.max_bytes), replica_directory_id=dir_from_kafka(p.replica_directory_id))

    def answer(resp: Any) -> None:
        top, code = split_error(_code(resp))
        part = km.FetchSnapshotResponsePartitionSnapshot(index=METADATA_PARTITION, error_code=code,
                                                         snapshot_id=km.FetchSnapshotResponseSnapshotId(
                                                             end_offset=-1, epoch=-1))
        out = km.FetchSnapshotResponse(error_code=top, topics=[km.FetchSnapshotResponseTopicSnapshot(
            name=METADATA_TOPIC, partitions=[part])])
        if isinstance(resp, m.FetchSnapshotResponse):
            if resp.snapshot_id is not None:
                part.snapshot_id = km.FetchSnapshotResponseSnapshotId(end_offset=resp.snapshot_id.end_offset,
                                                                      epoch=resp.snapshot_id.epoch)
            if resp.current_leader is not None:
                part.current_leader = km.FetchSnapshotResponseLeaderIdAndEpoch(
                    leader_id=resp.current_leader.leader_id, leader_epoch=resp.current_leader.leader_epoch)
                if ex.version >= 1:
                    out.node_endpoints = _leader_endpoints(ctx, resp.current_leader.leader_id,
                                                           km.FetchSnapshotResponseNodeEndpoint)
            part.size, part.position, part.unaligned_records = resp.size, resp.position, resp.unaligned_records
        ex.respond(out)

    ctx.ask(ex, ApiKey.FETCH_SNAPSHOT, body, answer)


# ---------------------------------------------------------- UpdateRaftVoter
def update_raft_voter(ctx: KafkaContext, ex: KafkaExchange) -> None:
    req = ex.body
    feature = req.k_raft_version_feature
    body = m.UpdateRaftVoterRequest(
        cluster_id=req.cluster_id, current_leader_epoch=req.current_leader_epoch, voter_id=req.voter_id,
        voter_directory_id=dir_from_kafka(req.voter_directory_id),
        listeners=[m.RaftListener(ln.name, ln.host, ln.port) for ln in req.listeners],
        kraft_version_min=feature.min_supported_version, kraft_version_max=feature.max_supported_version)

    def answer(resp: Any) -> None:
        out = km.UpdateRaftVoterResponse(error_code=_code(resp))
        leader = getattr(resp, "current_leader", None)
        if leader is not None:
            out.current_leader = km.UpdateRaftVoterResponseCurrentLeader(leader_id=leader.leader_id,
                                                                        leader_epoch=leader.leader_epoch)
            for ep in _leader_endpoints(ctx, leader.leader_id, dict):
                out.current_leader.host, out.current_leader.port = ep["host"], ep["port"]
        ex.respond(out)

    ctx.ask(ex, ApiKey.UPDATE_RAFT_VOTER, body, answer)


def _api(request: Any, lo: int, hi: int, handle: Any) -> KafkaApi:
    return KafkaApi(request, max(lo, request.LOWEST_VERSION), min(hi, request.HIGHEST_VERSION), handle)


APIS: dict[int, KafkaApi] = {
    ApiKey.VOTE: _api(km.VoteRequest, 0, 2, vote),
    ApiKey.BEGIN_QUORUM_EPOCH: _api(km.BeginQuorumEpochRequest, 0, 1, begin_quorum_epoch),
    ApiKey.END_QUORUM_EPOCH: _api(km.EndQuorumEpochRequest, 0, 1, end_quorum_epoch),
    ApiKey.FETCH_SNAPSHOT: _api(km.FetchSnapshotRequest, 0, 1, fetch_snapshot),
    ApiKey.UPDATE_RAFT_VOTER: _api(km.UpdateRaftVoterRequest, 0, 0, update_raft_voter),
}

__all__ = ["APIS", "replica_fetch_body", "replica_fetch_fill", "split_error"]
