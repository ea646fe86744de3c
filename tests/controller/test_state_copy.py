"""Issue 19 item 2: the snapshot's copy of the controller state taken a slice
at a time while records keep being applied. Whatever is applied between the
slices, the finished copy equals the live state at the moment it finishes,
and later changes to the live state never reach it."""

import random

import pytest

from metalog.broker.controller.state import ControllerState
from metalog.broker.controller.state_copy import IncrementalCopy, StateDict, TrackedDict
from metalog.protocol.invariants import InvariantViolation
from metalog.storage import metadata_records as r


def tid(i: int) -> str:
    return f"{i:08x}-0000-4000-8000-000000000000"


def base_state(topics: int = 30, partitions: int = 7) -> ControllerState:
    s = ControllerState()
    for b in range(3):
        incarnation = f"{b:08x}-0000-4000-8000-00000000000b"  # a uuid: the state can be written as a snapshot
        assert s.apply(s.offset, r.RegisterBroker(b, incarnation, 1, (r.Endpoint("PLAINTEXT", "h", 9000 + b),)))
    for i in range(topics):
        assert s.apply(s.offset, r.Topic(f"t{i}", tid(i)))
        for p in range(partitions):
            assert s.apply(s.offset, r.Partition(tid(i), p, (0, 1, 2), (0, 1, 2), p % 3))
        assert s.apply(s.offset, r.Config(r.RESOURCE_TOPIC, f"t{i}", "retention.ms", str(i)))
    return s


def random_change(s: ControllerState, rng: random.Random, next_topic: list[int]) -> None:
    x = rng.random()
    live = sorted(s.topics)
    if x < 0.5 and live:
        t = rng.choice(live)
        s.apply(s.offset, r.PartitionChange(t, rng.randrange(s.partition_counts[t]),
                                            isr=(0, 1), leader=rng.choice((0, 1))))
    elif x < 0.7 and live:
        name = s.topics[rng.choice(live)].name
        s.apply(s.offset, r.Config(r.RESOURCE_TOPIC, name, f"k{rng.randrange(3)}",
                                   None if rng.random() < 0.3 else str(rng.random())))
    elif x < 0.85 and live:
        s.apply(s.offset, r.RemoveTopic(rng.choice(live)))
    else:
        i = next_topic[0]
        next_topic[0] += 1
        s.apply(s.offset, r.Topic(f"t{i}", tid(i)))
        for p in range(rng.randrange(1, 5)):
            s.apply(s.offset, r.Partition(tid(i), p, (0, 1, 2), (0, 1, 2), 0))
    s.offset += 1


@pytest.mark.parametrize("seed", range(20))
def test_the_finished_copy_equals_the_state_when_it_finished_whatever_ran_between_slices(seed):
    rng = random.Random(seed)
    s = base_state()
    next_topic = [1000]
    c = IncrementalCopy(s, slice_entries=rng.choice((1, 5, 40)))
    steps = 0
    while not c.step():
        steps += 1
        for _ in range(rng.randrange(4)):
            random_change(s, rng, next_topic)
        assert steps < 10_000
    for _ in range(rng.randrange(4)):
        random_change(s, rng, next_topic)  # after the last slice, before finish
    copy = c.finish()
    assert copy == s and copy.offset == s.offset
    assert copy.partition_counts == s.partition_counts and copy.config_names == s.config_names
    assert list(copy.to_records()) == list(s.to_records())
    # Tracking is off again (a plain StateDict), and the copy is independent.
    assert type(s.configs) is StateDict and s.configs.changed is None
    frozen = list(copy.to_records())
    for _ in range(20):
        random_change(s, rng, next_topic)
    assert list(copy.to_records()) == frozen


def test_tracking_costs_nothing_outside_a_copy_and_one_copy_runs_at_a_time():
    s = base_state(topics=2, partitions=2)
    assert type(s.configs) is StateDict  # no Python-level __setitem__ on the apply path
    c = IncrementalCopy(s)
    assert type(s.configs) is TrackedDict
    with pytest.raises(InvariantViolation, match="one incremental copy at a time"):
        IncrementalCopy(s)
    c.abort()
    assert type(s.configs) is StateDict
    IncrementalCopy(s).finish()  # a new one may start after the abort
    assert type(s.configs) is StateDict
