"""Kafka's control records: LeaderChangeMessage (type 2), SnapshotHeaderRecord
(3), SnapshotFooterRecord (4), KRaftVersionRecord (5) and VotersRecord (6):
bodies in Kafka's flexible-version encoding of their JSON schemas (the bytes
below are written out by hand from the schemas), after Kafka's control record
key (version i16 = 0, type i16)."""

from __future__ import annotations

import pytest

from metalog.storage import control_records as cr
from metalog.storage.kafka_flexible import uuid_from_bytes

DIR = uuid_from_bytes(bytes(range(1, 17)))


def test_kraft_version_record_is_kafkas_bytes():
    value = cr.encode_control(cr.KRaftVersionRecord(1))
    assert value == bytes.fromhex("0000 0005") + bytes.fromhex("0000 0001 00")
    assert cr.decode_control(value) == cr.KRaftVersionRecord(1)


def test_voters_record_is_kafkas_bytes():
    rec = cr.VotersRecord([cr.Voter(1, DIR, [cr.VoterEndpoint("CONTROLLER", "h", 9093)], 0, 1)])
    body = (bytes.fromhex("0000")  # Version
            + bytes.fromhex("02")  # compact array: 1 voter
            + bytes.fromhex("00000001")  # VoterId
            + bytes(range(1, 17))  # VoterUuid, 16 raw bytes
            + bytes.fromhex("02")  # 1 endpoint
            + bytes.fromhex("0b") + b"CONTROLLER" + bytes.fromhex("02") + b"h" + bytes.fromhex("2385")
            + bytes.fromhex("00")  # endpoint tagged fields
            + bytes.fromhex("0000 0001 00")  # KRaftVersionFeature min, max, tagged fields
            + bytes.fromhex("00")  # voter tagged fields
            + bytes.fromhex("00"))  # record tagged fields
    value = cr.encode_control(rec)
    assert value == bytes.fromhex("0000 0006") + body
    assert cr.decode_control(value) == rec


def test_leader_change_message_is_kafkas_bytes():
    value = cr.encode_control(cr.LeaderChange(2, [1, 2, 3], [2, 3]))
    assert value == (bytes.fromhex("0000 0002")  # key: version 0, type LeaderChange
                     + bytes.fromhex("0000")  # Version
                     + bytes.fromhex("00000002")  # LeaderId
                     + bytes.fromhex("04 00000001 00 00000002 00 00000003 00")  # Voters: 3, each + tagged fields
                     + bytes.fromhex("03 00000002 00 00000003 00")  # GrantingVoters: 2
                     + bytes.fromhex("00"))
    assert cr.decode_control(value) == cr.LeaderChange(2, [1, 2, 3], [2, 3])


def test_snapshot_header_and_footer_are_kafkas_bytes():
    header = cr.encode_control(cr.SnapshotHeader(0x0102030405))
    assert header == bytes.fromhex("0000 0003" "0000" "0000000102030405" "00")
    assert cr.decode_control(header) == cr.SnapshotHeader(0x0102030405)
    footer = cr.encode_control(cr.SnapshotFooter())
    assert footer == bytes.fromhex("0000 0004" "0000" "00")
    assert cr.decode_control(footer) == cr.SnapshotFooter()


def test_the_cluster_id_rides_in_a_tagged_field_of_the_snapshot_header():
    """Our one departure: a tagged field (tag 10000) that Kafka's reader keeps
    as unknown; the fixed fields are Kafka's."""
    value = cr.encode_control(cr.SnapshotHeader(7, "c1"))
    assert value == bytes.fromhex("0000 0003" "0000" "0000000000000007") + bytes.fromhex("01 904e 03 03") + b"c1"
    assert cr.decode_control(value) == cr.SnapshotHeader(7, "c1")


@pytest.mark.parametrize("value, why", [
    (bytes.fromhex("0000"), "control record of 2 bytes is too short for its key"),
    (bytes.fromhex("0001 0002") + bytes.fromhex("0000 00000001 01 01 00"), "control record key version 1"),
    (bytes.fromhex("0000 0009 00"), "unknown control record type 9"),
])
def test_a_bad_key_is_a_control_record_error(value, why):
    """The reader names what is wrong with the key."""
    with pytest.raises(cr.ControlRecordError, match=why):
        cr.decode_control(value)


def test_unknown_directory_id_is_the_zero_uuid_and_round_trips():
    rec = cr.VotersRecord([cr.Voter(2, "", [], 0, 0), cr.Voter(3, DIR, [cr.VoterEndpoint("A", "::1", 1)])])
    value = cr.encode_control(rec)
    assert bytes(16) in value
    assert cr.decode_control(value) == rec


def test_tagged_fields_of_a_newer_writer_are_skipped():
    # KRaftVersionRecord with one tagged field (tag 7, 2 bytes) at the end.
    value = bytes.fromhex("0000 0005") + bytes.fromhex("0000 0001") + bytes.fromhex("01 07 02 abcd")
    assert cr.decode_control(value) == cr.KRaftVersionRecord(1)


@pytest.mark.parametrize("body, why", [
    (bytes.fromhex("0000 02 00000001"), "truncated"),
    (bytes.fromhex("0000 00 00"), "null array"),
    (bytes.fromhex("0000 01 00 ff"), "bytes left after the message"),
])
def test_a_damaged_voters_record_is_a_control_record_error(body, why):
    """The reader says what is wrong: 'undecodable control record type 6 v0: <why>'."""
    with pytest.raises(cr.ControlRecordError, match=f"undecodable control record type 6 v0: .*{why}"):
        cr.decode_control(bytes.fromhex("0000 0006") + body)


def test_the_log_finds_its_control_batches_by_header(tmp_path):
    """What boot reads to rebuild the voter-set history: only control batches,
    whole, from the log start (metalog.broker.server.recovery)."""
    from metalog.broker.quorum.voters import VoterSet, voter_sets_in
    from metalog.storage.batch import encode_batch
    from metalog.storage.segments import SegmentedLog

    voters = cr.VotersRecord([cr.Voter(1, DIR, [cr.VoterEndpoint("CONTROLLER", "h", 1)])])
    control = encode_batch(3, 1, [cr.encode_control(voters)], 0, is_control=True)
    log = SegmentedLog.open(str(tmp_path), segment_bytes_max=256)
    log.append(encode_batch(0, 1, [b"a", b"b", b"c"], 0))
    log.append(control)
    for base in range(4, 40, 4):
        log.append(encode_batch(base, 1, [b"x" * 20] * 4, 0))
    assert [i.is_control for i in log.iter_batch_headers()] == [False, True] + [False] * 9
    assert list(log.control_batches()) == [control]
    assert voter_sets_in(b"".join(log.control_batches())) == [(3, VoterSet({1: DIR}, kraft_version=1))]
    log.close()


def test_a_snapshot_carries_the_voter_set_after_its_header(tmp_path):
    """KIP-853: KRaftVersionRecord + VotersRecord in the control batch after
    the SnapshotHeader; the data records are read as before; a snapshot of
    static voters has none."""
    from metalog.storage.snapshot import SnapshotId, SnapshotWriter, read_snapshot, read_snapshot_voters, verify_snapshot

    voters = cr.VotersRecord([cr.Voter(1, DIR, [cr.VoterEndpoint("CONTROLLER", "h", 1)]),
                              cr.Voter(2, "", [])])
    sid = SnapshotId(10, 2)
    path, _, _ = SnapshotWriter(str(tmp_path), sid, 0, "c1", voters=voters).write_all([b"r1", b"r2"])
    _, layout = verify_snapshot(path)
    assert layout.voters == voters and layout.records == 2
    assert list(read_snapshot(path)[2]) == [b"r1", b"r2"]
    assert read_snapshot_voters(path) == voters
    plain, _, _ = SnapshotWriter(str(tmp_path), SnapshotId(20, 2), 0, "c1").write_all([b"r1"])
    assert read_snapshot_voters(plain) is None and verify_snapshot(plain)[1].voters is None
