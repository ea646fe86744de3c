"""Atomic replacement of small state files: temp file, fsync, rename, fsync dir.

After a crash at any point the file holds either the old or the new content,
never a mix; leftover ``*.tmp`` files are harmless and ignored by readers.
"""

from __future__ import annotations

import os


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], data: bytes, mode: int = 0o644) -> None:
    """`mode` applies from the first byte (0o600 for private keys)."""
    path = os.fspath(path)
    tmp = f"{path}.tmp"
    if os.path.exists(tmp):
        os.unlink(tmp)  # a leftover could carry a wider mode than asked for
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def read_file_if_exists(path: str | os.PathLike[str]) -> bytes | None:
    """The whole content of a small state file written by atomic_write, or
    None if it does not exist (a fresh directory)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None
