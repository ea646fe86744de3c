"""CoreTimer (metalog.broker.server.timers): the core is ticked when its next
deadline is due, never before it, however often that deadline moves; a
timer armed for a deadline that moved later stays armed and, firing early,
re-arms instead of ticking."""

from __future__ import annotations

import asyncio

from metalog.broker.server.clocks import now_ms
from metalog.broker.server.timers import CoreTimer
from tests.net.helpers import wait_for_condition


class _Core:
    def __init__(self, deadline_ms: int | None):
        self.next_deadline_ms = deadline_ms


def _timer(core: _Core, ticks: list[int]) -> CoreTimer:
    def tick() -> None:
        ticks.append(now_ms())
        core.next_deadline_ms = None  # the tick's step: nothing due any more

    return CoreTimer(core, tick, stopping=lambda: False)


async def _first_tick(ticks: list[int], within_s: float = 10.0) -> int:
    await wait_for_condition(lambda: ticks, within_s, "a tick")
    return ticks[0]


async def test_a_deadline_moved_later_is_ticked_at_the_later_time_only():
    ticks: list[int] = []
    core = _Core(now_ms() + 40)
    timer = _timer(core, ticks)
    timer.schedule()  # armed for +40 ms
    later_ms = now_ms() + 300
    core.next_deadline_ms = later_ms
    timer.schedule()  # left armed for +40 ms: it fires early and re-arms
    assert await _first_tick(ticks) >= later_ms
    await asyncio.sleep(0.05)
    assert len(ticks) == 1
    timer.cancel()


async def test_a_deadline_moved_earlier_is_ticked_at_the_earlier_time():
    ticks: list[int] = []
    start_ms = now_ms()
    core = _Core(start_ms + 60_000)
    timer = _timer(core, ticks)
    timer.schedule()
    earlier_ms = now_ms() + 50
    core.next_deadline_ms = earlier_ms
    timer.schedule()
    at_ms = await _first_tick(ticks)
    assert earlier_ms <= at_ms < start_ms + 60_000
    timer.cancel()


async def test_a_due_deadline_is_ticked_inside_schedule():
    ticks: list[int] = []
    core = _Core(now_ms() + 60_000)
    timer = _timer(core, ticks)
    timer.schedule()
    core.next_deadline_ms = now_ms() - 1  # due (replica fetches woken by this step's append)
    timer.schedule()
    assert len(ticks) == 1  # now, not a loop turn later
    timer.cancel()
