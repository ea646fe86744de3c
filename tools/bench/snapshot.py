"""Benchmark: snapshot generation and load for N committed metadata records.

    .venv/bin/python -m metalog.tools.bench.snapshot [--records 1000000] [--topics 1000]

Builds a metadata log in memory (brokers, topics, then ISR/leader changes,
configs and a few fence/unfence cycles up to N records), applies it to a
controller (the full-replay cost a new broker pays without a snapshot), then
measures: what one admin read costs at that size (one topic, one broker, a
page; view + JSON), the state copy taken on the event loop, snapshot generation (encode
+ write + fsync + rename, the part that runs off the loop), snapshot load
(read + CRC verify + decode + apply) in this process and in a fresh one (a
broker's boot: time, CPU, RSS holding the state), and the snapshot size.

Catch-up of a new broker over the network (FetchSnapshot vs Fetch of the full
log) needs the runtime and is measured by the cluster benchmark, not here; the
local replay-vs-load figures printed here are the CPU side of that comparison.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from metalog.broker.controller import views
from metalog.broker.controller.state import Controller, load_latest, write_controller_snapshot
from metalog.broker.controller.state_copy import COPY_SLICE_ENTRIES, IncrementalCopy
from metalog.protocol.messages import SnapshotId
from metalog.storage import batch as b
from metalog.storage import metadata_records as r
from metalog.storage.snapshot import SnapshotStore


def build_log(n_records: int, n_topics: int, partitions: int, n_brokers: int,
              seed: int = 1, batch_records: int = 1000) -> tuple[bytes, int]:
    """Encode a log of exactly n_records metadata records; returns (bytes, next offset)."""
    rng = random.Random(seed)
    c = Controller()
    brokers = list(range(n_brokers))
    head: list[bytes] = []
    for bid in brokers:
        head += c.register_broker(bid, [("PLAINTEXT", "localhost", 9092 + bid)], rack=f"r{bid % 3}")
    topic_ids = [f"{i:08x}-0000-4000-8000-000000000000" for i in range(n_topics)]
    for i, tid in enumerate(topic_ids):
        head.append(r.encode_record(r.Topic(f"topic-{i}", tid)))
        for p in range(partitions):
            reps = tuple(brokers[(i + p + k) % n_brokers] for k in range(3))
            head.append(r.encode_record(r.Partition(tid, p, reps, reps, reps[0])))
    values = head[:n_records]
    enc = r.encode_record
    while len(values) < n_records:
        x = rng.random()
        tid = topic_ids[rng.randrange(n_topics)]
        p = rng.randrange(partitions)
        if x < 0.80:
            isr = tuple(sorted(rng.sample(brokers, 3)))  # may be invalid: ignored, still applied
            values.append(enc(r.PartitionChange(tid, p, isr=isr, leader=isr[0], replicas=isr)))
        elif x < 0.99:
            values.append(enc(r.Config(2, f"topic-{rng.randrange(n_topics)}",
                                       f"k{rng.randrange(20)}", str(rng.randrange(10**6)))))
        else:
            values.append(enc(r.NoOp()))
    out = bytearray()
    for start in range(0, n_records, batch_records):
        out += b.encode_batch(start, 1, values[start:start + batch_records], 0)
    return bytes(out), n_records


def print_read_costs(st, rng: random.Random, queries: int = 300) -> dict[str, dict[str, float]]:
    """Issue 19 item 4: what one admin read costs at this size, view plus JSON
    encoding (the admin API's work per request, before HTTP), p50 / p99 / max;
    also returned, by label."""
    names = list(st.topic_ids)
    brokers = list(st.brokers)
    out: dict[str, dict[str, float]] = {}
    if not names or not brokers:
        return out
    cases = {
        "one topic (configs + up to 1000 partitions)": lambda: views.topic(st, rng.choice(names)),
        "one broker": lambda: views.broker(st, rng.choice(brokers)),
        "a page of 100 topics": lambda: views.topics_page(st, rng.choice(names), 100),
        "a page of 100 partitions": lambda: views.partitions_page(st, rng.choice(names), None, 100),
        "summary (/metadata)": lambda: views.summary(st),
    }
    for label, read in cases.items():
        ms = []
        for _ in range(queries):
            t0 = time.perf_counter()
            views.encode(read())  # as the admin API encodes it
            ms.append((time.perf_counter() - t0) * 1000)
        ms.sort()
        out[label] = {"p50_ms": ms[len(ms) // 2], "p99_ms": ms[int(len(ms) * 0.99)], "max_ms": ms[-1]}
        print(f"read {label}: p50 {ms[len(ms) // 2]:.3f} ms, p99 {ms[int(len(ms) * 0.99)]:.3f} ms, "
              f"max {ms[-1]:.3f} ms ({queries} queries)")
    return out


def main_thread_lags_ms(done, seconds: float | None = None) -> tuple[float, float]:
    """How late 1 ms sleeps wake up on this thread (the event loop's view of
    a worker thread holding the GIL): (p99, max) in ms, until done() or for
    `seconds`."""
    lags = []
    t_end = None if seconds is None else time.perf_counter() + seconds
    while not done() and (t_end is None or time.perf_counter() < t_end):
        t0 = time.perf_counter()
        time.sleep(0.001)
        lags.append((time.perf_counter() - t0) * 1000 - 1.0)
    lags.sort()
    return (lags[int(len(lags) * 0.99)], lags[-1]) if lags else (0.0, 0.0)


def write_beside_a_loop(store, state, sid):
    """Write the snapshot in a worker thread, as the broker does, while this
    thread measures how much it is held up (issue 19 item 2)."""
    box: dict = {}

    def work():
        box["res"] = write_controller_snapshot(store, state, sid, 0, "bench")

    t = threading.Thread(target=work)
    t.start()
    lag = main_thread_lags_ms(lambda: not t.is_alive())
    t.join()
    return box["res"], lag


def _proc_status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise LookupError(field)


def load_only(directory: str) -> dict:
    """Load the newest snapshot in `directory` as a booting broker does, in
    this process: wall and CPU seconds, RSS holding the state and its peak."""
    rss0 = _proc_status_mib("VmRSS")
    t0, c0 = time.perf_counter(), time.process_time()
    loaded = load_latest(SnapshotStore(directory))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    if loaded is None:
        raise SystemExit(f"no snapshot loads from {directory}")
    st = loaded[0]
    return {"seconds": wall, "cpu_seconds": cpu, "partitions": len(st.partitions),
            "rss_before_mib": rss0, "rss_mib": _proc_status_mib("VmRSS"), "peak_rss_mib": _proc_status_mib("VmHWM")}


def fresh_process_load(directory: str) -> dict:
    """load_only in a new Python process (no replayed state beside it, the
    imports of a broker), as a broker's boot pays it."""
    out = subprocess.run([sys.executable, "-m", "metalog.tools.bench.snapshot", "--load-only", directory],
                         capture_output=True, text=True)
    if out.returncode != 0:  # the child's own error, not a bare CalledProcessError
        raise SystemExit(f"snapshot load in a fresh process failed (exit {out.returncode}): "
                         f"{out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--topics", type=int, default=1000)
    ap.add_argument("--partitions", type=int, default=10)
    ap.add_argument("--brokers", type=int, default=10)
    ap.add_argument("--dir", default=None, help="snapshot directory (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the figures here as JSON (metalog bench --scale)")
    ap.add_argument("--load-only", metavar="DIR", default=None,
                    help="only load the newest snapshot in DIR and print the figures as JSON")
    args = ap.parse_args(argv)
    if args.load_only:
        print(json.dumps(load_only(args.load_only)))
        return 0
    fig: dict = {"records": args.records, "topics": args.topics, "partitions_per_topic": args.partitions,
                 "brokers": args.brokers}

    t0 = time.perf_counter()
    log_bytes, end = build_log(args.records, args.topics, args.partitions, args.brokers)
    print(f"log: {args.records} records, {len(log_bytes) / 1e6:.1f} MB "
          f"(built in {time.perf_counter() - t0:.1f} s)")

    c = Controller()
    t0 = time.perf_counter()
    c.apply_batches(log_bytes)
    replay_s = time.perf_counter() - t0
    st = c.state
    print(f"full log replay: {replay_s:.2f} s ({args.records / replay_s:,.0f} records/s); "
          f"state: {len(st.brokers)} brokers, {len(st.topics)} topics, "
          f"{len(st.partitions)} partitions, {len(st.configs)} configs, "
          f"{st.invalid_records} invalid records ignored")

    fig.update(replay_seconds=replay_s, replay_records_per_s=args.records / replay_s,
               partitions=len(st.partitions))
    fig["reads"] = print_read_costs(st, random.Random(2))

    directory = args.dir or tempfile.mkdtemp(prefix="bench-snapshot-")
    try:
        store = SnapshotStore(directory)
        t0 = time.perf_counter()
        st.copy()
        copy_ms = (time.perf_counter() - t0) * 1000
        # What the broker does instead: slices, the loop running between them.
        t0 = time.perf_counter()
        inc = IncrementalCopy(st)
        slices_ms = []
        done = False
        while not done:
            s0 = time.perf_counter()
            done = inc.step()
            slices_ms.append((time.perf_counter() - s0) * 1000)
        s0 = time.perf_counter()
        copy = inc.finish()
        finish_ms = (time.perf_counter() - s0) * 1000
        total_ms = (time.perf_counter() - t0) * 1000
        print(f"state copy for the snapshot: in one go {copy_ms:.1f} ms; a slice at a time "
              f"{len(slices_ms)} slices of {COPY_SLICE_ENTRIES} entries, longest {max(slices_ms):.1f} ms, "
              f"finish {finish_ms:.1f} ms, {total_ms:.1f} ms in all (the loop runs between slices)")
        res, lag = write_beside_a_loop(store, copy, SnapshotId(end, 1))
        idle = main_thread_lags_ms(lambda: False, seconds=1.0)
        print(f"main-thread stall while a worker thread writes the snapshot: p99 {lag[0]:.1f} ms, "
              f"max {lag[1]:.1f} ms (idle: p99 {idle[0]:.1f} ms, max {idle[1]:.1f} ms)")
        print(f"snapshot generation: write off the loop {res.elapsed_ms / 1000:.2f} s, "
              f"{res.records} records, {res.size_bytes / 1e6:.2f} MB")
        t0 = time.perf_counter()
        loaded = load_latest(store)
        load_s = time.perf_counter() - t0
        assert loaded is not None and loaded[0] == st, "loaded state differs from the live state"
        print(f"snapshot load: {load_s:.2f} s (state equal to the replayed one: yes)")
        print(f"full replay time / snapshot load time: {replay_s / load_s:.1f}")
        fresh = fresh_process_load(directory)
        print(f"snapshot load in a fresh process (a broker's boot): {fresh['seconds']:.2f} s "
              f"({fresh['cpu_seconds']:.2f} s CPU; replay / load {replay_s / fresh['seconds']:.1f}x), "
              f"RSS holding the state {fresh['rss_mib']:.0f} MiB, peak {fresh['peak_rss_mib']:.0f} MiB "
              f"(process before the load {fresh['rss_before_mib']:.0f} MiB)")
        fig["fresh_load"] = fresh
        fig.update(snapshot_bytes=res.size_bytes, snapshot_write_seconds=res.elapsed_ms / 1000,
                   load_seconds=load_s, replay_over_load=replay_s / load_s,
                   writer_stall_p99_ms=lag[0], writer_stall_max_ms=lag[1])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(fig, f, indent=2)
        print("catch-up of a new broker over the network (FetchSnapshot vs Fetch): "
              "measured later with the runtime, not by this benchmark")
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
