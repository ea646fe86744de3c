"""KIP-996 pre-vote and its composition with check-quorum, in the core.

A voter whose timer runs out is prospective: it sends Vote(pre_vote=true)
for its epoch + 1 without bumping or persisting anything; a voter grants a
pre-vote iff the candidate's log is at least as up to date and it has not
heard from a leader of its epoch within the fetch timeout, and records
nothing. Only a majority of grants makes a real candidate.
"""

from metalog.broker.quorum import api as a
from metalog.protocol import messages as m
from metalog.protocol.errors import Errors

from tests.quorum.harness import CLUSTER, MemLog, Node, batch, make_leader, of, one_response, sent


def pre_vote(candidate: int, epoch: int, last_epoch: int = -1, last_offset: int = 0) -> m.VoteRequest:
    return m.VoteRequest(cluster_id=CLUSTER, candidate_epoch=epoch, candidate_id=candidate,
                         last_offset_epoch=last_epoch, last_offset=last_offset, pre_vote=True)


def following(node_id: int = 3, leader: int = 1, epoch: int = 4, fetch_timeout_ms: int = 2000) -> tuple[Node, list]:
    """A voter with an empty log following `leader` in `epoch` (its first Fetch in the actions)."""
    n = Node(node_id, view=a.LogView(log_end_offset=0), state=a.QuorumStateData(epoch, leader, -1, (1, 2, 3)),
             fetch_timeout_ms=fetch_timeout_ms)
    return n, n.step(a.Tick(0))


def fetched(n: Node, acts: list, now: int) -> list:
    """The leader answers the Fetch in `acts` (no records): the follower heard from it at `now`."""
    (f,) = sent(acts, m.FetchRequest)
    return n.step(a.ResponseReceived(now, f.request_id, f.destination, m.FetchResponse(
        high_watermark=0, current_leader=m.LeaderIdAndEpoch(f.destination, n.core.epoch))))


def election_state(n: Node) -> tuple:
    return (n.core.role, n.core.epoch, n.core.leader_id, n.core.voted_id)


def test_a_follower_that_heard_from_its_leader_refuses_pre_votes_and_records_nothing():
    n, acts = following()
    fetched(n, acts, 100)
    before = election_state(n)
    acts = n.step(a.RequestReceived(500, "pv", pre_vote(2, 5)))
    r = one_response(acts, "pv")
    assert (r.error_code, r.vote_granted, r.leader_id, r.leader_epoch) == (Errors.NONE, False, 1, 4)
    assert election_state(n) == before and not of(acts, a.PersistQuorumState)


def test_a_follower_grants_a_pre_vote_once_the_fetch_timeout_passed_without_news_and_records_nothing():
    n, acts = following()
    fetched(n, acts, 100)
    # 2099 ms after the last answer: still refused; at 2100 (fetch timeout) granted.
    assert not one_response(n.step(a.RequestReceived(2099, "a", pre_vote(2, 5))), "a").vote_granted
    assert n.core.role == "follower"
    acts = n.step(a.RequestReceived(2100, "b", pre_vote(2, 5)))
    assert one_response(acts, "b").vote_granted
    assert not of(acts, a.PersistQuorumState)
    # Granting recorded nothing: epoch 4, no vote; the real vote in epoch 5 is still free.
    assert n.core.epoch == 4 and n.core.voted_id == -1


def test_pre_votes_are_granted_only_to_a_log_at_least_as_up_to_date():
    log = MemLog()
    log.append(batch(0, 3, 10), 0, 10)
    n = Node(1, log=log, view=a.LogView(log_end_offset=10, epochs=[(3, 0)]),
             state=a.QuorumStateData(3, -1, -1, (1, 2, 3)))
    n.step(a.Tick(0))
    assert not one_response(n.step(a.RequestReceived(1, "old", pre_vote(2, 4, 2, 50))), "old").vote_granted
    assert not one_response(n.step(a.RequestReceived(1, "short", pre_vote(2, 4, 3, 9))), "short").vote_granted
    assert one_response(n.step(a.RequestReceived(1, "same", pre_vote(2, 4, 3, 10))), "same").vote_granted
    # Two different would-be candidates may both hear yes: nothing was promised.
    assert one_response(n.step(a.RequestReceived(1, "other", pre_vote(3, 4, 3, 10))), "other").vote_granted
    # A pre-vote naming a newer epoch does not move us there (nobody is in it yet).
    assert election_state(n) == ("unattached", 3, -1, -1)


def test_a_leader_refuses_pre_votes_and_a_quarantined_voter_judges_by_the_log_it_had():
    leader = Node(1)
    now = make_leader(leader)
    r = one_response(leader.step(a.RequestReceived(now + 100, "pv", pre_vote(2, 2, 1, 100))), "pv")
    assert not r.vote_granted and leader.core.role == "leader" and (r.leader_id, r.leader_epoch) == (1, 1)

    log = MemLog()
    log.append(batch(0, 1, 4), 0, 4)
    q = Node(2, log=log, view=a.LogView(log_end_offset=4, epochs=[(1, 0)], must_reach_offset=10),
             state=a.QuorumStateData(1, -1, -1, (1, 2, 3)))
    q.step(a.Tick(0))
    # It had records up to 10 (epochs up to 1): a log ending at 8 is behind
    # what it may have acknowledged, though past its own short log.
    assert not one_response(q.step(a.RequestReceived(1, "pv", pre_vote(3, 2, 1, 8))), "pv").vote_granted
    assert one_response(q.step(a.RequestReceived(1, "pv2", pre_vote(3, 2, 1, 100))), "pv2").vote_granted


def test_a_pre_vote_from_an_older_epoch_is_fenced():
    n = Node(1, state=a.QuorumStateData(7, -1, -1, (1, 2, 3)))
    r = one_response(n.step(a.RequestReceived(0, "pv", pre_vote(2, 6))), "pv")
    assert r.error_code == Errors.FENCED_LEADER_EPOCH and r.leader_epoch == 7 and not r.vote_granted


def timed_out(fetch_timeout_ms: int = 2000) -> tuple[Node, list]:
    """Voter 3 whose leader 1 went quiet: prospective, its pre-votes in the actions."""
    n, acts = following(fetch_timeout_ms=fetch_timeout_ms)
    fetched(n, acts, 100)
    acts = n.step(a.Tick(100 + fetch_timeout_ms))
    assert n.core.role == "prospective" and n.core.epoch == 4 and n.core.leader_id == 1
    return n, acts


def answer(n: Node, s: a.SendRequest, now: int, granted: bool, leader: int = -1, epoch: int | None = None) -> list:
    return n.step(a.ResponseReceived(now, s.request_id, s.destination, m.VoteResponse(
        leader_id=leader, leader_epoch=n.core.epoch if epoch is None else epoch, vote_granted=granted)))


def test_a_prospective_sends_pre_votes_for_the_next_epoch_and_persists_nothing():
    n, acts = timed_out()
    pre = sent(acts, m.VoteRequest)
    assert sorted(s.destination for s in pre) == [1, 2]
    assert all(s.request.pre_vote and s.request.candidate_epoch == 5 and s.request.candidate_id == 3 for s in pre)
    assert not of(acts, a.PersistQuorumState)


def test_one_refusal_naming_the_known_leader_is_not_enough_to_give_up():
    """The other followers of a leader that just vanished still name it until
    their own fetch timeouts run out: one such refusal is one refusal."""
    n, acts = timed_out()
    to_2 = next(s for s in sent(acts, m.VoteRequest) if s.destination == 2)
    to_1 = next(s for s in sent(acts, m.VoteRequest) if s.destination == 1)
    answer(n, to_2, 2200, granted=False, leader=1)
    assert n.core.role == "prospective"
    # Voter 1 (the silent leader) never answers; a second refusal would make a majority.
    n.step(a.RequestFailed(2300, to_1.request_id, 1, "timeout"))
    assert n.core.role == "prospective" and n.core.epoch == 4


def test_a_majority_of_refusals_sends_a_prospective_back_to_following_its_leader():
    n, acts = timed_out()
    pre = sorted(sent(acts, m.VoteRequest), key=lambda s: s.destination)
    answer(n, pre[1], 2200, granted=False, leader=1)
    acts = answer(n, pre[0], 2201, granted=False, leader=1)  # the leader itself: alive
    assert election_state(n) == ("follower", 4, 1, -1)
    assert sent(acts, m.FetchRequest) and not of(acts, a.PersistQuorumState)
    assert n.core.next_deadline_ms >= 2201  # a fresh fetch timeout: no epoch bump at all


def test_the_known_leader_answering_sends_a_prospective_back_at_once():
    n, acts = timed_out()
    to_1 = next(s for s in sent(acts, m.VoteRequest) if s.destination == 1)
    answer(n, to_1, 2200, granted=False, leader=1)
    assert election_state(n) == ("follower", 4, 1, -1)
    # ... and having heard from it, it refuses the others' pre-votes again.
    assert not one_response(n.step(a.RequestReceived(2300, "pv", pre_vote(2, 5))), "pv").vote_granted


def test_begin_quorum_epoch_from_the_known_leader_sends_a_prospective_back():
    n, _ = timed_out()
    acts = n.step(a.RequestReceived(2200, "b", m.BeginQuorumEpochRequest(cluster_id=CLUSTER, leader_id=1,
                                                                       leader_epoch=4)))
    assert one_response(acts, "b").error_code == Errors.NONE
    assert election_state(n) == ("follower", 4, 1, -1)


def test_a_majority_of_grants_makes_a_real_candidate_in_the_next_epoch():
    n, acts = timed_out()
    to_2 = next(s for s in sent(acts, m.VoteRequest) if s.destination == 2)
    acts = answer(n, to_2, 2200, granted=True)
    assert n.core.role == "candidate" and n.core.epoch == 5 and n.core.voted_id == 3
    persist = of(acts, a.PersistQuorumState)
    assert persist and persist[0].state == a.QuorumStateData(5, -1, 3, (1, 2, 3))
    votes = sent(acts, m.VoteRequest)
    assert sorted(v.destination for v in votes) == [1, 2] and not any(v.request.pre_vote for v in votes)


def test_a_peer_too_old_for_vote_v2_makes_the_prospective_stand_at_once():
    """Kafka's rule for a mixed cluster: UNSUPPORTED_VERSION to a pre-vote
    means the peer predates KIP-996; stand as before, never hang."""
    n, acts = timed_out()
    to_2 = next(s for s in sent(acts, m.VoteRequest) if s.destination == 2)
    n.step(a.ResponseReceived(2200, to_2.request_id, 2, m.ErrorResponse(
        error_code=Errors.UNSUPPORTED_VERSION, error_message="api key 52 version 2 is not supported")))
    assert n.core.role == "candidate" and n.core.epoch == 5


def test_a_prospective_that_hears_nothing_retries_without_ever_bumping_the_epoch():
    """The partitioned follower: its pre-votes go unanswered, so each round
    ends at its election timer (at most 2 x election_timeout_ms), it falls
    back to following its leader for a grace of at most election_timeout_ms
    / 2 and asks every other voter again; it never stands, never bumps or
    persists its epoch. When the partition heals, its leader's refusal
    naming itself puts it back to following it, in the same epoch."""
    election_ms = a.QuorumConfig(node_id=3, voters=(1, 2, 3), cluster_id=CLUSTER).election_timeout_ms
    longest_round_ms = 2 * election_ms + election_ms // 2
    span_ms = 10 * election_ms
    n, acts = timed_out()
    start = now = 2100
    rounds = [(now, sent(acts, m.VoteRequest))]  # (when, the pre-votes sent)
    for _ in range(1000):  # bounded: every tick is at the core's next deadline, later than the last
        if now - start >= span_ms and n.core.role == "prospective":
            break
        assert n.core.next_deadline_ms > now
        now = n.core.next_deadline_ms
        acts = n.step(a.Tick(now))
        assert n.core.epoch == 4 and not of(acts, a.PersistQuorumState)
        votes = sent(acts, m.VoteRequest)
        assert all(v.request.pre_vote and v.request.candidate_epoch == 5 for v in votes)
        if votes:
            rounds.append((now, votes))
    else:
        raise AssertionError("the loop did not reach its span")
    assert all(sorted(v.destination for v in votes) == [1, 2] for _, votes in rounds)
    gaps = [b - a_ for (a_, _), (b, _) in zip(rounds, rounds[1:])]
    assert len(rounds) >= span_ms // longest_round_ms and max(gaps) <= longest_round_ms, gaps
    # Pinned at the end: prospective, still in epoch 4 under leader 1, no vote cast.
    assert election_state(n) == ("prospective", 4, 1, -1)

    # The partition heals: leader 1 answers the latest round's pre-vote.
    to_1 = next(v for v in rounds[-1][1] if v.destination == 1)
    acts = answer(n, to_1, now + 1, granted=False, leader=1)
    assert election_state(n) == ("follower", 4, 1, -1)
    assert [f.destination for f in sent(acts, m.FetchRequest)] == [1] and not of(acts, a.PersistQuorumState)


def test_a_candidate_that_lost_asks_for_pre_votes_again_before_another_epoch():
    n, acts = timed_out()
    to_2 = next(s for s in sent(acts, m.VoteRequest) if s.destination == 2)
    acts = answer(n, to_2, 2200, granted=True)
    votes = sent(acts, m.VoteRequest)
    for v in votes:
        answer(n, v, 2201, granted=False)
    assert n.core.role == "candidate" and n.core.epoch == 5
    while n.core.role == "candidate":
        acts = n.step(a.Tick(n.core.next_deadline_ms))
    assert n.core.role == "prospective" and n.core.epoch == 5
    assert all(s.request.pre_vote and s.request.candidate_epoch == 6 for s in sent(acts, m.VoteRequest))
    assert not of(acts, a.PersistQuorumState)


def test_end_quorum_epoch_lets_followers_grant_the_successors_pre_vote_at_once():
    n, acts = following(node_id=2)
    fetched(n, acts, 100)
    assert not one_response(n.step(a.RequestReceived(200, "a", pre_vote(3, 5))), "a").vote_granted
    n.step(a.RequestReceived(300, "e", m.EndQuorumEpochRequest(cluster_id=CLUSTER, leader_id=1, leader_epoch=4,
                                                             preferred_successors=[3, 2])))
    assert one_response(n.step(a.RequestReceived(301, "b", pre_vote(3, 5))), "b").vote_granted


def test_a_leader_saying_it_no_longer_leads_lets_its_followers_grant_pre_votes():
    """A resigned (check-quorum) or restarted (KAFKA-10527) leader answers
    its followers' fetches NOT_LEADER_OR_FOLLOWER naming no leader in the
    epoch: they stop defending it at once."""
    n, acts = following()
    acts = fetched(n, acts, 100)
    (f,) = sent(n.step(a.Tick(n.core.next_deadline_ms)), m.FetchRequest) if not sent(acts) else sent(acts)
    n.step(a.ResponseReceived(200, f.request_id, 1, m.FetchResponse(
        error_code=Errors.NOT_LEADER_OR_FOLLOWER, current_leader=m.LeaderIdAndEpoch(-1, 4))))
    assert n.core.role == "follower"
    assert one_response(n.step(a.RequestReceived(201, "pv", pre_vote(2, 5))), "pv").vote_granted


def test_check_quorum_resigned_leader_cut_off_never_bumps_the_epoch():
    """Check-quorum and pre-vote together: a leader that a majority stopped
    fetching from resigns after 1.5 x fetch timeout; cut off, its pre-votes
    go unanswered and it stays in its epoch however long the cut lasts."""
    n = Node(1, fetch_timeout_ms=1000)
    now = make_leader(n)
    n.step(a.Tick(now + 1499))
    assert n.core.role == "leader"
    n.step(a.Tick(now + 1500))
    assert n.core.role == "resigned"
    t = now + 1500
    while t < now + 60000:
        t = n.core.next_deadline_ms
        acts = n.step(a.Tick(t))
        assert n.core.epoch == 1 and not of(acts, a.PersistQuorumState)
    assert n.core.role == "prospective"


def test_two_followers_timing_out_together_do_not_both_stand():
    """Followers of a vanished leader time out together and grant each
    other's pre-votes. The one that granted defers its candidacy by a random
    0..election_timeout/4, so the other's real VoteRequest finds it still
    prospective and it votes instead of splitting the vote."""
    n, acts = timed_out()
    to_2 = next(s for s in sent(acts, m.VoteRequest) if s.destination == 2)
    # Voter 2 is prospective too: we grant its pre-vote, it grants ours.
    assert one_response(n.step(a.RequestReceived(2101, "pv", pre_vote(2, 5))), "pv").vote_granted
    acts = answer(n, to_2, 2102, granted=True)
    assert n.core.role == "prospective" and not of(acts, a.PersistQuorumState)
    stand_at = n.core.next_deadline_ms
    assert 2102 <= stand_at <= 2102 + 1000 // 4
    # Voter 2's delay ended first: its real vote reaches us while we wait.
    r = one_response(n.step(a.RequestReceived(stand_at - 1 if stand_at > 2102 else 2102, "v", m.VoteRequest(
        cluster_id=CLUSTER, candidate_epoch=5, candidate_id=2, last_offset_epoch=-1, last_offset=0))), "v")
    assert r.vote_granted and n.core.role == "voted" and n.core.epoch == 5


def test_a_prospective_that_granted_nobody_stands_at_once():
    n, acts = timed_out()
    to_2 = next(s for s in sent(acts, m.VoteRequest) if s.destination == 2)
    answer(n, to_2, 2102, granted=True)
    assert n.core.role == "candidate"


def test_a_deferring_prospective_stands_when_its_delay_ends():
    n, acts = timed_out()
    to_2 = next(s for s in sent(acts, m.VoteRequest) if s.destination == 2)
    n.step(a.RequestReceived(2101, "pv", pre_vote(2, 5)))
    answer(n, to_2, 2102, granted=True)
    acts = n.step(a.Tick(n.core.next_deadline_ms))
    assert n.core.role == "candidate" and n.core.epoch == 5
    assert len([s for s in sent(acts, m.VoteRequest) if not s.request.pre_vote]) == 2


def test_a_deferring_prospective_quarantined_before_its_delay_ends_probes_once_and_waits():
    """SIM_SEED=339: a prospective that won its pre-votes and deferred its
    candidacy found corruption before the delay ended. Quarantined, it may not
    stand: it probes and postpones. Its passed stand time used to stay set, so
    the core polled it forever at the same instant (a busy loop)."""
    n, acts = timed_out()
    to_2 = next(s for s in sent(acts, m.VoteRequest) if s.destination == 2)
    n.step(a.RequestReceived(2101, "pv", pre_vote(2, 5)))
    answer(n, to_2, 2102, granted=True)
    stand_at = n.core.next_deadline_ms
    n.step(a.LogQuarantined(2102, log_end_offset=0, must_reach_offset=n.core.log_end_offset + 1))
    acts = n.step(a.Tick(stand_at))
    assert n.core.role == "prospective" and n.core.epoch == 4
    assert all(s.request.last_offset == -1 for s in sent(acts, m.VoteRequest))  # probes only
    assert n.core.next_deadline_ms > stand_at
    assert not sent(n.step(a.Tick(stand_at)), m.VoteRequest)


def test_a_pre_vote_from_a_voter_already_in_a_newer_epoch_moves_us_up_to_its_epoch():
    """SIM_SEED=1954 of 10,000: a voter that stood in epoch 6 and lost sat
    prospective there forever, asking pre-votes for 7 of voters that followed
    a leader of epoch 5 and refused (they heard from it); nobody ever told it
    about epoch 5's leader in a way it could follow. As Kafka does with the
    request's ReplicaEpoch, the voters move up to the epoch it is in (not
    the one it would stand in); an election in a newer epoch follows."""
    n, acts = following(epoch=5)
    fetched(n, acts, 100)
    acts = n.step(a.RequestReceived(200, "pv", pre_vote(2, 7)))
    r = one_response(acts, "pv")
    assert n.core.epoch == 6 and n.core.role == "unattached" and n.core.leader_id == -1
    assert r.leader_epoch == 6 and r.vote_granted  # its (empty) log is as up to date as ours
    assert of(acts, a.PersistQuorumState)[0].state.leader_epoch == 6


def test_a_prospective_whose_round_times_out_fetches_from_its_leader_in_that_same_step():
    """Found by a real-process test (a voter frozen while the leader removed
    it; the leader refused its pre-votes with an error, so the round could
    only time out): the prospective went back to following its known leader
    inside its own poll, and the new follower was never polled, so it sent no
    Fetch until its fetch timeout, stood again, and looped for good, its log
    end frozen. The Fetch must go out in the step that ends the round."""
    n, acts = timed_out()
    assert {s.destination for s in sent(acts, m.VoteRequest)} == {1, 2}
    # Nobody answers: the round's own timer ends it.
    now = n.core.next_deadline_ms
    acts = n.step(a.Tick(now))
    assert (n.core.role, n.core.epoch, n.core.leader_id) == ("follower", 4, 1)
    (f,) = sent(acts, m.FetchRequest)
    assert f.destination == 1 and f.request.current_leader_epoch == 4
    # And the fetch loop goes on: its answer brings the next Fetch.
    acts = fetched(n, acts, now + 10)
    assert sent(acts, m.FetchRequest)
