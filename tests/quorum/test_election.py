"""Election rules of the quorum core: votes, timeouts, resignation, KAFKA-10527."""

from metalog.broker.quorum import api as a
from metalog.protocol import messages as m
from metalog.protocol.errors import Errors
from metalog.storage.batch import iter_batches
from metalog.storage.control_records import LeaderChange, decode_control
from metalog.storage.batch import decode_records

from tests.quorum.harness import CLUSTER, Node, make_leader, of, one_response, sent, stand


def vote_req(candidate: int, epoch: int, last_epoch: int = -1, last_offset: int = 0) -> m.VoteRequest:
    return m.VoteRequest(cluster_id=CLUSTER, candidate_epoch=epoch, candidate_id=candidate,
                         last_offset_epoch=last_epoch, last_offset=last_offset)


def test_vote_is_persisted_before_the_answer_and_granted_once_per_epoch():
    n = Node(1)
    n.step(a.Tick(0))
    acts = n.step(a.RequestReceived(1, "v2", vote_req(2, 5)))
    persist = [i for i, x in enumerate(acts) if isinstance(x, a.PersistQuorumState)]
    answer = [i for i, x in enumerate(acts) if isinstance(x, a.Respond)]
    assert persist and answer and persist[-1] < answer[0]
    assert acts[persist[-1]].state == a.QuorumStateData(5, -1, 2, (1, 2, 3))
    assert one_response(acts, "v2").vote_granted
    assert n.core.role == "voted" and n.core.voted_id == 2
    # A second candidate in the same epoch is refused; the first one again is granted.
    assert not one_response(n.step(a.RequestReceived(2, "v3", vote_req(3, 5))), "v3").vote_granted
    assert one_response(n.step(a.RequestReceived(3, "v2b", vote_req(2, 5))), "v2b").vote_granted


def test_vote_refused_to_a_less_up_to_date_log():
    view = a.LogView(log_end_offset=10, epochs=[(3, 0)])
    n = Node(1, view=view, state=a.QuorumStateData(3, -1, -1, (1, 2, 3)))
    n.step(a.Tick(0))
    # Older last epoch, even with a longer log: refused.
    r = one_response(n.step(a.RequestReceived(1, "a", vote_req(2, 4, last_epoch=2, last_offset=50))), "a")
    assert not r.vote_granted
    # Same last epoch, shorter log: refused (epoch 5 now: a new epoch, a fresh vote).
    r = one_response(n.step(a.RequestReceived(2, "b", vote_req(2, 5, last_epoch=3, last_offset=9))), "b")
    assert not r.vote_granted and n.core.voted_id == -1
    # Same last epoch, same length: granted.
    r = one_response(n.step(a.RequestReceived(3, "c", vote_req(3, 6, last_epoch=3, last_offset=10))), "c")
    assert r.vote_granted and n.core.voted_id == 3


def test_vote_from_an_older_epoch_is_fenced():
    n = Node(1, state=a.QuorumStateData(7, -1, -1, (1, 2, 3)))
    r = one_response(n.step(a.RequestReceived(0, "v", vote_req(2, 6))), "v")
    assert r.error_code == Errors.FENCED_LEADER_EPOCH and r.leader_epoch == 7 and not r.vote_granted


def test_candidate_timeout_is_randomized_between_t_and_2t():
    seen = set()
    for seed in range(20):
        n = Node(1, seed=seed)
        n.step(a.Tick(0))
        d = n.core.next_deadline_ms
        assert 1000 <= d < 2000
        seen.add(d)
    assert len(seen) > 5


def test_elected_leader_writes_leader_change_first_and_sends_begin_epoch():
    n = Node(1)
    n.step(a.Tick(0))
    acts = stand(n, n.core.next_deadline_ms)
    assert n.core.role == "candidate" and n.core.epoch == 1
    votes = sent(acts, m.VoteRequest)
    assert not any(v.request.pre_vote for v in votes)
    assert sorted(s.destination for s in votes) == [2, 3]
    acts = n.step(a.ResponseReceived(2000, votes[0].request_id, votes[0].destination,
                                     m.VoteResponse(leader_epoch=1, vote_granted=True)))
    assert n.core.role == "leader" and n.core.leader_id == 1
    appends = of(acts, a.AppendBatches)
    assert len(appends) == 1 and appends[0].base_offset == 0
    (_, h), = iter_batches(appends[0].data)
    assert h.is_control and h.leader_epoch == 1
    rec = decode_control(decode_records(appends[0].data)[0])
    assert isinstance(rec, LeaderChange) and rec.leader_id == 1 and rec.granting_voters == [1, votes[0].destination]
    begins = sent(acts, m.BeginQuorumEpochRequest)
    assert sorted(s.destination for s in begins) == [2, 3]
    assert of(acts, a.FlushLog)


def test_single_voter_elects_itself_at_once():
    n = Node(1, voters=(1,))
    acts = n.step(a.Tick(0))
    assert n.core.role == "leader" and n.core.epoch == 1
    assert of(acts, a.AppendBatches), "a new leader writes its LeaderChange record"
    n.step(a.FlushCompleted(0, 1))
    assert n.core.high_watermark == 1


def test_restarted_leader_does_not_resume_its_epoch():
    """KAFKA-10527: leader of epoch 4 restarts: it is resigned in 4 and runs for 5."""
    view = a.LogView(log_end_offset=3, epochs=[(4, 0)])
    n = Node(1, view=view, state=a.QuorumStateData(4, 1, 1, (1, 2, 3)))
    acts = n.step(a.Tick(0))
    assert n.core.role == "resigned" and n.core.epoch == 4
    # It neither takes writes nor serves fetches of epoch 4.
    acts = n.step(a.ClientAppend(1, [a.AppendWaiter("p", 1)], [b"x"]))
    assert one_response(acts, "p").error_code == Errors.NOT_LEADER_OR_FOLLOWER
    fr = m.FetchRequest(cluster_id=CLUSTER, replica_id=2, max_wait_ms=0, current_leader_epoch=4,
                        fetch_offset=3, last_fetched_epoch=4)
    assert one_response(n.step(a.RequestReceived(1, "f", fr)), "f").error_code == Errors.NOT_LEADER_OR_FOLLOWER
    # It does not vote in its own epoch either.
    assert not one_response(n.step(a.RequestReceived(1, "v", vote_req(2, 4, 4, 3))), "v").vote_granted
    acts = stand(n, n.core.next_deadline_ms)
    assert n.core.role == "candidate" and n.core.epoch == 5
    assert all(s.request.candidate_epoch == 5 for s in sent(acts, m.VoteRequest))


def test_restarted_single_voter_leader_takes_a_new_epoch():
    n = Node(1, voters=(1,), view=a.LogView(log_end_offset=2, epochs=[(3, 0)]),
             state=a.QuorumStateData(3, 1, 1, (1,)))
    n.step(a.Tick(0))
    assert n.core.role == "leader" and n.core.epoch == 4


def test_higher_epoch_in_a_vote_request_demotes_a_leader_and_fails_waiters():
    n = Node(1)
    now = make_leader(n)
    n.step(a.ClientAppend(now, [a.AppendWaiter("p", 1)], [b"x"]))
    acts = n.step(a.RequestReceived(now + 1, "v", vote_req(2, 9, 9, 100)))
    assert n.core.role == "voted" and n.core.epoch == 9
    assert one_response(acts, "p").error_code == Errors.NOT_LEADER_OR_FOLLOWER
    assert one_response(acts, "v").vote_granted


def test_check_quorum_leader_resigns_when_a_majority_is_silent():
    n = Node(1, fetch_timeout_ms=2000)
    now = make_leader(n)
    t = now + 2999
    n.step(a.Tick(t))
    assert n.core.role == "leader"
    assert n.core.next_deadline_ms <= now + 3000
    n.step(a.Tick(now + 3000))
    assert n.core.role == "resigned" and n.core.epoch == 1
    # Check-quorum with pre-vote: the cut-off former leader asks for pre-votes
    # again and again, but nobody answers, so it never bumps the epoch (it
    # would disrupt the majority's new leader when the partition heals).
    real_votes = 0
    t = now + 3000
    while t < now + 30000:
        t = n.core.next_deadline_ms
        acts = n.step(a.Tick(t))
        real_votes += sum(1 for s in sent(acts, m.VoteRequest) if not s.request.pre_vote)
        assert not of(acts, a.PersistQuorumState)
    assert n.core.role == "prospective" and n.core.epoch == 1 and real_votes == 0
    # A majority's grants make it a real candidate in epoch 2.
    stand(n, t + 1, n.step(a.Tick(n.core.next_deadline_ms)))
    assert n.core.role == "candidate" and n.core.epoch == 2


def test_check_quorum_one_fetching_follower_keeps_the_leader_of_three():
    n = Node(1, fetch_timeout_ms=2000)
    now = make_leader(n)
    for t in range(now, now + 10000, 1000):
        n.step(a.RequestReceived(t, "f", m.FetchRequest(
            cluster_id=CLUSTER, replica_id=2, max_wait_ms=0, current_leader_epoch=1,
            fetch_offset=n.core.log_end_offset, last_fetched_epoch=1)))
        assert n.core.role == "leader"


def test_graceful_shutdown_hands_over_to_the_most_caught_up_voter():
    n = Node(1)
    now = make_leader(n)
    n.step(a.FlushCompleted(now, 1))
    # Voter 3 has everything, voter 2 nothing.
    n.step(a.RequestReceived(now, "f3", m.FetchRequest(
        cluster_id=CLUSTER, replica_id=3, max_wait_ms=0, current_leader_epoch=1,
        fetch_offset=1, last_fetched_epoch=1)))
    acts = n.step(a.Shutdown(now + 1))
    assert n.core.role == "resigned"
    ends = sent(acts, m.EndQuorumEpochRequest)
    assert sorted(e.destination for e in ends) == [2, 3]
    assert all(e.request.preferred_successors == [3, 2] for e in ends)

    # The receiving side: voter 3 (first successor) runs at once, 2 backs off.
    for voter, expect_now in ((3, True), (2, False)):
        f = Node(voter, state=a.QuorumStateData(1, 1, -1, (1, 2, 3)))
        f.step(a.Tick(0))
        assert f.core.role == "follower"
        acts = f.step(a.RequestReceived(10, "e", ends[0].request))
        assert one_response(acts, "e").error_code == Errors.NONE
        if expect_now:
            assert f.core.role == "prospective" and f.core.epoch == 1
            assert all(s.request.pre_vote and s.request.candidate_epoch == 2 for s in sent(acts, m.VoteRequest))
        else:
            assert f.core.role == "follower" and f.core.next_deadline_ms == 10 + 100


def test_begin_quorum_epoch_makes_a_voter_follow():
    f = Node(2)
    f.step(a.Tick(0))
    acts = f.step(a.RequestReceived(5, "b", m.BeginQuorumEpochRequest(
        cluster_id=CLUSTER, leader_id=1, leader_epoch=3)))
    assert f.core.role == "follower" and f.core.leader_id == 1 and f.core.epoch == 3
    persist = of(acts, a.PersistQuorumState)
    assert persist and persist[-1].state.leader_id == 1 and persist[-1].state.leader_epoch == 3
    assert one_response(acts, "b").error_code == Errors.NONE
    # Empty log: no OffsetsForLeaderEpoch, straight to Fetch.
    fetches = sent(acts, m.FetchRequest)
    assert len(fetches) == 1 and fetches[0].destination == 1
    assert fetches[0].request.current_leader_epoch == 3 and fetches[0].request.fetch_offset == 0


def test_wrong_cluster_id_is_refused_with_a_clear_message():
    n = Node(1)
    acts = n.step(a.RequestReceived(0, "x", m.ProduceRequest(cluster_id="other", records=[b"a"])))
    r = one_response(acts, "x")
    assert r.error_code == Errors.INCONSISTENT_CLUSTER_ID
    assert r.error_message == "cluster id 'other' does not match ours 'test-cluster'"


def test_observer_never_votes_and_discovers_the_leader_through_a_voter():
    o = Node(9)
    acts = o.step(a.Tick(0))
    assert o.core.role == "observer"
    disc = sent(acts, m.FetchRequest)
    assert len(disc) == 1 and disc[0].destination in (1, 2, 3)
    assert not one_response(o.step(a.RequestReceived(1, "v", vote_req(2, 1))), "v").vote_granted
    # The voter answers NOT_LEADER with the current leader: we follow it.
    acts = o.step(a.ResponseReceived(2, disc[0].request_id, disc[0].destination, m.FetchResponse(
        error_code=Errors.FENCED_LEADER_EPOCH, current_leader=m.LeaderIdAndEpoch(3, 4))))
    assert o.core.role == "observer" and o.core.leader_id == 3 and o.core.epoch == 4
    nxt = sent(acts, m.FetchRequest)
    assert len(nxt) == 1 and nxt[0].destination == 3
    # Observers never become candidates, however long the leader is silent.
    o.step(a.Tick(100000))
    assert o.core.role == "observer"


def test_begin_and_end_quorum_epoch_from_a_non_voter_are_refused():
    n = Node(1)
    n.step(a.Tick(0))
    for req in (m.BeginQuorumEpochRequest(cluster_id=CLUSTER, leader_id=42, leader_epoch=7),
                m.EndQuorumEpochRequest(cluster_id=CLUSTER, leader_id=42, leader_epoch=7)):
        r = one_response(n.step(a.RequestReceived(1, "x", req)), "x")
        assert r.error_code == Errors.INCONSISTENT_VOTER_SET
    assert n.core.epoch == 0 and n.core.leader_id == -1, "a non-voter moved our epoch"
