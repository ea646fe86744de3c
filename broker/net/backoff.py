"""One retry back-off policy for the client and for peer channels.

Exponential from ``base_ms``, doubling per consecutive failure, capped at
``max_ms``, then spread by ±``jitter`` so that many retriers that failed
together do not come back together. Pure: the caller passes the attempt
number and a random source (``random`` itself, or a seeded
``random.Random``), and sleeps or schedules by the result.

The listener's refusal of addresses that keep failing (``metalog.broker.net.server``'s
``failed_connection_backoff_ms``) is a penalty imposed on others, not a
retry of our own, and keeps its own rule.
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
