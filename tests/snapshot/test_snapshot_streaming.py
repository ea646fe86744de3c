"""Snapshot files are checked and loaded a block at a time, never read whole
(issue 19 item 3: a new observer installing a 150 MB snapshot held it in RAM
twice over -- once to verify the download, once to load it -- on top of the
state; the leader read it whole to verify it before serving the first chunk).

Memory is measured with tracemalloc (every bytes object the check allocates),
and the streamed check must find exactly what the in-memory one finds, at
the same file positions, across block boundaries."""

from __future__ import annotations

import os
import random
import tracemalloc

import pytest

from metalog.protocol.messages import SnapshotId
from metalog.storage import batch as b
from metalog.storage.snapshot import (READ_BLOCK_BYTES, CorruptSnapshotError, SnapshotStore, SnapshotWriter,
                              read_snapshot, verify_snapshot_bytes, verify_snapshot_fd, verify_snapshot_file)

SID = SnapshotId(1000, 3)
MIB = 1 << 20


def write_snapshot(directory, n_values: int, value_bytes: int, batch_bytes_max: int = 1 << 20) -> tuple[str, list]:
    rng = random.Random(7)
    values = [rng.randbytes(value_bytes) for _ in range(n_values)]  # incompressible: the file is this big
    path, size, count = SnapshotWriter(str(directory), SID, 1, "c", batch_bytes_max=batch_bytes_max).write_all(values)
    assert count == n_values and size > n_values * value_bytes
    return path, values


def batch_positions(path: str) -> list[int]:
    with open(path, "rb") as f:
        return [pos for pos, _ in b.iter_batches(f.read())]


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> tuple[str, list]:
    """A ~24 MiB snapshot: six times the read block."""
    return write_snapshot(tmp_path_factory.mktemp("big"), 6 * 1024, 4096)


def peak_alloc_bytes(fn) -> tuple[object, int]:
    tracemalloc.start()
    try:
        result = fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, peak


def test_verifying_a_file_holds_a_block_not_the_file(big):
    path, _ = big
    size = os.path.getsize(path)
    assert size > 5 * READ_BLOCK_BYTES
    layout, peak = peak_alloc_bytes(lambda: verify_snapshot_file(path, SID))
    assert layout.size_bytes == size
    # A block, the batch straddling it, and the layout's headers; the whole
    # file (what the check read before) is 24 MiB.
    assert peak < READ_BLOCK_BYTES + 4 * MIB, f"peak {peak / MIB:.1f} MiB for a {size / MIB:.1f} MiB file"


def test_loading_streams_the_values(big):
    path, values = big

    def load():
        sid, _header, it = read_snapshot(path)
        n = 0
        for v in it:  # consumed as a loader does, nothing kept
            n += len(v)
        return sid, n

    (sid, n), peak = peak_alloc_bytes(load)
    assert sid == SID and n == sum(len(v) for v in values)
    assert peak < READ_BLOCK_BYTES + 4 * MIB, f"peak {peak / MIB:.1f} MiB"
    assert list(read_snapshot(path)[2]) == values  # and the values are all there, in order


def test_install_and_serving_check_stream_too(big, tmp_path):
    """PartialSnapshot.complete (the observer's install) and the leader's
    check before the first chunk it serves both hold a block, not the file."""
    src, _ = big
    store = SnapshotStore(str(tmp_path))
    part = store.partial(SID)
    with open(src, "rb") as f:
        pos = 0
        while chunk := f.read(MIB):
            part.write_at(pos, chunk)
            pos += len(chunk)
    final, peak = peak_alloc_bytes(lambda: part.complete(pos))
    assert final == store.path(SID) and os.path.getsize(final) == pos
    assert peak < READ_BLOCK_BYTES + 4 * MIB, f"install peak {peak / MIB:.1f} MiB"
    chunk, peak = peak_alloc_bytes(lambda: store.read_chunk(SID, 0, MIB))
    assert len(chunk) == MIB
    assert peak < READ_BLOCK_BYTES + 4 * MIB, f"first-chunk peak {peak / MIB:.1f} MiB"


@pytest.mark.parametrize("block_bytes", [1, 4096, 100_000, 1 << 30])
def test_the_streamed_check_equals_the_whole_file_check(tmp_path, block_bytes):
    path, _ = write_snapshot(tmp_path, 300, 900, batch_bytes_max=16 << 10)
    with open(path, "rb") as f:
        whole = verify_snapshot_bytes(f.read(), SID, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert verify_snapshot_fd(fd, SID, path, block_bytes=block_bytes) == whole
    finally:
        os.close(fd)


@pytest.mark.parametrize("block_bytes", [4096, 100_000])
def test_a_flipped_byte_beyond_the_first_block_is_found_at_its_batch(tmp_path, block_bytes):
    """The user sees CorruptSnapshotError naming the file and the damaged
    batch's file position (not a position within a block)."""
    path, _ = write_snapshot(tmp_path, 300, 900, batch_bytes_max=16 << 10)
    positions = batch_positions(path)
    target = next(p for p in positions if p > 2 * block_bytes)
    with open(path, "r+b") as f:
        f.seek(target + 100)
        byte = f.read(1)
        f.seek(target + 100)
        f.write(bytes([byte[0] ^ 0x40]))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CorruptSnapshotError, match="CRC mismatch") as exc:
            verify_snapshot_fd(fd, SID, path, block_bytes=block_bytes)
    finally:
        os.close(fd)
    assert exc.value.path == path and exc.value.position == target
    with open(path, "rb") as f:
        with pytest.raises(CorruptSnapshotError) as whole:
            verify_snapshot_bytes(f.read(), SID, path)
    assert whole.value.position == target  # as the in-memory check says


def test_a_truncated_file_is_refused_at_the_last_whole_batch(tmp_path):
    """A download cut mid-batch: 'truncated: N byte(s) after the last whole batch' at that batch's end."""
    path, _ = write_snapshot(tmp_path, 300, 900, batch_bytes_max=16 << 10)
    positions = batch_positions(path)
    cut = positions[len(positions) // 2] + 10
    with open(path, "r+b") as f:
        f.truncate(cut)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CorruptSnapshotError, match="truncated: 10 byte") as exc:
            verify_snapshot_fd(fd, SID, path, block_bytes=4096)
    finally:
        os.close(fd)
    assert exc.value.position == positions[len(positions) // 2]


def test_an_empty_file_is_refused(tmp_path):
    path = tmp_path / SnapshotStore(str(tmp_path)).path(SID).rsplit("/", 1)[1]
    path.write_bytes(b"")
    with pytest.raises(CorruptSnapshotError, match="empty file"):
        verify_snapshot_file(str(path), SID)


def test_a_load_sees_a_batch_damaged_after_its_check(tmp_path):
    """The second pass checks CRCs again: a batch damaged between the check
    and the load raises CorruptSnapshotError ('changed after its check'),
    never a wrong record."""
    path, _ = write_snapshot(tmp_path, 300, 900, batch_bytes_max=16 << 10)
    sid, _header, values = read_snapshot(path)
    target = batch_positions(path)[5]
    with open(path, "r+b") as f:
        f.seek(target + 200)
        byte = f.read(1)
        f.seek(target + 200)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(CorruptSnapshotError, match="changed after its check") as exc:
        list(values)
    assert exc.value.position == target
