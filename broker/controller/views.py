"""Read views of the controller state for the admin API: one topic, one
broker, and paged listings, each costing what it returns rather than the
size of the state.

At Kafka's headline scale (2 million partitions, 20,000 topics) the whole state
as JSON is hundreds of MB and seconds of CPU on the event loop, so no request
builds it: ``/metadata`` is a summary, a topic answers with its own partitions
and configs, listings are pages in a stable order with a ``next`` cursor
(topics by name, brokers by id, a topic's partitions by id, ACLs by id).
Every page is at most PAGE_LIMIT_MAX items, and so is every list inside an
answer (a topic's or a broker's configs: the rest through /metadata/configs).

Pure functions over a ``ControllerState`` (broker/controller/state.py), which keeps
the indexes they need, maintained as records are applied: each topic's
partition ids (broker/controller/partition_ids.py), each resource's config names, the
topic names and ACL ids, each sorted. A page costs O(log n + its items).

A view's partitions are ``PartitionView`` structs, not dicts: ``encode``
(msgspec) turns a view into JSON bytes about 10x faster than json.dumps, and
untracked structs give the cyclic GC nothing to count (a topic's answer
allocated 300 tracked dicts and lists before).
"""

from __future__ import annotations

import bisect
from typing import Any

import msgspec

from metalog.broker.controller import acl as authz
from metalog.storage import metadata_records as r

PAGE_LIMIT_DEFAULT = 100
PAGE_LIMIT_MAX = 1000

RESOURCE_NAMES = {r.RESOURCE_TOPIC: "topic", r.RESOURCE_BROKER: "broker"}


class PageError(ValueError):
    """A bad paging argument (the admin API answers 400 with the message)."""


class PartitionView(msgspec.Struct, frozen=True, gc=False):
    """One partition as the admin API shows it (JSON object, these keys)."""
    topic: str
    topic_id: str
    partition: int
    replicas: tuple[int, ...]
    isr: tuple[int, ...]
    leader: int
    leader_epoch: int
    partition_epoch: int


_encoder = msgspec.json.Encoder()


def encode(view: Any) -> bytes:
    """A view as JSON bytes (dicts, lists, PartitionView structs)."""
    return _encoder.encode(view)


def page_limit(text: str | None) -> int:
    if text is None or text == "":
        return PAGE_LIMIT_DEFAULT
    try:
        limit = int(text)
    except ValueError:
        raise PageError(f"limit must be an integer, got {text!r}") from None
    if not 1 <= limit <= PAGE_LIMIT_MAX:
        raise PageError(f"limit must be between 1 and {PAGE_LIMIT_MAX}, got {limit}")
    return limit


def int_cursor(text: str | None, name: str) -> int | None:
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise PageError(f"{name} must be an integer, got {text!r}") from None


def summary(state: Any) -> dict:
    """What GET /metadata answers: counts and where to page, never the whole state."""
    return {
        "offset": state.offset,
        "counts": {"brokers": len(state.brokers), "topics": len(state.topics),
                   "partitions": len(state.partitions), "configs": len(state.configs),
                   "acls": len(state.acls)},
        "features": dict(sorted(state.features.items())),
        "next_producer_id": state.next_producer_id,  # of Kafka brokers' blocks (producer_blocks)
        "paths": ["/metadata/brokers", "/metadata/brokers/{id}", "/metadata/topics",
                  "/metadata/topics/{name}", "/metadata/topics/{name}/partitions", "/metadata/acls",
                  "/metadata/configs?type=topic|broker&name=NAME"],
    }


def state_json(state: Any) -> dict:
    """The whole state as one dict (`offset` is the next offset reflected),
    for tests and tools on small states (``ControllerState.to_json``): the
    admin API never builds it, it serves the pages below."""
    topic_ids, topics = state.topic_ids, state.topics
    partitions = []
    for (tid, pid) in sorted(state.partitions, key=lambda k: (topics[k[0]].name, k[1])):
        p = state.partitions[(tid, pid)]
        partitions.append({
            "topic": topics[tid].name, "topic_id": tid, "partition": pid,
            "replicas": list(p.replicas), "isr": list(p.isr), "leader": p.leader,
            "leader_epoch": p.leader_epoch, "partition_epoch": p.partition_epoch,
        })
    return {
        "offset": state.offset,
        "brokers": [broker_json(state.brokers[bid]) for bid in sorted(state.brokers)],
        "topics": [{"name": name, "topic_id": topic_ids[name], "partitions": partition_count(state, topic_ids[name])}
                   for name in sorted(topic_ids)],
        "partitions": partitions,
        "configs": [{"resource_type": rt, "resource_name": rn, "name": n, "value": state.configs[(rt, rn, n)]}
                    for (rt, rn, n) in sorted(state.configs)],
        "features": dict(sorted(state.features.items())),
        "acls": [authz.acl_to_dict(state.acls[i]) for i in sorted(state.acls)],
    }


def broker_json(br: r.RegisterBroker) -> dict:
    return {"broker_id": br.broker_id, "incarnation_id": br.incarnation_id,
            "broker_epoch": br.broker_epoch, "rack": br.rack, "fenced": br.fenced,
            "endpoints": [{"name": e.name, "host": e.host, "port": e.port} for e in br.endpoints]}


def configs_page(state: Any, resource_type: int, resource_name: str, after: str | None = None,
                 limit: int = PAGE_LIMIT_MAX) -> tuple[dict[str, str], str | None]:
    """A resource's configs by name after `after`, at most `limit`, and the
    cursor of the next page (None: this is the last)."""
    names = state.config_names.get((resource_type, resource_name), ())
    start = 0 if after is None else bisect.bisect_right(names, after)
    chunk = names[start:start + limit]
    more = start + limit < len(names)
    configs = state.configs
    return ({n: configs[(resource_type, resource_name, n)] for n in chunk},
            chunk[-1] if more and chunk else None)


def resource_configs(state: Any, resource_type: int, resource_name: str) -> dict[str, str]:
    """Every config of one resource (for callers on small states and tests;
    the admin API pages them with configs_page)."""
    names = state.config_names.get((resource_type, resource_name), ())
    return {n: state.configs[(resource_type, resource_name, n)] for n in names}


def broker(state: Any, broker_id: int) -> dict | None:
    """One broker: its registration and its first PAGE_LIMIT_MAX configs
    (``next_config``: where /metadata/configs goes on; None: unknown broker)."""
    br = state.brokers.get(broker_id)
    if br is None:
        return None
    out = broker_json(br)
    out["configs"], out["next_config"] = configs_page(state, r.RESOURCE_BROKER, str(broker_id))
    return out


def brokers_page(state: Any, after: int | None, limit: int) -> dict:
    ids = sorted(state.brokers)  # hundreds at most: sorting is cheaper than an index
    start = 0 if after is None else bisect.bisect_right(ids, after)
    chunk = ids[start:start + limit]
    more = start + limit < len(ids)
    return {"offset": state.offset, "brokers": [broker_json(state.brokers[i]) for i in chunk],
            "next": chunk[-1] if more and chunk else None}


def partition_count(state: Any, topic_id: str) -> int:
    return len(state.partition_ids(topic_id))


def topic(state: Any, name: str, partitions_limit: int = PAGE_LIMIT_MAX) -> dict | None:
    """One topic: id, partition count, its first PAGE_LIMIT_MAX configs and
    its first partitions (all of them up to `partitions_limit`); the cursors
    ``next_config`` and ``next_partition`` say where the rest go on."""
    tid = state.topic_ids.get(name)
    if tid is None:
        return None
    page = partitions_page(state, name, None, partitions_limit)
    configs, next_config = configs_page(state, r.RESOURCE_TOPIC, name)
    return {"offset": state.offset, "name": name, "topic_id": tid,
            "partition_count": partition_count(state, tid),
            "configs": configs, "next_config": next_config,
            "partitions": page["partitions"], "next_partition": page["next"]}


def topics_page(state: Any, after: str | None, limit: int) -> dict:
    names = state.sorted_topic_names()
    start = 0 if after is None else bisect.bisect_right(names, after)
    chunk = names[start:start + limit]
    more = start + limit < len(names)
    topics = [{"name": n, "topic_id": state.topic_ids[n],
               "partitions": partition_count(state, state.topic_ids[n])} for n in chunk]
    return {"offset": state.offset, "topics": topics, "next": chunk[-1] if more and chunk else None}


def partitions_page(state: Any, name: str, after: int | None, limit: int) -> dict:
    """A topic's partitions by id after `after` (KeyError: unknown topic)."""
    tid = state.topic_ids[name]
    ids = state.partition_ids(tid)
    start = 0 if after is None else bisect.bisect_right(ids, after)
    chunk = ids[start:start + limit]
    more = start + limit < len(ids)
    out = [PartitionView(name, tid, p.partition_id, p.replicas, p.isr, p.leader, p.leader_epoch, p.partition_epoch)
           for p in state.partitions.ordered(tid, chunk)]  # one struct per partition, nothing else
    return {"offset": state.offset, "topic": name, "partitions": out,
            "next": chunk[-1] if more and out else None}


def acls_page(state: Any, after: str | None, limit: int) -> dict:
    ids = state.sorted_acl_ids()
    start = 0 if after is None else bisect.bisect_right(ids, after)
    chunk = ids[start:start + limit]
    more = start + limit < len(ids)
    return {"offset": state.offset, "acls": [authz.acl_to_dict(state.acls[i]) for i in chunk],
            "next": chunk[-1] if more and chunk else None}
