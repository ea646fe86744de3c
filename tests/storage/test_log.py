"""SegmentedLog operations: append, read, roll, index, flush, truncate, log start."""

from __future__ import annotations

import os
import threading

import pytest

from metalog.storage.batch import HEADER_SIZE, CorruptBatchError, decode_header, encode_batch
from metalog.storage.segments import SegmentedLog, segment_file_name
from metalog.storage.segments.segmented_log import RECENT_APPENDS_MAX
from tests.storage.helpers import RecordingLogger, append_batches, base_offsets, batch

BATCH_BYTES = len(batch(0))  # 142: 3 records of 20 bytes
SEG_MAX = 1000  # 7 batches per segment
INTERVAL = 300


def open_log(path, **kw):
    kw.setdefault("segment_bytes_max", SEG_MAX)
    kw.setdefault("index_interval_bytes", INTERVAL)
    kw.setdefault("logger", RecordingLogger())
    return SegmentedLog.open(path, **kw)


def expected_read(batches: list[bytes], start: int, end: int, max_bytes: int) -> bytes:
    """The LogReader.read contract computed from the list of appended batches."""
    out, total = [], 0
    offset = 0
    started = False
    for b in batches:
        n = int.from_bytes(b[57:61], "big")  # records_count
        nxt = offset + n
        offset = nxt
        if not started:
            if nxt <= start:
                continue
            started = True
        if nxt > end or (total and total + len(b) > max_bytes):
            break
        out.append(b)
        total += len(b)
    return b"".join(out)


def test_append_rolls_segments_and_reads_back_everything(tmp_path):
    log = open_log(tmp_path)
    batches = append_batches(log, 30)
    assert log.log_end_offset == 90
    assert log.read(0, 90, 1 << 20) == b"".join(batches)
    names = sorted(n for n in os.listdir(tmp_path) if n.endswith(".log"))
    assert names[0] == "00000000000000000000.log"
    assert names == [segment_file_name(b) for b in log.segment_base_offsets]
    assert len(names) == 5  # 7 batches (931 bytes) fit in 1000
    for name in names[:-1]:
        assert os.path.getsize(tmp_path / name) == 7 * BATCH_BYTES
    assert log.segment_base_offsets == [0, 21, 42, 63, 84]
    log.close()


def test_read_matches_the_contract_for_every_start_end_and_budget(tmp_path):
    log = open_log(tmp_path)
    batches = append_batches(log, 20)
    leo = log.log_end_offset
    for start in range(leo + 1):
        for end in (start, start + 1, start + 4, 30, leo, leo + 5):
            for max_bytes in (1, BATCH_BYTES, 3 * BATCH_BYTES + 1, 1 << 20):
                got = log.read(start, end, max_bytes)
                assert got == expected_read(batches, start, min(end, leo), max_bytes), (start, end, max_bytes)
    log.close()


def test_read_examples(tmp_path):
    log = open_log(tmp_path)
    append_batches(log, 10)
    assert base_offsets(log.read(4, 30, 1 << 20))[0] == 3  # batch containing 4
    assert base_offsets(log.read(0, 9, 1 << 20)) == [0, 3, 6]  # 6..8 < 9
    assert base_offsets(log.read(0, 8, 1 << 20)) == [0, 3]  # 6..8 reaches 8
    assert base_offsets(log.read(0, 30, 1)) == [0]  # at least one batch
    assert base_offsets(log.read(15, 30, 10 * BATCH_BYTES)) == [15, 18, 21, 24, 27]  # crosses a roll
    assert log.read(30, 40, 1 << 20) == b""
    assert log.read(5, 5, 1 << 20) == b""
    log.close()


def test_append_refuses_bad_input_and_leaves_the_log_unchanged(tmp_path):
    log = open_log(tmp_path)
    append_batches(log, 2)
    size_before = os.path.getsize(tmp_path / segment_file_name(0))
    with pytest.raises(ValueError, match=r"base offset 9 but the log end offset is 6 \(gap\)"):
        log.append(batch(9))
    with pytest.raises(ValueError, match=r"base offset 3 but the log end offset is 6 \(overlap\)"):
        log.append(batch(3))
    with pytest.raises(ValueError, match="10 trailing bytes at byte 142 are not a whole batch"):
        log.append(batch(6) + b"\0" * 10)
    with pytest.raises(ValueError, match="needs 142 bytes, only 100 given"):
        log.append(batch(6)[:100])
    bad = bytearray(batch(6))
    bad[-1] ^= 1
    with pytest.raises(ValueError, match="invalid batch at byte 0: CRC mismatch"):
        log.append(bytes(bad))
    with pytest.raises(ValueError, match="leader epoch 0, older than the log's last epoch 1"):
        log.append(batch(6, epoch=0))
    with pytest.raises(ValueError, match="empty buffer"):
        log.append(b"")
    # a bad second batch refuses the whole call, including the good first one
    with pytest.raises(ValueError, match="batch at byte 142 has base offset 10"):
        log.append(batch(6) + batch(10))
    assert log.log_end_offset == 6
    assert os.path.getsize(tmp_path / segment_file_name(0)) == size_before
    log.append(batch(6) + batch(9))  # several batches in one call
    assert log.log_end_offset == 12
    log.close()


def test_recent_appends_are_read_from_memory_until_the_log_moves_on(tmp_path):
    """A read of one or several of the last few appends, whole (a replica
    applying what it just committed), is served from the bytes the appends
    wrote, CRC-checked once, not read back: damage the disk did to them
    afterwards is found by the next read that goes to the file: one that
    starts before them, or once RECENT_APPENDS_MAX more appends moved the log
    on. A truncation's cut bytes are never served from memory."""
    log = open_log(tmp_path, verify_appends=False)
    log.append(batch(0))
    size = len(batch(0))
    log.append(batch(3))
    with open(tmp_path / segment_file_name(0), "r+b") as f:  # the disk damages the newest batch
        f.seek(size + size - 1)
        f.write(bytes([batch(3)[-1] ^ 1]))
    assert log.read(3, 6, 1 << 20) == batch(3)  # the append's own bytes
    assert log.read(0, 6, 1 << 20) == batch(0) + batch(3)  # two appends in a row
    offset = 6
    for _ in range(RECENT_APPENDS_MAX - 1):
        log.append(batch(offset))
        offset += 3
    with pytest.raises(CorruptBatchError, match="base offset 3"):
        log.read(0, 6, 1 << 20)  # batch 0 left the memory: the file's read
    assert log.read(3, 9, 1 << 20) == batch(3) + batch(6)  # still among the recent appends
    log.append(batch(offset))
    with pytest.raises(CorruptBatchError, match=r"at byte %d \(base offset 3\): CRC mismatch" % size):
        log.read(3, 6, 1 << 20)
    assert log.read(offset, offset + 3, 1 << 20) == batch(offset)
    log.truncate_to(offset)  # cut, then other bytes at the same offsets: never the old ones from memory
    assert log.read(offset, offset + 3, 1 << 20) == b""
    log.append(batch(offset, epoch=2))
    assert log.read(offset, offset + 3, 1 << 20) == batch(offset, epoch=2) != batch(offset)
    log.close()


def test_append_without_crc_checks_still_refuses_malformed_batches_and_reads_verify(tmp_path):
    """verify_appends=False (the broker's log: its caller checked the CRC where
    the bytes crossed the network, or encoded them itself) drops only the CRC
    check of append: a bad magic, a bad length or a torn batch is still a
    ValueError and the log is unchanged; append returns the headers it parsed.
    A batch whose CRC is wrong on disk is refused by read() with
    CorruptBatchError naming the file and byte: never served or applied."""
    log = open_log(tmp_path, verify_appends=False)
    headers = log.append(batch(0) + batch(3))
    assert [(h.base_offset, h.next_offset) for h in headers] == [(0, 3), (3, 6)]
    bad_magic = bytearray(batch(6))
    bad_magic[16] ^= 0xFF  # the magic byte
    with pytest.raises(ValueError, match="invalid batch at byte 0: bad magic"):
        log.append(bytes(bad_magic))
    with pytest.raises(ValueError, match="needs 142 bytes, only 100 given"):
        log.append(batch(6)[:100])
    assert log.log_end_offset == 6
    bad_crc = bytearray(batch(6))
    bad_crc[-1] ^= 1
    log.append(bytes(bad_crc))  # the CRC is the caller's check here: it is stored...
    with pytest.raises(CorruptBatchError, match=r"corrupt batch in .* at byte 284 \(base offset 6\): CRC mismatch"):
        log.read(6, 9, 1 << 20)  # ...and never read back
    assert log.read(0, 6, 1 << 20) == batch(0) + batch(3)
    log.close()


def test_index_is_sparse_and_names_each_indexed_batchs_last_offset_and_start(tmp_path):
    """Kafka's .index semantics: (relative offset of the batch's LAST offset,
    position of the batch's start)."""
    log = open_log(tmp_path, segment_bytes_max=1 << 20)
    append_batches(log, 50)
    raw = (tmp_path / segment_file_name(0, ".index")).read_bytes()
    entries = [(int.from_bytes(raw[i:i + 4], "big"), int.from_bytes(raw[i + 4:i + 8], "big"))
               for i in range(0, len(raw), 8)]
    # one entry every ceil(300 / 142) = 3 batches of 3 records
    assert entries == [(3 * k * 3 + 2, 3 * k * BATCH_BYTES) for k in range(1, 17)]
    # Every offset is found through it, the indexed batches' last offsets included.
    for offset in range(0, 150):
        data = log.read(offset, 150, 1)  # at least the batch holding offset
        h = decode_header(data)
        assert h.base_offset <= offset <= h.last_offset
    log.close()
    reopened = open_log(tmp_path, segment_bytes_max=1 << 20)  # a clean open trusts and checks the index
    assert reopened.log_end_offset == 150 and decode_header(reopened.read(149, 150, 1)).last_offset == 149
    reopened.close()


def test_flush_reports_flushed_offset(tmp_path):
    log = open_log(tmp_path)
    append_batches(log, 10)
    assert log.flushed_end_offset == 0
    assert log.flush() == 30
    assert log.flushed_end_offset == 30
    append_batches(log, 1)
    assert log.flushed_end_offset == 30
    assert log.flush() == 33
    log.close()


def test_flush_from_a_thread_while_appending_reports_what_it_covered(tmp_path):
    log = open_log(tmp_path, segment_bytes_max=4000)
    stop = threading.Event()
    results: list[tuple[int, int, int]] = []
    errors: list[BaseException] = []

    def flusher():
        try:
            while not stop.is_set() and len(results) < 10_000:
                before = log.log_end_offset
                got = log.flush()
                results.append((before, got, log.log_end_offset))
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    t = threading.Thread(target=flusher)
    t.start()
    try:
        append_batches(log, 300)
    finally:
        stop.set()
        t.join(timeout=30)
    assert not errors
    assert results
    for before, got, after in results:
        assert before <= got <= after
    flushed = [got for _b, got, _a in results]
    assert flushed == sorted(flushed)
    assert log.flush() == log.log_end_offset == 900
    log.close()


def test_truncate_at_batch_boundary_then_append_and_reopen(tmp_path):
    log = open_log(tmp_path)
    append_batches(log, 10)
    log.flush()
    log.truncate_to(12)
    assert log.log_end_offset == 12
    assert log.flushed_end_offset == 12
    assert base_offsets(log.read(0, 100, 1 << 20)) == [0, 3, 6, 9]
    new = batch(12, epoch=2)
    log.append(new)
    log.close()
    log = open_log(tmp_path)
    assert log.log_end_offset == 15
    assert log.read(12, 15, 1 << 20) == new
    assert log.last_batch_epoch == 2
    log.close()


def test_truncate_inside_a_batch_drops_the_whole_batch(tmp_path):
    log = open_log(tmp_path)
    append_batches(log, 10)
    log.truncate_to(13)
    assert log.log_end_offset == 12
    log.close()


def test_truncate_across_segments_deletes_later_segments(tmp_path):
    log = open_log(tmp_path)
    append_batches(log, 30)
    assert log.segment_base_offsets == [0, 21, 42, 63, 84]
    log.truncate_to(42)  # exactly a segment base
    assert log.segment_base_offsets == [0, 21]
    assert not (tmp_path / segment_file_name(42)).exists()
    assert not (tmp_path / segment_file_name(63, ".index")).exists()
    assert log.log_end_offset == 42
    log.truncate_to(3)
    assert log.segment_base_offsets == [0]
    assert log.log_end_offset == 3
    assert os.path.getsize(tmp_path / segment_file_name(0)) == BATCH_BYTES
    log.truncate_to(0)
    assert log.log_end_offset == 0 and log.read(0, 10, 100) == b""
    log.truncate_to(50)  # past the end: nothing to do
    assert log.log_end_offset == 0
    batches = append_batches(log, 12, epoch=3)
    assert log.read(0, 36, 1 << 20) == b"".join(batches)
    log.close()


def test_truncate_fully_restarts_empty_at_new_offset(tmp_path):
    log = open_log(tmp_path)
    append_batches(log, 20)
    log.truncate_fully(1000)
    assert (log.log_start_offset, log.log_end_offset, log.flushed_end_offset) == (1000, 1000, 1000)
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".log")) == [segment_file_name(1000)]
    log.append(batch(1000, epoch=4))
    log.close()
    log = open_log(tmp_path)
    assert (log.log_start_offset, log.log_end_offset) == (1000, 1003)
    assert base_offsets(log.read(1000, 2000, 1 << 20)) == [1000]
    log.close()


def test_interrupted_truncate_fully_is_finished_on_open(tmp_path):
    log = open_log(tmp_path)
    append_batches(log, 20)
    log.close()
    (tmp_path / "log-start-offset").write_text(
        '{"data_version": 1, "log_start_offset": 500, "truncate_fully_pending": true}')
    log = open_log(tmp_path)
    assert (log.log_start_offset, log.log_end_offset) == (500, 500)
    assert log.segment_base_offsets == [500]
    log.close()


def test_advance_log_start_deletes_whole_segments_and_persists(tmp_path):
    log = open_log(tmp_path)
    append_batches(log, 30)
    log.advance_log_start(30)  # inside segment 21..41
    assert log.log_start_offset == 30
    assert log.segment_base_offsets == [21, 42, 63, 84]
    assert not (tmp_path / segment_file_name(0)).exists()
    with pytest.raises(ValueError, match="read at offset 21 below the log start offset 30"):
        log.read(21, 90, 100)
    assert base_offsets(log.read(30, 36, 1 << 20)) == [30, 33]
    log.advance_log_start(10)  # backwards: ignored
    assert log.log_start_offset == 30
    with pytest.raises(ValueError, match=r"advance_log_start\(91\) past the log end offset 90"):
        log.advance_log_start(91)
    with pytest.raises(ValueError, match="below the log start offset 30; use truncate_fully"):
        log.truncate_to(20)
    log.advance_log_start(90)  # everything: the active segment stays
    assert log.segment_base_offsets == [84]
    log.close()
    log = open_log(tmp_path)
    assert (log.log_start_offset, log.log_end_offset) == (90, 90)
    log.close()


def test_advance_log_start_can_leave_the_unlink_to_the_caller_and_open_removes_what_a_crash_left(tmp_path):
    """With unlink=..., the doomed segments' files are renamed .deleted at
    once (the name is free, nothing reads them) and handed to the caller,
    which unlinks them off the event loop. If the process dies first, the
    next open removes them, without an unknown-file warning, and the log
    reads as before."""
    log = open_log(tmp_path)
    append_batches(log, 30)
    handed: list[str] = []
    log.advance_log_start(45, unlink=handed.append)
    assert log.segment_base_offsets == [42, 63, 84]
    assert sorted(os.path.basename(p) for p in handed) == sorted(
        segment_file_name(base, suffix) + ".deleted" for base in (0, 21) for suffix in (".log", ".index", ".timeindex"))
    assert all(os.path.exists(p) for p in handed)
    assert not (tmp_path / segment_file_name(0)).exists() and not (tmp_path / segment_file_name(21)).exists()
    assert base_offsets(log.read(45, 90, 1 << 20))[0] == 45
    log.close()
    logger = RecordingLogger()
    log = open_log(tmp_path, logger=logger)  # nobody unlinked them: as after a crash
    assert not any(os.path.exists(p) for p in handed)
    events = [event for _, event, _ in logger.records]
    assert "unknown_file_ignored" not in events and events.count("deleted_segment_file_removed") == 6
    assert (log.log_start_offset, log.segment_base_offsets) == (45, [42, 63, 84])
    assert base_offsets(log.read(45, 90, 1 << 20))[0] == 45
    log.close()


def test_batch_epochs_rebuild_the_epoch_history(tmp_path):
    log = open_log(tmp_path)
    append_batches(log, 2, epoch=1)
    append_batches(log, 5, epoch=2)
    append_batches(log, 9, epoch=5)
    assert log.batch_epochs() == [(1, 0), (2, 6), (5, 21)]
    infos = list(log.iter_batch_headers(20))
    assert infos[0].base_offset == 18 and infos[0].leader_epoch == 2
    assert [i.base_offset for i in infos] == list(range(18, 48, 3))
    log.advance_log_start(22)
    assert log.batch_epochs() == [(5, 22)]
    log.close()


def test_second_open_of_the_same_directory_is_refused(tmp_path):
    log = open_log(tmp_path)
    with pytest.raises(RuntimeError, match="is already open"):
        open_log(tmp_path)
    log.close()
    open_log(tmp_path).close()


def test_closed_log_refuses_work(tmp_path):
    log = open_log(tmp_path)
    log.close()
    with pytest.raises(RuntimeError, match="is closed"):
        log.append(batch(0))


def test_bad_configuration_is_refused(tmp_path):
    with pytest.raises(ValueError, match="segment_bytes_max must be in"):
        SegmentedLog.open(tmp_path, segment_bytes_max=0)
    with pytest.raises(ValueError, match="index_interval_bytes must be positive"):
        SegmentedLog.open(tmp_path, index_interval_bytes=0)


def test_a_batch_bigger_than_a_segment_gets_its_own_segment(tmp_path):
    log = open_log(tmp_path, segment_bytes_max=200)
    big = encode_batch(0, 1, [b"y" * 500], 0)
    log.append(big)
    log.append(batch(1))
    assert log.segment_base_offsets == [0, 1]
    assert log.read(0, 10, 1) == big
    assert len(big) > HEADER_SIZE
    log.close()


def _time_entries(path) -> list[tuple[int, int]]:
    raw = path.read_bytes()
    assert len(raw) % 12 == 0
    return [(int.from_bytes(raw[i:i + 8], "big", signed=True), int.from_bytes(raw[i + 8:i + 12], "big"))
            for i in range(0, len(raw), 12)]


def _append_with_timestamps(log, timestamps: list[int]) -> None:
    for ts in timestamps:
        base = log.log_end_offset
        log.append(encode_batch(base, 1, [b"r" * 20] * 3, ts))


def test_timeindex_holds_the_max_timestamp_so_far_and_its_offset_at_index_points(tmp_path):
    """Kafka's .timeindex: at each .index entry, (largest batch timestamp so
    far, relative last offset of the batch holding it), only when it grew."""
    log = open_log(tmp_path, segment_bytes_max=1 << 20)
    # Batch k holds offsets 3k..3k+2; index points every 3 batches (k = 3, 6, 9, ...).
    stamps = [1000 + k for k in range(7)] + [500, 501, 502, 503, 504, 505] + [2000 + k for k in range(6)]
    _append_with_timestamps(log, stamps)
    entries = _time_entries(tmp_path / segment_file_name(0, ".timeindex"))
    # k=3: max 1003 at batch 3 (last offset 11); k=6: 1006 at batch 6 (20);
    # k=9 and k=12: timestamps went back, max still 1006, no entry; k=15: 2002 at batch 15 (47); k=18: 2005 (56).
    assert entries == [(1003, 11), (1006, 20), (2002, 47), (2005, 56)]
    log.close()


@pytest.mark.parametrize("damage", ["missing", "torn", "out_of_order"])
def test_a_missing_or_bad_timeindex_is_rebuilt_at_open(tmp_path, damage):
    """The user sees one index_rebuilt warning; the rebuilt file equals the original."""
    log = open_log(tmp_path, segment_bytes_max=4000)
    _append_with_timestamps(log, [1000 + k for k in range(60)])
    log.close()
    path = tmp_path / segment_file_name(0, ".timeindex")
    good = path.read_bytes()
    assert len(good) >= 24
    if damage == "missing":
        path.unlink()
    elif damage == "torn":
        path.write_bytes(good[:-5])
    else:
        path.write_bytes(good[12:24] + good[:12] + good[24:])
    logger = RecordingLogger()
    reopened = open_log(tmp_path, segment_bytes_max=4000, logger=logger)
    assert path.read_bytes() == good
    assert [e["segment"] for e in logger.events("index_rebuilt")] == [str(tmp_path / segment_file_name(0))
                                                                        .replace(".log", ".index")]
    reopened.close()


def test_truncation_keeps_the_timeindex_consistent_with_a_log_written_without_the_tail(tmp_path):
    a, b_dir = tmp_path / "a", tmp_path / "b"
    stamps = [1000 + k for k in range(20)] + [900 + k for k in range(10)]
    log = open_log(a, segment_bytes_max=1 << 20)
    _append_with_timestamps(log, stamps)
    log.truncate_to(3 * 17 + 1)  # inside batch 17: it goes too, the log ends at 51
    _append_with_timestamps(log, [3000, 3001, 3002, 3003])
    log.close()
    ref = open_log(b_dir, segment_bytes_max=1 << 20)
    _append_with_timestamps(ref, stamps[:17] + [3000, 3001, 3002, 3003])
    ref.close()
    name = segment_file_name(0, ".timeindex")
    assert _time_entries(a / name) == _time_entries(b_dir / name)
    logger = RecordingLogger()
    open_log(a, segment_bytes_max=1 << 20, logger=logger).close()  # a clean open trusts it
    assert not logger.events("index_rebuilt")


def _index_entries(path) -> list[int]:
    raw = path.read_bytes()
    return [int.from_bytes(raw[i:i + 4], "big") for i in range(0, len(raw), 8)]


def _segment_max(path, base: int) -> tuple[int, int]:
    """(largest batch max timestamp, relative last offset of its first batch) of a .log file."""
    from metalog.storage.batch import iter_batches
    best = (-1, 0)
    for _pos, h in iter_batches(path.read_bytes()):
        if h.max_timestamp_ms > best[0]:
            best = (h.max_timestamp_ms, h.last_offset - base)
    return best


# 7 batches of 142 bytes per segment; with .index entries every 500 bytes
# the last one is at batch 4 (relative offset 14). Segment 0 peaks at batch 6
# (offsets 18..20), after it: its roll entry is (5000, 20). Segment 21 peaks
# at batch 4, which is indexed: nothing to append at its roll.
TIME_INTERVAL = 500
_PEAK_STAMPS = [1000, 1001, 1002, 1003, 1004, 1005, 5000] + [2000, 2001, 2002, 2003, 2004, 1500, 1501] \
    + [3000 + k for k in range(7)]


def test_a_roll_appends_the_final_timeindex_entry_as_kafka_does(tmp_path):
    """Kafka's onBecomeInactiveSegment: the sealed segment's .timeindex ends
    with (largest timestamp, offset of its batch); the active one does not."""
    log = open_log(tmp_path, index_interval_bytes=TIME_INTERVAL)
    _append_with_timestamps(log, _PEAK_STAMPS)
    assert log.segment_base_offsets == [0, 21, 42]
    log.close()
    for base in (0, 21):
        entries = _time_entries(tmp_path / segment_file_name(base, ".timeindex"))
        last_indexed = _index_entries(tmp_path / segment_file_name(base, ".index"))[-1]
        assert entries[-1] == _segment_max(tmp_path / segment_file_name(base), base)
        assert sum(r > last_indexed for _t, r in entries) <= 1
    seg0 = _time_entries(tmp_path / segment_file_name(0, ".timeindex"))
    assert seg0[-1] == (5000, 20)  # batch 6 holds offsets 18..20
    assert seg0[-1][1] > _index_entries(tmp_path / segment_file_name(0, ".index"))[-1]
    # Segment 21's largest timestamp was indexed already: nothing appended (Kafka's maybeAppend).
    seg21 = _time_entries(tmp_path / segment_file_name(21, ".timeindex"))
    assert seg21[-1][1] <= _index_entries(tmp_path / segment_file_name(21, ".index"))[-1]
    # The active segment holds entries at its .index entries only.
    active_index = _index_entries(tmp_path / segment_file_name(42, ".index"))
    assert all(r <= (active_index[-1] if active_index else -1)
               for _t, r in _time_entries(tmp_path / segment_file_name(42, ".timeindex")))


@pytest.mark.parametrize("clean", [True, False])
def test_reopen_accepts_the_final_entry_and_a_full_verification_writes_the_same(tmp_path, clean):
    """A clean open trusts the files (no index_rebuilt); after an unclean
    stop every segment is verified and its .timeindex rewritten: the same
    bytes, final entry included."""
    log = open_log(tmp_path, index_interval_bytes=TIME_INTERVAL)
    _append_with_timestamps(log, _PEAK_STAMPS)
    log.close()
    names = [segment_file_name(b, ".timeindex") for b in (0, 21, 42)]
    before = [(tmp_path / n).read_bytes() for n in names]
    if not clean:
        (tmp_path / "recovery-point-offset-checkpoint").write_text("0\n1\n__cluster_metadata 0 0\n")
        os.unlink(tmp_path / ".clean-shutdown")
    logger = RecordingLogger()
    reopened = open_log(tmp_path, logger=logger, index_interval_bytes=TIME_INTERVAL)
    assert [(tmp_path / n).read_bytes() for n in names] == before
    assert not logger.events("index_rebuilt")
    if not clean:
        assert logger.events("log_verified")[0]["from_offset"] == 0
    _append_with_timestamps(reopened, [6000] * 8)  # rolls segment 42: its final entry is the new peak
    reopened.close()
    assert _time_entries(tmp_path / names[2])[-1] == _segment_max(tmp_path / segment_file_name(42), 42)


@pytest.mark.parametrize("damage", ["final_timestamp_wrong", "final_offset_past_segment", "two_past_index",
                                    "non_monotonic", "final_on_active"])
def test_a_damaged_final_timeindex_entry_is_detected_and_rebuilt(tmp_path, damage):
    """The one trailing entry is allowed, nothing else: a final entry that
    does not match the data, names an offset outside the segment, a second
    entry past the .index, timestamps out of order, or a trailing entry on
    the active segment are each found at a clean open; the user sees one
    index_rebuilt warning naming the segment and the file comes back as the
    roll wrote it."""
    log = open_log(tmp_path, index_interval_bytes=TIME_INTERVAL)
    _append_with_timestamps(log, _PEAK_STAMPS)
    log.close()
    base = 42 if damage == "final_on_active" else 0
    path = tmp_path / segment_file_name(base, ".timeindex")
    good = path.read_bytes()
    entries = _time_entries(path)

    def pack(items):
        return b"".join(t.to_bytes(8, "big", signed=True) + r.to_bytes(4, "big") for t, r in items)

    if damage == "final_timestamp_wrong":
        bad = entries[:-1] + [(entries[-1][0] + 1, entries[-1][1])]
    elif damage == "final_offset_past_segment":
        bad = entries[:-1] + [(entries[-1][0], 21)]  # segment 0 holds relative offsets 0..20
    elif damage == "two_past_index":
        bad = entries[:-1] + [(entries[-1][0] - 1, entries[-1][1] - 1), entries[-1]]
    elif damage == "non_monotonic":
        bad = [entries[1], entries[0]] + entries[2:]
    else:
        bad = entries + [(9999, 20)]  # past its last .index entry (14), inside the segment: still refused
    path.write_bytes(pack(bad))
    logger = RecordingLogger()
    reopened = open_log(tmp_path, logger=logger, index_interval_bytes=TIME_INTERVAL)
    if base == 0:  # a sealed segment: rebuilt by a full scan
        assert [e["segment"] for e in logger.events("index_rebuilt")] == [
            str(tmp_path / segment_file_name(0, ".index"))]
    else:  # the last segment: recovered by a full scan, which rewrites its indexes
        assert not logger.events("index_rebuilt")
    reopened.close()
    assert path.read_bytes() == good


def test_a_segment_made_active_again_by_truncation_loses_its_final_entry(tmp_path):
    """Truncating to a segment boundary re-opens the segment before it for
    appends: its roll entry goes (an active segment has entries at .index
    entries only), a later roll writes the new one, and a reopen accepts it."""
    log = open_log(tmp_path, index_interval_bytes=TIME_INTERVAL)
    _append_with_timestamps(log, _PEAK_STAMPS)
    path = tmp_path / segment_file_name(0, ".timeindex")
    assert _time_entries(path)[-1] == (5000, 20)
    log.truncate_to(21)
    assert log.segment_base_offsets == [0]
    assert all(r <= _index_entries(tmp_path / segment_file_name(0, ".index"))[-1] for _t, r in _time_entries(path))
    _append_with_timestamps(log, [7000] * 3)
    assert _time_entries(path)[-1] == (5000, 20)  # sealed again: the final entry is back
    log.close()
    logger = RecordingLogger()
    open_log(tmp_path, logger=logger, index_interval_bytes=TIME_INTERVAL).close()
    assert not logger.events("index_rebuilt")


def test_a_quarantine_of_the_next_segment_from_its_first_byte_unseals_the_one_before(tmp_path):
    """Damage at byte 0 of segment 21: it and every later one are renamed
    .corrupt, segment 0 is the active one again and loses its roll entry; a
    clean reopen accepts what is left (no index_rebuilt)."""
    from metalog.storage.errors import CorruptionReport
    log = open_log(tmp_path, index_interval_bytes=TIME_INTERVAL)
    _append_with_timestamps(log, _PEAK_STAMPS)
    path = tmp_path / segment_file_name(0, ".timeindex")
    assert _time_entries(path)[-1] == (5000, 20)
    log.quarantine_from(CorruptionReport(str(tmp_path / segment_file_name(21)), 0, 21, 1, None, None, "test"))
    assert log.segment_base_offsets == [0] and log.log_end_offset == 21
    assert _time_entries(path) == [(1004, 14)]
    log.close()
    logger = RecordingLogger()
    open_log(tmp_path, logger=logger, index_interval_bytes=TIME_INTERVAL).close()
    assert not logger.events("index_rebuilt")
