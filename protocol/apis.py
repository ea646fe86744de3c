"""Api keys (Kafka's numbering) and the flat request and response types of each.

The broker's request router (``metalog.broker.server.inbound``), its
authorization gate and its outbound side think in the flat bodies of
``metalog.protocol.messages``; this table says which flat types belong to
which api (the gate answers a refusal with the api's response type). Which
versions of each api travel on the wire is Kafka's business: the served
ranges are the handlers' (``metalog.broker.server.kafka``), the sent
versions the edge's (``metalog.protocol.kafka.edge``).
"""

from __future__ import annotations

import enum

from metalog.protocol import messages as m


class ApiKey(enum.IntEnum):
    PRODUCE = 0
    FETCH = 1
    LIST_OFFSETS = 2
    METADATA = 3
    API_VERSIONS = 18
    INIT_PRODUCER_ID = 22
    OFFSET_FOR_LEADER_EPOCH = 23
    VOTE = 52
    BEGIN_QUORUM_EPOCH = 53
    END_QUORUM_EPOCH = 54
    DESCRIBE_QUORUM = 55
    UPDATE_FEATURES = 57
    FETCH_SNAPSHOT = 59
    ADD_RAFT_VOTER = 80
    REMOVE_RAFT_VOTER = 81
    UPDATE_RAFT_VOTER = 82
    CONTROLLER_COMMAND = 1000  # metalog's own, outside Kafka's range
    CONSISTENCY_CHECK = 1001  # metalog's own: cross-replica log digest (metalog.broker.server.consistency)


# api key -> (flat request type, flat response type)
APIS: dict[ApiKey, tuple[type[m.Body], type[m.Body]]] = {
    ApiKey.PRODUCE: (m.ProduceRequest, m.ProduceResponse),
    ApiKey.FETCH: (m.FetchRequest, m.FetchResponse),
    ApiKey.LIST_OFFSETS: (m.ListOffsetsRequest, m.ListOffsetsResponse),
    ApiKey.METADATA: (m.MetadataRequest, m.MetadataResponse),
    ApiKey.API_VERSIONS: (m.ApiVersionsRequest, m.ApiVersionsResponse),
    ApiKey.INIT_PRODUCER_ID: (m.InitProducerIdRequest, m.InitProducerIdResponse),
    ApiKey.OFFSET_FOR_LEADER_EPOCH: (m.OffsetsForLeaderEpochRequest, m.OffsetsForLeaderEpochResponse),
    ApiKey.VOTE: (m.VoteRequest, m.VoteResponse),
    ApiKey.BEGIN_QUORUM_EPOCH: (m.BeginQuorumEpochRequest, m.BeginQuorumEpochResponse),
    ApiKey.END_QUORUM_EPOCH: (m.EndQuorumEpochRequest, m.EndQuorumEpochResponse),
    ApiKey.DESCRIBE_QUORUM: (m.DescribeQuorumRequest, m.DescribeQuorumResponse),
    ApiKey.UPDATE_FEATURES: (m.UpdateFeaturesRequest, m.UpdateFeaturesResponse),
    ApiKey.FETCH_SNAPSHOT: (m.FetchSnapshotRequest, m.FetchSnapshotResponse),
    ApiKey.ADD_RAFT_VOTER: (m.AddRaftVoterRequest, m.AddRaftVoterResponse),
    ApiKey.REMOVE_RAFT_VOTER: (m.RemoveRaftVoterRequest, m.RemoveRaftVoterResponse),
    ApiKey.UPDATE_RAFT_VOTER: (m.UpdateRaftVoterRequest, m.UpdateRaftVoterResponse),
    ApiKey.CONTROLLER_COMMAND: (m.ControllerCommandRequest, m.ControllerCommandResponse),
    ApiKey.CONSISTENCY_CHECK: (m.ConsistencyCheckRequest, m.ConsistencyCheckResponse),
}

REQUEST_API_KEY: dict[type[m.Body], ApiKey] = {req: key for key, (req, _) in APIS.items()}
