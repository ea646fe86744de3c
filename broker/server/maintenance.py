"""The broker's background upkeep, started once it serves: the scrubber
(re-reads sealed data, ``metalog.storage.scrub``), the leader's consistency
check (``consistency_check.py``) and the garbage-collection watch
(``gc_watch.py``). None of them steps the core: a scrubber's find goes to
corruption handling on the loop, a divergence to /health.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from metalog.broker.server.config import BrokerConfig
from metalog.broker.server.consistency_check import ConsistencyChecker
from metalog.broker.server.gc_watch import GcWatch
from metalog.broker.server.metrics import BrokerMetrics
from metalog.storage.errors import CorruptionReport
from metalog.storage.scrub import Scrubber
from metalog.storage.segments import SegmentedLog
from metalog.storage.snapshot import SnapshotStore


class Maintenance:
    def __init__(self, cfg: BrokerConfig, seg_log: SegmentedLog, snapshots: SnapshotStore, metrics: BrokerMetrics,
                 logger: Any, *, corruption_found: Callable[[CorruptionReport, str], None],
                 task_done: Callable[[asyncio.Task[Any]], None]):
        self._cfg = cfg
        self._seg_log = seg_log
        self._snapshots = snapshots
        self._metrics = metrics
        self._log = logger
        self._corruption_found = corruption_found  # on the loop: report and react
        self._task_done = task_done  # an exception ending the check's task is fatal
        self.scrubber: Scrubber | None = None
        self._gc_watch: GcWatch | None = None
        self._consistency_task: asyncio.Task[None] | None = None

    def start(self, checker: ConsistencyChecker) -> None:
        """Start the scrubber, the GC watch and, if consistency_check_interval_ms is above 0, `checker`."""
        cfg = self._cfg
        loop = asyncio.get_running_loop()
        if cfg.storage.consistency_check_interval_ms > 0:
            self._consistency_task = loop.create_task(checker.run())
            self._consistency_task.add_done_callback(self._task_done)

        def found(report: CorruptionReport) -> None:  # on the scrubber's thread: handled on the loop
            loop.call_soon_threadsafe(self._corruption_found, report, "scrub")

        self.scrubber = Scrubber(self._seg_log, self._snapshots, cfg.storage.log_scrub_bytes_per_s, found,
                                 logger=self._log, metrics=self._metrics,
                                 idle_wait_ms=cfg.storage.log_scrub_idle_wait_ms)
        self.scrubber.start()
        self._gc_watch = GcWatch(self._metrics.gc_pause_seconds, self._log)
        self._gc_watch.install(young_threshold=cfg.gc_young_threshold)

    def new_snapshot(self) -> None:
        """A new snapshot file (written or installed): the scrubber reads it soon, not at its next pass."""
        if self.scrubber is not None:
            self.scrubber.notify()

    def cancel_check(self) -> None:
        if self._consistency_task is not None:
            self._consistency_task.cancel()

    async def stop(self) -> None:
        if self.scrubber is not None:
            await asyncio.to_thread(self.scrubber.stop)
        if self._gc_watch is not None:
            self._gc_watch.remove()
