"""The drill checker on synthetic histories: clean passes, each planted breach fails clearly."""


from metalog.storage.batch import encode_batch
from metalog.storage.segments import SegmentedLog
from metalog.tools.drill.checker import (Ack, History, HwSample, ReplicaLog, RoleEvent, Seen, Truncation, check,
                                 read_replica)


def replica(node, batches, log_start=0):
    """batches: list of (base_offset, epoch, [values]) -> ReplicaLog with real encoded bytes."""
    out = []
    for base, epoch, values in batches:
        raw = encode_batch(base, epoch, values, timestamp_ms=1000 + base)
        out.append((base, base + len(values), epoch, raw))
    end = out[-1][1] if out else log_start
    return ReplicaLog(node, log_start, end, out)


BATCHES = [(0, 1, [b"a0", b"a1"]), (2, 1, [b"a2"]), (3, 2, [b"b3", b"b4"])]


def clean_history():
    h = History()
    for off, v in enumerate([b"a0", b"a1", b"a2", b"b3", b"b4"]):
        h.acks.append(Ack(v, off, 1 if off < 3 else 2, ts=float(off)))
        h.attempted.add(v)
    h.roles = [RoleEvent(1, 0.0, "leader", 1, 1), RoleEvent(2, 0.1, "follower", 1, 1),
               RoleEvent(2, 3.0, "leader", 2, 2), RoleEvent(1, 3.1, "follower", 2, 2)]
    h.hw = [HwSample(1, 0, 0.5, 2), HwSample(1, 0, 1.0, 3), HwSample(1, 1, 4.0, 0), HwSample(1, 1, 5.0, 5)]
    h.seen = [Seen(0, off, 1, v, ts=10.0) for off, v in enumerate([b"a0", b"a1", b"a2"])]
    return h


def run(h, replicas, commit_end=5):
    return check(h, replicas, commit_end)


def test_clean_history_passes():
    res = run(clean_history(), [replica(n, BATCHES) for n in (1, 2, 3)])
    assert res.ok, res.summary()
    assert res.stats["acked"] == 5 and res.stats["verified_offsets"] == 5


def test_lost_write_fails():
    h = clean_history()
    h.acks.append(Ack(b"c5", 5, 3, ts=6.0))
    res = run(h, [replica(n, BATCHES) for n in (1, 2, 3)])
    assert not res.ok
    assert [b.kind for b in res.breaches] == ["lost_write"]
    assert "1 acknowledged write(s) lost" in res.summary()
    assert "b'c5' acked at offset 5 epoch 3, committed log ends at 5" in res.summary()


def test_write_overwritten_at_its_offset_fails():
    h = clean_history()
    h.acks[4] = Ack(b"zz", 4, 2, ts=4.0)
    res = run(h, [replica(n, BATCHES) for n in (1, 2, 3)])
    assert "acked at offset 4 epoch 2; that offset holds b'b4' epoch 2" in res.summary()


def test_duplicated_write_fails():
    h = clean_history()
    batches = BATCHES + [(5, 2, [b"a1"])]
    res = run(h, [replica(n, batches) for n in (1, 2, 3)], commit_end=6)
    kinds = [b.kind for b in res.breaches]
    assert kinds == ["duplicated_write"], res.summary()
    assert "b'a1' acked at 1 appears 2 times at [1, 5]" in res.summary()


def test_unacknowledged_write_stored_twice_fails():
    """A write whose answer was lost and whose retry was appended again (no
    idempotence) is a breach even though the writer never saw an ack: with
    idempotent writers every duplicate is a failure."""
    h = clean_history()
    h.attempted.add(b"c5")
    batches = BATCHES + [(5, 2, [b"c5"]), (6, 2, [b"c5"])]
    res = run(h, [replica(n, batches) for n in (1, 2, 3)], commit_end=7)
    assert not res.ok
    assert [b.kind for b in res.breaches] == ["duplicated_write"], res.summary()
    assert "unacknowledged b'c5' appears 2 times" in res.summary()


def test_two_leaders_in_one_epoch_fails():
    h = clean_history()
    h.roles.append(RoleEvent(3, 3.5, "leader", 2, 3, source="node-3/broker.log:17"))
    res = run(h, [replica(n, BATCHES) for n in (1, 2, 3)])
    assert [b.kind for b in res.breaches] == ["two_leaders"]
    assert "epoch 2 had 2 leaders: nodes [2, 3]" in res.summary()
    assert "node 3 leader at ts 3.500 (node-3/broker.log:17)" in res.summary()


def test_hw_decrease_fails_but_restart_resets():
    h = clean_history()
    assert run(h, [replica(n, BATCHES) for n in (1, 2, 3)]).ok  # incarnation 1 starting at 0 is fine
    h.hw.append(HwSample(1, 1, 6.0, 4))
    res = run(h, [replica(n, BATCHES) for n in (1, 2, 3)])
    assert [b.kind for b in res.breaches] == ["hw_decreased"]
    assert "node 1 HW went from 5 to 4 (incarnation 1)" in res.summary()


def test_diverging_committed_prefix_fails():
    bad = [(0, 1, [b"a0", b"a1"]), (2, 1, [b"a2"]), (3, 3, [b"b3", b"b4"])]  # same values, other epoch
    res = run(clean_history(), [replica(1, BATCHES), replica(2, BATCHES), replica(3, bad)])
    assert [b.kind for b in res.breaches] == ["diverging_prefix", "diverging_prefix"]
    assert "nodes 1 and 3 differ at offset 3 (epoch 2 vs 3), below the committed offset 5" in res.summary()


def test_divergence_above_commit_is_allowed():
    tail_a = BATCHES + [(5, 3, [b"x"])]
    tail_b = BATCHES + [(5, 4, [b"y"])]
    res = run(clean_history(), [replica(1, tail_a), replica(2, tail_b), replica(3, BATCHES)])
    assert res.ok, res.summary()


def test_replica_missing_committed_offsets_fails():
    res = run(clean_history(), [replica(1, BATCHES), replica(2, BATCHES[:2])])
    assert "node 2 log ends at 3, below the committed offset 5" in res.summary()


def test_consumer_saw_replaced_record_silently_fails_unless_told():
    h = clean_history()
    h.seen += [Seen(7, off, 1 if off < 3 else 2, v, ts=10.5) for off, v in enumerate([b"a0", b"a1", b"a2", b"b3"])]
    h.seen.append(Seen(7, 4, 2, b"ghost", ts=11.0))
    res = run(h, [replica(n, BATCHES) for n in (1, 2, 3)])
    assert [b.kind for b in res.breaches] == ["silent_truncation"]
    assert "consumer 7 saw b'ghost' at offset 4 epoch 2, final log has b'b4' epoch 2" in res.summary()
    h.truncations.append(Truncation(7, ts=12.0, offset=4))
    assert run(h, [replica(n, BATCHES) for n in (1, 2, 3)]).ok


def test_snapshotted_prefix_verified_through_consumers():
    h = clean_history()
    # node 3 rejoined by snapshot: its log starts at 3; node 1 and 2 too (prefix deleted)
    reps = [replica(n, BATCHES[2:], log_start=3) for n in (1, 2, 3)]
    assert run(h, reps).ok  # offsets 0-2 were read by consumer 0
    h.seen = []
    res = run(h, reps)
    assert [b.kind for b in res.breaches] == ["unverifiable"]
    assert "3 acknowledged write(s) are below every replica's log start" in res.summary()


def test_read_replica_from_a_real_log_dir(tmp_path):
    part = tmp_path / "data" / "__cluster_metadata-0"
    with SegmentedLog.open(part) as log:
        for base, epoch, values in BATCHES:
            log.append(encode_batch(base, epoch, values, timestamp_ms=1000 + base))
        log.flush()
    rep = read_replica(2, str(tmp_path / "data"))
    assert (rep.log_start, rep.log_end, len(rep.batches)) == (0, 5, 3)
    assert rep.records(5)[3] == (b"b3", 2)
    assert run(clean_history(), [rep, replica(1, BATCHES)]).ok


def test_metadata_version_the_quorum_writes_is_not_a_write_to_account_for():
    """The controller puts a metadata.version FeatureLevelRecord before the
    first metadata record of a log (as Kafka's log holds one): no client wrote
    it, so it is accounted like a control record, and a consumer that read it
    is no breach; a client's record with the same name prefix is still data."""
    from metalog.storage import metadata_records as MR
    from metalog.tools.drill.checker import written_by_quorum

    mv = MR.encode_record(MR.FeatureLevel(MR.METADATA_VERSION, 21))
    assert written_by_quorum(mv)
    assert not written_by_quorum(MR.encode_record(MR.FeatureLevel("kraft.version", 1)))
    assert not written_by_quorum(mv[:-3] + b"garbage")
    batches = [(0, 1, [b"a0", b"a1"]), (2, 1, [mv]), (3, 1, [b"a3"])]
    h = History()
    for off, v in ((0, b"a0"), (1, b"a1"), (3, b"a3")):
        h.acks.append(Ack(v, off, 1, ts=float(off)))
        h.attempted.add(v)
    h.roles = [RoleEvent(1, 0.0, "leader", 1, 1)]
    h.seen = [Seen(0, off, 1, v, ts=10.0) for off, v in ((0, b"a0"), (1, b"a1"), (2, mv), (3, b"a3"))]
    res = run(h, [replica(n, batches) for n in (1, 2, 3)], commit_end=4)
    assert res.ok, res.summary()
    assert 2 in res.control and res.stats["verified_offsets"] == 3
    h.acks.append(Ack(b"a2", 2, 1, ts=2.0))  # a write acknowledged at the quorum's own record's offset
    assert not run(h, [replica(n, batches) for n in (1, 2, 3)], commit_end=4).ok
