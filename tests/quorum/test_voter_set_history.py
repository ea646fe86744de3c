"""KIP-853 item 2 in the core: the voter set is data in the log.

The latest VotersRecord in the log counts from the moment it is appended
(fetched, committed or not), goes back when that part of the log is truncated
(DivergingEpoch, a quarantine cut) and comes with a snapshot; a node that
leaves the set becomes an observer, one that joins it a voter. The config's
static voters (kraft version 0) hold until the log says otherwise."""

from __future__ import annotations

from metalog.broker.quorum import api as a
from metalog.broker.quorum.voters import VoterSet, voter_sets_in
from metalog.protocol import messages as m
from metalog.storage import control_records as cr
from metalog.storage.batch import encode_batch

from tests.quorum.harness import CLUSTER, Node, batch, of, sent

D = {i: f"AAAAAAAAAAAAAAAAAAAA{c}w" for i, c in zip(range(1, 6), "BCDEF")}


def voters_batch(base: int, epoch: int, ids) -> bytes:
    rec = cr.VotersRecord([cr.Voter(i, D[i], [cr.VoterEndpoint("CONTROLLER", "127.0.0.1", 9090 + i)])
                           for i in ids])
    return encode_batch(base, epoch, [cr.encode_control(rec)], 0, is_control=True)


def dynamic(ids) -> VoterSet:
    return VoterSet({i: D[i] for i in ids}, kraft_version=1)


def answer(n: Node, send: a.SendRequest, resp: m.Body, now: int) -> list:
    return n.step(a.ResponseReceived(now, send.request_id, send.destination, resp))


def fetch_of(acts) -> a.SendRequest:
    (f,) = [s for s in sent(acts) if isinstance(s.request, m.FetchRequest)]
    return f


def following(node_id: int, leader: int, epoch: int) -> tuple[Node, list]:
    """A voter of the static set (1, 2, 3) with an empty log, told of `leader`."""
    n = Node(node_id, directory_id=D[node_id])
    n.step(a.Tick(0))
    acts = n.step(a.RequestReceived(0, "b", m.BeginQuorumEpochRequest(
        cluster_id=CLUSTER, leader_id=leader, leader_epoch=epoch, voter_id=node_id)))
    assert n.core.role == "follower"
    return n, acts


def test_voter_sets_in_finds_every_voters_record_at_its_offset():
    data = batch(0, 1, 3) + voters_batch(3, 1, (1, 2)) + batch(4, 1, 2) + voters_batch(6, 1, (1, 2, 3))
    assert voter_sets_in(data) == [(3, dynamic((1, 2))), (6, dynamic((1, 2, 3)))]
    assert voter_sets_in(batch(0, 1, 3)) == []


def test_a_fetched_voters_record_counts_at_once_and_goes_back_with_a_truncation():
    n, acts = following(2, leader=1, epoch=1)
    assert n.core.voter_set.kraft_version == 0 and n.core.voters == (1, 2, 3)
    # The leader's log: a data batch, then a VotersRecord that leaves node 2 out.
    acts = answer(n, fetch_of(acts), m.FetchResponse(
        high_watermark=0, records=batch(0, 1, 2) + voters_batch(2, 1, (1, 3, 4))), now=1)
    assert n.core.voters == (1, 3, 4) and n.core.voter_set.kraft_version == 1
    assert n.core.high_watermark <= 0, "not committed yet: it counts anyway"
    assert n.core.role == "observer" and not n.core.is_voter
    n.step(a.FlushCompleted(1, n.core.log_end_offset))
    # Leader 3 of epoch 2 never had the VotersRecord: we truncate it away.
    acts = n.step(a.RequestReceived(2, "b", m.BeginQuorumEpochRequest(
        cluster_id=CLUSTER, leader_id=3, leader_epoch=2, voter_id=2)))
    assert n.core.role == "observer" and n.core.leader_id == 3
    req = [s for s in sent(acts) if isinstance(s.request, (m.FetchRequest, m.OffsetsForLeaderEpochRequest))][0]
    if isinstance(req.request, m.OffsetsForLeaderEpochRequest):
        acts = answer(n, req, m.OffsetsForLeaderEpochResponse(leader_epoch=1, end_offset=2), now=3)
    else:
        acts = answer(n, req, m.FetchResponse(high_watermark=0, diverging_epoch=m.EpochEndOffset(1, 2)), now=3)
    assert a.TruncateLog(2) in acts and n.core.log_end_offset == 2
    assert n.core.voters == (1, 2, 3) and n.core.voter_set.kraft_version == 0
    assert n.core.role == "follower" and n.core.is_voter


def test_a_voter_that_joins_the_set_stands_when_its_leader_goes_quiet():
    """Node 4 starts as an observer (static voters 1-3); the VotersRecord that
    adds it makes it a voter: when its fetches go unanswered it asks for
    pre-votes of the new set."""
    n = Node(4, directory_id=D[4])
    n.step(a.Tick(0))
    acts = n.step(a.RequestReceived(0, "b", m.BeginQuorumEpochRequest(
        cluster_id=CLUSTER, leader_id=1, leader_epoch=1)))
    assert n.core.role == "observer"
    acts = answer(n, fetch_of(acts), m.FetchResponse(
        high_watermark=0, records=batch(0, 1, 1) + voters_batch(1, 1, (1, 2, 3, 4))), now=1)
    assert n.core.role == "follower" and n.core.voters == (1, 2, 3, 4)
    n.step(a.FlushCompleted(1, n.core.log_end_offset))
    acts = n.step(a.Tick(10_000))
    pre = [s for s in sent(acts, m.VoteRequest) if s.request.pre_vote]
    assert n.core.role == "prospective" and sorted(s.destination for s in pre) == [1, 2, 3]


def test_boot_takes_the_latest_voter_set_of_the_log():
    """A node restarted with a log whose latest VotersRecord leaves it out is
    an observer, whatever the static config says; one whose set is only itself
    leads alone."""
    view = a.LogView(log_end_offset=10, epochs=[(1, 0)], voter_history=[(3, dynamic((1, 2, 3))),
                                                                       (7, dynamic((1, 3)))])
    n = Node(2, view=view, directory_id=D[2])
    assert n.core.role == "observer" and n.core.voters == (1, 3)
    solo = Node(1, view=a.LogView(log_end_offset=5, epochs=[(1, 0)], voter_history=[(2, dynamic((1,)))]),
                directory_id=D[1])
    solo.step(a.Tick(0))
    for t in (2_500, 5_000):
        if solo.core.role != "leader":
            solo.step(a.Tick(t))
    assert solo.core.role == "leader", "a majority of a set of one"


def test_a_quarantine_cut_that_removes_our_membership_makes_us_an_observer():
    """Voter 4 (in the set only through a VotersRecord at offset 6) loses that
    record to a quarantine cut: it is no voter any more, unattached -> observer."""
    view = a.LogView(log_end_offset=10, epochs=[(1, 0)], voter_history=[(6, dynamic((1, 2, 3, 4)))])
    n = Node(4, view=view, directory_id=D[4])
    n.step(a.Tick(0))
    assert n.core.role == "unattached" and n.core.is_voter
    acts = n.step(a.LogQuarantined(1, log_end_offset=5, must_reach_offset=10))
    assert n.core.role == "observer" and n.core.voters == (1, 2, 3)
    assert not [s for s in sent(acts, m.VoteRequest)], "an observer never asks for votes"


def test_a_snapshot_brings_its_voter_set_and_a_failed_install_takes_it_back():
    n, acts = following(2, leader=1, epoch=1)
    sid = m.SnapshotId(20, 1)
    acts = answer(n, fetch_of(acts), m.FetchResponse(high_watermark=20, snapshot_id=sid), now=1)
    (fs,) = sent(acts, m.FetchSnapshotRequest)
    # A snapshot's beginning: its header batch, then the voter set (Kafka's layout).
    header = encode_batch(0, 1, [cr.encode_control(cr.SnapshotHeader(0, CLUSTER))], 0, is_control=True)
    data = header + voters_batch(1, 1, (1, 3, 5)) + batch(2, 1, 3)
    cut = len(header) + 30  # the chunks split the voters batch
    acts = answer(n, fs, m.FetchSnapshotResponse(snapshot_id=sid, size=len(data), position=0,
                                                 unaligned_records=data[:cut]), now=2)
    assert not of(acts, a.InstallSnapshot) and n.core.voters == (1, 2, 3)
    (fs,) = sent(acts, m.FetchSnapshotRequest)
    acts = answer(n, fs, m.FetchSnapshotResponse(snapshot_id=sid, size=len(data), position=cut,
                                                 unaligned_records=data[cut:]), now=2)
    assert of(acts, a.InstallSnapshot)
    assert n.core.voters == (1, 3, 5) and n.core.role == "observer"
    n.step(a.SnapshotInstallFailed(3, sid, "verification failed"))
    assert n.core.voters == (1, 2, 3) and n.core.role == "follower"
