"""broker/server/logging_setup.py: JSON lines into files and pipes (drills parse them), a short
human form on a terminal."""

from __future__ import annotations

import io
import json
import os
import pty

from metalog.broker.server.logging_setup import configure_logging

# configure_logging is process-wide; tests/conftest.py restores structlog after each test.


def test_a_file_or_pipe_gets_one_json_object_per_line():
    buf = io.StringIO()
    configure_logging("info", buf, node=2).info("role_changed", role="leader", epoch=3)
    line = json.loads(buf.getvalue())
    assert (line["event"], line["node"], line["role"], line["epoch"], line["level"]) == (
        "role_changed", 2, "leader", 3, "info")
    assert isinstance(line["ts"], float)


def test_a_terminal_gets_a_short_human_line():
    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w", buffering=1, closefd=False) as tty:
            log = configure_logging("info", tty, node=2)
            log.info("role_changed", role="leader", epoch=3)
            log.debug("not_shown")  # below the level
        text = os.read(master, 4096).decode()
    finally:
        os.close(master)
        os.close(slave)
    (line,) = [x for x in text.splitlines() if x.strip()]
    assert not line.lstrip().startswith("{")
    assert "role_changed" in line and "role=leader" in line and "epoch=3" in line and "[info" in line
