"""The drill's safety checker: did the cluster keep every promise it made?

Input is a ``History`` the drill recorded (acknowledged writes, what each
consumer saw and when it was told of truncation, role changes and HW samples
per broker incarnation) plus each broker's log read back from its data dir
(``read_replica``) after the cluster stopped. ``check(history, replicas,
commit_end)`` returns a ``CheckResult``; every breach carries the evidence:

* every acknowledged write is present exactly once, at its acknowledged
  offset (looked up in the committed range of the replicas' logs, then in what
  consumers read, since a snapshot may have removed the log prefix);
* the committed prefixes of all replicas are identical byte for byte (batch
  by batch, over the offsets every pair of replicas both still hold);
* at most one leader per epoch (from the ``role_changed`` log lines);
* the HW never decreased within one broker process (incarnation);
* no consumer saw a record that is not in the final committed log at that
  offset, unless it was told (``LogTruncationError``) before moving on.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from storage import batch as B

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
class RoleEvent:
    node: int
    ts: float
    role: str
    epoch: int
    leader_id: int | None
    source: str = "log"  # the broker.log line number or "admin"


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
    from storage.log import SegmentedLog

    part = os.path.join(data_dir, PARTITION_DIR)
    if not os.path.isdir(part):
        return ReplicaLog(node, 0, 0, [])
    log = SegmentedLog.open(part)
    try:
        batches = []
        for info in log.iter_batch_headers():
            raw = log.read(max(info.base_offset, log.log_start_offset), info.next_offset, 1 << 30)
            assert raw, f"node {node}: batch at {info.base_offset} read back empty"
            batches.append((info.base_offset, info.next_offset, info.leader_epoch, bytes(raw[:info.size])))
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


def check(history: History, replicas: list[ReplicaLog], commit_end: int) -> CheckResult:
    breaches: list[Breach] = []
    breaches += check_leaders(history.roles)
    breaches += check_hw(history.hw)
    breaches += check_prefixes(replicas, commit_end)

    # The committed log as far as anyone can show it: replicas first, then consumers.
    committed: dict[int, tuple[bytes, int]] = {}
    for r in replicas:
        for off, rec in r.records(commit_end).items():
            committed.setdefault(off, rec)

    # Consumers: every record seen must match, unless the consumer was told of a truncation after it.
    told = defaultdict(list)
    for t in history.truncations:
        told[t.consumer].append(t)
    unexplained = []
    for s in history.seen:
        final = committed.get(s.offset)
        if final is None:
            committed[s.offset] = (s.value, s.epoch)  # a snapshot removed it from every log
            continue
        if final[0] != s.value:
            excused = any(t.ts >= s.ts and t.offset <= s.offset for t in told[s.consumer])
            if not excused:
                unexplained.append(f"consumer {s.consumer} saw {s.value!r} at offset {s.offset} epoch {s.epoch}, "
                                   f"final log has {final[0]!r} epoch {final[1]}")
    if unexplained:
        breaches.append(Breach("silent_truncation", f"{len(unexplained)} consumed record(s) were later replaced "
                               "and the consumer was never told", unexplained))

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
                               "log start and no consumer read them (raise segment_bytes_max or keep a consumer "
                               "tailing from the start)", unverifiable))
    stats = {"acked": len(history.acks), "attempted": len(history.attempted),
             "committed_end": commit_end, "verified_offsets": len(committed),
             "consumed": len(history.seen), "truncations_told": len(history.truncations),
             "epochs": len({r.epoch for r in history.roles}),
             "replicas": len(replicas)}
    return CheckResult(breaches, stats)
