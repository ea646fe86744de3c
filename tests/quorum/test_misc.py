"""Metadata answers and the errors a driver sees when it feeds bad input."""

import pytest

from metalog.broker.quorum import api as a
from metalog.protocol import messages as m

from tests.quorum.harness import Node, fetch, make_leader, one_response


def test_metadata_names_leader_epoch_hw_and_blank_endpoints():
    n = Node(1)
    now = make_leader(n)
    fetch(n, now, 2, 1, 1)
    fetch(n, now, 9, 1, 1)  # an observer
    r = one_response(n.step(a.RequestReceived(now, "md", m.MetadataRequest())), "md")
    assert (r.node_id, r.leader_id, r.leader_epoch, r.high_watermark, r.log_start_offset) == (1, 1, 1, 1, 0)
    assert r.voters == [m.NodeEndpoint(v, "", 0) for v in (1, 2, 3)]
    assert r.observers == [m.NodeEndpoint(9, "", 0)]


def test_client_append_with_mismatched_waiter_counts_is_refused():
    n = Node(1)
    make_leader(n)
    with pytest.raises(ValueError, match="ClientAppend waiters count 3 records in total but 2 were given"):
        n.step(a.ClientAppend(5000, [a.AppendWaiter("p", 3)], [b"a", b"b"]))


def test_snapshot_beyond_the_high_watermark_is_refused():
    n = Node(1)
    make_leader(n)
    with pytest.raises(ValueError, match=r"snapshot 5-1 is outside \[log start 0, high watermark -1\]"):
        n.step(a.SnapshotCreated(5000, m.SnapshotId(5, 1)))


def test_empty_voter_set_is_refused():
    with pytest.raises(ValueError, match="QuorumConfig.voters is empty"):
        Node(1, voters=())


def test_produce_without_records_is_an_invalid_request():
    n = Node(1)
    make_leader(n)
    r = one_response(n.step(a.RequestReceived(5000, "p", m.ProduceRequest(cluster_id="test-cluster", records=[]))), "p")
    assert r.error_code == 42 and r.error_message == "a produce request must carry at least one record"
