"""Leader-epoch history: which epoch started at which offset.

``EpochHistory`` is the pure in-memory structure (the quorum core owns one);
``read_checkpoint`` / ``write_checkpoint`` store it in Kafka's text format::

    0            <- version
    2            <- number of entries
    1 0          <- epoch start_offset
    3 120
    crc32c 0x1b2c3d4e   <- (issue 12) CRC-32C of every byte above

The checksum line catches a bit flip that still parses (an epoch 3 that
became 7 would answer OffsetsForLeaderEpoch wrongly); files without it
(older writers) are still read. The file is derived data: on an error the
runtime rebuilds it from the log's batch headers.

``end_offset_for_epoch`` has Kafka's semantics (LeaderEpochFileCache.endOffsetFor),
which OffsetsForLeaderEpoch and the DivergingEpoch check of Fetch rely on.
"""

from __future__ import annotations

import bisect
import os
from typing import Iterable, NamedTuple

import crc32c

from metalog.protocol.invariants import InvariantViolation
from metalog.storage.atomic import atomic_write

NO_EPOCH = -1
NO_OFFSET = -1
CHECKPOINT_VERSION = 0


class EpochEntry(NamedTuple):
    epoch: int
    start_offset: int


class EpochHistory:
    def __init__(self, entries: Iterable[EpochEntry | tuple[int, int]] = ()):
        self._entries: list[EpochEntry] = []
        for e in entries:
            self.assign(*e)

    # -- queries ---------------------------------------------------------
    @property
    def entries(self) -> list[EpochEntry]:
        return list(self._entries)

    @property
    def latest_epoch(self) -> int:
        return self._entries[-1].epoch if self._entries else NO_EPOCH

    def epoch_for_offset(self, offset: int) -> int:
        """The epoch of the record at `offset` (NO_EPOCH if before every entry)."""
        i = bisect.bisect_right([e.start_offset for e in self._entries], offset) - 1
        return self._entries[i].epoch if i >= 0 else NO_EPOCH

    def end_offset_for_epoch(self, epoch: int, log_end_offset: int) -> tuple[int, int]:
        """(largest epoch <= `epoch`, the offset where it ends), as Kafka answers.

        The end offset of epoch E is the start offset of the first epoch > E,
        or the log end offset when E is the latest epoch. Asking for an epoch
        newer than every entry, or on an empty history, gives (NO_EPOCH, NO_OFFSET).
        """
        if not self._entries:
            return NO_EPOCH, NO_OFFSET
        if epoch == self.latest_epoch:
            return epoch, log_end_offset
        epochs = [e.epoch for e in self._entries]
        i = bisect.bisect_right(epochs, epoch)  # first entry with epoch > requested
        if i == len(self._entries):
            return NO_EPOCH, NO_OFFSET
        higher = self._entries[i]
        if i == 0:
            # Older than anything we know: it ended where our history starts.
            return epoch, higher.start_offset
        return self._entries[i - 1].epoch, higher.start_offset

    # -- updates ---------------------------------------------------------
    def assign(self, epoch: int, start_offset: int) -> bool:
        """Record that `epoch` starts at `start_offset`; False if nothing changed."""
        if self._entries:
            last = self._entries[-1]
            if epoch == last.epoch:
                return False
            if epoch < last.epoch:
                raise InvariantViolation(f"epoch {epoch} after {last.epoch}")
            if start_offset < last.start_offset:
                raise InvariantViolation(
                    f"epoch {epoch} start {start_offset} before {last.epoch} start {last.start_offset}")
            if start_offset == last.start_offset:
                # The previous epoch holds no records: replace it.
                self._entries.pop()
        self._entries.append(EpochEntry(epoch, start_offset))
        return True

    def truncate_from_end(self, end_offset: int) -> bool:
        """Drop entries starting at or after `end_offset` (the log was truncated)."""
        before = len(self._entries)
        while self._entries and self._entries[-1].start_offset >= end_offset:
            self._entries.pop()
        return len(self._entries) != before

    def truncate_from_start(self, start_offset: int) -> bool:
        """The log now starts at `start_offset`: keep the epoch covering it."""
        changed = False
        while len(self._entries) >= 2 and self._entries[1].start_offset <= start_offset:
            self._entries.pop(0)
            changed = True
        if self._entries and self._entries[0].start_offset < start_offset:
            self._entries[0] = EpochEntry(self._entries[0].epoch, start_offset)
            changed = True
        return changed

    def clear(self) -> None:
        self._entries.clear()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EpochHistory) and self._entries == other._entries

    def __repr__(self) -> str:
        return f"EpochHistory({self._entries!r})"


_CRC_PREFIX = "crc32c "


class EpochCheckpointError(Exception):
    pass


def write_checkpoint(path: str | os.PathLike[str], history: EpochHistory) -> None:
    lines = [str(CHECKPOINT_VERSION), str(len(history.entries))]
    lines += [f"{e.epoch} {e.start_offset}" for e in history.entries]
    body = ("\n".join(lines) + "\n").encode()
    atomic_write(path, body + f"{_CRC_PREFIX}{crc32c.crc32c(body):#010x}\n".encode())


def read_checkpoint(path: str | os.PathLike[str]) -> EpochHistory:
    """Read a leader-epoch-checkpoint; a missing file is an empty history."""
    try:
        with open(path, "rb") as f:
            text = f.read().decode()
    except FileNotFoundError:
        return EpochHistory()
    lines = text.splitlines()
    try:
        version = int(lines[0])
        count = int(lines[1])
        if version != CHECKPOINT_VERSION:
            raise EpochCheckpointError(f"{path}: unsupported version {version}")
        entries = []
        for line in lines[2:2 + count]:
            epoch_s, offset_s = line.split()
            entries.append(EpochEntry(int(epoch_s), int(offset_s)))
        if len(entries) != count:
            raise EpochCheckpointError(f"{path}: expected {count} entries, found {len(entries)}")
        rest = lines[2 + count:]
        if rest and rest[0].startswith(_CRC_PREFIX):
            stored = int(rest[0][len(_CRC_PREFIX):], 16)
            body = "".join(line + "\n" for line in lines[:2 + count]).encode()
            actual = crc32c.crc32c(body)
            if stored != actual:
                raise EpochCheckpointError(f"{path}: checksum mismatch (stored {stored:#010x}, "
                                           f"computed {actual:#010x}): the file is damaged")
    except (IndexError, ValueError) as exc:
        raise EpochCheckpointError(f"{path}: malformed leader-epoch-checkpoint: {exc}") from exc
    return EpochHistory(entries)
