"""Run many seeds of the deterministic simulator and print violations and failover latency.

    .venv/bin/python -m metalog.tools.simulate --seeds 10000 [--start 0] [--workers 2]

Prints the number of violations (must be 0), the failing seeds (replay one
with ``SIM_SEED=n .venv/bin/python -m pytest tests/sim -k random``), and the
simulated time from a leader crash to the next commit (the first record a
new leader commits in its epoch), p50/p99 over "clean" crashes: the other
voters were up and reachable and no other fault started in between. All
samples (including overlapped faults) are reported too, and clean crashes
split by kind: a killed process (its host resets the connections: followers
notice at once) or a lost host (silence: followers wait out the fetch
timeout). Default timeouts: election 1000 ms, fetch 1000 ms. Then the
RejoinNoEpochBump windows (a follower isolated from a healthy cluster; see
sim/random_run.py): how many, and in how many an epoch was bumped. Last, wire
corruption (a bit flipped in a fetch answer, drawn in half the seeds): in how
many seeds it fired, how many bits flipped and how many batches followers
refused for it (SIM_WIRE_FLIPS=0 turns it off).
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
import traceback

from metalog.sim.invariants import Violation
from metalog.sim.random_run import run_seed


def _one(args: tuple[int, int, bool, bool]) -> tuple[int, str | None, list[tuple[int, bool, bool]], int,
                                                      list[tuple[int, bool, bool]], dict[str, int]]:
    seed, duration_ms, snapshots, kafka_wire = args
    try:
        r = run_seed(seed, duration_ms=duration_ms, snapshots=snapshots, kafka_wire=kafka_wire)
        return seed, None, r.failover_samples, r.events, r.rejoin_samples, r.faults
    except Violation as v:
        return seed, str(v), [], 0, [], {}
    except Exception as exc:  # a crash of the harness or the core is a failure too
        return seed, f"SIM_SEED={seed} exception: {exc!r}\n{traceback.format_exc()}", [], 0, [], {}


def percentile(values: list[int], p: float) -> int:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=10000, help="how many seeds to run")
    ap.add_argument("--start", type=int, default=0, help="first seed")
    ap.add_argument("--workers", type=int, default=2, help="processes")
    ap.add_argument("--duration-ms", type=int, default=25000, help="simulated fault phase per seed")
    ap.add_argument("--no-snapshots", action="store_true")
    ap.add_argument("--kafka-wire", action="store_true",
                    help="every message between nodes through Kafka's bytes and the brokers' own mapping "
                         "(sim/kafka_wire.py; replay a seed with SIM_KAFKA_WIRE=1)")
    ap.add_argument("--slowest", type=int, default=0, metavar="N",
                    help="also print the N slowest silent failovers with their seeds (to replay them)")
    args = ap.parse_args(argv)
    if args.seeds <= 0 or args.workers <= 0:
        ap.error("--seeds and --workers must be positive")

    jobs = [(s, args.duration_ms, not args.no_snapshots, args.kafka_wire)
            for s in range(args.start, args.start + args.seeds)]
    started = time.monotonic()
    failures: list[tuple[int, str]] = []
    clean: list[int] = []
    clean_kill: list[int] = []
    clean_silent: list[int] = []
    silent_by_seed: list[tuple[int, int]] = []  # (ms, seed)
    every: list[int] = []
    rejoins: list[tuple[int, bool, bool]] = []
    wire = [0, 0, 0]  # seeds where a bit flipped on the wire, bits flipped, batches refused
    events = 0
    with multiprocessing.Pool(args.workers) as pool:
        for i, (seed, err, samples, n_events, rejoin, faults) in enumerate(
                pool.imap_unordered(_one, jobs, chunksize=4), 1):
            events += n_events
            rejoins.extend(rejoin)
            if faults.get("wire_flip"):
                wire[0] += 1
                wire[1] += faults["wire_flip"]
                wire[2] += faults.get("fetched_corrupt_refused", 0)
            if err is not None:
                failures.append((seed, err))
                print(err.splitlines()[0], file=sys.stderr, flush=True)
            for latency_ms, is_clean, silent in samples:
                every.append(latency_ms)
                if is_clean:
                    clean.append(latency_ms)
                    (clean_silent if silent else clean_kill).append(latency_ms)
                    if silent:
                        silent_by_seed.append((latency_ms, seed))
            if i % 500 == 0:
                print(f"... {i}/{len(jobs)} seeds, {len(failures)} violations, "
                      f"{time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)

    wall_s = time.monotonic() - started
    print(f"seeds: {len(jobs)} ({args.start}..{args.start + len(jobs) - 1}), "
          f"simulated {args.duration_ms} ms of faults each, {events} events, wall {wall_s:.0f} s")
    print(f"violations: {len(failures)}")
    if failures:
        print("failing seeds: " + " ".join(str(s) for s, _ in sorted(failures)))
        print("first failure:\n" + sorted(failures)[0][1])
    for name, xs in (("clean leader crashes", clean),
                     ("clean, process killed (connections reset)", clean_kill),
                     ("clean, host lost (silent)", clean_silent),
                     ("all leader crashes", every)):
        if xs:
            print(f"failover (leader crash -> next commit), {name}: n={len(xs)} "
                  f"p50={percentile(xs, 50)} ms p99={percentile(xs, 99)} ms max={max(xs)} ms")
        else:
            print(f"failover, {name}: no samples")
    if args.slowest:
        worst = sorted(silent_by_seed, reverse=True)[:args.slowest]
        print("slowest silent failovers: " + (", ".join(f"{latency_ms} ms (seed {sd})" for latency_ms, sd in worst) or "none"))
    lossless = [(b, healed) for b, healed, no_loss in rejoins if no_loss]
    lossy = [b for b, _, no_loss in rejoins if not no_loss]
    print(f"follower isolated from a healthy cluster (RejoinNoEpochBump): {len(rejoins)} windows, "
          f"{sum(1 for _, h, _ in rejoins if h)} healed within; epoch bumped in "
          f"{sum(1 for b, _ in lossless if b)} of {len(lossless)} lossless (checked) and "
          f"{sum(1 for b in lossy if b)} of {len(lossy)} lossy")
    print(f"wire corruption (a bit flipped in a fetch answer): fired in {wire[0]} of {len(jobs)} seeds, "
          f"{wire[1]} bits flipped, {wire[2]} batches refused by followers")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
