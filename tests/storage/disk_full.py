"""Child process for the disk-full tests (run with ``python -m``).

``fill DIR [FSIZE_LIMIT]`` appends 142-byte batches until the file system (or
RLIMIT_FSIZE) refuses, then exits WITHOUT closing the log (a crash) and prints
JSON: the error message, the end offset before the failure and the segment
size. ``check DIR`` reopens and prints the end offset, segment size and
whether every byte reads back as whole batches.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys

from metalog.storage.batch import iter_batches
from metalog.storage.errors import LogWriteError
from metalog.storage.segments import SegmentedLog, segment_file_name
from tests.storage.helpers import batch

MAX_APPENDS = 100_000  # bound: the limit is far smaller


def fill(directory: str, fsize_limit: int | None) -> None:
    if fsize_limit is not None:
        # Without this the kernel kills us with SIGXFSZ instead of failing the write.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))
    log = SegmentedLog.open(directory, segment_bytes_max=1 << 30, index_interval_bytes=4096)
    error = None
    end_before = log.log_end_offset
    for _ in range(MAX_APPENDS):
        end_before = log.log_end_offset
        try:
            log.append(batch(end_before) + batch(end_before + 3))  # 266 bytes per write
        except LogWriteError as exc:
            error = str(exc)
            break
    end_after = log.log_end_offset
    size = os.path.getsize(os.path.join(directory, segment_file_name(0)))
    print(json.dumps({"error": error, "end_before": end_before, "end_after": end_after, "size": size}))
    sys.stdout.flush()
    os._exit(0)  # no close(): no clean-shutdown marker


def check(directory: str) -> None:
    log = SegmentedLog.open(directory, segment_bytes_max=1 << 30, index_interval_bytes=4096)
    data = log.read(0, log.log_end_offset, 1 << 30)
    whole = sum(h.size for _pos, h in iter_batches(data))
    size = os.path.getsize(os.path.join(directory, segment_file_name(0)))
    print(json.dumps({"end": log.log_end_offset, "size": size, "read_bytes": len(data),
                      "whole_batch_bytes": whole}))
    log.close()


if __name__ == "__main__":
    if sys.argv[1] == "fill":
        fill(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)
    else:
        check(sys.argv[2])
