"""Storage integrity (issue 12): recovery point, full verification after an
unclean stop across all segments, quarantine of corrupt segments, verified reads."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from metalog.storage.batch import CorruptBatchError
from metalog.storage.errors import CorruptLogError, QuarantineState
from metalog.storage.segments import QUARANTINE_FILE, RECOVERY_POINT_FILE, SegmentedLog, segment_file_name
from tests.storage.helpers import RecordingLogger, append_batches
from tests.storage.test_recovery import BATCH_BYTES, INTERVAL, SEG_MAX, flip_bit

# Segments of 7 batches (21 offsets): 0, 21, 42. Byte 203 of a segment lies in
# its second batch, well before its last index entry (index every 300 bytes).
MID_BATCH_POS = BATCH_BYTES + 70  # in the records, covered by the CRC


def open_log(path, logger=None, **kw):
    return SegmentedLog.open(path, segment_bytes_max=SEG_MAX, index_interval_bytes=INTERVAL,
                             logger=logger or RecordingLogger(), **kw)


@pytest.fixture
def unflushed(tmp_path):
    """3 segments, 17 batches, copied while open and before any flush: a crash
    with the recovery point still at 0."""
    src = tmp_path / "src"
    log = open_log(src)
    batches = append_batches(log, 17)
    shutil.copytree(src, tmp_path / "crashed")
    log.close()
    return tmp_path / "crashed", batches


def test_unclean_open_finds_a_bit_flip_in_the_body_of_a_sealed_segment(unflushed):
    """The bug of issue 12: the flipped bit sits before the last index entry of
    the FIRST segment; the user sees CorruptLogError naming file, byte and offset."""
    d, _ = unflushed
    path = str(d / segment_file_name(0))
    flip_bit(path, MID_BATCH_POS)
    logger = RecordingLogger()
    with pytest.raises(CorruptLogError, match=rf"corrupt batch in {path} at byte {BATCH_BYTES} \(base offset 3\)") as info:
        open_log(d, logger)
    r = info.value.report
    assert (r.path, r.position, r.base_offset, r.leader_epoch) == (path, BATCH_BYTES, 3, 1)
    assert r.expected_crc is not None and r.actual_crc is not None and r.expected_crc != r.actual_crc
    assert "CRC mismatch" in r.reason


def test_unclean_open_quarantines_the_damaged_segment_and_all_later_ones(unflushed):
    d, batches = unflushed
    path = str(d / segment_file_name(0))
    flip_bit(path, MID_BATCH_POS)
    logger = RecordingLogger()
    log = open_log(d, logger, on_corruption="quarantine")
    # Truncated to the last good batch: the first batch (offsets 0..2) stays.
    assert log.log_end_offset == 3
    assert log.read(0, 3, 1 << 20) == batches[0]
    q = log.quarantine
    assert q is not None and q.must_reach_offset == 51  # the end it had before
    assert q.reports[0].path == path and q.reports[0].position == BATCH_BYTES
    names = sorted(os.listdir(d))
    for base in (0, 21, 42):
        assert segment_file_name(base) + ".corrupt" in names
        assert segment_file_name(base, ".index") + ".corrupt" in names
    (event,) = logger.events("corruption_detected")
    assert event["file"] == path and event["position"] == BATCH_BYTES and event["offset"] == 3
    # The state was persisted before the renames; appends go on from offset 3.
    assert QuarantineState.from_bytes((d / QUARANTINE_FILE).read_bytes()) == q
    assert log.startup_reports == [q.reports[0]]
    append_batches(log, 2)
    log.close()
    logger = RecordingLogger()
    log = open_log(d, logger, on_corruption="quarantine")
    assert log.quarantine == q and log.log_end_offset == 9
    assert logger.events("unknown_file_ignored") == []
    log.clear_quarantine()
    assert log.quarantine is None and not (d / QUARANTINE_FILE).exists()
    log.close()


def test_quarantine_twice_keeps_both_corrupt_copies(unflushed):
    """A second quarantine of a segment with the same name gets a .corrupt.1 suffix: nothing is overwritten."""
    d, _ = unflushed
    flip_bit(str(d / segment_file_name(0)), MID_BATCH_POS)
    log = open_log(d, on_corruption="quarantine")
    append_batches(log, 4)  # offsets 3..14 in a new 00..0.log
    flip_bit(str(d / segment_file_name(0)), 3 * BATCH_BYTES + 70)
    with pytest.raises(CorruptBatchError) as info:
        log.read(0, 15, 1 << 20)
    report = info.value.report
    assert report.position == 3 * BATCH_BYTES and report.base_offset == 9
    state = log.quarantine_from(report)
    assert state.must_reach_offset == 51 and len(state.reports) == 2  # merged: max of both ends
    assert log.log_end_offset == 9
    assert (d / (segment_file_name(0) + ".corrupt.1")).exists()
    log.close()


def test_zeroed_range_inside_a_sealed_segment_is_corruption_not_a_torn_tail(unflushed):
    d, _ = unflushed
    path = str(d / segment_file_name(21))
    with open(path, "r+b") as f:
        f.seek(2 * BATCH_BYTES)
        f.write(b"\0" * BATCH_BYTES)
    with pytest.raises(CorruptLogError, match=rf"corrupt batch in {path} at byte {2 * BATCH_BYTES} \(base offset 27\)"):
        open_log(d)


def test_zeroed_tail_of_the_last_segment_is_cut_after_an_unclean_stop(unflushed):
    d, batches = unflushed
    path = d / segment_file_name(42)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size - BATCH_BYTES)
        f.write(b"\0" * BATCH_BYTES)
    logger = RecordingLogger()
    log = open_log(d, logger)
    assert log.log_end_offset == 48
    assert log.read(0, 48, 1 << 20) == b"".join(batches[:16])
    assert logger.events("log_recovered")[0]["truncated_bytes"] == BATCH_BYTES
    log.close()


def test_recovery_point_moves_on_roll_and_bounds_the_unclean_verification(tmp_path):
    src = tmp_path / "src"
    log = open_log(src)
    append_batches(log, 17)
    log.flush()  # syncs the two rolled segments: the recovery point moves
    assert log.recovery_point == 51
    append_batches(log, 2)
    log.flush()  # no roll: the checkpoint file is not rewritten
    assert log.recovery_point == 51
    assert (src / RECOVERY_POINT_FILE).read_text() == "0\n1\n__cluster_metadata 0 51\n"
    crashed = tmp_path / "crashed"
    shutil.copytree(src, crashed)
    log.close()
    assert (src / RECOVERY_POINT_FILE).read_text().endswith(" 57\n")
    # A bit flip in a segment wholly below the recovery point is not re-read at
    # open (the scrubber finds it); the last segment is verified in full.
    flip_bit(str(crashed / segment_file_name(0)), MID_BATCH_POS)
    logger = RecordingLogger()
    log = open_log(crashed, logger)
    (ev,) = logger.events("log_verified")
    assert ev["from_offset"] == 51 and ev["bytes"] == (crashed / segment_file_name(42)).stat().st_size
    with pytest.raises(CorruptBatchError):
        log.read(0, 57, 1 << 20)
    log.close()


def test_truncation_below_the_recovery_point_lowers_it_first(tmp_path):
    log = open_log(tmp_path)
    append_batches(log, 17)
    log.flush()
    assert log.recovery_point == 51
    log.truncate_to(30)
    assert log.recovery_point == 30 and log.log_end_offset == 30
    assert (tmp_path / RECOVERY_POINT_FILE).read_text().endswith(" 30\n")
    log.close()


def test_clean_open_keeps_the_cheap_check(tmp_path):
    log = open_log(tmp_path)
    append_batches(log, 17)
    log.close()
    flip_bit(str(tmp_path / segment_file_name(0)), MID_BATCH_POS)
    logger = RecordingLogger()
    log = open_log(tmp_path, logger)  # no full scan after a clean stop
    assert logger.events("log_verified") == [] and log.log_end_offset == 51
    log.close()


def test_read_verifies_every_batch_and_never_returns_damaged_bytes(tmp_path):
    """read() raises CorruptBatchError whose report names file, byte, offset, epoch and both CRCs."""
    log = open_log(tmp_path)
    batches = append_batches(log, 17)
    path = str(tmp_path / segment_file_name(21))
    flip_bit(path, MID_BATCH_POS)
    assert log.read(0, 21, 1 << 20) == b"".join(batches[:7])  # the good range still reads
    with pytest.raises(CorruptBatchError, match=rf"corrupt batch in {path} at byte {BATCH_BYTES}") as info:
        log.read(21, 51, 1 << 20)
    r = info.value.report
    assert (r.path, r.position, r.base_offset, r.leader_epoch) == (path, BATCH_BYTES, 24, 1)
    assert r.expected_crc != r.actual_crc
    fields = r.as_log_fields()
    assert fields["expected_crc"].startswith("0x") and fields["file"] == path
    log.close()
    log = open_log(tmp_path, verify_reads=False)  # opt-out returns the bytes as they are
    assert len(log.read(21, 51, 1 << 20)) == 10 * BATCH_BYTES
    log.close()


def test_malformed_quarantine_state_refuses_to_open(tmp_path):
    """A quarantine-state file that cannot be read is never guessed at: CorruptLogError names it."""
    log = open_log(tmp_path)
    log.close()
    (tmp_path / QUARANTINE_FILE).write_text(json.dumps({"version": 1, "must_reach_offset": -1}))
    with pytest.raises(CorruptLogError, match="malformed quarantine-state file"):
        open_log(tmp_path)


def test_leader_epoch_checkpoint_carries_a_checksum(tmp_path):
    """A bit flip that still parses (epoch 3 -> 7) is refused with
    EpochCheckpointError naming the file; files without the line still read."""
    from metalog.storage.epochs import EpochCheckpointError, EpochHistory, read_checkpoint, write_checkpoint

    path = tmp_path / "leader-epoch-checkpoint"
    history = EpochHistory([(1, 0), (3, 120)])
    write_checkpoint(path, history)
    raw = path.read_bytes()
    assert raw.startswith(b"0\n2\n1 0\n3 120\ncrc32c 0x") and read_checkpoint(path) == history
    path.write_bytes(raw.replace(b"3 120", b"7 120"))  # '3' ^ '7' is one bit
    with pytest.raises(EpochCheckpointError, match=rf"^{path}: checksum mismatch \(stored 0x[0-9a-f]{{8}}, computed"):
        read_checkpoint(path)
    path.write_bytes(b"0\n2\n1 0\n3 120\n")  # an older writer's file
    assert read_checkpoint(path) == history


def test_quarantined_files_of_any_kind_are_not_unknown(tmp_path):
    log = open_log(tmp_path)
    log.close()
    for name in ("leader-epoch-checkpoint.corrupt", "00000000000000000010-0000000001.checkpoint.corrupt",
                 "00000000000000000000.log.corrupt.2"):
        (tmp_path / name).write_bytes(b"x")
    logger = RecordingLogger()
    open_log(tmp_path, logger).close()
    assert logger.events("unknown_file_ignored") == []
