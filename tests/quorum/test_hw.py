"""High-watermark rules: the blog's walkthrough (seed 002), KAFKA-12619, KAFKA-10533."""

from metalog.broker.quorum import api as a
from metalog.protocol import messages as m
from metalog.protocol.errors import Errors

from tests.quorum.harness import CLUSTER, Node, append, fetch, make_leader, of, one_response, responses, sent


def deliver(src: Node, send: a.SendRequest, dst: Node, now: int) -> list:
    """Hand one request from src to dst and its answer back; returns src's actions."""
    acts = dst.step(a.RequestReceived(now, ("rq", send.request_id), send.request))
    (resp,) = responses(acts, ("rq", send.request_id))
    return src.step(a.ResponseReceived(now, send.request_id, send.destination, resp))


def test_blog_walkthrough_hw_reaches_the_follower_one_fetch_round_later():
    # Kafka's timing, which the walkthrough follows: the Fetch that moves the
    # HW is answered at once (fetch_hw_linger_ms 0; with the default the
    # answer waits up to 2 ms for records to carry the HW: test_fetch_leader).
    leader = Node(1, voters=(1, 2), fetch_hw_linger_ms=0)
    follower = Node(2, voters=(1, 2))
    leader.step(a.Tick(0))
    acts = leader.step(a.Tick(leader.core.next_deadline_ms))
    (pre_vote,) = sent(acts, m.VoteRequest)
    acts = deliver(leader, pre_vote, follower, pre_vote.timeout_ms)
    (vote,) = sent(acts, m.VoteRequest)
    assert leader.core.role == "candidate" and not vote.request.pre_vote
    now = vote.timeout_ms
    acts = deliver(leader, vote, follower, now)
    assert leader.core.role == "leader"
    (begin,) = sent(acts, m.BeginQuorumEpochRequest)
    leader.step(a.FlushCompleted(now, 1))
    acts = follower.step(a.RequestReceived(now, "b", begin.request))
    (fetch_req,) = sent(acts, m.FetchRequest)

    def round_trip(send):
        acts = deliver(follower, send, leader, now)
        if of(acts, a.FlushLog):
            acts = follower.step(a.FlushCompleted(now, follower.core.log_end_offset))
        (nxt,) = sent(acts, m.FetchRequest)
        return nxt

    # Replicate the LeaderChange record (offset 0) and let both learn HW 1.
    fetch_req = round_trip(fetch_req)
    fetch_req = round_trip(fetch_req)
    assert (leader.core.high_watermark, follower.core.high_watermark) == (1, 1)

    # The producer writes one record: leader LEO 2, HW still 1.
    append(leader, now, 1)
    leader.step(a.FlushCompleted(now, 2))
    assert (leader.core.log_end_offset, leader.core.high_watermark) == (2, 1)
    # Round 1: the follower asks for offset 1, gets the record; remote LEO 1, nobody's HW moves.
    assert fetch_req.request.fetch_offset == 1
    fetch_req = round_trip(fetch_req)
    assert leader.core.replica_states[2].log_end_offset == 1
    assert (leader.core.high_watermark, follower.core.log_end_offset, follower.core.high_watermark) == (1, 2, 1)
    # Round 2: fetch offset 2 moves remote LEO and the leader's HW to 2; the answer carries it.
    assert fetch_req.request.fetch_offset == 2
    round_trip(fetch_req)
    assert (leader.core.high_watermark, follower.core.high_watermark) == (2, 2)


def test_hw_waits_for_the_leaders_first_record_of_its_epoch():
    """KAFKA-12619: old-epoch records a majority holds are not exposed as committed
    until the new leader's own LeaderChange record is."""
    view = a.LogView(log_end_offset=5, epochs=[(1, 0)])
    n = Node(1, view=view, state=a.QuorumStateData(1, -1, -1, (1, 2, 3)))
    now = make_leader(n)  # epoch 2, LeaderChange at offset 5
    assert n.core.epoch == 2 and n.core.log_end_offset == 6
    fetch(n, now, 2, 5, 1)  # voter 2 holds all of epoch 1
    assert n.core.high_watermark == -1
    fetch(n, now, 2, 6, 2)
    assert n.core.high_watermark == 6


def test_unflushed_leader_data_never_counts():
    """KAFKA-10533: the leader's own LEO for the HW is its flushed end offset."""
    n = Node(1)
    now = make_leader(n)
    append(n, now, 9)  # offsets 1..9, not flushed
    fetch(n, now, 2, 10, 1)
    assert n.core.high_watermark == 1  # voter 2 has 10, but we only flushed 1
    n.step(a.FlushCompleted(now, 7))
    assert n.core.high_watermark == 7
    n.step(a.FlushCompleted(now, 10))
    assert n.core.high_watermark == 10


def test_observers_never_count_and_hw_never_goes_back():
    n = Node(1)
    now = make_leader(n)
    append(n, now, 9)
    n.step(a.FlushCompleted(now, 10))
    fetch(n, now, 7, 10, 1)  # an observer
    fetch(n, now, 8, 10, 1)  # another
    assert n.core.high_watermark == -1
    fetch(n, now, 2, 10, 1)
    assert n.core.high_watermark == 10
    fetch(n, now, 2, 4, 1)  # voter 2 went back (e.g. it truncated)
    assert n.core.high_watermark == 10


def test_produce_waiters_are_answered_when_their_last_record_commits():
    n = Node(1)
    now = make_leader(n)
    acts = n.step(a.ClientAppend(now, [a.AppendWaiter("p1", 2), a.AppendWaiter("p2", 3)], [b"a", b"b", b"c", b"d", b"e"]))
    assert not responses(acts)
    n.step(a.FlushCompleted(now, 6))
    acts = fetch(n, now, 2, 3, 1)  # offsets 0..2 committed: p1 (1..2) done, p2 (3..5) not
    r = one_response(acts, "p1")
    assert (r.error_code, r.base_offset, r.leader_epoch) == (0, 1, 1)
    assert not responses(acts, "p2")
    r = one_response(fetch(n, now, 2, 6, 1), "p2")
    assert r.base_offset == 3
    # Not the leader: refused at once with the leader we know.
    f = Node(2, state=a.QuorumStateData(1, 1, -1, (1, 2, 3)))
    r = one_response(f.step(a.RequestReceived(0, "x", m.ProduceRequest(cluster_id=CLUSTER, records=[b"a"]))), "x")
    assert r.error_code == Errors.NOT_LEADER_OR_FOLLOWER and r.current_leader == m.LeaderIdAndEpoch(1, 1)
    assert r.error_message == "node 2 is not the leader"
