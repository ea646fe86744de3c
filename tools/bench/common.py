"""What the real-process benches share (tools/bench/bench.py, tools/bench/catchup.py):
the bench clusters' id and how one is made, and latency percentiles. Its own
module so that ``metalog bench`` can dispatch to the scale benches, which
use these too, without an import cycle."""

from __future__ import annotations

from typing import Any

from metalog.tools.cluster.launcher import LocalCluster

CLUSTER_ID = "metalog-bench"


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending list (q in 0..100)."""
    if not sorted_values:
        return None
    rank = max(1, -(-len(sorted_values) * q // 100))  # ceil
    return sorted_values[int(min(rank, len(sorted_values))) - 1]


def latency_summary_ms(latencies_us: list[int]) -> dict[str, Any]:
    vals = sorted(latencies_us)
    out: dict[str, Any] = {"samples": len(vals)}
    for name, q in (("p50_ms", 50), ("p99_ms", 99), ("p99_9_ms", 99.9), ("max_ms", 100)):
        v = percentile(vals, q)
        out[name] = None if v is None else round(v / 1000, 3)
    return out


def metalog_cluster(root: str, voters: int = 3, observers: int = 0, insecure: bool = False,
                    cert_dir: str | None = None, **common) -> LocalCluster:
    """Mutual TLS unless `insecure`; `cert_dir` shares one CA across the run (etcd's too)."""
    cluster = LocalCluster.create(root, voters=voters, observers=observers, cluster_id=CLUSTER_ID,
                                  common={"log_level": "warning", **common}, insecure=insecure)
    if cert_dir:
        cluster.cert_dir = cert_dir
    return cluster
