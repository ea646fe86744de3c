"""Follower side: KIP-320 truncation, DivergingEpoch, KAFKA-7786, KAFKA-14704, snapshots."""

from metalog.broker.quorum import api as a
from metalog.protocol import messages as m
from metalog.protocol.errors import Errors

from tests.quorum.harness import CLUSTER, Node, batch, of, sent, stand


def follower(epochs=((1, 0), (3, 5)), leo=10, leader=2, epoch=6, **kw) -> tuple[Node, list]:
    """Voter 3 restarted with a log, following `leader` in `epoch`."""
    n = Node(3, view=a.LogView(log_end_offset=leo, epochs=list(epochs)),
             state=a.QuorumStateData(epoch, leader, -1, (1, 2, 3)), **kw)
    return n, n.step(a.Tick(0))


def answer(n: Node, send: a.SendRequest, resp: m.Body, now: int = 1) -> list:
    return n.step(a.ResponseReceived(now, send.request_id, send.destination, resp))


def test_new_leader_first_asks_offsets_for_leader_epoch():
    n, acts = follower()
    assert n.core.role == "follower"
    (req,) = sent(acts)
    assert isinstance(req.request, m.OffsetsForLeaderEpochRequest)
    assert (req.destination, req.request.current_leader_epoch, req.request.leader_epoch) == (2, 6, 3)


def test_epoch_check_truncates_in_rounds_to_the_shared_prefix():
    n, acts = follower()
    (req,) = sent(acts)
    # The leader never had epoch 3: its largest epoch <= 3 is 2, ending at 8.
    acts = answer(n, req, m.OffsetsForLeaderEpochResponse(leader_epoch=2, end_offset=8))
    assert a.TruncateLog(5) in acts  # our epoch 2 does not exist: cut where our epoch 3 began
    assert n.core.log_end_offset == 5 and n.core.epochs.entries == [(1, 0)]
    (req,) = sent(acts)
    assert isinstance(req.request, m.OffsetsForLeaderEpochRequest) and req.request.leader_epoch == 1
    acts = answer(n, req, m.OffsetsForLeaderEpochResponse(leader_epoch=1, end_offset=5))
    assert not of(acts, a.TruncateLog)
    (req,) = sent(acts)
    assert isinstance(req.request, m.FetchRequest)
    assert (req.request.fetch_offset, req.request.last_fetched_epoch, req.request.current_leader_epoch) == (5, 1, 6)


def test_kafka_7786_stale_epoch_check_answer_is_ignored_and_fetching_continues():
    n, acts = follower(epoch=6)
    (old,) = sent(acts)
    # The same leader starts epoch 7 while our epoch-6 request is in flight.
    acts = n.step(a.RequestReceived(2, "b", m.BeginQuorumEpochRequest(cluster_id=CLUSTER, leader_id=2, leader_epoch=7)))
    assert n.core.epoch == 7
    (new,) = sent(acts)
    assert isinstance(new.request, m.OffsetsForLeaderEpochRequest) and new.request.current_leader_epoch == 7
    # The leader fenced the old request; that answer must not stall or move us.
    acts = answer(n, old, m.OffsetsForLeaderEpochResponse(
        error_code=Errors.FENCED_LEADER_EPOCH, current_leader=m.LeaderIdAndEpoch(2, 7)), now=3)
    assert acts == [] and n.core.epoch == 7 and n.core.role == "follower"
    acts = answer(n, new, m.OffsetsForLeaderEpochResponse(leader_epoch=3, end_offset=10), now=4)
    (f,) = sent(acts)
    assert isinstance(f.request, m.FetchRequest) and f.request.current_leader_epoch == 7


def test_kafka_7786_stale_success_answer_does_not_truncate():
    n, acts = follower(epoch=6)
    (old,) = sent(acts)
    n.step(a.RequestReceived(2, "b", m.BeginQuorumEpochRequest(cluster_id=CLUSTER, leader_id=2, leader_epoch=7)))
    acts = answer(n, old, m.OffsetsForLeaderEpochResponse(leader_epoch=1, end_offset=2), now=3)
    assert not of(acts, a.TruncateLog) and n.core.log_end_offset == 10


def test_fenced_answer_naming_a_newer_epoch_moves_us_there_and_retries():
    n, acts = follower(epoch=6)
    (old,) = sent(acts)
    acts = answer(n, old, m.OffsetsForLeaderEpochResponse(
        error_code=Errors.FENCED_LEADER_EPOCH, current_leader=m.LeaderIdAndEpoch(1, 8)))
    assert (n.core.epoch, n.core.leader_id) == (8, 1)
    assert of(acts, a.PersistQuorumState)[-1].state == a.QuorumStateData(8, 1, -1, (1, 2, 3))
    (req,) = sent(acts)
    assert req.destination == 1 and req.request.current_leader_epoch == 8


def skip_epoch_check(n: Node, acts: list) -> a.SendRequest:
    (req,) = sent(acts)
    acts = answer(n, req, m.OffsetsForLeaderEpochResponse(
        leader_epoch=n.core.epochs.latest_epoch, end_offset=n.core.log_end_offset))
    (req,) = sent(acts)
    assert isinstance(req.request, m.FetchRequest)
    return req


def test_diverging_epoch_truncates_to_the_leaders_epoch_end_offset():
    """Unclean loss: our uncommitted epoch-3 tail (5..9) is cut at 5."""
    n, acts = follower()
    f = skip_epoch_check(n, acts)
    assert (f.request.fetch_offset, f.request.last_fetched_epoch) == (10, 3)
    acts = answer(n, f, m.FetchResponse(high_watermark=20, diverging_epoch=m.EpochEndOffset(1, 5)))
    assert a.TruncateLog(5) in acts
    # KAFKA-14704: the HW from that answer applies only after truncation.
    assert n.core.log_end_offset == 5 and n.core.high_watermark == 5
    (f2,) = sent(acts)
    assert (f2.request.fetch_offset, f2.request.last_fetched_epoch) == (5, 1)


def test_diverging_epoch_below_our_high_watermark_is_fatal():
    n, acts = follower()
    f = skip_epoch_check(n, acts)
    acts = answer(n, f, m.FetchResponse(high_watermark=8))
    assert n.core.high_watermark == 8
    (f,) = sent(acts)
    acts = answer(n, f, m.FetchResponse(high_watermark=8, diverging_epoch=m.EpochEndOffset(1, 5)))
    fatal = of(acts, a.Fatal)
    assert len(fatal) == 1 and not of(acts, a.TruncateLog)
    assert fatal[0].reason == ("DivergingEpoch (1, 5) asks to truncate to 5, below our high "
                               "watermark 8 / log start 0")
    assert n.core.step(a.Tick(10_000)) == []  # a failed core stays stopped


def test_next_fetch_waits_for_the_flush_of_appended_data():
    n, acts = follower()
    f = skip_epoch_check(n, acts)
    data = batch(10, 6, 3) + batch(13, 6, 2)
    acts = answer(n, f, m.FetchResponse(high_watermark=12, records=data))
    assert a.AppendBatches(data, 10, 15) in acts and of(acts, a.FlushLog)
    assert not sent(acts)
    assert n.core.log_end_offset == 15 and n.core.high_watermark == 12
    assert n.core.epochs.entries == [(1, 0), (3, 5), (6, 10)]
    assert of(acts, a.WriteEpochCheckpoint)
    acts = n.step(a.FlushCompleted(2, 13))
    assert not sent(acts)  # not all of it is durable yet
    acts = n.step(a.FlushCompleted(3, 15))
    (f2,) = sent(acts)
    assert (f2.request.fetch_offset, f2.request.last_fetched_epoch) == (15, 6)


def test_a_fetched_batch_with_a_bad_crc_is_never_appended():
    """The CRC of fetched bytes is checked once, where they cross the network:
    here, in the core (the runtime's log then appends without checking it
    again). The batches before a corrupt one are appended; the corrupt one and
    what follows are not, so the follower's log ends before it and it fetches
    it again; a corrupt first batch appends nothing."""
    n, acts = follower()
    f = skip_epoch_check(n, acts)
    good = batch(10, 6, 3)
    bad = bytearray(batch(13, 6, 2))
    bad[-1] ^= 0x01  # a bit flip in the last record: header intact, CRC wrong
    acts = answer(n, f, m.FetchResponse(high_watermark=10, records=good + bytes(bad)))
    assert of(acts, a.AppendBatches) == [a.AppendBatches(good, 10, 13)]
    assert n.core.log_end_offset == 13
    # The driver is told (it logs a warning and counts it): offset, epoch, why.
    (found,) = of(acts, a.FetchedBatchCorrupt)
    assert (found.base_offset, found.fetch_epoch) == (13, 6) and found.reason.startswith("CRC mismatch: stored 0x")
    assert not of(acts, a.CorruptionFound), "nothing on our disk is damaged: no quarantine"
    acts = n.step(a.FlushCompleted(2, 13))
    (f2,) = sent(acts)
    assert f2.request.fetch_offset == 13  # the corrupt batch is asked for again

    acts = answer(n, f2, m.FetchResponse(high_watermark=10, records=bytes(bad)))
    assert not of(acts, a.AppendBatches) and n.core.log_end_offset == 13
    assert [x.base_offset for x in of(acts, a.FetchedBatchCorrupt)] == [13]


def test_fetch_timeout_makes_a_follower_a_candidate_after_a_pre_vote():
    n, acts = follower(fetch_timeout_ms=2000)
    n.step(a.Tick(1999))
    assert n.core.role == "follower"
    acts = n.step(a.Tick(2000))
    # KIP-996: prospective first, epoch and vote untouched, nothing persisted.
    assert n.core.role == "prospective" and n.core.epoch == 6 and n.core.leader_id == 2
    assert not of(acts, a.PersistQuorumState)
    pre = sent(acts, m.VoteRequest)
    assert len(pre) == 2 and all(s.request.pre_vote and s.request.candidate_epoch == 7 for s in pre)
    acts = stand(n, 2001, acts)
    assert n.core.role == "candidate" and n.core.epoch == 7
    assert len(sent(acts, m.VoteRequest)) == 2 and not any(s.request.pre_vote for s in sent(acts))


def test_failed_fetch_is_retried_after_a_short_backoff():
    n, acts = follower()
    (req,) = sent(acts)
    acts = n.step(a.RequestFailed(5, req.request_id, 2, "connection refused"))
    assert not sent(acts)
    assert n.core.next_deadline_ms == 55
    (again,) = sent(n.step(a.Tick(55)))
    assert isinstance(again.request, m.OffsetsForLeaderEpochRequest)


def test_snapshot_download_and_install():
    n, acts = follower(epochs=(), leo=0)
    (f,) = sent(acts)
    assert isinstance(f.request, m.FetchRequest) and f.request.fetch_offset == 0
    sid = m.SnapshotId(40, 5)
    acts = answer(n, f, m.FetchResponse(high_watermark=45, log_start_offset=40, snapshot_id=sid))
    (s,) = sent(acts)
    assert isinstance(s.request, m.FetchSnapshotRequest)
    assert (s.request.snapshot_id, s.request.position, s.request.current_leader_epoch) == (sid, 0, 6)
    acts = answer(n, s, m.FetchSnapshotResponse(snapshot_id=sid, size=6, position=0, unaligned_records=b"abcd"))
    assert a.WriteSnapshotChunk(sid, 0, b"abcd") in acts
    (s,) = sent(acts)
    assert s.request.position == 4
    # the next chunk is asked for before this one is written (and loaded):
    # the leader sends it meanwhile
    assert acts.index(s) < acts.index(a.WriteSnapshotChunk(sid, 0, b"abcd"))
    acts = answer(n, s, m.FetchSnapshotResponse(snapshot_id=sid, size=6, position=4, unaligned_records=b"ef"))
    assert a.WriteSnapshotChunk(sid, 4, b"ef") in acts and a.InstallSnapshot(sid, 6) in acts
    c = n.core
    assert (c.log_start_offset, c.log_end_offset, c.high_watermark) == (40, 40, 40)
    assert c.epochs.entries == [(5, 40)] and c.snapshots == (sid,)
    (f,) = sent(acts)
    assert (f.request.fetch_offset, f.request.last_fetched_epoch) == (40, 5)


def test_snapshot_not_found_falls_back_to_fetch():
    n, acts = follower(epochs=(), leo=0)
    (f,) = sent(acts)
    acts = answer(n, f, m.FetchResponse(snapshot_id=m.SnapshotId(40, 5)))
    (s,) = sent(acts)
    acts = answer(n, s, m.FetchSnapshotResponse(error_code=Errors.SNAPSHOT_NOT_FOUND))
    assert not sent(acts)
    (f,) = sent(n.step(a.Tick(1 + 50)))
    assert isinstance(f.request, m.FetchRequest)


def test_failed_snapshot_install_rolls_back_to_the_log_we_kept_and_downloads_again():
    """Issue 12 item 6: a download that fails verification used to leave the
    core believing in a snapshot the disk never installed. Now the driver feeds
    SnapshotInstallFailed: the core is back on its old log (start, end, epochs,
    HW), rewrites its epoch checkpoint, and fetches (and so downloads) again."""
    n, acts = follower(epochs=((1, 0), (3, 5)), leo=10)
    (e,) = sent(acts)  # the epoch check of a restarted follower
    acts = answer(n, e, m.OffsetsForLeaderEpochResponse(
        leader_epoch=3, end_offset=10, current_leader=m.LeaderIdAndEpoch(2, 6)))
    (f,) = sent(acts)
    sid = m.SnapshotId(40, 5)
    acts = answer(n, f, m.FetchResponse(high_watermark=45, log_start_offset=40, snapshot_id=sid))
    (s,) = sent(acts)
    acts = answer(n, s, m.FetchSnapshotResponse(snapshot_id=sid, size=2, position=0, unaligned_records=b"ab"))
    assert a.InstallSnapshot(sid, 2) in acts
    acts = n.step(a.SnapshotInstallFailed(2, sid, "CRC mismatch at byte 1"))
    c = n.core
    assert (c.log_start_offset, c.log_end_offset, c.flushed_end_offset) == (0, 10, 10)
    assert c.epochs.entries == [(1, 0), (3, 5)] and c.snapshots == ()
    assert c.high_watermark == -1
    assert a.WriteEpochCheckpoint(((1, 0), (3, 5))) in acts
    (again,) = sent(acts)
    assert isinstance(again.request, m.OffsetsForLeaderEpochRequest)


def test_a_leader_that_closes_the_connection_on_an_epoch_check_is_followed_by_fetch_alone():
    """A Kafka controller leading does not serve OffsetForLeaderEpoch on its
    controller listener: it closes the connection. The follower does not take
    that for a dead leader; it validates its log with Fetch's LastFetchedEpoch
    (DivergingEpoch), as Kafka's own followers do, and keeps its fetch timeout."""
    n, acts = follower()
    (check,) = sent(acts)
    assert isinstance(check.request, m.OffsetsForLeaderEpochRequest)
    deadline = n.core.next_deadline_ms
    # As our TLS channel reports it when Kafka closes at once (TLS 1.3: the handshake is not over for us yet).
    n.step(a.RequestFailed(5, check.request_id, 2, "TlsHandshakeError: TLS handshake with 127.0.0.1:9093 failed: "
                                                   "the broker closed the connection during the TLS handshake"))
    (fetch,) = sent(n.step(a.Tick(55)))
    assert isinstance(fetch.request, m.FetchRequest)
    assert (fetch.request.fetch_offset, fetch.request.last_fetched_epoch) == (10, 3)
    assert n.core.role == "follower" and n.core.next_deadline_ms >= deadline
    acts = answer(n, fetch, m.FetchResponse(high_watermark=8, diverging_epoch=m.EpochEndOffset(3, 8)), now=60)
    assert a.TruncateLog(8) in acts and n.core.log_end_offset == 8  # to the leader's end of epoch 3
