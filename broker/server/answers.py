"""Answers the runtime completes with what only it knows: endpoints.

The core builds the Metadata and DescribeQuorum answers
(``metalog.broker.quorum.answers``) but knows voters by id; where they listen
comes from the config (static voters), the log's voter set (KIP-853) and
what our leader said (BeginQuorumEpoch).
"""

from __future__ import annotations

from typing import Collection, Protocol

from metalog.broker.quorum.voters import VoterSet
from metalog.broker.server.config import Endpoint
from metalog.protocol import messages as m

# A voter's listeners as the log and the leader name them: (name, host, port).
Listeners = tuple[tuple[str, str, int], ...]


class EndpointsCore(Protocol):
    """What the answers read of the quorum core."""

    @property
    def voters(self) -> Collection[int]: ...

    @property
    def voter_set(self) -> VoterSet: ...

    @property
    def leader_endpoints(self) -> tuple[int, int, Listeners] | None: ...

    def metadata(self, endpoints: dict[int, tuple[str, int]] | None = None) -> m.MetadataResponse: ...


def voter_nodes(core: EndpointsCore, static_voters: dict[int, Endpoint]) -> list[m.DescribeQuorumNode]:
    """DescribeQuorum's Nodes: each voter's listeners from the log's voter set
    (KIP-853), else the config's address (static voters, name CONTROLLER)."""
    listeners = core.voter_set.endpoints
    nodes = []
    for nid in sorted(core.voters):
        if listeners.get(nid):
            eps = [m.RaftListener(name, host, port) for name, host, port in listeners[nid]]
        elif nid in static_voters:
            eps = [m.RaftListener("CONTROLLER", static_voters[nid].host, static_voters[nid].port)]
        else:
            eps = []
        nodes.append(m.DescribeQuorumNode(nid, eps))
    return nodes


def metadata_response(core: EndpointsCore, static_voters: dict[int, Endpoint], node_id: int,
                      own_listeners: Listeners) -> m.MetadataResponse:
    """Built by the core, with our voters' endpoints: the config's, then
    (KIP-853) the log's voter set's, then where our leader said it listens --
    a voter added online is in no config."""
    endpoints = {nid: (ep.host, ep.port) for nid, ep in static_voters.items()}
    for nid, eps in core.voter_set.endpoints.items():
        if eps:
            endpoints[nid] = (eps[0][1], eps[0][2])
    leader = core.leader_endpoints
    if leader is not None and leader[2]:
        _name, host, port = leader[2][0]
        endpoints[leader[0]] = (host, port)
    if own_listeners and node_id in endpoints:
        # Ourselves: where we listen now (our entry may still be the old one).
        _name, host, port = own_listeners[0]
        endpoints[node_id] = (host, port)
    return core.metadata(endpoints)
