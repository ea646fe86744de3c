"""One retry back-off policy for the client and for peer channels.

Exponential from ``base_ms``, doubling per consecutive failure, capped at
``max_ms``, then spread by ±``jitter`` so that many retriers that failed
together do not come back together. Pure: the caller passes the attempt
number and a random source (``random`` itself, or a seeded
``random.Random``), and sleeps or schedules by the result.

The listener's delay of addresses that keep failing (``failed_connection_backoff_ms``)
is a penalty imposed on others, not a retry of our own: ``AddressPolicy``
below folds it into the per-address connection rate (KIP-612), both
deciding when an address's next connection may start.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from metalog.protocol.invariants import invariant

MAX_DOUBLINGS = 30  # 2**30 * base exceeds any cap: stops the power from growing without bound


class RandomSource(Protocol):
    def uniform(self, a: float, b: float) -> float: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Backoff:
    base_ms: float
    max_ms: float
    jitter: float = 0.2  # ±20%, as Kafka's clients

    def __post_init__(self) -> None:
        if not 0 <= self.base_ms <= self.max_ms:
            raise ValueError(f"back-off needs 0 <= base_ms <= max_ms, got {self}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter}")

    def delay_ms(self, attempt: int, rng: RandomSource) -> float:
        """How long to wait before retry number `attempt` (1 = the first retry)."""
        invariant(attempt >= 1, "attempt counts from 1, got %d", attempt)
        capped = min(self.base_ms * 2 ** min(attempt - 1, MAX_DOUBLINGS), self.max_ms)
        if not self.jitter:
            return capped
        return capped * rng.uniform(1 - self.jitter, 1 + self.jitter)


# --------------------------------------------------------------------------
# Admission pacing of a listener (KIP-612's connection-rate quotas)


class RateSlots:
    """Slots of a rate, for arrivals that wait for theirs (GCRA, virtual scheduling).

    ``reserve(now_s)`` gives the time at which the arrival may go: now while
    the rate holds (a burst of ``burst`` arrivals goes at once), later than
    now when arrivals come faster: the arrival is delayed, never refused.
    Over any window the reserved slots respect ``rate_per_s`` plus the burst.
    A rate of 0 means no limit."""

    __slots__ = ("interval_s", "tolerance_s", "_next_s")

    def __init__(self, rate_per_s: float, burst: int = 1):
        if rate_per_s < 0 or burst < 1:
            raise ValueError(f"need rate_per_s >= 0 and burst >= 1, got {rate_per_s}, {burst}")
        self.interval_s = 1.0 / rate_per_s if rate_per_s else 0.0
        self.tolerance_s = (burst - 1) * self.interval_s
        self._next_s = -float("inf")  # the theoretical time of the next conforming arrival

    def reserve(self, now_s: float) -> float:
        """Take the next slot; returns when it starts (>= now_s)."""
        if not self.interval_s:
            return now_s
        tat_s = max(self._next_s, now_s)
        self._next_s = tat_s + self.interval_s
        return max(now_s, tat_s - self.tolerance_s)

    def push_back(self, until_s: float) -> None:
        """No slot before `until_s` (a back-off imposed on an address)."""
        self._next_s = max(self._next_s, until_s + self.tolerance_s)

    def idle_since(self, now_s: float) -> bool:
        """Whether a fresh ``RateSlots`` would behave the same (so the table may forget it)."""
        return self._next_s <= now_s


@dataclasses.dataclass(slots=True)
class AddressPace:
    """One source address: its rate slots and its run of failures."""

    slots: RateSlots
    failures: int = 0
    backoff_ms: float = 0.0
    blocked_until_s: float = 0.0


class AddressPolicy:
    """When each source address's next connection may start (rate and back-off in one).

    Two rules share the address's slots: at most ``rate_per_s`` new
    connections a second (a burst of ``burst``), and after
    ``failures_before_backoff`` consecutive failures (failed handshakes, bad
    frames, idle half-frames) no slot before a back-off period that starts
    at ``backoff_ms`` and doubles per further failure up to
    ``backoff_max_ms``; a success ends the run. Pure: the caller passes the
    clock. The table holds at most ``addresses_max`` addresses (the least
    recently seen are forgotten first)."""

    def __init__(self, rate_per_s: float, burst: int, failures_before_backoff: int, backoff_ms: float,
                 backoff_max_ms: float, addresses_max: int):
        invariant(addresses_max > 0, "addresses_max must be > 0, got %d", addresses_max)
        self._rate_per_s = rate_per_s
        self._burst = burst
        self._failures_before_backoff = failures_before_backoff
        self._backoff = Backoff(backoff_ms, backoff_max_ms, jitter=0)
        self._addresses_max = addresses_max
        self._table: dict[str, AddressPace] = {}  # insertion order = least recently seen first

    def __len__(self) -> int:
        return len(self._table)

    def get(self, host: str) -> AddressPace | None:
        return self._table.get(host)

    def _touch(self, host: str) -> AddressPace:
        pace = self._table.pop(host, None)
        if pace is None:
            pace = AddressPace(RateSlots(self._rate_per_s, self._burst))
            while len(self._table) >= self._addresses_max:
                del self._table[next(iter(self._table))]
        self._table[host] = pace
        return pace

    def reserve(self, host: str, now_s: float) -> float:
        """When a new connection from `host` may start its handshake."""
        pace = self._touch(host)
        return max(pace.slots.reserve(now_s), pace.blocked_until_s)

    def failed(self, host: str, now_s: float) -> float | None:
        """One failure; returns the back-off period (ms) if this one starts one."""
        pace = self._touch(host)
        pace.failures += 1
        over = pace.failures - self._failures_before_backoff + 1
        if over < 1:
            return None
        pace.backoff_ms = self._backoff.delay_ms(over, _NO_JITTER)
        pace.blocked_until_s = now_s + pace.backoff_ms / 1000
        pace.slots.push_back(pace.blocked_until_s)
        return pace.backoff_ms

    def succeeded(self, host: str) -> None:
        pace = self._table.get(host)
        if pace is not None:
            pace.failures = 0


class _NoJitter:
    def uniform(self, a: float, b: float) -> float:
        return 1.0


_NO_JITTER = _NoJitter()
