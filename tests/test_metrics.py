"""metalog.broker.server.metrics with a fake clock: the windowed raft stats (latencies,
rates, idle ratio) say what Kafka's raft-metrics say, and expire with the window."""

from __future__ import annotations

import math

from prometheus_client import generate_latest

import types

import pytest

from metalog.broker.quorum.roles import Role
from metalog.broker.server.metrics import (RAFT_METRIC_NAMES, WINDOW_S, BrokerMetrics, LoopIdleRatio, RaftStats,
                                          RaftView, WindowedStat, raft_view)
from metalog.protocol.invariants import InvariantViolation


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def test_windowed_stat_avg_max_rate_and_expiry():
    clock = FakeClock()
    stat = WindowedStat(clock, window_s=60, bucket_s=2)
    assert math.isnan(stat.avg()) and math.isnan(stat.max()) and stat.rate() == 0
    for v in (10, 30, 20):
        stat.record(v)
        clock.now_s += 1
    assert stat.avg() == 20 and stat.max() == 30
    clock.now_s += 57  # 60 s after the first record, the broker 60 s old
    assert stat.rate() == 60 / 60
    clock.now_s += 5  # every bucket is now older than the window
    assert math.isnan(stat.avg()) and math.isnan(stat.max()) and stat.rate() == 0


def test_young_stat_rate_divides_by_its_age_not_the_window():
    clock = FakeClock()
    stat = WindowedStat(clock, window_s=60, bucket_s=2)
    clock.now_s += 10
    stat.record(50)
    assert stat.rate() == 5.0


def test_commit_latency_is_from_leader_append_to_high_watermark():
    clock = FakeClock()
    raft = RaftStats(clock)
    raft.on_role("leader")
    raft.on_append(True, 0, 1)
    clock.now_s += 0.004
    raft.on_append(True, 1, 11)
    clock.now_s += 0.006
    raft.on_high_watermark(1)  # commits the first batch only
    assert math.isclose(raft.commit_latency_ms.max(), 10.0)
    raft.on_high_watermark(5)  # half of the second batch is not "committed" as a batch
    assert math.isclose(raft.commit_latency_ms.avg(), 10.0)
    clock.now_s += 0.010
    raft.on_high_watermark(11)
    assert math.isclose(raft.commit_latency_ms.max(), 16.0) and math.isclose(raft.commit_latency_ms.avg(), 13.0)
    assert raft.append_records.rate() == 11 / 2  # younger than one bucket: per bucket_s
    assert raft.fetch_records.rate() == 0


def test_batches_of_a_lost_leadership_get_no_commit_latency():
    clock = FakeClock()
    raft = RaftStats(clock)
    raft.on_role("leader")
    raft.on_append(True, 0, 3)
    raft.on_role("follower")
    raft.on_append(False, 0, 3)  # the new leader's copy, fetched
    clock.now_s += 1
    raft.on_high_watermark(3)
    assert math.isnan(raft.commit_latency_ms.max())
    assert raft.fetch_records.rate() > 0


def test_election_latency_spans_retries_and_ends_when_a_leader_is_known():
    clock = FakeClock()
    raft = RaftStats(clock)
    raft.on_role("unattached")
    raft.on_role("candidate")
    clock.now_s += 0.5
    raft.on_role("candidate")  # lost the round, stands again in the next epoch
    clock.now_s += 0.25
    raft.on_role("leader")
    assert math.isclose(raft.election_latency_ms.max(), 750.0)
    raft.on_role("resigned")
    raft.on_role("follower")  # learning a leader without having stood is no election of ours
    assert math.isclose(raft.election_latency_ms.avg(), 750.0)
    raft.on_role("candidate")
    clock.now_s += 0.25
    raft.on_role("follower")  # someone else won
    assert math.isclose(raft.election_latency_ms.avg(), 500.0)
    clock.now_s += WINDOW_S + 2
    assert math.isnan(raft.election_latency_ms.max())


def test_idle_ratio_is_the_share_of_wall_time_off_cpu():
    wall, cpu = FakeClock(), FakeClock()
    idle = LoopIdleRatio(window_s=10, sample_s=1, clock=wall, cpu_clock=cpu)
    idle.sample()
    assert math.isnan(idle.value())
    for _ in range(20):
        wall.now_s += 1
        cpu.now_s += 0.25
        idle.sample()
    assert math.isclose(idle.value(), 0.75)
    for _ in range(10):  # a busy window replaces the old one
        wall.now_s += 1
        cpu.now_s += 1
        idle.sample()
    assert idle.value() == 0.0


def test_registry_exports_every_raft_metric_with_the_views_values():
    m = BrokerMetrics(2)
    text = generate_latest(m.registry).decode()
    for name in RAFT_METRIC_NAMES:
        assert f"# TYPE {name} gauge" in text
    m.bind_raft_view(lambda: RaftView(state="follower", leader_id=1, voted_id=-1, epoch=7, high_watermark=42,
                                      log_end_offset=45, log_end_epoch=6, unknown_voter_connections=0))
    get = m.registry.get_sample_value
    assert get("kafka_server_raft_metrics_current_state", {"state": "follower"}) == 1
    assert get("kafka_server_raft_metrics_current_state", {"state": "leader"}) == 0
    assert get("kafka_server_raft_metrics_current_leader") == 1
    assert get("kafka_server_raft_metrics_current_vote") == -1
    assert get("kafka_server_raft_metrics_current_epoch") == 7
    assert get("kafka_server_raft_metrics_high_watermark") == 42
    assert get("kafka_server_raft_metrics_log_end_offset") == 45
    assert get("kafka_server_raft_metrics_log_end_epoch") == 6


def test_requests_are_counted_by_api_name():
    from metalog.protocol.apis import ApiKey

    metrics = BrokerMetrics(node_id=1)
    for api in (ApiKey.PRODUCE, ApiKey.FETCH, ApiKey.PRODUCE):
        metrics.count_request(api)
    text = generate_latest(metrics.registry).decode()
    assert 'metalog_requests_total{api="PRODUCE"} 2.0' in text
    assert 'metalog_requests_total{api="FETCH"} 1.0' in text


def _core(role: Role, **fields):
    """The members raft_view reads of a quorum core."""
    base = dict(voted_id=3, leader_id=2, epoch=9, high_watermark=40, log_end_offset=44,
                log=types.SimpleNamespace(last_epoch=lambda: 8), config=types.SimpleNamespace(voters=(1, 2, 3, 4)))
    base.update(fields)
    return types.SimpleNamespace(role=role, **base)


def test_raft_view_votes_as_kafka_says_and_counts_voters_without_an_address():
    # A leader or candidate has voted for itself; a voter for its vote; others for nobody.
    assert raft_view(_core(Role.LEADER), 1, {1: "a", 2: "b"}).voted_id == 1
    assert raft_view(_core(Role.CANDIDATE), 1, {}).voted_id == 1
    assert raft_view(_core(Role.VOTED), 1, {}).voted_id == 3
    assert raft_view(_core(Role.FOLLOWER), 1, {}).voted_id == -1
    view = raft_view(_core(Role.FOLLOWER, leader_id=-7), 1, {1: "a", 2: "b"})
    assert view == RaftView(state="follower", leader_id=-1, voted_id=-1, epoch=9, high_watermark=40,
                            log_end_offset=44, log_end_epoch=8, unknown_voter_connections=2)  # voters 3 and 4


def test_appends_that_do_not_go_forward_are_invariant_breaches():
    stats = RaftStats(FakeClock())
    stats.on_append(True, 0, 5)
    with pytest.raises(InvariantViolation, match="from 5 to 5"):
        stats.on_append(True, 5, 5)
    with pytest.raises(InvariantViolation, match="leader appends go forward: 3 after 5"):
        stats.on_append(True, 2, 3)
    with pytest.raises(ValueError, match="bucket_s"):
        WindowedStat(FakeClock(), window_s=1.0, bucket_s=2.0)
