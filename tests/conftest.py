"""Suite-wide fixtures.

Tools run in-process by tests (the CLI, bench, drill) configure structlog
globally to write to the stream they were given, often pytest's captured
stderr, which is closed after that test. Restoring the configuration after
every test keeps a later test's log lines from hitting a closed file; and
after every module, since a module-scoped fixture that runs a tool sets up
before the per-test save (tests/bench/test_vs_kafka.py's did: every later
module's `capture_logs` then saw nothing below the CLI's level).
"""

from __future__ import annotations

import pytest
import structlog


@pytest.fixture(autouse=True)
def _restore_structlog_config():
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.fixture(autouse=True, scope="module")
def _restore_structlog_config_per_module():
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)
