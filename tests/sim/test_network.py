"""SimNetwork: partitions, one-way cuts, loss and jitter."""

from __future__ import annotations

import random

from metalog.sim.network import NetworkConfig, SimNetwork


def test_isolation_cuts_both_ways_and_heal_restores():
    net = SimNetwork(random.Random(1))
    net.isolate(2)
    assert net.transit_ms(1, 2) is None and net.transit_ms(2, 3) is None
    assert net.transit_ms(1, 3) is not None
    net.heal(2)
    assert net.transit_ms(1, 2) is not None


def test_one_way_cut_only_drops_one_direction():
    net = SimNetwork(random.Random(1))
    net.cut(1, 2)
    assert not net.reachable(1, 2) and net.reachable(2, 1)
    net.heal()
    assert net.reachable(1, 2)


def test_jitter_stays_in_bounds_and_reorders():
    net = SimNetwork(random.Random(7), NetworkConfig(delay_ms=3, jitter_ms=10))
    delays = [net.transit_ms(1, 2) for _ in range(200)]
    assert min(delays) >= 3 and max(delays) <= 13
    assert len(set(delays)) > 5, "jitter must vary so that messages reorder"


def test_drop_probability_loses_about_that_share():
    net = SimNetwork(random.Random(3), NetworkConfig(drop_probability=0.25))
    lost = sum(net.transit_ms(1, 2) is None for _ in range(4000))
    assert 800 < lost < 1200
