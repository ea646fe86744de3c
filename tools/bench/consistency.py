"""Cost of the cross-replica consistency check (metalog.broker.server.consistency.LogDigest).

    .venv/bin/python -m metalog.tools.bench.consistency [--batches 1000000]

Prints the time a voter needs to answer a ConsistencyCheck over N batches (64
chunk digests) and the bookkeeping the digest adds to every append.
"""

from __future__ import annotations

import argparse
import time
from array import array

from metalog.broker.server.consistency import ENTRY, LogDigest
from metalog.storage.batch import encode_batch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=1_000_000, help="batches covered by one answer")
    args = ap.parse_args(argv)
    if args.batches <= 0:
        ap.error("--batches must be positive")
    n = args.batches
    d = LogDigest()
    # Entries as the runtime would have built them (contents do not change the cost).
    d._bases = array("q", range(0, n * 10, 10))
    d._nexts = array("q", range(10, n * 10 + 10, 10))
    d._entries = bytearray(ENTRY.size * n)
    t0 = time.perf_counter()
    d.digest_chunks(0, n * 10, 64)
    answer_s = time.perf_counter() - t0
    print(f"answer over {n:,} batches ({ENTRY.size * n / 1e6:.0f} MB of entries), 64 chunks: "
          f"{answer_s * 1000:.1f} ms")
    data = b"".join(encode_batch(i * 10, 1, [b"v" * 10] * 10, 0) for i in range(20_000))
    fresh = LogDigest()
    t0 = time.perf_counter()
    fresh.append(data)
    per_batch_us = (time.perf_counter() - t0) / 20_000 * 1e6
    print(f"append bookkeeping: {per_batch_us:.2f} us per batch")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
