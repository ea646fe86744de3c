"""What a leader knows of each follower and observer (KIP-501 in-sync
tracking, fetch positions for the high watermark and the log start), and
its parked long-poll fetches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from metalog.broker.quorum.api import QuorumConfig
from metalog.broker.quorum.voters import VoterSet
from metalog.protocol import messages as m

NO_OFFSET = m.NO_OFFSET
# Bound on the observers a leader keeps track of (the oldest is forgotten).
MAX_OBSERVERS = 1024


@dataclass(slots=True)
class ReplicaProgress:
    """What the leader knows of one follower or observer (KIP-501, blog)."""

    replica_id: int
    directory_id: str = m.NO_DIRECTORY_ID  # the one it last fetched with (KIP-853)
    log_end_offset: int = NO_OFFSET  # the fetch offset of its last valid fetch
    last_fetch_ms: int = -1  # arrival of its last valid fetch
    last_caught_up_ms: int = -1
    last_read_ms: int = -1  # when its previous fetch was served
    leader_leo_at_last_read: int = NO_OFFSET  # our LEO when that fetch was served
    last_contact_ms: int = -1  # check-quorum liveness (fetch or fetch-snapshot)
    pending_offset: int | None = None  # fetch offset of a fetch still pending
    pending_prev_leo: int = NO_OFFSET  # leader_leo_at_last_read when it arrived

    def forget_position(self, fetch_offset: int) -> None:
        """A replica fetching below the offset it already reported has lost data
        (restart after a crash, wipe, quarantine, truncation). Whatever we knew
        of it being caught up describes a log it no longer has: forget it, so it
        is not in sync (KIP-501) until it catches up again -- the role Kafka's
        broker-epoch reset (KIP-903) plays."""
        if fetch_offset >= self.log_end_offset:
            return
        self.log_end_offset = fetch_offset  # lower only: never helps the HW or the LBO
        self.last_caught_up_ms = -1
        self.last_read_ms = -1
        self.leader_leo_at_last_read = NO_OFFSET
        self.pending_offset = None
        self.pending_prev_leo = NO_OFFSET

    def on_fetch_served(self, fetch_offset: int, leader_leo: int, now_ms: int, pending_reads_insync: bool) -> None:
        """KIP-501 / Kafka's updateFetchState, at the moment the read is served."""
        if fetch_offset >= leader_leo:
            self.last_caught_up_ms = max(self.last_caught_up_ms, now_ms)
        elif fetch_offset >= self.leader_leo_at_last_read >= 0:
            caught_up_ms = now_ms if pending_reads_insync else self.last_read_ms
            self.last_caught_up_ms = max(self.last_caught_up_ms, caught_up_ms)
        self.last_read_ms = now_ms
        self.leader_leo_at_last_read = leader_leo
        self.pending_offset = None

    def in_sync(self, leader_leo: int, now_ms: int, cfg: QuorumConfig) -> bool:
        """KIP-501 in-sync rule, evaluated on the leader."""
        if self.log_end_offset < 0:
            return False
        if self.log_end_offset >= leader_leo:
            return True  # same LEO as the leader: in sync whatever the clock says
        if self.last_caught_up_ms >= 0 and now_ms - self.last_caught_up_ms <= cfg.replica_lag_time_max_ms:
            return True
        return (
            cfg.follower_fetch_pending_reads_insync_enable
            and self.pending_offset is not None
            and self.pending_prev_leo >= 0  # a first read after a reset proves nothing
            and self.pending_offset >= self.pending_prev_leo
        )

    def copy(self) -> ReplicaProgress:
        return ReplicaProgress(**{f: getattr(self, f) for f in ReplicaProgress.__slots__})


class ProgressTable:
    """The leader's ReplicaProgress per voter (fixed) and per observer
    (bounded). A replica counts as the voter only with the voter's key (node
    id and directory id, KIP-853): a wiped voter fetching with a new
    directory id is an observer, keyed (node id, directory id)."""

    __slots__ = ("voters", "observers", "voter_set")

    def __init__(self, other_voters: tuple[int, ...], voter_set: VoterSet, now_ms: int):
        self.voter_set = voter_set
        self.voters = {v: ReplicaProgress(v, voter_set.directory_id_of(v), last_contact_ms=now_ms)
                       for v in other_voters}
        self.observers: dict[tuple[int, str], ReplicaProgress] = {}

    def voter(self, replica_id: int, directory_id: str) -> ReplicaProgress | None:
        """The voter's progress if (replica_id, directory_id) is that voter."""
        st = self.voters.get(replica_id)
        if st is None or not self.voter_set.is_voter(replica_id, directory_id):
            return None
        return st

    def get(self, replica_id: int, directory_id: str) -> ReplicaProgress | None:
        return self.voter(replica_id, directory_id) or self.observers.get((replica_id, directory_id))

    def progress_for(self, replica_id: int, directory_id: str) -> ReplicaProgress:
        st = self.voter(replica_id, directory_id)
        if st is not None:
            # Static voters: remember the directory it fetches with (shown by
            # DescribeQuorum; what an upgrade to kraft version 1 would record).
            st.directory_id = directory_id
            return st
        key = (replica_id, directory_id)
        st = self.observers.get(key)
        if st is None:
            if len(self.observers) >= MAX_OBSERVERS:
                oldest = min(self.observers.items(), key=lambda kv: kv[1].last_fetch_ms)
                del self.observers[oldest[0]]
            st = self.observers[key] = ReplicaProgress(replica_id, directory_id)
        return st

    def voter_directory_id(self, voter_id: int) -> str:
        """The directory id voter `voter_id` is known by: the set's, else
        (static voters) the one it last fetched with; NO_DIRECTORY_ID if
        it has not fetched from us."""
        st = self.voters.get(voter_id)
        return st.directory_id if st is not None else m.NO_DIRECTORY_ID

    def all(self) -> tuple[ReplicaProgress, ...]:
        return (*self.voters.values(), *self.observers.values())


@dataclass(slots=True)
class ParkedFetch:
    """A Fetch with nothing to return yet, answered when data or the HW
    arrives, or at its max wait."""

    token: Any
    request: m.FetchRequest
    arrival_ms: int
    deadline_ms: int
    not_before_ms: int  # a stalled read (StallReads) is never answered earlier
    woken: bool = False  # data arrived in a step the driver had not applied yet


@dataclass(frozen=True, slots=True)
class ProduceWaiter:
    """A client write answered once the HW passes `end_offset`."""

    end_offset: int  # exclusive end of its records
    token: Any
    base_offset: int
    epoch: int
