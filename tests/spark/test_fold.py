"""The distributed replay plan (per-key folds + side tables), run without
Spark, must give exactly ControllerState's result on random workloads."""

from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from metalog.broker.controller.state import ControllerState
from metalog.storage import metadata_records as r
from tests.spark.workload import random_records, sequential_state
from metalog.tools.spark import fold


def _files(offsets: list[tuple[int, bytes]], rng: random.Random) -> list[tuple[int, bytes, str]]:
    """The records cut into 1-4 'files' at random points, the files in a random
    order (a task may hold several, not adjacent), each file's records in order."""
    bounds = sorted(rng.sample(range(1, len(offsets)), min(3, len(offsets) - 1))) if len(offsets) > 1 else []
    files = [offsets[a:b] for a, b in zip([0, *bounds], [*bounds, len(offsets)])]
    rng.shuffle(files)
    return [(o, v, f"f{o0}") for part in files for o0 in [part[0][0]] for o, v in part]


def _check(values: list[bytes], cuts: list[int], rng: random.Random | None = None) -> None:
    offsets = [(i * 2 + 1, v) for i, v in enumerate(values)]  # gaps stand for control batches
    if rng is None:
        by_cut, invalid = fold.replay_sequential(offsets, cuts)
    else:  # the Spark job's map-side combine: superseded config writes dropped per file and cut
        by_cut, invalid = fold.replay_sequential(_files(offsets, rng), cuts, combine=True)
    for cut in cuts:
        expected = sequential_state(offsets, cut)
        got, rejected = fold.state_from_rows(by_cut[cut], cut)
        assert rejected == 0, f"cut {cut}: the rebuilt snapshot has records a broker would reject"
        assert got == expected, f"cut {cut}: {got!r} != {expected!r}"
        assert got.to_json() == expected.to_json()
    expected_last = sequential_state(offsets, max(cuts))
    # The controller counts produced (non-metadata) records as invalid too; the
    # Spark job counts them apart as data records: the two add up to its count.
    data = sum(1 for o, v in offsets if o < max(cuts) and fold.key_of(v)[0] == fold.K_DATA)
    assert invalid + data == expected_last.invalid_records


def test_produced_records_are_data_not_invalid():
    """Values without a metadata frame are data records; a known api key
    with a body that does not decode is an invalid metadata record; a Kafka
    type we do not model is counted by its name."""
    assert fold.key_of(b"hello, produced record")[0] == fold.K_DATA  # frame version 0x68: not a frame
    assert fold.key_of(b"\x01")[0] == fold.K_DATA  # ends inside the frame
    broken = r.encode_record(r.FenceBroker(1, 1))[:5]
    assert fold.key_of(broken)[0] == fold.K_INVALID
    assert fold.key_of(bytes.fromhex("01 0f 00 00")) == (fold.K_PRODUCER_IDS, "")


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 400))
def test_folds_equal_sequential_state(seed, n):
    rng = random.Random(seed)
    values = random_records(rng, n)
    end = 2 * n + 1
    cuts = sorted({end, rng.randrange(1, end + 1), rng.randrange(1, end + 1)})
    _check(values, cuts)
    _check(values, cuts, rng)


def test_combine_keeps_what_a_cut_can_see():
    """A config key written many times across cuts, its topic deleted and
    re-created between writes, writes to the deleted name (invalid) inside a
    run: the combined replay equals ControllerState at every cut, invalid
    count included, and the combine did drop rows."""
    tid1, tid2 = "00000000-0000-0000-0000-0000000000a1", "00000000-0000-0000-0000-0000000000a2"

    def cfg(v):
        return r.Config(r.RESOURCE_TOPIC, "t", "retention.ms", v)

    recs = [r.Topic("t", tid1), *[cfg(str(i)) for i in range(10)], r.RemoveTopic(tid1),
            *[cfg(f"dead{i}") for i in range(5)], r.Topic("t", tid2), *[cfg(str(i)) for i in range(20, 30)],
            cfg(None), cfg("last"), r.RemoveTopic(tid2), cfg("after"), r.Topic("t", tid1)]
    values = [r.encode_record(x) for x in recs]
    offsets = [(i * 2 + 1, v) for i, v in enumerate(values)]
    end = 2 * len(values) + 1
    cuts = sorted({end, 8, 14, 23, 36, 41, 60, 63, 66})
    for rng in (None, random.Random(1), random.Random(2)):
        _check(values, cuts, rng)
    combiner = fold.Combiner(cuts)
    rows = [row for o, v in offsets for row in combiner.feed(o, v, "f")] + list(combiner.flush())
    assert sum(x.n for x in rows) == len(values)  # every record counted once
    configs = sum(isinstance(x, r.Config) for x in recs)
    assert len([x for x in rows if x.kind == fold.K_CONFIG]) < configs / 2


def test_combine_never_spans_a_transaction_marker():
    """The fused decode combines before the job drops an aborted transaction's
    range: a run spanning BeginTransaction would leave only its last write,
    inside the range, and the write before it would be lost with it."""
    tid = "00000000-0000-0000-0000-0000000000a1"

    def cfg(v):
        return r.encode_record(r.Config(r.RESOURCE_TOPIC, "t", "retention.ms", v))

    begin, abort = r.encode_record(r.UnknownRecord(23, 0, b"\x00")), r.encode_record(r.UnknownRecord(25, 0, b"\x00"))
    values = [r.encode_record(r.Topic("t", tid)), cfg("1"), cfg("2"), begin, cfg("3"), cfg("4"), abort, cfg("5")]
    combiner = fold.Combiner([100])
    rows = [row for o, v in enumerate(values) for row in combiner.feed(o, v, "f")] + list(combiner.flush())
    kept = [(x.offset, x.n) for x in rows if x.kind == fold.K_CONFIG]
    assert kept == [(2, 2), (5, 2), (7, 1)]  # one run each side of each marker
    assert sum(x.n for x in rows) == len(values)


def test_fence_expansion_elects_by_status_at_that_offset():
    """A fence elects the first usable replica as of the fence offset: a broker
    unfenced later must not count, one fenced earlier must not count."""
    tid = "00000000-0000-0000-0000-0000000000f1"
    recs = [
        r.RegisterBroker(1, "00000000-0000-0000-0000-0000000000b0", 1, fenced=False), r.RegisterBroker(2, "00000000-0000-0000-0000-0000000000b1", 1, fenced=True),
        r.RegisterBroker(3, "00000000-0000-0000-0000-0000000000b2", 1, fenced=False), r.Topic("x", tid),
        r.Partition(tid, 0, (1, 2, 3), (1, 2, 3), 1),
        r.FenceBrokerImplicit(1, 1),  # 2 is fenced now, 3 is elected
        r.UnfenceBroker(2, 1), r.UnfenceBroker(1, 1),
        r.FenceBrokerImplicit(3, 1),  # 1 is first usable in replica order
        r.RemoveTopic(tid), r.Topic("x", tid),  # re-created with the same id and name
        r.Partition(tid, 0, (3, 1), (3, 1), 3),
        r.FenceBrokerImplicit(1, 1),  # isr -> (3,), leader 3 stays
    ]
    values = [r.encode_record(x) for x in recs]
    _check(values, [len(values) * 2 + 1, 13, 19])
    by_cut, _ = fold.replay_sequential([(i * 2 + 1, v) for i, v in enumerate(values)], [12, 27])
    p12 = [r.decode_record(x.value) for x in by_cut[12] if x.sec == fold.SEC_PARTITION][0]
    assert (p12.leader, p12.isr, p12.leader_epoch) == (3, (2, 3), 1)
    p = [r.decode_record(x.value) for x in by_cut[27] if x.sec == fold.SEC_PARTITION][0]
    assert (p.leader, p.isr, p.partition_epoch) == (3, (3,), 1)


def test_state_rows_sort_as_to_records():
    rng = random.Random(7)
    values = random_records(rng, 300)
    offsets = list(enumerate(values))
    by_cut, _ = fold.replay_sequential(offsets, [300])
    expected = sequential_state(offsets, 300)
    got = [row.value for row in fold.iter_sorted(by_cut[300])]
    assert got == [r.encode_record(x) for x in expected.to_records()]


def test_acl_fold_follows_the_controller_rules():
    """An ACL id added twice keeps the first entry (the second is invalid), a
    removal of an unknown id is invalid, a malformed entry is invalid, and a
    re-add after removal is valid; every cut matches ControllerState."""
    def acl(acl_id: str, op: int = 4) -> r.AccessControlEntry:
        return r.AccessControlEntry(acl_id, 2, "__cluster_metadata", 3, "User:alice", "*", op, 3)

    a, b, c, d = (f"00000000-0000-0000-0000-00000000000{x}" for x in "abcd")
    values = [r.encode_record(x) for x in (
        acl(a), acl(a, op=3), r.RemoveAccessControlEntry(b), acl(c, op=99),
        r.RemoveAccessControlEntry(a), acl(a, op=8), acl(d))]
    by_cut, invalid = fold.replay_sequential(list(enumerate(values)), [2, 5, 7])
    assert invalid == 3
    final, _ = fold.state_from_rows(by_cut[7], 7)
    assert sorted(final.acls) == [a, d] and final.acls[a].operation == 8
    mid, _ = fold.state_from_rows(by_cut[5], 5)
    assert mid.acls == {}
    _check(values, [1, 2, 5, 7])


def test_partition_change_keyed_from_its_head_and_invalid_if_the_rest_is_broken():
    """key_of reads a PartitionChange's key from its first body bytes without
    decoding it; when the rest does not decode, the partition fold counts it
    invalid, so the state and the invalid count are still the controller's."""
    tid = "00000000-0000-4000-8000-000000000007"
    good = r.encode_record(r.PartitionChange(tid, 2, (1, 2), 2, None))
    trailing = good + b"\x00"  # a byte after the body
    cut_short = good[:-2]  # ends inside the tagged fields
    for broken in (trailing, cut_short):
        try:
            r.decode_record(broken)
        except r.MetadataRecordError:
            pass
        else:
            raise AssertionError(f"{broken.hex()} decodes: not a broken record")
        assert fold.key_of(broken) == (fold.K_PARTITION, f"{tid}\x002")
    values = [r.encode_record(r.RegisterBroker(b, f"00000000-0000-4000-8000-{b:012d}", 1,
                                               (r.Endpoint("PLAINTEXT", "h", 9092),), None, False))
              for b in (1, 2, 3)]
    values += [r.encode_record(r.Topic("t", tid)),
               r.encode_record(r.Partition(tid, 2, (1, 2, 3), (1, 2, 3), 1)),
               trailing, good, cut_short,
               r.encode_record(r.PartitionChange(tid, 2, None, 1, None))]
    _check(values, [9, 11, 13, 100])
    by_cut, invalid = fold.replay_sequential([(i * 2 + 1, v) for i, v in enumerate(values)], [100])
    assert invalid == 2


def test_producer_ids_fold_as_the_controller_replays_them():
    """Kafka's ProducerIdsRecords: the next id only moves forward; a record
    that does not (or does not decode) is invalid, the rest are counted by
    type as well; the rebuilt state's next_producer_id is the controller's."""
    from metalog.broker.controller import producer_blocks

    values = [r.encode_record(producer_blocks.record(1, 2, 1000)),
              r.encode_record(producer_blocks.record(1, 2, 500)),  # backwards: invalid
              bytes.fromhex("01 0f 00 00"),  # too short: invalid
              r.encode_record(producer_blocks.record(2, 5, 2000))]
    recs = list(enumerate(values))
    states, invalid, valid = fold.fold_producer_ids(recs, [2, 4])
    assert (invalid, valid) == (2, 2)
    by_cut = {row.cut: producer_blocks.decode(r.decode_record(row.value).raw)[2] for row in states}
    assert by_cut == {2: 1000, 4: 2000}
    state = ControllerState()
    for offset, value in recs:
        state.apply(offset, r.decode_record(value))
    assert state.next_producer_id == 2000 and state.invalid_records == 2
    assert state.unknown_records == {"ProducerIds": 2}
