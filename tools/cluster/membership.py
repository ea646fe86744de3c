"""Voter changes on a local cluster (KIP-853): add a node, remove one.

``add_node`` starts a new broker whose data dir is formatted
``--no-initial-controllers``, waits until the leader sees it fetching as a
caught-up observer under its directory id, then sends AddRaftVoter. The new
node gets a Kafka listener as `cluster up`'s nodes do (base port + 2000 + i,
or a free port); the running nodes' ``kafka_endpoints`` do not name it, so
it advertises that listener in its voter-set entry (``kafka_in_voter_set``),
from where every node's Metadata reads it -- the way they learn its address.
``remove_node`` sends RemoveRaftVoter for the directory id the leader's
voter set holds, waits until a leader other than that node reports the
smaller set, then stops the node. Both record the change in the launcher's
``cluster.json`` so `metalog cluster status|restart ...` see it. Used by
`metalog cluster add-node|remove-node` (tools/cli/cluster.py), the
real-process tests and the drill.

Errors are ``MembershipError`` with one line for the user (the broker's own
refusals, DUPLICATE_VOTER, VOTER_NOT_FOUND ..., come as MetalogError).
"""

from __future__ import annotations

import asyncio
import os
import socket

from metalog.broker.client import MetalogClient, MetalogError
from metalog.broker.server.recovery import new_directory_id
from metalog.tools.cluster.launcher import LocalCluster, NodeSpec, free_ports

LISTENER_NAME = "CONTROLLER"  # the listener name a VotersRecord gives the local brokers' endpoint


class MembershipError(Exception):
    """A voter change the local cluster cannot make, said in one line."""


def leader_view(cluster: LocalCluster, exclude: frozenset[int] = frozenset()) -> tuple[int, dict] | None:
    """(leader id, its /quorum) of the live leader with the highest epoch, None if none answers."""
    best = None
    for nid in sorted(cluster.nodes):
        if nid in exclude or not cluster.alive(nid) or cluster.paused(nid):
            continue
        q = cluster.quorum(nid)
        if q and q.get("role") == "leader" and "replicas" in q and (best is None or q["epoch"] > best[1]["epoch"]):
            best = (nid, q)
    return best


def _wait_leader(cluster: LocalCluster, timeout_s: float, exclude: frozenset[int] = frozenset()) -> tuple[int, dict]:
    try:
        return cluster.wait_for(lambda: leader_view(cluster, exclude), timeout_s, "a leader")
    except TimeoutError:
        raise MembershipError(f"no leader answered within {timeout_s:g}s (`metalog cluster status "
                              f"--dir {cluster.root}`)") from None


def _client(cluster: LocalCluster, timeout_s: float) -> MetalogClient:
    # The change returns once committed: retried (not caught up yet, another
    # change in progress, a leader change) until timeout_s.
    return MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls(),
                         request_timeout_ms=10_000, delivery_timeout_ms=int(timeout_s * 1000), max_retries=10_000)


def _voter_dirs(cluster: LocalCluster, timeout_s: float) -> dict[int, str]:
    """The leader's voter set: node id -> directory id."""
    _, q = _wait_leader(cluster, timeout_s)
    return {v["replica_id"]: v["directory_id"] for v in q["replicas"]["voters"]}


def _change(cluster: LocalCluster, timeout_s: float, call, done_already: str, is_done) -> None:
    """Send one voter change. The client retries a REQUEST_TIMED_OUT answer (the
    leader had appended the change but not committed it in time), and the
    change may commit meanwhile: the retry is then refused (`done_already`,
    VOTER_NOT_FOUND or DUPLICATE_VOTER). That refusal is success only if the
    leader's voter set now shows the change done (`is_done`)."""
    try:
        _run_client(cluster, timeout_s, call)
    except MetalogError as exc:
        if exc.error_name != done_already or not is_done(_voter_dirs(cluster, timeout_s)):
            raise


def _run_client(cluster: LocalCluster, timeout_s: float, call) -> None:
    async def go():
        client = _client(cluster, timeout_s)
        try:
            await call(client)
        finally:
            await client.close()

    asyncio.run(go())


def _require_dynamic(cluster: LocalCluster) -> None:
    if not cluster.dynamic:
        # A compose file's brokers run their own command lines, their voters fixed by its `voters` setting.
        how = ("the compose file fixes them in its brokers' `voters` setting"
               if any(spec.command for spec in cluster.nodes.values())
               else "`metalog cluster up` without --static-voters")
        raise MembershipError(f"the cluster in {cluster.root} has static voters (kraft.version 0): voter changes "
                              f"need a dynamic quorum ({how})")


def add_voter(cluster: LocalCluster, node_id: int, timeout_s: float = 60.0) -> str:
    """Make running node `node_id` a voter: wait until the leader sees it as a
    caught-up observer (fetching with the directory id its own /quorum
    reports, log end at the leader's HW), send AddRaftVoter (returns once
    committed), wait until the node itself knows it votes. Returns its
    directory id; the launcher's state marks it a voter."""
    _require_dynamic(cluster)
    if node_id not in cluster.nodes:
        raise MembershipError(_unknown(cluster, node_id))
    if not cluster.alive(node_id):
        raise MembershipError(f"node {node_id} is not running: start it first (`metalog cluster restart {node_id}`)")
    spec = cluster.nodes[node_id]

    def caught_up_observer():
        found = leader_view(cluster)
        mine = (cluster.quorum(node_id) or {}).get("directory_id")
        if found is None or mine is None:
            return None
        _, q = found
        if node_id in q["voters"] and any(v["replica_id"] == node_id and v["directory_id"] == mine
                                          for v in q["replicas"]["voters"]):
            raise MembershipError(f"node {node_id} (directory id {mine}) is a voter already")
        for o in q["replicas"]["observers"]:
            if o["replica_id"] == node_id and o["directory_id"] == mine and o["log_end_offset"] >= q["high_watermark"]:
                return mine
        return None

    try:
        directory_id = cluster.wait_for(caught_up_observer, timeout_s,
                                        f"node {node_id} to fetch from the leader as a caught-up observer")
    except TimeoutError as exc:
        raise MembershipError(f"{exc} (see {cluster.log_path(node_id)})") from None
    listeners = _listeners(cluster, node_id)
    _change(cluster, timeout_s, lambda c: c.add_voter(node_id, directory_id, listeners), "DUPLICATE_VOTER",
            lambda voters: voters.get(node_id) == directory_id)
    spec.voter = True
    spec.removed = False
    cluster.voter_addrs[node_id] = (cluster.node_host(node_id), spec.port)
    cluster.save_state()
    # The change is committed; wait until the node has replicated it, so it
    # votes in the next election (a voter that has not learnt it is one cannot).
    cluster.wait_for(lambda: node_id in ((cluster.quorum(node_id) or {}).get("voters") or []), timeout_s,
                     f"node {node_id} to learn that it is a voter")
    return directory_id


def _listeners(cluster: LocalCluster, node_id: int) -> list[tuple[str, str, int]]:
    """What node_id's AddRaftVoter names: its peers' listener, and its Kafka
    listener where its config advertises that in the voter set too (a node
    add_node started: no other node's kafka_endpoints names it). Exactly what
    the node itself advertises, or it would UpdateRaftVoter its entry back."""
    spec = cluster.nodes[node_id]
    listeners = [(LISTENER_NAME, cluster.node_host(node_id), spec.port)]
    if spec.kafka_port is not None and cluster.config_for(node_id).get("kafka_in_voter_set"):
        listeners.append(("PLAINTEXT" if cluster.insecure else "SSL", cluster.node_host(node_id), spec.kafka_port))
    return listeners


def _port_free(port: int) -> bool:
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def _ports_for(cluster: LocalCluster, node_id: int) -> tuple[int, int, int | None]:
    """(port, admin port, Kafka port) as `cluster up` would have given node_id
    (each base + id - first), if free; else free ones. No Kafka port where the
    cluster's nodes have none (a cluster from before the Kafka listener)."""
    first = min(cluster.nodes)
    with_kafka = cluster.nodes[first].kafka_port is not None
    wanted = [cluster.nodes[first].port + node_id - first, cluster.nodes[first].admin_port + node_id - first]
    if with_kafka:
        wanted.append(cluster.nodes[first].kafka_port + node_id - first)
    taken = {p for s in cluster.nodes.values() for p in (s.port, s.admin_port, s.kafka_port) if p is not None}
    if all(p < 65536 for p in wanted) and not set(wanted) & taken and all(_port_free(p) for p in wanted):
        ports = wanted
    else:
        ports = free_ports(len(wanted))
    return ports[0], ports[1], ports[2] if with_kafka else None


def add_node(cluster: LocalCluster, timeout_s: float = 60.0) -> tuple[int, str]:
    """Start a new node (the next unused id, its data dir formatted
    --no-initial-controllers), wait until it is a caught-up observer and add
    it as a voter. Returns (node id, directory id)."""
    _require_dynamic(cluster)
    node_id = max(cluster.nodes) + 1
    while os.path.exists(cluster.node_dir(node_id)):  # never reuse a dir some earlier node left behind
        node_id += 1
    port, admin_port, kafka_port = _ports_for(cluster, node_id)
    # No other node's kafka_endpoints names the new node: it advertises its
    # Kafka listener in its voter-set entry, which every node reads.
    extra = {"kafka_in_voter_set": True} if kafka_port is not None else {}
    cluster.nodes[node_id] = NodeSpec(node_id, port, admin_port, voter=False, extra=extra,
                                      directory_id=new_directory_id(), kafka_port=kafka_port)
    cluster.save_state()
    proc = cluster.start_node(node_id)
    try:
        cluster.wait_for(lambda: proc.poll() is not None or cluster.quorum(node_id), timeout_s,
                         f"node {node_id}'s admin API")
    except TimeoutError as exc:
        raise MembershipError(f"{exc} (see {cluster.log_path(node_id)})") from None
    if proc.poll() is not None:
        raise MembershipError(f"node {node_id} exited with code {proc.returncode} while starting; see "
                              f"{os.path.join(cluster.node_dir(node_id), 'stderr.log')}")
    return node_id, add_voter(cluster, node_id, timeout_s)


def remove_voter(cluster: LocalCluster, node_id: int, timeout_s: float = 60.0) -> str:
    """RemoveRaftVoter for node_id's directory id in the leader's voter set
    (the node may be dead); returns once the change is committed and a leader
    other than node_id reports the smaller set (a removed leader resigns once
    its removal commits). Returns the directory id removed."""
    _require_dynamic(cluster)
    if node_id not in cluster.nodes:
        raise MembershipError(_unknown(cluster, node_id))
    _, q = _wait_leader(cluster, timeout_s)
    if node_id not in q["voters"]:
        raise MembershipError(f"node {node_id} is not a voter (voters: {', '.join(map(str, q['voters']))})")
    if q["voters"] == [node_id]:
        raise MembershipError(f"node {node_id} is the last voter: a quorum needs one (add another first: "
                              f"`metalog cluster add-node --dir {cluster.root}`)")
    (entry,) = [v for v in q["replicas"]["voters"] if v["replica_id"] == node_id]
    directory_id = entry["directory_id"]
    _change(cluster, timeout_s, lambda c: c.remove_voter(node_id, directory_id), "VOTER_NOT_FOUND",
            lambda voters: voters.get(node_id) != directory_id)

    def smaller_set():
        found = leader_view(cluster, exclude=frozenset({node_id}))
        return found if found and node_id not in found[1]["voters"] else None

    try:
        cluster.wait_for(smaller_set, timeout_s, f"a leader other than node {node_id} without it in its voter set")
    except TimeoutError as exc:
        raise MembershipError(str(exc)) from None
    cluster.nodes[node_id].voter = False
    cluster.voter_addrs.pop(node_id, None)
    cluster.save_state()
    return directory_id


def remove_node(cluster: LocalCluster, node_id: int, timeout_s: float = 60.0) -> str:
    """remove_voter, then stop the node (SIGTERM; SIGKILL after timeout_s). It
    stays in cluster.json as a stopped non-voter marked removed (`cluster up`
    does not start it again; `cluster restart N` does, as an observer); its dir is kept."""
    directory_id = remove_voter(cluster, node_id, timeout_s)
    cluster.terminate(node_id, timeout_s)
    cluster.nodes[node_id].removed = True  # `cluster up` leaves it stopped
    cluster.save_state()
    return directory_id


def _unknown(cluster: LocalCluster, node_id: int) -> str:
    return (f"no node {node_id} in the cluster in {cluster.root} "
            f"(nodes: {', '.join(map(str, sorted(cluster.nodes)))})")
