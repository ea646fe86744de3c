"""`python -m metalog.tools.bench.storage_engine` on a tiny log: every line it prints is
there and sane (no speed asserted; the figures are in docs/bench-storage.md)."""

from __future__ import annotations

import re

from metalog.tools.bench import storage_engine as bench_storage


def test_bench_storage_prints_verified_reads_and_unclean_start_times(tmp_path, capsys):
    bench_storage.main(["--dir", str(tmp_path), "--recovery-bytes", str(8 << 20), "--segment-bytes", str(1 << 20),
                        "--batches-nofsync", "50", "--batches-fsync", "5"])
    out = capsys.readouterr().out
    assert re.search(r"unclean open of 0\.01 GiB in \d+ segments of <= 1 MiB, recovery point at the end", out)
    assert re.search(r"recovery point 0 \(EVERY segment verified\): [\d.]+ s = \d+ MB/s", out)
    on = re.search(r"CRC verification on :\s+(\d+) MB/s \(0\.01 GiB\)", out)
    off = re.search(r"CRC verification off:\s+(\d+) MB/s \(0\.01 GiB\)", out)
    assert on and off and int(on.group(1)) > 0 and int(off.group(1)) > 0
    assert re.search(r"recovery-point checkpoint write \(once per segment roll\): [\d.]+ ms", out)
