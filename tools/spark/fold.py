"""The distributed replay of the metadata log, as pure per-key folds.

``metalog.broker.controller.state.ControllerState`` applies records one by one over the
whole state. The Spark job cannot hold the whole state in one place, so it
splits the replay into folds that each see one *entity* (its key), with its
records in offset order, plus a few small side tables that carry the
cross-entity facts exactly:

1. **topic directory** (one key, ``T``): Topic and RemoveTopic. Names and ids
   form one namespace (a Topic is invalid if its name *or* its id is live), so
   these few records fold together. Output: the live intervals
   ``[created_at, removed_at)`` of every topic id (and so of every name).
2. **brokers** (key ``B``/broker id): Register/Unregister/Fence/Unfence and
   Kafka's BrokerRegistrationChange.
   Output: the broker's status timeline ``(offset, registered, fenced)`` after
   each valid record, and the offsets of its *valid* FenceBrokerImplicit
   records (an old log's fences; Kafka's FenceBroker only marks the broker,
   its partition changes are PartitionChange records of their own).
3. **partitions** (key ``P``/(topic id, partition id)): Partition and
   PartitionChange, plus *derived events* taken from the side tables: the
   removal of its topic (interval end), and every valid fence of a broker that
   ever appears in one of its replica lists (the ISR is a subset of the
   replicas and the leader is in the ISR or -1, so no other fence can touch
   it). The fence is applied with controller.py's FenceBrokerImplicit rule;
   the election asks the broker timeline for each candidate's status *as of
   that offset*.
4. **configs** (key ``C``/(type, name, key)): validity of a topic config needs
   the name to be live at that offset; the topic's removal deletes the key.
5. **features** (key ``F``/name). ``metadata.version`` starts at
   ``r.METADATA_VERSION_LEVEL`` as in ControllerState: ``seed_records()`` is
   one FeatureLevel at ``SEED_OFFSET`` (before any record, a snapshot's
   included) that every replay adds to its input, so the fold of that key
   always runs.
6. **ACLs** (key ``A``/ACL id): AccessControlEntry and its removal; an ACL's
   validity depends on its own id and fields only.
7. **producer ids** (key ``I``): Kafka's ProducerIdsRecord, the blocks of
   producer ids the controller hands Kafka brokers; the next id only moves
   forward (controller.producer_blocks). A type the record codec keeps whole,
   so it is also counted by name with the unmodelled types.

Side tables hold one row per topic lifecycle record / broker record, which in
any metadata log are few next to partition and config records; the Spark job
broadcasts them (exactly what a broadcast hash join does).

Every fold emits the entity's state at each requested *cut* offset (the state
reflecting records < cut), so one pass yields both the output snapshot and the
states to compare with the brokers' own snapshots at their offsets.

``replay_sequential`` runs the same folds with a plain dict standing in for the
shuffle; tests compare it (and the Spark job) with ControllerState.
"""

from __future__ import annotations

import bisect
import itertools
import struct
from dataclasses import dataclass, field
from typing import Iterable, Iterator, NamedTuple, Sequence

import msgspec

from metalog.broker.controller import producer_blocks
from metalog.broker.controller.acl import acl_problem
from metalog.broker.controller.state import ControllerState, _partition_problem
from metalog.protocol.invariants import InvariantViolation
from metalog.storage import metadata_records as r

_replace = msgspec.structs.replace

# Key kinds (first element of a record's key).
K_TOPICS = "T"
K_BROKER = "B"
K_PARTITION = "P"
K_CONFIG = "C"
K_FEATURE = "F"
K_ACL = "A"
K_NOOP = "N"
K_INVALID = "X"  # a metadata record (known api key) that does not decode: invalid
K_UNKNOWN = "U"  # a Kafka record type we do not model (key: its type name): counted by type
K_DATA = "D"  # not a metadata record at all (a produced record): no state, counted apart
K_PRODUCER_IDS = "I"  # Kafka's ProducerIdsRecord: folded (next_producer_id) and counted by type too

# Snapshot sections, in to_records() order.
SEC_FEATURE, SEC_BROKER, SEC_TOPIC, SEC_PARTITION, SEC_CONFIG, SEC_ACL, SEC_PRODUCER_IDS = range(7)
SEC_UNMODELLED = 99  # a Kafka record type in a snapshot that we do not model: listed, not compared

_SEP = "\x00"

# Before every offset a replay sees (a base snapshot's records take -(records + 1)..-2).
SEED_OFFSET = -(1 << 62)


def seed_records() -> list[tuple[int, bytes]]:
    """What a ControllerState holds before its first record, as records:
    metadata.version at the level a metalog cluster is born at."""
    return [(SEED_OFFSET, r.encode_record(r.FeatureLevel(r.METADATA_VERSION, r.METADATA_VERSION_LEVEL)))]


# Frame prefixes (frame version, api key, record version) of PartitionChange, the
# bulk of a metadata log: every version's body starts PartitionId int32, TopicId
# uuid, so its key is read from those 20 bytes without decoding the record.
_PARTITION_CHANGE_PREFIXES = frozenset(
    bytes((r.FRAME_VERSION, r.encode_record(r.PartitionChange(
        "00000000-0000-0000-0000-000000000000", 0, None, 0, None))[1], v)) for v in (0, 1, 2))
_PID_UUID = struct.Struct(">i16s")
_PID_UUID_END = 3 + _PID_UUID.size


def unread_version(value: bytes) -> str | None:
    """'<Type> v<N>' for a record of a type we model at a version past the
    ones this build reads (a newer Kafka's): not modelled, so listed by type
    and version as an unknown type is, never counted as an invalid record."""
    try:
        api_key, version, _pos = r.decode_frame(value)
    except r.MetadataRecordError:
        return None
    known = r.RECORD_TYPES.get(api_key)
    if known is None or version <= known[1]:
        return None
    return f"{r.record_type_name(api_key)} v{version}"


def key_of(value: bytes) -> tuple[str, str]:
    """(kind, key) of one record value; the key names the entity it changes.

    A PartitionChange is keyed from its first 20 body bytes alone: the
    partition fold decodes it in full and counts it invalid if it does not
    decode (as it would have been counted here), so the totals are the same."""
    if value[:3] in _PARTITION_CHANGE_PREFIXES and len(value) >= _PID_UUID_END:
        pid, raw_tid = _PID_UUID.unpack_from(value, 3)
        return K_PARTITION, f"{r.uuid_text(raw_tid)}{_SEP}{pid}"
    try:
        rec = r.decode_record(value)
    except r.MetadataRecordError:
        # Produced records share the log; their bytes carry no metadata
        # frame (frame version other than 1, or cut short inside the frame).
        try:
            r.decode_frame(value)
        except r.MetadataRecordError:
            return K_DATA, ""
        unread = unread_version(value)
        return (K_UNKNOWN, unread) if unread is not None else (K_INVALID, "")
    t = type(rec)
    if t is r.Config:  # first: most of a config-heavy log (Kafka's IncrementalAlterConfigs)
        return K_CONFIG, f"{rec.resource_type}{_SEP}{rec.resource_name}{_SEP}{rec.name}"
    if t is r.UnknownRecord:
        if rec.api_key == producer_blocks.RECORD_TYPE:  # the one such type the controller keeps state of
            return K_PRODUCER_IDS, ""
        return K_UNKNOWN, r.type_name(rec)
    if t in (r.RegisterBroker, r.UnregisterBroker):
        return K_BROKER, str(rec.broker_id)
    if t in (r.FenceBroker, r.UnfenceBroker, r.FenceBrokerImplicit):
        return K_BROKER, str(rec.id)
    if t is r.BrokerRegistrationChange:
        return K_BROKER, str(rec.broker_id)
    if t in (r.Topic, r.RemoveTopic):
        return K_TOPICS, ""
    if t in (r.Partition, r.PartitionChange):
        return K_PARTITION, f"{rec.topic_id}{_SEP}{rec.partition_id}"
    if t is r.FeatureLevel:
        return K_FEATURE, rec.name
    if t in (r.AccessControlEntry, r.RemoveAccessControlEntry):
        return K_ACL, rec.id
    return K_NOOP, ""


class StateRow(NamedTuple):
    """One entity of the state at `cut`, with its sort key in to_records() order."""

    cut: int
    sec: int
    s1: str
    n1: int
    s2: str
    s3: str
    value: bytes  # the encoded record that rebuilds the entity


def _emit_cuts(cuts: Sequence[int], ci: int, upto: int, emit) -> int:
    """Emit for every cut <= upto (state reflects records < cut); return next cut index."""
    while ci < len(cuts) and cuts[ci] <= upto:
        emit(cuts[ci])
        ci += 1
    return ci


# ------------------------------------------------------------------ map-side combine


COMBINE_KEYS_MAX = 1 << 17  # open runs per task: past it they are all emitted (memory bound)


_CONFIG_V0 = bytes((r.FRAME_VERSION, r.encode_record(r.Config(2, "", "", None))[1], 0))


def _config_key_bytes(value: bytes) -> bytes | None:
    """The bytes naming a ConfigRecord v0's key (resource type, resource name,
    config name) when the record is laid out plainly (one-byte lengths, no
    tagged fields) and its value is UTF-8; None otherwise (key_of decides)."""
    if value[:3] != _CONFIG_V0 or len(value) < 8:
        return None
    p = 4 + value[4]  # ResourceName: compact string, length + 1 in one byte
    if value[4] == 0 or value[4] >= 0x80 or p >= len(value) or value[p] == 0 or value[p] >= 0x80:
        return None
    q = p + value[p]  # Name: likewise; q is the Value's length byte
    if q >= len(value) or value[q] >= 0x80:
        return None
    end = q + 1 + max(value[q] - 1, 0)  # Value: compact nullable string (0 = null)
    if end + 1 != len(value) or value[end] != 0:  # then an empty tagged-field section
        return None
    try:
        value[q + 1:end].decode()
    except UnicodeDecodeError:
        return None
    return value[3:q]


# KIP-868 markers (key_of names them K_UNKNOWN): the job drops an aborted
# transaction's offsets after keying when the combine runs in the decode step.
TRANSACTION_MARKERS = frozenset({"BeginTransaction", "EndTransaction", "AbortTransaction"})


class KeyedRow(NamedTuple):
    offset: int
    kind: str
    key: str
    value: bytes
    n: int  # records this row stands for: 1, or a combined run's length


class Combiner:
    """Keys records (key_of) and drops the config writes no state can see,
    before the shuffle: of a run of writes to one config key, only the last
    can be in force at a cut. A run is a config key's writes inside one cut
    interval [cut_i, cut_i+1) of one file with no topic lifecycle record
    (Topic, RemoveTopic) or metadata transaction marker (an aborted
    transaction's range is dropped whole) between them. Within such a run
    the key's topic is live at every write or at none (liveness changes only
    at a lifecycle record, and a file's records reach one task in offset
    order, so the task sees every record between two of its writes), so
    fold_config counts the run's invalid records from its last one times
    ``n``; the last write of the run is the one the state keeps at the next
    cut, or a removal after it clears it either way. Every other kind passes
    through (a partition's fold needs every record: fences, elections). Feed
    records in the order of their file; ``file`` names the file (a run never
    spans two). More cuts than the replay's are safe: runs only get shorter."""

    def __init__(self, cuts: Sequence[int], combine: bool = True) -> None:
        self.cuts = sorted(set(cuts))
        self.combine = combine
        self.runs: dict[str, list] = {}  # config key -> [offset, value, n, interval, file]

    def feed(self, offset: int, value: bytes, file: str) -> Iterator[KeyedRow]:
        out: list[KeyedRow] = []
        self.feed_columns((offset,), (value,), (file,), out)
        return iter(out)

    def feed_columns(self, offsets: Sequence[int], values: Sequence[bytes], files: Sequence[str],
                     out: list[KeyedRow]) -> None:
        """Rows of the records, appended to out: the executors' hot loop,
        written out (a generator per record cost 2.4 us of 5.6). A ConfigRecord
        v0 in its plain layout continues a run on its key bytes alone, its
        value checked for UTF-8, without key_of's full decode (3 us); the
        first record of a run goes through key_of, which proves the key."""
        if not self.combine:
            for offset, value in zip(offsets, values):
                kind, key = key_of(value)
                out.append(KeyedRow(offset, kind, key, value, 1))
            return
        runs, cuts, bisect_right = self.runs, self.cuts, bisect.bisect_right
        for offset, value, file in zip(offsets, values, files):
            raw = _config_key_bytes(value)
            if raw is not None:
                run = runs.get(raw)
                if (run is not None and run[4] == file and offset > run[0]
                        and run[3] == bisect_right(cuts, offset)):
                    run[0], run[1], run[2] = offset, value, run[2] + 1
                    continue
            kind, key = key_of(value)
            if kind == K_CONFIG:
                rkey = raw if raw is not None else key
                run = runs.get(rkey)
                if run is not None:
                    out.append(KeyedRow(run[0], K_CONFIG, run[5], run[1], run[2]))
                elif len(runs) >= COMBINE_KEYS_MAX:
                    out.extend(self.flush())
                    runs = self.runs
                runs[rkey] = [offset, value, 1, bisect_right(cuts, offset), file, key]
                continue
            if kind == K_TOPICS or (kind == K_UNKNOWN and key in TRANSACTION_MARKERS):
                # Liveness may change at a lifecycle record; a transaction marker
                # bounds a range the job may drop whole (aborted): no run spans either.
                out.extend(self.flush())
                runs = self.runs
            out.append(KeyedRow(offset, kind, key, value, 1))

    def flush(self) -> Iterator[KeyedRow]:
        runs, self.runs = self.runs, {}
        for offset, value, n, _interval, _file, key in runs.values():
            yield KeyedRow(offset, K_CONFIG, key, value, n)


# ------------------------------------------------------------------ topic directory


@dataclass
class TopicTable:
    """Live intervals of topic ids and names: [start, end), end None = still live."""

    by_id: dict[str, list[tuple[int, int | None]]] = field(default_factory=dict)
    by_name: dict[str, list[tuple[int, int | None]]] = field(default_factory=dict)
    names: dict[tuple[str, int], str] = field(default_factory=dict)  # (id, start) -> name

    def add(self, tid: str, name: str, start: int, end: int | None) -> None:
        self.by_id.setdefault(tid, []).append((start, end))
        self.by_name.setdefault(name, []).append((start, end))
        self.names[(tid, start)] = name

    def finish(self) -> "TopicTable":
        for d in (self.by_id, self.by_name):
            for v in d.values():
                v.sort()
        return self

    @staticmethod
    def _live(intervals: list[tuple[int, int | None]] | None, offset: int) -> bool:
        for start, end in intervals or ():
            if start < offset and (end is None or offset < end):
                return True
        return False

    def id_live(self, tid: str, offset: int) -> bool:
        return self._live(self.by_id.get(tid), offset)

    def name_live(self, name: str, offset: int) -> bool:
        return self._live(self.by_name.get(name), offset)

    def id_removals(self, tid: str) -> list[int]:
        return [end for _, end in self.by_id.get(tid, ()) if end is not None]

    def name_removals(self, name: str) -> list[int]:
        return [end for _, end in self.by_name.get(name, ()) if end is not None]


class TopicInterval(NamedTuple):
    topic_id: str
    name: str
    start: int
    end: int  # -1: live at the end of the replayed range


def fold_topics(records: Iterable[tuple[int, bytes]], cuts: Sequence[int]
                ) -> tuple[list[TopicInterval], list[StateRow], int]:
    """Fold Topic/RemoveTopic in offset order; return intervals, state rows, invalid count."""
    live: dict[str, r.Topic] = {}  # id -> record
    names: dict[str, str] = {}  # name -> id
    started: dict[str, int] = {}
    intervals: list[TopicInterval] = []
    states: list[StateRow] = []
    invalid = 0

    def emit(cut: int) -> None:
        for tid, rec in live.items():
            states.append(StateRow(cut, SEC_TOPIC, tid, 0, "", "", r.encode_record(rec)))

    ci = 0
    for offset, value in sorted(records, key=lambda x: x[0]):
        ci = _emit_cuts(cuts, ci, offset, emit)
        rec = r.decode_record(value)
        if type(rec) is r.Topic:
            if rec.name in names or rec.topic_id in live:
                invalid += 1
                continue
            live[rec.topic_id] = rec
            names[rec.name] = rec.topic_id
            started[rec.topic_id] = offset
        else:
            if type(rec) is not r.RemoveTopic:
                raise InvariantViolation(f"topic fold: {type(rec).__name__} is not RemoveTopic")
            old = live.pop(rec.topic_id, None)
            if old is None:
                invalid += 1
                continue
            del names[old.name]
            intervals.append(TopicInterval(rec.topic_id, old.name, started.pop(rec.topic_id), offset))
    _emit_cuts(cuts, ci, 1 << 62, emit)
    for tid, rec in live.items():
        intervals.append(TopicInterval(tid, rec.name, started[tid], -1))
    return intervals, states, invalid


def topic_table(intervals: Iterable[TopicInterval]) -> TopicTable:
    t = TopicTable()
    for iv in intervals:
        t.add(iv.topic_id, iv.name, iv.start, None if iv.end < 0 else iv.end)
    return t.finish()


# ------------------------------------------------------------------ brokers


class BrokerChange(NamedTuple):
    broker_id: int
    offset: int
    registered: bool
    fenced: bool
    is_fence: bool  # this change is a valid FenceBroker (a partition event)


@dataclass
class BrokerTable:
    """Per broker: change offsets (sorted) and the status after each."""

    offsets: dict[int, list[int]] = field(default_factory=dict)
    status: dict[int, list[tuple[bool, bool]]] = field(default_factory=dict)
    fences: dict[int, list[int]] = field(default_factory=dict)

    def usable(self, bid: int, offset: int) -> bool:
        """Registered and unfenced after applying every record <= offset."""
        offs = self.offsets.get(bid)
        if not offs:
            return False
        i = bisect.bisect_right(offs, offset) - 1
        if i < 0:
            return False
        registered, fenced = self.status[bid][i]
        return registered and not fenced


def broker_table(changes: Iterable[BrokerChange]) -> BrokerTable:
    t = BrokerTable()
    for c in sorted(changes, key=lambda c: (c.broker_id, c.offset)):
        t.offsets.setdefault(c.broker_id, []).append(c.offset)
        t.status.setdefault(c.broker_id, []).append((c.registered, c.fenced))
        if c.is_fence:
            t.fences.setdefault(c.broker_id, []).append(c.offset)
    return t


def fold_broker(records: Iterable[tuple[int, bytes]], cuts: Sequence[int]
                ) -> tuple[list[BrokerChange], list[StateRow], int]:
    cur: r.RegisterBroker | None = None
    changes: list[BrokerChange] = []
    states: list[StateRow] = []
    invalid = 0

    def emit(cut: int) -> None:
        if cur is not None:
            states.append(StateRow(cut, SEC_BROKER, "", cur.broker_id, "", "", r.encode_record(cur)))

    ci = 0
    for offset, value in sorted(records, key=lambda x: x[0]):
        ci = _emit_cuts(cuts, ci, offset, emit)
        rec = r.decode_record(value)
        t = type(rec)
        is_fence = False
        if t is r.RegisterBroker:
            if cur is not None and cur.broker_epoch > rec.broker_epoch:
                invalid += 1
                continue
            cur = rec
            bid = rec.broker_id
        elif t is r.UnregisterBroker:
            if cur is None or cur.broker_epoch != rec.broker_epoch:
                invalid += 1
                continue
            bid = cur.broker_id
            cur = None
        elif t is r.BrokerRegistrationChange:
            # Kafka's fence/unfence: partitions change by their own PartitionChange records.
            if (cur is None or cur.broker_epoch != rec.broker_epoch or rec.fenced not in (-1, 0, 1)
                    or rec.in_controlled_shutdown not in (0, 1)):
                invalid += 1
                continue
            if rec.fenced:
                cur = _replace(cur, fenced=rec.fenced == 1)
            bid = rec.broker_id
        else:
            if t not in (r.FenceBroker, r.UnfenceBroker, r.FenceBrokerImplicit):
                raise InvariantViolation(f"broker fold: {t.__name__} is not a fence record")
            if cur is None or cur.broker_epoch != rec.epoch:
                invalid += 1
                continue
            cur = _replace(cur, fenced=t is not r.UnfenceBroker)
            bid = rec.id
            # Only an old log's implicit fence changes partitions by itself; Kafka's
            # FenceBroker comes with explicit PartitionChange records.
            is_fence = t is r.FenceBrokerImplicit
        changes.append(BrokerChange(bid, offset, cur is not None,
                                    cur is not None and cur.fenced, is_fence))
    _emit_cuts(cuts, ci, 1 << 62, emit)
    return changes, states, invalid


# ------------------------------------------------------------------ partitions

def fold_partition(key: str, records: Iterable[tuple[int, bytes]], cuts: Sequence[int],
                   topics: TopicTable, brokers: BrokerTable) -> tuple[list[StateRow], int]:
    """The partition's records merged, in offset order, with its topic's removals and
    the fences that touch it. Fences are merged lazily: between two events only a
    fence of a broker in the current ISR or the leader can change the partition, so
    for those few brokers the next fence is found by bisection in the broker table
    instead of offering every fence of every replica (most of a large log's
    fences) to every partition. Every offset holds one record, so no two events
    share an offset."""
    tid, _, pid_text = key.partition(_SEP)
    pid = int(pid_text)
    limit = cuts[-1] if cuts else 1 << 62
    decode = r.decode_record
    # Records first, then removals, at distinct offsets: (offset, record or None = removal).
    # key_of keys a PartitionChange by its first bytes: one that does not decode is invalid here.
    events = []
    undecodable = 0
    for offset, value in records:
        try:
            events.append((offset, decode(value)))
        except r.MetadataRecordError:
            undecodable += 1
    events.extend((o, None) for o in topics.id_removals(tid) if o < limit)
    events.sort(key=lambda e: e[0])
    fences = brokers.fences
    bisect_right = bisect.bisect_right
    usable = brokers.usable
    Partition, PartitionChange = r.Partition, r.PartitionChange

    cur: r.Partition | None = None
    states: list[StateRow] = []
    invalid = undecodable

    def emit(cut: int) -> None:
        if cur is not None:
            states.append(StateRow(cut, SEC_PARTITION, tid, pid, "", "", r.encode_record(cur)))

    ci = 0
    pos = -1  # every event at or below pos is applied
    # The next fence that touches cur: among the brokers in its ISR and its
    # leader, the smallest fence offset above pos. nxt[bid] indexes bid's fence
    # list at or just below that point (corrected forward lazily: pos only
    # grows), so a record that leaves the candidates alone costs no bisection.
    # A valid partition's leader is in its ISR or NO_LEADER (_partition_problem,
    # and a fence keeps it so), so the brokers in the ISR are all the candidates.
    nxt: dict[int, int] = {}
    nxt_at: dict[int, int] = {}  # bid -> fences[bid][nxt[bid]] (or never)
    never = 1 << 63
    next_at, next_bid = never, -1

    def refresh() -> None:
        """Recompute (next_at, next_bid) for the current cur and pos."""
        nonlocal next_at, next_bid
        best, best_bid = never, -1
        if cur is not None:
            for bid in cur.isr:
                at = nxt_at.get(bid)
                if at is None or at <= pos:
                    fl = fences.get(bid)
                    if fl is None:
                        nxt_at[bid] = never
                        continue
                    i = nxt[bid] = bisect_right(fl, pos, nxt.get(bid, 0))
                    at = nxt_at[bid] = fl[i] if i < len(fl) else never
                if at < best:
                    best, best_bid = at, bid
        next_at, next_bid = best, best_bid

    def fences_before(upto: int) -> None:
        """Apply, in offset order, the fences in (pos, upto) that touch cur. A fence
        only shrinks the ISR or moves the leader into it, so after each one the
        next is looked up among the (fewer) brokers it still touches."""
        nonlocal ci, pos, cur
        while next_at < upto:
            at, bid = next_at, next_bid
            if ci < n_cuts and cuts[ci] <= at:
                ci = _emit_cuts(cuts, ci, at, emit)
            # controller.py's FenceBroker expansion for this partition (bid is in its ISR).
            old_isr = cur.isr
            isr = tuple([x for x in old_isr if x != bid]) or old_isr
            leader = old_leader = cur.leader
            if leader == bid:
                leader = r.NO_LEADER
                for x in cur.replicas:
                    if x in isr and usable(x, at):
                        leader = x
                        break
            if isr != old_isr or leader != old_leader:
                cur = _replace(cur, isr=isr, leader=leader,
                               leader_epoch=cur.leader_epoch + (leader != old_leader),
                               partition_epoch=cur.partition_epoch + 1)
            i = nxt[bid] = nxt[bid] + 1
            fl = fences[bid]
            nxt_at[bid] = fl[i] if i < len(fl) else never
            pos = at
            refresh()

    n_cuts = len(cuts)
    for offset, rec in events:
        if next_at < offset:
            fences_before(min(offset, limit))
        if ci < n_cuts and cuts[ci] <= offset:
            ci = _emit_cuts(cuts, ci, offset, emit)
        pos = offset
        if rec is None:  # the topic was removed
            cur = None
            next_at = never
        elif type(rec) is Partition:
            if not topics.id_live(tid, offset) or _partition_problem(rec):
                invalid += 1
                continue
            cur = rec
            refresh()
        else:
            if type(rec) is not PartitionChange:
                raise InvariantViolation(f"partition fold: {type(rec).__name__} is not PartitionChange")
            if cur is None:
                invalid += 1
                continue
            leader = cur.leader if rec.leader == r.LEADER_NO_CHANGE else rec.leader
            new = _replace(
                cur,
                isr=cur.isr if rec.isr is None else tuple(rec.isr),
                replicas=cur.replicas if rec.replicas is None else tuple(rec.replicas),
                leader=leader,
                leader_epoch=cur.leader_epoch + (leader != cur.leader),
                partition_epoch=cur.partition_epoch + 1)
            if _partition_problem(new):
                invalid += 1
                continue
            cur = new
            refresh()
    fences_before(limit)
    _emit_cuts(cuts, ci, 1 << 62, emit)
    return states, invalid


# ------------------------------------------------------------------ configs, features

# Event kinds in a config's merged stream (a record and its topic's removals).
_EV_RECORD, _EV_REMOVE = 0, 1


def fold_config(key: str, records: Iterable[tuple], cuts: Sequence[int],
                topics: TopicTable) -> tuple[list[StateRow], int]:
    rt_text, rname, name = key.split(_SEP, 2)
    rtype = int(rt_text)
    limit = cuts[-1] if cuts else 1 << 62
    # Last write wins: a record's bytes are decoded only when a cut takes
    # them (key_of decoded every one already, so none here can fail), not
    # once per record: a config-heavy log (Kafka's IncrementalAlterConfigs)
    # spent a decode per record here for nothing.
    # A record is (offset, value) or (offset, value, n): the last of a run of
    # n writes the Combiner kept, whose validity is the run's (see Combiner).
    events: list[tuple[int, int, bytes | None, int]] = [
        (rec[0], _EV_RECORD, rec[1], rec[2] if len(rec) > 2 else 1) for rec in records]  # type: ignore[misc]
    if rtype == r.RESOURCE_TOPIC:
        events.extend((o, _EV_REMOVE, None, 0) for o in topics.name_removals(rname) if o < limit)
    events.sort(key=lambda e: (e[0], e[1]))
    last: bytes | None = None  # the bytes of the record in force, None when removed
    states: list[StateRow] = []
    invalid = 0

    def emit(cut: int) -> None:
        value = None if last is None else r.decode_record(last).value  # type: ignore[union-attr]
        if value is not None:
            states.append(StateRow(cut, SEC_CONFIG, "", rtype, rname, name,
                                   r.encode_record(r.Config(rtype, rname, name, value))))

    ci = 0
    for offset, kind, rec, n in events:
        ci = _emit_cuts(cuts, ci, offset, emit)
        if kind == _EV_REMOVE:
            last = None
            continue
        if rtype == r.RESOURCE_TOPIC:
            if not topics.name_live(rname, offset):
                invalid += n
                continue
        elif rtype != r.RESOURCE_BROKER:
            invalid += n
            continue
        last = rec
    _emit_cuts(cuts, ci, 1 << 62, emit)
    return states, invalid


def fold_feature(key: str, records: Iterable[tuple[int, bytes]], cuts: Sequence[int]
                 ) -> tuple[list[StateRow], int]:
    level = 0
    states: list[StateRow] = []
    invalid = 0

    def emit(cut: int) -> None:
        if level:
            states.append(StateRow(cut, SEC_FEATURE, key, 0, "", "",
                                   r.encode_record(r.FeatureLevel(key, level))))

    ci = 0
    for offset, value in sorted(records, key=lambda x: x[0]):
        ci = _emit_cuts(cuts, ci, offset, emit)
        rec = r.decode_record(value)
        if rec.feature_level < 0 or (key == r.METADATA_VERSION
                                     and rec.feature_level < r.METADATA_VERSION_LEVEL_MIN):
            invalid += 1
            continue
        level = rec.feature_level
    _emit_cuts(cuts, ci, 1 << 62, emit)
    return states, invalid


def fold_producer_ids(records: Iterable[tuple[int, bytes]], cuts: Sequence[int]
                      ) -> tuple[list[StateRow], int, int]:
    """Kafka's ProducerIdsRecords, as the controller replays them
    (broker.controller.producer_blocks): the next producer id only moves
    forward. (states, invalid, valid): the valid ones are also counted by
    type, as the controller's unknown_records counts them."""
    next_id = 0
    states: list[StateRow] = []
    invalid = 0

    def emit(cut: int) -> None:
        if next_id > 0:
            states.append(StateRow(cut, SEC_PRODUCER_IDS, "", 0, "", "",
                                   r.encode_record(producer_blocks.record(-1, -1, next_id))))

    ci = 0
    recs = sorted(records, key=lambda x: x[0])
    for offset, value in recs:
        ci = _emit_cuts(cuts, ci, offset, emit)
        rec = r.decode_record(value)
        try:
            _broker, _epoch, candidate = producer_blocks.decode(rec.raw)
        except ValueError:
            invalid += 1
            continue
        if candidate <= next_id:
            invalid += 1
            continue
        next_id = candidate
    _emit_cuts(cuts, ci, 1 << 62, emit)
    return states, invalid, len(recs) - invalid


def fold_acl(key: str, records: Iterable[tuple[int, bytes]], cuts: Sequence[int]
             ) -> tuple[list[StateRow], int]:
    """One ACL id: controller.py's AccessControlEntry / RemoveAccessControlEntry rules."""
    live: bytes | None = None  # the encoded entry while it exists
    states: list[StateRow] = []
    invalid = 0

    def emit(cut: int) -> None:
        if live is not None:
            states.append(StateRow(cut, SEC_ACL, key, 0, "", "", live))

    ci = 0
    for offset, value in sorted(records, key=lambda x: x[0]):
        ci = _emit_cuts(cuts, ci, offset, emit)
        rec = r.decode_record(value)
        if type(rec) is r.AccessControlEntry:
            if live is not None or acl_problem(rec):
                invalid += 1
                continue
            live = r.encode_record(rec)
        elif live is None:
            invalid += 1
        else:
            live = None
    _emit_cuts(cuts, ci, 1 << 62, emit)
    return states, invalid


# ------------------------------------------------------------------ assembling


def sort_key(row: StateRow) -> tuple:
    return (row.sec, row.s1, row.n1, row.s2, row.s3)


def state_from_rows(rows: Iterable[StateRow], offset: int) -> tuple[ControllerState, int]:
    """Rebuild a ControllerState as a broker loading the snapshot would (rows
    sorted in to_records() order); returns (state, records the load rejected)."""
    st = ControllerState.from_records(
        (r.decode_record(row.value) for row in sorted(rows, key=sort_key)), offset)
    return st, st.invalid_records


def replay_sequential(records: Iterable[tuple], cuts: Sequence[int], combine: bool = False
                      ) -> tuple[dict[int, list[StateRow]], int]:
    """The distributed plan with a dict for the shuffle: records (offset, value)
    or (offset, value, file) of the committed prefix, data records only, in
    each file's order. With combine the Combiner keys them as the Spark job
    does. Returns state rows per cut and the invalid record count."""
    cuts = sorted(set(cuts))
    groups: dict[tuple[str, str], list[tuple]] = {}
    combiner = Combiner(cuts, combine)
    keyed: list[KeyedRow] = []
    for rec in itertools.chain(seed_records(), records):
        if rec[0] < cuts[-1]:
            keyed.extend(combiner.feed(rec[0], rec[1], rec[2] if len(rec) > 2 else ""))
    keyed.extend(combiner.flush())
    for row in sorted(keyed, key=lambda k: k.offset):  # the shuffle's sort: offset order per key
        groups.setdefault((row.kind, row.key), []).append(
            (row.offset, row.value, row.n) if row.kind == K_CONFIG else (row.offset, row.value))
    rows: list[StateRow] = []
    invalid = sum(len(v) for (k, _), v in groups.items() if k == K_INVALID)
    intervals, st, inv = fold_topics(groups.get((K_TOPICS, ""), []), cuts)
    rows += st
    invalid += inv
    changes: list[BrokerChange] = []
    for (kind, key), recs in groups.items():
        if kind == K_BROKER:
            ch, st, inv = fold_broker(recs, cuts)
            changes += ch
            rows += st
            invalid += inv
    topics, brokers = topic_table(intervals), broker_table(changes)
    for (kind, key), recs in groups.items():
        if kind == K_PARTITION:
            st, inv = fold_partition(key, recs, cuts, topics, brokers)
        elif kind == K_CONFIG:
            st, inv = fold_config(key, recs, cuts, topics)
        elif kind == K_FEATURE:
            st, inv = fold_feature(key, recs, cuts)
        elif kind == K_ACL:
            st, inv = fold_acl(key, recs, cuts)
        elif kind == K_PRODUCER_IDS:
            st, inv, _valid = fold_producer_ids(recs, cuts)
        else:
            continue
        rows += st
        invalid += inv
    by_cut: dict[int, list[StateRow]] = {c: [] for c in cuts}
    for row in rows:
        by_cut[row.cut].append(row)
    return by_cut, invalid


def iter_sorted(rows: Iterable[StateRow]) -> Iterator[StateRow]:
    return iter(sorted(rows, key=sort_key))
