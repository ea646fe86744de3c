"""Suite-wide fixtures.

Tools run in-process by tests (the CLI, bench, drill) configure structlog
globally to write to the stream they were given, often pytest's captured
stderr, which is closed after that test. Restoring the configuration after
every test keeps a later test's log lines from hitting a closed file.
"""

from __future__ import annotations

import pytest
import structlog


@pytest.fixture(autouse=True)
def _restore_structlog_config():
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)
