"""The consumer of the client library: committed records in order, with
Kafka's truncation detection (KIP-320) and CRC checks.

``Consumer`` (``client.consumer(reset_policy)``) reads committed records with
Fetch (replica_id = CONSUMER_REPLICA_ID) and detects log truncation as KIP-320
asks of consumers:

* it remembers the leader epoch of the last record it consumed;
* after a leader change (a new leader epoch seen in metadata or in a hint, a
  FENCED_LEADER_EPOCH / UNKNOWN_LEADER_EPOCH answer) or after ``seek(offset,
  epoch)``, it asks the leader OffsetsForLeaderEpoch(last consumed epoch)
  before fetching again; a Fetch answer carrying ``diverging_epoch`` is the
  same answer delivered early;
* if the leader's end offset for that epoch is below the consumer's position,
  the records from that end offset on were truncated: with reset_policy
  "none" ``poll`` raises ``LogTruncationError(first_diverging_offset, epoch)``
  (and keeps raising until the user seeks); with "earliest" or "latest" the
  consumer resets precisely to that end offset (KIP-320's precise auto-reset;
  the policy name only matters when there is no position at all).
* an undefined answer (the leader knows no epoch <= ours) or
  OFFSET_OUT_OF_RANGE is out of range: "none" raises OffsetOutOfRangeError,
  the others reset to the earliest / latest offset via ListOffsets.

Every batch received is checked (Kafka's ``check.crcs``: header, length, CRC-32C)
before any record of it is handed out. A damaged batch raises
``CorruptRecordError`` naming the offset, the epoch and the broker that sent
it; the records before it in the same answer are returned first, and the
position stays at the damaged batch (the next poll raises). Never a silent stop.

The consumer sends its requests through its client (``MetalogClient``,
``metalog.broker.client.client``): leader tracking, retries and deadlines are
the client's. ``ConsumerClient`` names what it uses of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from metalog.broker.client.errors import (
    RETRIABLE,
    ClusterUnavailable,
    CorruptRecordError,
    LogTruncationError,
    MetalogError,
    NoOffsetError,
    OffsetOutOfRangeError,
    error_for,
)
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.protocol.errors import Errors
from metalog.protocol.invariants import InvariantViolation
from metalog.storage.batch import HEADER_SIZE, BatchHeader, CorruptBatchError, decode_header, decode_records, verify_crc

NO_EPOCH = m.NO_EPOCH


@dataclass(frozen=True, slots=True)
class ConsumedRecord:
    offset: int
    leader_epoch: int
    value: bytes


# The consumer handles fencing and range errors itself (they trigger validation or reset).
_FETCH_PASSTHROUGH = frozenset({Errors.FENCED_LEADER_EPOCH, Errors.UNKNOWN_LEADER_EPOCH, Errors.OFFSET_OUT_OF_RANGE})
_FETCH_RETRIABLE = RETRIABLE - _FETCH_PASSTHROUGH


class _Revalidate(Exception):
    """The leader epoch changed under a pending fetch: validate the position first."""


class ConsumerClient(Protocol):
    """What a Consumer uses of its client (MetalogClient): the leader it
    tracks and the hint that moves it, the retrying leader request and its
    back-off, the limits, the logger."""

    cluster_id: str
    leader_id: int
    leader_epoch: int
    max_retries: int
    request_timeout_ms: int
    answered_by: tuple[int, str]  # (node id, host:port) of the last answer
    _log: Any

    async def list_offsets(self, timestamp_ms: int, current_leader_epoch: int = ...) -> m.ListOffsetsResponse: ...

    async def _leader_request(self, api_key: ApiKey, make_body: Callable[[], m.Body], timeout_ms: int,
                              retriable: frozenset[int] = ..., passthrough: frozenset[int] = ...) -> Any: ...

    async def _backoff(self, attempt: int) -> None: ...

    def _apply_hint(self, hint: m.LeaderIdAndEpoch | None) -> bool: ...


class Consumer:
    """Reads committed records in order; see the module docstring for truncation handling."""

    def __init__(self, client: ConsumerClient, reset_policy: str = "earliest"):
        if reset_policy not in ("earliest", "latest", "none"):
            raise ValueError(f"reset_policy must be 'earliest', 'latest' or 'none', not {reset_policy!r}")
        self._client = client
        self.reset_policy = reset_policy
        self.position: int | None = None  # next offset to return
        self.last_epoch = NO_EPOCH  # leader epoch of the last consumed record (or of the seek)
        self._validated_leader_epoch = NO_EPOCH  # leader epoch the position was last checked under
        self._needs_validation = False
        self._max_wait_ms = 500  # of the poll in progress, read by _fetch_body

    def seek(self, offset: int, epoch: int = NO_EPOCH) -> None:
        """Continue at `offset`; with the `epoch` of the record before it, the position is validated first."""
        if offset < 0:
            raise ValueError(f"seek offset must be >= 0, not {offset}")
        self.position = offset
        self.last_epoch = epoch
        self._needs_validation = epoch != NO_EPOCH

    async def poll(self, max_wait_ms: int = 500) -> list[ConsumedRecord]:
        """Records from the position on (possibly none after max_wait_ms); advances the position."""
        c = self._client
        for attempt in range(c.max_retries + 1):
            if attempt:
                await c._backoff(attempt)
            if self.position is None:
                await self._reset()
            # Validate after every leader change; bounded, each round follows a newer epoch.
            for _ in range(c.max_retries + 1):
                if self.last_epoch == NO_EPOCH or not (
                    self._needs_validation or c.leader_epoch != self._validated_leader_epoch
                ):
                    break
                await self._validate()
            if self.position is None:
                continue  # validation found us out of range: reset first
            resp = await self._fetch_checked(max_wait_ms)
            if resp is None:
                continue  # the leader epoch moved while fetching: validate again
            code = resp.error_code
            if code in (Errors.FENCED_LEADER_EPOCH, Errors.UNKNOWN_LEADER_EPOCH):
                if not c._apply_hint(resp.current_leader) and code == Errors.FENCED_LEADER_EPOCH:
                    c.leader_id = m.NO_LEADER
                self._needs_validation = True
                continue
            if code == Errors.OFFSET_OUT_OF_RANGE:
                self._out_of_range("the leader answered OFFSET_OUT_OF_RANGE")
                continue
            if code != Errors.NONE:
                raise error_for(code, resp.error_message or "")
            if resp.diverging_epoch is not None:
                d = resp.diverging_epoch
                if d.end_offset < self.position:
                    self._truncated(d.end_offset, d.epoch)
                else:
                    self._needs_validation = True
                continue
            if resp.snapshot_id is not None:
                self._out_of_range(f"offset below the log start (snapshot {resp.snapshot_id})")
                continue
            return self._take(resp)
        raise ClusterUnavailable(f"poll gave up after {c.max_retries + 1} attempts")

    # -- internals -----------------------------------------------------------

    def _fetch_body(self) -> m.FetchRequest:
        c = self._client
        if self.last_epoch != NO_EPOCH and c.leader_epoch != self._validated_leader_epoch:
            raise _Revalidate()
        if self.position is None:
            raise InvariantViolation("a fetch is built only for a consumer with a position")
        return m.FetchRequest(
            cluster_id=c.cluster_id, replica_id=m.CONSUMER_REPLICA_ID, max_wait_ms=self._max_wait_ms,
            current_leader_epoch=c.leader_epoch, fetch_offset=self.position,
            last_fetched_epoch=self.last_epoch,
        )

    async def _fetch_checked(self, max_wait_ms: int) -> m.FetchResponse | None:
        self._max_wait_ms = max_wait_ms
        try:
            return await self._client._leader_request(
                ApiKey.FETCH, self._fetch_body, max_wait_ms + self._client.request_timeout_ms,
                retriable=_FETCH_RETRIABLE, passthrough=_FETCH_PASSTHROUGH,
            )
        except _Revalidate:
            return None

    def _take(self, resp: m.FetchResponse) -> list[ConsumedRecord]:
        if self.position is None:
            raise InvariantViolation("records are taken only by a consumer with a position")
        hw = resp.high_watermark
        out: list[ConsumedRecord] = []
        records = resp.records
        view = memoryview(records)
        pos = 0
        while pos < len(view):
            try:
                h = self._checked_header(view, pos)
            except CorruptRecordError:
                if out:
                    return out  # the good records first; the next poll raises
                raise
            batch_pos, pos = pos, pos + h.size
            if h.next_offset <= self.position:
                continue
            if hw != m.NO_OFFSET and h.base_offset >= hw:
                break  # never hand out an uncommitted record, whatever the server sent
            if h.base_offset > self.position:
                # A gap would silently skip records: a server bug, never papered over.
                raise MetalogError(Errors.CORRUPT_MESSAGE,
                                   f"fetch at offset {self.position} answered from offset {h.base_offset}")
            end = h.next_offset if hw == m.NO_OFFSET else min(h.next_offset, hw)
            if not h.is_control:
                values = decode_records(view[batch_pos:batch_pos + h.size], h)
                for off in range(max(self.position, h.base_offset), end):
                    out.append(ConsumedRecord(off, h.leader_epoch, values[off - h.base_offset]))
            self.position = end
            self.last_epoch = h.leader_epoch
        return out

    def _checked_header(self, view: memoryview, pos: int) -> BatchHeader:
        """The header of the batch at `pos`, after checking it is whole and its CRC."""
        try:
            left = len(view) - pos
            if left < HEADER_SIZE:
                raise CorruptBatchError(f"{left} trailing bytes, fewer than a batch header", pos)
            h = decode_header(view, pos)
            if h.size > left:
                raise CorruptBatchError(f"batch of {h.size} bytes but only {left} in the answer", pos,
                                        h.base_offset, leader_epoch=h.leader_epoch)
            verify_crc(view, pos, h)
            return h
        except CorruptBatchError as exc:
            broker_id, address = self._client.answered_by
            offset = exc.base_offset if exc.base_offset is not None else self.position
            raise CorruptRecordError(offset, exc.leader_epoch, broker_id, address, pos, str(exc)) from None

    async def _reset(self) -> None:
        if self.reset_policy == "none":
            raise NoOffsetError("consumer has no position and reset_policy='none': call seek() first")
        ts = m.LIST_OFFSETS_EARLIEST if self.reset_policy == "earliest" else m.LIST_OFFSETS_LATEST
        resp = await self._client.list_offsets(ts)
        self.position = resp.offset
        self.last_epoch = resp.leader_epoch
        self._validated_leader_epoch = self._client.leader_epoch
        self._needs_validation = False

    async def _validate(self) -> None:
        c = self._client
        used_epoch = NO_EPOCH

        def body() -> m.OffsetsForLeaderEpochRequest:
            nonlocal used_epoch
            used_epoch = c.leader_epoch
            return m.OffsetsForLeaderEpochRequest(
                cluster_id=c.cluster_id, replica_id=m.CONSUMER_REPLICA_ID,
                current_leader_epoch=used_epoch, leader_epoch=self.last_epoch,
            )

        resp = await c._leader_request(ApiKey.OFFSET_FOR_LEADER_EPOCH, body, c.request_timeout_ms)
        if self.position is None:
            raise InvariantViolation("a position is validated only once it exists")
        if resp.end_offset == m.NO_OFFSET or resp.leader_epoch == NO_EPOCH:
            self._out_of_range(f"the leader knows no epoch <= {self.last_epoch}")
        elif resp.end_offset < self.position:
            self._truncated(resp.end_offset, resp.leader_epoch)
        self._validated_leader_epoch = used_epoch
        self._needs_validation = False

    def _truncated(self, end_offset: int, epoch: int) -> None:
        if self.position is None:
            raise InvariantViolation("a truncation is detected only below a position")
        self._client._log.warning("log_truncation_detected", position=self.position,
                                  diverging_offset=end_offset, epoch=epoch, reset_policy=self.reset_policy)
        if self.reset_policy == "none":
            self._needs_validation = True  # keep raising until the user seeks
            raise LogTruncationError(end_offset, epoch, self.position)
        self.position = end_offset
        self.last_epoch = epoch

    def _out_of_range(self, reason: str) -> None:
        if self.reset_policy == "none":
            raise OffsetOutOfRangeError(self.position, reason)
        self._client._log.warning("offset_out_of_range", position=self.position, reason=reason,
                                  reset_policy=self.reset_policy)
        self.position = None
        self.last_epoch = NO_EPOCH
