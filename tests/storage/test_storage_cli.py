"""`metalog storage verify|recover` end to end on a real directory (a real
process, the console script's module)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from metalog.storage.segments import QUARANTINE_FILE, SegmentedLog, segment_file_name
from tests.storage.helpers import append_batches
from tests.storage.test_integrity import MID_BATCH_POS, open_log
from tests.storage.test_recovery import BATCH_BYTES, flip_bit

REPO = Path(__file__).resolve().parents[2]


def metalog(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "metalog.tools.cli", "storage", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def make_data_dir(tmp_path) -> tuple[Path, Path, list[bytes]]:
    data = tmp_path / "data"
    logdir = data / "__cluster_metadata-0"
    log = open_log(logdir)
    batches = append_batches(log, 17)  # segments 0, 21, 42
    log.close()
    return data, logdir, batches


def test_verify_a_whole_log_exits_0(tmp_path):
    data, _, _ = make_data_dir(tmp_path)
    proc = metalog("verify", "--data-dir", str(data))
    assert proc.returncode == 0, proc.stderr
    assert "verified 3 segment(s), 2414 bytes" in proc.stdout and "no corruption found" in proc.stdout


def test_recover_without_consent_only_reports_and_exits_1(tmp_path):
    """The user sees the damaged file, byte, offset and both CRCs, and the command to run; nothing changes on disk."""
    data, logdir, _ = make_data_dir(tmp_path)
    path = logdir / segment_file_name(21)
    flip_bit(str(path), MID_BATCH_POS)
    before = sorted(os.listdir(logdir))
    proc = metalog("recover", "--data-dir", str(data))
    assert proc.returncode == 1
    assert f"corrupt: {path} at byte {BATCH_BYTES} (offset 24, epoch 1, stored CRC 0x" in proc.stdout
    assert f"metalog storage recover --data-dir {data} --truncate-at-corruption" in proc.stdout
    assert sorted(os.listdir(logdir)) == before


def test_recover_with_consent_truncates_at_the_first_corruption(tmp_path):
    data, logdir, batches = make_data_dir(tmp_path)
    flip_bit(str(logdir / segment_file_name(21)), MID_BATCH_POS)
    proc = metalog("recover", "--data-dir", str(data), "--truncate-at-corruption")
    assert proc.returncode == 0, proc.stderr
    assert "will truncate the log at offset 24" in proc.stdout
    for base in (21, 42):
        assert f"renamed: {logdir / segment_file_name(base)}.corrupt" in proc.stdout
    assert "done: the log now ends at offset 24" in proc.stdout
    assert not (logdir / QUARANTINE_FILE).exists()  # consent given: this copy may vote again
    log = SegmentedLog.open(logdir)
    assert log.log_end_offset == 24 and log.quarantine is None
    assert log.read(0, 24, 1 << 20) == b"".join(batches[:8])
    log.close()
    again = metalog("verify", "--data-dir", str(data))
    assert again.returncode == 0 and "no corruption found" in again.stdout
