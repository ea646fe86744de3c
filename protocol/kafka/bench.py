"""The codec's speed: ``python -m metalog.protocol.kafka.bench``.

Prints encode+decode round trips per second, whole frames through ``wire``
(header included), for the messages on the broker's hot paths: a
Produce v9 request carrying one 1 KiB record batch, a Fetch v12
response carrying one 1 KiB batch for one partition, and a replica's Fetch
v17 request as a follower sends it (one partition, its directory id and the
ReplicaState and ClusterId tagged fields). Records are bytes the
codec does not look into, so their content does not matter here.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from metalog.protocol.kafka import messages as m
from metalog.protocol.kafka import wire
from metalog.protocol.kafka.edge_quorum import METADATA_TOPIC_ID
from metalog.protocol.kafka.primitives import Message

BATCH_BYTES = 1024
SUPPORTED = {0: (3, 13), 1: (4, 18)}
REPLICA_DIRECTORY_ID = bytes(range(16))  # any 16 bytes but the all-zero UUID


def produce_v9() -> tuple[wire.RequestHeader, m.ProduceRequest]:
    body = m.ProduceRequest(
        acks=-1,
        timeout_ms=30000,
        topic_data=[
            m.ProduceRequestTopicProduceData(
                name="__cluster_metadata",
                partition_data=[m.ProduceRequestPartitionProduceData(index=0, records=bytes(BATCH_BYTES))],
            )
        ],
    )
    return wire.RequestHeader(0, 9, 1, "bench"), body


def fetch_v12() -> tuple[wire.RequestHeader, m.FetchResponse]:
    body = m.FetchResponse(
        session_id=0,
        responses=[
            m.FetchResponseFetchableTopicResponse(
                topic="__cluster_metadata",
                partitions=[
                    m.FetchResponsePartitionData(
                        partition_index=0, high_watermark=1000, last_stable_offset=1000, log_start_offset=0,
                        aborted_transactions=[], records=bytes(BATCH_BYTES),
                    )
                ],
            )
        ],
    )
    return wire.RequestHeader(1, 12, 1, "bench"), body


def replica_fetch_v17() -> tuple[wire.RequestHeader, m.FetchRequest]:
    body = m.FetchRequest(
        cluster_id="metalog-bench-cluster1", replica_state=m.FetchRequestReplicaState(replica_id=2, replica_epoch=-1),
        max_wait_ms=500, min_bytes=1, max_bytes=1 << 20,
        topics=[m.FetchRequestFetchTopic(topic_id=METADATA_TOPIC_ID, partitions=[m.FetchRequestFetchPartition(
            partition=0, current_leader_epoch=3, fetch_offset=123_456, last_fetched_epoch=3, log_start_offset=0,
            partition_max_bytes=1 << 20, replica_directory_id=REPLICA_DIRECTORY_ID)])],
    )
    return wire.RequestHeader(1, 17, 1, "node-2"), body


def request_round_trip(made: Callable[[], tuple[wire.RequestHeader, Message]]) -> Callable[[], object]:
    header, body = made()

    def once() -> object:
        frame = wire.encode_request(header, body)
        return wire.decode_request(memoryview(frame)[4:], SUPPORTED)

    return once


def fetch_round_trip() -> Callable[[], object]:
    header, body = fetch_v12()

    def once() -> object:
        frame = wire.encode_response_buffer(header, body)
        return wire.decode_response(memoryview(frame)[4:], 1, 12)

    return once


def rate_per_s(once: Callable[[], object], seconds: float) -> float:
    """Round trips per CPU second over about ``seconds`` (best of three runs).

    CPU time, not wall time: on a shared machine the wall clock counts the
    other processes' turns too."""
    best = 0.0
    for _ in range(3):
        count = 0
        start = time.process_time()
        deadline = start + seconds / 3
        while True:
            for _ in range(200):
                once()
            count += 200
            now = time.process_time()
            if now >= deadline:
                break
        best = max(best, count / (now - start))
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="encode+decode per second of the Kafka codec")
    parser.add_argument("--seconds", type=float, default=3.0, help="time per message (default 3)")
    args = parser.parse_args(argv)
    for name, once in (("Produce v9 request, one 1 KiB batch", request_round_trip(produce_v9)),
                       ("Fetch v12 response, one 1 KiB batch", fetch_round_trip()),
                       ("replica Fetch v17 request", request_round_trip(replica_fetch_v17))):
        rate = rate_per_s(once, args.seconds)
        print(f"{name}: {rate:,.0f} encode+decode/s ({1e6 / rate:.1f} us each)")


if __name__ == "__main__":
    main()
