"""Which partition ids each topic has, in order, at a cost of nothing for the
usual topic (issue 19 item 4).

Reads, RemoveTopic, the incremental state copy and snapshots walk one
topic's partitions by id. Kafka's controller creates a topic's partitions as
ids 0..n-1, so for almost every topic the ids are ``range(count)`` with
``count`` = 1 + the highest id (``ControllerState.partition_counts``), and no
list of ids is kept. But a committed Partition record may carry any id: one
topic with ids {0, 2**31 - 1} must not make a page of partitions, a
RemoveTopic or a snapshot walk two billion ids that do not exist. A topic
whose ids have a gap is *sparse*: its ids are kept in a sorted array (8 bytes
per partition, only for such topics), from the record that opens the gap
until the topic is removed (partitions are never removed one by one).

Both shapes are sequences of ascending ints with ``len``, slicing and
``bisect``, so callers page them the same way.
"""

from __future__ import annotations

import bisect
from array import array
from typing import Sequence

from metalog.protocol.invariants import InvariantViolation

SparseIds = dict[str, array]  # topic id -> its partition ids, ascending ('q': any id a record may carry)


def ids_of(counts: dict[str, int], sparse: SparseIds, topic_id: str) -> Sequence[int]:
    """The topic's partition ids, ascending (empty for an unknown topic).
    A sparse topic's array is the live index: copy it to keep it."""
    ids = sparse.get(topic_id)
    return range(counts.get(topic_id, 0)) if ids is None else ids


def add_sparse(sparse: SparseIds, topic_id: str, partition_id: int, count: int) -> None:
    """Record `partition_id` of a topic that is sparse, or becomes sparse now
    (`count`: 1 + the topic's highest id before this record; its ids were
    0..count-1 while it was dense). The caller updates the count."""
    ids = sparse.get(topic_id)
    if ids is None:
        if partition_id <= count:
            raise InvariantViolation(f"a dense topic becomes sparse only at a gap: {partition_id} <= {count}")
        ids = sparse[topic_id] = array("q", range(count))
    i = bisect.bisect_left(ids, partition_id)
    if i == len(ids) or ids[i] != partition_id:  # a new id, not a replacement
        ids.insert(i, partition_id)


def copy_sparse(sparse: SparseIds) -> SparseIds:
    return {tid: array("q", ids) for tid, ids in sparse.items()}



def ids_extend_dense(counts: dict[str, int], sparse: SparseIds, topic_ids: list[str], pids: list[int]) -> bool:
    """Whether Partition rows (topic id, partition id), inserted in bulk
    with only the counts raised, leave every topic they touch dense: each
    topic's rows are one group, its ids counting up by one from the topic's
    count (what ControllerState.to_records writes, and a topic's creation).
    If not, the caller applies them record by record, which keeps the sparse
    ids. For a few rows; columns_extend_dense is the same over numpy columns."""
    if not topic_ids:
        return True
    one = topic_ids[0]
    if topic_ids.count(one) == len(topic_ids):  # one topic, as in a topic's creation: C loops only
        start = counts.get(one, 0)
        return not (sparse and one in sparse) and pids == list(range(start, start + len(pids)))
    current, expected, seen = None, 0, set()
    for t, pid in zip(topic_ids, pids):
        if t != current:
            if t in seen or (sparse and t in sparse):
                return False
            seen.add(t)
            current, expected = t, counts.get(t, 0)
        if pid != expected:
            return False
        expected += 1
    return True


def columns_extend_dense(counts: dict[str, int], sparse: SparseIds, topic_names: list[str], topic_index,
                         pids) -> bool:
    """ids_extend_dense over a metalog.storage.partition_runs.PartitionRun's columns
    (a slice of them): row i is partition pids[i] of topic_names[topic_index[i]].
    Vector operations, no per-row Python."""
    import numpy as np  # the loader's only, like the runs themselves

    n = len(topic_index)
    if n == 0:
        return True
    if sparse and any(t in sparse for t in topic_names):
        return False
    first = np.empty(n, dtype=bool)
    first[0] = True
    np.not_equal(topic_index[1:], topic_index[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    group_topics = topic_index[starts]
    if len(np.unique(group_topics)) != len(starts):  # a topic in two groups
        return False
    base = np.fromiter((counts.get(topic_names[t], 0) for t in group_topics.tolist()), dtype=np.int64,
                       count=len(starts))
    lengths = np.diff(np.append(starts, n))
    expected = np.repeat(base - starts, lengths) + np.arange(n)
    return bool((pids == expected).all())
