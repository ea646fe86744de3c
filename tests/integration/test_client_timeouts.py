"""The client's timeouts and errors against real brokers (TLS on, the launcher's
`admin` certificate): a frozen leader blocks a default client no longer than
the election plus one attempt; a permanent refusal fails at once with its
message; many records go in bounded requests; the CLI prints one line for
every failure (the traceback only with --debug)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import pytest

from metalog.broker.client import MetalogClient, MetalogError
from metalog.broker.client.client import RETRY_BACKOFF_MAX_MS
from metalog.broker.quorum.api import QuorumConfig
from metalog.protocol.errors import Errors
from metalog.tools.cluster.launcher import REPO_ROOT

pytestmark = pytest.mark.slow


def metalog(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "metalog.tools.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60)


async def test_a_frozen_leader_blocks_a_default_client_no_longer_than_election_plus_one_attempt(make_cluster):
    cluster = make_cluster(voters=3)  # the product's default timeouts
    leader, epoch = await asyncio.to_thread(cluster.wait_for_leader, 30)
    client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls())  # defaults
    try:
        await client.produce([b"warm-up"])
        cluster.signal(leader, signal.SIGSTOP)
        started = time.monotonic()
        offset, new_epoch = await client.produce([b"while-frozen"])
        blocked_ms = (time.monotonic() - started) * 1000
    finally:
        cluster.signal(leader, signal.SIGCONT)
        await client.close()
    q = QuorumConfig(node_id=leader, voters=tuple(cluster.nodes), cluster_id=cluster.cluster_id)  # its defaults
    # Followers notice the silent leader after fetch_timeout_ms and elect within two
    # election timeouts; then one attempt (request_timeout_ms) at most, plus one
    # metadata poll and process slack on a shared 2-core machine.
    election_ms = q.fetch_timeout_ms + 2 * q.election_timeout_ms
    bound_ms = election_ms + client.request_timeout_ms + client.retry_backoff_ms * 1.2 + 1000
    print(f"produce blocked {blocked_ms:.0f} ms by a frozen leader (bound {bound_ms:.0f} ms)")
    assert new_epoch > epoch, "the record was committed by the new leader"
    assert blocked_ms < bound_ms
    # The old rule (one attempt = request timeout + slack, then again at the frozen
    # leader) could not meet this: the bound is below two full attempts after the election.
    assert bound_ms < election_ms + 2 * client.request_timeout_ms + RETRY_BACKOFF_MAX_MS


async def test_a_permanent_refusal_fails_at_once_with_its_message(make_cluster):
    """Fencing an unknown broker: exit 1 and one line naming the broker, no retries."""
    cluster = make_cluster(voters=3)
    await asyncio.to_thread(cluster.wait_for_leader, 30)
    client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls())
    try:
        started = time.monotonic()
        with pytest.raises(MetalogError) as info:
            await client.command("fence_broker", broker_id=99)
        assert time.monotonic() - started < client.retry_backoff_ms / 1000 + 1.0  # not retried
        assert info.value.error_code == Errors.BROKER_NOT_AVAILABLE
    finally:
        await client.close()
    out = await asyncio.to_thread(metalog, "brokers", "fence", "99", "--client-config", cluster.client_config_path)
    assert out.returncode == 1
    assert out.stderr.strip() == "metalog: fence_broker refused: BROKER_NOT_AVAILABLE: unknown broker 99"


async def test_many_records_go_in_requests_bounded_by_max_request_bytes(make_cluster):
    cluster = make_cluster(voters=3)
    await asyncio.to_thread(cluster.wait_for_leader, 30)
    client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls(),
                           max_request_bytes=4096)
    values = [f"{i:04d}".encode() * 50 for i in range(100)]  # 200 bytes each, 20 KB in all
    chunks = client.split_requests(values)
    assert len(chunks) >= 5 and [v for c in chunks for v in c] == values
    sent: list[int] = []
    original = client._leader_request

    async def counting(api_key, make_body, *a, **kw):
        body = make_body()
        if hasattr(body, "records"):
            sent.append(sum(len(v) for v in body.records))
        return await original(api_key, make_body, *a, **kw)

    client._leader_request = counting
    try:
        base, _ = await client.produce(values)
        consumer = client.consumer()
        consumer.seek(base)
        got = []
        deadline = time.monotonic() + 20
        while len(got) < len(values) and time.monotonic() < deadline:
            got += [r.value for r in await consumer.poll(max_wait_ms=200)]
        with pytest.raises(MetalogError) as info:
            await client.produce([b"x" * 5000])
    finally:
        await client.close()
    assert len(sent) == len(chunks) and max(sent) <= 4096
    assert got[:len(values)] == values, "every record, in order, from the first base offset on"
    assert info.value.error_code == Errors.MESSAGE_TOO_LARGE and "record 0 has 5000 bytes" in str(info.value)


def test_an_unexpected_cli_failure_is_one_line_and_debug_shows_the_traceback():
    """A bootstrap with a bad port: one line naming the error (exit 1); --debug adds the traceback."""
    out = metalog("produce", "--insecure", "--bootstrap", "127.0.0.1:notaport", "x")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "metalog: --insecure: plaintext, no client certificate",
        "metalog: error: ValueError: invalid literal for int() with base 10: 'notaport' "
        "(run again with --debug for the traceback)"]
    out = metalog("produce", "--insecure", "--bootstrap", "127.0.0.1:notaport", "x", "--debug")
    assert out.returncode == 1
    assert "Traceback (most recent call last)" in out.stderr
    assert out.stderr.strip().splitlines()[-1] == ("metalog: error: ValueError: invalid literal for int() "
                                                    "with base 10: 'notaport'")
