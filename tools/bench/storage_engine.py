"""Storage benchmark: append throughput with and without fsync, verified reads, and recovery time.

    python -m metalog.tools.bench.storage_engine [--recovery-bytes 1073741824] [--dir DIR] [--one-segment]

Prints appended records/s and MB/s (100-byte records, 100 per batch by
default) when every batch is followed by flush() (fdatasync) and when no
flush happens, then the time SegmentedLog.open() takes on a log of
--recovery-bytes without its clean-shutdown marker:

* with 64 MiB segments and the recovery point at the log end (the usual
  unclean stop): the last segment is fully scanned (length, offsets, CRC-32C
  of every batch); every other segment gets the cheap open check (index
  sanity + the batches after its last index entry);
* the same log with the recovery point at 0 (no checkpoint): EVERY segment is
  verified in full -- the worst case of issue 12's start-up verification;
* with ``--one-segment``, the whole log in ONE segment: a full verified scan.

Then read() of the whole log in 1 MiB reads (as Fetch does), with the CRC of
every returned batch verified (the default) and without, and the cost of one
recovery-point checkpoint write (made once per segment roll, not per fsync).

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

from metalog.storage.batch import encode_batch
from metalog.storage.segments import CLEAN_SHUTDOWN_FILE, DEFAULT_SEGMENT_BYTES_MAX, RECOVERY_POINT_FILE, SegmentedLog


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


def timed_unclean_open(directory: str, segment_bytes_max: int, recovery_point_zero: bool) -> tuple[float, int, int]:
    """Open after an unclean stop; (seconds, segments, bytes of the last segment)."""
    marker = os.path.join(directory, CLEAN_SHUTDOWN_FILE)
    if os.path.exists(marker):
        os.unlink(marker)
    if recovery_point_zero:
        os.unlink(os.path.join(directory, RECOVERY_POINT_FILE))
    t0 = time.perf_counter()
    log = SegmentedLog.open(directory, segment_bytes_max=segment_bytes_max, logger=_Quiet())
    elapsed = time.perf_counter() - t0
    segments = len(log.segment_base_offsets)
    last_bytes = os.path.getsize(os.path.join(directory, f"{log.segment_base_offsets[-1]:020d}.log"))
    log.close()
    return elapsed, segments, last_bytes


def bench_reads(directory: str, verify_reads: bool, read_bytes: int = 1 << 20) -> tuple[float, int]:
    """Read the whole log front to back in read_bytes reads; (MB/s, bytes)."""
    log = SegmentedLog.open(directory, logger=_Quiet(), verify_reads=verify_reads)
    offset, end, total = log.log_start_offset, log.log_end_offset, 0
    t0 = time.perf_counter()
    while offset < end:
        data = log.read(offset, end, read_bytes)
        total += len(data)
        (last_base,) = struct.unpack_from(">q", data, _last_batch_pos(data))
        offset = last_base + 100  # every batch holds 100 records here
    elapsed = time.perf_counter() - t0
    log.close()
    return total / elapsed / 1e6, total


def _last_batch_pos(data: bytes) -> int:
    pos = 0
    while True:
        (length,) = struct.unpack_from(">i", data, pos + 8)
        nxt = pos + 12 + length
        if nxt >= len(data):
            return pos
        pos = nxt


def bench_checkpoint_write(directory: str, n: int = 50) -> float:
    """Mean seconds of one recovery-point checkpoint write (atomic_write: write,
    fsync, rename, directory fsync)."""
    log = SegmentedLog.open(directory, logger=_Quiet())
    t0 = time.perf_counter()
    for i in range(n):
        log._rp.write(i)
    elapsed = (time.perf_counter() - t0) / n
    log.close()
    return elapsed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", help="scratch directory (default: a temp dir next to the repo's /tmp)")
    p.add_argument("--record-bytes", type=int, default=100)
    p.add_argument("--records-per-batch", type=int, default=100)
    p.add_argument("--batches-fsync", type=int, default=1000, help="batches in the fsync-per-batch run")
    p.add_argument("--batches-nofsync", type=int, default=10000, help="batches in the no-fsync run")
    p.add_argument("--recovery-bytes", type=int, default=1 << 30)
    p.add_argument("--segment-bytes", type=int, default=DEFAULT_SEGMENT_BYTES_MAX)
    p.add_argument("--one-segment", action="store_true", help="also time a full scan of the log as ONE segment")
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
        seg_bytes = args.segment_bytes
        written = build_log(d, args.recovery_bytes, seg_bytes)
        gib = written / (1 << 30)
        elapsed, segments, last_bytes = timed_unclean_open(d, seg_bytes, recovery_point_zero=False)
        print(f"unclean open of {gib:.2f} GiB in {segments} segments of <= {seg_bytes >> 20} MiB, recovery "
              f"point at the end (last segment, {last_bytes / (1 << 20):.0f} MiB, verified): {elapsed:.3f} s")
        elapsed, segments, _ = timed_unclean_open(d, seg_bytes, recovery_point_zero=True)
        print(f"unclean open of {gib:.2f} GiB in {segments} segments, recovery point 0 (EVERY segment "
              f"verified): {elapsed:.3f} s = {written / elapsed / 1e6:.0f} MB/s")
        for verify in (True, False):
            mbps, total = bench_reads(d, verify)
            print(f"read() in 1 MiB reads, CRC verification {'on ' if verify else 'off'}: {mbps:8.0f} MB/s "
                  f"({total / (1 << 30):.2f} GiB)")
        print(f"recovery-point checkpoint write (once per segment roll): "
              f"{bench_checkpoint_write(d) * 1000:.2f} ms")
        shutil.rmtree(d, ignore_errors=True)
        if args.one_segment and args.recovery_bytes + (1 << 20) <= (1 << 32) - 1:
            one = args.recovery_bytes + (1 << 20)
            written = build_log(d, args.recovery_bytes, one)
            elapsed, _, _ = timed_unclean_open(d, one, recovery_point_zero=True)
            print(f"unclean open of {written / (1 << 30):.2f} GiB in ONE segment (whole log verified): "
                  f"{elapsed:.3f} s = {written / elapsed / 1e6:.0f} MB/s")
            shutil.rmtree(d, ignore_errors=True)
    finally:
        if not args.dir:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
