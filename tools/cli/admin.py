"""CLI for controller commands and state:

    metalog topics create NAME --partitions 3 --replication-factor 3
    metalog topics delete NAME
    metalog topics list [--admin https://127.0.0.1:10091]
    metalog brokers register ID [--endpoint NAME:HOST:PORT] [--rack R]
    metalog brokers fence|unfence|unregister ID
    metalog configs set  --topic NAME | --broker ID  KEY VALUE
    metalog configs delete --topic NAME | --broker ID  KEY
    metalog acls add|remove --allow-principal User:alice --operation Write --topic __cluster_metadata
    metalog acls add --deny-principal User:bob --operation All --cluster
    metalog acls list [-o json]

An authorization refusal is one line on stderr (``metalog: error: not
authorized: ...``) and exit code 3; other refusals exit 1.

Writes go to the leader over Kafka's protocol (our ControllerCommand extension) and
return once committed; reads come from a broker's admin API (/metadata/...),
one topic or broker at a time or page by page.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
import urllib.error
import urllib.parse

from metalog.broker.client import AuthorizationError, ClusterUnavailable, MetalogError
from metalog.broker.client.config import admin_get
from metalog.storage.metadata_records import RESOURCE_BROKER, RESOURCE_TOPIC
from metalog.tools.cli.client_options import add_client_args, add_credential_args, client_settings, make_client


EXIT_NOT_AUTHORIZED = 3


def _run(args, command: str, **cmd_args) -> int:
    async def go() -> int:
        client = make_client(args)
        try:
            offset, epoch = await client.command(command, **cmd_args)
        except AuthorizationError as exc:
            print(f"metalog: error: {exc}", file=sys.stderr)
            return EXIT_NOT_AUTHORIZED
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


def _admin_read(args, path: str) -> tuple[int, dict | None]:
    """GET an admin API path with the client config's certificate: (0, body)
    or (exit code, None) after one line on stderr (404: the name is unknown)."""
    cs = client_settings(args)
    admin = args.admin or cs["admin"] or ("http" if cs["tls"] is None else "https") + "://127.0.0.1:10091"
    url = admin.rstrip("/") + path
    try:
        return 0, admin_get(url, cs["tls"])
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read()).get("message", exc.reason)
        except ValueError:
            message = exc.reason
        print(f"metalog: {url}: {message}", file=sys.stderr)
        return 1, None
    except OSError as exc:
        print(f"metalog: cannot read {url}: {exc}", file=sys.stderr)
        return 1, None


def _list_pages(args, path: str, key: str) -> int:
    """Print a paged listing as JSON lines, one item each: one page of
    --limit items after --after, or every page with --all."""
    after = args.after
    while True:
        query = {"limit": args.limit} | ({} if after is None else {"after": after})
        rc, page = _admin_read(args, f"{path}?{urllib.parse.urlencode(query)}")
        if page is None:
            return rc
        for item in page[key]:
            print(json.dumps(item))
        after = page["next"]
        if after is None or not args.all:
            if after is not None:
                print(f"metalog: more after {after!r}: --after {shlex.quote(str(after))} or --all",
                      file=sys.stderr)
            return 0


def _read_args(p, listing: bool = False) -> None:
    p.add_argument("--admin", help="admin API URL (default: the client config's, e.g. https://127.0.0.1:10091)")
    add_credential_args(p)
    if listing:
        p.add_argument("--after", help="start after this name / id (the 'next' of the previous page)")
        p.add_argument("--limit", type=int, default=100, help="items per page (1..1000, default 100)")
        p.add_argument("--all", action="store_true", help="every page, not just one")


def register_cli(sub) -> None:
    topics = sub.add_parser("topics", help="create, delete and list topics")
    tsub = topics.add_subparsers(dest="topics_command", required=True)
    p = tsub.add_parser("create")
    add_client_args(p)
    p.add_argument("name")
    p.add_argument("--partitions", type=int, default=1)
    p.add_argument("--replication-factor", type=int, default=1)
    p.set_defaults(func=lambda a: _run(a, "create_topic", name=a.name, partitions=a.partitions,
                                       replication_factor=a.replication_factor))
    p = tsub.add_parser("delete")
    add_client_args(p)
    p.add_argument("name")
    p.set_defaults(func=lambda a: _run(a, "delete_topic", name=a.name))
    p = tsub.add_parser("list", help="topics by name with their partition counts, one JSON line each (paged)")
    _read_args(p, listing=True)
    p.set_defaults(func=lambda a: _list_pages(a, "/metadata/topics", "topics"))
    p = tsub.add_parser("describe", help="one topic: id, configs and partitions (leader, ISR, replicas)")
    _read_args(p)
    p.add_argument("name")
    p.set_defaults(func=_describe_topic)

    brokers = sub.add_parser("brokers", help="register, fence, unfence, unregister brokers")
    bsub = brokers.add_subparsers(dest="brokers_command", required=True)
    p = bsub.add_parser("register")
    add_client_args(p)
    p.add_argument("broker_id", type=int)
    p.add_argument("--endpoint", action="append", default=[], metavar="NAME:HOST:PORT")
    p.add_argument("--rack")
    p.set_defaults(func=lambda a: _run(a, "register_broker", broker_id=a.broker_id, rack=a.rack,
                                       endpoints=[_endpoint(e) for e in a.endpoint]))
    p = bsub.add_parser("list", help="registered brokers by id, one JSON line each (paged)")
    _read_args(p, listing=True)
    p.set_defaults(func=lambda a: _list_pages(a, "/metadata/brokers", "brokers"))
    p = bsub.add_parser("describe", help="one broker: registration, fenced or not, configs")
    _read_args(p)
    p.add_argument("broker_id", type=int)
    p.set_defaults(func=_describe_broker)
    for verb in ("fence", "unfence", "unregister"):
        p = bsub.add_parser(verb)
        add_client_args(p)
        p.add_argument("broker_id", type=int)
        p.set_defaults(func=lambda a, verb=verb: _run(a, f"{verb}_broker", broker_id=a.broker_id))

    _register_acls(sub)

    configs = sub.add_parser("configs", help="set or delete topic and broker configs")
    csub = configs.add_subparsers(dest="configs_command", required=True)
    for verb in ("set", "delete"):
        p = csub.add_parser(verb)
        add_client_args(p)
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


def _register_acls(sub) -> None:
    acls = sub.add_parser("acls", help="add, remove and list ACLs (Kafka's model; default deny)")
    asub = acls.add_subparsers(dest="acls_command", required=True)
    for verb in ("add", "remove"):
        p = asub.add_parser(verb, help=f"{verb} one ACL per principal x operation")
        add_client_args(p)
        p.add_argument("--allow-principal", action="append", default=[], metavar="User:NAME")
        p.add_argument("--deny-principal", action="append", default=[], metavar="User:NAME")
        p.add_argument("--operation", action="append", required=True,
                       help="All, Read, Write, Alter, Describe, ... (repeatable)")
        p.add_argument("--host", default="*", help="the client address the ACL applies to (default any)")
        target = p.add_mutually_exclusive_group(required=True)
        target.add_argument("--topic", help="a topic name (the metadata log is __cluster_metadata)")
        target.add_argument("--cluster", action="store_true", help="the cluster resource")
        p.add_argument("--resource-pattern-type", choices=["literal", "prefixed"], default="literal")
        p.set_defaults(func=lambda a, verb=verb: _acls_change(a, verb))
    p = asub.add_parser("list", help="every ACL, one line each")
    add_client_args(p)
    p.add_argument("-o", "--output", choices=["text", "json"], default="text")
    p.set_defaults(func=_acls_list)


def _acls_change(args, verb: str) -> int:
    entries = [(p, "Allow") for p in args.allow_principal] + [(p, "Deny") for p in args.deny_principal]
    if not entries:
        print("metalog: error: name at least one --allow-principal or --deny-principal", file=sys.stderr)
        return 2
    rc = 0
    for principal, permission in entries:
        for operation in args.operation:
            rc = _run(args, f"{verb}_acl", principal=principal, permission=permission, operation=operation,
                      host=args.host, resource_type="cluster" if args.cluster else "topic",
                      resource_name="kafka-cluster" if args.cluster else args.topic,
                      pattern_type=args.resource_pattern_type)
            if rc:
                return rc
    return rc


def _acls_list(args) -> int:
    async def go() -> int:
        client = make_client(args)
        try:
            acls = await client.list_acls()
        except AuthorizationError as exc:
            print(f"metalog: error: {exc}", file=sys.stderr)
            return EXIT_NOT_AUTHORIZED
        except (MetalogError, ClusterUnavailable) as exc:
            print(f"metalog: list_acls failed: {exc}", file=sys.stderr)
            return 1
        finally:
            await client.close()
        for acl in acls:
            if args.output == "json":
                print(json.dumps(acl))
            else:
                print(f"{acl['principal']} {acl['permission']} {acl['operation']} from {acl['host']} on "
                      f"{acl['resource_type']}:{acl['pattern_type']}:{acl['resource_name']}")
        return 0

    return asyncio.run(go())


def _endpoint(text: str) -> list:
    name, host, port = text.rsplit(":", 2)
    return [name, host, int(port)]


def _rest_of_configs(args, body: dict, kind: str, name: str) -> int:
    """Append to body["configs"] the pages after its first (a topic or broker
    answer holds 1000 configs and a "next_config" cursor)."""
    after = body.pop("next_config", None)
    while after is not None:
        query = urllib.parse.urlencode({"type": kind, "name": name, "limit": 1000, "after": after})
        rc, page = _admin_read(args, f"/metadata/configs?{query}")
        if page is None:
            return rc
        body["configs"].update(page["configs"])
        after = page["next"]
    return 0


def _describe_broker(args) -> int:
    rc, body = _admin_read(args, f"/metadata/brokers/{args.broker_id}")
    if body is None:
        return rc
    rc = _rest_of_configs(args, body, "broker", str(args.broker_id))
    if rc == 0:
        print(json.dumps(body, indent=2))
    return rc


def _describe_topic(args) -> int:
    """The topic with every partition and config (a topic's answer holds the
    first 1000 of each; the rest are read page by page)."""
    name = urllib.parse.quote(args.name, safe="")
    rc, body = _admin_read(args, f"/metadata/topics/{name}")
    if body is None:
        return rc
    after = body.pop("next_partition")
    while after is not None:
        rc, page = _admin_read(args, f"/metadata/topics/{name}/partitions?limit=1000&after={after}")
        if page is None:
            return rc
        body["partitions"] += page["partitions"]
        after = page["next"]
    rc = _rest_of_configs(args, body, "topic", args.name)
    if rc == 0:
        print(json.dumps(body, indent=2))
    return rc