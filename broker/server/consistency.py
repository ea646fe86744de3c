"""Cross-replica consistency check (etcd's corrupt check; Kafka has none).

CRCs prove that a batch is the batch that was written; they cannot prove that
two replicas wrote the same batch at the same offset. A software bug (a wrong
truncation, a misapplied fetch) or an operator's edit that re-computed a CRC
leaves every batch valid and the replicas different. This module catches that:

* ``LogDigest`` keeps, per batch of the local log, a 24-byte entry
  (base offset, next offset, leader epoch, the batch's stored CRC-32C), in one
  bytearray maintained by the runtime on every append, truncation, log-start
  move and snapshot install. The digest of a range of batches is the CRC-32C
  of their entries: one C call over a contiguous slice, so answering costs
  microseconds per thousand batches and never reads the log. The batch CRC
  already covers the payload, so equal digests mean equal bytes (up to
  CRC-32C's collision odds per batch).
* The leader periodically (``consistency_check_interval_ms``) sends each voter
  a ``ConsistencyCheckRequest`` for a committed range both hold; the voter
  answers chunk digests (``digest_chunks``); the leader computes its own over
  the same chunks (``compare``) and reports the first chunk that differs.

Replicas copy the leader's batches byte for byte, so batch boundaries agree
across replicas, and a log start (a snapshot's end) is a batch boundary too.
"""

from __future__ import annotations

import bisect
import struct
import time
from array import array
from typing import Iterable

import crc32c

from metalog.protocol import messages as m
from metalog.protocol.errors import Errors
from metalog.protocol.invariants import InvariantViolation
from metalog.storage.batch import BatchHeader, iter_batches

ENTRY = struct.Struct(">qqiI")  # base offset, next offset, leader epoch, batch CRC-32C
BUILD_CHUNK_BYTES = 8 << 20  # bound on what one read of the boot-time build holds
MAX_CHUNKS = 1024  # bound on the chunk digests one answer may carry


class LogDigest:
    """Per-batch entries of the local log from its start to its end."""

    def __init__(self, start_offset: int = 0):
        self._start = start_offset
        self._bases = array("q")
        self._nexts = array("q")
        self._entries = bytearray()

    # -- maintenance (the runtime calls these as it changes the log) -------
    @classmethod
    def build(cls, log, logger=None) -> "LogDigest":
        """From a SegmentedLog, reading it once in bounded chunks. The bytes
        are not CRC-checked here (the digest records each batch's stored CRC;
        finding damage is start-up's, the scrubber's and every read's job), so
        a start after a clean stop does not turn into a full verification.
        With `logger`, says how long it took (log_digest_built)."""
        t0_s = time.perf_counter()
        d = cls(log.log_start_offset)
        pos = log.log_start_offset
        end = log.log_end_offset
        while pos < end:
            data = log.read(pos, end, BUILD_CHUNK_BYTES, verify=False)
            if not data:
                break
            d.append(data)
            pos = d.end_offset
        if logger is not None:
            logger.info("log_digest_built", batches_from=d.first_base, end_offset=d.end_offset,
                        seconds=round(time.perf_counter() - t0_s, 4))
        return d

    @property
    def start_offset(self) -> int:
        return self._start

    @property
    def end_offset(self) -> int:
        return self._nexts[-1] if self._nexts else self._start

    def append(self, data: bytes) -> None:
        """Whole batches just appended at the log end."""
        self.append_headers(h for _, h in iter_batches(data, verify=False))

    def append_headers(self, headers: Iterable[BatchHeader]) -> None:
        """The headers of whole batches just appended at the log end (as the
        log's append parsed them)."""
        for h in headers:
            if self._nexts and h.base_offset != self._nexts[-1]:
                raise InvariantViolation(f"digest: batch at {h.base_offset} appended after {self._nexts[-1]}")
            self._bases.append(h.base_offset)
            self._nexts.append(h.next_offset)
            self._entries += ENTRY.pack(h.base_offset, h.next_offset, h.leader_epoch, h.crc)

    def truncate(self, end_offset: int) -> None:
        """Every batch at or past end_offset is gone (TruncateLog, quarantine)."""
        i = bisect.bisect_left(self._bases, end_offset)
        del self._bases[i:]
        del self._nexts[i:]
        del self._entries[i * ENTRY.size:]
        if not self._bases:
            self._start = min(self._start, end_offset)

    def advance_start(self, start_offset: int) -> None:
        """Whole batches below the new log start are gone (AdvanceLogStart)."""
        i = bisect.bisect_right(self._nexts, start_offset)
        del self._bases[:i]
        del self._nexts[:i]
        del self._entries[:i * ENTRY.size]
        self._start = max(self._start, start_offset) if not self._bases else self._bases[0]

    def reset(self, start_offset: int) -> None:
        """The log now starts and ends at start_offset (snapshot install)."""
        self.__init__(start_offset)

    # -- answers -------------------------------------------------------------
    def boundary(self, offset: int) -> bool:
        """Is `offset` a batch boundary we hold (a batch starts there, or the log ends there)?"""
        i = bisect.bisect_left(self._bases, offset)
        return (i < len(self._bases) and self._bases[i] == offset) or offset == self.end_offset

    def floor_boundary(self, offset: int) -> int:
        """The largest batch boundary <= offset that we hold (at least the start)."""
        i = bisect.bisect_right(self._nexts, offset)
        return self._nexts[i - 1] if i > 0 else self.first_base

    @property
    def first_base(self) -> int:
        return self._bases[0] if self._bases else self._start

    def digest(self, start_offset: int, end_offset: int) -> int:
        i = bisect.bisect_left(self._bases, start_offset)
        j = bisect.bisect_left(self._bases, end_offset)
        return crc32c.crc32c(memoryview(self._entries)[i * ENTRY.size:j * ENTRY.size])

    def digest_chunks(self, start_offset: int, end_offset: int, chunks: int) -> list[m.ConsistencyChunk]:
        """Split the batches in [start, end) into at most `chunks` runs of equal
        batch count and digest each. Both ends must be batch boundaries."""
        chunks = max(1, min(chunks, MAX_CHUNKS))
        i = bisect.bisect_left(self._bases, start_offset)
        j = bisect.bisect_left(self._bases, end_offset)
        n = j - i
        if n <= 0:
            return []
        per = -(-n // chunks)
        out = []
        view = memoryview(self._entries)
        for a in range(i, j, per):
            b = min(a + per, j)
            out.append(m.ConsistencyChunk(self._bases[a], self._nexts[b - 1],
                                          crc32c.crc32c(view[a * ENTRY.size:b * ENTRY.size])))
        return out

    def answer(self, req: m.ConsistencyCheckRequest) -> m.ConsistencyCheckResponse:
        """What a voter answers: the part of the asked range it holds."""
        start = max(req.start_offset, self.first_base)
        end = min(req.end_offset, self.end_offset)
        if start >= end or not self.boundary(start) or not self.boundary(end):

            return m.ConsistencyCheckResponse(
                error_code=Errors.OFFSET_OUT_OF_RANGE,
                error_message=f"holds batches [{self.first_base}, {self.end_offset}) on other boundaries "
                              f"than [{req.start_offset}, {req.end_offset})",
                start_offset=self.first_base, end_offset=self.end_offset)
        return m.ConsistencyCheckResponse(start_offset=start, end_offset=end,
                                          chunks=self.digest_chunks(start, end, req.chunks))


def compare(mine: list[m.ConsistencyChunk], theirs: list[m.ConsistencyChunk]) -> m.ConsistencyChunk | None:
    """The first of their chunks that differs from ours (None: all equal).
    A different chunk boundary is a difference too: batch boundaries disagree."""
    for a, b in zip(mine, theirs):
        if a != b:
            return b
    if len(mine) != len(theirs):
        return (theirs or mine)[min(len(mine), len(theirs)) - 1] if mine and theirs else (theirs or mine)[0]
    return None


def answer(req: m.ConsistencyCheckRequest, voters, flushed_end_offset: int,
           digest: LogDigest) -> m.ConsistencyCheckResponse:
    """A voter's answer to the leader's check, never vouching for data it has
    not flushed (the range is capped at `flushed_end_offset`)."""
    if req.leader_id not in voters:
        return m.ConsistencyCheckResponse(error_code=Errors.INCONSISTENT_VOTER_SET,
                                          error_message=f"node {req.leader_id} is not a voter")
    if req.start_offset < 0 or req.end_offset < req.start_offset:
        return m.ConsistencyCheckResponse(error_code=Errors.INVALID_REQUEST,
                                          error_message=f"bad range [{req.start_offset}, {req.end_offset})")
    end = min(req.end_offset, flushed_end_offset)
    return digest.answer(m.ConsistencyCheckRequest(
        cluster_id=req.cluster_id, leader_id=req.leader_id, leader_epoch=req.leader_epoch,
        start_offset=req.start_offset, end_offset=end, chunks=req.chunks))
