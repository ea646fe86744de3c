"""What a user sees when they give a real broker bad input: bad config values,
a data dir from another cluster, a wrong cluster id or a non-voter on the wire,
an unknown api or version, a huge length, random or mutated Kafka frames on
the `listen` port (Kafka's controller listener): Kafka's answer where Kafka
has one, else the connection closed, and the broker keeps serving everyone
else."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import struct
import subprocess
import sys

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from metalog.broker.client import MetalogClient
from metalog.broker.net.channel import PeerChannel
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.protocol.errors import Errors
from metalog.protocol.kafka import edge, wire
from metalog.protocol.kafka import messages as km
from metalog.tools.cluster.launcher import REPO_ROOT

pytestmark = pytest.mark.slow

FAST = dict(election_timeout_ms=300, fetch_timeout_ms=800, request_timeout_ms=800, fetch_max_wait_ms=100)
# The fuzz test sends many bad frames from one address on purpose: no back-off for it here.
NO_BACKOFF = dict(failed_connections_before_backoff=1_000_000)


def run_broker(config: dict, tmp_path) -> subprocess.CompletedProcess:
    path = tmp_path / "broker.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.run([sys.executable, "-m", "metalog.broker.server.main", "--config", str(path)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)


def base_config(tmp_path) -> dict:
    from metalog.tools.cluster.certs import cluster_certs

    certs = tmp_path / "certs"
    cluster_certs(str(certs), {1: ["127.0.0.1"]}, users=())
    return {"node_id": 1, "cluster_id": "c1", "data_dir": str(tmp_path / "data"),
            "listen": "127.0.0.1:0", "voters": "1@127.0.0.1:1", "ssl_ca_file": str(certs / "ca.crt"),
            "ssl_cert_file": str(certs / "node-1.crt"), "ssl_key_file": str(certs / "node-1.key")}


@pytest.mark.parametrize("key, value, expected", [
    ("node_id", "one", "node_id: Expected `int`, got `str`"),
    ("voters", "1@nohost", "voters: expected host:port, got 'nohost'"),
    ("election_timeout_ms", -5, "election_timeout_ms: must be > 0, got -5"),
    ("fetch_max_wait_ms", 5000, "fetch_max_wait_ms: must be below fetch_timeout_ms (1000), got 5000"),
    ("no_such_key", 1, "Object contains unknown field `no_such_key`"),
])
def test_bad_config_value_fails_at_start_naming_the_key(tmp_path, key, value, expected):
    cfg = base_config(tmp_path)
    cfg[key] = value
    result = run_broker(cfg, tmp_path)
    assert result.returncode == 2
    assert "metalog: config error:" in result.stderr
    assert expected in result.stderr


def test_data_dir_of_another_cluster_is_refused_at_boot(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "meta.properties").write_text("version=1\ncluster.id=other\nnode.id=1\n")
    result = run_broker(base_config(tmp_path), tmp_path)
    assert result.returncode == 3
    assert "belongs to cluster 'other' but the config says 'c1'" in result.stderr
    # Nothing was written into the foreign data dir.
    assert sorted(os.listdir(data)) == ["meta.properties"]


def test_a_malformed_directory_id_is_refused_at_boot(tmp_path):
    """The user sees exit 3 and "directory.id 'nope' is not a directory id";
    meta.properties is left as it was."""
    data = tmp_path / "data"
    data.mkdir()
    text = "version=1\ncluster.id=c1\nnode.id=1\ndirectory.id=nope\n"
    (data / "meta.properties").write_text(text)
    result = run_broker(base_config(tmp_path), tmp_path)
    assert result.returncode == 3
    assert "directory.id 'nope' is not a directory id" in result.stderr
    assert (data / "meta.properties").read_text() == text
    assert sorted(os.listdir(data)) == ["meta.properties"]


async def test_wrong_cluster_id_and_non_voter_requests_are_refused_on_the_wire(make_cluster):
    cluster = make_cluster(voters=1, **FAST)
    await asyncio.to_thread(cluster.wait_for_leader, 20)
    host, port = cluster.bootstrap()[0]
    ch = PeerChannel(host, port, tls=cluster.client_tls())
    try:
        # Kafka's Produce carries no cluster id; our ControllerCommand extension does.
        command = m.ControllerCommandRequest(cluster_id="wrong", command="list_acls")
        resp = await ch.request(ApiKey.CONTROLLER_COMMAND, command, 5000)
        assert resp.error_code == Errors.INCONSISTENT_CLUSTER_ID
        # The same check and message as the core's (metalog.broker.quorum.answers.check_cluster_id).
        assert resp.error_message == f"cluster id 'wrong' does not match ours {cluster.cluster_id!r}"
        vote = m.VoteRequest(cluster_id=cluster.cluster_id, candidate_epoch=99, candidate_id=42,
                             last_offset_epoch=99, last_offset=10**9)
        resp = await ch.request(ApiKey.VOTE, vote, 5000)
        # The authorizer answers before the core's voter-set check: a user
        # certificate (even the super user's) never votes, and node 42 is no voter.
        assert resp.error_code == Errors.CLUSTER_AUTHORIZATION_FAILED
        assert not resp.vote_granted
    finally:
        await ch.close()
    # The refused vote did not disturb the quorum: same leader, same epoch.
    q = cluster.quorum(1)
    assert q["role"] == "leader" and q["epoch"] < 99


def _valid_frames(cluster_id: str) -> list[bytes]:
    bodies = [
        (ApiKey.API_VERSIONS, m.ApiVersionsRequest()),
        (ApiKey.METADATA, m.MetadataRequest()),
        (ApiKey.FETCH, m.FetchRequest(cluster_id=cluster_id, replica_id=-1, max_wait_ms=0,
                                      current_leader_epoch=-1, fetch_offset=0, last_fetched_epoch=-1)),
        (ApiKey.DESCRIBE_QUORUM, m.DescribeQuorumRequest()),
    ]
    return [edge.encode_request(b, 7, "fuzz")[1] for _k, b in bodies]  # as our client sends them


@pytest.fixture(scope="module")
def live_broker(tmp_path_factory):
    from metalog.tools.cluster.launcher import LocalCluster

    cluster = LocalCluster.create(str(tmp_path_factory.mktemp("fuzz")), voters=1, observers=0,
                                  common={**FAST, **NO_BACKOFF})
    cluster.start()
    cluster.wait_for_leader(20)
    yield cluster
    cluster.stop()


def _send_raw(host: str, port: int, data: bytes, tls, half_close: bool = True) -> tuple[bytes, bool]:
    """Send bytes inside an authenticated TLS session, then read whatever comes
    back until the broker closes or a deadline passes: (the bytes, whether the
    broker closed). With `half_close` the broker sees end of stream after them."""
    out = bytearray()
    with tls.client().wrap_socket(socket.create_connection((host, port), timeout=5), server_hostname=host) as s:
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)  # TCP FIN without close_notify: the broker sees end of stream
        s.settimeout(5 if half_close else 2)
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (ConnectionResetError, ssl.SSLError):
            return bytes(out), True
        except socket.timeout:
            return bytes(out), False
    return bytes(out), True


def _frames(data: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos + 4 <= len(data):
        (size,) = struct.unpack_from(">i", data, pos)
        out.append(data[pos + 4:pos + 4 + size])
        pos += 4 + size
    assert pos == len(data), "a partial answer frame"
    return out


def test_the_listen_port_answers_bad_input_as_kafka_does(live_broker):
    """What a Kafka client (or a confused one) sees on `listen`: an ApiVersions
    of a version we do not serve gets Kafka's fallback (a v0 answer with
    UNSUPPORTED_VERSION and our ranges, so it steps down); a request it cannot
    read gets INVALID_REQUEST where Kafka's answer has an error code and the
    connection stays; an unknown api, a huge length or garbage close that
    connection and nothing else."""
    host, port = live_broker.bootstrap()[0]
    tls = live_broker.client_tls()
    metadata = wire.encode_request(wire.RequestHeader(3, 12, 9, "user"), km.MetadataRequest(topics=None))

    data, closed = _send_raw(host, port, struct.pack(">ihhih", 10, 18, 99, 5, -1) + metadata, tls, half_close=False)
    (fallback, md) = _frames(data)
    _, versions = wire.decode_response(fallback, 18, 0)
    assert versions.error_code == Errors.UNSUPPORTED_VERSION and {k.api_key for k in versions.api_keys} >= {18, 52}
    _, md = wire.decode_response(md, 3, 12)
    assert not closed and md.topics[0].partitions[0].leader_id == 1

    vote_truncated = struct.pack(">ihhih", 12, 52, 2, 6, -1) + b"\x00\x05"
    data, closed = _send_raw(host, port, vote_truncated + metadata, tls, half_close=False)
    (invalid, _md) = _frames(data)
    assert wire.decode_response(invalid, 52, 2)[1].error_code == Errors.INVALID_REQUEST and not closed

    for payload in (struct.pack(">ihhih", 10, 999, 0, 7, -1) + metadata,  # unknown api: Kafka closes
                    struct.pack(">i", 2**31 - 1) + b"x" * 10,  # a huge length
                    b"\xff" * 64):  # garbage: a negative length
        data, closed = _send_raw(host, port, payload, tls, half_close=False)
        assert (data, closed) == (b"", True), payload[:8]
    assert live_broker.alive(1)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_frames_never_crash_or_stall_a_live_broker(live_broker, data):
    host, port = live_broker.bootstrap()[0]
    frames = _valid_frames(live_broker.cluster_id)
    kind = data.draw(st.sampled_from(["garbage", "mutated", "huge_length", "truncated", "unknown_api"]))
    if kind == "garbage":
        payload = data.draw(st.binary(min_size=1, max_size=300))
    elif kind == "mutated":
        frame = bytearray(data.draw(st.sampled_from(frames)))
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(frame) - 1))
            frame[i] = data.draw(st.integers(0, 255))
        payload = bytes(frame)
    elif kind == "huge_length":
        payload = struct.pack(">i", data.draw(st.integers(64 << 20, 2**31 - 1))) + b"x" * 10
    elif kind == "truncated":
        frame = data.draw(st.sampled_from(frames))
        payload = frame[: data.draw(st.integers(1, len(frame) - 1))]
    else:
        body = struct.pack(">hhih", data.draw(st.integers(100, 999)), 0, 1, -1) + b"\x00" * 8
        payload = struct.pack(">i", len(body)) + body
    _send_raw(host, port, payload, live_broker.client_tls())

    # Another, well-behaved client is still served, promptly.
    async def healthy() -> m.MetadataResponse:
        client = MetalogClient([(host, port)], live_broker.cluster_id, request_timeout_ms=3000, max_retries=2,
                               tls=live_broker.client_tls())
        try:
            return await client.metadata()
        finally:
            await client.close()

    meta = asyncio.run(healthy())
    assert meta.leader_id == 1
    assert live_broker.alive(1), "the broker process died"


def test_corrupt_batch_in_the_middle_of_the_log_refuses_to_start_naming_file_position_and_offset(tmp_path):
    from metalog.storage.batch import encode_batch
    from metalog.storage.format_upgrade import FORMAT_VERSION
    from metalog.storage.segments import SegmentedLog

    cfg = base_config(tmp_path)
    part = tmp_path / "data" / "__cluster_metadata-0"
    part.mkdir(parents=True)
    (tmp_path / "data" / "meta.properties").write_text(
        f"version=1\ncluster.id=c1\nnode.id=1\nmetalog.format.version={FORMAT_VERSION}\n")
    log = SegmentedLog.open(str(part))
    for base in range(0, 30, 10):
        log.append(encode_batch(base, 1, [b"v%d" % i for i in range(10)], 0))
    log.close()
    segment = part / "00000000000000000000.log"
    raw = bytearray(segment.read_bytes())
    size = len(raw) // 3
    raw[size + size // 2] ^= 0x40  # a bit in the middle batch, valid batches after it
    segment.write_bytes(bytes(raw))
    (part / ".clean-shutdown").unlink(missing_ok=True)
    result = run_broker(cfg, tmp_path)
    assert result.returncode == 3
    assert "refusing to start" in result.stderr
    assert "00000000000000000000.log" in result.stderr and "offset 10" in result.stderr
    # Nothing was truncated: the damaged file is left for inspection.
    assert segment.read_bytes() == bytes(raw)
