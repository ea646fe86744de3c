"""Api keys (Kafka numbering) and which body types travel under each."""

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


# api key -> (request type, response type, min version, max version)
APIS: dict[ApiKey, tuple[type[m.Body], type[m.Body], int, int]] = {
    ApiKey.PRODUCE: (m.ProduceRequest, m.ProduceResponse, 0, 0),
    ApiKey.FETCH: (m.FetchRequest, m.FetchResponse, 0, 0),
    ApiKey.LIST_OFFSETS: (m.ListOffsetsRequest, m.ListOffsetsResponse, 0, 0),
    ApiKey.METADATA: (m.MetadataRequest, m.MetadataResponse, 0, 0),
    ApiKey.API_VERSIONS: (m.ApiVersionsRequest, m.ApiVersionsResponse, 0, 0),
    ApiKey.INIT_PRODUCER_ID: (m.InitProducerIdRequest, m.InitProducerIdResponse, 0, 0),
    ApiKey.OFFSET_FOR_LEADER_EPOCH: (m.OffsetsForLeaderEpochRequest, m.OffsetsForLeaderEpochResponse, 0, 0),
    # Vote: versions as Kafka numbers them. v1 is KIP-853's (directory ids,
    # carried as trailing fields with defaults in every version: an older
    # peer drops them, i.e. treats them as unknown); v2 adds pre_vote (KIP-996).
    ApiKey.VOTE: (m.VoteRequest, m.VoteResponse, 0, 2),
    ApiKey.BEGIN_QUORUM_EPOCH: (m.BeginQuorumEpochRequest, m.BeginQuorumEpochResponse, 0, 0),
    ApiKey.END_QUORUM_EPOCH: (m.EndQuorumEpochRequest, m.EndQuorumEpochResponse, 0, 0),
    ApiKey.DESCRIBE_QUORUM: (m.DescribeQuorumRequest, m.DescribeQuorumResponse, 0, 0),
    ApiKey.UPDATE_FEATURES: (m.UpdateFeaturesRequest, m.UpdateFeaturesResponse, 0, 0),
    ApiKey.FETCH_SNAPSHOT: (m.FetchSnapshotRequest, m.FetchSnapshotResponse, 0, 0),
    ApiKey.ADD_RAFT_VOTER: (m.AddRaftVoterRequest, m.AddRaftVoterResponse, 0, 0),
    ApiKey.REMOVE_RAFT_VOTER: (m.RemoveRaftVoterRequest, m.RemoveRaftVoterResponse, 0, 0),
    ApiKey.UPDATE_RAFT_VOTER: (m.UpdateRaftVoterRequest, m.UpdateRaftVoterResponse, 0, 0),
    ApiKey.CONTROLLER_COMMAND: (m.ControllerCommandRequest, m.ControllerCommandResponse, 0, 0),
    ApiKey.CONSISTENCY_CHECK: (m.ConsistencyCheckRequest, m.ConsistencyCheckResponse, 0, 0),
}

REQUEST_API_KEY: dict[type[m.Body], ApiKey] = {req: key for key, (req, _, _, _) in APIS.items()}

# The first version of an api whose body may carry a field (older versions
# must not: a peer that only knows them would drop it silently).
VOTE_PRE_VOTE_VERSION = 2


def request_version(body: m.Body) -> int:
    """The version a request is sent with: the lowest that carries what the
    body says, so that peers of an older build still read every request
    they can (a real Vote stays version 0)."""
    if type(body) is m.VoteRequest and body.pre_vote:
        return VOTE_PRE_VOTE_VERSION
    return 0


def version_problem(api_version: int, body: m.Body) -> str | None:
    """None, or why `body` cannot travel under `api_version`."""
    if api_version < request_version(body):
        return f"pre_vote needs Vote version {VOTE_PRE_VOTE_VERSION}, the request says version {api_version}"
    return None
