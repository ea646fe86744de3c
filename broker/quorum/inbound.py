"""Everything that comes in from the peers, as the core (the owner of the
roles) handles it: the checks every role makes first on a request (the
cluster id, the voter set, Fetch validation, KIP-320 epoch fencing), then who
serves it (the leader's reads, the election requests answered the same way in
every role, the voter changes, the core's exposure: DescribeQuorum, Metadata,
ApiVersions); and the answers to our own requests, and their failures, routed
by request kind to the role that sent them. These functions take the core
itself: they decide transitions, which the roles only ask for."""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

from metalog.broker.quorum import membership
from metalog.broker.quorum.answers import api_versions_response, check_cluster_id
from metalog.broker.quorum.api import AppendWaiter, RequestFailed, ResponseReceived
from metalog.broker.quorum.leader import STAMP, LeaderState
from metalog.broker.quorum.leader_reads import LeaderReads, fetch_problem
from metalog.broker.quorum.outbox import FETCH_LOOP, NOTIFICATIONS, RequestKind
from metalog.protocol import messages as m
from metalog.protocol.errors import Errors
from metalog.protocol.invariants import InvariantViolation
from metalog.storage.batch import HEADER_SIZE, LOG_OVERHEAD, MAGIC

if TYPE_CHECKING:
    from metalog.broker.quorum.core import QuorumCore

NO_EPOCH = m.NO_EPOCH
NO_LEADER = m.NO_LEADER


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
    if isinstance(req, m.FetchRequest):  # the hot path first
        handle_fetch(core, token, req, now_ms, completing=False)
        return
    me = core.electorate
    if (isinstance(req, (m.BeginQuorumEpochRequest, m.EndQuorumEpochRequest)) and req.leader_id not in me.voters
            and me.voter_set.kraft_version == 0):
        # Static voters only: with a voter set in the log (KIP-853) our latest
        # set may be an uncommitted one the leader of a newer epoch never had.
        core.respond(token, core.error_response(req, Errors.INCONSISTENT_VOTER_SET))
        return
    if isinstance(req, m.BeginQuorumEpochRequest) and not me.addressed_to_me(req.voter_id, req.voter_directory_id):
        # KIP-853: meant for another directory of this node (the one wiped).
        core.respond(token, core.error_response(req, Errors.INVALID_VOTER_KEY))
        return
    if isinstance(req, m.VoteRequest):
        handle_vote(core, token, req, now_ms)
    elif isinstance(req, m.BeginQuorumEpochRequest):
        handle_begin_epoch(core, token, req, now_ms)
    elif isinstance(req, m.EndQuorumEpochRequest):
        handle_end_epoch(core, token, req, now_ms)
    elif isinstance(req, (m.OffsetsForLeaderEpochRequest, m.FetchSnapshotRequest, m.ListOffsetsRequest)):
        _serve_read(core, token, req, now_ms)
    elif isinstance(req, m.ProduceRequest):
        if not req.records:
            core.respond(token, core.error_response(
                req, Errors.INVALID_REQUEST, "a produce request must carry at least one record"))
            return
        core.client_append(now_ms, [AppendWaiter(token, len(req.records))], list(req.records))
    elif isinstance(req, (m.AddRaftVoterRequest, m.RemoveRaftVoterRequest, m.UpdateRaftVoterRequest)):
        membership.handle(core, core.state, token, req, now_ms)
    elif isinstance(req, m.UpdateFeaturesRequest):
        membership.handle_update_features(core, core.state, token, req, now_ms)
    elif isinstance(req, m.DescribeQuorumRequest):
        core.respond(token, core.describe_quorum(now_ms))
    elif isinstance(req, m.MetadataRequest):
        core.respond(token, core.metadata())
    elif isinstance(req, m.ApiVersionsRequest):
        core.respond(token, api_versions_response(*core.log.finalized_kraft_version()))
    else:
        core.respond(token, m.ErrorResponse(
            error_code=Errors.INVALID_REQUEST, error_message=f"the quorum does not serve {type(req).__name__}"))


def _serve_read(core: QuorumCore, token: Any,
                req: m.OffsetsForLeaderEpochRequest | m.FetchSnapshotRequest | m.ListOffsetsRequest,
                now_ms: int) -> None:
    """A leader's read other than Fetch, once fenced (KIP-320)."""
    if isinstance(req, m.FetchSnapshotRequest):
        code = fence(core, req.current_leader_epoch)
    else:
        # ListOffsets is a client's; OffsetsForLeaderEpoch a client's or a replica's.
        sentinel_allowed = isinstance(req, m.ListOffsetsRequest) or req.replica_id < 0
        code = fence_client(core, req.current_leader_epoch, sentinel_allowed=sentinel_allowed)
    if code != Errors.NONE:
        core.respond(token, core.error_response(req, code))
    elif isinstance(req, m.FetchSnapshotRequest):
        _reads(core).serve_fetch_snapshot(token, req, now_ms)
    elif isinstance(req, m.ListOffsetsRequest):
        _reads(core).serve_list_offsets(token, req)
    else:
        _reads(core).serve_offsets_for_epoch(token, req)


def check_client_append(waiters: list[AppendWaiter], records: list[bytes],
                        producers: list[tuple[int, int, int] | None] | None, prebuilt: bool = False) -> None:
    """ValueError if a ClientAppend (or a Produce) is malformed: the driver's bug."""
    if prebuilt:
        _check_prebuilt(waiters, records, producers)
        return
    total = sum(n for _, n in waiters)
    if total != len(records) or any(n <= 0 for _, n in waiters):
        raise ValueError(
            f"ClientAppend waiters count {total} records in total but {len(records)} were given")
    if producers is None:
        return
    if len(producers) != len(waiters):
        raise ValueError(f"ClientAppend has {len(waiters)} waiter(s) but {len(producers)} producer entries")
    seen: set[int] = set()
    for p in producers:
        if p is None:
            continue
        if len(p) != 3 or min(p) < 0:
            raise ValueError(f"an idempotent waiter's producer must be (id, epoch, base sequence), "
                             f"all >= 0, got {p}")
        if p[0] in seen:
            # Both would have been judged against the same producer state.
            raise ValueError(f"producer id {p[0]} appears twice in one ClientAppend")
        seen.add(p[0])


_I32 = struct.Struct(">i")
MAGIC_OFFSET = STAMP.size  # the magic byte follows the stamped fields
RECORDS_COUNT_OFFSET = HEADER_SIZE - 4  # the header's last field


def _check_prebuilt(waiters: list[AppendWaiter], batches: list[bytes],
                    producers: list[tuple[int, int, int] | None] | None) -> None:
    """A prebuilt ClientAppend: one whole v2 batch per waiter, holding its
    waiter's record count (the header's fields only: the driver checked the
    CRC and the records before it queued the batch)."""
    if producers is not None or len(batches) != len(waiters):
        raise ValueError(f"a prebuilt ClientAppend has one batch per waiter and no producers: "
                         f"{len(waiters)} waiter(s), {len(batches)} batch(es)")
    for (_token, n), batch in zip(waiters, batches):
        size = len(batch)
        if size < HEADER_SIZE or batch[MAGIC_OFFSET] != MAGIC or LOG_OVERHEAD + _I32.unpack_from(batch, 8)[0] != size \
                or _I32.unpack_from(batch, RECORDS_COUNT_OFFSET)[0] != n or n <= 0:
            raise ValueError(f"a prebuilt batch of {size} bytes is not one whole v2 batch of {n} record(s)")


# -- answers to our own requests, and their failures -------------------------------


def on_request_failed(core: QuorumCore, ev: RequestFailed, now_ms: int) -> None:
    req = core.outbox.settle(ev.request_id)
    if req is None:
        return
    st = core.state
    if req.kind in FETCH_LOOP:
        st.fetch_failed(ev.request_id, ev.destination, ev.reason, req.epoch, now_ms)
    elif req.kind in NOTIFICATIONS:
        st.notification_failed(req.destination, ev.request_id, now_ms)
    elif req.kind is RequestKind.MEMBERSHIP:
        st.on_membership_failed(ev.request_id, now_ms)
    elif req.kind in (RequestKind.VOTE, RequestKind.PRE_VOTE):
        st.vote_request_failed(ev.destination, ev.request_id, now_ms)
    # PROBE: the quarantined voter keeps waiting for its election timeout.


def learn_leader(core: QuorumCore, leader_id: int, epoch: int, now_ms: int) -> None:
    """Someone told us (leader_id, epoch): move forward if it is news."""
    st = core.state
    node_id = core.electorate.node_id
    if epoch > st.epoch:
        if leader_id >= 0 and leader_id != node_id:
            core.become_follower(epoch, leader_id, now_ms)
        else:
            core.become_unattached(epoch, now_ms)
    elif epoch == st.epoch and leader_id >= 0 and leader_id != node_id:
        if st.leader_id == NO_LEADER:
            st.on_leader_claimed(leader_id, epoch, now_ms)
        elif st.leader_id != leader_id:
            core.fail(f"two leaders in epoch {epoch}: {st.leader_id} and {leader_id}")


def on_response(core: QuorumCore, ev: ResponseReceived, now_ms: int) -> None:
    req = core.outbox.settle(ev.request_id)
    if req is None:
        return
    resp = ev.response
    # Whatever the request, a newer epoch in the answer is news we act on.
    cl = getattr(resp, "current_leader", None)
    if cl is not None:
        learn_leader(core, cl.leader_id, cl.leader_epoch, now_ms)
    elif isinstance(resp, (m.VoteResponse, m.BeginQuorumEpochResponse, m.EndQuorumEpochResponse)):
        learn_leader(core, resp.leader_id, resp.leader_epoch, now_ms)
    if core.fatal_reason is not None:
        return
    kind = req.kind
    if kind in FETCH_LOOP:
        if not core.state.fetch_answered(ev.request_id):
            return  # superseded by a role or epoch change
    elif kind in NOTIFICATIONS:
        core.state.notification_answered(req.destination, ev.request_id)
    st = core.state
    if req.epoch != st.epoch or kind is RequestKind.PROBE:
        return  # KAFKA-7786: sent under an older epoch; a probe's news was learnt above
    if kind is RequestKind.MEMBERSHIP:
        st.on_membership_answer(ev.request_id, resp, now_ms)
    elif kind is RequestKind.VOTE:
        st.on_vote_answer(ev.destination, resp, now_ms)
    elif kind is RequestKind.PRE_VOTE:
        st.on_pre_vote_answer(ev.destination, resp, now_ms)
    elif kind in NOTIFICATIONS:
        ok = getattr(resp, "error_code", -1) == Errors.NONE
        st.notification_judged(req.destination, ok, now_ms)
    else:
        st.on_fetch_answer(kind, ev.destination, req.position, resp, now_ms)


def handle_fetch(core: QuorumCore, token: Any, req: m.FetchRequest, now_ms: int, completing: bool) -> None:
    """A Fetch, new or parked (completing): validated and fenced here, then
    served by the leader."""
    bad = fetch_problem(req, core.electorate.node_id)
    if bad is not None:
        core.respond(token, core.error_response(req, Errors.INVALID_REQUEST, bad))
        return
    code = fence_client(core, req.current_leader_epoch, sentinel_allowed=req.replica_id < 0)
    if code != Errors.NONE:
        core.respond(token, core.error_response(req, code))
        return
    _reads(core).serve_fetch(token, req, now_ms, completing)


# -- the election requests, answered the same way in every role -----------------


def handle_vote(core: QuorumCore, token: Any, req: m.VoteRequest, now_ms: int) -> None:
    me = core.electorate
    if not me.addressed_to_me(req.voter_id, req.voter_directory_id):
        # KIP-853: meant for another directory of this node (the one wiped).
        core.respond(token, core.error_response(req, Errors.INVALID_VOTER_KEY))
        return
    if not me.may_be_candidate(req.candidate_id, req.candidate_directory_id):
        # Not a voter, or a wiped one standing with its old node id.
        core.respond(token, core.error_response(req, Errors.INCONSISTENT_VOTER_SET))
        return
    # KIP-853 (Kafka 3.9): a replica addressed with its own voter key votes
    # even if its voter set does not name it yet -- a voter just added that
    # has not replicated the VotersRecord. Without it, a set grown to four
    # with one voter down and one quarantined could never elect (sim seed 494).
    may_vote = me.is_voter or me.addressed_by_own_key(req.voter_id, req.voter_directory_id)
    if req.candidate_epoch < core.state.epoch:
        core.respond(token, core.error_response(req, Errors.FENCED_LEADER_EPOCH))
        return
    if req.pre_vote:
        # KIP-996: answered from the state we are in. The epoch it would stand
        # in is not news (nobody is in it yet), but the one it is in is: a
        # voter that stood in a newer epoch than ours and lost could never
        # rejoin a leader of an older one (sim seed 1954 of 10,000), so we
        # move up to it, as Kafka does with the request's ReplicaEpoch.
        if req.candidate_epoch - 1 > core.state.epoch:
            core.become_unattached(req.candidate_epoch - 1, now_ms)
        granted = may_vote and core.state.grant_pre_vote(req, now_ms)
        if granted:
            core.elections.note_pre_vote_granted(core.state.epoch, now_ms)
        st = core.state
        core.respond(token, m.VoteResponse(leader_id=st.leader_id, leader_epoch=st.epoch, vote_granted=granted))
        return
    # The timer that would make us stand ourselves: an election timer, or a
    # follower's fetch timeout.
    running_deadline_ms = core.state.running_deadline_ms()
    if req.candidate_epoch > core.state.epoch:
        core.become_unattached(req.candidate_epoch, now_ms)
    # A quarantined voter may have forgotten records it acknowledged: it votes
    # only for a log at least as up to date as the one it had (LocalLog.
    # vote_position), so no vote depends on what it lost (docs/integrity.md).
    granted = may_vote and core.state.grant_vote(req, running_deadline_ms, now_ms)
    st = core.state
    core.respond(token, m.VoteResponse(leader_id=st.leader_id, leader_epoch=st.epoch, vote_granted=granted))


def handle_begin_epoch(core: QuorumCore, token: Any, req: m.BeginQuorumEpochRequest, now_ms: int) -> None:
    st = core.state
    if req.leader_epoch < st.epoch:
        core.respond(token, core.error_response(req, Errors.FENCED_LEADER_EPOCH))
        return
    if req.leader_id == core.electorate.node_id:
        if not st.is_leader or req.leader_epoch != st.epoch:
            core.fail(f"told we lead epoch {req.leader_epoch}; we are {st.role} in epoch {st.epoch}")
            return
    else:
        learn_leader(core, req.leader_id, req.leader_epoch, now_ms)
        if core.fatal_reason is not None:
            return
        if core.state.leader_id == req.leader_id and core.state.epoch == req.leader_epoch:
            core.elections.note_leader_contact(core.state.epoch, now_ms)
            core.state.on_leader_alive(now_ms)
            if req.leader_endpoints:
                # Where our leader listens now (its entry in our set may be old).
                core.leader_endpoints = (req.leader_id, req.leader_epoch,
                                         tuple((ln.name, ln.host, ln.port) for ln in req.leader_endpoints))
    st = core.state
    core.respond(token, m.BeginQuorumEpochResponse(leader_id=st.leader_id, leader_epoch=st.epoch))


def handle_end_epoch(core: QuorumCore, token: Any, req: m.EndQuorumEpochRequest, now_ms: int) -> None:
    if req.leader_epoch < core.state.epoch:
        core.respond(token, core.error_response(req, Errors.FENCED_LEADER_EPOCH))
        return
    if req.leader_epoch > core.state.epoch:
        core.become_unattached(req.leader_epoch, now_ms)
    core.state.on_end_quorum_epoch(req, now_ms)
    st = core.state
    core.respond(token, m.EndQuorumEpochResponse(leader_id=st.leader_id, leader_epoch=st.epoch))
