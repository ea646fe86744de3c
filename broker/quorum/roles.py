"""Role states of a quorum node, in the manner of Kafka's QuorumState.

Each role is a small object holding only its own fields; the node's current
role is one such object (``QuorumCore.state``) and events reach the role
through the methods below, which each role overrides where it cares (etcd
raft's per-role step functions). The base class holds what every role has:
the epoch, the leader and vote as known in it, and the election timer.

A role never holds the QuorumCore. It gets a context, a ``typing.Protocol``
naming exactly what it may use of its owner: ``RoleContext`` here for what
every role uses, and one extension per role module (``ElectionContext``,
``FollowerContext``, ``LeaderContext``). The core implements them all (mypy
checks it where the core builds a role); a test builds a role against a
small fake of its context (tests/quorum/test_role_alone.py). As in Kafka's
EpochState, a role answers questions and asks for a transition; the owner
makes it (``become_*``, ``stand``, ``resign``), persisting first.

``ALLOWED_TRANSITIONS`` lists every role change the core may make;
``QuorumCore.transition`` checks it (an invariant, kept under python -O), persists the election state first and
only then makes the new role observable (Kafka's durableTransitionTo).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Protocol

from metalog.protocol import messages as m
from metalog.protocol.errors import Errors

if TYPE_CHECKING:
    from metalog.broker.quorum.api import AppendWaiter, QuorumConfig
    from metalog.broker.quorum.election import ElectionMemory
    from metalog.broker.quorum.local_log import LocalLog
    from metalog.broker.quorum.outbox import RequestKind
    from metalog.broker.quorum.progress import ReplicaProgress
    from metalog.broker.quorum.voters import Electorate


class Role(enum.StrEnum):
    """The role as exposed (DescribeQuorum, /quorum, metrics)."""

    UNATTACHED = "unattached"
    VOTED = "voted"
    PROSPECTIVE = "prospective"  # KIP-996: asking for pre-votes, epoch not bumped
    CANDIDATE = "candidate"
    LEADER = "leader"
    FOLLOWER = "follower"
    RESIGNED = "resigned"
    OBSERVER = "observer"


# Kafka's RETRY_BACKOFF_BASE_MS: unit of the election backoffs.
RETRY_BACKOFF_BASE_MS = 100

R = Role
ALLOWED_TRANSITIONS: dict[Role, frozenset[Role]] = {
    # An epoch moves on (Vote, BeginQuorumEpoch, EndQuorumEpoch, any answer
    # naming a newer epoch): unattached there, or following its leader. A
    # voter whose timer runs out becomes prospective (KIP-996 pre-vote); only
    # a prospective with a majority of pre-votes becomes a candidate.
    # Any voter role whose node leaves the voter set (KIP-853: the log's set
    # changed, or went back with a truncation) becomes an observer.
    R.UNATTACHED: frozenset({R.UNATTACHED, R.VOTED, R.PROSPECTIVE, R.FOLLOWER, R.OBSERVER}),
    R.VOTED: frozenset({R.UNATTACHED, R.PROSPECTIVE, R.FOLLOWER, R.OBSERVER}),
    # Prospective to prospective: a new round of pre-votes. To voted: it grants
    # a real vote in its (unbumped) epoch, as an unattached voter would.
    R.PROSPECTIVE: frozenset({R.UNATTACHED, R.VOTED, R.PROSPECTIVE, R.CANDIDATE, R.FOLLOWER, R.OBSERVER}),
    # A quarantined candidate gives up its candidacy but keeps its own vote; a
    # candidate that lost asks for pre-votes again before its next epoch.
    R.CANDIDATE: frozenset({R.UNATTACHED, R.VOTED, R.PROSPECTIVE, R.LEADER, R.FOLLOWER, R.OBSERVER}),
    # A leader whose removal (KIP-853) is committed steps down to an observer.
    R.LEADER: frozenset({R.RESIGNED, R.UNATTACHED, R.FOLLOWER, R.OBSERVER}),
    R.RESIGNED: frozenset({R.UNATTACHED, R.PROSPECTIVE, R.FOLLOWER, R.OBSERVER}),
    # To voted: an observer that voted before and knows no leader is made a
    # voter again by the log's set (KIP-853): it keeps its vote.
    R.FOLLOWER: frozenset({R.UNATTACHED, R.VOTED, R.PROSPECTIVE, R.FOLLOWER}),
    # A non-voter is an observer whatever happens; it may lose or learn a leader.
    # (A follower that leaves or joins the voter set changes role in place.)
    R.OBSERVER: frozenset({R.OBSERVER}),
}
# Transitions that keep the persisted election as it is (Kafka's
# memoryTransitionTo): a resigned leader still records that it led the epoch,
# and a prospective persists nothing (no epoch bump, no vote: KIP-996).
MEMORY_TRANSITIONS = frozenset({(R.LEADER, R.RESIGNED)} | {
    (r, R.PROSPECTIVE) for r in (R.UNATTACHED, R.VOTED, R.PROSPECTIVE, R.CANDIDATE, R.RESIGNED, R.FOLLOWER)})


class RoleContext(Protocol):
    """What every role may use of its owner (the QuorumCore)."""

    @property
    def config(self) -> QuorumConfig: ...

    @property
    def log(self) -> LocalLog:
        """The local log's view, shared by every role."""
        ...

    @property
    def electorate(self) -> Electorate:
        """This node and the latest voter set."""
        ...

    @property
    def elections(self) -> ElectionMemory:
        """What elections remember across roles, and their random timers."""
        ...

    @property
    def shutting_down(self) -> bool: ...

    def send(self, destination: int, body: m.Body, kind: RequestKind, position: int = 0) -> int:
        """Send a request under our epoch; its id."""
        ...

    def respond(self, token: Any, body: m.Body) -> None: ...

    def current_leader(self) -> m.LeaderIdAndEpoch: ...

    def fail(self, reason: str) -> None:
        """An invariant of the quorum broke: stop the node (Fatal)."""
        ...

    def become_follower(self, epoch: int, leader_id: int, now_ms: int) -> RoleState:
        """Follow `leader_id` in `epoch`; the role in place after it."""
        ...

    def become_observer(self, now_ms: int) -> None:
        """We left the voter set (KIP-853)."""
        ...


class RoleState:
    """What every role has, and what a role does with an event it does not
    handle itself (mostly: nothing, or refuse)."""

    __slots__ = ("ctx", "role", "epoch", "leader_id", "voted_id", "election_deadline_ms")
    is_leader = False

    ctx: RoleContext

    def __init__(self, ctx: RoleContext, role: Role, epoch: int, leader_id: int, voted_id: int):
        self.ctx = ctx
        self.role = role
        self.epoch = epoch
        self.leader_id = leader_id  # NO_LEADER if unknown
        self.voted_id = voted_id  # -1 if none this epoch
        self.election_deadline_ms: int | None = None

    def persisted_leader_id(self) -> int:
        return self.leader_id

    # -- lifecycle (QuorumCore.transition and boot) --------------------------

    def on_enter(self, now_ms: int) -> None:
        """The role is observable and persisted: arm timers, send requests."""

    def on_exit(self, now_ms: int) -> None:
        """After the next role was entered: answer what only this role could."""

    def on_boot(self, now_ms: int) -> None:
        """First step of a process life, in the role read from disk."""

    # -- time ----------------------------------------------------------------

    def deadlines(self, now_ms: int) -> list[int]:
        return []

    def poll(self, now_ms: int) -> None:
        """Timers: run at the end of every step."""

    def before_event(self, now_ms: int) -> None:
        """Start of a step, before its event is handled."""

    # -- election ------------------------------------------------------------

    def grant_vote(self, req: m.VoteRequest, running_deadline_ms: int | None, now_ms: int) -> bool:
        return False

    def grant_pre_vote(self, req: m.VoteRequest, now_ms: int) -> bool:
        """KIP-996: would we vote for this candidate in the next epoch? Yes iff
        its log is at least as up to date as ours and no leader of our epoch
        has been heard from within the fetch timeout. Records nothing."""
        ctx = self.ctx
        up_to_date = ctx.log.up_to_date(req.last_offset_epoch, req.last_offset)
        return up_to_date and not ctx.elections.heard_from_leader_recently(self.epoch, now_ms)

    def on_leader_claimed(self, leader_id: int, epoch: int, now_ms: int) -> None:
        """Another node leads our epoch and we knew no leader in it."""
        self.ctx.become_follower(epoch, leader_id, now_ms)

    def on_end_quorum_epoch(self, req: m.EndQuorumEpochRequest, now_ms: int) -> None:
        """Our epoch's leader resigns."""

    def running_deadline_ms(self) -> int | None:
        """The timer that would make us stand ourselves."""
        return self.election_deadline_ms

    def postpone_candidacy(self, now_ms: int) -> None:
        """A quarantined voter may not stand: try again after an election timeout."""
        self.election_deadline_ms = now_ms + self.ctx.elections.timeout_ms()

    def stand_soon(self, now_ms: int) -> None:
        """Our leader is probably gone: stand again after a short grace (a
        follower of a known leader; no other role waits on a leader)."""

    def vote_request_failed(self, voter: int, request_id: int, now_ms: int) -> None:
        """A Vote (or pre-vote) of ours got no answer (timeout, connection)."""

    def on_vote_answer(self, voter: int, resp: m.Body, now_ms: int) -> None:
        """A VoteResponse of our epoch (only a candidate counts it)."""

    def on_pre_vote_answer(self, voter: int, resp: m.Body, now_ms: int) -> None:
        """An answer to a pre-vote sent in our epoch (only a prospective counts it)."""

    def on_membership_answer(self, request_id: int, resp: m.Body, now_ms: int) -> None:
        """The leader answered our own voter-set request (followers only)."""

    def on_membership_failed(self, request_id: int, now_ms: int) -> None:
        """Our own voter-set request got no answer (followers only)."""

    def on_leader_alive(self, now_ms: int) -> None:
        """Our epoch's known leader spoke to us (BeginQuorumEpoch, an answer)."""

    # -- answers to what a role sent (QuorumCore routes them by request kind) --

    def fetch_failed(self, request_id: int, destination: int, reason: str, sent_epoch: int, now_ms: int) -> None:
        """A fetch-loop request failed (no answer will come)."""

    def fetch_answered(self, request_id: int) -> bool:
        """A fetch-loop answer arrived: True if this role still waits for it."""
        return False

    def on_fetch_answer(self, kind: RequestKind, destination: int, position: int, resp: m.Body,
                        now_ms: int) -> None:
        """A fetch-loop answer this role waited for, sent in the current epoch."""

    def notification_failed(self, voter: int, request_id: int, now_ms: int) -> None:
        """A BeginQuorumEpoch / EndQuorumEpoch failed."""

    def notification_answered(self, voter: int, request_id: int) -> None:
        """A BeginQuorumEpoch / EndQuorumEpoch was answered (any epoch)."""

    def notification_judged(self, voter: int, ok: bool, now_ms: int) -> None:
        """The answer to a notification sent in the current epoch."""

    def client_append(self, waiters: list[AppendWaiter], records: list[bytes], now_ms: int,
                      producers: list[tuple[int, int, int] | None] | None = None, prebuilt: bool = False) -> None:
        ctx = self.ctx
        cl = ctx.current_leader()
        for token, _ in waiters:
            ctx.respond(token, m.ProduceResponse(
                error_code=Errors.NOT_LEADER_OR_FOLLOWER, current_leader=cl,
                error_message=f"node {ctx.electorate.node_id} is not the leader"))

    # -- the local log changed under us --------------------------------------

    def on_flushed(self, now_ms: int) -> None:
        """The flushed log end moved."""

    def on_log_cut(self, now_ms: int) -> None:
        """LogQuarantined: the log lost its tail to corruption."""

    def uncommitted_from(self) -> int | None:
        """The offset from which no record of our log can have been committed,
        if this role knows it (a leader that has committed in its own epoch);
        None when records past our high watermark may be committed elsewhere."""
        return None

    def on_log_rewound(self, now_ms: int) -> None:
        """SnapshotInstallFailed: the log is back as it was before the install."""

    def on_voters_changed(self, now_ms: int) -> None:
        """The latest voter set changed in this step (KIP-853). A voter role
        whose node is no longer a voter becomes an observer; a follower is
        one already (FollowerState serves both, its role is set in place)."""
        ctx = self.ctx
        if not ctx.electorate.is_voter and self.role not in (Role.OBSERVER, Role.LEADER):
            ctx.become_observer(now_ms)

    def on_shutdown(self, now_ms: int) -> None:
        """Graceful stop (the election timer is already disarmed)."""

    # -- exposure ------------------------------------------------------------

    def describe_quorum(self, now_ms: int) -> m.DescribeQuorumResponse:
        return m.DescribeQuorumResponse(
            error_code=Errors.NOT_LEADER_OR_FOLLOWER, leader_id=self.leader_id, leader_epoch=self.epoch)

    def is_in_sync(self, replica_id: int, now_ms: int) -> bool:
        return False

    def replica_states(self) -> dict[int, ReplicaProgress]:
        return {}

    def observer_ids(self) -> list[int]:
        return []

    def parked_fetch_replicas(self) -> list[int]:
        """The replica id of every fetch parked waiting for data (a leader's)."""
        return []
