"""KIP-853 item 1: a replica is (node id, directory id).

With a voter set that knows the voters' directory ids (kraft version 1), a
voter whose data dir was wiped (a new directory id) is not that voter any
more: it cannot vote or stand with its old identity, a Vote or
BeginQuorumEpoch meant for its old directory is refused with
INVALID_VOTER_KEY, and the leader does not count its fetches toward the high
watermark; it replicates as an observer. With static voters (kraft version
0) directory ids are unknown and not checked, as in Kafka."""

from __future__ import annotations

from metalog.broker.quorum import api as a
from metalog.broker.quorum.voters import VoterSet
from metalog.protocol import messages as m
from metalog.protocol.errors import Errors
from tests.quorum.harness import CLUSTER, Node, append, fetch, make_leader, of, one_response, sent, stand

D1, D2, D3 = "AAAAAAAAAAAAAAAAAAAAAg", "AAAAAAAAAAAAAAAAAAAAAw", "AAAAAAAAAAAAAAAAAAAABA"
WIPED = "zzzzzzzzzzzzzzzzzzzzzw"  # node 3's directory id after its disk was wiped
DYNAMIC = VoterSet({1: D1, 2: D2, 3: D3}, kraft_version=1)


def node(node_id: int, directory_id: str, voter_set: VoterSet | None = DYNAMIC, **kw) -> Node:
    return Node(node_id, view=a.LogView(voter_set=voter_set), directory_id=directory_id, **kw)


def vote(candidate: int, candidate_dir: str, voter: int, voter_dir: str, epoch: int = 1,
         pre_vote: bool = False) -> m.VoteRequest:
    return m.VoteRequest(cluster_id=CLUSTER, candidate_epoch=epoch, candidate_id=candidate,
                         last_offset_epoch=0, last_offset=0, pre_vote=pre_vote,
                         candidate_directory_id=candidate_dir, voter_id=voter, voter_directory_id=voter_dir)


def test_requests_carry_both_replicas_keys():
    """Pre-votes, votes and BeginQuorumEpoch name the voter they are for
    (id and directory id); Fetch names the fetching replica's directory."""
    c = node(1, D1)
    c.step(a.Tick(0))
    now = c.core.next_deadline_ms
    acts = c.step(a.Tick(now))
    pre = sent(acts, m.VoteRequest)
    assert {(s.destination, s.request.voter_id, s.request.voter_directory_id, s.request.candidate_directory_id,
             s.request.pre_vote) for s in pre} == {(2, 2, D2, D1, True), (3, 3, D3, D1, True)}
    acts = stand(c, now, acts)
    votes = sent(acts, m.VoteRequest)
    assert {(s.destination, s.request.voter_id, s.request.voter_directory_id, s.request.candidate_directory_id,
             s.request.pre_vote) for s in votes} == {(2, 2, D2, D1, False), (3, 3, D3, D1, False)}
    acts = c.step(a.ResponseReceived(now, votes[0].request_id, votes[0].destination, m.VoteResponse(
        leader_id=-1, leader_epoch=c.core.epoch, vote_granted=True)))
    assert c.core.role == "leader"
    begins = sent(acts, m.BeginQuorumEpochRequest)
    assert {(s.destination, s.request.voter_id, s.request.voter_directory_id) for s in begins} == {
        (2, 2, D2), (3, 3, D3)}
    f = node(2, D2)
    acts = f.step(a.RequestReceived(0, "b", m.BeginQuorumEpochRequest(
        cluster_id=CLUSTER, leader_id=1, leader_epoch=1, voter_id=2, voter_directory_id=D2)))
    assert one_response(acts, "b").error_code == Errors.NONE and f.core.leader_id == 1
    fetches = sent(acts + f.step(a.Tick(1)), m.FetchRequest)
    assert fetches and all(s.request.replica_directory_id == D2 for s in fetches)


def test_wiped_voter_is_an_observer_and_refuses_votes_meant_for_its_old_directory():
    """Node 3 after a wipe (new directory id): not a voter, never stands; a
    Vote or BeginQuorumEpoch addressed to (3, old directory) gets
    INVALID_VOTER_KEY and changes nothing on disk."""
    w = node(3, WIPED)
    assert not w.core.is_voter and w.core.role == "observer"
    acts = w.step(a.Tick(0))
    for t in (5_000, 10_000, 20_000):
        acts += w.step(a.Tick(t))
    assert not [s for s in sent(acts, m.VoteRequest)], "an observer never asks for votes"
    for req in (vote(1, D1, 3, D3, epoch=2), vote(1, D1, 3, D3, epoch=2, pre_vote=True)):
        acts = w.step(a.RequestReceived(30_000, "v", req))
        resp = one_response(acts, "v")
        assert resp.error_code == Errors.INVALID_VOTER_KEY and not resp.vote_granted
        assert not of(acts, a.PersistQuorumState)
    acts = w.step(a.RequestReceived(30_000, "b", m.BeginQuorumEpochRequest(
        cluster_id=CLUSTER, leader_id=1, leader_epoch=2, voter_id=3, voter_directory_id=D3)))
    assert one_response(acts, "b").error_code == Errors.INVALID_VOTER_KEY
    assert w.core.epoch == 0 and not of(acts, a.PersistQuorumState)
    # The voter it was, on its own old directory, would have granted that vote.
    old = node(3, D3)
    acts = old.step(a.RequestReceived(0, "v", vote(1, D1, 3, D3)))
    assert one_response(acts, "v").vote_granted


def test_voters_refuse_a_candidate_standing_with_a_wiped_directory():
    """A Vote from (3, new directory) is not from voter 3: INCONSISTENT_VOTER_SET,
    nothing persisted; the same request from (3, its directory) is granted."""
    v = node(2, D2)
    acts = v.step(a.RequestReceived(0, "v", vote(3, WIPED, 2, D2)))
    resp = one_response(acts, "v")
    assert resp.error_code == Errors.INCONSISTENT_VOTER_SET and not resp.vote_granted
    assert not of(acts, a.PersistQuorumState) and v.core.voted_id == -1
    acts = v.step(a.RequestReceived(0, "v2", vote(3, D3, 2, D2)))
    assert one_response(acts, "v2").vote_granted and v.core.voted_id == 3


def test_leader_counts_a_fetch_for_the_hw_only_from_the_voters_own_directory():
    n = node(1, D1)
    now = make_leader(n)
    end = n.core.log_end_offset
    epoch = n.core.epoch
    append(n, now, 3)
    n.step(a.FlushCompleted(now, n.core.log_end_offset))
    leo = n.core.log_end_offset
    hw_before = n.core.high_watermark
    # The wiped node 3 has everything: it still does not make a majority with us.
    fetch(n, now + 1, 3, leo, epoch, directory_id=WIPED)
    assert n.core.high_watermark == hw_before
    d = n.core.describe_quorum(now + 1)
    assert [(r.replica_id, r.replica_directory_id, r.log_end_offset) for r in d.observers] == [(3, WIPED, leo)]
    voter3 = next(r for r in d.voters if r.replica_id == 3)
    assert voter3.replica_directory_id == D3 and voter3.log_end_offset == -1
    assert next(r for r in d.voters if r.replica_id == 1).replica_directory_id == D1
    # A fetch that does not say its directory (an older build) is not voter 3 either.
    fetch(n, now + 2, 3, leo, epoch)
    assert n.core.high_watermark == hw_before
    # Voter 2 from its own directory does.
    fetch(n, now + 3, 2, leo, epoch, directory_id=D2)
    assert n.core.high_watermark == leo > end


def test_static_voters_do_not_check_directory_ids():
    """Kraft version 0: any directory of a listed node is that voter (as Kafka);
    the leader remembers the directory each voter fetches with."""
    n = node(1, D1, voter_set=None)
    assert n.core.voter_set.kraft_version == 0
    now = make_leader(n)
    epoch = n.core.epoch
    append(n, now, 2)
    n.step(a.FlushCompleted(now, n.core.log_end_offset))
    leo = n.core.log_end_offset
    fetch(n, now + 1, 3, leo, epoch, directory_id=WIPED)
    assert n.core.high_watermark == leo
    d = n.core.describe_quorum(now + 1)
    assert next(r for r in d.voters if r.replica_id == 3).replica_directory_id == WIPED and not d.observers
    v = node(2, D2, voter_set=None)
    acts = v.step(a.RequestReceived(0, "v", vote(3, WIPED, 2, "")))
    assert one_response(acts, "v").vote_granted


def test_a_wiped_voter_looking_for_the_leader_never_asks_itself():
    """Its node id is still in the voter set, but it asks the other voters."""
    w = node(3, WIPED)
    dests = set()
    for t in range(0, 40_000, 500):
        for s in sent(w.step(a.Tick(t)), m.FetchRequest):
            dests.add(s.destination)
            w.step(a.RequestFailed(t, s.request_id, s.destination, "refused"))
    assert dests == {1, 2}
