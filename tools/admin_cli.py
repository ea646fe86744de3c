"""CLI for controller commands and state:

    metalog topics create NAME --partitions 3 --replication-factor 3
    metalog topics delete NAME
    metalog topics list [--admin https://127.0.0.1:10091]
    metalog brokers register ID [--endpoint NAME:HOST:PORT] [--rack R]
    metalog brokers fence|unfence|unregister ID
    metalog configs set  --topic NAME | --broker ID  KEY VALUE
    metalog configs delete --topic NAME | --broker ID  KEY

Writes go to the leader over the binary protocol (ControllerCommand) and
return once committed; reads come from a broker's admin API (/metadata).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from storage.metadata_records import RESOURCE_BROKER, RESOURCE_TOPIC


def _run(args, command: str, **cmd_args) -> int:
    from broker.client import ClusterUnavailable, MetalogError
    from tools.cli import make_client

    async def go() -> int:
        client = make_client(args)
        try:
            offset, epoch = await client.command(command, **cmd_args)
        except MetalogError as exc:
            print(f"metalog: {command} refused: {exc}", file=sys.stderr)
            return 1
        except ClusterUnavailable as exc:
            print(f"metalog: {command} failed: {exc}", file=sys.stderr)
            return 1
        finally:
            await client.close()
        print(json.dumps({"command": command, "committed_at_offset": offset, "leader_epoch": epoch}))
        return 0

    return asyncio.run(go())


def _metadata(admin: str, tls) -> dict:
    from broker.client_config import admin_get

    return admin_get(admin.rstrip("/") + "/metadata", tls)


def register_cli(sub) -> None:
    from tools.cli import _client_args

    topics = sub.add_parser("topics", help="create, delete and list topics")
    tsub = topics.add_subparsers(dest="topics_command", required=True)
    p = tsub.add_parser("create")
    _client_args(p)
    p.add_argument("name")
    p.add_argument("--partitions", type=int, default=1)
    p.add_argument("--replication-factor", type=int, default=1)
    p.set_defaults(func=lambda a: _run(a, "create_topic", name=a.name, partitions=a.partitions,
                                       replication_factor=a.replication_factor))
    p = tsub.add_parser("delete")
    _client_args(p)
    p.add_argument("name")
    p.set_defaults(func=lambda a: _run(a, "delete_topic", name=a.name))
    p = tsub.add_parser("list", help="topics and partitions from a broker's /metadata")
    p.add_argument("--admin", help="admin API URL (default: the client config's, e.g. https://127.0.0.1:10091)")
    from tools.cli import _credential_args

    _credential_args(p)
    p.set_defaults(func=_list_topics)

    brokers = sub.add_parser("brokers", help="register, fence, unfence, unregister brokers")
    bsub = brokers.add_subparsers(dest="brokers_command", required=True)
    p = bsub.add_parser("register")
    _client_args(p)
    p.add_argument("broker_id", type=int)
    p.add_argument("--endpoint", action="append", default=[], metavar="NAME:HOST:PORT")
    p.add_argument("--rack")
    p.set_defaults(func=lambda a: _run(a, "register_broker", broker_id=a.broker_id, rack=a.rack,
                                       endpoints=[_endpoint(e) for e in a.endpoint]))
    for verb in ("fence", "unfence", "unregister"):
        p = bsub.add_parser(verb)
        _client_args(p)
        p.add_argument("broker_id", type=int)
        p.set_defaults(func=lambda a, verb=verb: _run(a, f"{verb}_broker", broker_id=a.broker_id))

    configs = sub.add_parser("configs", help="set or delete topic and broker configs")
    csub = configs.add_subparsers(dest="configs_command", required=True)
    for verb in ("set", "delete"):
        p = csub.add_parser(verb)
        _client_args(p)
        target = p.add_mutually_exclusive_group(required=True)
        target.add_argument("--topic")
        target.add_argument("--broker", help="broker id, or '' for the cluster default")
        p.add_argument("key")
        if verb == "set":
            p.add_argument("value")
        p.set_defaults(func=lambda a, verb=verb: _run(
            a, "set_config",
            resource_type=RESOURCE_TOPIC if a.topic is not None else RESOURCE_BROKER,
            resource_name=a.topic if a.topic is not None else a.broker,
            name=a.key, value=a.value if verb == "set" else None))


def _endpoint(text: str) -> list:
    name, host, port = text.rsplit(":", 2)
    return [name, host, int(port)]


def _list_topics(args: argparse.Namespace) -> int:
    from tools.cli import client_settings

    cs = client_settings(args)
    admin = args.admin or cs["admin"] or ("http" if cs["tls"] is None else "https") + "://127.0.0.1:10091"
    args.admin = admin
    try:
        meta = _metadata(admin, cs["tls"])
    except OSError as exc:
        print(f"metalog: cannot read {args.admin}/metadata: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"offset": meta.get("offset"), "topics": meta.get("topics")}, indent=2))
    return 0
