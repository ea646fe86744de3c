"""The log's fsyncs (group commit's flush side), and the unlink thread.

The core asks for a flush with ``FlushLog``; nothing it counts toward the
high watermark is acknowledged before the flush says it is durable
(``FlushCompleted``). One fdatasync covers every append that happened
before it started (group commit), and flushes never overlap
(``metalog.storage.group_commit.GroupCommit`` says when to start one).

Every replica syncs on the loop thread by default, as Kafka's raft thread
does (see ``Flusher.start``); ``storage.leader_flush_thread`` moves a
leader's fdatasync to a thread of its own, for disks whose sync takes
milliseconds. Old snapshot and segment files, renamed ``.deleted`` on the
loop, are unlinked on a second thread (``Unlinker``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import queue
import threading
import time
from typing import Any, Callable, Protocol

from metalog.broker.server.commit_trace import CommitTrace
from metalog.broker.server.metrics import BrokerMetrics
from metalog.storage.errors import StorageError
from metalog.storage.group_commit import GroupCommit


class FlushHost(Protocol):
    """What the flusher needs of the driver."""

    @property
    def fatal(self) -> str | None: ...

    def flushed(self, flushed_end_offset: int) -> None:
        """Everything below `flushed_end_offset` is durable: tell the core."""

    def release_writes(self) -> None:
        """Hand the writes that waited for this flush to the core (one batch)."""

    def storage_failed(self, reason: str, exc: BaseException | None = None) -> None: ...

    def fail(self, cause: str, reason: str, exc: BaseException | None = None, **fields: Any) -> None: ...


class Flusher:
    def __init__(self, host: FlushHost, group_commit: GroupCommit, flush_log: Callable[[], int],
                 log_end_offset: Callable[[], int], on_thread: Callable[[], bool], metrics: BrokerMetrics,
                 trace: CommitTrace | None):
        self._host = host
        self._gc = group_commit
        self._flush_log = flush_log  # fdatasync of the log; returns the flushed end offset
        self._log_end_offset = log_end_offset  # for the commit trace's flush_start mark
        self._on_thread = on_thread  # this flush goes to the flush thread (a leader with leader_flush_thread)
        self._metrics = metrics
        self._trace = trace
        # With leader_flush_thread a leader's fdatasyncs run here, one at a time (group commit never overlaps them).
        self._flush_thread = _FlushThread()
        self.start_wanted = False  # a FlushLog of the current step, started when the step ends
        self.completions = 0  # flushes whose end stepped the core (FlushCompleted)
        self._abandoned = False  # stopping is past its drain: completions are no longer fed

    def request(self, executing: bool) -> None:
        """The core's FlushLog. Mid-step (`executing`) the flush starts at the
        end of the step, after its sends (and the immediate Tick's, which
        answers the parked replica fetches this append woke): the flush
        thread's start then does not compete for the GIL with the encryption
        of those answers."""
        if self._gc.request_flush():
            if executing:
                self.start_wanted = True
            else:
                self.start()

    def start_if_wanted(self) -> bool:
        """Start the flush the step asked for (the driver calls this once the
        step's sends are out). True when it ran here and its end stepped the
        core (FlushCompleted): not on the flush thread, not failed."""
        if self.start_wanted and self._host.fatal is None:
            self.start_wanted = False
            completions = self.completions
            self.start()
            return self.completions != completions
        return False

    def start(self) -> None:
        """Start one fdatasync now, in this loop turn (not a task that starts
        a turn later).

        It runs on the loop thread, as Kafka's raft thread syncs: a
        follower's next Fetch reports the flushed end, so it has nothing to
        do on the commit path until the sync ends; a leader starts it after
        the step's answers are written (AnswerWrites), so its records are on
        their way to the followers while it syncs. A thread's two hand-offs
        cost more than they overlap: with the sync on a flush thread a leader
        waited ~0.3 ms for the thread to start and ~0.45 ms for the loop to
        see the end around a 0.35 ms fdatasync (GIL and wake-ups), and one
        client's commit p50 was 10-20% slower (docs/bench.md). With
        ``leader_flush_thread`` a leader hands it to the flush thread
        instead, and its completion comes back with one call_soon_threadsafe
        (_done): for disks whose sync takes milliseconds, where blocking the
        loop would cost more than the hand-offs."""
        gc = self._gc
        gc.flush_starting()
        if self._trace is not None:
            self._trace.mark("flush_start", self._log_end_offset())
        started_s = time.perf_counter()
        if not self._on_thread():
            try:
                flushed = self._flush_log()
            except (OSError, StorageError) as exc:
                self._done(-1, exc, started_s)  # _done's fail-stop, as from the thread
                return
            except Exception as exc:  # noqa: BLE001 - as from the thread: fatal, never swallowed
                gc.flush_stopped()
                self._host.fail("flush_failed", f"flush raised {type(exc).__name__}: {exc}", exc=exc)
                return
            self._done(flushed, None, started_s)
            return
        loop = asyncio.get_running_loop()
        flush_log = self._flush_log
        done = self._done

        def flush() -> None:  # on the flush thread
            exc: BaseException | None = None
            flushed = -1
            try:
                flushed = flush_log()
            except BaseException as err:  # noqa: BLE001 - handed to _done on the loop, as an executor's Future would
                exc = err
            try:
                loop.call_soon_threadsafe(done, flushed, exc, started_s)
            except RuntimeError:
                pass  # the loop is closed: the broker stopped, nothing waits for this flush

        self._flush_thread.submit(flush)

    def _done(self, flushed: int, exc: BaseException | None, started_s: float) -> None:
        gc = self._gc
        host = self._host
        if self._abandoned or host.fatal is not None:
            gc.flush_stopped()  # stopping flushes on its own; a failed broker acknowledges nothing
            return
        if exc is not None:
            if isinstance(exc, (OSError, StorageError)):
                gc.flush_stopped()
                host.storage_failed(f"flush failed: {exc}", exc)
                return
            raise exc  # anything else escapes to the loop's exception handler: fatal
        self._metrics.flush_seconds.observe(time.perf_counter() - started_s)
        if self._trace is not None:
            self._trace.mark("flush_done", flushed)
        host.flushed(flushed)
        self.completions += 1
        if gc.flush_completed():
            host.release_writes()
        if self._failed():  # the step or the writes may have failed the broker
            gc.flush_stopped()
        elif gc.flush_again():
            self.start()

    def _failed(self) -> bool:
        return self._host.fatal is not None

    def abandon(self) -> None:
        """Stopping: completions are no longer fed to the core."""
        self._abandoned = True

    def close(self) -> None:
        self._flush_thread.stop()


class _FlushThread:
    """The leader's flush thread: a bare queue and one daemon thread, rather
    than an executor's Future, Condition and work item per flush (about 3% of
    a leader's CPU at one client). Bounded: group commit never starts a flush
    before the last one completed, so the queue holds one job at most (and
    the stop)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="flush", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()

    def stop(self) -> None:
        """The thread ends after the job it runs, if any (not waited for)."""
        if self._thread is not None:
            self._jobs.put(None)


class Unlinker:
    """Old snapshot and segment files, renamed .deleted on the loop, are
    unlinked on a thread of their own: a 150 MB unlink held the loop about
    30 ms. A few per snapshot, so the queue is bounded by the files there
    are; boot removes any left over."""

    def __init__(self, logger: Any):
        self._log = logger
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="unlink")

    def unlink_later(self, path: str) -> None:
        """Unlink a file already out of every store's view (renamed .deleted) on the unlink thread."""
        log = self._log

        def unlink() -> None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:  # left for boot's cleanup; the file is out of use already
                log.error("unlink_failed", path=path, error=str(exc), action="boot removes it")

        self._executor.submit(unlink)

    def close(self) -> None:
        self._executor.shutdown(wait=False)  # a file not unlinked yet is boot's to remove
