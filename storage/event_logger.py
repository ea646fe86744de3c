"""What storage needs of a logger: structured events by name with keyword
fields, as structlog's bound loggers take them. A typing.Protocol, so a test
or a benchmark can hand in any object with these three methods."""

from __future__ import annotations

from typing import Protocol


class EventLogger(Protocol):
    def info(self, event: str, **fields: object) -> object: ...

    def warning(self, event: str, **fields: object) -> object: ...

    def error(self, event: str, **fields: object) -> object: ...
