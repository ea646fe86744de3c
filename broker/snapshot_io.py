"""The runtime's snapshot work (asyncio side of KIP-630 snapshots).

* Downloads: the core's ``WriteSnapshotChunk`` actions fill a partial file;
  ``InstallSnapshot`` verifies and publishes it, resets the log and the
  digest to its end and loads it into the controller, or rolls back cleanly
  (the partial is deleted, the log kept) and hands back the
  ``SnapshotInstallFailed`` event the core must see next.
* Our own snapshots: after records are applied, ``broker.snapshot_policy``
  says whether one is due; the state is copied a slice at a time on the loop
  (broker/state_copy.py), written from that copy on a worker thread, one at a
  time, then fed to the core as ``SnapshotCreated``.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Callable

from broker.controller import load_snapshot, write_controller_snapshot
from broker.quorum import api as qa
from broker.quorum.voters import voters_record
from broker.snapshot_policy import SnapshotPolicy
from broker.state_copy import IncrementalCopy
from protocol import messages as m
from storage.errors import StorageError
from storage.snapshot import PartialSnapshot

if TYPE_CHECKING:  # the runtime imports this module: no cycle at run time
    from broker.runtime import Broker


class SnapshotWork:
    def __init__(self, broker: "Broker", min_records: int, now_ms: Callable[[], int],
                 feed: Callable[[qa.Event], None]):
        self.broker = broker  # its log, snapshot store, digest, controller, core, metrics and logger
        self.policy = SnapshotPolicy(min_records)
        self._now_ms = now_ms
        self._feed = feed  # steps the core with an event
        self._partials: dict[m.SnapshotId, PartialSnapshot] = {}  # downloads in progress
        self.task: asyncio.Task | None = None  # our own snapshot being written

    # -- downloads from the leader --------------------------------------------
    def write_chunk(self, a: qa.WriteSnapshotChunk) -> None:
        part = self._partials.get(a.snapshot_id)
        if part is None or a.position == 0:
            if part is not None:
                part.abort()
            part = self._partials[a.snapshot_id] = self.broker.snapshots.partial(a.snapshot_id)
        part.write_at(a.position, a.data)

    def install(self, a: qa.InstallSnapshot) -> qa.SnapshotInstallFailed | None:
        b = self.broker
        sid = a.snapshot_id
        part = self._partials.pop(sid, None)
        if part is None:
            b.log.error("snapshot_install_without_download", snapshot=[sid.end_offset, sid.epoch])
            return None
        t0 = time.perf_counter()
        try:
            part.complete(a.size)
        except (StorageError, OSError, ValueError) as exc:
            # Clean rollback: the partial goes, the log stays, the core goes back
            # to it and downloads again (api.SnapshotInstallFailed).
            part.abort()
            b.log.error("snapshot_download_rejected", snapshot=[sid.end_offset, sid.epoch],
                        error=str(exc), action="partial deleted, log kept, downloading again")
            return qa.SnapshotInstallFailed(self._now_ms(), sid, str(exc))
        t_checked = time.perf_counter()
        b.seg_log.truncate_fully(sid.end_offset)
        b.digest.reset(sid.end_offset)
        b.snapshots.delete_before(sid)
        t_loading = time.perf_counter()
        b.controller.load(load_snapshot(b.snapshots, sid))
        t_done = time.perf_counter()
        b.metrics.snapshot_load_seconds.observe(t_done - t0)
        # Where an install's time goes: the download's check and fsync, the
        # log's truncation, the load.
        b.log.info("snapshot_installed", snapshot=[sid.end_offset, sid.epoch], size=a.size,
                   seconds=round(t_done - t0, 4), check_s=round(t_checked - t0, 4),
                   truncate_s=round(t_loading - t_checked, 4), load_s=round(t_done - t_loading, 4))
        return None

    # -- our own snapshots ------------------------------------------------------
    def maybe_start(self) -> None:
        b = self.broker
        snap_id = self.policy.next_snapshot(
            records_since_snapshot=b.controller.records_since_snapshot,
            applied_offset=b.controller.applied_offset, epoch_for_offset=b.core.epochs.epoch_for_offset,
            exists=lambda sid: b.snapshots.size(sid) is not None, busy=self.task is not None or b.stopping)
        if snap_id is None:
            return
        self.task = asyncio.get_running_loop().create_task(self._take())

    async def _take(self) -> None:
        """Copy the state a slice at a time (the loop and the applying go on
        between slices: a copy in one go held the loop ~430 ms at 2M
        partitions), then write it on a worker thread. The snapshot ends
        where the state is when the copy finishes."""
        b = self.broker
        try:
            state = b.controller.state
            copy = IncrementalCopy(state)
            try:
                while not copy.step():
                    await asyncio.sleep(0)
                    if b.controller.state is not state or b.stopping:
                        return  # replaced by an installed snapshot, or stopping: not ours to write
                frozen = copy.finish()
            finally:
                copy.abort()
            end = frozen.offset
            snap_id = m.SnapshotId(end, b.core.epochs.epoch_for_offset(end - 1))
            if b.snapshots.size(snap_id) is not None:
                return
            b.controller.snapshot_taken(end)
            await self._write(snap_id, frozen, voters_record(b.core.voter_set_at(end)))
        finally:
            self.task = None

    async def _write(self, snap_id: m.SnapshotId, frozen, voters) -> None:
        b = self.broker
        t0 = time.perf_counter()
        try:
            result = await asyncio.to_thread(write_controller_snapshot, b.snapshots, frozen, snap_id,
                                             int(time.time() * 1000), b.cfg.cluster_id, voters=voters)
            size = result.size_bytes
        except Exception as exc:  # noqa: BLE001 - logged; the next due point tries again
            b.log.error("snapshot_write_failed", snapshot=[snap_id.end_offset, snap_id.epoch], error=str(exc))
            return
        seconds = time.perf_counter() - t0
        b.metrics.snapshot_generation_seconds.observe(seconds)
        b.metrics.snapshot_bytes.set(size)
        b.log.info("snapshot_created", snapshot=[snap_id.end_offset, snap_id.epoch], size=size,
                   seconds=round(seconds, 4))
        self._feed(qa.SnapshotCreated(self._now_ms(), snap_id))

    async def wait(self, timeout_s: float) -> None:
        """Bound the wait for a snapshot being written (it logs its own failure)."""
        if self.task is not None:
            await asyncio.wait([self.task], timeout=timeout_s)
