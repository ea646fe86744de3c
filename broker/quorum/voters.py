"""The voter set (KIP-853): which replicas vote, each a (node id, directory id).

A replica is a node id plus the directory id of its data dir (a random UUID
written into meta.properties when the dir is first bound). A wiped dir gets
a new directory id, so the node is no longer the voter the set names: it
cannot vote or stand with the old identity and replicates as an observer.

With static voters from the config (kraft version 0) the directory ids are
unknown (NO_DIRECTORY_ID) and, as in Kafka, not checked: any directory of a
listed node id is that voter. Pure data: the core asks it who votes and what
a majority is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from protocol import messages as m

NO_DIRECTORY_ID = m.NO_DIRECTORY_ID


@dataclass(frozen=True, slots=True)
class VoterSet:
    """Voter id -> its directory id (NO_DIRECTORY_ID: unknown, not checked)."""

    directory_ids: Mapping[int, str]
    kraft_version: int = 0  # 0: static voters from the config; 1: the set lives in the log

    def __post_init__(self) -> None:
        assert self.directory_ids, "a voter set needs at least one voter"
        assert self.kraft_version in (0, 1), f"unknown kraft version {self.kraft_version}"
        assert self.kraft_version == 1 or all(d == NO_DIRECTORY_ID for d in self.directory_ids.values()), \
            "static voters (kraft version 0) have no directory ids"

    @classmethod
    def static(cls, voter_ids: Iterable[int]) -> VoterSet:
        """Kraft version 0: the config's voter ids, directory ids unknown."""
        return cls({v: NO_DIRECTORY_ID for v in voter_ids}, 0)

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(sorted(self.directory_ids))

    def directory_id_of(self, voter_id: int) -> str:
        return self.directory_ids.get(voter_id, NO_DIRECTORY_ID)

    def is_voter(self, node_id: int, directory_id: str) -> bool:
        """Is (node_id, directory_id) one of the voters? A voter whose
        directory id is unknown matches any directory of its node; a replica
        that does not say its directory id (an older peer) matches only such
        a voter."""
        if node_id not in self.directory_ids:
            return False
        known = self.directory_ids[node_id]
        return known == NO_DIRECTORY_ID or known == directory_id

    def is_majority(self, ids: Iterable[int]) -> bool:
        """Do the voter ids in `ids` make a majority of this set?"""
        return len(set(ids) & self.directory_ids.keys()) > len(self.directory_ids) // 2
