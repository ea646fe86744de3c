"""The drill's safety checker: did the cluster keep every promise it made?

Input is a ``History`` the drill recorded (acknowledged writes, what each
consumer saw and when it was told of truncation, role changes and HW samples
per broker incarnation) plus each broker's log read back from its data dir
(``read_replica``) after the cluster stopped. ``check(history, replicas,
commit_end)`` returns a ``CheckResult``; every breach carries the evidence:

* every acknowledged write is present exactly once, at its acknowledged
  offset. The committed log is assembled from the replicas' final logs and,
  below their log start (segments a snapshot removed), from the drill's
  segment archive (``metalog.tools.drill.archive``: hard links of every segment every
  broker ever had, each with the HW its broker vouched for while the segment
  was live); what consumers read is a last resort, counted separately;
* the committed prefixes of all replicas are identical byte for byte (batch
  by batch, over the offsets every pair of replicas both still hold), and so
  is every archived committed batch with every other copy of that batch;
* at most one leader per epoch (from the ``role_changed`` log lines);
* the HW never decreased within one broker process (incarnation);
* no consumer saw a record that is not in the final committed log at that
  offset, unless it was told (``LogTruncationError``) before moving on;
* no consumer skipped a data record: between two records it returned, every
  offset it passed is a control record or was jumped over by a recorded reset
  (an out-of-range answer after a snapshot moved the log start past the
  consumer, KIP-630) -- anything else is ``consumer_skipped``.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from metalog.protocol.invariants import InvariantViolation
from metalog.storage import batch as B
from metalog.storage import metadata_records as MR
from metalog.storage.segments import SegmentedLog

PARTITION_DIR = "__cluster_metadata-0"


@dataclass
class Ack:
    value: bytes
    offset: int
    epoch: int
    ts: float
    writer: int = 0


@dataclass
class Seen:
    consumer: int
    offset: int
    epoch: int
    value: bytes
    ts: float


@dataclass
class Truncation:
    consumer: int
    ts: float
    offset: int  # where the consumer was when told


@dataclass
class Reset:
    consumer: int
    ts: float
    from_offset: int | None  # the consumer's position when told it was out of range
    to_offset: int  # where it resumed (the leader's log start)


@dataclass
class RoleEvent:
    node: int
    ts: float
    role: str
    epoch: int
    leader_id: int | None
    source: str = "log"  # the broker.log line number or "admin"
    hw: int | None = None  # the node's high watermark when its role changed


@dataclass
class HwSample:
    node: int
    incarnation: int
    ts: float
    hw: int


@dataclass
class History:
    acks: list[Ack] = field(default_factory=list)
    attempted: set[bytes] = field(default_factory=set)  # every value ever sent, acked or not
    seen: list[Seen] = field(default_factory=list)
    truncations: list[Truncation] = field(default_factory=list)
    resets: list[Reset] = field(default_factory=list)
    roles: list[RoleEvent] = field(default_factory=list)
    hw: list[HwSample] = field(default_factory=list)


@dataclass
class ReplicaLog:
    node: int
    log_start: int
    log_end: int
    batches: list[tuple[int, int, int, bytes]]  # (base_offset, next_offset, epoch, raw bytes)

    def records(self, end: int) -> dict[int, tuple[bytes, int]]:
        """offset -> (value, epoch) of data records below `end` (control batches skipped)."""
        out = {}
        for base, nxt, epoch, raw in self.batches:
            if base >= end:
                break
            h = B.decode_header(raw, 0)
            if h.is_control:
                continue
            for i, value in enumerate(B.decode_records(raw, h)):
                if base + i < end and base + i >= self.log_start:
                    out[base + i] = (value, epoch)
        return out


@dataclass
class Breach:
    kind: str
    message: str
    evidence: list = field(default_factory=list)

    def __str__(self) -> str:
        ev = "; ".join(map(str, self.evidence[:5]))
        more = f" (+{len(self.evidence) - 5} more)" if len(self.evidence) > 5 else ""
        return f"[{self.kind}] {self.message}" + (f" -- evidence: {ev}{more}" if ev else "")


@dataclass
class CheckResult:
    breaches: list[Breach]
    stats: dict
    # The committed log as the copies showed it (offset -> value of data records, and the
    # control records' offsets): read back into the history for the independent checker.
    log: dict[int, bytes] = field(default_factory=dict)
    control: set[int] = field(default_factory=set)

    @property
    def ok(self) -> bool:
        return not self.breaches

    def summary(self) -> str:
        if self.ok:
            return "checker: clean ({})".format(", ".join(f"{k}={v}" for k, v in self.stats.items()))
        return "checker: {} breach(es)\n".format(len(self.breaches)) + "\n".join(f"  {b}" for b in self.breaches)

    def to_json(self) -> dict:
        return {"ok": self.ok, "stats": self.stats,
                "breaches": [{"kind": b.kind, "message": b.message, "evidence": [str(e) for e in b.evidence[:50]]}
                             for b in self.breaches]}


def read_replica(node: int, data_dir: str) -> ReplicaLog:
    """Read one broker's whole log from its data dir (the broker must be stopped)."""
    part = os.path.join(data_dir, PARTITION_DIR)
    if not os.path.isdir(part):
        return ReplicaLog(node, 0, 0, [])
    log = SegmentedLog.open(part)
    try:
        batches = []
        for info in log.iter_batch_headers():
            raw = log.read(max(info.base_offset, log.log_start_offset), info.next_offset, 1 << 30)
            if not raw:
                raise InvariantViolation(f"node {node}: batch at {info.base_offset} read back empty")
            batches.append((info.base_offset, info.next_offset, info.leader_epoch, bytes(raw[:info.size_bytes])))
        return ReplicaLog(node, log.log_start_offset, log.log_end_offset, batches)
    finally:
        log.close()


# ------------------------------------------------------------------ checks
def check_leaders(roles: list[RoleEvent]) -> list[Breach]:
    leaders: dict[int, set[int]] = defaultdict(set)
    where: dict[int, list] = defaultdict(list)
    for ev in roles:
        if ev.role == "leader":
            leaders[ev.epoch].add(ev.node)
            where[ev.epoch].append(f"node {ev.node} leader at ts {ev.ts:.3f} ({ev.source})")
    return [Breach("two_leaders", f"epoch {epoch} had {len(nodes)} leaders: nodes {sorted(nodes)}", where[epoch])
            for epoch, nodes in sorted(leaders.items()) if len(nodes) > 1]


def check_hw(samples: list[HwSample]) -> list[Breach]:
    out = []
    last: dict[tuple[int, int], HwSample] = {}
    for s in sorted(samples, key=lambda s: s.ts):
        key = (s.node, s.incarnation)
        prev = last.get(key)
        if prev is not None and s.hw < prev.hw:
            out.append(Breach("hw_decreased", f"node {s.node} HW went from {prev.hw} to {s.hw} "
                              f"(incarnation {s.incarnation})",
                              [f"ts {prev.ts:.3f} hw {prev.hw}", f"ts {s.ts:.3f} hw {s.hw}"]))
        if prev is None or s.hw >= prev.hw:
            last[key] = s
    return out


def check_prefixes(replicas: list[ReplicaLog], commit_end: int) -> list[Breach]:
    out = []
    maps = {r.node: {b[0]: b for b in r.batches if b[1] <= commit_end} for r in replicas}
    for r in replicas:
        if r.log_end < commit_end:
            out.append(Breach("missing_committed", f"node {r.node} log ends at {r.log_end}, below the "
                              f"committed offset {commit_end}", [f"log_start {r.log_start}"]))
    nodes = sorted(maps)
    for i, a in enumerate(nodes):
        for b in nodes[i + 1:]:
            ra = next(r for r in replicas if r.node == a)
            rb = next(r for r in replicas if r.node == b)
            lo = max(ra.log_start, rb.log_start)
            for base, ba in sorted(maps[a].items()):
                if base < lo:
                    continue
                bb = maps[b].get(base)
                if bb is None:
                    if any(x[0] < base < x[1] for x in rb.batches) or base < rb.log_end:
                        out.append(Breach("diverging_prefix", f"nodes {a} and {b} split batches differently "
                                          f"at offset {base} below the committed offset {commit_end}",
                                          [f"node {a}: batch {ba[0]}..{ba[1]} epoch {ba[2]}"]))
                        break
                    continue
                if ba[3] != bb[3]:
                    out.append(Breach("diverging_prefix", f"nodes {a} and {b} differ at offset {base} "
                                      f"(epoch {ba[2]} vs {bb[2]}), below the committed offset {commit_end}",
                                      [f"node {a}: {len(ba[3])} bytes", f"node {b}: {len(bb[3])} bytes"]))
                    break
    return out


def read_archived(seg, commit_end: int) -> tuple[list[tuple[int, int, int, bytes]], str | None]:
    """The batches of an archived segment (``metalog.tools.drill.archive.ArchivedSegment``) that its
    broker vouched for (ending at or below its committed_end) and below `commit_end`;
    plus a problem if the file is damaged below that bound."""
    bound = min(seg.committed_end, commit_end)
    if bound <= seg.base_offset:
        return [], None
    with open(seg.path, "rb") as f:
        data = f.read()
    out: list[tuple[int, int, int, bytes]] = []
    reached = seg.base_offset
    try:
        for pos, h in B.iter_batches(data):
            if h.next_offset > bound:
                break
            out.append((h.base_offset, h.next_offset, h.leader_epoch, bytes(data[pos:pos + h.size])))
            reached = h.next_offset
    except B.CorruptBatchError as exc:
        if reached < bound:
            return out, f"{seg.path}: corrupt batch after offset {reached}, below the vouched HW {bound}: {exc}"
    return out, None


class _Committed:
    """The committed log assembled from every copy of it: batch base -> (next, epoch, raw, source)."""

    def __init__(self):
        self.batches: dict[int, tuple[int, int, bytes, str]] = {}
        self.breaches: list[Breach] = []

    def add(self, base: int, nxt: int, epoch: int, raw: bytes, source: str, compare: bool = True) -> None:
        have = self.batches.get(base)
        if have is None:
            self.batches[base] = (nxt, epoch, raw, source)
        elif compare and have[2] != raw:
            self.breaches.append(Breach(
                "diverging_prefix", f"two copies of the committed batch at offset {base} differ "
                f"(epoch {have[1]} vs {epoch})", [f"{have[3]}: {len(have[2])} bytes", f"{source}: {len(raw)} bytes"]))

    def check_splits(self) -> None:
        prev = None
        for base in sorted(self.batches):
            nxt, epoch, _raw, source = self.batches[base]
            if prev is not None and base < prev[1]:
                self.breaches.append(Breach(
                    "diverging_prefix", f"committed batches overlap: {prev[0]}..{prev[1]} ({prev[2]}) and "
                    f"{base}..{nxt} ({source})", []))
            prev = (base, nxt, source)

    def records(self) -> tuple[dict[int, tuple[bytes, int, str]], set[int]]:
        """offset -> (value, epoch, source) of data records, and the offsets of
        control records and of records the quorum writes itself (written_by_quorum)."""
        out: dict[int, tuple[bytes, int, str]] = {}
        control: set[int] = set()
        for base, (nxt, epoch, raw, source) in self.batches.items():
            h = B.decode_header(raw, 0)
            if h.is_control:
                control.update(range(base, nxt))
                continue
            for i, value in enumerate(B.decode_records(raw, h)):
                if written_by_quorum(value):
                    control.add(base + i)
                else:
                    out[base + i] = (value, epoch, source)
        return out, control


_METADATA_VERSION_PREFIX = MR.encode_record(MR.FeatureLevel(MR.METADATA_VERSION, 1))[:-3]


def written_by_quorum(value: bytes) -> bool:
    """A record no client wrote: the metadata.version FeatureLevelRecord the
    controller puts before the first metadata record of a log, as Kafka's log
    holds one. The drill never writes one; like a control record it is not a
    write to account for."""
    if not value.startswith(_METADATA_VERSION_PREFIX):
        return False
    try:
        rec = MR.decode_record(value)
    except MR.MetadataRecordError:
        return False
    return type(rec) is MR.FeatureLevel and rec.name == MR.METADATA_VERSION


def check_consumer_gaps(history: History, control: set[int], known: set[int]) -> tuple[list[Breach], int]:
    """Every offset a consumer passed between two records it returned is a control record or
    inside a recorded reset (from its position to the leader's log start)."""
    resets = defaultdict(list)
    for r in history.resets:
        resets[r.consumer].append(r)
    by_consumer = defaultdict(list)
    for s in history.seen:
        by_consumer[s.consumer].append(s)
    unexplained = []
    explained = 0
    for cid, seen in by_consumer.items():
        expected, prev_ts = 0, float("-inf")
        for s in seen:
            if s.offset > expected:
                window = [r for r in resets[cid] if prev_ts <= r.ts <= s.ts]
                missing = []
                for off in range(expected, s.offset):
                    if off in control:
                        continue
                    if any(r.from_offset is not None and r.from_offset <= off < r.to_offset for r in window):
                        explained += 1
                        continue
                    missing.append(off)
                if missing:
                    what = "data" if all(o in known for o in missing) else "data or unknown"
                    unexplained.append(f"consumer {cid} skipped {len(missing)} {what} offset(s) "
                                       f"{missing[0]}..{missing[-1]} between offset {expected - 1} and {s.offset} "
                                       f"(resets in between: {[(r.from_offset, r.to_offset) for r in window]})")
            expected = s.offset + 1
            prev_ts = s.ts
    out = []
    if unexplained:
        out.append(Breach("consumer_skipped", f"{len(unexplained)} time(s) a consumer passed over data records "
                          "without returning them and without a reset", unexplained))
    return out, explained


def check(history: History, replicas: list[ReplicaLog], commit_end: int, archive: list = ()) -> CheckResult:
    breaches: list[Breach] = []
    breaches += check_leaders(history.roles)
    breaches += check_hw(history.hw)
    breaches += check_prefixes(replicas, commit_end)

    # The committed log as far as any copy shows it: final logs (compared pairwise by check_prefixes),
    # then the archived segments, each against every other copy.
    log = _Committed()
    for r in replicas:
        for base, nxt, epoch, raw in r.batches:
            if nxt <= commit_end:  # check_prefixes already compared the final logs above their log starts
                log.add(base, nxt, epoch, raw, f"node {r.node} final log", compare=base < r.log_start)
    corrupt = []
    for seg in archive:
        got, problem = read_archived(seg, commit_end)
        if problem:
            corrupt.append(problem)
        for base, nxt, epoch, raw in got:
            log.add(base, nxt, epoch, raw, f"archive {seg.path}")
    if corrupt:
        breaches.append(Breach("corrupt_committed", f"{len(corrupt)} archived segment(s) damaged below the HW "
                               "their broker reported", corrupt))
    log.check_splits()
    breaches += log.breaches
    recs, control = log.records()
    committed: dict[int, tuple[bytes, int]] = {off: (v, e) for off, (v, e, _src) in recs.items()}
    n_from_logs = sum(1 for off, (_v, _e, src) in recs.items() if src.endswith("final log"))
    n_from_archive = len(recs) - n_from_logs

    # Consumers: every record seen must match, unless the consumer was told of a truncation after it.
    told = defaultdict(list)
    for t in history.truncations:
        told[t.consumer].append(t)
    unexplained = []
    only_consumers = 0
    for s in history.seen:
        final = committed.get(s.offset)
        if final is None:
            if s.offset < commit_end and s.offset not in control:
                committed[s.offset] = (s.value, s.epoch)  # no copy of the log holds it any more
                only_consumers += 1
            continue
        if final[0] != s.value:
            excused = any(t.ts >= s.ts and t.offset <= s.offset for t in told[s.consumer])
            if not excused:
                unexplained.append(f"consumer {s.consumer} saw {s.value!r} at offset {s.offset} epoch {s.epoch}, "
                                   f"final log has {final[0]!r} epoch {final[1]}")
    if unexplained:
        breaches.append(Breach("silent_truncation", f"{len(unexplained)} consumed record(s) were later replaced "
                               "and the consumer was never told", unexplained))
    gap_breaches, skipped_by_reset = check_consumer_gaps(history, control, set(recs) | control)
    breaches += gap_breaches

    # Acknowledged writes: present at their offset, exactly once.
    counts = Counter(v for v, _e in committed.values())
    lost, moved, dup, unverifiable = [], [], [], []
    acked_values = set()
    for a in history.acks:
        acked_values.add(a.value)
        rec = committed.get(a.offset)
        if rec is None:
            if a.offset >= commit_end:
                lost.append(f"{a.value!r} acked at offset {a.offset} epoch {a.epoch}, committed log ends at {commit_end}")
            else:
                unverifiable.append(f"{a.value!r} at offset {a.offset}")
        elif rec[0] != a.value:
            where = [o for o, (v, _e) in committed.items() if v == a.value]
            (moved if where else lost).append(
                f"{a.value!r} acked at offset {a.offset} epoch {a.epoch}; that offset holds {rec[0]!r} epoch {rec[1]}"
                + (f"; value found at {where}" if where else ""))
        if counts[a.value] > 1:
            dup.append(f"{a.value!r} acked at {a.offset} appears {counts[a.value]} times at "
                       f"{sorted(o for o, (v, _e) in committed.items() if v == a.value)}")
    for v, n in counts.items():
        if n > 1 and v not in acked_values and v in history.attempted:
            dup.append(f"unacknowledged {v!r} appears {n} times")
    if lost:
        breaches.append(Breach("lost_write", f"{len(lost)} acknowledged write(s) lost", lost))
    if moved:
        breaches.append(Breach("moved_write", f"{len(moved)} acknowledged write(s) not at their acknowledged offset", moved))
    if dup:
        breaches.append(Breach("duplicated_write", f"{len(dup)} write(s) present more than once", dup))
    if unverifiable:
        breaches.append(Breach("unverifiable", f"{len(unverifiable)} acknowledged write(s) are below every replica's "
                               "log start, in no archived segment and no consumer read them", unverifiable))
    covered = set(committed) | control
    stats = {"acked": len(history.acks), "attempted": len(history.attempted),
             "committed_end": commit_end, "verified_offsets": len(committed),
             "verified_from_final_logs": n_from_logs, "verified_from_archive": n_from_archive,
             "verified_from_consumers_only": only_consumers, "control_offsets": len(control),
             "committed_offsets_uncovered": sum(1 for o in range(commit_end) if o not in covered),
             "unverifiable": len(unverifiable),
             "archived_segments": len(archive), "consumed": len(history.seen),
             "truncations_told": len(history.truncations), "consumer_resets": len(history.resets),
             "offsets_skipped_by_reset": skipped_by_reset,
             "epochs": len({r.epoch for r in history.roles}),
             "replicas": len(replicas)}
    from_copies = {off: v for off, (v, _e, _src) in recs.items()}
    return CheckResult(breaches, stats, log=from_copies, control=control)
