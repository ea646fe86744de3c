"""Producer state for idempotent produce (Kafka KIP-98's ProducerStateManager idea).

A producer (id from InitProducerId, epoch, per-record sequence numbers) writes
batches whose v2 header carries ``producer_id``, ``producer_epoch`` and
``base_sequence`` (metalog.storage.batch). This table remembers, per producer id, the
epoch, the last ``RETAINED_BATCHES`` batches it appended (first/last sequence,
first/last offset, leader epoch) and the timestamp of its last batch. The
leader consults it before appending a client's batch: the same
(id, epoch, first sequence, last sequence) as a retained batch is a
duplicate, answered with that batch's original offset; a sequence that does
not follow the last one is out of order.

Pure: no clock (callers pass ``now_ms``), no I/O. It is rebuilt from batch
headers in log order (``apply_header`` / ``apply_data``), so a leader and a
follower that hold the same log hold the same table, and a copy at a
committed offset plus the log after it rebuilds it after a truncation.
``to_entries`` / ``from_entries`` give the snapshot form.
"""

from __future__ import annotations

import enum
from collections import deque
from typing import Iterable, NamedTuple

from metalog.protocol.invariants import InvariantViolation, invariant
from metalog.storage.batch import ATTR_CONTROL, BatchHeader, iter_batches

NO_PRODUCER_ID = -1
NO_PRODUCER_EPOCH = -1
NO_SEQUENCE = -1
RETAINED_BATCHES = 5  # Kafka keeps the metadata of a producer's last 5 batches
DEFAULT_EXPIRATION_MS = 86_400_000  # Kafka's transactional.id.expiration / producer.id.expiration.ms


class BatchMeta(NamedTuple):
    """One appended batch of a producer."""

    first_seq: int
    last_seq: int
    base_offset: int
    last_offset: int
    leader_epoch: int


class ProducerEntry:
    __slots__ = ("producer_id", "producer_epoch", "batches", "last_timestamp_ms")

    def __init__(self, producer_id: int, producer_epoch: int, last_timestamp_ms: int,
                 batches: Iterable[BatchMeta] = ()) -> None:
        self.producer_id = producer_id
        self.producer_epoch = producer_epoch
        self.last_timestamp_ms = last_timestamp_ms
        self.batches: deque[BatchMeta] = deque(batches, maxlen=RETAINED_BATCHES)

    @property
    def last_seq(self) -> int:
        return self.batches[-1].last_seq if self.batches else NO_SEQUENCE

    def copy(self) -> "ProducerEntry":
        return ProducerEntry(self.producer_id, self.producer_epoch, self.last_timestamp_ms, self.batches)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ProducerEntry):
            return NotImplemented
        return (self.producer_id, self.producer_epoch, self.last_timestamp_ms, list(self.batches)) == (
            other.producer_id, other.producer_epoch, other.last_timestamp_ms, list(other.batches))

    __hash__ = None  # type: ignore[assignment]  # mutable: unhashable, as Python spells it (typeshed types __hash__ as a method)

    def __repr__(self) -> str:
        return (f"ProducerEntry(id={self.producer_id}, epoch={self.producer_epoch}, "
                f"last_ts={self.last_timestamp_ms}, batches={list(self.batches)})")


class Verdict(enum.Enum):
    APPEND = "append"  # a new batch in sequence: append it
    DUPLICATE = "duplicate"  # already appended: answer with the original offset
    OUT_OF_ORDER = "out_of_order"  # OUT_OF_ORDER_SEQUENCE_NUMBER (45)
    UNKNOWN_PRODUCER = "unknown_producer"  # UNKNOWN_PRODUCER_ID (59): the client re-inits
    FENCED_EPOCH = "fenced_epoch"  # INVALID_PRODUCER_EPOCH (47)


class Check(NamedTuple):
    verdict: Verdict
    original: BatchMeta | None = None  # for DUPLICATE
    message: str = ""


class ProducerStateTable:
    """Producer id -> ProducerEntry, as of ``end_offset`` (every batch below it applied)."""

    def __init__(self, expiration_ms: int = DEFAULT_EXPIRATION_MS, end_offset: int = 0) -> None:
        invariant(expiration_ms > 0, "expiration_ms %r must be positive", expiration_ms)
        self.expiration_ms = expiration_ms
        self.end_offset = end_offset
        self.producers: dict[int, ProducerEntry] = {}

    # -- rebuilt from the log ---------------------------------------------
    def apply_header(self, h: BatchHeader) -> None:
        """Apply one whole batch appended at h.base_offset (batches in log order).

        Runs for every batch a node appends or applies (one per idempotent
        request), so it reads the header's fields directly."""
        base = h.base_offset
        if base < self.end_offset:
            raise InvariantViolation(f"batches must be applied in log order: got {base}, next is {self.end_offset}")
        last = base + h.last_offset_delta
        self.end_offset = last + 1
        pid = h.producer_id
        if pid < 0 or h.attributes & ATTR_CONTROL:
            return
        ts = h.max_timestamp_ms
        entry = self.producers.get(pid)
        if entry is None or h.producer_epoch > entry.producer_epoch:
            # New producer, or a new epoch: the old epoch's history no longer matters.
            entry = self.producers[pid] = ProducerEntry(pid, h.producer_epoch, ts)
        elif ts > entry.last_timestamp_ms:
            entry.last_timestamp_ms = ts
        seq = h.base_sequence
        entry.batches.append(BatchMeta(seq, seq + h.records_count - 1, base, last, h.leader_epoch))

    def apply_headers(self, headers: Iterable[BatchHeader]) -> None:
        """Apply batches already parsed (in log order), skipping those that end
        at or below end_offset (see apply_data)."""
        for h in headers:
            if h.base_offset + h.last_offset_delta >= self.end_offset:
                self.apply_header(h)

    def apply_data(self, data: bytes | memoryview, skip_below: int | None = None) -> None:
        """Apply every whole batch in `data` (as the log holds them), skipping
        batches that end at or below `skip_below` (default: end_offset)."""
        floor = self.end_offset if skip_below is None else skip_below
        for _pos, h in iter_batches(data, verify=False):
            if h.next_offset <= floor:
                continue
            self.apply_header(h)

    # -- the leader's check before appending --------------------------------
    def check(self, producer_id: int, producer_epoch: int, first_seq: int, record_count: int,
              now_ms: int) -> Check:
        if producer_id < 0 or record_count <= 0:
            raise InvariantViolation(f"check of producer id {producer_id} with {record_count} records")
        last_seq_new = first_seq + record_count - 1
        entry = self.producers.get(producer_id)
        if entry is not None and self.expired(entry, now_ms):
            entry = None
        if entry is None:
            if first_seq == 0:
                return Check(Verdict.APPEND)
            return Check(Verdict.UNKNOWN_PRODUCER, message=(
                f"no state for producer id {producer_id} (never seen or expired after "
                f"{self.expiration_ms} ms idle) and its batch starts at sequence {first_seq}, not 0"))
        if producer_epoch < entry.producer_epoch:
            return Check(Verdict.FENCED_EPOCH, message=(
                f"producer id {producer_id} epoch {producer_epoch} is older than its current epoch "
                f"{entry.producer_epoch}"))
        if producer_epoch > entry.producer_epoch:
            if first_seq == 0:
                return Check(Verdict.APPEND)
            return Check(Verdict.OUT_OF_ORDER, message=(
                f"producer id {producer_id}: a new epoch {producer_epoch} must start at sequence 0, "
                f"got {first_seq}"))
        for meta in entry.batches:
            if meta.first_seq == first_seq and meta.last_seq == last_seq_new:
                return Check(Verdict.DUPLICATE, original=meta)
        expected = entry.last_seq + 1
        if first_seq == expected:
            return Check(Verdict.APPEND)
        return Check(Verdict.OUT_OF_ORDER, message=(
            f"producer id {producer_id} epoch {producer_epoch}: expected sequence {expected}, "
            f"got {first_seq}..{last_seq_new}"))

    # -- expiry ------------------------------------------------------------
    def expired(self, entry: ProducerEntry, now_ms: int) -> bool:
        return now_ms - entry.last_timestamp_ms >= self.expiration_ms

    def expire(self, now_ms: int) -> int:
        """Forget producers idle for expiration_ms; returns how many."""
        gone = [pid for pid, e in self.producers.items() if self.expired(e, now_ms)]
        for pid in gone:
            del self.producers[pid]
        return len(gone)

    # -- copies and the snapshot form ----------------------------------------
    def copy(self) -> "ProducerStateTable":
        c = ProducerStateTable(self.expiration_ms, self.end_offset)
        c.producers = {pid: e.copy() for pid, e in self.producers.items()}
        return c

    def to_entries(self) -> list[ProducerEntry]:
        """Entries sorted by producer id (deterministic snapshots)."""
        return [self.producers[pid] for pid in sorted(self.producers)]

    @classmethod
    def from_entries(cls, entries: Iterable[ProducerEntry], end_offset: int,
                     expiration_ms: int = DEFAULT_EXPIRATION_MS) -> "ProducerStateTable":
        t = cls(expiration_ms, end_offset)
        for e in entries:
            if e.producer_id in t.producers:
                raise InvariantViolation(f"producer id {e.producer_id} twice")
            t.producers[e.producer_id] = e.copy()
        return t

    def __len__(self) -> int:
        return len(self.producers)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ProducerStateTable):
            return NotImplemented
        return self.end_offset == other.end_offset and self.producers == other.producers

    __hash__ = None  # type: ignore[assignment]  # mutable: unhashable, as Python spells it (typeshed types __hash__ as a method)
