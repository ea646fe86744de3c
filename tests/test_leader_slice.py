"""metalog.broker.server.leader_slice: the event-loop thread's scheduler slice follows the role."""

from __future__ import annotations

import os
import threading

import pytest
import structlog.testing

from metalog.broker.server.leader_slice import LeaderSlice, set_thread_slice_ns


def _own_slice_ns() -> int | None:
    with open(f"/proc/self/task/{threading.get_native_id()}/sched") as f:
        for line in f:
            if line.startswith("se.slice"):
                return int(line.split(":")[1])
    return None


def _in_a_thread(fn):
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))  # not the test runner's own thread
    t.start()
    t.join()
    return out[0]


def test_a_thread_gets_the_slice_it_asks_for_keeps_its_nice_value_and_goes_back_to_the_default():
    def run():
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, 3)  # raising one's own nice value needs no privilege
        before = _own_slice_ns()
        asked = set_thread_slice_ns(250_000)
        during = _own_slice_ns()
        nice = os.getpriority(os.PRIO_PROCESS, tid)
        back = set_thread_slice_ns(0)
        return before, asked, during, nice, back, _own_slice_ns()

    before, asked, during, nice, back, after = _in_a_thread(run)
    assert asked is None and back is None
    assert nice == 3  # the call kept the thread's nice value
    if before is None:
        pytest.fail("this kernel shows no se.slice in /proc: the test needs Linux 6.6+")
    assert during == 250_000
    assert after == before != 250_000


def test_the_slice_follows_the_role_and_a_refusal_is_logged_once():
    asked: list[int] = []
    with structlog.testing.capture_logs() as logs:
        s = LeaderSlice(100, structlog.get_logger(), lambda ns: asked.append(ns))
        s.apply(False)  # a follower from the start: the kernel's default, nothing to ask
        s.apply(True)
        s.apply(True)
        s.apply(False)
        assert asked == [100_000, 0] and logs == []
        refused = LeaderSlice(100, structlog.get_logger(), lambda ns: "sched_setattr: Operation not permitted")
        refused.apply(True)
        refused.apply(False)
        refused.apply(True)
    assert [(e["event"], e["reason"]) for e in logs] == [("leader_slice_unavailable",
                                                         "sched_setattr: Operation not permitted")]


def test_zero_leaves_the_kernels_default_and_a_slice_below_the_kernels_range_is_refused():
    asked: list[int] = []
    s = LeaderSlice(0, structlog.get_logger(), asked.append)
    s.apply(True)
    assert asked == []
    with pytest.raises(ValueError, match="leader_slice_us must be 0 or 100-100000, got 50"):
        LeaderSlice(50, structlog.get_logger())
