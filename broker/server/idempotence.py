"""The runtime's side of idempotent produce (KIP-98): producer ids and dedup.

* ``ProducerIdAllocator``: the ids InitProducerId hands out, unique from
  the leader epoch (no record, no wait).
* ``ProducerGuard``: the producer state as of the log END (appended, not only
  committed; metalog.storage.producer_state), fed with every batch the log appends
  (the leader's own and a follower's fetched ones alike), rebuilt after a
  truncation or a snapshot install from the controller's committed copy plus
  the log after it. ``check`` judges a produce before it is appended; a
  duplicate is answered with its original offset once that offset is
  committed (``park_duplicate`` / ``release``).

Sans-IO: the runtime passes the clock, the high watermark and a log reader.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Iterable, Iterator

from metalog.protocol import messages as m
from metalog.protocol.errors import Errors
from metalog.protocol.invariants import invariant
from metalog.storage.batch import BatchHeader
from metalog.storage.producer_state import BatchMeta, Check, ProducerStateTable, Verdict

# Duplicates waiting for their original's commit; each is a request in flight
# on some connection, so the connections' in-flight limits bound this too.
MAX_PARKED_DUPLICATES = 10_000
REBUILD_READ_BYTES = 1 << 20


# Ids one leader may hand out in its epoch: the low 32 bits of an id.
IDS_PER_EPOCH = 1 << 32


class ProducerIdAllocator:
    """Producer ids for InitProducerId: ``leader_epoch * 2**32 + n``, n
    counting up from 0 within the epoch, in memory.

    Unique without writing anything: an epoch has at most one leader ever
    (a vote is fsynced before it is granted, a voter grants one vote per
    epoch), an epoch is never led twice (a restarted leader starts a new
    epoch, KAFKA-10527), and epochs only grow. So two leaders never share
    the high half, and one leader never repeats the low half. See
    docs/client.md for the full argument.
    """

    def __init__(self) -> None:
        self._epoch = -1
        self._next = 0

    def allocate(self, leader_epoch: int, current_leader: m.LeaderIdAndEpoch) -> m.InitProducerIdResponse:
        invariant(leader_epoch >= 0, "producer ids allocated in epoch %d", leader_epoch)
        if leader_epoch != self._epoch:
            invariant(leader_epoch > self._epoch, "a leader's epoch only grows: %d after %d", leader_epoch,
                      self._epoch)
            self._epoch, self._next = leader_epoch, 0
        if self._next >= IDS_PER_EPOCH or leader_epoch >= 1 << 31:
            return m.InitProducerIdResponse(
                error_code=Errors.REQUEST_TIMED_OUT, current_leader=current_leader,
                error_message=f"no producer ids left in epoch {leader_epoch}: retry after the next election")
        pid = leader_epoch * IDS_PER_EPOCH + self._next
        self._next += 1
        return m.InitProducerIdResponse(producer_id=pid, producer_epoch=0, current_leader=current_leader)


def validate_produce(body: m.ProduceRequest) -> str | None:
    """Why an idempotent produce's producer fields are malformed, or None."""
    if body.producer_id < 0:
        if body.producer_epoch != -1 or body.base_sequence != -1:
            return (f"producer_epoch {body.producer_epoch} / base_sequence {body.base_sequence} "
                    f"given without a producer_id")
        return None
    if not 0 <= body.producer_epoch <= 0x7FFF:
        return f"producer_epoch {body.producer_epoch} out of range 0..32767"
    if not 0 <= body.base_sequence <= 0x7FFFFFFF - len(body.records):
        return f"base_sequence {body.base_sequence} out of range for {len(body.records)} record(s)"
    return None


def split_by_producer(waiters: list, producer_of: Callable[[Any], int | None]) -> list[list]:
    """Cut one group commit's waiters (token, record count) into consecutive
    runs in which no producer id appears twice (`producer_of(token)`: its id,
    or None for a plain request), keeping their order.

    Each run becomes one core step whose idempotent requests are all judged
    against the producer state before that step; a second request of the same
    producer (e.g. a retry queued next to its original) must be judged after
    the first was appended, so it starts the next run."""
    runs: list[list] = []
    run: list = []
    seen: set[int] = set()
    for waiter in waiters:
        pid = producer_of(waiter[0])
        if pid is not None:
            if pid in seen:
                runs.append(run)
                run, seen = [], set()
            seen.add(pid)
        run.append(waiter)
    if run:
        runs.append(run)
    return runs


_ERROR_OF = {
    Verdict.OUT_OF_ORDER: Errors.OUT_OF_ORDER_SEQUENCE_NUMBER,
    Verdict.UNKNOWN_PRODUCER: Errors.UNKNOWN_PRODUCER_ID,
    Verdict.FENCED_EPOCH: Errors.INVALID_PRODUCER_EPOCH,
}


def refusal(check: Check) -> m.ProduceResponse:
    """The answer to a produce the producer state refuses (not a duplicate)."""
    return m.ProduceResponse(error_code=_ERROR_OF[check.verdict], error_message=check.message)


class ProducerGuard:
    def __init__(self, expiration_ms: int):
        self.table = ProducerStateTable(expiration_ms)
        # (token, original batch) waiting until the HW passes the original.
        self._parked: collections.deque[tuple[Any, BatchMeta]] = collections.deque()
        self.duplicates = 0  # answered from the table instead of appended (diagnostics)

    # -- keeping the table at the log end ------------------------------------
    def rebuild(self, committed: ProducerStateTable, read: Callable[[int], bytes], log_end_offset: int) -> None:
        """The table from the committed copy (at committed.end_offset) plus the
        log from there to its end; `read(offset)` returns whole batches from
        `offset` (at least one unless offset is the end).

        After a quarantine cut the log may end BELOW the committed copy (a
        damaged sealed segment cut records this node had applied). The table
        is then the committed copy, ahead of the log: the batches the log
        re-fetches up to committed.end_offset are those very committed
        batches, and on_append skips them instead of applying them twice."""
        table = committed.copy()
        table.expiration_ms = self.table.expiration_ms
        offset = table.end_offset
        while offset < log_end_offset:
            data = read(offset)
            if not data:
                break
            table.apply_data(data, skip_below=offset)
            invariant(table.end_offset > offset, "producer state rebuild made no progress at offset %d", offset)
            offset = table.end_offset
        self.table = table

    def on_append(self, headers: Iterable[BatchHeader]) -> None:
        """The headers of the batches the log just appended (as its append
        parsed them). Those ending at or below the table's end are already in
        it (re-fetched after a quarantine cut, see rebuild); one straddling the
        end still fails apply_header's order check."""
        self.table.apply_headers(headers)

    # -- the leader's check --------------------------------------------------
    def check(self, body: m.ProduceRequest, now_ms: int) -> Check:
        return self.table.check(body.producer_id, body.producer_epoch, body.base_sequence,
                                len(body.records), now_ms)

    def park_duplicate(self, token: Any, original: BatchMeta) -> bool:
        """Answer `token` with `original`'s offset once it is committed; False if full."""
        self.duplicates += 1
        if len(self._parked) >= MAX_PARKED_DUPLICATES:
            return False
        self._parked.append((token, original))
        return True

    @property
    def has_parked(self) -> bool:
        """Some duplicate waits for its original's commit (release has work)."""
        return bool(self._parked)

    def release(self, high_watermark: int | None, is_leader: bool,
                current_leader: m.LeaderIdAndEpoch) -> Iterator[tuple[Any, m.ProduceResponse]]:
        """Answers for parked duplicates: committed ones with their original
        offset, all of them with NOT_LEADER_OR_FOLLOWER once we no longer lead
        (the client retries at the new leader, whose table knows the batch)."""
        if not self._parked:
            return
        if not is_leader:
            parked, self._parked = self._parked, collections.deque()
            for token, _meta in parked:
                yield token, m.ProduceResponse(error_code=Errors.NOT_LEADER_OR_FOLLOWER,
                                               current_leader=current_leader,
                                               error_message="leadership moved before the original was committed")
            return
        if high_watermark is None:
            return
        keep: collections.deque = collections.deque()
        for token, meta in self._parked:
            if meta.last_offset < high_watermark:
                yield token, m.ProduceResponse(base_offset=meta.base_offset, leader_epoch=meta.leader_epoch,
                                               current_leader=current_leader)
            else:
                keep.append((token, meta))
        self._parked = keep

    def drop_parked(self) -> list[Any]:
        tokens = [token for token, _meta in self._parked]
        self._parked.clear()
        return tokens
