"""Where a client finds a cluster and its credentials: the client config file.

``metalog cluster up`` writes ``<cluster dir>/client.yaml``::

    bootstrap: 127.0.0.1:9091,127.0.0.1:9092,127.0.0.1:9093
    cluster_id: metalog-local
    admin: https://127.0.0.1:10091
    security_protocol: SSL
    ssl_ca_file: certs/ca.crt          # relative to this file's directory
    ssl_cert_file: certs/admin.crt
    ssl_key_file: certs/admin.key

Where a client looks for it (``find_client_config``): the file it is given,
else ``$METALOG_CLIENT_CONFIG``, else ``run/cluster/client.yaml`` under the
current directory (the local cluster of ``bash run.sh cluster``). The CLI
gives it ``--client-config FILE``; ``MetalogClient.from_config(path=None)``
its `path`. The CLI's explicit ``--bootstrap`` / ``--cluster-id`` flags
override the file's values.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.request
from dataclasses import dataclass
from typing import Any

import yaml

from metalog.broker.net.tls import TlsFiles, TlsPaths

ENV_VAR = "METALOG_CLIENT_CONFIG"
DEFAULT_PATH = os.path.join("run", "cluster", "client.yaml")
_KEYS = {"bootstrap", "cluster_id", "admin", "security_protocol", "ssl_ca_file", "ssl_cert_file", "ssl_key_file"}


class ClientConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ClientConfig:
    bootstrap: str
    cluster_id: str
    admin: str | None = None
    security_protocol: str = "SSL"
    ssl_ca_file: str | None = None
    ssl_cert_file: str | None = None
    ssl_key_file: str | None = None
    path: str | None = None  # where it was read from

    def endpoints(self) -> list[tuple[str, int]]:
        out = []
        for item in filter(None, (p.strip() for p in self.bootstrap.split(","))):
            host, _, port = item.rpartition(":")
            out.append((host or "127.0.0.1", int(port)))
        return out

    def tls(self) -> TlsFiles | None:
        """The client's TLS files (reloaded when they change), None in PLAINTEXT mode."""
        if self.security_protocol == "PLAINTEXT":
            return None
        if not (self.ssl_ca_file and self.ssl_cert_file and self.ssl_key_file):
            missing = [k for k in ("ssl_ca_file", "ssl_cert_file", "ssl_key_file") if not getattr(self, k)]
            raise ClientConfigError(f"client config {self.path or '(not from a file)'}: security_protocol "
                                    f"{self.security_protocol} needs {', '.join(missing)}")
        return TlsFiles(TlsPaths(self.ssl_ca_file, self.ssl_cert_file, self.ssl_key_file))

    def write(self, path: str) -> None:
        base = os.path.dirname(os.path.abspath(path))
        data: dict[str, Any] = {"bootstrap": self.bootstrap, "cluster_id": self.cluster_id}
        if self.admin:
            data["admin"] = self.admin
        data["security_protocol"] = self.security_protocol
        for key in ("ssl_ca_file", "ssl_cert_file", "ssl_key_file"):
            value = getattr(self, key)
            if value:
                data[key] = os.path.relpath(value, base)
        from metalog.storage.atomic import atomic_write

        atomic_write(path, yaml.safe_dump(data, sort_keys=False).encode())


def load_client_config(path: str) -> ClientConfig:
    try:
        with open(path, "rb") as f:
            data = yaml.safe_load(f.read())
    except OSError as exc:
        raise ClientConfigError(f"client config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ClientConfigError(f"client config {path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ClientConfigError(f"client config {path}: expected a mapping of keys to values")
    unknown = set(data) - _KEYS
    if unknown:
        raise ClientConfigError(f"client config {path}: unknown keys {sorted(unknown)} (known: {sorted(_KEYS)})")
    for key in ("bootstrap", "cluster_id"):
        if not data.get(key):
            raise ClientConfigError(f"client config {path}: {key} is required")
    proto = data.get("security_protocol", "SSL")
    if proto not in ("SSL", "PLAINTEXT"):
        raise ClientConfigError(f"client config {path}: security_protocol must be SSL or PLAINTEXT, got {proto!r}")
    base = os.path.dirname(os.path.abspath(path))
    files = {}
    for key in ("ssl_ca_file", "ssl_cert_file", "ssl_key_file"):
        value = data.get(key)
        if proto == "SSL" and not value:
            raise ClientConfigError(f"client config {path}: {key} is required with security_protocol SSL")
        if value:
            value = value if os.path.isabs(value) else os.path.join(base, value)
            if proto == "SSL" and not os.path.isfile(value):
                raise ClientConfigError(f"client config {path}: {key}: no such file: {value}")
        files[key] = value
    return ClientConfig(bootstrap=str(data["bootstrap"]), cluster_id=str(data["cluster_id"]),
                        admin=data.get("admin"), security_protocol=proto, path=os.path.abspath(path), **files)


def find_client_config(explicit: str | None = None) -> ClientConfig | None:
    """The flag's file, else the env var's, else ./run/cluster/client.yaml if present."""
    if explicit:
        return load_client_config(explicit)
    env = os.environ.get(ENV_VAR)
    if env:
        return load_client_config(env)
    if os.path.isfile(DEFAULT_PATH):
        return load_client_config(DEFAULT_PATH)
    return None


def admin_get(url: str, tls: TlsFiles | ssl.SSLContext | None, timeout_s: float = 5.0) -> Any:
    """GET an admin API path and decode its JSON; https with our client certificate."""
    ctx = tls.client() if isinstance(tls, TlsFiles) else tls
    with urllib.request.urlopen(url, timeout=timeout_s, context=ctx) as resp:
        return json.loads(resp.read())
