"""`metalog cluster status|down|logs|kill|pause|resume|restart|add-node|remove-node`: manage a local
cluster that `metalog cluster up` started (in the foreground or with --detach)
from any other process.

Everything is found through the cluster directory: ``cluster.json`` (node ids,
ports, voters, TLS or not) and ``node-N/broker.pid`` (pid and kernel start
time, so a stale pid file or a reused pid is never signalled). Each command
prints what it did, one line per node, and exits non-zero when it could not
do it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time

from metalog.tools.cluster import membership
from metalog.tools.cluster.launcher import ConfigEditedError, LocalCluster

POLL_S = 0.05


class ClusterCliError(Exception):
    """A one-line error for the user (the CLI prints it and exits 1)."""


def dir_flag(root: str) -> str:
    """The ``--dir`` part of a printed hint, exactly as it must be typed."""
    return f"--dir {shlex.quote(root)}"


def load(root: str) -> LocalCluster:
    try:
        return LocalCluster.load(root)
    except FileNotFoundError:
        raise ClusterCliError(
            f"no cluster in {os.path.abspath(root)} (no cluster.json there): start one with "
            f"`metalog cluster up {dir_flag(root)} --detach`") from None
    except (ValueError, KeyError) as exc:
        raise ClusterCliError(f"{os.path.join(os.path.abspath(root), 'cluster.json')} is not readable: "
                              f"{exc}") from None


def _node(cluster: LocalCluster, node: int, root: str) -> int:
    if node not in cluster.nodes:
        raise ClusterCliError(f"no node {node} in the cluster in {cluster.root} "
                              f"(nodes: {', '.join(map(str, sorted(cluster.nodes)))})")
    return node


def _wait_gone(cluster: LocalCluster, node_ids: list[int], timeout_s: float) -> list[int]:
    """Poll until none of node_ids runs or the deadline passes; returns those still running."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [nid for nid in node_ids if cluster.running_pid(nid) is not None]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(POLL_S)


def running_nodes(cluster: LocalCluster) -> list[int]:
    return [nid for nid in sorted(cluster.nodes) if cluster.running_pid(nid) is not None]


# ------------------------------------------------------------------ up: broker settings
def add_settings_args(up: argparse.ArgumentParser) -> None:
    """`cluster up --set` / `--node-set`: broker settings kept in cluster.json."""
    up.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="settings",
                    help="a broker setting for every broker (`metalog broker --help-config` lists them), kept "
                         "in cluster.json for later starts; repeat for more")
    up.add_argument("--node-set", action="append", default=[], metavar="N:KEY=VALUE", dest="node_settings",
                    help="a broker setting for node N only, kept in cluster.json; repeat for more")


def _key_value(flag: str, text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ClusterCliError(f"{flag} {text!r}: expected KEY=VALUE")
    return key.strip(), value


def parse_settings(args) -> tuple[dict[str, str], dict[int, dict[str, str]]]:
    """(every broker's, per node) settings from --set and --node-set, as text."""
    common = dict(_key_value("--set", item) for item in args.settings)
    per_node: dict[int, dict[str, str]] = {}
    for item in args.node_settings:
        node_s, sep, rest = item.partition(":")
        if not sep or not node_s.strip().isdigit():
            raise ClusterCliError(f"--node-set {item!r}: expected N:KEY=VALUE (N a node id)")
        key, value = _key_value("--node-set", rest)
        per_node.setdefault(int(node_s), {})[key] = value
    return common, per_node


def apply_up_settings(cluster: LocalCluster, args) -> None:
    """Before `cluster up` starts anything: take --set/--node-set into the
    cluster (checked against the broker's config keys) and refuse a
    broker.yaml edited by hand since `cluster up` wrote it."""
    common, per_node = parse_settings(args)
    if (common or per_node) and getattr(args, "compose", None):
        raise ClusterCliError("--set/--node-set do not apply with --compose: the compose file holds the brokers' "
                              "settings (its broker config and each service's `--set` arguments)")
    try:
        cluster.apply_settings(common, per_node)
    except ValueError as exc:
        raise ClusterCliError(str(exc)) from None
    edits = cluster.hand_edits([nid for nid in sorted(cluster.nodes) if not cluster.nodes[nid].removed])
    if edits:
        raise ClusterCliError(f"{edits[0]}; nothing was started")


# ------------------------------------------------------------------ status
def status_rows(cluster: LocalCluster) -> list[dict]:
    rows = []
    views = {}
    for nid in sorted(cluster.nodes):
        pid = cluster.running_pid(nid)
        paused = pid is not None and cluster.paused(nid)
        # A paused broker cannot answer: don't wait for its admin API.
        views[nid] = cluster.quorum(nid) if pid is not None and not paused else None
        spec = cluster.nodes[nid]
        q = views[nid] or {}
        role = "down" if pid is None else "paused" if paused else q.get("role", "unreachable")
        rows.append({"node": nid, "role": role, "voter": spec.voter, "epoch": q.get("epoch"),
                     "high_watermark": q.get("high_watermark"), "log_end_offset": q.get("log_end_offset"),
                     "lag": None, "pid": pid, "port": spec.port, "admin_port": spec.admin_port,
                     "kafka_port": spec.kafka_port})
    leaders = [v for v in views.values() if v and v.get("role") == "leader"]
    if leaders:
        leader = max(leaders, key=lambda v: v["epoch"])
        # Kafka's Lag: the leader's log end minus the replica's, as the leader sees it.
        seen = {r["replica_id"]: r["log_end_offset"]
                for group in ("voters", "observers") for r in leader.get("replicas", {}).get(group, [])}
        for row in rows:
            leo = seen.get(row["node"], row["log_end_offset"])
            if leo is not None and leo >= 0:
                row["lag"] = max(0, leader["log_end_offset"] - leo)
    return rows


def _cell(value) -> str:
    return "-" if value is None else str(value)


def cmd_status(args) -> int:
    cluster = load(args.dir)
    rows = status_rows(cluster)
    kafka = ",".join(f"{h}:{p}" for _, h, p in cluster.kafka_bootstrap())
    if args.output == "json":
        print(json.dumps({"cluster_id": cluster.cluster_id, "dir": cluster.root, "nodes": rows,
                          "kafka_bootstrap_servers": kafka or None}, indent=2))
    else:
        print(f"cluster {cluster.cluster_id!r} in {cluster.root}")
        header = ["NODE", "ROLE", "EPOCH", "HIGH-WATERMARK", "LOG-END", "LAG", "PID", "PORT", "ADMIN-PORT",
                  "KAFKA-PORT"]
        table = [header] + [[_cell(r[k]) for k in ("node", "role", "epoch", "high_watermark", "log_end_offset",
                                                    "lag", "pid", "port", "admin_port", "kafka_port")] for r in rows]
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        for row in table:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0 if any(r["pid"] for r in rows) else 3


# ------------------------------------------------------------------ down
def cmd_down(args) -> int:
    cluster = load(args.dir)
    running = {nid: cluster.running_pid(nid) for nid in running_nodes(cluster)}
    if not running:
        print(f"cluster in {cluster.root}: no broker running")
        return 0
    for nid, pid in running.items():
        os.kill(pid, signal.SIGCONT)  # a paused broker cannot handle SIGTERM
        os.kill(pid, signal.SIGTERM)
    left = _wait_gone(cluster, list(running), args.timeout_s)
    for nid, pid in running.items():
        if nid in left:
            print(f"node {nid}: still running after {args.timeout_s:g}s (pid {pid}); "
                  f"`metalog cluster kill {nid} {dir_flag(args.dir)}` stops it at once")
        else:
            print(f"node {nid}: stopped (pid {pid})")
    return 1 if left else 0


# ------------------------------------------------------------------ drills
def _signal_node(args, sig: int, verb: str) -> int:
    cluster = load(args.dir)
    nid = _node(cluster, args.node, args.dir)
    pid = cluster.running_pid(nid)
    if pid is None:
        raise ClusterCliError(f"node {nid} is not running (`metalog cluster status {dir_flag(args.dir)}`)")
    os.kill(pid, sig)
    if sig == signal.SIGKILL:
        if _wait_gone(cluster, [nid], 10.0):
            raise ClusterCliError(f"node {nid} (pid {pid}) still exists 10s after SIGKILL")
    print(f"node {nid}: {verb} (pid {pid})")
    return 0


def cmd_kill(args) -> int:
    return _signal_node(args, signal.SIGKILL, "killed with SIGKILL")


def cmd_pause(args) -> int:
    return _signal_node(args, signal.SIGSTOP, "paused with SIGSTOP")


def cmd_resume(args) -> int:
    return _signal_node(args, signal.SIGCONT, "resumed with SIGCONT")


def cmd_restart(args) -> int:
    cluster = load(args.dir)
    nid = _node(cluster, args.node, args.dir)
    # Before stopping it: a broker.yaml edited by hand is not overwritten.
    edit = cluster.hand_edit(nid) if cluster.nodes[nid].command is None else None
    if edit is not None:
        raise ClusterCliError(f"{edit}; node {nid} was left as it is")
    pid = cluster.running_pid(nid)
    if pid is not None:
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGTERM)
        if _wait_gone(cluster, [nid], args.timeout_s):
            os.kill(pid, signal.SIGKILL)
            if _wait_gone(cluster, [nid], 10.0):
                raise ClusterCliError(f"node {nid} (pid {pid}) did not stop")
    if cluster.nodes[nid].removed:  # brought back by hand: `cluster up` starts it again too
        cluster.nodes[nid].removed = False
        cluster.save_state()
    try:
        proc = cluster.start_node(nid)
    except ConfigEditedError as exc:  # edited between the check and the start
        raise ClusterCliError(str(exc)) from None
    deadline = time.monotonic() + args.ready_timeout_s
    while cluster.quorum(nid) is None:
        if proc.poll() is not None:
            raise ClusterCliError(f"node {nid} exited with code {proc.returncode} while starting; "
                                  f"see {os.path.join(cluster.node_dir(nid), 'stderr.log')}")
        if time.monotonic() > deadline:
            raise ClusterCliError(f"node {nid} (pid {proc.pid}) started but its admin API did not answer "
                                  f"within {args.ready_timeout_s:g}s; see {cluster.log_path(nid)}")
        time.sleep(POLL_S)
    print(f"node {nid}: restarted (pid {proc.pid})")
    return 0


# ------------------------------------------------------------------ voters (KIP-853)
def cmd_add_node(args) -> int:
    cluster = load(args.dir)
    try:
        if args.node is not None:
            nid = _node(cluster, args.node, args.dir)
            if not cluster.alive(nid):
                raise ClusterCliError(f"node {nid} is not running: start it first "
                                      f"(`metalog cluster restart {nid} {dir_flag(args.dir)}`)")
            directory_id = membership.add_voter(cluster, nid, args.timeout_s)
        else:
            nid, directory_id = membership.add_node(cluster, args.timeout_s)
    except membership.MembershipError as exc:
        raise ClusterCliError(str(exc)) from None
    spec = cluster.nodes[nid]
    voters = sorted(n for n, s in cluster.nodes.items() if s.voter)
    host = cluster.node_host(nid)
    kafka = f", kafka {host}:{spec.kafka_port}" if spec.kafka_port is not None else ""  # Kafka clients' bootstrap
    print(f"node {nid}: a voter (directory id {directory_id}, listen {host}:{spec.port}, admin "
          f"{cluster.admin_scheme}://{host}:{spec.admin_port}{kafka}); voters now {', '.join(map(str, voters))}")
    return 0


def cmd_remove_node(args) -> int:
    cluster = load(args.dir)
    nid = _node(cluster, args.node, args.dir)
    try:
        if args.keep_running:
            directory_id = membership.remove_voter(cluster, nid, args.timeout_s)
        else:
            directory_id = membership.remove_node(cluster, nid, args.timeout_s)
    except membership.MembershipError as exc:
        raise ClusterCliError(str(exc)) from None
    voters = sorted(n for n, s in cluster.nodes.items() if s.voter)
    what = "an observer, still running" if args.keep_running else "stopped"
    print(f"node {nid}: removed from the voters (directory id {directory_id}), {what}; "
          f"voters now {', '.join(map(str, voters))}")
    return 0


# ------------------------------------------------------------------ logs
def _tail_lines(path: str, n: int) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return f.readlines()[-n:] if n else []
    except FileNotFoundError:
        return []


def cmd_logs(args) -> int:
    cluster = load(args.dir)
    nodes = [_node(cluster, args.node, args.dir)] if args.node is not None else sorted(cluster.nodes)
    prefix = len(nodes) > 1
    for nid in nodes:
        for line in _tail_lines(cluster.log_path(nid), args.lines):
            sys.stdout.write(f"node-{nid} | {line}" if prefix else line)
    sys.stdout.flush()
    if not args.follow:
        return 0
    files = {}
    for nid in nodes:
        path = cluster.log_path(nid)
        files[nid] = [path, os.path.getsize(path) if os.path.exists(path) else 0]
    while True:  # until Ctrl-C (the CLI answers 130)
        for nid, entry in files.items():
            path, pos = entry
            try:
                size = os.path.getsize(path)
            except FileNotFoundError:
                continue
            if size < pos:  # replaced or truncated: start again from its beginning
                pos = 0
            if size > pos:
                with open(path, errors="replace") as f:
                    f.seek(pos)
                    chunk = f.read(1 << 20)  # bounded read per turn
                    end = chunk.rfind("\n") + 1  # only whole lines
                    for line in chunk[:end].splitlines(keepends=True):
                        sys.stdout.write(f"node-{nid} | {line}" if prefix else line)
                    pos += len(chunk[:end].encode())
                sys.stdout.flush()
            entry[1] = pos
        time.sleep(0.2)


# ------------------------------------------------------------------ parser
def register(csub: argparse._SubParsersAction, default_dir: str) -> None:
    def with_dir(p):
        p.add_argument("--dir", default=default_dir, help=f"the cluster directory (default {default_dir})")
        return p

    p = with_dir(csub.add_parser("status", help="node, role, epoch, high watermark, log end, lag, pid, ports"))
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    p.set_defaults(func=cmd_status)

    p = with_dir(csub.add_parser("down", help="SIGTERM every broker, wait, report"))
    p.add_argument("--timeout-s", type=float, default=15.0, help="how long to wait for the brokers to exit")
    p.set_defaults(func=cmd_down)

    p = with_dir(csub.add_parser("logs", help="a node's broker.log (every node's, prefixed, without NODE)"))
    p.add_argument("node", type=int, nargs="?")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines (Ctrl-C stops)")
    p.add_argument("-n", "--lines", type=int, default=50, help="lines to show from the end of each log")
    p.set_defaults(func=cmd_logs)

    for name, fn, what in (("kill", cmd_kill, "kill -9 a broker (it loses what it had not fsynced)"),
                           ("pause", cmd_pause, "freeze a broker with SIGSTOP"),
                           ("resume", cmd_resume, "SIGCONT a paused broker")):
        p = with_dir(csub.add_parser(name, help=what))
        p.add_argument("node", type=int)
        p.set_defaults(func=fn)

    p = with_dir(csub.add_parser("add-node", help="start a new broker (formatted --no-initial-controllers) and, "
                                                  "once it is a caught-up observer, make it a voter (KIP-853)"))
    p.add_argument("--node", type=int, help="make this running observer of the cluster a voter instead of "
                                            "starting a new broker")
    p.add_argument("--timeout-s", type=float, default=60.0, help="give up after this long")
    p.set_defaults(func=cmd_add_node)

    p = with_dir(csub.add_parser("remove-node", help="remove voter NODE (RemoveRaftVoter), wait until the "
                                                     "change is committed, stop it"))
    p.add_argument("node", type=int)
    p.add_argument("--keep-running", action="store_true", help="leave it running as an observer")
    p.add_argument("--timeout-s", type=float, default=60.0, help="give up after this long")
    p.set_defaults(func=cmd_remove_node)

    p = with_dir(csub.add_parser("restart", help="stop a broker (SIGTERM) and start it again"))
    p.add_argument("node", type=int)
    p.add_argument("--timeout-s", type=float, default=15.0, help="wait this long for it to stop, then SIGKILL")
    p.add_argument("--ready-timeout-s", type=float, default=30.0)
    p.set_defaults(func=cmd_restart)
