"""The on-disk layout of a segmented log directory: file names, suffixes and
the binary entry formats of the index files. Nothing here does IO except
``write_all``, the one loop every writer uses against short writes.

A segment is a triple named after its base offset (20 digits):

* ``<base>.log``       -- whole record batches (metalog.storage.batch format)
  back to back, the first one starting at the base offset;
* ``<base>.index``     -- Kafka's sparse offset index: 8-byte entries
  ``relative offset u32 | file position u32`` (big-endian), one for a batch
  roughly every ``index_interval_bytes`` of log data; the relative offset is
  that of the batch's LAST offset and the position that of the batch's start
  (as Kafka's LogSegment indexes a batch by its largest offset);
* ``<base>.timeindex`` -- Kafka's time index: 12-byte entries
  ``timestamp i64 | relative offset u32`` (see metalog.storage.segments.indexes).

Small files sit next to them: ``log-start-offset``, ``.clean-shutdown``,
``recovery-point-offset-checkpoint``, ``quarantine-state`` (see
metalog.storage.segments.checkpoints) and ``.lock`` (an flock, so two processes
never open one directory). Quarantined segments are kept as
``<name>.log.corrupt`` / ``<name>.index.corrupt``; a segment on its way out
is renamed ``<name>.deleted``.
"""

from __future__ import annotations

import os
import re
import struct

from metalog.storage import batch as B

LOG_SUFFIX = ".log"
INDEX_SUFFIX = ".index"
TIMEINDEX_SUFFIX = ".timeindex"
CLEAN_SHUTDOWN_FILE = ".clean-shutdown"
LOG_START_FILE = "log-start-offset"
LOCK_FILE = ".lock"
RECOVERY_POINT_FILE = "recovery-point-offset-checkpoint"
QUARANTINE_FILE = "quarantine-state"
CORRUPT_SUFFIX = ".corrupt"
DELETED_SUFFIX = ".deleted"  # a segment file on its way out (Segment.delete with an unlink)
ON_CORRUPTION_MODES = ("raise", "quarantine")
DEFAULT_SEGMENT_BYTES_MAX = 64 << 20
DEFAULT_INDEX_INTERVAL_BYTES = 4096
SCAN_CHUNK_BYTES = 64 << 10  # one pread while walking headers
U32_MAX = (1 << 32) - 1
# A segment's relative offsets must fit the u32 index field; roll well before.
RELATIVE_OFFSET_ROLL = 1 << 31

SEGMENT_RE = re.compile(r"^(\d{20})\.(log|index|timeindex)$")
DELETED_SEGMENT_RE = re.compile(r"^\d{20}\.(log|index|timeindex)\.deleted$")
# Anything quarantined by the log, the snapshot store or the runtime: kept for
# the operator, never read, never warned about.
CORRUPT_RE = re.compile(r"\.corrupt(\.\d+)?$")
# The partition directory is shared with the broker's other state files: the
# quorum-state, the leader-epoch checkpoint and snapshots (storage/snapshot.py's
# .checkpoint, .checkpoint.part, .checkpoint.deleted). Those are not ours to
# read, and warning about them on every restart would be noise.
SHARED_DIR_FILES = ("quorum-state", "leader-epoch-checkpoint")
KNOWN_FILES = frozenset(f + t for f in (LOG_START_FILE, CLEAN_SHUTDOWN_FILE, RECOVERY_POINT_FILE, QUARANTINE_FILE,
                                        *SHARED_DIR_FILES)
                        for t in ("", ".tmp")) | {LOCK_FILE}
SNAPSHOT_FILE_RE = re.compile(r"^\d{20}-\d{10}(-[^/]*)?\.checkpoint(\.part|\.deleted)?$")

INDEX_ENTRY = struct.Struct(">II")  # relative (last) offset, file position
TIME_ENTRY = struct.Struct(">qI")  # Kafka's TimeIndex entry: timestamp, relative offset
# The header fields a walk over a segment reads, at their batch-relative positions.
HDR_PREFIX = struct.Struct(">qii")  # base_offset, length, leader_epoch
LAST_DELTA = struct.Struct(">i")
LAST_DELTA_POS = 23
ATTRIBUTES = struct.Struct(">h")
ATTRIBUTES_POS = 21
MAGIC_POS = 16
MAGIC_BYTE = bytes([B.MAGIC])


def segment_file_name(base_offset: int, suffix: str = LOG_SUFFIX) -> str:
    return f"{base_offset:020d}{suffix}"


def write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    written = os.write(fd, view)
    while written < len(view):  # short writes happen near a size limit
        written += os.write(fd, view[written:])
