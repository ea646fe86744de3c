"""Cyclic garbage-collector pauses, measured (issue 19 item 2).

A collection runs on whichever thread allocates when a threshold is crossed,
and holds the GIL throughout: on the event loop's thread it is a stall of the
quorum. A full collection walks every tracked object that is not frozen, so
its cost grows with the heap (about 70 ms at 2M partitions before the state
was frozen and split by topic). ``GcWatch`` times each collection through
``gc.callbacks``: every pause of generation 1 or 2 goes into
``metalog_gc_pause_seconds`` by generation, and one of at least ``slow_ms``
is also a ``gc_pause`` log event, so a latency spike can be matched with the
collection behind it. Young (generation 0) collections run hundreds of
times a second under load and take microseconds: timing them would cost
about 3 us each, so they are skipped.

``install`` also sets how many net new objects start a young collection
(``gc_young_threshold``, 10,000 against Python's 700). Most objects of a
request die with it: collected 700 at a time, the survivors of every
in-flight request were walked again and again, and the 1000-client bench
ran 6-7% faster with the higher threshold (docs/bench.md).
"""

from __future__ import annotations

import gc
import time
from typing import Any

SLOW_GC_PAUSE_MS = 10.0


class GcWatch:
    def __init__(self, histogram: Any, log: Any, slow_ms: float = SLOW_GC_PAUSE_MS) -> None:
        if slow_ms < 0:
            raise ValueError(f"slow_ms must be >= 0, got {slow_ms}")
        self._histogram = histogram  # labelled by generation
        self._log = log
        self._slow_s = slow_ms / 1000
        self._started_s: float | None = None

    def install(self, young_threshold: int | None = None) -> None:
        """Time collections from now on; with `young_threshold`, also set
        the first gc threshold (the older generations keep theirs)."""
        if young_threshold is not None:
            if young_threshold <= 0:
                raise ValueError(f"gc_young_threshold must be > 0, got {young_threshold}")
            _young, older, oldest = gc.get_threshold()
            gc.set_threshold(young_threshold, older, oldest)
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def remove(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if info["generation"] == 0:
            return
        if phase == "start":
            self._started_s = time.perf_counter()
            return
        if self._started_s is None:  # installed mid-collection
            return
        seconds = time.perf_counter() - self._started_s
        self._started_s = None
        generation = info["generation"]
        self._histogram.labels(generation=str(generation)).observe(seconds)
        if seconds >= self._slow_s:
            self._log.info("gc_pause", generation=generation, seconds=round(seconds, 4),
                           collected=info.get("collected"), frozen_objects=gc.get_freeze_count())
