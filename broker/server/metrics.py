"""Prometheus metrics of one broker (its own registry, served at /metrics).

Two families live here:

* ``metalog_*``: this project's own metrics (requests, flush latency,
  corruption, scrubbing, snapshots ...).
* ``kafka_server_raft_metrics_*``: Kafka's raft metrics (JMX group
  ``raft-metrics``) under the name the usual JMX-to-Prometheus mapping gives
  them (``kafka.server<type=raft-metrics><>current-epoch`` ->
  ``kafka_server_raft_metrics_current_epoch``), with Kafka's meaning and
  Kafka's units (milliseconds for latencies, records per second for rates).
  docs/operations.md has the table.

The raft values are read at scrape time from a ``RaftView`` the runtime
provides (so they are never stale), except the windowed ones: latencies and
rates are recorded by the runtime into ``RaftStats`` and aggregated over the
last ``WINDOW_S`` seconds, as Kafka's sampled stats are (Kafka: 2 samples of
30 s; here 30 buckets of 2 s).
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any, Callable, Iterable, NamedTuple, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from metalog.broker.quorum.roles import Role
from metalog.protocol.invariants import InvariantViolation

# fetch: found on our disk while serving a Fetch; fetched: in a fetch answer
# this follower received (the network's or the sender's damage; dropped, fetched again).
CORRUPTION_SOURCES = ("startup", "scrub", "read", "fetch", "fetched", "apply", "producer_state")
# Kafka's state names (current-state), the same words our core uses for its roles.
ROLES = tuple(r.value for r in Role)
# Roles in which a node is running an election of its own (Kafka's
# updateElectionStartMs); "prospective" is KIP-996's pre-vote state.
ELECTION_ROLES = frozenset({"candidate", "prospective"})

RAFT_PREFIX = "kafka_server_raft_metrics_"
WINDOW_S = 60.0  # latencies and rates cover the last minute ...
BUCKET_S = 2.0  # ... in buckets of this size (memory is WINDOW_S / BUCKET_S buckets per stat)
IDLE_SAMPLE_S = 1.0  # how often the runtime samples the event-loop thread's CPU time
# Leader batches appended and not yet committed, remembered for commit-latency.
# Group commit keeps this small (one batch per fsync); the bound only guards
# against a leader that never commits (no majority): the oldest are dropped.
MAX_PENDING_COMMITS = 10_000


class WindowedStat:
    """Count, total and max of recorded values over the last ``window_s``
    seconds, in buckets of ``bucket_s`` (Kafka's SampledStat). ``clock`` is
    monotonic seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, window_s: float = WINDOW_S,
                 bucket_s: float = BUCKET_S):
        if not 0 < bucket_s <= window_s:
            raise ValueError(f"need 0 < bucket_s <= window_s, got bucket_s {bucket_s}, window_s {window_s}")
        self._clock = clock
        self._window_s = window_s
        self._bucket_s = bucket_s
        self._created_s = clock()
        # [bucket start, count, total, max]; one per bucket_s, the oldest fall off
        self._buckets: deque[list[float]] = deque(maxlen=int(math.ceil(window_s / bucket_s)) + 1)

    def record(self, value: float) -> None:
        now_s = self._clock()
        start_s = math.floor(now_s / self._bucket_s) * self._bucket_s
        if not self._buckets or self._buckets[-1][0] != start_s:
            self._buckets.append([start_s, 0, 0.0, -math.inf])
        b = self._buckets[-1]
        b[1] += 1
        b[2] += value
        b[3] = max(b[3], value)

    def _live(self) -> tuple[float, list[list[float]]]:
        now_s = self._clock()
        return now_s, [b for b in self._buckets if b[0] + self._bucket_s > now_s - self._window_s]

    def avg(self) -> float:
        """Mean of the values in the window; NaN if none (as Kafka's Avg)."""
        _, live = self._live()
        count = sum(b[1] for b in live)
        return sum(b[2] for b in live) / count if count else math.nan

    def max(self) -> float:
        """Largest value in the window; NaN if none (as Kafka's Max)."""
        _, live = self._live()
        return max((b[3] for b in live), default=math.nan)

    def rate(self) -> float:
        """Sum of the values in the window per second of the window (of the
        stat's lifetime while it is younger than the window, at least one
        bucket); 0 if none."""
        now_s, live = self._live()
        elapsed_s = min(self._window_s, max(self._bucket_s, now_s - self._created_s))
        return sum(b[2] for b in live) / elapsed_s


class LoopIdleRatio:
    """poll-idle-ratio-avg for an asyncio loop: 1 - (CPU time of the loop's
    thread) / (wall time), over the last ``window_s``.

    Kafka measures the share of its raft thread's time spent blocked in
    poll(). Our raft work runs on the event loop's thread, which is either
    running callbacks (on a CPU) or waiting in the loop's poll; so the CPU
    time the kernel counts for that thread (CLOCK_THREAD_CPUTIME_ID) is its
    busy time. uvloop gives no hook around its poll, this needs none. Caveats:
    time spent runnable but waiting for a CPU, or blocked in a synchronous
    syscall on the loop thread, counts as idle.

    ``sample()`` must be called on the loop's thread (every IDLE_SAMPLE_S);
    ``value()`` may be called anywhere and reads only the samples."""

    def __init__(self, window_s: float = WINDOW_S, sample_s: float = IDLE_SAMPLE_S,
                 clock: Callable[[], float] = time.monotonic, cpu_clock: Callable[[], float] = time.thread_time):
        self._window_s = window_s
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=int(math.ceil(window_s / sample_s)) + 2)

    def sample(self) -> None:
        self._samples.append((self._clock(), self._cpu_clock()))

    def value(self) -> float:
        if len(self._samples) < 2:
            return math.nan
        last_wall, last_cpu = self._samples[-1]
        first_wall, first_cpu = next(((w, c) for w, c in self._samples if w >= last_wall - self._window_s),
                                     self._samples[0])
        wall_s = last_wall - first_wall
        if wall_s <= 0:
            return math.nan
        return min(1.0, max(0.0, 1.0 - (last_cpu - first_cpu) / wall_s))


class RaftStats:
    """The event-driven raft metrics, fed by the runtime: commit and election
    latency, fetch and append record rates (the windowed ones of Kafka's
    raft-metrics). Times are monotonic seconds from ``clock``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self.commit_latency_ms = WindowedStat(clock)
        self.election_latency_ms = WindowedStat(clock)
        self.fetch_records = WindowedStat(clock)
        self.append_records = WindowedStat(clock)
        # (next offset after the batch, time the leader appended it), in offset order
        self._pending: deque[tuple[int, float]] = deque(maxlen=MAX_PENDING_COMMITS)
        self._election_start_s: float | None = None

    def on_role(self, role: str) -> None:
        """The exposed role changed (or the epoch did, in the same role).

        Election latency runs from the first candidacy (or pre-vote) of an
        election to the moment this node learns its outcome: it became leader
        or follows an elected leader. Re-standing after a lost round keeps the
        first start: the election is still going on. Kafka restarts the clock
        at each candidacy; we measure the whole election as its help text says."""
        now_s = self._clock()
        if role in ELECTION_ROLES:
            if self._election_start_s is None:
                self._election_start_s = now_s
        elif role in ("leader", "follower") and self._election_start_s is not None:
            self.election_latency_ms.record((now_s - self._election_start_s) * 1000)
            self._election_start_s = None
        if role != "leader":
            # Batches of a leadership we lost are not committed by us (they may
            # even be truncated): no commit latency for them.
            self._pending.clear()

    def on_append(self, is_leader: bool, base_offset: int, next_offset: int) -> None:
        """Batches were appended to the local log: by the leader (client
        writes, control records) or from a Fetch answer (follower, observer)."""
        records = next_offset - base_offset
        if records <= 0:
            raise InvariantViolation(f"an append of batches from {base_offset} to {next_offset}")
        if is_leader:
            self.append_records.record(records)
            if self._pending and self._pending[-1][0] >= next_offset:
                raise InvariantViolation(f"leader appends go forward: {next_offset} after {self._pending[-1][0]}")
            self._pending.append((next_offset, self._clock()))
        else:
            self.fetch_records.record(records)

    def on_high_watermark(self, high_watermark: int) -> None:
        """The leader's high watermark: every batch below it is committed."""
        if not self._pending:
            return
        now_s = self._clock()
        while self._pending and self._pending[0][0] <= high_watermark:
            _, appended_s = self._pending.popleft()
            self.commit_latency_ms.record((now_s - appended_s) * 1000)


class RaftView(NamedTuple):
    """The instantaneous raft state, read from the quorum core at scrape time."""

    state: str  # one of ROLES
    leader_id: int  # -1 if unknown
    voted_id: int  # Kafka's current-vote: self if leader or candidate, the vote if voted, else -1
    epoch: int
    high_watermark: int  # -1 if unknown
    log_end_offset: int
    log_end_epoch: int
    unknown_voter_connections: int


class RaftCore(Protocol):
    """What the raft view reads of the quorum core."""

    @property
    def role(self) -> Role: ...

    @property
    def voted_id(self) -> int: ...

    @property
    def leader_id(self) -> int: ...

    @property
    def epoch(self) -> int: ...

    @property
    def high_watermark(self) -> int: ...

    @property
    def log_end_offset(self) -> int: ...

    @property
    def log(self) -> Any: ...  # its last_epoch()

    @property
    def config(self) -> Any: ...  # its voters


def raft_view(core: RaftCore, node_id: int, known_voters: Iterable[int]) -> RaftView:
    """Kafka's instantaneous raft metrics, read from the core at scrape time."""
    role = str(core.role)
    if role in ("leader", "candidate"):
        vote = node_id  # Kafka: a leader or candidate has voted for itself
    elif role == "voted":
        vote = core.voted_id
    else:
        vote = -1
    known = set(known_voters)
    return RaftView(
        state=role, leader_id=core.leader_id if core.leader_id >= 0 else -1, voted_id=vote,
        epoch=core.epoch, high_watermark=core.high_watermark, log_end_offset=core.log_end_offset,
        log_end_epoch=core.log.last_epoch(),
        unknown_voter_connections=sum(1 for v in core.config.voters if v != node_id and v not in known))


class RaftCollector:
    """Yields the kafka_server_raft_metrics_* families on every scrape."""

    def __init__(self, view: Callable[[], RaftView | None], stats: RaftStats, idle: LoopIdleRatio):
        self._view = view
        self._stats = stats
        self._idle = idle

    def collect(self) -> Iterable[GaugeMetricFamily]:
        v = self._view()
        p = RAFT_PREFIX
        state = GaugeMetricFamily(p + "current_state", "current-state: 1 for the node's current raft state "
                                  "(leader, candidate, voted, follower, unattached, observer, resigned)",
                                  labels=["state"])
        for name in ROLES:
            state.add_metric([name], 1.0 if v is not None and v.state == name else 0.0)
        yield state

        def gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(p + name, help_text, value=value)

        nan = math.nan
        yield gauge("current_leader", "current-leader: id of the current leader, -1 if unknown",
                    v.leader_id if v else nan)
        yield gauge("current_vote", "current-vote: id this node voted for in the current epoch "
                    "(itself as leader or candidate), -1 if none", v.voted_id if v else nan)
        yield gauge("current_epoch", "current-epoch: the current quorum epoch", v.epoch if v else nan)
        yield gauge("high_watermark", "high-watermark: the high watermark (exclusive) known to this node, "
                    "-1 if unknown", v.high_watermark if v else nan)
        yield gauge("log_end_offset", "log-end-offset: the local log's end offset", v.log_end_offset if v else nan)
        yield gauge("log_end_epoch", "log-end-epoch: epoch of the last record in the local log",
                    v.log_end_epoch if v else nan)
        yield gauge("number_unknown_voter_connections", "number-unknown-voter-connections: voters whose "
                    "endpoint this node does not know", v.unknown_voter_connections if v else nan)
        s = self._stats
        yield gauge("commit_latency_avg", "commit-latency-avg: mean ms from a leader's append of a batch to its "
                    f"commit, over the last {WINDOW_S:g} s", s.commit_latency_ms.avg())
        yield gauge("commit_latency_max", "commit-latency-max: largest ms from a leader's append of a batch to "
                    f"its commit, over the last {WINDOW_S:g} s", s.commit_latency_ms.max())
        yield gauge("election_latency_avg", "election-latency-avg: mean ms from standing for election to a "
                    f"leader being elected, over the last {WINDOW_S:g} s", s.election_latency_ms.avg())
        yield gauge("election_latency_max", "election-latency-max: largest ms from standing for election to a "
                    f"leader being elected, over the last {WINDOW_S:g} s", s.election_latency_ms.max())
        yield gauge("fetch_records_rate", "fetch-records-rate: records per second appended from Fetch answers "
                    f"(follower, observer), over the last {WINDOW_S:g} s", s.fetch_records.rate())
        yield gauge("append_records_rate", "append-records-rate: records per second appended by this node as "
                    f"leader, over the last {WINDOW_S:g} s", s.append_records.rate())
        yield gauge("poll_idle_ratio_avg", "poll-idle-ratio-avg: share of wall time the event-loop thread was "
                    f"not on a CPU, over the last {WINDOW_S:g} s", self._idle.value())


RAFT_METRIC_NAMES = tuple(RAFT_PREFIX + n for n in (
    "current_state", "current_leader", "current_vote", "current_epoch", "high_watermark", "log_end_offset",
    "log_end_epoch", "number_unknown_voter_connections", "commit_latency_avg", "commit_latency_max",
    "election_latency_avg", "election_latency_max", "fetch_records_rate", "append_records_rate",
    "poll_idle_ratio_avg"))


class ListenerStatsView(Protocol):
    """What the metrics read of a listener's counters (``metalog.broker.net.guard.ListenerStats``)."""

    accepted_total: int
    delayed_total: Any  # Counter: why -> connections delayed
    delay_seconds_total: float
    refused_total: Any  # Counter: why -> connections refused
    failures_total: Any  # Counter: event -> refusals of bad input, failed handshakes, back-offs
    delayed_now: int
    connections_now: int
    accept_pauses_total: int


class HandshakeMeterView(Protocol):
    seconds_total: float
    handshakes_total: int


class ListenerCollector:
    """metalog_listener_* and metalog_tls_handshake_*: read from the listeners at every scrape."""

    def __init__(self) -> None:
        self.listeners: dict[str, ListenerStatsView] = {}
        self.meter: HandshakeMeterView | None = None

    def collect(self) -> Iterable[Any]:
        def labelled(kind: type, name: str, help_text: str, label: str, read: Callable[[Any], Any]) -> Any:
            family = kind(name, help_text, labels=["listener", label])
            for lname, st in self.listeners.items():
                for key, value in sorted(read(st).items()):
                    family.add_metric([lname, key], value)
            return family

        def per_listener(kind: type, name: str, help_text: str, read: Callable[[Any], float]) -> Any:
            family = kind(name, help_text, labels=["listener"])
            for lname, st in self.listeners.items():
                family.add_metric([lname], read(st))
            return family

        yield per_listener(CounterMetricFamily, "metalog_listener_connections_started",
                           "Connections that reached their handshake (or first read)", lambda s: s.accepted_total)
        yield labelled(CounterMetricFamily, "metalog_listener_connections_delayed",
                       "Connections held before their handshake, by why (rate_per_ip, backoff, rate_listener, "
                       "handshake_budget)", "reason", lambda s: s.delayed_total)
        yield per_listener(CounterMetricFamily, "metalog_listener_connection_delay_seconds",
                           "Time connections waited before their handshake", lambda s: s.delay_seconds_total)
        yield labelled(CounterMetricFamily, "metalog_listener_connections_refused",
                       "Connections closed before their handshake, by why (max_connections, "
                       "max_connections_per_ip, abandoned, handshake_queue_full, backoff)", "reason", lambda s: s.refused_total)
        yield labelled(CounterMetricFamily, "metalog_listener_refusals",
                       "Bad input and failures, by log event (tls_handshake_failed, bad_frame, bad_header, "
                       "bad_request, connection_idle_closed, connection_backoff ...)", "event",
                       lambda s: s.failures_total)
        yield per_listener(CounterMetricFamily, "metalog_listener_accept_pauses",
                           "Times the listener stopped accepting (max_delayed_connections waiting)",
                           lambda s: s.accept_pauses_total)
        yield per_listener(GaugeMetricFamily, "metalog_listener_connections_delayed_now",
                           "Connections accepted and waiting for their turn", lambda s: s.delayed_now)
        yield per_listener(GaugeMetricFamily, "metalog_listener_connections_open",
                           "Open connections", lambda s: s.connections_now)
        yield per_listener(GaugeMetricFamily, "metalog_listener_syn_filtered_addresses",
                           "Addresses in back-off whose packets the kernel drops before accept (IPv4 listeners "
                           "on Linux)", lambda s: s.syn_banned_now)
        yield per_listener(CounterMetricFamily, "metalog_listener_syn_sheds",
                           "Times the handshake queue was full and the kernel dropped new connections of "
                           "strangers (neither exempt nor known) for a while", lambda s: s.syn_sheds_total)
        if self.meter is not None:
            yield CounterMetricFamily("metalog_tls_handshake_seconds", "CPU time spent in TLS handshakes, "
                                      "in the handshake threads and on the loop (server side, every listener)",
                                      value=self.meter.seconds_total)
            yield CounterMetricFamily("metalog_tls_handshake_loop_seconds", "Of that, event-loop time (a "
                                      "listener on the loop's own TLS transport)",
                                      value=self.meter.loop_seconds_total)
            yield CounterMetricFamily("metalog_tls_handshakes", "TLS handshakes started (server side)",
                                      value=self.meter.handshakes_total)


class BrokerMetrics:
    def __init__(self, node_id: int, clock: Callable[[], float] = time.monotonic):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("metalog_requests_total", "Requests received, by api", ["api"], registry=r)
        self._request_counts: dict[Any, Any] = {}  # api key -> its child of `requests` (labels() costs ~1.3 us)
        self.authorization_failures = Counter(
            "metalog_authorization_failures_total", "Requests refused by the authorizer, by api", ["api"], registry=r)
        self.appended_records = Counter("metalog_client_records_total", "Client records accepted for append", registry=r)
        self.appended_bytes = Counter("metalog_log_appended_bytes_total", "Bytes appended to the local log", registry=r)
        self.flush_seconds = Histogram(
            "metalog_log_flush_seconds", "fdatasync latency of the log", registry=r,
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0),
        )
        self.high_watermark = Gauge("metalog_high_watermark", "High watermark (exclusive)", registry=r)
        self.epoch = Gauge("metalog_leader_epoch", "Current epoch", registry=r)
        self.role = Gauge("metalog_role", "1 for the current role", ["role"], registry=r)
        self.snapshot_generation_seconds = Histogram(
            "metalog_snapshot_generation_seconds", "Time to write a controller snapshot", registry=r)
        self.snapshot_generations = Counter(
            "metalog_snapshot_generations_total", "Controller snapshots written, by how (fork: a child process; "
            "thread: a worker thread)", ["path"], registry=r)
        self.snapshot_generation_failures = Counter(
            "metalog_snapshot_generation_failures_total", "Controller snapshot writes that failed, by how",
            ["path"], registry=r)
        for path in ("fork", "thread"):
            self.snapshot_generations.labels(path=path)
            self.snapshot_generation_failures.labels(path=path)
        self.snapshot_load_seconds = Histogram(
            "metalog_snapshot_load_seconds", "Time to load or install a snapshot", registry=r)
        self.gc_pause_seconds = Histogram(
            "metalog_gc_pause_seconds", "Cyclic garbage collections of generation 1 and 2 (2 = full) of this "
            "process, each holding the GIL, by generation", ["generation"], registry=r,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0))
        for generation in ("1", "2"):
            self.gc_pause_seconds.labels(generation=generation)
        self.snapshot_bytes = Gauge("metalog_snapshot_bytes", "Size of the latest snapshot written", registry=r)
        self.scrub_bytes = Counter("metalog_scrub_bytes", "Bytes of sealed segments and snapshots re-read by the scrubber",
                                   registry=r)
        self.scrub_last_complete_pass = Gauge(
            "metalog_scrub_last_complete_pass_timestamp_seconds",
            "Unix time the scrubber last finished a pass over all sealed data", registry=r)
        self.corrupt_batches = Counter(
            "metalog_corrupt_batches", "Corrupt batches (or snapshot files) found, by where they were found",
            ["source"], registry=r)
        for source in CORRUPTION_SOURCES:
            self.corrupt_batches.labels(source=source)
        self.consistency_checks = Counter(
            "metalog_consistency_checks_total", "Cross-replica consistency checks run by this leader, by result "
            "(match, mismatch, skipped, failed)", ["result"], registry=r)
        self.divergence_detected = Counter(
            "metalog_divergence_detected_total", "Committed log ranges found to differ from a voter's "
            "(equal offsets, different digests)", ["replica"], registry=r)
        # Kafka's raft-metrics: the runtime binds the view once its core exists.
        self.raft = RaftStats(clock)
        self.loop_idle = LoopIdleRatio(clock=clock)
        self._raft_view: Callable[[], RaftView | None] = lambda: None
        r.register(RaftCollector(lambda: self._raft_view(), self.raft, self.loop_idle))
        self._listeners = ListenerCollector()
        r.register(self._listeners)

    def count_request(self, api_key: Any) -> None:
        """One request received (`api_key` an ApiKey: its name is the label)."""
        child = self._request_counts.get(api_key)
        if child is None:
            child = self._request_counts[api_key] = self.requests.labels(api=api_key.name)
        child.inc()

    def bind_listener(self, name: str, stats: ListenerStatsView, meter: HandshakeMeterView | None) -> None:
        """Export a listener's counters (labelled `name`) and the process's handshake meter."""
        self._listeners.listeners[name] = stats
        if meter is not None:
            self._listeners.meter = meter

    def bind_raft_view(self, view: Callable[[], RaftView | None]) -> None:
        self._raft_view = view

    def set_role(self, role: str, epoch: int) -> None:
        for name in ROLES:
            self.role.labels(role=name).set(1 if name == role else 0)
        self.epoch.set(epoch)
