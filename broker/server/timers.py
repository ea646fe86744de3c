"""The runtime's timers: the core's next deadline, and the loop-idle sampler.

Time reaches the quorum core only as ``Tick`` events (``metalog.broker.quorum.api``
rule 5). After every step the driver asks ``CoreTimer.schedule`` to arm one
asyncio timer for ``QuorumCore.next_deadline_ms``; a deadline already due
ticks at once (at most once per step). A timer armed for an earlier deadline
stays armed; when it fires before the core's deadline it re-arms, without a Tick.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Protocol

from metalog.broker.server.clocks import now_ms
from metalog.broker.server.metrics import IDLE_SAMPLE_S, LoopIdleRatio


class Deadlines(Protocol):
    """What the timer reads of the quorum core."""

    @property
    def next_deadline_ms(self) -> int | None: ...


class CoreTimer:
    def __init__(self, core: Deadlines, tick: Callable[[], None], stopping: Callable[[], bool]):
        self._core = core
        self._tick = tick  # steps the core with a Tick of now
        self._stopping = stopping
        self._timer: asyncio.TimerHandle | None = None
        self._timer_deadline_ms: int | None = None
        self._ticking_now = False  # inside the immediate Tick of schedule

    def schedule(self) -> None:
        """Arm the timer for the core's next deadline (after each step)."""
        deadline_ms = self._core.next_deadline_ms
        if deadline_ms is None or self._stopping():
            return
        delay_ms = deadline_ms - now_ms()
        if delay_ms <= 0 and not self._ticking_now:
            # Due already -- e.g. replica fetches woken by this step's append
            # that its own bytes could not answer (LeaderReads.complete_parked
            # answers the usual one in the step itself): tick now rather than a timer
            # hop later, so the records reach the followers while our own
            # fsync runs (Kafka's and etcd's leaders write to followers in
            # parallel with their disk write; the HW still counts our log only
            # up to its flushed end). One immediate tick per step at most: a
            # deadline that stays due goes through the timer below. A timer
            # already armed stays: the tick's own step re-arms it if need be.
            self._ticking_now = True
            try:
                self._tick()
            finally:
                self._ticking_now = False
            return
        if self._timer is not None:
            if self._timer_deadline_ms is not None and self._timer_deadline_ms <= deadline_ms:
                # Armed for this deadline or an earlier one: leave it (a cancel
                # and a call_later per step were 2% of a leader's CPU; most
                # steps only move deadlines later). Firing early, it re-arms
                # instead of ticking (_on_timer).
                return
            self._timer.cancel()
        self._timer_deadline_ms = deadline_ms
        self._timer = asyncio.get_running_loop().call_later(max(0.0, delay_ms / 1000), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_deadline_ms = None
        deadline_ms = self._core.next_deadline_ms
        if deadline_ms is not None and deadline_ms > now_ms() and not self._stopping():
            self.schedule()  # armed for a deadline that has since moved later
            return
        self._tick()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


class IdleSampler:
    """Samples the loop thread's CPU time every IDLE_SAMPLE_S for
    poll-idle-ratio-avg (metalog.broker.server.metrics)."""

    def __init__(self, loop_idle: LoopIdleRatio, stopping: Callable[[], bool]):
        self._loop_idle = loop_idle
        self._stopping = stopping
        self._timer: asyncio.TimerHandle | None = None

    def sample(self) -> None:
        self._loop_idle.sample()
        if not self._stopping():
            self._timer = asyncio.get_running_loop().call_later(IDLE_SAMPLE_S, self.sample)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
