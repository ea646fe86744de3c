"""metalog.broker.server.snapshot_policy.SnapshotPolicy: when the applied state is snapshotted."""

from __future__ import annotations

from metalog.broker.server.snapshot_policy import SnapshotPolicy
from metalog.protocol import messages as m


def ask(policy, since, applied, existing=(), busy=False):
    return policy.next_snapshot(records_since_snapshot=since, applied_offset=applied,
                                epoch_for_offset=lambda off: 7 if off >= 100 else 2,
                                exists=lambda sid: sid in existing, busy=busy)


def test_not_before_min_records_then_at_the_applied_offset_with_its_epoch():
    p = SnapshotPolicy(min_records=50)
    assert ask(p, 49, 120) is None
    assert ask(p, 50, 120) == m.SnapshotId(120, 7)  # the epoch of offset 119, the last record covered
    assert ask(p, 50, 90) == m.SnapshotId(90, 2)


def test_one_at_a_time_and_never_twice_for_the_same_end():
    p = SnapshotPolicy(min_records=10)
    assert ask(p, 10, 120, busy=True) is None
    assert ask(p, 10, 120, existing={m.SnapshotId(120, 7)}) is None
