"""metalog.broker.net.server with mutual TLS, in-process: principals, handshake timeout, reload."""

from __future__ import annotations

import asyncio
import ssl

import pytest

from metalog.broker.net.channel import PeerChannel
from metalog.broker.net.listener import ListenerLimits
from metalog.broker.net.tls import TlsFiles, TlsPaths
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from tests.net.flat_server import serve_flat as serve
from tests.net.helpers import ListLogger, wait_for_condition
from metalog.tools.cluster import certs

# Both TLS ends share one event loop here: on a loaded machine a handshake can
# take longer than the 1 s production default, which these tests do not test.
CONNECT_TIMEOUT_MS = 10_000


@pytest.fixture
def pki(tmp_path):
    d = str(tmp_path)
    certs.cluster_certs(d, {1: ["127.0.0.1"], 2: ["127.0.0.1"]}, users=("alice",))
    def files(name: str) -> TlsFiles:
        return TlsFiles(TlsPaths(f"{d}/ca.crt", f"{d}/{name}.crt", f"{d}/{name}.key"))
    return d, files


async def _server(handler_log, tls, limits=None, logger=None):
    def handler(conn, header, body):
        handler_log.append((str(conn.principal), conn.peer))
        conn.send_response(header.correlation_id, m.MetadataResponse(leader_id=1))
    server = await serve("127.0.0.1", 0, handler, tls=tls, limits=limits, logger=logger or ListLogger())
    return server, server.sockets[0].getsockname()[1]


async def test_principal_is_set_from_the_certificate_before_dispatch(pki):
    _, files = pki
    seen: list = []
    server, port = await _server(seen, files("node-1"))
    try:
        for name, expected in (("alice", "User:alice"), ("node-2", "Node:2")):
            ch = PeerChannel("127.0.0.1", port, tls=files(name), connect_timeout_ms=CONNECT_TIMEOUT_MS)
            try:
                await ch.request(ApiKey.METADATA, m.MetadataRequest(), 3000)
            finally:
                await ch.close()
            assert seen[-1][0] == expected and seen[-1][1].startswith("127.0.0.1:")
    finally:
        server.close()


async def test_plaintext_listener_gives_anonymous():
    seen: list = []
    server, port = await _server(seen, None)
    try:
        ch = PeerChannel("127.0.0.1", port, connect_timeout_ms=CONNECT_TIMEOUT_MS)
        await ch.request(ApiKey.METADATA, m.MetadataRequest(), 3000)
        await ch.close()
        assert seen == [("User:ANONYMOUS", seen[0][1])]
    finally:
        server.close()


async def test_a_connection_that_never_handshakes_is_cut_after_the_timeout(pki):
    """Log: tls_handshake_failed reason='handshake timed out'; counts toward back-off."""
    _, files = pki
    log = ListLogger()
    server, port = await _server([], files("node-1"), ListenerLimits(ssl_handshake_timeout_ms=300), log)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        t0 = asyncio.get_running_loop().time()
        assert await asyncio.wait_for(reader.read(100), 10) == b""  # closed by the server
        assert asyncio.get_running_loop().time() - t0 >= 0.25
        writer.close()
        await wait_for_condition(lambda: log.named("tls_handshake_failed"), 5, "the log line")
        assert log.named("tls_handshake_failed")[0]["reason"] == "handshake timed out"
        assert server.listener.addresses.get("127.0.0.1").failures == 1
        await wait_for_condition(lambda: not server.listener.connections, 5, "the slot to be released")
    finally:
        server.close()


async def test_reload_serves_the_new_certificate_to_new_handshakes_only(pki):
    d, files = pki
    server_tls = files("node-1")
    server, port = await _server([], server_tls)
    try:
        client_tls = files("alice")
        ch = PeerChannel("127.0.0.1", port, tls=client_tls, connect_timeout_ms=CONNECT_TIMEOUT_MS)
        await ch.request(ApiKey.METADATA, m.MetadataRequest(), 3000)
        certs.issue_node(d, d, 1, ["127.0.0.1"])
        assert server_tls.reload(trigger="sighup")
        new_serial = certs.load_cert(f"{d}/node-1.crt").serial_number
        # the established connection still works
        await ch.request(ApiKey.METADATA, m.MetadataRequest(), 3000)
        await ch.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_tls.client(),
                                                       server_hostname="127.0.0.1")
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        from cryptography import x509

        assert x509.load_der_x509_certificate(der).serial_number == new_serial
        writer.close()
    finally:
        server.close()


async def test_a_half_rotated_pair_keeps_the_previous_context(pki, tmp_path):
    """A key that does not match the certificate: reload refuses, logs
    tls_reload_failed with the key names, and the old context stays."""
    d, _ = pki
    log = ListLogger()
    tls = TlsFiles(TlsPaths(f"{d}/ca.crt", f"{d}/node-1.crt", f"{d}/node-1.key"), logger=log)
    before = tls.server()
    with open(f"{d}/node-2.key", "rb") as f, open(f"{d}/node-1.key", "wb") as out:
        out.write(f.read())
    assert not tls.reload()
    ev = log.named("tls_reload_failed")
    assert ev and "ssl_cert_file" in ev[0]["error"] and ev[0]["action"] == "keep_previous"
    assert tls.server() is before


def test_a_lone_certificate_is_loaded_with_its_issuer_from_the_ca_file(pki, tmp_path):
    """OpenSSL would otherwise build (and verify) the chain on every handshake."""
    from cryptography import x509

    from metalog.broker.net.tls import _issuer_chain_pem

    d, _ = pki
    paths = TlsPaths(f"{d}/ca.crt", f"{d}/node-1.crt", f"{d}/node-1.key")
    chain = x509.load_pem_x509_certificates(_issuer_chain_pem(paths))
    ca = certs.load_cert(f"{d}/ca.crt")
    assert [c.subject for c in chain] == [certs.load_cert(f"{d}/node-1.crt").subject, ca.subject]
    # a CA file without the issuer, or a certificate file that is a chain already: loaded as they are
    other = str(tmp_path / "other")
    certs.init_ca(other, name="other-ca")
    assert _issuer_chain_pem(TlsPaths(f"{other}/ca.crt", paths.cert_file, paths.key_file)) is None
    with open(tmp_path / "chain.crt", "wb") as f:
        f.write(_issuer_chain_pem(paths))
    assert _issuer_chain_pem(TlsPaths(paths.ca_file, str(tmp_path / "chain.crt"), paths.key_file)) is None
