"""A paced snapshot write (metalog.broker.controller.state._paced, storage.snapshot_cpu_share)
hands on every value in order and pauses after each slice of work for the
time that keeps its share of the CPU: pause = slice x (1 - share) / share.
The clock is a fake one (each reading 0.1 ms later), so the pauses counted
are exact, not timed."""

import time

import pytest

from metalog.broker.controller import state as controller


@pytest.fixture
def pauses(monkeypatch) -> list[float]:
    """A fake clock (each reading 0.1 ms later) and the pauses asked of sleep."""
    now = [0.0]

    def clock():
        now[0] += 0.0001
        return now[0]

    asked: list[float] = []
    monkeypatch.setattr(time, "perf_counter", clock)
    monkeypatch.setattr(time, "sleep", asked.append)
    return asked


@pytest.mark.parametrize("share", [0.25, 0.35, 0.5, 0.9])
def test_every_value_comes_out_in_order_with_pauses_for_the_share(pauses, share):
    values = [str(i).encode() for i in range(20_000)]
    assert list(controller._paced(iter(values), share)) == values
    assert pauses and all(p == pytest.approx(controller.PACE_SLICE_S * (1 - share) / share) for p in pauses)
    # one pause per slice of work: the clock reads once per 32 values here,
    # 0.1 ms a reading, so a slice ends every k readings (k x 32 values), or
    # k + 1 where the float sums fall a hair short of the slice
    k = round(controller.PACE_SLICE_S / 0.0001)
    assert len(values) / ((k + 1) * 32) - 1 <= len(pauses) <= len(values) / (k * 32) + 1


def test_a_paced_snapshot_is_the_same_snapshot_and_a_full_share_never_pauses(tmp_path, monkeypatch, pauses):
    """write_controller_snapshot with a share below 1 pauses (fake clock)
    and writes a snapshot that loads to the same state; at a share of 1 it
    never calls sleep."""
    from metalog.protocol.messages import SnapshotId
    from metalog.storage import metadata_records as r
    from metalog.storage.snapshot import SnapshotStore

    s = controller.ControllerState()
    for t in range(20):
        tid = f"{t:08x}-0000-4000-8000-000000000000"
        s.apply(s.offset, r.Topic(f"t{t}", tid))
        for p in range(50):
            s.apply(s.offset, r.Partition(tid, p, (0, 1, 2), (0, 1, 2), -1))
    paced = SnapshotStore(str(tmp_path / "paced"))
    controller.write_controller_snapshot(paced, s, SnapshotId(s.offset, 1), 0, "c", cpu_share=0.35)
    assert pauses
    assert controller.load_latest(paced)[0] == s

    def no_sleep(sec):
        raise AssertionError("a full share must not pause")

    monkeypatch.setattr(time, "sleep", no_sleep)
    full = SnapshotStore(str(tmp_path / "full"))
    controller.write_controller_snapshot(full, s, SnapshotId(s.offset, 1), 0, "c", cpu_share=1.0)
    assert controller.load_latest(full)[0] == s
