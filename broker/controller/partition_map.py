"""The controller's partitions, held topic by topic (issue 19 items 1 and 2).

``ControllerState.partitions`` maps (topic id, partition id) to a frozen
``Partition`` record. At Kafka's headline scale (2 million partitions in
20,000 topics) one flat dict of tuple keys cost a 2M-entry hash table plus
2M key tuples: about 0.9 s of a 2.5 s snapshot load (hashing and inserting
the tuples) and 110 MiB of a broker's RSS (452 -> 339 MiB once split). Here each topic has its own small
dict keyed by partition id, built in one ``dict(zip(...))`` per topic when a
snapshot loads; no key tuple exists until a caller iterates keys.

Copies are copy-on-write per topic: ``copy()`` copies the outer dict only
(20,000 entries, under a millisecond) and from then on neither map writes
into a topic dict the two share; the first write to a topic in either map
gives that map its own copy of the topic (about a hundred entries). So a
snapshot's copy of the state costs O(topics), not O(partitions), and the
copy stays as it was while the live map keeps changing, even when another
thread reads the copy (the live map never writes a shared topic dict).

A loaded snapshot's topics stay as columns (``TopicColumns``) until one of
their partitions is written: building 2M Partition records and their dicts
was about 0.7 s of a 1.56 s load and most of a broker's RSS (340 -> 126 MiB
once kept as columns). A topic in columns reads
as a read-only mapping that builds the records it is asked for; the first
write to the topic turns it into a dict. Scans that look for one broker's
partitions (fencing) test the columns with vector operations.

The class keeps the mapping interface of the old flat dict (keys are
(topic id, partition id) tuples), so most callers did not change; per-topic
callers use ``topic()`` and the bulk methods.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping as _MappingABC
from itertools import repeat
from types import MappingProxyType
from typing import Any, Iterable, Iterator, Mapping, Sequence

from metalog.protocol.invariants import InvariantViolation, invariant
from metalog.storage import metadata_records as r

_EMPTY: Mapping[int, Any] = MappingProxyType({})  # an unknown topic's partitions: read only
_MISSING = object()


class PartitionColumns:
    """Rows of Partition records as int32 columns (numpy arrays, native byte
    order), shared by the topics a snapshot run holds: row i's replicas are
    replicas[i], its ISR isr[i] (or replicas[i] when `isr` is None: the
    usual case, stored once). Immutable once built."""

    __slots__ = ("replicas", "isr", "leaders", "leader_epochs", "partition_epochs")

    def __init__(self, replicas, isr, leaders, leader_epochs, partition_epochs) -> None:
        k = len(leaders)
        invariant(replicas.ndim == 2 and len(replicas) == k and (isr is None or len(isr) == k)
                  and len(leader_epochs) == k and len(partition_epochs) == k,
                  "partition columns of unequal lengths (%d leaders)", k)
        self.replicas = replicas
        self.isr = isr
        self.leaders = leaders
        self.leader_epochs = leader_epochs
        self.partition_epochs = partition_epochs

    def records(self, topic_id: str, first_pid: int, start: int, stop: int) -> list[r.Partition]:
        """Rows start..stop-1 as the records of partitions first_pid, first_pid + 1, ..."""
        shared = r.shared_ints
        reps = list(map(shared, map(tuple, self.replicas[start:stop].tolist())))
        isr = reps if self.isr is None else list(map(shared, map(tuple, self.isr[start:stop].tolist())))
        return list(map(r.Partition, repeat(topic_id), range(first_pid, first_pid + stop - start), reps, isr,
                        self.leaders[start:stop].tolist(), self.leader_epochs[start:stop].tolist(),
                        self.partition_epochs[start:stop].tolist()))

    def rows_with(self, broker_id: int) -> list[int]:
        """Rows whose ISR holds `broker_id` or whose leader it is, ascending."""
        isr = self.replicas if self.isr is None else self.isr
        hit = (isr == broker_id).any(axis=1) | (self.leaders == broker_id)
        return hit.nonzero()[0].tolist()


class TopicColumns(_MappingABC):
    """One topic's partitions first_pid, first_pid + 1, ... as rows
    start..stop-1 of a PartitionColumns: a read-only Mapping[int, Partition]
    that builds records when read and keeps none."""

    __slots__ = ("topic_id", "columns", "start", "stop", "first_pid")

    def __init__(self, topic_id: str, columns: PartitionColumns, start: int, stop: int, first_pid: int) -> None:
        if not (0 <= start < stop <= len(columns.leaders) and first_pid >= 0):  # one per topic of a load: inline
            raise InvariantViolation(f"rows {start}..{stop} (first id {first_pid}) outside columns of "
                                     f"{len(columns.leaders)} rows")
        self.topic_id = topic_id
        self.columns = columns
        self.start = start
        self.stop = stop
        self.first_pid = first_pid

    def __len__(self) -> int:
        return self.stop - self.start

    def __contains__(self, pid: object) -> bool:
        return type(pid) is int and self.first_pid <= pid < self.first_pid + self.stop - self.start

    def __getitem__(self, pid: int) -> r.Partition:
        if pid not in self:
            raise KeyError(pid)
        row = self.start + pid - self.first_pid
        return self.columns.records(self.topic_id, pid, row, row + 1)[0]

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.first_pid, self.first_pid + self.stop - self.start))

    def values(self) -> list[r.Partition]:  # type: ignore[override]
        """Every record, in partition id order (built now, in one go)."""
        return self.columns.records(self.topic_id, self.first_pid, self.start, self.stop)

    def between(self, first_pid: int, end_pid: int) -> list[r.Partition]:
        """The records of partitions first_pid..end_pid-1, every one present."""
        if end_pid <= first_pid:
            return []
        if first_pid < self.first_pid or end_pid > self.first_pid + len(self):
            raise KeyError(first_pid if first_pid < self.first_pid else end_pid - 1)
        row = self.start + first_pid - self.first_pid
        return self.columns.records(self.topic_id, first_pid, row, row + end_pid - first_pid)

    def items(self) -> Iterator[tuple[int, r.Partition]]:  # type: ignore[override]
        return zip(self, self.values())

    def to_dict(self) -> dict[int, r.Partition]:
        return dict(zip(self, self.values()))

    def records_at(self, rows: list[int]) -> list[r.Partition]:
        """The records of this topic's rows among `rows` (ascending row
        numbers of its PartitionColumns, as rows_with gives them)."""
        lo = bisect.bisect_left(rows, self.start)
        hi = bisect.bisect_left(rows, self.stop, lo)
        out = []
        for row in rows[lo:hi]:
            pid = self.first_pid + row - self.start
            out += self.columns.records(self.topic_id, pid, row, row + 1)
        return out

    def __repr__(self) -> str:
        return f"TopicColumns({self.topic_id}, partitions {self.first_pid}..{self.first_pid + len(self) - 1})"


class PartitionMap:
    """(topic id, partition id) -> Partition, stored as topic id -> {partition
    id: Partition}, or -> TopicColumns for a loaded topic not written since."""

    __slots__ = ("_topics", "_owned", "_len")

    def __init__(self, items: Iterable[tuple[tuple[str, int], r.Partition]] | Mapping | None = None) -> None:
        self._topics: dict[str, dict[int, r.Partition]] = {}
        # Topic ids whose dict only this map holds (may be written in place);
        # any other topic dict may be shared with a copy and is copied first.
        self._owned: set[str] = set()
        self._len = 0
        if items is not None:
            self.update(items)

    # ------------------------------------------------------------ reading

    def __len__(self) -> int:
        return self._len

    def __contains__(self, key: object) -> bool:
        try:
            tid, pid = key  # type: ignore[misc]
        except (TypeError, ValueError):
            return False
        return pid in self._topics.get(tid, _EMPTY)

    def __getitem__(self, key: tuple[str, int]) -> r.Partition:
        tid, pid = key
        try:
            return self._topics[tid][pid]
        except KeyError:
            raise KeyError(key) from None

    def get(self, key: tuple[str, int], default: Any = None) -> Any:
        parts = self._topics.get(key[0])
        return default if parts is None else parts.get(key[1], default)

    def topic(self, topic_id: str) -> Mapping[int, r.Partition]:
        """One topic's partitions by id (empty if none). Read only: writes go
        through the map, which may have to copy the topic first."""
        return self._topics.get(topic_id, _EMPTY)

    def topic_ids(self) -> Iterable[str]:
        """Topic ids that have at least one partition."""
        return self._topics.keys()

    def by_topic(self) -> Iterable[tuple[str, Mapping[int, r.Partition]]]:
        """(topic id, its partitions by id) for every topic with partitions,
        read only: a scan of every partition without a key tuple for each."""
        return self._topics.items()

    def __iter__(self) -> Iterator[tuple[str, int]]:
        for tid, parts in self._topics.items():
            for pid in parts:
                yield (tid, pid)

    def keys(self) -> Iterator[tuple[str, int]]:
        return iter(self)

    def items(self) -> Iterator[tuple[tuple[str, int], r.Partition]]:
        for tid, parts in self._topics.items():
            for pid, p in parts.items():
                yield (tid, pid), p

    def values(self) -> Iterator[r.Partition]:
        for parts in self._topics.values():
            yield from parts.values()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PartitionMap):
            return self._len == other._len and self._topics == other._topics
        if isinstance(other, Mapping):
            return self._len == len(other) and all(other.get(k, _MISSING) == v for k, v in self.items())
        return NotImplemented

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        return f"PartitionMap({len(self._topics)} topics, {self._len} partitions)"

    # ------------------------------------------------------------ writing

    def _writable(self, tid: str) -> dict[int, r.Partition]:
        """The topic's dict, this map's own (copied if shared, made if new)."""
        parts = self._topics.get(tid)
        if parts is None:
            parts = self._topics[tid] = {}
            self._owned.add(tid)
        elif tid not in self._owned:
            parts = self._topics[tid] = parts.to_dict() if type(parts) is TopicColumns else dict(parts)
            self._owned.add(tid)
        return parts

    def __setitem__(self, key: tuple[str, int], value: r.Partition) -> None:
        tid, pid = key
        parts = self._writable(tid)
        n = len(parts)
        parts[pid] = value
        self._len += len(parts) - n

    def replace(self, topic_id: str, partition_id: int, value: r.Partition) -> None:
        """Set the record of a partition that exists (a PartitionChange): the
        apply path's write, without the count's bookkeeping."""
        parts = self._topics[topic_id] if topic_id in self._owned else self._writable(topic_id)
        if partition_id not in parts:
            raise InvariantViolation(f"replace of a missing partition {topic_id}/{partition_id}")
        parts[partition_id] = value

    def __delitem__(self, key: tuple[str, int]) -> None:
        if self.pop(key, _MISSING) is _MISSING:
            raise KeyError(key)

    def pop(self, key: tuple[str, int], default: Any = _MISSING) -> Any:
        tid, pid = key
        if pid not in self._topics.get(tid, _EMPTY):
            if default is _MISSING:
                raise KeyError(key)
            return default
        parts = self._writable(tid)
        value = parts.pop(pid)
        self._len -= 1
        if not parts:  # no empty topic dicts: equality compares the outer dicts
            del self._topics[tid]
            self._owned.discard(tid)
        return value

    def update(self, items: Iterable[tuple[tuple[str, int], r.Partition]] | Mapping) -> None:
        if isinstance(items, (Mapping, PartitionMap)):
            items = items.items()
        for key, value in items:
            self[key] = value

    def add_rows(self, topic_id: str, partition_ids: list[int], records: list[r.Partition]) -> None:
        """Insert one topic's rows in bulk (a snapshot's or a creation's run):
        one dict built or updated, not a key tuple per row."""
        if len(partition_ids) != len(records):
            raise InvariantViolation(f"{len(partition_ids)} partition ids for {len(records)} records")
        parts = self._topics.get(topic_id)
        if parts is None:
            self._topics[topic_id] = dict(zip(partition_ids, records))
            self._owned.add(topic_id)
            self._len += len(self._topics[topic_id])
            return
        parts = self._writable(topic_id)
        n = len(parts)
        parts.update(zip(partition_ids, records))
        self._len += len(parts) - n

    def drop_topic(self, topic_id: str) -> int:
        """Remove every partition of the topic; how many there were."""
        parts = self._topics.pop(topic_id, None)
        self._owned.discard(topic_id)
        if parts is None:
            return 0
        self._len -= len(parts)
        return len(parts)

    def add_columns(self, topic_id: str, columns: PartitionColumns, start: int, stop: int,
                    first_pid: int) -> None:
        """Insert partitions first_pid.. of a topic as rows start..stop-1 of
        `columns` (a snapshot's load), kept as columns until written."""
        if topic_id in self._topics:  # the topic's earlier rows: one dict for both
            self.add_rows(topic_id, list(range(first_pid, first_pid + stop - start)),
                          columns.records(topic_id, first_pid, start, stop))
            return
        self._topics[topic_id] = TopicColumns(topic_id, columns, start, stop, first_pid)
        self._len += stop - start

    def ordered(self, topic_id: str, partition_ids: Sequence[int]) -> list[r.Partition]:
        """The topic's records for `partition_ids` (every one present), in that
        order: a topic still in columns builds a range of ids in one go."""
        parts = self._topics[topic_id]
        if type(parts) is TopicColumns and type(partition_ids) is range and partition_ids.step == 1:
            return parts.between(partition_ids.start, partition_ids.stop)
        return [parts[pid] for pid in partition_ids]

    def with_broker(self, broker_id: int) -> Iterator[tuple[str, int, r.Partition]]:
        """(topic id, partition id, record) of every partition whose ISR holds
        `broker_id` or whose leader it is, topic by topic: no key tuple or
        record built for another partition, columns tested as vectors."""
        hits: dict[int, list[int]] = {}  # id(PartitionColumns) -> its rows with the broker
        for tid, parts in self._topics.items():
            if type(parts) is TopicColumns:
                cols = parts.columns
                rows = hits.get(id(cols))
                if rows is None:
                    rows = hits[id(cols)] = cols.rows_with(broker_id)
                for p in parts.records_at(rows):
                    yield tid, p.partition_id, p
                continue
            for pid, p in parts.items():
                if broker_id in p.isr or p.leader == broker_id:
                    yield tid, pid, p

    def copy(self) -> "PartitionMap":
        """An independent map equal to this one now, in O(topics): the topic
        dicts are shared until either map writes to one (it copies it first)."""
        c = PartitionMap()
        c._topics = dict(self._topics)
        c._len = self._len
        self._owned = set()  # every topic dict is shared with `c` now
        return c
