"""`metalog cluster up --detach|status|down|logs|kill|pause|resume|restart` as a
user runs them: real broker processes in the background, TLS on (the launcher's
`admin` certificate), every command a separate CLI process."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from metalog.tools.cluster.launcher import REPO_ROOT, LocalCluster

pytestmark = pytest.mark.slow


def metalog(*args: str, timeout_s: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "metalog.tools.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout_s)


def _status(root: str) -> dict[int, dict]:
    out = metalog("cluster", "status", "--dir", root, "-o", "json")
    assert out.returncode in (0, 3), out.stderr
    return {row["node"]: row for row in json.loads(out.stdout)["nodes"]}


def test_detached_cluster_status_hints_drills_and_down(detached):
    root = detached
    up = metalog("cluster", "up", "--dir", root, "--base-port", "0", "--detach")
    assert up.returncode == 0, up.stderr
    assert "is up: leader" in up.stdout
    # The command returned, yet the brokers run on, each with a pid file.
    status = _status(root)
    assert sorted(status) == [1, 2, 3, 4]
    assert all(row["pid"] and os.path.exists(f"{root}/node-{n}/broker.pid") for n, row in status.items())
    assert sorted(r["role"] for r in status.values()) == ["follower", "follower", "leader", "observer"]

    # Every hint printed after "try:" runs exactly as printed and succeeds.
    block = up.stdout.split("try:", 1)[1].splitlines()
    hints = [line.strip() for line in block if line.strip().startswith("metalog ")]
    assert len(hints) >= 4, up.stdout
    for hint in hints:
        out = metalog(*shlex.split(hint)[1:])
        assert out.returncode == 0, f"hint {hint!r} failed: {out.stderr}"
        assert "Traceback" not in out.stderr
        if hint.startswith("metalog consume"):
            assert json.loads(out.stdout.splitlines()[-1])["value"] == "hello"
    stop_hint = up.stdout.split("stop them with:", 1)[1].strip()
    assert stop_hint == f"metalog cluster down --dir {root}"

    # The table: a header and one row per node with its ports.
    table = metalog("cluster", "status", "--dir", root)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[1].split() == ["NODE", "ROLE", "EPOCH", "HIGH-WATERMARK", "LOG-END", "LAG", "PID", "PORT",
                                "ADMIN-PORT", "KAFKA-PORT"]
    assert [line.split()[0] for line in lines[2:]] == ["1", "2", "3", "4"]
    assert all(str(status[int(line.split()[0])]["port"]) in line for line in lines[2:])

    # A second `up` in the same directory is refused, naming the way out.
    again = metalog("cluster", "up", "--dir", root, "--base-port", "0", "--detach")
    assert again.returncode == 1
    assert again.stderr.strip() == (f"metalog: error: a cluster in {root} is already running (nodes 1, 2, 3, 4): "
                                    f"`metalog cluster down --dir {root}` stops it")

    # Drills: pause a follower (status says so), resume it, kill -9 one and restart it.
    follower = min(n for n, r in status.items() if r["role"] == "follower")
    out = metalog("cluster", "pause", str(follower), "--dir", root)
    assert out.returncode == 0 and out.stdout.startswith(f"node {follower}: paused with SIGSTOP"), out.stderr
    assert _status(root)[follower]["role"] == "paused"
    assert metalog("cluster", "resume", str(follower), "--dir", root).returncode == 0
    out = metalog("cluster", "kill", str(follower), "--dir", root)
    assert out.returncode == 0, out.stderr
    assert _status(root)[follower]["role"] == "down"
    out = metalog("cluster", "pause", str(follower), "--dir", root)
    assert out.returncode == 1
    assert out.stderr.strip() == (f"metalog: error: node {follower} is not running "
                                  f"(`metalog cluster status --dir {root}`)")
    out = metalog("cluster", "restart", str(follower), "--dir", root)
    assert out.returncode == 0, out.stderr
    assert _status(root)[follower]["pid"] not in (None, status[follower]["pid"])

    out = metalog("cluster", "kill", "9", "--dir", root)
    assert out.returncode == 1
    assert out.stderr.strip() == f"metalog: error: no node 9 in the cluster in {root} (nodes: 1, 2, 3, 4)"

    # logs: one node's broker.log as is; every node's prefixed.
    out = metalog("cluster", "logs", str(follower), "--dir", root, "-n", "3")
    assert out.returncode == 0 and len(out.stdout.splitlines()) == 3
    assert all(json.loads(line)["node"] == follower for line in out.stdout.splitlines())
    out = metalog("cluster", "logs", "--dir", root, "-n", "1")
    assert [line.split(" | ")[0] for line in out.stdout.splitlines()] == ["node-1", "node-2", "node-3", "node-4"]

    # down: SIGTERM, wait, one line per node; then status shows every node down (exit 3).
    down = metalog("cluster", "down", "--dir", root)
    assert down.returncode == 0, down.stderr
    assert [line.split(":")[0] for line in down.stdout.splitlines()] == ["node 1", "node 2", "node 3", "node 4"]
    assert all(": stopped (pid " in line for line in down.stdout.splitlines())
    out = metalog("cluster", "status", "--dir", root, "-o", "json")
    assert out.returncode == 3
    assert {r["role"] for r in json.loads(out.stdout)["nodes"]} == {"down"}
    assert metalog("cluster", "down", "--dir", root).stdout.strip() == f"cluster in {root}: no broker running"


def test_cluster_commands_without_a_cluster_name_the_way_to_start_one(tmp_path):
    """No cluster.json: one line saying how to start one, exit 1, no traceback."""
    root = str(tmp_path / "none")
    out = metalog("cluster", "status", "--dir", root)
    assert out.returncode == 1
    assert out.stderr.strip() == (f"metalog: error: no cluster in {root} (no cluster.json there): start one "
                                  f"with `metalog cluster up --dir {root} --detach`")


def test_a_stale_pid_file_is_never_signalled(tmp_path):
    """A pid file whose process is gone, or whose pid now belongs to another
    program (different start time), counts as not running."""
    cluster = LocalCluster.create(str(tmp_path / "c"), voters=1, observers=0)
    cluster.save_state()
    os.makedirs(cluster.node_dir(1), exist_ok=True)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with open(cluster.pid_path(1), "w") as f:
            f.write(f"{sleeper.pid} 1\n")  # right pid, wrong start time: a reused pid
        assert cluster.running_pid(1) is None
        out = metalog("cluster", "kill", "1", "--dir", cluster.root)
        assert out.returncode == 1 and "node 1 is not running" in out.stderr
        assert sleeper.poll() is None, "the unrelated process was signalled"
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_foreground_cluster_stopped_by_cluster_down_exits_cleanly(detached):
    """`cluster up` in the foreground, `cluster down` from another terminal: the
    foreground command says every broker stopped cleanly and exits 0."""
    root = detached
    fg = subprocess.Popen([sys.executable, "-m", "metalog.tools.cli", "cluster", "up", "--dir", root, "--base-port", "0"],
                          cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in fg.stdout:  # bounded by the ready timeout of `up` (it exits if no leader)
            if line.startswith("Ctrl-C stops the cluster"):
                break
        status = _status(root)
        assert all(row["pid"] for row in status.values())
        down = metalog("cluster", "down", "--dir", root)
        assert down.returncode == 0, down.stderr
        _, err = fg.communicate(timeout=30)
    finally:
        if fg.poll() is None:
            fg.kill()
            fg.wait()
    assert fg.returncode == 0, err
    assert err.strip().splitlines()[-1] == "metalog: every broker stopped cleanly"


def test_cluster_up_again_restarts_the_cluster_as_it_is_on_disk(detached):
    """After `cluster add-node` and `cluster remove-node`, `down` then `up` again
    starts the nodes cluster.json names, on their ports, with their directory
    ids: the added node is back and still a voter; the removed one stays
    stopped, and `up` says so on stderr (the layout flags are ignored)."""
    root = detached
    up = metalog("cluster", "up", "--dir", root, "--base-port", "0", "--detach")
    assert up.returncode == 0, up.stderr
    added = metalog("cluster", "add-node", "--dir", root)
    assert added.returncode == 0, added.stderr
    assert added.stdout.startswith("node 5: a voter"), added.stdout
    removed = metalog("cluster", "remove-node", "2", "--dir", root)
    assert removed.returncode == 0, removed.stderr
    before = LocalCluster.load(root)
    ports = {nid: (s.port, s.admin_port, s.directory_id) for nid, s in before.nodes.items()}
    assert metalog("cluster", "down", "--dir", root).returncode == 0

    again = metalog("cluster", "up", "--dir", root, "--base-port", "0", "--detach")
    assert again.returncode == 0, again.stderr
    assert (f"metalog: {root} holds a cluster: starting it as it is on disk (nodes 1, 3, 4, 5; --voters, "
            f"--observers, --base-port and --cluster-id are ignored); removed node(s) 2 stay stopped") \
        in again.stderr.splitlines()
    after = LocalCluster.load(root)
    assert {nid: (s.port, s.admin_port, s.directory_id) for nid, s in after.nodes.items()} == ports
    status = _status(root)
    assert sorted(status) == [1, 2, 3, 4, 5]
    assert status[2]["role"] == "down" and status[2]["pid"] is None
    assert all(status[n]["pid"] for n in (1, 3, 4, 5))
    assert status[5]["voter"] and not status[2]["voter"]
    # The quorum itself (not only the launcher's notes) has node 5 as a voter, with its directory id.
    leader, _ = after.wait_for_leader(timeout_s=30)
    q = after.quorum(leader)
    assert sorted(q["voters"]) == [1, 3, 5]
    assert {v["replica_id"]: v["directory_id"] for v in q["replicas"]["voters"]}[5] == ports[5][2]
    after.wait_for(lambda: 5 in ((after.quorum(5) or {}).get("voters") or []), 30, "node 5 to know it votes")
    assert metalog("cluster", "down", "--dir", root).returncode == 0

    # In the foreground too: `cluster down` from elsewhere ends it cleanly (the
    # removed node, never started by it, is not waited for).
    fg = subprocess.Popen([sys.executable, "-m", "metalog.tools.cli", "cluster", "up", "--dir", root],
                          cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in fg.stdout:  # bounded by the ready timeout of `up` (it exits if no leader)
            if line.startswith("Ctrl-C stops the cluster"):
                break
        assert sorted(n for n, row in _status(root).items() if row["pid"]) == [1, 3, 4, 5]
        assert metalog("cluster", "down", "--dir", root).returncode == 0
        _, err = fg.communicate(timeout=30)
    finally:
        if fg.poll() is None:
            fg.kill()
            fg.wait()
    assert fg.returncode == 0, err
    assert err.strip().splitlines()[-1] == "metalog: every broker stopped cleanly"
