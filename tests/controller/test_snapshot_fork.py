"""Issue 19 item 2: a controller snapshot written by a forked child
(broker/server/snapshot_fork.py). The child sees the state as it was at the fork,
whatever the parent changes afterwards; a child whose write fails reports
the error and leaves no partial file; a child that dies mid-write is
reported with its signal and the parent removes its partial file."""

from __future__ import annotations

import asyncio
import os
import resource

import pytest

from metalog.broker.controller.state import ControllerState, load_snapshot, write_controller_snapshot
from metalog.broker.server.snapshot_fork import ForkedWrite
from metalog.protocol.messages import SnapshotId
from metalog.storage import metadata_records as r
from metalog.storage.snapshot import PART_SUFFIX, SnapshotStore, generation_part_path
from tests.controller.test_state_copy import base_state, tid



def _files(directory: str) -> list[str]:
    return sorted(os.listdir(directory))


def _writer(store: SnapshotStore, state: ControllerState, sid: SnapshotId, part: str, before=None):
    def write() -> dict:
        if before is not None:
            before()
        res = write_controller_snapshot(store, state, sid, 1000, "c", part_path=part)
        return {"size": res.size_bytes, "records": res.records}
    return write


async def test_the_child_writes_the_state_as_it_was_at_the_fork(tmp_path):
    store = SnapshotStore(str(tmp_path))
    state = base_state(topics=40, partitions=50)
    expected = state.to_json()
    sid = SnapshotId(state.offset, 1)
    part = generation_part_path(store.directory, sid)
    child = ForkedWrite(_writer(store, state, sid, part), part)
    child.start()
    # The parent goes on applying (as the event loop does) while the child writes.
    for p in range(50):
        assert state.apply(state.offset, r.PartitionChange(tid(0), p, isr=(0,), leader=0))
    assert state.apply(state.offset, r.RemoveTopic(tid(1)))
    res = await child.wait()
    assert res.ok, res.error
    assert res.exit_status == "exit 0" and res.pid != os.getpid()
    assert res.value["size"] == os.path.getsize(store.path(sid))
    assert res.value["child_memory"]["vmhwm_kib"] > 0
    loaded = load_snapshot(store, sid)
    assert loaded.to_json() == expected != state.to_json()
    assert not [n for n in _files(store.directory) if n.endswith(PART_SUFFIX)]


async def test_a_write_that_fails_in_the_child_reports_the_error_and_leaves_no_partial(tmp_path):
    """The child's file size limit (RLIMIT_FSIZE, set in the child only) makes
    its write fail with EFBIG as a full disk would: the parent gets the error
    text, no .part and no .checkpoint remain."""
    store = SnapshotStore(str(tmp_path))
    state = base_state(topics=40, partitions=50)
    sid = SnapshotId(state.offset, 1)
    part = generation_part_path(store.directory, sid)

    def full_disk() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    child = ForkedWrite(_writer(store, state, sid, part, before=full_disk), part)
    child.start()
    res = await child.wait()
    assert not res.ok
    assert res.exit_status == "exit 3"
    assert res.error.startswith("OSError: [Errno 27] File too large"), res.error
    assert _files(store.directory) == []
    assert store.size(sid) is None


async def test_a_child_killed_mid_write_is_reported_and_its_partial_file_removed(tmp_path):
    store = SnapshotStore(str(tmp_path))
    state = base_state(topics=5, partitions=5)
    sid = SnapshotId(state.offset, 1)
    part = generation_part_path(store.directory, sid)
    ready_r, ready_w = os.pipe()
    block_r, block_w = os.pipe()

    def stuck() -> None:
        with open(part, "xb") as f:  # as the writer does, then never finishes
            f.write(b"half a snapshot")
        os.write(ready_w, b"x")
        os.read(block_r, 1)  # blocks: nobody writes to it

    child = ForkedWrite(_writer(store, state, sid, part, before=stuck), part)
    child.start()
    try:
        # The child has created its partial file once it writes to the pipe.
        assert await asyncio.wait_for(asyncio.to_thread(os.read, ready_r, 1), 10) == b"x"
        assert os.path.exists(part)
        child.kill()
        res = await asyncio.wait_for(child.wait(), 10)
    finally:
        for fd in (ready_r, ready_w, block_r, block_w):
            os.close(fd)
    assert not res.ok
    assert res.exit_status == "signal 9 (SIGKILL)"
    assert res.error == "snapshot child process died (signal 9 (SIGKILL)) without a report"
    assert _files(store.directory) == []


def test_a_fork_that_fails_raises_and_leaks_no_descriptor(tmp_path, monkeypatch):
    """fork() refused (EAGAIN: too many processes): start() raises the
    OSError for the caller to log, and the report pipe is closed again."""
    import errno

    def refuse():
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    fds_before = sorted(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "fork", refuse)
    child = ForkedWrite(lambda: {}, str(tmp_path / "x.checkpoint.part"))
    with pytest.raises(OSError) as caught:
        child.start()
    assert caught.value.errno == errno.EAGAIN
    assert sorted(os.listdir("/proc/self/fd")) == fds_before
    assert child.pid is None


def test_a_child_forked_from_a_thread_other_than_the_main_one_writes(tmp_path):
    """A broker whose event loop runs outside the main thread (embedded) still
    gets its snapshot: the child's signal reset must not fail there."""
    import threading

    store = SnapshotStore(str(tmp_path))
    state = base_state(topics=3, partitions=3)
    sid = SnapshotId(state.offset, 1)
    part = generation_part_path(store.directory, sid)
    results = []

    async def go() -> None:
        child = ForkedWrite(_writer(store, state, sid, part), part)
        child.start()
        results.append(await child.wait())

    t = threading.Thread(target=lambda: asyncio.run(go()))
    t.start()
    t.join(30)
    assert not t.is_alive() and len(results) == 1
    assert results[0].ok, results[0].error
    assert load_snapshot(store, sid).to_json() == state.to_json()
