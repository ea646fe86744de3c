"""The client's timeouts and errors against real brokers (TLS on, the launcher's
`admin` certificate): a frozen leader blocks a default client no longer than
the election plus one attempt, and gets that one attempt only; a permanent refusal fails at once with its
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
from metalog.broker.quorum.api import QuorumConfig
from metalog.protocol.apis import ApiKey
from metalog.protocol.errors import Errors
from metalog.tools.cluster.launcher import REPO_ROOT

pytestmark = pytest.mark.slow


def metalog(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "metalog.tools.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60)


class RecordingChannels:
    """Records every request a client sends, as (monotonic time in s, port,
    api key name): the client's own channels, wrapped where it makes them."""

    def __init__(self, client: MetalogClient):
        self.sent: list[tuple[float, int, str]] = []
        make = client._channel
        sent = self.sent

        class Recording:
            def __init__(self, addr):
                self._addr = addr

            async def request(self, api_key, body, timeout_ms):
                sent.append((time.monotonic(), self._addr[1], ApiKey(api_key).name))
                return await make(self._addr).request(api_key, body, timeout_ms)

        client._channel = Recording

    def to(self, port: int) -> list[tuple[float, str]]:
        return [(t, api) for t, p, api in self.sent if p == port]


def elected_at_s(cluster, epoch: int) -> float:
    """Wall-clock time at which a broker logged that it leads `epoch`."""
    (ts,) = [ln["ts"] for n in cluster.nodes for ln in cluster.read_log_lines(n)
             if ln.get("event") == "role_changed" and ln.get("role") == "leader" and ln.get("epoch") == epoch]
    return ts


SHORT_ATTEMPT_MS = 700  # below the ~1 s an election takes here (fetch_timeout_ms passes first)


async def test_a_frozen_leader_blocks_a_default_client_no_longer_than_election_plus_one_attempt(make_cluster):
    """A default client producing while the leader is frozen (SIGSTOP): its
    attempt at the frozen leader times out, and that one attempt is all the
    frozen leader gets (no Metadata either: it is asked last); the client
    finds the new leader by the others' metadata and commits there within one
    attempt of the election, measured from the new leader's own log.

    The rule behind it (a broker whose attempt timed out is not sent to again
    at that epoch for one request timeout; metadata is polled instead) only
    shows when an attempt is shorter than the election, so a second client
    with SHORT_ATTEMPT_MS attempts produces under the same freeze: any two of
    its requests to the frozen leader are at least two attempts apart."""
    cluster = make_cluster(voters=3)  # the product's default timeouts
    leader, epoch = await asyncio.to_thread(cluster.wait_for_leader, 30)
    client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls())  # defaults
    short = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls(),
                          request_timeout_ms=SHORT_ATTEMPT_MS)
    frozen_port = cluster.nodes[leader].port
    try:
        await client.produce([b"warm-up"])
        await short.produce([b"warm-up-short"])
        seen, seen_short = RecordingChannels(client), RecordingChannels(short)

        async def timed(c: MetalogClient, value: bytes) -> tuple[int, float]:
            started = time.monotonic()
            _offset, new_epoch = await c.produce([value])
            return new_epoch, (time.monotonic() - started) * 1000

        cluster.signal(leader, signal.SIGSTOP)
        frozen_at_s = time.time()
        (new_epoch, blocked_ms), (short_epoch, _) = await asyncio.gather(
            timed(client, b"while-frozen"), timed(short, b"while-frozen-short"))
    finally:
        cluster.signal(leader, signal.SIGCONT)
        await client.close()
        await short.close()
    assert new_epoch > epoch and short_epoch > epoch, "the records were committed by the new leader"
    elected_ms = (elected_at_s(cluster, new_epoch) - frozen_at_s) * 1000
    q = QuorumConfig(node_id=leader, voters=tuple(cluster.nodes), cluster_id=cluster.cluster_id)  # its defaults
    # Followers notice the silent leader after fetch_timeout_ms and elect within two
    # election timeouts; then one attempt (request_timeout_ms) at most, plus one
    # metadata poll and process slack on a shared 2-core machine.
    one_attempt_ms = client.request_timeout_ms + client.retry_backoff_ms * 1.2 + 1000
    bound_ms = q.fetch_timeout_ms + 2 * q.election_timeout_ms + one_attempt_ms
    short_times = [t for t, api in seen_short.to(frozen_port) if api == "PRODUCE"]
    short_gaps_ms = [round((b - a) * 1000) for a, b in zip(short_times, short_times[1:])]
    print(f"produce blocked {blocked_ms:.0f} ms by a frozen leader (bound {bound_ms:.0f} ms), the election "
          f"took {elected_ms:.0f} ms; sent to the frozen leader: {[api for _, api in seen.to(frozen_port)]}; "
          f"by the {SHORT_ATTEMPT_MS} ms client: {len(short_times)} produce attempts, gaps {short_gaps_ms} ms")
    assert blocked_ms < bound_ms
    assert blocked_ms < elected_ms + one_attempt_ms, "more than one attempt after the measured election"
    # One attempt, not one per retry: the attempt that timed out is the only
    # request the frozen leader got; the rediscovery asked the others.
    assert [api for _, api in seen.to(frozen_port)] == ["PRODUCE"]
    # Its timeout, then one request timeout as a suspect (50 ms for the loop's clock).
    assert all(gap >= 2 * SHORT_ATTEMPT_MS - 50 for gap in short_gaps_ms), short_gaps_ms
    assert not [api for _, api in seen_short.to(frozen_port) if api != "PRODUCE"]


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
