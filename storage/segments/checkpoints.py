"""The small state files beside the segments, each read and written whole
with metalog.storage.atomic:

* ``recovery-point-offset-checkpoint`` (named and formatted as in Kafka): the
  offset below which the log was flushed and verified. It moves when a flush
  syncs a rolled (sealed) segment, at clean close and after open's
  verification, and is lowered before a truncation below it: not on every
  fsync, which would add a file write, an fsync and a directory fsync to the
  commit path. After an unclean shutdown every segment holding records at or
  past it is verified in full.
* ``log-start-offset`` (JSON): the log start, and whether a truncate_fully()
  is under way (open() finishes it).
* ``quarantine-state`` (metalog.storage.errors.QuarantineState), present while
  a quarantine lasts: the log end the replica had, which it must
  re-replicate past before it may vote.
"""

from __future__ import annotations

import json
import os
import threading
from typing import NamedTuple

from metalog.storage.atomic import atomic_write, fsync_dir, read_file_if_exists
from metalog.storage.errors import CorruptLogError, QuarantineState
from metalog.storage.event_logger import EventLogger
from metalog.storage.segments.layout import LOG_START_FILE, QUARANTINE_FILE, RECOVERY_POINT_FILE

# Kafka's checkpoint text format: version, entry count, "<topic> <partition> <offset>".
_RP_TOPIC = "__cluster_metadata"


class RecoveryPoint:
    """The recovery-point offset and its file. `lock` orders its writes: a
    flush holds it while it syncs and moves the point up (on a worker
    thread); a truncation takes it to lower the point first (owner thread)."""

    def __init__(self, directory: str, logger: EventLogger):
        self._path = os.path.join(directory, RECOVERY_POINT_FILE)
        self._log = logger
        self.lock = threading.Lock()
        self.offset = 0

    def read(self) -> int:
        """The checkpointed offset, 0 (verify everything) if missing or unreadable."""
        try:
            with open(self._path, "rb") as f:
                lines = f.read().decode("ascii").split("\n")
            if lines[0] != "0" or lines[1] != "1":
                raise ValueError(f"unknown version/count {lines[:2]}")
            offset = int(lines[2].split()[2])
            if offset < 0:
                raise ValueError(f"negative offset {offset}")
            return offset
        except FileNotFoundError:
            return 0
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            # Only costs a full verification: never trust it, never fail on it.
            self._log.warning("recovery_point_unreadable", path=self._path, error=str(exc))
            return 0

    def write(self, offset: int) -> None:
        atomic_write(self._path, f"0\n1\n{_RP_TOPIC} 0 {offset}\n".encode("ascii"))

    def raise_to(self, offset: int) -> None:
        """Move the recovery point up (the caller holds `lock`, or no other
        thread runs yet). Best effort (a full disk must not stop an open or a
        flush): a stale, lower one only costs verification time."""
        try:
            self.write(offset)
        except OSError as exc:
            self._log.warning("recovery_point_not_written", offset=offset, error=exc.strerror)
            return
        self.offset = offset

    def lower_to(self, offset: int) -> None:
        """Durably lower the recovery point before data below it is replaced."""
        with self.lock:
            if self.offset > offset:
                self.offset = offset
                self.write(offset)

    def reset(self, offset: int) -> None:
        """Set it to `offset` whichever way it moves (the log restarts there)."""
        with self.lock:
            self.offset = offset
            self.write(offset)


class LogStartState(NamedTuple):
    log_start_offset: int
    truncate_fully_pending: bool


def read_log_start_file(directory: str) -> LogStartState | None:
    path = os.path.join(directory, LOG_START_FILE)
    raw = read_file_if_exists(path)
    if raw is None:
        return None
    try:
        state = json.loads(raw)
        if not isinstance(state, dict) or not isinstance(state.get("log_start_offset"), int) \
                or state["log_start_offset"] < 0:
            raise ValueError("log_start_offset must be a non-negative integer")
    except ValueError as exc:
        raise CorruptLogError(f"{path}: malformed log-start-offset file: {exc}", path, 0, None) from exc
    return LogStartState(state["log_start_offset"], bool(state.get("truncate_fully_pending")))


def write_log_start_file(directory: str, offset: int, truncate_fully_pending: bool = False) -> None:
    state = {"data_version": 1, "log_start_offset": offset,
             "truncate_fully_pending": truncate_fully_pending}
    atomic_write(os.path.join(directory, LOG_START_FILE), json.dumps(state).encode())


def read_quarantine_file(directory: str) -> QuarantineState | None:
    path = os.path.join(directory, QUARANTINE_FILE)
    raw = read_file_if_exists(path)
    if raw is None:
        return None
    try:
        return QuarantineState.from_bytes(raw)
    except (ValueError, KeyError, TypeError) as exc:
        # Never guess here: a wrong must_reach_offset could let this voter vote.
        raise CorruptLogError(f"{path}: malformed quarantine-state file: {exc}", path, 0, None) from exc


def write_quarantine_file(directory: str, state: QuarantineState) -> None:
    atomic_write(os.path.join(directory, QUARANTINE_FILE), state.to_bytes())


def remove_quarantine_file(directory: str) -> None:
    try:
        os.unlink(os.path.join(directory, QUARANTINE_FILE))
    except FileNotFoundError:
        pass
    fsync_dir(directory)
