"""broker/controller/partition_ids.py: when rows of Partition records may be inserted in
bulk with only the counts raised (each touched topic stays dense), the
row-by-row check and the numpy-column check agree."""

from array import array

import numpy as np
import pytest

from metalog.broker.controller import partition_ids as pi

A, B = "a", "b"


@pytest.mark.parametrize("rows, counts, sparse, dense", [
    ([(A, 0), (A, 1), (B, 0)], {}, {}, True),  # new topics from id 0
    ([(A, 3), (A, 4)], {A: 3}, {}, True),  # a topic continued from its count
    ([], {}, {}, True),
    ([(A, 0), (A, 2)], {}, {}, False),  # a gap
    ([(A, 1)], {}, {}, False),  # no id 0
    ([(A, 0), (B, 0), (A, 1)], {}, {}, False),  # a topic in two groups
    ([(A, 2)], {A: 3}, {}, False),  # a replacement: the index need not change, but the bulk path may not judge it
    ([(A, 0)], {}, {A: None}, False),  # a sparse topic keeps its array up to date record by record
])
def test_rows_and_columns_agree_on_what_stays_dense(rows, counts, sparse, dense):
    sparse = {t: array("q") for t in sparse}
    tids = [t for t, _ in rows]
    pids = [p for _, p in rows]
    names = sorted(set(tids)) or [A]
    index = np.array([names.index(t) for t in tids], dtype=np.int64)
    assert pi.ids_extend_dense(counts, sparse, tids, pids) is dense
    assert pi.columns_extend_dense(counts, sparse, names, index, np.array(pids, dtype=">i4")) is dense
