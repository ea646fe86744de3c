"""The etcd side of ``metalog bench --vs etcd``: a 3-member etcd cluster on
loopback and a load client of comparable cost.

The cluster: three ``etcd`` processes with their own temp data dirs and free
loopback ports, default durability (etcd fsyncs its WAL before it answers a
put). Its members are found with ``shutil.which("etcd")``; without one,
``etcd_missing_message()`` says how to get it and the bench skips the
comparison.

The client: etcd's own gRPC API (``/etcdserverpb.KV/Put``) through grpcio's
asyncio channel, one HTTP/2 connection per load process multiplexing every
logical client, sent to the leader (no follower-forwarding hop). That mirrors
the metalog client: one TCP connection per broker, concurrent requests
multiplexed, binary framing, a request per write awaiting its commit. The
PutRequest protobuf (key = field 1, value = field 2) is two length-delimited
fields, encoded by hand so no generated stubs are needed. Without grpcio the
HTTP/JSON gateway (``POST /v3/kv/put``, base64 fields) is used through aiohttp
with a connection pool as large as the client count; the report says which.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import ssl
import subprocess
import time
import urllib.request

from metalog.tools.cluster import certs
from metalog.tools.cluster.launcher import free_ports


def etcd_binary() -> str | None:
    return shutil.which("etcd")


def etcd_missing_message() -> str:
    return ("metalog bench: no `etcd` binary on PATH, skipping the etcd comparison. "
            "Install it (Debian/Ubuntu: `apt-get install -y etcd-server etcd-client`, or a release "
            "tarball from github.com/etcd-io/etcd/releases) and run again with --vs etcd.")


def etcd_version() -> str:
    exe = etcd_binary()
    if exe is None:
        return "missing"
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10).stdout
    return out.splitlines()[0].strip() if out else "unknown"


def grpc_available() -> bool:
    # grpcio is optional (the [bench] extra): imported only where it is used, and
    # without it the HTTP/JSON gateway is used instead.
    try:
        import grpc  # noqa: F401
        import grpc.aio  # noqa: F401
    except ImportError:
        return False
    return True


class EtcdCluster:
    """Three etcd members on loopback under `root`.

    With `cert_dir` (a directory holding the cluster CA's ca.crt/ca.key, as
    ``metalog.tools.cluster.certs`` writes it) etcd is secured like metalog: TLS on client and
    peer URLs with ``--client-cert-auth --peer-client-cert-auth
    --trusted-ca-file``, member certificates and a `bench` client certificate
    issued by that same CA."""

    def __init__(self, root: str, members: int = 3, cert_dir: str | None = None):
        self.root = os.path.abspath(root)
        ports = free_ports(2 * members)
        self.names = [f"e{i + 1}" for i in range(members)]
        self.client_ports = ports[:members]
        self.peer_ports = ports[members:]
        self.procs: dict[str, subprocess.Popen] = {}
        self.cert_dir = cert_dir
        self.scheme = "https" if cert_dir else "http"

    def client_url(self, i: int) -> str:
        return f"{self.scheme}://127.0.0.1:{self.client_ports[i]}"

    def peer_url(self, i: int) -> str:
        return f"{self.scheme}://127.0.0.1:{self.peer_ports[i]}"

    def client_tls(self) -> list[str] | None:
        """[ca, cert, key] of the `bench` client certificate (None without TLS)."""
        if not self.cert_dir:
            return None
        out = os.path.join(self.cert_dir, "etcd")
        if not os.path.exists(os.path.join(out, "bench.crt")):
            certs.issue_user(self.cert_dir, out, "bench")
        return [os.path.join(self.cert_dir, "ca.crt"), os.path.join(out, "bench.crt"), os.path.join(out, "bench.key")]

    def _tls_flags(self, i: int) -> list[str]:
        if not self.cert_dir:
            return []
        out = os.path.join(self.cert_dir, "etcd")
        member = 100 + i  # a node certificate: serverAuth + clientAuth, SAN 127.0.0.1
        if not os.path.exists(os.path.join(out, f"node-{member}.crt")):
            certs.issue_node(self.cert_dir, out, member, ["127.0.0.1", "localhost"])
        crt, key, ca = (os.path.join(out, f"node-{member}.crt"), os.path.join(out, f"node-{member}.key"),
                        os.path.join(self.cert_dir, "ca.crt"))
        return ["--cert-file", crt, "--key-file", key, "--client-cert-auth", "--trusted-ca-file", ca,
                "--peer-cert-file", crt, "--peer-key-file", key, "--peer-client-cert-auth",
                "--peer-trusted-ca-file", ca]

    def start(self) -> None:
        exe = etcd_binary()
        if exe is None:
            raise FileNotFoundError(etcd_missing_message())
        initial = ",".join(f"{n}={self.peer_url(i)}" for i, n in enumerate(self.names))
        for i, name in enumerate(self.names):
            d = os.path.join(self.root, name)
            os.makedirs(d, exist_ok=True)
            cmd = [exe, "--name", name, "--data-dir", os.path.join(d, "data"),
                   "--listen-client-urls", self.client_url(i), "--advertise-client-urls", self.client_url(i),
                   "--listen-peer-urls", self.peer_url(i), "--initial-advertise-peer-urls", self.peer_url(i),
                   *self._tls_flags(i),
                   "--initial-cluster", initial, "--initial-cluster-state", "new",
                   "--initial-cluster-token", f"metalog-bench-{os.getpid()}",
                   "--log-level", "warn", "--logger", "zap"]
            log = open(os.path.join(d, "etcd.log"), "ab")
            self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
            log.close()

    def _post(self, i: int, path: str, body: dict, timeout_s: float = 2.0) -> dict | None:
        req = urllib.request.Request(self.client_url(i) + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        ctx = None
        if self.cert_dir:
            ca, crt, key = self.client_tls()  # type: ignore[misc]
            ctx = ssl.create_default_context(cafile=ca)
            ctx.load_cert_chain(crt, key)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s, context=ctx) as resp:
                return json.loads(resp.read())
        except Exception:
            return None

    def leader_index(self) -> int | None:
        """Index of the member that reports itself leader."""
        for i in range(len(self.names)):
            st = self._post(i, "/v3/maintenance/status", {})
            if st and st.get("leader") and st.get("leader") == st.get("header", {}).get("member_id"):
                return i
        return None

    def wait_ready(self, timeout_s: float = 30.0) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"etcd member {name} exited with {p.returncode}; see "
                                       f"{os.path.join(self.root, name, 'etcd.log')}")
            i = self.leader_index()
            if i is not None and self._post(i, "/v3/kv/put", {"key": _b64(b"ready"), "value": _b64(b"1")}):
                return i
            time.sleep(0.1)
        raise TimeoutError(f"etcd cluster not ready after {timeout_s}s; logs under {self.root}")

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def encode_put_request(key: bytes, value: bytes) -> bytes:
    """etcdserverpb.PutRequest{key: 1, value: 2} in protobuf wire format."""
    return b"\x0a" + _varint(len(key)) + key + b"\x12" + _varint(len(value)) + value


class EtcdPutter:
    """put(key, value) awaiting etcd's answer (which etcd sends after commit +
    WAL fsync on a majority); gRPC when available, else the JSON gateway."""

    def __init__(self, url: str, concurrency: int, tls: list[str] | None = None):
        self.url = url
        self.tls = tls  # [ca, cert, key] for a secured etcd
        self.transport = "grpc" if grpc_available() else "http-json-gateway"
        self._concurrency = concurrency
        self._put = None
        self._close = None

    async def open(self) -> None:
        if self.transport == "grpc":
            import grpc.aio  # optional, see grpc_available()

            if self.tls:
                ca, crt, key = (open(p, "rb").read() for p in self.tls)
                creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=crt)
                channel = grpc.aio.secure_channel(self.url.removeprefix("https://"), creds)
            else:
                channel = grpc.aio.insecure_channel(self.url.removeprefix("http://"))
            self._put = channel.unary_unary("/etcdserverpb.KV/Put")  # bytes in, bytes out
            self._close = channel.close
        else:
            import aiohttp  # not at the top: ~0.26 s of start-up every `metalog` command would pay

            ssl_ctx = None
            if self.tls:
                ssl_ctx = ssl.create_default_context(cafile=self.tls[0])
                ssl_ctx.load_cert_chain(self.tls[1], self.tls[2])
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self._concurrency, ssl=ssl_ctx))
            url = self.url + "/v3/kv/put"

            async def put(body: bytes, timeout: float):
                k, v = body
                async with session.post(url, json={"key": _b64(k), "value": _b64(v)}) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"etcd put answered HTTP {resp.status}: {await resp.text()}")
                    await resp.read()

            self._put = put
            self._close = session.close

    async def put(self, key: bytes, value: bytes, timeout_s: float = 10.0) -> None:
        if self.transport == "grpc":
            await self._put(encode_put_request(key, value), timeout=timeout_s)
        else:
            await self._put((key, value), timeout_s)

    async def close(self) -> None:
        if self._close is not None:
            await self._close()
