"""MetalogClient and Consumer against an in-test fake cluster.

FakeCluster is a TEST DOUBLE for these client tests only: a few nodes served
by a real Kafka listener (``tests.net.flat_server.serve_flat``: the real
``serve_kafka`` and ``KafkaDispatch``) over loopback TCP that answer Metadata, Produce,
Fetch, OffsetsForLeaderEpoch, ListOffsets and DescribeQuorum from one
in-memory list of batches (everything is committed at once; the "leader" is
whatever the test says). It is not the broker; end-to-end client tests
against real brokers belong with the broker runtime.
"""

from __future__ import annotations

import asyncio

import pytest

from metalog.broker.client import (
    ClusterUnavailable, ConsumedRecord, CorruptRecordError, LogTruncationError, MetalogClient, MetalogError, NoOffsetError,
)
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.protocol.errors import Errors
from metalog.storage.batch import encode_batch
from metalog.storage.control_records import LeaderChange, encode_control
from metalog.storage.epochs import EpochHistory
from tests.net.flat_server import serve_flat, values_of
from tests.net.helpers import ListLogger

CLUSTER = "fake-cluster"


class FakeCluster:
    def __init__(self) -> None:
        self.batches: list[tuple[int, int, bytes]] = []  # (base_offset, next_offset, encoded)
        self.epochs = EpochHistory()
        self.leader_id = 1
        self.leader_epoch = 1
        self.servers: dict[int, asyncio.AbstractServer] = {}
        self.requests: list[tuple[int, int, m.Body]] = []  # (node, api key, body)
        self.drop_produce_once = False
        self.advertised: dict[int, tuple[str, int]] = {}  # node -> address Metadata names (default: its own)
        self.next_producer_id = 100
        self.produce_errors: list[int] = []  # error codes the next produces get, in order (NONE: appended)

    @property
    def end_offset(self) -> int:
        return self.batches[-1][1] if self.batches else 0

    def append(self, records: list[bytes], epoch: int | None = None, control: bool = False) -> int:
        epoch = self.leader_epoch if epoch is None else epoch
        base = self.end_offset
        self.epochs.assign(epoch, base)
        data = encode_batch(base, epoch, records, 0, is_control=control)
        self.batches.append((base, base + len(records), data))
        return base

    def truncate(self, end_offset: int) -> None:
        self.batches = [b for b in self.batches if b[1] <= end_offset]
        assert self.end_offset == end_offset, "truncate at a batch boundary"
        self.epochs.truncate_from_end(end_offset)

    async def start(self, nodes=(1, 2)) -> None:
        for node in nodes:
            self.servers[node] = await serve_flat(
                "127.0.0.1", 0, lambda c, h, b, node=node: self.handle(node, c, h, b), logger=ListLogger(),
                node_id=node, cluster_id=CLUSTER, endpoints=self.endpoints)

    def endpoints(self) -> dict[int, tuple[str, int]]:
        return {n: self.advertised.get(n, ("127.0.0.1", self.port(n))) for n in self.servers}

    def port(self, node: int) -> int:
        return self.servers[node].sockets[0].getsockname()[1]

    def stop(self) -> None:
        for s in self.servers.values():
            s.close()

    def hint(self) -> m.LeaderIdAndEpoch:
        return m.LeaderIdAndEpoch(self.leader_id, self.leader_epoch)

    def handle(self, node, conn, header, body):
        self.requests.append((node, header.api_key, body))
        conn.send_response(header.correlation_id, self.answer(node, header.api_key, body))

    def answer(self, node, api_key, body):
        resp_type = {ApiKey.PRODUCE: m.ProduceResponse, ApiKey.FETCH: m.FetchResponse,
                     ApiKey.OFFSET_FOR_LEADER_EPOCH: m.OffsetsForLeaderEpochResponse,
                     ApiKey.LIST_OFFSETS: m.ListOffsetsResponse,
                     ApiKey.DESCRIBE_QUORUM: m.DescribeQuorumResponse,
                     ApiKey.INIT_PRODUCER_ID: m.InitProducerIdResponse}.get(api_key)
        if api_key == ApiKey.METADATA:
            return m.MetadataResponse(
                cluster_id=CLUSTER, node_id=node, leader_id=self.leader_id, leader_epoch=self.leader_epoch,
                high_watermark=self.end_offset, log_start_offset=0,
                voters=[m.NodeEndpoint(n, *self.advertised.get(n, ("127.0.0.1", self.port(n))))
                        for n in self.servers],
            )
        if getattr(body, "cluster_id", None) not in (None, CLUSTER):  # None: Kafka's Produce carries none
            return resp_type(error_code=Errors.INCONSISTENT_CLUSTER_ID)
        if node != self.leader_id:
            kw = {} if api_key == ApiKey.DESCRIBE_QUORUM else {"current_leader": self.hint()}
            return resp_type(error_code=Errors.NOT_LEADER_OR_FOLLOWER, **kw)
        epoch = getattr(body, "current_leader_epoch", m.NO_EPOCH)
        if epoch != m.NO_EPOCH and epoch < self.leader_epoch:
            return resp_type(error_code=Errors.FENCED_LEADER_EPOCH, current_leader=self.hint())
        if epoch > self.leader_epoch:
            return resp_type(error_code=Errors.UNKNOWN_LEADER_EPOCH, current_leader=self.hint())
        if api_key == ApiKey.INIT_PRODUCER_ID:
            self.next_producer_id += 1
            return m.InitProducerIdResponse(producer_id=self.next_producer_id - 1, producer_epoch=0)
        if api_key == ApiKey.PRODUCE:
            if self.produce_errors:
                code = self.produce_errors.pop(0)
                if code != Errors.NONE:  # NONE: this one is appended as usual
                    return m.ProduceResponse(error_code=code, error_message="fake refusal")
            if self.drop_produce_once:
                self.drop_produce_once = False
                return m.ProduceResponse(error_code=Errors.REQUEST_TIMED_OUT)
            return m.ProduceResponse(base_offset=self.append(values_of(body)), leader_epoch=self.leader_epoch)
        if api_key == ApiKey.FETCH:
            if body.last_fetched_epoch != m.NO_EPOCH and body.fetch_offset > 0:
                e, end = self.epochs.end_offset_for_epoch(body.last_fetched_epoch, self.end_offset)
                if e != body.last_fetched_epoch or end < body.fetch_offset:
                    return m.FetchResponse(high_watermark=self.end_offset, diverging_epoch=m.EpochEndOffset(e, end))
            if body.fetch_offset > self.end_offset:
                return m.FetchResponse(error_code=Errors.OFFSET_OUT_OF_RANGE)
            data = b"".join(d for base, nxt, d in self.batches if nxt > body.fetch_offset)
            return m.FetchResponse(high_watermark=self.end_offset, log_start_offset=0, records=data)
        if api_key == ApiKey.OFFSET_FOR_LEADER_EPOCH:
            e, end = self.epochs.end_offset_for_epoch(body.leader_epoch, self.end_offset)
            return m.OffsetsForLeaderEpochResponse(leader_epoch=e, end_offset=end)
        if api_key == ApiKey.LIST_OFFSETS:
            if body.timestamp_ms == m.LIST_OFFSETS_EARLIEST:
                off = 0
            else:
                off = self.end_offset
            ep = self.epochs.epoch_for_offset(max(off - 1, 0)) if self.batches else m.NO_EPOCH
            return m.ListOffsetsResponse(offset=off, leader_epoch=ep)
        if api_key == ApiKey.DESCRIBE_QUORUM:
            return m.DescribeQuorumResponse(leader_id=self.leader_id, leader_epoch=self.leader_epoch,
                                            high_watermark=self.end_offset)
        return m.ErrorResponse(error_code=Errors.INVALID_REQUEST, error_message="fake: unsupported")


@pytest.fixture
async def cluster():
    fc = FakeCluster()
    await fc.start()
    yield fc
    fc.stop()


def make_client(fc: FakeCluster, **kw) -> MetalogClient:
    kw.setdefault("retry_backoff_ms", 5)
    kw.setdefault("request_timeout_ms", 2000)
    return MetalogClient([("127.0.0.1", fc.port(2))], CLUSTER, logger=ListLogger(), **kw)


async def poll_until(consumer, n: int, max_polls: int = 20) -> list[ConsumedRecord]:
    out: list[ConsumedRecord] = []
    for _ in range(max_polls):
        if len(out) >= n:
            break
        out += await consumer.poll(max_wait_ms=10)
    return out


async def test_bootstrap_discovers_leader_and_produces(cluster):
    client = make_client(cluster)
    md = await client.metadata()
    assert (md.leader_id, md.leader_epoch) == (1, 1)  # (Kafka's Metadata names no answering node)
    assert [v.node_id for v in md.voters] == [1, 2]
    assert await client.produce([b"a", b"b"]) == (0, 1)
    assert await client.produce([b"c"]) == (2, 1)
    # Produce went to the leader (node 1) even though bootstrap named node 2.
    assert {n for n, k, _ in cluster.requests if k == ApiKey.PRODUCE} == {1}
    dq = await client.describe_quorum()
    assert (dq.leader_id, dq.high_watermark) == (1, 3)
    await client.close()


async def test_resolve_address_hook_decides_where_advertised_brokers_are_dialled(cluster):
    """The public hook the fault drill uses: Metadata advertises the leader at an
    address nothing listens on (as a drill's proxy listener would be for a
    client); resolve_address maps it to the real broker, so produce reaches the
    leader there, and the hook saw every advertised address."""
    cluster.advertised[1] = ("127.0.0.1", 1)  # port 1: connection refused if dialled
    seen = []

    def resolve(addr):
        seen.append(addr)
        return ("127.0.0.1", cluster.port(1)) if addr == ("127.0.0.1", 1) else addr

    client = make_client(cluster, resolve_address=resolve)
    assert await client.produce([b"a"]) == (0, 1)
    assert {n for n, k, _ in cluster.requests if k == ApiKey.PRODUCE} == {1}
    assert ("127.0.0.1", 1) in seen and ("127.0.0.1", cluster.port(2)) in seen
    assert client.answered_by == (1, f"127.0.0.1:{cluster.port(1)}")
    await client.close()


async def test_follows_not_leader_hint(cluster):
    client = make_client(cluster)
    await client.produce([b"a"])
    cluster.leader_id, cluster.leader_epoch = 2, 2
    assert await client.produce([b"b"]) == (1, 2)
    assert (client.leader_id, client.leader_epoch) == (2, 2)
    kinds = [(n, k) for n, k, _ in cluster.requests if k == ApiKey.PRODUCE]
    assert kinds == [(1, ApiKey.PRODUCE), (1, ApiKey.PRODUCE), (2, ApiKey.PRODUCE)]
    await client.close()


async def test_produce_retries_server_timeout(cluster):
    client = make_client(cluster)
    cluster.drop_produce_once = True
    assert await client.produce([b"x"]) == (0, 1)
    assert sum(1 for _, k, _ in cluster.requests if k == ApiKey.PRODUCE) == 2
    await client.close()


async def test_wrong_cluster_id_and_unreachable_bootstrap(cluster):
    client = MetalogClient([("127.0.0.1", cluster.port(1))], "other", retry_backoff_ms=5, max_retries=1,
                           logger=ListLogger())
    with pytest.raises(ClusterUnavailable, match="cluster id 'fake-cluster', expected 'other'"):
        await client.metadata()
    await client.close()
    port = cluster.port(1)
    cluster.stop()
    client = MetalogClient([("127.0.0.1", port)], CLUSTER, retry_backoff_ms=5, max_retries=1,
                           connect_timeout_ms=500, logger=ListLogger())
    with pytest.raises(ClusterUnavailable, match="no node answered Metadata: 127.0.0.1:"):
        await client.metadata()
    await client.close()


async def test_non_retriable_error_is_raised(cluster):
    client = make_client(cluster)
    with pytest.raises(ValueError, match="produce needs at least one record"):
        await client.produce([])
    cluster.leader_epoch = 5
    with pytest.raises(MetalogError, match="FENCED_LEADER_EPOCH") as ei:
        await client.list_offsets(m.LIST_OFFSETS_LATEST, current_leader_epoch=3)
    assert ei.value.error_code == Errors.FENCED_LEADER_EPOCH
    await client.close()


async def test_consumer_reads_in_order_skipping_control_batches(cluster):
    cluster.append([encode_control(LeaderChange(leader_id=1, voters=[1, 2]))], control=True)
    cluster.append([b"r1", b"r2"])
    cluster.append([b"r3"])
    client = make_client(cluster)
    consumer = client.consumer("earliest")
    got = await poll_until(consumer, 3)
    assert got == [ConsumedRecord(1, 1, b"r1"), ConsumedRecord(2, 1, b"r2"), ConsumedRecord(3, 1, b"r3")]
    assert consumer.position == 4
    # seek into the middle of a batch: records below the position are skipped
    consumer.seek(2)
    assert await poll_until(consumer, 2) == got[1:]
    latest = client.consumer("latest")
    assert await latest.poll(max_wait_ms=10) == []
    cluster.append([b"r4"])
    assert await poll_until(latest, 1) == [ConsumedRecord(4, 1, b"r4")]
    await client.close()


async def test_consumer_without_position_and_policy_none(cluster):
    client = make_client(cluster)
    with pytest.raises(ValueError, match="reset_policy must be 'earliest', 'latest' or 'none', not 'sometimes'"):
        client.consumer("sometimes")
    with pytest.raises(NoOffsetError, match="reset_policy='none': call seek\\(\\) first"):
        await client.consumer("none").poll(10)
    await client.close()


async def setup_truncation(cluster: FakeCluster, client: MetalogClient, policy: str):
    """Consume offsets 0..9 at epoch 1, then a new leader at epoch 2 keeps only 0..5."""
    cluster.append([b"a%d" % i for i in range(6)])
    cluster.append([b"b%d" % i for i in range(4)])  # offsets 6..9, to be lost
    consumer = client.consumer(policy)
    consumer.seek(0)
    assert len(await poll_until(consumer, 10)) == 10
    assert (consumer.position, consumer.last_epoch) == (10, 1)
    cluster.truncate(6)
    cluster.leader_id, cluster.leader_epoch = 2, 2
    cluster.append([b"new%d" % i for i in range(5)])  # offsets 6..10 at epoch 2
    return consumer


async def test_truncation_detected_after_leader_change_policy_none(cluster):
    client = make_client(cluster)
    consumer = await setup_truncation(cluster, client, "none")
    with pytest.raises(LogTruncationError) as ei:
        await consumer.poll(10)
    assert (ei.value.first_diverging_offset, ei.value.epoch, ei.value.position) == (6, 1, 10)
    assert "leader's log ends epoch 1 at offset 6, below the consumer position 10" in str(ei.value)
    # It was found with OffsetsForLeaderEpoch(last consumed epoch 1) to the new leader.
    ofle = [b for n, k, b in cluster.requests if k == ApiKey.OFFSET_FOR_LEADER_EPOCH]
    assert ofle[-1].leader_epoch == 1 and ofle[-1].current_leader_epoch == 2
    # Keeps raising until the user seeks; then reads the new leader's records.
    with pytest.raises(LogTruncationError):
        await consumer.poll(10)
    consumer.seek(ei.value.first_diverging_offset, ei.value.epoch)
    got = await poll_until(consumer, 5)
    assert got[0] == ConsumedRecord(6, 2, b"new0") and len(got) == 5
    await client.close()


@pytest.mark.parametrize("policy", ["earliest", "latest"])
async def test_truncation_resets_precisely_with_auto_reset(cluster, policy):
    client = make_client(cluster)
    consumer = await setup_truncation(cluster, client, policy)
    got = await poll_until(consumer, 5)
    assert [r.offset for r in got] == [6, 7, 8, 9, 10]
    assert all(r.leader_epoch == 2 for r in got)
    await client.close()


async def test_truncation_detected_through_diverging_epoch_in_fetch(cluster):
    """Same leader epoch known to the client (no leader change seen), but the fetch says diverging."""
    client = make_client(cluster)
    cluster.append([b"a%d" % i for i in range(6)])
    cluster.append([b"b%d" % i for i in range(4)])
    consumer = client.consumer("none")
    consumer.seek(0)
    assert len(await poll_until(consumer, 10)) == 10
    # Rewrite history under the same leader epoch the client knows (epoch bump hidden).
    cluster.truncate(6)
    cluster.epochs.assign(1, 0)
    cluster.leader_epoch = 2
    client.leader_epoch = 2  # as if metadata told us already and we validated under it
    consumer._validated_leader_epoch = 2
    cluster.append([b"n"])
    with pytest.raises(LogTruncationError) as ei:
        await consumer.poll(10)
    assert ei.value.first_diverging_offset == 6
    # Found from the Fetch answer itself, without an OffsetsForLeaderEpoch round trip.
    assert not [k for _, k, _ in cluster.requests if k == ApiKey.OFFSET_FOR_LEADER_EPOCH]
    await client.close()


async def test_seek_with_epoch_validates_first(cluster):
    client = make_client(cluster)
    cluster.append([b"a%d" % i for i in range(3)])
    cluster.leader_epoch = 2
    cluster.append([b"b%d" % i for i in range(3)])
    consumer = client.consumer("none")
    consumer.seek(5, epoch=2)  # consistent with the log: fine
    assert await poll_until(consumer, 1) == [ConsumedRecord(5, 2, b"b2")]
    consumer.seek(5, epoch=1)  # epoch 1 ended at 3 on the leader: records 3..4 diverged
    with pytest.raises(LogTruncationError) as ei:
        await consumer.poll(10)
    assert (ei.value.first_diverging_offset, ei.value.epoch) == (3, 1)
    await client.close()


async def test_consumer_refuses_an_answer_that_skips_past_its_position(cluster):
    """A server that answered a fetch with batches starting after the fetch
    offset would make the consumer skip records silently: it raises instead."""
    cluster.append([b"r0", b"r1"])
    cluster.append([b"r2"])
    client = make_client(cluster)
    consumer = client.consumer("earliest")
    assert [r.value for r in await poll_until(consumer, 3)] == [b"r0", b"r1", b"r2"]
    # Plant the server bug: the batch at offset 3 disappears, offset 4 follows.
    cluster.append([b"lost"])
    cluster.append([b"r4"])
    del cluster.batches[-2]
    with pytest.raises(MetalogError) as err:
        await poll_until(consumer, 1)
    assert "fetch at offset 3 answered from offset 4" in str(err.value)
    await client.close()


async def test_consumer_raises_corrupt_record_error_naming_offset_epoch_and_broker(cluster):
    """Kafka's check.crcs: a batch whose CRC does not match raises
    CorruptRecordError naming offset, epoch and broker; the good records before
    it come first, and the consumer never stops silently at the damage."""
    cluster.append([b"r0", b"r1"])
    cluster.append([b"r2"], epoch=1)
    base, nxt, data = cluster.batches[-1]
    damaged = bytearray(data)
    damaged[-1] ^= 0x01  # a bit in the record value: only the CRC can tell
    cluster.batches[-1] = (base, nxt, bytes(damaged))
    client = make_client(cluster)
    consumer = client.consumer("earliest")
    assert [r.value for r in await consumer.poll(100)] == [b"r0", b"r1"]
    with pytest.raises(CorruptRecordError) as err:
        await consumer.poll(100)
    e = err.value
    assert (e.offset, e.epoch, e.broker_id) == (2, 1, 1)
    assert e.broker_address == f"127.0.0.1:{cluster.port(1)}"
    assert str(e).startswith("CORRUPT_MESSAGE: corrupt batch at offset 2 (epoch 1) from broker 1 (127.0.0.1:")
    assert "CRC mismatch" in str(e)
    assert consumer.position == 2  # still at the damaged batch: it raises again, never skips
    with pytest.raises(CorruptRecordError):
        await consumer.poll(100)
    await client.close()


async def test_consumer_raises_on_a_batch_cut_short(cluster):
    """A fetch answer ending inside a batch is not silently dropped: CorruptRecordError says so."""
    cluster.append([b"r0", b"r1"])
    base, nxt, data = cluster.batches[-1]
    cluster.batches[-1] = (base, nxt, data[:-3])
    client = make_client(cluster)
    with pytest.raises(CorruptRecordError, match=r"at offset 0 \(epoch 1\) from broker 1 .*only"):
        await client.consumer("earliest").poll(100)
    await client.close()


def produces(fc: FakeCluster) -> list[tuple[list[bytes], int, int, int]]:
    return [(values_of(b), b.producer_id, b.producer_epoch, b.base_sequence)
            for _n, k, b in fc.requests if k == ApiKey.PRODUCE]


async def test_idempotent_produce_numbers_records_and_a_retry_reuses_its_sequence(cluster):
    client = make_client(cluster)
    assert await client.produce([b"a", b"b"]) == (0, 1)
    cluster.drop_produce_once = True  # the first attempt's answer is REQUEST_TIMED_OUT
    assert await client.produce([b"c"]) == (2, 1)
    assert await client.produce([b"d"]) == (3, 1)
    assert produces(cluster) == [([b"a", b"b"], 100, 0, 0), ([b"c"], 100, 0, 2), ([b"c"], 100, 0, 2),
                                 ([b"d"], 100, 0, 3)]
    assert sum(1 for _n, k, _b in cluster.requests if k == ApiKey.INIT_PRODUCER_ID) == 1
    await client.close()


async def test_unknown_producer_id_takes_a_new_id_and_resends_as_its_first_batch(cluster):
    client = make_client(cluster)
    await client.produce([b"a"])
    cluster.produce_errors = [Errors.UNKNOWN_PRODUCER_ID]  # e.g. expired on the leader
    assert await client.produce([b"b"]) == (1, 1)
    assert produces(cluster)[1:] == [([b"b"], 100, 0, 1), ([b"b"], 101, 0, 0)]
    await client.close()


async def test_out_of_order_is_permanent_and_the_next_call_uses_a_new_producer(cluster):
    """The user sees MetalogError OUT_OF_ORDER_SEQUENCE_NUMBER with the leader's
    message; the failed producer is not reused."""
    client = make_client(cluster)
    await client.produce([b"a"])
    cluster.produce_errors = [Errors.OUT_OF_ORDER_SEQUENCE_NUMBER]
    with pytest.raises(MetalogError, match="OUT_OF_ORDER_SEQUENCE_NUMBER: fake refusal") as ei:
        await client.produce([b"b"])
    assert ei.value.error_code == Errors.OUT_OF_ORDER_SEQUENCE_NUMBER
    await client.produce([b"c"])
    assert produces(cluster)[-1] == ([b"c"], 101, 0, 0)
    await client.close()


async def test_concurrent_produces_use_separate_producers_and_plain_mode_sends_none(cluster):
    client = make_client(cluster)
    await asyncio.gather(*(client.produce([b"x%d" % i]) for i in range(3)))
    seen = {(pid, seq) for _r, pid, _e, seq in produces(cluster)}
    assert seen == {(100, 0), (101, 0), (102, 0)}  # one in flight per producer, all at sequence 0
    await asyncio.gather(*(client.produce([b"y%d" % i]) for i in range(3)))
    assert client.producers_initialized == 3  # reused, not re-initialized
    plain = make_client(cluster, idempotent=False)
    await plain.produce([b"z"])
    assert produces(cluster)[-1] == ([b"z"], -1, -1, -1)
    await client.close()
    await plain.close()


async def test_concurrent_calls_share_a_request_and_each_gets_its_own_first_offset(cluster):
    """While the client's requests are out, later calls wait and leave
    together, as a Kafka producer's records share a batch; each call's
    records stay consecutive and its answer is its own first offset."""
    client = make_client(cluster, produce_inflight_max=1)
    calls = [[b"c%d-%d" % (i, j) for j in range(1 + i % 3)] for i in range(10)]
    answers = await asyncio.gather(*(client.produce(records) for records in calls))
    sent = produces(cluster)
    assert [records for records, *_ in sent] == [calls[0], [r for c in calls[1:] for r in c]]
    assert client.produce_requests_sent == 2
    stored = [r for records, *_ in sent for r in records]
    for records, (offset, epoch) in zip(calls, answers):
        assert stored[offset:offset + len(records)] == records
        assert epoch == 1
    # One producer, its sequences in order: the batch is one request of it.
    assert [(pid, seq) for _r, pid, _e, seq in sent] == [(100, 0), (100, 1)]
    await client.close()


async def test_a_failed_shared_request_fails_each_of_its_calls(cluster):
    """The user sees the request's error on every call it carried; the calls
    after it use a new producer, as after a failed call of its own."""
    client = make_client(cluster, produce_inflight_max=1)
    await client.produce([b"a"])
    cluster.produce_errors = [Errors.NONE, Errors.OUT_OF_ORDER_SEQUENCE_NUMBER]
    results = await asyncio.gather(*(client.produce([b"x%d" % i]) for i in range(4)), return_exceptions=True)
    assert results[0] == (1, 1)
    for failed in results[1:]:
        assert isinstance(failed, MetalogError) and failed.error_code == Errors.OUT_OF_ORDER_SEQUENCE_NUMBER
    assert await client.produce([b"b"]) == (2, 1)
    assert produces(cluster)[-1] == ([b"b"], 101, 0, 0)
    await client.close()


async def test_a_cancelled_waiting_call_is_not_sent(cluster):
    client = make_client(cluster, produce_inflight_max=1)
    first = asyncio.ensure_future(client.produce([b"first"]))
    waiting = asyncio.ensure_future(client.produce([b"cancelled"]))
    later = asyncio.ensure_future(client.produce([b"later"]))
    await asyncio.sleep(0)  # each call queued; only the first request is out
    waiting.cancel()
    assert await first == (0, 1)
    assert await later == (1, 1)
    assert [records for records, *_ in produces(cluster)] == [[b"first"], [b"later"]]
    await client.close()
