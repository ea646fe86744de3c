"""The roles that have no leader to follow (or are giving up on it) --
unattached, voted, prospective, candidate, resigned -- KIP-595 as Kafka's
KafkaRaftClient builds it, with KIP-996's pre-vote: a voter whose timer runs
out is first prospective and becomes a candidate (epoch + 1, a persisted
vote) only once a majority said it would vote for it. ``ElectionMemory`` is
what the elections of a node remember across these roles. The answers to the
election requests (Vote, BeginQuorumEpoch, EndQuorumEpoch) are the core's,
in metalog.broker.quorum.inbound."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from metalog.broker.quorum.notify import Notifier, NotifyingRole
from metalog.broker.quorum.outbox import RETRY_BACKOFF_MS, RequestKind
from metalog.broker.quorum.roles import RETRY_BACKOFF_BASE_MS, Role, RoleContext, RoleState
from metalog.protocol import messages as m
from metalog.protocol.errors import Errors

if TYPE_CHECKING:
    from metalog.broker.quorum.api import QuorumConfig
    from metalog.broker.quorum.env import Random

NO_EPOCH = m.NO_EPOCH
NO_LEADER = m.NO_LEADER
NO_OFFSET = m.NO_OFFSET


class ElectionContext(RoleContext, Protocol):
    """What the election roles may use of their owner, beyond RoleContext:
    the transitions an election makes."""

    def stand(self, now_ms: int) -> None:
        """Ask for pre-votes (prospective), unless quarantined."""
        ...

    def become_voted(self, candidate_id: int, now_ms: int) -> None: ...

    def become_candidate(self, now_ms: int) -> None: ...

    def become_leader(self, now_ms: int) -> None: ...


class ElectionMemory:
    """What the elections of one node remember across its role changes, and
    the randomized timers drawn from them (the core's Environment.random, in
    the order the roles ask):

    * when we last heard from the leader of our epoch (a good fetch-loop
      answer, a BeginQuorumEpoch): a voter that has, within the fetch timeout,
      refuses pre-votes (KIP-996);
    * when we last granted someone's pre-vote (see ProspectiveState._won);
    * the elections stood since we last had a leader: the exponent of the
      lost-election backoff."""

    __slots__ = ("config", "random", "retries", "_leader_contact", "_pre_vote_granted")

    def __init__(self, config: QuorumConfig, rng: Random) -> None:
        self.config = config
        self.random = rng
        self.retries = 0
        # (epoch, now_ms) of the last contact / grant; epoch -1: never.
        self._leader_contact = (-1, 0)
        self._pre_vote_granted = (-1, 0)

    def timeout_ms(self) -> int:
        """Randomized election timeout: T + rand(T)."""
        t_ms = self.config.election_timeout_ms
        return t_ms + (self.random.randrange(t_ms) if t_ms > 0 else 0)

    def lost_election_backoff_ms(self) -> int:
        # Kafka's binaryExponentialElectionBackoffMs.
        retries = max(1, self.retries)
        bound = 2 << min(retries - 1, 20)
        return min(RETRY_BACKOFF_BASE_MS * self.random.randrange(bound), self.config.election_backoff_max_ms)

    def stand_delay_ms(self) -> int:
        """A prospective that won but granted another's pre-vote lately waits
        a random 0..election_timeout_ms / 4 before it stands."""
        return self.random.randrange(self.config.election_timeout_ms // 4 + 1)

    def grace_ms(self) -> int:
        """A follower whose leader seems gone stands after a random
        election_timeout_ms / 10 .. / 2 (FollowerState.stand_soon)."""
        t_ms = self.config.election_timeout_ms
        lo_ms = t_ms // 10
        return lo_ms + (self.random.randrange(t_ms // 2 - lo_ms + 1) if t_ms // 2 > lo_ms else 0)

    def note_leader_contact(self, epoch: int, now_ms: int) -> None:
        """The leader of `epoch` (ours) answered or spoke to us just now."""
        self._leader_contact = (epoch, now_ms)

    def forget_leader_contact(self) -> None:
        """The leader is leaving or gone (EndQuorumEpoch, its connection reset)."""
        self._leader_contact = (-1, 0)

    def heard_from_leader_recently(self, epoch: int, now_ms: int) -> bool:
        at_epoch, at_ms = self._leader_contact
        return at_epoch == epoch and now_ms - at_ms < self.config.fetch_timeout_ms

    def note_pre_vote_granted(self, epoch: int, now_ms: int) -> None:
        self._pre_vote_granted = (epoch, now_ms)

    def granted_pre_vote_recently(self, epoch: int, now_ms: int) -> bool:
        at_epoch, at_ms = self._pre_vote_granted
        return at_epoch == epoch and now_ms - at_ms < self.config.election_timeout_ms


def vote_request(ctx: RoleContext, voter: int, epoch: int, last_offset_epoch: int, last_offset: int,
                 pre_vote: bool = False) -> m.VoteRequest:
    """A VoteRequest from us to `voter`, carrying both replicas' keys (KIP-853)."""
    me = ctx.electorate
    return m.VoteRequest(
        cluster_id=ctx.config.cluster_id, candidate_epoch=epoch, candidate_id=me.node_id,
        last_offset_epoch=last_offset_epoch, last_offset=last_offset, pre_vote=pre_vote,
        candidate_directory_id=me.directory_id, voter_id=voter,
        voter_directory_id=me.voter_set.directory_id_of(voter))


def probe_for_leader(ctx: RoleContext, epoch: int) -> None:
    """A quarantined voter that hears from no leader asks the others with a
    VoteRequest in its own epoch claiming an empty log (last offset -1),
    which no voter grants and which we never count (kind PROBE). Every
    answer names the leader it knows (we follow it); a voter in an older
    epoch moves up to ours, so the others elect a leader in a newer epoch,
    which then finds us. Without it a voter quarantined as a candidate whose
    VoteRequests were lost waits forever in an epoch nobody else reached
    (sim seed 2079)."""
    for v in ctx.electorate.others:
        ctx.send(v, vote_request(ctx, v, epoch, NO_EPOCH, NO_OFFSET), RequestKind.PROBE)


class _WaitingForElection(RoleState):
    """A voter with no leader: stands once its election timer runs out."""

    __slots__ = ()
    ctx: ElectionContext

    def on_enter(self, now_ms: int) -> None:
        if not self.ctx.shutting_down:
            self.election_deadline_ms = now_ms + self.ctx.elections.timeout_ms()

    def on_boot(self, now_ms: int) -> None:
        ctx = self.ctx
        self.election_deadline_ms = now_ms + ctx.elections.timeout_ms()
        if ctx.electorate.others == () and ctx.electorate.is_voter:
            ctx.stand(now_ms)  # single voter: elect ourselves now

    def deadlines(self, now_ms: int) -> list[int]:
        return [] if self.election_deadline_ms is None else [self.election_deadline_ms]

    def poll(self, now_ms: int) -> None:
        ctx = self.ctx
        if (ctx.electorate.is_voter and not ctx.shutting_down
                and self.election_deadline_ms is not None and now_ms >= self.election_deadline_ms):
            ctx.stand(now_ms)


class UnattachedState(_WaitingForElection):
    __slots__ = ()

    def __init__(self, ctx: ElectionContext, epoch: int):
        super().__init__(ctx, Role.UNATTACHED, epoch, NO_LEADER, -1)

    def grant_vote(self, req: m.VoteRequest, running_deadline_ms: int | None, now_ms: int) -> bool:
        log = self.ctx.log
        if log.up_to_date(req.last_offset_epoch, req.last_offset):
            self.ctx.become_voted(req.candidate_id, now_ms)  # persisted before the answer
            return True
        if running_deadline_ms is not None and self.election_deadline_ms is not None:
            # Refused for a stale log: keep the timer that was already running,
            # else a lagging voter that keeps standing (its lost-election
            # backoff is shorter than our fresh timeout) blocks every election.
            self.election_deadline_ms = min(self.election_deadline_ms, running_deadline_ms)
        return False


class VotedState(_WaitingForElection):
    __slots__ = ()

    def __init__(self, ctx: ElectionContext, epoch: int, voted_id: int):
        super().__init__(ctx, Role.VOTED, epoch, NO_LEADER, voted_id)

    def grant_vote(self, req: m.VoteRequest, running_deadline_ms: int | None, now_ms: int) -> bool:
        return self.voted_id == req.candidate_id  # one vote per epoch


class ResignedState(NotifyingRole, _WaitingForElection):
    """A leader that stepped down keeps its epoch (graceful stop, check-quorum,
    quarantine) and tells the others with EndQuorumEpoch, most caught-up
    successor first. A restarted former leader starts here (KAFKA-10527)."""

    __slots__ = ("notifier", "successors")

    def __init__(self, ctx: ElectionContext, epoch: int, voted_id: int, successors: list[int]):
        super().__init__(ctx, Role.RESIGNED, epoch, NO_LEADER, voted_id)
        self.successors = successors
        # Armed on entering from leadership; a restarted former leader has no
        # one to tell (it does not know whom it led).
        self.notifier = Notifier(RequestKind.END, (), 0)

    def persisted_leader_id(self) -> int:
        return self.ctx.electorate.node_id  # we led this epoch; keep saying so on disk

    def on_enter(self, now_ms: int) -> None:
        ctx = self.ctx
        self.notifier = Notifier(RequestKind.END, ctx.electorate.others, now_ms)
        super().on_enter(now_ms)

    def deadlines(self, now_ms: int) -> list[int]:
        return super().deadlines(now_ms) + self.notifier.deadlines(now_ms)

    def poll(self, now_ms: int) -> None:
        self.notifier.send_due(now_ms, self._end_epoch_request, self.ctx.send)
        super().poll(now_ms)

    def _end_epoch_request(self, voter: int) -> m.EndQuorumEpochRequest:
        ctx = self.ctx
        return m.EndQuorumEpochRequest(cluster_id=ctx.config.cluster_id, leader_id=ctx.electorate.node_id,
                                       leader_epoch=self.epoch, preferred_successors=list(self.successors))

    def on_leader_claimed(self, leader_id: int, epoch: int, now_ms: int) -> None:
        self.ctx.fail(f"node {leader_id} claims leadership of epoch {epoch}, which we led")


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
        due = [v for v, at_ms in self.retry_at_ms.items() if at_ms <= now_ms]
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
    ctx: ElectionContext

    def __init__(self, ctx: ElectionContext, epoch: int):
        super().__init__(ctx, Role.CANDIDATE, epoch, NO_LEADER, ctx.electorate.node_id)
        self.granted = {ctx.electorate.node_id}
        self.rejected: set[int] = set()
        self.backing_off = False
        log = ctx.log
        self.round = _VoteRound(lambda v: ctx.send(
            v, vote_request(ctx, v, epoch, log.last_epoch(), log.log_end_offset), RequestKind.VOTE))

    def on_enter(self, now_ms: int) -> None:
        ctx = self.ctx
        ctx.elections.retries += 1  # the exponent of the next lost-election backoff
        self.election_deadline_ms = now_ms + ctx.elections.timeout_ms()
        if ctx.electorate.is_majority(self.granted):
            ctx.become_leader(now_ms)
            return
        for v in ctx.electorate.others:
            self.round.ask(v)

    def vote_request_failed(self, voter: int, request_id: int, now_ms: int) -> None:
        if not self.backing_off:
            self.round.failed(voter, request_id, now_ms)

    def deadlines(self, now_ms: int) -> list[int]:
        ds = [] if self.election_deadline_ms is None else [self.election_deadline_ms]
        return ds if self.backing_off else ds + self.round.deadlines()

    def poll(self, now_ms: int) -> None:
        if not self.backing_off:
            self.round.ask_again(now_ms, self.granted | self.rejected, self.ctx.electorate.others)
        if self.election_deadline_ms is not None and now_ms >= self.election_deadline_ms:
            if self.backing_off:
                self.ctx.stand(now_ms)  # pre-votes again before another epoch
            else:
                self.backing_off = True
                self.election_deadline_ms = now_ms + self.ctx.elections.lost_election_backoff_ms()

    def on_vote_answer(self, voter: int, resp: m.Body, now_ms: int) -> None:
        if not isinstance(resp, m.VoteResponse) or resp.error_code != Errors.NONE:
            return
        if resp.vote_granted:
            self.granted.add(voter)
            if self.ctx.electorate.is_majority(self.granted):
                self.ctx.become_leader(now_ms)
        else:
            self.rejected.add(voter)
            n = len(self.ctx.electorate.voters)
            if len(self.rejected) > n - n // 2 - 1 and not self.backing_off:
                # Lost: back off (randomized, exponential) before the next try.
                self.backing_off = True
                self.election_deadline_ms = now_ms + self.ctx.elections.lost_election_backoff_ms()

    def on_log_cut(self, now_ms: int) -> None:
        # The votes on their way were granted to the log we no longer have
        # (sim seed 318): give up the candidacy, keep our vote for the epoch.
        self.ctx.become_voted(self.ctx.electorate.node_id, now_ms)


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
    ctx: ElectionContext

    def __init__(self, ctx: ElectionContext, old: RoleState):
        super().__init__(ctx, Role.PROSPECTIVE, old.epoch, old.leader_id, old.voted_id)
        self.persisted_leader = old.persisted_leader_id()  # unchanged on disk (a resigned leader's own id)
        self.granted = {ctx.electorate.node_id}
        self.rejected: set[int] = set()
        self.void = False  # our log changed under the pre-votes on their way
        self.stand_at_ms: int | None = None  # won, but deferring (see _won)
        log = ctx.log
        self.round = _VoteRound(lambda v: ctx.send(
            v, vote_request(ctx, v, self.epoch + 1, log.last_epoch(), log.log_end_offset, pre_vote=True),
            RequestKind.PRE_VOTE))

    def persisted_leader_id(self) -> int:
        return self.persisted_leader

    def on_enter(self, now_ms: int) -> None:
        ctx = self.ctx
        self.election_deadline_ms = now_ms + ctx.elections.timeout_ms()
        if ctx.electorate.is_majority(self.granted):
            ctx.become_candidate(now_ms)  # a single voter
            return
        for v in ctx.electorate.others:
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
        ctx = self.ctx
        if ctx.shutting_down:
            return
        if self._asking():
            self.round.ask_again(now_ms, self.granted | self.rejected, ctx.electorate.others)
        if self.stand_at_ms is not None and now_ms >= self.stand_at_ms:
            # Cleared first: a quarantined voter does not become a candidate
            # (it postpones and probes), and a deadline left in the past would
            # be polled forever (sim seed 339).
            self.stand_at_ms = None
            ctx.become_candidate(now_ms)
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
        ctx = self.ctx
        if self.stand_at_ms is not None:
            return
        if ctx.elections.granted_pre_vote_recently(self.epoch, now_ms):
            self.stand_at_ms = now_ms + ctx.elections.stand_delay_ms()
            return
        ctx.become_candidate(now_ms)

    def _lost(self, now_ms: int, timed_out: bool) -> None:
        ctx = self.ctx
        if self.leader_id >= 0:
            follower = ctx.become_follower(self.epoch, self.leader_id, now_ms)  # fetch again
            if timed_out:
                # Neither a majority nor our leader answered: it is most likely
                # gone, and the voters that refused had heard from it just
                # before us. A whole fetch timeout more before the next round
                # put silent failovers over 3 s (sim seed 20174); a live leader
                # answers the first fetch and restores the full timeout.
                follower.stand_soon(now_ms)
        elif timed_out:
            ctx.stand(now_ms)  # a new round (or, quarantined, a probe)
        # else: refused with no leader known; the election timer decides.

    def grant_vote(self, req: m.VoteRequest, running_deadline_ms: int | None, now_ms: int) -> bool:
        # A real Vote in our own epoch: as unattached / voted would answer it.
        if self.voted_id >= 0:
            return self.voted_id == req.candidate_id
        if self.leader_id >= 0 or self.persisted_leader >= 0:
            return False  # our epoch has (had) a leader
        log = self.ctx.log
        if log.up_to_date(req.last_offset_epoch, req.last_offset):
            self.ctx.become_voted(req.candidate_id, now_ms)
            return True
        return False

    def on_pre_vote_answer(self, voter: int, resp: m.Body, now_ms: int) -> None:
        ctx = self.ctx
        if self.void:
            return
        if getattr(resp, "error_code", None) == Errors.UNSUPPORTED_VERSION:
            # A peer too old for Vote v2 (pre-vote): Kafka stands at once, as
            # before KIP-996 (a mixed cluster keeps no disruption protection,
            # but never hangs its election).
            ctx.become_candidate(now_ms)
            return
        if not isinstance(resp, m.VoteResponse) or resp.error_code != Errors.NONE:
            return
        if resp.vote_granted:
            self.granted.add(voter)
            if ctx.electorate.is_majority(self.granted):
                self._won(now_ms)
            return
        if voter == self.leader_id and resp.leader_id == voter and resp.leader_epoch == self.epoch:
            ctx.elections.note_leader_contact(self.epoch, now_ms)
            ctx.become_follower(self.epoch, self.leader_id, now_ms)  # our leader is alive
            return
        self.rejected.add(voter)
        if ctx.electorate.is_majority(self.rejected):
            self._lost(now_ms, timed_out=False)

    def on_leader_alive(self, now_ms: int) -> None:
        self.ctx.become_follower(self.epoch, self.leader_id, now_ms)

    def on_leader_claimed(self, leader_id: int, epoch: int, now_ms: int) -> None:
        if self.persisted_leader == self.ctx.electorate.node_id:
            self.ctx.fail(f"node {leader_id} claims leadership of epoch {epoch}, which we led")
            return
        self.ctx.become_follower(epoch, leader_id, now_ms)

    def on_log_cut(self, now_ms: int) -> None:
        # The pre-votes on their way were for the log we no longer have.
        self.void = True

