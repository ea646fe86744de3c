"""The drill's network faults, on real network namespaces (nftables, tc) or on the fault proxy.

Both implement ``NetworkFaults``: ``isolate``, ``block`` (one direction),
``partition``, ``heal`` and ``counters`` (what the faults dropped so far,
read before ``heal``). ``NetnsFaults`` adds the packet-level faults only a
kernel can give: random loss on one link (``numgen random mod 100 < N``), a
bandwidth cap (a tc token bucket on the node's egress) and an MTU black hole
(every packet over ``MTU_BLACKHOLE_BYTES`` dropped: small requests pass,
large Fetch answers and TLS handshakes stall).

On namespaces every fault is an nftables table ``inet mlg_fault`` inside the
node's namespace, rewritten whole at each change and deleted at heal. Packets
are dropped, never rejected: a cut-off peer's TCP connections stay open and
silent, as behind a dead switch port. Traffic to and from a node's admin port
is exempt: the drill's monitor reads every broker's /quorum over it (its
management network) to verify that a fault took effect -- e.g. that an
isolated leader commits nothing while it is cut off.

``apply(kind, ...)`` injects one fault of the drill's schedule and returns
what it did (for the report and the verification).
"""

from __future__ import annotations

import json
from typing import Protocol

from metalog.tools.cluster.netns import NetnsError, NetnsHosts

TABLE = "mlg_fault"
MTU_BLACKHOLE_BYTES = 1200
BANDWIDTH_CAP = "200kbit"  # the leader's egress (replication and client answers share it): below the drill's least load
LOSS_PCT = {"loss_10": 10, "loss_30": 30}
# Faults of the network: the proxy has the first three, namespaces all of them.
PROXY_NET_FAULTS = ("isolate_leader", "cut_one_way", "split_majority")
PACKET_FAULTS = ("loss_10", "loss_30", "bandwidth_cap", "mtu_blackhole")
NET_FAULTS = PROXY_NET_FAULTS + PACKET_FAULTS
# Faults on the link between the leader and one follower (the last two: compound faults, see
# metalog.tools.drill.compound; the drill draws the follower for them too).
LINK_FAULTS = ("cut_one_way", "loss_10", "loss_30", "pause_under_loss", "wipe_under_cut")


class NetworkFaults(Protocol):
    name: str

    def isolate(self, node: int) -> None: ...

    def block(self, a: int, b: int) -> None: ...

    def partition(self, groups: list[set[int]]) -> None: ...

    def heal(self) -> None: ...

    def counters(self) -> dict[str, int]: ...


class ProxyFaults:
    """The user-space proxy's faults (where namespaces cannot be made). KIP-853 leader endpoints
    let followers dial the leader's real address, around the proxy: the drill's verification
    finds out when such a fault did nothing."""

    name = "proxy"

    def __init__(self, proxy):
        self.proxy = proxy

    def isolate(self, node: int) -> None:
        self.proxy.isolate(node)

    def block(self, a: int, b: int) -> None:
        self.proxy.block(a, b)

    def partition(self, groups: list[set[int]]) -> None:
        self.proxy.partition(groups)

    def heal(self) -> None:
        self.proxy.heal()

    def counters(self) -> dict[str, int]:
        return {"dropped_bytes": self.proxy.dropped_bytes, "forwarded_bytes": self.proxy.forwarded_bytes}


class NetnsFaults:
    """Faults as nftables rules and tc qdiscs inside the brokers' namespaces."""

    name = "netns"

    def __init__(self, hosts: NetnsHosts, admin_ports: dict[int, int]):
        self.hosts = hosts
        self.admin_ports = admin_ports
        self._rules: dict[int, list[tuple[str, str]]] = {}  # node -> [(chain, rule)]
        self._shaped: set[int] = set()
        self.events: list[str] = []

    # ------------------------------------------------------------ rules
    def _add(self, node: int, rules: list[tuple[str, str]]) -> None:
        mine = self._rules.setdefault(node, [])
        mine += rules
        port = self.admin_ports[node]
        # The management exemption comes first: the monitor must see an isolated node's /quorum.
        text = (f"add table inet {TABLE}\ndelete table inet {TABLE}\ntable inet {TABLE} {{\n"
                f"  chain input {{ type filter hook input priority 0; policy accept;\n"
                f"    iifname \"eth0\" tcp dport {port} accept\n"
                + "".join(f"    {r}\n" for c, r in mine if c == "input")
                + f"  }}\n  chain output {{ type filter hook output priority 0; policy accept;\n"
                f"    oifname \"eth0\" tcp sport {port} accept\n"
                + "".join(f"    {r}\n" for c, r in mine if c == "output") + "  }\n}\n")
        self.hosts.run_in(node, ["nft", "-f", "-"], input_text=text)

    def _addrs(self, nodes) -> str:
        return "{ " + ", ".join(self.hosts.addr(n) for n in sorted(nodes)) + " }"

    def isolate(self, node: int) -> None:
        self.events.append(f"isolate {node}")
        self._add(node, [("input", 'iifname "eth0" counter drop'), ("output", 'oifname "eth0" counter drop')])

    def block(self, a: int, b: int) -> None:
        """Drop everything node a sends to node b (its requests and its answers)."""
        self.events.append(f"cut {a}->{b}")
        self._add(a, [("output", f"ip daddr {self.hosts.addr(b)} counter drop")])

    def partition(self, groups: list[set[int]]) -> None:
        self.events.append("partition " + "|".join(",".join(map(str, sorted(g))) for g in groups))
        for i, g in enumerate(groups):
            others = set().union(*(h for j, h in enumerate(groups) if j != i)) - g
            if not others:
                continue
            for n in g:
                self._add(n, [("input", f"ip saddr {self._addrs(others)} counter drop"),
                              ("output", f"ip daddr {self._addrs(others)} counter drop")])

    def loss(self, a: int, b: int, pct: int) -> None:
        """pct % of the packets on the link a <-> b lost, each way (counted at a)."""
        self.events.append(f"loss {pct}% {a}<->{b}")
        peer = self.hosts.addr(b)
        self._add(a, [("input", f"ip saddr {peer} counter numgen random mod 100 < {pct} counter drop"),
                      ("output", f"ip daddr {peer} counter numgen random mod 100 < {pct} counter drop")])

    def mtu_blackhole(self, node: int) -> None:
        self.events.append(f"mtu black hole {node}")
        self._add(node, [("input", f'iifname "eth0" counter meta length > {MTU_BLACKHOLE_BYTES} counter drop'),
                         ("output", f'oifname "eth0" counter meta length > {MTU_BLACKHOLE_BYTES} counter drop')])

    def bandwidth_cap(self, node: int) -> None:
        self.events.append(f"bandwidth cap {BANDWIDTH_CAP} {node}")
        self.hosts.run_in(node, ["tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", BANDWIDTH_CAP,
                                 "burst", "8kb", "latency", "300ms"])
        self._shaped.add(node)

    def heal(self) -> None:
        self.events.append("heal")
        for node in sorted(self._rules):
            self.hosts.run_in(node, ["nft", "delete", "table", "inet", TABLE], check=False)
        for node in sorted(self._shaped):
            self.hosts.run_in(node, ["tc", "qdisc", "del", "dev", "eth0", "root"], check=False)
        self._rules.clear()
        self._shaped.clear()

    # ------------------------------------------------------------ what the faults did
    def counters(self) -> dict[str, int]:
        """Since the last heal: packets/bytes dropped by the rules, packets that reached a
        rule's match (``matched_packets``: the counter before numgen / a length test), and
        the token bucket's ``overlimits`` (packets it had to hold back)."""
        out = {"dropped_packets": 0, "dropped_bytes": 0, "matched_packets": 0, "overlimits": 0}
        for node in sorted(self._rules):
            try:
                listing = json.loads(self.hosts.run_in(node, ["nft", "-j", "list", "table", "inet", TABLE]))
            except (NetnsError, ValueError):
                continue
            for item in listing.get("nftables", []):
                exprs = item.get("rule", {}).get("expr", [])
                counts = [e["counter"] for e in exprs if isinstance(e, dict) and "counter" in e]
                if not counts or not any(isinstance(e, dict) and "drop" in e for e in exprs):
                    continue
                out["dropped_packets"] += counts[-1]["packets"]
                out["dropped_bytes"] += counts[-1]["bytes"]
                if len(counts) > 1:
                    out["matched_packets"] += counts[0]["packets"]
        for node in sorted(self._shaped):
            try:
                qdiscs = json.loads(self.hosts.run_in(node, ["tc", "-s", "-j", "qdisc", "show", "dev", "eth0"]))
            except (NetnsError, ValueError):
                continue
            out["overlimits"] += sum(int(q.get("overlimits", 0)) for q in qdiscs if q.get("kind") == "tbf")
        return out


def apply(kind: str, net, leader: int, followers: list[int], observers: list[int], other: int | None) -> dict:
    """Inject one network fault (see ``NET_FAULTS``); the node it centres on is the leader,
    ``other`` the follower at the far end of a ``LINK_FAULTS`` link (the caller draws it, and
    waits until it can show the fault's effect). Returns the report's detail for it."""
    if kind in LINK_FAULTS and other not in followers:
        raise ValueError(f"{kind} needs a follower of leader {leader} at the far end, not {other}")
    if kind == "isolate_leader":
        net.isolate(leader)
        return {}
    if kind == "cut_one_way":
        net.block(leader, other)
        return {"to": other}
    if kind == "split_majority":
        minority = {leader, *observers}
        net.partition([minority, set(followers)])
        return {"groups": [sorted(minority), sorted(followers)]}
    if kind in LOSS_PCT:
        net.loss(leader, other, LOSS_PCT[kind])
        return {"link": [leader, other], "loss_pct": LOSS_PCT[kind]}
    if kind == "bandwidth_cap":
        net.bandwidth_cap(leader)
        return {"rate": BANDWIDTH_CAP}
    if kind == "mtu_blackhole":
        net.mtu_blackhole(leader)
        return {"drop_over_bytes": MTU_BLACKHOLE_BYTES}
    raise ValueError(f"not a network fault: {kind}")
