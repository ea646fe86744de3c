"""`metalog dump ... | head`: a reader that goes away is not an error."""

import subprocess
import sys

from metalog.storage.batch import encode_batch
from metalog.storage.segments import SegmentedLog


def test_dump_into_a_closed_pipe_exits_quietly(tmp_path):
    """The user sees the first line and nothing on stderr; exit 0 (was 'metalog: error: [Errno 32] Broken pipe')."""
    log = SegmentedLog.open(tmp_path / "log")
    for i in range(2000):
        log.append(encode_batch(i, 1, [b"value-%d" % i], timestamp_ms=0))
    log.flush()
    log.close()
    seg = tmp_path / "log" / "00000000000000000000.log"
    p = subprocess.Popen([sys.executable, "-m", "metalog.tools.cli", "dump", "--print-data-log", str(seg)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = p.stdout.readline()
    p.stdout.close()  # the reader goes away, as `head -1` does
    err = p.stderr.read()
    assert p.wait(timeout=60) == 0
    assert first.startswith(b'{"batch"')
    assert err == b""
