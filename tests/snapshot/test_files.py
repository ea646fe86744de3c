"""Snapshot files: names, write/read round trip, refusal of truncated or corrupt files."""

import os

import pytest

from metalog.protocol.messages import SnapshotId
from metalog.storage import batch as b
from metalog.storage import control_records as cr
from metalog.storage.snapshot import (CorruptSnapshotError, SnapshotWriter, parse_snapshot_filename, verify_snapshot_bytes,
                              read_snapshot, snapshot_filename, verify_snapshot)

SID = SnapshotId(1234, 5)


def write(tmp_path, sid=SID, n=50, batch_bytes_max=200):
    values = [f"record-{i}".encode() * (1 + i % 3) for i in range(n)]
    w = SnapshotWriter(str(tmp_path), sid, 777, "cluster-x", batch_bytes_max=batch_bytes_max)
    w.append(values[: n // 2])
    w.append(values[n // 2:])
    path, size = w.freeze()
    return path, size, values


def test_filename():
    assert snapshot_filename(SID) == "00000000000000001234-0000000005.checkpoint"
    assert parse_snapshot_filename("00000000000000001234-0000000005.checkpoint") == SID
    for bad in ["1234-5.checkpoint", "00000000000000001234-0000000005.checkpoint.part",
                "00000000000000001234-0000000005-abc.checkpoint.part", "x.log"]:
        assert parse_snapshot_filename(bad) is None


def test_round_trip_and_layout(tmp_path):
    path, size, values = write(tmp_path)
    assert os.path.basename(path) == snapshot_filename(SID)
    assert os.path.getsize(path) == size
    assert os.listdir(tmp_path) == [os.path.basename(path)]  # no .part left
    sid, header, it = read_snapshot(path)
    assert sid == SID
    assert header == cr.SnapshotHeader(777, "cluster-x")
    assert list(it) == values
    data = open(path, "rb").read()
    batches = list(b.iter_batches(data))
    assert len(batches) > 3  # batch_bytes_max bounded the data batches
    assert batches[0][1].is_control and batches[0][1].base_offset == 0
    assert batches[-1][1].is_control
    assert all(h.leader_epoch == 5 for _, h in batches)
    # offsets are contiguous from 0 within the file
    expected = 0
    for _, h in batches:
        assert h.base_offset == expected
        expected = h.next_offset
    assert expected == len(values) + 2


def test_empty_snapshot_is_valid(tmp_path):
    w = SnapshotWriter(str(tmp_path), SnapshotId(0, 0), 0)
    path, _ = w.freeze()
    sid, _, it = read_snapshot(path)
    assert sid == SnapshotId(0, 0) and list(it) == []


def test_writer_part_name_and_abort(tmp_path):
    w = SnapshotWriter(str(tmp_path), SID, 0)
    w.append([b"x"])
    (name,) = os.listdir(tmp_path)
    assert name.startswith("00000000000000001234-0000000005-") and name.endswith(".checkpoint.part")
    w.abort()
    assert os.listdir(tmp_path) == []


def test_every_truncation_is_refused(tmp_path):
    path, size, _ = write(tmp_path, n=12, batch_bytes_max=40)
    data = open(path, "rb").read()
    cut_path = os.path.join(tmp_path, "cut", snapshot_filename(SID))
    os.makedirs(os.path.dirname(cut_path))
    for cut in range(size):
        with open(cut_path, "wb") as f:
            f.write(data[:cut])
        with pytest.raises(CorruptSnapshotError) as ei:
            read_snapshot(cut_path)
        msg = str(ei.value)
        assert msg.startswith(f"{cut_path}: corrupt snapshot at byte ")
        assert any(w in msg for w in ("truncated", "empty file", "no SnapshotHeader")), msg


def test_every_flipped_byte_is_refused(tmp_path):
    path, size, _ = write(tmp_path, n=6, batch_bytes_max=40)
    data = open(path, "rb").read()
    bad = os.path.join(tmp_path, "bad")
    os.makedirs(bad)
    bad_path = os.path.join(bad, snapshot_filename(SID))
    for pos in range(size):
        flipped = bytearray(data)
        flipped[pos] ^= 0x10
        with open(bad_path, "wb") as f:
            f.write(flipped)
        with pytest.raises(CorruptSnapshotError, match=r": corrupt snapshot at byte \d+: "):
            verify_snapshot(bad_path)


def test_crc_error_names_position(tmp_path):
    path, _, _ = write(tmp_path, n=4, batch_bytes_max=10_000)
    data = bytearray(open(path, "rb").read())
    first = next(b.iter_batches(data))[1]
    second_pos = first.size
    data[second_pos + 70] ^= 1  # inside the data batch's records
    open(path, "wb").write(data)
    with pytest.raises(CorruptSnapshotError) as ei:
        read_snapshot(path)
    assert ei.value.position == second_pos
    assert "CRC mismatch" in str(ei.value)


def test_epoch_must_match_name(tmp_path):
    path, _, _ = write(tmp_path)
    other = os.path.join(tmp_path, snapshot_filename(SnapshotId(1234, 6)))
    os.rename(path, other)
    with pytest.raises(CorruptSnapshotError, match="batch epoch 5, snapshot epoch 6"):
        read_snapshot(other)


def test_missing_footer_and_data_first(tmp_path):
    path = os.path.join(tmp_path, snapshot_filename(SID))
    header = b.encode_batch(0, 5, [cr.encode_control(cr.SnapshotHeader(0))], 0, is_control=True)
    data = b.encode_batch(1, 5, [b"a", b"b"], 0)
    open(path, "wb").write(header + data)
    with pytest.raises(CorruptSnapshotError, match="truncated: no SnapshotFooter"):
        read_snapshot(path)
    open(path, "wb").write(b.encode_batch(0, 5, [b"a"], 0))
    with pytest.raises(CorruptSnapshotError, match="at byte 0: first batch is not a SnapshotHeader"):
        read_snapshot(path)
    footer = b.encode_batch(3, 5, [cr.encode_control(cr.SnapshotFooter())], 0, is_control=True)
    extra = b.encode_batch(4, 5, [b"z"], 0)
    open(path, "wb").write(header + data + footer + extra)
    with pytest.raises(CorruptSnapshotError, match="batch after the SnapshotFooter"):
        read_snapshot(path)


def test_bad_file_name(tmp_path):
    p = os.path.join(tmp_path, "snap.checkpoint")
    open(p, "wb").write(b"")
    with pytest.raises(CorruptSnapshotError, match="'snap.checkpoint' is not a snapshot file name"):
        read_snapshot(p)


def test_kafka_4_layout_with_the_voter_set_in_the_header_batch(tmp_path):
    """Kafka 4.x writes SnapshotHeader, KRaftVersion and KRaftVoters in one
    control batch (seen in Kafka 4.3.1's own checkpoints, bootstrap 0-0
    included); metalog writes the voter set in a batch of its own. Both
    verify, with the voter set; anything else in the header's batch is refused."""
    voters = cr.VotersRecord([cr.Voter(1, "AAAAAAAAAAAAAAAAAAAAAQ", [cr.VoterEndpoint("CONTROLLER", "h", 9093)])])
    head = [cr.encode_control(cr.SnapshotHeader(5)), cr.encode_control(cr.KRaftVersionRecord(1)),
            cr.encode_control(voters)]
    footer = b.encode_batch(3, 0, [cr.encode_control(cr.SnapshotFooter())], 5, is_control=True)
    kafka_bootstrap = b.encode_batch(0, 0, head, 5, is_control=True) + footer
    layout = verify_snapshot_bytes(kafka_bootstrap, SnapshotId(0, 0), "00000000000000000000-0000000000.checkpoint")
    assert layout.voters == voters and layout.records == 0
    odd = b.encode_batch(0, 0, head[:2], 5, is_control=True) + b.encode_batch(
        2, 0, [cr.encode_control(cr.SnapshotFooter())], 5, is_control=True)
    with pytest.raises(CorruptSnapshotError, match="holds more than the header and a voter set"):
        verify_snapshot_bytes(odd, SnapshotId(0, 0), "x.checkpoint")
