"""Leader-side Fetch / OffsetsForLeaderEpoch / FetchSnapshot validation (kraft-facts table)."""

import pytest

from metalog.broker.quorum import api as a
from metalog.protocol import messages as m
from metalog.protocol.errors import Errors
from metalog.storage.batch import iter_batches

from tests.quorum.harness import CLUSTER, Node, append, fetch, make_leader, of, one_response, responses


@pytest.fixture
def leader():
    n = Node(1)
    now = make_leader(n)  # epoch 1, LeaderChange at offset 0
    append(n, now, 4)  # offsets 1..4
    n.step(a.FlushCompleted(now, 5))
    n.now = now
    return n


def req(**kw) -> m.FetchRequest:
    base = dict(cluster_id=CLUSTER, replica_id=2, max_wait_ms=0, current_leader_epoch=1,
                fetch_offset=0, last_fetched_epoch=0)
    base.update(kw)
    return m.FetchRequest(**base)


@pytest.mark.parametrize("kw, message", [
    (dict(max_wait_ms=-1), "max_wait_ms -1 is negative"),
    (dict(fetch_offset=-5), "fetch_offset -5 is negative"),
    (dict(last_fetched_epoch=-1), "last_fetched_epoch -1 is negative"),
    (dict(last_fetched_epoch=2), "last_fetched_epoch 2 is newer than current_leader_epoch 1"),
])
def test_invalid_requests(leader, kw, message):
    r = one_response(leader.step(a.RequestReceived(10, "t", req(**kw))), "t")
    assert r.error_code == Errors.INVALID_REQUEST
    assert r.error_message == message
    assert r.current_leader == m.LeaderIdAndEpoch(1, 1)


@pytest.mark.parametrize("epoch, code", [
    (0, Errors.FENCED_LEADER_EPOCH),
    (2, Errors.UNKNOWN_LEADER_EPOCH),
])
def test_epoch_fencing(leader, epoch, code):
    r = one_response(leader.step(a.RequestReceived(10, "t", req(current_leader_epoch=epoch,
                                                                last_fetched_epoch=0))), "t")
    assert r.error_code == code and r.current_leader == m.LeaderIdAndEpoch(1, 1)
    assert r.records == b""


def test_non_leader_answers_not_leader_with_the_leader_it_knows():
    f = Node(2, state=a.QuorumStateData(1, 1, -1, (1, 2, 3)))
    r = one_response(f.step(a.RequestReceived(0, "t", req(replica_id=3))), "t")
    assert r.error_code == Errors.NOT_LEADER_OR_FOLLOWER
    assert r.current_leader == m.LeaderIdAndEpoch(1, 1)


def test_fenced_fetch_does_not_count_toward_the_hw(leader):
    leader.step(a.RequestReceived(10, "t", req(current_leader_epoch=0, fetch_offset=5, last_fetched_epoch=0)))
    assert leader.core.high_watermark == -1
    assert leader.core.replica_states[2].log_end_offset == -1


def test_valid_fetch_returns_records_hw_and_log_start(leader):
    r = one_response(leader.step(a.RequestReceived(10, "t", req())), "t")
    assert r.error_code == Errors.NONE
    assert [h.base_offset for _, h in iter_batches(r.records)] == [0, 1]
    assert r.log_start_offset == 0 and r.high_watermark == -1


def test_diverging_epoch(leader):
    # Follower claims epoch 1 data up to offset 9; the leader's epoch 1 ends at 5.
    r = one_response(leader.step(a.RequestReceived(10, "t", req(fetch_offset=9, last_fetched_epoch=1))), "t")
    assert r.diverging_epoch == m.EpochEndOffset(1, 5) and r.records == b""
    # Follower whose last epoch (0) the leader never had: largest epoch <= 0 ends at 0.
    r = one_response(leader.step(a.RequestReceived(10, "u", req(fetch_offset=3, last_fetched_epoch=0))), "u")
    assert r.diverging_epoch == m.EpochEndOffset(0, 0)
    # The diverging fetch did not move the replica's LEO.
    assert leader.core.replica_states[2].log_end_offset == -1


def test_consumer_skips_fencing_with_no_epoch_and_reads_only_below_hw(leader):
    creq = req(replica_id=-1, current_leader_epoch=-1, last_fetched_epoch=-1)
    r = one_response(leader.step(a.RequestReceived(10, "c", creq)), "c")
    assert r.error_code == Errors.NONE and r.records == b""  # HW unknown: nothing committed
    fetch(leader, 11, 2, 5, 1)  # voter 2 has everything: HW = 5
    assert leader.core.high_watermark == 5
    r = one_response(leader.step(a.RequestReceived(12, "c2", creq)), "c2")
    assert [h.base_offset for _, h in iter_batches(r.records)] == [0, 1]
    # The consumer's fetches never count toward the HW or show up as replicas.
    assert -1 not in leader.core.replica_states


def test_empty_fetch_is_parked_until_data_arrives_and_gets_it_in_the_appends_own_step(leader):
    t = leader.now
    fetch(leader, t + 10, 3, 5, 1, max_wait_ms=0)  # voter 3 moves the HW to 5
    acts = fetch(leader, t + 10, 2, 5, 1, max_wait_ms=500, token="park")
    assert not of(acts, a.Respond)
    assert leader.core.next_deadline_ms == t + 510
    acts = append(leader, t + 20, 2)
    # Answered in the append's own step with the bytes the step hands the driver (the LogReader
    # cannot see them yet), after the AppendBatches: no second step, no Tick at once.
    [appended] = of(acts, a.AppendBatches)
    r = one_response(acts, "park")
    assert r.records == appended.data and [h.base_offset for _, h in iter_batches(r.records)] == [5]
    assert acts.index(appended) < next(i for i, x in enumerate(acts) if isinstance(x, a.Respond) and x.token == "park")
    assert leader.core.next_deadline_ms > t + 20


def test_a_parked_fetch_the_appends_bytes_do_not_fit_is_read_the_next_step(leader):
    t = leader.now
    fetch(leader, t + 10, 3, 5, 1, max_wait_ms=0)  # voter 3 moves the HW to 5
    small = req(replica_id=2, fetch_offset=5, last_fetched_epoch=1, max_wait_ms=500, max_bytes=10)
    assert not of(leader.step(a.RequestReceived(t + 10, "park", small)), a.Respond)
    acts = append(leader, t + 20, 2)
    # Its max_bytes is below the step's batch: the LogReader's rules (a whole first batch) apply,
    # and the reader sees the append once the driver has applied it, at the next step.
    assert "park" not in [x.token for x in of(acts, a.Respond)]
    assert leader.core.next_deadline_ms == t + 20
    r = one_response(leader.step(a.Tick(t + 20)), "park")
    assert [h.base_offset for _, h in iter_batches(r.records)] == [5]


def _hw_moving_fetch(node, t):
    """Voter 2's Fetch at the log end (5), which moves the HW to 5 (the
    leader and voter 2 are a majority of three)."""
    assert node.core.high_watermark == -1
    acts = fetch(node, t, 2, 5, 1, max_wait_ms=500, token="first")
    assert node.core.high_watermark == 5
    return acts


def test_fetch_that_moves_the_hw_waits_for_records_to_carry_it(leader):
    """fetch_hw_linger_ms (default 2): the follower's Fetch stays parked, so
    the next append reaches it at once, the new HW with it."""
    t = leader.now
    assert leader.core.config.fetch_hw_linger_ms == 2
    assert not responses(_hw_moving_fetch(leader, t + 10), "first")
    assert leader.core.next_deadline_ms == t + 12  # the linger, not max_wait_ms
    r = one_response(append(leader, t + 11, 2), "first")  # in the append's own step
    assert [h.base_offset for _, h in iter_batches(r.records)] == [5]
    assert r.high_watermark == 5


def test_fetch_that_moves_the_hw_is_answered_with_it_alone_after_the_linger(leader):
    t = leader.now
    _hw_moving_fetch(leader, t + 10)
    assert not responses(leader.step(a.Tick(t + 11)), "first")
    r = one_response(leader.step(a.Tick(t + 12)), "first")
    assert r.error_code == Errors.NONE and r.records == b"" and r.high_watermark == 5


def test_without_linger_the_fetch_that_moves_the_hw_is_answered_at_once():
    """fetch_hw_linger_ms 0: Kafka's behaviour."""
    n = Node(1, fetch_hw_linger_ms=0)
    now = make_leader(n)
    append(n, now, 4)
    n.step(a.FlushCompleted(now, 5))
    r = one_response(_hw_moving_fetch(n, now + 10), "first")
    assert r.high_watermark == 5 and r.records == b""


def test_when_the_hw_moves_a_parked_replica_learns_it_within_the_linger_and_a_consumer_at_once():
    n = Node(1)
    t = make_leader(n)
    append(n, t, 4)  # offsets 1..4, not flushed: the leader's log counts only once it is
    fetch(n, t, 3, 5, 1, max_wait_ms=500, token="first")  # HW 1: the flushed LeaderChange
    assert n.core.high_watermark == 1
    one_response(n.step(a.Tick(t + 2)), "first")  # the linger passed
    fetch(n, t + 10, 3, 5, 1, max_wait_ms=500, token="v3")
    consumer = m.FetchRequest(cluster_id=CLUSTER, replica_id=-1, max_wait_ms=500,
                              current_leader_epoch=-1, fetch_offset=1, last_fetched_epoch=-1)
    assert not of(n.step(a.RequestReceived(t + 10, "c", consumer)), a.Respond)
    assert n.core.high_watermark == 1 and n.core.next_deadline_ms == t + 510  # both parked
    acts = n.step(a.FlushCompleted(t + 20, 5))  # the leader and voter 3 hold 0..4
    assert n.core.high_watermark == 5
    c = one_response(acts, "c")
    assert [h.base_offset for _, h in iter_batches(c.records)] == [1]  # the batch of offsets 1..4
    assert not responses(acts, "v3")
    assert n.core.next_deadline_ms == t + 22  # max_wait_ms came down to the linger
    r = one_response(n.step(a.Tick(t + 22)), "v3")
    assert r.records == b"" and r.high_watermark == 5


def test_parked_fetch_is_answered_empty_when_max_wait_passes(leader):
    t = leader.now
    fetch(leader, t + 10, 3, 5, 1)
    fetch(leader, t + 10, 2, 5, 1, max_wait_ms=500, token="park")
    assert not of(leader.step(a.Tick(t + 509)), a.Respond)
    r = one_response(leader.step(a.Tick(t + 510)), "park")
    assert r.error_code == Errors.NONE and r.records == b"" and r.high_watermark == 5


def test_parked_fetch_is_answered_with_an_error_when_leadership_is_lost(leader):
    t = leader.now
    fetch(leader, t + 10, 2, 5, 1, max_wait_ms=500, token="first")
    fetch(leader, t + 10, 2, 5, 1, max_wait_ms=500, token="park")
    acts = leader.step(a.RequestReceived(t + 11, "v", m.VoteRequest(
        cluster_id=CLUSTER, candidate_epoch=2, candidate_id=3, last_offset_epoch=1, last_offset=5)))
    r = one_response(acts, "park")
    assert r.error_code == Errors.FENCED_LEADER_EPOCH and r.current_leader.leader_epoch == 2


def test_offsets_for_leader_epoch_is_fenced_and_answers_the_epoch_end(leader):
    def ofle(cur, ep, rid=2):
        return one_response(leader.step(a.RequestReceived(0, "o", m.OffsetsForLeaderEpochRequest(
            cluster_id=CLUSTER, replica_id=rid, current_leader_epoch=cur, leader_epoch=ep))), "o")
    assert ofle(0, 0).error_code == Errors.FENCED_LEADER_EPOCH
    assert ofle(3, 0).error_code == Errors.UNKNOWN_LEADER_EPOCH
    r = ofle(1, 1)
    assert (r.error_code, r.leader_epoch, r.end_offset) == (0, 1, 5)
    r = ofle(1, 0)
    assert (r.leader_epoch, r.end_offset) == (0, 0)
    # A consumer with NO_EPOCH skips the fence and sees committed data only.
    r = ofle(-1, 1, rid=-1)
    assert r.error_code == Errors.NONE and r.end_offset == 0


def test_snapshot_redirect_and_fetch_snapshot(leader):
    fetch(leader, 10, 2, 5, 1)
    fetch(leader, 10, 3, 5, 1)
    assert leader.core.high_watermark == 5
    sid = m.SnapshotId(5, 1)
    leader.log.snapshots[sid] = b"S" * 10
    # Every live replica has 5: the new snapshot moves the leader's log start
    # there at once, and the driver is told once, to delete the segments below.
    created = leader.step(a.SnapshotCreated(11, sid))
    assert leader.core.log_start_offset == 5
    assert [x.log_start_offset for x in of(created, a.AdvanceLogStart)] == [5]
    # A replica fetching at 0 (below the log start) is sent to the snapshot
    # (KAFKA-15078's fetch at 0 before the log start moves: the consumer test below).
    fetched = fetch(leader, 12, 2, 0, 0, token="z")
    r = one_response(fetched, "z")
    assert r.snapshot_id == sid and r.records == b""
    assert not of(fetched + leader.step(a.Tick(13)), a.AdvanceLogStart)
    r = one_response(fetch(leader, 14, 3, 3, 1, token="below"), "below")
    assert r.snapshot_id == sid

    def fs(pos, snap=sid, cur=1):
        return one_response(leader.step(a.RequestReceived(15, "s", m.FetchSnapshotRequest(
            cluster_id=CLUSTER, replica_id=2, current_leader_epoch=cur, snapshot_id=snap,
            position=pos, max_bytes=4))), "s")
    r = fs(0)
    assert (r.size, r.position, r.unaligned_records) == (10, 0, b"SSSS")
    assert fs(10).error_code == Errors.POSITION_OUT_OF_RANGE
    assert fs(-1).error_code == Errors.POSITION_OUT_OF_RANGE
    assert fs(0, m.SnapshotId(4, 1)).error_code == Errors.SNAPSHOT_NOT_FOUND
    assert fs(0, cur=0).error_code == Errors.FENCED_LEADER_EPOCH


def test_consumer_reads_from_the_log_start_and_only_below_it_is_sent_to_the_snapshot(leader):
    """A consumer (no epoch) at the log start reads the log, snapshot or not;
    the replica rules (KAFKA-15078's fetch at 0, an epoch that differs from
    the snapshot's at the log start) are for replicas' logs. Only an offset
    below the log start gets the snapshot id (the client: out of range)."""
    fetch(leader, 10, 2, 5, 1)
    fetch(leader, 10, 3, 0, 0)  # voter 3 lags at 0
    sid = m.SnapshotId(1, 1)  # the batches: [0] and [1..4]
    leader.log.snapshots[sid] = b"S" * 10

    def consume(offset, token):
        return one_response(leader.step(a.RequestReceived(11, token, req(
            replica_id=-1, current_leader_epoch=-1, last_fetched_epoch=-1, fetch_offset=offset))), token)
    leader.step(a.SnapshotCreated(11, sid))  # voter 3 still needs offset 0: the log start stays at 0
    assert leader.core.log_start_offset == 0
    r = consume(0, "c0")
    assert r.snapshot_id is None and [h.base_offset for _, h in iter_batches(r.records)] == [0, 1]
    assert one_response(fetch(leader, 12, 2, 0, 0, token="r0"), "r0").snapshot_id == sid  # a replica: redirected
    fetch(leader, 13, 2, 5, 1)
    fetch(leader, 13, 3, 5, 1)  # every live replica has the snapshot's offsets now
    assert leader.core.log_start_offset == 1
    r = consume(1, "c1")
    assert r.snapshot_id is None and r.error_code == Errors.NONE
    assert [h.base_offset for _, h in iter_batches(r.records)] == [1]
    assert consume(0, "c0b").snapshot_id == sid


def test_log_start_waits_for_a_lagging_live_replica_up_to_max_replication_lag():
    n = Node(1, max_replication_lag_ms=5000)
    now = make_leader(n)
    append(n, now, 4)
    n.step(a.FlushCompleted(now, 5))
    fetch(n, now, 2, 5, 1)
    fetch(n, now, 3, 1, 1)  # voter 3 lags at 1
    assert n.core.high_watermark == 5
    n.log.snapshots[m.SnapshotId(5, 1)] = b"x"
    n.step(a.SnapshotCreated(now + 1, m.SnapshotId(5, 1)))
    assert n.core.log_start_offset == 0
    fetch(n, now + 4000, 3, 1, 1)
    fetch(n, now + 4000, 2, 5, 1)
    assert n.core.log_start_offset == 0
    acts = n.step(a.Tick(now + 5001))
    assert a.AdvanceLogStart(5) in acts and n.core.log_start_offset == 5


def test_describe_quorum_and_list_offsets(leader):
    fetch(leader, 100, 2, 5, 1)
    fetch(leader, 100, 7, 2, 1)  # an observer
    d = one_response(leader.step(a.RequestReceived(101, "d", m.DescribeQuorumRequest())), "d")
    assert d.leader_id == 1 and d.high_watermark == 5
    assert [(v.replica_id, v.log_end_offset) for v in d.voters] == [(1, 5), (2, 5), (3, -1)]
    assert [(o.replica_id, o.log_end_offset) for o in d.observers] == [(7, 2)]
    assert d.voters[1].in_sync and not d.voters[2].in_sync

    def lo(ts, cur=1):
        return one_response(leader.step(a.RequestReceived(102, "l", m.ListOffsetsRequest(
            cluster_id=CLUSTER, current_leader_epoch=cur, timestamp_ms=ts))), "l")
    r = lo(m.LIST_OFFSETS_LATEST)
    assert (r.offset, r.leader_epoch) == (5, 1)
    r = lo(m.LIST_OFFSETS_EARLIEST)
    assert r.offset == 0
    assert lo(m.LIST_OFFSETS_LATEST, cur=0).error_code == Errors.FENCED_LEADER_EPOCH
    assert lo(m.LIST_OFFSETS_LATEST, cur=-1).error_code == Errors.NONE
