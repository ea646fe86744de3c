"""GC pauses are measured (broker/gc_watch.py): every collection of
generation 1 or 2 lands in the histogram under its generation, a slow one is
one gc_pause event, and young collections (microseconds, thousands a
second) are not timed."""

import gc

import structlog
from prometheus_client import CollectorRegistry, Histogram

from broker.gc_watch import GcWatch


def sample(reg, generation):
    return reg.get_sample_value("pauses_seconds_count", {"generation": generation}) or 0


def test_each_collection_is_timed_by_generation_and_slow_ones_are_logged():
    reg = CollectorRegistry()
    hist = Histogram("pauses_seconds", "t", ["generation"], registry=reg)
    with structlog.testing.capture_logs() as events:
        w = GcWatch(hist, structlog.get_logger("t"), slow_ms=0)  # every pause counts as slow
        w.install()
        try:
            gc.collect(2)
            gc.collect(1)
            gc.collect(0)
        finally:
            w.remove()
        # (automatic collections may add to the counts while installed)
        full, middle = sample(reg, "2"), sample(reg, "1")
        gc.collect(2)  # removed: not counted
    assert full >= 1 and middle >= 1 and sample(reg, "2") == full and sample(reg, "0") == 0
    pauses = [e for e in events if e["event"] == "gc_pause"]
    assert {2, 1} <= {e["generation"] for e in pauses} and all(e["seconds"] >= 0 for e in pauses)
    assert 0 not in {e["generation"] for e in pauses}
    assert len(pauses) == full + middle
    assert w._callback not in gc.callbacks


def test_a_fast_collection_is_not_an_event():
    reg = CollectorRegistry()
    hist = Histogram("pauses_seconds", "t", ["generation"], registry=reg)
    with structlog.testing.capture_logs() as events:
        w = GcWatch(hist, structlog.get_logger("t"), slow_ms=60_000)
        w.install()
        try:
            gc.collect(1)
        finally:
            w.remove()
    assert sample(reg, "1") >= 1 and not [e for e in events if e["event"] == "gc_pause"]
