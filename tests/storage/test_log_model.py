"""Property test: random append / flush / truncate / advance-LBO / truncate-fully /
crash-at-any-byte / reopen sequences agree with a simple in-memory model.

A crash copies the directory while the log is open and tears the unflushed
tail (the byte stream of every batch at or past the flushed offset, across
segment files) at an arbitrary byte; later segment files are left empty or
deleted. After reopening, the log must hold every flushed batch and be a
prefix of what was appended.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from metalog.storage.batch import encode_batch, iter_batches
from metalog.storage.segments import SegmentedLog
from tests.storage.helpers import RecordingLogger

SEG_MAX = 600
INTERVAL = 150


class LogMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="logmodel-")
        self.generation = 0
        self.dir = os.path.join(self.root, "g0")
        self.log = self._open()
        # model: [(base, next, epoch, bytes)], log start, end, flushed
        self.batches: list[tuple[int, int, int, bytes]] = []
        self.start = 0
        self.end = 0
        self.flushed = 0
        self.epoch = 0

    def _open(self):
        return SegmentedLog.open(self.dir, segment_bytes_max=SEG_MAX, index_interval_bytes=INTERVAL,
                                 logger=RecordingLogger())

    def teardown(self):
        self.log.close()
        shutil.rmtree(self.root, ignore_errors=True)

    # ------------------------------------------------------------ rules
    @rule(sizes=st.lists(st.lists(st.integers(0, 60), min_size=1, max_size=4), min_size=1, max_size=3),
          bump=st.booleans())
    def append(self, sizes, bump):
        if bump:
            self.epoch += 1
        parts = []
        offset = self.end
        for k, record_sizes in enumerate(sizes):
            records = [bytes([(offset + i) % 256]) * n for i, n in enumerate(record_sizes)]
            data = encode_batch(offset, self.epoch, records, offset)
            self.batches.append((offset, offset + len(records), self.epoch, data))
            parts.append(data)
            offset += len(records)
        self.log.append(b"".join(parts))
        self.end = offset

    @rule()
    def flush(self):
        assert self.log.flush() == self.end
        self.flushed = self.end

    @rule(data=st.data())
    def truncate(self, data):
        bounds = [b[0] for b in self.batches if b[0] >= self.start] + [self.end]
        bounds = [b for b in bounds if b >= self.start]
        end = data.draw(st.sampled_from(bounds))
        self.log.truncate_to(end)
        self.batches = [b for b in self.batches if b[1] <= end]
        self.end = end
        self.flushed = min(self.flushed, end)

    @rule(data=st.data())
    def advance_log_start(self, data):
        offset = data.draw(st.integers(self.start, self.end))
        self.log.advance_log_start(offset)
        self.start = offset

    @rule(gap=st.integers(0, 50))
    def truncate_fully(self, gap):
        new_start = self.end + gap
        self.log.truncate_fully(new_start)
        self.batches = []
        self.start = self.end = self.flushed = new_start

    @rule()
    def reopen_clean(self):
        self.log.close()
        self.log = self._open()
        self.flushed = self.end

    @rule(data=st.data())
    def crash(self, data):
        self.generation += 1
        new_dir = os.path.join(self.root, f"g{self.generation}")
        shutil.copytree(self.dir, new_dir)
        self.log.close()
        self.dir = new_dir
        segs = sorted(n for n in os.listdir(new_dir) if n.endswith(".log"))
        sizes = [os.path.getsize(os.path.join(new_dir, n)) for n in segs]
        total = sum(sizes)
        # The unflushed stream starts at the first batch at or past the flushed offset.
        flushed_pos, pos = total, 0
        unflushed_batches: list[tuple[int, int]] = []  # (position in the stream, size)
        for name, size in zip(segs, sizes):
            with open(os.path.join(new_dir, name), "rb") as f:
                for p, h in iter_batches(f.read()):
                    if h.base_offset >= self.flushed:
                        flushed_pos = min(flushed_pos, pos + p)
                        unflushed_batches.append((pos + p, h.size))
            pos += size
        unflushed = total - flushed_pos
        if unflushed_batches and data.draw(st.booleans(), label="tear inside a batch"):
            # Hypothesis favours the ends of a range; aim inside a batch too.
            start, size = data.draw(st.sampled_from(unflushed_batches), label="torn batch")
            keep = start - flushed_pos + data.draw(st.integers(1, size - 1), label="bytes of it kept")
        else:
            keep = data.draw(st.integers(0, unflushed), label="unflushed bytes kept")
        delete_empty = data.draw(st.booleans(), label="delete emptied segments")
        cut = total - unflushed + keep
        pos = 0
        for name, size in zip(segs, sizes):
            path = os.path.join(new_dir, name)
            if pos + size > cut:
                if pos >= cut and delete_empty and pos > 0:
                    os.unlink(path)
                else:
                    os.truncate(path, max(0, cut - pos))
            pos += size
        self.log = self._open()
        recovered = self.log.log_end_offset
        # Every flushed batch survived; what survived is a prefix of what was appended.
        assert recovered >= self.flushed, (recovered, self.flushed)
        assert recovered <= max(self.end, self.start)
        # A crash that lost data up to past the log start restarts the log empty
        # there (what is below the log start lives in a snapshot).
        assert recovered in {b[1] for b in self.batches} | {self.flushed, self.start}, recovered
        self.batches = [b for b in self.batches if b[1] <= recovered]
        self.end = recovered
        self.flushed = self.end

    @rule(data=st.data())
    def read_one_batch(self, data):
        """A read from inside any batch (the recent ones are found from the
        tail the log remembers, the rest by their headers) starts at that
        batch, and stops at the end asked or at bytes_max."""
        live = [b for b in self.batches if b[1] > self.start]
        if not live:
            return
        i = data.draw(st.integers(0, len(live) - 1))
        base, nxt, _epoch, raw = live[i]
        offset = data.draw(st.integers(max(base, self.start), nxt - 1))
        assert self.log.read(offset, self.end, 1) == raw
        assert self.log.read(offset, nxt, 1 << 30) == raw
        want = b"".join(b[3] for b in live[i:])
        assert self.log.read(offset, self.end, 1 << 30) == want

    # ------------------------------------------------------- invariants
    @invariant()
    def agrees_with_model(self):
        assert self.log.log_start_offset == self.start
        assert self.log.log_end_offset == self.end
        assert self.log.flushed_end_offset == self.flushed
        want = b"".join(b[3] for b in self.batches if b[1] > self.start)
        assert self.log.read(self.start, self.end, 1 << 30) == want
        last_epoch = self.batches[-1][2] if self.batches else -1
        if self.batches and self.batches[-1][1] > self.start:
            assert self.log.last_batch_epoch == last_epoch


LogMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLogModel = LogMachine.TestCase
