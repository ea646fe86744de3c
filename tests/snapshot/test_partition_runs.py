"""The loader's fast path (metalog.storage.partition_runs) reads exactly what the
general path reads.

A snapshot's PartitionRecords are read as numpy columns when a run of them
has one shape; anything else (another record type or shape, a tagged field,
one odd byte) ends the run and takes the general parser. These tests hold
the two readings equal: the same records in the same order from a batch,
the same ControllerState from a snapshot, and for a record the state machine
rejects, the same SnapshotLoadError text a user sees.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metalog.broker.controller.state import ControllerState, SnapshotLoadError, load_snapshot
from metalog.protocol.messages import SnapshotId
from metalog.storage import batch as b
from metalog.storage import metadata_records as r
from metalog.storage import partition_runs as pr
from metalog.storage.snapshot import CorruptSnapshotError, SnapshotStore, SnapshotWriter, read_snapshot

SID = SnapshotId(5000, 4)
TOPICS = [f"{i:08x}-0000-4000-8000-00000000000{i % 10}" for i in range(1, 4)]
TAGGED = b"\x01\x00\x01\x00"  # one tagged field: LeaderRecoveryState (tag 0) = 0


def partition(tid: str, pid: int, replicas=(1, 2, 3), isr=None, leader=None) -> bytes:
    isr = replicas if isr is None else isr
    return r.encode_record(r.Partition(tid, pid, tuple(replicas), tuple(isr),
                                       isr[0] if leader is None else leader, 2, 7))


def with_tag(value: bytes) -> bytes:
    """The same PartitionRecord with a tagged field instead of none."""
    assert value[-1] == 0
    return value[:-1] + TAGGED


def head() -> list[bytes]:
    return [r.encode_record(r.RegisterBroker(i, f"cccccccc-0000-4000-8000-00000000000{i}", 1)) for i in range(1, 6)] + \
        [r.encode_record(r.Topic(f"t{i}", tid)) for i, tid in enumerate(TOPICS)]


def expand(items) -> list[bytes]:
    """iter_batch's items as record values again (a run re-encoded)."""
    out = []
    for item in items:
        if type(item) is bytes:
            out.append(item)
            continue
        for row in range(item.count):
            out.append(r.encode_record(r.Partition(
                item.topic_ids[row], int(item.partition_ids[row]), tuple(item.replicas[row].tolist()),
                tuple(item.isr[row].tolist()), int(item.leaders[row]), int(item.leader_epochs[row]),
                int(item.partition_epochs[row]))))
    return out


def one_batch(values: list[bytes]) -> tuple[bytes, b.BatchHeader]:
    batch = bytes(b.encode_batch(100, 3, values, 1_700_000_000_000))
    return batch, b.decode_header(batch)


def test_a_batch_reads_the_same_with_runs_across_offset_delta_widths():
    """9,000 records in one batch: offset deltas of 1, 2 and 3 varint bytes
    (the row size changes at 64 and 8,192), shapes changing mid-batch, a
    tagged field and a Topic record among them. Runs cover most records, the
    odd ones come as values, and together they are the batch's records."""
    values = head()
    for pid in range(9000):
        if pid == 500:
            values.append(with_tag(partition(TOPICS[0], pid)))
        elif 3000 <= pid < 3400:
            values.append(partition(TOPICS[1], pid, replicas=(4, 5), isr=(5,)))
        elif pid == 7000:
            values.append(r.encode_record(r.Topic("late", "aaaaaaaa-0000-4000-8000-000000000000")))
        else:
            values.append(partition(TOPICS[pid % 3], pid, replicas=(1 + pid % 5, 1 + (pid + 1) % 5, 1 + (pid + 2) % 5)))
    batch, h = one_batch(values)
    items = list(pr.iter_batch(batch, h))
    runs = [x for x in items if type(x) is not bytes]
    assert expand(items) == b.decode_records(batch, h) == values
    assert sum(run.count for run in runs) >= 8800, "most partitions should come as runs"
    assert {run.replicas.shape[1] for run in runs} == {2, 3}
    tagged = [x for x in items if type(x) is bytes and x.startswith(pr.PARTITION_RECORD_PREFIX) and x.endswith(TAGGED)]
    assert len(tagged) == 1  # the tagged record is read by the general decoder


def test_a_run_goes_on_across_offset_delta_widths_and_past_the_lookup_table():
    """20,000 partitions of one shape in one batch are one run, offset deltas
    of 1, 2 and 3 bytes alike (a run does not end where the row size
    changes), and records past index 16,384 (beyond metalog.storage.batch's varint
    table) read the same as the general parser reads them."""
    values = [partition(TOPICS[pid % 3], pid // 3) for pid in range(20_000)]
    values += [r.encode_record(r.Config(r.RESOURCE_TOPIC, "t0", f"k{i}", "v")) for i in range(3)]
    batch, h = one_batch(values)
    items = list(pr.iter_batch(batch, h))
    assert [type(x) for x in items] == [pr.PartitionRun, bytes, bytes, bytes]
    assert items[0].count == 20_000 and items[0].first_index == 0
    assert expand(items) == b.decode_records(batch, h) == values


def test_a_damaged_record_inside_a_run_is_reported_as_the_general_parser_reports_it():
    """One record's offset delta is wrong (a batch rewritten with a good CRC,
    as a bug in a writer would make it): the run stops before it and the
    error is the general parser's CorruptBatchError, at the same position."""
    values = head() + [partition(TOPICS[0], pid) for pid in range(200)]
    batch, h = one_batch(values)
    data = bytearray(batch)
    index = len(values) - 10
    # Before the value: the offset delta (2 bytes here), the null key, the
    # value length (2 bytes).
    od_at = data.find(values[index]) - 5
    assert data[od_at:od_at + 2] == b._vi(index)
    data[od_at] += 2  # offset delta index + 1, same width
    with pytest.raises(b.CorruptBatchError) as general:
        b.decode_records(bytes(data), h)
    with pytest.raises(b.CorruptBatchError) as fast:
        list(pr.iter_batch(bytes(data), h))
    assert str(fast.value) == str(general.value) and "offset delta" in str(fast.value)
    assert fast.value.position == general.value.position


def write(tmp_path, values: list[bytes], batch_bytes_max: int = 1 << 20) -> SnapshotStore:
    store = SnapshotStore(str(tmp_path))
    SnapshotWriter(store.directory, SID, 1, "c", batch_bytes_max=batch_bytes_max).write_all(values)
    return store


def general_load(store: SnapshotStore) -> ControllerState:
    """The reference: every value decoded and applied one by one."""
    _, _, values = read_snapshot(store.path(SID))
    state = ControllerState.from_records((r.decode_record(v) for v in values), SID.end_offset)
    if state.invalid_records:
        raise SnapshotLoadError(
            f"snapshot {SID}: {state.invalid_records} record(s) rejected by the state "
            f"machine (last: {state.last_invalid})")
    return state


def outcome(fn):
    try:
        return fn()
    except SnapshotLoadError as exc:
        return f"SnapshotLoadError: {exc}"


@pytest.mark.parametrize("bad, message", [
    (dict(isr=(1, 4)), "ISR [1, 4] is not a subset of replicas [1, 2, 3]"),
    (dict(leader=4), "leader 4 is not in the ISR [1, 2, 3]"),
    (dict(replicas=(1, 1, 2), isr=(1, 2)), "bad replica list [1, 1, 2]"),
    (dict(replicas=(1, 2, -3), isr=(1, 2)), "bad replica list [1, 2, -3]"),
    (dict(isr=(2, 2, 3)), "bad ISR [2, 2, 3]"),
])
def test_a_rejected_partition_inside_a_run_fails_the_load_with_the_state_machines_words(tmp_path, bad, message):
    """A PartitionRecord the state machine rejects, in the middle of 2,000
    good ones of the same shape: the load refuses the snapshot with the
    general path's message -- what `metalog` logs as snapshot_refused."""
    values = head() + [partition(TOPICS[0], pid, **(bad if pid == 1234 else {})) for pid in range(2000)]
    store = write(tmp_path, values)
    with pytest.raises(SnapshotLoadError) as exc:
        load_snapshot(store, SID)
    assert str(exc.value) == outcome(lambda: general_load(store)).removeprefix("SnapshotLoadError: ")
    assert "1 record(s) rejected" in str(exc.value) and message in str(exc.value)


def test_a_partition_of_an_unknown_topic_inside_a_run_is_rejected(tmp_path):
    unknown = "bbbbbbbb-0000-4000-8000-000000000000"
    values = head() + [partition(unknown if pid == 700 else TOPICS[1], pid) for pid in range(1000)]
    store = write(tmp_path, values)
    with pytest.raises(SnapshotLoadError, match=f"Partition 700 of unknown topic {unknown}"):
        load_snapshot(store, SID)


def test_a_batch_changed_after_the_check_is_refused_on_the_fast_path_too(tmp_path):
    values = head() + [partition(TOPICS[0], pid) for pid in range(3000)]
    store = write(tmp_path, values, batch_bytes_max=32 << 10)
    path = store.path(SID)
    _, _, items = read_snapshot(path, partition_runs=True)
    with open(path, "r+b") as f:
        positions = [pos for pos, _ in b.iter_batches(f.read())]
        f.seek(positions[3] + 300)
        byte = f.read(1)
        f.seek(positions[3] + 300)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CorruptSnapshotError, match="changed after its check"):
        list(items)


shapes = st.tuples(st.integers(1, 5), st.integers(0, 4))  # replica count, ISR members dropped


@st.composite
def snapshots(draw):
    """Stretches of partitions of a few shapes (long enough for runs), a few
    records of other kinds, tagged ones or rejected ones among them; batches
    of any size."""
    values = head()
    pid_next = {tid: 0 for tid in TOPICS}
    for _ in range(draw(st.integers(1, 5))):
        n, drop = draw(shapes)
        tid = draw(st.sampled_from(TOPICS))
        count = draw(st.sampled_from([1, 40, 300, 700]))
        # At most three odd records per stretch: 1 tagged, 2 a Config, 3 rejected.
        odd = dict(draw(st.lists(st.tuples(st.integers(0, count - 1), st.integers(1, 3)), max_size=3)))
        for row in range(count):
            reps = tuple(range(1, n + 1))
            isr = reps[:max(1, n - drop)]
            leader = -1 if row % 17 == 5 else isr[row % len(isr)]
            pid = pid_next[tid]
            pid_next[tid] += 2 if row % 11 == 3 else 1  # gaps in the ids
            value = partition(tid, pid, reps, isr, leader)
            kind = odd.get(row, 0)
            if kind == 1:
                value = with_tag(value)
            elif kind == 2:
                value = r.encode_record(r.Config(r.RESOURCE_TOPIC, "t0", "retention.ms", str(pid)))
            elif kind == 3:
                value = partition(tid, pid, reps, isr, leader=99)  # rejected: not in the ISR
            values.append(value)
    return values, draw(st.sampled_from([300, 64 << 10, 1 << 20]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=snapshots())
def test_the_fast_load_equals_the_general_load(tmp_path_factory, case):
    values, batch_bytes_max = case
    store = write(tmp_path_factory.mktemp("snap"), values, batch_bytes_max)
    fast = outcome(lambda: load_snapshot(store, SID))
    slow = outcome(lambda: general_load(store))
    assert fast == slow
    if isinstance(fast, ControllerState):
        assert fast.partition_counts == slow.partition_counts
        # an ISR equal to its replicas is the replicas tuple itself (compact state)
        assert all(p.isr is p.replicas for p in fast.partitions.values() if p.isr == p.replicas)
        # topics kept as columns answer as records do: a scan for a broker,
        # a snapshot's records
        for bid in range(1, 7):
            assert fast.fence_changes(bid) == slow.fence_changes(bid)
        assert list(fast.to_records()) == list(slow.to_records())


@pytest.mark.parametrize("ids_by_topic", [
    {0: range(1000), 1: range(600), 2: range(300)},  # dense: the bulk insert
    {0: list(range(400)) + list(range(5000, 5400)), 1: range(600)},  # a gap inside a run
    {0: range(1, 700), 1: list(range(300)) + [2**31 - 1]},  # no id 0; one far id at a run's end
])
def test_the_fast_load_keeps_each_topics_partition_ids(tmp_path, ids_by_topic):
    """The bulk insert of a run keeps broker/controller/partition_ids.py's index as
    _partition does: every topic's ids are exactly those loaded, sparse
    topics (a gap) and dense ones alike, and a topic without a gap keeps no
    id array."""
    values = head() + [partition(TOPICS[t], pid) for t, ids in ids_by_topic.items() for pid in ids]
    store = write(tmp_path, values)
    fast, general = load_snapshot(store, SID), general_load(store)
    assert fast == general
    for t, ids in ids_by_topic.items():
        assert list(fast.partition_ids(TOPICS[t])) == list(general.partition_ids(TOPICS[t])) == list(ids)
    sparse = {TOPICS[t] for t, ids in ids_by_topic.items() if list(ids) != list(range(len(ids)))}
    assert set(fast.sparse_partition_ids) == set(general.sparse_partition_ids) == sparse
    # The same records as a log: replay's columns keep the index too.
    from metalog.broker.controller.state import Controller

    c = Controller()
    c.apply_batches(b.encode_batch(0, 1, values, 0))
    assert c.state.offset == len(values) and c.state.invalid_records == 0
    for t, ids in ids_by_topic.items():
        assert list(c.state.partition_ids(TOPICS[t])) == list(ids)
    assert set(c.state.sparse_partition_ids) == sparse


def test_a_loaded_state_kept_as_columns_changes_as_the_general_one_does(tmp_path):
    """A dense snapshot's topics load as columns (broker/controller/partition_map.py).
    Fencing a broker, a PartitionChange, a RemoveTopic and a copy taken in
    between leave the loaded state equal to the one the general path built,
    record for record, and the copy as it was."""
    from metalog.broker.controller.partition_map import TopicColumns

    values = head() + [partition(TOPICS[t], pid, replicas=(1 + t, 2 + t, 3 + t)) for t in range(3)
                       for pid in range(400)]
    store = write(tmp_path, values)
    fast, slow = load_snapshot(store, SID), general_load(store)
    assert all(type(fast.partitions.topic(t)) is TopicColumns for t in TOPICS), "the load kept no columns"
    copy_fast, copy_slow = fast.copy(), slow.copy()
    for rec in (r.FenceBrokerImplicit(2, 1), r.PartitionChange(TOPICS[2], 7, leader=5, isr=(5, 3, 4)),
                r.RemoveTopic(TOPICS[0])):
        fast._apply(rec)
        slow._apply(rec)
        assert fast == slow and fast.invalid_records == slow.invalid_records == 0
    # broker 2 left the ISR; it led, and no other replica is unfenced (registered brokers start fenced)
    assert fast.partitions[(TOPICS[1], 5)].isr == (3, 4) and fast.partitions[(TOPICS[1], 5)].leader == r.NO_LEADER
    assert list(fast.to_records()) == list(slow.to_records())
    assert copy_fast == copy_slow == general_load(store)
    assert copy_fast.partitions[(TOPICS[1], 5)].isr == (2, 3, 4)
