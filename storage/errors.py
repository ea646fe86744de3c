"""Errors raised by the storage engine (segmented log and small state files).

Each carries what an operator needs to act on it: the file, the byte position
and the offset involved, in the message itself.
"""

from __future__ import annotations


class StorageError(Exception):
    """Base class of every storage failure."""


class LogWriteError(StorageError):
    """An append failed (ENOSPC, EIO, EFBIG ...). The log is unchanged: no
    partial batch is visible and the end offset did not move."""


class CorruptLogError(StorageError):
    """Data that was once whole is damaged (CRC/length mismatch that is not a
    torn tail). Never repaired silently: the node must stop."""

    def __init__(self, message: str, path: str, position: int, base_offset: int | None):
        super().__init__(message)
        self.path = path
        self.position = position
        self.base_offset = base_offset


class QuorumStateError(StorageError):
    """The quorum-state file exists but cannot be understood."""
