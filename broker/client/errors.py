"""What the client library raises, and which answers it retries.

Every failure a user can catch lives here, so ``from metalog.broker.client
import MetalogError`` (and the others) works without reading the client:

* ``MetalogError``: an error answer from the cluster, with its Kafka error
  code and name; ``AuthorizationError`` (never retried) and
  ``CorruptRecordError`` (a fetched batch failed its CRC check) are kinds of it.
* ``ClusterUnavailable``: no node answered, or the call's retries and deadline
  ran out; ``TlsFailure`` is the handshake failing (raised at once).
* ``LogTruncationError``, ``OffsetOutOfRangeError``, ``NoOffsetError``: what a
  consumer with ``reset_policy="none"`` raises instead of moving its position.

``RETRIABLE`` and ``LEADER_ERRORS`` are the error codes that mean "ask again,
maybe elsewhere": the client's retry loop and the consumer share them.
"""

from __future__ import annotations

from metalog.protocol.errors import Errors, error_name

# Kafka's answer of a follower to InitProducerId (its brokers ask a
# coordinator for producer ids; ours come from the leader): ask the leader.
COORDINATOR_NOT_AVAILABLE = 15

# Answers that mean "ask again, maybe elsewhere". NOT_CONTROLLER and
# COORDINATOR_NOT_AVAILABLE are how a follower says "not the leader" in the
# Kafka handlers of AddRaftVoter, RemoveRaftVoter, UpdateFeatures and
# InitProducerId (Kafka's own clients retry at the controller on them).
LEADER_ERRORS = frozenset({
    Errors.NOT_LEADER_OR_FOLLOWER, Errors.FENCED_LEADER_EPOCH, Errors.UNKNOWN_LEADER_EPOCH,
    Errors.LEADER_NOT_AVAILABLE, Errors.BROKER_NOT_AVAILABLE, Errors.NOT_CONTROLLER, COORDINATOR_NOT_AVAILABLE,
})
RETRIABLE = LEADER_ERRORS | {Errors.REQUEST_TIMED_OUT, Errors.KAFKA_STORAGE_ERROR}

AUTHORIZATION_ERRORS = frozenset({Errors.TOPIC_AUTHORIZATION_FAILED, Errors.CLUSTER_AUTHORIZATION_FAILED})


class MetalogError(Exception):
    """An error answer from the cluster, with its Kafka error code."""

    def __init__(self, error_code: int, message: str = ""):
        self.error_code = error_code
        self.error_name = error_name(error_code)
        super().__init__(f"{self.error_name}: {message}" if message else self.error_name)


class AuthorizationError(MetalogError):
    """The cluster refused this principal (TOPIC/CLUSTER_AUTHORIZATION_FAILED):
    permanent until an admin adds an ACL, so never retried."""

    def __init__(self, error_code: int, message: str = ""):
        super().__init__(error_code, message)
        # Some of Kafka's answers carry no message (InitProducerId, Fetch's
        # top level): the broker logs the reason (authorization_failed).
        self.args = (message or f"not authorized ({self.error_name}; the broker's authorization_failed log line "
                                f"says which principal, operation and resource)",)


def error_for(code: int, message: str) -> MetalogError:
    """The exception for a permanent error answer: AuthorizationError for a refusal, else MetalogError."""
    return AuthorizationError(code, message) if code in AUTHORIZATION_ERRORS else MetalogError(code, message)


class CorruptRecordError(MetalogError):
    """A fetched batch failed verification (Kafka's check.crcs): the broker
    sent bytes that are not what was written. Names the offset, epoch and broker."""

    def __init__(self, offset: int, epoch: int | None, broker_id: int, broker_address: str,
                 position: int, reason: str):
        self.offset = offset
        self.epoch = epoch
        self.broker_id = broker_id
        self.broker_address = broker_address
        self.position = position
        self.reason = reason
        super().__init__(Errors.CORRUPT_MESSAGE,
                         f"corrupt batch at offset {offset} (epoch {epoch}) from broker {broker_id} "
                         f"({broker_address}), byte {position} of the fetch answer: {reason}")


class ClusterUnavailable(Exception):
    """No node answered Metadata (or every retry failed)."""


class TlsFailure(ClusterUnavailable):
    """The TLS handshake failed (unknown CA, expired certificate, wrong host name,
    plaintext/TLS mismatch): retrying would only repeat it, so it is raised at once.
    The message is one line, e.g. ``TLS handshake with 127.0.0.1:9091 failed: ...``."""


class LogTruncationError(Exception):
    """The leader's log no longer holds records this consumer returned (KIP-320)."""

    def __init__(self, first_diverging_offset: int, epoch: int, position: int):
        self.first_diverging_offset = first_diverging_offset
        self.epoch = epoch
        self.position = position
        super().__init__(
            f"log truncated: the leader's log ends epoch {epoch} at offset {first_diverging_offset}, "
            f"below the consumer position {position}; records from offset {first_diverging_offset} "
            f"on were not kept. seek() to resume."
        )


class OffsetOutOfRangeError(Exception):
    """The consumer's position is outside the leader's log and reset_policy is "none"."""

    def __init__(self, position: int | None, reason: str):
        self.position = position
        super().__init__(f"consumer position {position} is out of range: {reason}")


class NoOffsetError(Exception):
    """The consumer has no position and reset_policy is "none": seek() first."""
