"""Followers and observers: the pull-based fetch loop (KIP-320 epoch check,
Fetch, DivergingEpoch truncation, snapshot download per KIP-630) and the
fetch timeout that makes a voter stand when its leader goes quiet."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeGuard, TypeVar

from metalog.broker.quorum.api import WriteSnapshotChunk
from metalog.broker.quorum.outbox import RETRY_BACKOFF_MS, RequestKind
from metalog.broker.quorum.roles import RETRY_BACKOFF_BASE_MS, Role, RoleContext, RoleState
from metalog.broker.quorum.voters import VoterSet, voter_sets_in
from metalog.protocol import messages as m
from metalog.protocol.errors import Errors
from metalog.storage.batch import BatchStream, CorruptBatchError

if TYPE_CHECKING:
    from metalog.broker.quorum.api import Action
    from metalog.broker.quorum.env import Random

NO_LEADER = m.NO_LEADER
# The answers of the fetch loop that restart the fetch timeout.
_Answer = TypeVar("_Answer", m.FetchResponse, m.OffsetsForLeaderEpochResponse)
# A connection-level failure of a request to the leader (refused, reset: the
# driver's reason names it) means its process is gone, not slow -- what TCP
# reports after kill -9 while the host is up. Reasons that contain one of these.
CONNECTION_FAILURE_MARKERS = ("connectionlost", "refused", "reset")


def is_connection_failure(reason: str) -> bool:
    low = reason.lower()
    return any(mark in low for mark in CONNECTION_FAILURE_MARKERS)


def closed_by_peer(reason: str) -> bool:
    """The peer took the connection and then closed or reset it (not a refusal,
    not a timeout): a TLS layer may report that as a failed handshake."""
    low = reason.lower()
    return "refused" not in low and any(mark in low for mark in ("connectionlost", "reset", "closed"))


@dataclass(slots=True)
class SnapshotDownload:
    snapshot_id: m.SnapshotId
    position: int
    # KIP-853: the snapshot's voter set, found as the chunks stream by (not
    # CRC-checked here: the driver checks every batch before the install),
    # the last one seen in a control batch (None: static voters, kraft version 0).
    batches: BatchStream = field(default_factory=lambda: BatchStream(verify=False))
    voter_set: VoterSet | None = None

    def scan(self, chunk: bytes) -> None:
        controls = [bytes(view) for _, h, view in self.batches.feed(chunk) if h.is_control]
        if controls:
            found = voter_sets_in(b"".join(controls), verify=False)
            if found:
                self.voter_set = found[-1][1]


class FollowerContext(RoleContext, Protocol):
    """What a follower or observer may use of its owner, beyond RoleContext."""

    @property
    def random(self) -> Random:
        """Whom an observer with no leader asks."""
        ...

    @property
    def fatal_reason(self) -> str | None: ...

    def emit(self, action: Action) -> None:
        """Add an action to the step's list (a snapshot chunk to write)."""
        ...

    def stand(self, now_ms: int) -> None: ...

    def transition(self, new: RoleState, now_ms: int) -> None:
        """Make `new` the role (an observer that loses its leader or votes)."""
        ...

    def become_leaderless_voter(self, now_ms: int) -> None: ...


class FollowerState(RoleState):
    """A voter following the epoch's leader, or an observer (a non-voter,
    with or without a known leader: without one it asks a random voter)."""

    __slots__ = ("fetch_deadline_ms", "fetch_inflight", "fetch_retry_at_ms", "need_epoch_check", "download",
                 "_start", "membership_inflight", "membership_at_ms", "voter_updated")

    ctx: FollowerContext

    def __init__(self, ctx: FollowerContext, epoch: int, leader_id: int, voted_id: int, *, start: bool = True,
                 fetch_retry_at_ms: int = 0, need_epoch_check: bool = False):
        super().__init__(ctx, Role.FOLLOWER if ctx.electorate.is_voter else Role.OBSERVER, epoch, leader_id, voted_id)
        self.fetch_deadline_ms: int | None = None
        self.fetch_inflight: int | None = None  # request id of the fetch-loop request in flight
        self.fetch_retry_at_ms = fetch_retry_at_ms
        self.need_epoch_check = need_epoch_check
        self.download: SnapshotDownload | None = None
        self._start = start  # start fetching on entering
        # Our own voter-set request to the leader (KIP-853 UpdateRaftVoter,
        # KIP-1186 auto-join): the one in flight, when we may send the next,
        # and whether this leader took our endpoints (Kafka's hasUpdatedLeader).
        self.membership_inflight: int | None = None
        self.membership_at_ms = 0
        self.voter_updated = False

    def on_enter(self, now_ms: int) -> None:
        if self._start:
            self.start_following(now_ms)

    def on_boot(self, now_ms: int) -> None:
        self.start_following(now_ms)

    def sync_voter_role(self) -> None:
        """KIP-853: the voter set changed; Kafka's FollowerState serves voters
        and observers alike, so the role changes in place (the election state
        on disk -- epoch, leader, vote -- is the same)."""
        self.role = Role.FOLLOWER if self.ctx.electorate.is_voter else Role.OBSERVER

    def on_voters_changed(self, now_ms: int) -> None:
        """An observer that knew no leader became a voter (KIP-853, sim seed
        932): a voter without a leader must wait for an election (and stand
        when its timer runs out), not sit still as a leaderless follower."""
        if self.ctx.electorate.is_voter and self.leader_id < 0:
            self.ctx.become_leaderless_voter(now_ms)

    def start_following(self, now_ms: int) -> None:
        log = self.ctx.log
        self.fetch_inflight = None
        self.download = None
        self.fetch_retry_at_ms = now_ms
        self.fetch_deadline_ms = now_ms + self.ctx.config.fetch_timeout_ms
        # KIP-320: a new leader (or epoch) first validates our log's end.
        self.need_epoch_check = self.leader_id >= 0 and log.log_end_offset > log.log_start_offset

    # -- time ----------------------------------------------------------------

    def running_deadline_ms(self) -> int | None:
        return self.election_deadline_ms if self.election_deadline_ms is not None else self.fetch_deadline_ms

    def deadlines(self, now_ms: int) -> list[int]:
        ds = []
        if self.fetch_deadline_ms is not None and self.leader_id >= 0:
            ds.append(self.fetch_deadline_ms)
        if self.membership_at_ms > now_ms and self.membership_inflight is None and self._membership_request():
            ds.append(self.membership_at_ms)
        # While our appended data is unflushed, FlushCompleted wakes us: no tick.
        log = self.ctx.log
        if (self.fetch_inflight is None and self.fetch_retry_at_ms > now_ms
                and log.flushed_end_offset >= log.log_end_offset):
            ds.append(self.fetch_retry_at_ms)
        return ds

    def poll(self, now_ms: int) -> None:
        ctx = self.ctx
        if self.leader_id >= 0 and self.fetch_deadline_ms is not None and now_ms >= self.fetch_deadline_ms:
            if ctx.electorate.is_voter:
                if not ctx.shutting_down:
                    ctx.stand(now_ms)
                return
            # An observer forgets the silent leader and rediscovers one.
            nobody = FollowerState(ctx, self.epoch, NO_LEADER, self.voted_id)
            ctx.transition(nobody, now_ms)
            nobody.maybe_send_fetch(now_ms)
            return
        self.maybe_send_fetch(now_ms)
        if now_ms >= self.membership_at_ms and self.membership_inflight is None:
            req = self._membership_request()
            if req is not None:
                self.membership_inflight = self.ctx.send(self.leader_id, req, RequestKind.MEMBERSHIP)

    # -- our own place in the voter set (KIP-853 UpdateRaftVoter, KIP-1186) ----

    def _membership_request(self) -> m.Body | None:
        """What we should ask the leader about our own entry now, if anything:

        * a voter of a kraft version 1 set, whose advertised endpoints differ
          from its entry (it restarted on a new address), and which has not
          updated this leader yet: UpdateRaftVoter, as Kafka's follower does;
        * an observer with auto-join on (KIP-1186's
          controller.quorum.auto.join.enable): if the set names our node id
          with another directory id -- our old, wiped disk -- RemoveRaftVoter
          for that stale voter first; else AddRaftVoter for our own key. The
          leader refuses (REQUEST_TIMED_OUT) until we are caught up.
        """
        ctx = self.ctx
        vs = ctx.electorate.voter_set
        cfg = ctx.config
        if (self.leader_id < 0 or vs.kraft_version != 1 or vs.unknown or not cfg.listeners
                or ctx.shutting_down or ctx.electorate.directory_id == m.NO_DIRECTORY_ID):
            return None
        # (asked at every step's deadlines: nothing is built before it is needed)
        if ctx.electorate.is_voter:
            if self.voter_updated or tuple(vs.endpoints.get(ctx.electorate.node_id, ())) == cfg.listeners:
                return None
            listeners = [m.RaftListener(*ln) for ln in cfg.listeners]
            return m.UpdateRaftVoterRequest(
                cluster_id=cfg.cluster_id, current_leader_epoch=self.epoch, voter_id=ctx.electorate.node_id,
                voter_directory_id=ctx.electorate.directory_id, listeners=listeners)
        if not cfg.auto_join_enable:
            return None
        # The leader answers once the change commits, or at this timeout: before ours.
        timeout_ms = cfg.request_timeout_ms * 3 // 4
        stale = vs.directory_ids.get(ctx.electorate.node_id)
        if stale is not None:
            return m.RemoveRaftVoterRequest(cluster_id=cfg.cluster_id, voter_id=ctx.electorate.node_id,
                                            voter_directory_id=stale, timeout_ms=timeout_ms)
        return m.AddRaftVoterRequest(cluster_id=cfg.cluster_id, voter_id=ctx.electorate.node_id,
                                     voter_directory_id=ctx.electorate.directory_id,
                                     listeners=[m.RaftListener(*ln) for ln in cfg.listeners],
                                     timeout_ms=timeout_ms)

    def on_membership_answer(self, request_id: int, resp: m.Body, now_ms: int) -> None:
        if self.membership_inflight != request_id:
            return
        self.membership_inflight = None
        if isinstance(resp, m.UpdateRaftVoterResponse) and resp.error_code == Errors.NONE:
            self.voter_updated = True  # the leader has our endpoints (committed)
            return
        # Refused (not caught up yet, another change in progress, ...) or
        # done (an add or a removal committed: we see it once we replicate
        # it): look again after a fetch timeout, as Kafka's timer does.
        self.membership_at_ms = now_ms + self.ctx.config.fetch_timeout_ms

    def on_membership_failed(self, request_id: int, now_ms: int) -> None:
        self.on_membership_answer(request_id, m.ErrorResponse(error_code=Errors.REQUEST_TIMED_OUT), now_ms)


    def grant_vote(self, req: m.VoteRequest, running_deadline_ms: int | None, now_ms: int) -> bool:
        """Only an observer addressed by its own voter key gets here with a
        chance (KIP-853: a voter that has not replicated the VotersRecord
        adding it). One persisted vote per epoch, none while a leader of
        the epoch is known, only for a log at least as up to date. A voter
        following a leader never grants (it hears from that leader)."""
        ctx = self.ctx
        if ctx.electorate.is_voter or self.leader_id >= 0:
            return False
        if self.voted_id >= 0:
            return self.voted_id == req.candidate_id
        log = ctx.log
        if not log.up_to_date(req.last_offset_epoch, req.last_offset):
            return False
        # Still an observer (it keeps fetching); the vote is persisted before the answer.
        ctx.transition(FollowerState(ctx, self.epoch, NO_LEADER, req.candidate_id, start=False,
                                      fetch_retry_at_ms=self.fetch_retry_at_ms,
                                      need_epoch_check=self.need_epoch_check), now_ms)
        return True

    def postpone_candidacy(self, now_ms: int) -> None:
        super().postpone_candidacy(now_ms)
        self.fetch_deadline_ms = now_ms + self.ctx.config.fetch_timeout_ms

    def on_end_quorum_epoch(self, req: m.EndQuorumEpochRequest, now_ms: int) -> None:
        ctx = self.ctx
        if not ctx.electorate.is_voter or self.leader_id != req.leader_id or ctx.shutting_down:
            return
        # The leader is leaving: the most caught-up successor goes first, and
        # we grant the others' pre-votes (KIP-996) without waiting out the
        # fetch timeout.
        ctx.elections.forget_leader_contact()
        succ = req.preferred_successors
        backoff_max_ms = ctx.config.election_backoff_max_ms
        if ctx.electorate.node_id in succ:
            pos = succ.index(ctx.electorate.node_id)
            backoff_ms = 0 if pos == 0 else min(RETRY_BACKOFF_BASE_MS << (pos - 1), backoff_max_ms)
        else:
            backoff_ms = backoff_max_ms
        self.fetch_deadline_ms = min(self.fetch_deadline_ms or now_ms + backoff_ms, now_ms + backoff_ms)

    # -- the log changed under us ---------------------------------------------

    def on_log_cut(self, now_ms: int) -> None:
        self.start_following(now_ms)  # re-validate the end with the leader, re-fetch

    def on_log_rewound(self, now_ms: int) -> None:
        self.fetch_inflight = None  # a Fetch sent under the dropped view: its answer is ignored
        self.start_following(now_ms)

    # -- sending ---------------------------------------------------------------

    def maybe_send_fetch(self, now_ms: int) -> None:
        if self.fetch_inflight is not None or now_ms < self.fetch_retry_at_ms:
            return
        ctx = self.ctx
        log = ctx.log
        if log.flushed_end_offset < log.log_end_offset:
            return  # never report an unflushed offset: wait for FlushCompleted
        leader = self.leader_id
        cfg = ctx.config
        if leader < 0:
            others = ctx.electorate.others
            if ctx.electorate.is_voter or not others:
                return
            # Observer: ask a random voter; any answer names the leader. Never
            # ourselves: a wiped voter's node id is still in the set (KIP-853).
            dest = others[ctx.random.randrange(len(others))]
            self.fetch_inflight = ctx.send(dest, self._fetch_request(), RequestKind.FETCH)
            return
        if self.download is not None:
            d = self.download
            self.fetch_inflight = ctx.send(leader, m.FetchSnapshotRequest(
                cluster_id=cfg.cluster_id, replica_id=ctx.electorate.node_id, current_leader_epoch=self.epoch,
                snapshot_id=d.snapshot_id, position=d.position, max_bytes=cfg.snapshot_chunk_bytes,
                replica_directory_id=ctx.electorate.directory_id,
            ), RequestKind.FETCH_SNAPSHOT, d.position)
        elif self.need_epoch_check:
            self.fetch_inflight = ctx.send(leader, m.OffsetsForLeaderEpochRequest(
                cluster_id=cfg.cluster_id, replica_id=ctx.electorate.node_id, current_leader_epoch=self.epoch,
                leader_epoch=log.last_epoch(),
            ), RequestKind.EPOCH_CHECK)
        else:
            self.fetch_inflight = ctx.send(leader, self._fetch_request(), RequestKind.FETCH)

    def _fetch_request(self) -> m.FetchRequest:
        ctx = self.ctx
        cfg = ctx.config
        log = ctx.log
        return m.FetchRequest(
            cluster_id=cfg.cluster_id, replica_id=ctx.electorate.node_id,
            max_wait_ms=cfg.fetch_max_wait_ms, current_leader_epoch=self.epoch,
            fetch_offset=log.flushed_end_offset,
            last_fetched_epoch=max(log.last_epoch(), 0),
            log_start_offset=log.log_start_offset, max_bytes=cfg.fetch_max_bytes,
            replica_directory_id=ctx.electorate.directory_id,
        )

    # -- answers -----------------------------------------------------------------

    def _retry_later(self, now_ms: int) -> None:
        self.fetch_retry_at_ms = now_ms + RETRY_BACKOFF_MS

    def fetch_failed(self, request_id: int, destination: int, reason: str, sent_epoch: int, now_ms: int) -> None:
        if self.fetch_inflight != request_id:
            return
        self.fetch_inflight = None
        self._retry_later(now_ms)
        if self.download is None and self.need_epoch_check and closed_by_peer(reason):
            # The leader took our epoch check (OffsetForLeaderEpoch) and closed the
            # connection. A Kafka controller does: it does not serve that api on its
            # controller listener ("Received request for disabled api with key 23"); its
            # own followers validate with Fetch's LastFetchedEpoch alone (DivergingEpoch),
            # as we do next. A leader really gone refuses that Fetch, and then we stand.
            self.need_epoch_check = False
            return
        if (sent_epoch == self.epoch and destination == self.leader_id >= 0
                and self.fetch_deadline_ms is not None and is_connection_failure(reason)):
            self._on_leader_unreachable(now_ms)

    def _on_leader_unreachable(self, now_ms: int) -> None:
        """The leader's process refused or reset our connection: it has crashed
        (a slow or partitioned leader times out instead). Rather than wait out the
        whole fetch timeout, give up on it after a short randomized delay,
        uniform in [election_timeout_ms / 10, election_timeout_ms / 2]: the
        followers that notice together rarely stand together (split vote), and a
        transient reset costs nothing -- the retried fetches keep going every
        RETRY_BACKOFF_MS and the first answer restores the full timeout.
        We also stop refusing the other followers' pre-votes for it (they see
        the same resets). Safety does not depend on it: an election is only
        an election."""
        self.ctx.elections.forget_leader_contact()
        self.stand_soon(now_ms)

    def stand_soon(self, now_ms: int) -> None:
        """Give the leader a short randomized grace, uniform in
        [election_timeout_ms / 10, election_timeout_ms / 2], instead of a
        whole fetch timeout before we stand (ask for pre-votes) again."""
        if self.leader_id < 0 or self.fetch_deadline_ms is None:
            return  # no leader to wait for (an observer of nobody)
        self.fetch_deadline_ms = min(self.fetch_deadline_ms, now_ms + self.ctx.elections.grace_ms())

    def fetch_answered(self, request_id: int) -> bool:
        if self.fetch_inflight != request_id:
            return False  # superseded by a role or epoch change
        self.fetch_inflight = None
        return True

    def on_fetch_answer(self, kind: RequestKind, destination: int, position: int, resp: m.Body,
                        now_ms: int) -> None:
        if self.leader_id < 0 or destination != self.leader_id:
            self._retry_later(now_ms)
            return  # a discovery answer that named no leader
        if kind is RequestKind.FETCH:
            self._on_fetch_response(resp, now_ms)
        elif kind is RequestKind.EPOCH_CHECK:
            self._on_epoch_check_response(resp, now_ms)
        else:
            self._on_fetch_snapshot_response(resp, position, now_ms)

    def _heard_from_leader(self, resp: m.Body, expected: type[_Answer], now_ms: int) -> TypeGuard[_Answer]:
        """A good answer of the expected type restarts the fetch timeout; any
        other is retried after a pause."""
        if not isinstance(resp, expected) or resp.error_code != Errors.NONE:
            if self._leader_resigned(resp):
                # Our leader says it no longer leads our epoch (it resigned:
                # check-quorum, or restarted, KAFKA-10527): grant pre-votes.
                self.ctx.elections.forget_leader_contact()
            self._retry_later(now_ms)
            return False
        self.fetch_deadline_ms = now_ms + self.ctx.config.fetch_timeout_ms
        self.ctx.elections.note_leader_contact(self.epoch, now_ms)
        return True

    def _leader_resigned(self, resp: m.Body) -> bool:
        """NOT_LEADER_OR_FOLLOWER from the leader we follow, about our epoch.
        A Fetch or FetchSnapshot answer says it with its current leader (none,
        in our epoch). Kafka's OffsetForLeaderEpoch answer has no such field,
        but a replica's epoch check is always fenced (inbound.fence): a later
        epoch would answer FENCED_LEADER_EPOCH, an earlier one
        UNKNOWN_LEADER_EPOCH, so NOT_LEADER_OR_FOLLOWER is our epoch, and the
        one node that led it no longer does."""
        if getattr(resp, "error_code", None) != Errors.NOT_LEADER_OR_FOLLOWER:
            return False
        if isinstance(resp, m.OffsetsForLeaderEpochResponse):
            return True
        cl = getattr(resp, "current_leader", None)
        return cl is not None and cl.leader_epoch == self.epoch and cl.leader_id == NO_LEADER

    def _on_fetch_response(self, resp: m.Body, now_ms: int) -> None:
        if not self._heard_from_leader(resp, m.FetchResponse, now_ms):
            return
        ctx = self.ctx
        log = ctx.log
        if resp.diverging_epoch is not None:
            de = resp.diverging_epoch
            log.truncate_to_leader(de.epoch, de.end_offset, "DivergingEpoch")
            if ctx.fatal_reason is None:
                log.follower_hw(resp.high_watermark)
            return
        if resp.snapshot_id is not None:
            sid = resp.snapshot_id
            if log.high_watermark > sid.end_offset:
                ctx.fail(f"leader redirected us to snapshot {sid.end_offset}-{sid.epoch}, below "
                          f"our high watermark {log.high_watermark}")
                return
            self.download = SnapshotDownload(sid, 0)
            return
        if resp.records:
            if not log.append_fetched(resp.records, self.epoch):
                self._retry_later(now_ms)
                return
        log.follower_hw(resp.high_watermark)
        log.follower_log_start(resp.log_start_offset)

    def _on_epoch_check_response(self, resp: m.Body, now_ms: int) -> None:
        if not self._heard_from_leader(resp, m.OffsetsForLeaderEpochResponse, now_ms):
            return
        ctx = self.ctx
        log = ctx.log
        asked = log.last_epoch()
        if resp.leader_epoch > asked:
            # The leader's history starts past our last epoch (it answered with the
            # snapshot its log starts at): it cannot say where our log diverges.
            # Fetch; the leader's fetch validation sends us that snapshot.
            self.need_epoch_check = False
            return
        log.truncate_to_leader(resp.leader_epoch, resp.end_offset, "OffsetsForLeaderEpoch")
        if ctx.fatal_reason is not None:
            return
        # Done unless the leader answered an older epoch we also hold and our log
        # still ends in a later epoch of our own (Kafka asks again then).
        local_epoch = log.last_epoch()
        self.need_epoch_check = (
            resp.leader_epoch >= 0 and local_epoch != resp.leader_epoch and local_epoch != asked
            and log.log_end_offset > log.log_start_offset
        )

    def _on_fetch_snapshot_response(self, resp: m.Body, position: int, now_ms: int) -> None:
        d = self.download
        if d is None:
            return
        if (not isinstance(resp, m.FetchSnapshotResponse) or resp.error_code != Errors.NONE
                or resp.snapshot_id != d.snapshot_id or resp.position != position
                or resp.size <= 0):
            # SNAPSHOT_NOT_FOUND, POSITION_OUT_OF_RANGE...: rediscover with a Fetch.
            self.download = None
            self._retry_later(now_ms)
            return
        ctx = self.ctx
        self.fetch_deadline_ms = now_ms + ctx.config.fetch_timeout_ms
        ctx.elections.note_leader_contact(self.epoch, now_ms)
        data = resp.unaligned_records
        if not data and position < resp.size:
            self.download = None
            self._retry_later(now_ms)
            return
        d.position = position + len(data)
        more = d.position < resp.size
        if more:
            # The next chunk is asked for before this one is written: the
            # leader reads and sends it while the driver writes, checks and
            # loads this one. A FetchSnapshot acknowledges nothing, so no
            # write need be durable before it is sent.
            self.maybe_send_fetch(now_ms)
        ctx.emit(WriteSnapshotChunk(d.snapshot_id, position, data))
        try:
            d.scan(data)
        except CorruptBatchError:
            pass  # a damaged snapshot: the driver's verification refuses it at install
        if more:
            return
        self.download = None
        ctx.log.install_snapshot(d.snapshot_id, resp.size, d.voter_set)
        self.need_epoch_check = False
