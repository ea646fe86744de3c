"""The partitions map held topic by topic (broker/controller/partition_map.py): it
behaves as the flat dict of (topic id, partition id) keys it replaced, under
any mix of writes, and a copy is independent of the original from the moment
it is taken, whichever of the two is written afterwards. Topics loaded as
columns (a snapshot's load) read the same as topics held as records."""

import random

import numpy as np
import pytest

from metalog.broker.controller.partition_map import PartitionColumns, PartitionMap, TopicColumns
from metalog.storage import metadata_records as r


def part(t: str, pid: int, leader: int = 0) -> r.Partition:
    return r.Partition(t, pid, (0, 1, 2), (0, 1, 2), leader)


def check_same(m: PartitionMap, d: dict) -> None:
    assert len(m) == len(d) and bool(m) == bool(d)
    assert m == d and dict(m.items()) == d and sorted(m) == sorted(d)
    assert sorted(m.values(), key=lambda p: (p.topic_id, p.partition_id)) == [d[k] for k in sorted(d)]
    for t in {k[0] for k in d} | {"absent"}:
        assert dict(m.topic(t)) == {pid: p for (tt, pid), p in d.items() if tt == t}
    assert set(m.topic_ids()) == {k[0] for k in d}  # no topic left behind empty
    assert {(t, pid): p for t, parts in m.by_topic() for pid, p in parts.items()} == d
    for bid in range(5):
        want = sorted((k[0], k[1], p) for k, p in d.items() if bid in p.isr or p.leader == bid)
        assert sorted(m.with_broker(bid)) == want
    for t in {k[0] for k in d}:
        ids = sorted(pid for tt, pid in d if tt == t)
        assert m.ordered(t, ids) == [d[(t, pid)] for pid in ids]
        for lo in range(min(ids), max(ids) + 1):  # id ranges, as a page of a dense topic asks
            for hi in range(lo, max(ids) + 2):
                if all((t, pid) in d for pid in range(lo, hi)):
                    assert m.ordered(t, range(lo, hi)) == [d[(t, pid)] for pid in range(lo, hi)]


def add_columns(m: PartitionMap, d: dict, rng: random.Random) -> None:
    """Topics without partitions get some as columns, two topics sharing one
    PartitionColumns as the topics of one snapshot run do."""
    new = [t for t in (f"t{i}" for i in range(6)) if not any(k[0] == t for k in d)]
    if not new:
        return
    topics = rng.sample(new, min(len(new), 2))
    counts = [rng.randrange(1, 6) for _ in topics]
    rows = sum(counts)
    reps = np.array([rng.sample(range(5), 3) for _ in range(rows)], np.int32)
    same_isr = rng.random() < 0.5
    isr = None if same_isr else np.ascontiguousarray(reps[:, :2])
    # a leader outside the ISR too: the map does not check what the state machine does
    leaders = np.array([rng.choice([row[0], row[2], -1]) for row in reps.tolist()], np.int32)
    epochs = np.array([rng.randrange(9) for _ in range(rows)], np.int32)
    cols = PartitionColumns(reps, isr, leaders, epochs, epochs + 1)
    start = 0
    for t, n in zip(topics, counts):
        first = rng.randrange(3)
        m.add_columns(t, cols, start, start + n, first)
        for i in range(n):
            row = start + i
            rr = tuple(reps[row].tolist())
            ii = rr if same_isr else rr[:2]
            d[(t, first + i)] = r.Partition(t, first + i, rr, ii, int(leaders[row]), int(epochs[row]),
                                            int(epochs[row]) + 1)
        start += n


def random_write(m: PartitionMap, d: dict, rng: random.Random) -> None:
    t = f"t{rng.randrange(6)}"
    x = rng.random()
    if x < 0.35:
        key = (t, rng.randrange(8))
        m[key] = d[key] = part(t, key[1], rng.randrange(3))
    elif x < 0.45 and any(k[0] == t for k in d):
        key = rng.choice(sorted(k for k in d if k[0] == t))
        m.replace(t, key[1], part(t, key[1], 7))  # a PartitionChange's write
        d[key] = part(t, key[1], 7)
    elif x < 0.6:
        key = (t, rng.randrange(8))
        assert m.pop(key, None) == d.pop(key, None)
    elif x < 0.7:
        gone = [k for k in d if k[0] == t]
        assert m.drop_topic(t) == len(gone)
        for k in gone:
            del d[k]
    elif x < 0.8:
        add_columns(m, d, rng)
    else:
        pids = sorted(rng.sample(range(10), rng.randrange(1, 5)))
        recs = [part(t, pid, rng.randrange(3)) for pid in pids]
        m.add_rows(t, pids, recs)
        d.update(zip([(t, pid) for pid in pids], recs))


@pytest.mark.parametrize("seed", range(30))
def test_it_behaves_as_a_flat_dict_and_copies_never_see_each_others_writes(seed):
    rng = random.Random(seed)
    maps = [(PartitionMap(), {})]
    for _ in range(300):
        i = rng.randrange(len(maps))
        m, d = maps[i]
        if rng.random() < 0.05 and len(maps) < 6:
            maps.append((m.copy(), dict(d)))  # a snapshot's copy, taken in O(topics)
        else:
            random_write(m, d, rng)
        for m2, d2 in maps:
            check_same(m2, d2)


def test_missing_keys_raise_keyerror_naming_the_whole_key():
    m = PartitionMap([(("t", 0), part("t", 0))])
    with pytest.raises(KeyError) as e:
        m[("t", 1)]
    assert e.value.args == (("t", 1),)
    with pytest.raises(KeyError):
        m[("u", 0)]
    with pytest.raises(KeyError):
        del m[("t", 5)]
    assert ("t", 0) in m and ("t", 1) not in m and "t" not in m and m.get(("u", 0), 7) == 7


def test_a_copy_shares_topic_dicts_until_one_side_writes():
    m = PartitionMap()
    m.add_rows("a", [0, 1], [part("a", 0), part("a", 1)])
    m.add_rows("b", [0], [part("b", 0)])
    c = m.copy()
    assert m.topic("a") is c.topic("a")  # nothing copied but the outer dict
    m[("a", 1)] = part("a", 1, leader=2)
    assert m.topic("a") is not c.topic("a") and c[("a", 1)].leader == 0
    assert m.topic("b") is c.topic("b")
    c.drop_topic("b")
    assert m[("b", 0)] == part("b", 0) and ("b", 0) not in c


def test_a_topic_in_columns_builds_records_when_read_and_becomes_a_dict_when_written():
    reps = np.array([[1, 2, 3], [2, 3, 1], [3, 1, 2]], np.int32)
    cols = PartitionColumns(reps, None, reps[:, 0].copy(), np.zeros(3, np.int32), np.ones(3, np.int32))
    m = PartitionMap()
    m.add_columns("a", cols, 0, 3, 0)
    c = m.copy()
    assert type(m.topic("a")) is TopicColumns and len(m) == 3
    p = m[("a", 1)]
    assert p == r.Partition("a", 1, (2, 3, 1), (2, 3, 1), 2, 0, 1) and p.isr is p.replicas
    assert ("a", 3) not in m and ("a", -1) not in m and m.get(("a", 3)) is None
    assert type(m.topic("a")) is TopicColumns  # reads keep no records
    m.replace("a", 2, r.Partition("a", 2, (3, 1, 2), (3,), 3, 1, 2))
    assert type(m.topic("a")) is dict and m[("a", 2)].isr == (3,)
    assert type(c.topic("a")) is TopicColumns and c[("a", 2)].isr == (3, 1, 2)  # the copy kept its own
    # more rows for a topic that has some: one dict for all of them
    c.add_columns("a", cols, 0, 2, 3)
    assert type(c.topic("a")) is dict and sorted(c.topic("a")) == [0, 1, 2, 3, 4]
    assert c[("a", 4)].replicas == (2, 3, 1)
