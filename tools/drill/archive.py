"""Keep every log segment a drill broker ever wrote, so every acknowledged write stays checkable.

A broker deletes whole segments once a snapshot covers them (and whole
segments above a truncation point, and everything on a snapshot install or a
wiped data dir). Without a copy, an acknowledged write that no consumer read
before its segment went could be neither confirmed nor refuted. So while the
drill runs, ``SegmentArchive.scan`` hard-links every ``<base>.log`` segment of
a broker into ``<archive>/node-<N>/inc-<I>/<base>.<inode>.log`` as soon as it
appears. A hard link shares the inode: it sees every later append, an
``ftruncate`` of an uncommitted tail, and keeps the final bytes after the
broker unlinks the name. Keys are (node, inode), so a wiped node's old files
(held alive by the link) never mix with the files of its next incarnation, nor
a segment deleted by a truncation with the one re-created under the same name.

Not every archived byte was committed: a segment deleted by a snapshot
install or a wipe may end in a divergent, never-committed tail. So each
archived segment carries ``committed_end``: the highest HW its broker reported
while the segment was provably its live file -- the same (name, inode) seen in
a scan before the ``/quorum`` answer and in a scan after it (a name is only
ever created, appended, ftruncated or unlinked, never re-linked, so the inode
was live throughout). A broker's HW only covers records in its own log that
match the leader's committed log, and committed records are never rewritten,
so the batches of that inode ending at or below ``committed_end`` are
committed bytes. The checker (``metalog.tools.drill.checker``) compares them byte for
byte with every other source and uses them for the offsets below the final
logs' start.

The brackets need not come from the same thread as the ``/quorum`` call: the
drill scans from a dedicated thread every few milliseconds and reports each
answer with ``vouch(node, hw, sent_ts, received_ts)``. An answer vouches for
every inode first seen (linked) at or before ``sent_ts`` and seen again by a
scan that started at or after ``received_ts``: the file was in the data dir at
both instants, hence (never re-linked) throughout the request. So a slow or
timed-out HTTP call to one broker never delays the scans or another broker's
answers (``observe`` is the same rule with both scans inline). A segment whose
records all commit and which is deleted before any bracketed answer covers
them still has no bound: the drill keeps segments large enough that this
window is seconds long.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections import deque
from dataclasses import dataclass

PARTITION_DIR = "__cluster_metadata-0"
_SEGMENT_LOG_RE = re.compile(r"^(\d{20})\.log$")
MAX_SEGMENTS_PER_NODE = 1_000_000  # a bound on the bookkeeping; a drill makes a few thousand
# Answers waiting for a scan that starts after them; the scanner resolves them within one interval,
# so this bound is only reached if nothing scans (an answer dropped is a bound lost, never a wrong one).
MAX_PENDING_ANSWERS_PER_NODE = 4096


@dataclass
class ArchivedSegment:
    node: int
    incarnation: int  # the broker incarnation when the segment was first seen
    base_offset: int
    inode: int
    path: str  # the hard link in the archive
    committed_end: int = -1  # batches ending at or below it were committed (bracketed HW); -1: none known


class SegmentArchive:
    """Hard links of every segment file of every broker, with committed bounds. Thread-safe."""

    def __init__(self, root: str, data_dirs: dict[int, str]):
        self.root = os.path.abspath(root)
        self.data_dirs = dict(data_dirs)
        self.segments: dict[tuple[int, int], ArchivedSegment] = {}  # (node, inode) -> segment
        self.link_failures = 0  # a segment gone between listing and linking (never had data to lose)
        self.answers_dropped = 0  # vouch() answers evicted unresolved by MAX_PENDING_ANSWERS_PER_NODE
        self._last_live: dict[int, frozenset[int]] = {}
        # (node, inode) -> monotonic time by which the file was known to be in the data dir
        self._first_seen_ts: dict[tuple[int, int], float] = {}
        # node -> answers (hw, sent_ts, received_ts) not yet followed by a scan
        self._pending: dict[int, deque[tuple[int, float, float]]] = {}
        self._lock = threading.Lock()
        os.makedirs(self.root, exist_ok=True)

    def scan(self, node: int, incarnation: int) -> frozenset[int]:
        """Link every segment of `node` not archived yet; the inodes live now."""
        part = os.path.join(self.data_dirs[node], PARTITION_DIR)
        live = set()
        started_ts = time.monotonic()  # every name listed below was in the dir at some instant after this
        try:
            entries = list(os.scandir(part))
        except FileNotFoundError:  # not created yet, or wiped
            entries = []
        listed_ts = time.monotonic()  # ... and at some instant before this
        with self._lock:
            for entry in entries:
                m = _SEGMENT_LOG_RE.match(entry.name)
                if not m:
                    continue
                ino = entry.inode()
                if (node, ino) not in self.segments:
                    ino = self._link(node, incarnation, int(m.group(1)), entry.path, ino)
                    if ino is None:
                        continue
                self._first_seen_ts.setdefault((node, ino), listed_ts)
                live.add(ino)
            self._resolve(node, started_ts, live)
        return frozenset(live)

    def vouch(self, node: int, hw: int, sent_ts: float, received_ts: float) -> None:
        """`node` answered HW `hw` to a request sent at `sent_ts`, answered by `received_ts`
        (``time.monotonic()``). The next scan that starts at or after `received_ts` applies it
        to every segment it sees that was already known at `sent_ts`."""
        assert sent_ts <= received_ts, (sent_ts, received_ts)
        if hw < 0:
            return
        with self._lock:
            q = self._pending.setdefault(node, deque())
            if len(q) >= MAX_PENDING_ANSWERS_PER_NODE:
                q.popleft()
                self.answers_dropped += 1
            q.append((hw, sent_ts, received_ts))

    def _resolve(self, node: int, scan_started_ts: float, live: set[int]) -> None:
        """Apply the pending answers received before this scan started (lock held)."""
        q = self._pending.get(node)
        if not q:
            return
        keep = deque()
        for hw, sent_ts, received_ts in q:
            if received_ts > scan_started_ts:
                keep.append((hw, sent_ts, received_ts))  # a later scan brackets it
                continue
            for ino in live:
                seg = self.segments[(node, ino)]
                if self._first_seen_ts[(node, ino)] <= sent_ts and hw > seg.committed_end:
                    seg.committed_end = hw
        self._pending[node] = keep

    def _link(self, node: int, incarnation: int, base: int, src: str, ino: int) -> int | None:
        d = os.path.join(self.root, f"node-{node}", f"inc-{incarnation}")
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, f"{base:020d}.linking")
        try:
            os.link(src, tmp)
        except FileNotFoundError:
            self.link_failures += 1
            return None
        # The name may have been re-created between the listing and the link: trust the link's inode.
        real = os.stat(tmp).st_ino
        # The link proves the inode was in the dir by now (perhaps created after the listing).
        self._first_seen_ts.setdefault((node, real), time.monotonic())
        if (node, real) in self.segments:
            os.unlink(tmp)
            return real
        dst = os.path.join(d, f"{base:020d}.{real}.log")
        os.replace(tmp, dst)
        assert len(self.segments) < MAX_SEGMENTS_PER_NODE * max(1, len(self.data_dirs))
        self.segments[(node, real)] = ArchivedSegment(node, incarnation, base, real, dst)
        return real

    def observe(self, node: int, incarnation: int, hw: int | None) -> None:
        """One monitor round for `node`: `hw` is the HW it just answered (None: no answer).

        Scans after the answer; the segments seen both in the previous scan (before
        the answer) and in this one were live when the HW was reported."""
        live = self.scan(node, incarnation)
        with self._lock:
            before = self._last_live.get(node, frozenset())
            self._last_live[node] = live
            if hw is None or hw < 0:
                return
            for ino in before & live:
                seg = self.segments[(node, ino)]
                if hw > seg.committed_end:
                    seg.committed_end = hw

    def forget_live(self, node: int) -> None:
        """The node's data dir is about to be deleted: no later answer may vouch for its old files."""
        with self._lock:
            self._last_live[node] = frozenset()
            self._pending.pop(node, None)

    def list(self) -> list[ArchivedSegment]:
        with self._lock:
            return sorted(self.segments.values(), key=lambda s: (s.node, s.base_offset, s.inode))

    def stats(self) -> dict:
        segs = self.list()
        return {"segments": len(segs), "with_committed_bound": sum(1 for s in segs if s.committed_end >= 0),
                "bytes": sum(os.path.getsize(s.path) for s in segs), "link_failures": self.link_failures,
                "answers_dropped": self.answers_dropped}
