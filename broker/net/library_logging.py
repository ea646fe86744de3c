"""The logger of code that runs inside someone else's program: the client
library, and the channels and TLS files it uses.

A library is silent unless the application configures logging (the rule of
Python's logging HOWTO for libraries). Our own programs (the broker, the CLI,
bench, drill) configure structlog (``metalog.broker.server.logging_setup``)
and expect these events among their structured lines, so a
``LibraryLogger`` asks at each call which setup the process has:

* structlog configured (``structlog.is_configured()``): the event goes to
  structlog, exactly as a ``structlog.get_logger(name)`` would send it;
* otherwise it goes to the standard ``logging`` logger of that name
  (``metalog.client``, ``metalog.net``, ``metalog.tls``) as one message,
  ``producer_id_initialized producer_id=7 producer_epoch=0``. The
  ``metalog`` logger has a ``NullHandler``, so without a logging setup
  nothing reaches stderr (not even Python's last-resort handler for
  warnings); ``logging.basicConfig(level=logging.DEBUG)`` shows every line.

It has the structlog calls this code uses (``debug``, ``info``, ``warning``,
``error``, ``exception``, ``bind``), so a structlog logger handed in
explicitly (the broker's, a test's) replaces it without other change.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

ROOT_LOGGER_NAME = "metalog"

# Once per process: without a handler on the way up, a warning would go to
# logging.lastResort (stderr) in an application that configured nothing.
logging.getLogger(ROOT_LOGGER_NAME).addHandler(logging.NullHandler())


def _render(event: str, fields: dict[str, Any]) -> str:
    parts = [event]
    for key, value in fields.items():
        parts.append(f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}")
    return " ".join(parts)


class LibraryLogger:
    """structlog's calling convention (``log.info("event", key=value)``),
    routed to structlog when the process configured it, else to stdlib
    ``logging`` (silent unless configured). See the module docstring."""

    __slots__ = ("name", "_stdlib", "_structlog", "_bound")

    def __init__(self, name: str, bound: dict[str, Any] | None = None):
        self.name = name
        self._stdlib = logging.getLogger(name)
        self._structlog = structlog.get_logger(name)
        self._bound = bound or {}

    def bind(self, **fields: Any) -> LibraryLogger:
        return LibraryLogger(self.name, {**self._bound, **fields})

    def _emit(self, level: int, method: str, event: str, fields: dict[str, Any], exc_info: bool = False) -> None:
        if self._bound:
            fields = {**self._bound, **fields}
        if structlog.is_configured():
            getattr(self._structlog, method)(event, **fields)
        elif self._stdlib.isEnabledFor(level):
            self._stdlib.log(level, "%s", _render(event, fields), exc_info=exc_info)

    def debug(self, event: str, **fields: Any) -> None:
        self._emit(logging.DEBUG, "debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit(logging.INFO, "info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit(logging.WARNING, "warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit(logging.ERROR, "error", event, fields)

    def exception(self, event: str, **fields: Any) -> None:
        """An error with the exception being handled (its traceback)."""
        self._emit(logging.ERROR, "exception", event, fields, exc_info=True)


def library_logger(name: str) -> LibraryLogger:
    """The default logger of a library class named `name` (``metalog.client`` ...)."""
    return LibraryLogger(name)
