"""ClientAppend with idempotent waiters (KIP-98): one group commit becomes ONE
append and ONE flush holding one batch per idempotent waiter (its producer
fields in the header) and one per run of plain waiters; malformed producer
lists are refused with a ValueError naming the problem."""

import pytest

from metalog.broker.quorum import api as a
from metalog.storage.batch import decode_records, iter_batches

from tests.quorum.harness import Node, fetch, make_leader, of, responses


def test_a_mixed_group_is_one_append_and_one_flush_with_one_batch_per_idempotent_waiter():
    n = Node(1)
    now = make_leader(n)  # LeaderChange at offset 0
    waiters = [a.AppendWaiter("plain1", 2), a.AppendWaiter("plain2", 1), a.AppendWaiter("idem7", 2),
               a.AppendWaiter("idem9", 1), a.AppendWaiter("plain3", 1)]
    records = [b"a", b"b", b"c", b"d", b"e", b"f", b"g"]
    producers = [None, None, (7, 0, 10), (9, 3, 0), None]
    acts = n.step(a.ClientAppend(now, waiters, records, producers=producers))
    (app,) = of(acts, a.AppendBatches)
    assert len(of(acts, a.FlushLog)) == 1
    assert (app.base_offset, app.next_offset) == (1, 8)
    batches = [(h.base_offset, h.records_count, h.producer_id, h.producer_epoch, h.base_sequence,
                decode_records(bytes(app.data[pos:pos + h.size]), h))
               for pos, h in iter_batches(app.data)]
    assert batches == [
        (1, 3, -1, -1, -1, [b"a", b"b", b"c"]),  # plain1 and plain2 share a batch
        (4, 2, 7, 0, 10, [b"d", b"e"]),
        (6, 1, 9, 3, 0, [b"f"]),
        (7, 1, -1, -1, -1, [b"g"]),
    ]
    # Each waiter is answered with its own first offset once committed.
    n.step(a.FlushCompleted(now, 8))
    acts = fetch(n, now, 2, 8, n.core.epoch)
    got = {token: responses(acts, token)[0].base_offset for token in ("plain1", "plain2", "idem7", "idem9", "plain3")}
    assert got == {"plain1": 1, "plain2": 3, "idem7": 4, "idem9": 6, "plain3": 7}


def test_producers_none_keeps_one_plain_batch():
    n = Node(1)
    now = make_leader(n)
    acts = n.step(a.ClientAppend(now, [a.AppendWaiter("p", 1), a.AppendWaiter("q", 2)], [b"a", b"b", b"c"]))
    (app,) = of(acts, a.AppendBatches)
    assert [(h.base_offset, h.records_count, h.producer_id) for _pos, h in iter_batches(app.data)] == [(1, 3, -1)]


@pytest.mark.parametrize("producers, message", [
    ([(7, 0, 0)], r"ClientAppend has 2 waiter\(s\) but 1 producer entries"),
    ([(7, 0, 0), (7, 0, 1)], "producer id 7 appears twice in one ClientAppend"),
    ([(7, -1, 0), None], r"an idempotent waiter's producer must be \(id, epoch, base sequence\), all >= 0, "
                         r"got \(7, -1, 0\)"),
])
def test_malformed_producer_lists_are_refused(producers, message):
    n = Node(1)
    now = make_leader(n)
    with pytest.raises(ValueError, match=message):
        n.step(a.ClientAppend(now, [a.AppendWaiter("p", 1), a.AppendWaiter("q", 1)], [b"a", b"b"],
                              producers=producers))
    assert n.core.log_end_offset == 1  # nothing appended


def test_a_follower_answers_every_waiter_not_leader():
    n = Node(2)
    n.step(a.Tick(0))
    acts = n.step(a.ClientAppend(0, [a.AppendWaiter("p", 1), a.AppendWaiter("q", 1)], [b"a", b"b"],
                                 producers=[(7, 0, 0), None]))
    assert not of(acts, a.AppendBatches)
    assert [r.error_code for r in responses(acts)] == [6, 6]  # NOT_LEADER_OR_FOLLOWER
