"""The quorum-state file: what a voter must remember across restarts.

Leader epoch, leader id, the vote cast in that epoch and the voter set, as JSON
(Kafka's ``quorum-state`` carries the same fields plus ``data_version``).
Written through storage.atomic.atomic_write, so a crash leaves either the old
or the new content; a voter that forgot its vote could vote twice in an epoch.
"""

from __future__ import annotations

import json
import os
from typing import Any

from storage.atomic import atomic_write
from storage.errors import QuorumStateError

DATA_VERSION = 1
NO_LEADER = -1
NO_VOTE = -1


class QuorumStateFile:
    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)

    def read(self) -> dict[str, Any] | None:
        """The stored state (keys leader_epoch, leader_id, voted_id, voters,
        data_version), or None if the file does not exist."""
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        try:
            state = json.loads(raw)
        except ValueError as exc:
            raise QuorumStateError(f"{self.path}: malformed quorum-state file (not JSON: {exc})") from exc
        if not isinstance(state, dict):
            raise QuorumStateError(f"{self.path}: malformed quorum-state file (expected a JSON object)")
        if state.get("data_version") != DATA_VERSION:
            raise QuorumStateError(f"{self.path}: unsupported quorum-state data_version "
                                   f"{state.get('data_version')!r} (expected {DATA_VERSION})")
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
        atomic_write(self.path, json.dumps(state, sort_keys=True).encode() + b"\n")
