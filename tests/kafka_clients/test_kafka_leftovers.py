"""The Kafka listener's loose ends, as a user sees them (docs/kafka-listener.md):

* Apache Kafka 4.3.1's own kafka-metadata-quorum prints the voters' last
  fetch and caught-up times as wall-clock ages ("N ms ago"): small and
  non-negative for caught-up voters, asked at the leader or forwarded by a
  follower (the core's clock is monotonic; the listener converts).
* `metalog cluster add-node` gives the new node a Kafka listener; kcat
  through it lists every broker, and every old node -- whose kafka_endpoints
  do not name it -- lists it too (from the voter set), as `cluster status` does.
* librdkafka's all-topics Metadata request, caught on a bare socket: our
  header parse is right, and the 3 bytes left after the body are its own
  fields behind an unshrunk i32 placeholder (protocol/kafka/wire.py).

The module's cluster (conftest: 3 voters, 1 observer) grows to 5 nodes in
the add-node test, so the quorum tool's test runs first.
"""

from __future__ import annotations

import json
import re
import random
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time

import pytest

from metalog.tools.cluster import membership
from metalog.tools.cluster.launcher import REPO_ROOT, LocalCluster

from .conftest import RawKafka
from .test_kafka_clients import _java_client_config

METADATA_QUORUM = "org.apache.kafka.tools.MetadataQuorumCommand"
# Generous for a loaded 2-core machine: the leader's view of a follower's
# last fetch is at most a fetch wait (100 ms here) old plus scheduling delays.
AGE_MAX_MS = 15_000


def _metalog(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "metalog.tools.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=180)


def _replication(props: str, bootstrap: str, *flags: str) -> dict[int, dict[str, str]]:
    """kafka-metadata-quorum describe --replication, rows by node id (columns by header name)."""
    from metalog.tools import kafka

    out = kafka.run_class(METADATA_QUORUM, ["--bootstrap-server", bootstrap, "--command-config", props,
                                            "describe", "--replication", *flags], timeout_s=120)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    # Tab-separated columns, padded with spaces ("123 ms ago" is one cell).
    header, *body = [[cell.strip() for cell in line.rstrip().split("\t")] for line in lines]
    rows = {}
    for cells in body:
        assert len(cells) == len(header), (header, cells)
        row = dict(zip(header, cells))
        rows[int(row["NodeId"])] = row
    return rows


@pytest.mark.parametrize("ask", ["leader", "follower"])
def test_kafka_metadata_quorum_prints_wall_clock_ages(kafka_cluster, tmp_path, ask):
    leader, _ = kafka_cluster.leader()
    nid = leader if ask == "leader" else min(n for n in (1, 2, 3) if n != leader)
    host, port = kafka_cluster.kafka_ports[nid]
    props = _java_client_config(kafka_cluster, tmp_path)

    before_ms = int(time.time() * 1000)
    raw_rows = _replication(props, f"{host}:{port}")
    after_ms = int(time.time() * 1000)
    assert sorted(raw_rows) == [1, 2, 3, 4]
    for node, row in raw_rows.items():
        for column in ("LastFetchTimestamp", "LastCaughtUpTimestamp"):
            ts_ms = int(row[column])  # Kafka's unit: wall-clock epoch milliseconds
            assert before_ms - AGE_MAX_MS <= ts_ms <= after_ms, (node, column, ts_ms, before_ms, after_ms)

    aged = _replication(props, f"{host}:{port}", "--human-readable")
    assert sorted(aged) == [1, 2, 3, 4]
    for node in (1, 2, 3):  # caught-up voters
        row = aged[node]
        assert int(row["Lag"]) == 0, row  # nothing is written meanwhile
        for column in ("LastFetchTimestamp", "LastCaughtUpTimestamp"):
            m = re.fullmatch(r"(\d+) ms ago", row[column])
            assert m, (node, column, row[column])
            assert 0 <= int(m.group(1)) <= AGE_MAX_MS, (node, column, row[column])


@pytest.fixture(scope="module")
def grown(kafka_cluster):
    """The module's cluster after `metalog cluster add-node` (another process,
    as a user runs it); the node it started is stopped at the end (by its pid
    file: this process did not start it)."""
    root = kafka_cluster.cluster.root
    out = _metalog("cluster", "add-node", "--dir", root, "--timeout-s", "90")
    try:
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.startswith("node 5: a voter"), out.stdout
        grown = LocalCluster.load(root)
        # What the user is told: where to reach the new node, Kafka clients included.
        new, host = grown.nodes[5], grown.node_host(5)
        assert (f"listen {host}:{new.port}, admin {grown.admin_scheme}://{host}:{new.admin_port}, "
                f"kafka {host}:{new.kafka_port}); voters now 1, 2, 3, 5") in out.stdout, out.stdout
        yield grown
    finally:
        on_disk = LocalCluster.load(root)
        for nid in sorted(set(on_disk.nodes) - set(kafka_cluster.cluster.nodes)):
            on_disk.terminate(nid, 30)


def _metadata_brokers(kafka_cluster, host: str, port: int) -> dict[int, tuple[str, int]]:
    """Metadata v12 (kio's classes) straight to one node's Kafka listener: its broker list."""
    from kio.schema.metadata.v12.request import MetadataRequest
    from kio.schema.metadata.v12.response import MetadataResponse

    ctx = ssl.create_default_context(cafile=kafka_cluster.cert("ca.crt"))
    ctx.load_cert_chain(kafka_cluster.cert("admin.crt"), kafka_cluster.cert("admin.key"))
    raw = RawKafka(ctx.wrap_socket(socket.create_connection((host, port), timeout=10), server_hostname=host))
    try:
        _, resp = raw.ask(MetadataRequest(topics=None, allow_auto_topic_creation=False,
                                          include_topic_authorized_operations=False), MetadataResponse)
    finally:
        raw.close()
    return {b.node_id: (b.host, b.port) for b in resp.brokers}


def test_add_node_gives_the_new_node_a_kafka_listener_every_node_lists(kafka_cluster, grown):
    new = grown.nodes[5]
    assert new.kafka_port is not None
    expected = {nid: (h, p) for nid, h, p in grown.kafka_bootstrap()}
    assert sorted(expected) == [1, 2, 3, 4, 5]

    # kcat through the new node's Kafka port alone: every broker, node 5 a replica of the log.
    kcat = shutil.which("kcat")
    assert kcat, "kcat is not installed: bash run.sh setup installs it (Debian package kcat)"
    certs = grown.cert_dir
    out = subprocess.run([kcat, "-b", f"{grown.node_host(5)}:{new.kafka_port}", "-X", "security.protocol=SSL",
                          "-X", f"ssl.ca.location={certs}/ca.crt", "-X", f"ssl.certificate.location={certs}/admin.crt",
                          "-X", f"ssl.key.location={certs}/admin.key", "-L", "-J", "-m", "20"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    meta = json.loads(out.stdout)
    assert {b["id"]: b["name"] for b in meta["brokers"]} == {nid: f"{h}:{p}" for nid, (h, p) in expected.items()}
    (partition,) = meta["topics"][0]["partitions"]
    assert sorted(r["id"] for r in partition["replicas"]) == [1, 2, 3, 5]

    # Every node that was running before add-node lists node 5 at its Kafka port
    # (their kafka_endpoints do not name it: they read it from the voter set).
    for nid in (1, 2, 3, 4):
        h, p = expected[nid]
        assert _metadata_brokers(kafka_cluster, h, p) == expected, f"node {nid}"

    # confluent-kafka bootstrapped at an old node only.
    from confluent_kafka.admin import AdminClient

    h1, p1 = expected[1]
    md = AdminClient(kafka_cluster.librdkafka_conf(**{"bootstrap.servers": f"{h1}:{p1}"})).list_topics(timeout=20)
    assert {b.id: (b.host, b.port) for b in md.brokers.values()} == expected

    # `metalog cluster status` shows its Kafka port, and the bootstrap list has it.
    status = _metalog("cluster", "status", "--dir", grown.root, "-o", "json")
    assert status.returncode == 0, status.stderr
    doc = json.loads(status.stdout)
    assert {r["node"]: r["kafka_port"] for r in doc["nodes"]}[5] == new.kafka_port
    assert f"{expected[5][0]}:{expected[5][1]}" in doc["kafka_bootstrap_servers"].split(",")
    with open(grown.kafka_properties_path) as f:
        assert f"{expected[5][0]}:{expected[5][1]}" in f.read()


def test_add_node_follows_the_launchers_port_rule(tmp_path):
    """base port + 2000 + i for the Kafka port, as `cluster up --base-port` gives its nodes."""
    rng = random.Random()
    for _ in range(50):  # a base whose fourth node's three ports are free here
        base = rng.randrange(21_000, 26_000)
        if all(membership._port_free(p) for p in (base + 3, base + 1003, base + 2003)):
            break
    cluster = LocalCluster.create(str(tmp_path / "c"), voters=3, observers=0, base_port=base)
    assert membership._ports_for(cluster, 4) == (base + 3, base + 1003, base + 2003)
    for spec in cluster.nodes.values():  # a cluster from before the Kafka listener: none for a new node either
        spec.kafka_port = None
    assert membership._ports_for(cluster, 4) == (base + 3, base + 1003, None)


def test_librdkafkas_all_topics_metadata_request_and_its_three_extra_bytes():
    """What librdkafka (confluent-kafka's) really sends for list_topics(), caught
    by a bare server that answers its ApiVersions and Metadata: request header
    v2 as we read it (client id a non-compact string, then empty tags), then
    four zero bytes where a null Topics takes one (its i32 placeholder, never
    shrunk to a varint on this path) and its real AllowAutoTopicCreation (01),
    IncludeTopicAuthorizedOperations (00) and empty tags (00).
    protocol/kafka/wire.py's decode_request says where in librdkafka's source."""
    from confluent_kafka.admin import AdminClient

    from metalog.protocol.kafka import messages as km
    from metalog.protocol.kafka import wire

    served = {18: (0, 4), 3: (0, 13)}
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(1)
    port = server.getsockname()[1]
    metadata_frames: list[bytes] = []
    all_topics = threading.Event()

    def answer(header, body) -> bytes:
        if header.api_key == 18:
            return wire.encode_response(header, km.ApiVersionsResponse(api_keys=[
                km.ApiVersionsResponseApiVersion(api_key=k, min_version=lo, max_version=hi)
                for k, (lo, hi) in served.items()]))
        return wire.encode_response(header, km.MetadataResponse(
            brokers=[km.MetadataResponseMetadataResponseBroker(node_id=1, host="127.0.0.1", port=port)],
            cluster_id="c", controller_id=1, topics=[]))

    def connection(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(30)
            for _ in range(20):  # bounded: a few ApiVersions and Metadata requests
                try:
                    frame = _read_frame(conn)
                except (EOFError, OSError):
                    return
                header, body = wire.decode_request(frame, served)
                if header.api_key == 3:
                    metadata_frames.append(frame)
                    if body.topics is None:
                        all_topics.set()
                conn.sendall(answer(header, body))

    def accept() -> None:
        for _ in range(60):  # bounded: a second each
            if all_topics.is_set():
                return
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            threading.Thread(target=connection, args=(conn,), daemon=True).start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    admin = AdminClient({"bootstrap.servers": f"127.0.0.1:{port}", "client.id": "rdk"})
    md = admin.list_topics(timeout=20)
    assert list(md.brokers) == [1]
    assert all_topics.wait(20), [f.hex(" ") for f in metadata_frames]
    acceptor.join(5)
    server.close()
    after_header = {f[2 + 2 + 4 + 2 + len("rdk"):] for f in metadata_frames}
    assert {f[:4] for f in metadata_frames} == {bytes.fromhex("0003000d")}  # Metadata v13 only
    # A brokers-only refresh (Topics an empty compact array, 01) is well formed;
    # the all-topics request of list_topics() carries the 3 bytes.
    quirk = b"\x00" + b"\x00\x00\x00\x00" + b"\x01\x00\x00"
    assert quirk in after_header, [f.hex(" ") for f in after_header]
    assert after_header <= {quirk, b"\x00" + b"\x01\x00\x00\x00"}, [f.hex(" ") for f in after_header]
    # Read as Kafka reads it: Topics null, both flags false, three bytes left over.
    header, body = wire.decode_request(next(f for f in metadata_frames if f.endswith(quirk)), served)
    assert header.client_id == "rdk"
    assert (body.topics, body.allow_auto_topic_creation, body.include_topic_authorized_operations) == (
        None, False, False)


def _read_frame(conn: socket.socket) -> bytes:
    def exactly(n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = conn.recv(n - len(out))
            if not chunk:
                raise EOFError(f"closed after {len(out)} of {n} bytes")
            out += chunk
        return out

    return exactly(int.from_bytes(exactly(4), "big", signed=True))
