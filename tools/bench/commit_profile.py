"""``metalog bench --profile-commit``: where the time of one commit goes.

One client writes one record at a time to a 3-voter TLS cluster whose brokers
record commit-path timestamps (metalog.broker.server.commit_trace, turned on through the
environment for this cluster only). Every write is then followed through the
brokers' marks by its offset:

    client send -> leader reads the Produce -> leader appended -> [leader
    fsync done, in parallel] -> leader wrote the Fetch answer -> follower
    read it -> follower appended -> follower fsync done -> follower wrote its
    next Fetch -> leader read that Fetch -> HW advanced -> leader wrote the
    Produce answer -> client read it

and the table gives p50 and p99 of each stage (the follower whose Fetch
advanced the HW first is the one followed). All marks are
``time.monotonic_ns()``, one clock for every process on the machine.

A second table gives the Kafka codec's cost per request (issue 32 item 8):
the brokers time every decode and encode of a frame while they trace
(``metalog.broker.net.codec_clock``), and the rows the commit path goes
through are summed into the codec's share of one commit.
"""

from __future__ import annotations

import bisect
import glob
import os
from collections import defaultdict
from typing import Any

from metalog.broker.net import codec_clock as cc
from metalog.broker.server.commit_trace import load, load_codec
from metalog.protocol.apis import ApiKey

# The first writes warm connections and caches up: not part of the figures.
SKIP_FIRST_OPS = 50

STAGES = [
    ("client send -> leader read Produce", "send", "recv"),
    ("leader read -> appended (page cache)", "recv", "append"),
    ("appended -> leader fsync done", "append", "leader_flush"),
    ("appended -> Fetch answer written", "append", "fetch_answer"),
    ("Fetch answer -> follower read it", "fetch_answer", "f_resp"),
    ("follower read -> appended", "f_resp", "f_append"),
    ("follower appended -> fsync done", "f_append", "f_flush"),
    ("follower fsync -> next Fetch asked", "f_flush", "f_fetch_action"),
    ("Fetch asked -> written on socket", "f_fetch_action", "f_fetch_sent"),
    ("next Fetch written -> leader read it", "f_fetch_sent", "fetch_recv"),
    ("leader read Fetch -> HW advanced", "fetch_recv", "hw"),
    ("HW advanced -> Produce answer written", "hw", "reply"),
    ("Produce answer -> client read it", "reply", "client_recv"),
    ("total (client send -> answer)", "send", "client_recv"),
]


# Rows of the codec table for frames seen fewer times (elections, a client's
# first requests) are left out of the printed table, not out of the JSON.
CODEC_ROW_COUNT_MIN = 10

# The codec's work on one commit's path, one frame each: (whose, operation, api).
# The leader reads the Produce and one replica's Fetch and writes their
# answers; that follower reads the Fetch answer and writes its next Fetch.
CODEC_PATH = [
    ("leader", cc.DECODE_REQUEST, ApiKey.PRODUCE),
    ("leader", cc.ENCODE_RESPONSE, ApiKey.FETCH),
    ("follower", cc.DECODE_RESPONSE, ApiKey.FETCH),
    ("follower", cc.ENCODE_REQUEST, ApiKey.FETCH),
    ("leader", cc.DECODE_REQUEST, ApiKey.FETCH),
    ("leader", cc.ENCODE_RESPONSE, ApiKey.PRODUCE),
]


class _Series:
    """One node's marks of one event: times ascending, each with its offset."""

    def __init__(self) -> None:
        self.ns: list[int] = []
        self.offsets: list[int] = []
        self.peers: list[int] = []

    def first_at_least(self, offset: int, after_ns: int, peer: int | None = None) -> int | None:
        """The first mark at or after `after_ns` whose offset is >= `offset`."""
        i = bisect.bisect_left(self.ns, after_ns)
        while i < len(self.ns):
            if self.offsets[i] >= offset and (peer is None or self.peers[i] == peer):
                return self.ns[i]
            i += 1
        return None

    def last_before(self, before_ns: int, after_ns: int) -> int | None:
        i = bisect.bisect_right(self.ns, before_ns) - 1
        if i >= 0 and self.ns[i] >= after_ns:
            return self.ns[i]
        return None


def _index(marks) -> dict[str, _Series]:
    out: dict[str, _Series] = defaultdict(_Series)
    for ns, event, offset, peer in sorted(marks):
        s = out[event]
        s.ns.append(ns)
        s.offsets.append(offset)
        s.peers.append(peer)
    return out


def follow(trace_dir: str, ops: list) -> dict[str, Any]:
    """Stage durations (µs) per write, from the node traces in `trace_dir`
    and the client's (send ns, answer ns, base offset) per write."""
    nodes: dict[int, dict[str, _Series]] = {}
    for path in glob.glob(os.path.join(trace_dir, "node-*.json")):
        nid = _node_id(path)
        nodes[nid] = _index(load(path))
    leaders = [nid for nid, ev in nodes.items() if ev["produce_reply"].ns]
    if len(leaders) != 1:
        raise RuntimeError(f"expected one leader answering produces in the trace, found {leaders}")
    leader = leaders[0]
    L = nodes[leader]
    durations: dict[str, list[int]] = defaultdict(list)
    followed = skipped = 0
    leader_fsync_last = 0
    for send_ns, recv_ns, base in ops[SKIP_FIRST_OPS:]:
        end = base + 1
        t: dict[str, int | None] = {"send": send_ns, "client_recv": recv_ns}
        t["append"] = L["append"].first_at_least(end, send_ns)
        if t["append"] is None:
            skipped += 1
            continue
        t["recv"] = L["produce_recv"].last_before(t["append"], send_ns)
        t["leader_flush"] = L["flush_done"].first_at_least(end, t["append"])
        t["hw"] = L["hw"].first_at_least(end, t["append"])
        t["reply"] = L["produce_reply"].first_at_least(base, t["append"])
        best = None
        for nid, F in nodes.items():
            if nid == leader:
                continue
            fetch_recv = L["fetch_recv"].first_at_least(end, t["append"], peer=nid)
            if fetch_recv is not None and (best is None or fetch_recv < best[1]):
                best = (nid, fetch_recv)
        if best is None:
            skipped += 1
            continue
        nid, t["fetch_recv"] = best
        F = nodes[nid]
        t["fetch_answer"] = L["fetch_answer"].first_at_least(end, t["append"], peer=nid)
        t["f_resp"] = F["fetch_resp"].first_at_least(end, send_ns)
        t["f_append"] = F["append"].first_at_least(end, send_ns)
        t["f_flush"] = F["flush_done"].first_at_least(end, send_ns)
        t["f_fetch_action"] = F["fetch_action"].first_at_least(end, send_ns)
        t["f_fetch_sent"] = F["fetch_sent"].first_at_least(end, send_ns)
        if any(v is None for v in t.values()):
            skipped += 1
            continue
        followed += 1
        if t["leader_flush"] >= t["fetch_recv"]:
            leader_fsync_last += 1  # the leader's own fsync, not the follower, held the HW
        for name, a, b in STAGES:
            durations[name].append((t[b] - t[a]) // 1000)
    return {"leader": leader, "followed": followed, "skipped": skipped,
            "leader_fsync_on_critical_path": leader_fsync_last, "durations_us": dict(durations),
            "codec_ns": _codec(trace_dir, leader)}


def _node_id(path: str) -> int:
    """The node of a trace file, node-<id>.json."""
    return int(os.path.basename(path)[len("node-"):-len(".json")])


def _codec(trace_dir: str, leader: int) -> dict[tuple[str, str, int], list[int]]:
    """Codec durations (ns) by (leader|follower, operation, api key), the followers' pooled."""
    out: dict[tuple[str, str, int], list[int]] = defaultdict(list)
    for path in glob.glob(os.path.join(trace_dir, "node-*.json")):
        whose = "leader" if _node_id(path) == leader else "follower"
        for (op, api_key), durations in load_codec(path).items():
            out[(whose, op, api_key)].extend(durations)
    return dict(out)


def summarize_codec(followed: dict[str, Any]) -> dict[str, Any]:
    """Per (whose, operation, api): count and p50/p99 µs (one decimal); and the
    p50s of CODEC_PATH summed: the codec's time in one commit."""
    rows = []
    for (whose, op, api_key), ns in sorted(followed.get("codec_ns", {}).items()):
        rows.append({"node": whose, "op": op, "api": _api_name(api_key), "api_key": api_key, "count": len(ns),
                     "p50_us": round(_pct(ns, 50) / 1000, 1), "p99_us": round(_pct(ns, 99) / 1000, 1)})
    by_key = {(r["node"], r["op"], r["api_key"]): r for r in rows}
    path = [by_key.get((whose, op, int(api))) for whose, op, api in CODEC_PATH]
    per_commit = round(sum(r["p50_us"] for r in path), 1) if all(path) else None
    return {"rows": rows, "per_commit_p50_us": per_commit}


def _api_name(api_key: int) -> str:
    try:
        return ApiKey(api_key).name.title().replace("_", "")
    except ValueError:
        return f"api {api_key}"


def _pct(vals: list[int], q: float) -> int:
    vals = sorted(vals)
    return vals[min(len(vals) - 1, max(0, -(-len(vals) * q // 100) - 1))] if vals else -1


def summarize(followed: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for name, _a, _b in STAGES:
        vals = followed["durations_us"].get(name, [])
        rows.append({"stage": name, "p50_us": _pct(vals, 50), "p99_us": _pct(vals, 99)})
    return rows


def format_profile(followed: dict[str, Any]) -> str:
    lines = [f"commit profile: {followed['followed']} writes followed ({followed['skipped']} not matched), "
             f"leader node {followed['leader']}; the leader's own fsync ended after the follower's Fetch in "
             f"{followed['leader_fsync_on_critical_path']} of them",
             f"{'stage':40}  {'p50 us':>8}  {'p99 us':>8}"]
    for row in summarize(followed):
        lines.append(f"{row['stage']:40}  {row['p50_us']:>8}  {row['p99_us']:>8}")
    codec = summarize_codec(followed)
    if codec["rows"]:
        lines.append("")
        lines.append(f"{'Kafka codec, per frame':40}  {'count':>8}  {'p50 us':>8}  {'p99 us':>8}")
        rare = 0
        for r in codec["rows"]:
            if r["count"] < CODEC_ROW_COUNT_MIN:
                rare += 1
                continue
            name = f"{r['node']} {r['op']} {r['api']}"
            lines.append(f"{name:40}  {r['count']:>8}  {r['p50_us']:>8}  {r['p99_us']:>8}")
        if rare:
            lines.append(f"({rare} rows of frames seen fewer than {CODEC_ROW_COUNT_MIN} times, the election's and "
                         f"the client's first requests, are in the JSON report only)")
        if codec["per_commit_p50_us"] is not None:
            lines.append(f"the codec on one commit's path (the six p50s it goes through): "
                         f"{codec['per_commit_p50_us']} us")
    return "\n".join(lines)
