"""A failed fsync (EIO) through a fault-injecting layer under the real log
code: the log never reports the data flushed, never retries fsync on the same
file, refuses every later write, and a restart recovers from the last good sync."""

from __future__ import annotations

import errno
import os
import shutil

import pytest

from metalog.storage.segments import segmented_log as log_module
from metalog.storage.errors import LogWriteError
from tests.storage.helpers import RecordingLogger, append_batches
from tests.storage.test_integrity import open_log


def test_eio_on_fdatasync_fails_the_log_from_the_last_good_sync(tmp_path, monkeypatch):
    d = tmp_path / "log"
    log = open_log(d)
    good = append_batches(log, 5)
    assert log.flush() == 15
    append_batches(log, 3)  # offsets 15..23: written, not yet synced
    calls = []

    def failing_fdatasync(fd):
        calls.append(fd)
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(log_module.os, "fdatasync", failing_fdatasync)
    with pytest.raises(LogWriteError, match=r"flush of .* up to offset 24 failed: Input/output error"):
        log.flush()
    assert log.flushed_end_offset == 15  # never acknowledged past the last good sync
    monkeypatch.undo()  # the disk "works" again: the log must still refuse
    with pytest.raises(LogWriteError, match=r"is unusable: fdatasync failed: Input/output error"):
        log.flush()  # no retry of fsync on the same file as if nothing happened
    with pytest.raises(LogWriteError, match="is unusable"):
        log.append(good[0])
    assert len(calls) == 1
    # What is on disk after the failure is a crash image: recovery at the next
    # open verifies it from the recovery point (the unsynced tail may be gone).
    crash = tmp_path / "crash"
    shutil.copytree(d, crash)
    logger = RecordingLogger()
    reopened = open_log(crash, logger)
    assert reopened.log_end_offset >= 15
    assert reopened.read(0, 15, 1 << 20) == b"".join(good)
    assert logger.events("log_verified")
    reopened.close()
    log.close()  # a failed log closes without a flush or a clean-shutdown marker
    assert not (d / ".clean-shutdown").exists()
