"""What Kafka's DumpLogSegments printed, as data.

DumpLogSegments (``--deep-iteration``, with ``--cluster-metadata-decoder`` or
``--print-data-log``) prints, per file::

    Dumping <path>
    Log starting offset: <n>                        (a segment)
    Snapshot end offset: <n>, epoch: <e>            (a .checkpoint)
    baseOffset: 0 lastOffset: 0 count: 1 baseSequence: -1 ... isvalid: true
    | offset: 0 CreateTime: ... headerKeys: [] LeaderChange: {...}
    | offset: 1 CreateTime: ... headerKeys: [] payload: {"type":"TOPIC_RECORD",...}
    Found <n> invalid bytes at the end of <name>    (bytes past the last whole batch)
    offset: <last offset> position: <n>             (an .index entry)
    timestamp: <ms> offset: <n>                     (a .timeindex entry)

``parse_dump`` keeps every batch field and, per record, the control record
Kafka decoded (its JSON), the metadata record (type, version, data) or the
payload text, and the "Error at <offset>, skipping." line of a value the
metadata decoder refused. A line it cannot place is kept in ``unparsed``, so
a caller can insist there is none: nothing Kafka says is dropped here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_BATCH = re.compile(
    r"^baseOffset: (?P<base>-?\d+) lastOffset: (?P<last>-?\d+) count: (?P<count>\S+) "
    r"baseSequence: (?P<base_seq>-?\d+) lastSequence: (?P<last_seq>-?\d+) producerId: (?P<pid>-?\d+) "
    r"producerEpoch: (?P<pepoch>-?\d+) partitionLeaderEpoch: (?P<epoch>-?\d+) "
    r"isTransactional: (?P<txn>true|false) isControl: (?P<control>true|false) deleteHorizonMs: \S+ "
    r"position: (?P<position>\d+) \w+: (?P<max_ts>-?\d+) size: (?P<size>\d+) magic: (?P<magic>\d+) "
    r"compresscodec: (?P<codec>\S+) crc: (?P<crc>\d+) isvalid: (?P<valid>true|false)$")
_RECORD = re.compile(
    r"^\| offset: (?P<offset>-?\d+) \w+: (?P<ts>-?\d+) keySize: (?P<key_size>-?\d+) "
    r"valueSize: (?P<value_size>-?\d+) sequence: (?P<seq>-?\d+) headerKeys: \[(?P<headers>[^\]]*)\]"
    r"(?P<rest>.*)$")
# What printControlRecord prints after the record's fields.
_CONTROL = re.compile(r"^ (?P<kind>LeaderChange:|SnapshotHeader|SnapshotFooter|KRaftVersion|KRaftVoters"
                      r"|endTxnMarker:|controlType:) (?P<body>.*)$")
_METADATA_ERROR = re.compile(r"^Error at (?P<offset>-?\d+), skipping\. (?P<message>.*)$")
_INDEX_ENTRY = re.compile(r"^offset: (?P<offset>-?\d+) position: (?P<position>\d+)$")
_TIME_INDEX_ENTRY = re.compile(r"^timestamp: (?P<ts>-?\d+) offset: (?P<offset>-?\d+)$")
_TRAILING = re.compile(r"^Found (?P<n>\d+) invalid bytes at the end of (?P<name>.+)$")


@dataclass
class DumpedRecord:
    offset: int
    key_size: int
    value_size: int
    sequence: int
    control: str | None = None  # Kafka's word for a control record: LeaderChange, KRaftVoters, ...
    control_data: Any = None  # its JSON as Kafka printed it
    metadata: dict[str, Any] | None = None  # {"type": "TOPIC_RECORD", "version": 0, "data": {...}}
    payload: str | None = None  # the value as text (no metadata decoder)
    error: str | None = None  # the metadata decoder's "Error at ..., skipping." message


@dataclass
class DumpedBatch:
    base_offset: int
    last_offset: int
    count: int | None
    base_sequence: int
    last_sequence: int
    producer_id: int
    producer_epoch: int
    leader_epoch: int
    is_transactional: bool
    is_control: bool
    position: int
    max_timestamp_ms: int
    size_bytes: int
    magic: int
    compression: str
    crc: int
    valid: bool
    records: list[DumpedRecord] = field(default_factory=list)


@dataclass
class DumpedFile:
    path: str
    header: str = ""  # "Log starting offset: 0", "Snapshot end offset: 120, epoch: 2" or "<path> is empty."
    batches: list[DumpedBatch] = field(default_factory=list)
    invalid_trailing_bytes: int = 0
    # An .index file: (last offset of a batch, its position); a .timeindex: (timestamp, offset).
    index_entries: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class Dump:
    files: dict[str, DumpedFile] = field(default_factory=dict)
    unparsed: list[str] = field(default_factory=list)  # stdout lines none of the forms above match


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _batch(m: re.Match[str]) -> DumpedBatch:
    g = m.groupdict()
    return DumpedBatch(
        base_offset=int(g["base"]), last_offset=int(g["last"]),
        count=None if g["count"] == "null" else int(g["count"]),
        base_sequence=int(g["base_seq"]), last_sequence=int(g["last_seq"]), producer_id=int(g["pid"]),
        producer_epoch=int(g["pepoch"]), leader_epoch=int(g["epoch"]), is_transactional=g["txn"] == "true",
        is_control=g["control"] == "true", position=int(g["position"]), max_timestamp_ms=int(g["max_ts"]),
        size_bytes=int(g["size"]), magic=int(g["magic"]), compression=g["codec"], crc=int(g["crc"]),
        valid=g["valid"] == "true")


def _record(m: re.Match[str]) -> DumpedRecord | None:
    """The record of one "| offset: ..." line, or None if its tail is of no known form."""
    rec = DumpedRecord(offset=int(m["offset"]), key_size=int(m["key_size"]), value_size=int(m["value_size"]),
                       sequence=int(m["seq"]))
    rest = m["rest"]
    if not rest:
        return rec
    control = _CONTROL.match(rest)
    if control:
        rec.control = control["kind"].rstrip(":")
        rec.control_data = _json_or_text(control["body"])
        return rec
    if not rest.startswith(" payload: "):
        return None
    payload = rest[len(" payload: "):]
    error = _METADATA_ERROR.match(payload)
    if error:
        rec.error = error["message"]
        return rec
    decoded = _json_or_text(payload)
    if isinstance(decoded, dict) and {"type", "version", "data"} <= decoded.keys():
        rec.metadata = decoded
    else:
        rec.payload = payload
    return rec


def parse_dump(stdout: str) -> Dump:
    """The files, batches and records in DumpLogSegments' stdout."""
    dump = Dump()
    current: DumpedFile | None = None
    for line in stdout.splitlines():
        if line.startswith("Dumping "):
            current = DumpedFile(path=line[len("Dumping "):])
            dump.files[current.path] = current
            continue
        if current is None:
            dump.unparsed.append(line)
            continue
        if line == f"{current.path} is empty." or line == f"{current.path} passed sanity check.":
            current.header = line  # an index with no entry, or --index-sanity-check's word
            continue
        if line.startswith(("Log starting offset: ", "Snapshot end offset: ")):
            current.header = line
            continue
        batch = _BATCH.match(line)
        if batch:
            current.batches.append(_batch(batch))
            continue
        record = _RECORD.match(line)
        parsed = _record(record) if record and current.batches else None
        if parsed is not None:
            current.batches[-1].records.append(parsed)
            continue
        index_entry, time_entry = _INDEX_ENTRY.match(line), _TIME_INDEX_ENTRY.match(line)
        if index_entry and not current.batches:
            current.index_entries.append((int(index_entry["offset"]), int(index_entry["position"])))
            continue
        if time_entry and not current.batches:
            current.index_entries.append((int(time_entry["ts"]), int(time_entry["offset"])))
            continue
        trailing = _TRAILING.match(line)
        if trailing:
            current.invalid_trailing_bytes = int(trailing["n"])
            continue
        if line.strip():
            dump.unparsed.append(line)
    return dump
