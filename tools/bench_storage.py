"""Storage benchmark: append throughput with and without fsync, and recovery time.

    python -m tools.bench_storage [--recovery-bytes 1073741824] [--dir DIR]

Prints appended records/s and MB/s (100-byte records, 100 per batch by
default) when every batch is followed by flush() (fdatasync) and when no
flush happens, then the time SegmentedLog.open() takes on a log of
--recovery-bytes without its clean-shutdown marker:

* with 64 MiB segments: the last segment is fully scanned (length, offsets,
  CRC-32C of every batch); every other segment gets the cheap open check
  (index sanity + the batches after its last index entry);
* with the whole log in ONE segment: a full verified scan of every byte.

Both recovery figures run against a warm page cache (the log was just written);
a cold disk adds its read time. Batches are encoded before timing starts: the
figures measure the storage engine, not encoding.
"""

from __future__ import annotations

import argparse
import os
import shutil
import struct
import tempfile
import time

from storage.batch import encode_batch
from storage.log import CLEAN_SHUTDOWN_FILE, DEFAULT_SEGMENT_BYTES_MAX, SegmentedLog


class _Quiet:
    def info(self, *a, **k): ...
    def warning(self, *a, **k): ...


def make_batches(count: int, start_offset: int, records_per_batch: int, record_bytes: int) -> list[bytes]:
    """`count` encoded batches. One is encoded; the rest copy it and patch the
    base offset, which the CRC does not cover (as in Kafka)."""
    template = encode_batch(0, 1, [b"r" * record_bytes] * records_per_batch, 1_700_000_000_000)
    out = []
    for i in range(count):
        b = bytearray(template)
        struct.pack_into(">q", b, 0, start_offset + i * records_per_batch)
        out.append(bytes(b))
    return out


def bench_append(directory: str, batches: int, fsync_each: bool, records_per_batch: int,
                 record_bytes: int, verify_appends: bool) -> tuple[float, float]:
    shutil.rmtree(directory, ignore_errors=True)
    data = make_batches(batches, 0, records_per_batch, record_bytes)
    log = SegmentedLog.open(directory, logger=_Quiet(), verify_appends=verify_appends)
    append, flush = log.append, log.flush
    t0 = time.perf_counter()
    if fsync_each:
        for b in data:
            append(b)
            flush()
    else:
        for b in data:
            append(b)
    elapsed = time.perf_counter() - t0
    total_bytes = sum(len(b) for b in data)
    log.close()
    shutil.rmtree(directory, ignore_errors=True)
    return batches * records_per_batch / elapsed, total_bytes / elapsed / 1e6


def build_log(directory: str, total_bytes: int, segment_bytes_max: int) -> int:
    shutil.rmtree(directory, ignore_errors=True)
    log = SegmentedLog.open(directory, segment_bytes_max=segment_bytes_max, logger=_Quiet(),
                            verify_appends=False)
    chunk = make_batches(100, 0, 100, 100)  # ~1 MiB per append call
    batch_bytes = len(chunk[0])
    written = 0
    while written < total_bytes:
        off = log.log_end_offset
        blob = bytearray(b"".join(chunk))
        for i in range(100):
            struct.pack_into(">q", blob, i * batch_bytes, off + i * 100)
        log.append(bytes(blob))
        written += len(blob)
    log.close()
    os.unlink(os.path.join(directory, CLEAN_SHUTDOWN_FILE))
    return written


def bench_recovery(directory: str, total_bytes: int, segment_bytes_max: int) -> tuple[float, int, int, int]:
    written = build_log(directory, total_bytes, segment_bytes_max)
    t0 = time.perf_counter()
    log = SegmentedLog.open(directory, segment_bytes_max=segment_bytes_max, logger=_Quiet())
    elapsed = time.perf_counter() - t0
    segments = len(log.segment_base_offsets)
    last_bytes = os.path.getsize(os.path.join(directory, f"{log.segment_base_offsets[-1]:020d}.log"))
    log.close()
    shutil.rmtree(directory, ignore_errors=True)
    return elapsed, written, segments, last_bytes


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", help="scratch directory (default: a temp dir next to the repo's /tmp)")
    p.add_argument("--record-bytes", type=int, default=100)
    p.add_argument("--records-per-batch", type=int, default=100)
    p.add_argument("--batches-fsync", type=int, default=1000, help="batches in the fsync-per-batch run")
    p.add_argument("--batches-nofsync", type=int, default=10000, help="batches in the no-fsync run")
    p.add_argument("--recovery-bytes", type=int, default=1 << 30)
    p.add_argument("--segment-bytes", type=int, default=DEFAULT_SEGMENT_BYTES_MAX)
    args = p.parse_args(argv)
    scratch = args.dir or tempfile.mkdtemp(prefix="bench-storage-")
    d = os.path.join(scratch, "log")
    rpb, rb = args.records_per_batch, args.record_bytes
    try:
        print(f"records of {rb} bytes, {rpb} per batch; scratch {scratch}")
        for fsync_each, n in ((False, args.batches_nofsync), (True, args.batches_fsync)):
            for verify in (True, False):
                rps, mbps = bench_append(d, n, fsync_each, rpb, rb, verify)
                label = "fsync per batch" if fsync_each else "no fsync      "
                print(f"append, {label}, crc check {'on ' if verify else 'off'}: "
                      f"{rps:12,.0f} records/s {mbps:8.1f} MB/s  ({n} batches)")
        for seg_bytes in (args.segment_bytes, max(args.segment_bytes, args.recovery_bytes + (1 << 20))):
            if seg_bytes > (1 << 32) - 1:
                continue
            elapsed, written, segments, last_bytes = bench_recovery(d, args.recovery_bytes, seg_bytes)
            what = (f"last segment, {last_bytes / (1 << 20):.0f} MiB, scanned" if segments > 1
                    else "whole log scanned")
            line = (f"recovery of {written / (1 << 30):.2f} GiB in {segments} segment(s) of "
                    f"<= {seg_bytes >> 20} MiB ({what}): {elapsed:.3f} s")
            if segments == 1:
                line += f" = {written / elapsed / 1e6:.0f} MB/s verified scan"
            print(line)
    finally:
        if not args.dir:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
