"""The pure quorum core: KRaft-style election and pull replication as a state machine.

``QuorumCore.step(event) -> list[Action]`` is the whole interface (see
``metalog.broker.quorum.api`` for the events, actions and the rules a driver obeys).
Nothing in here touches sockets, clocks, files or global randomness: time comes
from the events, randomness from the ``Environment`` passed in
(``metalog.broker.quorum.env``), and the local log is read only through the
``LogReader``. That is what lets the deterministic simulator (sim/) and
the asyncio runtime drive the very same code.

``QuorumCore`` is the facade: it owns what every role shares and delegates to
the current role object (``metalog.broker.quorum.roles``), in the manner of Kafka's
QuorumState. Where things live:

* ``roles``: the Role enum, the base role, the table of allowed transitions;
* ``election``: unattached, voted, prospective (pre-vote tally), candidate
  (vote tally), resigned, and the Vote / BeginQuorumEpoch / EndQuorumEpoch
  answers;
* ``leader`` (HW, appends, check-quorum, log start), ``leader_reads`` (Fetch,
  parking, FetchSnapshot, OffsetsForLeaderEpoch, ListOffsets), ``progress``
  (per-replica state, parked fetches, produce waiters), ``notify``;
* ``follower``: followers and observers (fetch loop, snapshot download);
* ``log`` (the local log view, HW, snapshots, quarantine), ``outbox``
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
from metalog.broker.quorum.election import CandidateState, ProspectiveState, ResignedState, UnattachedState, VotedState
from metalog.broker.quorum.env import Environment
from metalog.broker.quorum.follower import FollowerState
from metalog.broker.quorum.leader import LeaderState
from metalog.broker.quorum.local_log import LocalLog
from metalog.broker.quorum.outbox import FETCH_LOOP, NOTIFICATIONS, Outbox, RequestKind
from metalog.broker.quorum.progress import ReplicaProgress
from metalog.broker.quorum.roles import ALLOWED_TRANSITIONS, MEMORY_TRANSITIONS, RETRY_BACKOFF_BASE_MS, Role, RoleState
from metalog.broker.quorum.voters import VoterSet
from metalog.protocol import messages as m
from metalog.protocol.errors import Errors
from metalog.protocol.invariants import InvariantViolation, invariant
from metalog.storage.epochs import EpochHistory

__all__ = ["QuorumCore", "ReplicaProgress", "Role"]

NO_LEADER = m.NO_LEADER
# A step polls the role a poll put in place, at most this many times in all.
MAX_POLLS_PER_STEP = 4


class QuorumCore:
    """One node of the quorum. Build it once per process life from what is on
    disk; feed it events; execute the actions it returns, in order."""

    def __init__(
        self,
        config: QuorumConfig,
        log_view: LogView,
        reader: LogReader,
        quorum_state: QuorumStateData | None,
        env: Environment,
    ):
        # The config's own rules (ranges, fetch_max_wait_ms < fetch_timeout_ms,
        # identity): ValueError("<key>: <why>") on the first one broken.
        config.validate()
        self.config = config
        self.reader = reader
        self.random = env.random  # the only randomness the core uses; it never reads env.clock
        self.node_id = config.node_id
        self.directory_id = config.directory_id
        # 40 random bits: ids of a restarted node do not collide with old ones.
        self.outbox = Outbox(config, (self.random.getrandbits(40) << 8) + 1)
        # KIP-853: the voter set is the latest one in the log (over the
        # snapshot's, else the config's static voters: kraft version 0).
        fallback = (VoterSet.unknown_set(config.voters) if config.voters_are_bootstrap
                    else VoterSet.static(config.voters))
        self.log = LocalLog(log_view, self.outbox, self.fail, fallback, self._on_voters_changed)
        self._refresh_voters()

        self._fatal: str | None = None
        self._booted = False
        self.shutting_down = False
        self.now_ms = 0
        self._wall_minus_now_ms = 0  # wall clock - now_ms, from Tick/ClientAppend
        self.election_retries = 0  # elections stood since we last had a leader (backoff exponent)
        self.read_stall_until_ms = 0  # StallReads
        # KIP-996: when we last heard from the leader of our epoch (a good
        # fetch-loop answer, a BeginQuorumEpoch); a voter that has, within the
        # fetch timeout, refuses pre-votes. (epoch, now_ms); epoch -1: never.
        self._leader_contact: tuple[int, int] = (-1, 0)
        # When we last granted someone's pre-vote: (epoch, now_ms); see
        # ProspectiveState._won.
        self._pre_vote_granted: tuple[int, int] = (-1, 0)
        self.appended_this_step = False
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
        self._handlers = {
            RequestReceived: lambda ev, now_ms: inbound.on_request(self, ev.token, ev.request, now_ms),
            ResponseReceived: self._on_response,
            Tick: lambda ev, now_ms: self._learn_wall_clock(ev.wall_clock_ms, now_ms),
            FlushCompleted: self._on_flush,
            ClientAppend: self._on_client_append,
            RequestFailed: self._on_request_failed,
            SnapshotCreated: lambda ev, now_ms: self.log.add_snapshot(ev.snapshot_id),
            Shutdown: self._on_shutdown,
            StallReads: self._on_stall_reads,
            LogQuarantined: self._on_quarantined,
            SnapshotInstallFailed: self._on_install_failed,
        }

    def _refresh_voters(self) -> None:
        """The views of the latest voter set the hot paths read."""
        vs = self.voter_set = self.log.voters.latest
        self.voters = vs.ids
        self.others = tuple(v for v in self.voters if v != self.node_id)
        # A wiped dir has a new directory id: not the voter the set names.
        self.is_voter = vs.is_voter(self.node_id, self.directory_id)
        self.hw_index = len(self.voters) // 2

    def _on_voters_changed(self) -> None:
        """The log's latest voter set changed (a VotersRecord appended, or
        truncated away, or a snapshot installed): it counts from now on."""
        self._refresh_voters()
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
        if not self.is_voter:
            leader = qs.leader_id if qs and qs.leader_id >= 0 and qs.leader_id != self.node_id else NO_LEADER
            # An observer keeps the vote it cast (addressed by its own voter key, KIP-853).
            return FollowerState(self, epoch, leader, qs.voted_id if qs else -1)
        if qs and qs.leader_id == self.node_id:
            # KAFKA-10527: never resume leadership of the epoch we led before the
            # restart; we may have lost unflushed records it already promised.
            return ResignedState(self, epoch, -1, [])
        if qs and qs.leader_id >= 0:
            return FollowerState(self, epoch, qs.leader_id, qs.voted_id)
        if qs and qs.voted_id >= 0:
            return VotedState(self, epoch, qs.voted_id)
        return UnattachedState(self, epoch)

    # ------------------------------------------------------------------
    # read-only exposure

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
        reads = getattr(self.state, "reads", None)
        return sorted(p.request.replica_id for p in reads.parked) if reads is not None else []

    def metadata(self, endpoints: dict[int, tuple[str, int]] | None = None) -> m.MetadataResponse:
        """The Metadata answer: leader, epoch, HW and log start as this node
        knows them; voters' endpoints from `endpoints` (the runtime's config)."""
        st = self.state
        return metadata_response(
            cluster_id=self.config.cluster_id, node_id=self.node_id, leader_id=st.leader_id,
            leader_epoch=st.epoch, high_watermark=self.log.high_watermark,
            log_start_offset=self.log.log_start_offset, voters=sorted(self.voters),
            observers=st.observer_ids(), endpoints=endpoints)

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
        now_ms = event.now_ms
        if now_ms < self.now_ms:
            now_ms = self.now_ms  # time never runs backwards inside the core
        self.now_ms = now_ms
        self.outbox.actions = []
        self.appended_this_step = False
        if not self._booted:
            self._boot(now_ms)
        self.state.before_event(now_ms)
        handler = self._handlers.get(type(event))
        if handler is None:
            raise TypeError(f"unknown event type {type(event).__name__}")
        handler(event, now_ms)
        if self._voters_changed_in_step and self._fatal is None:
            self._voters_changed_in_step = False
            self.state.on_voters_changed(now_ms)
        self._poll_until_settled(now_ms)
        if (self._fatal is None and not self.is_voter and not self.state.is_leader
                and self.state.role is not Role.OBSERVER):
            # KIP-853: a leader whose removal was pending resigned (check-quorum,
            # shutdown, a newer epoch): no voter role is left for it, and a
            # resigned non-voter would neither stand nor fetch. (Static
            # observers never get here: they are observers from the start.)
            self.become_observer(now_ms)
            self.state.poll(now_ms)
        return self.outbox.take()

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
        self.log.maybe_clear_quarantine(self.may_vote_later)
        self.state.on_boot(now_ms)

    # ------------------------------------------------------------------
    # role transitions: the only place the role changes

    def _persist(self, state: RoleState) -> None:
        self.outbox.actions.append(PersistQuorumState(self.election_state(state)))

    def election_state(self, state: RoleState) -> QuorumStateData:
        """What PersistQuorumState writes for `state`."""
        return QuorumStateData(state.epoch, state.persisted_leader_id(), state.voted_id, self.voters)

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
        if self.is_voter:
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
        invariant(not self.is_voter, "node %d is a voter: it cannot become an observer", self.node_id)
        leader = st.leader_id if st.leader_id != self.node_id else NO_LEADER
        self.transition(FollowerState(self, st.epoch, leader, st.voted_id), now_ms)

    def become_leaderless_voter(self, now_ms: int) -> None:
        """A follower with no leader that the voter set just made a voter:
        unattached, or voted if it voted in this epoch (the vote is kept)."""
        st = self.state
        if not (isinstance(st, FollowerState) and st.leader_id < 0 and self.is_voter):
            raise InvariantViolation(f"a leaderless voter comes from a leaderless follower, not {st.role} "
                                     f"(leader {st.leader_id}, voter {self.is_voter})")
        new = VotedState(self, st.epoch, st.voted_id) if st.voted_id >= 0 else UnattachedState(self, st.epoch)
        self.transition(new, now_ms)

    def become_voted(self, candidate_id: int, now_ms: int) -> None:
        self.transition(VotedState(self, self.state.epoch, candidate_id), now_ms)

    def stand(self, now_ms: int) -> None:
        """Start an election -- unless quarantined: first ask the voters for
        pre-votes (KIP-996) in our epoch + 1, bumping and persisting nothing."""
        invariant(self.is_voter, "node %d stands but is not a voter", self.node_id)
        if self.quarantined:
            # Not before we hold again everything we may have acknowledged.
            self.state.postpone_candidacy(now_ms)
            election.probe_for_leader(self)
            return
        self.transition(ProspectiveState(self, self.state), now_ms)

    def become_candidate(self, now_ms: int) -> None:
        """A majority would vote for us: stand for real in the next epoch
        (persisted vote for ourselves)."""
        st = self.state
        if not isinstance(st, ProspectiveState):
            raise InvariantViolation(f"a candidate comes from prospective, not {st.role}")
        if self.quarantined:
            self.state.postpone_candidacy(now_ms)
            election.probe_for_leader(self)
            return
        self.transition(CandidateState(self, st.epoch + 1), now_ms)

    @property
    def may_vote_later(self) -> bool:
        """Could this node vote without restarting? A voter; or anyone once
        the voter set lives in the log (KIP-853): replicating a VotersRecord
        can make it one. A quarantine is kept until re-replicated for it."""
        return self.is_voter or self.voter_set.kraft_version == 1

    def is_majority(self, ids: set[int]) -> bool:
        """Do `ids` make a majority of the voter set? (The one place elections
        count voters.)"""
        return self.voter_set.is_majority(ids)

    def voter_set_at(self, end_offset: int) -> VoterSet:
        """The voter set of the log below end_offset: what a snapshot ending
        there must hold (KIP-853)."""
        return self.log.voters.at(end_offset)

    def finalized_kraft_version(self) -> tuple[int, int]:
        """(kraft.version, the offset of the record that set it; -1 for
        static voters) as committed: the voter set below our HW."""
        hw = max(self.log.high_watermark, 0)
        at = [off for off, _ in self.log.voters.entries if off < hw]
        vs = self.log.voters.at(hw)
        return vs.kraft_version, (at[-1] if at else -1)

    def is_voter_key(self, replica_id: int, directory_id: str) -> bool:
        """Is (replica_id, directory_id) a voter? A directory id the set does
        not know (static voters) is not checked."""
        return self.voter_set.is_voter(replica_id, directory_id)

    def may_be_candidate(self, candidate_id: int, directory_id: str) -> bool:
        """May (candidate_id, directory_id) ask for our vote? A voter of our
        set may. With the voter set in the log (KIP-853) so may a node our
        set does not name at all: our set may lag the candidate's (a
        VotersRecord we have not replicated yet added it), and the candidate
        counts its majority in its own set. A node id our set names with
        another directory is a wiped replica: never."""
        vs = self.voter_set
        if vs.is_voter(candidate_id, directory_id):
            return True
        return (vs.kraft_version == 1 and directory_id != m.NO_DIRECTORY_ID
                and (vs.unknown or candidate_id not in vs.directory_ids))

    def addressed_by_own_key(self, voter_id: int, voter_directory_id: str) -> bool:
        """Does a Vote name this very replica, node id and directory id both
        (KIP-853)? Such a request comes from a candidate whose voter set has
        us as a voter, even if ours does not yet: we vote, by the usual rules."""
        return (voter_id == self.node_id and self.directory_id != m.NO_DIRECTORY_ID
                and voter_directory_id == self.directory_id)

    def addressed_to_me(self, voter_id: int, voter_directory_id: str) -> bool:
        """Kafka's isValidVoterKey: a Vote or BeginQuorumEpoch naming the voter
        it is for names this node and, if both sides know it, this very
        directory (a wiped and reformatted dir is another replica)."""
        if voter_id >= 0 and voter_id != self.node_id:
            return False
        return (voter_directory_id == m.NO_DIRECTORY_ID or self.directory_id == m.NO_DIRECTORY_ID
                or voter_directory_id == self.directory_id)

    def vote_request(self, voter: int, epoch: int, last_offset_epoch: int, last_offset: int,
                     pre_vote: bool = False) -> m.VoteRequest:
        """A VoteRequest from us to `voter`, carrying both replicas' keys (KIP-853)."""
        return m.VoteRequest(
            cluster_id=self.config.cluster_id, candidate_epoch=epoch, candidate_id=self.node_id,
            last_offset_epoch=last_offset_epoch, last_offset=last_offset, pre_vote=pre_vote,
            candidate_directory_id=self.directory_id, voter_id=voter,
            voter_directory_id=self.voter_set.directory_id_of(voter))

    def note_leader_contact(self, now_ms: int) -> None:
        """The leader of our epoch answered or spoke to us just now."""
        self._leader_contact = (self.state.epoch, now_ms)

    def forget_leader_contact(self) -> None:
        """The leader is leaving or gone (EndQuorumEpoch, its connection reset)."""
        self._leader_contact = (-1, 0)

    def note_pre_vote_granted(self, now_ms: int) -> None:
        self._pre_vote_granted = (self.state.epoch, now_ms)

    def granted_pre_vote_recently(self, now_ms: int) -> bool:
        epoch, at_ms = self._pre_vote_granted
        return epoch == self.state.epoch and now_ms - at_ms < self.config.election_timeout_ms

    def heard_from_leader_recently(self, now_ms: int) -> bool:
        epoch, at_ms = self._leader_contact
        return epoch == self.state.epoch and now_ms - at_ms < self.config.fetch_timeout_ms

    def become_leader(self, now_ms: int) -> None:
        cand = self.state
        if not isinstance(cand, CandidateState):
            raise InvariantViolation(f"a leader comes from candidate, not {cand.role}")
        self.election_retries = 0
        self.transition(LeaderState(self, cand.epoch, cand.voted_id, sorted(cand.granted), now_ms), now_ms)

    def become_follower(self, epoch: int, leader_id: int, now_ms: int) -> None:
        invariant(leader_id >= 0 and leader_id != self.node_id, "node %d cannot follow leader %d",
                  self.node_id, leader_id)
        old = self.state
        voted = old.voted_id if epoch == old.epoch else -1
        self.election_retries = 0
        self.transition(FollowerState(self, epoch, leader_id, voted), now_ms)

    def resign(self, now_ms: int) -> None:
        """Leader steps down but keeps the epoch (graceful, check-quorum, quarantine)."""
        leader = self.state
        if not isinstance(leader, LeaderState):
            raise InvariantViolation(f"only a leader resigns, not {leader.role}")
        self.transition(ResignedState(self, leader.epoch, leader.voted_id, leader.successors()), now_ms)

    def learn_leader(self, leader_id: int, epoch: int, now_ms: int) -> None:
        """Someone told us (leader_id, epoch): move forward if it is news."""
        st = self.state
        if epoch > st.epoch:
            if leader_id >= 0 and leader_id != self.node_id:
                self.become_follower(epoch, leader_id, now_ms)
            else:
                self.become_unattached(epoch, now_ms)
        elif epoch == st.epoch and leader_id >= 0 and leader_id != self.node_id:
            if st.leader_id == NO_LEADER:
                st.on_leader_claimed(leader_id, epoch, now_ms)
            elif st.leader_id != leader_id:
                self.fail(f"two leaders in epoch {epoch}: {st.leader_id} and {leader_id}")

    def fail(self, reason: str) -> None:
        if self._fatal is None:
            self._fatal = reason
            self.outbox.actions.append(Fatal(reason))

    # ------------------------------------------------------------------
    # shared helpers for the roles

    def election_timeout(self) -> int:
        t = self.config.election_timeout_ms
        return t + (self.random.randrange(t) if t > 0 else 0)

    def lost_election_backoff(self) -> int:
        # Kafka's binaryExponentialElectionBackoffMs.
        retries = max(1, self.election_retries)
        bound = 2 << min(retries - 1, 20)
        return min(RETRY_BACKOFF_BASE_MS * self.random.randrange(bound), self.config.election_backoff_max_ms)

    def _learn_wall_clock(self, wall_clock_ms: int, now_ms: int) -> None:
        if wall_clock_ms >= 0:
            self._wall_minus_now_ms = wall_clock_ms - now_ms

    def timestamp(self, now_ms: int) -> int:
        """Batch timestamp: the driver's wall clock, as of its last report."""
        return max(0, now_ms + self._wall_minus_now_ms)

    def send(self, destination: int, body: m.Body, kind: RequestKind, position: int = 0) -> int:
        return self.outbox.send(destination, body, kind, self.state.epoch, position)

    def respond(self, token: Any, body: m.Body) -> None:
        self.outbox.respond(token, body)

    def current_leader(self) -> m.LeaderIdAndEpoch:
        return m.LeaderIdAndEpoch(self.state.leader_id, self.state.epoch)

    def error_response(self, req: m.Body, code: int, message: str | None = None) -> m.Body:
        return error_response(req, code, message, self.current_leader())

    def handle_fetch(self, token: Any, req: m.FetchRequest, now_ms: int, completing: bool) -> None:
        """A Fetch, new or parked (completing): see metalog.broker.quorum.inbound."""
        inbound.handle_fetch(self, token, req, now_ms, completing)

    # ------------------------------------------------------------------
    # other events

    def _on_client_append(self, ev: ClientAppend, now_ms: int) -> None:
        self._learn_wall_clock(ev.wall_clock_ms, now_ms)
        self.client_append(now_ms, ev.waiters, ev.records, ev.producers)

    def client_append(self, now_ms: int, waiters: list[AppendWaiter], records: list[bytes],
                      producers: list[tuple[int, int, int] | None] | None = None) -> None:
        total = sum(n for _, n in waiters)
        if total != len(records) or any(n <= 0 for _, n in waiters):
            raise ValueError(
                f"ClientAppend waiters count {total} records in total but {len(records)} were given")
        if producers is not None:
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
        self.state.client_append(waiters, records, now_ms, producers)

    def _on_flush(self, ev: FlushCompleted, now_ms: int) -> None:
        if self.log.on_flushed(ev.flushed_end_offset):
            self.state.on_flushed(now_ms)
            self.log.maybe_clear_quarantine(self.may_vote_later)

    def _on_shutdown(self, ev: Shutdown, now_ms: int) -> None:
        self.shutting_down = True
        self.state.election_deadline_ms = None
        self.state.on_shutdown(now_ms)

    def _on_stall_reads(self, ev: StallReads, now_ms: int) -> None:
        self.read_stall_until_ms = max(self.read_stall_until_ms, ev.until_ms)
        reads = getattr(self.state, "reads", None)
        if reads is not None:
            reads.stall(self.read_stall_until_ms)  # fetches parked before it have not been read yet either

    def _on_quarantined(self, ev: LogQuarantined, now_ms: int) -> None:
        """The driver cut the log at the last good batch (the quarantine state
        is already durable). Fix our view; then each role does what it must (a
        leader resigns, a candidate withdraws, a follower re-validates)."""
        must = ev.must_reach_offset
        uncommitted = self.state.uncommitted_from()
        if uncommitted is not None:
            # A leader that lost only records nobody can have committed has
            # forgotten nothing a vote depends on: it needs to re-replicate only
            # up to its high watermark. Otherwise, if the only other copy of the
            # lost tail is on a replica that never stands (a voter whose removal
            # is in that tail), no leader could ever be elected (sim seed 1127).
            must = min(must, uncommitted)
        self.log.cut_for_quarantine(ev.log_end_offset, must, self.state.epoch)
        self.state.on_log_cut(now_ms)
        self.log.maybe_clear_quarantine(self.may_vote_later)

    def _on_install_failed(self, ev: SnapshotInstallFailed, now_ms: int) -> None:
        """The driver rejected the download and kept its log: so do we."""
        self.log.rollback_install(ev.snapshot_id)
        self.state.on_log_rewound(now_ms)

    def _on_request_failed(self, ev: RequestFailed, now_ms: int) -> None:
        req = self.outbox.settle(ev.request_id)
        if req is None:
            return
        if req.kind in FETCH_LOOP:
            self.state.fetch_failed(ev.request_id, ev.destination, ev.reason, req.epoch, now_ms)
        elif req.kind in NOTIFICATIONS:
            self.state.notification_failed(req.destination, ev.request_id, now_ms)
        elif req.kind is RequestKind.MEMBERSHIP:
            self.state.on_membership_failed(ev.request_id, now_ms)
        elif req.kind in (RequestKind.VOTE, RequestKind.PRE_VOTE):
            self.state.vote_request_failed(ev.destination, ev.request_id, now_ms)
        # PROBE: the quarantined voter keeps waiting for its election timeout.

    def _on_response(self, ev: ResponseReceived, now_ms: int) -> None:
        req = self.outbox.settle(ev.request_id)
        if req is None:
            return
        resp = ev.response
        # Whatever the request, a newer epoch in the answer is news we act on.
        cl = getattr(resp, "current_leader", None)
        if cl is not None:
            self.learn_leader(cl.leader_id, cl.leader_epoch, now_ms)
        elif isinstance(resp, (m.VoteResponse, m.BeginQuorumEpochResponse, m.EndQuorumEpochResponse)):
            self.learn_leader(resp.leader_id, resp.leader_epoch, now_ms)
        if self._fatal is not None:
            return
        kind = req.kind
        if kind in FETCH_LOOP:
            if not self.state.fetch_answered(ev.request_id):
                return  # superseded by a role or epoch change
        elif kind in NOTIFICATIONS:
            self.state.notification_answered(req.destination, ev.request_id)
        if req.epoch != self.state.epoch or kind is RequestKind.PROBE:
            return  # KAFKA-7786: sent under an older epoch; a probe's news was learnt above
        if kind is RequestKind.MEMBERSHIP:
            self.state.on_membership_answer(ev.request_id, resp, now_ms)
        elif kind is RequestKind.VOTE:
            self.state.on_vote_answer(ev.destination, resp, now_ms)
        elif kind is RequestKind.PRE_VOTE:
            self.state.on_pre_vote_answer(ev.destination, resp, now_ms)
        elif kind in NOTIFICATIONS:
            ok = getattr(resp, "error_code", -1) == Errors.NONE
            self.state.notification_judged(req.destination, ok, now_ms)
        else:
            self.state.on_fetch_answer(kind, ev.destination, req.position, resp, now_ms)
