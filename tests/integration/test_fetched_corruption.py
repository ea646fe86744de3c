"""A damaged batch in a fetch answer (issue 15, integrity loose end): the core
drops it and fetches it again (tests/quorum/test_follower.py); the runtime
logs one structured warning per batch, at most one per second (the rest are
counted in the next one's `suppressed`), and counts every one in
metalog_corrupt_batches_total{source="fetched"}. Nothing on disk is damaged:
no quarantine, /health stays ok. A real broker (one voter, real files), the
action fed as the core emits it."""

from __future__ import annotations

import asyncio
import time

import pytest
import structlog
from structlog.testing import capture_logs

from metalog.broker.server import corruption
from metalog.broker.server.config import config_from_dict
from metalog.broker.quorum import api as qa
from metalog.broker.server.runtime import Broker
from metalog.tools.cluster.launcher import free_ports


async def _started_broker(tmp_path) -> Broker:
    port, = free_ports(1)
    cfg = config_from_dict({"node_id": 1, "cluster_id": "fetched-corrupt", "data_dir": str(tmp_path / "d"),
                            "listen": f"127.0.0.1:{port}", "voters": f"1@127.0.0.1:{port}",
                            "election_timeout_ms": 200, "security_protocol": "PLAINTEXT"})
    broker = Broker(cfg, structlog.get_logger("test"))
    await broker.start()
    deadline = time.monotonic() + 10
    while not (str(broker.core.role) == "leader" and broker.core.high_watermark):
        assert time.monotonic() < deadline, "single voter did not become leader"
        await asyncio.sleep(0.02)
    return broker


@pytest.mark.asyncio
async def test_a_damaged_fetched_batch_is_one_rate_limited_warning_and_counted(tmp_path):
    broker = await _started_broker(tmp_path)
    count = lambda: broker.metrics.registry.get_sample_value(  # noqa: E731
        "metalog_corrupt_batches_total", {"source": "fetched"})
    reason = "CRC mismatch: stored 0x00000001, computed 0x00000002"
    try:
        assert count() == 0
        end = broker.seg_log.log_end_offset
        with capture_logs() as logs:
            for _ in range(3):  # the same damage answered three times in a row
                broker._execute(qa.FetchedBatchCorrupt(13, 6, reason))
            warned = [e for e in logs if e["event"] == "fetched_batch_corrupt"]
            assert warned == [{"event": "fetched_batch_corrupt", "log_level": "warning", "node": 1,
                               "leader_id": 1, "epoch": 6, "offset": 13, "reason": reason,
                               "suppressed": 0, "action": "dropped; fetching it again"}]
            assert count() == 3
            # A second later the next one is logged, saying how many were not.
            broker.corruption.fetched_warned_ms -= corruption.FETCHED_CORRUPT_WARN_INTERVAL_MS
            broker._execute(qa.FetchedBatchCorrupt(20, 6, reason))
            warned = [e for e in logs if e["event"] == "fetched_batch_corrupt"]
            assert [(e["offset"], e["suppressed"]) for e in warned] == [(13, 0), (20, 2)]
            assert count() == 4
            assert not [e for e in logs if e["event"] in ("corruption_detected", "log_quarantined")]
        assert broker.health_problems == {} and broker.seg_log.log_end_offset == end
    finally:
        await broker.stop()
