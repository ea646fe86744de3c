"""The data path judged by Kafka clients we did not write, over mutual TLS
(issue 32 items 3 and 6): confluent-kafka (librdkafka), kafka-python,
aiokafka and kcat produce to and consume from ``__cluster_metadata``
partition 0 on the Kafka listener; our own storage reader finds the
records in the log files as the clients built them; a leader killed with
-9 mid-stream loses or repeats none of the idempotent producer's
acknowledged records; a damaged batch and an offset past the end are
answered as Kafka answers them.

One module cluster (conftest's ``kafka_cluster``); the leader-kill test
runs last, as it changes the leader."""

from __future__ import annotations

import asyncio
import datetime
import glob
import os
import re
import shutil
import subprocess
import threading
import time
import uuid

import pytest

from metalog.broker.server.recovery import PARTITION_DIR
from metalog.storage.batch import decode_full_records, iter_batches

TOPIC = "__cluster_metadata"
DEADLINE_S = 60


def run_id() -> str:
    return uuid.uuid4().hex[:8]


def produce_librdkafka(kc, prefix: str, n: int, **conf) -> dict[int, int]:
    """n records (key, value, two headers) from an idempotent librdkafka
    producer, acks=all; {record index: offset} as its delivery reports say."""
    from confluent_kafka import Producer

    producer = Producer(kc.librdkafka_conf(**{"enable.idempotence": True, "acks": "all", "linger.ms": 5, **conf}))
    offsets: dict[int, int] = {}
    errors: list[str] = []

    def delivered(err, msg):
        if err is not None:
            errors.append(str(err))
        else:
            offsets[int(msg.key().decode().rsplit("-", 1)[1])] = msg.offset()

    for i in range(n):
        producer.produce(TOPIC, partition=0, key=f"{prefix}-{i}".encode(), value=f"value {i} of {prefix}".encode(),
                         headers=[("run", prefix.encode()), ("i", str(i).encode())], on_delivery=delivered)
        producer.poll(0)
    assert producer.flush(DEADLINE_S) == 0, "records still undelivered"
    assert errors == []
    return offsets


def ours(key: bytes | None, prefix: str) -> int | None:
    """The record index of one of this run's keys, else None."""
    if key is None or not key.startswith(prefix.encode() + b"-"):
        return None
    return int(key.rsplit(b"-", 1)[1])


def consume_librdkafka(kc, prefix: str, want: int, start: int = 0,
                       transport_errors: list | None = None) -> list[tuple[int, int, bytes, list, int]]:
    """(index, offset, value, headers, leader epoch) of this run's records, in the order a
    librdkafka consumer with assign() at `start` reads them, until `want` are
    read. librdkafka's own connection events (a broker gone: negative codes
    such as _TRANSPORT) go to `transport_errors` if given; any other error fails."""
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    local = (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._RESOLVE)

    consumer = Consumer(kc.librdkafka_conf(**{"group.id": f"t-{prefix}", "enable.auto.commit": False,
                                               "auto.offset.reset": "error"}))
    try:
        consumer.assign([TopicPartition(TOPIC, 0, start)])
        got: list[tuple[int, int, bytes, list, int]] = []
        deadline = time.monotonic() + DEADLINE_S
        while len(got) < want and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error() is not None and transport_errors is not None and msg.error().code() in local:
                transport_errors.append(msg.error())
                continue
            assert msg.error() is None, msg.error()
            index = ours(msg.key(), prefix)
            if index is not None:
                got.append((index, msg.offset(), msg.value(), msg.headers(), msg.leader_epoch()))
        return got
    finally:
        consumer.close()


def records_in_log_files(data_dir: str, prefix: str) -> dict[int, tuple[int, bytes, tuple]]:
    """{index: (offset, value, headers)} of this run's records in a node's
    segment files, read by our own storage code (every CRC checked)."""
    found = {}
    for path in sorted(glob.glob(os.path.join(data_dir, PARTITION_DIR, "*.log"))):
        with open(path, "rb") as f:
            data = f.read()
        for pos, h in iter_batches(data):
            if h.is_control:
                continue
            for i, rec in enumerate(decode_full_records(memoryview(data)[pos:pos + h.size], h)):
                index = ours(rec.key, prefix)
                if index is not None:
                    found[index] = (h.base_offset + i, rec.value, rec.headers)
    return found


# ------------------------------------------------------------------ librdkafka
def test_librdkafka_idempotent_producer_and_consumer(kafka_cluster):
    kc = kafka_cluster
    prefix, n = run_id(), 300
    offsets = produce_librdkafka(kc, prefix, n)
    assert sorted(offsets) == list(range(n))
    assert [offsets[i] for i in range(n)] == sorted(offsets.values())  # in order, one partition

    got = consume_librdkafka(kc, prefix, n)
    assert [g[0] for g in got] == list(range(n)), "each record once, in the order produced"
    for index, offset, value, headers, _epoch in got:
        assert offset == offsets[index]
        assert value == f"value {index} of {prefix}".encode()
        assert headers == [("run", prefix.encode()), ("i", str(index).encode())]

    # Every voter's log files hold them as the client built them (keys and headers kept).
    leader, _ = kc.leader()
    for nid in (1, 2, 3):
        files = kc.cluster.wait_for(lambda: (r := records_in_log_files(kc.cluster.data_dir(nid), prefix))
                                    and len(r) == n and r, DEADLINE_S, f"node {nid}'s log files")
        assert {i: off for i, (off, _v, _h) in files.items()} == offsets
        assert files[7][1:] == (f"value 7 of {prefix}".encode(), ((b"run", prefix.encode()), (b"i", b"7")))


# ---------------------------------------------- kafka-python, aiokafka, kcat
def kafka_python_tls(kc) -> dict:
    return dict(bootstrap_servers=kc.bootstrap.split(","), security_protocol="SSL", ssl_cafile=kc.cert("ca.crt"),
                ssl_certfile=kc.cert("admin.crt"), ssl_keyfile=kc.cert("admin.key"), request_timeout_ms=20000)


async def consume_aiokafka(kc, prefix: str, want: int) -> list[tuple[int, int, bytes]]:
    from aiokafka import AIOKafkaConsumer, TopicPartition
    from aiokafka.helpers import create_ssl_context

    ssl_context = create_ssl_context(cafile=kc.cert("ca.crt"), certfile=kc.cert("admin.crt"),
                                     keyfile=kc.cert("admin.key"))
    consumer = AIOKafkaConsumer(bootstrap_servers=kc.bootstrap.split(","), security_protocol="SSL",
                                ssl_context=ssl_context, group_id=None, enable_auto_commit=False)
    await consumer.start()
    try:
        tp = TopicPartition(TOPIC, 0)
        consumer.assign([tp])
        consumer.seek(tp, 0)
        got: list[tuple[int, int, bytes]] = []
        deadline = time.monotonic() + DEADLINE_S
        while len(got) < want and time.monotonic() < deadline:
            for msgs in (await consumer.getmany(timeout_ms=500)).values():
                for msg in msgs:
                    index = ours(msg.key, prefix)
                    if index is not None:
                        got.append((index, msg.offset, msg.value))
        return got
    finally:
        await consumer.stop()


def test_kafka_python_produces_and_kafka_python_aiokafka_kcat_consume(kafka_cluster):
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    kc = kafka_cluster
    prefix, n = run_id(), 50
    producer = KafkaProducer(acks="all", enable_idempotence=True, **kafka_python_tls(kc))
    try:
        futures = [producer.send(TOPIC, partition=0, key=f"{prefix}-{i}".encode(), value=f"kp {i}".encode(),
                                 headers=[("i", str(i).encode())]) for i in range(n)]
        offsets = {i: f.get(timeout=DEADLINE_S).offset for i, f in enumerate(futures)}
    finally:
        producer.close()
    assert [offsets[i] for i in range(n)] == sorted(offsets.values())

    consumer = KafkaConsumer(group_id=None, enable_auto_commit=False, **kafka_python_tls(kc))
    try:
        tp = TopicPartition(TOPIC, 0)
        consumer.assign([tp])
        consumer.seek(tp, 0)
        got = []
        deadline = time.monotonic() + DEADLINE_S
        while len(got) < n and time.monotonic() < deadline:
            for msgs in consumer.poll(timeout_ms=500).values():
                got += [(ours(r.key, prefix), r.offset, r.value, r.headers) for r in msgs
                        if ours(r.key, prefix) is not None]
    finally:
        consumer.close()
    assert got == [(i, offsets[i], f"kp {i}".encode(), [("i", str(i).encode())]) for i in range(n)]

    assert asyncio.run(consume_aiokafka(kc, prefix, n)) == [(i, offsets[i], f"kp {i}".encode()) for i in range(n)]

    kcat = shutil.which("kcat")
    assert kcat, "kcat is not installed: bash run.sh setup installs it (Debian package kcat)"
    out = subprocess.run([kcat, "-F", kc.cluster.kafka_properties_path, "-C", "-t", TOPIC, "-p", "0",
                          "-o", "beginning", "-e", "-q", "-f", "%o|%k|%s\n"],
                         capture_output=True, timeout=DEADLINE_S)
    assert out.returncode == 0, out.stderr
    lines = re.findall(rb"^(\d+)\|" + re.escape(prefix.encode()) + rb"-(\d+)\|(kp \d+)$", out.stdout, re.M)
    assert [(int(i), int(o), v) for o, i, v in lines] == [(i, offsets[i], f"kp {i}".encode()) for i in range(n)]


def test_every_node_hands_out_producer_ids_from_the_leaders_epoch(kafka_cluster):
    """Kafka's clients ask any broker for an idempotent producer's id: a
    follower (and the observer) asks the leader in its own name; every id is
    distinct, its high half the leader's epoch (metalog.broker.server.idempotence)."""
    from kio.schema.init_producer_id.v4.request import InitProducerIdRequest
    from kio.schema.init_producer_id.v4.response import InitProducerIdResponse

    kc = kafka_cluster
    leader, epoch = kc.leader()
    ids = []
    for nid in sorted(kc.kafka_ports):
        raw = kc.raw(nid)
        try:
            for cid in (1, 2):
                req = InitProducerIdRequest(transactional_id=None, transaction_timeout=datetime.timedelta(0),
                                            producer_id=-1, producer_epoch=-1)
                got_cid, resp = raw.ask(req, InitProducerIdResponse, cid)
                assert (got_cid, resp.error_code, resp.producer_epoch) == (cid, 0, 0), (nid, resp)
                ids.append(resp.producer_id)
        finally:
            raw.close()
    assert len(set(ids)) == len(ids) == 2 * len(kc.kafka_ports)
    assert {pid >> 32 for pid in ids} == {epoch}


# -------------------------------------------------------------------- bad input
def test_a_damaged_batch_is_corrupt_message_and_nothing_is_appended(kafka_cluster):
    from kafka.record.default_records import DefaultRecordBatchBuilder
    from kio.schema.produce.v9.request import PartitionProduceData, ProduceRequest, TopicProduceData
    from kio.schema.produce.v9.response import ProduceResponse

    kc = kafka_cluster

    def produce(records: bytes, correlation_id: int):
        req = ProduceRequest(acks=-1, timeout=datetime.timedelta(seconds=10), topic_data=(TopicProduceData(
            name=TOPIC, partition_data=(PartitionProduceData(index=0, records=records),)),))
        raw = kc.raw()  # the leader's listener
        try:
            cid, resp = raw.ask(req, ProduceResponse, correlation_id)
        finally:
            raw.close()
        assert cid == correlation_id
        (topic,) = resp.responses
        (part,) = topic.partition_responses
        return part

    builder = DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=False, producer_id=-1,
                                        producer_epoch=-1, base_sequence=-1, batch_size=1 << 16)
    builder.append(0, timestamp=int(time.time() * 1000), key=b"damaged", value=b"never stored", headers=[])
    good = bytes(builder.build())
    bad = bytearray(good)
    bad[-3] ^= 0x10  # a value byte: the CRC no longer matches
    first = produce(good, 11)
    assert first.error_code == 0
    refused = produce(bytes(bad), 12)
    assert refused.error_code == 2, refused  # CORRUPT_MESSAGE
    again = produce(good, 13)
    # The refused batch took no offset: the next one follows the first directly.
    assert (again.error_code, again.base_offset) == (0, first.base_offset + 1)


def test_a_follower_answers_produce_with_the_current_leader(kafka_cluster):
    """NOT_LEADER_OR_FOLLOWER with v10's CurrentLeader and the leader's Kafka
    endpoint in NodeEndpoints (decoded by kio), so a client refreshes at once."""
    from kafka.record.default_records import DefaultRecordBatchBuilder
    from kio.schema.produce.v10.request import PartitionProduceData, ProduceRequest, TopicProduceData
    from kio.schema.produce.v10.response import ProduceResponse

    kc = kafka_cluster
    leader, epoch = kc.leader()
    follower = min(nid for nid in kc.kafka_ports if nid != leader)
    builder = DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=False, producer_id=-1,
                                        producer_epoch=-1, base_sequence=-1, batch_size=1 << 16)
    builder.append(0, timestamp=int(time.time() * 1000), key=b"to-a-follower", value=b"refused", headers=[])
    req = ProduceRequest(acks=-1, timeout=datetime.timedelta(seconds=10), topic_data=(TopicProduceData(
        name=TOPIC, partition_data=(PartitionProduceData(index=0, records=bytes(builder.build())),)),))
    raw = kc.raw(follower)
    try:
        _cid, resp = raw.ask(req, ProduceResponse, 31)
    finally:
        raw.close()
    (part,) = resp.responses[0].partition_responses
    assert (part.error_code, part.current_leader.leader_id, part.current_leader.leader_epoch) == (6, leader, epoch)
    assert [(n.node_id, n.host, n.port) for n in resp.node_endpoints] == [(leader, *kc.kafka_ports[leader])]


def test_offset_for_leader_epoch_and_its_fencing_as_kip_320_wants(kafka_cluster):
    """What librdkafka asks after a leader change to validate its position:
    the end offset of its epoch (for a consumer: at most the high watermark,
    as ListOffsets latest reports it), with CurrentLeaderEpoch fenced;
    partition 1 does not exist."""
    from confluent_kafka import Consumer, TopicPartition
    from kio.schema.offset_for_leader_epoch.v4.request import (OffsetForLeaderEpochRequest, OffsetForLeaderPartition,
                                                              OffsetForLeaderTopic)
    from kio.schema.offset_for_leader_epoch.v4.response import OffsetForLeaderEpochResponse

    kc = kafka_cluster
    produce_librdkafka(kc, run_id(), 3)  # something committed in this epoch
    leader, epoch = kc.leader()
    consumer = Consumer(kc.librdkafka_conf(**{"group.id": "t-epochs"}))
    try:
        _low, hw = consumer.get_watermark_offsets(TopicPartition(TOPIC, 0), timeout=20)
    finally:
        consumer.close()
    asks = [(0, epoch, epoch), (0, epoch + 5, epoch), (0, epoch - 1, epoch - 1), (1, epoch, epoch)]
    req = OffsetForLeaderEpochRequest(replica_id=-1, topics=(OffsetForLeaderTopic(topic=TOPIC, partitions=tuple(
        OffsetForLeaderPartition(partition=p, current_leader_epoch=cur, leader_epoch=asked) for p, cur, asked in asks)),))
    raw = kc.raw(leader)
    try:
        _cid, resp = raw.ask(req, OffsetForLeaderEpochResponse, 41)
    finally:
        raw.close()
    got = [(p.partition, p.error_code, p.leader_epoch, p.end_offset) for p in resp.topics[0].partitions]
    assert got == [(0, 0, epoch, hw), (0, 75, -1, -1), (0, 74, -1, -1), (1, 3, -1, -1)]


def test_acks_0_gets_no_answer_and_its_batch_is_appended(kafka_cluster):
    """Kafka never answers a Produce with acks=0: the next answer on the
    connection is the next request's; the batch is stored all the same."""
    from kafka.record.default_records import DefaultRecordBatchBuilder
    from kio.schema.api_versions.v3.request import ApiVersionsRequest
    from kio.schema.api_versions.v3.response import ApiVersionsResponse
    from kio.schema.produce.v9.request import PartitionProduceData, ProduceRequest, TopicProduceData

    kc = kafka_cluster
    prefix = run_id()
    builder = DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=False, producer_id=-1,
                                        producer_epoch=-1, base_sequence=-1, batch_size=1 << 16)
    builder.append(0, timestamp=int(time.time() * 1000), key=f"{prefix}-0".encode(), value=b"fire and forget",
                   headers=[])
    req = ProduceRequest(acks=0, timeout=datetime.timedelta(seconds=10), topic_data=(TopicProduceData(
        name=TOPIC, partition_data=(PartitionProduceData(index=0, records=bytes(builder.build())),)),))
    raw = kc.raw()
    try:
        raw.send_frame(raw.request_bytes(req, 21))
        cid, _resp = raw.ask(ApiVersionsRequest(client_software_name="t", client_software_version="1"),
                             ApiVersionsResponse, 22)
        assert cid == 22
    finally:
        raw.close()
    assert [g[2] for g in consume_librdkafka(kc, prefix, 1)] == [b"fire and forget"]


def test_a_fetch_past_the_end_is_offset_out_of_range_for_the_client(kafka_cluster):
    from kafka import KafkaConsumer, TopicPartition
    from kafka.errors import OffsetOutOfRangeError

    consumer = KafkaConsumer(group_id=None, enable_auto_commit=False, auto_offset_reset="none",
                             **kafka_python_tls(kafka_cluster))
    try:
        tp = TopicPartition(TOPIC, 0)
        consumer.assign([tp])
        end = consumer.end_offsets([tp])[tp]
        consumer.seek(tp, end + 1000)
        deadline = time.monotonic() + DEADLINE_S
        with pytest.raises(OffsetOutOfRangeError):
            while time.monotonic() < deadline:
                consumer.poll(timeout_ms=500)
    finally:
        consumer.close()


# ------------------------------------------------------------- leader kill -9
def test_leader_killed_mid_stream_loses_and_repeats_no_acknowledged_record(kafka_cluster):
    """librdkafka's idempotent producer through a kill -9 of the leader: every
    acknowledged record exactly once, in order, no gap; its consumer, reading
    all along, continues from the new leader."""
    kc = kafka_cluster
    prefix, n = run_id(), 600
    old_leader, old_epoch = kc.leader()
    read: list[tuple[int, int, bytes, list, int]] = []
    failed: list[BaseException] = []
    transport_errors: list = []

    def read_all() -> None:
        try:
            read.extend(consume_librdkafka(kc, prefix, n, transport_errors=transport_errors))
        except BaseException as exc:  # noqa: BLE001 - reported by the test's thread below
            failed.append(exc)

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()

    from confluent_kafka import Producer

    producer = Producer(kc.librdkafka_conf(**{"enable.idempotence": True, "acks": "all", "linger.ms": 2,
                                              "message.timeout.ms": 60000}))
    acked: dict[int, int] = {}
    errors: list[str] = []

    def delivered(err, msg):
        if err is not None:
            errors.append(str(err))
        else:
            acked[int(msg.key().decode().rsplit("-", 1)[1])] = msg.offset()

    killed = False
    acked_before_kill = 0
    for i in range(n):
        producer.produce(TOPIC, partition=0, key=f"{prefix}-{i}".encode(), value=f"k {i}".encode(),
                         on_delivery=delivered)
        producer.poll(0.002)
        if not killed and len(acked) >= n // 3:
            acked_before_kill = len(acked)
            kc.cluster.kill(old_leader)  # mid-stream: records in flight, some not yet acknowledged
            killed = True
    assert killed
    assert producer.flush(DEADLINE_S) == 0
    assert errors == []
    new_leader, _ = kc.cluster.wait_for_leader(30, exclude={old_leader})
    assert new_leader != old_leader

    reader.join(DEADLINE_S + 10)
    assert failed == []
    indexes = [g[0] for g in read]
    assert indexes == list(range(n)), "every acknowledged record once, in order, no gap"
    assert {g[0]: g[1] for g in read} == acked
    # The records after the kill were written, and read, under the new leader.
    assert acked_before_kill < n and read[-1][4] > old_epoch
    assert [g[4] for g in read] == sorted(g[4] for g in read)
    kc.cluster.start_node(old_leader)  # the module's cluster whole again for whoever follows
