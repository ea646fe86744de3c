"""The quorum-state file: what a voter must remember across restarts.

Leader epoch, leader id, the vote cast in that epoch and the voter set, as JSON
(Kafka's ``quorum-state`` carries the same fields plus ``data_version``).
Written through storage.atomic.atomic_write, so a crash leaves either the old
or the new content; a voter that forgot its vote could vote twice in an epoch.

data_version 2 (issue 12) adds ``crc32c``: the CRC-32C of the canonical JSON
(sorted keys) of every other field. A bit flip that still parses (a voted_id
2 that became 3, an epoch 4 that became 6) would otherwise forge a vote; it
is refused with QuorumStateError instead. Version 1 files (no checksum) are
still read.
"""

from __future__ import annotations

import json
import os
from typing import Any

import crc32c

from storage.atomic import atomic_write, read_file_if_exists
from storage.errors import QuorumStateError

DATA_VERSION = 2
READABLE_VERSIONS = (1, 2)
NO_LEADER = -1
NO_VOTE = -1


class QuorumStateFile:
    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)

    def read(self) -> dict[str, Any] | None:
        """The stored state (keys leader_epoch, leader_id, voted_id, voters,
        data_version), or None if the file does not exist."""
        raw = read_file_if_exists(self.path)
        if raw is None:
            return None
        try:
            state = json.loads(raw)
        except ValueError as exc:
            raise QuorumStateError(f"{self.path}: malformed quorum-state file (not JSON: {exc})") from exc
        if not isinstance(state, dict):
            raise QuorumStateError(f"{self.path}: malformed quorum-state file (expected a JSON object)")
        version = state.get("data_version")
        if version not in READABLE_VERSIONS or isinstance(version, bool):
            raise QuorumStateError(f"{self.path}: unsupported quorum-state data_version "
                                   f"{version!r} (expected one of {READABLE_VERSIONS})")
        if version >= 2:
            stored = state.pop("crc32c", None)
            actual = _checksum(state)
            if stored != actual:
                shown = f"{stored:#010x}" if isinstance(stored, int) and not isinstance(stored, bool) else repr(stored)
                raise QuorumStateError(
                    f"{self.path}: quorum-state checksum mismatch (stored {shown}, computed {actual:#010x}): "
                    "the file is damaged and its vote cannot be trusted; refusing to start (restore the "
                    "file from a backup, or remove this voter's data dir and let it rejoin)")
        for key in ("leader_epoch", "leader_id", "voted_id"):
            if not isinstance(state.get(key), int) or isinstance(state.get(key), bool):
                raise QuorumStateError(f"{self.path}: malformed quorum-state file "
                                       f"({key} must be an integer, got {state.get(key)!r})")
        voters = state.get("voters")
        if not isinstance(voters, list) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                   for v in voters):
            raise QuorumStateError(f"{self.path}: malformed quorum-state file "
                                   f"(voters must be a list of integers, got {voters!r})")
        if state["leader_epoch"] < 0:
            raise QuorumStateError(f"{self.path}: malformed quorum-state file "
                                   f"(negative leader_epoch {state['leader_epoch']})")
        return state

    def write(self, leader_epoch: int, leader_id: int, voted_id: int, voters: tuple[int, ...] | list[int]) -> None:
        """Durably replace the state (fsync of file and directory before returning)."""
        assert leader_epoch >= 0, f"leader_epoch {leader_epoch} must be >= 0"
        state = {
            "data_version": DATA_VERSION,
            "leader_epoch": int(leader_epoch),
            "leader_id": int(leader_id),
            "voted_id": int(voted_id),
            "voters": [int(v) for v in voters],
        }
        state["crc32c"] = _checksum(state)
        atomic_write(self.path, json.dumps(state, sort_keys=True).encode() + b"\n")


def _checksum(state: dict[str, Any]) -> int:
    """CRC-32C of the canonical JSON of `state` (without the crc32c field)."""
    return crc32c.crc32c(json.dumps(state, sort_keys=True).encode())
