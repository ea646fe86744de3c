"""The produce path: client Produce requests become core appends.

A Produce request is checked (records given, producer fields well formed)
and queued in group commit (``metalog.storage.group_commit``): when the
disk is idle the queue is appended at the end of the loop turn it arrived
in (a writer alone: once the read that carried it is done); while a flush
runs it waits and becomes one batch when the flush completes (or after
``append_linger_ms`` if that is set above 0). The
batch is handed to the core as ONE ``ClientAppend`` (one append, one
flush), and each request is answered when the core acknowledges it.

A Kafka client's Produce (issue 32, ``metalog.broker.server.kafka.data``)
arrives as a ``PrebuiltProduce``: one whole RecordBatch v2 as the client
built it (CRC and records already checked). It queues in the same group
commit and is judged by the same producer state; its step hands the core
the batch itself (``ClientAppend(prebuilt=True)``), which appends it as
built, stamping only its base offset and partition leader epoch: no record
is re-encoded. A group mixing both kinds takes one core step per run of one
kind (one append each; the flusher's one fsync covers them all).

Idempotent produce (KIP-98, ``metalog.broker.server.idempotence``): a request
with a producer id is judged against the producer state at the log end
before its batch is formed. A duplicate is answered with its original's
offset once that is committed; an out-of-order or fenced one is refused.
``rebuild_producer_state`` rebuilds that state from the log (after a start,
a truncation, a snapshot install).

The runtime driver owns the core; this module only sees what
``ProduceCore`` names of it and steps it through the ``step`` it is given.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Container, Coroutine, NamedTuple, Protocol, cast

from metalog.broker.net.channel import NetError, PeerPool
from metalog.broker.net.kafka_conn import answer_writes
from metalog.broker.quorum import api as qa
from metalog.broker.server.clocks import now_ms, wall_clock_ms
from metalog.broker.server.idempotence import (REBUILD_READ_BYTES, ProducerGuard, ProducerIdAllocator, refusal,
                                               split_by_producer, validate_produce)
from metalog.broker.server.metrics import BrokerMetrics
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.protocol.errors import Errors
from metalog.protocol.invariants import InvariantViolation
from metalog.storage.batch import CorruptBatchError
from metalog.storage.errors import CorruptionReport
from metalog.storage.group_commit import Arm, GroupCommit
from metalog.storage.producer_state import BatchMeta, Check, ProducerStateTable, Verdict
from metalog.storage.segments import SegmentedLog

# Expired producers are dropped from memory at most this often (check()
# ignores expired ones anyway: this only bounds the tables' size).
PRODUCER_EXPIRY_INTERVAL_MS = 60_000

class Requester(Protocol):
    """Who asked a flat request and takes its flat answer: the router's view of
    a Kafka connection (``metalog.broker.server.kafka.dispatch``'s face)."""

    @property
    def principal(self) -> Any: ...  # metalog.broker.net.principal.Principal

    @property
    def peer(self) -> str: ...

    def send_response(self, correlation_id: int, body: m.Body) -> bool: ...


Token = tuple[Requester, int]  # (connection, correlation id): where a Produce is answered
# A producer as a produce names it: (id, epoch, base sequence, record count).
Ident = tuple[int, int, int, int]


class PrebuiltProduce(NamedTuple):
    """A Produce whose records are one whole RecordBatch v2 built by the client
    (a Kafka client's, issue 32): its CRC and records checked by whoever built
    this, its producer fields read from its header (-1: not idempotent)."""

    cluster_id: str | None  # None: the Kafka protocol carries none (the router's check skips it)
    batch: bytes | memoryview  # the client's bytes, not copied until the append joins them
    record_count: int
    producer_id: int
    producer_epoch: int
    base_sequence: int


class Spawner(Protocol):
    """Runs a background task whose escaping exception is fatal (the broker's BackgroundTasks)."""

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None: ...


class ProduceCore(Protocol):
    """What the produce path reads of the quorum core."""

    @property
    def is_leader(self) -> bool: ...

    @property
    def epoch(self) -> int: ...

    @property
    def high_watermark(self) -> int: ...

    def current_leader(self) -> m.LeaderIdAndEpoch: ...


class PeersHost(Protocol):
    """Where the broker keeps its channels to the other nodes (built after the produce path)."""

    cluster_id: str
    cfg: Any
    peers: PeerPool


def leader_asker(host: PeersHost) -> Callable[[int], Awaitable[m.Body]]:
    """ProducePath's `ask_leader`: an InitProducerId to the leader over the
    peers' channels, in this node's name (its certificate), bounded by the
    quorum's request timeout."""
    def ask(leader_id: int) -> Awaitable[m.Body]:
        return host.peers.channel(leader_id).request(ApiKey.INIT_PRODUCER_ID, m.InitProducerIdRequest(
            cluster_id=host.cluster_id), host.cfg.quorum.request_timeout_ms)

    return ask


def rebuild_producer_state(guard: ProducerGuard, committed: ProducerStateTable,
                           seg_log: SegmentedLog) -> CorruptionReport | None:
    """The producer state at the log end: the controller's committed copy
    plus the log after it. Returns the first damaged batch met, if any.

    A read from disk, so every CRC is checked (integrity.md: every read);
    a header that looks sane in a batch whose CRC fails must not become a
    producer's last sequence. On a damaged batch the table stops before
    the chunk that holds it (it never names a batch the quarantine cut
    will drop: a retry would be answered with an offset that is gone); the
    caller reacts as to any corruption (quarantine from the damage,
    re-fetch), and that cut rebuilds the table again from what is left."""
    damaged: list[CorruptBatchError] = []

    def read(offset: int) -> bytes:
        try:
            return seg_log.read(max(offset, seg_log.log_start_offset), seg_log.log_end_offset, REBUILD_READ_BYTES)
        except CorruptBatchError as exc:
            damaged.append(exc)
            return b""  # rebuild stops here

    guard.rebuild(committed, read, seg_log.log_end_offset)
    return damaged[0].report if damaged else None


def split_by_kind(runs: list[list[tuple[Any, int]]], prebuilt: Container[Any]) -> list[list[tuple[Any, int]]]:
    """Cut each run where it changes between plain records and client-built
    batches (a token in `prebuilt`): one core step appends one kind."""
    out: list[list[tuple[Any, int]]] = []
    for run in runs:
        cur: list[tuple[Any, int]] = []
        kind = False
        for waiter in run:
            built = waiter[0] in prebuilt
            if cur and built is not kind:
                out.append(cur)
                cur = []
            kind = built
            cur.append(waiter)
        if cur:
            out.append(cur)
    return out


class ProducePath:
    """Group commit of Produce requests, idempotence, InitProducerId."""

    def __init__(self, node_id: int, core: ProduceCore, group_commit: GroupCommit, guard: ProducerGuard,
                 metrics: BrokerMetrics, logger: Any, *, step: Callable[[qa.Event], None],
                 failed: Callable[[], bool], committed_producers: Callable[[], ProducerStateTable],
                 ask_leader: Callable[[int], Awaitable[m.Body]] | None = None, forwards: Spawner | None = None):
        self._node_id = node_id
        self._core = core
        self.group_commit = group_commit
        self.guard = guard  # the producer state at the log end (the driver feeds it every append)
        self._metrics = metrics
        self._log = logger
        self._step = step  # steps the core with an event
        self._failed = failed  # the broker is failing (fatal): nothing more is appended
        self._committed_producers = committed_producers  # the controller's copy, expired with ours
        # A follower asks the leader for a client's producer id (init_producer_id):
        # ask_leader(leader id) -> its InitProducerIdResponse, awaited in a task of `forwards`.
        self._ask_leader = ask_leader if forwards is not None else None
        self._forwards = cast(Spawner, forwards)
        # Produce tokens handed to the core and not yet answered (bounded by
        # the connections' in-flight limits): answered KAFKA_STORAGE_ERROR if
        # the disk fails before the core acknowledges them. The driver
        # discards a token when the core answers it.
        self.unanswered: set[Any] = set()
        # Queued idempotent requests by token (each becomes its own batch).
        self._idempotent: dict[Any, m.ProduceRequest] = {}
        # Queued client-built batches by token (a Kafka client's Produce).
        self._prebuilt: dict[Any, PrebuiltProduce] = {}
        self._producer_ids = ProducerIdAllocator()  # the ids this node hands out while it leads
        self._expired_at_ms = 0  # wall clock of the last expiry of producers from memory
        self._linger_handle: asyncio.Handle | None = None  # group commit's linger timer or call_soon

    # ------------------------------------------------------------ queueing
    def enqueue(self, token: Token, body: m.ProduceRequest | PrebuiltProduce) -> None:
        """A Produce request from the wire: refused now, or queued for the next batch."""
        if type(body) is PrebuiltProduce:
            # Counts as one record toward append_batch_records_max (a batch
            # of its own in the append, whatever it holds).
            self._prebuilt[token] = body
            self._arm(self.group_commit.offer(token, [cast(bytes, body.batch)]))
            return
        body = cast(m.ProduceRequest, body)
        problem = "a produce request needs at least one record" if not body.records else validate_produce(body)
        if problem is not None:
            conn, cid = token
            conn.send_response(cid, m.ProduceResponse(error_code=Errors.INVALID_REQUEST, error_message=problem))
            return
        if body.producer_id >= 0:
            # Judged against the producer state when its batch is formed
            # (flush), after every batch queued before it.
            self._idempotent[token] = body
        self._arm(self.group_commit.offer(token, body.records))

    def _arm(self, arm: Arm) -> None:
        if arm is Arm.APPEND_NOW:
            self.flush()
        elif arm is Arm.LINGER:
            self._linger_handle = asyncio.get_running_loop().call_later(
                self.group_commit.linger_ms / 1000, self.flush)
        elif arm is Arm.END_OF_READ:
            # After the frames of this read (a connection's answer scope), or now outside one.
            asyncio.get_running_loop().call_soon(self.group_commit.turn_ended)
            answer_writes.after_writes(self.flush)
        elif arm is Arm.END_OF_TURN:
            self._linger_handle = asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Hand everything queued to the core as one append (group commit)."""
        if self._linger_handle is not None:  # a TimerHandle or a call_soon Handle
            self._linger_handle.cancel()
            self._linger_handle = None
        batch = self.group_commit.take()
        if batch is None:
            return
        waiters, records = batch
        if self._idempotent or self._prebuilt:
            self._append_group(waiters, records)
            return
        self.unanswered.update(token for token, _n in waiters)
        self._metrics.appended_records.inc(len(records))
        # (token, count) pairs are what AppendWaiter is: no copy on the commit path.
        self._step(qa.ClientAppend(now_ms(), cast("list[qa.AppendWaiter]", waiters), records, wall_clock_ms()))

    # ------------------------------------------------- idempotent produce
    def _append_group(self, waiters: list[tuple[Any, int]], records: list[bytes]) -> None:
        """One group commit holding idempotent requests: ONE core step (one
        append, one flush) with one batch per idempotent request (its producer
        fields in the header) and one per run of plain requests, every
        idempotent request judged against the producer state before the step.
        A producer id appears at most once per step (split_by_producer): a
        group holding two requests of one producer takes one step more."""
        if self._failed():
            for token, _n in waiters:
                self._idempotent.pop(token, None)
                self._prebuilt.pop(token, None)
                conn, cid = token
                conn.send_response(cid, m.ProduceResponse(error_code=Errors.BROKER_NOT_AVAILABLE))
            return
        # Every token counts as handed to the core until answered here, so a
        # storage failure in one of the steps answers the rest too.
        self.unanswered.update(token for token, _n in waiters)
        records_of: dict[Any, list[bytes]] = {}
        pos = 0
        for token, n in waiters:
            records_of[token] = records[pos:pos + n]
            pos += n
        runs = split_by_kind(split_by_producer(waiters, self._producer_of), self._prebuilt)
        parked = False
        for run in runs:
            if self._failed():
                return  # the storage failure answered every unanswered token
            parked |= self._append_run(run, records_of)
        if parked and not self._failed():
            self.release_duplicates()  # an original may be committed already

    def _producer_of(self, token: Any) -> int | None:
        body = self._idempotent.get(token)
        if body is not None:
            return body.producer_id
        built = self._prebuilt.get(token)
        return built.producer_id if built is not None and built.producer_id >= 0 else None

    def _take_ident(self, token: Any, n: int) -> tuple[Ident | None, int]:
        """The queued request's producer (None: plain) and record count, forgotten here."""
        built = self._prebuilt.pop(token, None)
        if built is not None:
            ident = (built.producer_id, built.producer_epoch, built.base_sequence, built.record_count)
            return (ident if built.producer_id >= 0 else None), built.record_count
        body = self._idempotent.pop(token, None)
        if body is None:
            return None, n
        return (body.producer_id, body.producer_epoch, body.base_sequence, len(body.records)), n

    def _append_run(self, run: list[tuple[Any, int]], records_of: dict[Any, list[bytes]]) -> bool:
        """One step of _append_group (a run of one kind: records or client-built
        batches); True if a duplicate was parked."""
        now_wall_ms = wall_clock_ms()
        is_leader = self._core.is_leader
        prebuilt = run[0][0] in self._prebuilt
        step_waiters: list[tuple[Any, int]] = []
        step_records: list[bytes] = []
        step_producers: list[tuple[int, int, int] | None] = []
        parked = False
        appended = 0
        for token, queued in run:
            ident, n = self._take_ident(token, queued)
            producer: tuple[int, int, int] | None
            if ident is not None and is_leader:
                check = self.guard.table.check(*ident, now_wall_ms)
                if check.verdict is not Verdict.APPEND:
                    parked |= self._answer_unappended(token, ident, check)
                    continue
                producer = ident[:3]
            else:
                # Plain; or not the leader, and the core answers every waiter
                # NOT_LEADER_OR_FOLLOWER (the client retries at the leader).
                producer = None
            step_waiters.append((token, n))
            step_records.extend(records_of[token])
            step_producers.append(producer)
            appended += n
        if step_waiters:
            self._metrics.appended_records.inc(appended)
            # (a prebuilt batch carries its producer in its header: the core needs no entry)
            idempotent = not prebuilt and any(p is not None for p in step_producers)
            self._step(qa.ClientAppend(now_ms(), cast("list[qa.AppendWaiter]", step_waiters), step_records,
                                       wall_clock_ms(),
                                       producers=step_producers if idempotent else None, prebuilt=prebuilt))
        return parked

    def _answer_unappended(self, token: Token, ident: Ident, check: Check) -> bool:
        """A duplicate (parked until its original is committed) or a refusal;
        True if parked."""
        self.unanswered.discard(token)
        conn, cid = token
        producer_id, producer_epoch, base_sequence, _count = ident
        if check.verdict is Verdict.DUPLICATE:
            original = check.original
            if not isinstance(original, BatchMeta):  # the table names the original of every duplicate
                raise InvariantViolation(f"duplicate of producer {producer_id} without its original batch")
            self._log.info("produce_duplicate", producer_id=producer_id, producer_epoch=producer_epoch,
                           base_sequence=base_sequence, original_base_offset=original.base_offset)
            if self.guard.park_duplicate(token, original):
                return True
            conn.send_response(cid, m.ProduceResponse(error_code=Errors.REQUEST_TIMED_OUT,
                                                      error_message="too many duplicate produces waiting"))
            return False
        self._log.warning("produce_refused", producer_id=producer_id, verdict=check.verdict.value,
                          reason=check.message)
        conn.send_response(cid, refusal(check))
        return False

    def release_duplicates(self) -> None:
        """Answer the parked duplicates whose original is committed (after each step)."""
        core = self._core
        if self.guard.has_parked:  # (after every step: no leader struct built for nothing)
            for (conn, cid), response in self.guard.release(core.high_watermark, core.is_leader,
                                                            core.current_leader()):
                conn.send_response(cid, response)
        wall_ms = wall_clock_ms()
        if wall_ms - self._expired_at_ms >= PRODUCER_EXPIRY_INTERVAL_MS:
            self._expired_at_ms = wall_ms
            self.guard.table.expire(wall_ms)
            self._committed_producers().expire(wall_ms)

    def init_producer_id(self, conn: Requester, correlation_id: int) -> None:
        """InitProducerId: a new id from this leader's epoch (metalog.broker.server.idempotence).

        Not the leader: a client's request is asked of the leader in this
        node's name (``ask_leader``), as Kafka's brokers get producer ids from
        their controller: Kafka's clients ask any broker they are connected
        to for an idempotent producer's id (librdkafka keeps asking the first
        one up). Ids come only from the leader's epoch, so they stay unique.
        A request from a node (a forward) is not forwarded again."""
        core = self._core
        leader_id = core.current_leader().leader_id
        if (not core.is_leader and self._ask_leader is not None and 0 <= leader_id != self._node_id
                and getattr(conn.principal, "node_id", None) is None):
            self._forwards.spawn(self._forward_init(leader_id, conn, correlation_id))
            return
        if not core.is_leader:
            conn.send_response(correlation_id, m.InitProducerIdResponse(
                error_code=Errors.NOT_LEADER_OR_FOLLOWER, current_leader=core.current_leader(),
                error_message=f"node {self._node_id} is not the leader"))
            return
        conn.send_response(correlation_id, self._producer_ids.allocate(core.epoch, core.current_leader()))

    async def _forward_init(self, leader_id: int, conn: Requester, correlation_id: int) -> None:
        if self._ask_leader is None:
            raise InvariantViolation("an InitProducerId forwarded without a way to the leader")
        try:
            response = await self._ask_leader(leader_id)
        except (NetError, KeyError) as exc:  # the leader unreachable or unknown: the client retries
            response = m.InitProducerIdResponse(
                error_code=Errors.NOT_LEADER_OR_FOLLOWER, current_leader=self._core.current_leader(),
                error_message=f"node {self._node_id} could not ask leader {leader_id} for a producer id: {exc}")
        conn.send_response(correlation_id, response)

    # ------------------------------------------------------- disk failure
    def reject_pending(self, message: str) -> None:
        """The disk failed: every write queued here, or handed to the core and
        not acknowledged (its batch may not be durable), or parked as a
        duplicate is answered KAFKA_STORAGE_ERROR; none will be acknowledged
        by this process."""
        tokens = self.group_commit.drop_all() + list(self.unanswered) + self.guard.drop_parked()
        self.unanswered.clear()
        self._idempotent.clear()
        self._prebuilt.clear()
        for conn, cid in tokens:
            conn.send_response(cid, m.ProduceResponse(error_code=Errors.KAFKA_STORAGE_ERROR, error_message=message))
