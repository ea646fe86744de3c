"""The pure quorum core: KRaft-style election and pull replication as a state machine.

``QuorumCore.step(event) -> list[Action]`` is the whole interface (see
``broker.quorum.api`` for the events, actions and the rules a driver obeys).
Nothing in here touches sockets, clocks, files or global randomness: time comes
from the events, randomness from the ``random.Random`` passed in, and the local
log is read only through the ``LogReader``. That is what lets the deterministic
simulator (tests/sim) and the asyncio runtime drive the very same code.

What it implements, and where the rule comes from:

* Election (KIP-595 as built in Kafka's KafkaRaftClient): roles unattached,
  voted, candidate, leader, follower, resigned; non-voters are observers.
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

Where we depart from Kafka's timing, and why (measured in tests/sim, figures
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
  still noticed only after fetch_timeout_ms (p50 about 2 s).
* An epoch older than the leader's history (cut at its log-start snapshot) is
  answered with that snapshot's id, as KRaft's KafkaMetadataLog does; the
  follower then fetches and is sent the snapshot instead of truncating.
"""

from __future__ import annotations

import enum
import random as _random_mod
from collections import deque
from dataclasses import dataclass
from typing import Any

from broker.quorum.api import (
    Action,
    AdvanceLogStart,
    AppendBatches,
    ClearQuarantine,
    ClientAppend,
    CorruptionFound,
    Event,
    Fatal,
    FlushCompleted,
    FlushLog,
    InstallSnapshot,
    LogQuarantined,
    LogReader,
    LogView,
    PersistQuorumState,
    QuorumConfig,
    QuorumStateData,
    RequestFailed,
    RequestReceived,
    Respond,
    ResponseReceived,
    SendRequest,
    Shutdown,
    SnapshotCreated,
    SnapshotInstallFailed,
    StallReads,
    Tick,
    TruncateLog,
    WriteEpochCheckpoint,
    WriteSnapshotChunk,
)
from protocol import messages as m
from protocol.apis import APIS
from protocol.errors import Errors
from storage.batch import CorruptBatchError, encode_batch, iter_batches
from storage.errors import StorageError
from storage.control_records import LeaderChange, encode_control
from storage.epochs import EpochHistory

NO_EPOCH = m.NO_EPOCH
NO_LEADER = m.NO_LEADER
NO_OFFSET = m.NO_OFFSET

# Kafka's RETRY_BACKOFF_BASE_MS: unit of the election backoffs.
RETRY_BACKOFF_BASE_MS = 100
# Pause before re-sending a failed Fetch / BeginQuorumEpoch / EndQuorumEpoch.
FETCH_RETRY_BACKOFF_MS = 50
# A connection-level failure of a request to the leader (refused, reset: the
# driver's reason names it) means its process is gone, not slow -- what TCP
# reports after kill -9 while the host is up. Reasons that contain one of these.
CONNECTION_FAILURE_MARKERS = ("connectionlost", "refused", "reset")
# Bounds on what a leader keeps for others.
MAX_OBSERVERS = 1024
MAX_PARKED_FETCHES = 4096
# ListOffsets-by-timestamp reads the log in chunks of this size.
SCAN_CHUNK_BYTES = 1 << 20


def _is_connection_failure(reason: str) -> bool:
    low = reason.lower()
    return any(mark in low for mark in CONNECTION_FAILURE_MARKERS)


class Role(enum.StrEnum):
    UNATTACHED = "unattached"
    VOTED = "voted"
    CANDIDATE = "candidate"
    LEADER = "leader"
    FOLLOWER = "follower"
    RESIGNED = "resigned"
    OBSERVER = "observer"


@dataclass(slots=True)
class ReplicaProgress:
    """What the leader knows of one follower or observer (KIP-501, blog)."""

    replica_id: int
    log_end_offset: int = NO_OFFSET  # the fetch offset of its last valid fetch
    last_fetch_ms: int = -1  # arrival of its last valid fetch
    last_caught_up_ms: int = -1
    last_read_ms: int = -1  # when its previous fetch was served
    leader_leo_at_last_read: int = NO_OFFSET  # our LEO when that fetch was served
    last_contact_ms: int = -1  # check-quorum liveness (fetch or fetch-snapshot)
    pending_offset: int | None = None  # fetch offset of a fetch still pending
    pending_prev_leo: int = NO_OFFSET  # leader_leo_at_last_read when it arrived


@dataclass(slots=True)
class _Parked:
    token: Any
    request: m.FetchRequest
    arrival_ms: int
    deadline_ms: int
    not_before_ms: int  # a stalled read (StallReads) is never answered earlier
    woken: bool = False  # data arrived in a step the driver had not applied yet


@dataclass(slots=True)
class _Outstanding:
    kind: str  # "fetch", "epoch_check", "fetch_snapshot", "vote", "begin", "end"
    epoch: int  # our epoch when the request was sent (KAFKA-7786)
    destination: int
    position: int = 0  # fetch_snapshot: the requested position


@dataclass(slots=True)
class _Download:
    snapshot_id: m.SnapshotId
    position: int


class QuorumCore:
    """One node of the quorum. Build it once per process life from what is on
    disk; feed it events; execute the actions it returns, in order."""

    def __init__(
        self,
        config: QuorumConfig,
        log_view: LogView,
        reader: LogReader,
        quorum_state: QuorumStateData | None,
        random: _random_mod.Random,
    ):
        if not config.voters:
            raise ValueError("QuorumConfig.voters is empty: a quorum needs at least one voter")
        if log_view.log_start_offset > log_view.log_end_offset:
            raise ValueError(
                f"log start offset {log_view.log_start_offset} is past the log end offset "
                f"{log_view.log_end_offset}"
            )
        self.config = config
        self._reader = reader
        self._random = random
        self._node_id = config.node_id
        self._voters = tuple(config.voters)
        self._others = tuple(v for v in self._voters if v != self._node_id)
        self._is_voter = config.node_id in self._voters
        self._hw_index = len(self._voters) // 2

        self._log_start_offset = log_view.log_start_offset
        self._log_end_offset = log_view.log_end_offset
        self._flushed_end_offset = log_view.log_end_offset  # recovery: all on disk counts
        self._epochs = EpochHistory(log_view.epochs)
        self._snapshots: list[m.SnapshotId] = sorted(log_view.snapshots)
        self._high_watermark = NO_OFFSET
        # Quarantine (issue 12): the log end this voter had before corruption cut
        # it, which it may have acknowledged. Until the flushed end reaches it,
        # the voter neither grants votes nor stands. -1: not quarantined.
        self._must_reach_offset = log_view.must_reach_offset
        self._wall_minus_now_ms = 0  # wall clock - now_ms, from Tick/ClientAppend

        qs = quorum_state
        self._epoch = qs.leader_epoch if qs else 0
        self._leader_id = NO_LEADER
        self._voted_id = -1
        self._persist_on_boot = False
        if self._epochs.latest_epoch > self._epoch:
            # The log saw a newer epoch than the state file says (lost state file):
            # start unattached there, as Kafka's QuorumState does.
            self._epoch = self._epochs.latest_epoch
            self._persist_on_boot = True
            qs = None
        if not self._is_voter:
            self._role = Role.OBSERVER
            if qs and qs.leader_id >= 0 and qs.leader_id != self._node_id:
                self._leader_id = qs.leader_id
        elif qs and qs.leader_id == self._node_id:
            # KAFKA-10527: never resume leadership of the epoch we led before the
            # restart; we may have lost unflushed records it already promised.
            self._role = Role.RESIGNED
        elif qs and qs.leader_id >= 0:
            self._role = Role.FOLLOWER
            self._leader_id = qs.leader_id
            self._voted_id = qs.voted_id
        elif qs and qs.voted_id >= 0:
            self._role = Role.VOTED
            self._voted_id = qs.voted_id
        else:
            self._role = Role.UNATTACHED

        self._booted = False
        self._fatal: str | None = None
        self._shutting_down = False
        self._now_ms = 0
        self._out: list[Action] = []
        # 40 random bits: ids of a restarted node do not collide with old ones.
        self._next_request_id = (random.getrandbits(40) << 8) + 1
        self._outstanding: dict[int, _Outstanding] = {}

        # timers (None = not armed)
        self._election_deadline_ms: int | None = None
        self._fetch_deadline_ms: int | None = None
        # candidate
        self._granted: set[int] = set()
        self._rejected: set[int] = set()
        self._backing_off = False
        self._election_retries = 0
        # follower / observer fetch loop
        self._fetch_inflight: int | None = None
        self._fetch_retry_at_ms = 0
        self._need_epoch_check = False
        self._download: _Download | None = None
        # Our log as it was before the last InstallSnapshot, until it is known
        # to have succeeded (rolled back by SnapshotInstallFailed).
        self._pre_install: tuple | None = None
        # leader
        self._epoch_start_offset = NO_OFFSET
        self._replicas: dict[int, ReplicaProgress] = {}
        self._observers: dict[int, ReplicaProgress] = {}
        self._parked: list[_Parked] = []
        self._waiters: deque[tuple[int, Any, int, int]] = deque()  # (end, token, base, epoch)
        self._notify_unacked: set[int] = set()  # Begin/EndQuorumEpoch not yet acked
        self._notify_inflight: dict[int, int] = {}  # voter -> request id
        self._notify_retry_at: dict[int, int] = {}
        self._preferred_successors: list[int] = []
        self._check_quorum_deadline_ms: int | None = None
        self._lbo_wait: tuple[int, int] | None = None  # (candidate LBO, since ms)
        self._read_stall_until_ms = 0
        self._appended_this_step = False

    # ------------------------------------------------------------------
    # read-only exposure

    @property
    def node_id(self) -> int:
        return self._node_id

    @property
    def role(self) -> Role:
        return self._role

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def leader_id(self) -> int:
        return self._leader_id

    @property
    def voted_id(self) -> int:
        return self._voted_id

    @property
    def high_watermark(self) -> int:
        """Exclusive: offsets < HW are committed. NO_OFFSET (-1) until known."""
        return self._high_watermark

    @property
    def log_start_offset(self) -> int:
        return self._log_start_offset

    @property
    def log_end_offset(self) -> int:
        return self._log_end_offset

    @property
    def flushed_end_offset(self) -> int:
        return self._flushed_end_offset

    @property
    def epochs(self) -> EpochHistory:
        return EpochHistory(self._epochs.entries)

    @property
    def snapshots(self) -> tuple[m.SnapshotId, ...]:
        return tuple(self._snapshots)

    @property
    def must_reach_offset(self) -> int:
        """-1, or the offset a quarantined voter must re-replicate past before it
        votes or stands again."""
        return self._must_reach_offset

    @property
    def quarantined(self) -> bool:
        return self._must_reach_offset >= 0

    @property
    def fatal_reason(self) -> str | None:
        return self._fatal

    @property
    def replica_states(self) -> dict[int, ReplicaProgress]:
        """Leader only: per follower and observer progress (copies)."""
        out = {}
        for rid, st in (*self._replicas.items(), *self._observers.items()):
            out[rid] = ReplicaProgress(**{f: getattr(st, f) for f in ReplicaProgress.__slots__})
        return out

    def is_in_sync(self, replica_id: int, now_ms: int) -> bool:
        """KIP-501 in-sync rule, evaluated on the leader."""
        if self._role != Role.LEADER:
            return False
        if replica_id == self._node_id:
            return True
        st = self._replicas.get(replica_id) or self._observers.get(replica_id)
        if st is None or st.log_end_offset < 0:
            return False
        if st.log_end_offset >= self._log_end_offset:
            return True  # same LEO as the leader: in sync whatever the clock says
        if st.last_caught_up_ms >= 0 and now_ms - st.last_caught_up_ms <= self.config.replica_lag_time_max_ms:
            return True
        return (
            self.config.follower_fetch_pending_reads_insync_enable
            and st.pending_offset is not None
            and st.pending_prev_leo >= 0  # a first read after a reset proves nothing
            and st.pending_offset >= st.pending_prev_leo
        )

    def describe_quorum(self, now_ms: int) -> m.DescribeQuorumResponse:
        if self._role != Role.LEADER:
            return m.DescribeQuorumResponse(
                error_code=Errors.NOT_LEADER_OR_FOLLOWER, leader_id=self._exposed_leader(),
                leader_epoch=self._epoch,
            )
        voters = []
        for v in self._voters:
            if v == self._node_id:
                voters.append(m.ReplicaState(v, self._log_end_offset, now_ms, now_ms, True))
            else:
                voters.append(self._replica_state(self._replicas[v], now_ms))
        observers = [self._replica_state(st, now_ms) for st in self._observers.values()]
        return m.DescribeQuorumResponse(
            leader_id=self._node_id, leader_epoch=self._epoch,
            high_watermark=self._high_watermark, voters=voters, observers=observers,
        )

    def _replica_state(self, st: ReplicaProgress, now_ms: int) -> m.ReplicaState:
        return m.ReplicaState(
            st.replica_id, st.log_end_offset, st.last_fetch_ms, st.last_caught_up_ms,
            self.is_in_sync(st.replica_id, now_ms),
        )

    @property
    def next_deadline_ms(self) -> int | None:
        """When the driver must feed the next Tick (None: nothing scheduled)."""
        if self._fatal is not None:
            return None
        if not self._booted:
            return 0
        ds: list[int] = []
        role = self._role
        now = self._now_ms
        if role == Role.LEADER:
            if self._check_quorum_deadline_ms is not None:
                ds.append(self._check_quorum_deadline_ms)
            for p in self._parked:
                ds.append(max(p.not_before_ms, now) if p.woken else p.deadline_ms)
            if self._lbo_wait is not None:
                ds.append(self._lbo_wait[1] + self.config.max_replication_lag_ms)
        elif self._election_deadline_ms is not None and role in (
            Role.UNATTACHED, Role.VOTED, Role.CANDIDATE, Role.RESIGNED
        ):
            ds.append(self._election_deadline_ms)
        # Retries already due were sent by the last step; only future ones count.
        if role in (Role.LEADER, Role.RESIGNED):
            for v in self._notify_unacked:
                at = self._notify_retry_at.get(v, 0)
                if v not in self._notify_inflight and at > now:
                    ds.append(at)
        if role in (Role.FOLLOWER, Role.OBSERVER):
            if self._fetch_deadline_ms is not None and self._leader_id >= 0:
                ds.append(self._fetch_deadline_ms)
            # While our appended data is unflushed, FlushCompleted wakes us: no tick.
            if (self._fetch_inflight is None and self._fetch_retry_at_ms > now
                    and self._flushed_end_offset >= self._log_end_offset):
                ds.append(self._fetch_retry_at_ms)
        return min(ds) if ds else None

    # ------------------------------------------------------------------
    # record timestamps

    def _learn_wall_clock(self, wall_clock_ms: int, now: int) -> None:
        if wall_clock_ms >= 0:
            self._wall_minus_now_ms = wall_clock_ms - now

    def _timestamp(self, now: int) -> int:
        """Batch timestamp: the driver's wall clock, as of its last report."""
        return max(0, now + self._wall_minus_now_ms)

    # ------------------------------------------------------------------
    # the one entry point

    def step(self, event: Event) -> list[Action]:
        if self._fatal is not None:
            return []
        now = event.now_ms
        if now < self._now_ms:
            now = self._now_ms  # time never runs backwards inside the core
        self._now_ms = now
        self._out = []
        self._appended_this_step = False
        if not self._booted:
            self._boot(now)
        if self._parked and self._role == Role.LEADER:
            # The driver has applied the appends that woke these: read them now.
            self._complete_parked(now, lambda p: p.woken)
        t = type(event)
        if t is RequestReceived:
            self._on_request(event.token, event.request, now)
        elif t is ResponseReceived:
            self._on_response(event, now)
        elif t is Tick:
            self._learn_wall_clock(event.wall_clock_ms, now)
        elif t is FlushCompleted:
            self._on_flush(event.flushed_end_offset, now)
        elif t is ClientAppend:
            self._learn_wall_clock(event.wall_clock_ms, now)
            self._client_append(now, event.waiters, event.records)
        elif t is RequestFailed:
            self._on_request_failed(event, now)
        elif t is SnapshotCreated:
            self._on_snapshot_created(event.snapshot_id, now)
        elif t is Shutdown:
            self._on_shutdown(now)
        elif t is StallReads:
            self._read_stall_until_ms = max(self._read_stall_until_ms, event.until_ms)
        elif t is LogQuarantined:
            self._on_quarantined(event, now)
        elif t is SnapshotInstallFailed:
            self._on_install_failed(event, now)
        else:
            raise TypeError(f"unknown event type {t.__name__}")
        if self._fatal is None:
            self._poll(now)
        out, self._out = self._out, []
        return out

    # ------------------------------------------------------------------
    # boot and role transitions

    def _boot(self, now: int) -> None:
        self._booted = True
        if self._persist_on_boot:
            self._persist()
        self._maybe_clear_quarantine()
        role = self._role
        if role in (Role.UNATTACHED, Role.VOTED, Role.RESIGNED):
            self._election_deadline_ms = now + self._election_timeout()
            if self._others == () and self._is_voter:
                self._become_candidate(now)  # single voter: elect ourselves now
        elif role in (Role.FOLLOWER, Role.OBSERVER):
            self._start_following(now)

    def _persist(self) -> None:
        leader = self._leader_id
        if self._role == Role.RESIGNED:
            leader = self._node_id  # we led this epoch; keep saying so on disk
        self._out.append(PersistQuorumState(
            QuorumStateData(self._epoch, leader, self._voted_id, self._voters)
        ))

    def _set_epoch(self, epoch: int) -> None:
        assert epoch >= self._epoch, f"epoch would go back from {self._epoch} to {epoch}"
        if epoch > self._epoch:
            self._epoch = epoch
            self._voted_id = -1
            self._leader_id = NO_LEADER

    def _election_timeout(self) -> int:
        t = self.config.election_timeout_ms
        return t + (self._random.randrange(t) if t > 0 else 0)

    def _lost_election_backoff(self) -> int:
        # Kafka's binaryExponentialElectionBackoffMs.
        retries = max(1, self._election_retries)
        bound = 2 << min(retries - 1, 20)
        return min(RETRY_BACKOFF_BASE_MS * self._random.randrange(bound),
                   self.config.election_backoff_max_ms)

    def _leave_role(self, now: int) -> None:
        """Tidy up what the old role owned before taking a new one."""
        old = self._role
        self._fetch_inflight = None
        self._download = None
        self._backing_off = False
        self._fetch_deadline_ms = None
        self._election_deadline_ms = None
        if old in (Role.LEADER, Role.RESIGNED):
            self._notify_unacked.clear()
            self._notify_inflight.clear()
            self._notify_retry_at.clear()
            self._check_quorum_deadline_ms = None
            self._lbo_wait = None
        return None

    def _after_leadership(self, now: int) -> None:
        """Answer everyone who waited on us as leader: we no longer are."""
        cl = self._current_leader()
        while self._waiters:
            _, token, _, _ = self._waiters.popleft()
            self._respond(token, m.ProduceResponse(
                error_code=Errors.NOT_LEADER_OR_FOLLOWER, current_leader=cl,
                error_message="leadership lost before the records were committed",
            ))
        parked, self._parked = self._parked, []
        for p in parked:
            self._handle_fetch(p.token, p.request, now, completing=True)
        self._replicas.clear()
        self._observers.clear()

    def _become_unattached(self, epoch: int, now: int) -> None:
        was_leading = self._role == Role.LEADER
        self._leave_role(now)
        self._set_epoch(epoch)
        self._leader_id = NO_LEADER
        self._role = Role.UNATTACHED if self._is_voter else Role.OBSERVER
        self._persist()
        if self._is_voter and not self._shutting_down:
            self._election_deadline_ms = now + self._election_timeout()
        if was_leading:
            self._after_leadership(now)

    def _become_voted(self, candidate_id: int, now: int) -> None:
        self._leave_role(now)
        self._voted_id = candidate_id
        self._role = Role.VOTED
        self._persist()  # before the VoteResponse that follows in the action list
        if not self._shutting_down:
            self._election_deadline_ms = now + self._election_timeout()

    def _become_candidate(self, now: int) -> None:
        assert self._is_voter
        if self.quarantined:
            # Not before we hold again everything we may have acknowledged.
            self._election_deadline_ms = now + self._election_timeout()
            if self._role in (Role.FOLLOWER, Role.OBSERVER):
                self._fetch_deadline_ms = now + self.config.fetch_timeout_ms
            self._probe_for_leader()
            return
        self._leave_role(now)
        self._set_epoch(self._epoch + 1)
        self._voted_id = self._node_id
        self._role = Role.CANDIDATE
        self._persist()
        self._granted = {self._node_id}
        self._rejected = set()
        self._election_retries += 1
        self._election_deadline_ms = now + self._election_timeout()
        if len(self._granted) > len(self._voters) // 2:
            self._become_leader(now)
            return
        last_epoch = self._last_epoch()
        for v in self._others:
            self._send(v, m.VoteRequest(
                cluster_id=self.config.cluster_id, candidate_epoch=self._epoch,
                candidate_id=self._node_id, last_offset_epoch=last_epoch,
                last_offset=self._log_end_offset,
            ), "vote")

    def _probe_for_leader(self) -> None:
        """A quarantined voter that hears from no leader asks the others with a
        VoteRequest in its own epoch claiming an empty log (last offset -1),
        which no voter grants and which we never count (kind "probe"). Every
        answer names the leader it knows (we follow it); a voter in an older
        epoch moves up to ours, so the others elect a leader in a newer epoch,
        which then finds us. Without it a voter quarantined as a candidate whose
        VoteRequests were lost waits forever in an epoch nobody else reached
        (sim seed 2079)."""
        for v in self._others:
            self._send(v, m.VoteRequest(
                cluster_id=self.config.cluster_id, candidate_epoch=self._epoch,
                candidate_id=self._node_id, last_offset_epoch=NO_EPOCH, last_offset=NO_OFFSET,
            ), "probe")

    def _become_leader(self, now: int) -> None:
        granted = sorted(self._granted)
        self._leave_role(now)
        self._role = Role.LEADER
        self._leader_id = self._node_id
        self._election_retries = 0
        self._persist()
        self._replicas = {v: ReplicaProgress(v, last_contact_ms=now) for v in self._others}
        self._observers = {}
        self._notify_unacked = set(self._others)
        self._notify_retry_at = {v: now for v in self._others}
        self._lbo_wait = None
        self._epoch_start_offset = self._log_end_offset
        self._update_check_quorum_deadline()
        # The epoch's first record: LeaderChange. The HW may not move until it is
        # committed (KAFKA-12619), which is what makes the HW safe to expose.
        value = encode_control(LeaderChange(self._node_id, list(self._voters), granted))
        self._append_local(encode_batch(self._log_end_offset, self._epoch, [value], self._timestamp(now),
                                        is_control=True), 1)

    def _become_follower(self, epoch: int, leader_id: int, now: int) -> None:
        assert leader_id >= 0 and leader_id != self._node_id
        was_leading = self._role == Role.LEADER
        self._leave_role(now)
        self._set_epoch(epoch)
        self._leader_id = leader_id
        self._role = Role.FOLLOWER if self._is_voter else Role.OBSERVER
        self._election_retries = 0
        self._persist()
        self._start_following(now)
        if was_leading:
            self._after_leadership(now)

    def _start_following(self, now: int) -> None:
        self._fetch_inflight = None
        self._download = None
        self._fetch_retry_at_ms = now
        self._fetch_deadline_ms = now + self.config.fetch_timeout_ms
        # KIP-320: a new leader (or epoch) first validates our log's end.
        self._need_epoch_check = self._leader_id >= 0 and self._log_end_offset > self._log_start_offset

    def _resign(self, now: int) -> None:
        """Leader steps down but keeps the epoch (graceful or check-quorum)."""
        assert self._role == Role.LEADER
        replicas = self._replicas
        self._preferred_successors = sorted(
            self._others, key=lambda v: (-replicas[v].log_end_offset, v)
        )
        self._leave_role(now)
        self._role = Role.RESIGNED
        self._leader_id = NO_LEADER
        self._notify_unacked = set(self._others)
        self._notify_retry_at = {v: now for v in self._others}
        if not self._shutting_down:
            self._election_deadline_ms = now + self._election_timeout()
        self._after_leadership(now)

    def _learn_leader(self, leader_id: int, epoch: int, now: int) -> None:
        """Someone told us (leader_id, epoch): move forward if it is news."""
        if epoch > self._epoch:
            if leader_id >= 0 and leader_id != self._node_id:
                self._become_follower(epoch, leader_id, now)
            else:
                self._become_unattached(epoch, now)
        elif epoch == self._epoch and leader_id >= 0 and leader_id != self._node_id:
            if self._leader_id == NO_LEADER:
                if self._role == Role.RESIGNED:
                    self._fail(f"node {leader_id} claims leadership of epoch {epoch}, which we led")
                else:
                    self._become_follower(epoch, leader_id, now)
            elif self._leader_id != leader_id:
                self._fail(
                    f"two leaders in epoch {epoch}: {self._leader_id} and {leader_id}"
                )

    def _fail(self, reason: str) -> None:
        if self._fatal is None:
            self._fatal = reason
            self._out.append(Fatal(reason))

    # ------------------------------------------------------------------
    # timers

    def _poll(self, now: int) -> None:
        role = self._role
        if role == Role.LEADER:
            if self._check_quorum_deadline_ms is not None and now >= self._check_quorum_deadline_ms:
                self._update_check_quorum_deadline()
                if now >= self._check_quorum_deadline_ms:
                    self._resign(now)  # a majority has gone quiet: step down
                    self._poll(now)
                    return
            if self._parked:
                self._complete_parked(now, lambda p: p.deadline_ms <= now)
            self._send_notifications(now)
            self._maybe_advance_log_start(now)
        elif role == Role.CANDIDATE:
            if self._election_deadline_ms is not None and now >= self._election_deadline_ms:
                if self._backing_off:
                    self._become_candidate(now)
                else:
                    self._backing_off = True
                    self._election_deadline_ms = now + self._lost_election_backoff()
        elif role in (Role.UNATTACHED, Role.VOTED, Role.RESIGNED):
            if role == Role.RESIGNED:
                self._send_notifications(now)
            if (self._is_voter and not self._shutting_down
                    and self._election_deadline_ms is not None and now >= self._election_deadline_ms):
                self._become_candidate(now)
        elif role in (Role.FOLLOWER, Role.OBSERVER):
            if (self._leader_id >= 0 and self._fetch_deadline_ms is not None
                    and now >= self._fetch_deadline_ms):
                if self._is_voter:
                    if not self._shutting_down:
                        self._become_candidate(now)
                    return
                # An observer forgets the silent leader and rediscovers one.
                self._leader_id = NO_LEADER
                self._persist()
                self._start_following(now)
            self._maybe_send_fetch(now)

    def _update_check_quorum_deadline(self) -> None:
        need = len(self._voters) // 2  # other voters needed besides ourselves
        if need == 0:
            self._check_quorum_deadline_ms = None
            return
        contacts = sorted((self._replicas[v].last_contact_ms for v in self._others), reverse=True)
        self._check_quorum_deadline_ms = contacts[need - 1] + (3 * self.config.fetch_timeout_ms) // 2

    def _send_notifications(self, now: int) -> None:
        """BeginQuorumEpoch (leader) / EndQuorumEpoch (resigned) until acked."""
        for v in sorted(self._notify_unacked):
            if v in self._notify_inflight or now < self._notify_retry_at.get(v, 0):
                continue
            if self._role == Role.LEADER:
                body = m.BeginQuorumEpochRequest(
                    cluster_id=self.config.cluster_id, leader_id=self._node_id,
                    leader_epoch=self._epoch,
                )
                self._notify_inflight[v] = self._send(v, body, "begin")
            else:
                body = m.EndQuorumEpochRequest(
                    cluster_id=self.config.cluster_id, leader_id=self._node_id,
                    leader_epoch=self._epoch, preferred_successors=list(self._preferred_successors),
                )
                self._notify_inflight[v] = self._send(v, body, "end")

    # ------------------------------------------------------------------
    # outbound

    def _send(self, destination: int, body: m.Body, kind: str, position: int = 0) -> int:
        rid = self._next_request_id
        self._next_request_id += 1
        self._outstanding[rid] = _Outstanding(kind, self._epoch, destination, position)
        self._out.append(SendRequest(destination, rid, body, self._request_timeout_ms(kind)))
        return rid

    def _request_timeout_ms(self, kind: str) -> int:
        """The fetch loop's requests give up well before the fetch timeout, so a
        single lost request or answer is retried instead of costing an election:
        with request timeout = fetch timeout (2 s each by default) one lost
        message made the follower stand (sim: endless elections at 2 % loss).
        A Fetch may be parked for fetch_max_wait_ms, hence its allowance."""
        cfg = self.config
        if kind == "fetch":
            return min(cfg.request_timeout_ms, cfg.fetch_max_wait_ms + cfg.fetch_timeout_ms // 4)
        if kind in ("epoch_check", "fetch_snapshot"):
            return min(cfg.request_timeout_ms, cfg.fetch_timeout_ms // 4)
        if kind in ("begin", "end"):
            # A voter learns the new leader only from BeginQuorumEpoch: a lost one
            # must be re-sent before the voter's election timer (>= the election
            # timeout) makes it stand and depose the leader (sim seed 6059).
            return min(cfg.request_timeout_ms, cfg.election_timeout_ms // 2)
        return cfg.request_timeout_ms

    def _respond(self, token: Any, body: m.Body) -> None:
        self._out.append(Respond(token, body))

    def _exposed_leader(self) -> int:
        return self._leader_id

    def _current_leader(self) -> m.LeaderIdAndEpoch:
        return m.LeaderIdAndEpoch(self._leader_id, self._epoch)

    def _error_response(self, req: m.Body, code: int, message: str | None = None) -> m.Body:
        cl = self._current_leader()
        t = type(req)
        if t is m.FetchRequest:
            return m.FetchResponse(error_code=code, current_leader=cl, error_message=message)
        if t is m.OffsetsForLeaderEpochRequest:
            return m.OffsetsForLeaderEpochResponse(error_code=code, current_leader=cl)
        if t is m.FetchSnapshotRequest:
            return m.FetchSnapshotResponse(error_code=code, current_leader=cl)
        if t is m.ProduceRequest:
            return m.ProduceResponse(error_code=code, current_leader=cl, error_message=message)
        if t is m.ListOffsetsRequest:
            return m.ListOffsetsResponse(error_code=code, current_leader=cl)
        if t is m.VoteRequest:
            return m.VoteResponse(error_code=code, leader_id=cl.leader_id, leader_epoch=cl.leader_epoch)
        if t is m.BeginQuorumEpochRequest:
            return m.BeginQuorumEpochResponse(
                error_code=code, leader_id=cl.leader_id, leader_epoch=cl.leader_epoch)
        if t is m.EndQuorumEpochRequest:
            return m.EndQuorumEpochResponse(
                error_code=code, leader_id=cl.leader_id, leader_epoch=cl.leader_epoch)
        if t is m.DescribeQuorumRequest:
            return m.DescribeQuorumResponse(
                error_code=code, leader_id=cl.leader_id, leader_epoch=cl.leader_epoch)
        return m.ErrorResponse(error_code=code, error_message=message or "")

    def _fence_client(self, current_leader_epoch: int, sentinel_allowed: bool) -> int:
        """KIP-320: a client that does not know the epoch (NO_EPOCH) is not
        fenced, only sent to the leader; replicas are always fenced."""
        if sentinel_allowed and current_leader_epoch == NO_EPOCH:
            return Errors.NONE if self._role == Role.LEADER else Errors.NOT_LEADER_OR_FOLLOWER
        return self._fence(current_leader_epoch)

    def _fence(self, current_leader_epoch: int) -> int:
        """KIP-320 epoch check of a leader-only request; NONE if it may proceed."""
        if current_leader_epoch < self._epoch:
            return Errors.FENCED_LEADER_EPOCH
        if current_leader_epoch > self._epoch:
            return Errors.UNKNOWN_LEADER_EPOCH
        if self._role != Role.LEADER:
            return Errors.NOT_LEADER_OR_FOLLOWER
        return Errors.NONE

    # ------------------------------------------------------------------
    # inbound requests

    def _on_request(self, token: Any, req: m.Body, now: int) -> None:
        t = type(req)
        if t is m.FetchRequest:
            self._handle_fetch(token, req, now, completing=False)
            return
        cluster = getattr(req, "cluster_id", None)
        if cluster is not None and cluster != self.config.cluster_id:
            self._respond(token, self._error_response(
                req, Errors.INCONSISTENT_CLUSTER_ID,
                f"cluster id {cluster!r} does not match ours {self.config.cluster_id!r}"))
            return
        sender = req.leader_id if t in (m.BeginQuorumEpochRequest, m.EndQuorumEpochRequest) else None
        if sender is not None and sender not in self._voters:
            self._respond(token, self._error_response(req, Errors.INCONSISTENT_VOTER_SET))
            return
        if t is m.VoteRequest:
            self._handle_vote(token, req, now)
        elif t is m.BeginQuorumEpochRequest:
            self._handle_begin_epoch(token, req, now)
        elif t is m.EndQuorumEpochRequest:
            self._handle_end_epoch(token, req, now)
        elif t is m.OffsetsForLeaderEpochRequest:
            self._handle_offsets_for_epoch(token, req)
        elif t is m.FetchSnapshotRequest:
            self._handle_fetch_snapshot(token, req, now)
        elif t is m.ProduceRequest:
            if not req.records:
                self._respond(token, self._error_response(
                    req, Errors.INVALID_REQUEST, "a produce request must carry at least one record"))
                return
            self._client_append(now, [(token, len(req.records))], list(req.records))
        elif t is m.DescribeQuorumRequest:
            self._respond(token, self.describe_quorum(now))
        elif t is m.ListOffsetsRequest:
            self._handle_list_offsets(token, req)
        elif t is m.MetadataRequest:
            self._respond(token, self._metadata())
        elif t is m.ApiVersionsRequest:
            self._respond(token, m.ApiVersionsResponse(api_keys=[
                m.ApiVersionRange(int(k), lo, hi) for k, (_, _, lo, hi) in APIS.items()]))
        else:
            self._respond(token, m.ErrorResponse(
                error_code=Errors.INVALID_REQUEST,
                error_message=f"the quorum does not serve {t.__name__}"))

    # -- election ---------------------------------------------------------

    def _handle_vote(self, token: Any, req: m.VoteRequest, now: int) -> None:
        if req.candidate_id not in self._voters:
            self._respond(token, self._error_response(req, Errors.INCONSISTENT_VOTER_SET))
            return
        if req.candidate_epoch < self._epoch:
            self._respond(token, self._error_response(req, Errors.FENCED_LEADER_EPOCH))
            return
        # The timer that would make us stand ourselves: an election timer, or a
        # follower's fetch timeout.
        running_deadline = self._election_deadline_ms if self._election_deadline_ms is not None \
            else self._fetch_deadline_ms
        if req.candidate_epoch > self._epoch:
            self._become_unattached(req.candidate_epoch, now)
        granted = False
        if self.quarantined:
            # We may have forgotten records we acknowledged: a vote now could
            # elect a leader without them (docs/integrity.md). Refuse.
            pass
        elif self._role == Role.UNATTACHED:
            ours = (self._last_epoch(), self._log_end_offset)
            if (req.last_offset_epoch, req.last_offset) >= ours:
                self._become_voted(req.candidate_id, now)  # persisted before the answer
                granted = True
            elif running_deadline is not None and self._election_deadline_ms is not None:
                # Refused for a stale log: keep the timer that was already running,
                # else a lagging voter that keeps standing (its lost-election
                # backoff is shorter than our fresh timeout) blocks every election.
                self._election_deadline_ms = min(self._election_deadline_ms, running_deadline)
        elif self._role == Role.VOTED:
            granted = self._voted_id == req.candidate_id
        self._respond(token, m.VoteResponse(
            leader_id=self._leader_id, leader_epoch=self._epoch, vote_granted=granted))

    def _handle_begin_epoch(self, token: Any, req: m.BeginQuorumEpochRequest, now: int) -> None:
        if req.leader_epoch < self._epoch:
            self._respond(token, self._error_response(req, Errors.FENCED_LEADER_EPOCH))
            return
        if req.leader_id == self._node_id:
            if self._role != Role.LEADER or req.leader_epoch != self._epoch:
                self._fail(f"told we lead epoch {req.leader_epoch}; we are {self._role} "
                           f"in epoch {self._epoch}")
                return
        else:
            self._learn_leader(req.leader_id, req.leader_epoch, now)
            if self._fatal is not None:
                return
        self._respond(token, m.BeginQuorumEpochResponse(
            leader_id=self._leader_id, leader_epoch=self._epoch))

    def _handle_end_epoch(self, token: Any, req: m.EndQuorumEpochRequest, now: int) -> None:
        if req.leader_epoch < self._epoch:
            self._respond(token, self._error_response(req, Errors.FENCED_LEADER_EPOCH))
            return
        if req.leader_epoch > self._epoch:
            self._become_unattached(req.leader_epoch, now)
        if (self._role == Role.FOLLOWER and self._leader_id == req.leader_id
                and not self._shutting_down):
            # The leader is leaving: the most caught-up successor goes first.
            succ = req.preferred_successors
            if self._node_id in succ:
                pos = succ.index(self._node_id)
                backoff = 0 if pos == 0 else min(RETRY_BACKOFF_BASE_MS << (pos - 1),
                                                  self.config.election_backoff_max_ms)
            else:
                backoff = self.config.election_backoff_max_ms
            self._fetch_deadline_ms = min(self._fetch_deadline_ms or now + backoff, now + backoff)
        self._respond(token, m.EndQuorumEpochResponse(
            leader_id=self._leader_id, leader_epoch=self._epoch))

    # -- fetch, leader side ------------------------------------------------

    def _handle_fetch(self, token: Any, req: m.FetchRequest, now: int, completing: bool) -> None:
        consumer = req.replica_id < 0
        if req.cluster_id != self.config.cluster_id:
            self._respond(token, self._error_response(
                req, Errors.INCONSISTENT_CLUSTER_ID,
                f"cluster id {req.cluster_id!r} does not match ours {self.config.cluster_id!r}"))
            return
        bad = None
        if req.max_wait_ms < 0:
            bad = f"max_wait_ms {req.max_wait_ms} is negative"
        elif req.fetch_offset < 0:
            bad = f"fetch_offset {req.fetch_offset} is negative"
        elif req.last_fetched_epoch < 0 and not consumer:
            bad = f"last_fetched_epoch {req.last_fetched_epoch} is negative"
        elif req.current_leader_epoch != NO_EPOCH and req.last_fetched_epoch > req.current_leader_epoch:
            bad = (f"last_fetched_epoch {req.last_fetched_epoch} is newer than "
                   f"current_leader_epoch {req.current_leader_epoch}")
        elif req.replica_id == self._node_id:
            bad = f"replica {req.replica_id} is this node"
        if bad is not None:
            self._respond(token, self._error_response(req, Errors.INVALID_REQUEST, bad))
            return
        code = self._fence_client(req.current_leader_epoch, sentinel_allowed=consumer)
        if code != Errors.NONE:
            self._respond(token, self._error_response(req, code))
            return

        hw = self._high_watermark
        lso = self._log_start_offset
        leo = self._log_end_offset
        fetch_offset = req.fetch_offset
        lfe = req.last_fetched_epoch
        cl = self._current_leader()

        if not consumer and not completing:
            self._note_replica_offset(req.replica_id, fetch_offset)
        # Snapshot redirect (KIP-630, KAFKA-15078).
        snap = self._snapshot_redirect(fetch_offset, lfe)
        if snap is not None:
            self._respond(token, m.FetchResponse(
                high_watermark=hw, log_start_offset=lso, snapshot_id=snap, current_leader=cl))
            return
        # DivergingEpoch (the latest epoch is the hot path: no search).
        if fetch_offset > 0 and lfe >= 0:
            if lfe == self._epochs.latest_epoch:
                end_epoch, end_offset = lfe, leo
            else:
                end_epoch, end_offset = self._end_offset_for_epoch(lfe)
            if end_epoch != lfe or end_offset < fetch_offset:
                self._respond(token, m.FetchResponse(
                    high_watermark=hw, log_start_offset=lso, current_leader=cl,
                    diverging_epoch=m.EpochEndOffset(end_epoch, end_offset)))
                return
        if consumer and fetch_offset > leo:
            self._respond(token, self._error_response(
                req, Errors.OFFSET_OUT_OF_RANGE,
                f"fetch offset {fetch_offset} is past the log end offset {leo}"))
            return

        # A valid fetch: it updates the replica's state and may move the HW.
        st = None
        hw_before = self._high_watermark
        if not consumer:
            st = self._progress_for(req.replica_id, now)
            if not completing:
                st.log_end_offset = fetch_offset
                st.last_fetch_ms = now
                st.last_contact_ms = now
                self._notify_unacked.discard(req.replica_id)
                if req.replica_id in self._replicas:
                    self._maybe_advance_hw(now)
                    if self._role != Role.LEADER:
                        return  # cannot happen, but never serve as a non-leader
            upper = self._log_end_offset
        else:
            upper = max(self._high_watermark, lso)

        has_data = fetch_offset < upper
        stalled = now < self._read_stall_until_ms
        # Park an empty fetch -- unless it just moved the HW, which the
        # follower should learn now rather than max_wait_ms later.
        if not completing and (stalled or (not has_data and req.max_wait_ms > 0
                                           and self._high_watermark == hw_before)):
            if len(self._parked) < MAX_PARKED_FETCHES:
                self._park(token, req, now, has_data, st)
                return
        records = b""
        if has_data:
            try:
                records = self._reader.read(fetch_offset, upper, req.max_bytes)
            except (CorruptBatchError, StorageError) as exc:
                # Never send bytes that failed verification; the driver
                # quarantines and feeds LogQuarantined.
                self._out.append(CorruptionFound(exc))
                self._respond(token, self._error_response(
                    req, Errors.KAFKA_STORAGE_ERROR, f"node {self._node_id} failed to read offset "
                    f"{fetch_offset}: {exc}"))
                return
        if st is not None:
            self._on_fetch_served(st, fetch_offset, now)
        self._respond(token, m.FetchResponse(
            high_watermark=self._high_watermark, log_start_offset=self._log_start_offset,
            records=records, current_leader=cl))

    def _end_offset_for_epoch(self, epoch: int) -> tuple[int, int]:
        """Kafka's endOffsetForEpoch with KRaft's override (KafkaMetadataLog): an
        epoch older than our whole history, when the log starts at a snapshot,
        is answered with that snapshot's id. The history was cut at the log start
        (truncate_from_start), so we do not know where such an epoch really ended:
        the plain answer (epoch, log start) would claim the asker's records of
        that epoch up to our log start match ours -- untrue, and not even a batch
        boundary of the asker's log (sim finding 4). The answer's epoch is then
        newer than the one asked, which tells the asker to fetch and be sent the
        snapshot."""
        e, end = self._epochs.end_offset_for_epoch(epoch, self._log_end_offset)
        lso = self._log_start_offset
        if lso > 0 and e == epoch and end == lso and epoch != self._epochs.latest_epoch:
            base = self._snapshot_at(lso)
            first = self._epochs.entries[0] if self._epochs.entries else None
            if base is not None and (first is None or epoch < first.epoch):
                return base.epoch, base.end_offset
        return e, end

    def _snapshot_redirect(self, fetch_offset: int, lfe: int) -> m.SnapshotId | None:
        if not self._snapshots:
            return None
        latest = self._snapshots[-1]
        lso = self._log_start_offset
        if fetch_offset == 0 and latest.end_offset > 0:
            return latest  # KAFKA-15078: an empty replica starts from the snapshot
        if lso > 0:
            base = self._snapshot_at(lso)
            base_epoch = base.epoch if base is not None else latest.epoch
            if fetch_offset < lso or (fetch_offset == lso and lfe != base_epoch) or lfe < base_epoch:
                return latest
        return None

    def _snapshot_at(self, end_offset: int) -> m.SnapshotId | None:
        for s in self._snapshots:
            if s.end_offset == end_offset:
                return s
        return None

    def _note_replica_offset(self, replica_id: int, fetch_offset: int) -> None:
        """A replica fetching below the offset it already reported has lost data
        (restart after a crash, wipe, quarantine, truncation). Whatever we knew
        of it being caught up describes a log it no longer has: forget it, so it
        is not in sync (KIP-501) until it catches up again -- the role Kafka's
        broker-epoch reset (KIP-903) plays. Done before the snapshot redirect
        and DivergingEpoch answers too, which never update the fetch state: a
        wiped replica downloading a snapshot must not keep its old offset."""
        st = self._replicas.get(replica_id) or self._observers.get(replica_id)
        if st is None or fetch_offset >= st.log_end_offset:
            return
        st.log_end_offset = fetch_offset  # lower only: never helps the HW or the LBO
        st.last_caught_up_ms = -1
        st.last_read_ms = -1
        st.leader_leo_at_last_read = NO_OFFSET
        st.pending_offset = None
        st.pending_prev_leo = NO_OFFSET

    def _progress_for(self, replica_id: int, now: int) -> ReplicaProgress:
        st = self._replicas.get(replica_id)
        if st is not None:
            return st
        st = self._observers.get(replica_id)
        if st is None:
            if len(self._observers) >= MAX_OBSERVERS:
                oldest = min(self._observers.values(), key=lambda s: s.last_fetch_ms)
                del self._observers[oldest.replica_id]
            st = self._observers[replica_id] = ReplicaProgress(replica_id)
        return st

    def _park(self, token: Any, req: m.FetchRequest, now: int, has_data: bool,
              st: ReplicaProgress | None) -> None:
        stall = self._read_stall_until_ms
        if st is not None:
            # One pending fetch per replica: answer an older one first.
            for p in list(self._parked):
                if p.request.replica_id == req.replica_id:
                    self._parked.remove(p)
                    self._handle_fetch(p.token, p.request, now, completing=True)
            st.pending_offset = req.fetch_offset
            st.pending_prev_leo = st.leader_leo_at_last_read
        deadline = now if has_data else now + req.max_wait_ms
        self._parked.append(_Parked(token, req, now, max(deadline, stall), stall))

    def _complete_parked(self, now: int, which) -> None:
        if self._appended_this_step:
            # Reads go through the LogReader, which will not see this step's
            # AppendBatches until the driver executes them: answer next step.
            for p in self._parked:
                if which(p):
                    p.woken = True
            return
        keep: list[_Parked] = []
        done: list[_Parked] = []
        for p in self._parked:
            (done if p.not_before_ms <= now and which(p) else keep).append(p)
        if not done:
            return
        self._parked = keep
        for p in done:
            self._handle_fetch(p.token, p.request, now, completing=True)

    def _on_fetch_served(self, st: ReplicaProgress, fetch_offset: int, now: int) -> None:
        """KIP-501 / Kafka's updateFetchState, at the moment the read is served."""
        leo = self._log_end_offset
        if fetch_offset >= leo:
            st.last_caught_up_ms = max(st.last_caught_up_ms, now)
        elif fetch_offset >= st.leader_leo_at_last_read >= 0:
            t = now if self.config.follower_fetch_pending_reads_insync_enable else st.last_read_ms
            st.last_caught_up_ms = max(st.last_caught_up_ms, t)
        st.last_read_ms = now
        st.leader_leo_at_last_read = leo
        st.pending_offset = None

    def _maybe_advance_hw(self, now: int) -> None:
        leos = [self._flushed_end_offset]  # our own unflushed tail never counts (KAFKA-10533)
        replicas = self._replicas
        for v in self._others:
            leos.append(replicas[v].log_end_offset)
        leos.sort(reverse=True)
        new_hw = leos[self._hw_index]
        if new_hw > self._epoch_start_offset and new_hw > self._high_watermark:
            assert new_hw <= self._log_end_offset
            self._high_watermark = new_hw
            self._on_hw_advanced(now)

    def _on_hw_advanced(self, now: int) -> None:
        hw = self._high_watermark
        cl = None
        while self._waiters and self._waiters[0][0] <= hw:
            _, token, base, epoch = self._waiters.popleft()
            cl = cl or self._current_leader()
            self._respond(token, m.ProduceResponse(base_offset=base, leader_epoch=epoch,
                                                   current_leader=cl))
        if self._parked:
            # Followers learn the new HW now rather than after max_wait_ms.
            self._complete_parked(now, lambda p: True)

    # -- other leader-side requests -------------------------------------

    def _handle_offsets_for_epoch(self, token: Any, req: m.OffsetsForLeaderEpochRequest) -> None:
        code = self._fence_client(req.current_leader_epoch, sentinel_allowed=req.replica_id < 0)
        if code != Errors.NONE:
            self._respond(token, self._error_response(req, code))
            return
        epoch, end = self._end_offset_for_epoch(req.leader_epoch)
        if req.replica_id < 0 and end > self._high_watermark:
            end = max(self._high_watermark, self._log_start_offset)  # consumers see committed data only
        self._respond(token, m.OffsetsForLeaderEpochResponse(
            leader_epoch=epoch, end_offset=end, current_leader=self._current_leader()))

    def _handle_fetch_snapshot(self, token: Any, req: m.FetchSnapshotRequest, now: int) -> None:
        code = self._fence(req.current_leader_epoch)
        if code != Errors.NONE:
            self._respond(token, self._error_response(req, code))
            return
        if req.replica_id in self._replicas:
            self._replicas[req.replica_id].last_contact_ms = now
        size = self._reader.snapshot_size(req.snapshot_id)
        if size is None:
            self._respond(token, self._error_response(req, Errors.SNAPSHOT_NOT_FOUND))
            return
        if req.position < 0 or req.position >= size:
            self._respond(token, self._error_response(req, Errors.POSITION_OUT_OF_RANGE))
            return
        max_bytes = max(1, min(req.max_bytes, self.config.snapshot_chunk_bytes))
        try:
            data = self._reader.read_snapshot(req.snapshot_id, req.position, max_bytes)
        except (CorruptBatchError, StorageError) as exc:
            self._out.append(CorruptionFound(exc))
            self._respond(token, self._error_response(req, Errors.KAFKA_STORAGE_ERROR))
            return
        self._respond(token, m.FetchSnapshotResponse(
            snapshot_id=req.snapshot_id, size=size, position=req.position,
            unaligned_records=data, current_leader=self._current_leader()))

    def _handle_list_offsets(self, token: Any, req: m.ListOffsetsRequest) -> None:
        code = self._fence_client(req.current_leader_epoch, sentinel_allowed=True)
        if code == Errors.NONE and self._high_watermark < 0:
            code = Errors.LEADER_NOT_AVAILABLE  # our first record is not committed yet
        if code != Errors.NONE:
            self._respond(token, self._error_response(req, code))
            return
        cl = self._current_leader()
        hw = self._high_watermark
        lso = self._log_start_offset
        if req.timestamp_ms == m.LIST_OFFSETS_EARLIEST:
            offset, ts = lso, -1
        elif req.timestamp_ms == m.LIST_OFFSETS_LATEST:
            offset, ts = hw, -1
        else:
            try:
                offset, ts = self._offset_for_timestamp(req.timestamp_ms, lso, hw)
            except (CorruptBatchError, StorageError) as exc:
                self._out.append(CorruptionFound(exc))
                self._respond(token, self._error_response(req, Errors.KAFKA_STORAGE_ERROR))
                return
            if offset < 0:
                self._respond(token, m.ListOffsetsResponse(current_leader=cl))
                return
        # The epoch of the last record before `offset` lets the client validate it.
        epoch = self._epochs.epoch_for_offset(offset - 1) if offset > lso else NO_EPOCH
        if epoch == NO_EPOCH:
            base = self._snapshot_at(lso)
            epoch = base.epoch if base is not None else self._epochs.epoch_for_offset(offset)
        self._respond(token, m.ListOffsetsResponse(
            offset=offset, timestamp_ms=ts, leader_epoch=epoch, current_leader=cl))

    def _offset_for_timestamp(self, ts: int, start: int, end: int) -> tuple[int, int]:
        """First committed batch whose max timestamp is >= ts: (base offset, its ts)."""
        pos = start
        while pos < end:
            data = self._reader.read(pos, end, SCAN_CHUNK_BYTES)
            last_next = pos
            for _, h in iter_batches(data, verify=False):
                if h.next_offset > pos and h.max_timestamp_ms >= ts:
                    return max(h.base_offset, pos), h.max_timestamp_ms
                last_next = h.next_offset
            if last_next <= pos:
                break  # no progress: the reader returned nothing
            pos = last_next
        return NO_OFFSET, -1

    def _metadata(self) -> m.MetadataResponse:
        """Leader, epoch, HW and LBO as this node knows them. Endpoints are left
        blank (host "", port 0): the runtime fills them from its configuration."""
        observers = sorted(self._observers) if self._role == Role.LEADER else []
        return m.MetadataResponse(
            cluster_id=self.config.cluster_id, node_id=self._node_id,
            leader_id=self._leader_id, leader_epoch=self._epoch,
            high_watermark=self._high_watermark, log_start_offset=self._log_start_offset,
            voters=[m.NodeEndpoint(v, "", 0) for v in self._voters],
            observers=[m.NodeEndpoint(o, "", 0) for o in observers],
        )

    # ------------------------------------------------------------------
    # client writes (leader)

    def _client_append(self, now: int, waiters: list[tuple[Any, int]], records: list[bytes]) -> None:
        total = sum(n for _, n in waiters)
        if total != len(records) or any(n <= 0 for _, n in waiters):
            raise ValueError(
                f"ClientAppend waiters count {total} records in total but {len(records)} were given")
        if self._role != Role.LEADER or self._shutting_down:
            cl = self._current_leader()
            for token, _ in waiters:
                self._respond(token, m.ProduceResponse(
                    error_code=Errors.NOT_LEADER_OR_FOLLOWER, current_leader=cl,
                    error_message=f"node {self._node_id} is not the leader"))
            return
        base = self._log_end_offset
        batch = encode_batch(base, self._epoch, records, self._timestamp(now))
        offset = base
        for token, n in waiters:
            self._waiters.append((offset + n, token, offset, self._epoch))
            offset += n
        self._append_local(batch, len(records))

    def _append_local(self, batch: bytes, count: int) -> None:
        """Leader append at the log end under the current epoch."""
        base = self._log_end_offset
        self._out.append(AppendBatches(batch, base, base + count))
        self._appended_this_step = True
        self._log_end_offset = base + count
        if self._epochs.assign(self._epoch, base):
            self._out.append(WriteEpochCheckpoint(tuple(self._epochs.entries)))
        self._out.append(FlushLog())
        if self._parked:
            # Replicas waiting at the old end have data now; consumers wait for the HW.
            self._complete_parked(self._now_ms, lambda p: p.request.replica_id >= 0)

    def _on_flush(self, flushed_end_offset: int, now: int) -> None:
        new = min(flushed_end_offset, self._log_end_offset)
        if new > self._flushed_end_offset:
            self._flushed_end_offset = new
            if self._role == Role.LEADER:
                self._maybe_advance_hw(now)
            self._maybe_clear_quarantine()

    def _on_install_failed(self, ev: SnapshotInstallFailed, now: int) -> None:
        """The driver rejected the download and kept its log: so do we."""
        pre = self._pre_install
        if pre is None or pre[0] != ev.snapshot_id:
            raise ValueError(f"SnapshotInstallFailed for {ev.snapshot_id} without a matching InstallSnapshot")
        self._pre_install = None
        (_, self._log_start_offset, self._log_end_offset, self._flushed_end_offset, entries,
         self._snapshots, hw) = pre
        self._epochs = EpochHistory(entries)
        self._out.append(WriteEpochCheckpoint(tuple(self._epochs.entries)))
        # Back to the HW we had: the snapshot's end was committed, but the old
        # log past our old HW may hold records that diverge from it.
        self._high_watermark = hw
        self._download = None
        if self._role in (Role.FOLLOWER, Role.OBSERVER):
            self._fetch_inflight = None  # a Fetch sent under the dropped view: its answer is ignored
            self._start_following(now)

    # ------------------------------------------------------------------
    # quarantine (issue 12)

    def _maybe_clear_quarantine(self) -> None:
        must = self._must_reach_offset
        if must >= 0 and (must <= self._flushed_end_offset or not self._is_voter):
            # (an observer's log never counted toward a vote or a commit)
            self._out.append(ClearQuarantine(self._must_reach_offset))
            self._must_reach_offset = -1

    def _on_quarantined(self, ev: LogQuarantined, now: int) -> None:
        """The driver cut the log at the last good batch (the quarantine state
        is already durable). Fix our view; a leader resigns: it may no longer
        hold records it served or counted, and must not append at an offset its
        followers may already hold under this epoch."""
        end = ev.log_end_offset
        if end < self._log_start_offset or end > self._log_end_offset:
            raise ValueError(f"quarantine cut the log to {end}, outside [log start "
                             f"{self._log_start_offset}, log end {self._log_end_offset}]")
        self._must_reach_offset = max(self._must_reach_offset, ev.must_reach_offset)
        self._log_end_offset = end
        self._flushed_end_offset = min(self._flushed_end_offset, end)
        # What we can still serve as committed is what we still hold.
        self._high_watermark = min(self._high_watermark, end)
        if self._epochs.truncate_from_end(end):
            self._out.append(WriteEpochCheckpoint(tuple(self._epochs.entries)))
        if self._role == Role.LEADER:
            self._resign(now)
        elif self._role == Role.CANDIDATE:
            # The votes on their way were granted to the log we no longer have
            # (sim seed 318): give up the candidacy, keep our vote for the epoch.
            self._become_voted(self._node_id, now)
        elif self._role in (Role.FOLLOWER, Role.OBSERVER):
            self._start_following(now)  # re-validate the end with the leader, re-fetch
        self._maybe_clear_quarantine()

    # ------------------------------------------------------------------
    # snapshots and the log start

    def _on_snapshot_created(self, sid: m.SnapshotId, now: int) -> None:
        if sid.end_offset < self._log_start_offset or sid.end_offset > self._high_watermark:
            raise ValueError(
                f"snapshot {sid.end_offset}-{sid.epoch} is outside [log start "
                f"{self._log_start_offset}, high watermark {self._high_watermark}]")
        if sid.end_offset > self._log_start_offset:
            epoch = self._epochs.epoch_for_offset(sid.end_offset - 1)
            if epoch != sid.epoch:
                raise ValueError(
                    f"snapshot {sid.end_offset}-{sid.epoch}: the record at offset "
                    f"{sid.end_offset - 1} has epoch {epoch}")
        if sid not in self._snapshots:
            self._snapshots.append(sid)
            self._snapshots.sort()

    def _maybe_advance_log_start(self, now: int) -> None:
        """KIP-630: the leader moves its LBO to a snapshot once every live replica
        has it, or once it has waited max_replication_lag_ms."""
        if not self._snapshots:
            return
        target = self._snapshots[-1].end_offset
        if target <= self._log_start_offset or target > self._high_watermark:
            self._lbo_wait = None
            return
        if self._lbo_wait is None or self._lbo_wait[0] != target:
            self._lbo_wait = (target, now)
        lag_max = self.config.replica_lag_time_max_ms
        all_have = all(
            st.log_end_offset >= target
            for st in (*self._replicas.values(), *self._observers.values())
            if st.last_fetch_ms >= 0 and now - st.last_fetch_ms <= lag_max
        )
        if all_have or now - self._lbo_wait[1] >= self.config.max_replication_lag_ms:
            self._lbo_wait = None
            self._advance_log_start(target)

    def _advance_log_start(self, target: int) -> None:
        assert self._log_start_offset < target <= self._log_end_offset
        self._out.append(AdvanceLogStart(target))
        self._log_start_offset = target
        if self._epochs.truncate_from_start(target):
            self._out.append(WriteEpochCheckpoint(tuple(self._epochs.entries)))
        self._snapshots = [s for s in self._snapshots if s.end_offset >= target]

    # ------------------------------------------------------------------
    # shutdown

    def _on_shutdown(self, now: int) -> None:
        self._shutting_down = True
        self._election_deadline_ms = None
        if self._role == Role.LEADER:
            self._resign(now)

    # ------------------------------------------------------------------
    # follower / observer fetch loop

    def _maybe_send_fetch(self, now: int) -> None:
        if self._fetch_inflight is not None or now < self._fetch_retry_at_ms:
            return
        if self._flushed_end_offset < self._log_end_offset:
            return  # never report an unflushed offset: wait for FlushCompleted
        leader = self._leader_id
        cid = self.config.cluster_id
        if leader < 0:
            if self._is_voter or not self._voters:
                return
            # Observer: ask a random voter; any answer names the leader.
            dest = self._voters[self._random.randrange(len(self._voters))]
            self._fetch_inflight = self._send(dest, self._fetch_request(), "fetch")
            return
        if self._download is not None:
            d = self._download
            self._fetch_inflight = self._send(leader, m.FetchSnapshotRequest(
                cluster_id=cid, replica_id=self._node_id, current_leader_epoch=self._epoch,
                snapshot_id=d.snapshot_id, position=d.position,
                max_bytes=self.config.snapshot_chunk_bytes,
            ), "fetch_snapshot", d.position)
        elif self._need_epoch_check:
            self._fetch_inflight = self._send(leader, m.OffsetsForLeaderEpochRequest(
                cluster_id=cid, replica_id=self._node_id, current_leader_epoch=self._epoch,
                leader_epoch=self._last_epoch(),
            ), "epoch_check")
        else:
            self._fetch_inflight = self._send(leader, self._fetch_request(), "fetch")

    def _last_epoch(self) -> int:
        """Epoch of the last record we hold: from the epoch history, or, when
        the log is empty past a snapshot, the snapshot's epoch (as Kafka's
        lastFetchedEpoch). Fetch, OffsetsForLeaderEpoch and Vote all use it."""
        epoch = self._epochs.latest_epoch
        if epoch < 0 and self._snapshots and self._snapshots[-1].end_offset == self._log_end_offset:
            return self._snapshots[-1].epoch
        return epoch

    def _fetch_request(self) -> m.FetchRequest:
        return m.FetchRequest(
            cluster_id=self.config.cluster_id, replica_id=self._node_id,
            max_wait_ms=self.config.fetch_max_wait_ms, current_leader_epoch=self._epoch,
            fetch_offset=self._flushed_end_offset,
            last_fetched_epoch=max(self._last_epoch(), 0),
            log_start_offset=self._log_start_offset, max_bytes=self.config.fetch_max_bytes,
        )

    def _on_request_failed(self, ev: RequestFailed, now: int) -> None:
        req = self._outstanding.pop(ev.request_id, None)
        if req is None:
            return
        if req.kind in ("fetch", "epoch_check", "fetch_snapshot"):
            if self._fetch_inflight == ev.request_id:
                self._fetch_inflight = None
                self._fetch_retry_at_ms = now + FETCH_RETRY_BACKOFF_MS
                if (req.epoch == self._epoch and ev.destination == self._leader_id >= 0
                        and self._fetch_deadline_ms is not None
                        and _is_connection_failure(ev.reason)):
                    self._on_leader_unreachable(now)
        elif req.kind in ("begin", "end"):
            if self._notify_inflight.get(req.destination) == ev.request_id:
                del self._notify_inflight[req.destination]
                self._notify_retry_at[req.destination] = now + FETCH_RETRY_BACKOFF_MS
        # "vote": the candidate keeps waiting for its election timeout.

    def _on_leader_unreachable(self, now: int) -> None:
        """The leader's process refused or reset our connection: it has crashed
        (a slow or partitioned leader times out instead). Rather than wait out the
        whole fetch timeout, give up on it after a short randomized delay,
        uniform in [election_timeout_ms / 10, election_timeout_ms / 2]: the
        followers that notice together rarely stand together (split vote), and a
        transient reset costs nothing -- the retried fetches keep going every
        FETCH_RETRY_BACKOFF_MS and the first answer restores the full timeout.
        Safety does not depend on it: an election is only an election."""
        t = self.config.election_timeout_ms
        lo = t // 10
        delay = lo + (self._random.randrange(t // 2 - lo + 1) if t // 2 > lo else 0)
        self._fetch_deadline_ms = min(self._fetch_deadline_ms, now + delay)

    def _on_response(self, ev: ResponseReceived, now: int) -> None:
        req = self._outstanding.pop(ev.request_id, None)
        if req is None:
            return
        resp = ev.response
        # Whatever the request, a newer epoch in the answer is news we act on.
        cl = getattr(resp, "current_leader", None)
        if cl is not None:
            self._learn_leader(cl.leader_id, cl.leader_epoch, now)
        elif isinstance(resp, (m.VoteResponse, m.BeginQuorumEpochResponse, m.EndQuorumEpochResponse)):
            self._learn_leader(resp.leader_id, resp.leader_epoch, now)
        if self._fatal is not None:
            return
        kind = req.kind
        if kind in ("fetch", "epoch_check", "fetch_snapshot"):
            if self._fetch_inflight != ev.request_id:
                return  # superseded by a role or epoch change
            self._fetch_inflight = None
        elif kind in ("begin", "end"):
            if self._notify_inflight.get(req.destination) == ev.request_id:
                del self._notify_inflight[req.destination]
        if req.epoch != self._epoch or kind == "probe":
            return  # KAFKA-7786: sent under an older epoch; a probe's news was learnt above
        if kind == "vote":
            self._on_vote_response(ev.destination, resp, now)
        elif kind in ("begin", "end"):
            if getattr(resp, "error_code", -1) == Errors.NONE:
                self._notify_unacked.discard(req.destination)
            else:
                self._notify_retry_at[req.destination] = now + FETCH_RETRY_BACKOFF_MS
        elif self._role in (Role.FOLLOWER, Role.OBSERVER):
            if self._leader_id < 0 or ev.destination != self._leader_id:
                self._fetch_retry_at_ms = now + FETCH_RETRY_BACKOFF_MS
                return  # a discovery answer that named no leader
            if kind == "fetch":
                self._on_fetch_response(resp, now)
            elif kind == "epoch_check":
                self._on_epoch_check_response(resp, now)
            else:
                self._on_fetch_snapshot_response(resp, req.position, now)

    def _on_vote_response(self, voter: int, resp: m.Body, now: int) -> None:
        if self._role != Role.CANDIDATE or not isinstance(resp, m.VoteResponse):
            return
        if resp.error_code != Errors.NONE:
            return
        if resp.vote_granted:
            self._granted.add(voter)
            if len(self._granted) > len(self._voters) // 2:
                self._become_leader(now)
        else:
            self._rejected.add(voter)
            if len(self._rejected) > len(self._voters) - len(self._voters) // 2 - 1 and not self._backing_off:
                # Lost: back off (randomized, exponential) before the next try.
                self._backing_off = True
                self._election_deadline_ms = now + self._lost_election_backoff()

    def _retry_fetch_later(self, now: int) -> None:
        self._fetch_retry_at_ms = now + FETCH_RETRY_BACKOFF_MS

    def _on_fetch_response(self, resp: m.Body, now: int) -> None:
        if not isinstance(resp, m.FetchResponse) or resp.error_code != Errors.NONE:
            self._retry_fetch_later(now)
            return
        self._fetch_deadline_ms = now + self.config.fetch_timeout_ms
        if resp.diverging_epoch is not None:
            de = resp.diverging_epoch
            self._truncate_to_leader(de.epoch, de.end_offset, "DivergingEpoch")
            if self._fatal is None:
                self._follower_hw(resp.high_watermark)
            return
        if resp.snapshot_id is not None:
            sid = resp.snapshot_id
            if self._high_watermark > sid.end_offset:
                self._fail(f"leader redirected us to snapshot {sid.end_offset}-{sid.epoch}, below "
                           f"our high watermark {self._high_watermark}")
                return
            self._download = _Download(sid, 0)
            return
        if resp.records:
            if not self._append_fetched(resp.records):
                self._retry_fetch_later(now)
                return
        self._follower_hw(resp.high_watermark)
        self._follower_log_start(resp.log_start_offset)

    def _append_fetched(self, records: bytes) -> bool:
        """Append the whole batches of a fetch answer; False if it does not fit our log."""
        leo = self._log_end_offset
        expect = leo
        end_pos = 0
        changed = False
        try:
            for pos, h in iter_batches(records):
                if h.base_offset != expect:
                    if end_pos == 0:
                        return False  # not at our end: a stale or misaligned answer
                    break
                if h.leader_epoch > self._epoch:
                    self._fail(f"fetched a batch of epoch {h.leader_epoch} while in epoch {self._epoch}")
                    return False
                if h.leader_epoch < self._epochs.latest_epoch:
                    self._fail(f"fetched a batch of epoch {h.leader_epoch} at offset {h.base_offset} "
                               f"after epoch {self._epochs.latest_epoch}")
                    return False
                changed |= self._epochs.assign(h.leader_epoch, h.base_offset)
                expect = h.next_offset
                end_pos = pos + h.size
        except CorruptBatchError:
            if end_pos == 0:
                return False  # keep what was sound before the corrupt batch
        if end_pos == 0:
            return False
        self._out.append(AppendBatches(bytes(records[:end_pos]), leo, expect))
        self._log_end_offset = expect
        if changed:
            self._out.append(WriteEpochCheckpoint(tuple(self._epochs.entries)))
        self._out.append(FlushLog())
        return True

    def _follower_hw(self, leader_hw: int) -> None:
        new = min(self._log_end_offset, leader_hw)
        if new > self._high_watermark:
            self._high_watermark = new

    def _follower_log_start(self, leader_lso: int) -> None:
        """KIP-630: follow the leader's LBO up to our newest snapshot below it."""
        if leader_lso <= self._log_start_offset:
            return
        best = None
        for s in self._snapshots:
            if self._log_start_offset < s.end_offset <= leader_lso and s.end_offset <= self._high_watermark:
                best = s.end_offset
        if best is not None and best <= self._log_end_offset:
            self._advance_log_start(best)

    def _truncate_to_leader(self, leader_epoch: int, leader_end: int, why: str) -> None:
        """Kafka's truncateToEndOffset: cut to the largest offset both logs agree on."""
        if leader_epoch < 0 or leader_end < 0:
            target = self._log_start_offset  # the leader has nothing we could share
        else:
            local_epoch, local_end = self._epochs.end_offset_for_epoch(leader_epoch, self._log_end_offset)
            if local_end < 0:
                target = self._log_start_offset
            elif local_epoch == leader_epoch:
                target = min(local_end, leader_end)
            else:
                target = local_end
        target = min(target, self._log_end_offset)
        if target < self._high_watermark or target < self._log_start_offset:
            self._fail(
                f"{why} ({leader_epoch}, {leader_end}) asks to truncate to {target}, below our "
                f"high watermark {self._high_watermark} / log start {self._log_start_offset}")
            return
        if target < self._log_end_offset:
            self._out.append(TruncateLog(target))
            self._log_end_offset = target
            self._flushed_end_offset = min(self._flushed_end_offset, target)
            if self._epochs.truncate_from_end(target):
                self._out.append(WriteEpochCheckpoint(tuple(self._epochs.entries)))

    def _on_epoch_check_response(self, resp: m.Body, now: int) -> None:
        if not isinstance(resp, m.OffsetsForLeaderEpochResponse) or resp.error_code != Errors.NONE:
            self._retry_fetch_later(now)
            return
        self._fetch_deadline_ms = now + self.config.fetch_timeout_ms
        asked = self._last_epoch()
        if resp.leader_epoch > asked:
            # The leader's history starts past our last epoch (it answered with the
            # snapshot its log starts at): it cannot say where our log diverges.
            # Fetch; the leader's fetch validation sends us that snapshot.
            self._need_epoch_check = False
            return
        self._truncate_to_leader(resp.leader_epoch, resp.end_offset, "OffsetsForLeaderEpoch")
        if self._fatal is not None:
            return
        # Done unless the leader answered an older epoch we also hold and our log
        # still ends in a later epoch of our own (Kafka asks again then).
        local_epoch = self._last_epoch()
        self._need_epoch_check = (
            resp.leader_epoch >= 0 and local_epoch != resp.leader_epoch and local_epoch != asked
            and self._log_end_offset > self._log_start_offset
        )

    def _on_fetch_snapshot_response(self, resp: m.Body, position: int, now: int) -> None:
        d = self._download
        if d is None:
            return
        if (not isinstance(resp, m.FetchSnapshotResponse) or resp.error_code != Errors.NONE
                or resp.snapshot_id != d.snapshot_id or resp.position != position
                or resp.size <= 0):
            # SNAPSHOT_NOT_FOUND, POSITION_OUT_OF_RANGE...: rediscover with a Fetch.
            self._download = None
            self._retry_fetch_later(now)
            return
        self._fetch_deadline_ms = now + self.config.fetch_timeout_ms
        data = resp.unaligned_records
        if not data and position < resp.size:
            self._download = None
            self._retry_fetch_later(now)
            return
        self._out.append(WriteSnapshotChunk(d.snapshot_id, position, data))
        d.position = position + len(data)
        if d.position < resp.size:
            return
        sid = d.snapshot_id
        self._download = None
        self._pre_install = (sid, self._log_start_offset, self._log_end_offset, self._flushed_end_offset,
                             list(self._epochs.entries), list(self._snapshots), self._high_watermark)
        self._out.append(InstallSnapshot(sid, resp.size))
        # The log now starts and ends at the snapshot; its epoch is our last epoch
        # (KIP-630: the snapshot stands for every record below end_offset).
        self._log_start_offset = sid.end_offset
        self._log_end_offset = sid.end_offset
        self._flushed_end_offset = sid.end_offset
        self._epochs = EpochHistory([(sid.epoch, sid.end_offset)])
        self._out.append(WriteEpochCheckpoint(tuple(self._epochs.entries)))
        self._snapshots = [sid]
        self._need_epoch_check = False
        if sid.end_offset > self._high_watermark:
            self._high_watermark = sid.end_offset  # a snapshot only holds committed data
