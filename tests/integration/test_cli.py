"""The CLI as a user runs it, against real brokers: cluster up, produce,
consume, controller commands, /metadata, dump."""

from __future__ import annotations

import asyncio
import base64
import glob
import json
import os
import subprocess
import sys

import pytest

from metalog.tools.cluster.launcher import REPO_ROOT

pytestmark = pytest.mark.slow

FAST = dict(election_timeout_ms=300, fetch_timeout_ms=800, request_timeout_ms=800, fetch_max_wait_ms=100)


def metalog(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "metalog.tools.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout_s)


def test_cluster_up_starts_voters_and_an_observer_and_elects_a_leader(tmp_path):
    result = metalog("cluster", "up", "--dir", str(tmp_path), "--base-port", "0", "--exit-when-ready")
    assert result.returncode == 0, result.stderr
    assert "is up: leader" in result.stdout
    roles = [line.split()[1] for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert sorted(roles) == ["follower", "follower", "leader", "observer"]


async def test_produce_consume_and_controller_commands_through_the_cli(make_cluster):
    cluster = make_cluster(voters=3, observers=1, **FAST)
    await asyncio.to_thread(cluster.wait_for_leader, 20)
    boot = ",".join(f"{h}:{p}" for h, p in cluster.bootstrap())
    common = ["--bootstrap", boot, "--cluster-id", cluster.cluster_id, "--client-config", cluster.client_config_path]

    def run(*args):
        return metalog(*args[:2], *common, *args[2:]) if args[0] in ("topics", "brokers", "configs") \
            else metalog(args[0], *common, *args[1:])

    out = await asyncio.to_thread(run, "produce", "hello", "world")
    assert out.returncode == 0, out.stderr
    produced = json.loads(out.stdout)
    assert produced["records"] == 2 and produced["base_offset"] >= 0

    out = await asyncio.to_thread(run, "consume", "--from", "earliest", "--max-records", "2")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["value"] for r in lines] == ["hello", "world"]
    assert lines[0]["offset"] == produced["base_offset"]

    for broker_id in (1, 2, 3):
        out = await asyncio.to_thread(run, "brokers", "register", str(broker_id),
                                      "--endpoint", f"PLAINTEXT:127.0.0.1:{9000 + broker_id}")
        assert out.returncode == 0, out.stderr
    out = await asyncio.to_thread(run, "topics", "create", "orders", "--partitions", "3",
                                  "--replication-factor", "2")
    assert out.returncode == 0, out.stderr
    out = await asyncio.to_thread(run, "topics", "create", "orders", "--partitions", "1")
    assert out.returncode == 1
    assert "already exists" in out.stderr
    out = await asyncio.to_thread(run, "configs", "set", "--topic", "orders", "retention.ms", "1000")
    assert out.returncode == 0, out.stderr
    out = await asyncio.to_thread(run, "brokers", "fence", "2")
    assert out.returncode == 0, out.stderr

    # Every broker, followers and the observer included, converges on the same state.
    def same_metadata():
        views = [cluster.metadata_state(n) for n in cluster.nodes]
        return views if all(v == views[0] and v and v.get("topics") for v in views) else None

    views = await asyncio.to_thread(cluster.wait_for, same_metadata, 15, "all brokers to apply the commands")
    state = views[0]
    assert json.dumps(state).count("orders") >= 1
    assert "retention.ms" in json.dumps(state["configs"])
    for part in state["partitions"]:
        assert 2 not in part["isr"] or len(part["isr"]) == 1, "fenced broker 2 still in a multi-member ISR"

    # Reads as a user makes them: one topic, one broker, listings page by page.
    admin = f"https://{cluster.host}:{cluster.nodes[1].admin_port}"
    reads = ["--client-config", cluster.client_config_path, "--admin", admin]
    out = await asyncio.to_thread(run, "topics", "create", "audit", "--partitions", "1")
    assert out.returncode == 0, out.stderr

    def both_topics():
        out = metalog("topics", "list", *reads, "--limit", "1", "--all")
        return out if out.returncode == 0 and len(out.stdout.splitlines()) == 2 else None

    out = await asyncio.to_thread(cluster.wait_for, both_topics, 15, "both topics listed")
    assert [json.loads(line)["name"] for line in out.stdout.splitlines()] == ["audit", "orders"]
    out = await asyncio.to_thread(metalog, "topics", "list", *reads, "--limit", "1")
    assert [json.loads(line)["name"] for line in out.stdout.splitlines()] == ["audit"]
    assert "more after 'audit': --after audit or --all" in out.stderr
    out = await asyncio.to_thread(metalog, "topics", "describe", "orders", *reads)
    assert out.returncode == 0, out.stderr
    orders = json.loads(out.stdout)
    assert orders["partition_count"] == 3 and [p["partition"] for p in orders["partitions"]] == [0, 1, 2]
    assert orders["configs"] == {"retention.ms": "1000"}
    out = await asyncio.to_thread(metalog, "topics", "describe", "nope", *reads)
    assert out.returncode == 1 and out.stderr.strip() == f"metalog: {admin}/metadata/topics/nope: no topic 'nope'"
    out = await asyncio.to_thread(metalog, "brokers", "describe", "2", *reads)
    assert out.returncode == 0 and json.loads(out.stdout)["fenced"] is True
    out = await asyncio.to_thread(metalog, "brokers", "list", *reads)
    assert [json.loads(line)["broker_id"] for line in out.stdout.splitlines()] == [1, 2, 3]

    # consume shows the controller's records decoded, one JSON line each; --raw the bytes.
    out = await asyncio.to_thread(run, "consume", "--from", "earliest", "--idle-exit-s", "1")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["value"] for r in lines if r["type"] == "data"] == ["hello", "world"]
    registered = [r for r in lines if r["type"] == "RegisterBroker"]
    assert [r["fields"]["broker_id"] for r in registered] == [1, 2, 3]
    assert all(r["version"] == 0 and r["epoch"] >= 1 for r in registered)
    assert any(r["type"] == "Topic" and r["fields"]["name"] == "orders" for r in lines)
    out = await asyncio.to_thread(run, "consume", "--from", "earliest", "--max-records", "2", "--raw")
    assert out.returncode == 0, out.stderr
    raw = [json.loads(line) for line in out.stdout.splitlines()]
    assert [base64.b64decode(r["value"]) for r in raw] == [b"hello", b"world"]


def test_dump_decodes_a_segment_written_by_a_broker(tmp_path):
    result = metalog("cluster", "up", "--dir", str(tmp_path), "--base-port", "0", "--exit-when-ready")
    assert result.returncode == 0, result.stderr
    segments = glob.glob(os.path.join(str(tmp_path), "node-1", "data", "__cluster_metadata-0", "*.log"))
    assert segments
    out = metalog("dump", segments[0], "--print-data-log")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert lines[0]["batch"]["base_offset"] == 0 and lines[0]["batch"]["is_control"]
    assert lines[1]["type"] == "LeaderChange" and lines[1]["control"] and "fields" in lines[1]
    bad = tmp_path / "00000000000000000000-0000000001.checkpoint"
    bad.write_bytes(b"not a snapshot")
    out = metalog("dump", str(bad))
    assert out.returncode != 0
    assert "truncated: 14 byte(s) after the last whole batch at byte 0" in out.stderr


def test_cluster_up_reports_a_broker_that_cannot_start(tmp_path):
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        result = metalog("cluster", "up", "--dir", str(tmp_path), "--base-port", str(port),
                         "--voters", "1", "--observers", "0", "--exit-when-ready")
    finally:
        busy.close()
    assert result.returncode == 1
    assert "broker 1 exited with code 3 while starting" in result.stderr
    assert "address already in use" in result.stderr
