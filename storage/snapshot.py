"""KIP-630 snapshot files: write, verify, read, serve by chunks, download, clean up.

A snapshot ``<20-digit end offset>-<10-digit epoch>.checkpoint`` holds the
controller state reflecting every record with offset < end_offset. Its bytes
are record batches (``metalog.storage.batch``), all with leader epoch = snapshot
epoch and offsets counting from 0 within the file::

    control batch  SnapshotHeader   (offset 0)
    control batch  KRaftVersionRecord + VotersRecord (offsets 1, 2; only
                   with a voter set in the log: KIP-853, kraft version 1)
    data batches   metadata records (offsets 1.. or 3..)
    control batch  SnapshotFooter   (last)

Every batch carries a CRC. A file is trusted only when every CRC matches, the
header comes first, the footer last and nothing follows it.

Life cycle of files in the directory (names as in Kafka's raft module):

* ``<name>-<random>.checkpoint.part``: being written (generation) or
  ``<name>-fetch.checkpoint.part``: being downloaded (FetchSnapshot). Renamed
  to ``<name>.checkpoint`` after fsync; leftovers are deleted at boot.
* ``<name>.checkpoint.deleted``: marked for deletion (rename then unlink, so
  a crash in between never leaves a half-deleted file looking valid).
* ``<name>.checkpoint.corrupt``: refused at boot or load; kept for forensics,
  never listed and never loaded.
"""

from __future__ import annotations

import builtins
import os
import re
import threading
import uuid
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Literal, Sequence, overload

import structlog

from metalog.protocol.invariants import InvariantViolation, invariant
from metalog.protocol.messages import SnapshotId
from metalog.storage import batch as b
from metalog.storage import control_records as cr
from metalog.storage.atomic import fsync_dir
from metalog.storage.errors import CorruptionReport, StorageError

if TYPE_CHECKING:  # numpy: imported at run time by the loader only
    from metalog.storage.partition_runs import PartitionRun

log = structlog.get_logger(__name__)

SUFFIX = ".checkpoint"
PART_SUFFIX = ".checkpoint.part"
DELETED_SUFFIX = ".checkpoint.deleted"
CORRUPT_SUFFIX = ".checkpoint.corrupt"
_NAME = re.compile(r"(\d{20})-(\d{10})\.checkpoint")
# Kafka's bootstrap checkpoint (KIP-853): `storage format --standalone` or
# `--initial-controllers` writes the first voter set there. It is read at
# boot for that set only; it is not a snapshot of the log (never listed,
# served, loaded or deleted as one).
BOOTSTRAP_SNAPSHOT_ID = SnapshotId(0, 0)


class CorruptSnapshotError(StorageError):
    """A snapshot file that must not be loaded; says which file and where."""

    def __init__(self, path: str, position: int, reason: str):
        super().__init__(f"{path}: corrupt snapshot at byte {position}: {reason}")
        self.path = path
        self.position = position
        self.reason = reason
        self.report = CorruptionReport(path, position, None, None, None, None, reason)


class SnapshotNotFoundError(StorageError):
    pass


class PositionOutOfRangeError(StorageError):
    pass


class SnapshotInvariantError(StorageError):
    """The log cannot be used: it starts past 0 but no snapshot covers its start
    (KIP-630: treat the log as empty and bootstrap from the leader)."""


def snapshot_filename(snapshot_id: SnapshotId) -> str:
    invariant(0 <= snapshot_id.end_offset < 10**20 and 0 <= snapshot_id.epoch < 10**10,
              "snapshot id %r does not fit the file name's digits", snapshot_id)
    return f"{snapshot_id.end_offset:020d}-{snapshot_id.epoch:010d}{SUFFIX}"


def parse_snapshot_filename(name: str) -> SnapshotId | None:
    """The id of a complete snapshot's file name, None for any other name."""
    mt = _NAME.fullmatch(name)
    if mt is None:
        return None
    return SnapshotId(int(mt.group(1)), int(mt.group(2)))


# ------------------------------------------------------------------ writing


def generation_part_path(directory: str, snapshot_id: SnapshotId) -> str:
    """A fresh ``<name>-<random>.checkpoint.part`` for one generation."""
    stem = snapshot_filename(snapshot_id)[: -len(SUFFIX)]
    return os.path.join(os.fspath(directory), f"{stem}-{uuid.uuid4().hex}{PART_SUFFIX}")


class SnapshotWriter:
    """Writes one snapshot: header, data batches of at most ~batch_bytes_max,
    footer; ``freeze()`` makes it durable and visible atomically."""

    def __init__(self, directory: str, snapshot_id: SnapshotId,
                 last_contained_log_timestamp_ms: int, cluster_id: str = "",
                 batch_bytes_max: int = 1 << 20, timestamp_ms: int | None = None,
                 voters: cr.VotersRecord | None = None, part_path: str | None = None,
                 sync_every_bytes: int | None = None) -> None:
        invariant(batch_bytes_max > 0 and (sync_every_bytes is None or sync_every_bytes > 0),
                  "batch_bytes_max %r, sync_every_bytes %r", batch_bytes_max, sync_every_bytes)
        self.directory = os.fspath(directory)
        self.snapshot_id = snapshot_id
        self.final_path = os.path.join(self.directory, snapshot_filename(snapshot_id))
        # part_path: chosen by a caller that must clean up after a writer that
        # dies without aborting (a forked child killed mid-write).
        self.part_path = part_path or generation_part_path(self.directory, snapshot_id)
        invariant(os.path.dirname(self.part_path) == self.directory and self.part_path.endswith(PART_SUFFIX),
                  "part file %r outside %r", self.part_path, self.directory)
        self.batch_bytes_max = batch_bytes_max
        self._timestamp_ms = (last_contained_log_timestamp_ms if timestamp_ms is None
                              else timestamp_ms)
        self._file = open(self.part_path, "xb", buffering=1 << 20)
        # sync_every_bytes: write back as it goes, so that the final fsync does
        # not push the whole file at once and stall every other fdatasync on
        # the disk (the log's commits) behind it.
        self._sync_every_bytes = sync_every_bytes
        self._unsynced_bytes = 0
        self._next_offset = 0
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._closed = False
        self._write_batch([cr.encode_control(cr.SnapshotHeader(
            last_contained_log_timestamp_ms, cluster_id))], control=True)
        if voters is not None:
            # KIP-853: the voter set of the log below end_offset travels with it.
            self._write_batch([cr.encode_control(cr.KRaftVersionRecord(1)), cr.encode_control(voters)],
                              control=True)

    def _write_batch(self, records: list[bytes], control: bool = False) -> None:
        data = b.encode_batch(self._next_offset, self.snapshot_id.epoch, records,
                              self._timestamp_ms, is_control=control)
        self._file.write(data)
        self._next_offset += len(records)
        if self._sync_every_bytes is not None:
            self._unsynced_bytes += len(data)
            if self._unsynced_bytes >= self._sync_every_bytes:
                self._file.flush()
                os.fdatasync(self._file.fileno())
                self._unsynced_bytes = 0

    def _flush_pending(self) -> None:
        if self._pending:
            self._write_batch(self._pending)
            self._pending = []
            self._pending_bytes = 0

    def append(self, records: Sequence[bytes]) -> None:
        invariant(not self._closed, "snapshot writer already frozen or aborted")
        for value in records:
            self._pending.append(value)
            self._pending_bytes += len(value) + 4
            if self._pending_bytes >= self.batch_bytes_max:
                self._flush_pending()

    def write_all(self, values: Iterable[bytes]) -> tuple[str, int, int]:
        """Append every value, then freeze; abort (no .part left) on any error.
        Returns (path, size in bytes, number of records)."""
        count = 0
        try:
            for value in values:
                self.append((value,))
                count += 1
            path, size = self.freeze()
        except BaseException:
            self.abort()
            raise
        return path, size, count

    def freeze(self) -> tuple[str, int]:
        """Footer, fsync, close, rename to .checkpoint, fsync the directory.
        Returns (path, size in bytes)."""
        invariant(not self._closed, "snapshot writer already frozen or aborted")
        self._flush_pending()
        self._write_batch([cr.encode_control(cr.SnapshotFooter())], control=True)
        self._file.flush()
        os.fsync(self._file.fileno())
        size = self._file.tell()
        self._file.close()
        self._closed = True
        if os.path.exists(self.final_path):
            os.unlink(self.part_path)
            raise FileExistsError(f"snapshot {self.final_path} already exists")
        os.rename(self.part_path, self.final_path)
        fsync_dir(self.directory)
        return self.final_path, size

    def abort(self) -> None:
        if not self._closed:
            self._file.close()
            self._closed = True
        try:
            os.unlink(self.part_path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> "SnapshotWriter":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None or not self._closed:
            self.abort()


# ------------------------------------------------------------------ reading


@dataclass
class SnapshotLayout:
    """Where the data batches of a verified snapshot file are."""

    header: cr.SnapshotHeader
    data_batches: list[tuple[int, b.BatchHeader]]  # (position, header)
    size_bytes: int
    records: int
    voters: cr.VotersRecord | None = None  # KIP-853: the voter set it holds, if any


class _SnapshotCheck:
    """The structure checks of a snapshot, fed one whole batch at a time in
    file order (by verify_snapshot_bytes, or by verify_snapshot_file reading
    a bounded block at a time): raises CorruptSnapshotError naming `path`
    and the byte position."""

    def __init__(self, snapshot_id: SnapshotId, path: str) -> None:
        self.snapshot_id = snapshot_id
        self.path = path
        self.batches: list[tuple[int, b.BatchHeader]] = []
        self.expected_offset = 0
        self.end = 0
        self.footer_seen = False
        self.header: cr.SnapshotHeader | None = None
        self.voters: cr.VotersRecord | None = None

    def batch(self, pos: int, h: b.BatchHeader, view: memoryview) -> None:
        """`view`: the batch's bytes (CRC already checked), starting at file position `pos`."""
        path = self.path
        self.end = pos + h.size
        if self.footer_seen:
            raise CorruptSnapshotError(path, pos, "batch after the SnapshotFooter")
        if h.base_offset != self.expected_offset:
            raise CorruptSnapshotError(
                path, pos, f"batch offset {h.base_offset}, expected {self.expected_offset}")
        if h.leader_epoch != self.snapshot_id.epoch:
            raise CorruptSnapshotError(
                path, pos, f"batch epoch {h.leader_epoch}, snapshot epoch {self.snapshot_id.epoch}")
        self.expected_offset = h.next_offset
        if h.is_control:
            try:
                values = b.decode_records(view, h)
                recs = [cr.decode_control(v) for v in values]
            except b.CorruptBatchError as exc:
                raise CorruptSnapshotError(path, pos + exc.position, str(exc)) from exc
            except cr.ControlRecordError as exc:
                raise CorruptSnapshotError(path, pos, str(exc)) from exc
            if pos == 0:
                if not recs or not isinstance(recs[0], cr.SnapshotHeader):
                    raise CorruptSnapshotError(path, 0, "first batch is not a SnapshotHeader")
                self.header = recs[0]
                if len(recs) == 3 and self._voter_set(recs[1:]):
                    pass  # Kafka 4.x writes the voter set in the header's batch
                elif len(recs) != 1:
                    raise CorruptSnapshotError(path, 0, "the SnapshotHeader's batch holds more than the header "
                                                        "and a voter set (KRaftVersion, KRaftVoters)")
            elif len(recs) == 1 and isinstance(recs[0], cr.SnapshotFooter):
                self.footer_seen = True
            elif self.voters is None and not self.batches and self._voter_set(recs):
                pass  # right after the header, before any data (the batch metalog writes)
            else:
                raise CorruptSnapshotError(path, pos, "unexpected control batch")
        elif pos == 0:
            raise CorruptSnapshotError(path, 0, "first batch is not a SnapshotHeader")
        else:
            self.batches.append((pos, h))

    def _voter_set(self, recs: list[cr.ControlRecord]) -> bool:
        """KRaftVersion then KRaftVoters (KIP-853): kept as the snapshot's voter set."""
        if len(recs) == 2 and isinstance(recs[0], cr.KRaftVersionRecord) and isinstance(recs[1], cr.VotersRecord):
            self.voters = recs[1]
            return True
        return False

    def finish(self, size_bytes: int) -> SnapshotLayout:
        path, end = self.path, self.end
        if size_bytes == 0:
            raise CorruptSnapshotError(path, 0, "empty file")
        if end != size_bytes:
            raise CorruptSnapshotError(
                path, end, f"truncated: {size_bytes - end} byte(s) after the last whole batch")
        if self.header is None:
            raise CorruptSnapshotError(path, 0, "no SnapshotHeader (file shorter than one batch)")
        if not self.footer_seen:
            raise CorruptSnapshotError(path, end, "truncated: no SnapshotFooter")
        return SnapshotLayout(self.header, self.batches, size_bytes,
                              sum(h.records_count for _, h in self.batches), self.voters)


def verify_snapshot_bytes(data: bytes | memoryview, snapshot_id: SnapshotId,
                          path: str) -> SnapshotLayout:
    """Check every CRC and the header/data/footer structure; raise
    CorruptSnapshotError naming `path` and the byte position otherwise."""
    view = memoryview(data)
    size = len(view)
    if size == 0:
        raise CorruptSnapshotError(path, 0, "empty file")
    check = _SnapshotCheck(snapshot_id, path)
    try:
        for pos, h in b.iter_batches(view):
            check.batch(pos, h, view[pos:pos + h.size])
    except b.CorruptBatchError as exc:
        raise CorruptSnapshotError(path, exc.position, str(exc)) from exc
    return check.finish(size)


# Bytes read at a time when a snapshot file is verified or loaded: memory for
# a check stays this plus one batch, whatever the snapshot's size.
READ_BLOCK_BYTES = 4 << 20


def verify_snapshot_fd(fd: int, snapshot_id: SnapshotId, path: str,
                       block_bytes: int = READ_BLOCK_BYTES, on_read: Callable[[int], None] | None = None,
                       stop: threading.Event | None = None) -> SnapshotLayout | None:
    """verify_snapshot_bytes on an open file, read block by block (os.pread:
    the fd's offset is not used) instead of whole: a 150 MB snapshot used to
    be held in RAM whole for its check, on top of the state it holds.

    on_read(n) after each read of n bytes (the scrubber's rate limit); None
    is returned only if `stop` is set before the check is done."""
    invariant(block_bytes > 0, "block_bytes %r must be positive", block_bytes)
    check = _SnapshotCheck(snapshot_id, path)
    buf = bytearray(block_bytes)  # one buffer, reused: its bytes [0, filled) are the file's from `base`
    base = filled = 0
    while True:
        if stop is not None and stop.is_set():
            return None
        if filled == len(buf):
            # One batch longer than the buffer (batch headers bound it to
            # MAX_BATCH_BYTES): make room for it.
            buf += bytes(len(buf))
        with memoryview(buf) as mv:
            n = os.preadv(fd, [mv[filled:]], base + filled)
        if n == 0:
            break
        if on_read is not None:
            on_read(n)
        filled += n
        end = 0
        view = memoryview(buf)
        try:
            for pos, h in b.iter_batches(view[:filled]):
                check.batch(base + pos, h, view[pos:pos + h.size])
                end = pos + h.size
        except b.CorruptBatchError as exc:
            raise CorruptSnapshotError(path, base + exc.position, str(exc)) from exc
        finally:
            view.release()
        buf[:filled - end] = buf[end:filled]  # the batch not yet whole moves to the front
        base += end
        filled -= end
    return check.finish(base + filled)


def verify_snapshot_file(path: str, snapshot_id: SnapshotId) -> SnapshotLayout:
    fd = os.open(path, os.O_RDONLY)
    try:
        layout = verify_snapshot_fd(fd, snapshot_id, path)
    finally:
        os.close(fd)
    if layout is None:
        raise InvariantViolation("no stop event, yet the check stopped")
    return layout


def verify_snapshot(path: str) -> tuple[SnapshotId, SnapshotLayout]:
    name = os.path.basename(path)
    sid = parse_snapshot_filename(name)
    if sid is None:
        raise CorruptSnapshotError(path, 0, f"{name!r} is not a snapshot file name "
                                            "(<20-digit offset>-<10-digit epoch>.checkpoint)")
    return sid, verify_snapshot_file(path, sid)


# The voter set sits in the batch after the header: this much is read to find it.
VOTERS_READ_BYTES = 1 << 20


def read_snapshot_voters(path: str) -> cr.VotersRecord | None:
    """The voter set a snapshot holds (KIP-853), None when it holds none
    (static voters). Reads only the file's first batches: for a snapshot
    already verified as a whole (boot loads it first)."""
    with open(path, "rb") as f:
        data = f.read(VOTERS_READ_BYTES)
    try:
        for i, (pos, h) in enumerate(b.iter_batches(data)):
            if i == 0:
                continue  # the SnapshotHeader
            if not h.is_control or h.records_count != 2:
                return None
            recs = [cr.decode_control(v) for v in b.decode_records(memoryview(data)[pos:pos + h.size], h)]
            return recs[1] if isinstance(recs[1], cr.VotersRecord) else None
    except (b.CorruptBatchError, cr.ControlRecordError) as exc:
        raise CorruptSnapshotError(path, 0, f"unreadable voter set: {exc}") from exc
    return None


@overload
def read_snapshot(path: str, partition_runs: Literal[False] = False
                  ) -> tuple[SnapshotId, cr.SnapshotHeader, Iterator[bytes]]: ...


@overload
def read_snapshot(path: str, partition_runs: bool
                  ) -> tuple[SnapshotId, cr.SnapshotHeader, Iterator[bytes | PartitionRun]]: ...


def read_snapshot(path: str, partition_runs: bool = False
                  ) -> tuple[SnapshotId, cr.SnapshotHeader, Iterator[bytes | PartitionRun]]:
    """Verify the whole file first (so a bad file never yields a record), then
    return its id, header and an iterator over the data record values.

    Both passes read a block or a batch at a time, never the whole file: the
    loader's memory is the state it builds, not the state plus the file. The
    second pass checks each batch's CRC again (the file is read twice).

    partition_runs: runs of common-shape PartitionRecords come as
    metalog.storage.partition_runs.PartitionRun items instead of one value each (the
    controller's load applies them as columns)."""
    name = os.path.basename(path)
    sid = parse_snapshot_filename(name)
    if sid is None:
        raise CorruptSnapshotError(path, 0, f"{name!r} is not a snapshot file name")
    layout = verify_snapshot_file(path, sid)

    def values() -> Iterator[bytes | PartitionRun]:
        if partition_runs:
            from metalog.storage import partition_runs as pr  # numpy: imported by the loader only

            names = pr.TopicNames()
        with open(path, "rb", buffering=0) as f:
            fd = f.fileno()
            for pos, h in layout.data_batches:
                batch = os.pread(fd, h.size, pos)
                if len(batch) != h.size:
                    raise CorruptSnapshotError(path, pos + len(batch), "file shrank after its check")
                try:
                    b.verify_crc(batch, 0, h)
                    if partition_runs and not h.attributes & b.ATTR_CONTROL:
                        yield from pr.iter_batch(batch, h, names)
                        continue
                    records = b.decode_records(batch, h)
                except b.CorruptBatchError as exc:
                    raise CorruptSnapshotError(path, pos + exc.position, f"changed after its check: {exc}") from exc
                yield from records

    return sid, layout.header, values()


# ------------------------------------------------------------------ download


class PartialSnapshot:
    """A snapshot being downloaded chunk by chunk (FetchSnapshot follower side).

    The file name is fixed per id so a driver can recreate this object for each
    chunk. A download cut off by a crash leaves the `.part` that boot deletes.

    Chunks written in order from position 0 are checked as they come (CRCs
    and structure, the checks of verify_snapshot_file), so ``complete`` does
    not read the whole file back (at 150 MB about a fifth of a catch-up's
    install); a chunk out of order, or an object made mid-download, makes
    ``complete`` verify the file from disk instead. A corrupt chunk is
    reported by ``complete``, as a corrupt file is.

    `on_data_batch`, if given, is handed each data batch once checked, in
    file order (the controller's SnapshotLoader: the load overlaps the
    download). ``streamed`` says whether it saw every one exactly once;
    if not (a chunk out of order, a restart at 0), load from the file.
    """

    def __init__(self, directory: str, snapshot_id: SnapshotId,
                 on_data_batch: Callable[[memoryview, b.BatchHeader], None] | None = None) -> None:
        self.directory = os.fspath(directory)
        self.snapshot_id = snapshot_id
        self._on_data_batch = on_data_batch
        stem = snapshot_filename(snapshot_id)[: -len(SUFFIX)]
        self.part_path = os.path.join(self.directory, f"{stem}-fetch{PART_SUFFIX}")
        self.final_path = os.path.join(self.directory, snapshot_filename(snapshot_id))
        # The streaming check: None when the bytes written are not known in order.
        self._check: _SnapshotCheck | None = None
        self._batches = b.BatchStream()  # the whole batches before its position are checked
        self._written = 0  # bytes written in order from position 0
        self._error: CorruptSnapshotError | None = None

    def size_bytes(self) -> int:
        try:
            return os.path.getsize(self.part_path)
        except FileNotFoundError:
            return 0

    def write_at(self, position: int, data: bytes) -> None:
        """Position 0 starts afresh; otherwise position must not leave a hole."""
        if position == 0:
            fd = os.open(self.part_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        else:
            have = self.size_bytes()
            if position < 0 or position > have:
                raise PositionOutOfRangeError(
                    f"{self.part_path}: chunk at position {position} but only {have} "
                    "byte(s) downloaded")
            fd = os.open(self.part_path, os.O_WRONLY)
        try:
            view = memoryview(data)
            pos = position
            while view:
                n = os.pwrite(fd, view, pos)
                view = view[n:]
                pos += n
        finally:
            os.close(fd)
        self._feed(position, data)

    def _feed(self, position: int, data: bytes) -> None:
        """Check the whole batches that `data` completes (see the class doc)."""
        if position == 0:
            if self._check is not None or self._written:
                self._on_data_batch = None  # it has seen batches that are gone now
            self._check = _SnapshotCheck(self.snapshot_id, self.part_path)
            self._batches, self._written, self._error = b.BatchStream(), 0, None
        if self._check is None or position != self._written:
            self._check = None  # not in order: complete() reads the file back
            self._on_data_batch = None
            return
        self._written += len(data)
        if self._error is not None:
            return
        try:
            for pos, h, view in self._batches.feed(data):
                self._check.batch(pos, h, view)
                if self._on_data_batch is not None and not h.is_control:
                    self._on_data_batch(view, h)
        except b.CorruptBatchError as exc:
            self._error = CorruptSnapshotError(self.part_path, exc.position, str(exc))
        except CorruptSnapshotError as exc:
            self._error = exc

    @property
    def streamed(self) -> bool:
        """Whether on_data_batch was handed every data batch of the bytes
        written, once each, in order, all of them checked."""
        return (self._on_data_batch is not None and self._check is not None and self._error is None
                and self._written == self.size_bytes() and self._batches.position == self._written)

    def complete(self, size_bytes: int) -> str:
        """Verify the size and every CRC, fsync, rename to .checkpoint, fsync dir.
        A bad download is deleted and CorruptSnapshotError raised."""
        try:
            have = self.size_bytes()
            if have != size_bytes:
                raise CorruptSnapshotError(
                    self.part_path, have, f"download has {have} byte(s), leader said {size_bytes}")
            if self._check is not None and self._written == have:
                if self._error is not None:
                    raise self._error
                self._check.finish(have)  # every byte was checked as it was written
            else:
                verify_snapshot_file(self.part_path, self.snapshot_id)
        except CorruptSnapshotError:
            self.abort()
            raise
        fd = os.open(self.part_path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(self.part_path, self.final_path)
        fsync_dir(self.directory)
        return self.final_path

    def abort(self) -> None:
        try:
            os.unlink(self.part_path)
        except FileNotFoundError:
            pass


# ------------------------------------------------------------------ the directory


@dataclass
class BootReport:
    removed_leftovers: list[str] = field(default_factory=list)  # .part / .deleted
    removed_below_start: list[SnapshotId] = field(default_factory=list)
    corrupt: list[tuple[str, str]] = field(default_factory=list)  # (file name, reason)
    snapshots: list[SnapshotId] = field(default_factory=list)  # valid, ascending


class SnapshotStore:
    """The snapshot files of one log directory."""

    def __init__(self, directory: str) -> None:
        self.directory = os.fspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        # (inode, size, mtime_ns) of the files read_chunk verified in full:
        # FetchSnapshot chunks cut batches anywhere, so a snapshot is verified
        # whole when a download starts (position 0), not per chunk.
        self._verified: dict[SnapshotId, tuple[int, int, int]] = {}

    def path(self, snapshot_id: SnapshotId) -> str:
        return os.path.join(self.directory, snapshot_filename(snapshot_id))

    def list(self) -> list[SnapshotId]:
        """Complete snapshots (by file name), ascending."""
        ids = [sid for sid in map(parse_snapshot_filename, os.listdir(self.directory))
               if sid is not None and sid != BOOTSTRAP_SNAPSHOT_ID]
        return sorted(ids)

    def bootstrap_voters(self) -> cr.VotersRecord | None:
        """The voter set of the bootstrap checkpoint (KIP-853), None without
        one. CorruptSnapshotError if it is damaged (verified whole first)."""
        path = self.path(BOOTSTRAP_SNAPSHOT_ID)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        verify_snapshot_bytes(data, BOOTSTRAP_SNAPSHOT_ID, path)
        voters = read_snapshot_voters(path)
        if voters is None:
            raise CorruptSnapshotError(path, 0, "the bootstrap checkpoint holds no voter set")
        return voters

    def write_bootstrap(self, voters: cr.VotersRecord, cluster_id: str) -> str:
        """Write the bootstrap checkpoint durably (refuses to replace one)."""
        path = self.path(BOOTSTRAP_SNAPSHOT_ID)
        if os.path.exists(path):
            raise FileExistsError(path)
        w = SnapshotWriter(self.directory, BOOTSTRAP_SNAPSHOT_ID, 0, cluster_id, voters=voters)
        w.freeze()
        return path

    def latest(self) -> SnapshotId | None:
        ids = self.list()
        return ids[-1] if ids else None

    def size(self, snapshot_id: SnapshotId) -> int | None:
        try:
            return os.path.getsize(self.path(snapshot_id))
        except FileNotFoundError:
            return None

    def read_chunk(self, snapshot_id: SnapshotId, position: int, bytes_max: int) -> bytes:
        """Bytes [position, position + bytes_max) for FetchSnapshot."""
        try:
            fd = os.open(self.path(snapshot_id), os.O_RDONLY)
        except FileNotFoundError:
            raise SnapshotNotFoundError(f"no snapshot {snapshot_filename(snapshot_id)}") from None
        try:
            st = os.fstat(fd)
            size = st.st_size
            if position < 0 or position >= size:
                raise PositionOutOfRangeError(
                    f"position {position} outside snapshot "
                    f"{snapshot_filename(snapshot_id)} of {size} byte(s)")
            ident = (st.st_ino, size, st.st_mtime_ns)
            if position == 0 or self._verified.get(snapshot_id) != ident:
                # Raises CorruptSnapshotError: never serve a damaged snapshot.
                verify_snapshot_fd(fd, snapshot_id, self.path(snapshot_id))  # no stop: never None
                self._verified[snapshot_id] = ident
            return os.pread(fd, max(0, min(bytes_max, size - position)), position)
        finally:
            os.close(fd)

    def partial(self, snapshot_id: SnapshotId,
                on_data_batch: Callable[[memoryview, b.BatchHeader], None] | None = None) -> PartialSnapshot:
        return PartialSnapshot(self.directory, snapshot_id, on_data_batch)

    def delete(self, snapshot_id: SnapshotId, unlink: Callable[[str], None] | None = None) -> None:
        """Rename to .deleted, then unlink: a crash in between leaves a file
        that boot deletes, never a half-deleted .checkpoint. `unlink`, if
        given, is handed the renamed path instead of unlinking it here: on
        this machine's disk (mounted with discard) a 150 MB unlink takes
        about 30 ms, a stall if made on the event loop."""
        path = self.path(snapshot_id)
        marked = path[: -len(SUFFIX)] + DELETED_SUFFIX
        try:
            os.rename(path, marked)
        except FileNotFoundError:
            return
        (unlink or os.unlink)(marked)

    def delete_before(self, snapshot_id: SnapshotId,
                      unlink: Callable[[str], None] | None = None) -> builtins.list[SnapshotId]:
        """Delete every snapshot older than `snapshot_id` (`unlink`: see delete)."""
        gone = [sid for sid in self.list() if sid < snapshot_id]
        for sid in gone:
            self.delete(sid, unlink)
        if gone:
            fsync_dir(self.directory)
        return gone

    def quarantine(self, snapshot_id: SnapshotId) -> None:
        """Rename a refused snapshot to .corrupt (kept for forensics, never loaded)."""
        path = self.path(snapshot_id)
        try:
            os.replace(path, path[: -len(SUFFIX)] + CORRUPT_SUFFIX)
        except FileNotFoundError:
            return
        fsync_dir(self.directory)

    def boot_cleanup(self, log_start_offset: int) -> BootReport:
        """Boot-time validation (KIP-630 + Kafka's raft module):

        1. delete `.part` (cut-off writes and downloads) and `.deleted` files;
        2. delete snapshots ending below the log start offset (they cannot be
           followed by the log);
        3. verify every remaining snapshot; a bad one is quarantined as
           `.corrupt` with a logged error;
        4. if log_start_offset > 0 and no valid snapshot ends at or past it,
           raise SnapshotInvariantError: the caller treats the log as empty
           and bootstraps from the leader.
        """
        report = BootReport()
        for name in sorted(os.listdir(self.directory)):
            if name.endswith(PART_SUFFIX) or name.endswith(DELETED_SUFFIX):
                os.unlink(os.path.join(self.directory, name))
                report.removed_leftovers.append(name)
        for sid in self.list():
            if sid.end_offset < log_start_offset:
                self.delete(sid)
                report.removed_below_start.append(sid)
                continue
            path = self.path(sid)
            try:
                verify_snapshot(path)
            except CorruptSnapshotError as exc:
                log.error("snapshot_corrupt", file=path, position=exc.position, reason=exc.reason)
                self.quarantine(sid)
                report.corrupt.append((os.path.basename(path), str(exc)))
                continue
            report.snapshots.append(sid)
        fsync_dir(self.directory)
        if log_start_offset > 0 and not report.snapshots:
            bad = ", ".join(name for name, _ in report.corrupt) or "none"
            raise SnapshotInvariantError(
                f"{self.directory}: the log starts at offset {log_start_offset} but no valid "
                f"snapshot ends at or past it (refused: {bad}); treat the log as empty "
                "and bootstrap from the leader")
        return report
