"""Safety invariants checked after every simulated event, and the final check.

After every event (the reference's RaftEventSimulationTest list, plus ours):

* SingleLeader: at most one node is ever leader of a given epoch.
* MonotonicEpoch: a node's epoch never goes down (across restarts too: the
  quorum state is durable; only a node wiped whole starts over).
* MonotonicHighWatermark: a node's HW never goes down within one incarnation
  (the HW is not persisted), and the HW of the newest leader, once it has
  committed its own epoch's first record, never goes down cluster-wide.
* MajorityReachedHighWatermark: the record below a leader's HW is durable
  (flushed, same epoch at that offset) on a majority of voters -- so a leader
  that counted unflushed data (KAFKA-10533) is caught at the next crash.
* NoAcknowledgedAppendLost: every acknowledged record sits at its offset, with
  its value and epoch, in every node's log below that node's HW.
* NoTruncationBelowHighWatermark: TruncateLog never cuts under the node's HW.
* SnapshotAtLogStart: a log that starts past 0 has a snapshot ending there.
* QuarantinedVoterVotesByItsOldLog (issue 12, checked by the driver as it
  executes the actions): a voter whose quarantine state is on disk never sends
  a VoteRequest that could win (a probe claiming an empty log is allowed),
  grants a vote or pre-vote only to a log at least as up to date as the one it
  had up to its mark, and clears the state only once its flushed log end
  reached the mark (the disk's must_reach_offset, or, for a leader that had
  committed in its epoch, its high watermark then). For
  MajorityReachedHighWatermark a quarantined voter still counts as holding
  what it lost below its mark: it votes as if it held it, which is what makes
  the lost copy harmless (docs/integrity.md, "How a quarantined voter votes").
* The core's view of its log (start, end) matches the disk the driver wrote.

Fetched-batch corruption (a bit flipped on the wire, sim/network.py), checked
by ``FetchedCorruptionChecker`` as the driver executes the actions:

* CorruptBatchNeverAppended: every AppendBatches is whole batches with sound
  headers and CRCs (so nothing damaged is ever applied: a node applies only
  what it appended and committed).
* FetchedCorruptionOnlyFromTheWire: a FetchedBatchCorrupt names a batch whose
  bits the wire flipped on its way to that node (the leader's disk is sound).
* RefusedBatchNeverAcknowledged: a Fetch acknowledges (by its fetch offset)
  only records its sender holds, and never past a batch it refused, until a
  sound copy of that batch (or a snapshot past it) replaced it.
* FetchedCorruptionConverges (at the end): each node that refused a batch
  holds that offset with the committed record, unless a later leader's log
  ended before it (the uncommitted tail it was part of was truncated).

At the end, ``check_final``: ConsistentCommittedData (all nodes agree on every
offset below their HW, snapshots included), every acknowledged record is
committed, and every node has caught up to the leader's HW.
"""

from __future__ import annotations

import bisect
import collections
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from metalog.broker.quorum.api import SnapshotInstallFailed
from metalog.protocol import messages as m
from metalog.sim.disk import split_batches
from metalog.storage.batch import batches_sound, decode_records

if TYPE_CHECKING:
    from metalog.broker.quorum.api import FetchedBatchCorrupt
    from metalog.sim.cluster import ClientAck, SimCluster, SimNode
    from metalog.sim.network import WireFlip

FLIPS_REMEMBERED_MAX = 64  # per node: flipped answers in flight to it that it may still refuse


class Violation(AssertionError):
    def __init__(self, message: str, seed: int | None = None, reason: str = ""):
        super().__init__(message)
        self.seed = seed
        self.reason = reason


def is_leader(core: Any) -> bool:
    r = core.role
    return str(getattr(r, "name", getattr(r, "value", r))).lower() == "leader"


def epoch_entries(core: Any) -> list[tuple[int, int]]:
    epochs = core.epochs
    entries = getattr(epochs, "entries", epochs) or ()  # an EpochHistory or a list of pairs
    return [(int(e[0]), int(e[1])) for e in entries]


@dataclass
class Refusal:
    """A node refused a fetched batch (FetchedBatchCorrupt) and has not yet
    replaced it with a sound copy."""

    node_id: int
    base_offset: int
    at_ms: int
    refetched: bool = False  # a later Fetch asked for that very offset


class FetchedCorruptionChecker:
    """The invariants of fetched-batch corruption (module docstring), fed by
    the driver: the flips the wire made, the refusals the cores reported, the
    appends, Fetches and snapshot installs the driver executed."""

    def __init__(self, cluster: "SimCluster"):
        self.cluster = cluster
        self.flips: dict[int, collections.deque[WireFlip]] = {}  # node -> flips sent its way
        self.pending: dict[int, list[Refusal]] = {}  # node -> refusals not yet replaced
        # Every one, for the final check and the counts: at most one per flip.
        self.refusals: list[Refusal] = []
        self.flip_count = 0
        self.resolved_count = 0

    def on_flip(self, dst: int, flip: "WireFlip") -> None:
        self.flip_count += 1
        self.flips.setdefault(dst, collections.deque(maxlen=FLIPS_REMEMBERED_MAX)).append(flip)

    def on_fetched_corrupt(self, n: "SimNode", a: "FetchedBatchCorrupt") -> None:
        """FetchedCorruptionOnlyFromTheWire, then remember the refusal."""
        flipped = [f for f in self.flips.get(n.node_id, ()) if f.base_offset == a.base_offset]
        if not flipped:
            self.cluster.fail(f"n{n.node_id} refused a fetched batch at {a.base_offset} (epoch {a.fetch_epoch}: "
                              f"{a.reason}) that the wire never damaged: the leader served bad bytes")
        if a.base_offset is None or n.disk.log_end_offset > a.base_offset:
            self.cluster.fail(f"n{n.node_id} refused the batch at {a.base_offset} but its log ends at "
                              f"{n.disk.log_end_offset}, past it")
        r = Refusal(n.node_id, a.base_offset, self.cluster.now_ms)
        self.refusals.append(r)
        self.pending.setdefault(n.node_id, []).append(r)

    def on_append(self, n: "SimNode", data: bytes, base_offset: int, next_offset: int) -> None:
        """CorruptBatchNeverAppended; a sound batch over a refused offset resolves it."""
        if not batches_sound(data):
            self.cluster.fail(f"n{n.node_id} appended a damaged batch at {base_offset}..{next_offset} "
                              f"(a header or CRC check fails)")
        self._resolve(n, lambda b: base_offset <= b < next_offset)

    def on_log_replaced(self, n: "SimNode") -> None:
        """A snapshot install moved the log past some refused offsets: resolved."""
        end_offset = n.disk.log_end_offset
        self._resolve(n, lambda b: b < end_offset)

    def _resolve(self, n: "SimNode", covers: Callable[[int], bool]) -> None:
        pending = self.pending.get(n.node_id)
        if not pending:
            return
        keep = [r for r in pending if not covers(r.base_offset)]
        self.resolved_count += len(pending) - len(keep)
        self.pending[n.node_id] = keep

    def on_send(self, n: "SimNode", request: m.Body) -> None:
        """RefusedBatchNeverAcknowledged, on every Fetch a node sends."""
        if not isinstance(request, m.FetchRequest):
            return
        offset = request.fetch_offset
        if offset in self._failing_installs(n):
            # The core asks past the snapshot whose install fails in this very
            # step (it learns so from SnapshotInstallFailed, fed next, and rolls
            # back): the claim names a snapshot, which holds only records
            # committed before it was written, so it moves no high watermark.
            return
        if offset > n.disk.log_end_offset:
            self.cluster.fail(f"n{n.node_id} fetches at {offset}, acknowledging records past its log end "
                              f"{n.disk.log_end_offset}")
        for r in self.pending.get(n.node_id, ()):
            if offset > r.base_offset:
                self.cluster.fail(f"n{n.node_id} fetches at {offset}, acknowledging the batch at "
                                  f"{r.base_offset} it refused as corrupt at t={r.at_ms}")
            r.refetched |= offset == r.base_offset

    @staticmethod
    def _failing_installs(n: "SimNode") -> set[int]:
        return {e.snapshot_id.end_offset for e in n.follow_up if isinstance(e, SnapshotInstallFailed)}

    def check_final(self, leader: "SimNode") -> None:
        """FetchedCorruptionConverges: each refused offset the cluster committed
        is held by the node that refused it, as the leader holds it."""
        hw = leader.core.high_watermark
        for r in self.refusals:
            if r.base_offset >= hw:
                continue  # that tail was never committed: a later leader's log replaced it
            n = self.cluster.nodes[r.node_id]
            mine, theirs = n.disk.any_record_at(r.base_offset), leader.disk.any_record_at(r.base_offset)
            if mine is None or mine != theirs:
                self.cluster.fail(f"FetchedCorruptionConverges: n{r.node_id} refused the batch at {r.base_offset} "
                                  f"at t={r.at_ms} and now holds {mine} there, the leader {theirs}")


class InvariantChecker:
    def __init__(self, cluster: "SimCluster"):
        self.cluster = cluster
        self.leaders_by_epoch: dict[int, int] = {}
        self.epoch_floor: dict[int, int] = {}
        self.hw_floor: dict[int, int] = {}
        self.leader_hw_floor = (-1, 0)  # (epoch, hw) of the newest committed leader seen
        self.acked_offsets: list[int] = []
        self.checked: dict[int, tuple[int, int]] = {}  # node -> (disk version, offsets verified below)
        self.checked_changes: dict[int, tuple[int, int, int]] = {}  # node -> its latest voter change checked
        self.wire = FetchedCorruptionChecker(cluster)

    def fail(self, reason: str) -> None:
        self.cluster.fail(reason)

    # ------------------------------------------------------------- helpers
    def epoch_start(self, n: "SimNode", epoch: int) -> int:
        for e, start in epoch_entries(n.core):
            if e == epoch:
                return start
        return 1 << 62  # the epoch has no record yet: nothing of it is committed

    def majority(self) -> int:
        return len(self.cluster.config.voters) // 2 + 1

    def holds_durably(self, v: "SimNode", offset: int, epoch: int, count_quarantine: bool = True) -> bool:
        d = v.disk
        # A quarantined voter votes as if it held what it lost below its mark
        # until it re-replicated it; with a voter set in the log (KIP-853) so
        # does any node (it may become a voter).
        if (count_quarantine and (v.is_voter or self.cluster.config.dynamic)
                and d.log_start_offset <= offset < v.quarantine_mark()):
            return d.epoch_before(offset + 1) == epoch
        if offset < d.log_start_offset:
            return any(s.end_offset > offset for s in d.snapshots)
        if offset >= d.flushed_end_offset:
            return False
        return d.epoch_at(offset) == epoch

    # ------------------------------------------------------------- hooks
    def on_boot(self, n: "SimNode") -> None:
        self.hw_floor.pop(n.node_id, None)
        self.checked.pop(n.node_id, None)

    def on_crash(self, n: "SimNode", wiped: str | None) -> None:
        if wiped == "all":
            self.epoch_floor.pop(n.node_id, None)
        # Data lost in the crash must not be data some leader counted as committed.
        for other in self.cluster.nodes.values():
            if other.alive and is_leader(other.core):
                self.check_majority(other)

    def on_quarantine(self, n: "SimNode") -> None:
        """Corruption cut the node's log below what it knew as committed: its
        own HW restarts from what it still holds (a new 'incarnation' of its
        log); everything else keeps being checked."""
        self.hw_floor.pop(n.node_id, None)
        self.checked.pop(n.node_id, None)

    def on_truncate(self, n: "SimNode", end_offset: int) -> None:
        hw = self.hw_floor.get(n.node_id, 0)
        if end_offset < hw:
            self.fail(f"n{n.node_id} truncates its log to {end_offset}, below its high watermark {hw}")

    def on_ack(self, ack: "ClientAck") -> None:
        acks = self.cluster.acks
        prev = acks.get(ack.offset)
        if prev is not None and (prev.value, prev.epoch) != (ack.value, ack.epoch):
            self.fail(f"offset {ack.offset} acknowledged twice: {prev} then {ack}")
        if prev is None:
            acks[ack.offset] = ack
            bisect.insort(self.acked_offsets, ack.offset)
        for n in self.cluster.nodes.values():
            if n.alive and n.core.high_watermark is not None:
                self._check_ack_on(n, ack)

    def _check_ack_on(self, n: "SimNode", ack: "ClientAck") -> None:
        if not (n.disk.log_start_offset <= ack.offset < n.core.high_watermark):
            return
        got = n.disk.record_at(ack.offset)
        if got != (ack.epoch, ack.value):
            self.fail(f"acknowledged record lost: offset {ack.offset} was acked as epoch {ack.epoch} "
                      f"value {ack.value!r}, n{n.node_id} holds {got} below its HW {n.core.high_watermark}")

    # ------------------------------------------------------------- after every step
    def after_step(self, n: "SimNode") -> None:
        core = n.core
        nid = n.node_id
        epoch = core.epoch
        if epoch < self.epoch_floor.get(nid, -1):
            self.fail(f"n{nid} epoch went down from {self.epoch_floor[nid]} to {epoch}")
        self.epoch_floor[nid] = epoch
        leader = is_leader(core)
        if leader:
            prev = self.leaders_by_epoch.get(epoch)
            if prev is None:
                self.leaders_by_epoch[epoch] = nid
                # (A leader may stop being a voter later: KIP-853 removes it
                # and it leads until that commits.)
                if not core.is_voter:
                    self.fail(f"observer n{nid} became leader of epoch {epoch}")
            elif prev != nid:
                self.fail(f"two leaders in epoch {epoch}: n{prev} and n{nid}")
            self._check_voter_changes(n)
        hw = core.high_watermark
        if hw is None or hw < 0:
            hw = 0
        floor = self.hw_floor.get(nid, 0)
        if hw < floor:
            self.fail(f"n{nid} high watermark went down from {floor} to {hw}")
        self.hw_floor[nid] = hw
        d = n.disk
        if core.log_end_offset != d.log_end_offset:
            self.fail(f"n{nid} core thinks its log ends at {core.log_end_offset}, the disk ends at {d.log_end_offset}")
        if core.log_start_offset != d.log_start_offset:
            self.fail(f"n{nid} core thinks its log starts at {core.log_start_offset}, "
                      f"the disk starts at {d.log_start_offset}")
        if hw > d.log_end_offset:
            self.fail(f"n{nid} high watermark {hw} is past its log end {d.log_end_offset}")
        if d.log_start_offset > 0 and not any(s.end_offset == d.log_start_offset for s in d.snapshots):
            self.fail(f"n{nid} log starts at {d.log_start_offset} with no snapshot ending there "
                      f"(snapshots {sorted(d.snapshots)})")
        if leader:
            self.check_majority(n)
            if hw > self.epoch_start(n, epoch):
                last_epoch, last_hw = self.leader_hw_floor
                if epoch >= last_epoch:
                    if hw < last_hw:
                        self.fail(f"leader n{nid} of epoch {epoch} has HW {hw}, below {last_hw} "
                                  f"reached by the leader of epoch {last_epoch}")
                    self.leader_hw_floor = (epoch, hw)
        self._check_acks_below_hw(n, hw)

    def _check_voter_changes(self, n: "SimNode") -> None:
        """NoDisjointMajorities (KIP-853): each VotersRecord a leader appends
        differs from the set before it by at most one voter (node id and
        directory id), and the one before it was committed first."""
        core = n.core
        entries = core.log.voters.entries
        if not entries:
            return
        offset, vs = entries[-1]
        key = (n.node_id, n.incarnation, offset)
        if self.checked_changes.get(n.node_id) == key or n.disk.epoch_at(offset) != core.epoch:
            return
        self.checked_changes[n.node_id] = key
        before = core.log.voters.at(offset)
        if before.unknown:
            return
        if before.kraft_version == 0:
            # The online upgrade (kraft.version 0 -> 1): the same voters, now
            # named with their directory ids.
            if before.ids != vs.ids:
                self.fail(f"leader n{n.node_id} upgraded to kraft version 1 at offset {offset} with voters "
                          f"{list(vs.ids)}, not the static ones {list(before.ids)}")
            return
        changed = set(before.directory_ids.items()) ^ set(vs.directory_ids.items())
        if len({vid for vid, _ in changed}) > 1 or len(changed) > 2:
            self.fail(f"leader n{n.node_id} changed the voters from {dict(before.directory_ids)} to "
                      f"{dict(vs.directory_ids)} at offset {offset}: more than one voter at once")
        older = [o for o, _ in entries[:-1]]
        if older and older[-1] >= core.high_watermark:
            self.fail(f"leader n{n.node_id} appended a voter change at {offset} while the one at {older[-1]} "
                      f"was not committed (HW {core.high_watermark})")

    def check_majority(self, n: "SimNode") -> None:
        hw = n.core.high_watermark or 0
        if hw <= 0:
            return
        offset = hw - 1
        if offset < n.disk.log_start_offset:
            return  # covered by the snapshot the log starts at
        epoch = n.disk.epoch_at(offset)
        if epoch is None:
            self.fail(f"leader n{n.node_id} has HW {hw} but no record at {offset}")
        # The leader's voter set (static: the config's); across a change (KIP-853)
        # the set in effect below the HW will do as well: a majority of either
        # overlaps every majority of both.
        nodes = self.cluster.nodes.values()
        best: list[int] = []
        for vs in (n.core.voter_set, n.core.voter_set_at(hw)):
            # A voter whose disk was replaced (KIP-853) counts as holding: that
            # replica is gone and never votes again (WipedNodeNeverVotes, checked
            # by the driver), so no election quorum can include it -- as a
            # quarantined voter counts, knowing what it lost.
            holders = [v.node_id for v in nodes
                       if v.node_id in vs.directory_ids
                       and (self.holds_durably(v, offset, epoch) if vs.is_voter(v.node_id, v.disk.directory_id)
                            else vs.kraft_version == 1)]
            if vs.is_majority(holders):
                return
            best = best or holders
        self.fail(f"leader n{n.node_id} (epoch {n.core.epoch}) has HW {hw} but only voters {best} "
                  f"hold offset {offset} (epoch {epoch}) durably; a majority of {n.core.voters} is "
                  f"{len(n.core.voters) // 2 + 1}")

    def _check_acks_below_hw(self, n: "SimNode", hw: int) -> None:
        version, verified_end_offset = self.checked.get(n.node_id, (-1, 0))
        if version != n.disk.version:
            verified_end_offset = 0
        lo_offset = max(verified_end_offset, n.disk.log_start_offset)
        if hw > lo_offset and self.acked_offsets:
            acks = self.cluster.acks
            i = bisect.bisect_left(self.acked_offsets, lo_offset)
            while i < len(self.acked_offsets) and self.acked_offsets[i] < hw:
                self._check_ack_on(n, acks[self.acked_offsets[i]])
                i += 1
        self.checked[n.node_id] = (n.disk.version, max(verified_end_offset, hw))


def committed_records(n: "SimNode") -> dict[int, tuple[int, bytes]]:
    """offset -> (epoch, value) for every offset below the node's HW, snapshot included."""
    hw = n.core.high_watermark or 0
    d = n.disk
    out: dict[int, tuple[int, bytes]] = {}
    if d.log_start_offset > 0:
        sid = max(s for s in d.snapshots if s.end_offset == d.log_start_offset)
        for b in split_batches(d.snapshots[sid]):
            for i, v in enumerate(decode_records(b.data)):
                if b.base_offset + i < hw:
                    out[b.base_offset + i] = (b.epoch, v)
    for b in d.batches:
        if b.base_offset >= hw:
            break
        for i, v in enumerate(decode_records(b.data)):
            o = b.base_offset + i
            if d.log_start_offset <= o < hw:
                out[o] = (b.epoch, v)
    return out


def check_final(cluster: "SimCluster") -> None:
    """ConsistentCommittedData + everything acknowledged committed + all caught up."""
    leader = cluster.current_leader()
    if leader is None:
        cluster.fail("no leader after healing and settling")
    for n in cluster.nodes.values():
        if not n.alive:
            cluster.fail(f"n{n.node_id} is not running at the end")
    ref = committed_records(leader)
    ref_hw = leader.core.high_watermark
    for o in range(ref_hw):
        if o not in ref:
            cluster.fail(f"leader n{leader.node_id} has no record at committed offset {o}")
    for n in cluster.nodes.values():
        if n is leader:
            continue
        mine = committed_records(n)
        for o, rec in mine.items():
            theirs = ref.get(o)
            if theirs is not None and theirs != rec:
                cluster.fail(f"ConsistentCommittedData: offset {o} is {rec} on n{n.node_id} "
                             f"but {theirs} on leader n{leader.node_id}")
            if theirs is None and o < ref_hw:
                cluster.fail(f"n{n.node_id} has committed offset {o} the leader lacks")
        if n.core.high_watermark != ref_hw:
            cluster.fail(f"n{n.node_id} has not caught up: HW {n.core.high_watermark}, leader HW {ref_hw}")
    for o, ack in cluster.acks.items():
        if ref.get(o) != (ack.epoch, ack.value):
            cluster.fail(f"acknowledged record at {o} ({ack.value!r}, epoch {ack.epoch}) is "
                         f"{ref.get(o)} in the leader's committed log")
    cluster.checker.wire.check_final(leader)
