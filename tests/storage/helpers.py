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


def legacy_producer_state(rec) -> bytes:
    """A ProducerState as snapshots wrote it before it rode in a NoOp
    (metadata_records.PRODUCER_STATE_TAG): frame 1, metalog's key 1000
    (uvarint e8 07), version 0, then the same body the NoOp's tag now holds."""
    from metalog.storage import metadata_records as r

    value = r.encode_record(rec)
    # 01 14 00 | 01 (one tag) | 90 4e (tag 10000) | uvarint size | body
    size, pos = r._uv(value, 6)
    body = value[pos:]
    assert value[:6] == bytes.fromhex("011400" "01" "904e") and len(body) == size
    return bytes.fromhex("01e80700") + body


def rewrite_snapshot_the_old_way(path: str) -> int:
    """Rewrite the snapshot at `path` in place as a build before this one
    wrote it: ProducerState records under key 1000, no metadata.version
    record. Offsets are kept (batch by batch, the same record counts but for
    the dropped metadata.version). Returns the ProducerState records rewritten."""
    from metalog.storage import batch as b
    from metalog.storage import metadata_records as r

    with open(path, "rb") as f:
        data = f.read()
    out = bytearray()
    rewritten = 0
    next_offset = 0
    for pos, h in iter_batches(data):
        values = [bytes(v) for v in b.decode_records(data[pos:pos + h.size], h)]
        if not h.is_control:
            kept = []
            for v in values:
                rec = r.decode_record(v)
                if rec == r.FeatureLevel(r.METADATA_VERSION, r.METADATA_VERSION_LEVEL):
                    continue
                if isinstance(rec, r.ProducerState):
                    v = legacy_producer_state(rec)
                    rewritten += 1
                kept.append(v)
            values = kept
        if values:
            out += encode_batch(next_offset, h.leader_epoch, values, h.max_timestamp_ms, is_control=h.is_control)
            next_offset += len(values)
    with open(path, "wb") as f:
        f.write(out)
    return rewritten
