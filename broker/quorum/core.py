"""The pure quorum core: KRaft-style election and pull replication as a state machine.

``QuorumCore.step(event) -> list[Action]`` is the whole interface (see
``metalog.broker.quorum.api`` for the events, actions and the rules a driver obeys).
Nothing in here touches sockets, clocks, files or global randomness: time comes
from the events, randomness from the ``Environment`` passed in
(``metalog.broker.quorum.env``), and the local log is read only through the
``LogReader``. That is what lets the deterministic simulator (sim/) and
the asyncio runtime drive the very same code.

``QuorumCore`` is the owner: it holds what every role shares, makes every
transition (persisting first) and delegates events to the current role object
(``metalog.broker.quorum.roles``), in the manner of Kafka's QuorumState. A role
never holds the core: it gets a context, a ``typing.Protocol`` of what it may
use (``RoleContext`` and one per role module), which the core implements.
Where things live:

* ``roles``: the Role enum, RoleContext, the base role, the table of allowed
  transitions;
* ``election``: unattached, voted, prospective (pre-vote tally), candidate
  (vote tally), resigned; ``ElectionMemory`` (what elections remember across
  roles, and their random timers);
* ``leader`` (HW, appends, check-quorum, log start), ``leader_reads`` (Fetch,
  parking, FetchSnapshot, OffsetsForLeaderEpoch, ListOffsets), ``progress``
  (per-replica state, parked fetches, produce waiters), ``notify``,
  ``membership`` (voter changes, KIP-853);
* ``follower``: followers and observers (fetch loop, snapshot download);
* ``inbound``: requests (checks, fencing, the election requests) and the
  answers to our own requests, routed to the role that sent them;
* ``local_log`` (the local log view, HW, snapshots, quarantine), ``voters``
  (voter sets; ``Electorate``: this node in the latest one), ``outbox``
  (actions, request kinds and timeouts), ``answers`` (error answers, the
  cluster-id check, ApiVersions and Metadata, shared with the runtime).

What it implements, and where the rule comes from:

* Election (KIP-595 as built in Kafka's KafkaRaftClient): roles unattached,
  voted, prospective, candidate, leader, follower, resigned; non-voters are
  observers. Pre-vote (KIP-996, Kafka 4.0): a voter first asks for pre-votes
  in epoch + 1 without bumping or persisting anything, and stands only with a
  majority of them; a voter that heard from its leader within the fetch
  timeout refuses, so a node cut off by a partition bumps no epoch.
  One persisted vote per epoch, granted only to a log at least as up to date
  (last epoch, end offset). Randomized election timeout T + rand(T), binary
  exponential backoff after a lost election, fetch timeout on followers,
  BeginQuorumEpoch / EndQuorumEpoch, check-quorum (1.5 x fetch timeout), and a
  restarted former leader starts resigned (KAFKA-10527).
* Replication (KIP-320 fencing, kraft-facts "Fetch (leader side)"): epoch
  validated Fetch / OffsetsForLeaderEpoch, DivergingEpoch, snapshot redirect
  (KIP-630, KAFKA-15078), long-poll parking, consumer reads bounded by the HW.
* High watermark (the blog in seed 002): leader = majority of voters' LEOs,
  its own counted only once flushed (KAFKA-10533), only past the start of its
  own epoch (KAFKA-12619), never backwards; follower = min(own LEO, leader HW)
  after truncation (KAFKA-14704).
* KIP-501 in-sync tracking with the pending-fetch rule behind
  ``follower_fetch_pending_reads_insync_enable``.
* KAFKA-7786: every response is judged against the epoch its request was sent
  under; stale answers are dropped and fetching continues in the new epoch.

Where we depart from Kafka's timing, and why (measured in sim/, figures
in docs/simulation.md):

* Fetch-loop requests time out before the fetch timeout: a Fetch after
  fetch_max_wait_ms + fetch_timeout_ms / 4, an OffsetsForLeaderEpoch or
  FetchSnapshot after fetch_timeout_ms / 4 (never above request_timeout_ms).
  With Kafka's equal 2 s request and fetch timeouts one lost message made a
  follower stand for election; now it is retried inside the fetch timeout.
* Fast failover on a dead process: when a Fetch to the leader fails at
  connection level (the driver's reason says refused / reset /
  ConnectionLost -- what TCP reports after kill -9 while the host is up), the
  follower stands after a random 100-500 ms (election_timeout_ms / 10 .. / 2)
  instead of waiting out fetch_timeout_ms. A slow, paused or partitioned
  leader times out instead and keeps the full fetch timeout, so this never
  disrupts a live leader; a transient reset is forgotten at the next answer.
  Safety never depends on timing. A leader whose host vanishes silently is
  noticed after fetch_timeout_ms, 1000 ms by default (Kafka: 2000): with
  pre-vote a follower's false alarm bumps no epoch, so it may be short.
* The followers of a vanished leader time out together and grant each
  other's pre-votes; one that granted another's lately stands after a random
  0..election_timeout_ms / 4 instead of at once, so they do not split the vote.
* An epoch older than the leader's history (cut at its log-start snapshot) is
  answered with that snapshot's id, as KRaft's KafkaMetadataLog does; the
  follower then fetches and is sent the snapshot instead of truncating.
"""

from __future__ import annotations

from typing import Any

from metalog.broker.quorum import election, inbound
from metalog.broker.quorum.answers import error_response, metadata_response
from metalog.broker.quorum.api import (
    Action,
    AppendWaiter,
    ClientAppend,
    Event,
    Fatal,
    FlushCompleted,
    LogQuarantined,
    LogReader,
    LogView,
    PersistQuorumState,
    QuorumConfig,
    QuorumStateData,
    RequestFailed,
    RequestReceived,
    ResponseReceived,
    Shutdown,
    SnapshotCreated,
    SnapshotInstallFailed,
    StallReads,
    Tick,
)
from metalog.broker.quorum.election import (
    CandidateState,
    ElectionMemory,
    ProspectiveState,
    ResignedState,
    UnattachedState,
    VotedState,
)
from metalog.broker.quorum.env import Environment
from metalog.broker.quorum.follower import FollowerState
from metalog.broker.quorum.leader import LeaderState
from metalog.broker.quorum.local_log import LocalLog
from metalog.broker.quorum.outbox import Outbox, RequestKind
from metalog.broker.quorum.progress import ReplicaProgress
from metalog.broker.quorum.roles import ALLOWED_TRANSITIONS, MEMORY_TRANSITIONS, Role, RoleState
from metalog.broker.quorum.voters import Electorate, VoterSet
from metalog.protocol import messages as m
from metalog.protocol.invariants import InvariantViolation, invariant
from metalog.storage.epochs import EpochHistory

__all__ = ["QuorumCore", "ReplicaProgress", "Role"]

NO_LEADER = m.NO_LEADER
# A step polls the role a poll put in place, at most this many times in all.
MAX_POLLS_PER_STEP = 4


class QuorumCore:
    """One node of the quorum. Build it once per process life from what is on
    disk; feed it events; execute the actions it returns, in order."""

    def __init__(self, config: QuorumConfig, log_view: LogView, reader: LogReader,
                 quorum_state: QuorumStateData | None, env: Environment):
        # The config's own rules (ranges, fetch_max_wait_ms < fetch_timeout_ms,
        # identity): ValueError("<key>: <why>") on the first one broken.
        config.validate()
        self.config = config
        self.reader = reader
        self.random = env.random  # the only randomness the core uses; it never reads env.clock
        # 40 random bits: ids of a restarted node do not collide with old ones.
        self.outbox = Outbox(config, (self.random.getrandbits(40) << 8) + 1)
        # KIP-853: the voter set is the latest one in the log (over the
        # snapshot's, else the config's static voters: kraft version 0).
        fallback = (VoterSet.unknown_set(config.voters) if config.voters_are_bootstrap
                    else VoterSet.static(config.voters))
        self.log = LocalLog(log_view, self.outbox, self.fail, fallback, self._on_voters_changed)
        self.electorate = Electorate(config.node_id, config.directory_id, self.log.voters.latest)
        self.elections = ElectionMemory(config, self.random)
        self._fatal: str | None = None
        self._booted = False
        self.shutting_down = False
        self.now_ms = 0
        self._wall_minus_now_ms = 0  # wall clock - now_ms, from Tick/ClientAppend
        self.read_stall_until_ms = 0  # StallReads
        # (leader id, epoch, endpoints) from the last BeginQuorumEpoch of our
        # leader that carried them: the driver dials the leader there.
        self.leader_endpoints: tuple[int, int, tuple[tuple[str, str, int], ...]] | None = None
        self._voters_changed_in_step = False
        self._persist_on_boot = False
        self.state: RoleState = self._state_from_disk(quorum_state)
        if self.log.must_reach_offset >= 0:
            # Quarantined at start: the lost records' epochs are gone with them;
            # none is newer than the epoch we were in.
            self.log.must_reach_epoch = max(self.state.epoch, self.log.last_epoch())

    def _on_voters_changed(self) -> None:
        """The log's latest voter set changed (a VotersRecord appended, or
        truncated away, or a snapshot installed): it counts from now on."""
        self.electorate.refresh(self.log.voters.latest)
        st = getattr(self, "state", None)
        if isinstance(st, FollowerState):
            st.sync_voter_role()
        elif isinstance(st, LeaderState):
            st.sync_progress(self.now_ms)  # its progress table must name the voters now
        self._voters_changed_in_step = True  # other roles hear it at the end of the step

    def _state_from_disk(self, qs: QuorumStateData | None) -> RoleState:
        epoch = qs.leader_epoch if qs else 0
        if self.log.epochs.latest_epoch > epoch:
            # The log saw a newer epoch than the state file says (lost state file):
            # start unattached there, as Kafka's QuorumState does.
            epoch = self.log.epochs.latest_epoch
            self._persist_on_boot = True
            qs = None
        node_id = self.config.node_id
        if not self.electorate.is_voter:
            leader = qs.leader_id if qs and qs.leader_id >= 0 and qs.leader_id != node_id else NO_LEADER
            # An observer keeps the vote it cast (addressed by its own voter key, KIP-853).
            return FollowerState(self, epoch, leader, qs.voted_id if qs else -1)
        if qs and qs.leader_id == node_id:
            # KAFKA-10527: never resume leadership of the epoch we led before the
            # restart; we may have lost unflushed records it already promised.
            return ResignedState(self, epoch, -1, [])
        if qs and qs.leader_id >= 0:
            return FollowerState(self, epoch, qs.leader_id, qs.voted_id)
        if qs and qs.voted_id >= 0:
            return VotedState(self, epoch, qs.voted_id)
        return UnattachedState(self, epoch)

    # ------------------------------------------------------------------
    # read-only exposure (the drivers, metrics, tests)

    @property
    def role(self) -> Role:
        return self.state.role

    @property
    def is_leader(self) -> bool:
        return self.state.is_leader

    @property
    def epoch(self) -> int:
        return self.state.epoch

    @property
    def leader_id(self) -> int:
        return self.state.leader_id

    @property
    def voted_id(self) -> int:
        return self.state.voted_id

    @property
    def voter_set(self) -> VoterSet:
        return self.electorate.voter_set

    @property
    def voters(self) -> tuple[int, ...]:
        return self.electorate.voters

    @property
    def is_voter(self) -> bool:
        return self.electorate.is_voter

    @property
    def high_watermark(self) -> int:
        """Exclusive: offsets < HW are committed. NO_OFFSET (-1) until known."""
        return self.log.high_watermark

    @property
    def log_start_offset(self) -> int:
        return self.log.log_start_offset

    @property
    def log_end_offset(self) -> int:
        return self.log.log_end_offset

    @property
    def flushed_end_offset(self) -> int:
        return self.log.flushed_end_offset

    @property
    def epochs(self) -> EpochHistory:
        return EpochHistory(self.log.epochs.entries)

    @property
    def snapshots(self) -> tuple[m.SnapshotId, ...]:
        return tuple(self.log.snapshots)

    @property
    def must_reach_offset(self) -> int:
        """-1, or the offset a quarantined voter must re-replicate past before it
        votes or stands again."""
        return self.log.must_reach_offset

    @property
    def quarantined(self) -> bool:
        return self.log.must_reach_offset >= 0

    @property
    def fatal_reason(self) -> str | None:
        return self._fatal

    @property
    def replica_states(self) -> dict[int, ReplicaProgress]:
        """Leader only: per follower and observer progress (copies)."""
        return self.state.replica_states()

    def is_in_sync(self, replica_id: int, now_ms: int) -> bool:
        """KIP-501 in-sync rule, evaluated on the leader."""
        return self.state.is_in_sync(replica_id, now_ms)

    def describe_quorum(self, now_ms: int) -> m.DescribeQuorumResponse:
        return self.state.describe_quorum(now_ms)

    @property
    def parked_fetch_replicas(self) -> list[int]:
        """Leader only: the replica id of every fetch parked waiting for data
        (a follower's long poll); empty on other roles."""
        return self.state.parked_fetch_replicas()

    def metadata(self, endpoints: dict[int, tuple[str, int]] | None = None) -> m.MetadataResponse:
        """The Metadata answer: leader, epoch, HW and log start as this node
        knows them; voters' endpoints from `endpoints` (the runtime's config)."""
        st = self.state
        return metadata_response(
            cluster_id=self.config.cluster_id, node_id=self.config.node_id, leader_id=st.leader_id,
            leader_epoch=st.epoch, high_watermark=self.log.high_watermark,
            log_start_offset=self.log.log_start_offset, voters=sorted(self.electorate.voters),
            observers=st.observer_ids(), endpoints=endpoints)

    def voter_set_at(self, end_offset: int) -> VoterSet:
        """The voter set of the log below end_offset: what a snapshot ending
        there must hold (KIP-853)."""
        return self.log.voters.at(end_offset)

    def finalized_kraft_version(self) -> tuple[int, int]:
        """(kraft.version, the offset of the record that set it; -1 for
        static voters) as committed."""
        return self.log.finalized_kraft_version()

    @property
    def next_deadline_ms(self) -> int | None:
        """When the driver must feed the next Tick (None: nothing scheduled)."""
        if self._fatal is not None:
            return None
        if not self._booted:
            return 0
        ds = self.state.deadlines(self.now_ms)
        return min(ds) if ds else None

    # ------------------------------------------------------------------
    # the one entry point

    def step(self, event: Event) -> list[Action]:
        if self._fatal is not None:
            return []
        now_ms = max(event.now_ms, self.now_ms)  # time never runs backwards inside the core
        self.now_ms = now_ms
        self.outbox.actions = []
        self.log.appended_this_step = False
        if not self._booted:
            self._boot(now_ms)
        self.state.before_event(now_ms)
        self._handle(event, now_ms)
        if self._voters_changed_in_step and self._fatal is None:
            self._voters_changed_in_step = False
            self.state.on_voters_changed(now_ms)
        self._poll_until_settled(now_ms)
        if (self._fatal is None and not self.electorate.is_voter and not self.state.is_leader
                and self.state.role is not Role.OBSERVER):
            # KIP-853: a leader whose removal was pending resigned (check-quorum,
            # shutdown, a newer epoch): no voter role is left for it, and a
            # resigned non-voter would neither stand nor fetch. (Static
            # observers never get here: they are observers from the start.)
            self.become_observer(now_ms)
            self.state.poll(now_ms)
        return self.outbox.take()

    def _handle(self, ev: Event, now_ms: int) -> None:
        """The event, to whom it concerns: inbound traffic to
        metalog.broker.quorum.inbound, the rest to the log and the role."""
        if isinstance(ev, RequestReceived):
            inbound.on_request(self, ev.token, ev.request, now_ms)
        elif isinstance(ev, ResponseReceived):
            inbound.on_response(self, ev, now_ms)
        elif isinstance(ev, RequestFailed):
            inbound.on_request_failed(self, ev, now_ms)
        elif isinstance(ev, (Tick, ClientAppend)):
            if ev.wall_clock_ms >= 0:
                self._wall_minus_now_ms = ev.wall_clock_ms - now_ms
            if isinstance(ev, ClientAppend):
                self.client_append(now_ms, ev.waiters, ev.records, ev.producers, ev.prebuilt)
        elif isinstance(ev, FlushCompleted):
            if self.log.on_flushed(ev.flushed_end_offset):
                self.state.on_flushed(now_ms)
                self.log.maybe_clear_quarantine(self.electorate.may_vote_later)
        elif isinstance(ev, SnapshotCreated):
            self.log.add_snapshot(ev.snapshot_id)
        elif isinstance(ev, Shutdown):
            self.shutting_down = True
            self.state.election_deadline_ms = None
            self.state.on_shutdown(now_ms)
        elif isinstance(ev, StallReads):
            self.read_stall_until_ms = max(self.read_stall_until_ms, ev.until_ms)
            if isinstance(self.state, LeaderState):
                # Fetches parked before it have not been read yet either.
                self.state.reads.stall(self.read_stall_until_ms)
        elif isinstance(ev, LogQuarantined):
            # The driver cut the log at its last good batch (the quarantine is
            # durable): our view follows, then the role does what it must (a
            # leader resigns, a candidate withdraws, a follower re-validates).
            st = self.state
            self.log.cut_for_quarantine(ev.log_end_offset, ev.must_reach_offset, st.uncommitted_from(), st.epoch)
            st.on_log_cut(now_ms)
            self.log.maybe_clear_quarantine(self.electorate.may_vote_later)
        elif isinstance(ev, SnapshotInstallFailed):
            # The driver rejected the download and kept its log: so do we.
            self.log.rollback_install(ev.snapshot_id)
            self.state.on_log_rewound(now_ms)
        else:
            raise TypeError(f"unknown event type {type(ev).__name__}")

    def _poll_until_settled(self, now_ms: int) -> None:
        """Poll the current role; a role that a poll replaced is polled too, in
        the same step: a prospective whose round times out becomes a follower
        inside its own poll, and that follower's first Fetch must go out now,
        not at its fetch timeout (by which time it would stand again: a loop
        that never fetched, found by a real-process membership test). Bounded:
        every hop is a transition, and a role polled right after entering
        stays put, so a few hops always settle."""
        for _ in range(MAX_POLLS_PER_STEP):
            if self._fatal is not None:
                return
            polled = self.state
            polled.poll(now_ms)
            if self.state is polled:
                return

    def _boot(self, now_ms: int) -> None:
        self._booted = True
        if self._persist_on_boot:
            self._persist(self.state)
        self.log.maybe_clear_quarantine(self.electorate.may_vote_later)
        self.state.on_boot(now_ms)

    def client_append(self, now_ms: int, waiters: list[AppendWaiter], records: list[bytes],
                      producers: list[tuple[int, int, int] | None] | None = None, prebuilt: bool = False) -> None:
        """Records to append as one (ClientAppend, a Produce): the leader
        appends them, any other role refuses them."""
        inbound.check_client_append(waiters, records, producers, prebuilt)
        self.state.client_append(waiters, records, now_ms, producers, prebuilt)

    # ------------------------------------------------------------------
    # role transitions: the only place the role changes

    def _persist(self, state: RoleState) -> None:
        self.outbox.actions.append(PersistQuorumState(self.election_state(state)))

    def election_state(self, state: RoleState) -> QuorumStateData:
        """What PersistQuorumState writes for `state`."""
        return QuorumStateData(state.epoch, state.persisted_leader_id(), state.voted_id, self.electorate.voters)

    def transition(self, new: RoleState, now_ms: int) -> None:
        """Kafka's durableTransitionTo: persist the new role's election state
        (the action comes before any answer the new role gives), make it the
        current role, let it start, then let the old one answer what only it
        could (a former leader's waiting writes and parked fetches)."""
        old = self.state
        # The table is checked in production too (not an assert: python -O keeps it).
        invariant(new.role in ALLOWED_TRANSITIONS[old.role], "no transition from %s to %s", old.role, new.role)
        invariant(new.epoch >= old.epoch, "epoch would go back from %d to %d", old.epoch, new.epoch)
        if (old.role, new.role) in MEMORY_TRANSITIONS:
            invariant(self.election_state(new) == self.election_state(old),
                      "%s -> %s keeps the election on disk, yet %s differs from %s", old.role, new.role,
                      self.election_state(new), self.election_state(old))
        elif self.election_state(new) != self.election_state(old):
            self._persist(new)
        # (else the disk already says it: e.g. a prospective back to following
        # its leader, KIP-996 -- no write, no fsync)
        self.state = new
        new.on_enter(now_ms)
        old.on_exit(now_ms)

    def become_unattached(self, epoch: int, now_ms: int) -> None:
        old = self.state
        invariant(epoch > old.epoch, "unattached in epoch %d, not past %d", epoch, old.epoch)
        if self.electorate.is_voter:
            self.transition(UnattachedState(self, epoch), now_ms)
            return
        if not isinstance(old, FollowerState):
            # A voter role (or a leader) whose node a VotersRecord of this
            # step removed (KIP-853): an observer now, in the new epoch.
            self.transition(FollowerState(self, epoch, NO_LEADER, -1), now_ms)
            return
        # An observer stays one, without a leader; its fetch loop keeps its pace.
        self.transition(FollowerState(self, epoch, NO_LEADER, -1, start=False,
                                      fetch_retry_at_ms=old.fetch_retry_at_ms,
                                      need_epoch_check=old.need_epoch_check), now_ms)

    def become_observer(self, now_ms: int) -> None:
        """We left the voter set (KIP-853): replicate as an observer, keeping
        the epoch, the leader we know and the vote we cast in it. A leader
        gets here once the VotersRecord that removed it is committed."""
        st = self.state
        node_id = self.config.node_id
        invariant(not self.electorate.is_voter, "node %d is a voter: it cannot become an observer", node_id)
        leader = st.leader_id if st.leader_id != node_id else NO_LEADER
        self.transition(FollowerState(self, st.epoch, leader, st.voted_id), now_ms)

    def become_leaderless_voter(self, now_ms: int) -> None:
        """A follower with no leader that the voter set just made a voter:
        unattached, or voted if it voted in this epoch (the vote is kept)."""
        st = self.state
        if not (isinstance(st, FollowerState) and st.leader_id < 0 and self.electorate.is_voter):
            raise InvariantViolation(f"a leaderless voter comes from a leaderless follower, not {st.role}")
        new = VotedState(self, st.epoch, st.voted_id) if st.voted_id >= 0 else UnattachedState(self, st.epoch)
        self.transition(new, now_ms)

    def become_voted(self, candidate_id: int, now_ms: int) -> None:
        self.transition(VotedState(self, self.state.epoch, candidate_id), now_ms)

    def stand(self, now_ms: int) -> None:
        """Start an election -- unless quarantined: first ask the voters for
        pre-votes (KIP-996) in our epoch + 1, bumping and persisting nothing."""
        invariant(self.electorate.is_voter, "node %d stands but is not a voter", self.config.node_id)
        if not self._postponed_for_quarantine(now_ms):
            self.transition(ProspectiveState(self, self.state), now_ms)

    def become_candidate(self, now_ms: int) -> None:
        """A majority would vote for us: stand for real in the next epoch
        (persisted vote for ourselves)."""
        st = self.state
        if not isinstance(st, ProspectiveState):
            raise InvariantViolation(f"a candidate comes from prospective, not {st.role}")
        if not self._postponed_for_quarantine(now_ms):
            self.transition(CandidateState(self, st.epoch + 1), now_ms)

    def _postponed_for_quarantine(self, now_ms: int) -> bool:
        """A quarantined voter does not stand before it holds again everything
        it may have acknowledged: it waits an election timeout and probes."""
        if not self.quarantined:
            return False
        self.state.postpone_candidacy(now_ms)
        election.probe_for_leader(self, self.state.epoch)
        return True

    def become_leader(self, now_ms: int) -> None:
        cand = self.state
        if not isinstance(cand, CandidateState):
            raise InvariantViolation(f"a leader comes from candidate, not {cand.role}")
        self.elections.retries = 0
        self.transition(LeaderState(self, cand.epoch, cand.voted_id, sorted(cand.granted), now_ms), now_ms)

    def become_follower(self, epoch: int, leader_id: int, now_ms: int) -> RoleState:
        node_id = self.config.node_id
        invariant(leader_id >= 0 and leader_id != node_id, "node %d cannot follow leader %d", node_id, leader_id)
        old = self.state
        voted = old.voted_id if epoch == old.epoch else -1
        self.elections.retries = 0
        self.transition(FollowerState(self, epoch, leader_id, voted), now_ms)
        return self.state

    def resign(self, now_ms: int) -> RoleState:
        """Leader steps down but keeps the epoch (graceful, check-quorum, quarantine)."""
        leader = self.state
        if not isinstance(leader, LeaderState):
            raise InvariantViolation(f"only a leader resigns, not {leader.role}")
        self.transition(ResignedState(self, leader.epoch, leader.voted_id, leader.successors()), now_ms)
        return self.state

    def fail(self, reason: str) -> None:
        if self._fatal is None:
            self._fatal = reason
            self.outbox.actions.append(Fatal(reason))

    # ------------------------------------------------------------------
    # what the roles may use besides (their contexts: roles.RoleContext and
    # one per role module)

    def timestamp_ms(self, now_ms: int) -> int:
        """Batch timestamp: the driver's wall clock, as of its last report."""
        return max(0, now_ms + self._wall_minus_now_ms)

    def send(self, destination: int, body: m.Body, kind: RequestKind, position: int = 0) -> int:
        return self.outbox.send(destination, body, kind, self.state.epoch, position)

    def respond(self, token: Any, body: m.Body) -> None:
        self.outbox.respond(token, body)

    def emit(self, action: Action) -> None:
        self.outbox.actions.append(action)

    def current_leader(self) -> m.LeaderIdAndEpoch:
        return m.LeaderIdAndEpoch(self.state.leader_id, self.state.epoch)

    def error_response(self, req: m.Body, code: int, message: str | None = None) -> m.Body:
        return error_response(req, code, message, self.current_leader())

    def handle_fetch(self, token: Any, req: m.FetchRequest, now_ms: int, completing: bool) -> None:
        """A Fetch, new or parked (completing): see metalog.broker.quorum.inbound."""
        inbound.handle_fetch(self, token, req, now_ms, completing)
