"""The roles that have no leader to follow (or are giving up on it) --
unattached, voted, prospective, candidate, resigned -- and the answers to the
election requests (Vote, BeginQuorumEpoch, EndQuorumEpoch), KIP-595 as
Kafka's KafkaRaftClient builds it, with KIP-996's pre-vote: a voter whose
timer runs out is first prospective and becomes a candidate (epoch + 1, a
persisted vote) only once a majority said it would vote for it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

from metalog.broker.quorum.notify import Notifier, NotifyingRole
from metalog.broker.quorum.outbox import RETRY_BACKOFF_MS, RequestKind
from metalog.broker.quorum.roles import Role, RoleState
from metalog.protocol import messages as m
from metalog.protocol.errors import Errors

if TYPE_CHECKING:
    from metalog.broker.quorum.core import QuorumCore

NO_EPOCH = m.NO_EPOCH
NO_LEADER = m.NO_LEADER
NO_OFFSET = m.NO_OFFSET


class _WaitingForElection(RoleState):
    """A voter with no leader: stands once its election timer runs out."""

    __slots__ = ()

    def on_enter(self, now_ms: int) -> None:
        if not self.core.shutting_down:
            self.election_deadline_ms = now_ms + self.core.election_timeout()

    def on_boot(self, now_ms: int) -> None:
        core = self.core
        self.election_deadline_ms = now_ms + core.election_timeout()
        if core.others == () and core.is_voter:
            core.stand(now_ms)  # single voter: elect ourselves now

    def deadlines(self, now_ms: int) -> list[int]:
        return [] if self.election_deadline_ms is None else [self.election_deadline_ms]

    def poll(self, now_ms: int) -> None:
        core = self.core
        if (core.is_voter and not core.shutting_down
                and self.election_deadline_ms is not None and now_ms >= self.election_deadline_ms):
            core.stand(now_ms)


class UnattachedState(_WaitingForElection):
    __slots__ = ()

    def __init__(self, core: QuorumCore, epoch: int):
        super().__init__(core, Role.UNATTACHED, epoch, NO_LEADER, -1)

    def grant_vote(self, req: m.VoteRequest, running_deadline: int | None, now_ms: int) -> bool:
        log = self.core.log
        if log.up_to_date(req.last_offset_epoch, req.last_offset):
            self.core.become_voted(req.candidate_id, now_ms)  # persisted before the answer
            return True
        if running_deadline is not None and self.election_deadline_ms is not None:
            # Refused for a stale log: keep the timer that was already running,
            # else a lagging voter that keeps standing (its lost-election
            # backoff is shorter than our fresh timeout) blocks every election.
            self.election_deadline_ms = min(self.election_deadline_ms, running_deadline)
        return False


class VotedState(_WaitingForElection):
    __slots__ = ()

    def __init__(self, core: QuorumCore, epoch: int, voted_id: int):
        super().__init__(core, Role.VOTED, epoch, NO_LEADER, voted_id)

    def grant_vote(self, req: m.VoteRequest, running_deadline: int | None, now_ms: int) -> bool:
        return self.voted_id == req.candidate_id  # one vote per epoch


class ResignedState(NotifyingRole, _WaitingForElection):
    """A leader that stepped down keeps its epoch (graceful stop, check-quorum,
    quarantine) and tells the others with EndQuorumEpoch, most caught-up
    successor first. A restarted former leader starts here (KAFKA-10527)."""

    __slots__ = ("notifier", "successors")

    def __init__(self, core: QuorumCore, epoch: int, voted_id: int, successors: list[int]):
        super().__init__(core, Role.RESIGNED, epoch, NO_LEADER, voted_id)
        self.successors = successors
        # Armed on entering from leadership; a restarted former leader has no
        # one to tell (it does not know whom it led).
        self.notifier = Notifier(RequestKind.END, (), 0)

    def persisted_leader_id(self) -> int:
        return self.core.node_id  # we led this epoch; keep saying so on disk

    def on_enter(self, now_ms: int) -> None:
        core = self.core
        self.notifier = Notifier(RequestKind.END, core.others, now_ms)
        super().on_enter(now_ms)

    def deadlines(self, now_ms: int) -> list[int]:
        return super().deadlines(now_ms) + self.notifier.deadlines(now_ms)

    def poll(self, now_ms: int) -> None:
        self.notifier.send_due(now_ms, self._end_epoch_request, self.core.send)
        super().poll(now_ms)

    def _end_epoch_request(self, voter: int) -> m.EndQuorumEpochRequest:
        core = self.core
        return m.EndQuorumEpochRequest(cluster_id=core.config.cluster_id, leader_id=core.node_id,
                                       leader_epoch=self.epoch, preferred_successors=list(self.successors))

    def on_leader_claimed(self, leader_id: int, epoch: int, now_ms: int) -> None:
        self.core.fail(f"node {leader_id} claims leadership of epoch {epoch}, which we led")


class _VoteRound:
    """The (pre-)vote requests of one round: who was asked by which request,
    and when an unanswered one is asked again. Asking again is harmless: a
    voter answers the same question the same way (one persisted vote per
    epoch; a pre-vote promises nothing). `send(voter)` sends the round's
    request and returns its id."""

    __slots__ = ("send", "asked", "retry_at_ms")

    def __init__(self, send: Callable[[int], int]) -> None:
        self.send = send
        self.asked: dict[int, int] = {}  # voter -> request id of our latest ask
        self.retry_at_ms: dict[int, int] = {}  # voter -> when to ask again

    def ask(self, voter: int) -> None:
        self.asked[voter] = self.send(voter)

    def failed(self, voter: int, request_id: int, now_ms: int) -> None:
        if self.asked.get(voter) == request_id:
            del self.asked[voter]
            self.retry_at_ms[voter] = now_ms + RETRY_BACKOFF_MS

    def deadlines(self) -> list[int]:
        return [min(self.retry_at_ms.values())] if self.retry_at_ms else []

    def ask_again(self, now_ms: int, answered: set[int], voters: Iterable[int]) -> None:
        """Ask the voters whose retry is due, unless they answered meanwhile
        or left the set (bounded by the voter set)."""
        due = [v for v, t in self.retry_at_ms.items() if t <= now_ms]
        for v in due:
            del self.retry_at_ms[v]
        others = set(voters)
        for v in due:
            if v not in answered and v in others:
                self.ask(v)


class CandidateState(RoleState):
    """Asks every voter for its vote in a new epoch; leads with a majority,
    backs off (randomized, exponential) after losing."""

    __slots__ = ("granted", "rejected", "backing_off", "round")

    def __init__(self, core: QuorumCore, epoch: int):
        super().__init__(core, Role.CANDIDATE, epoch, NO_LEADER, core.node_id)
        self.granted = {core.node_id}
        self.rejected: set[int] = set()
        self.backing_off = False
        log = core.log
        self.round = _VoteRound(lambda v: core.send(
            v, core.vote_request(v, epoch, log.last_epoch(), log.log_end_offset), RequestKind.VOTE))

    def on_enter(self, now_ms: int) -> None:
        core = self.core
        core.election_retries += 1
        self.election_deadline_ms = now_ms + core.election_timeout()
        if core.is_majority(self.granted):
            core.become_leader(now_ms)
            return
        for v in core.others:
            self.round.ask(v)

    def vote_request_failed(self, voter: int, request_id: int, now_ms: int) -> None:
        if not self.backing_off:
            self.round.failed(voter, request_id, now_ms)

    def deadlines(self, now_ms: int) -> list[int]:
        ds = [] if self.election_deadline_ms is None else [self.election_deadline_ms]
        return ds if self.backing_off else ds + self.round.deadlines()

    def poll(self, now_ms: int) -> None:
        if not self.backing_off:
            self.round.ask_again(now_ms, self.granted | self.rejected, self.core.others)
        if self.election_deadline_ms is not None and now_ms >= self.election_deadline_ms:
            if self.backing_off:
                self.core.stand(now_ms)  # pre-votes again before another epoch
            else:
                self.backing_off = True
                self.election_deadline_ms = now_ms + self.core.lost_election_backoff()

    def on_vote_answer(self, voter: int, resp: m.Body, now_ms: int) -> None:
        if not isinstance(resp, m.VoteResponse) or resp.error_code != Errors.NONE:
            return
        if resp.vote_granted:
            self.granted.add(voter)
            if self.core.is_majority(self.granted):
                self.core.become_leader(now_ms)
        else:
            self.rejected.add(voter)
            n = len(self.core.voters)
            if len(self.rejected) > n - n // 2 - 1 and not self.backing_off:
                # Lost: back off (randomized, exponential) before the next try.
                self.backing_off = True
                self.election_deadline_ms = now_ms + self.core.lost_election_backoff()

    def on_log_cut(self, now_ms: int) -> None:
        # The votes on their way were granted to the log we no longer have
        # (sim seed 318): give up the candidacy, keep our vote for the epoch.
        self.core.become_voted(self.core.node_id, now_ms)


class ProspectiveState(RoleState):
    """KIP-996 (Kafka 4.0's ProspectiveState): a voter that lost its leader
    (fetch timeout) or whose election timer ran out asks every voter with
    Vote(pre_vote=true) whether it would vote for us in epoch + 1. Our epoch,
    vote and known leader stay as they were, persisted nothing (a memory
    transition). A majority of grants makes us a candidate; a majority of
    refusals, or our known leader answering, sends us back to following it;
    with no leader known we try again when the election timer runs out.

    A refusal that merely names the leader we already know counts as one
    refusal, not as news: the other followers of a leader that just vanished
    name it until their own fetch timeouts run out, so leaving at the first
    such answer would let only the last follower to time out win."""

    __slots__ = ("granted", "rejected", "persisted_leader", "void", "stand_at_ms", "round")

    def __init__(self, core: QuorumCore, old: RoleState):
        super().__init__(core, Role.PROSPECTIVE, old.epoch, old.leader_id, old.voted_id)
        self.persisted_leader = old.persisted_leader_id()  # unchanged on disk (a resigned leader's own id)
        self.granted = {core.node_id}
        self.rejected: set[int] = set()
        self.void = False  # our log changed under the pre-votes on their way
        self.stand_at_ms: int | None = None  # won, but deferring (see _won)
        log = core.log
        self.round = _VoteRound(lambda v: core.send(
            v, core.vote_request(v, self.epoch + 1, log.last_epoch(), log.log_end_offset, pre_vote=True),
            RequestKind.PRE_VOTE))

    def persisted_leader_id(self) -> int:
        return self.persisted_leader

    def on_enter(self, now_ms: int) -> None:
        core = self.core
        self.election_deadline_ms = now_ms + core.election_timeout()
        if core.is_majority(self.granted):
            core.become_candidate(now_ms)  # a single voter
            return
        for v in core.others:
            self.round.ask(v)

    def _asking(self) -> bool:
        return not self.void and self.stand_at_ms is None

    def vote_request_failed(self, voter: int, request_id: int, now_ms: int) -> None:
        if self._asking():
            self.round.failed(voter, request_id, now_ms)

    def deadlines(self, now_ms: int) -> list[int]:
        ds = [] if self.election_deadline_ms is None else [self.election_deadline_ms]
        if self.stand_at_ms is not None:
            ds.append(self.stand_at_ms)
        return ds + self.round.deadlines() if self._asking() else ds

    def poll(self, now_ms: int) -> None:
        core = self.core
        if core.shutting_down:
            return
        if self._asking():
            self.round.ask_again(now_ms, self.granted | self.rejected, core.others)
        if self.stand_at_ms is not None and now_ms >= self.stand_at_ms:
            # Cleared first: a quarantined voter does not become a candidate
            # (it postpones and probes), and a deadline left in the past would
            # be polled forever (sim seed 339).
            self.stand_at_ms = None
            core.become_candidate(now_ms)
        elif self.election_deadline_ms is not None and now_ms >= self.election_deadline_ms:
            self._lost(now_ms, timed_out=True)

    def _won(self, now_ms: int) -> None:
        """A majority would vote for us. If we granted another voter's
        pre-vote in this epoch lately, it is probably standing right now --
        the followers of a vanished leader time out together, each granting
        the other -- and standing too would split the vote (a lost election
        costs an election timeout and a back-off). Stand after a random
        0..election_timeout_ms/4 instead: the one whose delay ends first
        asks for real votes, and the other, still prospective, grants it."""
        core = self.core
        if self.stand_at_ms is not None:
            return
        if core.granted_pre_vote_recently(now_ms):
            self.stand_at_ms = now_ms + core.random.randrange(core.config.election_timeout_ms // 4 + 1)
            return
        core.become_candidate(now_ms)

    def _lost(self, now_ms: int, timed_out: bool) -> None:
        core = self.core
        if self.leader_id >= 0:
            core.become_follower(self.epoch, self.leader_id, now_ms)  # fetch again
            if timed_out:
                # Neither a majority nor our leader answered: it is most likely
                # gone, and the voters that refused had heard from it just
                # before us. A whole fetch timeout more before the next round
                # put silent failovers over 3 s (sim seed 20174); a live leader
                # answers the first fetch and restores the full timeout.
                core.state.stand_soon(now_ms)
        elif timed_out:
            core.stand(now_ms)  # a new round (or, quarantined, a probe)
        # else: refused with no leader known; the election timer decides.

    def grant_vote(self, req: m.VoteRequest, running_deadline: int | None, now_ms: int) -> bool:
        # A real Vote in our own epoch: as unattached / voted would answer it.
        if self.voted_id >= 0:
            return self.voted_id == req.candidate_id
        if self.leader_id >= 0 or self.persisted_leader >= 0:
            return False  # our epoch has (had) a leader
        log = self.core.log
        if log.up_to_date(req.last_offset_epoch, req.last_offset):
            self.core.become_voted(req.candidate_id, now_ms)
            return True
        return False

    def on_pre_vote_answer(self, voter: int, resp: m.Body, now_ms: int) -> None:
        core = self.core
        if self.void:
            return
        if resp.error_code == Errors.UNSUPPORTED_VERSION:
            # A peer too old for Vote v2 (pre-vote): Kafka stands at once, as
            # before KIP-996 (a mixed cluster keeps no disruption protection,
            # but never hangs its election).
            core.become_candidate(now_ms)
            return
        if not isinstance(resp, m.VoteResponse) or resp.error_code != Errors.NONE:
            return
        if resp.vote_granted:
            self.granted.add(voter)
            if core.is_majority(self.granted):
                self._won(now_ms)
            return
        if voter == self.leader_id and resp.leader_id == voter and resp.leader_epoch == self.epoch:
            core.note_leader_contact(now_ms)
            core.become_follower(self.epoch, self.leader_id, now_ms)  # our leader is alive
            return
        self.rejected.add(voter)
        if core.is_majority(self.rejected):
            self._lost(now_ms, timed_out=False)

    def on_leader_alive(self, now_ms: int) -> None:
        self.core.become_follower(self.epoch, self.leader_id, now_ms)

    def on_leader_claimed(self, leader_id: int, epoch: int, now_ms: int) -> None:
        if self.persisted_leader == self.core.node_id:
            self.core.fail(f"node {leader_id} claims leadership of epoch {epoch}, which we led")
            return
        self.core.become_follower(epoch, leader_id, now_ms)

    def on_log_cut(self, now_ms: int) -> None:
        # The pre-votes on their way were for the log we no longer have.
        self.void = True


# -- the election requests, answered the same way in every role -----------------


def probe_for_leader(core: QuorumCore) -> None:
    """A quarantined voter that hears from no leader asks the others with a
    VoteRequest in its own epoch claiming an empty log (last offset -1),
    which no voter grants and which we never count (kind PROBE). Every
    answer names the leader it knows (we follow it); a voter in an older
    epoch moves up to ours, so the others elect a leader in a newer epoch,
    which then finds us. Without it a voter quarantined as a candidate whose
    VoteRequests were lost waits forever in an epoch nobody else reached
    (sim seed 2079)."""
    for v in core.others:
        core.send(v, core.vote_request(v, core.state.epoch, NO_EPOCH, NO_OFFSET), RequestKind.PROBE)


def handle_vote(core: QuorumCore, token: Any, req: m.VoteRequest, now_ms: int) -> None:
    if not core.addressed_to_me(req.voter_id, req.voter_directory_id):
        # KIP-853: meant for another directory of this node (the one wiped).
        core.respond(token, core.error_response(req, Errors.INVALID_VOTER_KEY))
        return
    if not core.may_be_candidate(req.candidate_id, req.candidate_directory_id):
        # Not a voter, or a wiped one standing with its old node id.
        core.respond(token, core.error_response(req, Errors.INCONSISTENT_VOTER_SET))
        return
    # KIP-853 (Kafka 3.9): a replica addressed with its own voter key votes
    # even if its voter set does not name it yet -- a voter just added that
    # has not replicated the VotersRecord. Without it, a set grown to four
    # with one voter down and one quarantined could never elect (sim seed 494).
    may_vote = core.is_voter or core.addressed_by_own_key(req.voter_id, req.voter_directory_id)
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
            core.note_pre_vote_granted(now_ms)
        st = core.state
        core.respond(token, m.VoteResponse(leader_id=st.leader_id, leader_epoch=st.epoch, vote_granted=granted))
        return
    # The timer that would make us stand ourselves: an election timer, or a
    # follower's fetch timeout.
    running_deadline = core.state.running_deadline()
    if req.candidate_epoch > core.state.epoch:
        core.become_unattached(req.candidate_epoch, now_ms)
    # A quarantined voter may have forgotten records it acknowledged: it votes
    # only for a log at least as up to date as the one it had (LocalLog.
    # vote_position), so no vote depends on what it lost (docs/integrity.md).
    granted = may_vote and core.state.grant_vote(req, running_deadline, now_ms)
    st = core.state
    core.respond(token, m.VoteResponse(leader_id=st.leader_id, leader_epoch=st.epoch, vote_granted=granted))


def handle_begin_epoch(core: QuorumCore, token: Any, req: m.BeginQuorumEpochRequest, now_ms: int) -> None:
    st = core.state
    if req.leader_epoch < st.epoch:
        core.respond(token, core.error_response(req, Errors.FENCED_LEADER_EPOCH))
        return
    if req.leader_id == core.node_id:
        if not st.is_leader or req.leader_epoch != st.epoch:
            core.fail(f"told we lead epoch {req.leader_epoch}; we are {st.role} in epoch {st.epoch}")
            return
    else:
        core.learn_leader(req.leader_id, req.leader_epoch, now_ms)
        if core.fatal_reason is not None:
            return
        if core.state.leader_id == req.leader_id and core.state.epoch == req.leader_epoch:
            core.note_leader_contact(now_ms)
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
