"""One randomized simulation run: mixed faults + client load, then heal, settle, check.

Everything is drawn from the seed, so ``run_seed(n)`` is a pure function of n
(and of the code): a failing seed replays exactly with ``SIM_SEED=n``.

Faults (one every 1-4 s of simulated time during the fault phase, overlapping
freely): crash a node (unflushed data may be lost; 3 in 4 crashes are a
process kill whose connections the host resets, 1 in 4 the loss of the host,
silent) and restart it later,
crash the leader, kill all nodes, kill-and-wipe, pause a node (a zombie: it
resumes later with stale state and a backlog), pause the leader, isolate a
node or the leader, cut one direction between two nodes, a burst of packet
loss, corruption of a node's disk (while it is down, or found by the scrubber
of a running node).

Besides these, two kinds run from streams of their own, so that a seed
without them replays exactly as it did before they existed: voter changes
(KIP-853) in half the seeds, and wire corruption in half the seeds (a bit
flipped in a fetch answer's batches on its way to a follower, by a chance
per answer drawn for the seed; see sim/network.py). SIM_MEMBERSHIP=0 and
SIM_WIRE_FLIPS=0 turn them off.

Kill-and-wipe and Raft: a voter that loses its log AND its vote could vote
twice in one epoch and elect a leader without committed data -- unsafe by
design, not a bug to find. So a wiped OBSERVER loses everything (it never
votes), while a wiped VOTER loses its log but keeps its quorum state, and only
when the other voters durably hold everything committed and are a majority on
their own (otherwise the fault degrades to a plain crash). An empty log never
wins a vote against a voter holding the committed data, so safety holds.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

from metalog.protocol import messages as m
from metalog.sim.cluster import SimCluster, SimConfig, SimNode, role_name, sim_endpoints
from metalog.sim.invariants import check_final
from metalog.sim.network import NetworkConfig

SILENT_CRASH_PROBABILITY = 0.25
# KIP-853: the share of seeds that run a dynamic cluster (voter set in the log)
# with voter changes mixed into the faults. Drawn from a stream of its own, so
# the other seeds replay exactly as before (SIM_MEMBERSHIP=0: none).
MEMBERSHIP_SEED_SHARE = 0.5
STATIC_START_SHARE = 0.25
# The share of seeds whose fetch answers may arrive with a bit flipped, and
# the chances per answer a seed draws from (one stream of their own).
WIRE_FLIP_SEED_SHARE = 0.5
WIRE_FLIP_PROBABILITIES = (0.02, 0.05, 0.1)
WIRE_SALT = 0xF11C
AUTO_JOIN_SHARE = 0.33
MEMBERSHIP_WEIGHTS = (("add_voter", 3), ("remove_voter", 2), ("remove_leader", 1), ("replace_voter", 2))
FAULT_WEIGHTS = (
    ("crash", 3), ("crash_leader", 4), ("kill_all", 1), ("wipe", 1), ("pause", 2),
    ("pause_leader", 2), ("isolate", 2), ("isolate_leader", 2), ("cut", 2), ("drop_burst", 1),
    ("corrupt", 2), ("corrupt_live", 1),
)


@dataclass
class RunResult:
    seed: int
    trace_hash: str
    events: int
    acked_records: int
    final_hw: int
    failover_samples: list[tuple[int, bool, bool]] = field(default_factory=list)  # (ms, clean?, silent?)
    # One per watched isolation of a follower (see RandomRun._watch_rejoin):
    # (epochs bumped in the window, healed within it?, lossless network?)
    rejoin_samples: list[tuple[int, bool, bool]] = field(default_factory=list)
    faults: dict[str, int] = field(default_factory=dict)  # kind -> how many were injected
    drawn: dict[str, int] = field(default_factory=dict)  # kind -> how many times the dice chose it


def config_for_seed(rng_seed: int, snapshots: bool) -> SimConfig:
    r = random.Random(rng_seed ^ 0x5EED)
    net = NetworkConfig(delay_ms=r.randint(1, 5), jitter_ms=r.randint(0, 20),
                        drop_probability=r.choice([0.0, 0.0, 0.005, 0.02]))
    return SimConfig(network=net, snapshot_interval_ms=2500 if snapshots else 0, snapshot_min_records=40,
                     snapshot_install_fail_probability=r.choice([0.0, 0.0, 0.2]),
                     spin_is_violation=os.environ.get("SIM_ALLOW_SPIN", "0") != "1")


class RandomRun:
    def __init__(self, seed: int, duration_ms: int, settle_ms: int, snapshots: bool, kafka_wire: bool = False):
        self.seed = seed
        # Voter changes draw from their own stream (never from the fault,
        # client or network ones): seeds without them replay as they did.
        self.rng_members = random.Random((seed << 16) ^ 0x853)
        self.membership = (os.environ.get("SIM_MEMBERSHIP", "1") != "0"
                           and self.rng_members.random() < MEMBERSHIP_SEED_SHARE)
        config = config_for_seed(seed, snapshots)
        config.dynamic = self.membership
        config.kafka_wire = kafka_wire
        self.wire_flip_probability = wire_flip_probability(seed)
        config.network.fetch_flip_probability = self.wire_flip_probability
        if self.membership:
            # A quarter start as static voters and upgrade online (kraft.version
            # 0 -> 1, UpdateFeatures); a third run with auto-join (KIP-1186) on.
            config.static_start = self.rng_members.random() < STATIC_START_SHARE
            if self.rng_members.random() < AUTO_JOIN_SHARE:
                config.quorum = {**config.quorum, "auto_join_enable": True}
        self.cluster = SimCluster(seed, config)
        self.duration_ms = duration_ms
        self.settle_ms = settle_ms
        self.rng = self.cluster.rng_faults
        self.base_drop = self.cluster.config.network.drop_probability
        self.fault_counts: dict[str, int] = {}
        self.drawn_counts: dict[str, int] = {}  # fault kinds drawn, injected or not
        self.member_counts: dict[str, int] = {}  # voter changes asked for (KIP-853)
        self.faults_on = True
        self.client_on = True
        self.rejoin_watches: list[list] = []  # open RejoinNoEpochBump windows (see _watch_rejoin)
        self.rejoin_samples: list[tuple[int, bool, bool]] = []

    # ------------------------------------------------------------ workload
    def client_tick(self) -> None:
        c = self.cluster
        if not self.client_on:
            return
        r = c.rng_client
        leader = c.current_leader()
        candidates = [n for n in c.nodes.values() if n.alive and not n.paused]
        target = leader if leader is not None and r.random() < 0.85 else (r.choice(candidates) if candidates else None)
        if target is not None:
            k = c._client_seq + 1
            values = [f"s{self.seed}-a{k}-{i}".encode() for i in range(r.randint(1, c.config.records_per_append_max))]
            c.client_append(target.node_id, values)
        lo, hi = c.config.client_interval_ms
        c.schedule(c.now_ms + r.randint(lo, hi), "call", self.client_tick)

    # --------------------------------------------------------------- faults
    def fault_tick(self) -> None:
        c = self.cluster
        if not self.faults_on:
            return
        kinds = [k for k, _ in FAULT_WEIGHTS]
        weights = [w for _, w in FAULT_WEIGHTS]
        kind = self.rng.choices(kinds, weights)[0]
        self.drawn_counts[kind] = self.drawn_counts.get(kind, 0) + 1
        for w in list(self.rejoin_watches):
            self._close_rejoin(w)  # another fault strikes: judge the window as it stands
        c.note_fault()
        if getattr(self, "fault_" + kind)():
            self.fault_counts[kind] = self.fault_counts.get(kind, 0) + 1
        c.schedule(c.now_ms + self.rng.randint(1000, 4000), "call", self.fault_tick)

    def _live(self) -> list[SimNode]:
        return [n for n in self.cluster.nodes.values() if n.alive]

    def _later(self, lo_ms: int, hi_ms: int, fn) -> None:
        self.cluster.schedule(self.cluster.now_ms + self.rng.randint(lo_ms, hi_ms), "call", fn)

    def _restart(self, node_id: int):
        def go() -> None:
            if not self.cluster.nodes[node_id].alive:
                self.cluster.boot(node_id)
        return go

    def _crash(self, n: SimNode | None, wipe: str | None = None) -> bool:
        if n is None or not n.alive:
            return False
        # A quarter of the crashes lose the whole host (silent: no connection reset).
        silent = self.rng.random() < SILENT_CRASH_PROBABILITY
        self.cluster.crash(n.node_id, wipe, silent=silent)
        self._later(300, 4000, self._restart(n.node_id))
        return True

    def fault_crash(self) -> bool:
        live = self._live()
        return self._crash(self.rng.choice(live) if live else None)

    def fault_crash_leader(self) -> bool:
        return self._crash(self.cluster.current_leader())

    def fault_kill_all(self) -> bool:
        for n in self._live():
            self.cluster.crash(n.node_id)
        for n in self.cluster.nodes.values():
            self._later(200, 2000, self._restart(n.node_id))
        return True

    def fault_wipe(self) -> bool:
        c = self.cluster
        n = self.rng.choice(list(c.nodes.values()))
        if self.membership and self.cluster.config.static_start:
            # Started from static voters: a node the config names would come
            # back from a whole new disk as a static voter (the config is its
            # fallback), which is Kafka's hazard too (after the upgrade the
            # operator turns the config into bootstrap servers). Only the
            # others lose their disk; a voter's wipe is a plain crash.
            named = n.node_id in c.config.voters or n.is_voter
            return self._crash(n, wipe=None if named else "all")
        if self.membership:
            # A dynamic cluster: the disk is replaced whole (a new directory id),
            # voter or not; the new replica never votes as the old one.
            return self._crash(n, wipe="all" if self._may_lose_voter(n) else None)
        if not n.is_voter:
            return self._crash(n, wipe="all")
        return self._crash(n, wipe="log" if self._others_hold_committed(n) else None)

    def _others_hold_committed(self, n: SimNode) -> bool:
        c = self.cluster
        committed = max([o.core.high_watermark or 0 for o in c.nodes.values() if o.alive]
                        + [a + 1 for a in c.acks])
        if committed == 0:
            return True
        ref = next((o for o in c.nodes.values() if o.alive and (o.core.high_watermark or 0) >= committed
                    and o.disk.epoch_at(committed - 1) is not None), None)
        if ref is None:
            return False
        epoch = ref.disk.epoch_at(committed - 1)
        holders = [o for o in c.nodes.values() if o.is_voter and o is not n
                   and c.checker.holds_durably(o, committed - 1, epoch, count_quarantine=False)]
        return len(holders) >= c.checker.majority()

    # ------------------------------------------------- voter changes (KIP-853)
    def _voter_set(self):
        """The set the current leader goes by (None: no leader to ask)."""
        leader = self.cluster.current_leader()
        return (leader, leader.core.voter_set) if leader is not None else (None, None)

    def _intact(self, vs, vid: int) -> bool:
        """Is voter `vid` of `vs` still the replica the set names (its disk not replaced)?"""
        return self.cluster.nodes[vid].disk.directory_id == vs.directory_id_of(vid)

    def _may_lose_voter(self, n: SimNode) -> bool:
        """May `n` stop being a usable voter for good -- its disk replaced, or
        quarantined? Not if, in any voter set in view, that would leave fewer
        usable voters (intact, not quarantined) than a majority: the cluster
        could never elect a leader again (liveness, not a bug to find). With
        static voters: the old rule, one quarantined voter at a time."""
        c = self.cluster
        if not self.membership:
            return not n.is_voter or not any(
                o.is_voter and o is not n and o.disk.must_reach_offset >= 0 for o in c.nodes.values())
        leader, vs = self._voter_set()
        sets = [vs] if vs is not None else []
        sets += [o.core.voter_set for o in c.nodes.values() if o.alive]
        for s in sets:
            if n.node_id not in s.directory_ids or s.unknown:
                continue
            # Usable: intact, not quarantined, and a voter in its own view too.
            # (A voter just added that has not replicated its VotersRecord
            # votes when asked by its own key, as in Kafka 3.9, but never
            # stands; nor does one that replicated its own removal. When the
            # only copy of a quarantined voter's lost tail is on such a
            # replica, no election can restore it: sim seed 6413.)
            usable = [v for v in s.ids if v != n.node_id and self._intact(s, v)
                      and c.nodes[v].disk.must_reach_offset < 0 and c.nodes[v].is_voter]
            if len(usable) < len(s.ids) // 2 + 1:
                return False
        return True

    def member_tick(self) -> None:
        c = self.cluster
        if not self.faults_on:
            return
        r = self.rng_members
        c.schedule(c.now_ms + r.randint(1500, 5000), "call", self.member_tick)
        leader, vs = self._voter_set()
        if leader is None:
            return
        if vs.kraft_version == 0:
            if c.config.static_start:
                # kraft.version 0 -> 1 online (retried by the next tick if refused).
                self._change(leader, m.UpdateFeaturesRequest(
                    cluster_id=c.config.cluster_id,
                    feature_updates=[m.FeatureUpdate(m.KRAFT_VERSION_FEATURE, 1)]), "upgrade")
            return
        stale = [v for v in vs.ids if not self._intact(vs, v)]
        if stale:
            # A replaced disk: first remove the old identity, then add the new one.
            self._change(leader, m.RemoveRaftVoterRequest(
                cluster_id=c.config.cluster_id, voter_id=stale[0], voter_directory_id=vs.directory_id_of(stale[0])),
                "remove_stale_voter")
            return
        kinds = [k for k, _ in MEMBERSHIP_WEIGHTS]
        kind = r.choices(kinds, [w for _, w in MEMBERSHIP_WEIGHTS])[0]
        self.drawn_counts[kind] = self.drawn_counts.get(kind, 0) + 1
        outside = [n for n in sorted(c.nodes) if n not in vs.directory_ids]
        if kind == "add_voter" and outside:
            nid = r.choice(outside)
            self._change(leader, m.AddRaftVoterRequest(
                cluster_id=c.config.cluster_id, voter_id=nid, voter_directory_id=c.nodes[nid].disk.directory_id,
                listeners=[m.RaftListener(*e) for e in sim_endpoints(nid)], timeout_ms=5000), kind)
        elif kind == "remove_voter" and len(vs.ids) >= 4:
            nid = r.choice([v for v in vs.ids if v != leader.node_id])
            self._change(leader, m.RemoveRaftVoterRequest(
                cluster_id=c.config.cluster_id, voter_id=nid, voter_directory_id=vs.directory_id_of(nid)), kind)
        elif kind == "remove_leader" and len(vs.ids) >= 4:
            self._change(leader, m.RemoveRaftVoterRequest(
                cluster_id=c.config.cluster_id, voter_id=leader.node_id,
                voter_directory_id=vs.directory_id_of(leader.node_id)), kind)
        elif kind == "replace_voter" and len(vs.ids) >= 3 and not c.config.static_start:
            n = c.nodes[r.choice(vs.ids)]
            if n.alive and self._may_lose_voter(n):
                for w in list(self.rejoin_watches):
                    self._close_rejoin(w)
                c.note_fault()
                self.member_counts[kind] = self.member_counts.get(kind, 0) + 1
                c.crash(n.node_id, "all", silent=r.random() < SILENT_CRASH_PROBABILITY)
                c.schedule(c.now_ms + r.randint(300, 3000), "call", self._restart(n.node_id))

    def _change(self, leader: SimNode, req: m.Body, kind: str) -> None:
        for w in list(self.rejoin_watches):
            self._close_rejoin(w)  # a voter change strikes: judge the window as it stands
        self.cluster.note_fault()
        self.member_counts[kind] = self.member_counts.get(kind, 0) + 1
        self.cluster.inject_request(leader.node_id, req)

    def _may_quarantine(self, n: SimNode) -> bool:
        """At most one voter in quarantine at a time: with two of three voters
        abstaining no leader can be elected until an operator acts (the
        documented 'all copies bad' case), which is liveness, not a bug to find."""
        return self._may_lose_voter(n)

    def fault_corrupt(self) -> bool:
        """Crash a node; while it is down a bit flips in its durable log, or its
        last fsyncs turn out lost (both detected at the next open)."""
        c = self.cluster
        n = self.rng.choice(list(c.nodes.values()))
        if not self._may_quarantine(n):
            return False
        kind = self.rng.choice(("bit_flip", "bit_flip", "lost_fsync"))
        if n.alive:
            c.crash(n.node_id, silent=self.rng.random() < SILENT_CRASH_PROBABILITY)
            self._later(300, 4000, self._restart(n.node_id))
        c.corrupt(n.node_id, kind, self.rng)
        return True

    def fault_corrupt_live(self) -> bool:
        """The scrubber of a running node (the leader half the time) finds a bit flip."""
        c = self.cluster
        leader = c.current_leader()
        live = [x for x in self._live() if not x.paused]
        if not live:
            return False
        n = leader if leader is not None and self.rng.random() < 0.5 else self.rng.choice(live)
        if not self._may_quarantine(n):
            return False
        return c.corrupt_live(n.node_id, self.rng)

    def _pause(self, n: SimNode | None) -> bool:
        if n is None or not n.alive or n.paused:
            return False
        self.cluster.pause(n.node_id)
        self._later(500, 5000, lambda: self.cluster.resume(n.node_id))
        return True

    def fault_pause(self) -> bool:
        live = self._live()
        return self._pause(self.rng.choice(live) if live else None)

    def fault_pause_leader(self) -> bool:
        return self._pause(self.cluster.current_leader())

    def _isolate(self, n: SimNode | None) -> bool:
        if n is None:
            return False
        watch = self._watch_rejoin(n)
        self.cluster.network.isolate(n.node_id)
        self.cluster.trace(f"n{n.node_id} isolated")

        def heal() -> None:
            self._heal(n.node_id)
            if watch is not None and watch in self.rejoin_watches:
                watch[2] = True
                # Watch until a fetch timeout after the heal: a disruptive
                # rejoin shows at once (its higher epoch reaches the others).
                self.cluster.schedule(self.cluster.now_ms + self.cluster.quorum_config(n.node_id).fetch_timeout_ms,
                                      "call", lambda: self._close_rejoin(watch))
        self._later(500, 5000, heal)
        return True

    def _watch_rejoin(self, n: SimNode) -> list | None:
        """Invariant RejoinNoEpochBump (KIP-996): a follower isolated while
        the rest of the cluster is healthy -- a leader, every voter up and
        following it in its epoch, nothing else isolated or cut -- bumps no
        epoch, neither while cut off nor when it rejoins. The window runs
        from the isolation to a fetch timeout after the heal, or to the next
        fault, whichever comes first (the epochs are compared just before
        that fault strikes). Checked on lossless networks; with random loss a
        majority follower may legitimately time out in the window (counted,
        not failed)."""
        c = self.cluster
        leader = c.current_leader()
        healthy = (leader is not None and leader is not n and n.is_voter and n.alive and not n.paused
                   and all(o.alive and not o.paused and o.core.epoch == leader.core.epoch
                           and (o is leader or role_name(o.core) == "follower")
                           for o in c.nodes.values() if o.is_voter)
                   and not c.network.isolated and not c.network.cuts
                   and c.network.config.drop_probability == self.base_drop and not self.rejoin_watches)
        if healthy and self.membership:
            # A voter change under way may legitimately end in an election (a
            # removed leader steps down once it commits): not a healthy cluster.
            entries = leader.core.log.voters.entries
            # And the others must be a majority without the isolated one (with
            # two voters the leader's check-quorum rightly gives up).
            # Every voter of the set must be the replica it names: a voter
            # whose disk was replaced (not yet removed) answers nothing as that
            # voter, so the leader's majority may rest on the isolated one
            # (sim seed 5166).
            voters = leader.core.voters
            vs = leader.core.voter_set
            healthy = (leader.core.is_voter and getattr(leader.core.state, "pending_change", None) is None
                       and (not entries or entries[-1][0] < leader.core.high_watermark)
                       and len(voters) - 1 >= len(voters) // 2 + 1
                       and all(self._intact(vs, v) for v in vs.ids))
        if not healthy:
            return None
        watch = [n.node_id, leader.core.epoch, False]  # node, epoch at isolation, healed yet?
        self.rejoin_watches.append(watch)
        return watch

    def _close_rejoin(self, watch: list) -> None:
        if watch not in self.rejoin_watches:
            return
        self.rejoin_watches.remove(watch)
        node_id, epoch, healed = watch
        c = self.cluster
        bumped = max(o.core.epoch for o in c.nodes.values() if o.alive) - epoch
        lossless = self.base_drop == 0
        self.rejoin_samples.append((bumped, healed, lossless))
        if lossless and bumped > 0:
            c.fail(f"RejoinNoEpochBump: n{node_id} was isolated from a healthy cluster in epoch {epoch} "
                   f"and {bumped} epoch(s) were bumped {'after it rejoined' if healed else 'while it was cut off'}")

    def _heal(self, node_id: int | None) -> None:
        self.cluster.network.heal(node_id)
        self.cluster.trace(f"heal {node_id if node_id is not None else 'all'}")

    def fault_isolate(self) -> bool:
        return self._isolate(self.rng.choice(list(self.cluster.nodes.values())))

    def fault_isolate_leader(self) -> bool:
        return self._isolate(self.cluster.current_leader())

    def fault_cut(self) -> bool:
        ids = sorted(self.cluster.nodes)
        src, dst = self.rng.sample(ids, 2)
        self.cluster.network.cut(src, dst)
        self.cluster.trace(f"cut {src}->{dst}")

        def heal() -> None:
            self.cluster.network.cuts.discard((src, dst))
            self.cluster.trace(f"heal cut {src}->{dst}")
        self._later(500, 4000, heal)
        return True

    def fault_drop_burst(self) -> bool:
        net = self.cluster.network.config
        net.drop_probability = self.rng.uniform(0.05, 0.3)
        self.cluster.trace(f"drop burst p={net.drop_probability:.3f}")

        def restore() -> None:
            net.drop_probability = self.base_drop
        self._later(1000, 3000, restore)
        return True

    # ------------------------------------------------------------------ run
    def run(self) -> RunResult:
        c = self.cluster
        c.start()
        c.start_snapshots()
        c.schedule(0, "call", self.client_tick)
        c.schedule(self.rng.randint(1000, 3000), "call", self.fault_tick)
        if self.membership:
            c.schedule(self.rng_members.randint(1000, 4000), "call", self.member_tick)
        c.run_until(self.duration_ms)
        # Heal everything, restart the dead, resume the paused; then settle.
        self.faults_on = False
        for w in list(self.rejoin_watches):
            self._close_rejoin(w)
        self.cluster.network.config.drop_probability = self.base_drop
        self.cluster.network.config.fetch_flip_probability = 0.0  # the wire heals too
        self._heal(None)
        for n in c.nodes.values():
            if not n.alive:
                c.boot(n.node_id)
            elif n.paused:
                c.resume(n.node_id)
        c.run_until(self.duration_ms + self.settle_ms // 2)
        self.client_on = False
        c.run_until(self.duration_ms + self.settle_ms, stop=self._settled)
        check_final(c)
        leader = c.current_leader()
        return RunResult(self.seed, c.trace_hash, c.events_processed, len(c.acks),
                         leader.core.high_watermark, list(c.failover_samples),
                         faults={**self.fault_counts, **self.member_counts, **self._wire_counts()},
                         drawn=self._drawn(), rejoin_samples=list(self.rejoin_samples))

    def _wire_counts(self) -> dict[str, int]:
        """Bits flipped on the wire, and fetched batches refused for it (only kinds that happened)."""
        wire = self.cluster.checker.wire
        counts = {"wire_flip": wire.flip_count, "fetched_corrupt_refused": len(wire.refusals)}
        return {k: v for k, v in counts.items() if v}

    def _drawn(self) -> dict[str, int]:
        drawn = dict(self.drawn_counts)
        if self.wire_flip_probability:
            drawn["wire_flip"] = 1  # drawn once per seed: its chance per fetch answer
        return drawn

    def _settled(self) -> bool:
        c = self.cluster
        leader = c.current_leader()
        if leader is None or any(not n.alive or n.paused for n in c.nodes.values()):
            return False
        hw = leader.core.high_watermark
        return hw == leader.core.log_end_offset and all(n.core.high_watermark == hw for n in c.nodes.values())


def wire_flip_probability(seed: int) -> float:
    """The chance per fetch answer that a bit flips on the wire in this seed (0: never)."""
    if os.environ.get("SIM_WIRE_FLIPS", "1") == "0":
        return 0.0
    r = random.Random((seed << 16) ^ WIRE_SALT)
    return r.choice(WIRE_FLIP_PROBABILITIES) if r.random() < WIRE_FLIP_SEED_SHARE else 0.0


def run_seed(seed: int, duration_ms: int | None = None, settle_ms: int = 15000,
             snapshots: bool | None = None, kafka_wire: bool | None = None) -> RunResult:
    """One seed. `kafka_wire` (default: $SIM_KAFKA_WIRE=1) puts every message
    between nodes through Kafka's bytes (sim/kafka_wire.py); it draws nothing,
    so a seed makes the same choices either way."""
    if duration_ms is None:
        duration_ms = int(os.environ.get("SIM_DURATION_MS", "25000"))
    if snapshots is None:
        snapshots = os.environ.get("SIM_SNAPSHOTS", "1") != "0"
    if kafka_wire is None:
        kafka_wire = os.environ.get("SIM_KAFKA_WIRE", "0") == "1"
    return RandomRun(seed, duration_ms, settle_ms, snapshots, kafka_wire).run()
