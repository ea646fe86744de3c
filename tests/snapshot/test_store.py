"""Snapshot directory: boot cleanup, invariant, chunks, downloads, loading with fallback."""

import os

import pytest

from metalog.broker.controller.state import (Controller, ControllerState, load_latest, load_snapshot,
                               write_controller_snapshot)
from metalog.protocol.messages import SnapshotId
from metalog.storage import metadata_records as r
from metalog.storage.snapshot import (CorruptSnapshotError, PositionOutOfRangeError,
                              SnapshotInvariantError, SnapshotNotFoundError, SnapshotStore,
                              snapshot_filename)
from tests.controller.test_state import cluster


def state_at(n_topics):
    c, lg = cluster(3)
    for i in range(n_topics):
        lg.commit(c.create_topic(f"t{i}", 3, 2, topic_id=f"00000000-0000-0000-0000-{i:012d}"))
    lg.commit(c.fence_broker(1))
    return c.state


def snap(store, state, epoch=1):
    return write_controller_snapshot(store, state.copy(), SnapshotId(state.offset, epoch), 0, "c")


def test_generate_and_load(tmp_path):
    store = SnapshotStore(str(tmp_path))
    s = state_at(5)
    res = snap(store, s)
    assert res.records == len(list(s.to_records())) and res.size_bytes == store.size(res.snapshot_id)
    loaded, sid = load_latest(store)
    assert sid == res.snapshot_id and loaded == s


def test_snapshot_of_a_copy_is_not_affected_by_later_applies(tmp_path):
    store = SnapshotStore(str(tmp_path))
    c, lg = cluster(3)
    lg.commit(c.create_topic("t", 2, 2, topic_id="00000000-0000-0000-0000-0000000000a1"))
    copy = c.state.copy()
    expected = ControllerState.from_records(copy.to_records(), copy.offset)
    lg.commit(c.fence_broker(0))
    lg.commit(c.delete_topic("t"))
    write_controller_snapshot(store, copy, SnapshotId(copy.offset, 1), 0)
    loaded, _ = load_latest(store)
    assert loaded == expected and loaded != c.state


def test_corrupt_latest_falls_back_to_older(tmp_path):
    store = SnapshotStore(str(tmp_path))
    old_state = state_at(2)
    snap(store, old_state)
    new_state = state_at(4)
    new = snap(store, new_state, epoch=2)
    with open(new.path, "r+b") as f:
        f.truncate(new.size_bytes - 3)
    loaded, sid = load_latest(store)
    assert sid == SnapshotId(old_state.offset, 1) and loaded == old_state
    names = sorted(os.listdir(tmp_path))
    assert snapshot_filename(new.snapshot_id).replace(".checkpoint", ".checkpoint.corrupt") in names
    assert store.list() == [sid]  # never listed (or loaded) again


def test_only_snapshot_corrupt_gives_none(tmp_path):
    store = SnapshotStore(str(tmp_path))
    res = snap(store, state_at(1))
    data = bytearray(open(res.path, "rb").read())
    data[-10] ^= 0xFF
    open(res.path, "wb").write(data)
    assert load_latest(store) is None


def test_snapshot_with_records_the_state_machine_rejects_is_refused(tmp_path):
    from metalog.storage.snapshot import SnapshotWriter
    from metalog.broker.controller.state import SnapshotLoadError
    store = SnapshotStore(str(tmp_path))
    w = SnapshotWriter(str(tmp_path), SnapshotId(3, 1), 0)
    w.append([r.encode_record(r.Partition("00000000-0000-0000-0000-00000000dead", 0, (1,), (1,), 1))])
    w.freeze()
    with pytest.raises(SnapshotLoadError, match="1 record\\(s\\) rejected.*unknown topic"):
        load_snapshot(store, SnapshotId(3, 1))
    assert load_latest(store) is None


def test_boot_cleanup_removes_leftovers_and_old_snapshots(tmp_path):
    store = SnapshotStore(str(tmp_path))
    a = snap(store, state_at(1))
    b_ = snap(store, state_at(3), epoch=2)
    # a generation cut off, a download cut off, a deletion cut off
    w_part = os.path.join(tmp_path, "00000000000000000099-0000000002-abc.checkpoint.part")
    open(w_part, "wb").write(b"half")
    store.partial(SnapshotId(500, 3)).write_at(0, b"partial download")
    deleted = os.path.join(tmp_path, "00000000000000000001-0000000001.checkpoint.deleted")
    open(deleted, "wb").write(b"x")
    report = store.boot_cleanup(log_start_offset=a.snapshot_id.end_offset + 1)
    assert sorted(report.removed_leftovers) == sorted([
        os.path.basename(w_part), "00000000000000000500-0000000003-fetch.checkpoint.part",
        os.path.basename(deleted)])
    assert report.removed_below_start == [a.snapshot_id]
    assert report.snapshots == [b_.snapshot_id] and report.corrupt == []
    assert os.listdir(tmp_path) == [snapshot_filename(b_.snapshot_id)]


def test_boot_cleanup_quarantines_corrupt_and_enforces_invariant(tmp_path):
    store = SnapshotStore(str(tmp_path))
    res = snap(store, state_at(2))
    with open(res.path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(SnapshotInvariantError) as ei:
        store.boot_cleanup(log_start_offset=res.snapshot_id.end_offset)
    msg = str(ei.value)
    assert f"the log starts at offset {res.snapshot_id.end_offset} but no valid snapshot" in msg
    assert snapshot_filename(res.snapshot_id) in msg and "bootstrap from the leader" in msg
    assert store.list() == []


def test_boot_cleanup_with_log_at_zero_needs_no_snapshot(tmp_path):
    store = SnapshotStore(str(tmp_path))
    assert store.boot_cleanup(0).snapshots == []
    with pytest.raises(SnapshotInvariantError, match="the log starts at offset 7"):
        store.boot_cleanup(7)


def test_read_chunk_errors(tmp_path):
    store = SnapshotStore(str(tmp_path))
    res = snap(store, state_at(1))
    sid, size = res.snapshot_id, res.size_bytes
    whole = open(res.path, "rb").read()
    assert store.read_chunk(sid, 0, 10) == whole[:10]
    assert store.read_chunk(sid, size - 5, 100) == whole[-5:]
    with pytest.raises(PositionOutOfRangeError, match=f"position {size} outside snapshot"):
        store.read_chunk(sid, size, 10)
    with pytest.raises(PositionOutOfRangeError, match="position -1 outside"):
        store.read_chunk(sid, -1, 10)
    with pytest.raises(SnapshotNotFoundError, match="no snapshot 00000000000000000009-0000000009"):
        store.read_chunk(SnapshotId(9, 9), 0, 10)
    assert store.size(SnapshotId(9, 9)) is None


def test_download_by_chunks(tmp_path):
    leader = SnapshotStore(str(tmp_path / "leader"))
    follower = SnapshotStore(str(tmp_path / "follower"))
    s = state_at(3)
    res = snap(leader, s)
    sid = res.snapshot_id
    part = follower.partial(sid)
    pos = 0
    while pos < res.size_bytes:
        chunk = leader.read_chunk(sid, pos, 97)
        follower.partial(sid).write_at(pos, chunk)  # a fresh object per chunk works
        pos += len(chunk)
    part.write_at(0, leader.read_chunk(sid, 0, 50))  # restart from 0 truncates
    with pytest.raises(PositionOutOfRangeError, match="chunk at position 60 but only 50"):
        part.write_at(60, b"x")
    part.write_at(50, leader.read_chunk(sid, 50, res.size_bytes))
    part.complete(res.size_bytes)
    assert follower.list() == [sid]
    loaded, _ = load_latest(follower)
    assert loaded == s


def test_download_bad_size_or_crc_is_refused_and_removed(tmp_path):
    leader = SnapshotStore(str(tmp_path / "leader"))
    follower = SnapshotStore(str(tmp_path / "follower"))
    res = snap(leader, state_at(1))
    sid = res.snapshot_id
    whole = leader.read_chunk(sid, 0, res.size_bytes)
    part = follower.partial(sid)
    part.write_at(0, whole[:-1])
    with pytest.raises(CorruptSnapshotError, match=f"download has {res.size_bytes - 1} byte"):
        part.complete(res.size_bytes)
    bad = bytearray(whole)
    bad[80] ^= 4
    part.write_at(0, bytes(bad))
    with pytest.raises(CorruptSnapshotError, match="-fetch.checkpoint.part: corrupt snapshot"):
        part.complete(res.size_bytes)
    assert os.listdir(follower.directory) == []


def test_delete_before(tmp_path):
    store = SnapshotStore(str(tmp_path))
    ids = [snap(store, state_at(n), epoch=n).snapshot_id for n in (1, 2, 3)]
    assert store.delete_before(ids[2]) == ids[:2]
    assert store.list() == [ids[2]] and store.latest() == ids[2]


def test_snapshot_plus_tail_equals_full_replay(tmp_path):
    store = SnapshotStore(str(tmp_path))
    c, lg = cluster(3)
    for i in range(3):
        lg.commit(c.create_topic(f"t{i}", 2, 2))
    snap_res = snap(store, c.state)
    lg.commit(c.fence_broker(0))
    lg.commit(c.delete_topic("t1"))
    lg.commit(c.unfence_broker(0))
    state, sid = load_latest(store)
    tail = Controller(state)
    tail.apply_batches(bytes(lg.data))  # re-reading from 0 skips what the snapshot holds
    assert sid == snap_res.snapshot_id and tail.records_since_snapshot == lg.next_offset - sid.end_offset
    full = Controller()
    full.apply_batches(bytes(lg.data))
    assert tail.state == full.state == c.state


def chunks_of(data: bytes, size: int):
    return [(pos, data[pos:pos + size]) for pos in range(0, len(data), size)]


@pytest.mark.parametrize("chunk_bytes", [1, 97, 4096, 1 << 20])
def test_a_download_in_order_is_checked_as_it_comes_and_a_bad_byte_anywhere_is_refused(tmp_path, chunk_bytes):
    """Chunks written in order are checked as they arrive (complete() does
    not read the file back); a flipped byte in any chunk, at any chunk size,
    is refused by complete() with the position of its batch, and the partial
    file is gone."""
    leader = SnapshotStore(str(tmp_path / "leader"))
    s = state_at(4)
    res = snap(leader, s)
    sid = res.snapshot_id
    whole = leader.read_chunk(sid, 0, res.size_bytes)
    follower = SnapshotStore(str(tmp_path / f"follower-{chunk_bytes}"))
    part = follower.partial(sid)
    for pos, chunk in chunks_of(whole, chunk_bytes):
        part.write_at(pos, chunk)
    assert part._check is not None and part._written == len(whole)  # streamed: no read-back
    part.complete(res.size_bytes)
    assert load_latest(follower)[0] == s
    for flip in (30, len(whole) // 2, len(whole) - 3):
        bad = bytearray(whole)
        bad[flip] ^= 0x10
        part = follower.partial(SnapshotId(sid.end_offset, sid.epoch + 1))
        for pos, chunk in chunks_of(bytes(bad), chunk_bytes):
            part.write_at(pos, chunk)
        with pytest.raises(CorruptSnapshotError, match="corrupt snapshot|batch epoch|CRC"):
            part.complete(res.size_bytes)
        assert not os.path.exists(part.part_path)


def test_a_download_out_of_order_is_verified_from_disk(tmp_path):
    """A fresh object per chunk (a driver that keeps none) cannot check as
    it goes: complete() reads the file back and still finds a bad byte."""
    leader = SnapshotStore(str(tmp_path / "leader"))
    res = snap(leader, state_at(2))
    sid = res.snapshot_id
    bad = bytearray(leader.read_chunk(sid, 0, res.size_bytes))
    bad[len(bad) // 2] ^= 1
    follower = SnapshotStore(str(tmp_path / "follower"))
    for pos, chunk in chunks_of(bytes(bad), 500):
        follower.partial(sid).write_at(pos, chunk)
    last = follower.partial(sid)
    assert last._check is None
    with pytest.raises(CorruptSnapshotError, match="-fetch.checkpoint.part: corrupt snapshot"):
        last.complete(res.size_bytes)
    assert os.listdir(follower.directory) == []


def test_old_snapshots_can_be_unlinked_later_and_boot_removes_what_was_not(tmp_path):
    """delete_before(unlink=...) renames the old files .deleted at once (out
    of list(), never loaded or served again) and hands them to the caller,
    who unlinks them off the event loop; a .deleted file a crash left behind
    is removed at boot."""
    store = SnapshotStore(str(tmp_path))
    ids = [snap(store, state_at(n), epoch=n).snapshot_id for n in (1, 2, 3)]
    handed: list[str] = []
    assert store.delete_before(ids[2], unlink=handed.append) == ids[:2]
    assert store.list() == [ids[2]] and len(handed) == 2
    assert all(p.endswith(".deleted") and os.path.exists(p) for p in handed)
    with pytest.raises(SnapshotNotFoundError):
        store.read_chunk(ids[0], 0, 10)
    report = store.boot_cleanup(log_start_offset=0)  # the crash: nobody unlinked them
    assert sorted(report.removed_leftovers) == sorted(os.path.basename(p) for p in handed)
    assert not any(os.path.exists(p) for p in handed) and store.list() == [ids[2]]
