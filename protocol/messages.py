"""The flat request and response bodies of metalog's core (no longer a wire format).

On the wire every message is Kafka's (``metalog.protocol.kafka.messages``);
the quorum core, the request router, the authorization gate and our client
library think in these flat bodies instead: one msgspec Struct per request
or response (``metalog.protocol.apis`` says which belong to which api key).
The two are mapped at the edge: the sending side through
``metalog.protocol.kafka.edge``, the serving side in the handlers of
``metalog.broker.server.kafka``.

The field names follow Kafka's message schemas (KIP-320, KIP-595, KIP-630) in
snake_case; the single replicated log (``__cluster_metadata``) means there are
no topic/partition arrays. Sentinels follow Kafka: ``-1`` means "unknown" for
ids, epochs and offsets (``NO_EPOCH``, ``NO_LEADER``, ``NO_OFFSET``).

These types are shared by the pure quorum core (which consumes and produces
them as events and actions), the broker runtime, the client library and the
deterministic simulator.
"""

from __future__ import annotations

from typing import Any

import msgspec

NO_EPOCH = -1
NO_LEADER = -1
NO_OFFSET = -1
NO_REPLICA = -1
# replica_id of a consumer (not a replica) in Fetch, as in Kafka.
CONSUMER_REPLICA_ID = -1
# KIP-853: a replica is (node id, directory id). The directory id is Kafka's
# Uuid string (22 characters of url-safe base64); "" stands for Kafka's
# ZERO_UUID, "unknown" (static voters, kraft version 0, or an older peer).
NO_DIRECTORY_ID = ""


class Body(msgspec.Struct, array_like=True, frozen=True, kw_only=True):
    """Base of every request and response body."""


# --------------------------------------------------------------------------
# Shared sub-structures


class SnapshotId(msgspec.Struct, array_like=True, frozen=True, order=True):
    """A snapshot holds every record with offset < end_offset (KIP-630)."""

    end_offset: int
    epoch: int


class EpochEndOffset(msgspec.Struct, array_like=True, frozen=True):
    epoch: int
    end_offset: int


class LeaderIdAndEpoch(msgspec.Struct, array_like=True, frozen=True):
    leader_id: int
    leader_epoch: int


class ReplicaState(msgspec.Struct, array_like=True, frozen=True):
    replica_id: int
    log_end_offset: int
    last_fetch_timestamp_ms: int = -1
    last_caught_up_timestamp_ms: int = -1
    in_sync: bool = False
    replica_directory_id: str = NO_DIRECTORY_ID  # KIP-853 (DescribeQuorum v2)


class ApiVersionRange(msgspec.Struct, array_like=True, frozen=True):
    api_key: int
    min_version: int
    max_version: int


class NodeEndpoint(msgspec.Struct, array_like=True, frozen=True):
    node_id: int
    host: str
    port: int


# --------------------------------------------------------------------------
# ApiVersions (18)


class ApiVersionsRequest(Body, frozen=True):
    client_software_name: str = "metalog"


class SupportedFeature(msgspec.Struct, array_like=True, frozen=True):
    """A feature this build supports (Kafka's ApiVersions SupportedFeatures)."""

    name: str
    min_version: int
    max_version: int


class FinalizedFeature(msgspec.Struct, array_like=True, frozen=True):
    """A feature's level the cluster has committed (Kafka's FinalizedFeatures)."""

    name: str
    max_version_level: int
    min_version_level: int


class ApiVersionsResponse(Body, frozen=True):
    error_code: int = 0
    api_keys: list[ApiVersionRange] = []
    # Kafka's tagged fields of ApiVersions v3 (what `kafka-features describe`
    # reads): trailing, with defaults, so an older peer drops them.
    supported_features: list[SupportedFeature] = []
    finalized_features_epoch: int = -1  # the offset of the record that set them; -1 unknown
    finalized_features: list[FinalizedFeature] = []


# --------------------------------------------------------------------------
# Vote (52), BeginQuorumEpoch (53), EndQuorumEpoch (54)


class VoteRequest(Body, frozen=True):
    cluster_id: str
    candidate_epoch: int  # a pre-vote names the epoch it would stand in (its own + 1)
    candidate_id: int
    last_offset_epoch: int
    last_offset: int  # the candidate's log end offset
    # KIP-996 (Kafka's PreVote, Vote v2): only asks whether the voter would
    # vote; it records nothing. The edge sends every Vote as v2.
    pre_vote: bool = False
    # KIP-853 (Kafka's Vote v1 fields).
    candidate_directory_id: str = NO_DIRECTORY_ID
    voter_id: int = NO_REPLICA  # the voter addressed; NO_REPLICA: not said
    voter_directory_id: str = NO_DIRECTORY_ID


class VoteResponse(Body, frozen=True):
    error_code: int = 0
    leader_id: int = NO_LEADER
    leader_epoch: int = NO_EPOCH
    vote_granted: bool = False


class RaftListener(msgspec.Struct, array_like=True, frozen=True):
    """One endpoint a voter listens on (Kafka's Listeners entry)."""

    name: str
    host: str
    port: int


class BeginQuorumEpochRequest(Body, frozen=True):
    cluster_id: str
    leader_id: int
    leader_epoch: int
    # KIP-853 (BeginQuorumEpoch v1): the voter addressed.
    voter_id: int = NO_REPLICA
    voter_directory_id: str = NO_DIRECTORY_ID
    # KIP-853 (v1 LeaderEndpoints, KAFKA-16927): where the leader listens now
    # -- how a voter reaches a leader whose address changed before the voter
    # set in its log says so. Empty: use the voter set's (or the config's).
    leader_endpoints: list[RaftListener] = []


class BeginQuorumEpochResponse(Body, frozen=True):
    error_code: int = 0
    leader_id: int = NO_LEADER
    leader_epoch: int = NO_EPOCH


class EndQuorumEpochRequest(Body, frozen=True):
    cluster_id: str
    leader_id: int
    leader_epoch: int
    # Voters ordered most caught up first; the first gets the shortest backoff.
    preferred_successors: list[int] = []


class EndQuorumEpochResponse(Body, frozen=True):
    error_code: int = 0
    leader_id: int = NO_LEADER
    leader_epoch: int = NO_EPOCH


# --------------------------------------------------------------------------
# Fetch (1): followers, observers and consumers


class FetchRequest(Body, frozen=True):
    cluster_id: str
    replica_id: int  # CONSUMER_REPLICA_ID for a consumer
    max_wait_ms: int
    current_leader_epoch: int  # NO_EPOCH: the caller does not know (KIP-320 sentinel)
    fetch_offset: int
    last_fetched_epoch: int
    log_start_offset: int = NO_OFFSET
    max_bytes: int = 1 << 20
    replica_directory_id: str = NO_DIRECTORY_ID  # KIP-853 (Fetch v17's ReplicaDirectoryId)


class FetchResponse(Body, frozen=True):
    error_code: int = 0
    high_watermark: int = NO_OFFSET
    log_start_offset: int = NO_OFFSET
    records: bytes = b""  # whole encoded record batches (metalog.storage.batch format)
    diverging_epoch: EpochEndOffset | None = None
    current_leader: LeaderIdAndEpoch | None = None
    snapshot_id: SnapshotId | None = None
    error_message: str | None = None


# --------------------------------------------------------------------------
# OffsetForLeaderEpoch (23)


class OffsetsForLeaderEpochRequest(Body, frozen=True):
    cluster_id: str
    replica_id: int  # CONSUMER_REPLICA_ID for a consumer
    current_leader_epoch: int  # fenced like Fetch; NO_EPOCH skips the check
    leader_epoch: int  # the epoch whose end offset is asked for


class OffsetsForLeaderEpochResponse(Body, frozen=True):
    error_code: int = 0
    # The largest epoch <= the requested one, and its end offset (KIP-320).
    leader_epoch: int = NO_EPOCH
    end_offset: int = NO_OFFSET
    current_leader: LeaderIdAndEpoch | None = None
    error_message: str | None = None


# --------------------------------------------------------------------------
# FetchSnapshot (59)


class FetchSnapshotRequest(Body, frozen=True):
    cluster_id: str
    replica_id: int
    current_leader_epoch: int
    snapshot_id: SnapshotId
    position: int
    max_bytes: int = 1 << 20
    replica_directory_id: str = NO_DIRECTORY_ID  # KIP-853 (FetchSnapshot v1)


class FetchSnapshotResponse(Body, frozen=True):
    error_code: int = 0
    snapshot_id: SnapshotId | None = None
    size: int = -1  # total size of the snapshot file in bytes
    position: int = -1
    unaligned_records: bytes = b""
    current_leader: LeaderIdAndEpoch | None = None


# --------------------------------------------------------------------------
# DescribeQuorum (55)


class DescribeQuorumRequest(Body, frozen=True):
    pass


class DescribeQuorumResponse(Body, frozen=True):
    error_code: int = 0
    leader_id: int = NO_LEADER
    leader_epoch: int = NO_EPOCH
    high_watermark: int = NO_OFFSET
    voters: list[ReplicaState] = []
    observers: list[ReplicaState] = []
    error_message: str | None = None
    # Kafka's v2 Nodes: the endpoints of the voters (from the log's voter set,
    # KIP-853; with static voters, the config's), for `describe --status`.
    nodes: list[DescribeQuorumNode] = []


# --------------------------------------------------------------------------
# Client calls: Produce (0), ListOffsets (2), Metadata (3).
# Consumers read with Fetch and replica_id = CONSUMER_REPLICA_ID.


class ProduceRequest(Body, frozen=True):
    cluster_id: str
    records: list[bytes]
    timeout_ms: int = 5000
    # Idempotent produce (KIP-98): the producer from InitProducerId and the
    # sequence of the first record; they go into the batch header as is.
    # -1 (NO_PRODUCER_ID) = not idempotent. A retry reuses all three.
    producer_id: int = -1
    producer_epoch: int = -1
    base_sequence: int = -1


class ProduceResponse(Body, frozen=True):
    error_code: int = 0
    base_offset: int = NO_OFFSET  # offset of the first record written
    leader_epoch: int = NO_EPOCH  # epoch the records were written under
    current_leader: LeaderIdAndEpoch | None = None
    error_message: str | None = None


# --------------------------------------------------------------------------
# InitProducerId (22), Kafka's fields (no transactions: transactional_id stays
# None). The leader answers with a fresh id derived from its leader epoch
# (unique across leaders: see metalog.broker.server.idempotence and docs/client.md).


class InitProducerIdRequest(Body, frozen=True):
    cluster_id: str
    transactional_id: str | None = None
    transaction_timeout_ms: int = -1
    producer_id: int = -1  # an existing id to re-init (unused: a new id is always allocated)
    producer_epoch: int = -1
    timeout_ms: int = 5000


class InitProducerIdResponse(Body, frozen=True):
    error_code: int = 0
    producer_id: int = -1
    producer_epoch: int = -1
    current_leader: LeaderIdAndEpoch | None = None
    error_message: str | None = None


LIST_OFFSETS_EARLIEST = -2
LIST_OFFSETS_LATEST = -1


class ListOffsetsRequest(Body, frozen=True):
    cluster_id: str
    current_leader_epoch: int  # NO_EPOCH skips the fence (KIP-320)
    # LIST_OFFSETS_EARLIEST, LIST_OFFSETS_LATEST (the HW) or a timestamp in ms.
    timestamp_ms: int


class ListOffsetsResponse(Body, frozen=True):
    error_code: int = 0
    offset: int = NO_OFFSET
    timestamp_ms: int = -1
    # Epoch of the last record before `offset` (KIP-320): what a consumer that
    # seeks to `offset` validates its position against.
    leader_epoch: int = NO_EPOCH
    current_leader: LeaderIdAndEpoch | None = None
    error_message: str | None = None


class MetadataRequest(Body, frozen=True):
    pass


class MetadataResponse(Body, frozen=True):
    error_code: int = 0
    cluster_id: str = ""
    node_id: int = NO_REPLICA  # the answering node
    leader_id: int = NO_LEADER
    leader_epoch: int = NO_EPOCH
    high_watermark: int = NO_OFFSET
    log_start_offset: int = NO_OFFSET
    voters: list[NodeEndpoint] = []
    observers: list[NodeEndpoint] = []
    error_message: str | None = None


class ErrorResponse(Body, frozen=True):
    """Sent when a request's header was readable but its body was not."""

    error_code: int
    error_message: str = ""


# --------------------------------------------------------------------------
# AddRaftVoter (80), RemoveRaftVoter (81), UpdateRaftVoter (82): KIP-853's
# voter changes, answered by the leader once the VotersRecord is committed.


class DescribeQuorumNode(msgspec.Struct, array_like=True, frozen=True):
    """DescribeQuorum v2's Nodes entry: one node and where it listens."""

    node_id: int
    listeners: list[RaftListener] = []


class AddRaftVoterRequest(Body, frozen=True):
    cluster_id: str
    voter_id: int
    voter_directory_id: str
    listeners: list[RaftListener] = []
    timeout_ms: int = 30000  # answered REQUEST_TIMED_OUT if not committed by then


class AddRaftVoterResponse(Body, frozen=True):
    error_code: int = 0
    error_message: str | None = None


class RemoveRaftVoterRequest(Body, frozen=True):
    cluster_id: str
    voter_id: int
    voter_directory_id: str
    timeout_ms: int = 30000


class RemoveRaftVoterResponse(Body, frozen=True):
    error_code: int = 0
    error_message: str | None = None


class UpdateRaftVoterRequest(Body, frozen=True):
    """A voter tells the leader its endpoints (and supported kraft versions)."""

    cluster_id: str
    current_leader_epoch: int
    voter_id: int
    voter_directory_id: str
    listeners: list[RaftListener] = []
    kraft_version_min: int = 0
    kraft_version_max: int = 1


class UpdateRaftVoterResponse(Body, frozen=True):
    error_code: int = 0
    error_message: str | None = None
    current_leader: LeaderIdAndEpoch | None = None


# --------------------------------------------------------------------------
# UpdateFeatures (57): Kafka's `kafka-features upgrade`. The quorum serves one
# feature, kraft.version (KIP-853): 0 static voters from the config, 1 the
# voter set in the log; the leader answers once the upgrade is committed.

KRAFT_VERSION_FEATURE = "kraft.version"
UPGRADE_TYPE_UPGRADE = 1  # Kafka's FeatureUpdate.UpgradeType: 1 upgrade, 2 safe / 3 unsafe downgrade


class FeatureUpdate(msgspec.Struct, array_like=True, frozen=True):
    feature: str
    max_version_level: int
    upgrade_type: int = UPGRADE_TYPE_UPGRADE


class UpdateFeaturesRequest(Body, frozen=True):
    cluster_id: str
    feature_updates: list[FeatureUpdate] = []
    timeout_ms: int = 60000
    validate_only: bool = False


class UpdatableFeatureResult(msgspec.Struct, array_like=True, frozen=True):
    feature: str
    error_code: int = 0
    error_message: str | None = None


class UpdateFeaturesResponse(Body, frozen=True):
    error_code: int = 0  # the first failing feature's, else NONE
    error_message: str | None = None
    results: list[UpdatableFeatureResult] = []


# --------------------------------------------------------------------------
# ControllerCommand (1000, metalog's own): create/delete topics, register,
# fence and unfence brokers, set configs. Kafka spreads these over several
# apis (CreateTopics, DeleteTopics, IncrementalAlterConfigs, BrokerRegistration,
# ...); one api with a command name keeps our single-log controller simple.
# The leader validates against its committed state and answers once the
# resulting records are committed.


class ControllerCommandRequest(Body, frozen=True):
    cluster_id: str
    command: str  # create_topic, delete_topic, register_broker, unregister_broker,
    #               fence_broker, unfence_broker, set_config, add_acl, remove_acl, list_acls
    args: dict[str, Any] = {}  # validated by the leader's controller
    timeout_ms: int = 5000


class ControllerCommandResponse(Body, frozen=True):
    error_code: int = 0
    error_message: str | None = None
    base_offset: int = NO_OFFSET  # offset of the first record the command wrote
    leader_epoch: int = NO_EPOCH
    current_leader: LeaderIdAndEpoch | None = None
    result: Any = None  # what a read-only command (list_acls) answers


# --------------------------------------------------------------------------
# ConsistencyCheck (1001), metalog's own (etcd's corrupt check; no Kafka
# equivalent): the leader asks a voter for the digest of its log over
# [start_offset, end_offset), a range both hold committed. The answer covers
# [max(start_offset, its log start), end_offset) and splits it into chunks so
# a mismatch can be located (see metalog.broker.server.consistency).


class ConsistencyCheckRequest(Body, frozen=True):
    cluster_id: str
    leader_id: int
    leader_epoch: int
    start_offset: int
    end_offset: int
    chunks: int = 64  # at most this many chunk digests in the answer


class ConsistencyChunk(msgspec.Struct, array_like=True, frozen=True):
    start_offset: int
    end_offset: int
    digest: int  # CRC-32C over the (base, next, epoch, batch CRC) entries of its batches


class ConsistencyCheckResponse(Body, frozen=True):
    error_code: int = 0
    error_message: str | None = None
    start_offset: int = NO_OFFSET
    end_offset: int = NO_OFFSET
    chunks: list[ConsistencyChunk] = []
