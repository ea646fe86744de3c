"""The controller: the metadata log materialized into cluster state.

``ControllerState`` is a deterministic state machine over the metadata records
of ``metalog.storage.metadata_records``: every replica that applies the same committed
records in the same order ends in the same state. It is pure (no asyncio, no
I/O) so the Spark job can reuse ``apply`` as is. ``Controller`` wraps it for
the broker: it decodes committed batches, counts records since the last
snapshot, and builds validated commands for clients.

Apply rules (the Spark job must reproduce them exactly)
-------------------------------------------------------
A record that breaks a rule below is *invalid*: it is ignored (state
unchanged) and ``invalid_records`` is incremented -- never an exception, since
a committed record can never be taken back and every replica must skip it the
same way. A record value that does not decode counts as invalid too.

* RegisterBroker: inserts or replaces the broker. Invalid if a registration
  with a higher broker_epoch exists.
* UnregisterBroker: removes the broker. Invalid if unknown or the epoch differs.
  Partitions are not touched (the command builder fences first).
* FenceBroker(id, epoch): invalid if unknown or the epoch differs. Marks the
  broker fenced; partitions are not touched: as Kafka's controller does, the
  command builder writes a PartitionChange for every partition the fence
  changes (``fence_changes``: the rule below), in the same batch.
* FenceBrokerImplicit(id, epoch) (metalog's key 1001: the FenceBroker of
  format versions 1-2, converted by ``metalog storage upgrade``): the same
  checks and mark, then, as an *event* record, changes every partition whose
  ISR holds the broker or whose leader it is, independently of each other:

  1. ``isr' = isr`` without the broker; if that leaves the ISR empty the ISR is
     kept as it was (Kafka never shrinks an ISR to nothing: the last in-sync
     replica must stay known for a clean recovery).
  2. if the broker was the leader: the new leader is the first broker in
     ``replicas`` order that is in ``isr'``, is registered and is not fenced
     (the fenced broker itself is fenced by now); if none, -1.
  3. ``leader_epoch += 1`` if the leader changed; ``partition_epoch += 1``
     if the ISR or the leader changed.
* UnfenceBroker(id, epoch): invalid if unknown or the epoch differs. Marks the
  broker unfenced; partitions are not touched (the command builder adds
  PartitionChange records to bring offline partitions back).
* BrokerRegistrationChange(broker_id, broker_epoch, fenced, in_controlled_shutdown)
  (Kafka's fence/unfence since metadata.version 3.3; we never write it):
  invalid if the broker is unknown, the epoch differs, fenced is not -1, 0 or
  1 or in_controlled_shutdown not 0 or 1. fenced 1 fences, -1 unfences;
  partitions are not touched (Kafka writes their PartitionChange records).
* Topic: invalid if the name or the id exists.
* Partition: inserts or replaces. Invalid if the topic id is unknown, or the
  partition is malformed (see ``_partition_problem``).
* PartitionChange: invalid if the partition is unknown. Applies the non-null
  fields (leader -2 = no change); invalid if the result is malformed.
  ``leader_epoch += 1`` if the leader changed, ``partition_epoch += 1`` always.
* Config: resource type 2 (topic, which must exist by name) or 4 (broker);
  value None deletes the key (deleting a missing key is valid and a no-op).
* RemoveTopic: invalid if unknown; removes the topic, its partitions and its
  topic configs.
* FeatureLevel: sets the level; level 0 removes the feature. A state starts
  with ``metadata.version`` at ``r.METADATA_VERSION_LEVEL`` (our clusters
  write no bootstrap record at birth: every snapshot carries it, first, and
  the first metadata command of a log without one writes it, see
  ``metadata_version_logged``), and a ``metadata.version`` below Kafka's
  lowest level (7) is invalid, removal included.
* AccessControlEntry: invalid if the id is live or the entry is malformed
  (``metalog.broker.controller.acl.acl_problem``); otherwise adds it.
* RemoveAccessControlEntry: invalid if the id is unknown; removes it.
* NoOp: nothing.
* UnknownRecord (a Kafka record type we do not model, e.g. RegisterController): no
  state change, valid; counted by type name in ``unknown_records`` so that a
  replay of a Kafka log says what it could not model. ProducerIds (15) is
  counted too, and moves ``next_producer_id`` forward (``producer_blocks``):
  invalid if it does not.

A partition is malformed when: replicas is empty or has duplicates or a
negative id, the ISR has duplicates or holds a non-replica, or the leader is
neither -1 nor in the ISR, or a partition id is negative. An empty ISR is
valid (leaderless, then): Kafka writes one since KIP-966 (ELR) when the last
in-sync replica is fenced; metalog's own fence keeps the last member.
"""

from __future__ import annotations

import bisect
import gc
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Sequence

import msgspec
import structlog

from metalog.broker.controller import acl as authz
from metalog.broker.controller import partition_ids, producer_blocks
from metalog.broker.controller import partition_map, views
from metalog.broker.controller.partition_map import PartitionMap
from metalog.broker.controller.state_copy import StateDict
from metalog.protocol import messages as m
from metalog.protocol.errors import Errors as ErrorCode
from metalog.protocol.invariants import InvariantViolation, invariant
from metalog.storage import batch as b
from metalog.storage import metadata_records as r
from metalog.storage.producer_state import RETAINED_BATCHES, BatchMeta, ProducerEntry, ProducerStateTable

log = structlog.get_logger(__name__)

PartitionKey = tuple[str, int]  # (topic_id, partition_id)
ConfigKey = tuple[int, str, str]  # (resource_type, resource_name, name)

_replace = msgspec.structs.replace


def _partition_problem(p: r.Partition) -> str | None:
    """Why a partition is malformed, or None."""
    if p.partition_id < 0:
        return f"negative partition id {p.partition_id}"
    # The answer depends on (replicas, ISR, leader) only, and few distinct
    # ones exist (replica lists repeat across partitions): replay asks once
    # per distinct triple instead of building sets per record.
    key = (p.replicas, p.isr, p.leader)
    got = _assignment_problems.get(key, _UNKNOWN)
    if got is _UNKNOWN:
        if len(_assignment_problems) >= _ASSIGNMENT_PROBLEMS_MAX:
            _assignment_problems.clear()
        got = _assignment_problems[key] = _assignment_problem(p)
    return got


_UNKNOWN = object()
_ASSIGNMENT_PROBLEMS_MAX = 1 << 16
_assignment_problems: dict[tuple, str | None] = {}


def _assignment_problem(p: r.Partition) -> str | None:
    if not p.replicas:
        return "empty replica list"
    if len(set(p.replicas)) != len(p.replicas) or min(p.replicas) < 0:
        return f"bad replica list {list(p.replicas)}"
    # An empty ISR is Kafka's since KIP-966 (eligible leader replicas): the last
    # in-sync replica fenced, the partition has no leader and its ISR is empty
    # (a leader must be in the ISR, so only a leaderless partition has one).
    if len(set(p.isr)) != len(p.isr):
        return f"bad ISR {list(p.isr)}"
    if not set(p.isr) <= set(p.replicas):
        return f"ISR {list(p.isr)} is not a subset of replicas {list(p.replicas)}"
    if p.leader != r.NO_LEADER and p.leader not in p.isr:
        return f"leader {p.leader} is not in the ISR {list(p.isr)}"
    return None


def _shared_rows(a) -> list[tuple[int, ...]]:
    """Each row of the int array `a` as a metalog.storage.metadata_records.shared_ints
    tuple: built once per distinct row, not once per row."""
    from metalog.storage.partition_runs import distinct_rows  # numpy: for the loader only

    uniq, inverse = distinct_rows(a)
    tuples = [r.shared_ints(tuple(x)) for x in uniq.tolist()]
    return list(map(tuples.__getitem__, inverse.tolist()))


class _PreparedRows:
    """A PartitionRun's rows checked against _partition_problem and held as
    native int32 columns, computed as columns (numpy) once; their Partition
    records only if asked for (a snapshot's load keeps the columns)."""

    __slots__ = ("columns", "_ok", "_run", "_records", "_pids")

    def __init__(self, run) -> None:
        import numpy as np  # numpy: for runs only

        reps, isr, leaders, pids = run.replicas, run.isr, run.leaders, run.partition_ids
        n, m = reps.shape[1], isr.shape[1]
        # _partition_problem per row: id >= 0, distinct non-negative replicas,
        # distinct ISR members, ISR within the replicas, leader in the ISR or
        # none. Column by column in native byte order: the runs' big-endian
        # columns and .any(axis=1) over 2-3 wide rows are slow (this alone took
        # the 2M-partition load from 1.85-1.94 s to 1.58-1.70 s).
        rc = [reps[:, x].astype(np.int32) for x in range(n)]
        ic = [isr[:, x].astype(np.int32) for x in range(m)]
        lead = leaders.astype(np.int32)
        ok = pids >= 0
        if n == 0 or m == 0:  # an empty replica list or ISR: every row is refused
            ok &= False
        for x in range(n):
            ok &= rc[x] >= 0
            for y in range(x + 1, n):
                ok &= rc[x] != rc[y]
        in_isr = lead == r.NO_LEADER
        for x in range(m):
            for y in range(x + 1, m):
                ok &= ic[x] != ic[y]
            member = np.zeros(len(ok), bool)
            for y in range(n):
                member |= rc[y] == ic[x]
            ok &= member
            in_isr |= ic[x] == lead
        ok &= in_isr
        self._ok = ok
        native_reps = np.stack(rc, axis=1) if n else reps.astype(np.int32)
        same_isr = n == m and all(bool((a == b).all()) for a, b in zip(rc, ic))
        native_isr = None if same_isr else (np.stack(ic, axis=1) if m else isr.astype(np.int32))
        self.columns = partition_map.PartitionColumns(
            native_reps, native_isr, lead, run.leader_epochs.astype(np.int32),
            run.partition_epochs.astype(np.int32))
        self._run = run
        self._records: list[r.Partition] | None = None
        self._pids: list[int] | None = None

    def all_ok(self, start: int, stop: int) -> bool:
        """Whether rows[start:stop] all pass _partition_problem."""
        return bool(self._ok[start:stop].all())

    @property
    def pids(self) -> list[int]:
        if self._pids is None:
            self._pids = self._run.partition_ids.tolist()
        return self._pids

    @property
    def records(self) -> list[r.Partition]:
        """Every row as a Partition record. shared_ints hands out one tuple
        per value: an ISR equal to its replica list is the replica tuple itself."""
        if self._records is None:
            cols = self.columns
            rep_list = _shared_rows(cols.replicas)
            isr_list = rep_list if cols.isr is None else _shared_rows(cols.isr)
            self._records = list(map(r.Partition, self._run.topic_ids, self.pids, rep_list, isr_list,
                                     cols.leaders.tolist(), cols.leader_epochs.tolist(),
                                     cols.partition_epochs.tolist()))
        return self._records

    def topics_known(self, topics: Mapping[str, Any], start: int, stop: int) -> bool:
        """Whether every topic of rows[start:stop] is in `topics`."""
        run = self._run
        if start == 0 and stop == run.count:
            return all(t in topics for t in run.topic_names)
        return all(t in topics for t in set(run.topic_ids[start:stop]))

    def extends_dense(self, counts: dict[str, int], sparse: partition_ids.SparseIds, start: int, stop: int) -> bool:
        """Whether rows[start:stop] leave every topic they touch dense
        (broker/controller/partition_ids.py), so that raising the counts keeps the index."""
        if stop - start < 512:
            return partition_ids.ids_extend_dense(counts, sparse, self._run.topic_ids[start:stop],
                                                  self.pids[start:stop])
        return partition_ids.columns_extend_dense(counts, sparse, self._run.topic_names,
                                                  self._run.topic_index[start:stop],
                                                  self._run.partition_ids[start:stop])

    def highest(self, start: int, stop: int) -> Iterable[tuple[str, int]]:
        """(topic id, its highest partition id) among rows[start:stop]."""
        if stop - start < 512:
            top: dict[str, int] = {}
            for t, pid in zip(self._run.topic_ids[start:stop], self.pids[start:stop]):
                if pid > top.get(t, -1):
                    top[t] = pid
            return top.items()
        import numpy as np

        # the last row of each topic's group once sorted by (topic, id)
        index = self._run.topic_index[start:stop]
        pids = self._run.partition_ids[start:stop]
        order = np.lexsort((pids, index))
        by_topic = index[order]
        last = np.append(by_topic[1:] != by_topic[:-1], True)
        names = self._run.topic_names
        return [(names[t], pid) for t, pid in zip(by_topic[last].tolist(), pids[order][last].tolist())]

    def groups(self, start: int, stop: int) -> Iterable[tuple[str, int, int]]:
        """(topic id, first row, end row) of each run of consecutive rows of
        one topic among rows[start:stop]."""
        if stop - start < 512:
            out = []
            tids = self._run.topic_ids
            a = start
            for i in range(start + 1, stop):
                if tids[i] != tids[a]:
                    out.append((tids[a], a, i))
                    a = i
            if a < stop:
                out.append((tids[a], a, stop))
            return out
        import numpy as np

        index = self._run.topic_index[start:stop]
        cuts = (np.flatnonzero(index[1:] != index[:-1]) + 1 + start).tolist()
        bounds = [start] + cuts + [stop]
        names, index = self._run.topic_names, self._run.topic_index
        return [(names[index[a]], a, z) for a, z in zip(bounds, bounds[1:])]


class ControllerState:
    """Brokers, topics, partitions, configs and features at `offset`.

    ``offset`` is the next offset: every record < offset is reflected. Values in
    the dicts are frozen records and never mutated in place, so ``copy()`` (a
    shallow copy of each dict; the partitions copied on write, topic by topic)
    is a consistent, independent snapshot of the state that another thread may
    serialize while this one keeps applying.
    """

    __slots__ = ("offset", "brokers", "topics", "topic_ids", "partitions", "configs",
                 "features", "acls", "acl_version", "invalid_records", "last_invalid", "producers",
                 "unknown_records", "metadata_version_logged", "next_producer_id",
                 "partition_counts", "sparse_partition_ids", "config_names", "_sorted_names",
                 "_sorted_acl_ids")

    def __init__(self, offset: int = 0) -> None:
        self.offset = offset
        self.brokers: dict[int, r.RegisterBroker] = {}
        self.topics: dict[str, r.Topic] = {}  # by topic id
        self.topic_ids: dict[str, str] = {}  # name -> topic id
        # Topic by topic, copied on write (broker/controller/partition_map.py); configs a
        # StateDict that an IncrementalCopy (broker/controller/state_copy.py) can track.
        self.partitions = PartitionMap()
        self.configs: dict[ConfigKey, str] = StateDict()
        # Indexes for reads and removals that must not scan every partition or
        # config (2M partitions): a topic's partitions are ids 0..count-1, as
        # in Kafka, unless a record opened a gap (broker/controller/partition_ids.py); a
        # resource's config names, sorted; topic names and ACL ids sorted for
        # paging, built by the first read that pages them and kept sorted
        # from then on (None: not built, nothing to maintain).
        self.partition_counts: dict[str, int] = {}  # topic id -> 1 + highest partition id
        self.sparse_partition_ids: partition_ids.SparseIds = {}  # only topics with a gap in their ids
        self.config_names: dict[tuple[int, str], list[str]] = {}
        self._sorted_names: list[str] | None = None
        self._sorted_acl_ids: list[str] | None = None
        self.features: dict[str, int] = {r.METADATA_VERSION: r.METADATA_VERSION_LEVEL}
        self.acls: dict[str, r.AccessControlEntry] = {}  # by ACL id
        self.acl_version = 0  # bumped on every ACL change: lets the authorizer cache its view
        # Idempotent producers as of the committed batches (metalog.storage.producer_state):
        # carried in snapshots so that a replica loading one knows them. Not part
        # of equality (the runtime expires idle producers locally).
        self.producers = ProducerStateTable(end_offset=offset)
        # Diagnostic only: not part of equality (a replica that loaded a
        # snapshot never saw the invalid records that preceded it).
        self.invalid_records = 0
        self.last_invalid: str | None = None
        # Diagnostic, like invalid_records: records of types we do not model, by type name.
        self.unknown_records: dict[str, int] = {}
        # The first id of the next block of producer ids for Kafka brokers (producer_blocks).
        self.next_producer_id = 0
        # Whether a metadata.version FeatureLevel is in the log or snapshot this state came
        # from: Kafka's replay (its MetadataLoader, its controller) stops at a metadata record
        # before one ("Unknown metadata version for FeaturesImage"). Not part of equality.
        self.metadata_version_logged = False

    # ---------------------------------------------------------------- apply

    def apply(self, offset: int, record: r.MetadataRecord) -> bool:
        """Apply the record at `offset`; False if it was invalid and ignored."""
        if offset < self.offset:
            raise InvariantViolation(f"records must be applied in offset order: got {offset}, next is {self.offset}")
        if type(record) is r.ProducerState:
            # Snapshot-only: in the log it would let a writer forge another producer's state.
            self.offset = offset + 1
            return self._invalid(f"offset {offset}: ProducerState belongs in snapshots only")
        ok = self._apply(record)
        self.offset = offset + 1
        return ok

    def apply_value(self, offset: int, value: bytes) -> bool:
        """Decode then apply; an undecodable value counts as invalid."""
        try:
            record = r.decode_record(value)
        except r.MetadataRecordError as exc:
            if offset < self.offset:
                raise InvariantViolation(f"records must be applied in offset order: got {offset}, "
                                         f"next is {self.offset}")
            self.offset = offset + 1
            self._invalid(f"offset {offset}: {exc}")
            return False
        return self.apply(offset, record)

    def skip_to(self, next_offset: int) -> None:
        """Offsets that hold no metadata record (control batches)."""
        if next_offset < self.offset:
            raise InvariantViolation(f"skip_to({next_offset}) would go back from {self.offset}")
        self.offset = next_offset

    def _invalid(self, why: str) -> bool:
        self.invalid_records += 1
        self.last_invalid = why
        return False

    def _apply(self, rec: r.MetadataRecord) -> bool:
        handler = _HANDLERS.get(type(rec))
        if handler is None:
            return self._invalid(f"no handler for {type(rec).__name__}")
        return handler(self, rec)

    def _register_broker(self, rec: r.RegisterBroker) -> bool:
        old = self.brokers.get(rec.broker_id)
        if old is not None and old.broker_epoch > rec.broker_epoch:
            return self._invalid(f"RegisterBroker {rec.broker_id} epoch {rec.broker_epoch} "
                                 f"older than registered epoch {old.broker_epoch}")
        self.brokers[rec.broker_id] = rec
        return True

    def _unregister_broker(self, rec: r.UnregisterBroker) -> bool:
        old = self.brokers.get(rec.broker_id)
        if old is None or old.broker_epoch != rec.broker_epoch:
            return self._invalid(f"UnregisterBroker of unknown broker {rec.broker_id} "
                                 f"epoch {rec.broker_epoch}")
        del self.brokers[rec.broker_id]
        return True

    def _fence_broker(self, rec: r.FenceBroker | r.FenceBrokerImplicit) -> bool:
        old = self.brokers.get(rec.id)
        if old is None or old.broker_epoch != rec.epoch:
            return self._invalid(f"{type(rec).__name__} of unknown broker {rec.id} epoch {rec.epoch}")
        self.brokers[rec.id] = _replace(old, fenced=True)
        return True

    def _fence_broker_implicit(self, rec: r.FenceBrokerImplicit) -> bool:
        if not self._fence_broker(rec):
            return False
        changed = [(key, _replace(p, isr=isr, leader=leader,
                                  leader_epoch=p.leader_epoch + (leader != p.leader),
                                  partition_epoch=p.partition_epoch + 1))
                   for key, p, isr, leader in self.fence_changes(rec.id)]
        self.partitions.update(changed)
        return True

    def fence_changes(self, bid: int) -> list[tuple[PartitionKey, r.Partition, tuple[int, ...], int]]:
        """(key, partition, new ISR, new leader) of every partition that fencing
        broker `bid` changes, in key order, with `bid` counted as fenced: it
        leaves the ISR (unless it is the last member: an ISR never empties),
        and where it led, the first replica in the new ISR that is registered
        and unfenced leads, else none (-1). Kafka's ReplicationControlManager rule."""
        out = []
        # One pass, topic by topic: no sort of every key and no key tuple or
        # record for a partition the broker is not in (2M partitions).
        for tid, pid, p in self.partitions.with_broker(bid):
            isr = tuple(x for x in p.isr if x != bid) or p.isr
            leader = p.leader
            if leader == bid:
                leader = self._elect(p.replicas, isr, exclude=bid)
            if isr != p.isr or leader != p.leader:
                out.append(((tid, pid), p, isr, leader))
        out.sort(key=lambda change: change[0])
        return out

    def _elect(self, replicas: Sequence[int], isr: Sequence[int], exclude: int = -1) -> int:
        for x in replicas:
            if x in isr and x != exclude:
                br = self.brokers.get(x)
                if br is not None and not br.fenced:
                    return x
        return r.NO_LEADER

    def _unfence_broker(self, rec: r.UnfenceBroker) -> bool:
        old = self.brokers.get(rec.id)
        if old is None or old.broker_epoch != rec.epoch:
            return self._invalid(f"UnfenceBroker of unknown broker {rec.id} epoch {rec.epoch}")
        self.brokers[rec.id] = _replace(old, fenced=False)
        return True

    def _broker_registration_change(self, rec: r.BrokerRegistrationChange) -> bool:
        old = self.brokers.get(rec.broker_id)
        if (old is None or old.broker_epoch != rec.broker_epoch or rec.fenced not in (-1, 0, 1)
                or rec.in_controlled_shutdown not in (0, 1)):
            return self._invalid(f"BrokerRegistrationChange of broker {rec.broker_id} epoch {rec.broker_epoch} "
                                 f"(fenced {rec.fenced}, in controlled shutdown {rec.in_controlled_shutdown})")
        if rec.fenced:
            self.brokers[rec.broker_id] = _replace(old, fenced=rec.fenced == 1)
        return True

    def _topic(self, rec: r.Topic) -> bool:
        if rec.name in self.topic_ids or rec.topic_id in self.topics:
            return self._invalid(f"Topic {rec.name!r} / {rec.topic_id} already exists")
        self.topics[rec.topic_id] = rec
        self.topic_ids[rec.name] = rec.topic_id
        if self._sorted_names is not None:
            bisect.insort(self._sorted_names, rec.name)
        return True

    def _partition(self, rec: r.Partition) -> bool:
        if rec.topic_id not in self.topics:
            return self._invalid(f"Partition {rec.partition_id} of unknown topic {rec.topic_id}")
        problem = _partition_problem(rec)
        if problem:
            return self._invalid(f"Partition {rec.topic_id}/{rec.partition_id}: {problem}")
        self.partitions[(rec.topic_id, rec.partition_id)] = rec
        count = self.partition_counts.get(rec.topic_id, 0)
        if rec.partition_id > count or (self.sparse_partition_ids and rec.topic_id in self.sparse_partition_ids):
            partition_ids.add_sparse(self.sparse_partition_ids, rec.topic_id, rec.partition_id, count)
        if rec.partition_id >= count:
            self.partition_counts[rec.topic_id] = rec.partition_id + 1
        return True

    def _apply_partition_run(self, run) -> None:
        """Apply a metalog.storage.partition_runs.PartitionRun as a snapshot's load
        does: the same as _partition on each of its records, checked as
        columns and kept as columns (broker/controller/partition_map.py) until written."""
        rows = _PreparedRows(run)
        if not self._rows_insertable(rows, 0, run.count):
            self._insert_rows(rows, 0, run.count)  # record by record
            return
        counts, parts, cols = self.partition_counts, self.partitions, rows.columns
        for tid, a, z in rows.groups(0, run.count):
            first = counts.get(tid, 0)  # a dense extension: ids first, first + 1, ...
            parts.add_columns(tid, cols, a, z, first)
            counts[tid] = first + z - a

    def _rows_insertable(self, rows: "_PreparedRows", start: int, stop: int) -> bool:
        """Whether rows[start:stop] may go in in bulk: every one valid, of a
        known topic, extending its topic's ids densely."""
        return (rows.all_ok(start, stop) and rows.topics_known(self.topics, start, stop)
                and rows.extends_dense(self.partition_counts, self.sparse_partition_ids, start, stop))

    def _insert_rows(self, rows: "_PreparedRows", start: int, stop: int) -> None:
        """_partition on rows[start:stop] (records in a row): one dict update
        when every one is valid, else record by record, so that a rejection
        and its message are exactly _partition's."""
        if not self._rows_insertable(rows, start, stop):
            # a rejection, or a gap in a topic's partition ids (broker/controller/partition_ids.py)
            for rec in rows.records[start:stop]:
                self._partition(rec)
            return
        parts, pids, records = self.partitions, rows.pids, rows.records
        for tid, a, z in rows.groups(start, stop):
            parts.add_rows(tid, pids[a:z], records[a:z])
        counts = self.partition_counts
        for t, pid in rows.highest(start, stop):
            if pid >= counts.get(t, 0):
                counts[t] = pid + 1

    def _partition_change(self, rec: r.PartitionChange) -> bool:
        key = (rec.topic_id, rec.partition_id)
        p = self.partitions.get(key)
        if p is None:
            return self._invalid(f"PartitionChange of unknown partition {key}")
        leader = p.leader if rec.leader == r.LEADER_NO_CHANGE else rec.leader
        replicas = p.replicas if rec.replicas is None else r.shared_ints(tuple(rec.replicas))
        isr = p.isr if rec.isr is None else tuple(rec.isr)
        new = _replace(
            p,
            isr=replicas if isr == replicas else r.shared_ints(isr),
            replicas=replicas,
            leader=leader,
            leader_epoch=p.leader_epoch + (leader != p.leader),
            partition_epoch=p.partition_epoch + 1,
        )
        problem = _partition_problem(new)
        if problem:
            return self._invalid(f"PartitionChange {key}: {problem}")
        self.partitions.replace(rec.topic_id, rec.partition_id, new)
        return True

    def _config(self, rec: r.Config) -> bool:
        if rec.resource_type == r.RESOURCE_TOPIC:
            if rec.resource_name not in self.topic_ids:
                return self._invalid(f"Config for unknown topic {rec.resource_name!r}")
        elif rec.resource_type != r.RESOURCE_BROKER:
            return self._invalid(f"Config with unknown resource type {rec.resource_type}")
        key = (rec.resource_type, rec.resource_name, rec.name)
        resource = (rec.resource_type, rec.resource_name)
        names = self.config_names.get(resource)
        i = -1 if names is None else bisect.bisect_left(names, rec.name)
        present = names is not None and i < len(names) and names[i] == rec.name
        if rec.value is None:
            self.configs.pop(key, None)
            if present:
                del names[i]
                if not names:
                    del self.config_names[resource]
        else:
            self.configs[key] = rec.value
            if names is None:
                self.config_names[resource] = [rec.name]
            elif not present:
                names.insert(i, rec.name)
        return True

    def _remove_topic(self, rec: r.RemoveTopic) -> bool:
        topic = self.topics.pop(rec.topic_id, None)
        if topic is None:
            return self._invalid(f"RemoveTopic of unknown topic id {rec.topic_id}")
        del self.topic_ids[topic.name]
        if self._sorted_names is not None:
            del self._sorted_names[bisect.bisect_left(self._sorted_names, topic.name)]
        self.partitions.drop_topic(rec.topic_id)
        self.partition_counts.pop(rec.topic_id, None)
        self.sparse_partition_ids.pop(rec.topic_id, None)
        for name in self.config_names.pop((r.RESOURCE_TOPIC, topic.name), ()):
            del self.configs[(r.RESOURCE_TOPIC, topic.name, name)]
        return True

    def _feature_level(self, rec: r.FeatureLevel) -> bool:
        if rec.feature_level < 0:
            return self._invalid(f"FeatureLevel {rec.name!r} with negative level")
        if rec.name == r.METADATA_VERSION and rec.feature_level < r.METADATA_VERSION_LEVEL_MIN:
            return self._invalid(f"FeatureLevel metadata.version {rec.feature_level}: Kafka's levels start "
                                 f"at {r.METADATA_VERSION_LEVEL_MIN}")
        if rec.name == r.METADATA_VERSION:
            self.metadata_version_logged = True
        if rec.feature_level == 0:
            self.features.pop(rec.name, None)
        else:
            self.features[rec.name] = rec.feature_level
        return True

    def _access_control_entry(self, rec: r.AccessControlEntry) -> bool:
        if rec.id in self.acls:
            return self._invalid(f"AccessControlEntry {rec.id} already exists")
        problem = authz.acl_problem(rec)
        if problem:
            return self._invalid(f"AccessControlEntry {rec.id}: {problem}")
        self.acls[rec.id] = rec
        self.acl_version += 1
        if self._sorted_acl_ids is not None:
            bisect.insort(self._sorted_acl_ids, rec.id)
        return True

    def _remove_access_control_entry(self, rec: r.RemoveAccessControlEntry) -> bool:
        if self.acls.pop(rec.id, None) is None:
            return self._invalid(f"RemoveAccessControlEntry of unknown ACL {rec.id}")
        self.acl_version += 1
        if self._sorted_acl_ids is not None:
            del self._sorted_acl_ids[bisect.bisect_left(self._sorted_acl_ids, rec.id)]
        return True

    def _no_op(self, rec: r.NoOp) -> bool:
        return True

    def _unknown(self, rec: r.UnknownRecord) -> bool:
        if rec.api_key == producer_blocks.RECORD_TYPE:  # the one such type we keep state of
            problem = producer_blocks.replay(self, rec)
            if problem is not None:
                return self._invalid(problem)
        name = r.type_name(rec)
        self.unknown_records[name] = self.unknown_records.get(name, 0) + 1
        return True

    def _producer_state(self, rec: r.ProducerState) -> bool:
        if rec.producer_id < 0 or len(rec.batches) > RETAINED_BATCHES:
            return self._invalid(f"ProducerState of producer id {rec.producer_id} with "
                                 f"{len(rec.batches)} batches")
        self.producers.producers[rec.producer_id] = ProducerEntry(
            rec.producer_id, rec.producer_epoch, rec.last_timestamp_ms,
            (BatchMeta(*meta) for meta in rec.batches))
        return True

    # ---------------------------------------------------------- views, copies

    def copy(self, configs: dict | None = None) -> "ControllerState":
        """An independent copy: O(topics + configs) dict copies (partitions
        are copied on write, topic by topic), no record is copied (they are
        frozen). `configs`: a copy made already (an IncrementalCopy's), used
        as it is."""
        c = ControllerState(self.offset)
        c.brokers = dict(self.brokers)
        c.topics = dict(self.topics)
        c.topic_ids = dict(self.topic_ids)
        c.partitions = self.partitions.copy()
        c.configs = StateDict(self.configs) if configs is None else configs
        c.partition_counts = dict(self.partition_counts)
        c.sparse_partition_ids = partition_ids.copy_sparse(self.sparse_partition_ids)
        c.config_names = {k: list(v) for k, v in self.config_names.items()}
        c.features = dict(self.features)
        c.acls = dict(self.acls)
        c.acl_version = self.acl_version
        c.invalid_records = self.invalid_records
        c.last_invalid = self.last_invalid
        c.unknown_records = dict(self.unknown_records)
        c.next_producer_id = self.next_producer_id
        c.metadata_version_logged = self.metadata_version_logged
        c.producers = self.producers.copy()  # entries are mutable: copied
        return c

    def to_records(self) -> Iterator[r.MetadataRecord]:
        """The state as records that rebuild it exactly (in dependency order:
        features, brokers, topics, partitions, configs, ACLs, producers), sorted
        for determinism. metadata.version comes first, as in Kafka's snapshots
        (FeaturesImage.write): Kafka's loaders read the rest by it. Producers
        are NoOp records to Kafka (metadata_records.PRODUCER_STATE_TAG)."""
        return _records_of(self)

    @classmethod
    def from_records(cls, records: Iterable[r.MetadataRecord], offset: int) -> "ControllerState":
        """Rebuild from ``to_records()`` output (e.g. a snapshot ending at `offset`)."""
        state = cls()
        for rec in records:
            state._apply(rec)
        state.offset = offset
        state.producers.end_offset = offset
        return state

    def _key(self) -> tuple:
        return (self.offset, self.brokers, self.topics, self.partitions, self.configs,
                self.features, self.acls, self.next_producer_id)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ControllerState):
            return NotImplemented
        return self._key() == other._key()

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        return (f"ControllerState(offset={self.offset}, brokers={len(self.brokers)}, "
                f"topics={len(self.topics)}, partitions={len(self.partitions)}, "
                f"configs={len(self.configs)}, acls={len(self.acls)}, invalid={self.invalid_records})")

    def sorted_topic_names(self) -> list[str]:
        """Topic names in order (for paging): sorted once, then kept sorted as
        topics come and go (the live index: do not modify)."""
        if self._sorted_names is None:
            self._sorted_names = sorted(self.topic_ids)
        return self._sorted_names

    def sorted_acl_ids(self) -> list[str]:
        """ACL ids in order (for paging), like sorted_topic_names."""
        if self._sorted_acl_ids is None:
            self._sorted_acl_ids = sorted(self.acls)
        return self._sorted_acl_ids

    def partition_ids(self, topic_id: str) -> Sequence[int]:
        """The topic's partition ids, ascending: every one is in `partitions`
        (broker/controller/partition_ids.py; the live index: do not modify)."""
        return partition_ids.ids_of(self.partition_counts, self.sparse_partition_ids, topic_id)

    def topic_by_name(self, name: str) -> r.Topic | None:
        tid = self.topic_ids.get(name)
        return None if tid is None else self.topics[tid]

    def to_json(self) -> dict:
        """The whole state as one dict, for tests and tools on small states
        (metalog.broker.controller.views.state_json; the admin API serves pages)."""
        return views.state_json(self)


_HANDLERS = {
    r.RegisterBroker: ControllerState._register_broker,
    r.UnregisterBroker: ControllerState._unregister_broker,
    r.FenceBroker: ControllerState._fence_broker,
    r.FenceBrokerImplicit: ControllerState._fence_broker_implicit,
    r.UnfenceBroker: ControllerState._unfence_broker,
    r.BrokerRegistrationChange: ControllerState._broker_registration_change,
    r.Topic: ControllerState._topic,
    r.Partition: ControllerState._partition,
    r.PartitionChange: ControllerState._partition_change,
    r.Config: ControllerState._config,
    r.RemoveTopic: ControllerState._remove_topic,
    r.FeatureLevel: ControllerState._feature_level,
    r.AccessControlEntry: ControllerState._access_control_entry,
    r.RemoveAccessControlEntry: ControllerState._remove_access_control_entry,
    r.NoOp: ControllerState._no_op,
    r.ProducerState: ControllerState._producer_state,
    r.UnknownRecord: ControllerState._unknown,
}


# ------------------------------------------------------------------ commands


def _records_of(state: "ControllerState") -> Iterator[r.MetadataRecord]:
    """``ControllerState.to_records``: out of the class, which must stay short enough to read."""
    mv = state.features.get(r.METADATA_VERSION)
    if mv is not None:
        yield r.FeatureLevel(r.METADATA_VERSION, mv)
    for name in sorted(state.features):
        if name != r.METADATA_VERSION:
            yield r.FeatureLevel(name, state.features[name])
    for bid in sorted(state.brokers):
        yield state.brokers[bid]
    for tid in sorted(state.topics):
        yield state.topics[tid]
    # Topic by topic, partition ids ascending: the order of sorted keys,
    # without one sort of every key. That sort is one C call holding the
    # GIL for seconds at 2M partitions, stalling the event loop while a
    # worker thread writes the snapshot (issue 19 item 2).
    for tid in sorted(state.partition_counts):
        yield from state.partitions.ordered(tid, state.partition_ids(tid))
    for (rtype, rname, name) in sorted(state.configs):
        yield r.Config(rtype, rname, name, state.configs[(rtype, rname, name)])
    for acl_id in sorted(state.acls):
        yield state.acls[acl_id]
    blocks = producer_blocks.snapshot_record(state)
    if blocks is not None:
        yield blocks
    for e in state.producers.to_entries():
        yield r.ProducerState(e.producer_id, e.producer_epoch, e.last_timestamp_ms,
                              tuple(tuple(meta) for meta in e.batches))


class CommandError(ValueError):
    """A client command refused against the current state; the message is what
    the client sees, `error_code` the Kafka error code to answer with."""

    def __init__(self, message: str, error_code: int = ErrorCode.INVALID_REQUEST):
        super().__init__(message)
        self.error_code = int(error_code)


class LogGapError(ValueError):
    """Batches handed to the controller skip offsets: a driver bug."""


def _uuid_arg(what: str, text: str | None) -> str:
    """A fresh uuid when `text` is None, else `text` if it is one (ids are 16
    bytes on disk, canonical hyphenated text in memory)."""
    if text is None:
        return str(uuid.uuid4())
    try:
        r.uuid_bytes(text)
    except ValueError:
        raise CommandError(f"{what} {text!r} is not a uuid "
                           "(like 0f8e4a2c-5b1d-4c3e-9a7f-2d6b8c1e3f40)") from None
    return text


_TOPIC_NAME = re.compile(r"[a-zA-Z0-9._-]{1,249}")


def settle_heap() -> None:
    """Collect, then move every object alive now out of the cyclic GC's
    sight (gc.freeze): the state just loaded lives as long as the process.
    Its records and per-topic partition dicts are untracked already, but the
    configs map (tuple keys), the topics' outer dict and the indexes are
    walked entry by entry by every full collection (tens of ms at 2M
    partitions, a commit's p99 while it runs; a flat partitions dict cost
    about 70 ms before it was split by topic). Frozen objects are still
    freed by reference counting; only cycles among them would stay."""
    gc.collect()
    gc.freeze()


def _check_replication(replication_factor: int, live: Sequence[int]) -> None:
    if replication_factor > len(live):
        raise CommandError(
            f"replication factor {replication_factor} is larger than the "
            f"{len(live)} live broker(s) {list(live)}", ErrorCode.INVALID_REPLICATION_FACTOR)


def _placed(tid: str, pids: Iterable[int], replication_factor: int, live: Sequence[int]) -> list[bytes]:
    """Partition records, replicas round robin over `live`, shifted per
    partition so leaders spread over brokers."""
    n = len(live)
    out = []
    for pid in pids:
        replicas = tuple(live[(pid + i) % n] for i in range(replication_factor))
        out.append(r.encode_record(r.Partition(tid, pid, replicas, replicas, replicas[0])))
    return out


class Controller:
    """The state machine fed with committed batches, plus command builders.

    Command builders validate against the *applied* (committed) state; two
    concurrent commands may both pass and the later record then fails the
    apply rules and is ignored deterministically. The runtime serializes
    commands on the leader to keep that rare.
    """

    def __init__(self, state: ControllerState | None = None) -> None:
        self.state = state or ControllerState()
        self.records_since_snapshot = 0
        self._topic_names = None  # metalog.storage.partition_runs.TopicNames, once a batch is read as columns

    @property
    def applied_offset(self) -> int:
        """Next offset to apply: every record < applied_offset is reflected."""
        return self.state.offset

    def load(self, state: ControllerState) -> None:
        """Replace the state (snapshot loaded or installed)."""
        self.state = state
        self.records_since_snapshot = 0
        settle_heap()

    def snapshot_taken(self, end_offset: int) -> None:
        """A snapshot ending at `end_offset` exists: recount from there."""
        self.records_since_snapshot = max(0, self.state.offset - end_offset)

    def apply_batches(self, data: bytes | memoryview, end_offset: int | None = None,
                      verify: bool = True) -> int:
        """Apply the committed records in `data` (whole batches, as the log
        reader returns them), skipping records below applied_offset (a batch
        re-read) and stopping at `end_offset` (the HW) if given. Control batches
        only advance the offset. Returns the number of records applied.

        `verify=False` skips the CRC check (headers are still checked) for
        bytes the caller's log read has just verified (SegmentedLog.read)."""
        state = self.state
        applied = 0
        pos = 0
        for pos, h in b.iter_batches(data, verify=verify):
            if h.base_offset > state.offset:
                raise LogGapError(
                    f"gap in the metadata log: expected offset {state.offset}, "
                    f"got a batch starting at {h.base_offset}")
            if end_offset is not None and h.base_offset >= end_offset:
                break
            if h.next_offset <= state.offset:
                continue
            if h.is_control:
                stop = h.next_offset if end_offset is None else min(h.next_offset, end_offset)
                state.skip_to(stop)
                if stop == h.next_offset:
                    state.producers.end_offset = stop  # a batch boundary: producer state is as of it
                continue
            if h.records_count >= COLUMN_BATCH_RECORDS_MIN and h.base_offset == state.offset and (
                    end_offset is None or h.next_offset <= end_offset):
                applied += self._apply_batch_columns(memoryview(data)[pos:pos + h.size], h)
            else:
                values = b.decode_records(memoryview(data)[pos:pos + h.size], h)
                for i, value in enumerate(values):
                    offset = h.base_offset + i
                    if offset < state.offset:
                        continue
                    if end_offset is not None and offset >= end_offset:
                        break
                    state.apply_value(offset, value)
                    applied += 1
            if state.offset == h.next_offset:  # the whole batch is applied
                if h.producer_id >= 0:
                    state.producers.apply_header(h)
                else:
                    state.producers.end_offset = h.next_offset
        self.records_since_snapshot += applied
        return applied

    def _apply_batch_columns(self, batch: memoryview, h: b.BatchHeader) -> int:
        """Apply a whole data batch with its PartitionRecords read as columns
        (metalog.storage.partition_runs.read_batch): a topic's creation is a
        TopicRecord and its partitions in one batch. The same state as record
        by record; the batch is read whole before the first record applies,
        so one that does not parse changes nothing (as with decode_records)."""
        from metalog.storage import partition_runs as pr  # numpy: on the first such batch

        if self._topic_names is None:
            self._topic_names = pr.TopicNames()
        read = pr.read_batch(batch, h, self._topic_names)
        state = self.state
        rows = None if read.run is None else _PreparedRows(read.run)
        offset = h.base_offset
        row = 0
        for item in read.items:
            if type(item) is int:
                state._insert_rows(rows, row, row + item)
                row += item
                offset += item
                state.offset = offset
            else:
                state.apply_value(offset, item)
                offset += 1
        invariant(offset == h.next_offset and (rows is None or row == len(rows.records)),
                  "column read of batch %s ended at offset %d, row %d", h, offset, row)
        return h.records_count

    # -- builders: each returns encoded record values to append as one batch

    def create_topic(self, name: str, partitions: int, replication_factor: int,
                     live_brokers: Sequence[int] | None = None,
                     topic_id: str | None = None) -> list[bytes]:
        st = self.state
        if not _TOPIC_NAME.fullmatch(name) or name in (".", ".."):
            raise CommandError(
                f"invalid topic name {name!r}: use 1-249 of [a-zA-Z0-9._-], not '.' or '..'")
        if name in st.topic_ids:
            raise CommandError(f"topic {name!r} already exists", ErrorCode.TOPIC_ALREADY_EXISTS)
        if partitions < 1:
            raise CommandError(f"number of partitions must be at least 1, got {partitions}",
                               ErrorCode.INVALID_PARTITIONS)
        if replication_factor < 1:
            raise CommandError(f"replication factor must be at least 1, got {replication_factor}",
                               ErrorCode.INVALID_REPLICATION_FACTOR)
        if live_brokers is None:
            live = sorted(bid for bid, br in st.brokers.items() if not br.fenced)
        else:
            for bid in live_brokers:
                br = st.brokers.get(bid)
                if br is None or br.fenced:
                    raise CommandError(f"broker {bid} is not registered and unfenced",
                                       ErrorCode.BROKER_NOT_AVAILABLE)
            live = sorted(set(live_brokers))
        _check_replication(replication_factor, live)
        tid = _uuid_arg("topic id", topic_id)
        if tid in st.topics:
            raise CommandError(f"topic id {tid} already exists")
        return [r.encode_record(r.Topic(name, tid))] + _placed(tid, range(partitions), replication_factor, live)

    def create_partitions(self, name: str, count: int) -> list[bytes]:
        """Grow topic `name` to `count` partitions (Kafka's CreatePartitions):
        the new ones after its highest id, placed as create_topic places them,
        with the replication factor of its first partition."""
        st = self.state
        topic = st.topic_by_name(name)
        if topic is None:
            raise CommandError(f"unknown topic {name!r}", ErrorCode.UNKNOWN_TOPIC_OR_PARTITION)
        ids = st.partition_ids(topic.topic_id)
        if count <= len(ids):
            raise CommandError(f"topic {name!r} has {len(ids)} partition(s); the count can only grow, "
                               f"got {count}", ErrorCode.INVALID_PARTITIONS)
        replication_factor = len(st.partitions[(topic.topic_id, ids[0])].replicas) if ids else 1
        live = sorted(bid for bid, br in st.brokers.items() if not br.fenced)
        _check_replication(replication_factor, live)
        first = ids[-1] + 1 if ids else 0
        return _placed(topic.topic_id, range(first, first + count - len(ids)), replication_factor, live)

    def delete_topic(self, name: str) -> list[bytes]:
        topic = self.state.topic_by_name(name)
        if topic is None:
            raise CommandError(f"unknown topic {name!r}", ErrorCode.UNKNOWN_TOPIC_OR_PARTITION)
        return [r.encode_record(r.RemoveTopic(topic.topic_id))]

    def register_broker(self, broker_id: int, endpoints: Sequence[tuple[str, str, int]] = (),
                        rack: str | None = None, fenced: bool = False,
                        incarnation_id: str | None = None) -> list[bytes]:
        """Register (or re-register with a new epoch). Unfenced by default so a
        CLI user can create topics right away; Kafka registers fenced and
        unfences on the first heartbeat."""
        if broker_id < 0:
            raise CommandError(f"broker id must be >= 0, got {broker_id}")
        eps = []
        for ep in endpoints:
            name, host, port = ep
            if not (0 < int(port) < 65536):
                raise CommandError(f"endpoint {name!r}: port {port} out of range 1..65535")
            eps.append(r.Endpoint(str(name), str(host), int(port)))
        old = self.state.brokers.get(broker_id)
        epoch = old.broker_epoch + 1 if old else 1
        rec = r.RegisterBroker(broker_id, _uuid_arg("incarnation id", incarnation_id), epoch,
                               tuple(eps), rack, fenced)
        return [r.encode_record(rec)]

    def _broker(self, broker_id: int) -> r.RegisterBroker:
        br = self.state.brokers.get(broker_id)
        if br is None:
            raise CommandError(f"unknown broker {broker_id}", ErrorCode.BROKER_NOT_AVAILABLE)
        return br

    def unregister_broker(self, broker_id: int) -> list[bytes]:
        """Fence first (moving leadership away), then unregister."""
        br = self._broker(broker_id)
        out = [] if br.fenced else self._fence(br)
        out.append(r.encode_record(r.UnregisterBroker(broker_id, br.broker_epoch)))
        return out

    def fence_broker(self, broker_id: int) -> list[bytes]:
        br = self._broker(broker_id)
        if br.fenced:
            raise CommandError(f"broker {broker_id} is already fenced")
        return self._fence(br)

    def _fence(self, br: r.RegisterBroker) -> list[bytes]:
        """FenceBroker, then a PartitionChange per partition it shrinks or
        moves, as Kafka's controller writes them (only the changed fields)."""
        out = [r.encode_record(r.FenceBroker(br.broker_id, br.broker_epoch))]
        for (tid, pid), p, isr, leader in self.state.fence_changes(br.broker_id):
            out.append(r.encode_record(r.PartitionChange(
                tid, pid, isr=isr if isr != p.isr else None,
                leader=leader if leader != p.leader else r.LEADER_NO_CHANGE)))
        return out

    def unfence_broker(self, broker_id: int) -> list[bytes]:
        """Unfence, and bring back every offline partition whose ISR holds the
        broker (it becomes leader there), as Kafka's controller does."""
        br = self._broker(broker_id)
        if not br.fenced:
            raise CommandError(f"broker {broker_id} is not fenced")
        out = [r.encode_record(r.UnfenceBroker(broker_id, br.broker_epoch))]
        # One pass, then a sort of the few it brings back, not of every key
        # (seconds at 2M partitions, on the leader's event loop).
        offline = sorted((tid, pid) for tid, pid, p in self.state.partitions.with_broker(broker_id)
                         if p.leader == r.NO_LEADER and broker_id in p.isr)
        out += [r.encode_record(r.PartitionChange(tid, pid, leader=broker_id)) for tid, pid in offline]
        return out

    def set_config(self, resource_type: int, resource_name: str, name: str,
                   value: str | None) -> list[bytes]:
        if resource_type == r.RESOURCE_TOPIC:
            if resource_name not in self.state.topic_ids:
                raise CommandError(f"unknown topic {resource_name!r}",
                                   ErrorCode.UNKNOWN_TOPIC_OR_PARTITION)
        elif resource_type == r.RESOURCE_BROKER:
            if resource_name and not resource_name.isdigit():
                raise CommandError(
                    f"broker config resource must be a broker id or '' (cluster default), "
                    f"got {resource_name!r}")
        else:
            raise CommandError(
                f"unknown config resource type {resource_type} (2 = topic, 4 = broker)")
        if not name:
            raise CommandError("config name must not be empty")
        return [r.encode_record(r.Config(resource_type, resource_name, name, value))]

    # -- ACLs: args as the CLI sends them (names, not codes); see metalog.broker.controller.acl

    @staticmethod
    def _acl_from_args(args: dict) -> r.AccessControlEntry:
        try:
            return authz.new_acl(
                principal=str(args["principal"]),
                operation=authz.parse_enum(authz.Operation, str(args["operation"])),
                permission=authz.parse_enum(authz.Permission, str(args.get("permission", "Allow"))),
                resource_type=authz.parse_enum(authz.ResourceType, str(args["resource_type"])),
                resource_name=str(args.get("resource_name") or authz.CLUSTER_RESOURCE_NAME),
                pattern_type=authz.parse_enum(authz.PatternType, str(args.get("pattern_type", "literal"))),
                host=str(args.get("host", authz.WILDCARD)),
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from None

    def add_acl(self, args: dict) -> list[bytes]:
        """One AccessControlEntry; adding an ACL that exists is a no-op (no record)."""
        rec = self._acl_from_args(args)
        if any(authz.same_binding(rec, old) for old in self.state.acls.values()):
            return []
        return [r.encode_record(rec)]

    def remove_acl(self, args: dict) -> list[bytes]:
        """Remove the ACL with exactly these fields; an error if there is none."""
        want = self._acl_from_args(args)
        ids = sorted(i for i, old in self.state.acls.items() if authz.same_binding(want, old))
        if not ids:
            raise CommandError(f"no such ACL: {authz.acl_to_text(want)}")
        return [r.encode_record(r.RemoveAccessControlEntry(i)) for i in ids]


# ------------------------------------------------------------------ snapshots


# A snapshot is written back every this many bytes: one fsync of 130 MB at
# the end held the log's fdatasyncs (the commits) behind it for tens of ms.
SNAPSHOT_SYNC_EVERY_BYTES = 2 << 20


@dataclass(frozen=True)
class SnapshotResult:
    snapshot_id: m.SnapshotId
    path: str
    size_bytes: int
    records: int
    elapsed_ms: float


def write_controller_snapshot(store, state: ControllerState, snapshot_id: m.SnapshotId,
                              last_contained_log_timestamp_ms: int, cluster_id: str = "",
                              batch_bytes_max: int = 1 << 20, voters=None,
                              part_path: str | None = None,
                              sync_every_bytes: int | None = SNAPSHOT_SYNC_EVERY_BYTES,
                              cpu_share: float = 1.0) -> SnapshotResult:
    """Serialize `state` into the snapshot `snapshot_id` of `store`.

    Made to run off the event loop: in a forked child (broker/server/snapshot_fork.py,
    the default), whose copy-on-write memory holds the state as it was at the
    fork, or in a worker thread given a copy taken on the loop at the moment
    state.offset == snapshot_id.end_offset (the copy shares only frozen
    records with the live state). Either way the loop keeps applying (and
    the log keeps appending) while this encodes and fsyncs.
    `voters` (a VotersRecord) is the log's voter set below end_offset, if the
    log has one (KIP-853); it travels in the snapshot. `part_path`: the
    temporary file's name, if the caller must be able to remove it.
    """
    from metalog.storage.snapshot import SnapshotWriter  # storage must not import broker

    invariant(state.offset == snapshot_id.end_offset, "state reflects offset %d, snapshot id says %d",
              state.offset, snapshot_id.end_offset)
    start_s = time.perf_counter()
    writer = SnapshotWriter(store.directory, snapshot_id, last_contained_log_timestamp_ms,
                            cluster_id, batch_bytes_max=batch_bytes_max, voters=voters,
                            part_path=part_path, sync_every_bytes=sync_every_bytes)
    values = (r.encode_record(rec) for rec in state.to_records())
    if cpu_share < 1.0:
        values = _paced(values, cpu_share)
    path, size_bytes, count = writer.write_all(values)
    return SnapshotResult(snapshot_id, path, size_bytes, count,
                          (time.perf_counter() - start_s) * 1000.0)


# Work between two pauses of a paced write. Short slices matter more than the
# share: at 0.35 of a CPU, 1 ms slices left commit p99 during generation at
# 1.7-2.7x idle, quarter-millisecond ones at 1.3-1.7x (docs/bench.md).
PACE_SLICE_S = 0.00025


def _paced(values: Iterator[bytes], cpu_share: float) -> Iterator[bytes]:
    """`values`, pausing so that the caller runs at most `cpu_share` of the
    time: about PACE_SLICE_S of work, then a sleep."""
    invariant(0.0 < cpu_share < 1.0, "a paced write needs 0 < cpu_share < 1, got %s", cpu_share)
    pause_s = PACE_SLICE_S * (1.0 - cpu_share) / cpu_share
    clock, sleep = time.perf_counter, time.sleep
    t = clock()
    for i, v in enumerate(values):
        yield v
        if not i & 31 and clock() - t >= PACE_SLICE_S:
            sleep(pause_s)
            t = clock()


# Smaller batches are applied record by record: a batch's column reading
# costs a fixed few hundred microseconds of numpy calls.
COLUMN_BATCH_RECORDS_MIN = 64


class SnapshotLoadError(ValueError):
    """A snapshot whose bytes are whole but whose records do not rebuild a state."""


class SnapshotLoader:
    """A ControllerState rebuilt from a snapshot's data records, fed in file
    order: by load_snapshot from a verified file, and by a download as its
    chunks arrive, each batch CRC-checked first (broker/server/snapshot_work.py), so
    that a catch-up's load overlaps its download instead of following it."""

    def __init__(self, snapshot_id: m.SnapshotId) -> None:
        self.snapshot_id = snapshot_id
        self.state = ControllerState()
        self.records = 0  # applied so far
        self._names = None  # metalog.storage.partition_runs.TopicNames, shared by the batches

    def add_batch(self, batch: bytes | memoryview, h: b.BatchHeader) -> None:
        """One whole data batch, CRC already checked. Raises
        b.CorruptBatchError (a record's framing) or SnapshotLoadError."""
        from metalog.storage import partition_runs as pr  # numpy: for loads only

        invariant(not h.is_control, "control batches are the snapshot's framing, not state")
        if self._names is None:
            self._names = pr.TopicNames()
        self.apply(pr.iter_batch(batch, h, self._names))

    def apply(self, items: Iterable) -> None:
        """Record values (bytes) and PartitionRuns, in the snapshot's order."""
        state, dec = self.state, r.decode_record
        # Loading allocates only long-lived objects: cyclic GC passes over the
        # growing heap would cost more than the load itself.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            for item in items:
                if type(item) is not bytes:  # a PartitionRun (metalog.storage.partition_runs)
                    state._apply_partition_run(item)
                    self.records += item.count
                    continue
                try:
                    rec = dec(item)
                except r.MetadataRecordError as exc:
                    raise SnapshotLoadError(f"snapshot {self.snapshot_id}: record {self.records}: {exc}") from exc
                state._apply(rec)
                self.records += 1
        finally:
            if gc_was_enabled:
                gc.enable()

    def finish(self) -> ControllerState:
        """The state, once every data record is in; raises SnapshotLoadError
        if the state machine rejected any."""
        state, sid = self.state, self.snapshot_id
        if state.invalid_records:
            raise SnapshotLoadError(
                f"snapshot {sid}: {state.invalid_records} record(s) rejected by the state "
                f"machine (last: {state.last_invalid})")
        state.offset = sid.end_offset
        state.producers.end_offset = sid.end_offset
        return state


def load_snapshot(store, snapshot_id: m.SnapshotId) -> ControllerState:
    """Load one snapshot; raises CorruptSnapshotError or SnapshotLoadError."""
    from metalog.storage.snapshot import read_snapshot

    sid, _header, items = read_snapshot(store.path(snapshot_id), partition_runs=True)
    loader = SnapshotLoader(sid)
    loader.apply(items)
    return loader.finish()


def load_latest(store) -> tuple[ControllerState, m.SnapshotId] | None:
    """Load the newest snapshot that loads; a bad one is quarantined
    (renamed ``.corrupt``, never loaded again) and the next older one tried."""
    from metalog.storage.snapshot import CorruptSnapshotError

    for sid in reversed(store.list()):
        try:
            return load_snapshot(store, sid), sid
        except (CorruptSnapshotError, SnapshotLoadError) as exc:
            log.error("snapshot_refused", snapshot=str(sid), error=str(exc))
            store.quarantine(sid)
    return None
