"""Decoding of log segments and snapshot files inside Spark executors.

``decode_file(path, content)`` turns one file's bytes (a row of Spark's
binaryFile source) into rows of one flat schema, ``DECODED_FIELDS``, told
apart by ``kind``:

* ``rec``   one record of a segment: replica, offset, epoch, control bit,
            64-bit digest of the value (for the byte-for-byte audit), value,
            batch timestamp;
* ``err``   a problem, with file, byte position, offset and epoch when known
            and the message in ``info``;
* ``file``  one per segment: JSON summary (base, end offset, epochs, counts)
            the driver uses to check continuity *across* segments;
* ``snap``  one per valid snapshot: JSON (id, cluster id, records);
* ``snaprec`` one record of a snapshot with its entity sort key (for the
            distributed comparison with the rebuilt state);
* ``meta``  the text of a small file (meta.properties, log-start-offset,
            quorum-state);
* ``krec``  (the fused path only, ``Fused``) a data record already keyed and
            combined for the replay: offset, value, fold kind in ``s1``, key
            in ``s2``, the records it stands for in ``n1``; control records
            stay ``rec`` rows;
* ``mark``  (fused path) the epoch and batch timestamp of the record at one
            offset: each ``Fused.marks`` offset and each segment's last record
            (what the checkpoint's name and header need at the HW).

The fused path (one clean replica, known before decoding) keys and combines
in the same pass that decodes (``fold.Combiner`` per file, cut at every
snapshot offset of the listing and a given end offset), so the rows the job
caches are the few combined ones, not one per record.

Everything is decoded with the broker's own code (metalog.storage.batch,
metalog.storage.snapshot, metalog.storage.metadata_records). Pure Python; no Spark import,
so it is testable alone and cheap to ship to executors.
"""

from __future__ import annotations

import hashlib
import json
import re
from bisect import bisect_left
from itertools import repeat
from typing import Iterator, NamedTuple, Sequence

from metalog.protocol.invariants import InvariantViolation
from metalog.storage import batch as b
from metalog.storage import control_records as cr
from metalog.storage import metadata_records as r
from metalog.storage.snapshot import CorruptSnapshotError, parse_snapshot_filename, verify_snapshot_bytes
from metalog.tools.spark import fold

PARTITION_DIR = "__cluster_metadata-0"
SEGMENT_RE = re.compile(r"(\d{20})\.log")
META_FILES = ("meta.properties", "log-start-offset", "quorum-state")
ERRORS_PER_FILE_MAX = 50  # more are counted, not listed

# (name, arrow type name) -- spark_job builds both the Spark and Arrow schema from this.
DECODED_FIELDS = [
    ("kind", "string"), ("replica", "string"), ("file", "string"),
    ("offset", "long"), ("epoch", "int"), ("position", "long"), ("control", "bool"),
    ("digest", "long"), ("ts", "long"), ("value", "binary"), ("info", "string"),
    ("sec", "int"), ("s1", "string"), ("n1", "long"), ("s2", "string"), ("s3", "string"),
]
FIELD_NAMES = [n for n, _ in DECODED_FIELDS]


class Fused(NamedTuple):
    """How the fused decode keys and combines: ``cuts`` (sorted: every offset
    the replay may emit a state at, except the log end) bound the combined
    runs; ``marks`` (sorted) are the offsets whose epoch and timestamp the
    driver needs (each cut - 1)."""

    cuts: Sequence[int]
    marks: Sequence[int]


def split_path(path: str) -> tuple[str, str, str]:
    """(replica dir, log dir name, file name) of a file path or URI."""
    head, _, name = path.rstrip("/").rpartition("/")
    parent, _, dirname = head.rpartition("/")
    if dirname == PARTITION_DIR:
        return parent, dirname, name
    return head, dirname, name


def classify(path: str) -> str:
    """'segment', 'snapshot', 'meta', 'ignored' or 'bad' (a .log/.checkpoint
    inside the partition dir whose name is not a segment/snapshot name)."""
    _replica, dirname, name = split_path(path)
    if name in META_FILES:
        return "meta"
    if SEGMENT_RE.fullmatch(name):
        return "segment"
    if parse_snapshot_filename(name) is not None:
        return "snapshot"
    return "bad" if dirname == PARTITION_DIR else "ignored"


def digest64(value: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(value, digest_size=8).digest(), "big", signed=True)


def _row(kind: str, replica: str, file: str, **kw) -> dict:
    row = dict.fromkeys(FIELD_NAMES)
    row.update(kind=kind, replica=replica, file=file, **kw)
    return row


def decode_file(path: str, content: bytes) -> Iterator[dict]:
    replica, _dirname, name = split_path(path)
    what = classify(path)
    if what == "meta":
        yield _row("meta", replica, name, info=content.decode("utf-8", "replace"))
    elif what == "segment":
        yield from _decode_segment(replica, name, content)
    elif what == "snapshot":
        yield from _decode_snapshot(replica, name, content)
    elif what == "bad":
        yield _row("err", replica, name, position=0, info=(
            f"{name!r} is not a segment or snapshot file (expected <20-digit base offset>.log "
            "or <20-digit offset>-<10-digit epoch>.checkpoint)"))
    else:
        yield _row("ignored", replica, name, info=f"ignored {name!r}: not a metadata log file")


def decode_file_columns(path: str, content: bytes, cols: dict[str, list],
                        fused: Fused | None = None) -> Iterator[int]:
    """decode_file's rows appended straight to column lists (``cols[name]`` for
    every name of FIELD_NAMES): a segment's records go in per batch with list
    extends, no dict per record (the executors' hot loop). Yields the row count
    so far after each batch, so the caller can cut Arrow batches. With
    `fused`, a segment's data records come out keyed and combined (``krec``)."""
    replica, _dirname, name = split_path(path)
    if classify(path) != "segment":
        for row in decode_file(path, content):
            for n in FIELD_NAMES:
                cols[n].append(row[n])
        yield len(cols["kind"])
        return
    for row in _decode_segment(replica, name, content, cols, fused):
        if row is None:  # a batch of records went into cols
            yield len(cols["kind"])
            continue
        for n in FIELD_NAMES:
            cols[n].append(row[n])
    yield len(cols["kind"])


_NONE_COLS = ("info", "sec", "s1", "n1", "s2", "s3")


def _append_records(cols: dict[str, list], replica: str, name: str, h, pos: int, values: list) -> None:
    """One ``rec`` row per record of a batch, appended to the columns."""
    k = len(values)
    cols["kind"].extend(repeat("rec", k))
    cols["replica"].extend(repeat(replica, k))
    cols["file"].extend(repeat(name, k))
    cols["offset"].extend(range(h.base_offset, h.base_offset + k))
    cols["epoch"].extend(repeat(h.leader_epoch, k))
    cols["position"].extend(repeat(pos, k))
    cols["control"].extend(repeat(h.is_control, k))
    cols["digest"].extend([digest64(v) for v in values])
    cols["ts"].extend(repeat(h.max_timestamp_ms, k))
    cols["value"].extend(values)
    for col in _NONE_COLS:
        cols[col].extend(repeat(None, k))


def _append_keyed(cols: dict[str, list], replica: str, name: str, rows: list) -> None:
    """``krec`` rows (fold.KeyedRow: offset, kind, key, value, n) appended to the columns."""
    k = len(rows)
    if not k:
        return
    offsets, kinds, keys, values, weights = zip(*rows)
    cols["kind"].extend(repeat("krec", k))
    cols["replica"].extend(repeat(replica, k))
    cols["file"].extend(repeat(name, k))
    cols["offset"].extend(offsets)
    cols["control"].extend(repeat(False, k))
    cols["value"].extend(values)
    cols["s1"].extend(kinds)
    cols["s2"].extend(keys)
    cols["n1"].extend(weights)
    for col in _NONE_FOR_KEYED:
        cols[col].extend(repeat(None, k))


_NONE_FOR_KEYED = ("epoch", "position", "digest", "ts", "info", "sec", "s3")


class _FusedSegment:
    """The fused path's state over one segment: its Combiner (runs never span
    two files) and the marks it has emitted."""

    def __init__(self, fused: Fused, replica: str, name: str) -> None:
        self.fused = fused
        self.replica = replica
        self.name = name
        self.combiner = fold.Combiner(fused.cuts)
        self.marked: set[int] = set()

    def batch(self, cols: dict[str, list], h, values: list) -> Iterator[dict]:
        """Keys and combines a data batch into cols (a control batch's records
        are rows of their own already); yields the batch's mark rows."""
        end = h.base_offset + len(values)
        if values and not h.is_control:
            out: list = []
            self.combiner.feed_columns(range(h.base_offset, end), values, repeat(self.name), out)
            _append_keyed(cols, self.replica, self.name, out)
        marks = self.fused.marks
        i = bisect_left(marks, h.base_offset)
        while i < len(marks) and marks[i] < end:
            yield self._mark(marks[i], h.leader_epoch, h.max_timestamp_ms)
            i += 1

    def _mark(self, offset: int, epoch: int, ts: int) -> dict:
        self.marked.add(offset)
        return _row("mark", self.replica, self.name, offset=offset, epoch=epoch, ts=ts)

    def finish(self, cols: dict[str, list], last: tuple[int, int, int] | None) -> Iterator[dict]:
        """Flushes the open runs; the mark of the segment's last record
        (`last`: offset, epoch, batch timestamp)."""
        _append_keyed(cols, self.replica, self.name, list(self.combiner.flush()))
        if last is not None and last[0] not in self.marked:
            yield self._mark(*last)


def _decode_segment(replica: str, name: str, data: bytes, cols: dict[str, list] | None = None,
                    fused: Fused | None = None) -> Iterator[dict | None]:
    """Rows of one segment; with `cols`, the record rows are appended to those
    columns (and None yielded per batch) instead of yielded as dicts; with
    `fused` too, data records are appended keyed and combined (``krec``)."""
    fz = _FusedSegment(fused, replica, name) if fused is not None and cols is not None else None
    last: tuple[int, int, int] | None = None
    base = int(name[:20])
    view = memoryview(data)
    n = len(view)
    pos = 0
    expected = base
    first_epoch = last_epoch = -1
    batches = records = errors = 0
    digest = digest64

    def err(message: str, position: int, offset: int | None, epoch: int | None = None):
        nonlocal errors
        errors += 1
        if errors <= ERRORS_PER_FILE_MAX:
            return _row("err", replica, name, position=position, offset=offset, epoch=epoch,
                        info=message)
        return None

    # An empty segment is normal: a fresh log, a roll, or a log restarted at a snapshot.
    while pos < n:
        if n - pos < b.HEADER_SIZE:
            e = err(f"truncated batch: {n - pos} trailing byte(s), less than a header", pos, expected)
            if e:
                yield e
            break
        try:
            h = b.decode_header(view, pos)
        except b.CorruptBatchError as exc:
            # The length cannot be trusted, so the rest of the file cannot be walked.
            e = err(f"corrupt batch header: {exc}; {n - pos} byte(s) from here unreadable",
                    pos, exc.base_offset)
            if e:
                yield e
            break
        if pos + h.size > n:
            e = err(f"truncated batch: needs {h.size} bytes, {n - pos} left", pos, h.base_offset,
                    h.leader_epoch)
            if e:
                yield e
            break
        batches += 1
        if h.base_offset != expected:
            e = err(f"offsets not contiguous: batch starts at {h.base_offset}, expected {expected}",
                    pos, h.base_offset, h.leader_epoch)
            if e:
                yield e
        if h.leader_epoch < last_epoch:
            e = err(f"epoch went backwards: {h.leader_epoch} after {last_epoch}", pos,
                    h.base_offset, h.leader_epoch)
            if e:
                yield e
        if first_epoch < 0:
            first_epoch = h.leader_epoch
        last_epoch = max(last_epoch, h.leader_epoch)
        expected = h.next_offset
        try:
            b.verify_crc(view, pos, h)
            values = b.decode_records(view[pos:pos + h.size], h)
        except b.CorruptBatchError as exc:
            e = err(f"corrupt batch: {exc}", pos, h.base_offset, h.leader_epoch)
            if e:
                yield e
            pos += h.size
            continue
        ctl = h.is_control
        if values:
            last = (h.base_offset + len(values) - 1, h.leader_epoch, h.max_timestamp_ms)
        if fz is not None and not ctl:
            yield from fz.batch(cols, h, values)
            yield None
        elif cols is not None:
            _append_records(cols, replica, name, h, pos, values)
            if fz is not None:  # a control batch: its records stay rows, and it may hold a mark
                yield from fz.batch(cols, h, values)
            yield None
        else:
            for i, value in enumerate(values):
                yield _row("rec", replica, name, offset=h.base_offset + i, epoch=h.leader_epoch,
                           position=pos, control=ctl, digest=digest(value), ts=h.max_timestamp_ms,
                           value=value)
        records += len(values)
        pos += h.size
    if fz is not None:
        yield from fz.finish(cols, last)
    yield _row("file", replica, name, info=json.dumps({
        "base_offset": base, "end_offset": expected, "first_epoch": first_epoch,
        "last_epoch": last_epoch, "batches": batches, "records": records, "bytes": n,
        "errors": errors}))


def _decode_snapshot(replica: str, name: str, data: bytes) -> Iterator[dict]:
    sid = parse_snapshot_filename(name)
    if sid is None:
        raise InvariantViolation(f"{name}: not a snapshot file name")
    try:
        layout = verify_snapshot_bytes(data, sid, name)
    except CorruptSnapshotError as exc:
        yield _row("err", replica, name, position=exc.position, offset=sid.end_offset,
                   epoch=sid.epoch, info=f"corrupt snapshot: {exc.reason}")
        return
    view = memoryview(data)
    count = 0
    for pos, h in layout.data_batches:
        for value in b.decode_records(view[pos:pos + h.size], h):
            value = canonical_value(bytes(value))
            sec, s1, n1, s2, s3 = entity_key(value)
            if sec == fold.SEC_UNMODELLED:
                n1 = count  # one row per record: they are counted, not compared
            yield _row("snaprec", replica, name, offset=sid.end_offset, epoch=sid.epoch, position=count,
                       value=value, sec=sec, s1=s1, n1=n1, s2=s2, s3=s3)
            count += 1
    yield _row("snap", replica, name, offset=sid.end_offset, epoch=sid.epoch, info=json.dumps({
        "end_offset": sid.end_offset, "epoch": sid.epoch, "cluster_id": layout.header.cluster_id,
        "records": count, "bytes": len(data),
        # KIP-853: the voter set it carries (Kafka's VotersRecord, hex), for the job's own checkpoint.
        "voters": cr.encode_control(layout.voters).hex() if layout.voters is not None else None}))


def canonical_value(value: bytes) -> bytes:
    """A snapshot record as this build encodes it (version 0 of its type), so
    that a snapshot Kafka wrote at later record versions compares equal, entity
    by entity, to the rebuilt state; unknown types and undecodable bytes as they are."""
    try:
        rec = r.decode_record(value)
    except r.MetadataRecordError:
        return value
    return value if type(rec) is r.UnknownRecord else r.encode_record(rec)


def entity_key(value: bytes) -> tuple[int, str, int, str, str]:
    """Sort key (section, s1, n1, s2, s3) of a state record, as fold.StateRow;
    a Kafka type we do not model is (SEC_UNMODELLED, its name, ...)."""
    try:
        rec = r.decode_record(value)
    except r.MetadataRecordError:
        unread = fold.unread_version(value)  # a newer version of a type we model: listed, not compared
        return (fold.SEC_UNMODELLED, unread, 0, "", "") if unread is not None else (-1, "", 0, "", "")
    t = type(rec)
    if t is r.UnknownRecord:
        return fold.SEC_UNMODELLED, r.type_name(rec), 0, "", ""
    if t is r.FeatureLevel:
        return fold.SEC_FEATURE, rec.name, 0, "", ""
    if t is r.RegisterBroker:
        return fold.SEC_BROKER, "", rec.broker_id, "", ""
    if t is r.Topic:
        return fold.SEC_TOPIC, rec.topic_id, 0, "", ""
    if t is r.Partition:
        return fold.SEC_PARTITION, rec.topic_id, rec.partition_id, "", ""
    if t is r.Config:
        return fold.SEC_CONFIG, "", rec.resource_type, rec.resource_name, rec.name
    if t is r.AccessControlEntry:
        return fold.SEC_ACL, rec.id, 0, "", ""
    return -1, type(rec).__name__, 0, "", ""
