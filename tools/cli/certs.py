"""``metalog certs``: the cluster CA and its certificates for a real deployment.

    metalog certs init --dir certs                       # CA (ca.crt, ca.key)
    metalog certs node 1 --host broker1 --host 10.0.0.5 --dir certs
    metalog certs user alice --dir certs
    metalog certs cluster --dir certs --node 1:broker1 --node 2:broker2 --user admin
    metalog certs rotate certs/node-1.crt                # new key + certificate, same names
    metalog certs show certs/node-1.crt                  # subject, SANs, validity

Files are written atomically; a running broker picks up rotated files within
``ssl_reload_check_ms`` or at once on SIGHUP (docs/security.md).
"""

from __future__ import annotations

import json
import os
import sys

from metalog.tools.cluster import certs


def _node(args) -> int:
    hosts = args.host or ["127.0.0.1", "localhost"]
    issued = certs.issue_node(args.dir, args.out or args.dir, args.node_id, hosts, valid_days=args.days)
    print(json.dumps({"cert": issued.cert_path, "key": issued.key_path}))
    return 0


def _user(args) -> int:
    issued = certs.issue_user(args.dir, args.out or args.dir, args.name, valid_days=args.days)
    print(json.dumps({"cert": issued.cert_path, "key": issued.key_path}))
    return 0


def _init(args) -> int:
    if os.path.exists(os.path.join(args.dir, "ca.crt")) and not args.force:
        print(f"metalog: error: {args.dir}/ca.crt exists; a new CA invalidates every certificate "
              "(--force to replace it)", file=sys.stderr)
        return 1
    issued = certs.init_ca(args.dir, valid_days=args.days)
    print(json.dumps({"cert": issued.cert_path, "key": issued.key_path}))
    return 0


def _cluster(args) -> int:
    nodes: dict[int, list[str]] = {}
    for item in args.node:
        nid, _, host = item.partition(":")
        nodes.setdefault(int(nid), ["127.0.0.1", "localhost"]).extend(h for h in host.split(",") if h)
    certs.cluster_certs(args.dir, nodes, users=tuple(args.user))
    print(json.dumps(sorted(os.listdir(args.dir))))
    return 0


def _rotate(args) -> int:
    """Re-issue a certificate with a new key: same CN, SANs and kind, new validity."""
    info = certs.describe(args.cert)
    directory, base = os.path.split(args.cert)
    name = base.removesuffix(".crt")
    uris = [s for s in info["san"] if s.startswith("urn:metalog:")]
    if not uris:
        print(f"metalog: error: {args.cert} has no metalog URI SAN; issue it anew with `metalog certs node|user`",
              file=sys.stderr)
        return 1
    ca_dir = args.ca_dir or directory
    if uris[0].startswith("urn:metalog:node:"):
        node_id = int(uris[0].rsplit(":", 1)[1])
        hosts = [s for s in info["san"] if not s.startswith("urn:")]
        issued = certs.issue_node(ca_dir, directory or ".", node_id, hosts, valid_days=args.days)
    else:
        issued = certs.issue_user(ca_dir, directory or ".", name, valid_days=args.days)
    print(json.dumps({"rotated": issued.cert_path, "not_after": certs.describe(issued.cert_path)["not_after"]}))
    return 0


def _show(args) -> int:
    print(json.dumps([certs.describe(p) for p in args.certs], indent=2))
    return 0


def register_cli(sub) -> None:
    p = sub.add_parser("certs", help="create, rotate and inspect the cluster CA and certificates")
    csub = p.add_subparsers(dest="certs_command", required=True)
    q = csub.add_parser("init", help="create the cluster CA (ca.crt, ca.key)")
    q.add_argument("--dir", default="certs")
    q.add_argument("--days", type=int, default=certs.CA_VALID_DAYS)
    q.add_argument("--force", action="store_true")
    q.set_defaults(func=_init)
    q = csub.add_parser("node", help="issue a node certificate (server + client, SAN urn:metalog:node:<id>)")
    q.add_argument("node_id", type=int)
    q.add_argument("--host", action="append", help="DNS name or IP the node is dialled by (repeatable)")
    q.add_argument("--dir", default="certs", help="where ca.crt/ca.key are")
    q.add_argument("--out", help="where to write (default --dir)")
    q.add_argument("--days", type=int, default=certs.CERT_VALID_DAYS)
    q.set_defaults(func=_node)
    q = csub.add_parser("user", help="issue a user (client) certificate, principal User:<name>")
    q.add_argument("name")
    q.add_argument("--dir", default="certs")
    q.add_argument("--out")
    q.add_argument("--days", type=int, default=certs.CERT_VALID_DAYS)
    q.set_defaults(func=_user)
    q = csub.add_parser("cluster", help="CA (if missing) + node and user certificates, keeping existing ones")
    q.add_argument("--dir", default="certs")
    q.add_argument("--node", action="append", default=[], metavar="ID[:HOST,HOST...]")
    q.add_argument("--user", action="append", default=[])
    q.set_defaults(func=_cluster)
    q = csub.add_parser("rotate", help="re-issue a certificate with a new key (same names)")
    q.add_argument("cert")
    q.add_argument("--ca-dir", help="where ca.crt/ca.key are (default: the certificate's directory)")
    q.add_argument("--days", type=int, default=certs.CERT_VALID_DAYS)
    q.set_defaults(func=_rotate)
    q = csub.add_parser("show", help="subject, SANs, validity of certificates")
    q.add_argument("certs", nargs="+")
    q.set_defaults(func=_show)
