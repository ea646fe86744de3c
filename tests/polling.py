"""Waiting for a condition with a deadline, the suite's one way (never a bare sleep)."""

from __future__ import annotations

import time
from typing import Any, Callable


def await_value(what: str, check: Callable[[], Any], deadline_s: float, interval_s: float = 0.05) -> Any:
    """check() until its value is truthy (returned), or fail naming `what`
    and the last value seen once `deadline_s` has passed."""
    end = time.monotonic() + deadline_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {deadline_s:.0f} s (last seen: {value!r})")
        time.sleep(interval_s)
