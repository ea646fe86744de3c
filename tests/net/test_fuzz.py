"""Protocol fuzz: random and mutated Kafka frames against a live Kafka listener
(the real serve_kafka + KafkaDispatch of tests.net.flat_server, the handlers
of every served api behind it).

The server and a well-behaved PeerChannel live on an event loop in a
background thread for the whole module; each hypothesis example opens a raw
blocking socket, sends its bytes, half-closes, and reads until the server
closes. Every example must end (no hang: socket timeout), every byte the
server sent back must parse as answer frames, and the well-behaved client must
still be answered afterwards.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metalog.broker.net.channel import PeerChannel
from metalog.broker.net.listener import ListenerLimits
from metalog.broker.server.kafka.dispatch import served_apis
from metalog.protocol import messages as m
from metalog.protocol.apis import APIS, ApiKey
from metalog.protocol.errors import Errors
from metalog.protocol.kafka.framing import NEED_DATA, FrameDecoder, response_correlation_id
from tests.net.flat_server import serve_flat as serve
from tests.net.helpers import ListLogger
from tests.protocol.kafka.test_bad_input import CORPUS

MAX_FRAME_BYTES = 4096
IO_TIMEOUT_S = 5.0


class LiveServer:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.log = ListLogger()
        # Bad frames from one address on purpose: no back-off for it here (its new connections would wait).
        self.server = self.run(serve("127.0.0.1", 0, self.handler, max_frame_bytes=MAX_FRAME_BYTES,
                                     max_inflight_per_conn=8, logger=self.log,
                                     limits=ListenerLimits(failed_connections_before_backoff=1_000_000)))
        self.port = self.server.sockets[0].getsockname()[1]
        self.good = PeerChannel("127.0.0.1", self.port, client_id="good")

    @staticmethod
    def handler(conn, header, body):
        # Answer every flat request the Kafka handlers ask with its own response type's default.
        conn.send_response(header.correlation_id, APIS[header.api_key][1]())

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(IO_TIMEOUT_S * 2)

    async def _aclose(self) -> None:
        await self.good.close()
        self.server.close()

    def close(self) -> None:
        self.run(self._aclose())  # on the loop's own thread: asyncio is not thread-safe
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(IO_TIMEOUT_S)


@pytest.fixture(scope="module")
def live():
    srv = LiveServer()
    yield srv
    srv.close()


def _served_request_frames() -> list[bytes]:
    """The kept corpus's request frames (every api at its lowest and highest
    version, tests/protocol/kafka/make_corpus.py) of the apis a broker serves,
    with their length prefix."""
    served = {api.request.__name__ for api in served_apis().values()}
    frames = [p.read_bytes() for p in CORPUS if p.name.split("-v")[0] in served]
    return [struct.pack(">i", len(f)) + f for f in frames]


VALID_FRAMES = _served_request_frames()


@st.composite
def mutated_frame(draw) -> bytes:
    frame = bytearray(draw(st.sampled_from(VALID_FRAMES)))
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "length", "delete"]))
        if kind == "flip" and frame:
            i = draw(st.integers(0, len(frame) - 1))
            frame[i] = draw(st.integers(0, 255))
        elif kind == "truncate" and frame:
            del frame[draw(st.integers(0, len(frame) - 1)):]
        elif kind == "insert":
            i = draw(st.integers(0, len(frame)))
            frame[i:i] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete" and len(frame) > 1:
            i = draw(st.integers(0, len(frame) - 2))
            del frame[i:i + draw(st.integers(1, len(frame) - i))]
        elif kind == "length" and len(frame) >= 4:
            struct.pack_into(">i", frame, 0, draw(st.integers(-(2**31), 2**31 - 1)))
    # Often repair the length prefix, so the mutation reaches header and body decoding.
    if len(frame) >= 4 and draw(st.booleans()):
        struct.pack_into(">i", frame, 0, len(frame) - 4)
    return bytes(frame)


inputs = st.lists(
    st.one_of(mutated_frame(), st.binary(max_size=64), st.sampled_from(VALID_FRAMES)),
    min_size=1, max_size=6,
).map(b"".join)


def exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server closed on us mid-send: allowed for garbage
        out = bytearray()
        while True:
            try:
                chunk = sock.recv(65536)  # socket.timeout here means the server hung: test fails
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
        return bytes(out)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=inputs)
def test_fuzzed_frames_never_break_the_server(live, data):
    answer = exchange(live.port, data)
    # Whatever came back is whole, decodable answer frames.
    dec = FrameDecoder(1 << 20)
    dec.feed(answer)
    while (frame := dec.next_frame()) is not NEED_DATA:
        # The test does not track which request each answer is for (a mutated
        # frame may carry any api and version): every answer is a whole frame
        # that starts with a correlation id.
        response_correlation_id(frame)
    assert dec.buffered_bytes == 0, "server sent a partial frame"
    # The well-behaved client on the same server is still served.
    resp = live.run(live.good.request(ApiKey.METADATA, m.MetadataRequest(), int(IO_TIMEOUT_S * 1000)))
    assert resp.error_code == Errors.NONE


def test_fuzz_logged_bad_input(live):
    """After the fuzz run (same module server), bad input left structured log lines."""
    exchange(live.port, b"\xff\xff\xff\xff")
    # The server logs on its own thread, which may close the connection first: poll, with a deadline.
    deadline_s = time.monotonic() + IO_TIMEOUT_S
    while "bad_frame" not in {e for _, e, _ in live.log.events}:
        assert time.monotonic() < deadline_s, f"no bad_frame line; logged: {sorted({e for _, e, _ in live.log.events})}"
        time.sleep(0.01)  # polling the other thread's log, bounded by the deadline
