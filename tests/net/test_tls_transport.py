"""Server-side TLS handshakes in a handshake thread, and our own TLS transport after (metalog.broker.net.tls_transport)."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import threading
import time

import pytest
import uvloop

from metalog.broker.net.channel import PeerChannel
from metalog.broker.net.guard import HANDSHAKE_METER
from metalog.broker.net.listener import ListenerLimits
from metalog.broker.net.tls import TlsFiles, TlsPaths
from metalog.broker.net.tls_transport import HANDSHAKE_THREADS, STRANGERS_THREAD_NICE, TlsSocketTransport
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.tools.cluster import certs
from tests.net.flat_server import serve_flat as serve
from tests.net.helpers import ListLogger, client_hello, wait_for_condition

TIMEOUT_S = 30  # generous: the machine may be loaded


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("pki"))
    certs.cluster_certs(d, {1: ["127.0.0.1"]}, users=("alice",))
    other = str(tmp_path_factory.mktemp("other_ca"))
    certs.cluster_certs(other, {1: ["127.0.0.1"]}, users=("mallory",))

    def files(name: str, where: str = d) -> TlsFiles:
        return TlsFiles(TlsPaths(f"{where}/ca.crt", f"{where}/{name}.crt", f"{where}/{name}.key"))
    return d, other, files


class Echo(asyncio.Protocol):
    """Echoes what it reads; stops reading while its transport's write buffer is full."""

    def __init__(self) -> None:
        self.transport: TlsSocketTransport | None = None
        self.pauses = 0
        self.resumes = 0
        self.eof = False
        self.lost: asyncio.Future = asyncio.get_running_loop().create_future()

    def connection_made(self, transport):
        self.transport = transport

    close_after_echo = False

    def data_received(self, data):
        self.transport.write(data)
        if self.close_after_echo:
            self.transport.close()

    def pause_writing(self):
        self.pauses += 1
        self.transport.pause_reading()

    def resume_writing(self):
        self.resumes += 1
        self.transport.resume_reading()

    def eof_received(self):
        self.eof = True

    def connection_lost(self, exc):
        if not self.lost.done():
            self.lost.set_result(exc)


async def _accept_one(lsock: socket.socket, tls: TlsFiles, close_after_echo: bool = False) -> tuple[TlsSocketTransport, Echo]:
    loop = asyncio.get_running_loop()
    sock, addr = await loop.sock_accept(lsock)
    sock.setblocking(False)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)  # the kernel's buffers do not hide ours
    transport = TlsSocketTransport.accept(sock, tls.server(), addr, exempt=False)
    echo = Echo()
    echo.close_after_echo = close_after_echo
    transport.set_protocol(echo)
    echo.connection_made(transport)
    await transport.handshake(TIMEOUT_S)
    return transport, echo


def _listening() -> socket.socket:
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(16)
    lsock.setblocking(False)
    return lsock


async def _echo_large_frames(files) -> None:
    lsock = _listening()
    port = lsock.getsockname()[1]
    try:
        accepted = asyncio.ensure_future(_accept_one(lsock, files("node-1")))
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=files("alice").client())
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        transport, echo = await asyncio.wait_for(accepted, TIMEOUT_S)
        assert transport.get_extra_info("peercert")["subject"]  # the client's certificate, verified
        assert transport.get_extra_info("ssl_object").version() in ("TLSv1.3", "TLSv1.2")
        transport.set_write_buffer_limits(high=64 * 1024)
        payload = os.urandom(3 * 1024 * 1024 + 17)  # > 1 MiB: many records, many reads and writes
        writer.write(payload)
        # The client reads nothing yet: the echo fills the socket, then our buffer, and the
        # protocol is told to pause (and pauses reading, so the client's sending stalls too).
        await wait_for_condition(lambda: echo.pauses > 0, TIMEOUT_S, "pause_writing")
        assert transport.get_write_buffer_size() > 64 * 1024
        got = await asyncio.wait_for(reader.readexactly(len(payload)), TIMEOUT_S)
        assert got == payload
        assert echo.resumes == echo.pauses
        assert transport.get_write_buffer_size() == 0
        transport.close()  # the server closes: a close_notify, then the socket
        assert await asyncio.wait_for(reader.read(), TIMEOUT_S) == b""
        assert await asyncio.wait_for(echo.lost, TIMEOUT_S) is None
        assert transport.is_closing()
        writer.close()
    finally:
        lsock.close()


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_large_frames_echo_with_flow_control_and_close(pki, loop_factory):
    _, _, files = pki
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(_echo_large_frames(files))


def _blocking_client(port: int, ctx: ssl.SSLContext, message: bytes) -> tuple[bytes, bytes]:
    """A blocking client that tells a close_notify (b"") from a bare close (SSLEOFError)."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as raw:
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1", suppress_ragged_eofs=False) as s:
            s.sendall(message)
            echoed = b""
            while len(echoed) < len(message):
                echoed += s.recv(65536)
            return echoed, s.recv(1)  # the server closed after the echo: its close_notify reads as b""


async def test_the_server_closes_with_a_close_notify_after_what_it_wrote(pki):
    _, _, files = pki
    lsock = _listening()
    try:
        accepted = asyncio.ensure_future(_accept_one(lsock, files("node-1"), close_after_echo=True))
        client = asyncio.ensure_future(asyncio.to_thread(_blocking_client, lsock.getsockname()[1],
                                                         files("alice").client(), b"hello" * 1000))
        transport, echo = await asyncio.wait_for(accepted, TIMEOUT_S)
        echoed, after = await asyncio.wait_for(client, TIMEOUT_S)
        assert echoed == b"hello" * 1000 and after == b""  # no SSLEOFError: the close was TLS's
        assert await asyncio.wait_for(echo.lost, TIMEOUT_S) is None
    finally:
        lsock.close()


def _flood(port: int, hello: bytes, n: int, stop: threading.Event) -> int:
    """`n` connections from 127.0.0.x (x >= 100): a replayed ClientHello, our answer read, gone."""
    answered = 0
    for i in range(n):
        if stop.is_set():
            break
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5,
                                          source_address=(f"127.0.0.{100 + i % 100}", 0)) as s:
                s.sendall(hello)
                if s.recv(4096):
                    answered += 1
        except OSError:
            pass  # refused or cut: the listener's right under a flood
    return answered


async def test_a_client_hello_flood_is_answered_in_the_handshake_thread_and_a_peer_in_its_own(pki):
    """The loop never runs a handshake step (its meter stays still), its ticker stays on
    time, and a peer (an exempt address) handshakes meanwhile, in the peers' thread."""
    _, _, files = pki
    limits = ListenerLimits(connection_creation_rate_per_ip=0, max_connection_creation_rate=0,
                            ssl_handshake_loop_share=1.0, exempt_hosts=frozenset({"127.0.0.1"}))
    log = ListLogger()
    server = await serve("127.0.0.1", 0,
                         lambda c, h, b: c.send_response(h.correlation_id, m.MetadataResponse(leader_id=1)),
                         tls=files("node-1"), limits=limits, logger=log)
    port = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    loop_seconds, seconds, started = (HANDSHAKE_METER.loop_seconds_total, HANDSHAKE_METER.seconds_total,
                                      HANDSHAKE_METER.handshakes_total)
    HANDSHAKE_THREADS.thread_names.clear()
    stop = threading.Event()
    flood = asyncio.ensure_future(asyncio.to_thread(_flood, port, client_hello(), 400, stop))
    lateness_s: list[float] = []
    ch = PeerChannel("127.0.0.1", port, tls=files("alice"), connect_timeout_ms=TIMEOUT_S * 1000)
    try:
        await wait_for_condition(lambda: HANDSHAKE_METER.handshakes_total >= started + 20, TIMEOUT_S, "flood")
        answer = asyncio.ensure_future(ch.request(ApiKey.METADATA, m.MetadataRequest(), TIMEOUT_S * 1000))
        while not flood.done():  # the loop's ticker: a 5 ms timer, how late it fires
            t0 = loop.time()
            await asyncio.sleep(0.005)
            lateness_s.append(loop.time() - t0 - 0.005)
        assert (await asyncio.wait_for(answer, TIMEOUT_S)).leader_id == 1
        answered = flood.result()
    finally:
        stop.set()
        await ch.close()
        server.close()
    assert answered >= 100  # the flood was answered...
    assert HANDSHAKE_METER.seconds_total > seconds  # ...its handshakes measured...
    assert HANDSHAKE_METER.loop_seconds_total == loop_seconds  # ...and none on the loop
    assert {"metalog-tls_0", "metalog-tls-peers_0"} <= HANDSHAKE_THREADS.thread_names
    assert threading.current_thread().name not in HANDSHAKE_THREADS.thread_names
    # the strangers' thread yields the CPU to the rest (unless the process is as low as it goes)
    nice = {t.name: os.getpriority(os.PRIO_PROCESS, t.native_id) for t in threading.enumerate()
            if t.name in ("metalog-tls_0", "metalog-tls-peers_0")}
    process_nice = os.getpriority(os.PRIO_PROCESS, os.getpid())  # the main thread's
    assert nice["metalog-tls-peers_0"] == process_nice
    assert nice["metalog-tls_0"] == min(19, process_nice + STRANGERS_THREAD_NICE)
    lateness_s.sort()
    # Loose bounds (a loaded machine delays any timer): a handshake on the loop costs ~1 ms
    # each, back to back under a flood; here the ticker waits for the flood thread's GIL only.
    assert lateness_s[len(lateness_s) // 2] < 0.05, lateness_s[-10:]


async def test_a_certificate_of_another_ca_is_refused_counted_and_told_to_the_client(pki):
    _, other, files = pki
    log = ListLogger()
    server = await serve("127.0.0.1", 0, lambda c, h, b: None, tls=files("node-1"),
                         limits=ListenerLimits(), logger=log)
    port = server.sockets[0].getsockname()[1]
    ctx = files("mallory", other).client()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # mallory does not check us: we check mallory
    try:
        with pytest.raises((ssl.SSLError, ConnectionError)) as info:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="127.0.0.1"), TIMEOUT_S)
            await asyncio.wait_for(reader.read(1), TIMEOUT_S)  # TLS 1.3: the client hears the alert on its first read
        if isinstance(info.value, ssl.SSLError):  # the alert reached the client: it can tell its user why
            assert "UNKNOWN_CA" in (info.value.reason or "")
        st = server.listener.stats
        await wait_for_condition(lambda: st.failures_total["tls_handshake_failed"] == 1, TIMEOUT_S, "counted")
        line = log.named("tls_handshake_failed")[0]
        assert "certificate verify failed" in line["reason"]
        assert server.listener.addresses.get("127.0.0.1").failures == 1  # toward its back-off
        assert st.connections_now == 0
    finally:
        server.close()


async def test_a_handshake_that_times_out_in_the_middle_is_cut_and_counted(pki):
    """A ClientHello answered, then silence: the timeout cuts it while it waits for readiness."""
    _, _, files = pki
    log = ListLogger()
    server = await serve("127.0.0.1", 0, lambda c, h, b: None, tls=files("node-1"),
                         limits=ListenerLimits(ssl_handshake_timeout_ms=300), logger=log)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(client_hello())
        assert await asyncio.wait_for(reader.read(1), TIMEOUT_S)  # our answer
        assert await asyncio.wait_for(reader.read(), TIMEOUT_S) is not None  # then the cut (EOF or alert)
        st = server.listener.stats
        await wait_for_condition(lambda: st.failures_total["tls_handshake_failed"] == 1, TIMEOUT_S, "counted")
        assert log.named("tls_handshake_failed")[0]["reason"] == "handshake timed out"
        await wait_for_condition(lambda: st.connections_now == 0, TIMEOUT_S, "released")
        writer.close()
    finally:
        server.close()
