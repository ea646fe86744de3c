"""Connection flags and client construction shared by every ``metalog`` subcommand that talks to a cluster.

Bootstrap, cluster id, TLS files and admin URL come from the flags, else from
the client config file (``--client-config``, ``$METALOG_CLIENT_CONFIG``, or
``run/cluster/client.yaml``). A config found without ``--client-config`` may
belong to another cluster than an explicit ``--bootstrap``: when none of its
brokers is among the flag's, the CLI says it borrows that config's CA and
certificate, and a failed TLS handshake names the config and CA it used
(``tls_hint``)."""

from __future__ import annotations

import argparse
import os
import sys

from metalog.broker.client import MetalogClient
from metalog.broker.client.config import ENV_VAR, ClientConfig, ClientConfigError, find_client_config


def _endpoints(text: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        host, _, port = item.strip().rpartition(":")
        out.append((host or "127.0.0.1", int(port)))
    return out


# One machine's names for itself: 127.0.0.1:9091 and localhost:9091 are the same broker.
_LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}


def _same_brokers(a: list[tuple[str, int]], b: list[tuple[str, int]]) -> bool:
    """Do the two endpoint lists name any broker in common?"""
    def norm(eps):
        return {("127.0.0.1" if host in _LOOPBACK else host, port) for host, port in eps}

    return bool(norm(a) & norm(b))


DEFAULT_BOOTSTRAP = os.environ.get("METALOG_BOOTSTRAP", "127.0.0.1:9091,127.0.0.1:9092,127.0.0.1:9093")
DEFAULT_CLUSTER_ID = os.environ.get("METALOG_CLUSTER_ID", "metalog-local")


def add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bootstrap", help="host:port,... of any brokers (default: the client config's)")
    p.add_argument("--cluster-id", help="default: the client config's")
    p.add_argument("--timeout-ms", type=int, default=30000,
                   help="overall deadline of a call, retries included (the client's delivery_timeout_ms)")
    p.add_argument("--request-timeout-ms", type=int, default=2000,
                   help="how long one attempt waits for its answer before rediscovering the leader")
    add_credential_args(p)


def add_credential_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--client-config", help="client config file (bootstrap, CA, certificate, key); default "
                   "$METALOG_CLIENT_CONFIG, else run/cluster/client.yaml")
    p.add_argument("--insecure", action="store_true", help="plaintext without a certificate (PLAINTEXT clusters only)")


def client_settings(args) -> dict:
    """Bootstrap, cluster id, TLS files and admin URL from flags and the client config."""
    explicit = getattr(args, "client_config", None)
    cc = find_client_config(explicit)
    args.client_config_used = cc  # for tls_hint, should the handshake fail
    bootstrap = getattr(args, "bootstrap", None)
    tls = None
    if getattr(args, "insecure", False):
        print("metalog: --insecure: plaintext, no client certificate", file=sys.stderr)
    elif cc is None:
        raise ClientConfigError(
            "no client credentials: give --client-config FILE, set $METALOG_CLIENT_CONFIG, or run from the "
            "directory where `bash run.sh cluster` wrote run/cluster/client.yaml (`metalog certs` creates "
            "certificates; --insecure talks plaintext to a PLAINTEXT cluster)")
    else:
        if bootstrap and not explicit and not _same_brokers(_endpoints(bootstrap), cc.endpoints()):
            _say_borrowed(bootstrap, cc)
        tls = cc.tls()
    return {
        "bootstrap": _endpoints(bootstrap or (cc.bootstrap if cc else DEFAULT_BOOTSTRAP)),
        "cluster_id": getattr(args, "cluster_id", None) or (cc.cluster_id if cc else DEFAULT_CLUSTER_ID),
        "tls": tls,
        "admin": (cc.admin if cc and cc.admin else None),
    }


def _say_borrowed(bootstrap: str, cc: ClientConfig) -> None:
    found = f"${ENV_VAR}" if os.environ.get(ENV_VAR) else "found in the current directory"
    print(f"metalog: --bootstrap {bootstrap} names none of the brokers of {cc.path} ({found}); using its CA "
          f"and certificate anyway (`--client-config FILE` names the credentials of another cluster)",
          file=sys.stderr)


def tls_hint(args) -> str:
    """What to add to a failed TLS handshake's error: the client config and CA
    it used, and how to name another."""
    cc: ClientConfig | None = getattr(args, "client_config_used", None)
    if cc is None or not cc.ssl_ca_file:
        return ""
    return (f" (credentials from client config {cc.path}, CA {cc.ssl_ca_file}; `--client-config FILE` "
            f"names another cluster's)")


def make_client(args):
    cs = client_settings(args)
    return MetalogClient(cs["bootstrap"], cs["cluster_id"], request_timeout_ms=min(args.request_timeout_ms,
                                                                               args.timeout_ms),
                         delivery_timeout_ms=args.timeout_ms, tls=cs["tls"])
