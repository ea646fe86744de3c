"""Kafka's error codes, reused as-is on the metalog wire (see kraft-facts)."""

from __future__ import annotations

import enum


class Errors(enum.IntEnum):
    UNKNOWN_SERVER_ERROR = -1
    NONE = 0
    OFFSET_OUT_OF_RANGE = 1
    CORRUPT_MESSAGE = 2
    UNKNOWN_TOPIC_OR_PARTITION = 3
    LEADER_NOT_AVAILABLE = 5
    NOT_LEADER_OR_FOLLOWER = 6
    REQUEST_TIMED_OUT = 7
    BROKER_NOT_AVAILABLE = 8
    MESSAGE_TOO_LARGE = 10
    TOPIC_AUTHORIZATION_FAILED = 29  # the principal lacks an ACL on the topic
    CLUSTER_AUTHORIZATION_FAILED = 31  # lacks an ACL on the cluster, or is not the replica it claims
    UNSUPPORTED_VERSION = 35
    TOPIC_ALREADY_EXISTS = 36  # CreateTopics: the name is taken
    INVALID_PARTITIONS = 37  # CreateTopics / CreatePartitions: a partition count that cannot be
    INVALID_REPLICATION_FACTOR = 38  # more replicas than live brokers, or fewer than 1
    INVALID_CONFIG = 40  # IncrementalAlterConfigs: an operation or value the controller does not take
    NOT_CONTROLLER = 41  # an admin request at a node that is not the leader: the client retries there
    INVALID_REQUEST = 42
    OUT_OF_ORDER_SEQUENCE_NUMBER = 45  # idempotent produce: a gap in the producer's sequence
    INVALID_PRODUCER_EPOCH = 47  # the producer's epoch is older than the one the leader knows
    KAFKA_STORAGE_ERROR = 56
    UNKNOWN_PRODUCER_ID = 59  # no state for the producer (expired): the client re-inits
    FENCED_LEADER_EPOCH = 74  # the request's epoch is older than ours
    UNKNOWN_LEADER_EPOCH = 75  # the request's epoch is newer than ours
    STALE_BROKER_EPOCH = 77  # BrokerHeartbeat: not the epoch of the broker's current registration
    INCONSISTENT_VOTER_SET = 94
    INVALID_UPDATE_VERSION = 95  # UpdateFeatures: a level this build or cluster cannot take now
    PRINCIPAL_DESERIALIZATION_FAILURE = 97  # Envelope: the forwarded client principal cannot be read
    SNAPSHOT_NOT_FOUND = 98
    POSITION_OUT_OF_RANGE = 99
    DUPLICATE_BROKER_REGISTRATION = 101  # BrokerRegistration: a live broker (valid session) holds the id
    BROKER_ID_NOT_REGISTERED = 102  # BrokerHeartbeat of a broker id with no registration
    INCONSISTENT_CLUSTER_ID = 104
    INVALID_REGISTRATION = 119  # BrokerRegistration: log dirs missing, reserved, repeated or another broker's
    INVALID_VOTER_KEY = 125  # KIP-853: the request names another directory id of this node
    DUPLICATE_VOTER = 126  # KIP-853 AddRaftVoter: that replica is already a voter
    VOTER_NOT_FOUND = 127  # KIP-853 RemoveRaftVoter / UpdateRaftVoter: no such voter


def error_name(code: int) -> str:
    try:
        return Errors(code).name
    except ValueError:
        return f"UNKNOWN_ERROR_CODE({code})"
