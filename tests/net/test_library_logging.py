"""The library's logger (broker/net/library_logging.py): silent in an
application that configured no logging, visible through the application's
stdlib logging setup, and the same structured lines as before in our own
programs, which configure structlog.

Each case runs in a fresh interpreter: this suite configures structlog for
itself (tests/conftest.py), and a library's silence is only visible where
nobody did."""

from __future__ import annotations

import json
import subprocess
import sys

EMIT = """
from metalog.broker.net.library_logging import library_logger
log = library_logger("metalog.client")
log.debug("producer_id_initialized", producer_id=7, producer_epoch=0)
log.info("leader_changed", leader_id=2, leader_epoch=3)
log.warning("log_truncation_detected", position=5, reset_policy="none")
log.bind(peer="h:1").error("connect_failed", error="refused by peer")
"""


def _run(setup: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", setup + EMIT], capture_output=True, text=True, timeout=60)


def test_an_application_without_a_logging_setup_sees_nothing():
    out = _run("")
    assert out.returncode == 0, out.stderr
    assert (out.stdout, out.stderr) == ("", "")  # not even the warning and the error (no last-resort handler)


def test_the_applications_stdlib_logging_shows_every_line_at_its_level():
    out = _run("import logging, sys\nlogging.basicConfig(level=logging.DEBUG, stream=sys.stderr, "
               "format='%(name)s %(levelname)s %(message)s')\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""
    assert out.stderr.splitlines() == [
        "metalog.client DEBUG producer_id_initialized producer_id=7 producer_epoch=0",
        "metalog.client INFO leader_changed leader_id=2 leader_epoch=3",
        "metalog.client WARNING log_truncation_detected position=5 reset_policy='none'",
        "metalog.client ERROR connect_failed peer='h:1' error='refused by peer'",
    ]
    quiet = _run("import logging\nlogging.basicConfig(level=logging.WARNING)\n")
    assert [line.split(":")[:3] for line in quiet.stderr.splitlines()] == [
        ["WARNING", "metalog.client", "log_truncation_detected position=5 reset_policy='none'"],
        ["ERROR", "metalog.client", "connect_failed peer='h"],
    ]


def test_a_program_that_configured_structlog_gets_its_structured_lines():
    """The broker, the CLI, bench and drill configure structlog
    (logging_setup.configure_logging): the events reach it with their fields,
    as a structlog logger's would, and nothing goes through stdlib logging."""
    out = _run("import io, sys\nfrom metalog.broker.server.logging_setup import configure_logging\n"
               "configure_logging('debug', sys.stdout)\n")
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(e["event"], e["level"]) for e in lines] == [
        ("producer_id_initialized", "debug"), ("leader_changed", "info"),
        ("log_truncation_detected", "warning"), ("connect_failed", "error")]
    assert lines[0]["producer_id"] == 7 and lines[3]["peer"] == "h:1" and lines[3]["error"] == "refused by peer"
