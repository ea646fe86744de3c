"""`metalog storage upgrade`: a format-version-1 or -2 data dir converted to
Kafka's records and metadata records (version 3), durably and idempotently; a
broker refuses an older dir and names the command."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import crc32c
import pytest

from metalog.broker.controller.state import Controller, ControllerState, load_snapshot
from metalog.broker.server.recovery import StartupError, check_meta
from metalog.storage import batch as b
from metalog.storage import metadata_records as mr
from metalog.storage import control_records as cr
from metalog.storage.format_upgrade import FORMAT_KEY, FormatError, convert_file, upgrade_data_dir
from metalog.storage.segments import SegmentedLog
from metalog.storage.snapshot import (SnapshotId, SnapshotStore, SnapshotWriter, read_snapshot, snapshot_filename,
                              verify_snapshot)
from tests.formats.v1 import v1_batch, v1_control, v2_metadata_value
from tests.storage.helpers import RecordingLogger
from metalog.tools.cluster.launcher import REPO_ROOT

PART = "__cluster_metadata-0"
TS = 1_700_000_000_000
DIR_ID = "AAECAwQFBgcICQoLDA0ODw"


def write_v1_dir(data_dir: str, cluster_id: str = "c1", node_id: int = 1, records: int = 200) -> list[bytes]:
    """meta.properties without a format version, two v1 segments (a
    LeaderChange control batch, data batches) and a v1 snapshot. Returns the
    data values in log order."""
    part = os.path.join(data_dir, PART)
    os.makedirs(part)
    with open(os.path.join(data_dir, "meta.properties"), "w") as fh:
        fh.write(f"version=1\ncluster.id={cluster_id}\nnode.id={node_id}\ndirectory.id={DIR_ID}\n")
    values = [f"value-{i:04d}".encode() * (1 + i % 7) for i in range(records)]
    segs = [bytearray(), bytearray()]
    segs[0] += v1_batch(0, 1, [v1_control(cr.LEADER_CHANGE, node_id, [node_id], [node_id])], TS, control=True)
    offset = 1
    for i in range(0, records, 10):
        target = segs[0] if i < records // 2 else segs[1]
        if target is segs[1] and not segs[1]:
            second_base = offset
        target += v1_batch(offset, 1, values[i:i + 10], TS + offset)
        offset += len(values[i:i + 10])
    with open(os.path.join(part, "00000000000000000000.log"), "wb") as fh:
        fh.write(segs[0])
    with open(os.path.join(part, f"{second_base:020d}.log"), "wb") as fh:
        fh.write(segs[1])
    snap = (v1_batch(0, 1, [v1_control(cr.SNAPSHOT_HEADER, TS, cluster_id)], TS, control=True)
            + v1_batch(1, 1, [b"snap-a", b"snap-b"], TS)
            + v1_batch(3, 1, [v1_control(cr.SNAPSHOT_FOOTER)], TS, control=True))
    with open(os.path.join(part, snapshot_filename(SnapshotId(1, 1))), "wb") as fh:
        fh.write(snap)
    return values


def log_values(part: str) -> list[bytes]:
    log = SegmentedLog.open(part)
    try:
        data = log.read(log.log_start_offset, log.log_end_offset, 1 << 30)
    finally:
        log.close()
    return [v for pos, h in b.iter_batches(data) if not h.is_control
            for v in b.decode_records(data[pos:pos + h.size], h)]


def test_a_v1_dir_with_data_is_refused_naming_its_version_and_the_command(tmp_path):
    """StartupError: 'data dir D is in metalog format version 1 ... metalog storage upgrade --data-dir D'."""
    write_v1_dir(str(tmp_path))
    before = (tmp_path / "meta.properties").read_text()
    with pytest.raises(StartupError, match=r"is in metalog format version 1 .*refusing to start.*"
                                           rf"metalog storage upgrade --data-dir {tmp_path}$"):
        check_meta(str(tmp_path), "c1", 1, RecordingLogger())
    assert (tmp_path / "meta.properties").read_text() == before


def test_a_newer_format_version_is_refused(tmp_path):
    (tmp_path / "meta.properties").write_text(f"version=1\ncluster.id=c1\nnode.id=1\n{FORMAT_KEY}=9\n")
    with pytest.raises(StartupError, match="format version 9 .*reads format version 3 only"):
        check_meta(str(tmp_path), "c1", 1, RecordingLogger())


def test_an_empty_v1_dir_is_stamped_at_boot(tmp_path):
    (tmp_path / "meta.properties").write_text(f"version=1\ncluster.id=c1\nnode.id=1\ndirectory.id={DIR_ID}\n")
    log = RecordingLogger()
    assert check_meta(str(tmp_path), "c1", 1, log) == DIR_ID
    assert f"{FORMAT_KEY}=3" in (tmp_path / "meta.properties").read_text()
    assert log.events("format_version_stamped")


def test_upgrade_converts_segments_and_snapshots_and_is_idempotent(tmp_path):
    values = write_v1_dir(str(tmp_path))
    part = tmp_path / PART
    (part / "00000000000000000000.index").write_bytes(b"\x00\x00\x00\x00\x00\x00\x00\x00")
    (part / "quorum-state").write_text(
        '{"data_version": 1, "leader_epoch": 1, "leader_id": 1, "voted_id": 1, "voters": [1]}')
    report = upgrade_data_dir(str(tmp_path))
    assert len(report.rewritten) == 4 and not report.unchanged and not report.already
    assert '"leaderEpoch": 1' in (part / "quorum-state").read_text()
    assert (part / "00000000000000000000.index").read_bytes() == b""  # rebuilt at open
    assert f"{FORMAT_KEY}=3" in (tmp_path / "meta.properties").read_text()
    assert check_meta(str(tmp_path), "c1", 1, RecordingLogger()) == DIR_ID
    assert log_values(str(part)) == values
    with open(part / "00000000000000000000.log", "rb") as fh:
        first = fh.read()
    [(_, h)] = list(b.iter_batches(first))[:1]
    assert cr.decode_control(b.decode_records(first[:h.size], h)[0]) == cr.LeaderChange(1, [1], [1])
    path = str(part / snapshot_filename(SnapshotId(1, 1)))
    verify_snapshot(path)
    _sid, header, recs = read_snapshot(path)
    assert header == cr.SnapshotHeader(TS, "c1") and list(recs) == [b"snap-a", b"snap-b"]
    snapshot = (part / snapshot_filename(SnapshotId(1, 1))).read_bytes()
    assert upgrade_data_dir(str(tmp_path)).already
    # An interrupted run (meta not yet stamped) finishes: converted files are kept as they are.
    (tmp_path / "meta.properties").write_text(f"version=1\ncluster.id=c1\nnode.id=1\ndirectory.id={DIR_ID}\n")
    again = upgrade_data_dir(str(tmp_path))
    assert len(again.unchanged) == 4 and not again.rewritten
    assert (part / snapshot_filename(SnapshotId(1, 1))).read_bytes() == snapshot


def test_upgrade_refuses_a_corrupt_batch_and_rewrites_nothing_of_that_file(tmp_path):
    """The user sees the file and byte of the damage; the file is left as it was."""
    write_v1_dir(str(tmp_path))
    seg = tmp_path / PART / "00000000000000000000.log"
    raw = bytearray(seg.read_bytes())
    raw[200] ^= 0x10
    seg.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match=rf"{seg}: corrupt batch at byte \d+: CRC mismatch"):
        convert_file(str(seg))
    assert seg.read_bytes() == bytes(raw)
    proc = subprocess.run([sys.executable, "-m", "metalog.tools.cli", "storage", "upgrade", "--data-dir", str(tmp_path)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert f"metalog storage upgrade: {seg}: corrupt batch at byte" in proc.stderr
    assert "version=1" in (tmp_path / "meta.properties").read_text()
    assert FORMAT_KEY not in (tmp_path / "meta.properties").read_text()


# ---------------------------------------------------------------- version 2 -> 3

def _u(n: int) -> str:
    return f"00000000-0000-4000-8000-{n:012x}"


def v2_workload() -> list:
    """Metadata records of every type a version-2 controller wrote, in an order
    the state machine accepts, with one produced (non-metadata) value."""
    t1, t2, acl1, acl2 = _u(1), _u(2), _u(3), _u(4)
    return [
        mr.FeatureLevel("metadata.version", 7),
        mr.RegisterBroker(1, _u(11), 1, (mr.Endpoint("PLAINTEXT", "127.0.0.1", 9192),), "r1", False),
        mr.RegisterBroker(2, _u(12), 1, (mr.Endpoint("SSL", "127.0.0.1", 9193),), None, False),
        mr.RegisterBroker(3, _u(13), 1, (), None, False),
        mr.Topic("orders", t1),
        mr.Partition(t1, 0, (1, 2, 3), (1, 2, 3), 1),
        mr.Partition(t1, 1, (2, 3, 1), (2, 3, 1), 2),
        mr.Topic("gone", t2),
        mr.Partition(t2, 0, (3,), (3,), 3),
        mr.Config(mr.RESOURCE_TOPIC, "orders", "retention.ms", "86400000"),
        mr.Config(mr.RESOURCE_BROKER, "", "log.level", "INFO"),
        b"a produced value, kept byte for byte",
        mr.FenceBroker(1, 1),
        mr.PartitionChange(t1, 1, (2, 3), mr.LEADER_NO_CHANGE),
        mr.UnfenceBroker(1, 1),
        mr.PartitionChange(t1, 0, leader=3),
        mr.AccessControlEntry(acl1, 2, "orders", 3, "User:alice", "*", 4, 3),
        mr.AccessControlEntry(acl2, 4, "kafka-cluster", 3, "User:bob", "*", 8, 3),
        mr.RemoveAccessControlEntry(acl2),
        mr.RemoveTopic(t2),
        mr.NoOp(),
        mr.Config(mr.RESOURCE_BROKER, "", "log.level", None),
        mr.UnregisterBroker(3, 1),
    ]


def _value_v2(x) -> bytes:
    return x if isinstance(x, bytes) else v2_metadata_value(x)


def as_v3(x):
    """What the upgrade makes of a version-2 item: a FenceBroker, whose apply
    shrank ISRs then, becomes FenceBrokerImplicit, which still does."""
    return mr.FenceBrokerImplicit(x.id, x.epoch) if type(x) is mr.FenceBroker else x


def value_v3(x) -> bytes:
    return x if isinstance(x, bytes) else mr.encode_record(as_v3(x))


def expected_state(items, end: int) -> ControllerState:
    """The state a version-2 build had of a log holding `items` at offsets 1..
    (offset 0: a LeaderChange)."""
    st = ControllerState()
    st.skip_to(1)
    for i, x in enumerate(items[:end - 1]):
        if isinstance(x, bytes):
            st.apply_value(1 + i, x)
        else:
            assert st.apply(1 + i, as_v3(x)), st.last_invalid
    return st


def write_v2_dir(data_dir: str, items, cluster_id: str = "c1", node_id: int = 1,
                 snapshot_at: int | None = None) -> None:
    """A format-version-2 dir: Kafka's records and control records, metadata
    values in the version-2 encoding, and optionally a snapshot of the state
    at `snapshot_at` in that encoding."""
    part = os.path.join(data_dir, PART)
    os.makedirs(part)
    with open(os.path.join(data_dir, "meta.properties"), "w") as fh:
        fh.write(f"version=1\ncluster.id={cluster_id}\nnode.id={node_id}\ndirectory.id={DIR_ID}\n"
                 f"{FORMAT_KEY}=2\n")
    seg = bytearray(b.encode_batch(0, 1, [cr.encode_control(cr.LeaderChange(node_id, [node_id]))], TS,
                                   is_control=True))
    values = [_value_v2(x) for x in items]
    for i in range(0, len(values), 4):
        seg += b.encode_batch(1 + i, 1, values[i:i + 4], TS + i)
    with open(os.path.join(part, "00000000000000000000.log"), "wb") as fh:
        fh.write(seg)
    if snapshot_at is not None:
        st = expected_state(items, snapshot_at)
        w = SnapshotWriter(part, SnapshotId(snapshot_at, 1), TS, cluster_id)
        w.write_all(v2_metadata_value(rec) for rec in st.to_records())


def test_a_v2_dir_with_data_is_refused_naming_its_version_and_the_command(tmp_path):
    """StartupError: 'data dir D is in metalog format version 2 (.../meta.properties:
    metalog.format.version=2); this build reads format version 3 ... metalog storage upgrade --data-dir D'."""
    write_v2_dir(str(tmp_path), v2_workload())
    with pytest.raises(StartupError, match=rf"is in metalog format version 2 \(.*{FORMAT_KEY}=2\); this build "
                                           r"reads format version 3 .*refusing to start.*"
                                           rf"metalog storage upgrade --data-dir {tmp_path}$"):
        check_meta(str(tmp_path), "c1", 1, RecordingLogger())


def test_upgrade_2_to_3_reencodes_every_metadata_value_and_keeps_the_state(tmp_path):
    items = v2_workload()
    write_v2_dir(str(tmp_path), items, snapshot_at=13)
    part = str(tmp_path / PART)
    report = upgrade_data_dir(str(tmp_path))
    assert len(report.rewritten) == 2 and not report.already
    assert f"{FORMAT_KEY}=3" in (tmp_path / "meta.properties").read_text()
    assert check_meta(str(tmp_path), "c1", 1, RecordingLogger()) == DIR_ID
    got = log_values(part)
    assert got == [value_v3(x) for x in items]
    assert [mr.decode_record(v) for v in got if not v.startswith(b"a produced")] == \
        [as_v3(x) for x in items if not isinstance(x, bytes)]
    assert mr.FenceBrokerImplicit(1, 1) in [mr.decode_record(v) for v in got if v[0] == 1]
    # The snapshot loads with the new codec into the state at its offset, and
    # the whole log replays into the state the version-2 build had.
    store = SnapshotStore(part)
    snap = load_snapshot(store, SnapshotId(13, 1))
    assert snap == expected_state(items, 13)
    c = Controller()
    log = SegmentedLog.open(part)
    try:
        c.apply_batches(log.read(0, log.log_end_offset, 1 << 30))
    finally:
        log.close()
    assert c.state == expected_state(items, len(items) + 1)
    assert c.state.invalid_records == 1  # the produced value, as before the upgrade
    # Rerun: nothing left to do; an interrupted run (meta not stamped) changes no byte.
    assert upgrade_data_dir(str(tmp_path)).already
    (tmp_path / "meta.properties").write_text(f"version=1\ncluster.id=c1\nnode.id=1\n{FORMAT_KEY}=2\n")
    again = upgrade_data_dir(str(tmp_path))
    assert len(again.unchanged) == 2 and not again.rewritten


def test_upgrade_1_to_3_in_one_run(tmp_path):
    """A version-1 dir whose batches hold version-2 metadata values comes out in version 3."""
    items = v2_workload()
    part = tmp_path / PART
    part.mkdir()
    (tmp_path / "meta.properties").write_text(f"version=1\ncluster.id=c1\nnode.id=1\ndirectory.id={DIR_ID}\n")
    (part / "00000000000000000000.log").write_bytes(
        v1_batch(0, 1, [v1_control(cr.LEADER_CHANGE, 1, [1], [1])], TS, control=True)
        + v1_batch(1, 1, [_value_v2(x) for x in items], TS))
    report = upgrade_data_dir(str(tmp_path))
    assert len(report.rewritten) == 1
    assert f"{FORMAT_KEY}=3" in (tmp_path / "meta.properties").read_text()
    assert log_values(str(part)) == [value_v3(x) for x in items]


def test_upgrade_refuses_a_record_kafka_cannot_encode(tmp_path):
    """A version-2 topic whose id is not a uuid cannot be written as Kafka's
    16 bytes: FormatError names the file, byte and offset; nothing is rewritten."""
    write_v2_dir(str(tmp_path), [mr.Topic("t", "T")])
    seg = tmp_path / PART / "00000000000000000000.log"
    before = seg.read_bytes()
    with pytest.raises(FormatError, match=rf"{seg}: batch at byte \d+ \(offset 1\) cannot be converted to "
                                          r"format version 3: its Topic record has no Kafka encoding: "
                                          r"not a uuid: 'T'"):
        upgrade_data_dir(str(tmp_path))
    assert seg.read_bytes() == before
    assert f"{FORMAT_KEY}=2" in (tmp_path / "meta.properties").read_text()


def test_an_upgrade_interrupted_after_a_segment_rewrite_leaves_no_stale_index(tmp_path):
    """A run that crashed after rewriting a segment but before emptying its
    index left version-1 positions in the .index; the rerun finds the segment
    converted already and must still empty that index: every record then
    reads back (a stale index would send reads mid-batch)."""
    values = write_v1_dir(str(tmp_path), records=400)
    part = tmp_path / PART
    seg = part / "00000000000000000000.log"
    v1_positions = [pos for pos, _h in b.iter_batches(seg.read_bytes())][1:6]
    # The index a broker of version 1 wrote: (relative offset, position) of some batches.
    stale = b"".join(struct.pack(">II", 1 + 10 * i, p) for i, p in enumerate(v1_positions))
    (part / "00000000000000000000.index").write_bytes(stale)
    assert convert_file(str(seg)) == (True, 21)  # the crash came right after this
    assert (part / "00000000000000000000.index").read_bytes() == stale
    report = upgrade_data_dir(str(tmp_path))
    assert str(seg) in report.unchanged
    assert (part / "00000000000000000000.index").read_bytes() == b""
    assert log_values(str(part)) == values


@pytest.mark.parametrize("damage, why", [
    ("short control", "version-1 control record of 2 bytes is too short for its type and version"),
    ("bad voters body", "control record type 6"),
    ("attribute bits", "attributes 0x4: versions 1 and 2 set no bit but the control bit"),
])
def test_damaged_version_1_batches_get_a_format_error_naming_file_and_byte(tmp_path, damage, why):
    """What the user sees (`metalog storage upgrade`): FormatError '<file>: batch
    at byte N (offset O) cannot be converted to format version 3: <why>', never a
    traceback; the file is left as it was and a rerun says the same."""
    write_v1_dir(str(tmp_path))
    seg = tmp_path / PART / "00000000000000000000.log"
    raw = seg.read_bytes()
    end = len(raw)
    if damage == "short control":
        bad = v1_batch(10_000, 1, [b"\x00\x06"], TS, control=True)
    elif damage == "bad voters body":
        bad = v1_batch(10_000, 1, [struct.pack(">hh", cr.KRAFT_VOTERS, 0) + b"\x00\x00\x05"], TS, control=True)
    else:
        hdr = bytearray(v1_batch(10_000, 1, [b"x"], TS))
        attrs_at = b.CRC_OFFSET + 4
        struct.pack_into(">h", hdr, attrs_at, 0x4)
        crc = crc32c.crc32c(bytes(hdr[b.CRC_START:]))
        struct.pack_into(">I", hdr, b.CRC_OFFSET, crc)
        bad = bytes(hdr)
    seg.write_bytes(raw + bad)
    with pytest.raises(FormatError) as err:
        upgrade_data_dir(str(tmp_path))
    assert str(err.value).startswith(f"{seg}: batch at byte {end} (offset 10000) cannot be converted to format version 3: ")
    assert why in str(err.value)
    assert seg.read_bytes() == raw + bad
    assert FORMAT_KEY not in (tmp_path / "meta.properties").read_text()
