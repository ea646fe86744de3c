"""How a produce call's records are cut into requests: consecutive runs of
records, each request at most ``max_request_bytes`` (Kafka's
max.request.size), counting each record's framing and the request's own.

A record that cannot fit in any request is refused before anything is sent
(MESSAGE_TOO_LARGE, naming the record), so a produce call never stores part
of its records because a later one was too large.
"""

from __future__ import annotations

from metalog.broker.client.errors import MetalogError
from metalog.protocol.errors import Errors

# Bytes a record costs in a request besides its value, generously: a Kafka
# RecordBatch v2 record's length, attributes, timestamp and offset deltas, key
# length, value length and header count (at most 5 + 1 + 1 + 5 + 1 + 5 + 1 = 19).
RECORD_OVERHEAD_BYTES = 24
# Request framing besides the records (header, cluster id, timeout; Kafka's
# Produce: the topic and partition nesting and the 61-byte batch header).
REQUEST_OVERHEAD_BYTES = 512


def records_cost_bytes(records: list[bytes]) -> int:
    """What `records` take of a request's budget (values and their framing)."""
    return sum(len(value) for value in records) + RECORD_OVERHEAD_BYTES * len(records)


def split_records(records: list[bytes], max_request_bytes: int) -> list[list[bytes]]:
    """Consecutive chunks of `records`, each fitting in `max_request_bytes`."""
    budget_bytes = max_request_bytes - REQUEST_OVERHEAD_BYTES
    chunks: list[list[bytes]] = []
    current: list[bytes] = []
    size_bytes = 0
    for i, value in enumerate(records):
        cost_bytes = len(value) + RECORD_OVERHEAD_BYTES
        if cost_bytes > budget_bytes:
            raise MetalogError(Errors.MESSAGE_TOO_LARGE,
                               f"record {i} has {len(value)} bytes; max_request_bytes "
                               f"{max_request_bytes} fits at most {budget_bytes - RECORD_OVERHEAD_BYTES}")
        if current and size_bytes + cost_bytes > budget_bytes:
            chunks.append(current)
            current, size_bytes = [], 0
        current.append(value)
        size_bytes += cost_bytes
    if current:
        chunks.append(current)
    return chunks
