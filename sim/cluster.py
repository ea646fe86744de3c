"""The deterministic cluster simulator: real QuorumCore instances, fake everything below.

A ``SimCluster`` runs N nodes (voters + observers), each a ``QuorumCore`` on a
``SimDisk``, connected by a ``SimNetwork``, driven by one seeded scheduler: a
heap of ``(time_ms, seq, event)`` with a fake clock. All randomness comes from
``random.Random(seed)``, split into sub-streams (network, disk crashes,
faults, client, one per core incarnation) so that e.g. a change in client
timing does not reshuffle the network's dice.

The driver obeys ``broker/quorum/api.py``: actions run in order before the next
event; FlushLog completes later with FlushCompleted; every SendRequest ends in
exactly one ResponseReceived or RequestFailed (timeout, or connection refused
when the peer is down); every RequestReceived ends in one Respond.

After EVERY event ``InvariantChecker`` runs (see invariants.py); a breach
raises ``Violation`` carrying the seed and the last events of the trace. The
trace is hashed so that a test can prove that replaying a seed is exact.

Two ways to use it:

* ``run_random_seed(seed)``: mixed faults and a client workload, then heal,
  settle and check final consistency (tests/sim/test_random.py, tools/simulate.py);
* by hand in scenario tests: ``intercept`` decides per message whether it is
  delivered, held (``release`` later), dropped or, for a fetch answer with
  records, corrupted on the wire (one bit flipped); ``run_until`` moves time.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import heapq
import random
from dataclasses import dataclass, field
from typing import Any, Callable, assert_never

from metalog.broker.quorum import api
from metalog.broker.quorum.core import QuorumCore
from metalog.broker.quorum.env import Environment
from metalog.broker.quorum.voters import VoterSet
from metalog.protocol import messages as m
from metalog.protocol.invariants import InvariantViolation, invariant
from metalog.sim.disk import SimDisk, SimDiskError
from metalog.sim.invariants import InvariantChecker, Violation, is_leader
from metalog.sim.kafka_wire import KafkaWire
from metalog.sim.network import NetworkConfig, SimNetwork, WireFlip

TRACE_TAIL = 60
MAX_EVENTS_PER_RUN = 3_000_000
MAX_SAME_TIME_TICKS = 200
INBOX_MAX = 100_000  # events held for a paused node
WIRE_SEED_SALT = 0xF11B  # the wire-corruption stream: seeded apart from the root stream (see network.py)


def wire_rng(seed: int) -> random.Random:
    """The wire-corruption dice of a seed: not split from the root stream, so
    that turning the fault on reshuffles no other stream."""
    return random.Random((seed << 20) ^ WIRE_SEED_SALT)


def default_core_factory():
    return QuorumCore


@dataclass
class SimConfig:
    voters: tuple[int, ...] = (1, 2, 3)
    observers: tuple[int, ...] = (4,)
    cluster_id: str = "sim-cluster"
    quorum: dict[str, Any] = field(default_factory=dict)  # QuorumConfig overrides
    network: NetworkConfig = field(default_factory=NetworkConfig)
    flush_latency_ms: tuple[int, int] = (1, 8)
    # Client workload
    client_interval_ms: tuple[int, int] = (30, 150)
    records_per_append_max: int = 3
    # Snapshots: every interval, a node whose HW is this many records past its
    # newest snapshot writes one (0 = never).
    snapshot_interval_ms: int = 0
    snapshot_min_records: int = 50
    # Probability that a downloaded snapshot fails verification at install
    # (the driver then feeds SnapshotInstallFailed and the core rolls back).
    snapshot_install_fail_probability: float = 0.0
    # A core asking for a tick at the same ms over and over is a busy loop: a
    # violation by default. False only to explore past a known spin (the tick
    # is then deferred 1 ms and counted in SimCluster.spin_ticks).
    spin_is_violation: bool = True
    # KIP-853: a dynamic cluster (kraft version 1): the voters are formatted
    # with a bootstrap checkpoint naming them by directory id, the config's
    # voters are only bootstrap servers, and the voter set may change.
    dynamic: bool = False
    # With dynamic: start as a static cluster (kraft version 0, the config's
    # voters, no bootstrap checkpoint) that may upgrade online to kraft
    # version 1 (UpdateFeatures); from then on the log's set decides.
    static_start: bool = False
    # Every message between nodes as Kafka's bytes, mapped by the brokers' own
    # edge and handlers (sim/kafka_wire.py); off: the flat bodies travel as they are.
    kafka_wire: bool = False


@dataclass
class Message:
    kind: str  # "request" | "response" | "refused" | "reset"
    src: int
    dst: int
    src_incarnation: int  # incarnation of the requester (responses must match it)
    request_id: int
    body: m.Body | None

    def src_incarnation_void(self, cluster: "SimCluster") -> bool:
        """A request sent by a life of its sender whose disk was wiped since."""
        if self.kind != "request":
            return False
        return self.src_incarnation < cluster.nodes[self.src].void_before_incarnation

    def __repr__(self) -> str:
        return f"{self.kind} {self.src}->{self.dst} #{self.request_id} {brief(self.body)}"


def brief(body: Any) -> str:
    if body is None:
        return "-"
    parts = [type(body).__name__]
    for name in ("error_code", "candidate_epoch", "leader_epoch", "current_leader_epoch", "fetch_offset",
                 "last_fetched_epoch", "vote_granted", "high_watermark", "end_offset", "base_offset",
                 "leader_id", "position", "pre_vote", "last_offset_epoch", "last_offset"):
        v = getattr(body, name, None)
        if v is not None and v is not False:
            parts.append(f"{name}={v}")
    recs = getattr(body, "records", None)
    if isinstance(recs, (bytes, bytearray, memoryview)) and len(recs):  # memoryview: off Kafka's wire
        parts.append(f"records={len(recs)}B")
    for name in ("diverging_epoch", "snapshot_id", "current_leader"):
        v = getattr(body, name, None)
        if v is not None:
            parts.append(f"{name}={v}")
    return " ".join(parts)


def sim_endpoints(node_id: int) -> tuple[tuple[str, str, int], ...]:
    """The listener a simulated voter registers in a VotersRecord."""
    return (("CONTROLLER", f"n{node_id}", 9093),)


def sim_directory_id(node_id: int, generation: int) -> str:
    """A directory id (Kafka's Uuid string) for a node's disk: derived, not
    drawn, so that the seeded random streams stay as they were."""
    raw = b"sim-dir" + node_id.to_bytes(4, "big") + generation.to_bytes(5, "big")
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


class SimNode:
    def __init__(self, node_id: int, is_voter: bool):
        self.node_id = node_id
        self.is_voter = is_voter
        self.disk = SimDisk()
        self.disk.directory_id = sim_directory_id(node_id, 0)
        self.core: Any = None
        self.alive = False
        self.paused = False
        self.incarnation = 0
        self.pending_requests: dict[int, int] = {}  # request_id -> destination
        self.open_tokens: set[Any] = set()
        self.vote_requests: dict[Any, m.VoteRequest] = {}  # token -> the VoteRequest (or pre-vote) it answers
        self.next_tick_ms: int | None = None
        self.same_time_ticks = 0
        self.last_tick_ms = -1
        self.inbox: collections.deque = collections.deque()
        self.last_flush_done_ms = 0
        # The lowest mark the driver lets the running core clear its quarantine
        # at (a leader's high watermark when it was quarantined); None: the disk's.
        self.quarantine_floor: int | None = None
        self.last_event: Any = None  # the event of the latest step (for listeners)
        self.follow_up: list = []  # events the driver feeds right after the current step
        self.silent_down = False  # down by host loss: nothing answers, not even a refusal
        # Messages sent by incarnations below this one are void: that life's disk was wiped.
        self.void_before_incarnation = 0
        # Fetch answers refused as corrupt (FetchedBatchCorrupt): the runtime's
        # metalog_corrupt_batches_total{source="fetched"} of this node.
        self.fetched_corrupt_count = 0

    def quarantine_mark(self) -> int:
        """The end this node's quarantine makes it vote by and re-replicate to
        (-1: not quarantined): the disk's, or the lower floor the core may use."""
        mark = self.disk.must_reach_offset
        if mark >= 0 and self.quarantine_floor is not None:
            mark = min(mark, self.quarantine_floor)
        return mark

    def __repr__(self) -> str:
        if not self.alive:
            return f"n{self.node_id}(down)"
        c = self.core
        return (f"n{self.node_id}({role_name(c)} e{c.epoch} leader={c.leader_id} hw={c.high_watermark} "
                f"leo={c.log_end_offset}{' paused' if self.paused else ''})")


def bisect_durable(disk: SimDisk) -> int:
    """How many batches are wholly below the flushed end (the scrubber reads
    only durable, sealed data)."""
    return sum(1 for b in disk.batches if b.next_offset <= disk.flushed_end_offset)


def role_name(core: Any) -> str:
    r = core.role
    return str(getattr(r, "name", getattr(r, "value", r))).lower()


@dataclass
class ClientAck:
    offset: int
    epoch: int
    value: bytes


class SimClock:
    """The fake clock the cores' Environment carries (metalog.broker.quorum.env.Clock):
    simulated milliseconds, which also serve as the simulated wall clock."""

    def __init__(self, cluster: "SimCluster"):
        self._cluster = cluster

    def now_ms(self) -> int:
        return self._cluster.now_ms

    def wall_clock_ms(self) -> int:
        return self._cluster.now_ms


class SimCluster:
    def __init__(self, seed: int, config: SimConfig | None = None, core_factory: Callable | None = None):
        self.seed = seed
        self.config = config or SimConfig()
        root = random.Random(seed)
        self.rng_net = random.Random(root.getrandbits(64))
        self.rng_disk = random.Random(root.getrandbits(64))
        self.rng_faults = random.Random(root.getrandbits(64))
        self.rng_client = random.Random(root.getrandbits(64))
        self.rng_flush = random.Random(root.getrandbits(64))
        self.rng_cores = random.Random(root.getrandbits(64))
        self.core_cls = (core_factory or default_core_factory)()
        self.network = SimNetwork(self.rng_net, self.config.network, rng_wire=wire_rng(seed))
        self.now_ms = 0
        self.clock = SimClock(self)
        self._heap: list[tuple[int, int, str, tuple]] = []
        self._seq = 0
        self.nodes: dict[int, SimNode] = {}
        for v in self.config.voters:
            self.nodes[v] = SimNode(v, True)
        for o in self.config.observers:
            self.nodes[o] = SimNode(o, False)
        if self.config.dynamic and not self.config.static_start:
            initial = VoterSet({v: self.nodes[v].disk.directory_id for v in self.config.voters}, kraft_version=1,
                               endpoints={v: sim_endpoints(v) for v in self.config.voters})
            for v in self.config.voters:
                self.nodes[v].disk.bootstrap_voters = initial
        self.trace_tail: collections.deque[str] = collections.deque(maxlen=TRACE_TAIL)
        self._trace_hash = hashlib.sha256()
        self.events_processed = 0
        self.spin_ticks = 0
        self.truncations: list[tuple[int, int, int]] = []  # (time ms, node, end offset)
        self.checker = InvariantChecker(self)
        self.kafka = KafkaWire(self.config.cluster_id) if self.config.kafka_wire else None
        # Scenario control: decide per message "deliver" | "hold" | "drop" | "corrupt".
        self.intercept: Callable[[Message], str] | None = None
        self.held: list[Message] = []
        # Client bookkeeping
        self._client_seq = 0
        self.client_pending: dict[Any, tuple[int, list[bytes]]] = {}
        self.client_results: list[tuple[Any, m.Body]] = []
        self.acks: dict[int, ClientAck] = {}
        # Failover latency: (crash time ms, epoch of the crashed leader, clean?, silent crash?)
        self.failover_pending: tuple[int, int, bool, bool] | None = None
        self.failover_samples: list[tuple[int, bool, bool]] = []  # (ms, clean?, silent crash?)
        self.listeners: list[Callable[[SimNode], None]] = []  # called after every step
        self.injected: dict[int, m.Body] = {}  # responses to inject_request, by its number

    # ------------------------------------------------------------------ time
    def schedule(self, at_ms: int, kind: str, *args: Any) -> None:
        if at_ms < self.now_ms:
            raise InvariantViolation(f"scheduling {kind} in the past ({at_ms} < {self.now_ms})")
        self._seq += 1
        heapq.heappush(self._heap, (at_ms, self._seq, kind, args))

    def run_until(self, until_ms: int, stop: Callable[[], bool] | None = None) -> bool:
        """Process events up to `until_ms` (inclusive). With `stop`, return True as
        soon as it holds (checked after every event), False if time ran out."""
        if stop is not None and stop():
            return True
        while self._heap and self._heap[0][0] <= until_ms:
            at_ms, _, kind, args = heapq.heappop(self._heap)
            self.now_ms = at_ms
            self._dispatch(kind, args)
            self.events_processed += 1
            if self.events_processed > MAX_EVENTS_PER_RUN:
                self.fail(f"event budget of {MAX_EVENTS_PER_RUN} exceeded (livelock?)")
            if stop is not None and stop():
                return True
        self.now_ms = max(self.now_ms, until_ms)
        return stop() if stop is not None else True

    def advance(self, duration_ms: int) -> None:
        self.run_until(self.now_ms + duration_ms)

    def run_until_true(self, cond: Callable[[], bool], within_ms: int, what: str) -> None:
        if not self.run_until(self.now_ms + within_ms, cond):
            raise AssertionError(f"within {within_ms} ms: {what} never happened; nodes: {self.describe()}")

    # ----------------------------------------------------------------- trace
    def trace(self, line: str) -> None:
        entry = f"{self.now_ms} {line}"
        self.trace_tail.append(entry)
        self._trace_hash.update(entry.encode())
        self._trace_hash.update(b"\n")

    @property
    def trace_hash(self) -> str:
        return self._trace_hash.hexdigest()

    def describe(self) -> str:
        return " ".join(repr(n) for n in self.nodes.values())

    def fail(self, reason: str) -> None:
        tail = "\n    ".join(self.trace_tail)
        raise Violation(
            f"SIM_SEED={self.seed} violation at t={self.now_ms} ms: {reason}\n"
            f"  nodes: {self.describe()}\n  last events:\n    {tail}",
            seed=self.seed, reason=reason,
        )

    # ------------------------------------------------------------- lifecycle
    def start(self) -> None:
        for n in self.nodes.values():
            self.boot(n.node_id)

    def quorum_config(self, node_id: int) -> api.QuorumConfig:
        return api.QuorumConfig(node_id=node_id, voters=tuple(self.config.voters),
                                cluster_id=self.config.cluster_id,
                                directory_id=self.nodes[node_id].disk.directory_id,
                                voters_are_bootstrap=self.config.dynamic and not self.config.static_start,
                                voter_endpoints=tuple((v, *sim_endpoints(v)[0]) for v in self.config.voters),
                                listeners=sim_endpoints(node_id),
                                **self.config.quorum)

    def boot(self, node_id: int) -> None:
        n = self.nodes[node_id]
        invariant(not n.alive, "boot of n%d, which is running", node_id)
        n.incarnation += 1
        env = Environment(self.clock, random.Random(self.rng_cores.getrandbits(64)))
        n.core = self.core_cls(self.quorum_config(node_id), n.disk.log_view(), n.disk, n.disk.quorum_state, env)
        n.alive = True
        n.paused = False
        n.pending_requests.clear()
        if self.kafka is not None:
            self.kafka.forget(n.open_tokens)
        n.open_tokens.clear()
        n.vote_requests.clear()
        n.inbox.clear()
        n.next_tick_ms = None
        n.last_flush_done_ms = self.now_ms
        self.trace(f"n{node_id} boot inc={n.incarnation} leo={n.disk.log_end_offset} qs={n.disk.quorum_state}")
        self.checker.on_boot(n)
        self.step(n, api.Tick(self.now_ms))

    def crash(self, node_id: int, wipe: str | None = None, silent: bool = False) -> None:
        """Hard kill: unflushed data may be lost. wipe: None | "log" | "all".

        By default the process dies and its host stays up (kill -9): the kernel
        resets the node's connections, so every request another node has
        outstanding at it fails with "connection reset" one hop later, and new
        ones are refused until it restarts. ``silent`` is the loss of the whole
        host (power, kernel panic): no reset, no refusal, requests just time out."""
        n = self.nodes[node_id]
        if not n.alive:
            return
        self._note_leader_crash(n, silent)
        n.silent_down = silent
        if not silent:
            for o in self.nodes.values():
                if o is n or not o.alive:
                    continue
                for rid, dest in o.pending_requests.items():
                    if dest != node_id:
                        continue
                    back = self.network.transit_ms(node_id, o.node_id)
                    if back is not None:
                        self.schedule(self.now_ms + back, "deliver",
                                      Message("reset", node_id, o.node_id, o.incarnation, rid, None))
        n.alive = False
        n.paused = False
        n.core = None
        n.incarnation += 1  # responses and timers of the dead incarnation are void
        n.quarantine_floor = None
        n.disk.crash(self.rng_disk)
        if wipe == "log":
            n.disk.wipe_log()
        elif wipe == "all":
            n.disk.wipe_all()
            n.disk.directory_id = sim_directory_id(node_id, n.incarnation)  # a new disk, a new id
        if wipe is not None:
            # A replaced disk takes longer than any message is in flight: what the
            # wiped life still had on the wire (a Fetch claiming records it no
            # longer holds) must not arrive after the wipe -- that would be the
            # disk-loss unsafety that Raft has by design, not a bug to find.
            n.void_before_incarnation = n.incarnation
        n.pending_requests.clear()
        if self.kafka is not None:
            self.kafka.forget(n.open_tokens)
        n.open_tokens.clear()
        n.inbox.clear()
        n.next_tick_ms = None
        self.trace(f"n{node_id} crash wipe={wipe} durable_leo={n.disk.log_end_offset}")
        self.checker.on_crash(n, wiped=wipe)

    def corrupt(self, node_id: int, kind: str, rng: random.Random) -> bool:
        """Corruption of a node's durable data while it is down (found at the
        next open): kind "bit_flip" or "lost_fsync" (see sim/disk.py)."""
        n = self.nodes[node_id]
        invariant(not n.alive, "corrupt n%d while it is down, not running", node_id)
        got = getattr(n.disk, kind)(rng)
        if got is None:
            return False
        self.trace(f"n{node_id} {kind}: log cut to {got[0]}, quarantined until {got[1]}")
        self.checker.on_quarantine(n)
        return True

    def corrupt_live(self, node_id: int, rng: random.Random) -> bool:
        """The scrubber (or a read) finds a bit flip in a running node's durable
        data: storage quarantines and cuts, then the driver feeds LogQuarantined."""
        n = self.nodes[node_id]
        if not n.alive or n.paused:
            return False
        i = bisect_durable(n.disk)
        if i == 0:
            return False
        got = n.disk.quarantine(rng.randrange(i))
        if got is None:
            return False
        self.trace(f"n{node_id} scrub found a bit flip: log cut to {got[0]}, quarantined until {got[1]}")
        self.checker.on_quarantine(n)
        # A leader that has committed in its epoch may clear at its high
        # watermark (nothing past it can be committed): remember the floor the
        # driver accepts for this quarantine, read before the core hears of it.
        lead = n.core.state
        n.quarantine_floor = (n.core.high_watermark if role_name(n.core) == "leader"
                              and n.core.high_watermark > lead.epoch_start_offset else None)
        self.step(n, api.LogQuarantined(self.now_ms, got[0], got[1]))
        return True

    def pause(self, node_id: int) -> None:
        n = self.nodes[node_id]
        if n.alive:
            n.paused = True
            self.trace(f"n{node_id} pause")

    def resume(self, node_id: int) -> None:
        n = self.nodes[node_id]
        if not (n.alive and n.paused):
            return
        n.paused = False
        # Ticks that fell due during the pause were dropped: forget the one we
        # remembered, or _schedule_tick never arms an earlier one again.
        n.next_tick_ms = None
        self.trace(f"n{node_id} resume inbox={len(n.inbox)}")
        held = list(n.inbox)
        n.inbox.clear()
        for kind, args in held:
            if not n.alive or n.paused:
                break
            self._dispatch(kind, args)
        if n.alive and not n.paused:
            self.step(n, api.Tick(self.now_ms))

    # ------------------------------------------------------------ dispatching
    def _dispatch(self, kind: str, args: tuple) -> None:
        getattr(self, "_on_" + kind)(*args)

    def _for_node(self, node_id: int, incarnation: int | None, kind: str, args: tuple) -> SimNode | None:
        """The node if it should process this event now; defers events of a paused node."""
        n = self.nodes[node_id]
        if not n.alive or (incarnation is not None and incarnation != n.incarnation):
            return None
        if n.paused:
            if kind != "tick" and len(n.inbox) < INBOX_MAX:
                n.inbox.append((kind, args))
            return None
        return n

    def _on_tick(self, node_id: int, incarnation: int, at_ms: int) -> None:
        n = self._for_node(node_id, incarnation, "tick", ())
        if n is None or n.next_tick_ms != at_ms:
            return
        n.next_tick_ms = None
        if at_ms == n.last_tick_ms:
            n.same_time_ticks += 1
            if n.same_time_ticks > MAX_SAME_TIME_TICKS:
                if self.config.spin_is_violation:
                    self.fail(f"n{node_id} asked for more than {MAX_SAME_TIME_TICKS} ticks at t={at_ms} "
                              f"(busy loop: next_deadline_ms stays in the past while nothing happens)")
                self.spin_ticks += 1
                n.next_tick_ms = at_ms + 1
                self.schedule(at_ms + 1, "tick", node_id, incarnation, at_ms + 1)
                return
        else:
            n.same_time_ticks = 0
            n.last_tick_ms = at_ms
        self.step(n, api.Tick(self.now_ms))

    def _on_deliver(self, msg: Message) -> None:
        if msg.src_incarnation_void(self):
            self.trace(f"void {msg!r} (sent before its sender's disk was wiped)")
            return
        if msg.kind == "request":
            self._deliver_request(msg)
        else:
            self._deliver_response(msg)

    def _deliver_request(self, msg: Message) -> None:
        dst = self.nodes[msg.dst]
        if not self.network.reachable(msg.src, msg.dst):
            self.trace(f"lost {msg!r}")
            return
        if not dst.alive:
            if dst.silent_down:
                self.trace(f"lost {msg!r} (host down)")
                return
            # Connection refused travels back if the path back is open.
            back = self.network.transit_ms(msg.dst, msg.src)
            if back is not None:
                self.schedule(self.now_ms + back, "deliver",
                              Message("refused", msg.dst, msg.src, msg.src_incarnation, msg.request_id, None))
            return
        n = self._for_node(msg.dst, None, "deliver", (msg,))
        if n is None:
            return
        body = msg.body
        if body is None:
            raise InvariantViolation(f"a request without a body: {msg!r}")
        token = ("net", msg.src, msg.src_incarnation, msg.request_id)
        if self.kafka is not None:
            body, answer = self.kafka.arrive(n.node_id, lambda: self._endpoints_seen_by(n), token, msg.src,
                                             msg.request_id, body)
            if answer is not None:  # the listener's handler answered it (e.g. INVALID_REQUEST)
                self.trace(f"n{n.node_id} <= {msg!r}, answered at the edge: {brief(answer)}")
                self._send(Message("response", n.node_id, msg.src, msg.src_incarnation, msg.request_id, answer))
                return
            if body is None:
                raise InvariantViolation(f"the edge gave {msg!r} neither a body nor an answer")
        n.open_tokens.add(token)
        if isinstance(body, m.VoteRequest):
            n.vote_requests[token] = body
        self.trace(f"n{n.node_id} <= {msg!r}")
        self.step(n, api.RequestReceived(self.now_ms, token, body))

    def _endpoints_seen_by(self, n: SimNode) -> dict[int, tuple[str, int]]:
        """A node's controller-listener endpoints of every voter (the brokers'
        KafkaDispatch.endpoints: the configured voters, overridden by the
        CONTROLLER listeners its voter set names)."""
        out = {v: sim_endpoints(v)[0][1:] for v in self.config.voters}
        for nid, listeners in n.core.voter_set.endpoints.items():
            for name, host, port in listeners:
                if name == "CONTROLLER":
                    out[nid] = (host, port)
        return out

    def _deliver_response(self, msg: Message) -> None:
        if msg.kind == "response" and not self.network.reachable(msg.src, msg.dst):
            self.trace(f"lost {msg!r}")
            return
        n = self._for_node(msg.dst, msg.src_incarnation, "deliver", (msg,))
        if n is None or msg.request_id not in n.pending_requests:
            return  # the requester died, or gave up on this request already
        del n.pending_requests[msg.request_id]
        self.trace(f"n{n.node_id} <= {msg!r}")
        if msg.kind == "refused":
            self.step(n, api.RequestFailed(self.now_ms, msg.request_id, msg.src, "connection refused"))
        elif msg.kind == "reset":
            self.step(n, api.RequestFailed(self.now_ms, msg.request_id, msg.src, "connection reset by peer"))
        elif msg.body is None:
            raise InvariantViolation(f"a response without a body: {msg!r}")
        else:
            self.step(n, api.ResponseReceived(self.now_ms, msg.request_id, msg.src, msg.body))

    def _on_timeout(self, node_id: int, incarnation: int, request_id: int) -> None:
        n = self._for_node(node_id, incarnation, "timeout", (node_id, incarnation, request_id))
        if n is None or request_id not in n.pending_requests:
            return
        dest = n.pending_requests.pop(request_id)
        self.trace(f"n{node_id} request #{request_id} to n{dest} timed out")
        self.step(n, api.RequestFailed(self.now_ms, request_id, dest, "timeout"))

    def _on_flush(self, node_id: int, incarnation: int, target: int) -> None:
        n = self._for_node(node_id, incarnation, "flush", (node_id, incarnation, target))
        if n is None:
            return
        flushed = n.disk.flush(target)
        self.trace(f"n{node_id} flushed to {flushed}")
        self.step(n, api.FlushCompleted(self.now_ms, flushed))

    def _on_call(self, fn: Callable[[], None]) -> None:
        fn()

    # -------------------------------------------------------------- the step
    def step(self, n: SimNode, event: Any) -> list:
        invariant(n.alive and not n.paused, "a step of n%d, which is down or paused", n.node_id)
        n.last_event = event
        actions = n.core.step(event)
        if self.config.dynamic:
            n.is_voter = n.core.is_voter  # the log's voter set decides (KIP-853)
        self.trace(f"n{n.node_id} {type(event).__name__} -> {','.join(type(a).__name__ for a in actions)}")
        n.follow_up = []
        for a in actions:
            try:
                self._execute(n, a)
            except SimDiskError as exc:
                self.fail(f"n{n.node_id} {type(a).__name__} broke the storage contract: {exc}")
            if not n.alive:
                return actions  # a Fatal stopped the node
        follow_up, n.follow_up = n.follow_up, []
        for ev in follow_up:  # fed before any other event (api: SnapshotInstallFailed)
            self.step(n, ev)
            if not n.alive:
                return actions
        self.checker.after_step(n)
        self.check_failover(n)
        for listener in self.listeners:
            listener(n)
        self._schedule_tick(n)
        return actions

    def _schedule_tick(self, n: SimNode) -> None:
        d = n.core.next_deadline_ms
        if callable(d):
            d = d()
        if d is None:
            return
        d = max(int(d), self.now_ms)
        if n.next_tick_ms is None or d < n.next_tick_ms:
            n.next_tick_ms = d
            self.schedule(d, "tick", n.node_id, n.incarnation, d)

    def _execute(self, n: SimNode, a: api.Action) -> None:
        """One action, as broker/quorum/api.py demands of a driver. The match
        is exhaustive over the Action union: a new action type that has no
        case here is a type error (assert_never; tests/test_types.py)."""
        disk = n.disk
        match a:
            case api.PersistQuorumState():
                disk.persist_quorum_state(a.state)
            case api.AppendBatches():
                self.checker.wire.on_append(n, a.data, a.base_offset, a.next_offset)
                disk.append(a.data, a.base_offset, a.next_offset)
            case api.TruncateLog():
                self.truncations.append((self.now_ms, n.node_id, a.end_offset))
                self.checker.on_truncate(n, a.end_offset)
                disk.truncate(a.end_offset)
            case api.WriteEpochCheckpoint():
                disk.write_epoch_checkpoint(a.entries)
            case api.FlushLog():
                self._flush_later(n)
            case api.SendRequest():
                self._send_request(n, a)
            case api.Respond():
                self._check_vote_answer(n, a)
                self._respond(n, a)
            case api.WriteSnapshotChunk():
                disk.write_snapshot_chunk(a.snapshot_id, a.position, a.data)
            case api.InstallSnapshot():
                self._install_snapshot(n, a)
            case api.AdvanceLogStart():
                disk.advance_log_start(a.log_start_offset)
            case api.ClearQuarantine():
                self._clear_quarantine(n, a)
            case api.FetchedBatchCorrupt():
                self._fetched_corrupt(n, a)
            case api.CorruptionFound():
                self.fail(f"n{n.node_id} reported corruption the simulated disk never serves: {a.error}")
            case api.Fatal():
                self.fail(f"n{n.node_id} raised Fatal: {a.reason}")
            case _:
                assert_never(a)

    def _flush_later(self, n: SimNode) -> None:
        """FlushLog: completes after a drawn latency, never before an earlier flush."""
        lo_ms, hi_ms = self.config.flush_latency_ms
        done_ms = max(self.now_ms + self.rng_flush.randint(lo_ms, hi_ms), n.last_flush_done_ms)
        n.last_flush_done_ms = done_ms
        self.schedule(done_ms, "flush", n.node_id, n.incarnation, n.disk.log_end_offset)

    def _send_request(self, n: SimNode, a: api.SendRequest) -> None:
        disk = n.disk
        if (isinstance(a.request, m.VoteRequest) and disk.must_reach_offset >= 0
                and (a.request.last_offset >= 0 or role_name(n.core) == "candidate")):
            # (a probe claiming an empty log, which no voter grants, is allowed)
            self.fail(f"quarantined voter n{n.node_id} stood for election before re-replicating "
                      f"past {disk.must_reach_offset}")
        if a.request_id in n.pending_requests:
            self.fail(f"n{n.node_id} reused request id {a.request_id} while it is outstanding")
        self.checker.wire.on_send(n, a.request)
        n.pending_requests[a.request_id] = a.destination
        self.schedule(self.now_ms + a.timeout_ms, "timeout", n.node_id, n.incarnation, a.request_id)
        self._send(Message("request", n.node_id, a.destination, n.incarnation, a.request_id, a.request))

    def _check_vote_answer(self, n: SimNode, a: api.Respond) -> None:
        """QuarantinedVoterVotesByItsOldLog and WipedNodeNeverVotesWithItsOldIdentity
        on an answer to a VoteRequest (or pre-vote)."""
        vote = n.vote_requests.pop(a.token, None)
        granted = isinstance(a.response, m.VoteResponse) and a.response.vote_granted
        disk = n.disk
        if granted and disk.must_reach_offset >= 0:
            # A quarantined voter votes only for a log at least as up to
            # date as the one it had up to its mark (the disk's, or a
            # leader's high watermark when it was quarantined).
            mark = n.quarantine_mark()
            mark_epoch = disk.epoch_before(mark) if mark > 0 else -1
            if mark_epoch is None:
                self.fail(f"n{n.node_id}: no epoch known for its quarantine mark {mark}")
            elif vote is None or (vote.last_offset_epoch, vote.last_offset) < (mark_epoch, mark):
                self.fail(f"quarantined voter n{n.node_id} granted a vote to a log behind what it had "
                          f"(mark {mark} in epoch {mark_epoch}; flushed end {disk.flushed_end_offset})")
        if vote is not None and not vote.pre_vote and granted:
            self._check_vote_identity(n, vote)

    def _install_snapshot(self, n: SimNode, a: api.InstallSnapshot) -> None:
        disk = n.disk
        p = self.config.snapshot_install_fail_probability
        if p > 0 and self.rng_disk.random() < p:
            disk.partial_snapshots.pop(a.snapshot_id, None)  # verification failed: partial deleted
            ok = False
        else:
            ok = disk.install_snapshot(a.snapshot_id, a.size)
        self.trace(f"n{n.node_id} install snapshot {a.snapshot_id} ok={ok}")
        if ok:
            self.checker.wire.on_log_replaced(n)
        else:
            self.checker.on_quarantine(n)  # its HW falls back with its log
            n.follow_up.append(api.SnapshotInstallFailed(self.now_ms, a.snapshot_id, "verification failed"))

    def _clear_quarantine(self, n: SimNode, a: api.ClearQuarantine) -> None:
        # A node that may vote later (a voter, or anyone once the set is in
        # the log) clears only once it re-replicated; a static observer at once.
        disk = n.disk
        floor = n.quarantine_floor
        if a.must_reach_offset < disk.must_reach_offset and (floor is None or a.must_reach_offset < floor):
            self.fail(f"n{n.node_id} cleared its quarantine at {a.must_reach_offset}, below the disk's "
                      f"{disk.must_reach_offset}, without being a leader whose high watermark was there")
        disk.clear_quarantine(a.must_reach_offset, n.is_voter or n.core.voter_set.kraft_version == 1)
        n.quarantine_floor = None
        self.trace(f"n{n.node_id} quarantine cleared at {a.must_reach_offset}")

    def _fetched_corrupt(self, n: SimNode, a: api.FetchedBatchCorrupt) -> None:
        """As the runtime executes it: counted (its metric), reported, and
        nothing else -- the disk is sound, so no quarantine; the core has
        already dropped the batch and will fetch it again."""
        n.fetched_corrupt_count += 1
        self.trace(f"n{n.node_id} fetched batch corrupt at {a.base_offset} (epoch {a.fetch_epoch}): {a.reason}")
        self.checker.wire.on_fetched_corrupt(n, a)

    def _check_vote_identity(self, n: SimNode, vote: m.VoteRequest) -> None:
        """WipedNodeNeverVotesWithItsOldIdentity (KIP-853): a granted vote comes
        from the very directory it was addressed to, and from a node that is a
        voter (its node id and current directory id) of its own latest set --
        or, not yet in its own set, one addressed by exactly that key (a voter
        just added that has not replicated the record naming it, Kafka 3.9)."""
        d = n.disk.directory_id
        if vote.voter_directory_id not in (m.NO_DIRECTORY_ID, d):
            self.fail(f"n{n.node_id} (directory {d}) granted a vote addressed to its directory "
                      f"{vote.voter_directory_id}: a wiped node voted with its old identity")
        by_own_key = vote.voter_id == n.node_id and d != m.NO_DIRECTORY_ID and vote.voter_directory_id == d
        if not n.core.voter_set.is_voter(n.node_id, d) and not by_own_key:
            self.fail(f"n{n.node_id} (directory {d}) granted a vote in epoch {vote.candidate_epoch} while not a "
                      f"voter of its own set {dict(n.core.voter_set.directory_ids)}")

    def _send(self, msg: Message) -> None:
        decision = self.intercept(msg) if self.intercept is not None else "deliver"
        if decision == "hold":
            self.held.append(msg)
            self.trace(f"held {msg!r}")
            return
        if decision == "drop":
            self.trace(f"dropped {msg!r}")
            return
        invariant(decision in ("deliver", "corrupt"), "intercept decided %r for %r", decision, msg)
        transit_ms = self.network.transit_ms(msg.src, msg.dst)
        if transit_ms is None:
            self.trace(f"lost {msg!r}")
            return
        if msg.kind == "response":
            msg = self._through_the_wire(msg, decision == "corrupt")
        self.schedule(self.now_ms + transit_ms, "deliver", msg)

    def _through_the_wire(self, msg: Message, flip: bool) -> Message:
        """The response as it arrives: with a bit flipped in a fetch answer's
        batches when the intercept said "corrupt", or by the network's own
        chance (traced only when it happens: seeds without it replay as before)."""
        got: tuple[m.FetchResponse, WireFlip] | None
        if flip:
            if not isinstance(msg.body, m.FetchResponse) or not msg.body.records:
                raise ValueError(f"only a fetch answer with records can be corrupted, not {msg!r}")
            got = self.network.flip(msg.body)
        else:
            got = self.network.maybe_flip(msg.body)
        if got is None:
            return msg
        body, where = got
        self.trace(f"wire flip {msg!r}: batch {where.base_offset} byte {where.byte_position} bit {where.bit}")
        self.checker.wire.on_flip(msg.dst, where)
        return Message(msg.kind, msg.src, msg.dst, msg.src_incarnation, msg.request_id, body)

    def release(self, msg: Message, delay_ms: int = 0) -> None:
        """Deliver a held message `delay_ms` from now (scenario tests)."""
        self.held.remove(msg)
        self.schedule(self.now_ms + delay_ms, "deliver", msg)

    def held_where(self, pred: Callable[[Message], bool]) -> list[Message]:
        return [msg for msg in self.held if pred(msg)]

    def _respond(self, n: SimNode, a: api.Respond) -> None:
        if a.token not in n.open_tokens:
            self.fail(f"n{n.node_id} answered token {a.token!r} that is unknown or already answered")
        n.open_tokens.discard(a.token)
        if a.token[0] == "net":
            _, src, src_inc, rid = a.token
            response = a.response if self.kafka is None else self.kafka.leave(a.token, a.response)
            self._send(Message("response", n.node_id, src, src_inc, rid, response))
        elif a.token[0] == "inject":
            self.trace(f"n{n.node_id} answered injected #{a.token[1]}: {brief(a.response)}")
            self.injected[a.token[1]] = a.response
        else:
            self._client_response(n, a.token, a.response)

    def inject_request(self, node_id: int, request: m.Body) -> int:
        """Feed `request` to a node as if a peer sent it (scenario tests forge stale
        requests this way); its answer lands in ``self.injected[number]``."""
        n = self.nodes[node_id]
        self._client_seq += 1
        token = ("inject", self._client_seq)
        n.open_tokens.add(token)
        self.trace(f"n{node_id} <= injected #{self._client_seq} {brief(request)}")
        self.step(n, api.RequestReceived(self.now_ms, token, request))
        return self._client_seq

    # ---------------------------------------------------------------- client
    def current_leader(self) -> SimNode | None:
        """The live, unpaused node that leads the highest epoch (an oracle)."""
        best = None
        for n in self.nodes.values():
            if n.alive and not n.paused and is_leader(n.core):
                if best is None or n.core.epoch > best.core.epoch:
                    best = n
        return best

    def client_append(self, node_id: int, values: list[bytes]) -> Any:
        n = self.nodes[node_id]
        self._client_seq += 1
        token = ("client", self._client_seq)
        self.client_pending[token] = (node_id, values)
        n.open_tokens.add(token)
        self.trace(f"n{node_id} client append {len(values)} records token={self._client_seq}")
        self.step(n, api.ClientAppend(self.now_ms, [api.AppendWaiter(token, len(values))], list(values)))
        return token

    def _client_response(self, n: SimNode, token: Any, response: m.Body) -> None:
        _, values = self.client_pending.pop(token, (None, []))
        self.client_results.append((token, response))
        self.trace(f"n{n.node_id} client response {brief(response)}")
        if isinstance(response, m.ProduceResponse) and response.error_code == 0:
            for i, value in enumerate(values):
                self.checker.on_ack(ClientAck(response.base_offset + i, response.leader_epoch, value))

    def _note_leader_crash(self, n: SimNode, silent: bool) -> None:
        leader = self.current_leader()
        if leader is n and n.is_voter:
            # Clean: the other voters are up, reachable, and a majority without
            # the leader (with two voters no failover exists: the sample would
            # measure the leader's restart, as in seed 20171).
            # Nor does one when a voter of the set is a replaced disk (KIP-853:
            # that identity never answers) and the rest are no majority (seed 20026).
            vs = n.core.voter_set
            intact = [v for v in vs.ids if v != n.node_id and v in self.nodes
                      and (vs.kraft_version == 0 or self.nodes[v].disk.directory_id == vs.directory_id_of(v))]
            clean = (all(o.alive and not o.paused and o.node_id not in self.network.isolated
                         for o in self.nodes.values() if o.is_voter and o is not n) and not self.network.cuts
                     and len(intact) >= len(vs.ids) // 2 + 1)
            self.failover_pending = (self.now_ms, n.core.epoch, clean, silent)

    def note_fault(self) -> None:
        """A new fault began: an ongoing failover measurement is no longer clean."""
        if self.failover_pending is not None:
            crash_ms, epoch, _, silent = self.failover_pending
            self.failover_pending = (crash_ms, epoch, False, silent)

    def check_failover(self, n: SimNode) -> None:
        if self.failover_pending is None:
            return
        crash_ms, epoch, clean, silent = self.failover_pending
        core = n.core
        if is_leader(core) and core.epoch > epoch and core.high_watermark > self.checker.epoch_start(n, core.epoch):
            self.failover_samples.append((self.now_ms - crash_ms, clean, silent))
            self.failover_pending = None

    # -------------------------------------------------------------- snapshots
    def start_snapshots(self) -> None:
        if self.config.snapshot_interval_ms > 0:
            self.schedule(self.now_ms + self.config.snapshot_interval_ms, "snapshot_round")

    def _on_snapshot_round(self) -> None:
        for n in self.nodes.values():
            if n.alive and not n.paused:
                self.maybe_snapshot(n)
        self.schedule(self.now_ms + self.config.snapshot_interval_ms, "snapshot_round")

    def maybe_snapshot(self, n: SimNode, min_records: int | None = None) -> m.SnapshotId | None:
        """Write a snapshot of the committed log at the last batch boundary <= HW."""
        need = self.config.snapshot_min_records if min_records is None else min_records
        d = n.disk
        hw = n.core.high_watermark or 0
        latest = max([s.end_offset for s in d.snapshots] + [d.log_start_offset])
        if hw - latest < need or hw <= d.log_start_offset:
            return None
        b = d.batch_at(hw - 1)
        if b is None:
            return None
        end_offset = hw if b.next_offset == hw else b.base_offset
        sid = d.create_snapshot(end_offset)
        if sid is None:
            return None
        self.trace(f"n{n.node_id} snapshot {sid}")
        self.step(n, api.SnapshotCreated(self.now_ms, sid))
        return sid
