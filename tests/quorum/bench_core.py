"""Benchmark of the pure quorum core's hot path (not a test).

Three voters in one process, messages handed over synchronously, flushes
complete at once, an in-memory log with O(log n) reads. Each round the leader
takes one ClientAppend of `--batch` records; the round ends when the records
are committed and answered. Prints committed records per second of wall time,
which bounds what the core can sustain end to end (the runtime adds I/O).

    .venv/bin/python -m tests.quorum.bench_core --records 200000 --batch 100
"""

from __future__ import annotations

import argparse
import bisect
import random
import time
from collections import deque

from metalog.broker.quorum import api as a
from metalog.broker.quorum.core import QuorumCore
from metalog.broker.quorum.env import Environment
from metalog.protocol import messages as m
from metalog.storage.batch import iter_batches


class FastLog:
    def __init__(self) -> None:
        self.bases: list[int] = []
        self.data: list[bytes] = []
        self.nexts: list[int] = []

    def read(self, start: int, end: int, max_bytes: int) -> bytes:
        i = bisect.bisect_right(self.bases, start) - 1
        i = max(i, 0)
        out, size = [], 0
        while i < len(self.bases) and self.nexts[i] <= end:
            if out and size + len(self.data[i]) > max_bytes:
                break
            out.append(self.data[i])
            size += len(self.data[i])
            i += 1
        return b"".join(out)

    def snapshot_size(self, sid):
        return None

    def read_snapshot(self, sid, pos, n):
        return b""

    def apply(self, act) -> None:
        if isinstance(act, a.AppendBatches):
            # Index every batch: a later read may start at any batch boundary.
            for pos, h in iter_batches(act.data, verify=False):
                self.bases.append(h.base_offset)
                self.data.append(act.data[pos:pos + h.size])
                self.nexts.append(h.next_offset)
        elif isinstance(act, a.TruncateLog):
            i = bisect.bisect_left(self.bases, act.end_offset)
            del self.bases[i:], self.data[i:], self.nexts[i:]


class BenchClock:
    """The bench stamps events with its own simulated time, never from here."""

    def now_ms(self) -> int:
        raise AssertionError("the core must take time from its events")

    def wall_clock_ms(self) -> int:
        raise AssertionError("the core must take time from its events")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--record-bytes", type=int, default=100)
    args = ap.parse_args()

    voters = (1, 2, 3)
    logs = {i: FastLog() for i in voters}
    cores = {i: QuorumCore(a.QuorumConfig(node_id=i, voters=voters, cluster_id="bench"),
                           a.LogView(), logs[i], None, Environment(BenchClock(), random.Random(i))) for i in voters}
    now = 0
    queue: deque = deque()
    answered = 0

    def run(node: int, ev) -> None:
        nonlocal answered
        for act in cores[node].step(ev):
            t = type(act)
            if t is a.AppendBatches or t is a.TruncateLog:
                logs[node].apply(act)
            elif t is a.FlushLog:
                queue.append((node, a.FlushCompleted(now, cores[node].log_end_offset)))
            elif t is a.SendRequest:
                queue.append((act.destination, a.RequestReceived(now, (node, act.request_id), act.request)))
            elif t is a.Respond:
                if isinstance(act.token, tuple):
                    src, rid = act.token
                    queue.append((src, a.ResponseReceived(now, rid, node, act.response)))
                elif isinstance(act.response, m.ProduceResponse):
                    assert act.response.error_code == 0, act.response
                    answered += 1
            elif t is a.Fatal:
                raise SystemExit(act.reason)

    def drain(limit: int = 100_000) -> None:
        nonlocal now
        for _ in range(limit):
            if not queue:
                # Nothing in flight: move time to the next deadline.
                d = min((c.next_deadline_ms for c in cores.values() if c.next_deadline_ms is not None))
                now = max(now, d)
                for i, c in cores.items():
                    if c.next_deadline_ms is not None and c.next_deadline_ms <= now:
                        run(i, a.Tick(now))
                return
            node, ev = queue.popleft()
            run(node, ev)

    while not any(c.role == "leader" and c.high_watermark > 0 for c in cores.values()):
        drain()
    leader = next(i for i, c in cores.items() if c.role == "leader")
    payload = [bytes(args.record_bytes)] * args.batch
    rounds = args.records // args.batch
    start = time.perf_counter()
    for r in range(rounds):
        run(leader, a.ClientAppend(now, [a.AppendWaiter(r, args.batch)], payload))
        while answered <= r:
            drain(1)
    elapsed = time.perf_counter() - start
    total = rounds * args.batch
    assert cores[leader].role == "leader"
    print(f"committed {total} records in {rounds} appends of {args.batch} "
          f"({args.record_bytes} B each), 3 voters: {elapsed:.2f} s, "
          f"{total / elapsed:,.0f} records/s, {rounds / elapsed:,.0f} commits/s")


if __name__ == "__main__":
    main()
