"""PartitionRecords read as columns: the snapshot loader's and replay's fast path.

A 2M-partition controller snapshot is 2M PartitionRecords in a row, nearly
all of one shape: the same replica and ISR counts, no reassignment, no
directories, no tagged fields. Inside one batch such records have the same
length for every index whose offset-delta varint has the same width, so a
run of them is an array of fixed-size rows. numpy reads that array in place
(np.frombuffer on a structured dtype), compares every byte that must be
constant -- record length, attributes, timestamp delta, offset delta = its
index, null key, value length, frame, api key, version, array lengths, empty
removing/adding lists, no tags, no headers -- in a few vector operations, and
hands the controller columns (iter_batch). The general path parses a record
frame and a record body in Python for each partition: about 4 us each, 8 s
at 2M partitions.

A log holds shorter runs: a topic's creation is its TopicRecord and then its
partitions, a few dozen to a few hundred. read_batch finds a batch's record
boundaries with one Python pass over their lengths and reads every record of
the batch's partition shape as columns at once, so the numpy calls are paid
once per batch, not once per run.

Anything else -- another record type, another shape, a tagged field, one
mismatching byte -- is read by the general parser (metalog.storage.batch), and the
record decoder (metalog.storage.metadata_records) says what is wrong with it, exactly
as without this module: the items returned here are the batch's records in
order, some as values and some as rows, never a different reading of the
same bytes (tests/snapshot/test_partition_runs.py,
tests/controller/test_column_replay.py).
"""

from __future__ import annotations

from typing import Iterator, NamedTuple, Sequence

import numpy as np

from metalog.storage import batch as b
from metalog.protocol.invariants import InvariantViolation, invariant
from metalog.storage.metadata_records import uuid_text

PARTITION_RECORD_PREFIX = b"\x01\x03\x00"  # frame version 1, api key 3 (PartitionRecord), version 0
MAX_ARRAY = 16  # longer replica lists take the general path (a compact-array length of one byte)
# A run costs a fixed ~0.3 ms of numpy calls, the general path ~4 us a record:
# shorter runs (a topic's creation of a few dozen partitions) are read record
# by record. Whether a record starts a run is guessed from it and the record
# MIN_RUN_ROWS - 1 rows further (cheap), then checked for that many rows, then
# for the rest of the width region.
MIN_RUN_ROWS = 256
RETRY_AFTER_RECORDS = 8  # after a guess that failed, records read one by one before the next


class PartitionRun:
    """`count` consecutive PartitionRecords v0 of one shape, as columns."""

    __slots__ = ("first_index", "topic_names", "topic_index", "partition_ids", "replicas", "isr",
                 "leaders", "leader_epochs", "partition_epochs", "_topic_ids")

    def __init__(self, first_index: int, topic_names: list[str], topic_index: np.ndarray,
                 partition_ids: np.ndarray, replicas: np.ndarray, isr: np.ndarray, leaders: np.ndarray,
                 leader_epochs: np.ndarray, partition_epochs: np.ndarray) -> None:
        self.first_index = first_index  # of the first record in its batch
        self.topic_names = topic_names  # the distinct topic ids (uuid text) of the run
        self.topic_index = topic_index  # (count,): the row's topic id is topic_names[topic_index[row]]
        # int32 columns, big-endian views of the batch's bytes where one
        # width region holds the run
        self.partition_ids = partition_ids  # (count,)
        self.replicas = replicas  # (count, n)
        self.isr = isr  # (count, m)
        self.leaders = leaders  # (count,)
        self.leader_epochs = leader_epochs
        self.partition_epochs = partition_epochs
        self._topic_ids: list[str] | None = None

    @property
    def count(self) -> int:
        return len(self.partition_ids)

    @property
    def topic_ids(self) -> list[str]:
        """The topic id of each row (one shared str per topic); built when
        first asked for: a snapshot's load needs only the distinct ones."""
        if self._topic_ids is None:
            self._topic_ids = list(map(self.topic_names.__getitem__, self.topic_index.tolist()))
        return self._topic_ids


def _zz(n: int) -> bytes:
    return b._vi(n)


def _shape(data: bytes, pos: int, index: int) -> tuple[int, int] | None:
    """(replica count, ISR count) if the record at `pos` looks like a
    common-shape PartitionRecord at `index` (checked whole by the run)."""
    try:
        ln = data[pos]
        p = pos + (1 if ln < 0x80 else 2)
        mid = b.data_mid(index)
        if data[p:p + len(mid)] != mid:
            return None
        p += len(mid)
        p += 1 if data[p] < 0x80 else 2  # value length
        if data[p:p + 3] != PARTITION_RECORD_PREFIX:
            return None
        n = data[p + 23] - 1
        if not 0 < n <= MAX_ARRAY:
            return None
        m = data[p + 24 + 4 * n] - 1
        return (n, m) if 0 < m <= MAX_ARRAY else None
    except IndexError:
        return None


def _region_end(index: int) -> int:
    """First index whose offset-delta varint is wider than index's."""
    z = 2 * index
    width = 1
    while z >= 0x80:
        z >>= 7
        width += 1
    return 1 << (7 * width - 1)


class _Layout(NamedTuple):
    dtype: np.dtype  # a record as fields (the ones read, and the constant bytes around them)
    constant_at: np.ndarray  # where a record's constant bytes are (offset delta excluded)
    constant: np.ndarray  # (len(constant_at),) uint8: their values
    od_at: int  # where the offset-delta varint starts (the bytes that vary with the index)
    od_width: int


_layouts: dict[tuple[int, int, int], _Layout] = {}


def _layout(n: int, m: int, od_width: int) -> _Layout:
    key = (n, m, od_width)
    got = _layouts.get(key)
    if got is None:
        value_len = 40 + 4 * (n + m)
        vl = _zz(value_len)
        body = 2 + od_width + 1 + len(vl) + value_len + 1
        head = _zz(body) + b"\x00\x00"  # record length, attributes, timestamp delta
        mid = b"\x01" + vl + PARTITION_RECORD_PREFIX  # null key, value length, frame
        dtype = np.dtype([
            ("head", "u1", (len(head),)), ("od", "u1", (od_width,)), ("mid", "u1", (len(mid),)),
            ("pid", ">i4"), ("tid", "V16"), ("nb", "u1"), ("reps", ">i4", (n,)),
            ("mb", "u1"), ("isr", ">i4", (m,)), ("ra", "u1", (2,)), ("lil", ">i4", (3,)),
            ("tail", "u1", (2,)),  # no tagged fields, no headers
        ])
        invariant(dtype.itemsize == len(head) - 2 + body, "layout %r of a %d-byte body", dtype, body)
        fields = dtype.fields
        if fields is None:
            raise InvariantViolation("a structured dtype has fields")
        at: list[int] = []
        constant: list[int] = []
        for name, value in (("head", head), ("mid", mid), ("nb", bytes([n + 1])), ("mb", bytes([m + 1])),
                            ("ra", b"\x01\x01"), ("tail", b"\x00\x00")):
            start = fields[name][1]
            at += range(start, start + len(value))
            constant += value
        got = _layouts[key] = _Layout(dtype, np.asarray(at, np.intp), np.asarray(constant, np.uint8),
                                      fields["od"][1], od_width)
    return got


def _good_rows(raw: np.ndarray, lay: _Layout, first: int) -> int:
    """How many leading rows of `raw` (the records at first, first + 1, ...)
    hold exactly the expected framing."""
    ok = _framing_ok(raw, lay, np.arange(first, first + len(raw), dtype=np.int64))
    return len(raw) if ok.all() else int(np.argmin(ok))


def distinct_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct rows of the 2-D integer array `a`, sorted; for each row
    of `a` the index of its distinct row). np.unique(axis=0) and unique on a
    void view sort bytes through a generic comparison (~1 us a row); a
    lexsort of integer columns is an order of magnitude cheaper."""
    k = len(a)
    if k == 0:
        return a, np.empty(0, np.int64)
    order = np.lexsort(a.T[::-1])
    s = a[order]
    new = np.empty(k, bool)
    new[0] = True
    np.any(s[1:] != s[:-1], axis=1, out=new[1:])
    inverse = np.empty(k, np.int64)
    inverse[order] = np.cumsum(new) - 1
    return s[new], inverse


class TopicNames:
    """Raw 16-byte topic ids to their text, one shared str per topic."""

    MAX = 1 << 20  # a broker keeps one for its life: cleared when full (topics come and go)

    def __init__(self) -> None:
        self._text: dict[bytes, str] = {}

    def column(self, raw: np.ndarray) -> tuple[list[str], np.ndarray]:
        """(distinct texts, row -> index into them) of a column of raw ids.
        Rows of one topic usually come together (a snapshot writes topic by
        topic, a creation its partitions in a row), so the rows are cut where
        the id changes and only each stretch's first row is read."""
        ids = np.ascontiguousarray(raw).view("<u8").reshape(-1, 2)
        k = len(ids)
        if k == 0:
            return [], np.empty(0, np.int64)
        new = np.empty(k, bool)
        new[0] = True
        np.any(ids[1:] != ids[:-1], axis=1, out=new[1:])
        starts = np.flatnonzero(new)
        if len(self._text) + len(starts) > self.MAX:
            self._text.clear()
        at: dict[str, int] = {}  # text -> index into names
        names: list[str] = []
        stretch = []  # per stretch: index into names
        raw_u1 = ids.view(np.uint8).reshape(k, 16)
        for row in starts.tolist():
            x = raw_u1[row].tobytes()
            s = self._text.get(x)
            if s is None:
                s = self._text[x] = uuid_text(x)
            i = at.get(s)
            if i is None:
                i = at[s] = len(names)
                names.append(s)
            stretch.append(i)
        lengths = np.diff(np.append(starts, k))
        return names, np.repeat(np.asarray(stretch, np.int64), lengths)


def _run(data: bytes, pos: int, index: int, count: int, n: int, m: int,
         names: TopicNames) -> tuple[PartitionRun | None, int, int]:
    """The longest run from `index`, across offset-delta width regions (a
    batch of 15,000 partitions is one run, not three): (run or None, bytes
    taken, index of the next attempt if None). Its start is guessed from two
    records before any numpy call."""
    parts: list[np.ndarray] = []  # the run's rows, one structured array per width region
    i, p = index, pos
    while i < count:
        region_end = min(_region_end(i), count)
        lay = _layout(n, m, len(_zz(i)))
        size = lay.dtype.itemsize
        rows = min(region_end - i, (len(data) - p) // size)
        if parts:
            if not rows or _shape(data, p, i) != (n, m):
                break
            good = _good_rows(np.frombuffer(data, np.uint8, count=rows * size, offset=p).reshape(rows, size),
                              lay, i)
        else:
            # A start: MIN_RUN_ROWS rows, or the rest of a short region (the
            # 64 records of offset-delta width 1) if the batch goes on after it.
            need = min(MIN_RUN_ROWS, region_end - i)
            if rows < need or (need < MIN_RUN_ROWS and region_end == count):
                return None, 0, region_end  # nothing to try before the next width
            if _shape(data, p + (need - 1) * size, i + need - 1) != (n, m):
                return None, 0, i + RETRY_AFTER_RECORDS
            raw = np.frombuffer(data, np.uint8, count=rows * size, offset=p).reshape(rows, size)
            good = _good_rows(raw[:need], lay, i)
            if good < need:
                return None, 0, i + RETRY_AFTER_RECORDS
            if rows > need:
                good += _good_rows(raw[need:], lay, i + need)
        if good:
            parts.append(np.frombuffer(data, lay.dtype, count=good, offset=p))
        i += good
        p += good * size
        if i < region_end:
            break  # the run ends inside this region
    if len(parts) == 1:
        a = parts[0]
        pid, tid, reps, isr, lil = a["pid"], a["tid"], a["reps"], a["isr"], a["lil"]
    else:  # the regions' dtypes differ in framing widths only
        pid, tid, reps, isr, lil = (np.concatenate([x[f] for x in parts]) for f in ("pid", "tid", "reps", "isr", "lil"))
    return PartitionRun(index, *names.column(tid), pid, reps, isr, lil[:, 0], lil[:, 1], lil[:, 2]), p - pos, 0


def iter_batch(batch: bytes, h: b.BatchHeader, names: TopicNames | None = None
               ) -> Iterator[bytes | PartitionRun]:
    """The records of one whole data batch (CRC already checked), in order:
    a value (bytes) per record, except runs of common-shape PartitionRecords,
    which come as PartitionRun. Raises CorruptBatchError as
    metalog.storage.batch.decode_records does."""
    if h.attributes & b.ATTR_CONTROL:
        raise InvariantViolation("control batches take decode_records")
    names = names or TopicNames()
    data = bytes(memoryview(batch)[b.HEADER_SIZE:h.size])
    end = len(data)
    pos = i = 0
    next_try = 0  # records before this index are read one by one
    while i < h.records_count:
        if i >= next_try:
            shape = _shape(data, pos, i)
            if shape is None:
                next_try = i + 1
            else:
                run, taken, next_try = _run(data, pos, i, h.records_count, *shape, names)
                if run is not None:
                    yield run
                    pos += taken
                    i += run.count
                    continue
        value, pos = b.next_value(data, pos, end, i, h)
        yield value
        i += 1
    if pos != end:
        raise b.CorruptBatchError("trailing bytes after the last record", b.HEADER_SIZE + pos, h.base_offset)


# ------------------------------------------------------- a batch at a time
#
# Replay meets PartitionRecords in shorter runs than a snapshot holds: a
# topic's creation writes its partitions in one batch after its TopicRecord,
# so a 1000-record batch of a log is ten topics of ninety-odd partitions. A
# run's fixed numpy cost would eat its gain; read_batch pays it once per
# batch instead: the records' boundaries are found by one Python pass over
# their length varints, every record of the batch's PartitionRecord shape is
# checked and read as columns at once, and the controller applies the rows
# between the other records.


class BatchRows(NamedTuple):
    """A data batch's records in order: `items` holds the value (bytes) of
    each record read by the general parser, and for each stretch of records
    read as partition rows their count (int); `run` holds those rows, in
    order, as one PartitionRun (None if there are none)."""

    items: Sequence[bytes | int]
    run: PartitionRun | None


def _record_starts(data: bytes, count: int) -> list[int] | None:
    """Where each record starts (and, last, where the last one ends), from
    their length varints; None if a length is not a non-negative varint of
    at most two bytes, or the records do not end at the end of `data` (the
    general parser then says what is wrong)."""
    starts = [0] * (count + 1)
    pos = 0
    end = len(data)
    try:
        for i in range(count):
            z = data[pos]
            if z < 0x80:
                pos += 1 + (z >> 1)
            else:
                z2 = data[pos + 1]
                if z2 >= 0x80:
                    return None
                z = (z & 0x7F) | (z2 << 7)
                pos += 2 + (z >> 1)
            if z & 1:
                return None  # a negative length
            starts[i + 1] = pos
    except IndexError:
        return None
    return starts if pos == end else None


def _widths(count: int) -> Iterator[tuple[int, int, int]]:
    """(offset-delta width, first index, end index) of the width regions of
    indexes 0..count-1."""
    lo, width = 0, 1
    while lo < count:
        hi = min(_region_end(lo), count)
        yield width, lo, hi
        lo, width = hi, width + 1


def read_batch(batch: bytes, h: b.BatchHeader, names: TopicNames | None = None) -> BatchRows:
    """The records of one whole data batch (CRC already checked), its
    PartitionRecords of one shape (the first one's) as columns, the rest as
    values. Raises CorruptBatchError as metalog.storage.batch.decode_records does."""
    if h.attributes & b.ATTR_CONTROL:
        raise InvariantViolation("control batches take decode_records")
    names = names or TopicNames()
    data = bytes(memoryview(batch)[b.HEADER_SIZE:h.size])
    count = h.records_count
    starts = _record_starts(data, count)
    shape = None
    if starts is not None:
        shape = next(filter(None, (_shape(data, starts[i], i) for i in range(count))), None)
    if shape is None or starts is None:
        return BatchRows(b.decode_records(batch, h), None)
    n, m = shape
    at = np.asarray(starts, np.int64)
    sizes = np.diff(at)
    arr = np.frombuffer(data, np.uint8)
    good_rows, groups = [], []
    for width, lo, hi in _widths(count):
        lay = _layout(n, m, width)
        size = lay.dtype.itemsize
        rows = np.nonzero(sizes[lo:hi] == size)[0] + lo
        if not len(rows):
            continue
        raw = arr[at[rows][:, None] + np.arange(size)]  # (rows, size): a copy, row by row
        good = _framing_ok(raw, lay, rows)
        good_rows.append(rows[good])
        groups.append(raw[good].view(lay.dtype).ravel())
    rows = np.concatenate(good_rows) if good_rows else np.empty(0, np.int64)
    if not len(rows):
        return BatchRows(b.decode_records(batch, h), None)

    def column(name: str) -> np.ndarray:  # the regions' dtypes differ in framing widths only
        return np.concatenate([g[name] for g in groups]) if len(groups) > 1 else groups[0][name]

    lil = column("lil")
    run = PartitionRun(int(rows[0]), *names.column(column("tid")), column("pid"), column("reps"),
                       column("isr"), lil[:, 0], lil[:, 1], lil[:, 2])
    items: list[bytes | int] = []
    end = len(data)
    prev = 0  # the first index not yet in items
    is_row = np.zeros(count, bool)
    is_row[rows] = True
    for i in np.nonzero(~is_row)[0].tolist():
        if i > prev:
            items.append(i - prev)
        value, pos = b.next_value(data, starts[i], end, i, h)
        if pos != starts[i + 1]:
            raise InvariantViolation(f"record {i} ends at {pos}, its length said {starts[i + 1]}")
        items.append(value)
        prev = i + 1
    if prev < count:
        items.append(count - prev)
    return BatchRows(items, run)


def _framing_ok(raw: np.ndarray, lay: _Layout, index: np.ndarray) -> np.ndarray:
    """Per row of `raw` (the record at index[row], as bytes): whether it
    holds exactly the expected framing, offset delta included. Only the
    constant bytes are read (a fifth of a row), not the whole row."""
    ok: np.ndarray = (raw[:, lay.constant_at] == lay.constant).all(axis=1)
    z = 2 * index.astype(np.int64)
    for k in range(lay.od_width):
        ok &= raw[:, lay.od_at + k] == (((z >> (7 * k)) & 0x7F) | (0x80 if k < lay.od_width - 1 else 0))
    return ok
