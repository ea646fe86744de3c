"""The one door through which time and randomness reach the quorum core.

A driver builds one ``Environment`` per core: the runtime with the system
clock and a fresh ``random.Random()``, the simulator with its fake clock and a
seeded ``random.Random`` (so a seed replays exactly). The core draws its random
numbers (election timeouts, backoffs, request ids) from ``env.random`` only and
never reads ``env.clock``: time reaches it on the events (``now_ms``), which
the driver stamps from ``env.clock``. Nothing here calls a clock itself.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

# The type of the core's randomness, for the modules that annotate with it
# (only this module imports `random`).
Random = random.Random


class Clock(Protocol):
    def now_ms(self) -> int:
        """Monotonic milliseconds: what timers run on (survives wall-clock jumps)."""
        ...

    def wall_clock_ms(self) -> int:
        """Milliseconds since the Unix epoch: what record batches are stamped with."""
        ...


@dataclass(frozen=True, slots=True)
class Environment:
    clock: Clock
    random: random.Random
