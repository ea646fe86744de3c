"""GC pauses are measured (broker/server/gc_watch.py): every collection of
generation 1 or 2 lands in the histogram under its generation, a slow one is
one gc_pause event, and young collections (microseconds, hundreds a
second) are not timed. A broker sets its young threshold from the config."""

import gc

import pytest
import structlog
from prometheus_client import CollectorRegistry, Histogram

from metalog.broker.server.config import ConfigError, config_from_dict
from metalog.broker.server.gc_watch import GcWatch
from metalog.broker.server.runtime import Broker
from metalog.tools.cluster.launcher import free_ports


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


def test_install_sets_the_young_threshold_and_keeps_the_older_ones():
    before = gc.get_threshold()
    w = GcWatch(Histogram("p_seconds", "t", ["generation"], registry=CollectorRegistry()), structlog.get_logger("t"))
    try:
        w.install(young_threshold=12_345)
        assert gc.get_threshold() == (12_345, before[1], before[2])
    finally:
        w.remove()
        gc.set_threshold(*before)


@pytest.mark.asyncio
async def test_a_started_broker_collects_young_objects_at_its_configured_threshold(tmp_path):
    before = gc.get_threshold()
    port, = free_ports(1)
    base = {"node_id": 1, "cluster_id": "gc-test", "data_dir": str(tmp_path / "d"),
            "listen": f"127.0.0.1:{port}", "voters": f"1@127.0.0.1:{port}", "security_protocol": "PLAINTEXT"}
    assert config_from_dict(base).gc_young_threshold == 10_000  # the default
    with pytest.raises(ConfigError, match="gc_young_threshold.*must be > 0"):
        config_from_dict({**base, "gc_young_threshold": 0})
    cfg = config_from_dict({**base, "gc_young_threshold": 4321})
    broker = Broker(cfg, structlog.get_logger("test"))
    try:
        await broker.start()
        assert gc.get_threshold() == (4321, before[1], before[2])
    finally:
        await broker.stop()
        gc.set_threshold(*before)
