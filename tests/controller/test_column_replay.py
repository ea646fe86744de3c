"""Replay with a batch's PartitionRecords read as columns
(Controller.apply_batches -> metalog.storage.partition_runs.read_batch) ends in the
same state as applying every record one by one: the same partitions, the
same rejections counted with the same last message, the same offsets. And a
batch that does not parse raises the same error and changes nothing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metalog.broker.controller.state import Controller, ControllerState
from metalog.broker.controller.state_copy import IncrementalCopy
from metalog.storage import batch as b
from metalog.storage import metadata_records as r
from metalog.storage import partition_runs as pr

TS = 1_700_000_000_000


def tid(i: int) -> str:
    return f"{i:08x}-0000-4000-8000-000000000000"


def brokers() -> list[bytes]:
    return [r.encode_record(r.RegisterBroker(i, f"cccccccc-0000-4000-8000-00000000000{i}", 1)) for i in range(1, 6)]


def partition(topic: int, pid: int, reps=(1, 2, 3), isr=None, leader=None) -> bytes:
    isr = reps if isr is None else isr
    return r.encode_record(r.Partition(tid(topic), pid, tuple(reps), tuple(isr),
                                       isr[0] if leader is None else leader, 1, 3))


def log_of(batches: list[list[bytes]]) -> bytes:
    out = bytearray()
    offset = 0
    for values in batches:
        out += b.encode_batch(offset, 2, values, TS)
        offset += len(values)
    return bytes(out)


def one_by_one(log: bytes) -> ControllerState:
    """The reference: every record decoded and applied alone."""
    state = ControllerState()
    for pos, h in b.iter_batches(log):
        for i, value in enumerate(b.decode_records(memoryview(log)[pos:pos + h.size], h)):
            state.apply_value(h.base_offset + i, value)
    return state


def same(a: ControllerState, c: ControllerState) -> None:
    assert a == c
    assert (a.partition_counts, a.invalid_records, a.last_invalid) == (c.partition_counts, c.invalid_records,
                                                                      c.last_invalid)


def test_topic_creations_in_one_batch_replay_as_columns_to_the_same_state():
    """Ten topics of 90 partitions per batch, as CreateTopics writes them,
    replica lists rotating; the batch is read as columns (one run of rows
    between each TopicRecord), and the state equals the record-by-record one."""
    batches = [brokers()]
    for first in range(0, 40, 10):
        values = []
        for t in range(first, first + 10):
            values.append(r.encode_record(r.Topic(f"t{t}", tid(t))))
            values += [partition(t, p, reps=(1 + p % 5, 1 + (p + 1) % 5, 1 + (p + 2) % 5)) for p in range(90)]
        batches.append(values)
    log = log_of(batches)
    read = pr.read_batch(*first_data_batch(log, 1))
    assert read.run is not None and read.run.count == 900
    assert [type(x) for x in read.items[:3]] == [bytes, int, bytes] and read.items[1] == 90
    c = Controller()
    assert c.apply_batches(log) == 5 + 4 * 910
    same(c.state, one_by_one(log))
    assert len(c.state.partitions) == 3600


def first_data_batch(log: bytes, skip: int = 0):
    for k, (pos, h) in enumerate(b.iter_batches(log)):
        if k == skip:
            return memoryview(log)[pos:pos + h.size], h
    raise AssertionError("no such batch")


def test_rejected_partitions_among_the_columns_count_as_one_by_one():
    """A partition of an unknown topic, one whose leader is outside its
    ISR, a RemoveTopic between two stretches of the same topic's rows: the
    rejections and the last message are the record-by-record ones."""
    values = [r.encode_record(r.Topic("t0", tid(0))), r.encode_record(r.Topic("t1", tid(1)))]
    values += [partition(0, p) for p in range(40)]
    values += [partition(0, 40, leader=4)]  # leader 4 is not in the ISR [1, 2, 3]
    values += [partition(0, p) for p in range(41, 80)]
    values += [r.encode_record(r.RemoveTopic(tid(1)))]
    values += [partition(1, p) for p in range(30)]  # topic removed: all 30 rejected
    values += [partition(9, 0)]  # a topic that never existed
    log = log_of([brokers(), values])
    c = Controller()
    c.apply_batches(log)
    ref = one_by_one(log)
    same(c.state, ref)
    assert ref.invalid_records == 32 and "unknown topic" in ref.last_invalid


def test_a_batch_that_does_not_parse_raises_as_before_and_changes_nothing():
    """One record's offset delta is off by one (a good CRC over bad bytes, as
    a writer bug would make it): apply_batches raises the general parser's
    CorruptBatchError and applies none of the batch's records."""
    values = [r.encode_record(r.Topic("t0", tid(0)))] + [partition(0, p) for p in range(100)]
    batch = bytearray(b.encode_batch(0, 2, values, TS))
    h = b.decode_header(bytes(batch))
    # before the value: offset delta (2 bytes), null key, value length (2 bytes)
    od_at = batch.find(values[70]) - 5
    assert bytes(batch[od_at:od_at + 2]) == b._vi(70)
    batch[od_at] += 2
    with pytest.raises(b.CorruptBatchError) as general:
        b.decode_records(bytes(batch), h)
    c = Controller()
    with pytest.raises(b.CorruptBatchError) as columns:
        c._apply_batch_columns(memoryview(bytes(batch)), h)
    assert str(columns.value) == str(general.value) and "offset delta" in str(columns.value)
    assert c.state.offset == 0 and not c.state.topics and not c.state.partitions


def test_an_incremental_copy_in_progress_sees_every_row_applied_as_columns():
    """While a snapshot's copy is taken a slice at a time, rows read as
    columns keep being applied in bulk (the partitions are copied on write,
    topic by topic), and the finished copy equals the state."""
    first = log_of([brokers(), [r.encode_record(r.Topic(f"t{t}", tid(t))) for t in range(3)]
                    + [partition(t, p) for t in range(3) for p in range(100)]])
    c = Controller()
    c.apply_batches(first)
    copy = IncrementalCopy(c.state, slice_entries=10)
    copy.step()
    more = [partition(t, p, reps=(2, 3, 4)) for t in range(3) for p in range(50, 150)]
    c.apply_batches(b.encode_batch(c.state.offset, 2, more, TS))
    while not copy.step():
        pass
    assert copy.finish() == c.state
    assert all(c.state.partitions[(tid(t), p)].replicas == (2, 3, 4) for t in range(3) for p in range(50, 150))


# Rows of one shape (3 replicas, an ISR of 2: a run), each failing exactly
# one of _partition_problem's rules, so that the column check is tried rule
# by rule.
GOOD_ROW = ((1, 2, 3), (1, 2), 1)
NEGATIVE_ID = ((1, 2, 3), (2, 1), 2)  # fine but for its partition id, made negative
BAD_ROWS = [
    ((1, 1, 3), (1, 3), 1),  # duplicate replica
    ((1, -2, 3), (1, 3), 1),  # negative replica
    ((1, 2, 3), (1, 1), 1),  # duplicate ISR member
    ((1, 2, 3), (1, 4), 1),  # ISR member outside the replicas
    ((1, 2, 3), (1, 2), 3),  # leader outside the ISR
    ((1, 2, 3), (3, 2), -1),  # fine: no leader, ISR in another order
    NEGATIVE_ID,
]


@pytest.mark.parametrize("bad", BAD_ROWS)
def test_each_malformed_row_in_a_run_is_refused_as_a_record_alone_would_be(bad):
    """One malformed row among 89 good ones of the same shape: read as
    columns, it is refused (or kept) exactly as the record alone would be."""
    values = [r.encode_record(r.Topic("t0", tid(0)))]
    for p in range(90):
        reps, isr, leader = bad if p == 5 else GOOD_ROW
        pid = -p if (p == 5 and bad == NEGATIVE_ID) else p
        values.append(r.encode_record(r.Partition(tid(0), pid, reps, isr, leader, 1, 3)))
    log = log_of([brokers(), values])
    c = Controller()
    c.apply_batches(log)
    ref = one_by_one(log)
    same(c.state, ref)
    assert ref.invalid_records == (0 if bad[2] == -1 else 1)
    assert len(c.state.partitions) == 90 - ref.invalid_records


@st.composite
def logs(draw):
    """Batches of topic creations, partition changes, removals, configs and
    bad partitions, in any order and size, some records tagged."""
    batches = [brokers()]
    topics = 0
    for _ in range(draw(st.integers(1, 4))):
        values = []
        for _ in range(draw(st.integers(1, 6))):
            kind = draw(st.sampled_from(["create", "create", "change", "remove", "config", "bad", "badrows"]))
            if kind == "create" or topics == 0:
                n = draw(st.integers(1, 4))
                isr_drop = draw(st.integers(0, n - 1))
                values.append(r.encode_record(r.Topic(f"t{topics}", tid(topics))))
                for p in range(draw(st.sampled_from([1, 30, 90, 200]))):
                    reps = tuple(1 + (p + k) % 5 for k in range(n))
                    value = partition(topics, p, reps, reps[:n - isr_drop])
                    if p % 37 == 36 and draw(st.booleans()):
                        value = value[:-1] + b"\x01\x00\x01\x00"  # a tagged field: the general parser's
                    values.append(value)
                topics += 1
            elif kind == "change":
                t = draw(st.integers(0, topics - 1))
                values.append(r.encode_record(r.PartitionChange(tid(t), 0, isr=(1,), leader=1)))
            elif kind == "remove":
                values.append(r.encode_record(r.RemoveTopic(tid(draw(st.integers(0, topics - 1))))))
            elif kind == "config":
                values.append(r.encode_record(r.Config(r.RESOURCE_TOPIC, "t0", "retention.ms", "1")))
            elif kind == "badrows":
                # a creation whose columns hold malformed rows of every kind
                # the column check must refuse as _partition_problem does
                values.append(r.encode_record(r.Topic(f"t{topics}", tid(topics))))
                bad = {p: draw(st.sampled_from(BAD_ROWS)) for p in draw(st.sets(st.integers(0, 89), max_size=6))}
                for p in range(90):
                    reps, isr, leader = bad.get(p, GOOD_ROW)
                    values.append(r.encode_record(r.Partition(tid(topics), -p if (reps, isr, leader) == NEGATIVE_ID
                                                              else p, reps, isr, leader, 1, 3)))
                topics += 1
            else:
                t = draw(st.integers(0, topics))
                values.append(partition(t, draw(st.integers(0, 300)), (1, 2), (1, 3)))  # ISR not in replicas
        batches.append(values)
    return batches


@settings(max_examples=40, deadline=None)
@given(batches=logs())
def test_column_replay_equals_record_by_record(batches):
    log = log_of(batches)
    c = Controller()
    c.apply_batches(log)
    same(c.state, one_by_one(log))


def test_a_loaded_state_is_out_of_the_cyclic_gcs_sight():
    """Controller.load (a snapshot loaded at boot or installed) freezes the
    heap: the partitions map, which a full collection would walk entry by
    entry (about 70 ms at 2M partitions), is in the permanent generation,
    and a full collection afterwards does not see it."""
    import gc

    log = log_of([brokers(), [r.encode_record(r.Topic("t0", tid(0)))] + [partition(0, p) for p in range(100)]])
    c = Controller()
    c.apply_batches(log)
    fresh = Controller()
    try:
        fresh.load(c.state)
        assert gc.get_freeze_count() > 0
        gc.collect()
        assert not any(o is c.state.partitions for o in gc.get_objects())
    finally:
        gc.unfreeze()  # the rest of the test session collects as usual
    assert any(o is c.state.partitions for o in gc.get_objects())
