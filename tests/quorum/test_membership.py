"""KIP-853 item 4 in the core: AddRaftVoter, RemoveRaftVoter, UpdateRaftVoter.

Every rule and every error the leader answers with: one change at a time
(an uncommitted VotersRecord answers REQUEST_TIMED_OUT), the leader must
first commit a record of its epoch, a new voter must be a caught-up observer
fetching with that very directory id, DUPLICATE_VOTER, VOTER_NOT_FOUND,
INVALID_REQUEST, UNSUPPORTED_VERSION with static voters; the answer waits
for the commit; a removed leader keeps leading until the change commits,
then steps down; a follower whose uncommitted change is truncated goes back
to the old set."""

from __future__ import annotations

import dataclasses

from metalog.broker.quorum import api as a
from metalog.broker.quorum.voters import VoterSet, voter_sets_in
from metalog.protocol import messages as m
from metalog.protocol.errors import Errors
from tests.quorum.harness import CLUSTER, MemLog, Node, fetch, grant_pre_votes, make_leader, one_response, responses

D = {1: "AAAAAAAAAAAAAAAAAAAAAg", 2: "AAAAAAAAAAAAAAAAAAAAAw", 3: "AAAAAAAAAAAAAAAAAAAABA",
     4: "AAAAAAAAAAAAAAAAAAAABQ"}
WIPED3 = "zzzzzzzzzzzzzzzzzzzzzw"
EP = {i: (("CONTROLLER", "127.0.0.1", 9090 + i),) for i in range(1, 5)}


def dynamic(ids) -> VoterSet:
    return VoterSet({i: D[i] for i in ids}, kraft_version=1, endpoints={i: EP[i] for i in ids})


def listeners(i: int, port: int | None = None) -> list[m.RaftListener]:
    return [m.RaftListener("CONTROLLER", "127.0.0.1", port or 9090 + i)]


def add(i: int, directory_id: str | None = None, **kw) -> m.AddRaftVoterRequest:
    kw.setdefault("listeners", listeners(i))
    return m.AddRaftVoterRequest(cluster_id=CLUSTER, voter_id=i, voter_directory_id=D[i] if directory_id is None else directory_id, **kw)


def remove(i: int, directory_id: str | None = None, **kw) -> m.RemoveRaftVoterRequest:
    return m.RemoveRaftVoterRequest(cluster_id=CLUSTER, voter_id=i, voter_directory_id=D[i] if directory_id is None else directory_id, **kw)


def leader(voters=(1, 2, 3), node_id: int = 1) -> tuple[Node, int]:
    """node_id leading a dynamic set, the LeaderChange of its epoch committed
    (voter 2 fetched to the end)."""
    n = Node(node_id, voters=voters, view=a.LogView(voter_set=dynamic(voters)), directory_id=D[node_id])
    now = make_leader(n)
    catch_up(n, now, [v for v in voters if v != node_id][: len(voters) // 2])
    assert n.core.high_watermark == n.core.log_end_offset > 0
    return n, now


def catch_up(n: Node, now: int, ids, directory_ids: dict | None = None) -> list:
    acts = []
    for i in ids:
        acts += fetch(n, now, i, n.core.log_end_offset, n.core.epoch,
                      directory_id=(directory_ids or D).get(i, D.get(i)), token=("f", i))
    return acts


def ask(n: Node, now: int, req: m.Body, token="v") -> list:
    return n.step(a.RequestReceived(now, token, req))


def refused(n: Node, now: int, req: m.Body) -> tuple[int, str]:
    end = n.core.log_end_offset
    resp = one_response(ask(n, now, req), "v")
    assert n.core.log_end_offset == end, "a refused change appends nothing"
    return resp.error_code, resp.error_message


def test_add_voter_waits_for_the_commit_then_the_new_voter_counts():
    n, now = leader()
    catch_up(n, now, [4])  # node 4 fetches as an observer, caught up
    acts = ask(n, now + 1, add(4))
    assert responses(acts, "v") == [], "answered only once the VotersRecord is committed"
    assert n.core.voters == (1, 2, 3, 4), "the new set counts from the moment it is appended"
    (_, first), (at, vs) = voter_sets_in(n.log.read(0, n.core.log_end_offset, 1 << 20))
    assert first == dynamic((1, 2, 3)), "the first leader put the bootstrap set in the log"
    assert vs == dynamic((1, 2, 3, 4)) and vs.endpoints[4] == EP[4]
    n.step(a.FlushCompleted(now + 1, n.core.log_end_offset))
    # Leader + voter 2 are no majority of four any more: it takes a third.
    acts = catch_up(n, now + 2, [2])
    assert n.core.high_watermark <= at and responses(acts, "v") == []
    acts = catch_up(n, now + 3, [4])
    assert n.core.high_watermark == at + 1
    assert one_response(acts, "v") == m.AddRaftVoterResponse(error_code=Errors.NONE)
    assert {r.replica_id for r in n.core.describe_quorum(now + 3).voters} == {1, 2, 3, 4}


def test_one_change_at_a_time():
    """An uncommitted VotersRecord blocks the next change: REQUEST_TIMED_OUT, nothing appended."""
    n, now = leader()
    catch_up(n, now, [4])
    ask(n, now + 1, remove(3), token="first")
    code, msg = refused(n, now + 1, add(4))
    assert code == Errors.REQUEST_TIMED_OUT and "another voter change is in progress" in msg


def test_leader_must_commit_a_record_of_its_epoch_first():
    n = Node(1, view=a.LogView(voter_set=dynamic((1, 2, 3))), directory_id=D[1])
    now = make_leader(n)  # LeaderChange appended and flushed, not committed
    code, msg = refused(n, now, remove(3))
    assert code == Errors.REQUEST_TIMED_OUT and "has not committed a record of its epoch" in msg


def test_new_voter_must_be_a_caught_up_observer_with_that_directory():
    n, now = leader()
    code, msg = refused(n, now, add(4))
    assert code == Errors.REQUEST_TIMED_OUT and "is not fetching from the leader" in msg
    fetch(n, now, 4, n.core.log_end_offset, n.core.epoch, directory_id=WIPED3)  # another directory
    code, msg = refused(n, now, add(4))
    assert code == Errors.REQUEST_TIMED_OUT and "is not fetching" in msg
    fetch(n, now, 4, 0, 0, directory_id=D[4])  # fetching, from offset 0
    code, msg = refused(n, now, add(4))
    assert code == Errors.REQUEST_TIMED_OUT and "is not caught up" in msg
    # Long silent: not fetching any more.
    catch_up(n, now, [4])
    code, msg = refused(n, now + n.core.config.fetch_timeout_ms + 1, add(4))
    assert code == Errors.REQUEST_TIMED_OUT and "is not fetching" in msg


def test_duplicate_voter_and_voter_not_found():
    n, now = leader()
    catch_up(n, now, [3], {3: WIPED3})  # the wiped node 3 fetches with its new directory
    code, msg = refused(n, now, add(3, WIPED3))
    assert code == Errors.DUPLICATE_VOTER and "node 3 is already a voter" in msg
    code, msg = refused(n, now, remove(3, WIPED3))
    assert code == Errors.VOTER_NOT_FOUND and "is not a voter (its directory id is" in msg
    code, msg = refused(n, now, remove(4))
    assert code == Errors.VOTER_NOT_FOUND and "no such node id" in msg
    upd = m.UpdateRaftVoterRequest(cluster_id=CLUSTER, current_leader_epoch=n.core.epoch, voter_id=4,
                                   voter_directory_id=D[4], listeners=listeners(4))
    code, _ = refused(n, now, upd)
    assert code == Errors.VOTER_NOT_FOUND


def test_invalid_requests():
    n, now = leader()
    catch_up(n, now, [4])
    assert refused(n, now, add(4, listeners=[]))[0] == Errors.INVALID_REQUEST
    assert refused(n, now, add(4, listeners=[m.RaftListener("CONTROLLER", "h", 0)]))[0] == Errors.INVALID_REQUEST
    code, msg = refused(n, now, add(4, m.NO_DIRECTORY_ID))
    assert code == Errors.INVALID_REQUEST and "directory id" in msg
    solo, t = Node(1, voters=(1,), view=a.LogView(voter_set=dynamic((1,))), directory_id=D[1]), 0
    solo.step(a.Tick(t))  # a single voter elects itself at once
    assert solo.core.role == "leader"
    solo.step(a.FlushCompleted(t, solo.core.log_end_offset))
    code, msg = refused(solo, t, remove(1))
    assert code == Errors.INVALID_REQUEST and "only voter" in msg


def test_static_voters_cannot_change():
    n = Node(1)  # kraft version 0
    now = make_leader(n)
    fetch(n, now, 2, n.core.log_end_offset, n.core.epoch)
    code, msg = refused(n, now, remove(3))
    assert code == Errors.UNSUPPORTED_VERSION and "kraft.version 0" in msg


def test_not_the_leader():
    n = Node(2, view=a.LogView(voter_set=dynamic((1, 2, 3))), directory_id=D[2])
    n.step(a.Tick(0))
    code, msg = refused(n, 0, add(4))
    assert code == Errors.NOT_LEADER_OR_FOLLOWER and "is not the leader" in msg


def test_update_voter_changes_endpoints_and_is_fenced():
    n, now = leader()
    upd = m.UpdateRaftVoterRequest(cluster_id=CLUSTER, current_leader_epoch=n.core.epoch - 1, voter_id=2,
                                   voter_directory_id=D[2], listeners=listeners(2, 7000))
    assert refused(n, now, upd)[0] == Errors.FENCED_LEADER_EPOCH
    same = m.UpdateRaftVoterRequest(cluster_id=CLUSTER, current_leader_epoch=n.core.epoch, voter_id=2,
                                    voter_directory_id=D[2], listeners=listeners(2))
    assert refused(n, now, same)[0] == Errors.NONE, "nothing to change: answered at once"
    new = m.UpdateRaftVoterRequest(cluster_id=CLUSTER, current_leader_epoch=n.core.epoch, voter_id=2,
                                   voter_directory_id=D[2], listeners=listeners(2, 7000))
    ask(n, now, new)
    assert n.core.voter_set.endpoints[2] == (("CONTROLLER", "127.0.0.1", 7000),)
    n.step(a.FlushCompleted(now, n.core.log_end_offset))
    resp = one_response(catch_up(n, now + 1, [2]), "v")
    assert resp.error_code == Errors.NONE and resp.current_leader == m.LeaderIdAndEpoch(1, n.core.epoch)


def test_update_voter_checks_and_records_the_supported_kraft_versions():
    """Kafka's UpdateVoterHandler: a range that does not include the
    finalized kraft.version (1 here) is INVALID_REQUEST naming both, as is a
    range whose min is above its max; nothing is appended. A new range with
    the same endpoints is a change: the VotersRecord carries it, and an
    update naming it again changes nothing."""
    n, now = leader()

    def upd(lo: int, hi: int, port: int | None = None) -> m.UpdateRaftVoterRequest:
        return m.UpdateRaftVoterRequest(cluster_id=CLUSTER, current_leader_epoch=n.core.epoch, voter_id=2,
                                        voter_directory_id=D[2], listeners=listeners(2, port),
                                        kraft_version_min=lo, kraft_version_max=hi)

    code, msg = refused(n, now, upd(0, 0, 7000))
    assert code == Errors.INVALID_REQUEST
    assert msg == ("voter 2 supports kraft.version 0..0, which does not include the cluster's finalized "
                   "kraft.version 1")
    code, msg = refused(n, now, upd(2, 1))
    assert (code, msg) == (Errors.INVALID_REQUEST, "voter 2: bad supported kraft.version range 2..1")
    assert n.core.voter_set.endpoints[2] == EP[2], "a refused update changes nothing"
    assert refused(n, now, upd(0, 1))[0] == Errors.NONE, "the range on record, same endpoints"
    ask(n, now, upd(1, 3))
    assert n.core.voter_set.kraft_range_of(2) == (1, 3)
    n.step(a.FlushCompleted(now, n.core.log_end_offset))
    assert one_response(catch_up(n, now + 1, [2]), "v").error_code == Errors.NONE
    [(_, vs)] = voter_sets_in(n.log.read(0, n.core.log_end_offset, 1 << 30))[-1:]
    assert vs.kraft_range_of(2) == (1, 3) and vs.kraft_range_of(1) == (0, 1)
    assert refused(n, now + 2, upd(1, 3))[0] == Errors.NONE


def test_update_voter_with_static_voters_checks_the_range_against_version_0():
    n = Node(1)  # kraft version 0
    now = make_leader(n)
    fetch(n, now, 2, n.core.log_end_offset, n.core.epoch)
    upd = m.UpdateRaftVoterRequest(cluster_id=CLUSTER, current_leader_epoch=n.core.epoch, voter_id=2,
                                   voter_directory_id=D[2], listeners=listeners(2),
                                   kraft_version_min=1, kraft_version_max=1)
    code, msg = refused(n, now, upd)
    assert code == Errors.INVALID_REQUEST and "does not include the cluster's finalized kraft.version 0" in msg


def test_change_times_out_and_leadership_loss_answers():
    n, now = leader()
    ask(n, now, remove(3, timeout_ms=500))
    acts = n.step(a.Tick(now + 500))
    resp = one_response(acts, "v")
    assert resp.error_code == Errors.REQUEST_TIMED_OUT and "not committed in time" in resp.error_message
    n2, now2 = leader()
    ask(n2, now2, remove(3))
    acts = n2.step(a.RequestReceived(now2 + 1, "b", m.BeginQuorumEpochRequest(
        cluster_id=CLUSTER, leader_id=2, leader_epoch=n2.core.epoch + 1, voter_id=1, voter_directory_id=D[1])))
    assert one_response(acts, "v").error_code == Errors.NOT_LEADER_OR_FOLLOWER


def test_removed_leader_leads_until_the_change_commits_then_steps_down():
    n, now = leader()
    acts = ask(n, now, remove(1))
    at = n.core.log_end_offset - 1
    assert n.core.role == "leader" and not n.core.is_voter and n.core.voters == (2, 3)
    n.step(a.FlushCompleted(now, n.core.log_end_offset))
    # Our own log no longer counts: voter 2 alone is no majority of {2, 3}.
    acts = catch_up(n, now + 1, [2])
    assert n.core.high_watermark <= at and n.core.role == "leader"
    acts = catch_up(n, now + 2, [3])
    assert one_response(acts, "v").error_code == Errors.NONE
    assert n.core.role == "observer" and n.core.leader_id == -1
    assert [p.state for p in acts if isinstance(p, a.PersistQuorumState)][-1].leader_id == -1


def test_a_truncated_uncommitted_change_is_reverted_on_a_follower():
    """Follower 2 fetched leader 1's uncommitted RemoveRaftVoter(3); leader 3
    of the next epoch never had it: 2 truncates and 3 is a voter again."""
    lead, now = leader()
    ask(lead, now, remove(3))
    log = lead.log.read(0, lead.core.log_end_offset, 1 << 20)
    f = Node(2, view=a.LogView(voter_set=dynamic((1, 2, 3))), directory_id=D[2], log=MemLog())
    f.step(a.Tick(0))
    acts = f.step(a.RequestReceived(0, "b", m.BeginQuorumEpochRequest(
        cluster_id=CLUSTER, leader_id=1, leader_epoch=lead.core.epoch, voter_id=2, voter_directory_id=D[2])))
    (req,) = [x for x in acts if isinstance(x, a.SendRequest)]
    f.step(a.ResponseReceived(1, req.request_id, 1, m.FetchResponse(high_watermark=0, records=log)))
    assert f.core.voters == (1, 2)
    f.step(a.FlushCompleted(1, f.core.log_end_offset))
    acts = f.step(a.RequestReceived(2, "b2", m.BeginQuorumEpochRequest(
        cluster_id=CLUSTER, leader_id=3, leader_epoch=lead.core.epoch + 1, voter_id=2, voter_directory_id=D[2])))
    req = [x for x in acts if isinstance(x, a.SendRequest)][0]
    end_before = lead.core.log_end_offset - 1  # the VotersRecord's offset
    if isinstance(req.request, m.OffsetsForLeaderEpochRequest):
        resp = m.OffsetsForLeaderEpochResponse(leader_epoch=lead.core.epoch, end_offset=end_before)
    else:
        resp = m.FetchResponse(high_watermark=0, diverging_epoch=m.EpochEndOffset(lead.core.epoch, end_before))
    acts = f.step(a.ResponseReceived(3, req.request_id, 3, resp))
    assert a.TruncateLog(end_before) in acts
    assert f.core.voters == (1, 2, 3) and f.core.is_voter


def test_first_leader_of_a_formatted_cluster_writes_the_bootstrap_set_into_the_log():
    """Kafka's first leader appends KRaftVersionRecord(1) + VotersRecord in its
    first epoch; a later leader (the set already in its log) does not."""
    from metalog.storage import control_records as cr
    from metalog.storage.batch import decode_records, iter_batches
    n, now = leader()
    data = n.log.read(0, n.core.log_end_offset, 1 << 20)
    controls = [cr.decode_control(bytes(v)) for pos, h in iter_batches(data) if h.is_control
                for v in decode_records(data[pos:pos + h.size], h)]
    assert [type(c).__name__ for c in controls] == ["LeaderChange", "KRaftVersionRecord", "VotersRecord"]
    assert controls[1] == cr.KRaftVersionRecord(1)
    assert n.core.log.voters.entries == [(2, dynamic((1, 2, 3)))]


def test_a_dynamic_node_without_a_voter_set_never_falls_back_to_static_voters():
    """A wiped dir in a dynamic cluster (voters_are_bootstrap, no bootstrap
    checkpoint, empty log): the config's ids are whom to ask, not voters. It is
    an observer, refuses votes, never stands; the log's set makes it a voter."""
    n = Node(3, directory_id=WIPED3, voters_are_bootstrap=True)
    acts = n.step(a.Tick(0))
    assert n.core.role == "observer" and not n.core.is_voter
    # A Vote that does not name it by its own key (no directory id: an older
    # peer, or one asking node 3 without knowing which replica) gets no vote.
    vote = m.VoteRequest(cluster_id=CLUSTER, candidate_epoch=1, candidate_id=1, last_offset_epoch=0,
                         last_offset=0, candidate_directory_id=D[1], voter_id=3,
                         voter_directory_id=m.NO_DIRECTORY_ID)
    resp = one_response(n.step(a.RequestReceived(1, "vote", vote)), "vote")
    assert resp.error_code == Errors.NONE and not resp.vote_granted and n.core.voted_id == -1
    for t in range(0, 30_000, 500):
        n.step(a.Tick(t))
        assert n.core.role == "observer", "it never stands"
    # The leader's log has a set naming node 3 with the new directory: now a voter.
    lead, now = leader()
    ids = {1: D[1], 2: D[2], 3: WIPED3}
    vs = VoterSet(ids, kraft_version=1, endpoints={i: EP[i] for i in ids})
    from metalog.broker.quorum.voters import voters_record
    from metalog.storage.batch import encode_batch
    from metalog.storage.control_records import encode_control
    data = lead.log.read(0, lead.core.log_end_offset, 1 << 20) + encode_batch(
        lead.core.log_end_offset, lead.core.epoch, [encode_control(voters_record(vs))], 0, is_control=True)
    acts = n.step(a.RequestReceived(30_000, "b", m.BeginQuorumEpochRequest(
        cluster_id=CLUSTER, leader_id=1, leader_epoch=lead.core.epoch, voter_id=3, voter_directory_id=WIPED3)))
    req = [x for x in acts if isinstance(x, a.SendRequest) and isinstance(x.request, m.FetchRequest)][-1]
    n.step(a.ResponseReceived(30_001, req.request_id, 1, m.FetchResponse(high_watermark=0, records=data)))
    assert n.core.voters == (1, 2, 3) and n.core.is_voter and n.core.role == "follower"


def test_a_quarantined_node_keeps_its_quarantine_when_a_cut_leaves_it_outside_the_set():
    """Sim seed 208: a voter added by a VotersRecord lost that part of its log
    (corruption, quarantine cut below the record): with the log's set it is no
    voter for now, but replicating the record back makes it one again -- so it
    must keep abstaining until it re-replicated what it had acknowledged."""
    n = Node(4, view=a.LogView(voter_set=dynamic((1, 2, 3)), log_end_offset=3, epochs=[(1, 0)],
                               must_reach_offset=57), directory_id=D[4], voters_are_bootstrap=True)
    n.step(a.Tick(0))
    assert not n.core.is_voter and n.core.quarantined and n.core.must_reach_offset == 57
    static = Node(4, view=a.LogView(log_end_offset=3, epochs=[(1, 0)], must_reach_offset=57), directory_id=D[4])
    acts = static.step(a.Tick(0))
    assert not static.core.quarantined and a.ClearQuarantine(57) in acts, "a static observer never votes"


def test_a_leader_removing_itself_that_resigns_before_the_commit_becomes_an_observer():
    """Sim seed 751: the removal was pending when check-quorum made the leader
    resign; a resigned non-voter would never stand nor fetch (its election
    timer due forever: a busy loop). It replicates as an observer instead."""
    n, now = leader()
    ask(n, now, remove(1))
    assert n.core.role == "leader" and not n.core.is_voter
    acts = n.step(a.Tick(now + 10 * n.core.config.fetch_timeout_ms))  # nobody fetched: check-quorum
    assert one_response(acts, "v").error_code == Errors.NOT_LEADER_OR_FOLLOWER
    assert n.core.role == "observer"
    deadline = n.core.next_deadline_ms
    assert deadline is None or deadline > now + 10 * n.core.config.fetch_timeout_ms, "no tick due in the past"


def test_an_observer_without_a_leader_made_a_voter_waits_for_an_election():
    """Sim seed 932: an observer that knew no leader got a voter set naming
    it: it must become a voter that stands when its election timer runs out,
    not a leaderless follower that never fetches nor stands. (The set is fed
    to its log directly: how it arrived -- a fetch, a truncation -- is covered
    above.)"""
    n = Node(4, view=a.LogView(voter_set=dynamic((1, 2, 3))), directory_id=D[4], voters_are_bootstrap=True)
    n.step(a.Tick(0))
    assert n.core.role == "observer" and n.core.leader_id == -1
    n.core.log.add_voter_set(0, dynamic((1, 2, 3, 4)))
    n.step(a.Tick(1))
    assert n.core.is_voter and n.core.role == "unattached"
    deadline = n.core.next_deadline_ms
    assert deadline is not None and deadline > 1
    n.step(a.Tick(deadline))
    assert n.core.role == "prospective", "it stands when its election timer runs out"


# -- KIP-853: a voter that has not replicated the record adding it still votes --


def vote_for(candidate: int, epoch: int, last_epoch: int, last_offset: int, *, pre_vote: bool = False,
             voter: int = 4, voter_directory_id: str | None = None, candidate_directory_id: str | None = None):
    return m.VoteRequest(cluster_id=CLUSTER, candidate_epoch=epoch, candidate_id=candidate,
                         last_offset_epoch=last_epoch, last_offset=last_offset, pre_vote=pre_vote,
                         candidate_directory_id=D[candidate] if candidate_directory_id is None
                         else candidate_directory_id,
                         voter_id=voter, voter_directory_id=D[voter] if voter_directory_id is None
                         else voter_directory_id)


def new_voter(log_end: int = 5, epoch: int = 2) -> Node:
    """Node 4, just added to {1, 2, 3} by a VotersRecord it has not fetched:
    its own set still says {1, 2, 3}; its log ends at `log_end` in `epoch`."""
    n = Node(4, view=a.LogView(voter_set=dynamic((1, 2, 3)), log_end_offset=log_end, epochs=[(epoch, 0)]),
             state=a.QuorumStateData(epoch, -1, -1, (1, 2, 3)), directory_id=D[4], voters_are_bootstrap=True)
    n.step(a.Tick(0))
    assert n.core.role == "observer" and not n.core.is_voter
    return n


def test_a_new_voter_that_has_not_replicated_its_record_grants_pre_vote_and_vote_by_its_own_key():
    """Sim seed 494's liveness gap (Kafka 3.9's rule): a Vote naming this very
    replica (node id and directory id) comes from a candidate whose set makes
    it a voter; it is granted by the usual rules although our set does not
    name us yet: pre-vote (nothing recorded), then the real vote, persisted
    before the answer, one per epoch; the node stays an observer (fetching)."""
    n = new_voter()
    acts = ask(n, 10, vote_for(2, 3, 2, 6, pre_vote=True))
    resp = one_response(acts, "v")
    assert resp.error_code == Errors.NONE and resp.vote_granted
    assert not of_type(acts, a.PersistQuorumState) and n.core.voted_id == -1 and n.core.epoch == 2
    acts = ask(n, 11, vote_for(2, 3, 2, 6))
    resp = one_response(acts, "v")
    assert resp.vote_granted and resp.leader_epoch == 3
    persisted = of_type(acts, a.PersistQuorumState)
    assert persisted and persisted[-1].state.voted_id == 2 and persisted[-1].state.leader_epoch == 3
    assert acts.index(persisted[-1]) < next(i for i, x in enumerate(acts) if isinstance(x, a.Respond)), \
        "the vote is on disk before the answer"
    assert n.core.role == "observer" and n.core.voted_id == 2
    # One vote per epoch: another candidate of epoch 3 is refused, the same one granted again.
    assert not one_response(ask(n, 12, vote_for(3, 3, 2, 9)), "v").vote_granted
    assert one_response(ask(n, 13, vote_for(2, 3, 2, 6)), "v").vote_granted
    # The vote survives a restart: a new process on that state refuses candidate 3 in epoch 3.
    again = Node(4, view=a.LogView(voter_set=dynamic((1, 2, 3)), log_end_offset=5, epochs=[(2, 0)]),
                 state=persisted[-1].state, directory_id=D[4], voters_are_bootstrap=True)
    again.step(a.Tick(20))
    assert again.core.voted_id == 2
    assert not one_response(ask(again, 21, vote_for(3, 3, 2, 9)), "v").vote_granted


def test_an_observer_votes_only_when_named_by_its_own_key_and_by_the_usual_rules():
    """What the user of the core sees for each refusal: a key naming another
    directory of this node is INVALID_VOTER_KEY; no directory id in the key,
    a stale log, an older epoch (FENCED_LEADER_EPOCH), a known leader of the
    epoch, or a quarantine: not granted, nothing persisted."""
    n = new_voter()
    resp = one_response(ask(n, 1, vote_for(2, 3, 2, 6, voter_directory_id=WIPED3)), "v")
    assert resp.error_code == Errors.INVALID_VOTER_KEY and not resp.vote_granted
    for req in (vote_for(2, 3, 2, 6, voter_directory_id=m.NO_DIRECTORY_ID),  # not named by its key
                vote_for(2, 3, 2, 4), vote_for(2, 3, 1, 9),  # a log behind ours
                vote_for(2, 3, 2, 4, pre_vote=True)):
        acts = ask(n, 2, req)
        resp = one_response(acts, "v")
        assert resp.error_code == Errors.NONE and not resp.vote_granted, req
        assert n.core.voted_id == -1 and not [p for p in of_type(acts, a.PersistQuorumState)
                                              if p.state.voted_id >= 0]
    resp = one_response(ask(n, 3, vote_for(2, 1, 1, 9)), "v")
    assert resp.error_code == Errors.FENCED_LEADER_EPOCH and not resp.vote_granted
    # Following a live leader of epoch 3: no pre-vote, no vote in that epoch.
    ask(n, 4, m.BeginQuorumEpochRequest(cluster_id=CLUSTER, leader_id=1, leader_epoch=3, voter_id=4,
                                        voter_directory_id=D[4]), token="b")
    assert n.core.leader_id == 1 and n.core.role == "observer"
    assert not one_response(ask(n, 5, vote_for(2, 4, 3, 9, pre_vote=True)), "v").vote_granted
    assert not one_response(ask(n, 6, vote_for(2, 3, 3, 9)), "v").vote_granted
    # A quarantined replica votes, whatever the key, only for a log at least
    # as up to date as the one it had (end 50, epochs up to 2 after a restart):
    # past its own short log is not enough.
    q = Node(4, view=a.LogView(voter_set=dynamic((1, 2, 3)), log_end_offset=5, epochs=[(2, 0)],
                               must_reach_offset=50), directory_id=D[4], voters_are_bootstrap=True)
    q.step(a.Tick(0))
    assert q.core.quarantined
    assert not one_response(ask(q, 1, vote_for(2, 3, 2, 40, pre_vote=True)), "v").vote_granted
    assert not one_response(ask(q, 2, vote_for(2, 3, 2, 40)), "v").vote_granted
    assert one_response(ask(q, 3, vote_for(2, 3, 2, 60, pre_vote=True)), "v").vote_granted
    assert one_response(ask(q, 4, vote_for(2, 3, 2, 60)), "v").vote_granted
    assert q.core.voted_id == 2 and q.core.quarantined


def test_a_voter_grants_a_candidate_its_lagging_set_does_not_name_but_never_a_wiped_one():
    """KIP-853: our set may lag the candidate's (it was added by a record we
    have not replicated): with the set in the log, a node id we do not know
    may ask and gets the usual answer. A node id our set names with another
    directory is a wiped replica: INCONSISTENT_VOTER_SET. Static voters keep
    refusing a stranger."""
    v = Node(2, view=a.LogView(voter_set=dynamic((1, 2, 3))), directory_id=D[2], voters_are_bootstrap=True)
    v.step(a.Tick(0))
    resp = one_response(ask(v, 1, vote_for(4, 1, 0, 0, voter=2)), "v")
    assert resp.error_code == Errors.NONE and resp.vote_granted and v.core.voted_id == 4
    resp = one_response(ask(v, 2, vote_for(3, 2, 0, 0, voter=2, candidate_directory_id=WIPED3)), "v")
    assert resp.error_code == Errors.INCONSISTENT_VOTER_SET and not resp.vote_granted
    static = Node(2)
    static.step(a.Tick(0))
    resp = one_response(ask(static, 1, vote_for(4, 1, 0, 0, voter=2, voter_directory_id=m.NO_DIRECTORY_ID)), "v")
    assert resp.error_code == Errors.INCONSISTENT_VOTER_SET


def of_type(actions, cls) -> list:
    return [x for x in actions if isinstance(x, cls)]


# -- UpdateRaftVoter at startup (KIP-853): a voter on a new address tells its leader --


def follower_on(port: int | None, voters=(1, 2, 3), node_id: int = 2, **kw) -> tuple[Node, list]:
    """Node 2 of a dynamic set that records it at 9092, advertising `port`
    (None: nothing advertised); it learns leader 1 of epoch 3."""
    listeners = () if port is None else (("CONTROLLER", "127.0.0.1", port),)
    n = Node(node_id, view=a.LogView(voter_set=kw.pop("voter_set", dynamic(voters))), directory_id=D[node_id],
             voters_are_bootstrap=True, listeners=listeners, **kw)
    n.step(a.Tick(0))
    acts = n.step(a.RequestReceived(10, "b", m.BeginQuorumEpochRequest(
        cluster_id=CLUSTER, leader_id=1, leader_epoch=3, voter_id=node_id, voter_directory_id=D[node_id])))
    assert n.core.role == "follower" and n.core.leader_id == 1
    return n, acts


def update_requests(acts) -> list[a.SendRequest]:
    return [x for x in acts if isinstance(x, a.SendRequest) and isinstance(x.request, m.UpdateRaftVoterRequest)]


def test_a_voter_whose_endpoints_changed_sends_update_raft_voter_once_it_follows_a_leader():
    n, acts = follower_on(9999)
    (upd,) = update_requests(acts)
    assert upd.destination == 1 and upd.request == m.UpdateRaftVoterRequest(
        cluster_id=CLUSTER, current_leader_epoch=3, voter_id=2, voter_directory_id=D[2],
        listeners=[m.RaftListener("CONTROLLER", "127.0.0.1", 9999)])
    # Not yet answered: never a second one in flight, however many steps pass.
    assert update_requests(n.step(a.Tick(20))) == []
    # The leader took it: nothing more is sent to this leader, not even later.
    n.step(a.ResponseReceived(30, upd.request_id, 1, m.UpdateRaftVoterResponse(
        current_leader=m.LeaderIdAndEpoch(1, 3))))
    # (Within the fetch timeout: a follower that stands and comes back to this
    # leader is a new following, which asks again while the log's entry still
    # differs -- Kafka's hasUpdatedLeader is per FollowerState too.)
    for t in (40, 1000, 2000):
        acts = n.step(a.Tick(t))
        assert update_requests(acts) == []
        n.step(a.FlushCompleted(t, n.core.log_end_offset))


def test_update_raft_voter_refused_or_lost_is_sent_again_after_a_fetch_timeout():
    n, acts = follower_on(9999)
    (upd,) = update_requests(acts)
    n.step(a.ResponseReceived(30, upd.request_id, 1, m.UpdateRaftVoterResponse(
        error_code=Errors.REQUEST_TIMED_OUT, error_message="another voter change is in progress",
        current_leader=m.LeaderIdAndEpoch(1, 3))))
    retry_at = 30 + n.core.config.fetch_timeout_ms
    assert retry_at in n.core.state.deadlines(31), "a tick is due for the retry"
    # Keep the leader alive meanwhile (a good fetch answer), then the retry goes out.
    def leader_answers(acts, at):
        fetches = [x for x in acts if isinstance(x, a.SendRequest) and isinstance(x.request, m.FetchRequest)]
        return n.step(a.ResponseReceived(at, fetches[-1].request_id, 1, m.FetchResponse(high_watermark=0)))

    fetching = leader_answers(acts, retry_at - 1)
    assert update_requests(fetching) == [], "not before the retry is due"
    (again,) = update_requests(n.step(a.Tick(retry_at)))
    n.step(a.RequestFailed(retry_at + 5, again.request_id, 1, "timed out"))
    third_at = retry_at + 5 + n.core.config.fetch_timeout_ms
    acts = leader_answers(fetching, third_at - 1)
    (third,) = update_requests(acts + n.step(a.Tick(third_at)))
    assert third.request == upd.request and n.core.role == "follower"


def test_no_update_raft_voter_when_nothing_changed_or_the_voters_are_static():
    assert update_requests(follower_on(9092)[1]) == []  # the set already says 9092
    assert update_requests(follower_on(None)[1]) == []  # nothing advertised (a wildcard listen address)
    # Static voters (kraft version 0): the config holds the endpoints, nothing to tell.
    n = Node(2, directory_id=D[2], listeners=(("CONTROLLER", "127.0.0.1", 9999),))
    n.step(a.Tick(0))
    acts = n.step(a.RequestReceived(10, "b", m.BeginQuorumEpochRequest(cluster_id=CLUSTER, leader_id=1,
                                                                       leader_epoch=3)))
    assert n.core.role == "follower" and update_requests(acts) == []


# -- auto-join (KIP-1186, controller.quorum.auto.join.enable) ------------------


def observer(node_id: int, directory_id: str, voters=(1, 2, 3), auto_join: bool = True) -> tuple[Node, list]:
    """An observer of a dynamic set, following leader 1 of epoch 3 (from its
    quorum state), advertising 127.0.0.1:9090+id."""
    n = Node(node_id, view=a.LogView(voter_set=dynamic(voters)), directory_id=directory_id,
             state=a.QuorumStateData(3, 1, -1, tuple(voters)), voters_are_bootstrap=True,
             listeners=EP[node_id], auto_join_enable=auto_join)
    acts = n.step(a.Tick(0))
    assert n.core.role == "observer" and n.core.leader_id == 1
    return n, acts


def leader_answers_fetch(n: Node, acts: list, at: int) -> list:
    """Leader 1 answers the last Fetch in `acts` at `at` (it stays our live leader)."""
    f = [x for x in acts if isinstance(x, a.SendRequest) and isinstance(x.request, m.FetchRequest)][-1]
    return n.step(a.ResponseReceived(at, f.request_id, 1, m.FetchResponse(high_watermark=0)))


def membership_requests(acts) -> list[a.SendRequest]:
    return [x for x in acts if isinstance(x, a.SendRequest) and isinstance(
        x.request, (m.AddRaftVoterRequest, m.RemoveRaftVoterRequest, m.UpdateRaftVoterRequest))]


def test_auto_join_an_observer_adds_itself_and_retries_until_the_leader_takes_it():
    n, acts = observer(4, D[4])
    (req,) = membership_requests(acts)
    assert req.destination == 1 and isinstance(req.request, m.AddRaftVoterRequest)
    assert (req.request.voter_id, req.request.voter_directory_id, req.request.listeners) == (
        4, D[4], listeners(4))
    assert req.request.timeout_ms < req.timeout_ms, "the leader answers before our request times out"
    assert membership_requests(n.step(a.Tick(5))) == [], "one at a time"
    # Not caught up yet: asked again after a fetch timeout (the observer keeps
    # its leader meanwhile: observers do not stand).
    n.step(a.ResponseReceived(10, req.request_id, 1, m.AddRaftVoterResponse(
        error_code=Errors.REQUEST_TIMED_OUT, error_message="replica 4 is not caught up")))
    later = 10 + n.core.config.fetch_timeout_ms
    fetching = leader_answers_fetch(n, acts, later - 1)
    assert membership_requests(fetching) == [], "not before a fetch timeout"
    (again,) = membership_requests(n.step(a.Tick(later)))
    assert again.request == req.request and n.core.leader_id == 1
    # Once the set names it, it is a voter and asks nothing more.
    n.core.log.add_voter_set(0, dynamic((1, 2, 3, 4)))
    acts = n.step(a.Tick(later + 1))
    assert n.core.is_voter and membership_requests(acts + n.step(a.Tick(later + 10 * 1000))) == []


def test_auto_join_a_wiped_voter_removes_its_stale_identity_first_then_adds_itself():
    """KIP-1186: node 3 comes back with a new directory id while the set still
    names (3, its old directory): RemoveRaftVoter for that one, then, once the
    set no longer names node 3, AddRaftVoter for (3, new directory)."""
    n, acts = observer(3, WIPED3)
    (req,) = membership_requests(acts)
    assert req.request == m.RemoveRaftVoterRequest(cluster_id=CLUSTER, voter_id=3, voter_directory_id=D[3],
                                                   timeout_ms=req.request.timeout_ms)
    n.step(a.ResponseReceived(10, req.request_id, 1, m.RemoveRaftVoterResponse()))
    n.core.log.add_voter_set(0, dynamic((1, 2)))
    later = 10 + n.core.config.fetch_timeout_ms
    fetching = leader_answers_fetch(n, acts, later - 1)
    (req,) = membership_requests(fetching + n.step(a.Tick(later)))
    assert isinstance(req.request, m.AddRaftVoterRequest)
    assert (req.request.voter_id, req.request.voter_directory_id) == (3, WIPED3)


def test_no_auto_join_unless_enabled_and_never_with_static_voters():
    n, acts = observer(4, D[4], auto_join=False)
    assert membership_requests(acts + n.step(a.Tick(50_000))) == []
    s = Node(4, directory_id=D[4], state=a.QuorumStateData(3, 1, -1, (1, 2, 3)), listeners=EP[4],
             auto_join_enable=True)
    acts = s.step(a.Tick(0))
    assert s.core.role == "observer" and membership_requests(acts + s.step(a.Tick(50_000))) == []


def test_a_leader_on_a_new_address_records_its_own_endpoints_once_its_epoch_is_committed():
    """Kafka's leader updates its own entry (KAFKA-16533): node 1 leads a set
    that records it at 9091 while it advertises 9991; once its epoch is
    committed it appends a VotersRecord changing only its endpoints, once
    (the other voters' supported kraft.version ranges kept)."""
    start = dataclasses.replace(dynamic((1, 2, 3)), kraft_ranges={2: (1, 1)})
    n = Node(1, voters=(1, 2, 3), view=a.LogView(voter_set=start), directory_id=D[1],
             listeners=(("CONTROLLER", "127.0.0.1", 9991),))
    now = make_leader(n)
    assert n.core.voter_set.endpoints[1] == EP[1], "nothing before the epoch is committed"
    catch_up(n, now, [2])
    n.step(a.Tick(now + 1))
    vs = n.core.voter_set
    assert vs.endpoints[1] == (("CONTROLLER", "127.0.0.1", 9991),) and vs.endpoints[2] == EP[2]
    assert vs.directory_ids == dynamic((1, 2, 3)).directory_ids, "the membership is unchanged"
    assert vs.kraft_range_of(2) == (1, 1), "voter 2's supported range is kept"
    records = voter_sets_in(n.log.read(0, n.core.log_end_offset, 1 << 20))
    end = n.core.log_end_offset
    n.step(a.FlushCompleted(now + 2, end))
    catch_up(n, now + 2, [2])
    n.step(a.Tick(now + 3))
    assert n.core.log_end_offset == end and voter_sets_in(n.log.read(0, end, 1 << 20)) == records, "once"


def test_begin_quorum_epoch_carries_where_the_leader_listens_and_the_follower_keeps_it():
    """KIP-853 BeginQuorumEpoch v1 LeaderEndpoints (KAFKA-16927): the leader
    sends its advertised endpoints; its follower exposes them to the driver
    (core.leader_endpoints) so it can reach a leader whose entry in the
    follower's set is still an old address."""
    n = Node(1, voters=(1, 2, 3), view=a.LogView(voter_set=dynamic((1, 2, 3))), directory_id=D[1],
             listeners=(("CONTROLLER", "127.0.0.1", 9991),))
    n.step(a.Tick(0))
    acts = n.step(a.Tick(n.core.next_deadline_ms))
    votes = [x for x in grant_pre_votes(n, n.core.now_ms, acts) if isinstance(x, a.SendRequest)]
    for v in votes:
        acts = n.step(a.ResponseReceived(n.core.now_ms, v.request_id, v.destination, m.VoteResponse(
            leader_id=-1, leader_epoch=n.core.epoch, vote_granted=True)))
        if n.core.role == "leader":
            break
    begins = [x.request for x in acts if isinstance(x, a.SendRequest)
              and isinstance(x.request, m.BeginQuorumEpochRequest)]
    assert begins and all(b.leader_endpoints == [m.RaftListener("CONTROLLER", "127.0.0.1", 9991)] for b in begins)
    f = Node(2, view=a.LogView(voter_set=dynamic((1, 2, 3))), directory_id=D[2], voters_are_bootstrap=True)
    f.step(a.Tick(0))
    assert f.core.leader_endpoints is None
    f.step(a.RequestReceived(5, "b", next(b for b in begins if b.voter_id == 2)))
    assert f.core.leader_id == 1
    assert f.core.leader_endpoints == (1, n.core.epoch, (("CONTROLLER", "127.0.0.1", 9991),))
