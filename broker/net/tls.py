"""TLS contexts for brokers and clients, reloadable for certificate rotation.

Mutual TLS with the standard ``ssl`` module: TLS 1.2 minimum (1.3 is
negotiated whenever both ends have it), both sides present a certificate
signed by the cluster CA (CERT_REQUIRED both ways) and a client checks the
server's host name against the certificate's SANs.

``TlsFiles`` owns the paths of one party's CA, certificate and key and hands
out the current ``ssl.SSLContext``. ``reload()`` (SIGHUP) or ``maybe_reload()``
(a file-mtime check, at most once per ``check_interval_s``) builds a new
context when a file changed: new handshakes use it, established connections
keep the one they were made with. A reload that fails (half-rotated files,
key not matching the certificate) keeps the previous context and says why.
"""

from __future__ import annotations

import os
import ssl
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from metalog.broker.net.library_logging import library_logger
from metalog.protocol.invariants import InvariantViolation

# What the broker log and /health say about a PLAINTEXT (insecure) broker.
INSECURE_DETAIL = ("security_protocol PLAINTEXT: no encryption and no authentication; anyone who can "
                   "reach the ports can read the log and act as a replica or a client")


CHAIN_DEPTH_MAX = 8  # issuers looked up in the CA file for the certificate chain


class TlsConfigError(ValueError):
    pass


@dataclass(frozen=True)
class TlsPaths:
    ca_file: str
    cert_file: str
    key_file: str


def _base_context(purpose: ssl.Purpose, paths: TlsPaths) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if purpose is ssl.Purpose.CLIENT_AUTH else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        ctx.load_verify_locations(cafile=paths.ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise TlsConfigError(f"ssl_ca_file {paths.ca_file}: {tls_error_text(exc)}") from None
    try:
        chain = _issuer_chain_pem(paths)
        if chain is None:
            ctx.load_cert_chain(paths.cert_file, paths.key_file)
        else:
            with tempfile.TemporaryDirectory(prefix="metalog-chain-") as tmp:
                chain_file = os.path.join(tmp, "chain.pem")
                with open(chain_file, "wb") as f:
                    f.write(chain)
                ctx.load_cert_chain(chain_file, paths.key_file)
    except (OSError, ssl.SSLError) as exc:
        raise TlsConfigError(f"ssl_cert_file {paths.cert_file} / ssl_key_file {paths.key_file}: {tls_error_text(exc)}") from None
    return ctx


def _issuer_chain_pem(paths: TlsPaths) -> bytes | None:
    """The certificate followed by its issuers from the CA file, when the
    certificate file holds the certificate alone (None: load it as it is).

    Without a chain OpenSSL builds one for every handshake, verifying the
    certificate against the CA store each time: a third of what a server
    spends answering a ClientHello (issue 34: a handshake flood pays it per
    connection). Given the chain, it sends it as is."""
    from cryptography import x509

    try:
        with open(paths.cert_file, "rb") as f:
            own = x509.load_pem_x509_certificates(f.read())
        with open(paths.ca_file, "rb") as f:
            cas = x509.load_pem_x509_certificates(f.read())
    except (OSError, ValueError):
        return None  # load_cert_chain / load_verify_locations say what is wrong
    if len(own) != 1:
        return None  # a chain already, or not one certificate
    chain = [own[0]]
    for _ in range(CHAIN_DEPTH_MAX):
        issuer = next((ca for ca in cas if ca.subject == chain[-1].issuer and ca not in chain), None)
        if issuer is None:
            break
        chain.append(issuer)
        if issuer.issuer == issuer.subject:  # self-signed: the root
            break
    if len(chain) == 1:
        return None  # the CA file does not hold its issuer: leave the chain to OpenSSL
    from cryptography.hazmat.primitives.serialization import Encoding

    return b"".join(cert.public_bytes(Encoding.PEM) for cert in chain)


def server_context(paths: TlsPaths) -> ssl.SSLContext:
    """Accepting side: a client certificate signed by the CA is required."""
    return _base_context(ssl.Purpose.CLIENT_AUTH, paths)


def client_context(paths: TlsPaths) -> ssl.SSLContext:
    """Connecting side: presents our certificate, verifies the server's and its host name."""
    ctx = _base_context(ssl.Purpose.SERVER_AUTH, paths)
    ctx.check_hostname = True
    return ctx


def tls_error_text(exc: BaseException) -> str:
    """One short line for a TLS or file error: OpenSSL's verify message or reason
    (``certificate verify failed: ...``, ``sslv3 alert certificate unknown``), the OS's."""
    if isinstance(exc, ssl.SSLCertVerificationError) and exc.verify_message:
        return f"certificate verify failed: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return exc.reason.lower().replace("_", " ")
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def is_handshake_timeout(exc: BaseException) -> bool:
    # asyncio and uvloop abort a slow handshake with this ConnectionAbortedError.
    return isinstance(exc, TimeoutError) or (
        isinstance(exc, ConnectionAbortedError) and "handshake is taking longer" in str(exc))


def handshake_failure_reason(exc: BaseException) -> str:
    """One short line for a failed handshake, e.g. ``certificate verify failed:
    certificate has expired`` or ``wrong version number`` (plaintext to a TLS port)."""
    if is_handshake_timeout(exc):
        return "handshake timed out"
    if isinstance(exc, (ConnectionResetError, BrokenPipeError)):
        return "connection reset by peer during the handshake"
    if isinstance(exc, ssl.SSLError) and exc.reason == "TLSV1_ALERT_UNKNOWN_CA":
        return "the peer does not trust our certificate (unknown CA)"
    if isinstance(exc, ssl.SSLError) and exc.reason == "SSLV3_ALERT_CERTIFICATE_EXPIRED":
        return "the peer refused our certificate: certificate expired or not yet valid"
    if isinstance(exc, ssl.SSLError) and exc.reason == "SSLV3_ALERT_BAD_CERTIFICATE":
        return "the peer refused our certificate (bad certificate)"
    if isinstance(exc, ssl.SSLError) and exc.reason == "TLSV13_ALERT_CERTIFICATE_REQUIRED":
        return "the peer requires a client certificate"
    return tls_error_text(exc)


def _cert_validity(path: str):
    from cryptography import x509

    try:
        with open(path, "rb") as f:
            cert = x509.load_pem_x509_certificate(f.read())
    except (OSError, ValueError) as exc:
        raise TlsConfigError(f"ssl_cert_file {path}: {tls_error_text(exc) if isinstance(exc, OSError) else exc}") from None
    return cert.not_valid_before_utc, cert.not_valid_after_utc


class TlsFiles:
    """The current server and client contexts of one party, reloaded on change."""

    def __init__(self, paths: TlsPaths, *, check_interval_s: float = 1.0, logger: Any = None):
        self.paths = paths
        self.check_interval_s = check_interval_s
        self._log = logger if logger is not None else library_logger("metalog.tls")
        self._server: ssl.SSLContext | None = None
        self._client: ssl.SSLContext | None = None
        self._mtimes = self._stat()
        self._next_check_s = 0.0
        self.generation = 0  # bumped on every successful (re)load
        self._build()

    def _stat(self) -> tuple:
        out = []
        for p in (self.paths.ca_file, self.paths.cert_file, self.paths.key_file):
            try:
                st = os.stat(p)
                out.append((st.st_mtime_ns, st.st_ino, st.st_size))
            except OSError:
                out.append(None)
        return tuple(out)

    def _build(self) -> None:
        self._validity = _cert_validity(self.paths.cert_file)
        server = server_context(self.paths)
        # A context handed out earlier (e.g. to aiohttp's listener) switches each
        # new handshake over to the current one, so a reload reaches every listener.
        server.sni_callback = self._use_current
        self._server = server
        self._client = client_context(self.paths)
        self.generation += 1

    def server(self) -> ssl.SSLContext:
        self.maybe_reload()
        if self._server is None:
            raise InvariantViolation("TlsFiles built without a server context")
        return self._server

    def _use_current(self, sslobj: Any, _server_name: str | None, ctx: ssl.SSLContext) -> None:
        # Runs inside a handshake, in a handshake thread for our own listeners
        # (metalog.broker.net.tls_transport): it reads the current context and
        # leaves the reload (file checks, a rebuild) to the loop thread, which
        # checks before every handshake and on the listener's sweep.
        current = self._server
        if current is not None and ctx is not current:
            sslobj.context = current

    def own_cert_problem(self) -> str | None:
        """Why our own certificate cannot work now (expired, not yet valid), else None.
        Checked before connecting: the peer's refusal would not say why."""
        import datetime as dt

        not_before, not_after = self._validity
        now = dt.datetime.now(dt.timezone.utc)
        if now > not_after:
            return f"our certificate {self.paths.cert_file} has expired (not after {not_after.isoformat()})"
        if now < not_before:
            return f"our certificate {self.paths.cert_file} is not yet valid (not before {not_before.isoformat()})"
        return None

    def client(self) -> ssl.SSLContext:
        self.maybe_reload()
        if self._client is None:
            raise InvariantViolation("TlsFiles built without a client context")
        return self._client

    def maybe_reload(self) -> bool:
        """Cheap: stats three files at most once per check interval."""
        now_s = time.monotonic()
        if now_s < self._next_check_s:
            return False
        self._next_check_s = now_s + self.check_interval_s
        mtimes = self._stat()
        if mtimes == self._mtimes:
            return False
        return self.reload(trigger="file_change", mtimes=mtimes)

    def reload(self, trigger: str = "sighup", mtimes: tuple | None = None) -> bool:
        mtimes = mtimes if mtimes is not None else self._stat()
        try:
            self._build()
        except TlsConfigError as exc:
            # Keep serving with the old context; a rotation in progress may finish soon.
            self._log.warning("tls_reload_failed", trigger=trigger, error=str(exc), action="keep_previous")
            self._mtimes = mtimes
            return False
        self._mtimes = mtimes
        self._log.info("tls_reloaded", trigger=trigger, generation=self.generation,
                       cert_file=self.paths.cert_file, ca_file=self.paths.ca_file)
        return True
