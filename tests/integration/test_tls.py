"""Mutual TLS on real broker processes: what a user sees when the certificates
are wrong (plaintext to a TLS port, another CA, expired / not yet valid, wrong
host name), rotation while running, connection hygiene (idle half-frames,
caps, back-off) and the opt-in insecure mode."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import signal
import socket
import ssl
import subprocess
import sys
import time

import pytest

from metalog.broker.client import MetalogClient, TlsFailure
from metalog.broker.client.config import ClientConfig
from metalog.broker.net.channel import PeerChannel, TlsHandshakeError
from metalog.broker.net.tls import TlsFiles, TlsPaths
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.tools.cluster import certs
from metalog.tools.cluster.launcher import REPO_ROOT

pytestmark = pytest.mark.slow

FAST = dict(election_timeout_ms=300, fetch_timeout_ms=800, request_timeout_ms=800, fetch_max_wait_ms=100)


def metalog(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "metalog.tools.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout_s)


def events(cluster, node_id: int, name: str) -> list[dict]:
    return [e for e in cluster.read_log_lines(node_id) if e.get("event") == name]


def wait_events(cluster, node_id: int, name: str, n: int = 1, timeout_s: float = 10) -> list[dict]:
    return cluster.wait_for(lambda: (lambda ev: ev if len(ev) >= n else None)(events(cluster, node_id, name)),
                            timeout_s, f"{n} {name} event(s) in node {node_id}'s log")


def client_config(tmp_path, cluster, cert_dir: str, user: str, name: str = "client.yaml") -> str:
    path = str(tmp_path / name)
    ClientConfig(bootstrap=",".join(f"{h}:{p}" for h, p in cluster.bootstrap()), cluster_id=cluster.cluster_id,
                 ssl_ca_file=os.path.join(cluster.cert_dir, "ca.crt"),
                 ssl_cert_file=os.path.join(cert_dir, f"{user}.crt"),
                 ssl_key_file=os.path.join(cert_dir, f"{user}.key")).write(path)
    return path


@pytest.fixture
def one_node(make_cluster):
    cluster = make_cluster(voters=1, **FAST)
    cluster.wait_for_leader(20)
    return cluster


def test_cli_over_tls_and_plaintext_to_the_tls_port(one_node, tmp_path):
    """The launcher's cluster speaks TLS: the CLI with the cluster's client config
    works; a plaintext client gets one line and exit 1, and the broker logs the
    failed handshake once, with the peer address and the reason."""
    cluster = one_node
    ok = metalog("produce", "--client-config", cluster.client_config_path, "a", "b")
    assert ok.returncode == 0, ok.stderr
    assert '"records": 2' in ok.stdout
    host, port = cluster.bootstrap()[0]
    before = len(events(cluster, 1, "tls_handshake_failed"))
    bad = metalog("produce", "--insecure", "--bootstrap", f"{host}:{port}", "--cluster-id", cluster.cluster_id,
                  "--timeout-ms", "2000", "x")
    assert bad.returncode == 1
    lines = [l for l in bad.stderr.strip().splitlines() if l.startswith("metalog: error:")]
    assert len(lines) == 1 and "Traceback" not in bad.stderr, bad.stderr
    assert "drop --insecure" in lines[0]
    got = wait_events(cluster, 1, "tls_handshake_failed", before + 1)[before:]
    assert got[0]["reason"] == "wrong version number"
    assert got[0]["peer"].startswith("127.0.0.1:")


def test_client_certificate_from_another_ca_is_refused(one_node, tmp_path):
    """A certificate signed by another CA: the CLI prints one line naming the
    TLS failure; the broker logs the reason with the peer address."""
    cluster = one_node
    other = str(tmp_path / "other-ca")
    certs.init_ca(other, name="evil-ca")
    certs.issue_user(other, other, "mallory")
    cfg = client_config(tmp_path, cluster, other, "mallory")
    before = len(events(cluster, 1, "tls_handshake_failed"))
    res = metalog("produce", "--client-config", cfg, "--timeout-ms", "2000", "x")
    assert res.returncode == 1
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("metalog: error: TLS handshake with 127.0.0.1:"), res.stderr
    assert "the broker closed the connection during the TLS handshake" in err[0], err[0]
    got = wait_events(cluster, 1, "tls_handshake_failed", before + 1)[before:]
    assert "certificate verify failed: unable to get local issuer certificate" in got[0]["reason"]


@pytest.mark.parametrize("when, reason", [
    ("expired", "certificate verify failed: certificate has expired"),
    ("not_yet_valid", "certificate verify failed: certificate is not yet valid"),
])
def test_expired_and_not_yet_valid_client_certificates_are_refused(one_node, tmp_path, when, reason):
    cluster = one_node
    now = dt.datetime.now(dt.timezone.utc)
    start = now - dt.timedelta(days=10) if when == "expired" else now + dt.timedelta(days=10)
    user_dir = str(tmp_path / "users")
    certs.issue_user(cluster.cert_dir, user_dir, "late", valid_days=1, not_before=start)
    cfg = client_config(tmp_path, cluster, user_dir, "late")
    before = len(events(cluster, 1, "tls_handshake_failed"))
    res = metalog("produce", "--client-config", cfg, "--timeout-ms", "2000", "x")
    assert res.returncode == 1
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and "TLS handshake with 127.0.0.1:" in err[0], res.stderr
    # the client sees the problem itself, before bothering the broker
    assert ("has expired (not after" if when == "expired" else "is not yet valid (not before") in err[0]
    # A client that does not check its own certificate (a raw TLS socket) is refused by the broker,
    # which logs the reason once.
    host, port = cluster.bootstrap()[0]
    tls = TlsFiles(TlsPaths(os.path.join(cluster.cert_dir, "ca.crt"), f"{user_dir}/late.crt", f"{user_dir}/late.key"))
    try:
        with tls.client().wrap_socket(socket.create_connection((host, port), timeout=5), server_hostname=host) as s:
            _closed_by_server(s, 5)  # TLS 1.3: our side finished, the broker closes without answering
    except (ssl.SSLError, ConnectionResetError):
        pass  # or the refusal came during the handshake
    got = wait_events(cluster, 1, "tls_handshake_failed", before + 1)[before:]
    assert got[0]["reason"] == reason
    time.sleep(0.2)  # give a (wrong) second log line the chance to appear before counting
    assert len(events(cluster, 1, "tls_handshake_failed")) == before + 1  # once per failed connection


async def test_wrong_host_name_is_refused_by_the_client(one_node):
    """The node certificate names 127.0.0.1 and localhost; dialled as another
    name, the client refuses the server."""
    cluster = one_node
    host, port = cluster.bootstrap()[0]
    ch = PeerChannel(host, port, tls=cluster.client_tls(), server_hostname="broker9.example")
    try:
        with pytest.raises(TlsHandshakeError) as info:
            await ch.request(ApiKey.METADATA, m.MetadataRequest(), 3000)
    finally:
        await ch.close()
    assert str(info.value).startswith(f"TLS handshake with {host}:{port} failed: certificate verify failed: "
                                      "Hostname mismatch")
    client = MetalogClient([(host, port)], cluster.cluster_id, tls=cluster.client_tls(), max_retries=3)
    try:
        assert (await client.metadata()).leader_id == 1  # the right name works
    finally:
        await client.close()


def _peer_serial(host: str, port: int, tls: TlsFiles) -> int:
    with socket.create_connection((host, port), timeout=5) as raw:
        with tls.client().wrap_socket(raw, server_hostname=host) as s:
            der = s.getpeercert(binary_form=True)
    from cryptography import x509

    return x509.load_der_x509_certificate(der).serial_number


async def test_rotation_while_running(make_cluster, tmp_path):
    """Re-issue the node's certificate (new key) and SIGHUP: new handshakes get
    the new certificate while an established client connection keeps working;
    without SIGHUP the mtime check picks up a rotated user certificate... and a
    client whose certificate is rotated connects with the new one."""
    cluster = make_cluster(voters=1, ssl_reload_check_ms=200, **FAST)
    cluster.wait_for_leader(20)
    host, port = cluster.bootstrap()[0]
    client = MetalogClient([(host, port)], cluster.cluster_id, tls=cluster.client_tls(), max_retries=3)
    try:
        await client.produce([b"before"])
        old_serial = _peer_serial(host, port, cluster.client_tls())
        certs.issue_node(cluster.cert_dir, cluster.cert_dir, 1, ["127.0.0.1", "localhost"])
        new_serial = certs.load_cert(os.path.join(cluster.cert_dir, "node-1.crt")).serial_number
        assert new_serial != old_serial
        cluster.signal(1, signal.SIGHUP)
        wait_events(cluster, 1, "tls_reloaded")
        assert events(cluster, 1, "tls_reloaded")[0]["trigger"] == "sighup"
        assert _peer_serial(host, port, cluster.client_tls()) == new_serial
        # the connection made before the rotation is still served
        offset, _ = await client.produce([b"after"])
        assert offset >= 1
    finally:
        await client.close()

    # A user certificate rotated in place: a new client connects with it; a
    # certificate from before the CA was replaced no longer does.
    user_dir = str(tmp_path / "u")
    certs.issue_user(cluster.cert_dir, user_dir, "alice")
    alice = TlsFiles(TlsPaths(os.path.join(cluster.cert_dir, "ca.crt"), f"{user_dir}/alice.crt",
                              f"{user_dir}/alice.key"))
    assert _peer_serial(host, port, alice) == new_serial
    certs.issue_user(cluster.cert_dir, user_dir, "alice")  # rotate alice
    alice2 = TlsFiles(TlsPaths(os.path.join(cluster.cert_dir, "ca.crt"), f"{user_dir}/alice.crt",
                               f"{user_dir}/alice.key"))
    assert _peer_serial(host, port, alice2) == new_serial

    # CA rotation: a new CA replaces the old one in the broker's ca.crt (mtime
    # check, no signal); a certificate of the old CA is then refused.
    old_ca_dir = str(tmp_path / "old-ca")
    os.makedirs(old_ca_dir)
    for f in ("ca.crt", "ca.key"):
        with open(os.path.join(cluster.cert_dir, f), "rb") as src, open(os.path.join(old_ca_dir, f), "wb") as dst:
            dst.write(src.read())
    new_ca = str(tmp_path / "new-ca")
    certs.init_ca(new_ca)
    certs.issue_node(new_ca, cluster.cert_dir, 1, ["127.0.0.1", "localhost"])
    certs.issue_user(new_ca, new_ca, "admin")
    with open(os.path.join(new_ca, "ca.crt"), "rb") as f:
        from metalog.storage.atomic import atomic_write

        atomic_write(os.path.join(cluster.cert_dir, "ca.crt"), f.read())
    wait_events(cluster, 1, "tls_reloaded", 2)
    assert events(cluster, 1, "tls_reloaded")[1]["trigger"] == "file_change"
    new_admin = TlsFiles(TlsPaths(f"{new_ca}/ca.crt", f"{new_ca}/admin.crt", f"{new_ca}/admin.key"))
    client = MetalogClient([(host, port)], cluster.cluster_id, tls=new_admin, max_retries=3)
    try:
        assert (await client.metadata()).leader_id == 1
    finally:
        await client.close()
    old_client = MetalogClient([(host, port)], cluster.cluster_id, tls=alice2, max_retries=1)
    try:
        with pytest.raises(TlsFailure):
            await old_client.metadata()
    finally:
        await old_client.close()


def _tls_socket(host: str, port: int, tls: TlsFiles, source: str = "127.0.0.1") -> ssl.SSLSocket:
    raw = socket.create_connection((host, port), timeout=5, source_address=(source, 0))
    return tls.client().wrap_socket(raw, server_hostname=host)


def _closed_by_server(s: socket.socket, timeout_s: float) -> float:
    """Seconds until the server closed `s` (EOF or reset), failing after timeout_s."""
    t0 = time.monotonic()
    s.settimeout(timeout_s)
    try:
        data = s.recv(100)
        assert data == b"", f"unexpected answer {data!r}"
    except (ConnectionResetError, ssl.SSLError):
        pass
    except socket.timeout:
        raise AssertionError(f"server did not close the connection within {timeout_s}s") from None
    return time.monotonic() - t0


def test_idle_timeout_cuts_a_client_that_sends_three_bytes_and_stalls(make_cluster):
    cluster = make_cluster(voters=1, connections_max_idle_ms=600, **FAST)
    cluster.wait_for_leader(20)
    host, port = cluster.bootstrap()[0]
    with _tls_socket(host, port, cluster.client_tls()) as s:
        s.sendall(b"\x00\x00\x00")  # 3 bytes of a frame's length, then nothing
        waited = _closed_by_server(s, 10)
    assert waited >= 0.3  # not cut at once: after the idle limit
    ev = wait_events(cluster, 1, "connection_idle_closed")
    assert ev[0]["partial_frame_bytes"] == 3 and ev[0]["principal"] == "User:admin"


def test_connection_caps_per_address_and_per_listener(make_cluster):
    """max_connections_per_ip=2: a third connection from 127.0.0.2 is closed
    before the handshake while 127.0.0.3 still gets in; the refusal is logged."""
    cluster = make_cluster(voters=1, max_connections=3, max_connections_per_ip=2, **FAST)
    cluster.wait_for_leader(20)
    host, port = cluster.bootstrap()[0]
    tls = cluster.client_tls()
    held = [_tls_socket(host, port, tls, "127.0.0.2"), _tls_socket(host, port, tls, "127.0.0.2")]
    try:
        with pytest.raises((ssl.SSLError, ConnectionResetError, OSError)):
            s = _tls_socket(host, port, tls, "127.0.0.2")
            s.recv(1)  # TLS 1.3: a refusal may surface on the first read
        ev = wait_events(cluster, 1, "connection_refused")
        assert ev[0]["reason"] == "connection limit" and ev[0]["peer"].startswith("127.0.0.2:")
        held.append(_tls_socket(host, port, tls, "127.0.0.3"))  # another address: fine (3 of 3)
        with pytest.raises((ssl.SSLError, ConnectionResetError, OSError)):
            s = _tls_socket(host, port, tls, "127.0.0.4")  # the listener is full
            s.recv(1)
    finally:
        for s in held:
            s.close()
    # closing frees the slots
    def can_connect():
        try:
            with _tls_socket(host, port, tls, "127.0.0.4") as s:
                s.sendall(b"")
                return True
        except OSError:
            return False
    cluster.wait_for(can_connect, 10, "a free slot after closing")


def test_back_off_for_an_address_that_keeps_failing(make_cluster):
    """After failed_connections_before_backoff failed handshakes, the address's
    new connections are held without a handshake for a growing period (one
    log line per period; KIP-612's delay, not a refusal); other addresses are
    served meanwhile."""
    cluster = make_cluster(voters=1, failed_connections_before_backoff=3, failed_connection_backoff_ms=3000,
                           **FAST)
    cluster.wait_for_leader(20)
    host, port = cluster.bootstrap()[0]
    for _ in range(3):
        last_failure = time.monotonic()  # the back-off starts after this
        with socket.create_connection((host, port), timeout=5, source_address=("127.0.0.5", 0)) as s:
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")  # plaintext to the TLS port: a failed handshake
            _closed_by_server(s, 5)
    ev = wait_events(cluster, 1, "connection_backoff")
    assert ev[0]["address"] == "127.0.0.5" and ev[0]["backoff_ms"] == 3000
    failed_before = len(events(cluster, 1, "tls_handshake_failed"))
    with _tls_socket(host, port, cluster.client_tls(), "127.0.0.6") as ok:
        assert ok.version() in ("TLSv1.3", "TLSv1.2")
    with _tls_socket(host, port, cluster.client_tls(), "127.0.0.5") as held:  # even a valid client, from there
        assert held.version() in ("TLSv1.3", "TLSv1.2")  # ... gets in, once the period is over
        assert time.monotonic() - last_failure >= 2.5  # held for its 3 s back-off
    # held before any handshake: no new handshake failure logged for it, one back-off line
    assert len(events(cluster, 1, "tls_handshake_failed")) == failed_before
    assert len(events(cluster, 1, "connection_backoff")) == 1


def test_tls_1_1_is_refused(one_node):
    host, port = one_node.bootstrap()[0]
    ctx = one_node.client_tls().client()
    ctx2 = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx2.load_verify_locations(os.path.join(one_node.cert_dir, "ca.crt"))
    ctx2.load_cert_chain(os.path.join(one_node.cert_dir, "admin.crt"), os.path.join(one_node.cert_dir, "admin.key"))
    try:
        # the very point of the test is an old protocol: Python warns that it is deprecated
        with pytest.warns(DeprecationWarning, match="TLSv1"):
            ctx2.minimum_version = ssl.TLSVersion.TLSv1
            ctx2.maximum_version = ssl.TLSVersion.TLSv1_1
    except (ValueError, ssl.SSLError):
        pytest.skip("this OpenSSL cannot even offer TLS 1.1")
    with socket.create_connection((host, port), timeout=5) as raw:
        with pytest.raises(ssl.SSLError):
            ctx2.wrap_socket(raw, server_hostname=host)
    with socket.create_connection((host, port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname=host) as s:
            assert s.version() == "TLSv1.3"


def test_insecure_mode_warns_and_says_so_in_health(make_cluster):
    cluster = make_cluster(voters=1, start=False, **FAST)
    cluster.insecure = True
    cluster.start()
    cluster.wait_for_leader(20)
    warn = wait_events(cluster, 1, "insecure_mode")
    assert warn[0]["level"] == "warning" and "no encryption and no authentication" in warn[0]["detail"]
    health = cluster.admin(1, "/health")
    assert health["status"] == "ok" and "no encryption" in health["insecure"]
    res = metalog("produce", "--insecure", "--bootstrap", ",".join(f"{h}:{p}" for h, p in cluster.bootstrap()),
                  "--cluster-id", cluster.cluster_id, "x")
    assert res.returncode == 0, res.stderr
    assert "--insecure: plaintext" in res.stderr


def test_secure_health_has_no_insecure_flag_and_needs_a_client_certificate(one_node):
    health = one_node.admin(1, "/health")
    assert health["status"] == "ok" and "insecure" not in health
    port = one_node.nodes[1].admin_port
    ctx = ssl.create_default_context(cafile=os.path.join(one_node.cert_dir, "ca.crt"))  # no client cert
    import urllib.error
    import urllib.request

    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionResetError)):
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/health", context=ctx, timeout=5) as r:
            r.read()
