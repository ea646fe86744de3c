"""Issue 36, tried as a new user would: every `metalog cluster` subcommand on
every cluster `cluster up` starts (a compose-run one, an --insecure one), and
broker settings given to `cluster up` (--set / --node-set) rather than lost
in a broker.yaml that the next start rewrites.

Real broker processes, each command a separate CLI process as a user types it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import yaml

from metalog.tools.cluster.launcher import REPO_ROOT, LocalCluster, free_ports

pytestmark = pytest.mark.slow

COMPOSE = os.path.join(REPO_ROOT, "docker-compose.yml")
COMPOSE_PORTS = (8091, 8092, 8093, 8094, 9091, 9092, 9093, 9094,  # the shipped file's container ports
                 11091, 11092, 11093, 11094)


def metalog(*args: str, env: dict | None = None, timeout_s: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "metalog.tools.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout_s, env=env)


def _all_free(ports) -> bool:
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def compose_port_offset() -> int:
    """An offset that puts every container port of the compose file on a free local port."""
    for base in free_ports(20):
        offset = base - min(COMPOSE_PORTS)
        if offset > 0 and max(COMPOSE_PORTS) + offset < 32000 and _all_free(p + offset for p in COMPOSE_PORTS):
            return offset
    raise OSError("no free port range for the compose file's brokers")


def status(root: str) -> dict[int, dict]:
    out = metalog("cluster", "status", "--dir", root, "-o", "json")
    assert out.returncode in (0, 3), out.stderr
    return {row["node"]: row for row in json.loads(out.stdout)["nodes"]}


def wait_roles(root: str, want: list[str], timeout_s: float = 30) -> dict[int, dict]:
    """Poll `cluster status` until the sorted roles are `want` (a restarted node rejoins in its own time)."""
    cluster = LocalCluster.load(root)
    return cluster.wait_for(lambda: (lambda rows: rows if sorted(r["role"] for r in rows.values()) == want
                                     else None)(status(root)), timeout_s, f"roles {want}", poll_s=0.3)


# ------------------------------------------------------------------ item 1: every mode, every subcommand
def test_status_and_drills_reach_a_compose_run_cluster_through_its_certs_volume(detached):
    """The compose layout keeps its certificates under D/volumes/certs; status,
    pause, restart and the rest use them (they showed every node
    `unreachable`), and add-node says why a compose cluster's voters are fixed."""
    root = detached
    env = dict(os.environ, METALOG_COMPOSE_PORT_OFFSET=str(compose_port_offset()))
    up = metalog("cluster", "up", "--compose", COMPOSE, "--detach", "--dir", root, env=env)
    assert up.returncode == 0, up.stdout + up.stderr
    assert f"certificates: {root}/volumes/certs" in up.stdout

    rows = status(root)
    assert sorted(r["role"] for r in rows.values()) == ["follower", "follower", "leader", "observer"], rows
    assert all(r["epoch"] is not None and r["high_watermark"] is not None for r in rows.values())
    follower = min(n for n, r in rows.items() if r["role"] == "follower")

    assert metalog("cluster", "pause", str(follower), "--dir", root).returncode == 0
    assert status(root)[follower]["role"] == "paused"
    assert metalog("cluster", "resume", str(follower), "--dir", root).returncode == 0
    old_pid = rows[follower]["pid"]
    restarted = metalog("cluster", "restart", str(follower), "--dir", root)
    assert restarted.returncode == 0, restarted.stderr
    # Still the compose service's own command line, with the certificates of the volume.
    assert not os.path.exists(os.path.join(root, f"node-{follower}", "broker.yaml"))
    assert not os.path.exists(os.path.join(root, "certs"))
    rows = wait_roles(root, ["follower", "follower", "leader", "observer"])
    assert rows[follower]["pid"] not in (None, old_pid)

    out = metalog("cluster", "logs", str(follower), "--dir", root, "-n", "1")
    assert out.returncode == 0 and json.loads(out.stdout)["event"]
    out = metalog("cluster", "add-node", "--dir", root)
    assert out.returncode == 1
    assert out.stderr.strip() == (f"metalog: error: the cluster in {root} has static voters (kraft.version 0): "
                                  f"voter changes need a dynamic quorum (the compose file fixes them in its "
                                  f"brokers' `voters` setting)")
    down = metalog("cluster", "down", "--dir", root)
    assert down.returncode == 0, down.stderr
    assert {r["role"] for r in status(root).values()} == {"down"}


def test_status_and_voter_changes_on_an_insecure_cluster(detached):
    """--insecure: plain HTTP to the admin API, no certificates anywhere."""
    root = detached
    up = metalog("cluster", "up", "--insecure", "--voters", "1", "--observers", "1", "--base-port", "0",
                 "--detach", "--dir", root)
    assert up.returncode == 0, up.stdout + up.stderr
    rows = status(root)
    assert [rows[n]["role"] for n in (1, 2)] == ["leader", "observer"], rows
    assert all(r["epoch"] == rows[1]["epoch"] for r in rows.values())
    assert not os.path.exists(os.path.join(root, "certs"))

    added = metalog("cluster", "add-node", "--node", "2", "--dir", root)
    assert added.returncode == 0, added.stderr
    assert added.stdout.startswith("node 2: a voter") and "admin http://127.0.0.1:" in added.stdout
    assert status(root)[2]["voter"]
    assert metalog("cluster", "down", "--dir", root).returncode == 0


# ------------------------------------------------------------------ item 5: settings of a local cluster
def segments(root: str, nid: int) -> list[str]:
    part = os.path.join(root, f"node-{nid}", "data", "__cluster_metadata-0")
    return sorted(name for name in os.listdir(part) if name.endswith(".log")) if os.path.isdir(part) else []


def produce_big_records(root: str, n: int) -> None:
    """n records of 5000 bytes, one request each: with 4 KiB segments, each fills the segment it lands in."""
    for _ in range(n):
        out = metalog("produce", "--client-config", os.path.join(root, "client.yaml"), "x" * 5000)
        assert out.returncode == 0, out.stderr


def test_a_setting_given_to_cluster_up_reaches_the_broker_and_outlives_a_restart(detached):
    """--set goes to every broker and --node-set to one, both kept in cluster.json:
    after `cluster down` and a plain `cluster up` the brokers still run with them.
    A broker.yaml edited by hand is refused (one line: where settings belong and
    the exact flag that keeps the edit), nothing started; that flag then works."""
    root = detached
    up = metalog("cluster", "up", "--insecure", "--voters", "1", "--observers", "1", "--base-port", "0",
                 "--detach", "--dir", root, "--set", "segment_bytes_max=4096", "--node-set", "2:log_level=debug")
    assert up.returncode == 0, up.stdout + up.stderr
    with open(os.path.join(root, "cluster.json")) as f:
        state = json.load(f)
    assert state["common"] == {"segment_bytes_max": 4096}
    assert [n["extra"] for n in state["nodes"]] == [{}, {"log_level": "debug"}]
    with open(os.path.join(root, "node-2", "broker.yaml")) as f:
        assert {k: v for k, v in yaml.safe_load(f).items() if k in ("segment_bytes_max", "log_level")} == \
            {"segment_bytes_max": 4096, "log_level": "debug"}
    # The brokers roll 4 KiB segments (64 MiB by default: these would all fit in one).
    cluster = LocalCluster.load(root)
    produce_big_records(root, 3)
    cluster.wait_for(lambda: len(segments(root, 1)) >= 3 and len(segments(root, 2)) >= 3, 20,
                     "a segment per record on both brokers")
    assert metalog("cluster", "down", "--dir", root).returncode == 0

    # A hand edit: refused, one line, exit 1, no broker started, the file kept as edited.
    path = os.path.join(root, "node-1", "broker.yaml")
    with open(path, "a") as f:
        f.write("gc_young_threshold: 5000\n")
    with open(path) as f:
        edited = f.read()
    refused = metalog("cluster", "up", "--dir", root, "--detach")
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines()[-1] == (  # after the line saying it restarts the cluster on disk
        f"metalog: error: {path} was edited by hand since `metalog cluster up` wrote it (it is rewritten from "
        f"cluster.json at every start): broker settings belong in `--set KEY=VALUE` (every broker) or "
        f"`--node-set 1:KEY=VALUE` (this one), which cluster.json keeps; to keep this edit, add "
        f"`--node-set 1:gc_young_threshold=5000` to `metalog cluster up`; to drop it, delete {path}; "
        f"nothing was started")
    assert all(LocalCluster.load(root).running_pid(nid) is None for nid in (1, 2))
    with open(path) as f:
        assert f.read() == edited

    # The flag it names keeps the edit; the 4 KiB segments stay without --set.
    again = metalog("cluster", "up", "--dir", root, "--detach", "--node-set", "1:gc_young_threshold=5000")
    assert again.returncode == 0, again.stdout + again.stderr
    with open(path) as f:
        cfg = yaml.safe_load(f)
    assert (cfg["segment_bytes_max"], cfg["gc_young_threshold"]) == (4096, 5000)
    before = len(segments(root, 1))
    produce_big_records(root, 2)
    assert len(segments(root, 1)) >= before + 1
    assert metalog("cluster", "down", "--dir", root).returncode == 0


@pytest.mark.parametrize("flags, error", [
    (["--set", "segmnt_bytes_max=1"],
     "--set segmnt_bytes_max=1: segmnt_bytes_max: Object contains unknown field `segmnt_bytes_max`; "
     "did you mean `segment_bytes_max`?"),
    (["--set", "segment_bytes_max=10"], "--set segment_bytes_max=10: segment_bytes_max: must be >= 4096, got 10"),
    (["--node-set", "2:quorum.election_timeout_ms=-5"],
     "--node-set 2:quorum.election_timeout_ms=-5: election_timeout_ms: must be > 0, got -5"),
    (["--set", "listen=127.0.0.1:1"],
     "--set listen=127.0.0.1:1: listen comes from the cluster's layout (--voters, --observers, --base-port, "
     "--cluster-id, --insecure, --static-voters), not from --set"),
    (["--node-set", "9:log_level=debug"], "--node-set 9:...: no node 9 in the cluster (nodes: 1, 2, 3, 4)"),
    (["--node-set", "log_level=debug"], "--node-set 'log_level=debug': expected N:KEY=VALUE (N a node id)"),
    (["--compose", COMPOSE, "--set", "log_level=debug"],
     "--set/--node-set do not apply with --compose: the compose file holds the brokers' settings (its broker "
     "config and each service's `--set` arguments)"),
])
def test_a_wrong_setting_is_one_line_before_anything_starts(tmp_path, flags, error):
    root = str(tmp_path / "c")
    out = metalog("cluster", "up", "--dir", root, "--base-port", "0", "--detach", *flags)
    assert out.returncode == 1
    assert out.stderr.strip() == f"metalog: error: {error}"
    assert not any(name.startswith("node-") for name in os.listdir(root)) if os.path.exists(root) else True


def test_restart_leaves_a_hand_edited_broker_yaml_and_its_broker_alone(tmp_path):
    cluster = LocalCluster.create(str(tmp_path / "c"), voters=1, observers=0, insecure=True)
    path = cluster.write_config(1)
    cluster.save_state()
    with open(path, "a") as f:
        f.write("log_level: debug\n")
    out = metalog("cluster", "restart", "1", "--dir", cluster.root)
    assert out.returncode == 1
    assert out.stderr.strip().endswith("to keep this edit, add `--node-set 1:log_level=debug` to `metalog cluster "
                                       f"up`; to drop it, delete {path}; node 1 was left as it is")
    assert cluster.running_pid(1) is None
