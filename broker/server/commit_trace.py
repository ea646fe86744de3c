"""Commit-path timestamps for ``metalog bench --profile-commit``.

Off unless the broker's environment names a directory in
``METALOG_COMMIT_TRACE_DIR`` (the bench sets it for the clusters it profiles;
a production broker never records anything). When on, the runtime marks each
step of a commit's journey with ``time.monotonic_ns()`` -- system-wide on
Linux, so the marks of the three brokers and the client line up -- and the
marks are written as JSON to ``<dir>/node-<id>.json`` when the broker stops.
``metalog.tools.bench.commit_profile`` turns them into the per-stage table.

A mark is (ns, event, offset, peer). Events (offset meaning in brackets):

    produce_recv   leader read a Produce request              [-1]
    append         a batch is in the log (page cache)         [next offset]
    flush_start    an fdatasync starts                        [log end]
    flush_done     an fdatasync finished                      [flushed end]
    fetch_recv     leader read a replica's Fetch              [fetch offset]
    fetch_answer   leader wrote a Fetch answer with records   [its log end]
    hw             the core moved the high watermark          [new HW]
    produce_reply  leader wrote a Produce answer              [base offset]
    fetch_resp     follower read a Fetch answer with records  [log end after]
    fetch_action   follower's core asked for a Fetch          [fetch offset]
    fetch_sent     follower wrote that Fetch on the socket    [fetch offset]

Beside the marks, the trace is the process's codec meter
(``metalog.broker.net.codec_clock``): how long each decode and encode of a
Kafka frame took, by operation and api key, which the profile prints per
request.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from metalog.broker.net import codec_clock
from metalog.storage.atomic import atomic_write

ENV_VAR = "METALOG_COMMIT_TRACE_DIR"
# Bound on the marks kept (about 40 bytes each); later marks are dropped.
MAX_MARKS = 500_000


class CommitTrace:
    __slots__ = ("path", "marks", "dropped", "codec", "codec_kept")

    def __init__(self, path: str):
        self.path = path
        self.marks: list[tuple[int, str, int, int]] = []
        self.dropped = 0
        # "<operation>:<api key>" -> durations (ns); MAX_MARKS in all, later ones dropped.
        self.codec: dict[str, list[int]] = {}
        self.codec_kept = 0

    def codec_sample(self, op: str, api_key: int, ns: int) -> None:
        """One decode or encode of a Kafka frame (codec_clock's meter)."""
        if self.codec_kept >= MAX_MARKS:
            self.dropped += 1
            return
        self.codec_kept += 1
        self.codec.setdefault(f"{op}:{api_key}", []).append(ns)

    def mark(self, event: str, offset: int, peer: int = -1, ns: int | None = None) -> None:
        if len(self.marks) >= MAX_MARKS:
            self.dropped += 1
            return
        self.marks.append((time.monotonic_ns() if ns is None else ns, event, offset, peer))

    def dump(self) -> None:
        atomic_write(self.path, json.dumps({"marks": self.marks, "codec": self.codec,
                                            "dropped": self.dropped}).encode())

    def dump_or_warn(self, log: Any) -> None:
        """dump(), at stop: a trace that cannot be written is a warning, not a failure."""
        try:
            self.dump()
        except OSError as exc:
            log.warning("commit_trace_not_written", path=self.path, error=str(exc))


def from_env(node_id: int) -> CommitTrace | None:
    """The trace this broker records into, or None (the default: off). A
    trace is also the process's codec meter from now on (one broker, one
    process, one trace)."""
    trace_dir = os.environ.get(ENV_VAR)
    if not trace_dir:
        return None
    trace = CommitTrace(os.path.join(trace_dir, f"node-{node_id}.json"))
    codec_clock.set_meter(trace)
    return trace


def load(path: str) -> list[tuple[int, str, int, int]]:
    with open(path, encoding="utf-8") as f:
        return [tuple(mk) for mk in json.load(f)["marks"]]


def load_codec(path: str) -> dict[tuple[str, int], list[int]]:
    """The codec durations (ns) of one node's trace, by (operation, api key)."""
    with open(path, encoding="utf-8") as f:
        raw = json.load(f).get("codec", {})
    out: dict[tuple[str, int], list[int]] = {}
    for key, durations in raw.items():
        op, api_key = key.rsplit(":", 1)
        out[(op, int(api_key))] = durations
    return out
