"""Inbound requests: the checks every role makes first (the cluster id, the
voter set, Fetch validation, KIP-320 epoch fencing), then the role that
serves the request (the leader's reads, the election answers, the core's
exposure: DescribeQuorum, Metadata, ApiVersions)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from metalog.broker.quorum import election, membership
from metalog.broker.quorum.answers import api_versions_response, check_cluster_id
from metalog.broker.quorum.api import AppendWaiter
from metalog.broker.quorum.leader import LeaderState
from metalog.broker.quorum.leader_reads import LeaderReads, fetch_problem
from metalog.protocol import messages as m
from metalog.protocol.errors import Errors
from metalog.protocol.invariants import InvariantViolation

if TYPE_CHECKING:
    from metalog.broker.quorum.core import QuorumCore

NO_EPOCH = m.NO_EPOCH


def _reads(core: QuorumCore) -> LeaderReads:
    """The leader's reads; only reached once fencing said we lead."""
    st = core.state
    if not isinstance(st, LeaderState):
        raise InvariantViolation(f"serving a leader's read as {st.role}")
    return st.reads


def fence_client(core: QuorumCore, current_leader_epoch: int, sentinel_allowed: bool) -> int:
    """KIP-320: a client that does not know the epoch (NO_EPOCH) is not
    fenced, only sent to the leader; replicas are always fenced."""
    if sentinel_allowed and current_leader_epoch == NO_EPOCH:
        return Errors.NONE if core.state.is_leader else Errors.NOT_LEADER_OR_FOLLOWER
    return fence(core, current_leader_epoch)


def fence(core: QuorumCore, current_leader_epoch: int) -> int:
    """KIP-320 epoch check of a leader-only request; NONE if it may proceed."""
    st = core.state
    if current_leader_epoch < st.epoch:
        return Errors.FENCED_LEADER_EPOCH
    if current_leader_epoch > st.epoch:
        return Errors.UNKNOWN_LEADER_EPOCH
    if not st.is_leader:
        return Errors.NOT_LEADER_OR_FOLLOWER
    return Errors.NONE


def on_request(core: QuorumCore, token: Any, req: m.Body, now_ms: int) -> None:
    """RequestReceived: every request ends in exactly one Respond (maybe later)."""
    wrong_cluster = check_cluster_id(core.config.cluster_id, req, core.current_leader())
    if wrong_cluster is not None:
        core.respond(token, wrong_cluster)
        return
    t = type(req)
    if t is m.FetchRequest:
        handle_fetch(core, token, req, now_ms, completing=False)
        return
    if (t in (m.BeginQuorumEpochRequest, m.EndQuorumEpochRequest) and req.leader_id not in core.voters
            and core.voter_set.kraft_version == 0):
        # Static voters only: with a voter set in the log (KIP-853) our latest
        # set may be an uncommitted one the leader of a newer epoch never had.
        core.respond(token, core.error_response(req, Errors.INCONSISTENT_VOTER_SET))
        return
    if t is m.BeginQuorumEpochRequest and not core.addressed_to_me(req.voter_id, req.voter_directory_id):
        # KIP-853: meant for another directory of this node (the one wiped).
        core.respond(token, core.error_response(req, Errors.INVALID_VOTER_KEY))
        return
    if t is m.VoteRequest:
        election.handle_vote(core, token, req, now_ms)
    elif t is m.BeginQuorumEpochRequest:
        election.handle_begin_epoch(core, token, req, now_ms)
    elif t is m.EndQuorumEpochRequest:
        election.handle_end_epoch(core, token, req, now_ms)
    elif t is m.OffsetsForLeaderEpochRequest:
        code = fence_client(core, req.current_leader_epoch, sentinel_allowed=req.replica_id < 0)
        if code != Errors.NONE:
            core.respond(token, core.error_response(req, code))
        else:
            _reads(core).serve_offsets_for_epoch(token, req)
    elif t is m.FetchSnapshotRequest:
        code = fence(core, req.current_leader_epoch)
        if code != Errors.NONE:
            core.respond(token, core.error_response(req, code))
        else:
            _reads(core).serve_fetch_snapshot(token, req, now_ms)
    elif t is m.ProduceRequest:
        if not req.records:
            core.respond(token, core.error_response(
                req, Errors.INVALID_REQUEST, "a produce request must carry at least one record"))
            return
        core.client_append(now_ms, [AppendWaiter(token, len(req.records))], list(req.records))
    elif t in (m.AddRaftVoterRequest, m.RemoveRaftVoterRequest, m.UpdateRaftVoterRequest):
        membership.handle(core, token, req, now_ms)
    elif t is m.UpdateFeaturesRequest:
        membership.handle_update_features(core, token, req, now_ms)
    elif t is m.DescribeQuorumRequest:
        core.respond(token, core.describe_quorum(now_ms))
    elif t is m.ListOffsetsRequest:
        code = fence_client(core, req.current_leader_epoch, sentinel_allowed=True)
        if code != Errors.NONE:
            core.respond(token, core.error_response(req, code))
        else:
            _reads(core).serve_list_offsets(token, req)
    elif t is m.MetadataRequest:
        core.respond(token, core.metadata())
    elif t is m.ApiVersionsRequest:
        core.respond(token, api_versions_response(*core.finalized_kraft_version()))
    else:
        core.respond(token, m.ErrorResponse(
            error_code=Errors.INVALID_REQUEST, error_message=f"the quorum does not serve {t.__name__}"))


def handle_fetch(core: QuorumCore, token: Any, req: m.FetchRequest, now_ms: int, completing: bool) -> None:
    """A Fetch, new or parked (completing): validated and fenced here, then
    served by the leader."""
    bad = fetch_problem(req, core.node_id)
    if bad is not None:
        core.respond(token, core.error_response(req, Errors.INVALID_REQUEST, bad))
        return
    code = fence_client(core, req.current_leader_epoch, sentinel_allowed=req.replica_id < 0)
    if code != Errors.NONE:
        core.respond(token, core.error_response(req, code))
        return
    _reads(core).serve_fetch(token, req, now_ms, completing)
