"""Producer state for idempotent produce (metalog.storage.producer_state): rebuilt from
batch headers, dedup, out-of-order, unknown/expired producers, truncation
rollback (rebuild from a committed copy plus the log) and the snapshot round
trip through the controller state."""

from __future__ import annotations

from metalog.broker.controller.state import Controller, ControllerState, load_snapshot, write_controller_snapshot
from metalog.broker.server.idempotence import ProducerGuard, split_by_producer
from metalog.protocol import messages as m
from metalog.storage import metadata_records as r
from metalog.storage.batch import encode_batch, iter_batches
from metalog.storage.producer_state import BatchMeta, ProducerStateTable, Verdict
from metalog.storage.snapshot import SnapshotStore

T0 = 1_700_000_000_000


def pbatch(base, pid, seq, n, epoch=0, leader_epoch=1, ts=T0):
    return encode_batch(base, leader_epoch, [b"v%d" % i for i in range(n)], ts,
                        producer_id=pid, producer_epoch=epoch, base_sequence=seq)


def plain(base, n, ts=T0):
    return encode_batch(base, 1, [r.encode_record(r.NoOp())] * n, ts)


def headers(data):
    """The headers of `data`'s batches, as the log's append returns them."""
    return [h for _, h in iter_batches(data)]


def table_of(*batches, expiration_ms=60_000):
    t = ProducerStateTable(expiration_ms)
    t.apply_data(b"".join(batches))
    return t


def test_state_is_rebuilt_from_batch_headers_in_log_order():
    t = table_of(plain(0, 2), pbatch(2, 7, 0, 3), pbatch(5, 8, 0, 1), pbatch(6, 7, 3, 2, leader_epoch=2))
    assert t.end_offset == 8
    e = t.producers[7]
    assert list(e.batches) == [BatchMeta(0, 2, 2, 4, 1), BatchMeta(3, 4, 6, 7, 2)]
    assert e.last_seq == 4 and e.producer_epoch == 0
    assert list(t.producers[8].batches) == [BatchMeta(0, 0, 5, 5, 1)]


def test_duplicate_of_a_retained_batch_names_the_original_offsets():
    t = table_of(pbatch(0, 7, 0, 3), pbatch(3, 7, 3, 2))
    c = t.check(7, 0, 0, 3, T0)
    assert c.verdict is Verdict.DUPLICATE and c.original == BatchMeta(0, 2, 0, 2, 1)
    c = t.check(7, 0, 3, 2, T0)
    assert c.verdict is Verdict.DUPLICATE and (c.original.base_offset, c.original.last_offset) == (3, 4)
    assert t.check(7, 0, 5, 1, T0).verdict is Verdict.APPEND  # the next one in sequence


def test_only_the_last_five_batches_are_retained():
    t = table_of(*(pbatch(i, 7, i, 1) for i in range(7)))
    assert [b.first_seq for b in t.producers[7].batches] == [2, 3, 4, 5, 6]
    assert t.check(7, 0, 2, 1, T0).verdict is Verdict.DUPLICATE
    c = t.check(7, 0, 1, 1, T0)  # too old to be recognised: refused, never appended again
    assert c.verdict is Verdict.OUT_OF_ORDER


def test_out_of_order_sequence_says_what_was_expected():
    t = table_of(pbatch(0, 7, 0, 3))
    c = t.check(7, 0, 5, 1, T0)
    assert c.verdict is Verdict.OUT_OF_ORDER
    assert c.message == "producer id 7 epoch 0: expected sequence 3, got 5..5"
    # Same first sequence but another length is not the same batch.
    assert t.check(7, 0, 0, 2, T0).verdict is Verdict.OUT_OF_ORDER


def test_unknown_producer_starts_at_sequence_zero_else_unknown_producer_id():
    t = table_of()
    assert t.check(9, 0, 0, 4, T0).verdict is Verdict.APPEND
    c = t.check(9, 0, 4, 1, T0)
    assert c.verdict is Verdict.UNKNOWN_PRODUCER
    assert "no state for producer id 9" in c.message


def test_older_epoch_is_fenced_and_a_newer_epoch_restarts_at_zero():
    t = table_of(pbatch(0, 7, 0, 1, epoch=2))
    assert t.check(7, 1, 1, 1, T0).verdict is Verdict.FENCED_EPOCH
    assert t.check(7, 3, 1, 1, T0).verdict is Verdict.OUT_OF_ORDER
    assert t.check(7, 3, 0, 1, T0).verdict is Verdict.APPEND


def test_expiry_after_the_idle_time():
    t = table_of(pbatch(0, 7, 0, 2, ts=T0), pbatch(2, 8, 0, 1, ts=T0 + 30_000), expiration_ms=60_000)
    assert t.check(7, 0, 0, 2, T0 + 59_999).verdict is Verdict.DUPLICATE
    # Idle for expiration_ms: forgotten; its next batch gets UNKNOWN_PRODUCER_ID.
    assert t.check(7, 0, 2, 1, T0 + 60_000).verdict is Verdict.UNKNOWN_PRODUCER
    assert t.expire(T0 + 60_000) == 1
    assert set(t.producers) == {8}


def test_truncation_rolls_back_by_rebuilding_from_the_committed_copy_and_the_log():
    committed_log = [pbatch(0, 7, 0, 2), plain(2, 1)]
    tail = [pbatch(3, 7, 2, 2), pbatch(5, 9, 0, 1)]  # appended, then truncated away
    c = Controller()
    c.apply_batches(b"".join(committed_log))
    assert c.state.producers.end_offset == 3
    guard = ProducerGuard(60_000)
    log = b"".join(committed_log + tail)
    guard.on_append(headers(log))
    assert guard.table.check(7, 0, 2, 2, T0).verdict is Verdict.DUPLICATE
    # Truncate at 3: the log now ends at 3; a different batch takes offset 3.
    kept = b"".join(committed_log)
    guard.rebuild(c.state.producers, lambda off: kept, 3)
    assert guard.table.end_offset == 3 and 9 not in guard.table.producers
    assert guard.table.check(7, 0, 2, 2, T0).verdict is Verdict.APPEND  # the retry is appended again
    guard.on_append(headers(pbatch(3, 7, 2, 2, leader_epoch=2)))
    assert guard.table.check(7, 0, 2, 2, T0).original.leader_epoch == 2


def test_controller_state_carries_producers_through_a_snapshot(tmp_path):
    c = Controller()
    c.apply_batches(pbatch(0, 7, 0, 2) + plain(2, 1) + pbatch(3, 7, 2, 1) + pbatch(4, 11, 0, 3, epoch=1))
    assert c.applied_offset == 7
    store = SnapshotStore(str(tmp_path))
    sid = m.SnapshotId(7, 1)
    write_controller_snapshot(store, c.state.copy(), sid, T0)
    loaded = load_snapshot(store, sid)
    assert loaded.producers == c.state.producers
    assert loaded.producers.end_offset == 7
    assert loaded.producers.check(7, 0, 2, 1, T0).verdict is Verdict.DUPLICATE
    assert loaded.producers.check(11, 1, 3, 1, T0).verdict is Verdict.APPEND
    # Also through to_records/from_records (what the Spark job folds).
    again = ControllerState.from_records(c.state.to_records(), 7)
    assert again.producers == c.state.producers


def test_a_snapshot_written_the_old_way_loads_its_producers(tmp_path):
    """Snapshots written before producer state rode in NoOp records held it
    under metalog's key 1000 and no metadata.version: they load to the same
    producers, at the metadata.version a metalog cluster is born at."""
    from tests.storage.helpers import rewrite_snapshot_the_old_way

    c = Controller()
    c.apply_batches(pbatch(0, 7, 0, 2) + plain(2, 1) + pbatch(3, 7, 2, 1) + pbatch(4, 11, 0, 3, epoch=1))
    store = SnapshotStore(str(tmp_path))
    sid = m.SnapshotId(7, 1)
    write_controller_snapshot(store, c.state.copy(), sid, T0)
    new_records = [r.decode_record(v) for _, v in _data_values(store.path(sid))]
    assert new_records[0] == r.FeatureLevel("metadata.version", 21)
    assert [type(x) for x in new_records[1:]] == [r.ProducerState, r.ProducerState]
    assert rewrite_snapshot_the_old_way(store.path(sid)) == 2
    assert [v[:4] for _, v in _data_values(store.path(sid))] == [bytes.fromhex("01e80700")] * 2
    loaded = load_snapshot(store, sid)
    assert loaded.producers == c.state.producers and loaded.producers.end_offset == 7
    assert loaded.features == {"metadata.version": 21} and loaded == c.state
    assert loaded.producers.check(7, 0, 2, 1, T0).verdict is Verdict.DUPLICATE


def _data_values(path: str) -> list[tuple[int, bytes]]:
    from metalog.storage.batch import decode_records

    with open(path, "rb") as f:
        data = f.read()
    return [(h.base_offset, bytes(v)) for pos, h in iter_batches(data) if not h.is_control
            for v in decode_records(data[pos:pos + h.size], h)]


def test_a_snapshot_without_producer_records_still_loads(tmp_path):
    """Snapshots written before idempotent produce hold no ProducerState records:
    they load with an empty producer table."""
    from metalog.storage.snapshot import SnapshotWriter

    store = SnapshotStore(str(tmp_path))
    sid = m.SnapshotId(3, 1)
    SnapshotWriter(store.directory, sid, T0, "").write_all([r.encode_record(r.FeatureLevel("metadata.version", 17))])
    state = load_snapshot(store, sid)
    assert state.features == {"metadata.version": 17}
    assert len(state.producers) == 0 and state.producers.end_offset == 3


def test_producer_state_in_the_log_is_refused():
    """ProducerState belongs in snapshots; a writer cannot forge it through the log."""
    c = Controller()
    rec = r.encode_record(r.ProducerState(5, 0, T0, ((0, 9, 0, 9, 1),)))
    c.apply_batches(encode_batch(0, 1, [rec], T0))
    assert len(c.state.producers) == 0
    assert c.state.last_invalid == "offset 0: ProducerState belongs in snapshots only"


def test_a_duplicate_is_answered_with_the_original_offset_only_once_committed():
    from metalog.protocol.errors import Errors

    guard = ProducerGuard(60_000)
    guard.on_append(headers(pbatch(0, 7, 0, 3, leader_epoch=4)))
    req = m.ProduceRequest(cluster_id="c", records=[b"a", b"b", b"c"], producer_id=7, producer_epoch=0,
                           base_sequence=0)
    check = guard.check(req, T0)
    assert check.verdict is Verdict.DUPLICATE
    leader = m.LeaderIdAndEpoch(1, 4)
    assert guard.park_duplicate("tok", check.original)
    assert list(guard.release(2, True, leader)) == []  # offsets 0..2 not all committed yet
    (answer,) = guard.release(3, True, leader)
    assert answer == ("tok", m.ProduceResponse(base_offset=0, leader_epoch=4, current_leader=leader))
    # Leadership lost before the commit: NOT_LEADER_OR_FOLLOWER, the client retries elsewhere.
    guard.park_duplicate("tok2", check.original)
    ((tok, resp),) = guard.release(None, False, m.LeaderIdAndEpoch(2, 5))
    assert tok == "tok2" and resp.error_code == Errors.NOT_LEADER_OR_FOLLOWER


def test_producer_ids_come_from_the_leader_epoch_and_never_repeat():
    from metalog.broker.server.idempotence import IDS_PER_EPOCH, ProducerIdAllocator

    alloc = ProducerIdAllocator()
    cl = m.LeaderIdAndEpoch(1, 3)
    ids = [alloc.allocate(3, cl).producer_id for _ in range(3)]
    assert ids == [3 * IDS_PER_EPOCH, 3 * IDS_PER_EPOCH + 1, 3 * IDS_PER_EPOCH + 2]
    assert alloc.allocate(5, cl).producer_id == 5 * IDS_PER_EPOCH  # a later epoch: a fresh range
    assert alloc.allocate(5, cl).producer_epoch == 0


def test_malformed_producer_fields_are_refused_by_name():
    from metalog.broker.server.idempotence import validate_produce

    def req(**kw):
        return m.ProduceRequest(cluster_id="c", records=[b"x"], **kw)

    assert validate_produce(req()) is None
    assert validate_produce(req(producer_id=1, producer_epoch=0, base_sequence=0)) is None
    assert validate_produce(req(base_sequence=4)) == "producer_epoch -1 / base_sequence 4 given without a producer_id"
    assert validate_produce(req(producer_id=1, producer_epoch=-1, base_sequence=0)) == (
        "producer_epoch -1 out of range 0..32767")
    assert validate_produce(req(producer_id=1, producer_epoch=0, base_sequence=-3)) == (
        "base_sequence -3 out of range for 1 record(s)")


def test_a_group_is_split_so_that_no_producer_appears_twice_in_one_step():
    """A retry queued next to its original must not be judged against the same
    state as the original (both would be appended): the group is cut before
    the second request of a producer, order kept; plain requests never cut."""
    pid = {"a1": 7, "b1": 8, "a2": 7, "c1": 9, "b2": 8, "b3": 8}
    waiters = [("p1", 1), ("a1", 2), ("b1", 1), ("p2", 3), ("a2", 2), ("c1", 1), ("b2", 1), ("b3", 1), ("p3", 1)]
    runs = split_by_producer(waiters, pid.get)
    assert [[t for t, _n in run] for run in runs] == [
        ["p1", "a1", "b1", "p2"], ["a2", "c1", "b2"], ["b3", "p3"]]
    assert [w for run in runs for w in run] == waiters
    assert split_by_producer([("p1", 1), ("p2", 1)], pid.get) == [[("p1", 1), ("p2", 1)]]
    assert split_by_producer([], pid.get) == []


def test_rebuild_after_a_quarantine_cut_below_the_committed_copy_then_refetch():
    """A bit flip in a sealed segment cuts the log (quarantine) below what the
    controller had applied: the committed copy is AHEAD of the log end. The
    table is that copy; re-fetching the same committed batches must not apply
    them twice (it once failed apply_header's order assertion, a fatal
    `task_failed` on the old leader, which then never left quarantine), and
    appends past the copy's end apply as usual."""
    committed_log = [pbatch(0, 7, 0, 2), plain(2, 1), pbatch(3, 7, 2, 2), pbatch(5, 9, 0, 1)]
    c = Controller()
    c.apply_batches(b"".join(committed_log))
    assert c.state.producers.end_offset == 6
    guard = ProducerGuard(60_000)
    guard.on_append(headers(b"".join(committed_log)))
    before = guard.table.copy()
    # Cut at 2: the log keeps only the first batch; nothing is read past it.
    kept = committed_log[0]
    guard.rebuild(c.state.producers, lambda off: kept[off:] if off == 0 else b"", 2)
    assert guard.table == before and guard.table.end_offset == 6
    # Re-fetch from the new leader: the same committed batches, then a new one.
    guard.on_append(headers(b"".join(committed_log[1:])))
    assert guard.table == before
    guard.on_append(headers(pbatch(6, 9, 1, 1, leader_epoch=2)))
    assert guard.table.end_offset == 7
    assert guard.table.check(9, 0, 1, 1, T0).original.base_offset == 6
    assert guard.table.check(7, 0, 2, 2, T0).original.base_offset == 3  # still a duplicate, not re-appended
