"""Shared test helpers for the net tests: a recording logger and a subprocess server."""

from __future__ import annotations

import asyncio
import ssl
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class ListLogger:
    """Stands in for a structlog logger and records (level, event, fields)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict]] = []

    def _rec(self, level: str, event: str, **kw) -> None:
        self.events.append((level, event, kw))

    def debug(self, event, **kw): self._rec("debug", event, **kw)
    def info(self, event, **kw): self._rec("info", event, **kw)
    def warning(self, event, **kw): self._rec("warning", event, **kw)
    def error(self, event, **kw): self._rec("error", event, **kw)
    def exception(self, event, **kw): self._rec("exception", event, **kw)

    def named(self, event: str) -> list[dict]:
        return [kw for _, e, kw in self.events if e == event]


async def wait_for_condition(cond, timeout_s: float = 5.0, what: str = "condition") -> None:
    """Poll `cond()` until true; fail after `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.005)


SERVER_SCRIPT = r'''
import asyncio, os, sys
from metalog.protocol import messages as m
from tests.net.flat_server import serve_flat

async def main(port):
    def handler(conn, header, body):
        if isinstance(body, m.MetadataRequest):
            conn.send_response(header.correlation_id, m.MetadataResponse(leader_id=os.getpid()))
        # anything else is parked forever, so it is in flight when we are killed
    server = await serve_flat("127.0.0.1", port, handler)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()

asyncio.run(main(int(sys.argv[1])))
'''


async def start_server_process(port: int = 0) -> tuple[asyncio.subprocess.Process, int]:
    """A real Kafka listener process answering Metadata with its pid as the leader; returns (process, port)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SERVER_SCRIPT, str(port),
        stdout=asyncio.subprocess.PIPE, cwd=str(REPO),
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 20)
    assert line, "server process exited before listening"
    return proc, int(line)


def client_hello() -> bytes:
    """A TLS ClientHello's bytes, as the hostile bench's flood replays it (no certificate)."""
    from metalog.tools.bench.hostile import client_hello as made_by

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    hello = made_by(ctx)
    assert hello, "no ClientHello made"
    return hello
