"""metalog.broker.net.backoff.Backoff: the one retry back-off of the client and the peer channels."""

from __future__ import annotations

import random

import pytest

from metalog.broker.net.backoff import Backoff
from metalog.protocol.invariants import InvariantViolation


class Fixed:
    """A random source that always answers one end of the range."""

    def __init__(self, pick: str):
        self.pick = pick

    def uniform(self, a: float, b: float) -> float:
        return a if self.pick == "low" else b


def test_doubles_per_attempt_then_stays_at_the_cap():
    b = Backoff(base_ms=100, max_ms=2000, jitter=0)
    assert [b.delay_ms(n, random) for n in range(1, 8)] == [100, 200, 400, 800, 1600, 2000, 2000]


def test_huge_attempt_numbers_stay_at_the_cap():
    assert Backoff(50, 1000).delay_ms(10_000, Fixed("high")) == pytest.approx(1200)


def test_jitter_spreads_twenty_percent_either_way():
    b = Backoff(base_ms=100, max_ms=2000)
    assert b.delay_ms(3, Fixed("low")) == pytest.approx(320)
    assert b.delay_ms(3, Fixed("high")) == pytest.approx(480)
    rng = random.Random(7)
    delays = [b.delay_ms(6, rng) for _ in range(500)]
    assert min(delays) >= 1600 and max(delays) <= 2400
    assert max(delays) - min(delays) > 600  # actually spread, not constant


def test_same_seed_same_delays():
    b = Backoff(20, 100)
    assert [b.delay_ms(n, random.Random(3)) for n in range(1, 6)] == \
           [b.delay_ms(n, random.Random(3)) for n in range(1, 6)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(base_ms=200, max_ms=100), "0 <= base_ms <= max_ms"),
    (dict(base_ms=-1, max_ms=100), "0 <= base_ms <= max_ms"),
    (dict(base_ms=10, max_ms=100, jitter=1.0), "jitter must be in"),
])
def test_bad_parameters_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Backoff(**kwargs)


def test_attempt_counts_from_one():
    with pytest.raises(InvariantViolation, match="attempt counts from 1"):
        Backoff(10, 100).delay_ms(0, random)


def test_client_and_peer_channel_use_it_with_their_settings():
    from metalog.broker.client import MetalogClient
    from metalog.broker.client.client import RETRY_BACKOFF_MAX_MS
    from metalog.broker.net.channel import PeerChannel

    client = MetalogClient([("127.0.0.1", 1)], "c", retry_backoff_ms=100)
    assert client._retry_backoff == Backoff(100, RETRY_BACKOFF_MAX_MS)
    ch = PeerChannel("127.0.0.1", 1, reconnect_backoff_ms=20, reconnect_backoff_max_ms=100)
    assert ch._backoff == Backoff(20, 100)
    # A base above the cap waits the cap, as before.
    assert PeerChannel("127.0.0.1", 1, reconnect_backoff_ms=500, reconnect_backoff_max_ms=100)._backoff \
        == Backoff(100, 100)


def test_bad_parameters_are_refused_under_python_O_too():
    import subprocess
    import sys

    code = "from metalog.broker.net.backoff import Backoff\nBackoff(200, 100)\n"
    proc = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "ValueError: back-off needs 0 <= base_ms <= max_ms" in proc.stderr
