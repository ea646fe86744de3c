"""SimNetwork: partitions, one-way cuts, loss, jitter and bits flipped on the wire."""

from __future__ import annotations

import random

import pytest

from metalog.protocol import messages as m
from metalog.sim.network import MAGIC_POSITION, NetworkConfig, SimNetwork
from metalog.storage.batch import CorruptBatchError, encode_batch, iter_batches


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


def test_a_wire_flip_changes_one_bit_that_the_batch_checks_catch():
    records = encode_batch(10, 3, [b"a", b"b"], 0) + encode_batch(12, 3, [b"c"], 0)
    body = m.FetchResponse(high_watermark=10, records=records)
    for seed in range(200):
        net = SimNetwork(random.Random(1), rng_wire=random.Random(seed))
        got, flip = net.flip(body)
        diff = [i for i, (x, y) in enumerate(zip(records, got.records)) if x != y]
        assert len(diff) == 1 and bin(records[diff[0]] ^ got.records[diff[0]]).count("1") == 1
        assert flip.base_offset in (10, 12) and flip.byte_position >= MAGIC_POSITION
        with pytest.raises(CorruptBatchError):
            list(iter_batches(got.records))


def test_wire_flips_draw_only_from_their_own_stream():
    net = SimNetwork(random.Random(1), NetworkConfig(fetch_flip_probability=1.0), rng_wire=random.Random(2))
    body = m.FetchResponse(high_watermark=0, records=encode_batch(0, 1, [b"x"], 0))
    before = net.rng.getstate()
    assert net.maybe_flip(body) is not None
    assert net.maybe_flip(m.FetchResponse(high_watermark=0)) is None  # nothing to flip
    assert net.rng.getstate() == before
    off = SimNetwork(random.Random(1), rng_wire=random.Random(2))
    wire_before = off.rng_wire.getstate()
    assert off.maybe_flip(body) is None and off.rng_wire.getstate() == wire_before
