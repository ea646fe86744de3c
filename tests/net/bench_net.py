"""Throughput of serve() + PeerChannel on loopback: python -m tests.net.bench_net [--uvloop].

Prints requests/s for C concurrent requesters on one channel, the server
answering every Metadata request at once. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from metalog.broker.net.channel import PeerChannel
from metalog.broker.net.listener import serve
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey


async def serve_streams(handler_resp):
    """The same server written on asyncio streams, only to compare with serve()."""
    from metalog.protocol import codec

    async def on_conn(reader, writer):
        try:
            while True:
                (n,) = codec.LENGTH.unpack(await reader.readexactly(4))
                header, _ = codec.decode_request(await reader.readexactly(n))
                writer.write(codec.encode_response(header.correlation_id, handler_resp))
                if writer.transport.get_write_buffer_size() > 1 << 20:
                    await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.CancelledError, ConnectionError):
            writer.close()

    return await asyncio.start_server(on_conn, "127.0.0.1", 0)


async def run(total: int, concurrency: int, streams: bool = False) -> float:
    resp = m.MetadataResponse(cluster_id="c", node_id=1, leader_id=1, leader_epoch=3, high_watermark=10)

    def handler(conn, header, body):
        conn.send_response(header.correlation_id, resp)

    if streams:
        server = await serve_streams(resp)
    else:
        server = await serve("127.0.0.1", 0, handler, max_inflight_per_conn=4096)
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
    ap.add_argument("--streams", action="store_true", help="stream-based server, for comparison")
    ap.add_argument("--total", type=int, default=50_000)
    ap.add_argument("--concurrency", type=int, default=64)
    args = ap.parse_args()
    if args.uvloop:
        import uvloop
        uvloop.install()
    rate = asyncio.run(run(args.total, args.concurrency, args.streams))
    server = "streams-server" if args.streams else "serve()"
    print(f"{server} {'uvloop' if args.uvloop else 'asyncio'} concurrency={args.concurrency}: {rate:,.0f} requests/s")


if __name__ == "__main__":
    main()
