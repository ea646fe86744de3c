"""SimDisk: the crash model and LogReader semantics the simulator relies on."""

from __future__ import annotations

import random

import pytest

from metalog.protocol import messages as m
from metalog.storage.batch import encode_batch
from metalog.sim.disk import SimDisk, SimDiskError


def batch(base: int, epoch: int, n: int = 2) -> bytes:
    return encode_batch(base, epoch, [f"v{base + i}".encode() for i in range(n)], timestamp_ms=0)


def disk_with(batches: int, epoch: int = 1, n: int = 2) -> SimDisk:
    d = SimDisk()
    for k in range(batches):
        d.append(batch(k * n, epoch, n), k * n, (k + 1) * n)
    return d


def test_crash_keeps_the_flushed_prefix_and_never_more_than_was_written():
    for seed in range(50):
        d = disk_with(5)  # offsets 0..9
        d.flush(4)
        d.append(batch(10, 2), 10, 12)
        d.crash(random.Random(seed))
        assert 4 <= d.log_end_offset <= 12
        assert d.log_end_offset % 2 == 0, "a crash never leaves a torn batch"
        assert d.flushed_end_offset == d.log_end_offset, "after recovery everything on disk counts as flushed"
        assert d.record_at(3) == (1, b"v3")


def test_crash_loses_some_unflushed_batches_for_some_seeds():
    ends = set()
    for seed in range(50):
        d = disk_with(5)
        d.flush(2)
        d.crash(random.Random(seed))
        ends.add(d.log_end_offset)
    assert min(ends) == 2 and max(ends) == 10


def test_recovered_log_view_cuts_the_epoch_checkpoint_to_the_log_end():
    d = disk_with(2, epoch=1)  # 0..3 epoch 1
    d.flush(4)
    d.append(batch(4, 3), 4, 6)
    d.write_epoch_checkpoint(((1, 0), (3, 4)))
    d.crash(random.Random(0))  # seed 0 loses or keeps the epoch-3 batch; check both cases
    view = d.log_view()
    if d.log_end_offset == 4:
        assert view.epochs == [(1, 0)]
    else:
        assert view.epochs == [(1, 0), (3, 4)]
    assert view.log_end_offset == d.log_end_offset


def test_log_view_rebuilds_epochs_missing_from_the_checkpoint():
    d = disk_with(1, epoch=1)
    d.append(batch(2, 4), 2, 4)
    d.write_epoch_checkpoint(((1, 0),))
    assert d.log_view().epochs == [(1, 0), (4, 2)]


def test_truncation_is_durable_and_lowers_the_flushed_end():
    d = disk_with(5)
    d.flush(10)
    d.truncate(6)
    assert d.log_end_offset == 6 and d.flushed_end_offset == 6
    d.crash(random.Random(1))
    assert d.log_end_offset == 6


def test_truncate_inside_a_batch_is_refused():
    d = disk_with(2)
    with pytest.raises(SimDiskError, match="falls inside the batch at 2"):
        d.truncate(3)


def test_append_must_continue_at_the_log_end():
    d = disk_with(1)
    with pytest.raises(SimDiskError, match="AppendBatches at 4 but the log ends at 2"):
        d.append(batch(4, 1), 4, 6)


def test_read_returns_whole_batches_below_the_end_and_at_least_one():
    d = disk_with(5)
    assert d.read(3, 10, 1) == batch(2, 1), "the batch holding the start offset, even past max_bytes"
    assert d.read(0, 4, 1 << 20) == batch(0, 1) + batch(2, 1)
    assert d.read(10, 12, 100) == b""


def test_flush_issued_before_a_truncation_cannot_make_later_data_durable():
    d = disk_with(5)
    d.truncate(4)
    d.append(batch(4, 2), 4, 6)
    assert d.flush(10) == 6  # the flush covers what exists now, nothing beyond the log end


def test_snapshot_create_install_and_advance_log_start():
    leader = disk_with(5)  # offsets 0..9
    sid = leader.create_snapshot(6)
    assert sid == m.SnapshotId(end_offset=6, epoch=1)
    assert leader.create_snapshot(5) is None, "5 is inside a batch"
    leader.advance_log_start(6)
    assert leader.log_start_offset == 6 and leader.batch_at(6) is not None and leader.batch_at(4) is None
    assert leader.snapshot_record_at(5) == (1, b"v5")

    follower = SimDisk()
    data = leader.read_snapshot(sid, 0, 1 << 20)
    follower.write_snapshot_chunk(sid, 0, data[:50])
    follower.write_snapshot_chunk(sid, 50, data[50:])
    assert follower.install_snapshot(sid, len(data))
    assert (follower.log_start_offset, follower.log_end_offset) == (6, 6)
    assert follower.any_record_at(0) == (1, b"v0")
    assert follower.log_view().snapshots == [sid]


def test_install_with_wrong_size_fails_verification_and_part_files_die_in_a_crash():
    leader = disk_with(3)
    sid = leader.create_snapshot(6)
    data = leader.read_snapshot(sid, 0, 1 << 20)
    f = SimDisk()
    f.write_snapshot_chunk(sid, 0, data)
    assert not f.install_snapshot(sid, len(data) + 1)
    f.write_snapshot_chunk(sid, 0, data[:10])
    f.crash(random.Random(0))
    with pytest.raises(SimDiskError, match="holds None bytes"):
        f.write_snapshot_chunk(sid, 10, data[10:])


def test_wipe_log_keeps_quorum_state_and_wipe_all_does_not():
    from metalog.broker.quorum.api import QuorumStateData

    d = disk_with(2)
    d.persist_quorum_state(QuorumStateData(3, 1, 1, (1, 2, 3)))
    d.wipe_log()
    assert d.log_end_offset == 0 and d.quorum_state is not None
    d.wipe_all()
    assert d.quorum_state is None


def test_corruption_cuts_at_the_bad_batch_and_persists_the_old_end_first():
    d = disk_with(5)  # offsets 0..9
    d.flush(10)
    assert d.quarantine(2) == (4, 10)
    assert (d.log_end_offset, d.flushed_end_offset, d.must_reach_offset) == (4, 4, 10)
    assert d.log_view().must_reach_offset == 10
    d.crash(random.Random(0))
    assert d.must_reach_offset == 10, "the quarantine state survives a crash"
    with pytest.raises(SimDiskError, match="below must_reach_offset 10"):
        d.clear_quarantine(10)
    for k in range(2, 5):
        d.append(batch(k * 2, 2), k * 2, k * 2 + 2)
    d.flush(10)
    d.clear_quarantine(10)
    assert d.must_reach_offset == -1


def test_lost_fsync_loses_only_the_last_flushed_batches():
    for seed in range(20):
        d = disk_with(5)
        d.flush(10)
        new_end, must = d.lost_fsync(random.Random(seed))
        assert 4 <= new_end < 10 and must == 10
