"""A real broker under a TLS handshake flood (issue 34 items 3 and 4).

A 1-voter TLS cluster; an attacker process (metalog.tools.bench.hostile's
flood) opens 600 new connections a second from 127.0.2.x, each replaying a
ClientHello, for a few seconds. Meanwhile an established client keeps
committing: every commit must be answered within a deadline, with no error.
Afterwards the broker's log holds a bounded number of refusal lines with the
counts in summary lines, and its metrics show the handshakes it paced and the
windows in which the kernel dropped the strangers' SYNs.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from metalog.broker.client import MetalogClient
from metalog.tools.cluster import certs
from metalog.tools.cluster.launcher import REPO_ROOT

pytestmark = pytest.mark.slow

FLOOD_PER_S = 600
FLOOD_S = 6.0
COMMIT_DEADLINE_S = 2.0  # a starved loop would miss it; an idle commit takes milliseconds
FAST = dict(election_timeout_ms=300, fetch_timeout_ms=800, request_timeout_ms=800, fetch_max_wait_ms=100)


def metric(cluster, node: int, name: str) -> float:
    url = f"{cluster.admin_scheme}://{cluster.node_host(node)}:{cluster.nodes[node].admin_port}/metrics"
    with urllib.request.urlopen(url, timeout=10, context=cluster.client_tls().client()) as resp:
        text = resp.read().decode()
    found = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


async def commit_during(cluster, until_s: float) -> list[float]:
    """Commit one record after another until `until_s`; each commit's seconds."""
    client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls(),
                           request_timeout_ms=10_000)
    took: list[float] = []
    try:
        await client.produce([b"warm"])
        while time.monotonic() < until_s:
            t0 = time.monotonic()
            await asyncio.wait_for(client.produce([b"x" * 100]), COMMIT_DEADLINE_S)
            took.append(time.monotonic() - t0)
    finally:
        await client.close()
    return took


def test_an_established_client_is_answered_through_a_handshake_flood(make_cluster, tmp_path):
    cluster = make_cluster(voters=1, refusal_log_interval_ms=2000, refusal_log_lines_max=3, **FAST)
    cluster.wait_for_leader(20)
    bad = str(tmp_path / "other-ca")
    certs.init_ca(bad, name="attacker-ca")
    certs.issue_user(bad, bad, "mallory")
    handshakes_before = metric(cluster, 1, "metalog_tls_handshakes_total")
    attacker = subprocess.Popen(
        [sys.executable, "-m", "metalog.tools.bench.hostile", "attacker", "flood", cluster.host,
         str(cluster.nodes[1].port), str(FLOOD_PER_S), str(FLOOD_S), bad],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        time.sleep(1.0)  # a fixed warm-up of the attack, not a wait for a condition
        took = asyncio.run(commit_during(cluster, time.monotonic() + FLOOD_S - 2.0))
    finally:
        out, _ = attacker.communicate(timeout=60)
    assert attacker.returncode == 0, out
    # every commit answered within the deadline (wait_for raised otherwise), and many of them
    assert len(took) >= 20 and max(took) < COMMIT_DEADLINE_S
    # the flood reached the broker and its handshakes were paced, not all started at once
    handshakes = metric(cluster, 1, "metalog_tls_handshakes_total") - handshakes_before
    assert handshakes >= 10
    delayed = metric(cluster, 1, 'metalog_listener_connections_delayed_total{listener="binary",'
                                 'reason="handshake_budget"}')
    assert delayed > 0
    # and the queue filled: the kernel dropped strangers' SYNs for a while (metalog.broker.net.syn_filter)
    assert metric(cluster, 1, 'metalog_listener_syn_sheds_total{listener="binary"}') > 0
    # thousands of failed handshakes, a bounded number of log lines: a few per interval, then a summary
    def summaries():
        return [e for e in cluster.read_log_lines(1) if e.get("event") == "connection_refusals_summary"
                and e.get("reason") == "tls_handshake_failed"]
    cluster.wait_for(summaries, 15, "a summary of the failed handshakes")
    failed_lines = [e for e in cluster.read_log_lines(1) if e.get("event") == "tls_handshake_failed"]
    intervals = len(summaries()) + 1
    assert len(failed_lines) <= 3 * intervals + 3
    # every failure is told: in a full line or in a summary's count of the lines not written
    assert sum(s["not_logged"] for s in summaries()) + len(failed_lines) >= handshakes / 2
    assert all(s["first_address"].startswith("127.0.2.") for s in summaries())
