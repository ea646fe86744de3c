"""The contract between the pure quorum core and whoever drives it.

The core (``metalog.broker.quorum.core.QuorumCore``) is a state machine in the manner
of etcd's raft: ``core.step(event) -> list[Action]``. It never touches sockets,
clocks, randomness or files. Two drivers exist and both obey the same rules:

* ``metalog.broker.server.runtime`` (asyncio, real files, real TCP), and
* ``sim`` (seeded scheduler, fake clock, simulated network and disk).

Both hand the core an ``Environment`` (``metalog.broker.quorum.env``): the clock they
stamp events with and the ``random.Random`` the core draws from.

Rules for a driver
------------------
1. Execute the returned actions **in order**, before feeding the next event.
   ``PersistQuorumState``, ``AppendBatches``, ``TruncateLog``,
   ``WriteEpochCheckpoint``, ``AdvanceLogStart`` and the snapshot actions are
   applied synchronously, so that a later ``SendRequest``/``Respond`` in the
   same list never goes out before the state it depends on is written.
   ``PersistQuorumState`` must be durable (fsync) before the next action.
2. ``FlushLog`` may complete asynchronously (group commit); the driver feeds
   ``FlushCompleted(flushed_end_offset)`` when the data is durable. The core
   never counts unflushed data toward the high watermark (KAFKA-10533) and a
   follower never reports an unflushed offset in Fetch.
3. Reads are synchronous through the ``LogReader`` the core was built with
   (like etcd's Storage interface): the core reads records to answer a Fetch
   and snapshot chunks to answer FetchSnapshot. Reads never change state.
4. Every ``SendRequest`` ends in exactly one ``ResponseReceived`` or
   ``RequestFailed`` with the same ``request_id`` (the driver enforces the
   timeout). Every inbound request fed as ``RequestReceived`` ends in exactly
   one ``Respond`` with the same ``token`` (possibly later: parked fetches and
   produce requests waiting for commit).
5. Time only moves through ``Tick(now_ms)`` (and the ``now_ms`` on events);
   ``QuorumCore.next_deadline_ms`` tells the driver when to tick next.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from metalog.broker.quorum.settings import check_settings, setting
from metalog.broker.quorum.voters import VoterSet
from metalog.protocol import messages as m

# --------------------------------------------------------------------------
# Events (driver -> core). Each carries the current time.


@dataclass(frozen=True, slots=True)
class Tick:
    now_ms: int
    # The wall clock (ms since the epoch) at this moment, if the driver has one:
    # record batches are stamped with it (ListOffsets by timestamp), while
    # timers keep running on the monotonic now_ms. -1: stamp with now_ms.
    wall_clock_ms: int = -1


@dataclass(frozen=True, slots=True)
class RequestReceived:
    """An inbound request. `token` is opaque to the core; echo it in Respond."""

    now_ms: int
    token: Any
    request: m.Body


@dataclass(frozen=True, slots=True)
class ResponseReceived:
    now_ms: int
    request_id: int
    destination: int
    response: m.Body


@dataclass(frozen=True, slots=True)
class RequestFailed:
    """Timeout, connection refused or reset: no response will come."""

    now_ms: int
    request_id: int
    destination: int
    reason: str


@dataclass(frozen=True, slots=True)
class FlushCompleted:
    now_ms: int
    flushed_end_offset: int  # every offset < this is durable


class AppendWaiter(NamedTuple):
    """One Produce (or controller command) inside a ClientAppend."""

    token: Any  # opaque to the core; echoed in the Respond
    record_count: int  # how many of the ClientAppend's records are its own, in order


@dataclass(frozen=True, slots=True)
class ClientAppend:
    """Records from one or more Produce requests, to become ONE append (group
    commit: one AppendBatches, one FlushLog). Each waiter is answered with a
    ProduceResponse once its records are committed, or with an error if
    leadership is lost first.

    Plain waiters' records go into one batch; with ``producers``, a waiter
    whose entry is not None (an idempotent produce, KIP-98) gets a batch of
    its own whose header carries its (producer id, producer epoch, base
    sequence), and consecutive plain waiters around it share one batch. The
    driver has judged those sequences against its producer state (at most
    one waiter per producer id per ClientAppend); the core only records them.

    ``prebuilt`` (a Kafka client's Produce, issue 32): ``records`` holds one
    whole RecordBatch v2 per waiter, as the client built it (keys, headers,
    timestamps, its producer fields), each holding its waiter's record count;
    the leader appends them as they are, stamping only the base offset and
    the partition leader epoch (both outside the CRC). ``producers`` is then
    None: the driver judged the batches' producer fields already."""

    now_ms: int
    waiters: list[AppendWaiter]  # in the order of their records
    records: list[bytes]  # (prebuilt: bytes-like whole batches, one per waiter)
    wall_clock_ms: int = -1  # see Tick
    # None: every waiter is plain. Else one entry per waiter, in order.
    producers: list[tuple[int, int, int] | None] | None = None
    prebuilt: bool = False


@dataclass(frozen=True, slots=True)
class SnapshotCreated:
    """The driver finished writing a snapshot of the committed state."""

    now_ms: int
    snapshot_id: m.SnapshotId


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Graceful stop: a leader resigns with EndQuorumEpoch."""

    now_ms: int


@dataclass(frozen=True, slots=True)
class StallReads:
    """Fault injection for KIP-501's example (a leader whose log read takes 25 s):
    until `until_ms` the leader's reads are slow, so every Fetch it receives
    stays pending and is answered no earlier than `until_ms`. Production drivers
    never feed it; the simulator and tests do."""

    now_ms: int
    until_ms: int


@dataclass(frozen=True, slots=True)
class LogQuarantined:
    """The driver found corruption at run time (scrubber, a read answering a
    Fetch, the controller's apply), persisted the quarantine state and cut the
    log to its last good batch: everything from `log_end_offset` on is gone.
    The core fixes its view of the log; a leader resigns (EndQuorumEpoch); a
    voter does not stand, and votes only for logs at least as up to date as
    the one it had, until its flushed log end reaches `must_reach_offset` (the
    end it had before, which it may have acknowledged; a leader that committed
    in its epoch lowers it to its high watermark), then emits ClearQuarantine."""

    now_ms: int
    log_end_offset: int
    must_reach_offset: int


@dataclass(frozen=True, slots=True)
class SnapshotInstallFailed:
    """InstallSnapshot's verification (or its fsync/rename) failed: the driver
    deleted the partial download and kept the log as it was. Fed right after
    the actions of the step that asked for the install, before any other
    event; the core goes back to its log as it was and downloads again."""

    now_ms: int
    snapshot_id: m.SnapshotId
    reason: str


Event = (Tick | RequestReceived | ResponseReceived | RequestFailed | FlushCompleted
         | ClientAppend | SnapshotCreated | Shutdown | StallReads | LogQuarantined
         | SnapshotInstallFailed)

# --------------------------------------------------------------------------
# Actions (core -> driver), executed in order.


@dataclass(frozen=True, slots=True)
class QuorumStateData:
    """What must survive a restart to keep votes and epochs safe."""

    leader_epoch: int
    leader_id: int  # NO_LEADER if unknown
    voted_id: int  # -1 if none this epoch
    voters: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PersistQuorumState:
    state: QuorumStateData


@dataclass(frozen=True, slots=True)
class AppendBatches:
    """Append whole, already-encoded batches at the log end (offsets contiguous
    from `base_offset` to `next_offset`)."""

    data: bytes
    base_offset: int
    next_offset: int


@dataclass(frozen=True, slots=True)
class TruncateLog:
    """Remove every record with offset >= end_offset."""

    end_offset: int


@dataclass(frozen=True, slots=True)
class WriteEpochCheckpoint:
    entries: tuple[tuple[int, int], ...]  # (epoch, start_offset)


@dataclass(frozen=True, slots=True)
class FlushLog:
    """Make everything appended so far durable, then feed FlushCompleted."""


@dataclass(frozen=True, slots=True)
class SendRequest:
    destination: int
    request_id: int
    request: m.Body
    timeout_ms: int


@dataclass(frozen=True, slots=True)
class Respond:
    token: Any
    response: m.Body


@dataclass(frozen=True, slots=True)
class WriteSnapshotChunk:
    """Follower downloading a snapshot: write `data` at `position` of the
    snapshot's `.part` file (position 0 starts a fresh file)."""

    snapshot_id: m.SnapshotId
    position: int
    data: bytes


@dataclass(frozen=True, slots=True)
class InstallSnapshot:
    """The download is complete (`size` bytes): verify, fsync, rename to
    `.checkpoint`, drop the whole log and older snapshots; the log now starts
    and ends at snapshot_id.end_offset. If verification fails the driver
    deletes the partial, keeps the log, executes the rest of the step's
    actions and then, before any other event, feeds SnapshotInstallFailed
    (the core rolls back and rewrites the epoch checkpoint it had)."""

    snapshot_id: m.SnapshotId
    size: int


@dataclass(frozen=True, slots=True)
class AdvanceLogStart:
    """Delete whole segments below `log_start_offset` and snapshots older than
    the newest one covering it."""

    log_start_offset: int


@dataclass(frozen=True, slots=True)
class Fatal:
    """An invariant breach (e.g. a divergence below our own high watermark).
    The driver logs it loudly and stops the node; never papered over."""

    reason: str


@dataclass(frozen=True, slots=True)
class ClearQuarantine:
    """The flushed log has reached the quarantine's must_reach_offset again:
    the driver removes the persisted quarantine state (the voter votes again)."""

    must_reach_offset: int


@dataclass(frozen=True, slots=True)
class CorruptionFound:
    """A read through the LogReader raised `error` (a CorruptBatchError or
    CorruptSnapshotError); the request it served was answered with
    KAFKA_STORAGE_ERROR. The driver quarantines and feeds LogQuarantined."""

    error: Any


@dataclass(frozen=True, slots=True)
class FetchedBatchCorrupt:
    """A batch of a fetch answer failed verification (CRC, header) where it
    crossed the network: it and what follows it were dropped, the batches
    before it appended, and the follower fetches it again. Nothing on disk is
    damaged (no quarantine): the driver logs a warning and counts it."""

    base_offset: int | None  # as the damaged header says (None: unreadable)
    fetch_epoch: int  # the epoch of the leader that answered
    reason: str


Action = (ClearQuarantine | CorruptionFound | FetchedBatchCorrupt | PersistQuorumState | AppendBatches | TruncateLog | WriteEpochCheckpoint | FlushLog
          | SendRequest | Respond | WriteSnapshotChunk | InstallSnapshot | AdvanceLogStart | Fatal)

# --------------------------------------------------------------------------
# Read-only access to the local log (etcd's Storage idea).


class LogReader(Protocol):
    def read(self, start_offset: int, end_offset: int, max_bytes: int) -> bytes:
        """Whole batches starting with the one that contains `start_offset`,
        none with records at or past `end_offset` (batch boundaries align with
        the bounds the core passes), stopping before `max_bytes` would be
        exceeded -- but always at least one batch if one is available."""
        ...

    def snapshot_size(self, snapshot_id: m.SnapshotId) -> int | None:
        """Size of a complete local snapshot, None if we do not have it."""
        ...

    def read_snapshot(self, snapshot_id: m.SnapshotId, position: int, max_bytes: int) -> bytes:
        ...


@dataclass
class LogView:
    """What the core knows of its local log at construction (read at boot)."""

    log_start_offset: int = 0
    log_end_offset: int = 0  # after recovery everything on disk counts as flushed
    epochs: list[tuple[int, int]] = field(default_factory=list)
    snapshots: list[m.SnapshotId] = field(default_factory=list)  # complete, ascending
    # Quarantine found at open (storage's quarantine-state): the voter does not
    # stand, and votes by its old log, until its flushed log end reaches it. -1: none.
    must_reach_offset: int = -1
    # KIP-853: the voter set below the log (the one the snapshot at the log
    # start holds); None: the static voters of the config (kraft version 0).
    voter_set: VoterSet | None = None
    # (offset, voter set) of every VotersRecord in the log, in order
    # (metalog.broker.quorum.voters.voter_sets_in over the log's batches).
    voter_history: list[tuple[int, VoterSet]] = field(default_factory=list)


@dataclass
class QuorumConfig:
    """The core's settings (section ``quorum`` of broker.yaml) plus this node's
    identity. Each setting is declared once (default, description, range) with
    ``setting``; ``validate`` holds the range checks and the cross-field rules,
    and the core checks them. The identity (node_id, voters, cluster_id, directory_id) is
    not a setting: the driver fills it in (``BrokerConfig`` from its top-level
    keys, the simulator from its cluster)."""

    node_id: int = -1
    voters: tuple[int, ...] = ()
    cluster_id: str = ""
    # KIP-853: the directory id of this node's data dir (meta.properties'
    # directory.id); NO_DIRECTORY_ID when the driver has none (a replica that
    # does not say its directory id matches only voters whose id is unknown).
    directory_id: str = m.NO_DIRECTORY_ID
    # KIP-853: the cluster keeps its voter set in the log (kraft version 1):
    # `voters` are then only whom to ask for the leader (Kafka's
    # controller.quorum.bootstrap.servers), never static voters. A node that
    # finds no voter set (no bootstrap checkpoint, no VotersRecord: a wiped
    # dir) is an observer until the log gives it one.
    voters_are_bootstrap: bool = False
    # The static voters' endpoints from the config, (node id, listener name,
    # host, port): what the VotersRecord of an online upgrade to kraft
    # version 1 names (the log has no endpoints for static voters).
    voter_endpoints: tuple[tuple[int, str, str, int], ...] = ()
    # This node's own endpoints as it advertises them, (listener name, host,
    # port): a voter whose entry in the log's voter set differs tells the
    # leader with UpdateRaftVoter once it follows it (KIP-853). Empty: never.
    listeners: tuple[tuple[str, str, int], ...] = ()
    election_timeout_ms: int = setting(
        1000, "a voter that knows no leader stands for election after a random "
              "election_timeout_ms..2x (Kafka's quorum.election.timeout.ms)", gt=0)
    fetch_timeout_ms: int = setting(
        1000, "a follower whose fetches go unanswered this long asks for pre-votes (KIP-996); a leader "
              "that a majority stops fetching from resigns after 1.5x this (quorum.fetch.timeout.ms; "
              "Kafka's 2000 halved: with pre-vote a false alarm bumps no epoch)", gt=0)
    election_backoff_max_ms: int = setting(
        1000, "cap of the random exponential back-off before a candidate that lost stands again "
              "(quorum.election.backoff.max.ms)", gt=0)
    request_timeout_ms: int = setting(
        2000, "timeout of a request to a peer (quorum.request.timeout.ms)", gt=0)
    fetch_max_wait_ms: int = setting(
        500, "how long a leader parks a Fetch with no new data; must be below fetch_timeout_ms", ge=0)
    fetch_hw_linger_ms: int = setting(
        2, "a replica's Fetch that only a high-watermark advance would answer is held this long for "
           "new records to carry the HW (the replica's next Fetch is then already waiting when they "
           "come); answered with the HW alone after it", ge=0, note="0 = at once, as Kafka does")
    fetch_max_bytes: int = setting(1 << 20, "most bytes of records in one Fetch answer", gt=0)
    replica_lag_time_max_ms: int = setting(
        30000, "a follower not caught up for this long leaves the in-sync set (replica.lag.time.max.ms)", gt=0)
    follower_fetch_pending_reads_insync_enable: bool = setting(
        True, "KIP-501: a follower with a pending fetch at or past the previous log end stays in sync")
    max_replication_lag_ms: int = setting(
        60000, "KIP-630 max.replication.lag.ms: how long the log start may wait for a lagging replica "
               "before passing it", gt=0)
    snapshot_chunk_bytes: int = setting(1 << 20, "most bytes of a snapshot in one FetchSnapshot answer", gt=0)
    auto_join_enable: bool = setting(
        False, "KIP-1186 (controller.quorum.auto.join.enable): with the voter set in the log, an observer "
               "adds itself as a voter once caught up (AddRaftVoter for its own node and directory id), "
               "first removing a voter with its node id and another directory id (its wiped disk)")

    @property
    def is_voter(self) -> bool:
        return self.node_id in self.voters

    def validate(self) -> "QuorumConfig":
        """Raise ValueError("<key>: <why>") for the first bad setting or a
        broken cross-field rule; return self."""
        bad = check_settings(self)
        if bad is not None:
            raise ValueError(f"{bad[0]}: {bad[1]}")
        if self.fetch_max_wait_ms >= self.fetch_timeout_ms:
            # A parked fetch must be answered before the follower gives up on the leader.
            raise ValueError(f"fetch_max_wait_ms: must be below fetch_timeout_ms ({self.fetch_timeout_ms}), "
                             f"got {self.fetch_max_wait_ms}")
        if self.node_id < 0:
            raise ValueError(f"node_id: must be >= 0, got {self.node_id}")
        if not self.voters:
            raise ValueError("voters: QuorumConfig.voters is empty: a quorum needs at least one voter")
        if len(set(self.voters)) != len(self.voters):
            raise ValueError(f"voters: a node id is listed twice in {self.voters}")
        if not self.cluster_id.strip():
            raise ValueError("cluster_id: must not be empty")
        return self
