"""``metalog bench``: throughput, commit latency, failover and catch-up of a
real local cluster, optionally side by side with a 3-member etcd cluster.

Sections (``--only`` picks some):

* throughput -- 3 voters on loopback, fsync on, ``--clients`` logical clients
  (default 1000) each appending one ``--value-bytes`` record and awaiting its
  commit in a loop. The load runs in ``--load-procs`` separate processes
  (default 2), each with one client connection multiplexing its share of the
  logical clients, on uvloop (as the brokers). records/s and commit latency
  p50/p99/p99.9 over a measured window after a warm-up.
* light -- one logical client, commit latency percentiles.
* failover -- repeated kill -9 of the leader under load (``--failover-clients``
  in-process clients); time from the kill to the first commit acknowledged in
  a newer epoch; p50/p99. The killed broker is restarted and rejoins before
  the next kill, so every kill leaves a majority.
* catchup -- a fresh observer started against a log of ``--catchup-records``
  metadata records (Config updates over ``--catchup-keys`` distinct keys, so
  the state is much smaller than the log, as metadata usually is): once with
  the whole log retained (catch-up by log), once after the leader snapshotted
  and moved its log start (catch-up by snapshot).

``--vs etcd`` runs the throughput and light sections against etcd too,
interleaved round by round (``--rounds``), and prints metalog/etcd ratios.
See tools/bench/etcd.py and docs/bench.md for how the comparison is fair and
where it is not. ``--smoke`` shrinks everything for CI: it must work, not be
fast. The report is printed as a table and written as JSON (``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any


from metalog.broker.server import commit_trace
from metalog.broker.client import MetalogClient
from metalog.broker.server.logging_setup import configure_logging
from metalog.broker.net.tls import TlsFiles, TlsPaths
from metalog.storage import metadata_records
from metalog.tools.bench import commit_profile
from metalog.tools.bench import etcd as bench_etcd
from metalog.tools.bench.etcd import EtcdPutter
from metalog.tools.bench.common import CLUSTER_ID, latency_summary_ms, metalog_cluster, percentile  # noqa: F401 (bench.X)
from metalog.tools.cluster.launcher import REPO_ROOT, LocalCluster


def _uvloop_run(coro):
    """uvloop.run(coro); uvloop is imported on first use, not at the top: ~80 ms
    of start-up that every `metalog` command would pay (the CLI imports this module)."""
    import uvloop

    return uvloop.run(coro)


# ------------------------------------------------------------------ load worker (a separate process)
READY_LINE = b"ready\n"
# How long the parent waits for every worker to import, connect and say ready
# (seconds on an idle machine; a loaded CI box has taken several).
WORKER_READY_TIMEOUT_S = 120.0


async def _ready_then_start_at() -> float:
    """Tell the parent this worker is connected (READY_LINE on stdout) and
    wait for the common start time (a time.monotonic() value, system-wide on
    Linux) on stdin. The window is only fixed once every worker is connected:
    a fixed start time missed it whole when imports and TLS took longer than
    the slack on a loaded machine (0 records measured)."""
    sys.stdout.buffer.write(READY_LINE)
    sys.stdout.buffer.flush()
    line = await asyncio.to_thread(sys.stdin.buffer.readline)
    if not line.strip():
        raise RuntimeError("the bench parent closed stdin before sending the start time")
    return float(line)


async def _closed_loop(clients: int, start_at: float, warmup_s: float, duration_s: float,
                       write_one) -> dict:
    """`clients` logical clients, each awaiting `write_one(i, seq)` in a loop;
    latencies of writes that finish inside the measured window."""
    measure_from = start_at + warmup_s
    stop_at = measure_from + duration_s
    lat_us: list[int] = []
    errors = calls = 0

    async def one(i: int) -> None:
        nonlocal errors, calls
        seq = 0
        while True:
            now = time.monotonic()
            if now >= stop_at:
                return
            calls += 1
            try:
                await write_one(i, seq)
            except Exception:
                errors += 1
                await asyncio.sleep(0.01)
                continue
            finally:
                seq += 1
            done = time.monotonic()
            if measure_from <= done < stop_at:
                lat_us.append(int((done - now) * 1e6))

    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    await asyncio.gather(*(one(i) for i in range(clients)))
    return {"ops": len(lat_us), "errors": errors, "latencies_us": lat_us, "calls": calls}


async def _metalog_load(endpoints: list[tuple[str, int]], clients: int, warmup_s: float, duration_s: float,
                        value_bytes: int, tag: str, tls_files: list[str] | None = None,
                        trace: bool = False, produce_inflight_max: int | None = None) -> dict:
    tls = None
    if tls_files:
        tls = TlsFiles(TlsPaths(*tls_files))
    options = {} if produce_inflight_max is None else {"produce_inflight_max": produce_inflight_max}
    client = MetalogClient(endpoints, CLUSTER_ID, request_timeout_ms=10000, max_retries=20, tls=tls, **options)
    await client.metadata()
    start_at = await _ready_then_start_at()
    pad = b"x" * value_bytes

    # --profile-commit: (send ns, answer ns, base offset) of every write, on
    # the system-wide monotonic clock the brokers' commit traces use.
    trace_ops: list[tuple[int, int, int]] = []

    async def write_one(i: int, seq: int) -> None:
        value = (f"{tag}-{i}-{seq}-".encode() + pad)[:value_bytes]
        if not trace:
            await client.produce([value])
            return
        sent_ns = time.monotonic_ns()
        base_offset, _epoch = await client.produce([value])
        trace_ops.append((sent_ns, time.monotonic_ns(), base_offset))

    calls_before = client.produce_requests_sent
    try:
        result = await _closed_loop(clients, start_at, warmup_s, duration_s, write_one)
    finally:
        await client.close()
    # Calls (one record each) and the requests that carried them, warm-up
    # included: the client's batching (metalog.broker.client.batching).
    result["produce_calls"] = result.pop("calls")
    result["produce_requests"] = client.produce_requests_sent - calls_before
    if trace:
        result["trace_ops"] = trace_ops
    return result


async def _etcd_load(url: str, clients: int, warmup_s: float, duration_s: float,
                     value_bytes: int, tag: str, tls: list[str] | None = None) -> dict:
    putter = EtcdPutter(url, clients, tls=tls)
    await putter.open()
    await putter.put(b"bench-warm-" + tag.encode(), b"1")
    start_at = await _ready_then_start_at()
    pad = b"x" * value_bytes

    async def write_one(i: int, seq: int) -> None:
        key = f"bench/{tag}/{i}/{seq}".encode()  # distinct keys, as the metalog records are distinct
        await putter.put(key, (key + b"-" + pad)[:value_bytes])

    try:
        result = await _closed_loop(clients, start_at, warmup_s, duration_s, write_one)
    finally:
        await putter.close()
    result["transport"] = putter.transport
    return result


def worker_main(argv: list[str]) -> int:
    """python -m metalog.tools.bench worker '<json spec>': run a load share (start
    barrier on stdin/stdout, see _ready_then_start_at), write its JSON result."""
    configure_logging("warning", sys.stderr)  # stdout carries only the ready line
    spec = json.loads(argv[0])
    if spec["system"] == "metalog":
        coro = _metalog_load([tuple(e) for e in spec["endpoints"]], spec["clients"],
                             spec["warmup_s"], spec["duration_s"], spec["value_bytes"], spec["tag"],
                             spec.get("tls"), spec.get("trace", False), spec.get("produce_inflight_max"))
    else:
        coro = _etcd_load(spec["url"], spec["clients"], spec["warmup_s"],
                          spec["duration_s"], spec["value_bytes"], spec["tag"], spec.get("tls"))
    result = _uvloop_run(coro)
    with open(spec["out"], "w") as f:
        json.dump(result, f)
    return 0


def run_load(target: dict, clients: int, procs: int, warmup_s: float, duration_s: float,
             value_bytes: int, tag: str) -> dict:
    """Split `clients` over `procs` worker processes; start them together once
    all are connected; merge their results."""
    procs = max(1, min(procs, clients))
    shares = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    out_dir = tempfile.mkdtemp(prefix="metalog-bench-load-")
    env = dict(os.environ)
    children = []
    for i, share in enumerate(shares):
        spec = dict(target, clients=share, warmup_s=warmup_s, duration_s=duration_s,
                    value_bytes=value_bytes, tag=f"{tag}-p{i}", out=os.path.join(out_dir, f"load-{i}.json"))
        with open(os.path.join(out_dir, f"load-{i}.stderr"), "wb") as err:
            children.append(subprocess.Popen([sys.executable, "-m", "metalog.tools.bench", "worker", json.dumps(spec)],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env,
                                             cwd=REPO_ROOT))
    try:
        _start_together(children, out_dir)
    except BaseException:
        for child in children:
            child.kill()
            child.wait()
        raise
    lat: list[int] = []
    ops = errors = calls = requests = 0
    transport = None
    trace_ops: list = []
    for i, child in enumerate(children):
        if child.wait(timeout=warmup_s + duration_s + 120) != 0:
            raise RuntimeError(f"load worker failed ({child.returncode}): {_worker_stderr(out_dir, i)}")
        child.stdout.close()
    for i in range(len(children)):
        with open(os.path.join(out_dir, f"load-{i}.json")) as f:
            res = json.load(f)
        lat += res["latencies_us"]
        ops += res["ops"]
        errors += res["errors"]
        transport = res.get("transport", transport)
        trace_ops += res.get("trace_ops", [])
        calls += res.get("produce_calls", 0)
        requests += res.get("produce_requests", 0)
    shutil.rmtree(out_dir, ignore_errors=True)
    out = {"clients": clients, "load_procs": procs, "duration_s": duration_s, "ops": ops, "errors": errors,
           "records_per_s": round(ops / duration_s, 1), **latency_summary_ms(lat)}
    if transport:
        out["transport"] = transport
    if requests:
        out["records_per_request"] = round(calls / requests, 1)
    if target.get("trace"):
        out["trace_ops"] = trace_ops
    return out


def _worker_stderr(out_dir: str, i: int) -> str:
    with open(os.path.join(out_dir, f"load-{i}.stderr"), "rb") as f:
        return f.read().decode(errors="replace")[-2000:]


def _start_together(children: list[subprocess.Popen], out_dir: str) -> None:
    """Wait until every worker said READY_LINE, then send all of them one
    start time: the warm-up and the measured window start after the slowest
    worker connected, however long its imports and handshake took."""
    deadline = time.monotonic() + WORKER_READY_TIMEOUT_S
    for i, child in enumerate(children):
        while True:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise RuntimeError(f"load worker {i} not ready after {WORKER_READY_TIMEOUT_S} s: "
                                   f"{_worker_stderr(out_dir, i)}")
            readable, _, _ = select.select([child.stdout], [], [], remaining_s)
            if readable:
                break
        line = child.stdout.readline()
        if line != READY_LINE:
            child.wait(timeout=10)
            raise RuntimeError(f"load worker {i} failed before it was ready ({child.returncode}): "
                               f"{_worker_stderr(out_dir, i)}")
    start_at = time.monotonic() + 0.05  # the line reaches every worker well within this
    for child in children:
        child.stdin.write(f"{start_at!r}\n".encode())
        child.stdin.close()


# ------------------------------------------------------------------ clusters
def _start(cluster: LocalCluster, nodes: list[int] | None = None) -> None:
    cluster.start(nodes)
    cluster.wait_for_leader(timeout_s=30)


def _metalog_target(cluster: LocalCluster) -> dict:
    target = {"system": "metalog", "endpoints": [list(e) for e in cluster.bootstrap()]}
    tls = cluster.client_tls()
    if tls is not None:
        target["tls"] = [tls.paths.ca_file, tls.paths.cert_file, tls.paths.key_file]
    return target


# ------------------------------------------------------------------ sections
def bench_load(args, root: str, clients: int, rounds: int, label: str, report: dict) -> None:
    """Throughput/latency rounds for metalog and (with --vs etcd) etcd, interleaved:
    each round runs every system once, in the reverse order of the round
    before (so neither always runs first, on a machine whose speed drifts)."""
    runs: dict[str, list[dict]] = {"metalog": [], "etcd": [], "plaintext": []}
    cert_dir = os.path.join(root, "certs")  # one CA for every cluster of the run, etcd's too
    systems = ["metalog"] + (["plaintext"] if args.vs == "etcd" or args.plaintext else [])
    if args.vs == "etcd" and report["etcd"]["available"]:
        systems.append("etcd")
    for r in range(rounds):
        for key in (systems if r % 2 == 0 else systems[::-1]):
            if key == "etcd":
                res = _etcd_round(args, root, clients, label, r, cert_dir)
                _progress(f"{label} round {r + 1}/{rounds} etcd: {res['records_per_s']} rec/s "
                          f"p50 {res['p50_ms']} p99 {res['p99_ms']} ms")
            else:
                res = _metalog_round(args, root, clients, label, r, cert_dir, insecure=key == "plaintext")
                what = "metalog TLS" if key == "metalog" else "metalog plaintext"
                _progress(f"{label} round {r + 1}/{rounds} {what}: {res['records_per_s']} rec/s "
                          f"p50 {res['p50_ms']} p99 {res['p99_ms']} ms, "
                          f"{res.get('records_per_request', '?')} records per request")
            runs[key].append(res)
    report[label] = {"rounds": runs["metalog"], "best": _best(runs["metalog"]), "tls": True}
    if runs["plaintext"]:
        report[label]["plaintext_rounds"] = runs["plaintext"]
        report[label]["plaintext_best"] = _best(runs["plaintext"])
    if runs["etcd"]:
        report[label]["etcd_rounds"] = runs["etcd"]
        report[label]["etcd_best"] = _best(runs["etcd"])
        report[label]["paired"] = paired_rounds(runs["metalog"], runs["etcd"])


def _metalog_round(args, root: str, clients: int, label: str, r: int, cert_dir: str, insecure: bool) -> dict:
    key = "plaintext" if insecure else "metalog"
    cluster = metalog_cluster(os.path.join(root, f"{label}-{key}-{r}"), insecure=insecure, cert_dir=cert_dir)
    try:
        _start(cluster)
        target = _metalog_target(cluster)
        if getattr(args, "produce_inflight_max", None):
            target["produce_inflight_max"] = args.produce_inflight_max
        return run_load(target, clients, args.load_procs, args.warmup_s, args.duration_s,
                        args.value_bytes, f"{label}{r}")
    finally:
        cluster.stop()


def _etcd_round(args, root: str, clients: int, label: str, r: int, cert_dir: str) -> dict:
    etcd = bench_etcd.EtcdCluster(os.path.join(root, f"{label}-etcd-{r}"), cert_dir=cert_dir)
    try:
        etcd.start()
        leader = etcd.wait_ready()
        return run_load({"system": "etcd", "url": etcd.client_url(leader), "tls": etcd.client_tls()},
                        clients, args.load_procs, args.warmup_s, args.duration_s, args.value_bytes, f"{label}{r}")
    finally:
        etcd.stop()


def paired_rounds(metalog: list[dict], etcd: list[dict]) -> dict:
    """Each round's metalog run against the etcd run of the same round (run
    next to each other, so a machine whose speed drifts hits both alike):
    in how many rounds metalog's p50 and p99 are below etcd's, and the median
    of the rounds' ratios (etcd's figure / metalog's: above 1, metalog is ahead)."""
    # A round in which either side committed nothing has no figures to compare: left out.
    pairs = [(m, e) for m, e in zip(metalog, etcd)
             if all(run[k] for run in (m, e) for k in ("p50_ms", "p99_ms", "records_per_s"))]
    if not pairs:
        return {"rounds": 0}

    def ratios(key: str, etcd_over_metalog: bool = True) -> list[float]:
        return [e[key] / m[key] if etcd_over_metalog else m[key] / e[key] for m, e in pairs]

    return {"rounds": len(pairs),
            "p50_below": sum(m["p50_ms"] < e["p50_ms"] for m, e in pairs),
            "p99_below": sum(m["p99_ms"] < e["p99_ms"] for m, e in pairs),
            "both_below": sum(m["p50_ms"] < e["p50_ms"] and m["p99_ms"] < e["p99_ms"] for m, e in pairs),
            "median_p50_ratio": round(statistics.median(ratios("p50_ms")), 3),
            "median_p99_ratio": round(statistics.median(ratios("p99_ms")), 3),
            "median_throughput_ratio": round(statistics.median(ratios("records_per_s", False)), 3)}


def _best(rounds: list[dict]) -> dict:
    """The round with the median throughput (robust against one noisy round)."""
    ordered = sorted(rounds, key=lambda r: r["records_per_s"])
    return ordered[(len(ordered) - 1) // 2]


async def _failover_async(args, cluster: LocalCluster) -> dict:
    client = MetalogClient(cluster.bootstrap(), CLUSTER_ID, tls=cluster.client_tls(), request_timeout_ms=2000,
                           retry_backoff_ms=20,
                           max_retries=2, connect_timeout_ms=500)
    await client.metadata()
    commits: list[tuple[float, int]] = []  # (monotonic time acknowledged, leader epoch)
    stop = asyncio.Event()
    pad = b"f" * args.value_bytes

    async def one(i: int) -> None:
        seq = 0
        while not stop.is_set():
            seq += 1
            try:
                _, epoch = await client.produce([(f"fo-{i}-{seq}-".encode() + pad)[:args.value_bytes]])
            except Exception:
                await asyncio.sleep(0.02)  # poll granularity of the measurement
                continue
            commits.append((time.monotonic(), epoch))
            if len(commits) > 100_000:
                del commits[:50_000]

    tasks = [asyncio.create_task(one(i)) for i in range(args.failover_clients)]
    gaps_s: list[float] = []
    try:
        for k in range(args.failovers):
            leader, epoch = await asyncio.to_thread(cluster.wait_for_leader, 30)
            # Load flows in this epoch before the kill.
            deadline = time.monotonic() + 30
            while not any(e == epoch for _, e in commits[-50:]):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no commit in epoch {epoch} before kill {k + 1}")
                await asyncio.sleep(0.01)
            t_kill = time.monotonic()
            await asyncio.to_thread(cluster.kill, leader)
            deadline = t_kill + 60
            while True:
                after = [t for t, e in commits[-2000:] if e > epoch and t >= t_kill]
                if after:
                    gaps_s.append(min(after) - t_kill)
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no commit within 60s after killing leader {leader} (epoch {epoch})")
                await asyncio.sleep(0.005)
            _progress(f"failover {k + 1}/{args.failovers}: killed {leader} (epoch {epoch}), "
                      f"next commit after {gaps_s[-1] * 1000:.0f} ms")
            await asyncio.to_thread(cluster.start_node, leader)
            await asyncio.to_thread(_wait_rejoined, cluster, leader)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
    vals = sorted(gaps_s)
    return {"kills": len(vals), "clients": args.failover_clients,
            "election_timeout_ms": args.election_timeout_ms, "fetch_timeout_ms": args.fetch_timeout_ms,
            "p50_ms": round(percentile(vals, 50) * 1000), "p99_ms": round(percentile(vals, 99) * 1000),
            "min_ms": round(vals[0] * 1000), "max_ms": round(vals[-1] * 1000),
            "all_ms": [round(v * 1000) for v in gaps_s]}


def _wait_rejoined(cluster: LocalCluster, node: int) -> None:
    def ok():
        # The leader's HW first, the node's LEO after: under load the HW moves
        # while we ask (each admin call is an HTTPS handshake), so the other
        # order could keep a caught-up follower "behind" forever.
        lead = cluster.leader()
        lq = cluster.quorum(lead[0]) if lead else None
        q = cluster.quorum(node)
        if not q or not lead or not lq or q.get("role") != "follower" or q.get("epoch") != lead[1]:
            return False
        return q["log_end_offset"] >= (lq.get("high_watermark") or 0)

    cluster.wait_for(ok, 60, f"node {node} to rejoin as a caught-up follower")


def bench_profile_commit(args, root: str, report: dict) -> None:
    """--profile-commit: one client against a 3-voter TLS (--plaintext: PLAINTEXT) cluster whose brokers
    record commit-path timestamps (metalog.broker.server.commit_trace; on for this cluster
    only, through its environment); the per-stage table (metalog.tools.bench.commit_profile)."""
    trace_dir = os.path.join(root, "profile-trace")
    os.makedirs(trace_dir, exist_ok=True)
    cluster = metalog_cluster(os.path.join(root, "profile"), insecure=args.plaintext,
                              cert_dir=os.path.join(root, "certs"))
    os.environ[commit_trace.ENV_VAR] = trace_dir  # inherited by the brokers started now
    try:
        _start(cluster)
    finally:
        del os.environ[commit_trace.ENV_VAR]
    try:
        res = run_load(dict(_metalog_target(cluster), trace=True), 1, 1, args.warmup_s, args.light_duration_s,
                       args.value_bytes, "profile")
    finally:
        cluster.stop()  # SIGTERM: each broker writes its trace as it stops
    followed = commit_profile.follow(trace_dir, res.pop("trace_ops"))
    report["commit_profile"] = {"load": res, "leader": followed["leader"], "followed": followed["followed"],
                                "skipped": followed["skipped"],
                                "leader_fsync_on_critical_path": followed["leader_fsync_on_critical_path"],
                                "stages": commit_profile.summarize(followed),
                                "codec": commit_profile.summarize_codec(followed)}
    _progress(f"commit profile: {res['records_per_s']} rec/s p50 {res['p50_ms']} ms p99 {res['p99_ms']} ms")
    print(commit_profile.format_profile(followed))


def bench_failover(args, root: str, report: dict) -> None:
    cluster = metalog_cluster(os.path.join(root, "failover"), election_timeout_ms=args.election_timeout_ms,
                              fetch_timeout_ms=args.fetch_timeout_ms)
    try:
        _start(cluster)
        report["failover"] = _uvloop_run(_failover_async(args, cluster))
    finally:
        cluster.stop()


async def _load_metadata(cluster: LocalCluster, records: int, keys: int, value_bytes: int) -> None:
    client = MetalogClient(cluster.bootstrap(), CLUSTER_ID, tls=cluster.client_tls(), request_timeout_ms=30000,
                           max_retries=20)
    batch = 2000
    starts = iter(range(0, records, batch))

    async def loader() -> None:
        for s in starts:
            values = [metadata_records.encode_record(metadata_records.Config(
                2, "bench-topic", f"key-{i % keys}", f"{i:012d}".ljust(max(12, value_bytes - 40), "v")))
                      for i in range(s, min(records, s + batch))]
            await client.produce(values)

    try:
        await asyncio.gather(*(loader() for _ in range(8)))
    finally:
        await client.close()


def _catchup_once(args, root: str, by_snapshot: bool) -> dict:
    n = args.catchup_records
    common: dict[str, Any] = {"max_replication_lag_ms": 1000}
    # By snapshot: one snapshot once every record is applied, then the log start moves past it.
    # By log: never snapshot, the whole log stays.
    common["snapshot_min_records"] = n if by_snapshot else 1 << 40
    cluster = metalog_cluster(os.path.join(root, "catchup-snapshot" if by_snapshot else "catchup-log"),
                              voters=3, observers=1, **common)
    observer = 4
    try:
        _start(cluster, [1, 2, 3])
        t0 = time.perf_counter()
        _uvloop_run(_load_metadata(cluster, n, args.catchup_keys, args.value_bytes))
        load_s = time.perf_counter() - t0
        leader, _ = cluster.wait_for_leader()
        if by_snapshot:
            cluster.wait_for(lambda: (cluster.quorum(leader) or {}).get("log_start_offset", 0) >= n, 120,
                             "the leader to snapshot and move its log start", poll_s=0.1)
        lq = cluster.quorum(leader)
        target_hw = lq["high_watermark"]
        cluster.nodes[observer].extra["log_level"] = "info"  # for broker_started / snapshot_installed
        t_spawn = time.time()
        cluster.start_node(observer)
        cluster.wait_for(lambda: (cluster.quorum(observer) or {}).get("log_end_offset", -1) >= target_hw, 600,
                         "the observer to reach the high watermark", poll_s=0.01)
        t_done = time.time()
        obs = cluster.quorum(observer)
        started_ts = _started_ts(cluster, observer)
        installed = [line for line in cluster.read_log_lines(observer) if line.get("event") == "snapshot_installed"]
    finally:
        cluster.stop()
    if by_snapshot and not installed:
        raise RuntimeError("catch-up by snapshot finished without installing a snapshot")
    return {"records": n, "distinct_keys": args.catchup_keys, "high_watermark": target_hw,
            "load_seconds": round(load_s, 2), "wall_seconds_from_spawn": round(t_done - t_spawn, 3),
            "process_boot_seconds": None if started_ts is None else round(started_ts - t_spawn, 3),
            # From the broker being up (listening, log opened) to its log end at the HW.
            "catchup_seconds": round(t_done - (started_ts or t_spawn), 3),
            "log_start_offset": lq["log_start_offset"], "snapshot_installed": bool(installed),
            "observer_applied_offset": obs.get("applied_offset")}


def _started_ts(cluster: LocalCluster, node: int) -> float | None:
    """Wall-clock time of the node's broker_started log line (its boot is done)."""
    for line in cluster.read_log_lines(node):
        if line.get("event") == "broker_started" and isinstance(line.get("ts"), (int, float)):
            return float(line["ts"])
    return None


def bench_catchup(args, root: str, report: dict) -> None:
    by_log = _catchup_once(args, root, by_snapshot=False)
    _progress(f"catch-up by log: {by_log['catchup_seconds']} s")
    by_snap = _catchup_once(args, root, by_snapshot=True)
    _progress(f"catch-up by snapshot: {by_snap['catchup_seconds']} s")
    ratio = by_log["catchup_seconds"] / by_snap["catchup_seconds"] if by_snap["catchup_seconds"] > 0 else None
    report["catchup"] = {"by_log": by_log, "by_snapshot": by_snap,
                         "snapshot_speedup": None if ratio is None else round(ratio, 1)}


# ------------------------------------------------------------------ report
def machine() -> dict:
    # The interpreter's build moves every figure (docs/bench.md, "The interpreter"): say which ran.
    info = {"nproc": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "python_executable": os.path.realpath(sys.executable), "libpython": _libpython()}
    try:
        info["lscpu"] = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout.splitlines()[:10]
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def _libpython() -> str:
    """'shared' when libpython is a shared library of this process (pyenv's and the official
    Docker images' builds), 'static' when it is linked into the binary (Debian's and Ubuntu's)."""
    try:
        with open("/proc/self/maps") as f:
            return "shared" if "libpython" in f.read() else "static"
    except OSError:
        return "unknown"


def _progress(text: str) -> None:
    print(f"[bench] {text}", file=sys.stderr, flush=True)


def format_table(report: dict) -> str:
    lines = []
    etcd_on = report.get("etcd", {}).get("available") and report.get("vs") == "etcd"

    def row(name, res, other=None):
        cells = [f"{name:28}", f"{res['records_per_s']:>10}", f"{res['p50_ms']!s:>8}", f"{res['p99_ms']!s:>8}",
                 f"{res['p99_9_ms']!s:>8}", f"{res['errors']:>6}"]
        lines.append("  ".join(cells))

    lines.append(f"{'load':28}  {'rec/s':>10}  {'p50 ms':>8}  {'p99 ms':>8}  {'p99.9 ms':>8}  {'errors':>6}")
    for label in ("throughput", "light"):
        if label not in report:
            continue
        sec = report[label]
        clients = sec["best"]["clients"]
        row(f"metalog TLS {label} ({clients} cl)", sec["best"])
        if "plaintext_best" in sec:
            row(f"metalog plain {label} ({clients} cl)", sec["plaintext_best"])
        if "etcd_best" in sec:
            row(f"etcd TLS {label} ({clients} cl)", sec["etcd_best"])
            m, e = sec["best"], sec["etcd_best"]
            ratio = round(m["records_per_s"] / e["records_per_s"], 2) if e["records_per_s"] else None
            p99 = round(e["p99_ms"] / m["p99_ms"], 2) if m["p99_ms"] else None
            lines.append(f"{'  ratio metalog/etcd (TLS)':28}  {ratio!s:>10}  (etcd p99 / metalog p99: {p99})")
            pr = sec.get("paired", {})
            if pr.get("rounds"):
                lines.append(f"  paired rounds (TLS): metalog's p50 below etcd's in {pr['p50_below']} of "
                             f"{pr['rounds']}, p99 in {pr['p99_below']}, both in {pr['both_below']}; median "
                             f"etcd/metalog p50 {pr['median_p50_ratio']}, p99 {pr['median_p99_ratio']}, "
                             f"records/s metalog/etcd {pr['median_throughput_ratio']}")
    if "failover" in report:
        f = report["failover"]
        lines.append(f"failover: {f['kills']} kill -9 of the leader, next commit after p50 {f['p50_ms']} ms, "
                     f"p99 {f['p99_ms']} ms (min {f['min_ms']}, max {f['max_ms']})")
    if "scale" in report:
        from metalog.tools.bench import catchup as scale_catchup  # on use: every metalog command imports this module

        lines.append(scale_catchup.format_report(report["scale"]))
    if "catchup" in report:
        c = report["catchup"]
        lines.append(f"catch-up of {c['by_log']['records']} records: by log {c['by_log']['catchup_seconds']} s, "
                     f"by snapshot {c['by_snapshot']['catchup_seconds']} s, speed-up {c['snapshot_speedup']}x "
                     f"(process boot excluded: {c['by_log']['process_boot_seconds']} / "
                     f"{c['by_snapshot']['process_boot_seconds']} s)")
    if "hostile" in report:
        from metalog.tools.bench import hostile  # on use: every metalog command imports this module

        lines.append(hostile.format_report(report["hostile"]))
    if report.get("vs") == "etcd" and not etcd_on:
        lines.append("etcd comparison skipped: " + report["etcd"].get("why", ""))
    return "\n".join(lines)


# The one-client section's rounds, at least (or --rounds, if more): one client's 5 s
# windows swing by a third between minutes on a small shared machine (the 1000
# clients' by about 7%), so its median-low round needs more of them to say which
# side is faster.
LIGHT_ROUNDS_MIN = 6

SMOKE = dict(clients=50, duration_s=2.0, warmup_s=0.5, light_duration_s=1.0, failovers=2, failover_clients=10,
             catchup_records=2000, catchup_keys=50, rounds=1, light_rounds=1)


SCALE_SECTIONS = {"scale-catchup": "catchup", "scale-commit": "commit"}  # --only name: metalog.tools.bench.catchup's


def cmd_bench(args) -> int:
    if args.vs == "kafka":
        from metalog.tools.bench import vs_kafka  # on use: every metalog command imports this module

        return vs_kafka.cmd_vs_kafka(args)
    if args.scale:
        from metalog.tools.bench import scale  # on use: every metalog command imports this module

        return scale.cmd_scale(args)
    if args.smoke:
        for k, v in SMOKE.items():
            if getattr(args, k) == _DEFAULTS[k]:
                setattr(args, k, v)
    if args.light_rounds is not None and args.light_rounds < 1:
        print(f"metalog bench: --light-rounds must be at least 1, got {args.light_rounds}", file=sys.stderr)
        return 2
    args.light_rounds = args.light_rounds or max(args.rounds, LIGHT_ROUNDS_MIN)  # the report's settings name it
    sections = [s.strip() for s in args.only.split(",")] if args.only else ["throughput", "light", "failover",
                                                                           "catchup"]
    unknown = set(sections) - {"throughput", "light", "failover", "catchup", "profile", "hostile", *SCALE_SECTIONS}
    if unknown:
        print(f"metalog bench: unknown section(s) {sorted(unknown)}; choose from throughput, light, failover, "
              f"catchup, profile, hostile, scale-catchup, scale-commit", file=sys.stderr)
        return 2
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(),
                              "vs": args.vs, "argv": sys.argv[1:],
                              "settings": {k: getattr(args, k) for k in _DEFAULTS}}
    report["etcd"] = {"available": False}
    if args.vs == "etcd":
        if bench_etcd.etcd_binary() is None:
            print(bench_etcd.etcd_missing_message(), file=sys.stderr)
            report["etcd"]["why"] = "no etcd binary on PATH"
        else:
            report["etcd"] = {"available": True, "version": bench_etcd.etcd_version(),
                              "client": "grpc" if bench_etcd.grpc_available() else "http-json-gateway"}
    root = args.dir or tempfile.mkdtemp(prefix="metalog-bench-")
    os.makedirs(root, exist_ok=True)
    try:
        light_args = argparse_copy(args, duration_s=args.light_duration_s, load_procs=1)
        if "throughput" in sections:
            bench_load(args, root, args.clients, args.rounds, "throughput", report)
        if "light" in sections:
            bench_load(light_args, root, 1, args.light_rounds, "light", report)
        if "failover" in sections:
            bench_failover(args, root, report)
        if "catchup" in sections:
            bench_catchup(args, root, report)
        if args.profile_commit or "profile" in sections:
            bench_profile_commit(args, root, report)
        if "hostile" in sections:
            from metalog.tools.bench import hostile  # on use: every metalog command imports this module

            _progress("hostile: idle, 200 hostile connections, a flood of 1000 new connections/s")
            report["hostile"] = hostile.run(200, 1000, 2.0 if args.smoke else 8.0, os.path.join(root, "hostile"),
                                            rounds=1 if args.smoke else 3)
        scale_sections = [SCALE_SECTIONS[s] for s in sections if s in SCALE_SECTIONS]
        if scale_sections:
            from metalog.tools.bench import catchup as scale_catchup  # on use: every metalog command imports this module

            report["scale"] = scale_catchup.run(args.scale_partitions or scale_catchup.DEFAULT_PARTITIONS,
                                                scale_sections, root=os.path.join(root, "scale"), keep=True)
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print(format_table(report))
    if args.json:
        print(f"JSON report: {args.json}")
    return 0


def argparse_copy(args, **changes):
    ns = argparse.Namespace(**vars(args))
    for k, v in changes.items():
        setattr(ns, k, v)
    return ns


_DEFAULTS = dict(clients=1000, duration_s=10.0, warmup_s=2.0, light_duration_s=5.0, value_bytes=100, load_procs=2,
                 rounds=2, light_rounds=None, failovers=20, failover_clients=50, election_timeout_ms=1000,
                 fetch_timeout_ms=2000, catchup_records=1_000_000, catchup_keys=10_000)


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("bench", help="throughput, latency, failover and catch-up benchmarks "
                                            "(optionally against etcd)")
    d = _DEFAULTS
    p.add_argument("--only", help="comma list of sections: throughput,light,failover,catchup (default all); "
                                  "also profile, hostile (metalog.tools.bench.hostile: commits idle and under "
                                  "attack), scale-catchup, scale-commit (metalog.tools.bench.catchup)")
    p.add_argument("--vs", choices=["etcd", "kafka"],
                   help="etcd: also run the load sections against a 3-member etcd cluster; kafka: instead, admin "
                        "writes/s, latency, failover, RSS and start-up of metalog vs a 3-controller Apache Kafka "
                        "KRaft quorum, both mutual TLS, through librdkafka (metalog.tools.bench.vs_kafka; uses "
                        "--rounds, --duration-s, --warmup-s, --smoke, --json, --dir, --keep)")
    p.add_argument("--clients", type=int, default=d["clients"], help="concurrent logical clients (throughput)")
    p.add_argument("--duration-s", type=float, default=d["duration_s"], help="measured window per run")
    p.add_argument("--warmup-s", type=float, default=d["warmup_s"], help="unmeasured warm-up per run")
    p.add_argument("--light-duration-s", type=float, default=d["light_duration_s"])
    p.add_argument("--value-bytes", type=int, default=d["value_bytes"])
    p.add_argument("--produce-inflight-max", type=int, default=None,
                   help="the load clients' produce_inflight_max (default: the client's, 8); at least the clients "
                        "per load process sends one request per record, as before the client batched")
    p.add_argument("--load-procs", type=int, default=d["load_procs"], help="load generator processes")
    p.add_argument("--rounds", type=int, default=d["rounds"], help="interleaved rounds per system")
    p.add_argument("--light-rounds", type=int, default=d["light_rounds"],
                   help=f"interleaved rounds per system of the one-client section (default: --rounds, at least "
                        f"{LIGHT_ROUNDS_MIN}): its 5 s windows swing by a third on a small shared machine")
    p.add_argument("--failovers", type=int, default=d["failovers"], help="leader kills")
    p.add_argument("--failover-clients", type=int, default=d["failover_clients"])
    p.add_argument("--election-timeout-ms", type=int, default=d["election_timeout_ms"])
    p.add_argument("--fetch-timeout-ms", type=int, default=d["fetch_timeout_ms"])
    p.add_argument("--catchup-records", type=int, default=d["catchup_records"])
    p.add_argument("--catchup-keys", type=int, default=d["catchup_keys"])
    p.add_argument("--profile-commit", action="store_true",
                   help="also run one client against brokers that record commit-path timestamps and print where "
                        "the time of a commit goes, stage by stage (p50/p99)")
    p.add_argument("--smoke", action="store_true", help="tiny CI mode: must work, not be fast")
    p.add_argument("--scale", action="store_true",
                   help="issue 19's scale goals: metalog.tools.bench.snapshot plus the real-process catch-up and "
                        "commit-during-snapshot benches at --scale-partitions; writes the figures table into "
                        "--scale-docs")
    p.add_argument("--scale-partitions", type=int, default=None,
                   help="state size of --scale (default 2000000) and of --only scale-catchup,scale-commit "
                        "(default 200000)")
    p.add_argument("--scale-docs", default=None,
                   help="with --scale: the docs file whose marked section gets the table (default docs/bench.md; "
                        "'' to write none)")
    p.add_argument("--scale-note", default=None, help="with --scale: the note above the table (default: says the "
                                                      "machine was loaded)")
    p.add_argument("--plaintext", action="store_true",
                   help="also run metalog in PLAINTEXT (insecure) mode, to show TLS's cost (on with --vs etcd); "
                        "the commit profile then runs on a PLAINTEXT cluster instead of a TLS one")
    p.add_argument("--json", help="write the JSON report here")
    p.add_argument("--dir", help="where clusters live (default: a temp dir, removed afterwards)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (logs) afterwards")
    p.set_defaults(func=cmd_bench)
