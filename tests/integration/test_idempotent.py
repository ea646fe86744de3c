"""Idempotent produce on real processes (KIP-98): a retried produce is stored
exactly once at its original offset, and a producer id survives a leader change.

The answer to a produce is lost the way it is in production: the leader
appends the batch but cannot commit it (both followers are frozen with
SIGSTOP), the client's attempt times out, and the client sends the SAME
request again (same producer id, epoch and sequence). Before idempotent
produce that retry was appended a second time.
"""

from __future__ import annotations

import asyncio
import signal

import pytest

from metalog.broker.client import MetalogClient
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.protocol.errors import Errors
from tests.integration.test_cluster import committed_values

pytestmark = pytest.mark.slow

# check-quorum (1.5 x fetch timeout) must not depose the leader while its
# followers are frozen for a few seconds.
SETTINGS = dict(election_timeout_ms=500, fetch_timeout_ms=5000, request_timeout_ms=1000,
                fetch_max_wait_ms=200, snapshot_min_records=1_000_000)


def events(cluster, node: int, name: str) -> list[dict]:
    return [e for e in cluster.read_log_lines(node) if e.get("event") == name]


def followers_committed(cluster, leader: int, hw: int):
    """(node, [(offset, value)]) below `hw` for every node but `leader`, read
    from its stopped data dir."""
    for n in [x for x in cluster.nodes if x != leader]:
        yield n, [(off, v) for off, _ep, v in committed_values(cluster.data_dir(n), hw)]


async def test_retry_after_a_lost_answer_is_stored_once_at_its_original_offset_and_survives_failover(make_cluster):
    cluster = make_cluster(voters=3, **SETTINGS)
    leader, epoch = await asyncio.to_thread(cluster.wait_for_leader, 20)
    followers = [n for n in cluster.nodes if n != leader]
    client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls(),
                           request_timeout_ms=1000, delivery_timeout_ms=60000, max_retries=200,
                           retry_backoff_ms=50)
    try:
        await client.produce([b"warm-up"])  # takes the producer id, sequence 0 used
        (producer,) = client._idle_producers
        pid = producer.producer_id
        assert pid >= 0 and producer.next_sequence == 1

        for n in followers:
            cluster.signal(n, signal.SIGSTOP)
        try:
            task = asyncio.create_task(client.produce([b"exactly-once"]))
            # The leader appended it (uncommitted); the client's attempt times out and it
            # sends the same request again, which the leader recognises as a duplicate.
            await asyncio.to_thread(cluster.wait_for, lambda: events(cluster, leader, "produce_duplicate"), 20,
                                    "the retried produce to reach the leader")
            assert not task.done(), "answered before the original was committed"
        finally:
            for n in followers:
                cluster.signal(n, signal.SIGCONT)
        base, ep = await asyncio.wait_for(task, 30)
        assert ep == epoch
        dup = events(cluster, leader, "produce_duplicate")[0]
        assert (dup["producer_id"], dup["base_sequence"], dup["original_base_offset"]) == (pid, 1, base)

        # Leader change: the new leader knows the producer from the batches it replicated.
        cluster.kill(leader)
        new_leader, new_epoch = await asyncio.to_thread(cluster.wait_for_leader, 30, {leader})
        assert new_epoch > epoch
        # The very same request once more, now at the new leader: its original offset.
        resp = await client._leader_request(
            ApiKey.PRODUCE, lambda: m.ProduceRequest(cluster_id=cluster.cluster_id, records=[b"exactly-once"],
                                                     producer_id=pid, producer_epoch=0, base_sequence=1),
            3000)
        # Its original offset. Kafka's Produce answer says no epoch (the client library fills in
        # the answering leader's: see _written_epoch); the raw answer has none.
        assert (resp.error_code, resp.base_offset, resp.leader_epoch) == (Errors.NONE, base, m.NO_EPOCH)
        # The same producer goes on at the next sequence (no OUT_OF_ORDER, no new id).
        after, after_epoch = await client.produce([b"after-failover"])
        assert after > base and after_epoch == new_epoch
        assert client.producers_initialized == 1
        # A gap in the sequence is refused with Kafka's error and message.
        gap = await client._leader_request(
            ApiKey.PRODUCE, lambda: m.ProduceRequest(cluster_id=cluster.cluster_id, records=[b"gap"],
                                                     producer_id=pid, producer_epoch=0, base_sequence=9),
            3000, passthrough=frozenset({Errors.OUT_OF_ORDER_SEQUENCE_NUMBER}))
        assert gap.error_code == Errors.OUT_OF_ORDER_SEQUENCE_NUMBER
        assert gap.error_message == f"producer id {pid} epoch 0: expected sequence 3, got 9..9"
        hw = (await client.metadata()).high_watermark
    finally:
        await client.close()
    cluster.stop()
    for n, values in followers_committed(cluster, leader, hw):
        assert [off for off, v in values if v == b"exactly-once"] == [base], f"broker {n}"
        assert [v for _off, v in values if v in (b"warm-up", b"exactly-once", b"after-failover", b"gap")] == [
            b"warm-up", b"exactly-once", b"after-failover"]


async def test_producer_ids_are_unique_across_a_leader_change(make_cluster):
    """Every InitProducerId answer is a distinct id, before and after the
    leader is killed: the new leader's ids are above every old one (its epoch
    is the high half), and InitProducerId puts nothing in the log that
    consumers would see."""
    cluster = make_cluster(voters=3, election_timeout_ms=500, fetch_timeout_ms=1000, request_timeout_ms=1000,
                           fetch_max_wait_ms=200)
    leader, _ = await asyncio.to_thread(cluster.wait_for_leader, 20)
    client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls(),
                           request_timeout_ms=2000, max_retries=50)
    try:
        ids = [await client.init_producer_id() for _ in range(5)]
        cluster.kill(leader)
        await asyncio.to_thread(cluster.wait_for_leader, 20, {leader})
        ids += [await client.init_producer_id() for _ in range(5)]
    finally:
        await client.close()
    assert all(e == 0 for _pid, e in ids)
    pids = [pid for pid, _e in ids]
    assert len(set(pids)) == 10 and pids == sorted(pids), pids
    assert pids[5] >> 32 > pids[4] >> 32  # a new leader, a new epoch, a new range
    hw = (await asyncio.to_thread(lambda: cluster.quorum(cluster.leader()[0])))["high_watermark"]
    cluster.stop()
    for n in cluster.nodes:
        if n != leader:
            assert committed_values(cluster.data_dir(n), hw) == [], "InitProducerId wrote records"


async def test_a_retry_pipelined_next_to_its_original_is_stored_once(make_cluster):
    """Requests written back to back on one connection reach the leader in one
    event-loop turn and are group-committed together: producer A's request,
    the same request again (a retry), a plain request, producer B's first
    request and A's next request. Each idempotent request of a group is judged
    before the group's single append, and a producer appears once per append,
    so the retry is answered with the original's offset (not appended again)
    and A's next request follows it in sequence (not OUT_OF_ORDER)."""
    cluster = make_cluster(voters=3, election_timeout_ms=500, fetch_timeout_ms=2000, request_timeout_ms=1000,
                           fetch_max_wait_ms=200)
    leader, _epoch = await asyncio.to_thread(cluster.wait_for_leader, 20)
    client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls(),
                           request_timeout_ms=5000, max_retries=50)
    try:
        (pid_a, ep_a), (pid_b, ep_b) = await client.init_producer_id(), await client.init_producer_id()
        await client.metadata()
        channel = client._channel(client._endpoints[client.leader_id])

        def produce(value: bytes, pid: int = -1, epoch: int = -1, seq: int = -1) -> m.ProduceRequest:
            return m.ProduceRequest(cluster_id=cluster.cluster_id, records=[value], timeout_ms=4000,
                                    producer_id=pid, producer_epoch=epoch, base_sequence=seq)

        bodies = [produce(b"a0", pid_a, ep_a, 0), produce(b"a0", pid_a, ep_a, 0), produce(b"plain"),
                  produce(b"b0", pid_b, ep_b, 0), produce(b"a1", pid_a, ep_a, 1)]
        answers = await asyncio.gather(*(channel.request(ApiKey.PRODUCE, b, 5000) for b in bodies))
        assert [(r.error_code, r.error_message) for r in answers] == [(Errors.NONE, None)] * 5
        a0, a0_retry, _plain, _b0, a1 = (r.base_offset for r in answers)
        assert a0_retry == a0 and a1 > a0
        hw = (await client.metadata()).high_watermark
    finally:
        await client.close()
    cluster.stop()
    for n, values in followers_committed(cluster, leader, hw):
        assert sorted(v for _off, v in values) == [b"a0", b"a1", b"b0", b"plain"], f"broker {n}"
        assert dict((v, off) for off, v in values)[b"a0"] == a0 and dict((v, off) for off, v in values)[b"a1"] == a1
