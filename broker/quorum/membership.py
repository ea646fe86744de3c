"""KIP-853 voter changes on the leader: AddRaftVoter (80), RemoveRaftVoter
(81) and UpdateRaftVoter (82), with the rules of Kafka's AddVoterHandler,
RemoveVoterHandler and UpdateVoterHandler; and UpdateFeatures (57) for
kraft.version, the online upgrade from static voters (bottom of the module).

A change is one VotersRecord appended by the leader; like any VotersRecord
it counts from the moment it is appended (metalog.broker.quorum.voters). Safety
comes from doing one change at a time, each committed before the next:
two sets that differ by one voter always share a majority, so no two
disjoint majorities can exist across a change. Hence, before a change:

* the leader must have committed a record of its own epoch (its HW is past
  the epoch's start: every older uncommitted change is settled), and
* no VotersRecord may be uncommitted (REQUEST_TIMED_OUT otherwise, Kafka's
  answer: the client retries).

Then: an added replica must already fetch from us as an observer with the
directory id named and be caught up (it can count toward the HW at once);
kraft version 0 (static voters from the config) cannot change
(UNSUPPORTED_VERSION); the answer goes out when the VotersRecord commits, or
REQUEST_TIMED_OUT at the request's timeout, or NOT_LEADER_OR_FOLLOWER if
leadership is lost first. A leader that removed itself keeps leading
until the change commits, its own log end no longer counting toward the
HW, then steps down to an observer (metalog.broker.quorum.leader).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

from metalog.broker.quorum.voters import VoterSet
from metalog.protocol import messages as m
from metalog.protocol.errors import Errors

if TYPE_CHECKING:
    from metalog.broker.quorum.leader import LeaderState
    from metalog.broker.quorum.roles import RoleContext, RoleState

NO_DIRECTORY_ID = m.NO_DIRECTORY_ID
VoterRequest = m.AddRaftVoterRequest | m.RemoveRaftVoterRequest | m.UpdateRaftVoterRequest
VoterChangeRequest = VoterRequest | m.UpdateFeaturesRequest
_RESPONSE = {m.AddRaftVoterRequest: m.AddRaftVoterResponse, m.RemoveRaftVoterRequest: m.RemoveRaftVoterResponse,
             m.UpdateRaftVoterRequest: m.UpdateRaftVoterResponse}


@dataclass(slots=True)
class PendingChange:
    """A voter change appended by the leader, answered when it commits."""

    token: Any
    request: VoterChangeRequest
    offset: int  # of its VotersRecord
    deadline_ms: int


class ChangeRefused(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def _leads(st: RoleState, ctx: RoleContext, token: Any, req: VoterChangeRequest) -> TypeGuard[LeaderState]:
    """Does `st` lead? If not, answer NOT_LEADER_OR_FOLLOWER (naming epoch and leader)."""
    if st.is_leader:
        return True
    answer(ctx, token, req, Errors.NOT_LEADER_OR_FOLLOWER,
           f"node {ctx.electorate.node_id} is not the leader (epoch {st.epoch}, leader {st.leader_id})")
    return False


def answer(ctx: RoleContext, token: Any, req: VoterChangeRequest, code: int, message: str | None = None) -> None:
    """The response type `req` expects, with `code`."""
    if isinstance(req, m.UpdateRaftVoterRequest):
        ctx.respond(token, m.UpdateRaftVoterResponse(error_code=code, error_message=message,
                                                      current_leader=ctx.current_leader()))
    elif isinstance(req, m.UpdateFeaturesRequest):
        ctx.respond(token, m.UpdateFeaturesResponse(error_code=code, error_message=message, results=[
            m.UpdatableFeatureResult(u.feature, code, message) for u in req.feature_updates]))
    else:
        ctx.respond(token, _RESPONSE[type(req)](error_code=code, error_message=message))


def handle(ctx: RoleContext, st: RoleState, token: Any, req: VoterRequest, now_ms: int) -> None:
    """RequestReceived of AddRaftVoter / RemoveRaftVoter / UpdateRaftVoter in
    role `st` (every one is answered, now or when its change commits)."""
    if isinstance(req, m.UpdateRaftVoterRequest) and req.current_leader_epoch != st.epoch:
        # KIP-320 fencing, as inbound.fence: the voter's view of the epoch is off.
        code = Errors.FENCED_LEADER_EPOCH if req.current_leader_epoch < st.epoch else Errors.UNKNOWN_LEADER_EPOCH
        answer(ctx, token, req, code, f"epoch {req.current_leader_epoch} is not ours ({st.epoch})")
        return
    if not _leads(st, ctx, token, req):
        return
    try:
        new_set = _new_voter_set(ctx, st, req, now_ms)
    except ChangeRefused as refused:
        answer(ctx, token, req, refused.code, refused.message)
        return
    if new_set is None:  # nothing to change (an update naming the endpoints it has)
        answer(ctx, token, req, Errors.NONE)
        return
    timeout_ms = getattr(req, "timeout_ms", ctx.config.request_timeout_ms)
    offset = st.append_voters(new_set, now_ms)
    st.pending_change = PendingChange(token, req, offset, now_ms + max(0, timeout_ms))


def _new_voter_set(ctx: RoleContext, st: LeaderState, req: VoterRequest, now_ms: int) -> VoterSet | None:
    """The voter set after `req`, or None if it changes nothing; ChangeRefused
    with Kafka's error when it may not be made now."""
    log = ctx.log
    vs = ctx.electorate.voter_set
    hw = log.high_watermark
    # In Kafka's order: a change of ours pending, our epoch not committed
    # yet, static voters, any VotersRecord not committed yet.
    if st.pending_change is not None:
        raise ChangeRefused(Errors.REQUEST_TIMED_OUT,
                            f"another voter change is in progress (its VotersRecord at offset "
                            f"{st.pending_change.offset} is not committed yet); retry")
    if hw <= st.epoch_start_offset:
        raise ChangeRefused(Errors.REQUEST_TIMED_OUT,
                            f"the leader has not committed a record of its epoch {st.epoch} yet; retry")
    if vs.kraft_version == 0:
        if isinstance(req, m.UpdateRaftVoterRequest):
            _check_kraft_range(req, 0)
            return None  # static voters: the config holds the endpoints; nothing to record (as Kafka)
        raise ChangeRefused(Errors.UNSUPPORTED_VERSION,
                            "the cluster runs kraft.version 0 (static voters from the config): voters "
                            "cannot change until it is upgraded to kraft.version 1")
    if log.voters.entries and log.voters.entries[-1][0] >= hw:
        raise ChangeRefused(Errors.REQUEST_TIMED_OUT,
                            f"another voter change is in progress (its VotersRecord at offset "
                            f"{log.voters.entries[-1][0]} is not committed yet, high watermark {hw}); retry")
    if isinstance(req, m.UpdateRaftVoterRequest):
        _check_kraft_range(req, vs.kraft_version)
    vid, vdir = req.voter_id, req.voter_directory_id
    if vid < 0 or vdir == NO_DIRECTORY_ID:
        raise ChangeRefused(Errors.INVALID_REQUEST,
                            f"a voter is a node id >= 0 and a directory id, got {vid} and {vdir!r}")
    endpoints = {k: e for k, e in vs.endpoints.items()}
    ranges = dict(vs.kraft_ranges)
    ids = dict(vs.directory_ids)
    if isinstance(req, m.AddRaftVoterRequest):
        if vid in ids:
            raise ChangeRefused(Errors.DUPLICATE_VOTER,
                                f"node {vid} is already a voter (directory id {ids[vid]!r}); "
                                f"remove it first to replace its directory")
        listeners = _listeners(req)
        progress = st.progress.observers.get((vid, vdir))
        fetch_timeout_ms = ctx.config.fetch_timeout_ms
        if progress is None or progress.last_fetch_ms < 0 or now_ms - progress.last_fetch_ms > fetch_timeout_ms:
            raise ChangeRefused(Errors.REQUEST_TIMED_OUT,
                                f"replica {vid} with directory id {vdir!r} is not fetching from the leader; "
                                f"start it as an observer first")
        if progress.log_end_offset < hw:
            raise ChangeRefused(Errors.REQUEST_TIMED_OUT,
                                f"replica {vid} is not caught up (fetched to {progress.log_end_offset}, "
                                f"high watermark {hw}); retry")
        ids[vid] = vdir
        endpoints[vid] = listeners
    else:
        if ids.get(vid) != vdir:
            where = f"(its directory id is {ids[vid]!r})" if vid in ids else "(no such node id in the set)"
            raise ChangeRefused(Errors.VOTER_NOT_FOUND,
                                f"replica {vid} with directory id {vdir!r} is not a voter {where}")
        if isinstance(req, m.RemoveRaftVoterRequest):
            if len(ids) == 1:
                raise ChangeRefused(Errors.INVALID_REQUEST, f"node {vid} is the only voter: it cannot be removed")
            del ids[vid]
            endpoints.pop(vid, None)
            ranges.pop(vid, None)
        else:
            listeners = _listeners(req)
            supported = (req.kraft_version_min, req.kraft_version_max)
            if endpoints.get(vid) == listeners and vs.kraft_range_of(vid) == supported:
                return None
            endpoints[vid] = listeners
            ranges[vid] = supported
    return VoterSet(ids, kraft_version=1, endpoints=endpoints, kraft_ranges=ranges)


def _check_kraft_range(req: m.UpdateRaftVoterRequest, kraft_version: int) -> None:
    """Kafka's UpdateVoterHandler: the voter must still support the
    finalized kraft.version (INVALID_REQUEST otherwise, naming both)."""
    lo, hi = req.kraft_version_min, req.kraft_version_max
    if not 0 <= lo <= hi:
        raise ChangeRefused(Errors.INVALID_REQUEST,
                            f"voter {req.voter_id}: bad supported kraft.version range {lo}..{hi}")
    if not lo <= kraft_version <= hi:
        raise ChangeRefused(Errors.INVALID_REQUEST,
                            f"voter {req.voter_id} supports kraft.version {lo}..{hi}, which does not include "
                            f"the cluster's finalized kraft.version {kraft_version}")


def _listeners(req: m.AddRaftVoterRequest | m.UpdateRaftVoterRequest) -> tuple[tuple[str, str, int], ...]:
    if not req.listeners:
        raise ChangeRefused(Errors.INVALID_REQUEST, f"voter {req.voter_id}: at least one listener is required")
    for ln in req.listeners:
        if not ln.name or not ln.host or not 0 < ln.port < 65536:
            raise ChangeRefused(Errors.INVALID_REQUEST,
                                f"voter {req.voter_id}: bad listener {ln.name!r} {ln.host!r}:{ln.port}")
    return tuple((ln.name, ln.host, ln.port) for ln in req.listeners)


# -- kraft.version 0 -> 1 online (Kafka's `kafka-features upgrade --feature kraft.version=1`) --


def handle_update_features(ctx: RoleContext, st: RoleState, token: Any, req: m.UpdateFeaturesRequest,
                           now_ms: int) -> None:
    """UpdateFeatures (57) for kraft.version: a cluster of static voters
    (kraft version 0) upgrades online. The leader, once it has committed a
    record of its epoch and knows every static voter's directory id (the one
    it fetches with, Fetch's ReplicaDirectoryId) and endpoints (the config's),
    appends KRaftVersionRecord(1) + the VotersRecord of those voters, as
    Kafka's LeaderState does; from then on the set lives in the log and
    AddRaftVoter / RemoveRaftVoter work. Answered when that batch commits.
    Refused: a feature other than kraft.version, a level above 1 or a
    downgrade (INVALID_UPDATE_VERSION), a voter whose directory id or
    endpoint is unknown (INVALID_UPDATE_VERSION, naming it), the epoch not
    committed yet or an upgrade / voter change pending (REQUEST_TIMED_OUT:
    retry). Level 1 when the cluster is at 1 already: NONE, nothing written."""
    updates = req.feature_updates
    if not updates:
        answer(ctx, token, req, Errors.INVALID_REQUEST, "no feature to update")
        return
    for u in updates:
        if u.feature != m.KRAFT_VERSION_FEATURE:
            answer(ctx, token, req, Errors.INVALID_UPDATE_VERSION,
                   f"unknown feature {u.feature!r}: the quorum has only {m.KRAFT_VERSION_FEATURE}")
            return
    if len(updates) > 1:
        answer(ctx, token, req, Errors.INVALID_REQUEST, f"{m.KRAFT_VERSION_FEATURE} named more than once")
        return
    level = updates[0].max_version_level
    if not _leads(st, ctx, token, req):
        return
    try:
        new_set = _upgraded_voter_set(ctx, st, level, now_ms)
    except ChangeRefused as refused:
        answer(ctx, token, req, refused.code, refused.message)
        return
    if new_set is None or req.validate_only:
        answer(ctx, token, req, Errors.NONE)
        return
    offset = st.append_kraft_upgrade(new_set, now_ms)
    st.pending_change = PendingChange(token, req, offset, now_ms + max(0, req.timeout_ms))


def _upgraded_voter_set(ctx: RoleContext, st: LeaderState, level: int, now_ms: int) -> VoterSet | None:
    """The set kraft.version `level` writes (None: already there), or ChangeRefused."""
    vs = ctx.electorate.voter_set
    hw = ctx.log.high_watermark
    if level > 1:
        raise ChangeRefused(Errors.INVALID_UPDATE_VERSION,
                            f"{m.KRAFT_VERSION_FEATURE} {level} is not supported (this build supports 0..1)")
    if st.pending_change is not None:
        what = ("the upgrade to kraft.version 1" if type(st.pending_change.request) is m.UpdateFeaturesRequest
                else "a voter change")
        raise ChangeRefused(Errors.REQUEST_TIMED_OUT,
                            f"{what} at offset {st.pending_change.offset} is not committed yet; retry")
    if level < vs.kraft_version:
        raise ChangeRefused(Errors.INVALID_UPDATE_VERSION,
                            f"{m.KRAFT_VERSION_FEATURE} cannot be downgraded from {vs.kraft_version} to {level}")
    if level == vs.kraft_version:
        if ctx.log.voters.entries and ctx.log.voters.entries[-1][0] >= hw:
            raise ChangeRefused(Errors.REQUEST_TIMED_OUT,
                                f"the change to {m.KRAFT_VERSION_FEATURE} {level} at offset "
                                f"{ctx.log.voters.entries[-1][0]} is not committed yet; retry")
        return None
    if hw <= st.epoch_start_offset:
        raise ChangeRefused(Errors.REQUEST_TIMED_OUT,
                            f"the leader has not committed a record of its epoch {st.epoch} yet; retry")
    ids: dict[int, str] = {}
    unknown = []
    for v in vs.ids:
        d = ctx.electorate.directory_id if v == ctx.electorate.node_id else st.progress.voter_directory_id(v)
        if d == NO_DIRECTORY_ID:
            unknown.append(v)
        ids[v] = d
    if unknown:
        raise ChangeRefused(Errors.INVALID_UPDATE_VERSION,
                            f"the directory id of voter(s) {unknown} is not known to the leader (a voter "
                            f"tells it in its fetches: start it, with a data dir formatted with a directory.id)")
    endpoints = {nid: ((name, host, port),) for nid, name, host, port in ctx.config.voter_endpoints}
    missing = [v for v in vs.ids if v not in endpoints]
    if missing:
        raise ChangeRefused(Errors.INVALID_UPDATE_VERSION,
                            f"no endpoint is configured for voter(s) {missing}")
    return VoterSet(ids, kraft_version=1, endpoints={v: endpoints[v] for v in vs.ids})
