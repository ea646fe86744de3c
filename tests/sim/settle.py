"""Waiting for a simulated cluster to settle: one leader, every live node at its HW."""

from __future__ import annotations

from metalog.sim.cluster import SimCluster


def settled(c: SimCluster) -> bool:
    lead = c.current_leader()
    if lead is None:
        return False
    hw = lead.core.high_watermark
    return hw == lead.core.log_end_offset and all(
        n.core.high_watermark == hw for n in c.nodes.values() if n.alive and not n.paused)


def wait_settled(c: SimCluster, within_ms: int = 10000):
    c.run_until_true(lambda: settled(c), within_ms, "a leader with every node caught up")
    return c.current_leader()
