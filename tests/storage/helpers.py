"""Shared helpers for the storage tests."""

from __future__ import annotations

from metalog.storage.batch import encode_batch, iter_batches


class RecordingLogger:
    """Stands in for a structlog logger: keeps (level, event, fields)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str, dict]] = []

    def _rec(self, level: str, event: str, **kw) -> None:
        self.records.append((level, event, kw))

    def info(self, event: str, **kw) -> None:
        self._rec("info", event, **kw)

    def warning(self, event: str, **kw) -> None:
        self._rec("warning", event, **kw)

    def error(self, event: str, **kw) -> None:
        self._rec("error", event, **kw)

    def events(self, name: str) -> list[dict]:
        return [kw for _lvl, ev, kw in self.records if ev == name]


def batch(base_offset: int, epoch: int = 1, n_records: int = 3, value_bytes: int = 20) -> bytes:
    records = [bytes([(base_offset + i) % 251]) * value_bytes for i in range(n_records)]
    return encode_batch(base_offset, epoch, records, 1_700_000_000_000 + base_offset)


def append_batches(log, count: int, epoch: int = 1, n_records: int = 3, value_bytes: int = 20) -> list[bytes]:
    """Append `count` batches one call each; return their encodings."""
    out = []
    for _ in range(count):
        b = batch(log.log_end_offset, epoch, n_records, value_bytes)
        log.append(b)
        out.append(b)
    return out


def base_offsets(data: bytes) -> list[int]:
    return [h.base_offset for _pos, h in iter_batches(data)]
