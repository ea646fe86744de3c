"""A new leader's OffsetsForLeaderEpoch answer to a consumer (the drill's wrong truncation notice).

Found by the drill's history (docs/drills.md, tests/drill/fixtures/drill_history.jsonl.gz):
both consumers, at position 811 after reading 809-810 (one batch of epoch 3),
were told "the leader's log ends epoch 3 at offset 809": a truncation that did
not happen -- every replica holds 809-810 in epoch 3 and epoch 4 from 811. The
answer came from the new leader of epoch 4, 0.6 s after the old leader was
killed. As a follower it had fetched 809-810 with the HW the old leader had
then (809); a new leader commits nothing, so learns no newer HW, until a record
of its own epoch is committed (Raft 5.4.2). Its answer for epoch 3, (3, 811),
the start of its epoch 4, was cut to that stale HW "so consumers see committed
data only", and 809 < 811 reads as a truncation.

Every committed record is in the new leader's log below the start of its epoch
(leader completeness), and a consumer's position never passes a committed
offset, so that start is as far as the answer must reach; past it only the
leader's own uncommitted records are hidden. (Fetch's DivergingEpoch answer to
the same consumer never had the cut; Kafka has none either.)
"""

from metalog.broker.quorum import api as a
from metalog.protocol import messages as m
from metalog.protocol.errors import Errors

from tests.quorum.harness import CLUSTER, Node, batch, one_response, sent, stand


def follower_that_fetched_809_810_with_hw_809() -> Node:
    """Voter 2 following leader 1 in epoch 3, log end 809: it fetches the batch
    809-810 of epoch 3, answered with the HW the leader had then, 809."""
    n = Node(2, view=a.LogView(log_end_offset=809, epochs=[(3, 0)]),
             state=a.QuorumStateData(3, 1, -1, (1, 2, 3)))
    (check,) = sent(n.step(a.Tick(0)))
    acts = n.step(a.ResponseReceived(1, check.request_id, 1, m.OffsetsForLeaderEpochResponse(
        leader_epoch=3, end_offset=809)))
    (f,) = sent(acts)
    assert isinstance(f.request, m.FetchRequest) and f.request.fetch_offset == 809
    n.step(a.ResponseReceived(2, f.request_id, 1, m.FetchResponse(
        high_watermark=809, records=batch(809, 3, 2))))
    n.step(a.FlushCompleted(3, 811))
    assert (n.core.log_end_offset, n.core.high_watermark) == (811, 809)
    return n


def elected_in_epoch_4(n: Node) -> None:
    """Leader 1 is killed: no more answers; voter 2's fetch timeout runs out and it wins epoch 4."""
    acts = stand(n, 10_000)
    for s in sent(acts, m.VoteRequest):
        n.step(a.ResponseReceived(10_001, s.request_id, s.destination, m.VoteResponse(
            leader_id=-1, leader_epoch=n.core.epoch, vote_granted=True)))
        if n.core.role == "leader":
            break
    n.step(a.FlushCompleted(10_001, n.core.log_end_offset))
    assert (n.core.role, n.core.epoch) == ("leader", 4)
    assert n.core.epochs.entries == [(3, 0), (4, 811)]  # its LeaderChange record at 811
    assert n.core.high_watermark == 809  # nothing of epoch 4 is committed yet: the follower's HW


def consumer_asks(n: Node, leader_epoch: int) -> m.OffsetsForLeaderEpochResponse:
    resp = one_response(n.step(a.RequestReceived(10_002, "c", m.OffsetsForLeaderEpochRequest(
        cluster_id=CLUSTER, replica_id=m.CONSUMER_REPLICA_ID, current_leader_epoch=4,
        leader_epoch=leader_epoch))), "c")
    assert resp.error_code == Errors.NONE
    return resp


def test_new_leader_tells_a_consumer_where_epoch_3_really_ended():
    n = follower_that_fetched_809_810_with_hw_809()
    elected_in_epoch_4(n)
    # The consumer read 809-810 (committed by the old leader) and validates position 811.
    resp = consumer_asks(n, 3)
    assert (resp.leader_epoch, resp.end_offset) == (3, 811), (
        f"epoch 3 ends at 811 in the new leader's log, answered {resp.end_offset}: "
        f"a consumer at 811 is told of a truncation that did not happen")
    # Fetch's DivergingEpoch check gives the same consumer the same verdict: no divergence.
    fetched = one_response(n.step(a.RequestReceived(10_003, "f", m.FetchRequest(
        cluster_id=CLUSTER, replica_id=m.CONSUMER_REPLICA_ID, max_wait_ms=0, current_leader_epoch=4,
        fetch_offset=811, last_fetched_epoch=3))), "f")
    assert fetched.diverging_epoch is None


def test_the_leaders_own_uncommitted_records_stay_hidden_from_consumers():
    n = follower_that_fetched_809_810_with_hw_809()
    elected_in_epoch_4(n)
    n.step(a.ClientAppend(10_002, [a.AppendWaiter("p", 3)], [b"x", b"y", b"z"]))
    n.step(a.FlushCompleted(10_002, n.core.log_end_offset))
    assert n.core.log_end_offset == 815 and n.core.high_watermark == 809
    # Epoch 4 runs to 815 in its log, none of it committed: a consumer is told no further than 811.
    resp = consumer_asks(n, 4)
    assert (resp.leader_epoch, resp.end_offset) == (4, 811)
