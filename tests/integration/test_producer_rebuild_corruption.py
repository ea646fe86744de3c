"""The producer state is rebuilt at boot from the log with every CRC checked
(issue 15, integrity loose end). After a clean stop the log's open trusts the
indexes of sealed segments, so a bit flipped in the middle of one is first
read by this rebuild: the user sees one `corruption_detected` event with
source `producer_state`, the file, the offset and both CRCs; the log is
quarantined from that batch (`log_quarantined`, the segment kept as
*.corrupt) and the producer table ends before it. A real broker in this
process, real files; its two fellow voters are absent (it never leads)."""

from __future__ import annotations

import os

import pytest
import structlog
from structlog.testing import capture_logs

from metalog.broker.server.config import config_from_dict
from metalog.broker.server.runtime import Broker
from metalog.storage import batch as b
from metalog.storage.segments import SegmentedLog
from metalog.tools.cluster.launcher import free_ports

PART = "__cluster_metadata-0"


def _config(tmp_path, ports):
    return config_from_dict({
        "node_id": 1, "cluster_id": "producer-rebuild", "data_dir": str(tmp_path / "d"),
        "listen": f"127.0.0.1:{ports[0]}",
        "voters": ",".join(f"{i + 1}@127.0.0.1:{p}" for i, p in enumerate(ports)),
        "security_protocol": "PLAINTEXT", "log_scrub_bytes_per_s": 0})


@pytest.mark.asyncio
async def test_a_damaged_batch_read_by_the_boot_time_producer_rebuild_is_quarantined(tmp_path):
    ports = free_ports(3)
    cfg = _config(tmp_path, ports)
    broker = Broker(cfg, structlog.get_logger("test"))
    await broker.start()  # binds the dir (meta.properties); an empty log
    await broker.stop()

    # Idempotent batches in 16 KiB segments (index entries every 4 KiB), closed cleanly.
    part = os.path.join(cfg.data_dir, PART)
    log = SegmentedLog.open(part, segment_bytes_max=16 << 10)
    offset = 0
    for i in range(300):
        log.append(b.encode_batch(offset, 1, [b"v" * 150], 1000 + i, producer_id=7, producer_epoch=0,
                                  base_sequence=i))
        offset += 1
    log.flush()
    log.close()
    segs = sorted(n for n in os.listdir(part) if n.endswith(".log"))
    assert len(segs) >= 3
    victim = os.path.join(part, segs[1])
    with open(victim, "r+b") as fh:
        data = fh.read()
        pos, h = list(b.iter_batches(data))[3]  # well before the segment's last index entry
        fh.seek(pos + b.HEADER_SIZE + 10)
        fh.write(bytes([data[pos + b.HEADER_SIZE + 10] ^ 0x08]))
    bad = h.base_offset

    broker = Broker(cfg, structlog.get_logger("test"))
    with capture_logs() as logs:
        await broker.start()
    try:
        found = [e for e in logs if e["event"] == "corruption_detected"]
        assert len(found) == 1, found
        ev = found[0]
        assert (ev["source"], ev["file"], ev["offset"]) == ("producer_state", victim, bad)
        assert ev["expected_crc"] != ev["actual_crc"]
        assert [e["event"] for e in logs if e["event"] == "log_quarantined"] == ["log_quarantined"]
        assert not [e for e in logs if e["event"] == "fatal"]
        assert broker.seg_log.log_end_offset == bad, "cut at the damaged batch, to be fetched again"
        assert os.path.exists(victim + ".corrupt")
        # The table never names a batch past the cut: a retry of one would be
        # answered with an offset the log no longer holds.
        table = broker.producers.table
        assert table.end_offset <= bad
        assert all(meta.last_offset < bad for e in table.producers.values() for meta in e.batches)
        assert broker.metrics.registry.get_sample_value(
            "metalog_corrupt_batches_total", {"source": "producer_state"}) == 1
        assert "quarantine" in broker.health_problems
    finally:
        await broker.stop()
