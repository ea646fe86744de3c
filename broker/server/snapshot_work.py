"""The runtime's snapshot work (asyncio side of KIP-630 snapshots).

* Downloads: the core's ``WriteSnapshotChunk`` actions fill a partial file,
  whose batches are checked and loaded as they arrive (the load overlaps
  the download); ``InstallSnapshot`` verifies and publishes it, resets the
  log and the digest to its end and hands the state to the controller, or
  rolls back cleanly (the partial is deleted, the log kept) and hands back
  the ``SnapshotInstallFailed`` event the core must see next.
* Our own snapshots: after records are applied, ``metalog.broker.server.snapshot_policy``
  says whether one is due; one at a time, fed to the core as
  ``SnapshotCreated`` once durable. ``storage.snapshot_generation`` says how:
  ``fork`` (default) writes it in a child process whose memory is the state
  at that instant (broker/server/snapshot_fork.py); ``thread`` copies the state a
  slice at a time on the loop (broker/controller/state_copy.py) and writes the copy on
  a worker thread, which shares the GIL with the loop.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Protocol

from metalog.broker.controller.state import (Controller, SnapshotLoader, SnapshotLoadError, load_snapshot,
                                             write_controller_snapshot)
from metalog.broker.quorum import api as qa
from metalog.broker.quorum.voters import VoterSet, voters_record
from metalog.broker.server.consistency import LogDigest
from metalog.broker.server.metrics import BrokerMetrics
from metalog.broker.server.snapshot_fork import ForkedWrite, fork_available
from metalog.broker.server.snapshot_policy import SnapshotPolicy
from metalog.broker.controller.state_copy import IncrementalCopy
from metalog.protocol import messages as m
from metalog.storage import batch as sb
from metalog.storage.epochs import EpochHistory
from metalog.storage.errors import StorageError
from metalog.storage.segments import SegmentedLog
from metalog.storage.snapshot import (CorruptSnapshotError, PartialSnapshot, SnapshotStore, generation_part_path,
                                      verify_snapshot_file)

SNAPSHOT_GENERATIONS = ("fork", "thread")


class SnapshotCore(Protocol):
    """What snapshot work reads of the quorum core."""

    @property
    def epochs(self) -> EpochHistory: ...

    def voter_set_at(self, end_offset: int) -> VoterSet: ...


class SnapshotHost(Protocol):
    """What snapshot work uses of the broker. The log, the store, the digest
    and the controller exist once the broker has started; so does the core,
    which only our own snapshots read (an install never does)."""

    @property
    def seg_log(self) -> SegmentedLog: ...

    @property
    def snapshots(self) -> SnapshotStore: ...

    @property
    def digest(self) -> LogDigest: ...

    @property
    def controller(self) -> Controller: ...

    @property
    def core(self) -> SnapshotCore: ...

    @property
    def cluster_id(self) -> str: ...

    @property
    def stopping(self) -> bool: ...

    @property
    def metrics(self) -> BrokerMetrics: ...

    @property
    def log(self) -> Any: ...

    def unlink_later(self, path: str) -> None:
        """Unlink a file already renamed out of the store's view, off the loop."""

    def storage_failed(self, reason: str, exc: BaseException | None = None) -> None: ...


class SnapshotWork:
    def __init__(self, broker: SnapshotHost, min_records: int, now_ms: Callable[[], int],
                 feed: Callable[[qa.Event], None], generation: str = "fork", cpu_share: float = 1.0):
        if generation not in SNAPSHOT_GENERATIONS:
            raise ValueError(f"snapshot_generation must be one of {', '.join(SNAPSHOT_GENERATIONS)}, "
                             f"got {generation!r}")
        if not 0.0 < cpu_share <= 1.0:
            raise ValueError(f"snapshot_cpu_share must be in (0, 1], got {cpu_share}")
        self.cpu_share = cpu_share  # of one CPU, for the writer (metalog.broker.controller.state._paced)
        self.broker = broker
        self.policy = SnapshotPolicy(min_records)
        self._now_ms = now_ms
        self._feed = feed  # steps the core with an event
        self._partials: dict[m.SnapshotId, PartialSnapshot] = {}  # downloads in progress
        self._loads: dict[m.SnapshotId, _StreamedLoad] = {}  # the newest download's load
        self.task: asyncio.Task | None = None  # our own snapshot being written
        if generation == "fork" and not fork_available():
            broker.log.warning("snapshot_fork_unavailable", action="snapshots written on a worker thread",
                               consequence="commit latency rises while a snapshot is written")
            generation = "thread"
        self.generation = generation
        self._child: ForkedWrite | None = None  # the fork path's child while it writes

    # -- downloads from the leader --------------------------------------------
    def write_chunk(self, a: qa.WriteSnapshotChunk) -> None:
        try:
            part = self._partials.get(a.snapshot_id)
            if part is None or a.position == 0:
                # A download begins (the core starts one at position 0 whenever it finds
                # the leader's snapshot): every other partial is superseded. One download
                # on disk and one load in memory at most: a download cut off by a partition,
                # the leader's snapshot newer by the heal, left its .part (and an open file)
                # until the next append or boot (the drill's partition_snapshot found it).
                self.abandon_downloads()
                load = self._loads[a.snapshot_id] = _StreamedLoad(a.snapshot_id)
                part = self._partials[a.snapshot_id] = self.broker.snapshots.partial(a.snapshot_id, load.add)
            part.write_at(a.position, a.data)
        except OSError as exc:
            # A full disk (ENOSPC, EFBIG) or a failing one: fail-stop as for
            # an append, after deleting the partial so that its space is
            # free for the restart, which downloads again.
            self.abandon_downloads()
            self.broker.storage_failed(f"snapshot download {a.snapshot_id.end_offset}-{a.snapshot_id.epoch}: "
                                       f"write of {len(a.data)} bytes at position {a.position} failed: "
                                       f"{exc.strerror or exc}", exc)

    def abandon_downloads(self) -> None:
        """The follower is appending the leader's log: any download it had
        begun is given up (the core starts a new one at position 0). Its
        partial file and partly loaded state go now, not at the next boot."""
        for part in self._partials.values():
            part.abort()
        self._partials.clear()
        self._loads.clear()

    @property
    def downloading(self) -> bool:
        return bool(self._partials)

    def install(self, a: qa.InstallSnapshot) -> qa.SnapshotInstallFailed | None:
        b = self.broker
        sid = a.snapshot_id
        part = self._partials.pop(sid, None)
        load = self._loads.pop(sid, None)
        if part is None:
            b.log.error("snapshot_install_without_download", snapshot=[sid.end_offset, sid.epoch])
            return None
        t0_s = time.perf_counter()
        # Whether every batch was checked and loaded as it came: the state is ready.
        loader = load.loader if load is not None and load.error is None and part.streamed else None
        streamed = loader is not None
        try:
            part.complete(a.size)
        except (StorageError, OSError, ValueError) as exc:
            # Clean rollback: the partial goes, the log stays, the core goes back
            # to it and downloads again (api.SnapshotInstallFailed).
            part.abort()
            b.log.error("snapshot_download_rejected", snapshot=[sid.end_offset, sid.epoch],
                        error=str(exc), action="partial deleted, log kept, downloading again")
            return qa.SnapshotInstallFailed(self._now_ms(), sid, str(exc))
        checked_s = time.perf_counter()
        # Before the log is reset, the file is read back from disk with every
        # CRC checked again (a CRC pass: tens of milliseconds at 150 MB; the
        # load itself is done): a bad byte rolls back as a bad download does,
        # with the log and older snapshots still there. A streamed load that
        # failed is made again from the file, which says what is wrong as a
        # boot's load would.
        try:
            if loader is not None:
                verify_snapshot_file(b.snapshots.path(sid), sid)
                state = loader.finish()
            else:
                state = load_snapshot(b.snapshots, sid)
        except CorruptSnapshotError as exc:
            b.snapshots.quarantine(sid)
            b.log.error("snapshot_download_rejected", snapshot=[sid.end_offset, sid.epoch], error=str(exc),
                        action="snapshot quarantined, log kept, downloading again")
            return qa.SnapshotInstallFailed(self._now_ms(), sid, str(exc))
        loaded_s = time.perf_counter()
        b.seg_log.truncate_fully(sid.end_offset)
        b.digest.reset(sid.end_offset)
        b.snapshots.delete_before(sid, unlink=b.unlink_later)
        b.controller.load(state)
        done_s = time.perf_counter()
        b.metrics.snapshot_load_seconds.observe(done_s - t0_s)
        # Where an install's time goes: the download's check and fsync, the
        # log's truncation, the load.
        b.log.info("snapshot_installed", snapshot=[sid.end_offset, sid.epoch], size=a.size,
                   loaded_while_downloading=streamed,
                   seconds=round(done_s - t0_s, 4), check_s=round(checked_s - t0_s, 4),
                   load_s=round(loaded_s - checked_s, 4), truncate_s=round(done_s - loaded_s, 4))
        return None

    # -- our own snapshots ------------------------------------------------------
    def maybe_start(self) -> None:
        b = self.broker
        busy = self.task is not None or b.stopping
        if not self.policy.due(b.controller.records_since_snapshot, busy):
            return  # before next_snapshot's arguments are built: this runs after every apply
        snap_id = self.policy.next_snapshot(
            records_since_snapshot=b.controller.records_since_snapshot,
            applied_offset=b.controller.applied_offset, epoch_for_offset=b.core.epochs.epoch_for_offset,
            exists=lambda sid: b.snapshots.size(sid) is not None, busy=busy)
        if snap_id is None:
            return
        take = self._take_forked() if self.generation == "fork" else self._take()
        self.task = asyncio.get_running_loop().create_task(take)

    async def _take_forked(self) -> None:
        """Fork now: the child's memory is the state at this instant, the
        snapshot ends at its offset. Nothing is copied on the loop; the fork
        itself costs the copy of the page tables (milliseconds)."""
        b = self.broker
        try:
            state = b.controller.state
            end = state.offset
            snap_id = m.SnapshotId(end, b.core.epochs.epoch_for_offset(end - 1))
            if b.snapshots.size(snap_id) is not None:
                return
            voters = voters_record(b.core.voter_set_at(end))
            part_path = generation_part_path(b.snapshots.directory, snap_id)
            store, ts_ms, cluster_id = b.snapshots, int(time.time() * 1000), b.cluster_id
            cpu_share = self.cpu_share

            def write() -> dict:  # runs in the child
                res = write_controller_snapshot(store, state, snap_id, ts_ms, cluster_id, voters=voters,
                                                part_path=part_path, cpu_share=cpu_share)
                return {"size": res.size_bytes, "records": res.records, "write_ms": round(res.elapsed_ms, 1)}

            # Taken before the fork: a failed attempt waits for the next due
            # point instead of being retried at every applied batch.
            b.controller.snapshot_taken(end)
            child = ForkedWrite(write, part_path)
            t0_s = time.perf_counter()
            try:
                child.start()
            except OSError as exc:  # EAGAIN/ENOMEM: no child, nothing written
                b.metrics.snapshot_generation_failures.labels(path="fork").inc()
                b.log.error("snapshot_write_failed", snapshot=[snap_id.end_offset, snap_id.epoch], path="fork",
                            error=f"fork failed: {exc}", action="nothing written; the next due point tries again")
                return
            fork_ms = (time.perf_counter() - t0_s) * 1000
            self._child = child
            try:
                res = await child.wait()
            finally:
                self._child = None
            if not res.ok and b.stopping:
                b.log.info("snapshot_abandoned", snapshot=[snap_id.end_offset, snap_id.epoch], path="fork",
                           reason="broker stopping", child_exit=res.exit_status)
                return
            if not res.ok or res.value is None:
                b.metrics.snapshot_generation_failures.labels(path="fork").inc()
                b.log.error("snapshot_write_failed", snapshot=[snap_id.end_offset, snap_id.epoch], path="fork",
                            pid=res.pid, child_exit=res.exit_status, error=res.error,
                            action="partial file removed; the next due point tries again")
                return
            self._created(snap_id, "fork", res.value["size"], res.seconds, fork_ms=round(fork_ms, 2),
                          pid=res.pid, records=res.value["records"], child_memory=res.value.get("child_memory"))
        finally:
            self.task = None

    async def _take(self) -> None:
        """The thread path. Copy the state a slice at a time (the loop and the applying go on
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
        t0_s = time.perf_counter()
        try:
            result = await asyncio.to_thread(write_controller_snapshot, b.snapshots, frozen, snap_id,
                                             int(time.time() * 1000), b.cluster_id, voters=voters,
                                             cpu_share=self.cpu_share)
            size_bytes = result.size_bytes
        except Exception as exc:  # noqa: BLE001 - logged; the next due point tries again
            b.metrics.snapshot_generation_failures.labels(path="thread").inc()
            b.log.error("snapshot_write_failed", snapshot=[snap_id.end_offset, snap_id.epoch], path="thread",
                        error=str(exc))
            return
        self._created(snap_id, "thread", size_bytes, time.perf_counter() - t0_s)

    def _created(self, snap_id: m.SnapshotId, path: str, size_bytes: int, seconds: float, **fields: Any) -> None:
        b = self.broker
        b.metrics.snapshot_generation_seconds.observe(seconds)
        b.metrics.snapshot_generations.labels(path=path).inc()
        b.metrics.snapshot_bytes.set(size_bytes)
        b.log.info("snapshot_created", snapshot=[snap_id.end_offset, snap_id.epoch], size=size_bytes,
                   seconds=round(seconds, 4), path=path, **fields)
        self._feed(qa.SnapshotCreated(self._now_ms(), snap_id))

    async def wait(self, timeout_s: float) -> None:
        """At stop: bound the wait for a snapshot being written (it logs its
        own failure). A forked child is killed at once (the log holds all it
        would have written; a 2M-partition snapshot takes tens of seconds)."""
        if self.task is None:
            return
        if self._child is not None:
            self._child.kill()
        await asyncio.wait([self.task], timeout=timeout_s)


class _StreamedLoad:
    """A download's SnapshotLoader, fed each data batch once checked. A batch
    it cannot load stops it (the state is dropped); the install then loads
    the file, which reports the error as a boot's load would."""

    __slots__ = ("loader", "error")

    def __init__(self, snapshot_id: m.SnapshotId) -> None:
        self.loader: SnapshotLoader | None = SnapshotLoader(snapshot_id)
        self.error: Exception | None = None

    def add(self, batch: memoryview, h: sb.BatchHeader) -> None:
        if self.loader is None:
            return
        try:
            self.loader.add_batch(batch, h)
        except (sb.CorruptBatchError, SnapshotLoadError) as exc:
            self.error = exc
            self.loader = None
