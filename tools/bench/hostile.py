"""Quorum commit latency idle vs. under hostile connections (issue 13, item 5).

    .venv/bin/python -m metalog.tools.bench.hostile --hostile 200 --duration-s 10

Starts a local 3-voter cluster (mutual TLS, default hygiene settings), measures
one client's commit latency (produce, await commit, repeat) for
``--duration-s``, then again while ``--hostile`` connections hammer the
leader's port from a separate process. Each hostile connection loops over one
of three behaviours, reconnecting at once when cut:

* stalled: connects, sends 3 bytes of a frame, then nothing;
* garbage: connects and sends random bytes;
* bad handshake: TLS with a certificate from another CA.

They come from many loopback source addresses (127.0.1.x), as an attacker's
would from other hosts; the legitimate client and the peers use 127.0.0.1.
Prints both p50/p99 and the ratio (the goal: p99 within 2x of idle).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import ssl
import subprocess
import sys
import tempfile
import time

import uvloop

from metalog.broker.client import MetalogClient
from metalog.tools.bench.bench import latency_summary_ms
from metalog.tools.cluster import certs
from metalog.tools.cluster.launcher import REPO_ROOT, LocalCluster

CLUSTER_ID = "metalog-hostile"


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


# ---------------------------------------------------------------- the attacker (own process)
async def _attacker(host: str, port: int, n: int, duration_s: float, bad_ca_dir: str) -> dict:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.load_cert_chain(os.path.join(bad_ca_dir, "mallory.crt"), os.path.join(bad_ca_dir, "mallory.key"))
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


def attacker_main(argv: list[str]) -> int:
    host, port, n, duration_s, bad = argv[0], int(argv[1]), int(argv[2]), float(argv[3]), argv[4]
    print(json.dumps(uvloop.run(_attacker(host, port, n, duration_s, bad))), flush=True)
    return 0


def run(hostile: int, duration_s: float, root: str) -> dict:
    cluster = LocalCluster.create(os.path.join(root, "cluster"), voters=3, observers=0, cluster_id=CLUSTER_ID,
                                  common={"log_level": "warning"})
    bad = os.path.join(root, "other-ca")
    certs.init_ca(bad, name="attacker-ca")
    certs.issue_user(bad, bad, "mallory")
    cluster.start()
    try:
        leader, _ = cluster.wait_for_leader(30)
        idle = asyncio.run(_measure(cluster, duration_s))
        host, port = cluster.host, cluster.nodes[leader].port
        env = dict(os.environ)
        attacker = subprocess.Popen([sys.executable, "-m", "metalog.tools.bench.hostile", "attacker", host, str(port),
                                     str(hostile), str(duration_s + 3), bad], cwd=REPO_ROOT, env=env,
                                    stdout=subprocess.PIPE, text=True)
        time.sleep(2)  # a warm-up: let the hostile connections pile up before measuring
        try:
            under = asyncio.run(_measure(cluster, duration_s))
        finally:
            out, _ = attacker.communicate(timeout=duration_s + 60)
        attack = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
        still_leader = cluster.leader()
        log = cluster.read_log_lines(leader)
        counts = {e: sum(1 for x in log if x.get("event") == e)
                  for e in ("tls_handshake_failed", "bad_frame", "connection_idle_closed", "connection_refused",
                            "connection_backoff")}
    finally:
        cluster.stop()
    ratio = (under["p99_ms"] / idle["p99_ms"]) if idle.get("p99_ms") and under.get("p99_ms") else None
    return {"hostile_connections": hostile, "duration_s": duration_s, "idle": idle, "under_attack": under,
            "p99_ratio": None if ratio is None else round(ratio, 2), "attacker": attack,
            "leader_log_events": counts, "leader_after": still_leader}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m metalog.tools.bench.hostile", description=__doc__.split("\n\n")[0])
    p.add_argument("--hostile", type=int, default=200, help="concurrent hostile connections")
    p.add_argument("--duration-s", type=float, default=10.0, help="measured window, idle and under attack")
    p.add_argument("--dir", help="keep the cluster here (default: a temp dir)")
    args = p.parse_args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="metalog-hostile-")
    result = run(args.hostile, args.duration_s, root)
    print(json.dumps(result, indent=2))
    i, u = result["idle"], result["under_attack"]
    print(f"commit latency idle: p50 {i['p50_ms']} ms p99 {i['p99_ms']} ms ({i['commits_per_s']}/s); "
          f"under {args.hostile} hostile connections: p50 {u['p50_ms']} ms p99 {u['p99_ms']} ms "
          f"({u['commits_per_s']}/s, {u['errors']} errors); p99 ratio {result['p99_ratio']}x (goal <= 2x)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "attacker":
        sys.exit(attacker_main(sys.argv[2:]))
    sys.exit(main())
