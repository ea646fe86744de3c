"""Quorum commit latency idle vs. under hostile load (issues 13 and 34).

    .venv/bin/python -m metalog.tools.bench.hostile --hostile 200 --flood-per-s 1000 --duration-s 8
    metalog bench --only hostile          (the same, as a section of the bench)

Starts a local 3-voter cluster (mutual TLS, default settings), measures one
client's commit latency (produce, await commit, repeat) for ``--duration-s``
idle, then under each attack, run from a separate process against the
leader's port:

* **connections**: ``--hostile`` connections, each looping over one of three
  behaviours and reconnecting at once when cut: stalled (3 bytes of a frame,
  then nothing), garbage (random bytes), bad handshake (TLS with a
  certificate of another CA); from 127.0.1.x;
* **flood**: ``--flood-per-s`` new connections a second, each sending a
  TLS ClientHello (made once, replayed: the attacker spends nothing on
  crypto, the server a key exchange and a signature per answer) and waiting
  up to 2 s for the answer; from 127.0.2.x (other addresses than the first
  attack's, whose back-offs would otherwise still hold them);
* with ``--flood-sink``, the same flood at a bare listener of its own
  process beside the cluster, which closes each connection at once: the
  commits it costs are what the flood costs through the machine (the
  attacker's CPU, the kernel's connections) on cores the cluster shares,
  with no broker in the way, the floor under the leader's own figure.

The attackers come from many loopback addresses, as an attacker's would from
other hosts; the client and the peers use 127.0.0.1 (the voters' host: exempt
from the connection limits, which it does not need: it keeps one connection).
Prints, per attack (each after an idle window of its own, so that other
work on the machine skews both alike): idle and attacked p50/p99, the p99
ratio (goal <= 2x),
commits per second both ways (goal: attacked >= 80% of idle), errors, the
share of a core the leader spent in TLS handshakes (its
``metalog_tls_handshake_seconds`` over the window: the CPU time of its
handshake thread, off the loop since issue 34's handshake threads), how
many log lines the leader wrote per refusal event and what its kernel
dropped. With ``--rounds N`` each attack gets N idle and N attacked windows
in turn, and the report gives the round with the median commits share with
every round's ratios: on a shared 2-core machine one window's idle rate
swings by a third between runs, the median of interleaved rounds much less.
``metalog bench --only hostile`` runs 3 rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import errno
import json
import os
import random
import re
import resource
import selectors
import socket
import ssl
import subprocess
import sys
import tempfile
import time

import uvloop
import yaml

from metalog.broker.client import MetalogClient
from metalog.tools.bench.common import latency_summary_ms
from metalog.tools.cluster import certs
from metalog.tools.cluster.launcher import REPO_ROOT, LocalCluster

CLUSTER_ID = "metalog-hostile"
WARMUP_S = 2.0  # the attack runs this long before the client measures
FLOOD_GIVE_UP_S = 2.0  # a flood connection not done by then is dropped by the attacker
FLOOD_INFLIGHT_MAX = 4000  # attacker's open flood connections (its file descriptors)
REFUSED_REASONS = ("handshake_queue_full", "backoff")  # the leader's refusals before a handshake, told in the report
# What the leader's kernel dropped for it (metalog.broker.net.syn_filter), told in the report too.
SHEDS_METRIC = 'metalog_listener_syn_sheds_total{listener="binary"}'
BANNED_METRIC = 'metalog_listener_syn_filtered_addresses{listener="binary"}'
LOG_EVENTS = ("tls_handshake_failed", "bad_frame", "bad_header", "connection_idle_closed", "connection_refused",
              "connection_backoff", "connection_refusals_summary")


async def _measure(cluster: LocalCluster, duration_s: float) -> dict:
    client = MetalogClient(cluster.bootstrap(), CLUSTER_ID, tls=cluster.client_tls(), request_timeout_ms=5000)
    lat_us: list[int] = []
    errors = 0
    try:
        await client.produce([b"warm"])
        stop = time.monotonic() + duration_s
        while time.monotonic() < stop:
            t0 = time.monotonic()
            try:
                await client.produce([b"x" * 100])
            except Exception:  # counted and reported: the figure must show failures, not hide them
                errors += 1
                continue
            lat_us.append(int((time.monotonic() - t0) * 1e6))
    finally:
        await client.close()
    out = latency_summary_ms(lat_us)
    out["errors"] = errors
    out["commits_per_s"] = round(len(lat_us) / duration_s, 1)
    return out


# ---------------------------------------------------------------- the attackers (own process)
def _bad_context(bad_ca_dir: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.load_cert_chain(os.path.join(bad_ca_dir, "mallory.crt"), os.path.join(bad_ca_dir, "mallory.key"))
    return ctx


async def _connections(host: str, port: int, n: int, duration_s: float, bad_ca_dir: str) -> dict:
    ctx = _bad_context(bad_ca_dir)
    stats = {"connects": 0, "connect_errors": 0}
    stop = time.monotonic() + duration_s
    rng = random.Random(7)

    async def one(i: int) -> None:
        kind = ("stalled", "garbage", "handshake")[i % 3]
        source = f"127.0.1.{1 + i % 250}"
        while time.monotonic() < stop:
            try:
                if kind == "handshake":
                    reader, writer = await asyncio.wait_for(asyncio.open_connection(
                        host, port, ssl=ctx, server_hostname=host, local_addr=(source, 0)), 5)
                else:
                    reader, writer = await asyncio.wait_for(asyncio.open_connection(
                        host, port, local_addr=(source, 0)), 5)
                stats["connects"] += 1
                if kind == "stalled":
                    writer.write(b"\x00\x00\x00")
                elif kind == "garbage":
                    writer.write(rng.randbytes(rng.randrange(1, 300)))
                else:
                    writer.write(b"\x00\x00\x00\x10" + b"\x00" * 16)
                remaining = stop - time.monotonic()
                try:
                    await asyncio.wait_for(reader.read(1 << 16), max(remaining, 0.01))
                except (TimeoutError, OSError):
                    pass
                writer.close()
            except (OSError, TimeoutError, ssl.SSLError):
                stats["connect_errors"] += 1
                await asyncio.sleep(0.01)  # the loop's only pause: a refused connect retries at once otherwise

    await asyncio.gather(*(one(i) for i in range(n)))
    return stats


def client_hello(ctx: ssl.SSLContext) -> bytes:
    """A TLS ClientHello, made once: the flood replays it (the server's cost, not the attacker's)."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname="metalog")
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


def _flood(host: str, port: int, per_s: int, duration_s: float, bad_ca_dir: str) -> dict:
    """`per_s` new connections a second, each sending a ClientHello and waiting (up to
    FLOOD_GIVE_UP_S) for the server's answer to it, its key share and certificate, which
    cost the server a signature: the cheap-for-us, costly-for-them handshake flood.

    Bare non-blocking sockets under one selector rather than asyncio streams: the attacker
    shares the cluster's cores, and a Task, a StreamReader and a timeout per connection cost
    it about 150 us of CPU a connection where bare sockets take 90 (most of it the kernel's
    connect), CPU an attacker on another host would not take from the cluster. The server
    sees the same traffic."""
    hello = client_hello(_bad_context(bad_ca_dir))
    stats = {"opened": 0, "server_answered": 0, "gave_up": 0, "connect_errors": 0, "skipped_at_cap": 0}
    flood = _LeanFlood(host, port, hello, stats)
    start_s = time.monotonic()
    i = 0
    while True:
        elapsed_s = time.monotonic() - start_s
        if elapsed_s < duration_s:
            due = int(elapsed_s * per_s)
            while i < due:  # bounded: at most per_s * duration_s openings in all
                if flood.open_count() >= FLOOD_INFLIGHT_MAX:
                    stats["skipped_at_cap"] += 1
                else:
                    flood.open(f"127.0.2.{1 + i % 250}")
                i += 1
        elif flood.open_count() == 0 or elapsed_s > duration_s + FLOOD_GIVE_UP_S + 1:
            break
        flood.poll(0.005)  # also the pacing tick of the flood
    flood.close_all()
    return stats


class _LeanFlood:
    """The flood's connections: connect, send the ClientHello, wait for an answer or give up."""

    def __init__(self, host: str, port: int, hello: bytes, stats: dict) -> None:
        self.address, self.hello, self.stats = (host, port), hello, stats
        self.selector = selectors.DefaultSelector()
        self.give_up: collections.deque[tuple[float, socket.socket]] = collections.deque()  # in opening order

    def open_count(self) -> int:
        return len(self.selector.get_map())

    def open(self, source: str) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        self.stats["opened"] += 1
        try:
            sock.bind((source, 0))
            err = sock.connect_ex(self.address)
        except OSError:
            err = -1
        if err not in (0, errno.EINPROGRESS):
            self.stats["connect_errors"] += 1
            sock.close()
            return
        self.selector.register(sock, selectors.EVENT_WRITE, "connecting")
        self.give_up.append((time.monotonic() + FLOOD_GIVE_UP_S, sock))

    def poll(self, timeout_s: float) -> None:
        for key, _ in self.selector.select(timeout_s):
            sock = key.fileobj
            if key.data == "connecting":
                self._connected(sock)  # type: ignore[arg-type]
            else:
                self._answered(sock)  # type: ignore[arg-type]
        now_s = time.monotonic()
        while self.give_up and self.give_up[0][0] <= now_s:
            _, sock = self.give_up.popleft()
            if sock.fileno() >= 0:
                self._finish(sock, "gave_up")

    def _connected(self, sock: socket.socket) -> None:
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            return self._finish(sock, "connect_errors")
        try:
            sock.send(self.hello)
        except OSError:
            return self._finish(sock, "connect_errors")
        self.selector.modify(sock, selectors.EVENT_READ, "waiting")

    def _answered(self, sock: socket.socket) -> None:
        try:
            answered = sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            answered = b""
        self._finish(sock, "server_answered" if answered else "connect_errors")

    def _finish(self, sock: socket.socket, outcome: str) -> None:
        self.stats[outcome] += 1
        self.selector.unregister(sock)
        sock.close()

    def close_all(self) -> None:
        for key in list(self.selector.get_map().values()):
            self._finish(key.fileobj, "gave_up")  # type: ignore[arg-type]
        self.selector.close()


async def _sink(duration_s: float) -> None:
    """A bare listener that closes each connection at once: what the flood costs the machine
    (the attacker, the kernel's connections) with no broker in the way."""
    async def close(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.transport.abort()

    server = await asyncio.start_server(close, "127.0.0.1", 0, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.sleep(duration_s)  # the sink lives as long as the attack it receives
    server.close()


def attacker_main(argv: list[str]) -> int:
    kind, host, port, n, duration_s, bad = argv[0], argv[1], int(argv[2]), int(argv[3]), float(argv[4]), argv[5]
    before = resource.getrusage(resource.RUSAGE_SELF)  # after the imports: the attack's own CPU only
    if kind == "connections":
        stats = uvloop.run(_connections(host, port, n, duration_s, bad))
    else:
        stats = _flood(host, port, n, duration_s, bad)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = usage.ru_utime + usage.ru_stime - before.ru_utime - before.ru_stime
    stats["cpu_per_s"] = round(cpu_s / duration_s, 2)  # the attacker's own share of a core
    print(json.dumps(stats), flush=True)
    return 0


# ---------------------------------------------------------------- the bench
def _metric(cluster: LocalCluster, node: int, name: str) -> float | None:
    """One sample of the node's /metrics (None if the admin API does not answer)."""
    import urllib.request

    url = f"{cluster.admin_scheme}://{cluster.node_host(node)}:{cluster.nodes[node].admin_port}/metrics"
    ctx = None if cluster.insecure else cluster.client_tls().client()
    try:
        with urllib.request.urlopen(url, timeout=5, context=ctx) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    found = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(found.group(1)) if found else None


def _cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _measure_with_cpu(cluster: LocalCluster, leader: int, duration_s: float) -> dict:
    """`_measure`, plus the share of one core the leader's process used meanwhile."""
    pid = cluster.running_pid(leader)
    cpu0, t0 = _cpu_s(pid), time.monotonic()
    out = asyncio.run(_measure(cluster, duration_s))
    cpu1, t1 = _cpu_s(pid), time.monotonic()
    out["leader_cpu"] = None if cpu0 is None or cpu1 is None else round((cpu1 - cpu0) / (t1 - t0), 2)
    return out


def _under_attack(cluster: LocalCluster, leader: int, kind: str, amount: int, duration_s: float, bad: str) -> dict:
    if kind == "sink":  # the flood, at a bare listener of its own instead of the leader
        sink = subprocess.Popen([sys.executable, "-m", "metalog.tools.bench.hostile", "sink",
                                 str(duration_s + WARMUP_S + 5)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
        try:
            host, port = "127.0.0.1", int(sink.stdout.readline())  # type: ignore[union-attr]
            return _attack(cluster, leader, "flood", amount, duration_s, bad, host, port) | {"attack": "sink"}
        finally:
            sink.kill()
            sink.wait()
    return _attack(cluster, leader, kind, amount, duration_s, bad, cluster.host, cluster.nodes[leader].port)


def _attack(cluster: LocalCluster, leader: int, kind: str, amount: int, duration_s: float, bad: str,
            host: str, port: int) -> dict:
    log_before = _event_counts(cluster, leader)
    hs_before = _metric(cluster, leader, "metalog_tls_handshake_seconds_total")
    refused_before = _refused(cluster, leader)
    sheds_before = _metric(cluster, leader, SHEDS_METRIC) or 0.0
    attacker = subprocess.Popen([sys.executable, "-m", "metalog.tools.bench.hostile", "attacker", kind, host,
                                 str(port), str(amount), str(duration_s + WARMUP_S + 1), bad], cwd=REPO_ROOT,
                                stdout=subprocess.PIPE, text=True)
    time.sleep(WARMUP_S)  # let the attack build up before measuring
    try:
        t0 = time.monotonic()
        under = _measure_with_cpu(cluster, leader, duration_s)
        window_s = time.monotonic() - t0
        hs_after = _metric(cluster, leader, "metalog_tls_handshake_seconds_total")
    finally:
        out, _ = attacker.communicate(timeout=duration_s + 60)
    log_after = _event_counts(cluster, leader)
    share = None if hs_before is None or hs_after is None else round((hs_after - hs_before) / window_s, 3)
    refused_after = _refused(cluster, leader)
    refused = {why: refused_after[why] - refused_before[why] for why in REFUSED_REASONS}
    kernel = {"shed_windows": (_metric(cluster, leader, SHEDS_METRIC) or 0.0) - sheds_before,
              "addresses_in_back_off_at_the_end": _metric(cluster, leader, BANNED_METRIC) or 0.0}
    return {"attack": kind, "amount": amount, "under_attack": under, "leader_refused": refused,
            "leader_kernel_drops": kernel,
            "attacker": json.loads(out.strip().splitlines()[-1]) if out.strip() else {},
            "leader_handshake_loop_share": share,
            "leader_log_lines": {e: log_after[e] - log_before[e] for e in LOG_EVENTS}}


def _refused(cluster: LocalCluster, node: int) -> dict[str, float]:
    """The node's connections refused before a handshake so far, by REFUSED_REASONS (0: none yet)."""
    return {why: _metric(cluster, node, f'metalog_listener_connections_refused_total{{listener="binary",'
                                        f'reason="{why}"}}') or 0.0 for why in REFUSED_REASONS}


def _event_counts(cluster: LocalCluster, node: int) -> dict[str, int]:
    log = cluster.read_log_lines(node)
    return {e: sum(1 for x in log if x.get("event") == e) for e in LOG_EVENTS}


def _ratios(a: dict) -> dict:
    i, u = a["idle"], a["under_attack"]
    a["p99_ratio"] = round(u["p99_ms"] / i["p99_ms"], 2) if i.get("p99_ms") and u.get("p99_ms") else None
    a["commits_share"] = round(u["commits_per_s"] / i["commits_per_s"], 2) if i["commits_per_s"] else None
    return a


def median_round(rounds: list[dict]) -> dict:
    """The round with the median commits share (the lower middle of an even count), with every
    round's (p99 ratio, commits share) in ``rounds``: one window's ratio swings with the
    machine, the median of interleaved ones much less."""
    ordered = sorted(rounds, key=lambda a: a["commits_share"] if a["commits_share"] is not None else -1.0)
    middle = dict(ordered[(len(ordered) - 1) // 2])
    middle["rounds"] = [[a["p99_ratio"], a["commits_share"]] for a in rounds]
    middle["p99_ratio_median"] = _median([a["p99_ratio"] for a in rounds if a["p99_ratio"] is not None])
    return middle


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return xs[(len(xs) - 1) // 2] if xs else None


def run(hostile: int, flood_per_s: int, duration_s: float, root: str, settings: dict | None = None,
        flood_sink: bool = False, rounds: int = 1) -> dict:
    cluster = LocalCluster.create(os.path.join(root, "cluster"), voters=3, observers=0, cluster_id=CLUSTER_ID,
                                  common={"log_level": "warning", **(settings or {})})
    bad = os.path.join(root, "other-ca")
    certs.init_ca(bad, name="attacker-ca")
    certs.issue_user(bad, bad, "mallory")
    cluster.start()
    attacks = []
    try:
        leader, _ = cluster.wait_for_leader(30)
        for kind, amount in (("connections", hostile), ("flood", flood_per_s),
                             ("sink", flood_per_s if flood_sink else 0)):
            if not amount:
                continue
            per_round = []
            for _ in range(rounds):
                # idle right before each attack: the ratio compares neighbouring windows, so
                # that other work on the machine skews both alike
                idle = _measure_with_cpu(cluster, leader, duration_s)
                per_round.append(_ratios(
                    {"idle": idle, **_under_attack(cluster, leader, kind, amount, duration_s, bad)}))
            attacks.append(median_round(per_round))
        still_leader = cluster.leader()
    finally:
        cluster.stop()
    return {"duration_s": duration_s, "rounds": rounds, "settings": settings or {}, "attacks": attacks,
            "leader": leader, "leader_after": still_leader, "load_average": os.getloadavg()}


def format_report(result: dict) -> str:
    lines = [f"hostile (one client's commits; load average {', '.join(f'{x:.1f}' for x in result['load_average'])} "
             f"at the end):"]
    for a in result["attacks"]:
        i, u = a["idle"], a["under_attack"]
        what = {"connections": f"{a['amount']} hostile connections",
                "flood": f"a flood of {a['amount']} new connections/s",
                "sink": f"the same flood at a bare listener beside the cluster (the machine's share)"}[a["attack"]]
        logged = sum(a["leader_log_lines"].values())
        lines.append(f"  idle:  p50 {i['p50_ms']} ms p99 {i['p99_ms']} ms, {i['commits_per_s']}/s, {i['errors']} "
                     f"errors; leader CPU {i.get('leader_cpu')} of a core")
        lines.append(f"  under {what}: p50 {u['p50_ms']} ms p99 {u['p99_ms']} ms, {u['commits_per_s']}/s, "
                     f"{u['errors']} errors; p99 {a['p99_ratio']}x idle (goal <= 2x), commits "
                     f"{a['commits_share']} of idle (goal >= 0.8); leader: CPU {u.get('leader_cpu')} of a core, "
                     f"{a['leader_handshake_loop_share']} of a core in TLS handshakes, {logged} refusal log "
                     f"lines, refused before a handshake {a.get('leader_refused')}, dropped by the kernel "
                     f"{a.get('leader_kernel_drops')}; "
                     f"attacker CPU {a['attacker'].get('cpu_per_s')} of a core")
        if len(a.get("rounds", ())) > 1:
            lines.append(f"  (the median of {len(a['rounds'])} rounds by commits share; every round's p99 ratio "
                         f"and commits share: {a['rounds']}; median p99 ratio {a['p99_ratio_median']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m metalog.tools.bench.hostile", description=__doc__.split("\n\n")[0])
    p.add_argument("--hostile", type=int, default=200, help="concurrent hostile connections (0: skip)")
    p.add_argument("--flood-per-s", type=int, default=1000, help="new hostile connections a second (0: skip)")
    p.add_argument("--duration-s", type=float, default=8.0, help="measured window, idle and under each attack")
    p.add_argument("--rounds", type=int, default=1,
                   help="idle and attacked windows in turn, this many of each per attack; the report gives the "
                        "round with the median commits share and every round's ratios")
    p.add_argument("--flood-sink", action="store_true",
                   help="also run the flood against a bare listener beside the cluster: what the flood costs "
                        "the client through the machine (the attacker's CPU, the kernel), with no broker in the way")
    p.add_argument("--dir", help="keep the cluster here (default: a temp dir)")
    p.add_argument("--json", help="also write the result here")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a broker setting (YAML value), e.g. ssl_handshake_loop_share=0.1; repeatable")
    args = p.parse_args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="metalog-hostile-")
    settings = {k: yaml.safe_load(v) for k, _, v in (x.partition("=") for x in args.set)}
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    result = run(args.hostile, args.flood_per_s, args.duration_s, root, settings, args.flood_sink, args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    print(format_report(result))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "attacker":
        sys.exit(attacker_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "sink":
        sys.exit(uvloop.run(_sink(float(sys.argv[2]))))
    sys.exit(main())
