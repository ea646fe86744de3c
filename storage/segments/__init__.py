"""The segmented log: the on-disk, append-only home of the replicated log
(Kafka's UnifiedLog and LogSegment family). Import what you need from here:

    from metalog.storage.segments import SegmentedLog, BatchInfo, SegmentRef

One module per job:

* ``segmented_log`` -- SegmentedLog, the facade: open, append, read, flush,
  truncate, delete, quarantine; the threading contract;
* ``segment``       -- one segment: its .log/.index/.timeindex and the reads
  inside it (Kafka's LogSegment);
* ``indexes``       -- reading and checking the .index and .timeindex files
  (Kafka's OffsetIndex and TimeIndex);
* ``layout``        -- file names and binary entry formats;
* ``scan``          -- verifying scans of batch bytes (length, offsets,
  epochs, CRC-32C);
* ``loader``        -- opening the directory at boot and recovering after a
  crash (Kafka's LogLoader);
* ``appends``       -- checking a buffer of batches before it is appended;
* ``reader``        -- reading batches across segments;
* ``truncation``    -- removing records from the end, the start, or all;
* ``quarantine``    -- moving damaged segments aside;
* ``checkpoints``   -- the recovery point, log-start and quarantine-state files;
* ``segment_table`` -- the live segment list and the offsets flush() shares.
"""

from metalog.storage.errors import CorruptionReport, CorruptLogError, LogWriteError, QuarantineState
from metalog.storage.segments.layout import (
    CLEAN_SHUTDOWN_FILE, DEFAULT_INDEX_INTERVAL_BYTES, DEFAULT_SEGMENT_BYTES_MAX, LOG_START_FILE,
    ON_CORRUPTION_MODES, QUARANTINE_FILE, RECOVERY_POINT_FILE, segment_file_name)
from metalog.storage.segments.scan import corruption_report_at
from metalog.storage.segments.segment import BatchInfo, SegmentRef
from metalog.storage.segments.segmented_log import SegmentedLog

__all__ = [
    "BatchInfo", "CLEAN_SHUTDOWN_FILE", "CorruptLogError", "CorruptionReport", "DEFAULT_INDEX_INTERVAL_BYTES",
    "DEFAULT_SEGMENT_BYTES_MAX", "LOG_START_FILE", "LogWriteError", "ON_CORRUPTION_MODES", "QUARANTINE_FILE",
    "QuarantineState", "RECOVERY_POINT_FILE", "SegmentRef", "SegmentedLog", "corruption_report_at",
    "segment_file_name",
]
