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
from dataclasses import dataclass, field

from metalog.protocol import messages as m
from metalog.protocol.invariants import invariant
from metalog.storage import control_records as cr
from metalog.storage.batch import decode_records, iter_batches

NO_DIRECTORY_ID = m.NO_DIRECTORY_ID
SUPPORTED_KRAFT_VERSIONS = (0, 1)  # the kraft.version range this build supports


@dataclass(frozen=True, slots=True)
class VoterSet:
    """Voter id -> its directory id (NO_DIRECTORY_ID: unknown, not checked)."""

    directory_ids: Mapping[int, str]
    kraft_version: int = 0  # 0: static voters from the config; 1: the set lives in the log
    # (listener name, host, port) per voter, as its VotersRecord says; empty
    # for static voters (the runtime's config has their addresses).
    endpoints: Mapping[int, tuple[tuple[str, str, int], ...]] = field(default_factory=dict, compare=False)
    # (min, max) kraft.version each voter supports, as its VotersRecord says
    # (UpdateRaftVoter checks and records it); absent: this build's range.
    kraft_ranges: Mapping[int, tuple[int, int]] = field(default_factory=dict, compare=False)
    # True only for VoterSet.unknown_set: a dynamic cluster's node that knows
    # no voter set yet (a wiped or --no-initial-controllers dir): nobody is a
    # voter to it, it never votes or stands, it replicates until the log says.
    unknown: bool = False

    def __post_init__(self) -> None:
        invariant(self.directory_ids, "a voter set needs at least one voter")
        invariant(self.kraft_version in (0, 1), "unknown kraft version %d", self.kraft_version)
        invariant(not self.unknown or self.kraft_version == 1, "an unknown voter set is kraft version 1")
        invariant(self.kraft_version == 1 or all(d == NO_DIRECTORY_ID for d in self.directory_ids.values()),
                  "static voters (kraft version 0) have no directory ids")

    @classmethod
    def static(cls, voter_ids: Iterable[int]) -> VoterSet:
        """Kraft version 0: the config's voter ids, directory ids unknown."""
        return cls({v: NO_DIRECTORY_ID for v in voter_ids}, 0)

    @classmethod
    def unknown_set(cls, bootstrap_ids: Iterable[int]) -> VoterSet:
        """Kraft version 1, set not known yet: the config's ids are only whom
        to ask for the leader (Kafka's controller.quorum.bootstrap.servers).
        Never a fallback to them as static voters: a wiped voter must not
        vote with its old node id."""
        return cls({v: NO_DIRECTORY_ID for v in bootstrap_ids}, 1, unknown=True)

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(sorted(self.directory_ids))

    def kraft_range_of(self, voter_id: int) -> tuple[int, int]:
        """The (min, max) kraft.version voter_id supports."""
        return self.kraft_ranges.get(voter_id, SUPPORTED_KRAFT_VERSIONS)

    def directory_id_of(self, voter_id: int) -> str:
        return self.directory_ids.get(voter_id, NO_DIRECTORY_ID)

    def is_voter(self, node_id: int, directory_id: str) -> bool:
        """Is (node_id, directory_id) one of the voters? A voter whose
        directory id is unknown matches any directory of its node; a replica
        that does not say its directory id (an older peer) matches only such
        a voter."""
        if self.unknown or node_id not in self.directory_ids:
            return False
        known = self.directory_ids[node_id]
        return known == NO_DIRECTORY_ID or known == directory_id

    def is_majority(self, ids: Iterable[int]) -> bool:
        """Do the voter ids in `ids` make a majority of this set?"""
        if self.unknown:
            return False
        return len(set(ids) & self.directory_ids.keys()) > len(self.directory_ids) // 2


def voter_set_of(record: cr.VotersRecord) -> VoterSet:
    """The voter set a VotersRecord describes (kraft version 1)."""
    return VoterSet({v.voter_id: v.directory_id for v in record.voters}, kraft_version=1,
                    endpoints={v.voter_id: tuple((e.name, e.host, e.port) for e in v.endpoints)
                               for v in record.voters},
                    kraft_ranges={v.voter_id: (v.min_kraft_version, v.max_kraft_version) for v in record.voters})


def voters_record(voter_set: VoterSet) -> cr.VotersRecord | None:
    """The VotersRecord of a voter set that lives in the log (kraft version
    1); None for static voters, which no record describes."""
    if voter_set.kraft_version == 0 or voter_set.unknown:
        return None
    return cr.VotersRecord([
        cr.Voter(v, voter_set.directory_ids[v],
                 [cr.VoterEndpoint(name, host, port) for name, host, port in voter_set.endpoints.get(v, ())],
                 *voter_set.kraft_range_of(v))
        for v in voter_set.ids])


def voter_sets_in(records: bytes, verify: bool = True) -> list[tuple[int, VoterSet]]:
    """(offset, voter set) of every VotersRecord in whole encoded batches, in
    order. Only control batches are decoded (a data batch never holds one).
    Shared by the core (fetched appends) and the drivers (the log at boot)."""
    out = []
    for pos, h in iter_batches(records, verify=verify):
        if not h.is_control:
            continue
        for i, value in enumerate(decode_records(records[pos:pos + h.size], h)):
            try:
                rec = cr.decode_control(bytes(value))
            except cr.ControlRecordError:
                continue  # a control type we do not know (a newer writer's) holds no voters
            if isinstance(rec, cr.VotersRecord) and rec.voters:
                out.append((h.base_offset + i, voter_set_of(rec)))
    return out


class VoterSetHistory:
    """Kafka's VoterSetHistory: the voter set as of each offset of the log.

    `base` holds below every entry: the voter set of the snapshot the log
    starts at, or the config's static voters. Each entry (offset, set) is a
    VotersRecord at that offset; the latest entry counts from the moment it
    is appended, committed or not (KIP-853), and goes when the log is
    truncated at or below its offset."""

    __slots__ = ("base", "entries")

    def __init__(self, base: VoterSet, entries: Iterable[tuple[int, VoterSet]] = ()):
        self.base = base
        self.entries: list[tuple[int, VoterSet]] = []
        for offset, vs in entries:
            self.add(offset, vs)

    @property
    def latest(self) -> VoterSet:
        return self.entries[-1][1] if self.entries else self.base

    def add(self, offset: int, voter_set: VoterSet) -> None:
        invariant(not self.entries or offset > self.entries[-1][0],
                  "voter set at offset %d is not past the last one (%d)", offset,
                  self.entries[-1][0] if self.entries else -1)
        self.entries.append((offset, voter_set))

    def at(self, end_offset: int) -> VoterSet:
        """The voter set of the log below end_offset (what a snapshot there holds)."""
        found = self.base
        for offset, vs in self.entries:
            if offset >= end_offset:
                break
            found = vs
        return found

    def truncate_from(self, end_offset: int) -> bool:
        """The log lost every offset >= end_offset; True if the latest set changed."""
        before = self.latest
        while self.entries and self.entries[-1][0] >= end_offset:
            self.entries.pop()
        return self.latest != before

    def trim_before(self, start_offset: int) -> None:
        """The log now starts at start_offset: the last set below it becomes
        the base (the one the snapshot there holds); later ones stay."""
        while self.entries and self.entries[0][0] < start_offset:
            self.base = self.entries.pop(0)[1]

    def reset(self, base: VoterSet) -> None:
        """A snapshot replaced the whole log: its voter set is all there is."""
        self.base = base
        self.entries = []

    def copy(self) -> VoterSetHistory:
        return VoterSetHistory(self.base, self.entries)


class Electorate:
    """This node's place in the latest voter set (KIP-853), in the form the
    hot paths read it. The core refreshes it whenever the log's latest set
    changes; the roles and the request handlers only read it."""

    __slots__ = ("node_id", "directory_id", "voter_set", "voters", "others", "is_voter", "hw_index")

    def __init__(self, node_id: int, directory_id: str, voter_set: VoterSet) -> None:
        self.node_id = node_id
        self.directory_id = directory_id
        self.refresh(voter_set)

    def refresh(self, voter_set: VoterSet) -> None:
        self.voter_set = voter_set
        self.voters = voter_set.ids
        self.others = tuple(v for v in self.voters if v != self.node_id)
        # A wiped dir has a new directory id: not the voter the set names.
        self.is_voter = voter_set.is_voter(self.node_id, self.directory_id)
        # The voters' log ends sorted descending: a majority holds the one at this index.
        self.hw_index = len(self.voters) // 2

    @property
    def may_vote_later(self) -> bool:
        """Could this node vote without restarting? A voter; or anyone once
        the voter set lives in the log (KIP-853): replicating a VotersRecord
        can make it one. A quarantine is kept until re-replicated for it."""
        return self.is_voter or self.voter_set.kraft_version == 1

    def is_majority(self, ids: Iterable[int]) -> bool:
        """Do `ids` make a majority of the voter set? (The one place elections
        count voters.)"""
        return self.voter_set.is_majority(ids)

    def may_be_candidate(self, candidate_id: int, directory_id: str) -> bool:
        """May (candidate_id, directory_id) ask for our vote? A voter of our
        set may. With the voter set in the log (KIP-853) so may a node our
        set does not name at all: our set may lag the candidate's (a
        VotersRecord we have not replicated yet added it), and the candidate
        counts its majority in its own set. A node id our set names with
        another directory is a wiped replica: never."""
        vs = self.voter_set
        if vs.is_voter(candidate_id, directory_id):
            return True
        return (vs.kraft_version == 1 and directory_id != NO_DIRECTORY_ID
                and (vs.unknown or candidate_id not in vs.directory_ids))

    def addressed_by_own_key(self, voter_id: int, voter_directory_id: str) -> bool:
        """Does a Vote name this very replica, node id and directory id both
        (KIP-853)? Such a request comes from a candidate whose voter set has
        us as a voter, even if ours does not yet: we vote, by the usual rules."""
        return (voter_id == self.node_id and self.directory_id != NO_DIRECTORY_ID
                and voter_directory_id == self.directory_id)

    def addressed_to_me(self, voter_id: int, voter_directory_id: str) -> bool:
        """Kafka's isValidVoterKey: a Vote or BeginQuorumEpoch naming the voter
        it is for names this node and, if both sides know it, this very
        directory (a wiped and reformatted dir is another replica)."""
        if voter_id >= 0 and voter_id != self.node_id:
            return False
        return (voter_directory_id == NO_DIRECTORY_ID or self.directory_id == NO_DIRECTORY_ID
                or voter_directory_id == self.directory_id)
