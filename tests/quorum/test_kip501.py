"""KIP-501's example (seed 001): leader read takes 25 s, replica.lag.time.max.ms 10 s."""

import pytest

from metalog.broker.quorum import api as a
from metalog.protocol import messages as m

from tests.quorum.harness import Node, append, fetch, make_leader, of, one_response


def scenario(flag: bool):
    n = Node(1, replica_lag_time_max_ms=10_000, follower_fetch_pending_reads_insync_enable=flag,
             fetch_timeout_ms=60_000)
    t = make_leader(n)
    append(n, t, 949)  # LEO 950
    n.step(a.FlushCompleted(t, 950))
    t_prev = t + 1000
    fetch(n, t_prev, 2, 950, 1)  # caught up with LEO 950
    fetch(n, t_prev, 3, 950, 1)
    append(n, t_prev, 52)  # LEO 1002
    tx = t_prev + 1000
    fetch(n, tx, 2, 950, 1)  # fetch-offset 950 while the leader's LEO is 1002
    append(n, tx, 98)  # LEO 1100
    ty = tx + 1000
    n.step(a.StallReads(ty, ty + 25_000))  # the leader's read takes 25 s
    acts = fetch(n, ty, 2, 1002, 1, max_wait_ms=500, token="slow")
    assert not of(acts, a.Respond)  # pending
    return n, tx, ty


def test_pending_fetch_keeps_the_follower_in_sync_with_the_flag_on():
    n, tx, ty = scenario(True)
    assert n.core.is_in_sync(2, tx + 10_500)
    d = n.core.describe_quorum(tx + 10_500)
    assert [v.in_sync for v in d.voters if v.replica_id == 2] == [True]
    assert not of(n.step(a.Tick(ty + 24_999)), a.Respond)
    r = one_response(n.step(a.Tick(ty + 25_000)), "slow")
    assert r.records  # served at last
    assert n.core.replica_states[2].last_caught_up_ms == ty + 25_000
    assert n.core.is_in_sync(2, ty + 25_001)


def test_follower_drops_out_of_sync_with_the_flag_off():
    n, tx, ty = scenario(False)
    assert not n.core.is_in_sync(2, tx + 10_500)
    d = n.core.describe_quorum(tx + 10_500)
    assert [v.in_sync for v in d.voters if v.replica_id == 2] == [False]
    one_response(n.step(a.Tick(ty + 25_000)), "slow")
    # Served, but caught up only as of the previous fetch (tx): still out of sync.
    assert n.core.replica_states[2].last_caught_up_ms == tx
    assert not n.core.is_in_sync(2, ty + 25_001)


@pytest.mark.parametrize("flag", [True, False])
def test_pending_fetch_behind_the_previous_leo_does_not_count(flag):
    n = Node(1, replica_lag_time_max_ms=10_000, follower_fetch_pending_reads_insync_enable=flag,
             fetch_timeout_ms=60_000)
    t = make_leader(n)
    append(n, t, 99)
    n.step(a.FlushCompleted(t, 100))
    fetch(n, t, 2, 10, 1)  # served with LEO 100
    n.step(a.StallReads(t + 1, t + 60_000))
    fetch(n, t + 1, 2, 50, 1, token="slow")  # pending, but 50 < 100
    assert not n.core.is_in_sync(2, t + 20_000)


def test_kafka_caught_up_rule_without_pending_reads():
    n = Node(1, replica_lag_time_max_ms=10_000, fetch_timeout_ms=60_000,
             follower_fetch_pending_reads_insync_enable=False)
    t = make_leader(n)
    append(n, t, 9)
    n.step(a.FlushCompleted(t, 10))
    fetch(n, t, 2, 10, 1)  # fetch offset >= LEO: caught up now
    assert n.core.replica_states[2].last_caught_up_ms == t
    append(n, t + 5, 10)  # LEO 20
    fetch(n, t + 7000, 2, 10, 1)  # >= LEO at previous fetch (10): caught up as of then
    assert n.core.replica_states[2].last_caught_up_ms == t
    fetch(n, t + 8000, 2, 15, 1)  # < LEO at previous fetch (20): no update
    assert n.core.replica_states[2].last_caught_up_ms == t
    assert n.core.is_in_sync(2, t + 10_000)
    assert not n.core.is_in_sync(2, t + 10_001)
    fetch(n, t + 10_002, 2, 20, 1)  # same LEO as the leader
    assert n.core.is_in_sync(2, t + 50_000)


def test_a_replica_that_comes_back_with_less_data_is_not_in_sync_until_it_caught_up():
    """Issue 12 item 7: a follower that was caught up, then wiped (or crashed,
    or quarantined) and fetches again from offset 0, is reported out of sync by
    DescribeQuorum -- not in sync on the strength of its caught-up time from
    before the wipe -- and in sync again once it reaches the leader's LEO."""
    n = Node(1, replica_lag_time_max_ms=10_000, fetch_timeout_ms=60_000)
    t = make_leader(n)
    append(n, t, 99)
    n.step(a.FlushCompleted(t, 100))
    fetch(n, t, 2, 100, 1)  # caught up
    fetch(n, t, 3, 100, 1)
    assert n.core.is_in_sync(2, t + 1)
    fetch(n, t + 100, 2, 0, 0)  # wiped: starts over
    d = n.core.describe_quorum(t + 200)
    v2 = [v for v in d.voters if v.replica_id == 2][0]
    assert (v2.log_end_offset, v2.last_caught_up_timestamp_ms, v2.in_sync) == (0, -1, False)
    fetch(n, t + 300, 2, 50, 1)  # half way
    assert not n.core.is_in_sync(2, t + 301)
    fetch(n, t + 400, 2, 100, 1)  # at the leader's LEO again
    assert n.core.is_in_sync(2, t + 401)


def test_a_wiped_replica_sent_to_a_snapshot_loses_its_old_offset():
    """The snapshot redirect answers before the fetch state is updated (as in
    Kafka); a wiped replica redirected there must still not keep the LEO and
    caught-up time of the log it lost."""
    n = Node(1, replica_lag_time_max_ms=10_000, fetch_timeout_ms=60_000)
    t = make_leader(n)
    append(n, t, 99)
    n.step(a.FlushCompleted(t, 100))
    fetch(n, t, 2, 100, 1)
    fetch(n, t, 3, 100, 1)
    n.log.snapshots[m.SnapshotId(100, 1)] = b"snap"
    n.step(a.SnapshotCreated(t, m.SnapshotId(100, 1)))
    acts = fetch(n, t + 10, 2, 0, 0)
    assert one_response(acts, "f").snapshot_id == m.SnapshotId(100, 1)
    st = n.core.replica_states[2]
    assert (st.log_end_offset, st.last_caught_up_ms) == (0, -1)
    assert not n.core.is_in_sync(2, t + 20)
