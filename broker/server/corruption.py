"""What the broker does about damaged data found while it runs (issue 12).

Corruption is found by the scrubber, by a read answering a Fetch, by the
controller's apply and by the producer-state rebuild. Each find is reported
once per (file, position): one structured ``corruption_detected`` error
event, ``metalog_corrupt_batches_total`` and /health "degraded" with the
reason. Then the broker reacts:

* damage in the log, with another copy in the quorum: the storage
  quarantines the log from the damaged batch (``SegmentedLog.quarantine_from``)
  and the core is told (``LogQuarantined``): a leader resigns, a voter
  abstains until it has re-replicated past the end it had;
* damage in the log of a sole voter: no other copy exists, truncating would
  lose committed records: fail-stop, naming the command that truncates;
* a damaged snapshot: kept as ``.corrupt``, never served, and a leader
  steps down so that a replica with a sound snapshot leads.

A damaged batch in a fetch ANSWER (``FetchedBatchCorrupt``) is not a disk
problem: the core dropped it and fetches it again; it is counted and
warned about, rate-limited.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

from metalog.broker.quorum import api as qa
from metalog.broker.server.clocks import now_ms
from metalog.broker.server.consistency import LogDigest
from metalog.broker.server.metrics import BrokerMetrics
from metalog.broker.server.recovery import no_copy_message
from metalog.storage.errors import CorruptionReport, StorageError
from metalog.storage.segments import SegmentedLog

FETCHED_CORRUPT_WARN_INTERVAL_MS = 1000  # at most one fetched_batch_corrupt warning per second


class CorruptionCore(Protocol):
    """What corruption handling reads of the quorum core."""

    @property
    def is_leader(self) -> bool: ...

    @property
    def leader_id(self) -> int: ...

    @property
    def log_end_offset(self) -> int: ...


class CorruptionHost(Protocol):
    """What corruption handling needs of the driver: whether it is still
    running, and the ways it reacts."""

    @property
    def fatal(self) -> str | None: ...

    def feed(self, event: qa.Event) -> None:
        """Step the core with `event` (right after the current step's actions if mid-step)."""

    def rebuild_producers(self) -> None:
        """Rebuild the producer state from the log (after a quarantine cut)."""

    def storage_failed(self, reason: str, exc: BaseException | None = None) -> None: ...

    def fail(self, cause: str, reason: str, exc: BaseException | None = None, **fields: Any) -> None: ...


class CorruptionHandler:
    def __init__(self, host: CorruptionHost, core: CorruptionCore, seg_log: SegmentedLog, digest: LogDigest, *,
                 sole_voter: bool, data_dir: str, metrics: BrokerMetrics, logger: Any,
                 health_problems: dict[str, str], seen: set[tuple[str, int]]):
        self._host = host
        self._core = core
        self._seg_log = seg_log
        self._digest = digest
        self._sole_voter = sole_voter  # no other copy of our log exists: corruption is fatal
        self._data_dir = data_dir
        self._metrics = metrics
        self._log = logger
        self._health_problems = health_problems  # /health's reasons, shared with the driver
        self._seen = seen  # (file, position) already reported (boot's finds included)
        # fetched_batch_corrupt warnings are rate-limited (fetched_corrupt).
        self.fetched_warned_ms = -FETCHED_CORRUPT_WARN_INTERVAL_MS
        self._fetched_suppressed = 0

    def report(self, report: CorruptionReport, source: str = "scrub") -> None:
        """Corruption found (by the scrubber, a read, a fetch): one structured
        error event, the metric, /health degraded with the reason, then the
        reaction. Reported once per (file, position)."""
        key = (report.path, report.position)
        if key in self._seen:
            return
        self._seen.add(key)
        self._log.error("corruption_detected", source=source, **report.as_log_fields())
        self._metrics.corrupt_batches.labels(source=source).inc()
        self._health_problems[f"corruption:{report.path}"] = (
            f"corrupt data in {report.path} at byte {report.position} (offset {report.base_offset}, "
            f"found by {source}): {report.reason}")
        if self._host.fatal is None:
            self._react(report)

    def found_by_read(self, error: Any) -> None:
        """The core's CorruptionFound: a read through its LogReader raised `error`."""
        report = getattr(error, "report", None)
        if report is None:
            report = CorruptionReport("", -1, None, None, None, None, str(error))
        self.report(report, "fetch")

    def fetched_corrupt(self, a: qa.FetchedBatchCorrupt) -> None:
        """A fetch answer held a damaged batch (the core dropped it and
        fetches it again): counted every time, one warning per batch but at
        most one per FETCHED_CORRUPT_WARN_INTERVAL_MS, naming how many were
        not logged since -- a leader that keeps sending the same damage must
        not flood the log. Not a disk problem: no quarantine, /health unchanged."""
        self._metrics.corrupt_batches.labels(source="fetched").inc()
        current_ms = now_ms()
        if current_ms - self.fetched_warned_ms < FETCHED_CORRUPT_WARN_INTERVAL_MS:
            self._fetched_suppressed += 1
            return
        self._log.warning("fetched_batch_corrupt", leader_id=self._core.leader_id,
                          epoch=a.fetch_epoch, offset=a.base_offset, reason=a.reason,
                          suppressed=self._fetched_suppressed, action="dropped; fetching it again")
        self.fetched_warned_ms = current_ms
        self._fetched_suppressed = 0

    def quarantine_cleared(self, must_reach_offset: int) -> None:
        """The core's ClearQuarantine: the flushed log reached must_reach_offset
        again; the persisted quarantine state goes and the voter votes again."""
        self._seg_log.clear_quarantine()
        self._health_problems.pop("quarantine", None)
        self._log.info("quarantine_cleared", must_reach_offset=must_reach_offset,
                       log_end_offset=self._seg_log.log_end_offset)

    def _react(self, report: CorruptionReport) -> None:
        """Issue 12 item 4: quarantine through the storage and tell the core
        (LogQuarantined): a leader resigns, a voter abstains until it has
        re-replicated past the end it had. With no other copy (one voter) the
        broker stops instead: truncating would lose committed records."""
        if report.path.endswith(".checkpoint"):
            self._snapshot_corrupt(report)
            return
        if self._sole_voter:
            # The report's own reason is in the message: as a field it would
            # collide with fail()'s `reason` (a TypeError instead of the fatal event).
            fields: dict[str, Any] = {k: v for k, v in report.as_log_fields().items() if k != "reason"}
            self._host.fail("corruption_no_other_copy", no_copy_message(report, self._data_dir), **fields)
            return
        seg_log = self._seg_log
        try:
            state = seg_log.quarantine_from(report)
        except ValueError as exc:
            # Not a live segment any more (deleted by a log-start move, or already
            # cut by an earlier report): nothing of the current log is affected.
            self._log.warning("corruption_not_in_current_log", error=str(exc), file=report.path)
            return
        except (StorageError, OSError) as exc:
            self._host.storage_failed(f"quarantine failed: {exc}", exc)
            return
        self._digest.truncate(seg_log.log_end_offset)
        self._host.rebuild_producers()
        self._health_problems["quarantine"] = (
            f"log cut to {seg_log.log_end_offset} after corruption; not voting until the log "
            f"reaches {state.must_reach_offset} again")
        self._host.feed(qa.LogQuarantined(now_ms(), seg_log.log_end_offset, state.must_reach_offset))

    def _snapshot_corrupt(self, report: CorruptionReport) -> None:
        """A snapshot failed verification: keep it for the operator as .corrupt
        (never deleted), never serve it; a leader steps down (a LogQuarantined
        that cuts nothing: it resigns and votes again at once) so that a replica
        with a sound snapshot leads."""
        try:
            os.replace(report.path, report.path + ".corrupt")
        except FileNotFoundError:
            pass
        if self._core.is_leader:
            end = self._core.log_end_offset
            self._host.feed(qa.LogQuarantined(now_ms(), end, end))

