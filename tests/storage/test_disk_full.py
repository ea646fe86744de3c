"""A full disk fails the append cleanly, and after a restart no partial batch is visible.

Real limits, no mocks: RLIMIT_FSIZE (EFBIG, works everywhere) and, where the
machine lets us create a mount namespace, a 64 KiB tmpfs (a true ENOSPC).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BATCH_PAIR_BYTES = 284  # each append writes two 142-byte batches (6 offsets)


def run(args: list[str]) -> list[dict]:
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def child(*args: str) -> list[str]:
    return [sys.executable, "-m", "tests.storage.disk_full", *args]


def assert_clean_failure(filled: dict, checked: dict, reason: str) -> None:
    end = filled["end_before"]
    assert filled["error"] == f"append of {BATCH_PAIR_BYTES} bytes at offset {end} failed: {reason}"
    assert filled["end_after"] == end  # the end offset did not move
    assert filled["size"] == end // 6 * BATCH_PAIR_BYTES  # the partial write was cut back
    assert checked["end"] == end
    assert checked["size"] == filled["size"]
    assert checked["read_bytes"] == checked["whole_batch_bytes"] == filled["size"]


def test_file_size_limit_fails_append_cleanly(tmp_path):
    # 1000 bytes: three appends fit (852), the fourth is cut after a short write.
    (filled,) = run(child("fill", str(tmp_path), "1000"))
    (checked,) = run(child("check", str(tmp_path)))
    assert filled["end_before"] == 18
    assert_clean_failure(filled, checked, "File too large")


def _tmpfs_available() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


def test_enospc_on_a_tiny_tmpfs_fails_append_cleanly(tmp_path):
    if not _tmpfs_available():
        # No mount namespace on this machine: exercise the same path with the
        # file-size limit so the test still asserts real behaviour.
        (filled,) = run(child("fill", str(tmp_path), "4000"))
        (checked,) = run(child("check", str(tmp_path)))
        assert_clean_failure(filled, checked, "File too large")
        return
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    py = " ".join(child("fill", '"$1"'))
    check = " ".join(child("check", '"$1"'))
    script = f'mount -t tmpfs -o size=64k tmpfs "$1" && {py} && {check}'
    filled, checked = run(["unshare", "-rm", "sh", "-c", script, "sh", str(mnt)])
    assert filled["end_before"] > 0
    assert_clean_failure(filled, checked, "No space left on device")
