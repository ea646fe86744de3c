"""The runtime's two clocks, in one place so that the runtime and the admin API
read the same ones (the pure core gets time only through its events)."""

from __future__ import annotations

import time


def now_ms() -> int:
    """The core's clock: monotonic, so timers survive wall-clock jumps."""
    return int(time.monotonic() * 1000)


def wall_clock_ms() -> int:
    """What record batches are stamped with (ListOffsets by timestamp)."""
    return int(time.time() * 1000)


class SystemClock:
    """These two clocks as the core's Environment carries them
    (metalog.broker.quorum.env.Clock); the simulator passes its fake one instead."""

    now_ms = staticmethod(now_ms)
    wall_clock_ms = staticmethod(wall_clock_ms)
