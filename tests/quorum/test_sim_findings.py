"""Regression tests for core bugs the deterministic simulator found (docs/sim-findings.md).

Each test replays, by hand, the smallest situation of one finding.
"""

from metalog.broker.quorum import api as a
from metalog.broker.quorum.outbox import RETRY_BACKOFF_MS
from metalog.protocol import messages as m

from tests.quorum.harness import CLUSTER, Node, append, make_leader, of, one_response, sent, stand


def snapshot_started_leader() -> Node:
    """Voter 1 whose log starts at snapshot 50-8 (history cut to [(8, 50)]),
    elected leader of epoch 9: LeaderChange at 50."""
    sid = m.SnapshotId(50, 8)
    n = Node(1, view=a.LogView(log_start_offset=50, log_end_offset=50, epochs=[(8, 50)], snapshots=[sid]),
             state=a.QuorumStateData(8, -1, -1, (1, 2, 3)))
    n.log.snapshots[sid] = b"snapshot"
    n.log.start = 50
    make_leader(n)
    assert (n.core.epoch, n.core.log_end_offset) == (9, 51)
    return n


def test_finding4_epoch_older_than_the_history_is_answered_with_the_log_start_snapshot():
    """SIM_SEED=4: the leader answered (11, 169) for an epoch its history had
    lost below the log start; the follower cut its log inside a batch."""
    n = snapshot_started_leader()
    resp = one_response(n.step(a.RequestReceived(5, "o", m.OffsetsForLeaderEpochRequest(
        cluster_id=CLUSTER, replica_id=2, current_leader_epoch=9, leader_epoch=6))), "o")
    assert (resp.leader_epoch, resp.end_offset) == (8, 50)
    # Epochs the history does know keep Kafka's answers.
    for asked, want in ((8, (8, 50)), (9, (9, 51))):
        resp = one_response(n.step(a.RequestReceived(5, "o", m.OffsetsForLeaderEpochRequest(
            cluster_id=CLUSTER, replica_id=2, current_leader_epoch=9, leader_epoch=asked))), "o")
        assert (resp.leader_epoch, resp.end_offset) == want


def test_finding4_follower_does_not_truncate_on_an_answer_newer_than_it_asked():
    """The follower holds epoch 6 up to 60 with HW 40; the leader's history starts
    at its snapshot 50-8. No truncation: the next Fetch (last epoch 6) is what
    gets the follower redirected to the snapshot."""
    n = Node(3, view=a.LogView(log_end_offset=60, epochs=[(1, 0), (6, 30)]),
             state=a.QuorumStateData(9, 1, -1, (1, 2, 3)))
    (req,) = sent(n.step(a.Tick(0)))
    assert isinstance(req.request, m.OffsetsForLeaderEpochRequest) and req.request.leader_epoch == 6
    acts = n.step(a.ResponseReceived(1, req.request_id, 1, m.OffsetsForLeaderEpochResponse(
        leader_epoch=8, end_offset=50, current_leader=m.LeaderIdAndEpoch(1, 9))))
    assert not of(acts, a.TruncateLog) and not of(acts, a.Fatal)
    assert n.core.log_end_offset == 60
    (f,) = sent(acts)
    assert isinstance(f.request, m.FetchRequest)
    assert (f.request.fetch_offset, f.request.last_fetched_epoch) == (60, 6)


def test_finding4_leader_redirects_that_fetch_to_its_snapshot():
    n = snapshot_started_leader()
    append(n, 5, 2)
    resp = one_response(n.step(a.RequestReceived(6, "f", m.FetchRequest(
        cluster_id=CLUSTER, replica_id=3, max_wait_ms=0, current_leader_epoch=9,
        fetch_offset=60, last_fetched_epoch=6))), "f")
    assert resp.snapshot_id == m.SnapshotId(50, 8) and resp.diverging_epoch is None


def test_lost_fetch_is_retried_before_the_fetch_timeout():
    """SIM_SEED=174 (2 % loss): the fetch request timeout was the 2 s request
    timeout, equal to the fetch timeout, so one lost Fetch or answer made the
    follower stand for election. A Fetch now gives up after max wait (500) +
    fetch timeout / 4; the retry lands inside the fetch timeout (at the
    defaults: gives up at 750 ms, retried at 800, inside 1000)."""
    n = Node(3, view=a.LogView(log_end_offset=0), state=a.QuorumStateData(4, 1, -1, (1, 2, 3)))
    cfg = n.core.config
    (f,) = sent(n.step(a.Tick(0)))
    gives_up = cfg.fetch_max_wait_ms + cfg.fetch_timeout_ms // 4
    assert isinstance(f.request, m.FetchRequest) and f.timeout_ms == gives_up
    # The driver reports the timeout; the core retries 50 ms later, still following.
    assert sent(n.step(a.RequestFailed(gives_up, f.request_id, 1, "timeout"))) == []
    (retry,) = sent(n.step(a.Tick(n.core.next_deadline_ms)))
    assert isinstance(retry.request, m.FetchRequest) and retry.destination == 1
    answered = gives_up + 100  # the retry went out 50 ms after giving up; its answer 50 ms later
    assert answered < cfg.fetch_timeout_ms
    acts = n.step(a.ResponseReceived(answered, retry.request_id, 1, m.FetchResponse(
        high_watermark=0, current_leader=m.LeaderIdAndEpoch(1, 4))))
    assert n.core.role == "follower" and not sent(acts, m.VoteRequest)
    n.step(a.Tick(answered + cfg.fetch_timeout_ms - 1))
    assert n.core.role == "follower"  # the fetch timeout counts from the retry's answer


def test_request_timeouts_by_kind():
    """Epoch checks and snapshot chunks get fetch timeout / 4; votes and
    pre-votes election timeout / 4 (an unanswered one is asked again within
    the round, see test_an_unanswered_vote_is_asked_again_within_the_round)."""
    n = Node(3, view=a.LogView(log_end_offset=5, epochs=[(1, 0)]), state=a.QuorumStateData(4, 1, -1, (1, 2, 3)))
    cfg = n.core.config
    (check,) = sent(n.step(a.Tick(0)))
    assert isinstance(check.request, m.OffsetsForLeaderEpochRequest)
    assert check.timeout_ms == cfg.fetch_timeout_ms // 4 == 250
    votes = sent(n.step(a.Tick(5000)), m.VoteRequest)
    assert votes and all(v.timeout_ms == cfg.election_timeout_ms // 4 == 250 for v in votes)


def test_an_unanswered_vote_is_asked_again_within_the_round():
    """Sim seed 20251: one lost VoteRequest cost the candidate its whole
    election timeout. A (pre-)vote that fails is asked again RETRY_BACKOFF_MS
    later, of that voter only, while the round lasts; an answered voter is
    never asked again, and a stale failure (an older ask) changes nothing."""
    n = Node(3, view=a.LogView(log_end_offset=5, epochs=[(1, 0)]), state=a.QuorumStateData(4, 1, -1, (1, 2, 3)))
    n.step(a.Tick(0))
    pre = sent(n.step(a.Tick(5000)), m.VoteRequest)
    assert n.core.role == "prospective" and {p.destination for p in pre} == {1, 2}
    to1 = next(p for p in pre if p.destination == 1)
    to2 = next(p for p in pre if p.destination == 2)
    # Voter 1 refuses (it still hears the leader); the ask to 2 times out.
    n.step(a.ResponseReceived(5010, to1.request_id, 1, m.VoteResponse(leader_id=-1, leader_epoch=4,
                                                                       vote_granted=False)))
    assert sent(n.step(a.RequestFailed(5250, to2.request_id, 2, "timeout")), m.VoteRequest) == []
    again = sent(n.step(a.Tick(5250 + RETRY_BACKOFF_MS)), m.VoteRequest)
    assert [(v.destination, v.request.pre_vote) for v in again] == [(2, True)]
    # The old ask's failure, arriving late, does not trigger another one.
    n.step(a.RequestFailed(5400, to2.request_id, 2, "timeout"))
    assert sent(n.step(a.Tick(5400 + RETRY_BACKOFF_MS)), m.VoteRequest) == []
    # Voter 2 grants: a majority of pre-votes, a real candidacy in epoch 5.
    acts = n.step(a.ResponseReceived(5420, again[0].request_id, 2, m.VoteResponse(
        leader_id=-1, leader_epoch=4, vote_granted=True)))
    assert n.core.role == "candidate" and n.core.epoch == 5
    real = sent(acts, m.VoteRequest)
    assert {v.destination for v in real} == {1, 2} and not any(v.request.pre_vote for v in real)
    # A real vote lost on its way to 1 is asked again too.
    to1 = next(v for v in real if v.destination == 1)
    n.step(a.RequestFailed(5600, to1.request_id, 1, "connection refused"))
    again = sent(n.step(a.Tick(5600 + RETRY_BACKOFF_MS)), m.VoteRequest)
    assert [(v.destination, v.request.candidate_epoch, v.request.pre_vote) for v in again] == [(1, 5, False)]


def following_node(seed: int = 0) -> tuple[Node, a.SendRequest]:
    n = Node(3, view=a.LogView(log_end_offset=0), state=a.QuorumStateData(4, 1, -1, (1, 2, 3)), seed=seed)
    (f,) = sent(n.step(a.Tick(0)))
    return n, f


def test_leader_connection_refused_starts_an_election_after_a_short_random_delay():
    """Failover: a refused or reset connection means the leader's process is
    gone. The follower stands 100-500 ms later (election timeout / 10 .. / 2)
    instead of after the 2 s fetch timeout."""
    waits = set()
    for seed in range(20):
        n, f = following_node(seed)
        n.step(a.RequestFailed(10, f.request_id, 1, "ConnectionLost: cannot connect to 1: "
                                                   "ConnectionRefusedError(111, 'Connect call failed')"))
        now = 10
        while n.core.role == "follower":
            now = n.core.next_deadline_ms
            acts = n.step(a.Tick(now))
            for s in sent(acts, m.FetchRequest):  # retries keep being refused
                n.step(a.RequestFailed(now, s.request_id, 1, "connection refused"))
        assert n.core.role == "prospective" and n.core.epoch == 4  # asks for pre-votes first
        waits.add(now)
    assert min(waits) >= 10 + 100 and max(waits) <= 10 + 500
    assert len(waits) > 5  # randomized: followers that notice together rarely stand together


def test_a_timeout_is_not_proof_of_a_crash_and_keeps_the_fetch_timeout():
    n, f = following_node()
    t = n.core.config.fetch_timeout_ms
    n.step(a.RequestFailed(t // 2, f.request_id, 1, "timeout"))
    n.step(a.Tick(t - 1))
    assert n.core.role == "follower"
    n.step(a.Tick(t))
    assert n.core.role == "prospective"


def test_a_transient_reset_is_forgotten_once_the_leader_answers():
    n, f = following_node()
    n.step(a.RequestFailed(10, f.request_id, 1, "connection reset by peer"))
    (retry,) = sent(n.step(a.Tick(60)))
    n.step(a.ResponseReceived(70, retry.request_id, 1, m.FetchResponse(
        high_watermark=0, current_leader=m.LeaderIdAndEpoch(1, 4))))
    t = n.core.config.fetch_timeout_ms
    n.step(a.Tick(70 + t - 1))  # well past the 100-500 ms a reset would have allowed
    assert n.core.role == "follower"
    assert n.core.next_deadline_ms == 70 + t  # the full fetch timeout again


def test_lost_begin_quorum_epoch_is_resent_within_half_the_election_timeout():
    """SIM_SEED=6059 of 10,000 (2 % loss): a lost BeginQuorumEpoch was re-sent
    after the 2 s request timeout; the voter, which learns the leader only from
    it, stood first (its election timer is 1-2 s) and deposed the leader."""
    n = Node(1)
    n.step(a.Tick(0))
    now = n.core.next_deadline_ms
    votes = sent(stand(n, now), m.VoteRequest)
    begins = []
    for v in votes:  # the first grant makes us leader; Begin goes to both others
        begins += sent(n.step(a.ResponseReceived(now, v.request_id, v.destination, m.VoteResponse(
            leader_id=-1, leader_epoch=n.core.epoch, vote_granted=True))), m.BeginQuorumEpochRequest)
    assert n.core.role == "leader"
    assert sorted(b.destination for b in begins) == [2, 3]
    assert all(b.timeout_ms == 500 for b in begins)
