"""The on-disk format version of a data dir, and the upgrades to the current one.

Version 1 (builds before issue 17) framed the records inside a batch as
``u32 length | value`` and a control record as ``type i16 | version i16 |
body`` (msgpack bodies for LeaderChange, SnapshotHeader, SnapshotFooter).
Version 2 writes Kafka's v2 records and Kafka's control records
(metalog.storage.batch, metalog.storage.control_records), but metadata record values are
still ``api_key i16 | version i16 | msgpack array`` (ACLs under keys 6 and
16). Version 3 writes metadata record values in Kafka's ApiMessageAndVersion
framing with Kafka's bodies and api keys (metalog.storage.metadata_records). Batch
headers are the same in all three; only the records and so the lengths, CRCs
and file positions change.

meta.properties carries ``metalog.format.version`` (absent = 1). A broker
refuses an older dir that holds data, naming its version and the command
``metalog storage upgrade --data-dir DIR``, which calls upgrade_data_dir:
every segment and snapshot is rewritten batch by batch (tmp file, fsync,
rename, directory fsync: metalog.storage.atomic.atomic_write), 1 -> 3 in one pass,
the segment's ``.index`` and ``.timeindex`` are emptied first (positions
move; the log rebuilds them at open), a snake_case quorum-state is rewritten as
Kafka's JSON, and meta.properties is stamped last. A batch or value already
in version 3 is kept as it is, so an interrupted upgrade is finished by
running it again. A version-2 FenceBroker, whose apply also shrank ISRs and
moved leaders, becomes metalog's FenceBrokerImplicit (key 1001), which keeps
that rule, so the log replays to the same state; a version-3 controller
writes Kafka's FenceBroker plus explicit PartitionChange records instead.
A value that is not a version-2 metadata record (a
produced record, or one no build could decode) is kept byte for byte.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

import msgspec

from metalog.protocol.invariants import invariant
from metalog.storage import batch as b
from metalog.storage import control_records as cr
from metalog.storage import metadata_records as mr
from metalog.storage.atomic import atomic_write
from metalog.storage.errors import QuorumStateError
from metalog.storage.quorum_state import QuorumStateFile

FORMAT_VERSION = 3
UPGRADABLE_VERSIONS = (1, 2)
FORMAT_KEY = "metalog.format.version"
META_FILE = "meta.properties"
PARTITION_DIR = "__cluster_metadata-0"
_V1_LEN = struct.Struct(">I")
_V1_PREFIX = struct.Struct(">hh")  # type, version
_V1_BODIES = {cr.LEADER_CHANGE, cr.SNAPSHOT_HEADER, cr.SNAPSHOT_FOOTER}  # msgpack arrays in v1


class FormatError(ValueError):
    """A file in no version we know, or damaged: names file and byte."""


# Version 1 and 2 metadata values: api key i16 | version i16 (always 0) | a
# msgpack array of the record's fields in order (the classes of
# metalog.storage.metadata_records kept those fields; Endpoint's new last field has a
# default). AccessControlEntry and its removal had keys 6 and 16, not Kafka's.
_LEGACY_PREFIX = struct.Struct(">hh")
_LEGACY_TYPES = {
    0: mr.RegisterBroker, 1: mr.UnregisterBroker, 2: mr.Topic, 3: mr.Partition, 4: mr.Config,
    5: mr.PartitionChange, 6: mr.AccessControlEntry, 7: mr.FenceBroker, 8: mr.UnfenceBroker,
    9: mr.RemoveTopic, 12: mr.FeatureLevel, 16: mr.RemoveAccessControlEntry, 20: mr.NoOp,
    1000: mr.ProducerState,
}
_LEGACY_DECODERS: dict[int, msgspec.msgpack.Decoder[mr.MetadataRecord]] = {
    key: msgspec.msgpack.Decoder(cls) for key, cls in _LEGACY_TYPES.items()}


def legacy_metadata_record(value: bytes) -> mr.MetadataRecord | None:
    """The record a version-1/2 metadata value holds, or None if the value is
    not one (a produced record, an undecodable one, or a version-3 value: its
    first byte, frame version 1, makes a key of 256..511, which no type had)."""
    if len(value) < _LEGACY_PREFIX.size:
        return None
    key, version = _LEGACY_PREFIX.unpack_from(value)
    dec = _LEGACY_DECODERS.get(key)
    if dec is None or version != 0:
        return None
    try:
        return dec.decode(value[_LEGACY_PREFIX.size:])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def convert_value(value: bytes) -> bytes:
    """A metadata value in version 3; anything else unchanged. ValueError if the
    record cannot be written in Kafka's encoding (an id that is not a uuid)."""
    rec = legacy_metadata_record(value)
    if rec is None:
        return value
    if type(rec) is mr.FenceBroker:  # its apply shrank ISRs: kept under our own key
        rec = mr.FenceBrokerImplicit(rec.id, rec.epoch)
    try:
        return mr.encode_record(rec)
    except (ValueError, OverflowError) as exc:
        raise ValueError(f"its {type(rec).__name__} record has no Kafka encoding: {exc}") from None


def read_props(path: str) -> dict[str, str]:
    with open(path) as f:
        lines = f.read().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))


def format_version_of(props: dict[str, str]) -> int | str:
    """The dir's format version (1 when the key is absent); the raw text if it is not a number."""
    raw = props.get(FORMAT_KEY)
    if raw is None:
        return 1
    return int(raw) if raw.isdigit() else raw


def holds_data(part_dir: str) -> bool:
    """Any non-empty segment or any snapshot in the log directory."""
    if not os.path.isdir(part_dir):
        return False
    for name in os.listdir(part_dir):
        path = os.path.join(part_dir, name)
        if name.endswith(".checkpoint") or (name.endswith(".log") and os.path.getsize(path) > 0):
            return True
    return False


def _v1_records(raw: bytes, h: b.BatchHeader) -> list[bytes]:
    out = []
    pos, end = b.HEADER_SIZE, h.size
    for _ in range(h.records_count):
        if pos + 4 > end:
            raise ValueError("version-1 record runs past the batch end")
        (n,) = _V1_LEN.unpack_from(raw, pos)
        pos += 4
        if pos + n > end:
            raise ValueError("version-1 record runs past the batch end")
        out.append(raw[pos:pos + n])
        pos += n
    if pos != end:
        raise ValueError("trailing bytes after the last version-1 record")
    return out


def _v1_control(value: bytes) -> bytes:
    """A version-1 control record (type, version, body) as version 2 (Kafka's key + value)."""
    if len(value) < _V1_PREFIX.size:
        raise ValueError(f"version-1 control record of {len(value)} bytes is too short for its type and version")
    rtype, _version = _V1_PREFIX.unpack_from(value)
    body = value[_V1_PREFIX.size:]
    if rtype in _V1_BODIES:
        fields = msgspec.msgpack.decode(body)
        rec = {cr.LEADER_CHANGE: cr.LeaderChange, cr.SNAPSHOT_HEADER: cr.SnapshotHeader,
               cr.SNAPSHOT_FOOTER: cr.SnapshotFooter}[rtype](*fields)
        return cr.encode_control(rec)
    if rtype in (cr.KRAFT_VERSION, cr.KRAFT_VOTERS):  # already Kafka's bodies in v1
        out = struct.pack(">hh", cr.KEY_VERSION, rtype) + body
        # Checked here: a damaged body written as is would be neither version
        # afterwards (is_v2_batch fails, then the v1 parse does): a rerun could not finish.
        cr.decode_control(out)  # ControlRecordError (a ValueError) names what is wrong
        return out
    raise ValueError(f"unknown version-1 control record type {rtype}")


def is_v2_batch(raw: bytes, h: b.BatchHeader) -> bool:
    """Whether the batch's records parse as version 2. A version-1 record
    starts with the high byte of a u32 length (0 for any record under 16 MiB),
    which as a v2 varint is a length of 0: never a whole v2 record."""
    try:
        records = b.decode_records(raw, h)
        if h.is_control:
            for rec in records:
                cr.decode_control(rec)
    except (b.CorruptBatchError, cr.ControlRecordError):
        return False
    return True


def convert_batch(raw: bytes, h: b.BatchHeader) -> bytes:
    """The batch in version 3: itself if it is already; else re-encoded with
    the same offsets, epoch, timestamp, producer fields and control bit."""
    if is_v2_batch(raw, h):
        old = b.decode_records(raw, h)
        records = old if h.is_control else [convert_value(v) for v in old]
        if records == old:
            return raw
    else:
        records = _v1_records(raw, h)
        records = [_v1_control(v) for v in records] if h.is_control else [convert_value(v) for v in records]
    if h.attributes & ~b.ATTR_CONTROL:  # input, not an invariant: a clear FormatError, no traceback
        raise ValueError(f"attributes {h.attributes:#x}: versions 1 and 2 set no bit but the control bit")
    out = b.encode_batch(h.base_offset, h.leader_epoch, records, h.first_timestamp_ms, is_control=h.is_control,
                         producer_id=h.producer_id, producer_epoch=h.producer_epoch,
                         base_sequence=h.base_sequence)
    invariant(b.decode_records(out) == records, "a re-encoded batch decodes to other records")
    return out


def convert_file(path: str) -> tuple[bool, int]:
    """Rewrite one segment or snapshot file in version 3, durably.
    Returns (changed, batches). A torn tail (an incomplete last batch) is kept
    as it is: the log's crash recovery cuts it, as before. FormatError names
    the file and byte of a batch that is damaged or in neither format."""
    with open(path, "rb") as fh:
        data = fh.read()
    parts: list[bytes] = []
    end = 0
    count = 0
    try:
        for pos, h in b.iter_batches(data):
            raw = data[pos:pos + h.size]
            try:
                parts.append(convert_batch(raw, h))
            except (ValueError, msgspec.DecodeError, TypeError) as exc:
                raise FormatError(f"{path}: batch at byte {pos} (offset {h.base_offset}) cannot be "
                                  f"converted to format version {FORMAT_VERSION}: {exc}") from None
            end = pos + h.size
            count += 1
    except b.CorruptBatchError as exc:
        raise FormatError(f"{path}: corrupt batch at byte {exc.position}: {exc}; nothing rewritten "
                          "(see metalog storage verify)") from None
    parts.append(data[end:])
    new = b"".join(parts)
    if new == data:
        return False, count
    atomic_write(path, new)
    return True, count


@dataclass
class UpgradeReport:
    already: bool = False  # the dir was at FORMAT_VERSION before
    rewritten: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    batches: int = 0


def upgrade_data_dir(data_dir: str) -> UpgradeReport:
    """Bring a stopped broker's data dir to FORMAT_VERSION (idempotent)."""
    meta = os.path.join(data_dir, META_FILE)
    if not os.path.exists(meta):
        raise FormatError(f"{data_dir}: no {META_FILE}: not a formatted data dir")
    props = read_props(meta)
    version = format_version_of(props)
    report = UpgradeReport()
    if version == FORMAT_VERSION:
        report.already = True
        return report
    if version not in UPGRADABLE_VERSIONS:
        raise FormatError(f"{meta}: {FORMAT_KEY}={version}: this build upgrades versions 1 and 2 "
                          f"to {FORMAT_VERSION} only; nothing changed")
    part_dir = os.path.join(data_dir, PARTITION_DIR)
    names = sorted(os.listdir(part_dir)) if os.path.isdir(part_dir) else []
    for name in names:
        path = os.path.join(part_dir, name)
        if not (name.endswith(".log") or name.endswith(".checkpoint")):
            continue
        if name.endswith(".log"):
            # Emptied before the segment is rewritten (positions move; the log
            # rebuilds them at open), and for every segment of a version-1 dir:
            # a run interrupted between a rewrite and this would otherwise
            # leave an index of version-1 positions that the rerun, finding
            # the segment already converted, kept -- reads through it would
            # land mid-batch and look like corruption.
            for suffix in (".index", ".timeindex"):
                index = path[:-len(".log")] + suffix
                if os.path.exists(index) and os.path.getsize(index) > 0:
                    atomic_write(index, b"")
        changed, batches = convert_file(path)
        report.batches += batches
        (report.rewritten if changed else report.unchanged).append(path)
    qs_path = os.path.join(part_dir, "quorum-state")
    if os.path.exists(qs_path):
        before = open(qs_path, "rb").read()
        try:
            QuorumStateFile(qs_path).read()  # a snake_case file is rewritten as Kafka's JSON
        except QuorumStateError as exc:
            raise FormatError(f"{exc}; nothing more changed") from None
        (report.rewritten if open(qs_path, "rb").read() != before else report.unchanged).append(qs_path)
    # Stamped last: an interrupted upgrade leaves the old version and is run again.
    lines = [f"{k}={v}" for k, v in props.items() if k != FORMAT_KEY] + [f"{FORMAT_KEY}={FORMAT_VERSION}"]
    atomic_write(meta, ("\n".join(lines) + "\n").encode())
    return report
