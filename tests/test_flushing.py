"""Flusher (metalog.broker.server.flushing): where a replica's fdatasync runs.

By default every replica syncs on the event-loop thread, inside the call
that starts the flush, and the host hears of it before that call returns;
with ``storage.leader_flush_thread`` a leader's sync runs on the flush
thread and its completion comes back to the loop. Either way the host is
told the flushed end the sync returned, once, and a flush asked for while
one runs is started after it (group commit never overlaps them)."""

from __future__ import annotations

import threading

from metalog.broker.server.flushing import Flusher
from metalog.broker.server.metrics import BrokerMetrics
from metalog.storage.group_commit import GroupCommit
from tests.net.helpers import wait_for_condition


class _Host:
    """The driver's side of FlushHost, recording what the flusher told it."""

    fatal = None

    def __init__(self) -> None:
        self.flushed_ends: list[int] = []

    def flushed(self, flushed_end_offset: int) -> None:
        self.flushed_ends.append(flushed_end_offset)

    def release_writes(self) -> None:
        pass

    def storage_failed(self, reason, exc=None) -> None:
        raise AssertionError(f"storage failed: {reason}")

    def fail(self, cause, reason, exc=None, **fields) -> None:
        raise AssertionError(f"failed: {cause} {reason}")


def _flusher(on_thread: bool, sync_threads: list[str]) -> tuple[Flusher, _Host]:
    host = _Host()
    end = [0]

    def flush_log() -> int:  # stands for SegmentedLog.flush: returns the flushed end
        sync_threads.append(threading.current_thread().name)
        end[0] += 10
        return end[0]

    flusher = Flusher(host, GroupCommit(0.0, 4096), flush_log, lambda: end[0], lambda: on_thread,
                      BrokerMetrics(node_id=1), None)
    return flusher, host


async def test_by_default_the_sync_runs_on_the_loop_thread_and_is_reported_before_start_returns():
    threads: list[str] = []
    flusher, host = _flusher(False, threads)
    flusher.request(executing=False)
    assert threads == [threading.current_thread().name]
    assert host.flushed_ends == [10]
    flusher.request(executing=False)
    assert host.flushed_ends == [10, 20]
    flusher.close()


async def test_with_leader_flush_thread_the_sync_runs_on_the_flush_thread_and_comes_back_to_the_loop():
    threads: list[str] = []
    flusher, host = _flusher(True, threads)
    flusher.request(executing=False)
    flusher.request(executing=False)  # asked while the first runs: started after it, not beside it
    await wait_for_condition(lambda: host.flushed_ends == [10, 20], timeout_s=10, what="both flushes reported")
    assert threads == ["flush", "flush"]
    flusher.close()


async def test_a_flush_asked_mid_step_starts_when_the_driver_says_the_step_is_done():
    threads: list[str] = []
    flusher, host = _flusher(False, threads)
    flusher.request(executing=True)
    assert host.flushed_ends == [] and threads == []
    # True: the sync ran here and its end reached the host (the driver's
    # follower then leaves the step's bookkeeping to the FlushCompleted step's).
    assert flusher.start_if_wanted() is True
    assert host.flushed_ends == [10]
    assert flusher.start_if_wanted() is False  # nothing wanted: nothing ran
    flusher.close()


async def test_start_if_wanted_is_false_when_the_sync_went_to_the_flush_thread():
    threads: list[str] = []
    flusher, host = _flusher(True, threads)
    flusher.request(executing=True)
    assert flusher.start_if_wanted() is False  # its end comes back to the loop later
    await wait_for_condition(lambda: host.flushed_ends == [10], timeout_s=10, what="the flush reported")
    flusher.close()
