"""The ``metalog`` command line.

    metalog cluster up          start a local cluster (3 voters + 1 observer; --detach: background)
    metalog cluster status|down|logs|kill|pause|resume|restart|add-node|remove-node   manage it (tools/cli/cluster.py)
    metalog broker --config F   run one broker
    metalog produce VALUE...    write records (answers offset and epoch once committed)
    metalog consume             read committed records, with KIP-320 truncation detection
    metalog quorum              DescribeQuorum from the leader
    metalog quorum add-voter|remove-voter   KIP-853 voter changes (AddRaftVoter / RemoveRaftVoter)
    metalog features describe|upgrade       kraft.version (UpdateFeatures): static voters -> dynamic online
    metalog metadata            leader, epoch, HW and endpoints from any broker

    metalog topics|brokers|configs ...   controller commands (tools/cli/admin.py)
    metalog storage verify|recover       offline log checks (tools/cli/storage.py)
    metalog dump | spark | drill | bench      (their own modules register them)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
import traceback

from metalog.broker.client import AuthorizationError, ClusterUnavailable, LogTruncationError, MetalogError, TlsFailure
from metalog.broker.client.config import ClientConfigError
from metalog.broker.server.recovery import META_FILE
from metalog.broker.server.logging_setup import configure_logging
from metalog.broker.net.tls import TlsConfigError
from metalog.protocol.messages import LIST_OFFSETS_EARLIEST, LIST_OFFSETS_LATEST
from metalog.tools.bench import bench
from metalog.tools.cli import admin as admin_cli
from metalog.tools.cli import certs as certs_cli
from metalog.tools.cli import cluster as cluster_cli
from metalog.tools.cli import dump
from metalog.tools.cli import storage as storage_cli
from metalog.tools.kafka import follow as kafka_follow
from metalog.tools.cli.client_options import DEFAULT_CLUSTER_ID, add_client_args, make_client, tls_hint
from metalog.tools.cli.cluster import ClusterCliError, dir_flag, running_nodes
from metalog.tools.cli.dump import record_json
from metalog.tools.cluster.compose import cluster_from_compose
from metalog.tools.cluster.launcher import LocalCluster
from metalog.tools.drill import drill
from metalog.tools.spark import job as spark_job


# ------------------------------------------------------------------ cluster
def _check_same_quorum_mode(args) -> None:
    """Data dirs an earlier `cluster up` bound keep their quorum mode: a static
    cluster's dirs hold no voter set, so started dynamic every broker would be
    an observer (no leader ever), and a dynamic one's voter set is in its log."""
    try:
        with open(os.path.join(args.dir, "cluster.json")) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return
    was_dynamic = bool(state.get("dynamic", False))
    bound = [n["node_id"] for n in state.get("nodes", [])
             if os.path.exists(os.path.join(args.dir, f"node-{n['node_id']}", "data", "meta.properties"))]
    if bound and was_dynamic == args.static_voters:
        had = "a dynamic quorum (kraft.version 1)" if was_dynamic else "static voters (kraft.version 0)"
        way = "without --static-voters" if was_dynamic else "with --static-voters"
        raise ClusterCliError(f"{os.path.abspath(args.dir)} holds the data of a cluster with {had}: start it "
                              f"{way}, or use another --dir (or remove this one) for a new cluster")


def _cluster_on_disk(args) -> LocalCluster | None:
    """The cluster cluster.json describes when some node's data dir is
    formatted (its data is bound to that layout: node ids, ports, directory
    ids, voters added or removed since), else None (a fresh layout may be made)."""
    try:
        cluster = LocalCluster.load(args.dir)
    except (OSError, ValueError, KeyError):
        return None
    if any(os.path.exists(os.path.join(cluster.data_dir(nid), META_FILE)) for nid in cluster.nodes):
        return cluster
    return None


def cmd_cluster_up(args) -> int:
    existing = None
    if os.path.exists(os.path.join(args.dir, "cluster.json")):
        try:
            running = running_nodes(LocalCluster.load(args.dir))
        except (OSError, ValueError, KeyError):
            running = []
        if running:
            raise ClusterCliError(f"a cluster in {os.path.abspath(args.dir)} is already running (nodes "
                                  f"{', '.join(map(str, running))}): `metalog cluster down {dir_flag(args.dir)}` "
                                  f"stops it")
        if not args.compose:
            _check_same_quorum_mode(args)
            existing = _cluster_on_disk(args)
    if args.compose:
        cluster = cluster_from_compose(args.compose, args.dir, insecure=args.insecure)
    elif existing is not None:
        # Restart the cluster as it is on disk: a fresh 3+1 layout would give
        # the formatted dirs new directory ids and forget nodes added later.
        cluster = existing
        start_ids = [nid for nid in sorted(cluster.nodes) if not cluster.nodes[nid].removed]
        skipped = sorted(set(cluster.nodes) - set(start_ids))
        print(f"metalog: {cluster.root} holds a cluster: starting it as it is on disk (nodes "
              f"{', '.join(map(str, start_ids))}; --voters, --observers, --base-port and --cluster-id are "
              f"ignored)" + (f"; removed node(s) {', '.join(map(str, skipped))} stay stopped" if skipped else ""),
              file=sys.stderr)
    else:
        cluster = LocalCluster.create(args.dir, voters=args.voters, observers=args.observers,
                                      base_port=args.base_port, cluster_id=args.cluster_id,
                                      insecure=args.insecure, dynamic=not args.static_voters)
    cluster_cli.apply_up_settings(cluster, args)  # --set/--node-set; a hand-edited broker.yaml: refused
    if cluster.insecure:
        print("metalog: WARNING: --insecure: brokers talk plaintext without authentication", file=sys.stderr)
    stop = {"now": False}

    def on_signal(signum, _frame):
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    cluster.start([nid for nid in sorted(cluster.nodes) if not cluster.nodes[nid].removed])

    def leader_or_dead_broker():
        for nid, proc in cluster.procs.items():
            if proc.poll() is not None:
                return ("dead", nid, proc.returncode)
        found = cluster.leader()
        return ("leader", *found) if found else None

    try:
        outcome = cluster.wait_for(leader_or_dead_broker, args.ready_timeout_s, "a leader")
    except TimeoutError as exc:
        print(f"metalog: cluster did not elect a leader: {exc}; see {cluster.root}/node-*/broker.log",
              file=sys.stderr)
        cluster.stop()
        return 1
    if outcome[0] == "dead":
        _, nid, rc = outcome
        tail = _tail(os.path.join(cluster.node_dir(nid), "stderr.log"))
        print(f"metalog: broker {nid} exited with code {rc} while starting:\n{tail}", file=sys.stderr)
        cluster.stop()
        return 1
    _, leader, epoch = outcome
    print(f"metalog cluster {cluster.cluster_id!r} is up: leader {leader}, epoch {epoch}")
    if cluster.dynamic:
        print("dynamic quorum (KIP-853, kraft.version 1): `metalog cluster add-node|remove-node` change the voters")
    else:
        print("static voters (kraft.version 0): the voter set is fixed by the brokers' config")
    print(f"{'node':>4}  {'role':10} {'listen':22} {'admin':22} data")
    for nid, spec in sorted(cluster.nodes.items()):
        q = cluster.quorum(nid) or {}
        print(f"{nid:>4}  {q.get('role', '?'):10} {cluster.host + ':' + str(spec.port):22} "
              f"{cluster.admin_scheme + '://' + cluster.host + ':' + str(spec.admin_port):22} {cluster.data_dir(nid)}")
    print(f"\nclient config (bootstrap, CA, admin certificate): {cluster.client_config_path}")
    kafka = ",".join(f"{h}:{p}" for _, h, p in cluster.kafka_bootstrap())
    if kafka:
        print(f"Kafka clients: bootstrap.servers={kafka} (librdkafka/Java properties: "
              f"{cluster.kafka_properties_path})")
    if not cluster.insecure:
        print(f"certificates: {cluster.cert_dir} (CA, node-N, admin)")
    # Every hint runs exactly as printed (a test runs them).
    d = dir_flag(args.dir)
    print(f"try:  metalog produce --client-config {cluster.client_config_path} hello")
    print(f"      metalog consume --client-config {cluster.client_config_path} --from earliest --idle-exit-s 1")
    print(f"      metalog cluster status {d}")
    print(f"      metalog cluster logs {d} {min(cluster.nodes)}")
    if kafka:
        print(f"      kcat -F {cluster.kafka_properties_path} -L")
    print("      (from the repo root, run/cluster/client.yaml is found without --client-config)")
    sys.stdout.flush()
    if args.exit_when_ready:
        cluster.stop()
        return 0
    if args.detach:
        print(f"the brokers run in the background (pid files and logs in {cluster.root}/node-N/); "
              f"stop them with:  metalog cluster down {d}")
        sys.stdout.flush()
        return 0
    print("Ctrl-C stops the cluster.")
    sys.stdout.flush()
    while not stop["now"]:
        time.sleep(0.2)
        # The brokers this command started (a removed node of a restarted cluster is not one).
        dead = [nid for nid in cluster.procs if not cluster.alive(nid)]
        if dead and len(dead) == len(cluster.procs):
            codes = {nid: cluster.procs[nid].returncode for nid in dead}
            if all(code == 0 for code in codes.values()):  # e.g. `metalog cluster down` from elsewhere
                print("metalog: every broker stopped cleanly", file=sys.stderr)
                return 0
            print(f"metalog: every broker exited (exit codes {codes}); see {cluster.root}/node-N/broker.log",
                  file=sys.stderr)
            return 1
    cluster.stop()
    # Brokers `metalog cluster add-node` started from another process are in
    # cluster.json only: Ctrl-C stops them too.
    try:
        others = LocalCluster.load(args.dir)
    except (OSError, ValueError, KeyError):
        return 0
    for nid in running_nodes(others):
        if nid not in cluster.procs:
            others.terminate(nid)
    return 0


def _tail(path: str, lines: int = 5) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:]).rstrip()
    except OSError:
        return "(no output)"


# ------------------------------------------------------------------ client
async def _with_client(args, fn):
    client = make_client(args)
    try:
        return await fn(client)
    finally:
        await client.close()


def cmd_produce(args) -> int:
    values = [v.encode() for v in args.values] or [line.rstrip("\n").encode() for line in sys.stdin]

    async def go(client):
        client.idempotent = not args.no_idempotence
        offset, epoch = await client.produce(values)
        print(json.dumps({"base_offset": offset, "leader_epoch": epoch, "records": len(values)}))
        return 0

    return asyncio.run(_with_client(args, go))


def cmd_consume(args) -> int:
    async def go(client):
        consumer = client.consumer(reset_policy=args.reset)
        if args.offset is not None:
            consumer.seek(args.offset, args.epoch)
        else:
            where = LIST_OFFSETS_EARLIEST if args.start == "earliest" else LIST_OFFSETS_LATEST
            resp = await client.list_offsets(where)
            consumer.seek(resp.offset, resp.leader_epoch if args.start == "latest" else -1)
        got = 0
        deadline = time.monotonic() + args.idle_exit_s if args.idle_exit_s else None
        while args.max_records is None or got < args.max_records:
            try:
                records = await consumer.poll(max_wait_ms=500)
            except LogTruncationError as exc:
                print(f"metalog: log truncated under us: {exc}", file=sys.stderr)
                return 5
            for rec in records:
                if args.max_records is not None and got >= args.max_records:
                    break  # a poll can return more than asked for
                # Metadata records decoded (type, version, fields); produced values as
                # UTF-8 text or base64; --raw: every value as base64 of its bytes.
                print(json.dumps(record_json(rec.offset, rec.leader_epoch, rec.value, False, raw=args.raw)))
                got += 1
            if records and args.idle_exit_s:
                deadline = time.monotonic() + args.idle_exit_s
            if deadline is not None and time.monotonic() > deadline:
                break
        return 0

    return asyncio.run(_with_client(args, go))


def cmd_quorum(args) -> int:
    async def go(client):
        resp = await client.describe_quorum()
        leader_leo = next((r.log_end_offset for r in resp.voters if r.replica_id == resp.leader_id), None)
        print(json.dumps({
            "leader_id": resp.leader_id, "leader_epoch": resp.leader_epoch,
            "high_watermark": resp.high_watermark,
            "voters": [_replica(r, leader_leo) for r in resp.voters],
            "observers": [_replica(r, leader_leo) for r in resp.observers],
        }, indent=2))
        return 0

    return asyncio.run(_with_client(args, go))


def quorum_status(resp, cluster_id: str) -> dict:
    """Kafka's `kafka-metadata-quorum describe --status` fields from a DescribeQuorum answer."""
    leader = next((r for r in resp.voters if r.replica_id == resp.leader_id), None)
    followers = [r for r in resp.voters if r.replica_id != resp.leader_id]
    lag, lag_time_ms = 0, 0
    if leader is not None and followers:
        # As Kafka computes them: the voter furthest behind, and how long since it was caught up.
        slowest = min(followers, key=lambda r: r.log_end_offset)
        lag = max(0, leader.log_end_offset - slowest.log_end_offset)
        if slowest.last_caught_up_timestamp_ms >= 0:
            lag_time_ms = max(0, leader.last_caught_up_timestamp_ms - slowest.last_caught_up_timestamp_ms)
        else:
            lag_time_ms = -1  # never caught up
    # As Kafka 3.9+ prints them (KIP-853): id, directory id and, for voters, endpoints as NAME://host:port.
    endpoints = {n.node_id: [f"{ln.name}://{ln.host}:{ln.port}" for ln in n.listeners] for n in resp.nodes}

    def replica(r, voter: bool) -> dict:
        out = {"id": r.replica_id, "directoryId": r.replica_directory_id or None}
        if voter:
            out["endpoints"] = endpoints.get(r.replica_id, [])
        return out
    return {"ClusterId": cluster_id, "LeaderId": resp.leader_id, "LeaderEpoch": resp.leader_epoch,
            "HighWatermark": resp.high_watermark, "MaxFollowerLag": lag, "MaxFollowerLagTimeMs": lag_time_ms,
            "CurrentVoters": [replica(r, True) for r in sorted(resp.voters, key=lambda r: r.replica_id)],
            "CurrentObservers": [replica(r, False) for r in sorted(resp.observers, key=lambda r: r.replica_id)]}


def quorum_replication(resp) -> list[dict]:
    """Kafka's `describe --replication` rows: leader first, then voters, then observers.
    DirectoryId is the replica's directory id (KIP-853, meta.properties' directory.id),
    null when the replica did not say it (a build from before directory ids).
    The timestamps are the leader's monotonic clock (not wall time), so each row
    also says how long ago that was, measured against the leader's own entry."""
    leader = next((r for r in resp.voters if r.replica_id == resp.leader_id), None)
    leader_leo = leader.log_end_offset if leader is not None else None
    leader_now_ms = leader.last_fetch_timestamp_ms if leader is not None else None

    def ago(ts: int):
        return None if ts < 0 or leader_now_ms is None else max(0, leader_now_ms - ts)
    rows = []
    for status, group in (("Leader", [r for r in resp.voters if r.replica_id == resp.leader_id]),
                          ("Follower", sorted((r for r in resp.voters if r.replica_id != resp.leader_id),
                                              key=lambda r: r.replica_id)),
                          ("Observer", sorted(resp.observers, key=lambda r: r.replica_id))):
        for r in group:
            rows.append({"NodeId": r.replica_id, "DirectoryId": r.replica_directory_id or None,
                         "LogEndOffset": r.log_end_offset,
                         "Lag": max(0, leader_leo - r.log_end_offset) if leader_leo is not None else None,
                         "LastFetchTimestamp": r.last_fetch_timestamp_ms,
                         "LastCaughtUpTimestamp": r.last_caught_up_timestamp_ms, "Status": status,
                         "LastFetchMsAgo": ago(r.last_fetch_timestamp_ms),
                         "LastCaughtUpMsAgo": ago(r.last_caught_up_timestamp_ms)})
    return rows


def cmd_quorum_describe(args) -> int:
    async def go(client):
        resp = await client.describe_quorum()
        if args.status:
            status = quorum_status(resp, client.cluster_id)
            if args.output == "json":
                print(json.dumps(status, indent=2))
            else:
                width = max(map(len, status))
                for key, value in status.items():
                    shown = json.dumps(value) if isinstance(value, list) else value  # as Kafka prints the sets
                    print(f"{key + ':':<{width + 1}} {shown}")
            return 0
        rows = quorum_replication(resp)
        if args.output == "json":
            print(json.dumps(rows, indent=2))
            return 0
        # As Kafka's --human-readable shows them: "N ms ago".
        header = ["NodeId", "DirectoryId", "LogEndOffset", "Lag", "LastFetchTimestamp", "LastCaughtUpTimestamp",
                  "Status"]
        shown = {"LastFetchTimestamp": "LastFetchMsAgo", "LastCaughtUpTimestamp": "LastCaughtUpMsAgo"}

        def cell(r, k):
            v = r[shown.get(k, k)]
            return "null" if v is None else f"{v} ms ago" if k in shown else str(v)

        table = [header] + [[cell(r, k) for k in header] for r in rows]
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        for row in table:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        return 0

    return asyncio.run(_with_client(args, go))


def _listener(text: str) -> tuple[str, str, int]:
    """[NAME=]host:port -> (listener name, host, port); CONTROLLER if unnamed."""
    name, _, addr = text.rpartition("=")
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterCliError(f"--listener: expected [NAME=]host:port, got {text!r}")
    return (name or "CONTROLLER", host, int(port))


def cmd_quorum_add_voter(args) -> int:
    listeners = [_listener(x) for x in args.listener]

    async def go(client):
        await client.add_voter(args.controller_id, args.controller_directory_id, listeners)
        print(json.dumps({"added": args.controller_id, "directory_id": args.controller_directory_id}))
        return 0

    return asyncio.run(_with_client(args, go))


def cmd_quorum_remove_voter(args) -> int:
    async def go(client):
        await client.remove_voter(args.controller_id, args.controller_directory_id)
        print(json.dumps({"removed": args.controller_id, "directory_id": args.controller_directory_id}))
        return 0

    return asyncio.run(_with_client(args, go))


def cmd_features_describe(args) -> int:
    """Kafka's `kafka-features describe`: one line per feature (or JSON)."""
    async def go(client):
        resp = await client.describe_features()
        finalized = {f.name: f.max_version_level for f in resp.finalized_features}
        rows = [{"Feature": f.name, "SupportedMinVersion": f.min_version, "SupportedMaxVersion": f.max_version,
                 "FinalizedVersionLevel": finalized.get(f.name, 0), "Epoch": resp.finalized_features_epoch}
                for f in resp.supported_features]
        if args.output == "json":
            print(json.dumps(rows, indent=2))
        else:
            for r in rows:
                print("\t".join(f"{k}: {v}" for k, v in r.items()))
        return 0

    return asyncio.run(_with_client(args, go))


def cmd_features_upgrade(args) -> int:
    async def go(client):
        await client.update_kraft_version(args.kraft_version, validate_only=args.dry_run)
        print(json.dumps({"feature": "kraft.version", "level": args.kraft_version,
                          "dry_run": args.dry_run}))
        return 0

    return asyncio.run(_with_client(args, go))


def _replica(r, leader_leo: int | None) -> dict:
    """One replica of DescribeQuorum. Its lag behind the leader's log end, not
    an in-sync flag: Kafka's DescribeQuorum has none (the admin API's /quorum
    reports in_sync by KIP-501's rule)."""
    return {"replica_id": r.replica_id, "directory_id": r.replica_directory_id or None,
            "log_end_offset": r.log_end_offset,
            "lag": None if leader_leo is None else max(0, leader_leo - r.log_end_offset),
            "last_fetch_timestamp_ms": r.last_fetch_timestamp_ms,
            "last_caught_up_timestamp_ms": r.last_caught_up_timestamp_ms}


def cmd_metadata(args) -> int:
    async def go(client):
        resp = await client.metadata()
        print(json.dumps({
            "cluster_id": resp.cluster_id, "leader_id": resp.leader_id, "leader_epoch": resp.leader_epoch,
            "high_watermark": resp.high_watermark, "log_start_offset": resp.log_start_offset,
            "voters": [[v.node_id, f"{v.host}:{v.port}"] for v in resp.voters],
        }, indent=2))
        return 0

    return asyncio.run(_with_client(args, go))


# ------------------------------------------------------------------ parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="metalog", description="metalog: a replicated metadata log",
                                     epilog="--debug (anywhere on the line): show the traceback of a failure")
    sub = parser.add_subparsers(dest="command", required=True)

    # Parsed by metalog.broker.server.main (tools/cli/__init__.py dispatches it); listed here for --help.
    sub.add_parser("broker", help="run one broker: metalog broker --config FILE [--set key=value ...] (--help-config: every key)",
                   add_help=False)

    p = sub.add_parser("cluster", help="local multi-broker cluster")
    csub = p.add_subparsers(dest="cluster_command", required=True)
    up = csub.add_parser("up", help="start a local cluster in the foreground (Ctrl-C stops it)")
    up.add_argument("--dir", default="run/cluster", help="where node dirs, configs and logs go")
    up.add_argument("--voters", type=int, default=3)
    up.add_argument("--observers", type=int, default=1)
    up.add_argument("--base-port", type=int, default=9091,
                    help="node i listens on base+i-1, its admin API on base+1000+i-1 (0 = any free ports)")
    up.add_argument("--cluster-id", default=DEFAULT_CLUSTER_ID)
    up.add_argument("--compose", help="run the broker services of this docker-compose file as local processes")
    up.add_argument("--ready-timeout-s", type=float, default=30.0)
    up.add_argument("--exit-when-ready", action="store_true", help="stop again once a leader is elected")
    up.add_argument("--static-voters", action="store_true",
                    help="voters fixed by the config (kraft.version 0) instead of a dynamic quorum formatted "
                         "--initial-controllers (KIP-853, the default: `cluster add-node|remove-node` change it)")
    up.add_argument("--insecure", action="store_true",
                    help="plaintext without certificates (every broker warns; /health says insecure)")
    up.add_argument("--detach", action="store_true",
                    help="start the brokers in the background and return once there is a leader "
                         "(`metalog cluster down` stops them)")
    cluster_cli.add_settings_args(up)
    up.set_defaults(func=cmd_cluster_up)
    cluster_cli.register(csub, default_dir="run/cluster")

    p = sub.add_parser("produce", help="write records; prints base offset and epoch once committed")
    add_client_args(p)
    p.add_argument("values", nargs="*", help="record values (default: one per stdin line)")
    p.add_argument("--no-idempotence", action="store_true",
                   help="plain produce: a retry after a lost answer may store the records twice "
                        "(default: idempotent, each record stored once)")
    p.set_defaults(func=cmd_produce)

    p = sub.add_parser("consume", help="read committed records")
    add_client_args(p)
    p.add_argument("--from", dest="start", choices=["earliest", "latest"], default="earliest")
    p.add_argument("--offset", type=int, help="start at this offset")
    p.add_argument("--epoch", type=int, default=-1, help="leader epoch of the record before --offset")
    p.add_argument("--reset", choices=["earliest", "latest", "none"], default="none",
                   help="what to do when the log was truncated under us (KIP-320)")
    p.add_argument("--max-records", type=int)
    p.add_argument("--idle-exit-s", type=float, default=0, help="exit after this long without records")
    p.add_argument("--raw", action="store_true", help="values as base64 of their bytes, not decoded")
    p.set_defaults(func=cmd_consume)

    p = sub.add_parser("quorum", help="DescribeQuorum from the leader (JSON; `quorum describe` for Kafka's views)")
    add_client_args(p)
    p.set_defaults(func=cmd_quorum)
    qsub = p.add_subparsers(dest="quorum_command")
    d = qsub.add_parser("describe", help="kafka-metadata-quorum describe: --status or --replication")
    add_client_args(d)
    which = d.add_mutually_exclusive_group(required=True)
    which.add_argument("--status", action="store_true",
                       help="ClusterId, LeaderId, LeaderEpoch, HighWatermark, MaxFollowerLag, ..., "
                            "CurrentVoters (id, directoryId, endpoints), CurrentObservers")
    which.add_argument("--replication", action="store_true",
                       help="per replica: NodeId, DirectoryId, LogEndOffset, Lag, LastFetchTimestamp, ..., Status")
    d.add_argument("-o", "--output", choices=["table", "json"], default="table")
    d.set_defaults(func=cmd_quorum_describe)
    for name, func, what in (("add-voter", cmd_quorum_add_voter, "AddRaftVoter: make a caught-up observer a voter"),
                             ("remove-voter", cmd_quorum_remove_voter, "RemoveRaftVoter: a voter leaves the set")):
        v = qsub.add_parser(name, help=f"{what} (KIP-853; returns once committed)")
        add_client_args(v)
        v.add_argument("--controller-id", type=int, required=True, help="the voter's node id")
        v.add_argument("--controller-directory-id", required=True,
                       help="its data dir's directory.id (meta.properties; `metalog quorum describe --replication`)")
        if name == "add-voter":
            v.add_argument("--listener", action="append", required=True, metavar="[NAME=]HOST:PORT",
                           help="where the voter listens (repeatable; name CONTROLLER if omitted)")
        v.set_defaults(func=func)

    p = sub.add_parser("features", help="kafka-features: describe the features, upgrade kraft.version")
    fsub = p.add_subparsers(dest="features_command", required=True)
    f = fsub.add_parser("describe", help="supported and finalized feature levels (from the leader)")
    add_client_args(f)
    f.add_argument("-o", "--output", choices=["table", "json"], default="table")
    f.set_defaults(func=cmd_features_describe)
    f = fsub.add_parser("upgrade", help="UpdateFeatures: kraft.version 0 -> 1 online (static voters -> the "
                                        "voter set in the log, KIP-853); returns once committed")
    add_client_args(f)
    f.add_argument("--kraft-version", type=int, required=True, choices=[0, 1],
                   help="the level to finalize (1: voters from the log; a downgrade is refused)")
    f.add_argument("--dry-run", action="store_true", help="only check that the leader would accept it")
    f.set_defaults(func=cmd_features_upgrade)

    p = sub.add_parser("metadata", help="leader, epoch, HW and endpoints")
    add_client_args(p)
    p.set_defaults(func=cmd_metadata)

    # Subcommands that live with their tools: each module adds its own parsers.
    for module in (admin_cli, dump, spark_job, drill, bench, storage_cli, certs_cli, kafka_follow):
        module.register_cli(sub)
    return parser


def main(argv: list[str]) -> int:
    """Every command but ``metalog broker``, which tools/cli/__init__.py hands to the broker first."""
    assert argv[:1] != ["broker"], "tools/cli/__init__.py dispatches `metalog broker`"
    # --debug may stand anywhere on the line: a failure then shows its traceback.
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    args = build_parser().parse_args(argv)
    # Client-side logs go to stderr so stdout stays machine-readable.
    # The CLI prints its own one-line errors; library warnings only when asked for.
    configure_logging(os.environ.get("METALOG_LOG_LEVEL", "error"), sys.stderr)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`metalog dump ... | head`): as for any Unix filter, not an error
        # to report. Point stdout at /dev/null so the interpreter's final flush stays quiet too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except AuthorizationError as exc:
        # Permanent until an ACL is added: one line, no traceback, its own exit code.
        if debug:
            traceback.print_exc()
        print(f"metalog: error: {exc}", file=sys.stderr)
        return 3
    except (ClientConfigError, TlsConfigError, ClusterUnavailable, MetalogError, ClusterCliError) as exc:
        # One line, no traceback: e.g. "metalog: error: TLS handshake with 127.0.0.1:9091 failed: ..."
        if debug:
            traceback.print_exc()
        hint = ""
        if getattr(args, "insecure", False) and isinstance(exc, ClusterUnavailable):
            # A TLS broker closes a plaintext connection (or never answers it): say the likely cause.
            hint = " (plaintext to a TLS port? if the cluster uses TLS, drop --insecure)"
        elif isinstance(exc, TlsFailure):  # whose CA and certificate: perhaps another cluster's
            hint = tls_hint(args)
        print(f"metalog: error: {exc}{hint}", file=sys.stderr)
        return 1
    except (OSError, TimeoutError) as exc:
        if debug:
            traceback.print_exc()
        print(f"metalog: error: {exc or type(exc).__name__}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - the last resort: one line, the traceback only on request
        if debug:
            traceback.print_exc()
            print(f"metalog: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        else:
            print(f"metalog: error: {type(exc).__name__}: {exc} (run again with --debug for the traceback)",
                  file=sys.stderr)
        return 1
