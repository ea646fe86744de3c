"""The background scrubber (metalog.storage.scrub): finds damage in sealed segments and
snapshots that start-up's cheap check trusts, at a bounded rate, and never
reports a segment the owner changed under it."""

from __future__ import annotations

import threading
import time

import pytest

from metalog.broker.server.metrics import BrokerMetrics
from metalog.protocol.messages import SnapshotId
from metalog.storage.batch import CorruptBatchError
from metalog.storage.segments import segment_file_name
from metalog.storage.scrub import Scrubber
from metalog.storage.snapshot import SnapshotStore, SnapshotWriter
from tests.storage.helpers import append_batches
from tests.storage.test_integrity import MID_BATCH_POS, open_log
from tests.storage.test_recovery import BATCH_BYTES, flip_bit


def sample(metrics: BrokerMetrics, name: str, **labels) -> float:
    value = metrics.registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


@pytest.fixture
def log(tmp_path):
    log = open_log(tmp_path)
    append_batches(log, 17)  # segments 0, 21 (sealed) and 42 (active)
    yield log
    log.close()


def test_scrub_finds_a_bit_flip_before_the_last_index_entry_of_a_sealed_segment(log, tmp_path):
    """What the operator gets: one report naming file, byte, offset, epoch and both CRCs; metrics move."""
    path = str(tmp_path / segment_file_name(21))
    flip_bit(path, MID_BATCH_POS)
    found = []
    metrics = BrokerMetrics(1)
    scrubber = Scrubber(log, None, 0, found.append, metrics=metrics, chunk_bytes=200)  # batches cut by chunks
    result = scrubber.scrub_pass()
    assert result.complete and result.segments == 2 and result.skipped == 0
    # Segment 0 in full, segment 21 up to the chunk holding the damage (then it stops).
    assert result.bytes_read == 7 * BATCH_BYTES + 400
    (r,) = found
    assert (r.path, r.position, r.base_offset, r.leader_epoch) == (path, BATCH_BYTES, 24, 1)
    assert r.expected_crc != r.actual_crc and "CRC mismatch" in r.reason
    assert result.corrupt == [r]
    assert sample(metrics, "metalog_scrub_bytes_total") == result.bytes_read
    assert sample(metrics, "metalog_scrub_last_complete_pass_timestamp_seconds") > 0
    # The same damage is reported once, not on every pass.
    assert scrubber.scrub_pass().corrupt == [] and len(found) == 1


def test_scrub_of_a_clean_log_reads_every_sealed_byte_and_reports_nothing(log):
    found = []
    result = Scrubber(log, None, 0, found.append).scrub_pass()
    assert found == [] and result.bytes_read == 14 * BATCH_BYTES and result.segments == 2


def test_a_segment_truncated_or_quarantined_under_the_scrubber_is_skipped_not_reported(log, tmp_path):
    """The owner changes segments after the scrubber listed them: the scrubber
    sees missing or shorter files and must say nothing."""
    stale = log.sealed_segments()

    class StaleView:  # the scrubber's listing taken before the owner's changes
        def __getattr__(self, name):
            return getattr(log, name)

        def sealed_segments(self):
            return stale

    flip_bit(str(tmp_path / segment_file_name(21)), MID_BATCH_POS)
    with pytest.raises(CorruptBatchError) as info:
        log.read(21, 42, 1 << 20)
    log.quarantine_from(info.value.report)  # renames 21 and 42 .corrupt, end at 24
    log.truncate_to(9)  # segment 0 becomes the active one and shorter
    found = []
    result = Scrubber(StaleView(), None, 0, found.append).scrub_pass()
    assert found == [] and result.skipped == 2


def test_scrub_finds_a_corrupt_snapshot(tmp_path):
    log = open_log(tmp_path / "log")
    store = SnapshotStore(str(tmp_path / "snap"))
    path, size, _ = SnapshotWriter(store.directory, SnapshotId(10, 2), 0).write_all(
        [bytes([i]) * 50 for i in range(20)])
    flip_bit(path, size // 2)
    found = []
    result = Scrubber(log, store, 0, found.append).scrub_pass()
    assert result.snapshots == 1 and result.bytes_read == size
    (r,) = found
    assert r.path == path and "CRC mismatch" in r.reason
    # FetchSnapshot never serves it either: the file is verified when a download starts.
    with pytest.raises(Exception, match="corrupt snapshot at byte"):
        store.read_chunk(SnapshotId(10, 2), 0, 100)
    log.close()


def test_rate_limit_bounds_the_read_rate(log):
    bytes_per_s = 10_000
    t0 = time.monotonic()
    result = Scrubber(log, None, bytes_per_s, lambda r: None, chunk_bytes=500).scrub_pass()
    elapsed = time.monotonic() - t0
    assert result.bytes_read == 14 * BATCH_BYTES
    assert elapsed >= (result.bytes_read - 500) / bytes_per_s  # at most one chunk ahead of the budget


def test_background_thread_reports_and_stops(log, tmp_path):
    flip_bit(str(tmp_path / segment_file_name(0)), MID_BATCH_POS)
    got = threading.Event()
    found = []

    def on_corruption(report):
        found.append(report)
        got.set()

    scrubber = Scrubber(log, None, 1_000_000, on_corruption)
    scrubber.start()
    try:
        assert got.wait(10), "the scrubber thread did not report within 10 s"
    finally:
        scrubber.stop()
    assert found[0].position == BATCH_BYTES and found[0].base_offset == 3
    assert not any(t.name == "metalog-scrubber" for t in threading.enumerate())


def test_zero_rate_disables_and_negative_is_refused(log):
    s = Scrubber(log, None, 0, lambda r: None)
    s.start()
    assert not s.enabled and not any(t.name == "metalog-scrubber" for t in threading.enumerate())
    with pytest.raises(ValueError, match="bytes_per_s must be >= 0"):
        Scrubber(log, None, -1, lambda r: None)


def test_no_false_reports_while_the_owner_truncates_rolls_and_deletes_concurrently(tmp_path):
    """The scrubber thread re-reads segments in a loop while the owner thread
    truncates into sealed segments, appends (rolls) and advances the log start
    (deleting segments): no report may come out of a healthy log."""
    log = open_log(tmp_path)
    append_batches(log, 40)
    found = []
    scrubber = Scrubber(log, None, 0, found.append, chunk_bytes=64)  # many small reads: wide race windows
    stop = threading.Event()
    passes = []

    def scrub_loop():
        while not stop.is_set():
            passes.append(scrubber.scrub_pass())

    t = threading.Thread(target=scrub_loop)
    t.start()
    try:
        deadline = time.monotonic() + 3.0
        rounds = 0
        while time.monotonic() < deadline:
            log.truncate_to(log.log_end_offset - 30)  # cuts into a sealed segment
            append_batches(log, 12)  # grows back and rolls new segments
            log.flush()
            if rounds % 10 == 9:
                log.advance_log_start(log.segment_base_offsets[1])  # deletes the oldest segment
            rounds += 1
    finally:
        stop.set()
        t.join(10)
    assert found == [], found
    assert rounds > 10 and len(passes) > 10 and sum(p.skipped for p in passes) > 0
    log.close()


def test_a_segment_sealed_after_start_is_read_at_the_roll_not_after_the_idle_wait(tmp_path):
    """Nothing is sealed when the scrubber starts, so it goes idle for
    idle_wait_ms (10 minutes here). Damage in the active segment is sealed by
    a roll: the roll wakes the scrubber, which reports the damage (file, byte,
    offset) within seconds -- only the wake-up can explain that."""
    log = open_log(tmp_path)
    append_batches(log, 5)  # all in segment 0, still active
    assert log.segment_base_offsets == [0]
    got = threading.Event()
    found = []

    def on_corruption(report):
        found.append(report)
        got.set()

    scrubber = Scrubber(log, None, 1_000_000, on_corruption, idle_wait_ms=600_000)
    scrubber.start()
    try:
        flip_bit(str(tmp_path / segment_file_name(0)), MID_BATCH_POS)
        append_batches(log, 4)  # rolls: segment 0 is sealed
        assert len(log.segment_base_offsets) == 2
        assert got.wait(10), "the roll did not wake the scrubber"
    finally:
        scrubber.stop()
        log.close()
    (r,) = found
    assert (r.path, r.position, r.base_offset) == (str(tmp_path / segment_file_name(0)), BATCH_BYTES, 3)
    assert "CRC mismatch" in r.reason


def test_a_new_snapshot_is_read_on_notify_and_an_unannounced_one_within_the_idle_wait(tmp_path):
    """A snapshot written while the scrubber idles: notify() (the runtime
    calls it for a created or installed snapshot) has it read at once; one
    nothing announced is found when the idle wait (200 ms here) runs out.
    Both reports name the snapshot file."""
    for idle_wait_ms, announce in ((600_000, True), (200, False)):
        d = tmp_path / f"{idle_wait_ms}"
        log = open_log(d / "log")
        store = SnapshotStore(str(d / "snap"))
        got = threading.Event()
        found = []

        def on_corruption(report, found=found, got=got):
            found.append(report)
            got.set()

        scrubber = Scrubber(log, store, 1_000_000, on_corruption, idle_wait_ms=idle_wait_ms)
        scrubber.start()
        try:
            path, size, _ = SnapshotWriter(store.directory, SnapshotId(10, 2), 0).write_all(
                [bytes([i]) * 50 for i in range(20)])
            flip_bit(path, size // 2)
            if announce:
                scrubber.notify()
            assert got.wait(10), f"not found (idle_wait_ms={idle_wait_ms}, notify={announce})"
        finally:
            scrubber.stop()
            log.close()
        assert [r.path for r in found] == [path] and "CRC mismatch" in found[0].reason


def test_new_files_are_read_once_per_wake_up_not_again(log):
    """scrub_new reads only what it has not read since the file appeared: a
    second call reads nothing; a roll adds exactly the newly sealed segment."""
    s = Scrubber(log, None, 0, lambda r: None)
    first = s.scrub_new()
    assert first.segments == 2 and first.bytes_read == 14 * BATCH_BYTES
    assert s.scrub_new().bytes_read == 0
    append_batches(log, 8)  # seals segment 42
    third = s.scrub_new()
    assert third.segments == 1 and third.bytes_read == 7 * BATCH_BYTES


def test_idle_wait_must_be_positive(log):
    with pytest.raises(ValueError, match="idle_wait_ms must be positive, got 0"):
        Scrubber(log, None, 1000, lambda r: None, idle_wait_ms=0)


def test_after_a_wake_up_full_passes_resume_so_later_damage_is_found(tmp_path):
    """Started idle (nothing sealed, idle wait 10 minutes); a roll seals a
    clean segment, which the wake-up reads; a bit flipped in it afterwards is
    found by the full passes that follow (a pause of about a second), not
    after the idle wait."""
    log = open_log(tmp_path)
    append_batches(log, 5)
    metrics = BrokerMetrics(1)
    got = threading.Event()
    found = []

    def on_corruption(report):
        found.append(report)
        got.set()

    scrubber = Scrubber(log, None, 1_000_000, on_corruption, metrics=metrics, idle_wait_ms=600_000)
    scrubber.start()
    try:
        append_batches(log, 4)  # rolls: segment 0 (7 batches) sealed
        sealed_bytes = 7 * BATCH_BYTES
        deadline = time.monotonic() + 10
        while sample(metrics, "metalog_scrub_bytes_total") < sealed_bytes:
            assert time.monotonic() < deadline, "the wake-up did not read the sealed segment"
            got.wait(0.01)
        assert found == []
        flip_bit(str(tmp_path / segment_file_name(0)), MID_BATCH_POS)
        assert got.wait(15), "a full pass did not follow the wake-up"
    finally:
        scrubber.stop()
        log.close()
    assert [(r.position, r.base_offset) for r in found] == [(BATCH_BYTES, 3)]


def test_a_segment_sealed_during_a_slow_pass_is_read_at_the_next_chunk_not_after_the_file(tmp_path):
    """A rate-limited pass is in the middle of segment 0 (one batch per
    chunk, 1000 bytes/s) when a roll seals segment 21, whose second batch
    is damaged. The scrubber reads the new segment at its next chunk: the
    report comes while segment 0 is still unfinished (fewer bytes counted
    than segment 0 plus the two chunks that reach the damage)."""
    log = open_log(tmp_path)
    append_batches(log, 10)  # segment 0 sealed (7 batches), 21 active with 3
    metrics = BrokerMetrics(1)
    got = threading.Event()
    at_report: list[float] = []

    def on_corruption(report):
        at_report.append(sample(metrics, "metalog_scrub_bytes_total"))
        got.set()

    scrubber = Scrubber(log, None, 1000, on_corruption, metrics=metrics, chunk_bytes=BATCH_BYTES,
                        idle_wait_ms=600_000)
    scrubber.start()
    try:
        deadline = time.monotonic() + 10
        while sample(metrics, "metalog_scrub_bytes_total") < BATCH_BYTES:  # the pass has begun
            assert time.monotonic() < deadline, "the first pass did not start"
            got.wait(0.01)
        flip_bit(str(tmp_path / segment_file_name(21)), MID_BATCH_POS)
        append_batches(log, 5)  # rolls: 21 sealed with its damage
        assert got.wait(15), "the damage in the newly sealed segment was not reported"
    finally:
        scrubber.stop()
        log.close()
    assert at_report[0] < 7 * BATCH_BYTES + 2 * BATCH_BYTES, at_report


def test_scrubbing_a_large_snapshot_holds_a_chunk_not_the_file(tmp_path):
    """A 2M-partition snapshot is 150 MB on every broker: the scrubber used to
    gather all its chunks and check them joined, holding the whole file.
    Now it checks as it reads: the peak is about a chunk, and a clean file
    is read exactly once."""
    import random
    import tracemalloc

    log = open_log(tmp_path / "log")
    store = SnapshotStore(str(tmp_path / "snap"))
    rng = random.Random(5)
    path, size, _ = SnapshotWriter(store.directory, SnapshotId(10, 2), 0).write_all(
        [rng.randbytes(4096) for _ in range(4096)])  # 16 MiB, incompressible
    chunk = 1 << 20
    found = []
    tracemalloc.start()
    try:
        result = Scrubber(log, store, 0, found.append, chunk_bytes=chunk).scrub_pass()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert found == [] and result.snapshots == 1 and result.bytes_read == size  # no sealed segments here
    assert peak < 4 * chunk, f"peak {peak / chunk:.1f} MiB scrubbing a {size / chunk:.1f} MiB snapshot"
    log.close()
