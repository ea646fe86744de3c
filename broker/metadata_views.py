"""Read views of the controller state for the admin API: one topic, one
broker, and paged listings, each costing what it returns rather than the
size of the state.

At Kafka's headline scale (2 million partitions, 20,000 topics) the whole state
as JSON is hundreds of MB and seconds of CPU on the event loop, so no request
builds it: ``/metadata`` is a summary, a topic answers with its own partitions
and configs, listings are pages in a stable order with a ``next`` cursor
(topics by name, brokers by id, a topic's partitions by id, ACLs by id).
Every page is at most PAGE_LIMIT_MAX items.

Pure functions over a ``ControllerState`` (broker/controller.py), which keeps
the indexes they need (partition counts per topic, config names per resource,
a version of the set of topic names).
"""

from __future__ import annotations

import bisect
from typing import Any

from broker import authz
from storage import metadata_records as r

PAGE_LIMIT_DEFAULT = 100
PAGE_LIMIT_MAX = 1000

RESOURCE_NAMES = {r.RESOURCE_TOPIC: "topic", r.RESOURCE_BROKER: "broker"}


class PageError(ValueError):
    """A bad paging argument (the admin API answers 400 with the message)."""


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
        "paths": ["/metadata/brokers", "/metadata/brokers/{id}", "/metadata/topics",
                  "/metadata/topics/{name}", "/metadata/topics/{name}/partitions", "/metadata/acls",
                  "/metadata/configs?type=topic|broker&name=NAME"],
    }


def broker_json(br: r.RegisterBroker) -> dict:
    return {"broker_id": br.broker_id, "incarnation_id": br.incarnation_id,
            "broker_epoch": br.broker_epoch, "rack": br.rack, "fenced": br.fenced,
            "endpoints": [{"name": e.name, "host": e.host, "port": e.port} for e in br.endpoints]}


def partition_json(name: str, p: r.Partition) -> dict:
    return {"topic": name, "topic_id": p.topic_id, "partition": p.partition_id,
            "replicas": list(p.replicas), "isr": list(p.isr), "leader": p.leader,
            "leader_epoch": p.leader_epoch, "partition_epoch": p.partition_epoch}


def resource_configs(state: Any, resource_type: int, resource_name: str) -> dict[str, str]:
    names = state.config_names.get((resource_type, resource_name), ())
    return {n: state.configs[(resource_type, resource_name, n)] for n in sorted(names)}


def broker(state: Any, broker_id: int) -> dict | None:
    """One broker: its registration and its configs (None: unknown)."""
    br = state.brokers.get(broker_id)
    if br is None:
        return None
    out = broker_json(br)
    out["configs"] = resource_configs(state, r.RESOURCE_BROKER, str(broker_id))
    return out


def brokers_page(state: Any, after: int | None, limit: int) -> dict:
    ids = sorted(state.brokers)  # hundreds at most: sorting is cheaper than an index
    start = 0 if after is None else bisect.bisect_right(ids, after)
    chunk = ids[start:start + limit]
    more = start + limit < len(ids)
    return {"offset": state.offset, "brokers": [broker_json(state.brokers[i]) for i in chunk],
            "next": chunk[-1] if more and chunk else None}


def partition_count(state: Any, topic_id: str) -> int:
    return state.partition_counts.get(topic_id, 0)


def topic(state: Any, name: str, partitions_limit: int = PAGE_LIMIT_MAX) -> dict | None:
    """One topic: id, partition count, its configs and its first partitions
    (all of them up to `partitions_limit`; page the rest)."""
    tid = state.topic_ids.get(name)
    if tid is None:
        return None
    page = partitions_page(state, name, None, partitions_limit)
    return {"offset": state.offset, "name": name, "topic_id": tid,
            "partition_count": partition_count(state, tid),
            "configs": resource_configs(state, r.RESOURCE_TOPIC, name),
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
    """A topic's partitions by id (KeyError: unknown topic)."""
    tid = state.topic_ids[name]
    count = partition_count(state, tid)
    first = 0 if after is None else max(0, after + 1)
    out = []
    pid = first
    while pid < count and len(out) < limit:
        p = state.partitions.get((tid, pid))
        if p is not None:
            out.append(partition_json(name, p))
        pid += 1
    more = any((tid, q) in state.partitions for q in range(pid, count))
    return {"offset": state.offset, "topic": name, "partitions": out,
            "next": out[-1]["partition"] if more and out else None}


def acls_page(state: Any, after: str | None, limit: int) -> dict:
    ids = sorted(state.acls)
    start = 0 if after is None else bisect.bisect_right(ids, after)
    chunk = ids[start:start + limit]
    more = start + limit < len(ids)
    return {"offset": state.offset, "acls": [authz.acl_to_dict(state.acls[i]) for i in chunk],
            "next": chunk[-1] if more and chunk else None}
