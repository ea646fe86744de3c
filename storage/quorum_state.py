"""The quorum-state file: what a voter must remember across restarts.

Leader epoch, leader id, the vote cast in that epoch and the voter set, as
Kafka's JSON (FileQuorumStateStore: QuorumStateData with a ``data_version``
field), data_version 0, in Kafka's key order::

    {"clusterId": "", "leaderId": 1, "leaderEpoch": 2, "votedId": -1,
     "appliedOffset": 0, "currentVoters": [{"voterId": 1}, ...],
     "data_version": 0, "crc32c": 1234}

Written through metalog.storage.atomic.atomic_write, so a crash leaves either the old
or the new content; a voter that forgot its vote could vote twice in an epoch.

``crc32c`` is ours (issue 12), an extra key Kafka's reader ignores: the
CRC-32C of the canonical JSON (sorted keys) of every other field. A bit flip
that still parses (a votedId 2 that became 3, an epoch 4 that became 6)
would otherwise forge a vote; it is refused with QuorumStateError instead.
A file without it must hold exactly Kafka's keys of its data_version (one
Kafka wrote; data_version 1, KIP-853, has votedDirectoryId and no voters).

Files of builds before issue 17 (snake_case keys, our data_version 1 or 2)
are read once and rewritten in Kafka's form.
"""

from __future__ import annotations

import json
import os
from typing import Any

import crc32c

from metalog.protocol.invariants import invariant
from metalog.storage.atomic import atomic_write, read_file_if_exists
from metalog.storage.errors import QuorumStateError

DATA_VERSION = 0  # Kafka's QuorumStateData version we write
NO_LEADER = -1
NO_VOTE = -1
_KAFKA_KEYS = {
    0: {"clusterId", "leaderId", "leaderEpoch", "votedId", "appliedOffset", "currentVoters", "data_version"},
    1: {"leaderId", "leaderEpoch", "votedId", "votedDirectoryId", "data_version"},
}
_LEGACY_VERSIONS = (1, 2)  # snake_case files of builds before issue 17


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class QuorumStateFile:
    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)

    def _error(self, what: str) -> QuorumStateError:
        return QuorumStateError(f"{self.path}: malformed quorum-state file ({what})")

    def read(self) -> dict[str, Any] | None:
        """The stored state (keys leader_epoch, leader_id, voted_id, voters,
        data_version), or None if the file does not exist."""
        raw = read_file_if_exists(self.path)
        if raw is None:
            return None
        state = self._load(raw)
        if "leader_epoch" in state:
            out = self._read_legacy(state)
            self.write(out["leader_epoch"], out["leader_id"], out["voted_id"], out["voters"])
            return self.read()
        return self._check_kafka(state)

    def decode(self, raw: bytes | str) -> dict[str, Any]:
        """The state held in `raw` (the file's content, read elsewhere: e.g. by
        a Spark executor), checked as read() checks it (CRC, keys, types) but
        without touching the file: a snake_case file of an older build is
        translated, not rewritten. self.path only names the file in errors."""
        state = self._load(raw)
        if "leader_epoch" in state:
            out = self._read_legacy(state)
            return {"data_version": DATA_VERSION, "leader_epoch": out["leader_epoch"],
                    "leader_id": out["leader_id"], "voted_id": out["voted_id"], "voters": list(out["voters"])}
        return self._check_kafka(state)

    def _load(self, raw: bytes | str) -> dict[str, Any]:
        try:
            state = json.loads(raw)
        except ValueError as exc:
            raise QuorumStateError(f"{self.path}: malformed quorum-state file (not JSON: {exc})") from exc
        if not isinstance(state, dict):
            raise self._error("expected a JSON object")
        return state

    def _check_kafka(self, state: dict[str, Any]) -> dict[str, Any]:
        version = state.get("data_version")
        if version not in _KAFKA_KEYS or not _is_int(version):
            raise QuorumStateError(f"{self.path}: unsupported quorum-state data_version "
                                   f"{version!r} (expected one of {tuple(_KAFKA_KEYS)})")
        self._check_crc(state)
        if "crc32c" not in state and set(state) != _KAFKA_KEYS[version]:
            raise self._error(f"keys {sorted(set(state) ^ _KAFKA_KEYS[version])} differ from Kafka's "
                              f"data_version {version} and there is no crc32c")
        for key in ("leaderEpoch", "leaderId", "votedId"):
            if not _is_int(state.get(key)):
                raise self._error(f"{key} must be an integer, got {state.get(key)!r}")
        voters = state.get("currentVoters") or []
        if not isinstance(voters, list) or not all(
                isinstance(v, dict) and _is_int(v.get("voterId")) for v in voters):
            raise self._error(f"currentVoters must be a list of {{\"voterId\": int}}, got {voters!r}")
        if state["leaderEpoch"] < 0:
            raise self._error(f"negative leaderEpoch {state['leaderEpoch']}")
        return {"data_version": version, "leader_epoch": state["leaderEpoch"], "leader_id": state["leaderId"],
                "voted_id": state["votedId"], "voters": [v["voterId"] for v in voters]}

    def _check_crc(self, state: dict[str, Any]) -> None:
        if "crc32c" not in state:
            return
        stored = state.pop("crc32c")
        actual = _checksum(state)
        if stored != actual:
            shown = f"{stored:#010x}" if _is_int(stored) else repr(stored)
            raise QuorumStateError(
                f"{self.path}: quorum-state checksum mismatch (stored {shown}, computed {actual:#010x}): "
                "the file is damaged and its vote cannot be trusted; refusing to start (restore the "
                "file from a backup, or remove this voter's data dir and let it rejoin)")

    def _read_legacy(self, state: dict[str, Any]) -> dict[str, Any]:
        """A snake_case file of a build before issue 17, checked as that build did."""
        version = state.get("data_version")
        if version not in _LEGACY_VERSIONS or not _is_int(version):
            raise QuorumStateError(f"{self.path}: unsupported quorum-state data_version "
                                   f"{version!r} (expected one of {_LEGACY_VERSIONS})")
        if version >= 2:
            self._check_crc(state)
        for key in ("leader_epoch", "leader_id", "voted_id"):
            if not _is_int(state.get(key)):
                raise self._error(f"{key} must be an integer, got {state.get(key)!r}")
        voters = state.get("voters")
        if not isinstance(voters, list) or not all(_is_int(v) for v in voters):
            raise self._error(f"voters must be a list of integers, got {voters!r}")
        if state["leader_epoch"] < 0:
            raise self._error(f"negative leader_epoch {state['leader_epoch']}")
        return state

    def write(self, leader_epoch: int, leader_id: int, voted_id: int, voters: tuple[int, ...] | list[int]) -> None:
        """Durably replace the state (fsync of file and directory before returning)."""
        invariant(leader_epoch >= 0, "leader_epoch %d must be >= 0", leader_epoch)
        state = {
            "clusterId": "",
            "leaderId": int(leader_id),
            "leaderEpoch": int(leader_epoch),
            "votedId": int(voted_id),
            "appliedOffset": 0,
            "currentVoters": [{"voterId": int(v)} for v in voters],
            "data_version": DATA_VERSION,
        }
        state["crc32c"] = _checksum(state)
        atomic_write(self.path, json.dumps(state).encode() + b"\n")


def _checksum(state: dict[str, Any]) -> int:
    """CRC-32C of the canonical JSON of `state` (without the crc32c field)."""
    return crc32c.crc32c(json.dumps(state, sort_keys=True).encode())
