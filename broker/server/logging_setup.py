"""Structured logging for brokers and tools: one JSON object per line.

Drills read these lines back (role changes, recoveries), so the event names
and fields are an interface: ``role_changed`` carries node, role, epoch,
leader_id; every line carries ``ts`` (wall clock, seconds) and ``node``.

On a terminal (a broker without ``log_file`` run by hand, or the CLI's own
warnings) the same events are printed in a short human form instead:
``21:07:35 info     role_changed  epoch=3 role=leader``. Files and pipes always
get JSON.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def _add_ts(_logger, _name, event_dict):
    event_dict.setdefault("ts", round(time.time(), 6))
    return event_dict


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def configure_logging(level: str = "info", stream: TextIO | None = None, **bound) -> structlog.BoundLogger:
    stream = stream or sys.stderr
    if _is_terminal(stream):
        tail = [structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False),
                structlog.dev.ConsoleRenderer(colors=False, pad_event_to=14)]
    else:
        tail = [_add_ts, structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            *tail,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    return structlog.get_logger().bind(**bound)
