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
        assert partition_id > count, f"a dense topic becomes sparse only at a gap: {partition_id} <= {count}"
        ids = sparse[topic_id] = array("q", range(count))
    i = bisect.bisect_left(ids, partition_id)
    if i == len(ids) or ids[i] != partition_id:  # a new id, not a replacement
        ids.insert(i, partition_id)


def copy_sparse(sparse: SparseIds) -> SparseIds:
    return {tid: array("q", ids) for tid, ids in sparse.items()}
