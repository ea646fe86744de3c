"""Errors raised by the storage engine (segmented log and small state files).

Each carries what an operator needs to act on it: the file, the byte position
and the offset involved, in the message itself. Corruption errors also carry a
structured ``CorruptionReport`` (``.report``) that the runtime logs, counts and
hands to the quorum core, and that ``QuarantineState`` persists.

``CorruptBatchError`` lives in metalog.storage.batch (the pure codec raises it); it
carries a ``.report`` too.
"""

from __future__ import annotations

import json
from typing import Any
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class CorruptionReport:
    """Where a damaged batch sits and how it is damaged."""

    path: str  # the file ("" for bytes that never were in a file)
    position: int  # byte position of the damaged batch (or run of bytes) in it
    base_offset: int | None  # the offset the batch should start at, if known
    leader_epoch: int | None  # the epoch its header claims, if readable
    expected_crc: int | None  # the CRC stored in the header
    actual_crc: int | None  # the CRC computed over the bytes read
    reason: str

    def as_log_fields(self) -> dict[str, object]:
        """Fields for one structured log event (CRCs in hex, as Kafka prints them)."""
        return {
            "file": self.path,
            "position": self.position,
            "offset": self.base_offset,
            "epoch": self.leader_epoch,
            "expected_crc": None if self.expected_crc is None else f"{self.expected_crc:#010x}",
            "actual_crc": None if self.actual_crc is None else f"{self.actual_crc:#010x}",
            "reason": self.reason,
        }

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "CorruptionReport":
        return cls(path=str(raw["path"]), position=int(raw["position"]),
                   base_offset=_opt_int(raw.get("base_offset")), leader_epoch=_opt_int(raw.get("leader_epoch")),
                   expected_crc=_opt_int(raw.get("expected_crc")), actual_crc=_opt_int(raw.get("actual_crc")),
                   reason=str(raw["reason"]))


def _opt_int(v: object) -> int | None:
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"expected an integer or null, got {v!r}")
    return v


@dataclass(frozen=True)
class QuarantineState:
    """A replica that truncated corrupt data: until it has re-replicated up to
    ``must_reach_offset`` (its log end before the damage) it may have lost
    records it acknowledged, so it must not vote or stand for election."""

    must_reach_offset: int
    reports: tuple[CorruptionReport, ...]

    def to_bytes(self) -> bytes:
        return json.dumps({"version": 1, "must_reach_offset": self.must_reach_offset,
                           "reports": [r.to_json() for r in self.reports]}, indent=1).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "QuarantineState":
        state = json.loads(raw)
        if not isinstance(state, dict) or state.get("version") != 1:
            raise ValueError("not a version 1 quarantine-state object")
        must = state.get("must_reach_offset")
        if not isinstance(must, int) or must < 0:
            raise ValueError(f"must_reach_offset must be a non-negative integer, got {must!r}")
        return cls(must, tuple(CorruptionReport.from_json(r) for r in state.get("reports", [])))

    def merge(self, must_reach_offset: int, report: CorruptionReport) -> "QuarantineState":
        return QuarantineState(max(self.must_reach_offset, must_reach_offset), self.reports + (report,))


class StorageError(Exception):
    """Base class of every storage failure."""


class LogWriteError(StorageError):
    """An append failed (ENOSPC, EIO, EFBIG ...). The log is unchanged: no
    partial batch is visible and the end offset did not move."""


class CorruptLogError(StorageError):
    """Data that was once whole is damaged (CRC/length mismatch that is not a
    torn tail). Never repaired silently: the node must stop (or, opened with
    on_corruption="quarantine", the log quarantines it)."""

    def __init__(self, message: str, path: str, position: int, base_offset: int | None,
                 report: CorruptionReport | None = None):
        super().__init__(message)
        self.path = path
        self.position = position
        self.base_offset = base_offset
        self.report = report if report is not None else CorruptionReport(
            path, position, base_offset, None, None, None, message)


class QuorumStateError(StorageError):
    """The quorum-state file exists but cannot be understood."""
