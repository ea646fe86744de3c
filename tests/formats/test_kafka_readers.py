"""Our files read by code we did not write.

kafka-python's record-batch reader (kafka.record: MemoryRecords,
DefaultRecordBatch) and kio's record reader read every batch and record of
real segment and snapshot files we wrote, with the offsets, epochs, producer
fields, keys and values we meant; kio's entities, generated from Kafka's own
JSON schemas, parse every control record value; kafka-python's batch builder
writes, byte for byte, the batch we write. Golden bytes come from Kafka's
documented v2 record layout."""

from __future__ import annotations

import os

import crc32c
import pytest
from kafka.record import MemoryRecords
from kafka.record.default_records import DefaultRecordBatchBuilder
from kio.records.readers import read_batch
from kio.schema.k_raft_version_record.v0.data import KRaftVersionRecord as KioKRaftVersion
from kio.schema.leader_change_message.v0.data import LeaderChangeMessage as KioLeaderChange
from kio.schema.snapshot_footer_record.v0.data import SnapshotFooterRecord as KioFooter
from kio.schema.snapshot_header_record.v0.data import SnapshotHeaderRecord as KioHeader
from kio.schema.voters_record.v0.data import VotersRecord as KioVoters
from kio.serial import entity_reader

from metalog.storage import batch as b
from metalog.storage import control_records as cr
from metalog.storage import metadata_records as mr
from metalog.storage.kafka_flexible import uuid_from_bytes
from metalog.storage.segments import SegmentedLog
from metalog.storage.snapshot import SnapshotId, SnapshotWriter

DIR_ID = uuid_from_bytes(bytes(range(1, 17)))
VOTERS = cr.VotersRecord([cr.Voter(1, DIR_ID, [cr.VoterEndpoint("CONTROLLER", "127.0.0.1", 9091)]),
                          cr.Voter(2, "", [cr.VoterEndpoint("CONTROLLER", "127.0.0.1", 9092)], 0, 1)])
KIO_ENTITY = {cr.LEADER_CHANGE: KioLeaderChange, cr.SNAPSHOT_HEADER: KioHeader, cr.SNAPSHOT_FOOTER: KioFooter,
              cr.KRAFT_VERSION: KioKRaftVersion, cr.KRAFT_VOTERS: KioVoters}
TS = 1_700_000_000_123


def _metadata_values(n: int) -> list[bytes]:
    values = [mr.encode_record(mr.RegisterBroker(x, f"00000000-0000-0000-0001-{x:012d}", 1, (mr.Endpoint("PLAINTEXT", f"h{x}", 9092),),
                                                 None, False)) for x in range(n)]
    values.append(b"")  # an empty value is a record too
    values.append(b"v" * 300)  # a two-byte varint length
    return values


def write_log(directory: str) -> list[tuple[bytes, bool]]:
    """A segmented log as the leader writes it (a LeaderChange, the KIP-853
    pair, plain and idempotent batches, rolled over several segments).
    Returns (batch bytes, is_control) in log order."""
    batches: list[tuple[bytes, bool]] = []
    log = SegmentedLog.open(directory, segment_bytes_max=2048)
    offset = 0

    def add(records: list[bytes], epoch: int, control: bool = False, **producer) -> None:
        nonlocal offset
        data = b.encode_batch(offset, epoch, records, TS + offset, is_control=control, **producer)
        log.append(data)
        batches.append((data, control))
        offset += len(records)

    add([cr.encode_control(cr.LeaderChange(1, [1, 2, 3], [1, 2]))], 1, control=True)
    add([cr.encode_control(cr.KRaftVersionRecord(1)), cr.encode_control(VOTERS)], 1, control=True)
    for i in range(12):
        add(_metadata_values(3 + i % 4), 1 + i // 6)
    add([b"idem-0", b"idem-1"], 2, producer_id=7, producer_epoch=0, base_sequence=0)
    add([cr.encode_control(cr.LeaderChange(2, [1, 2, 3], [2, 3]))], 3, control=True)
    log.flush()
    log.close()
    assert len([f for f in os.listdir(directory) if f.endswith(".log")]) > 1, "rolled over segments"
    return batches


def file_bytes(directory: str, suffix: str) -> bytes:
    out = b""
    for name in sorted(os.listdir(directory)):
        if name.endswith(suffix):
            with open(os.path.join(directory, name), "rb") as fh:
                out += fh.read()
    return out


def assert_kafka_python_reads(data: bytes, expected: list[tuple[bytes, bool]]) -> int:
    """kafka-python reads `data` batch by batch exactly as we encoded it; returns records seen."""
    records = MemoryRecords(data)
    seen = 0
    for raw, control in expected:
        h = b.decode_header(raw)
        theirs = records.next_batch()
        assert theirs is not None, f"kafka-python found no batch at offset {h.base_offset}"
        assert theirs.validate_crc()
        assert (theirs.base_offset, theirs.leader_epoch, theirs.magic, theirs.last_offset_delta) == \
            (h.base_offset, h.leader_epoch, 2, h.last_offset_delta)
        assert (theirs.producer_id, theirs.producer_epoch, theirs.base_sequence) == \
            (h.producer_id, h.producer_epoch, h.base_sequence)
        assert theirs.is_control_batch == control and theirs.compression_type == 0
        ours = b.decode_records(raw)
        got = list(theirs)
        assert [r.offset for r in got] == list(range(h.base_offset, h.next_offset))
        assert all(r.timestamp == h.first_timestamp_ms and r.headers == [] for r in got)
        for rec, value in zip(got, ours, strict=True):
            if control:
                assert (rec.version, rec.type) == (0, cr.control_type(value))
                assert rec.key + rec.value == value
            else:
                assert rec.key is None and rec.value == value
        seen += len(got)
    assert not records.has_next(), "kafka-python found bytes after the last batch"
    return seen


def assert_kio_reads(data: bytes, expected: list[tuple[bytes, bool]]) -> list:
    """kio's batch reader agrees, and kio's generated entities parse every
    control record value to the fields we wrote. Returns the parsed entities."""
    entities = []
    pos = 0
    for raw, control in expected:
        batch, size = read_batch(data, pos)
        assert size == len(raw) and data[pos:pos + size] == raw
        pos += size
        h = b.decode_header(raw)
        assert (batch.base_offset, batch.partition_leader_epoch, batch.crc) == (h.base_offset, h.leader_epoch, h.crc)
        assert [r.offset for r in batch.records] == list(range(h.base_offset, h.next_offset))
        ours = b.decode_records(raw)
        for rec, value in zip(batch.records, ours, strict=True):
            if not control:
                assert rec.key is None and rec.value == value
                continue
            assert rec.key == value[:4]
            ctype = cr.control_type(value)
            parsed, used = entity_reader(KIO_ENTITY[ctype])(rec.value, 0)
            assert used == len(rec.value), f"kio left bytes of control type {ctype}"
            entities.append((ctype, parsed, cr.decode_control(value)))
    assert pos == len(data)
    return entities


def assert_entity_matches(ctype: int, kio, ours) -> None:
    assert kio.version == 0
    if ctype == cr.LEADER_CHANGE:
        assert kio.leader_id == ours.leader_id
        assert [v.voter_id for v in kio.voters] == ours.voters
        assert [v.voter_id for v in kio.granting_voters] == ours.granting_voters
    elif ctype == cr.SNAPSHOT_HEADER:
        assert kio.last_contained_log_timestamp == ours.last_contained_log_timestamp_ms
    elif ctype == cr.KRAFT_VERSION:
        assert kio.k_raft_version == ours.kraft_version
    elif ctype == cr.KRAFT_VOTERS:
        assert [v.voter_id for v in kio.voters] == [v.voter_id for v in ours.voters]
        # kio reads Kafka's ZERO_UUID (our "", unknown) as None.
        assert [uuid_from_bytes(v.voter_directory_id.bytes) if v.voter_directory_id is not None else ""
                for v in kio.voters] == [v.directory_id for v in ours.voters]
        assert [[(e.name, e.host, e.port) for e in v.endpoints] for v in kio.voters] == \
            [[(e.name, e.host, e.port) for e in v.endpoints] for v in ours.voters]
        assert [(v.k_raft_version_feature.min_supported_version, v.k_raft_version_feature.max_supported_version)
                for v in kio.voters] == [(v.min_kraft_version, v.max_kraft_version) for v in ours.voters]
    else:
        assert ctype == cr.SNAPSHOT_FOOTER


def test_every_batch_and_record_of_our_segments_reads_with_kafka_python_and_kio(tmp_path):
    expected = write_log(str(tmp_path))
    data = file_bytes(str(tmp_path), ".log")
    assert data == b"".join(raw for raw, _ in expected)
    assert assert_kafka_python_reads(data, expected) == sum(b.decode_header(r).records_count for r, _ in expected)
    entities = assert_kio_reads(data, expected)
    assert sorted({t for t, _, _ in entities}) == [cr.LEADER_CHANGE, cr.KRAFT_VERSION, cr.KRAFT_VOTERS]
    for ctype, kio, ours in entities:
        assert_entity_matches(ctype, kio, ours)


def test_every_batch_and_record_of_our_snapshots_reads_with_kafka_python_and_kio(tmp_path):
    """A snapshot as the broker writes it (header, KIP-853 voter set, data
    batches, footer). Without a cluster id its header is Kafka's byte for byte."""
    values = _metadata_values(40)
    w = SnapshotWriter(str(tmp_path), SnapshotId(len(values) + 10, 4), TS, batch_bytes_max=700, voters=VOTERS)
    path, _size, count = w.write_all(values)
    assert count == len(values)
    with open(path, "rb") as fh:
        data = fh.read()
    expected = [(bytes(memoryview(data)[pos:pos + h.size]), h.is_control) for pos, h in b.iter_batches(data)]
    assert len(expected) > 4, "data in several batches"
    assert_kafka_python_reads(data, expected)
    entities = assert_kio_reads(data, expected)
    assert [t for t, _, _ in entities] == [cr.SNAPSHOT_HEADER, cr.KRAFT_VERSION, cr.KRAFT_VOTERS, cr.SNAPSHOT_FOOTER]
    for ctype, kio, ours in entities:
        assert_entity_matches(ctype, kio, ours)
    data_values = [v for raw, control in expected if not control for v in b.decode_records(raw)]
    assert data_values == values


def test_a_snapshot_header_with_a_cluster_id_is_read_by_kafka_python_and_our_tag_is_the_only_extra():
    """Our one departure: the cluster id as a tagged field (tag 10000), which
    Kafka's generated Java reader keeps as an unknown tagged field. kio's
    reader is stricter and names the tag it does not know."""
    value = cr.encode_control(cr.SnapshotHeader(TS, "cluster-x"))
    raw = b.encode_batch(0, 1, [value], TS, is_control=True)
    [rec] = list(MemoryRecords(raw).next_batch())
    assert (rec.version, rec.type) == (0, cr.SNAPSHOT_HEADER)
    plain = cr.encode_control(cr.SnapshotHeader(TS))
    # The same bytes as Kafka's header up to the tagged-field section.
    assert rec.value[:10] == plain[4:-1]
    with pytest.raises(KeyError, match="Unknown tagged field tag: 10000"):
        entity_reader(KioHeader)(rec.value, 0)


@pytest.mark.parametrize("producer", [(-1, -1, -1), (42, 3, 17)])
def test_kafka_pythons_builder_writes_our_batch_byte_for_byte(producer):
    """Everything from the length field on except the leader epoch (the
    builder leaves base offset and epoch to the broker, 0)."""
    pid, pepoch, seq = producer
    values = [b"a", b"", b"x" * 200, bytes(range(256)) * 40]
    builder = DefaultRecordBatchBuilder(2, 0, False, pid, pepoch, seq, 1 << 20)
    for i, v in enumerate(values):
        assert builder.append(i, TS, None, v, []) is not None
    theirs = bytes(builder.build())
    ours = b.encode_batch(0, 0, values, TS, producer_id=pid, producer_epoch=pepoch, base_sequence=seq)
    assert ours == theirs


def test_golden_bytes_of_one_record_from_kafkas_documented_layout():
    """Kafka's documented v2 layout, written out by hand: a batch at offset 5,
    epoch 3, holding one record with value b'hi' (null key, no headers)."""
    record = bytes.fromhex(
        "10"  # length 8, zig-zag
        "00"  # attributes
        "00"  # timestamp delta 0
        "00"  # offset delta 0
        "01"  # key length -1 (null)
        "04") + b"hi" + bytes.fromhex("00")  # value length 2, value, 0 headers
    after_crc = bytes.fromhex(
        "0000"  # attributes: no compression, create time, not transactional, not control
        "00000000"  # last offset delta
        "0000018bcfe5687b" "0000018bcfe5687b"  # first / max timestamp (TS)
        "ffffffffffffffff" "ffff" "ffffffff"  # producer id, epoch, base sequence: none
        "00000001") + record  # records count
    crc = crc32c.crc32c(after_crc)
    golden = (bytes.fromhex("0000000000000005")  # base offset
              + (len(after_crc) + 9).to_bytes(4, "big")  # length: epoch + magic + crc + the rest
              + bytes.fromhex("00000003" "02") + crc.to_bytes(4, "big") + after_crc)
    assert b.encode_batch(5, 3, [b"hi"], TS) == golden
    assert b.decode_records(golden) == [b"hi"]


def test_golden_bytes_of_a_control_record():
    """A LeaderChange control record: key (version 0, type 2), value Kafka's
    LeaderChangeMessage v0 (leader 1, voters [1], granting [1])."""
    value = cr.encode_control(cr.LeaderChange(1, [1], [1]))
    raw = b.encode_batch(0, 1, [value], TS, is_control=True)
    records = raw[b.HEADER_SIZE:]
    body = bytes.fromhex("0000" "00000001" "02 00000001 00" "02 00000001 00" "00")
    assert records == (bytes([(1 + 1 + 1 + 1 + 4 + 1 + len(body) + 1) * 2])
                       + bytes.fromhex("00 00 00" "08" "0000 0002") + bytes([len(body) * 2]) + body + b"\x00")
    assert b.decode_header(raw).attributes == b.ATTR_CONTROL


@pytest.mark.parametrize("damage, why", [
    (lambda r: r[:-1], "trailing bytes|runs past"),
    (lambda r: bytes([r[0] + 2]) + r[1:], "runs past|bytes left|trailing"),
    (lambda r: r[:3] + b"\x02" + r[4:], "offset delta 1, expected 0"),
])
def test_a_malformed_record_is_a_corrupt_batch_error(damage, why):
    """decode_records names the record and what is wrong (CorruptBatchError),
    whatever the CRC says (the header is re-encoded around the damage)."""
    raw = b.encode_batch(0, 1, [b"hello"], TS)
    h = b.decode_header(raw)
    records = damage(raw[b.HEADER_SIZE:])
    header = b.HEADER.pack(0, b.HEADER_SIZE - b.LOG_OVERHEAD + len(records), 1, 2, 0, *h[5:])
    with pytest.raises(b.CorruptBatchError, match=why):
        b.decode_records(header + records)
