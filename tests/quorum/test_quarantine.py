"""Issue 12 item 4, the core's side: a voter whose log was cut by corruption
(quarantine) never stands, and votes only for a log at least as up to date as
the one it had, until it has re-replicated past that end; a leader that finds
corruption resigns, and needs to re-replicate only up to its high watermark
when it has committed in its epoch (nothing past it can be committed); a Fetch
whose read fails verification is answered with KAFKA_STORAGE_ERROR, never with
the bytes."""

from metalog.broker.quorum import api as a
from metalog.protocol import messages as m
from metalog.protocol.errors import Errors
from metalog.storage.batch import CorruptBatchError

from tests.quorum.harness import CLUSTER, MemLog, Node, append, batch, fetch, make_leader, of, one_response, sent, stand


def vote(node: Node, now: int, candidate: int, epoch: int, last_epoch: int, last_offset: int, token="v"):
    return node.step(a.RequestReceived(now, token, m.VoteRequest(
        cluster_id=CLUSTER, candidate_epoch=epoch, candidate_id=candidate,
        last_offset_epoch=last_epoch, last_offset=last_offset)))


def quarantined_voter(must_reach: int = 10, end: int = 4) -> Node:
    log = MemLog()
    log.append(batch(0, 1, end), 0, end)
    view = a.LogView(log_start_offset=0, log_end_offset=end, epochs=[(1, 0)], must_reach_offset=must_reach)
    return Node(2, log=log, view=view, state=a.QuorumStateData(1, -1, -1, (1, 2, 3)))


def test_a_quarantined_voter_votes_only_for_a_log_at_least_as_up_to_date_as_the_one_it_had():
    n = quarantined_voter(must_reach=10, end=4)
    n.step(a.Tick(0))
    # Past its own short log (4) but behind what it had (10): refused, so the
    # vote never depends on records it lost.
    r = one_response(vote(n, 1, candidate=3, epoch=2, last_epoch=1, last_offset=8), "v")
    assert (r.error_code, r.vote_granted) == (Errors.NONE, False)
    assert n.core.epoch == 2 and n.core.voted_id == -1  # learns the epoch, votes for nobody
    r = one_response(vote(n, 2, candidate=3, epoch=3, last_epoch=1, last_offset=10, token="w"), "w")
    assert r.vote_granted and n.core.voted_id == 3 and n.core.quarantined


def test_a_quarantined_voter_never_stands_for_election():
    n = quarantined_voter()
    t = 0
    for _ in range(20):
        t += 5000
        acts = n.step(a.Tick(t))
        # Only probes (an empty log no voter grants), never a real candidacy.
        assert all(v.request.last_offset == -1 for v in sent(acts, m.VoteRequest))
        assert n.core.role != "candidate"
    assert n.core.next_deadline_ms is not None  # still ticking, not stuck


def test_the_quarantine_ends_once_the_flushed_log_reaches_must_reach_offset():
    n = quarantined_voter(must_reach=10, end=4)
    n.step(a.Tick(0))
    # A leader of epoch 2 finds us; we fetch and get records 4..12.
    acts = n.step(a.RequestReceived(1, "b", m.BeginQuorumEpochRequest(
        cluster_id=CLUSTER, leader_id=1, leader_epoch=2)))
    assert n.core.role == "follower"
    data = batch(4, 1, 4) + batch(8, 2, 4)
    fetches = sent(acts, m.OffsetsForLeaderEpochRequest)
    assert fetches
    acts = n.step(a.ResponseReceived(3, fetches[0].request_id, 1, m.OffsetsForLeaderEpochResponse(
        leader_epoch=1, end_offset=8, current_leader=m.LeaderIdAndEpoch(1, 2))))
    f = sent(acts, m.FetchRequest)[0]
    assert f.request.fetch_offset == 4
    acts = n.step(a.ResponseReceived(5, f.request_id, 1, m.FetchResponse(
        high_watermark=12, log_start_offset=0, records=data, current_leader=m.LeaderIdAndEpoch(1, 2))))
    assert of(acts, a.AppendBatches) and n.core.quarantined
    assert not of(n.step(a.FlushCompleted(6, 9)), a.ClearQuarantine)  # 9 < 10: still abstains
    acts = n.step(a.FlushCompleted(7, 12))
    assert of(acts, a.ClearQuarantine) == [a.ClearQuarantine(10)]
    assert not n.core.quarantined
    r = one_response(vote(n, 8, candidate=3, epoch=3, last_epoch=2, last_offset=12), "v")
    assert r.vote_granted  # a voter again


def leader_with(hw: int) -> tuple[Node, int]:
    """Leader 1 with records up to 10 flushed and followers 2 and 3 at `hw`."""
    n = Node(1)
    t = make_leader(n)
    append(n, t, 9)
    n.step(a.FlushCompleted(t, 10))
    fetch(n, t, 2, hw, 1)
    fetch(n, t, 3, hw, 1)
    assert n.core.high_watermark == hw
    return n, t


def test_a_leader_that_finds_corruption_resigns_and_abstains():
    n, t = leader_with(10)
    acts = n.step(a.LogQuarantined(t + 1, log_end_offset=4, must_reach_offset=10))
    assert n.core.role == "resigned"
    assert {s.destination for s in sent(acts, m.EndQuorumEpochRequest)} == {2, 3}
    assert (n.core.log_end_offset, n.core.flushed_end_offset, n.core.high_watermark) == (4, 4, 4)
    assert n.core.quarantined
    for k in range(1, 10):
        assert all(v.request.last_offset == -1 for v in sent(n.step(a.Tick(t + k * 3000)), m.VoteRequest))
        assert n.core.role != "candidate"


def test_a_leader_that_lost_only_uncommitted_records_is_not_held_in_quarantine():
    """Sim seed 1127: a leader whose flipped records all lie past its high
    watermark (committed in its own epoch) lost nothing anyone can have
    committed. It resigns and clears the quarantine at once, so it may stand
    again; otherwise, with the only other copy on a replica that never stands,
    no leader could ever be elected."""
    n, t = leader_with(6)
    acts = n.step(a.LogQuarantined(t + 1, log_end_offset=8, must_reach_offset=10))
    assert n.core.role == "resigned" and not n.core.quarantined
    assert [c.must_reach_offset for c in of(acts, a.ClearQuarantine)] == [6]


def test_a_leader_cut_below_its_high_watermark_must_re_replicate_to_it_not_to_its_old_end():
    n, t = leader_with(6)
    n.step(a.LogQuarantined(t + 1, log_end_offset=4, must_reach_offset=10))
    assert n.core.role == "resigned" and n.core.must_reach_offset == 6
    # It votes for a log that reaches its high watermark in epoch 1...
    r = one_response(vote(n, t + 2, candidate=2, epoch=2, last_epoch=1, last_offset=6), "v")
    assert r.vote_granted
    # ...but a follower (no high watermark of its own epoch) keeps its old end.
    f = quarantined_voter(must_reach=10, end=4)
    f.step(a.Tick(0))
    f.step(a.LogQuarantined(1, log_end_offset=2, must_reach_offset=10))
    assert f.core.must_reach_offset == 10


def test_a_fetch_whose_read_fails_verification_gets_a_storage_error_not_bytes():
    class CorruptReader(MemLog):
        def read(self, start_offset, end_offset, max_bytes):
            raise CorruptBatchError("bad CRC at byte 123", 123, 5)

    n = Node(1, log=CorruptReader())
    t = make_leader(n)
    append(n, t, 9)
    n.step(a.FlushCompleted(t, 10))
    acts = fetch(n, t, 2, 0, 0)
    r = one_response(acts, "f")
    assert r.error_code == Errors.KAFKA_STORAGE_ERROR and r.records == b""
    assert "bad CRC at byte 123" in r.error_message
    found = of(acts, a.CorruptionFound)
    assert len(found) == 1 and isinstance(found[0].error, CorruptBatchError)
    assert n.core.role == "leader"  # the driver quarantines; then LogQuarantined decides


def test_an_observer_is_never_held_in_quarantine():
    log = MemLog()
    view = a.LogView(must_reach_offset=5)
    n = Node(9, log=log, view=view)
    n.step(a.Tick(0))
    acts = n.step(a.LogQuarantined(1, log_end_offset=0, must_reach_offset=5))
    assert of(acts, a.ClearQuarantine) and not n.core.quarantined


def test_a_candidate_that_finds_corruption_gives_up_the_votes_granted_to_its_old_log():
    """Sim seed 318: quarantined while its VoteRequests were out, a candidate
    won with votes granted to the log it no longer had, then a follower was
    asked to truncate below its HW. Now it drops the candidacy."""
    log = MemLog()
    log.append(batch(0, 1, 10), 0, 10)
    n = Node(1, log=log, view=a.LogView(log_end_offset=10, epochs=[(1, 0)]),
             state=a.QuorumStateData(1, -1, -1, (1, 2, 3)))
    n.step(a.Tick(0))
    acts = stand(n, n.core.next_deadline_ms)
    votes = sent(acts, m.VoteRequest)
    assert n.core.role == "candidate" and votes
    n.step(a.LogQuarantined(5000, log_end_offset=0, must_reach_offset=10))
    assert n.core.role == "voted" and n.core.voted_id == 1
    for v in votes:
        n.step(a.ResponseReceived(5001, v.request_id, v.destination, m.VoteResponse(
            leader_id=-1, leader_epoch=n.core.epoch, vote_granted=True)))
    assert n.core.role != "leader"


def test_a_quarantined_voter_without_a_leader_probes_with_a_vote_request_nobody_grants():
    """Sim seed 2079: quarantined as a candidate whose VoteRequests were lost,
    a voter sat in an epoch nobody else reached and never heard of the leader.
    Now, at its election timeout, it sends a probe (its epoch, an empty log)
    and follows the leader any answer names; the probe itself is refused."""
    n = quarantined_voter()
    n.step(a.Tick(0))
    acts = n.step(a.Tick(n.core.next_deadline_ms))
    probes = sent(acts, m.VoteRequest)
    assert {p.destination for p in probes} == {1, 3}
    assert all((p.request.last_offset, p.request.last_offset_epoch) == (-1, -1) for p in probes)
    assert n.core.role != "candidate"
    n.step(a.ResponseReceived(n.core.next_deadline_ms or 1, probes[0].request_id, 1, m.VoteResponse(
        leader_id=3, leader_epoch=n.core.epoch, vote_granted=False)))
    assert (n.core.role, n.core.leader_id) == ("follower", 3)
    # A voter never grants such a probe, whatever its own log.
    other = Node(3)
    other.step(a.Tick(0))
    r = one_response(vote(other, 1, candidate=2, epoch=1, last_epoch=-1, last_offset=-1), "v")
    assert r.vote_granted is False
