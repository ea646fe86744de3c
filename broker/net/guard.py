"""What keeps a listener's cost bounded under hostile load (issue 34).

* ``HANDSHAKE_METER``: the time spent inside server-side TLS handshakes.
  The listeners of ``metalog.broker.net.listener`` run them in a handshake
  thread (``metalog.broker.net.tls_transport``), which reports each step's
  thread CPU time; a handshake run by uvloop's or asyncio's own SSL
  transport (a connection of another accept loop) runs on the loop and is
  measured where it is spent (every ``do_handshake`` call of a
  ``TimedSSLObject``, which ``SSLContext.wrap_bio`` makes once
  ``meter_handshakes(ctx)`` has set the context's ``sslobject_class``),
  counted apart in ``loop_seconds_total``. One meter per process: the
  handshakes share one budget, whichever listener spends it.
* ``HandshakePacer``: when a listener may start its next handshake so that
  handshakes take at most ``share`` of one core (the handshake thread's, or
  the loop's for handshakes on the loop): starts are spaced by the
  measured mean cost of a handshake divided by the share (1 ms at 0.25: one
  start per 4 ms, 250 a second), and none starts while the measured share
  of the last second is above it. Off the loop it bounds what a flood takes
  from the machine (the broker's other threads and processes share its
  cores), no longer the loop's own time.
* ``RefusalLog``: refusals an attacker controls (failed handshakes, bad
  frames, refused or delayed connections, back-offs) are logged in full up
  to ``lines_max`` times per reason per interval; the rest are counted and
  told in one ``connection_refusals_summary`` line per reason per interval
  with the count and the first offender's address.
* ``ListenerStats``: the counters behind the broker's metrics of a listener.
"""

from __future__ import annotations

import collections
import math
import ssl
import time
from typing import Any, Callable

METER_DECAY_S = 1.0  # the meter's memory: "the share of the last second"
MEAN_DECAY_S = 30.0  # the memory of the mean cost of a handshake
DEFAULT_HANDSHAKE_COST_S = 0.001  # until measured: a full TLS 1.3 handshake on one core, about 1 ms
PACER_BURST = 2  # handshakes that may start back to back after a quiet period
OUTCOME_DECAY_S = 5.0  # the pacer's memory of how its handshakes ended
OUTCOMES_MIN = 4.0  # fewer (decayed) outcomes than this: the whole share
FAILING_SHARE_MIN = 0.2  # of the share, while every handshake fails (a flood)


class HandshakeMeter:
    """Loop seconds spent in TLS handshakes: a total, the share of the last
    second, and the mean cost of a handshake (over the last
    ``MEAN_DECAY_S``, so that a burst after a quiet period is still paced by
    what handshakes cost)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, decay_s: float = METER_DECAY_S,
                 mean_decay_s: float = MEAN_DECAY_S):
        self._clock = clock
        self._decay_s = decay_s
        self._mean_decay_s = mean_decay_s
        self.seconds_total = 0.0  # every handshake step, on the loop or in a handshake thread
        self.loop_seconds_total = 0.0  # of which on the loop thread (uvloop's or asyncio's own SSL transports)
        self.handshakes_total = 0  # started
        self._recent_s = 0.0  # seconds spent, decayed over decay_s
        self._mean_s = 0.0  # seconds spent, decayed over mean_decay_s
        self._mean_n = 0.0  # handshakes that took a first step, decayed alike
        self._at_s = clock()

    def _decay(self) -> None:
        now_s = self._clock()
        if now_s > self._at_s:
            elapsed_s = now_s - self._at_s
            self._recent_s *= math.exp(-elapsed_s / self._decay_s)
            f = math.exp(-elapsed_s / self._mean_decay_s)
            self._mean_s *= f
            self._mean_n *= f
            self._at_s = now_s

    def started(self) -> None:
        self.handshakes_total += 1

    def spent(self, seconds: float, first: bool, on_loop: bool = True) -> None:
        """One handshake step took `seconds`; `first`: the handshake's first step;
        `on_loop`: it ran on the loop thread (else in a handshake thread)."""
        self._decay()
        self.seconds_total += seconds
        if on_loop:
            self.loop_seconds_total += seconds
        self._recent_s += seconds
        self._mean_s += seconds
        if first:
            self._mean_n += 1

    def share(self) -> float:
        """Share of the loop's recent time spent in handshakes (~ the last second)."""
        self._decay()
        return self._recent_s / self._decay_s

    def mean_cost_s(self) -> float:
        self._decay()
        if self._mean_n < 1e-9:
            return DEFAULT_HANDSHAKE_COST_S
        return max(self._mean_s / self._mean_n, 1e-5)


HANDSHAKE_METER = HandshakeMeter()


class TimedSSLObject(ssl.SSLObject):
    """An SSLObject that tells ``HANDSHAKE_METER`` how long each handshake step took."""

    def do_handshake(self) -> None:
        # A handshake counts toward the mean at its first step, the costly one for a server (the
        # answer to a ClientHello is a key exchange and a signature): a flood that never finishes
        # its handshakes still teaches the meter what they cost.
        first = not getattr(self, "_metered", False)
        self._metered = True
        t0 = time.perf_counter()
        try:
            super().do_handshake()
        finally:
            HANDSHAKE_METER.spent(time.perf_counter() - t0, first)


def meter_handshakes(ctx: ssl.SSLContext) -> ssl.SSLContext:
    """Make `ctx`'s server-side handshakes measured (idempotent; returns `ctx`)."""
    if ctx.sslobject_class is not TimedSSLObject:
        ctx.sslobject_class = TimedSSLObject
    return ctx


class HandshakePacer:
    """When the next handshake may start, keeping handshakes under ``share`` of the loop.

    The share shrinks while the handshakes it starts fail: to
    ``share * max(FAILING_SHARE_MIN, the share of them that succeeded)`` over
    about the last ``OUTCOME_DECAY_S``. A reconnect storm of real clients
    keeps the whole budget; a flood, whose handshakes never complete, gets
    a fifth of it (and its addresses the back-off)."""

    def __init__(self, share: float, meter: HandshakeMeter = HANDSHAKE_METER,
                 clock: Callable[[], float] = time.monotonic):
        if not 0 <= share <= 1:
            raise ValueError(f"share must be in [0, 1], got {share}")
        self.share = share
        self._meter = meter
        self._next_s = -math.inf
        self._clock = clock
        self._ok = 0.0  # handshakes that completed, decayed over OUTCOME_DECAY_S
        self._failed = 0.0  # ... that failed in a way that counts toward a back-off
        self._at_s = clock()

    def ended(self, ok: bool) -> None:
        """A handshake this pacer started completed (`ok`) or failed."""
        self._decay()
        if ok:
            self._ok += 1
        else:
            self._failed += 1

    def _decay(self) -> None:
        now_s = self._clock()
        if now_s > self._at_s:
            f = math.exp(-(now_s - self._at_s) / OUTCOME_DECAY_S)
            self._ok *= f
            self._failed *= f
            self._at_s = now_s

    def effective_share(self) -> float:
        """The share now: smaller while most recent handshakes failed."""
        self._decay()
        ended = self._ok + self._failed
        if ended < OUTCOMES_MIN:
            return self.share
        return self.share * max(FAILING_SHARE_MIN, self._ok / ended)

    def next_start_s(self, now_s: float) -> float:
        """The earliest time (>= now_s) the next handshake may start; 0 share: always now."""
        if not self.share:
            return now_s
        at_s = max(now_s, self._next_s)
        over = self._meter.share() - self.effective_share()
        if over > 0:  # costlier than the mean said: wait until the excess has decayed
            at_s = max(at_s, now_s + over * METER_DECAY_S)
        return at_s

    def rate_per_s(self) -> float:
        """Handshakes a second the share allows at the measured mean cost (0 share: unbounded)."""
        if not self.share:
            return math.inf
        return self.effective_share() / self._meter.mean_cost_s()

    def took(self, now_s: float) -> None:
        """A handshake starts now."""
        self._meter.started()
        if self.share:
            interval_s = self._meter.mean_cost_s() / self.effective_share()
            self._next_s = max(self._next_s, now_s - (PACER_BURST - 1) * interval_s) + interval_s


class _Reason:
    __slots__ = ("count", "logged", "first_address", "since_s")

    def __init__(self, address: str, now_s: float):
        self.count = 0
        self.logged = 0
        self.first_address = address
        self.since_s = now_s


class RefusalLog:
    """Bounded logging of the events an attacker can repeat at will."""

    def __init__(self, logger: Any, interval_ms: int, lines_max: int,
                 clock: Callable[[], float] = time.monotonic):
        if interval_ms <= 0 or lines_max < 0:
            raise ValueError(f"need interval_ms > 0 and lines_max >= 0, got {interval_ms}, {lines_max}")
        self._log = logger
        self._interval_s = interval_ms / 1000
        self._lines_max = lines_max
        self._clock = clock
        self._reasons: dict[str, _Reason] = {}  # at most one per event name: a fixed, small set

    def event(self, event: str, source: str, /, **fields: Any) -> None:
        """One refusal: logged as `event` with `fields` while this interval's lines last."""
        now_s = self._clock()
        st = self._reasons.get(event)
        if st is not None and now_s - st.since_s >= self._interval_s:
            self._summarize(event, st)
            st = None
        if st is None:
            st = self._reasons[event] = _Reason(source, now_s)
        st.count += 1
        if st.logged < self._lines_max:
            st.logged += 1
            self._log.warning(event, **fields)

    def flush(self, force: bool = False) -> None:
        """Summarize the reasons whose interval is over (all of them with `force`)."""
        now_s = self._clock()
        for event, st in list(self._reasons.items()):
            if force or now_s - st.since_s >= self._interval_s:
                self._summarize(event, st)

    def _summarize(self, event: str, st: _Reason) -> None:
        del self._reasons[event]
        if st.count > st.logged:
            self._log.warning("connection_refusals_summary", reason=event, count=st.count,
                              not_logged=st.count - st.logged, first_address=st.first_address,
                              interval_ms=round((self._clock() - st.since_s) * 1000))


class ListenerStats:
    """Counters of one listener, read by the broker's metrics at scrape time."""

    def __init__(self) -> None:
        self.accepted_total = 0  # connections that reached their handshake (or their first read)
        self.delayed_total: collections.Counter[str] = collections.Counter()  # by why: rate_per_ip, ...
        self.delay_seconds_total = 0.0
        self.refused_total: collections.Counter[str] = collections.Counter()  # by why: max_connections, ...
        self.failures_total: collections.Counter[str] = collections.Counter()  # by event: bad_frame, ...
        self.delayed_now = 0  # connections accepted and waiting for their turn
        self.accept_pauses_total = 0  # times accepting stopped because max_delayed_connections waited
        self.connections_now = 0
        self.syn_banned_now = 0  # addresses in back-off the kernel drops before accept (syn_filter)
        self.syn_sheds_total = 0  # times the kernel dropped strangers' SYNs for a while (a full handshake queue)
