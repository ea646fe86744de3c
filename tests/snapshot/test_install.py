"""Installing a downloaded snapshot (broker/server/snapshot_work.py SnapshotWork.install)
with the runtime's real parts: snapshot store, segmented log, digest,
controller and metrics in a temporary data dir.

A download is checked and loaded as it arrives; the install reads the file
back from disk with every CRC checked again. If the bytes on disk went bad
in between, it refuses them *before* the log is reset: the install rolls
back as a bad download does (SnapshotInstallFailed, the log and its state
untouched, the file quarantined) instead of leaving a broker with no log
and no state. Chunks that did not come in order load from the file."""

import os
import types

import structlog

from metalog.broker.server.consistency import LogDigest
from metalog.broker.controller.state import Controller, write_controller_snapshot
from metalog.broker.server.metrics import BrokerMetrics
from metalog.broker.quorum import api as qa
from metalog.broker.server.snapshot_work import SnapshotWork
from metalog.protocol.messages import SnapshotId
from metalog.storage import batch as b
from metalog.storage import metadata_records as r
from metalog.storage.segments import SegmentedLog
from metalog.storage.snapshot import SnapshotStore


def leader_snapshot(tmp_path) -> tuple[SnapshotStore, SnapshotId, Controller]:
    c = Controller()
    log = bytearray()
    for bid in range(3):
        log += b.encode_batch(len(c.state.brokers), 1, c.register_broker(bid, [("SSL", "h", 9000 + bid)]), 0)
        c.apply_batches(bytes(log))
    c.state.apply(c.state.offset, r.Topic("t", "00000000-0000-4000-8000-000000000001"))
    store = SnapshotStore(str(tmp_path / "leader"))
    sid = SnapshotId(c.state.offset, 1)
    write_controller_snapshot(store, c.state.copy(), sid, 0, "cluster")
    return store, sid, c


def follower(tmp_path):
    part_dir = tmp_path / "follower"
    seg_log = SegmentedLog.open(str(part_dir / "log"))
    seg_log.append(b.encode_batch(0, 1, [r.encode_record(r.NoOp())] * 2, 0))
    broker = types.SimpleNamespace(
        snapshots=SnapshotStore(str(part_dir / "snapshots")), seg_log=seg_log,
        digest=LogDigest.build(seg_log), controller=Controller(), metrics=BrokerMetrics(9),
        log=structlog.get_logger("test"), unlink_later=os.unlink)
    return broker, SnapshotWork(broker, 1 << 40, lambda: 1, lambda ev: None)


def download(work, store, sid, chunk_bytes=300):
    size = store.size(sid)
    for pos in range(0, size, chunk_bytes):
        work.write_chunk(qa.WriteSnapshotChunk(sid, pos, store.read_chunk(sid, pos, chunk_bytes)))
    return size


def installed(work, sid, size) -> dict:
    """The install's snapshot_installed event (the install must succeed)."""
    with structlog.testing.capture_logs() as events:
        assert work.install(qa.InstallSnapshot(sid, size)) is None
    [event] = [e for e in events if e["event"] == "snapshot_installed"]
    return event


def test_an_install_loads_the_snapshot_and_resets_the_log_to_its_end(tmp_path):
    store, sid, leader = leader_snapshot(tmp_path)
    broker, work = follower(tmp_path)
    size = download(work, store, sid)
    assert installed(work, sid, size)["loaded_while_downloading"] is True
    assert broker.controller.state == leader.state
    assert broker.seg_log.log_start_offset == broker.seg_log.log_end_offset == sid.end_offset
    assert broker.snapshots.list() == [sid]


def test_bytes_gone_bad_on_disk_after_the_download_roll_back_the_install(tmp_path):
    store, sid, _ = leader_snapshot(tmp_path)
    broker, work = follower(tmp_path)
    size = download(work, store, sid)
    part = work._partials[sid]
    fd = os.open(part.part_path, os.O_RDWR)  # one byte flipped on disk behind the streamed check
    try:
        at = size // 2
        byte = os.pread(fd, 1, at)
        os.pwrite(fd, bytes([byte[0] ^ 0x08]), at)
    finally:
        os.close(fd)
    with structlog.testing.capture_logs() as events:
        failed = work.install(qa.InstallSnapshot(sid, size))
    assert isinstance(failed, qa.SnapshotInstallFailed) and failed.snapshot_id == sid
    assert "corrupt" in failed.reason.lower() or "crc" in failed.reason.lower()
    rejected = [e for e in events if e["event"] == "snapshot_download_rejected"]
    assert len(rejected) == 1 and rejected[0]["action"] == "snapshot quarantined, log kept, downloading again"
    # Nothing was reset: the two records of the log and the empty state stay.
    assert (broker.seg_log.log_start_offset, broker.seg_log.log_end_offset) == (0, 2)
    assert broker.controller.state.offset == 0 and not broker.controller.state.brokers
    assert broker.snapshots.list() == []  # the bad file is quarantined, never loaded
    assert any(n.endswith(".corrupt") for n in os.listdir(broker.snapshots.directory))


def test_chunks_out_of_order_or_a_restart_load_from_the_file(tmp_path):
    """The streamed load saw a chunk twice (one written again) or a download
    begun again at 0 on the same object: it cannot be trusted to hold each
    record once, so the install loads the file, to the same state."""
    store, sid, leader = leader_snapshot(tmp_path)
    broker, work = follower(tmp_path)
    size = download(work, store, sid)
    work.write_chunk(qa.WriteSnapshotChunk(sid, 300, store.read_chunk(sid, 300, 300)))  # again, out of order
    work.write_chunk(qa.WriteSnapshotChunk(sid, size - (size % 300 or 300), store.read_chunk(
        sid, size - (size % 300 or 300), 300)))
    event = installed(work, sid, size)
    assert event["loaded_while_downloading"] is False
    assert broker.controller.state == leader.state

    broker, work = follower(tmp_path / "again")
    download(work, store, sid)
    part = work._partials[sid]
    for pos in range(0, size, 300):  # the same object, from 0 again
        part.write_at(pos, store.read_chunk(sid, pos, 300))
    assert not part.streamed
    assert installed(work, sid, size)["loaded_while_downloading"] is False
    assert broker.controller.state == leader.state


def test_a_snapshot_the_state_machine_refuses_stops_the_install_before_the_log_is_reset(tmp_path):
    """Whole, CRC-valid bytes whose records do not rebuild a state (a
    partition of a topic the snapshot does not hold): the install raises the
    SnapshotLoadError a boot's load raises, word for word (the runtime's
    fatal path), leaving the log and the state as they were."""
    import pytest

    from metalog.broker.controller.state import SnapshotLoadError, load_snapshot
    from metalog.storage.snapshot import SnapshotWriter

    store = SnapshotStore(str(tmp_path / "leader"))
    sid = SnapshotId(50, 1)
    orphan = r.Partition("00000000-0000-4000-8000-0000000000aa", 0, (1, 2), (1, 2), 1)
    SnapshotWriter(store.directory, sid, 1, "cluster").write_all(
        [r.encode_record(r.Topic("t", "00000000-0000-4000-8000-000000000001")), r.encode_record(orphan)])
    with pytest.raises(SnapshotLoadError) as at_boot:
        load_snapshot(store, sid)
    broker, work = follower(tmp_path)
    size = download(work, store, sid)
    with pytest.raises(SnapshotLoadError) as at_install:
        work.install(qa.InstallSnapshot(sid, size))
    assert str(at_install.value) == str(at_boot.value) and "unknown topic" in str(at_install.value)
    assert (broker.seg_log.log_start_offset, broker.seg_log.log_end_offset) == (0, 2)
    assert broker.controller.state.offset == 0 and not broker.controller.state.topics


def test_a_download_given_up_leaves_no_partial_file_or_state(tmp_path):
    """The follower went back to the leader's log (an AppendBatches): the
    half-downloaded file and the state loaded from it go at once; a new
    download from position 0 then installs as usual."""
    store, sid, leader = leader_snapshot(tmp_path)
    broker, work = follower(tmp_path)
    size = store.size(sid)
    half = size // 2
    work.write_chunk(qa.WriteSnapshotChunk(sid, 0, store.read_chunk(sid, 0, half)))
    part_path = work._partials[sid].part_path
    assert os.path.exists(part_path) and work.downloading
    work.abandon_downloads()
    assert not os.path.exists(part_path) and not work.downloading and not work._loads
    download(work, store, sid)
    assert installed(work, sid, size)["loaded_while_downloading"] is True
    assert broker.controller.state == leader.state


def test_an_install_carries_the_producers_written_either_way(tmp_path):
    """A follower installing a snapshot by FetchSnapshot gets the leader's
    idempotent producers, from a snapshot of this build (ProducerState in
    NoOp records) and from one written the old way (key 1000)."""
    from metalog.storage.producer_state import Verdict
    from tests.storage.helpers import rewrite_snapshot_the_old_way

    for way in ("new", "old"):
        c = Controller()
        data = (b.encode_batch(0, 1, [b"a", b"b"], 0, producer_id=7, producer_epoch=0, base_sequence=0)
                + b.encode_batch(2, 1, [b"c"], 0, producer_id=9, producer_epoch=2, base_sequence=0))
        c.apply_batches(data)
        store = SnapshotStore(str(tmp_path / way / "leader"))
        sid = SnapshotId(c.state.offset, 1)
        write_controller_snapshot(store, c.state.copy(), sid, 0, "cluster")
        if way == "old":
            assert rewrite_snapshot_the_old_way(store.path(sid)) == 2
        broker, work = follower(tmp_path / way)
        size = download(work, store, sid)
        installed(work, sid, size)
        got = broker.controller.state.producers
        assert got == c.state.producers and set(got.producers) == {7, 9}, way
        assert got.check(7, 0, 0, 2, 0).verdict is Verdict.DUPLICATE, way
