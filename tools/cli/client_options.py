"""Connection flags and client construction shared by every ``metalog`` subcommand that talks to a cluster.

Bootstrap, cluster id, TLS files and admin URL come from the flags, else from
the client config file (``--client-config``, ``$METALOG_CLIENT_CONFIG``, or
``run/cluster/client.yaml``)."""

from __future__ import annotations

import argparse
import os
import sys

from metalog.broker.client import MetalogClient
from metalog.broker.client.config import ClientConfigError, find_client_config


def _endpoints(text: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        host, _, port = item.strip().rpartition(":")
        out.append((host or "127.0.0.1", int(port)))
    return out


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
    cc = find_client_config(getattr(args, "client_config", None))
    tls = None
    if getattr(args, "insecure", False):
        print("metalog: --insecure: plaintext, no client certificate", file=sys.stderr)
    elif cc is None:
        raise ClientConfigError(
            "no client credentials: give --client-config FILE, set $METALOG_CLIENT_CONFIG, or run from the "
            "directory where `bash run.sh cluster` wrote run/cluster/client.yaml (`metalog certs` creates "
            "certificates; --insecure talks plaintext to a PLAINTEXT cluster)")
    else:
        tls = cc.tls()
    return {
        "bootstrap": _endpoints(getattr(args, "bootstrap", None) or (cc.bootstrap if cc else DEFAULT_BOOTSTRAP)),
        "cluster_id": getattr(args, "cluster_id", None) or (cc.cluster_id if cc else DEFAULT_CLUSTER_ID),
        "tls": tls,
        "admin": (cc.admin if cc and cc.admin else None),
    }


def make_client(args):
    cs = client_settings(args)
    return MetalogClient(cs["bootstrap"], cs["cluster_id"], request_timeout_ms=min(args.request_timeout_ms,
                                                                               args.timeout_ms),
                         delivery_timeout_ms=args.timeout_ms, tls=cs["tls"])
