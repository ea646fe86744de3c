"""metalog.storage.group_commit.GroupCommit: the adaptive group-commit policy the runtime drives."""

from __future__ import annotations

import pytest

from metalog.storage.group_commit import Arm, GroupCommit


def _busy(gc: GroupCommit) -> GroupCommit:
    """`gc` after a batch of two requests: writers are not alone."""
    gc.offer("x", [b"x"])
    gc.offer("y", [b"y"])
    gc.take()
    gc.turn_ended()
    return gc


def test_idle_disk_appends_at_the_end_of_the_turn_and_joins_the_turns_writes():
    gc = _busy(GroupCommit(linger_ms=0, batch_records_max=100))
    assert gc.offer("a", [b"1"]) is Arm.END_OF_TURN
    assert gc.offer("b", [b"2", b"3"]) is Arm.WAIT  # already armed: joins the batch
    assert gc.take() == ([("a", 1), ("b", 2)], [b"1", b"2", b"3"])
    assert gc.take() is None and gc.pending_records == 0


def test_a_lone_writer_is_appended_once_its_read_is_done_at_most_once_a_turn():
    gc = GroupCommit(linger_ms=0, batch_records_max=100)
    assert gc.offer("a", [b"1"]) is Arm.END_OF_READ  # an idle broker: nobody else writes
    assert gc.offer("b", [b"2"]) is Arm.WAIT  # a frame of the same read joins it
    assert gc.take() == ([("a", 1), ("b", 1)], [b"1", b"2"])
    gc.turn_ended()
    assert gc.offer("c", [b"3"]) is Arm.END_OF_TURN  # the last batch held two requests
    assert gc.take() == ([("c", 1)], [b"3"])
    assert gc.offer("d", [b"4"]) is Arm.END_OF_READ  # alone again
    assert gc.take() == ([("d", 1)], [b"4"])
    # A second lone writer in the same turn (another connection's read) waits for the turn's end,
    # where every connection read meanwhile joins it.
    assert gc.offer("e", [b"5"]) is Arm.END_OF_TURN
    assert gc.take() == ([("e", 1)], [b"5"])
    gc.turn_ended()
    assert gc.offer("f", [b"6"]) is Arm.END_OF_READ


def test_a_lone_writer_still_waits_for_a_running_flush():
    gc = GroupCommit(linger_ms=0, batch_records_max=100)
    assert gc.request_flush()
    gc.flush_starting()
    assert gc.offer("a", [b"1"]) is Arm.WAIT
    assert gc.flush_completed() is True


def test_while_a_flush_runs_writes_wait_and_go_out_as_one_batch_when_it_completes():
    gc = GroupCommit(linger_ms=0, batch_records_max=100)
    assert gc.request_flush() is True
    gc.flush_starting()
    assert gc.offer("a", [b"1"]) is Arm.WAIT
    assert gc.offer("b", [b"2"]) is Arm.WAIT
    assert gc.flush_completed() is True
    assert gc.take() == ([("a", 1), ("b", 1)], [b"1", b"2"])


def test_nothing_waiting_after_a_flush_means_no_batch():
    gc = GroupCommit(linger_ms=0, batch_records_max=100)
    assert gc.request_flush()
    gc.flush_starting()
    assert gc.flush_completed() is False
    assert gc.flush_again() is False and gc.flush_running is False


def test_a_write_armed_before_the_flush_is_left_to_its_own_callback():
    gc = GroupCommit(linger_ms=0, batch_records_max=100)
    assert gc.offer("a", [b"1"]) is Arm.END_OF_READ
    assert gc.request_flush()
    gc.flush_starting()
    assert gc.flush_completed() is False  # the end-of-turn callback takes it
    assert gc.take() == ([("a", 1)], [b"1"])


def test_batch_records_max_appends_at_once():
    gc = GroupCommit(linger_ms=0, batch_records_max=3)
    assert gc.request_flush()
    assert gc.offer("a", [b"1", b"2"]) is Arm.WAIT
    assert gc.offer("b", [b"3"]) is Arm.APPEND_NOW
    assert gc.take() == ([("a", 2), ("b", 1)], [b"1", b"2", b"3"])


def test_fixed_linger_arms_one_timer_even_while_the_disk_is_idle():
    gc = GroupCommit(linger_ms=5, batch_records_max=100)
    assert gc.offer("a", [b"1"]) is Arm.LINGER
    assert gc.offer("b", [b"2"]) is Arm.WAIT
    assert gc.take() == ([("a", 1), ("b", 1)], [b"1", b"2"])
    assert gc.offer("c", [b"3"]) is Arm.LINGER  # take() disarmed: the next write arms again


def test_flushes_never_overlap_and_one_asked_for_meanwhile_runs_after():
    gc = GroupCommit(linger_ms=0, batch_records_max=100)
    assert gc.request_flush() is True
    gc.flush_starting()
    assert gc.request_flush() is False  # remembered
    gc.flush_completed()
    assert gc.flush_again() is True and gc.flush_running
    gc.flush_starting()
    gc.flush_completed()
    assert gc.flush_again() is False and not gc.flush_running
    assert gc.request_flush() is True


def test_a_failed_flush_stops_the_flusher_and_drop_all_returns_every_queued_token():
    gc = GroupCommit(linger_ms=0, batch_records_max=100)
    assert gc.request_flush()
    gc.flush_starting()
    gc.offer("a", [b"1"])
    gc.offer("b", [b"2"])
    gc.flush_stopped()
    assert not gc.flush_running
    assert gc.drop_all() == ["a", "b"]
    assert gc.take() is None and gc.pending_records == 0


@pytest.mark.parametrize("kwargs", [dict(linger_ms=-1, batch_records_max=1), dict(linger_ms=0, batch_records_max=0)])
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(AssertionError):
        GroupCommit(**kwargs)


def test_an_empty_write_is_never_queued():
    with pytest.raises(AssertionError, match="empty write"):
        GroupCommit(0, 10).offer("a", [])
