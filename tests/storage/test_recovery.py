"""Crash recovery on open: torn tails, bit flips, lost indexes, stray files."""

from __future__ import annotations

import os
import shutil

import pytest

from metalog.storage.errors import CorruptLogError
from metalog.storage.segments import CLEAN_SHUTDOWN_FILE, SegmentedLog, segment_file_name
from tests.storage.helpers import RecordingLogger, append_batches, base_offsets

SEG_MAX = 1000  # 7 batches of 142 bytes per segment
INTERVAL = 300
BATCH_BYTES = 142
EPOCH_FIELD = range(12, 16)  # not covered by the CRC (as in Kafka): see storage/segments/scan.py


def open_log(path, logger=None):
    return SegmentedLog.open(path, segment_bytes_max=SEG_MAX, index_interval_bytes=INTERVAL,
                             logger=logger or RecordingLogger())


@pytest.fixture
def crashed(tmp_path):
    """A flushed log of 3 segments (0, 21, 42) and 17 batches, left without a
    clean shutdown (the directory is copied while the log is open)."""
    src = tmp_path / "src"
    log = open_log(src)
    batches = append_batches(log, 17)
    log.flush()
    shutil.copytree(src, tmp_path / "crashed")
    log.close()
    return tmp_path / "crashed", batches


def fresh_copy(src, dst):
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


def flip_bit(path, position, bit=0):
    with open(path, "r+b") as f:
        f.seek(position)
        b = f.read(1)[0]
        f.seek(position)
        f.write(bytes([b ^ (1 << bit)]))


def test_unclean_open_of_a_whole_log_keeps_everything(crashed):
    d, batches = crashed
    logger = RecordingLogger()
    log = open_log(d, logger)
    assert log.log_end_offset == 51 and log.flushed_end_offset == 51
    assert log.read(0, 51, 1 << 20) == b"".join(batches)
    assert logger.events("log_recovered") == []
    log.close()


def test_torn_tail_at_every_byte_of_the_last_batch(crashed, tmp_path):
    d, batches = crashed
    last = d / segment_file_name(42)
    size = os.path.getsize(last)
    last_start = size - BATCH_BYTES
    for cut in range(last_start, size):
        work = fresh_copy(d, tmp_path / "work")
        os.truncate(work / segment_file_name(42), cut)
        logger = RecordingLogger()
        log = open_log(work, logger)
        assert log.log_end_offset == 48, cut
        assert log.read(0, 100, 1 << 20) == b"".join(batches[:16])
        events = logger.events("log_recovered")
        if cut == last_start:
            assert events == []
        else:
            assert len(events) == 1
            assert events[0]["truncated_bytes"] == cut - last_start
            assert events[0]["from_offset"] == 48
            assert events[0]["segment"] == str(work / segment_file_name(42))
        assert os.path.getsize(work / segment_file_name(42)) == last_start
        # The log is whole again: appends continue at 48.
        append_batches(log, 1)
        log.close()


def test_zero_filled_tail_is_truncated(crashed):
    d, batches = crashed
    with open(d / segment_file_name(42), "ab") as f:
        f.write(b"\0" * 5000)  # file size grew but the data never reached the disk
    logger = RecordingLogger()
    log = open_log(d, logger)
    assert log.log_end_offset == 51
    assert logger.events("log_recovered")[0]["truncated_bytes"] == 5000
    log.close()


def test_bit_flip_in_a_middle_batch_is_a_named_error(crashed, tmp_path):
    d, _ = crashed
    # last segment holds batches 42, 45, 48; corrupt 45 (bytes 142..283)
    for rel in range(BATCH_BYTES):
        if rel in EPOCH_FIELD:
            continue
        work = fresh_copy(d, tmp_path / "work")
        path = work / segment_file_name(42)
        flip_bit(path, BATCH_BYTES + rel, bit=rel % 8)
        with pytest.raises(CorruptLogError) as info:
            open_log(work)
        msg = str(info.value)
        assert f"corrupt batch in {path} at byte {BATCH_BYTES} (base offset 45)" in msg, (rel, msg)
        assert "not a torn tail" in msg
        assert (info.value.path, info.value.position, info.value.base_offset) == (str(path), BATCH_BYTES, 45)


def test_bit_flip_in_the_last_batch_is_truncated_and_reported(crashed, tmp_path):
    d, batches = crashed
    for rel in range(BATCH_BYTES):
        if rel in EPOCH_FIELD:
            continue
        work = fresh_copy(d, tmp_path / "work")
        flip_bit(work / segment_file_name(42), 2 * BATCH_BYTES + rel, bit=(rel * 3) % 8)
        logger = RecordingLogger()
        log = open_log(work, logger)
        assert log.log_end_offset == 48, rel
        assert log.read(0, 100, 1 << 20) == b"".join(batches[:16])
        (event,) = logger.events("log_recovered")
        assert event["truncated_bytes"] == BATCH_BYTES and event["from_offset"] == 48
        log.close()


def test_corruption_in_a_non_last_segment_is_an_error(crashed):
    d, _ = crashed
    path = d / segment_file_name(21)
    # batch 39 is the last of segment 21, after its last index entry: the open check reads it
    flip_bit(path, 6 * BATCH_BYTES + 70)
    with pytest.raises(CorruptLogError, match=rf"corrupt batch in {path} at byte {6 * BATCH_BYTES} "
                                              r"\(base offset 39\).*not the last segment"):
        open_log(d)


def test_corruption_early_in_a_segment_is_found_when_its_index_is_rebuilt(crashed):
    d, _ = crashed
    path = d / segment_file_name(0)
    flip_bit(path, 70)
    os.unlink(d / segment_file_name(0, ".index"))
    with pytest.raises(CorruptLogError, match=rf"corrupt batch in {path} at byte 0 \(base offset 0\)"):
        open_log(d)


def test_torn_non_last_segment_is_an_error(crashed):
    d, _ = crashed
    path = d / segment_file_name(21)
    os.truncate(path, os.path.getsize(path) - 10)
    with pytest.raises(CorruptLogError, match=rf"corrupt batch in {path} at byte {6 * BATCH_BYTES}"):
        open_log(d)


@pytest.mark.parametrize("clean", [True, False])
def test_missing_index_is_rebuilt(tmp_path, clean):
    log = open_log(tmp_path)
    append_batches(log, 17)
    originals = {b: (tmp_path / segment_file_name(b, ".index")).read_bytes() for b in (0, 21, 42)}
    log.close()
    if not clean:
        os.unlink(tmp_path / CLEAN_SHUTDOWN_FILE)
    for b in (0, 21, 42):
        os.unlink(tmp_path / segment_file_name(b, ".index"))
    logger = RecordingLogger()
    log = open_log(tmp_path, logger)
    for b in (0, 21, 42):
        assert (tmp_path / segment_file_name(b, ".index")).read_bytes() == originals[b]
    rebuilt = {e["segment"] for e in logger.events("index_rebuilt")}
    assert str(tmp_path / segment_file_name(0, ".index")) in rebuilt
    assert str(tmp_path / segment_file_name(21, ".index")) in rebuilt
    assert base_offsets(log.read(25, 40, 1 << 20)) == [24, 27, 30, 33, 36]
    log.close()


def test_garbage_index_is_rebuilt(tmp_path):
    log = open_log(tmp_path)
    append_batches(log, 17)
    original = (tmp_path / segment_file_name(0, ".index")).read_bytes()
    log.close()
    (tmp_path / segment_file_name(0, ".index")).write_bytes(b"\0" * 16)
    logger = RecordingLogger()
    log = open_log(tmp_path, logger)
    assert (tmp_path / segment_file_name(0, ".index")).read_bytes() == original
    assert logger.events("index_rebuilt")
    log.close()


def test_unknown_files_are_left_alone_and_logged(tmp_path):
    log = open_log(tmp_path)
    append_batches(log, 3)
    log.close()
    (tmp_path / "notes.txt").write_text("keep me")
    (tmp_path / "subdir").mkdir()
    logger = RecordingLogger()
    log = open_log(tmp_path, logger)
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    assert (tmp_path / "subdir").is_dir()
    paths = sorted(e["path"] for e in logger.events("unknown_file_ignored"))
    assert paths == [str(tmp_path / "notes.txt"), str(tmp_path / "subdir")]
    assert log.log_end_offset == 9
    log.close()


def test_the_brokers_own_files_in_the_log_dir_are_not_warned_about(tmp_path):
    """A restart must not warn `unknown_file_ignored` about the quorum-state, the
    leader-epoch checkpoint or snapshots that share the partition directory; a
    stranger's file still is."""
    log = open_log(tmp_path)
    append_batches(log, 2)
    log.close()
    own = ["quorum-state", "quorum-state.tmp", "leader-epoch-checkpoint", "leader-epoch-checkpoint.tmp",
           "00000000000000000005-0000000001.checkpoint",
           "00000000000000000005-0000000001-0123abcd.checkpoint.part",
           "00000000000000000005-0000000001-fetch.checkpoint.part",
           "00000000000000000003-0000000001.checkpoint.deleted"]
    for name in own + ["00000000000000000005.checkpoint"]:
        (tmp_path / name).write_text("x")
    logger = RecordingLogger()
    log = open_log(tmp_path, logger)
    assert [e["path"] for e in logger.events("unknown_file_ignored")] == [
        str(tmp_path / "00000000000000000005.checkpoint")]
    assert all((tmp_path / name).read_text() == "x" for name in own)
    log.close()


def test_clean_shutdown_marker_is_consumed_on_open(tmp_path):
    log = open_log(tmp_path)
    append_batches(log, 3)
    log.close()
    assert (tmp_path / CLEAN_SHUTDOWN_FILE).exists()
    log = open_log(tmp_path)
    assert not (tmp_path / CLEAN_SHUTDOWN_FILE).exists()
    log.close()


def test_clean_marker_with_a_torn_tail_still_recovers(tmp_path):
    log = open_log(tmp_path)
    append_batches(log, 3)
    log.close()
    os.truncate(tmp_path / segment_file_name(0), 2 * BATCH_BYTES + 50)
    logger = RecordingLogger()
    log = open_log(tmp_path, logger)
    assert log.log_end_offset == 6
    assert logger.events("log_recovered")[0]["truncated_bytes"] == 50
    log.close()


def test_empty_segment_left_by_a_crash_after_a_roll_is_removed(crashed):
    d, batches = crashed
    # The crash cut the unflushed end of segment 42 and left the next, empty segment.
    os.truncate(d / segment_file_name(42), BATCH_BYTES + 7)
    (d / segment_file_name(51)).write_bytes(b"")
    logger = RecordingLogger()
    log = open_log(d, logger)
    assert log.log_end_offset == 45
    assert not (d / segment_file_name(51)).exists()
    assert logger.events("empty_segment_removed")
    assert log.read(0, 100, 1 << 20) == b"".join(batches[:15])
    log.close()


def test_log_start_past_the_recovered_end_restarts_empty_there(crashed):
    d, _ = crashed
    (d / "log-start-offset").write_text('{"data_version": 1, "log_start_offset": 60}')
    logger = RecordingLogger()
    log = open_log(d, logger)
    assert (log.log_start_offset, log.log_end_offset) == (60, 60)
    assert logger.events("log_start_past_end")
    log.close()


def test_malformed_log_start_file_is_a_named_error(crashed):
    d, _ = crashed
    (d / "log-start-offset").write_text("forty-two")
    with pytest.raises(CorruptLogError, match=rf"{d / 'log-start-offset'}: malformed log-start-offset file"):
        open_log(d)
