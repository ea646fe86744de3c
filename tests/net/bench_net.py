"""Throughput of a Kafka listener + PeerChannel on loopback: python -m tests.net.bench_net [--uvloop].

Prints requests/s for C concurrent requesters on one channel, the listener
(serve_kafka + KafkaDispatch, tests.net.flat_server) answering every
Metadata request at once: Kafka's framing and codec both ways, the edge's
mapping on the channel's side, the dispatch's on the server's. A benchmark,
not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from metalog.broker.net.channel import PeerChannel
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from tests.net.flat_server import serve_flat


async def run(total: int, concurrency: int) -> float:
    resp = m.MetadataResponse(cluster_id="c", leader_id=1, leader_epoch=3, high_watermark=10)

    def handler(conn, header, body):
        conn.send_response(header.correlation_id, resp)

    server = await serve_flat("127.0.0.1", 0, handler, max_inflight_per_conn=4096)
    port = server.sockets[0].getsockname()[1]
    ch = PeerChannel("127.0.0.1", port, client_id="bench", max_queued_requests=concurrency)
    per_worker = total // concurrency

    async def worker():
        for _ in range(per_worker):
            await ch.request(ApiKey.METADATA, m.MetadataRequest(), 5000)

    await ch.request(ApiKey.METADATA, m.MetadataRequest(), 5000)
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    await ch.close()
    server.close()
    await server.wait_closed()
    return per_worker * concurrency / elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--uvloop", action="store_true")
    ap.add_argument("--total", type=int, default=50_000)
    ap.add_argument("--concurrency", type=int, default=64)
    args = ap.parse_args()
    if args.uvloop:
        import uvloop
        uvloop.install()
    rate = asyncio.run(run(args.total, args.concurrency))
    print(f"Kafka listener {'uvloop' if args.uvloop else 'asyncio'} concurrency={args.concurrency}: "
          f"{rate:,.0f} requests/s")


if __name__ == "__main__":
    main()
