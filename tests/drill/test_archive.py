"""The segment archive and the checker's use of it: offsets a snapshot removed from every log stay
verifiable, uncommitted tails and wiped incarnations never pass for committed data, and a consumer
skipping a data record without a reset is caught."""

import os
import shutil

from metalog.storage.batch import encode_batch
from metalog.storage.segments import SegmentedLog
from metalog.tools.drill.archive import ArchivedSegment, SegmentArchive
from metalog.tools.drill.checker import Ack, History, ReplicaLog, Reset, Seen, check, read_replica

BIG = 1500  # bytes per value: with 4 KiB segments, a segment holds two batches


def value(off: int, tag: str = "v") -> bytes:
    return f"{tag}{off}-".encode().ljust(BIG, b".")


def history_acking(offsets, epoch=1, tag="v") -> History:
    h = History()
    for off in offsets:
        h.acks.append(Ack(value(off, tag), off, epoch, ts=float(off)))
        h.attempted.add(value(off, tag))
    return h


def open_log(data_dir) -> SegmentedLog:
    return SegmentedLog.open(os.path.join(data_dir, "__cluster_metadata-0"), segment_bytes_max=4096)


def test_archive_keeps_segments_a_snapshot_deleted_and_keys_wiped_incarnations_apart(tmp_path):
    data = str(tmp_path / "node-1" / "data")
    archive = SegmentArchive(str(tmp_path / "archive"), {1: data})
    log = open_log(data)
    for off in range(10):
        log.append(encode_batch(off, 1, [value(off)], timestamp_ms=1000))
    log.flush()
    archive.observe(1, 1, None)  # first scan: nothing vouched for yet
    archive.observe(1, 1, 10)  # HW 10 answered between two scans that saw the same files
    log.append(encode_batch(10, 1, [value(10, "uncommitted")], timestamp_ms=1000))  # never committed
    archive.scan(1, 1)
    log.advance_log_start(8)  # a snapshot at 8: the segments below go
    assert log.segment_base_offsets[0] >= 6
    log.close()
    assert {s.base_offset for s in archive.list()} >= {0, 2, 4, 6, 8}
    # wipe: the data dir goes, the node rejoins at a snapshot at 10 and is handed a different record 10
    shutil.rmtree(data)
    archive.forget_live(1)
    log = open_log(data)
    log.truncate_fully(10)
    log.append(encode_batch(10, 2, [value(10)], timestamp_ms=1000))
    archive.observe(1, 2, None)
    archive.observe(1, 2, 11)
    log.close()

    segs = archive.list()
    assert len({s.inode for s in segs}) == len(segs)
    old10 = [s for s in segs if s.incarnation == 1 and s.base_offset == 10]
    new10 = [s for s in segs if s.incarnation == 2 and s.base_offset == 10]
    assert len(old10) == 1 and len(new10) == 1 and old10[0].path != new10[0].path
    assert old10[0].committed_end <= 10  # the pre-wipe record at 10 was never vouched for
    assert new10[0].committed_end == 11
    assert all(os.path.exists(s.path) for s in segs)

    rep = read_replica(1, data)
    assert rep.log_start == 10
    h = history_acking(range(11))
    h.acks[10] = Ack(value(10), 10, 2, ts=10.0)
    res = check(h, [rep], 11, segs)
    assert res.ok, res.summary()
    assert res.stats["verified_from_archive"] == 10 and res.stats["unverifiable"] == 0
    assert res.stats["committed_offsets_uncovered"] == 0
    # without the archive the same history cannot be checked
    res = check(h, [rep], 11)
    assert [b.kind for b in res.breaches] == ["unverifiable"]
    assert "10 acknowledged write(s) are below every replica's log start, in no archived segment" in res.summary()


def write_segment(path, batches) -> None:
    with open(path, "wb") as f:
        for base, epoch, values in batches:
            f.write(encode_batch(base, epoch, values, timestamp_ms=1000))


def final_log(node, batches, log_start) -> ReplicaLog:
    out = [(b, b + len(v), e, encode_batch(b, e, v, timestamp_ms=1000)) for b, e, v in batches]
    return ReplicaLog(node, log_start, out[-1][1], out)


COMMITTED = [(0, 1, [value(0), value(1)]), (2, 1, [value(2)]), (3, 2, [value(3), value(4)])]


def test_divergent_archived_tail_counts_only_below_its_vouched_hw(tmp_path):
    path = str(tmp_path / "seg.log")
    # a follower's segment: the committed prefix, then a tail of epoch 1 that epoch 2 replaced
    write_segment(path, COMMITTED[:2] + [(3, 1, [value(3, "stale")])])
    reps = [final_log(n, COMMITTED[2:], log_start=3) for n in (1, 2)]
    h = history_acking(range(3))
    h.acks += [Ack(value(3), 3, 2, ts=3.0), Ack(value(4), 4, 2, ts=4.0)]
    seg = ArchivedSegment(3, 1, 0, 77, path, committed_end=3)
    res = check(h, reps, 5, [seg])
    assert res.ok, res.summary()
    assert res.stats["verified_from_archive"] == 3
    # had the broker vouched for the stale tail, the copies disagree: a committed batch diverged
    seg.committed_end = 4
    res = check(h, reps, 5, [seg])
    assert [b.kind for b in res.breaches] == ["diverging_prefix"]
    assert "two copies of the committed batch at offset 3 differ (epoch 2 vs 1)" in res.summary()


def test_archived_committed_bytes_must_agree_with_each_other(tmp_path):
    a, b = str(tmp_path / "a.log"), str(tmp_path / "b.log")
    write_segment(a, COMMITTED[:2])
    write_segment(b, [COMMITTED[0], (2, 1, [value(2, "other")])])
    reps = [final_log(1, COMMITTED[2:], log_start=3)]
    h = history_acking(range(3))
    segs = [ArchivedSegment(1, 1, 0, 1, a, 3), ArchivedSegment(2, 1, 0, 2, b, 3)]
    res = check(h, reps, 5, segs)
    assert [x.kind for x in res.breaches] == ["diverging_prefix"]
    assert "two copies of the committed batch at offset 2 differ" in res.summary()
    assert "b.log" in res.summary()


def test_consumer_skipping_a_data_record_fails_unless_a_reset_or_control_record_explains_it():
    reps = [final_log(n, COMMITTED, log_start=0) for n in (1, 2)]
    h = history_acking(range(5))
    h.acks[3:] = [Ack(value(3), 3, 2, ts=3.0), Ack(value(4), 4, 2, ts=4.0)]
    h.seen = [Seen(0, 0, 1, value(0), 10.0), Seen(0, 1, 1, value(1), 10.0), Seen(0, 4, 2, value(4), 12.0)]
    res = check(h, reps, 5)
    assert [b.kind for b in res.breaches] == ["consumer_skipped"]
    assert "consumer 0 skipped 2 data offset(s) 2..3 between offset 1 and 4" in res.summary()
    h.resets.append(Reset(0, 11.0, from_offset=2, to_offset=4))  # the log start moved past it
    res = check(h, reps, 5)
    assert res.ok, res.summary()
    assert res.stats["offsets_skipped_by_reset"] == 2
    # a reset from another moment does not explain this gap
    h.resets[0] = Reset(0, 13.0, from_offset=2, to_offset=4)
    assert [b.kind for b in check(h, reps, 5).breaches] == ["consumer_skipped"]


def test_consumer_passing_a_control_record_is_fine():
    batches = [(0, 1, [value(0)]), (1, 2, [b"leader-change"]), (2, 2, [value(2)])]
    out = []
    for base, epoch, values in batches:
        raw = encode_batch(base, epoch, values, timestamp_ms=1000, is_control=base == 1)
        out.append((base, base + 1, epoch, raw))
    rep = ReplicaLog(1, 0, 3, out)
    h = History()
    h.acks = [Ack(value(0), 0, 1, 0.0), Ack(value(2), 2, 2, 2.0)]
    h.seen = [Seen(0, 0, 1, value(0), 10.0), Seen(0, 2, 2, value(2), 11.0)]
    res = check(h, [rep], 3)
    assert res.ok, res.summary()
    assert res.stats["control_offsets"] == 1 and res.stats["committed_offsets_uncovered"] == 0


def test_vouch_applies_an_answer_only_to_segments_seen_before_it_was_sent_and_after_it_arrived(tmp_path):
    """The drill's scanner thread and its /quorum threads are decoupled: an answer counts for a
    segment only if some scan saw it by the time the request left and a later scan, started after
    the answer arrived, still saw it."""
    import time

    data = str(tmp_path / "node-1" / "data")
    archive = SegmentArchive(str(tmp_path / "archive"), {1: data})
    log = open_log(data)
    for off in range(4):
        log.append(encode_batch(off, 1, [value(off)], timestamp_ms=1000))
    log.flush()
    archive.scan(1, 1)  # links the segments at 0 and 2
    sent = time.monotonic()
    for off in range(4, 6):  # a new segment (base 4) appears while the request is in flight
        log.append(encode_batch(off, 1, [value(off)], timestamp_ms=1000))
    log.flush()
    received = time.monotonic()
    archive.vouch(1, 6, sent, received)
    by_base = {s.base_offset: s for s in archive.list()}
    assert by_base[0].committed_end == -1  # no scan after the answer yet
    archive.scan(1, 1)
    by_base = {s.base_offset: s for s in archive.list()}
    assert by_base[0].committed_end == 6 and by_base[2].committed_end == 6
    assert by_base[4].committed_end == -1  # first seen after the request left: not vouched for

    # a segment deleted before any scan after the answer is not vouched for by it
    sent = time.monotonic()
    archive.scan(1, 1)  # base 4 is now known
    received = time.monotonic()
    archive.vouch(1, 6, sent, received)  # received after that scan started: still pending
    log.append(encode_batch(6, 1, [value(6)], timestamp_ms=1000))  # rolls: base 4 is whole
    log.advance_log_start(6)  # the segments at 0, 2 and 4 go before the next scan
    assert log.segment_base_offsets[0] == 6
    archive.scan(1, 1)
    by_base = {s.base_offset: s for s in archive.list()}
    assert by_base[4].committed_end == -1
    log.close()


def test_vouched_answer_resolves_against_the_scan_that_saw_the_segment_before_deletion(tmp_path):
    import time

    data = str(tmp_path / "node-1" / "data")
    archive = SegmentArchive(str(tmp_path / "archive"), {1: data})
    log = open_log(data)
    for off in range(4):
        log.append(encode_batch(off, 1, [value(off)], timestamp_ms=1000))
    log.flush()
    archive.scan(1, 1)
    sent = time.monotonic()
    received = time.monotonic()
    archive.vouch(1, 4, sent, received)
    archive.scan(1, 1)  # started after the answer: it closes the bracket
    log.advance_log_start(4)
    log.close()
    assert {s.base_offset: s.committed_end for s in archive.list()} == {0: 4, 2: 4}
    assert archive.stats()["answers_dropped"] == 0
    # an answer about a wiped node never vouches for its old files
    shutil.rmtree(data)
    archive.forget_live(1)
    archive.vouch(1, 100, time.monotonic(), time.monotonic())
    archive.scan(1, 2)
    assert {s.base_offset: s.committed_end for s in archive.list()} == {0: 4, 2: 4}
