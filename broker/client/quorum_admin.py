"""The client's calls that administer the quorum itself (KIP-853 voter
changes, kraft.version, features): Kafka's own APIs, as
``kafka-metadata-quorum`` and ``kafka-features`` send them.

A mixin of ``MetalogClient`` (``metalog.broker.client.client``), apart so
that the client class stays readable at once; it uses only the client's
leader-request path and its settings below.
"""

from __future__ import annotations

from typing import Any, Callable

from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey


class QuorumAdminCalls:
    """What these calls use of the client they are mixed into."""

    cluster_id: str
    request_timeout_ms: int

    @property
    def _server_wait_ms(self) -> int:
        raise NotImplementedError  # MetalogClient's

    async def _leader_request(self, api_key: ApiKey, build: Callable[[], Any], timeout_ms: int,
                              **options: Any) -> Any:
        raise NotImplementedError  # MetalogClient's

    async def add_voter(self, voter_id: int, directory_id: str, listeners: list[tuple[str, str, int]]) -> None:
        """AddRaftVoter (KIP-853): returns once the leader committed the new
        voter set. REQUEST_TIMED_OUT (not caught up yet, another change in
        progress) is retried until delivery_timeout_ms; DUPLICATE_VOTER,
        INVALID_REQUEST, UNSUPPORTED_VERSION ... raise MetalogError."""
        await self._leader_request(
            ApiKey.ADD_RAFT_VOTER,
            lambda: m.AddRaftVoterRequest(cluster_id=self.cluster_id, voter_id=voter_id,
                                          voter_directory_id=directory_id,
                                          listeners=[m.RaftListener(*ln) for ln in listeners],
                                          timeout_ms=self._server_wait_ms),
            self.request_timeout_ms)

    async def remove_voter(self, voter_id: int, directory_id: str) -> None:
        """RemoveRaftVoter (KIP-853): returns once the change is committed
        (VOTER_NOT_FOUND ... raise MetalogError)."""
        await self._leader_request(
            ApiKey.REMOVE_RAFT_VOTER,
            lambda: m.RemoveRaftVoterRequest(cluster_id=self.cluster_id, voter_id=voter_id,
                                             voter_directory_id=directory_id, timeout_ms=self._server_wait_ms),
            self.request_timeout_ms)

    async def update_kraft_version(self, level: int, validate_only: bool = False) -> None:
        """UpdateFeatures (57) for kraft.version (Kafka's `kafka-features
        upgrade --feature kraft.version=1`): returns once the leader committed
        the upgrade. REQUEST_TIMED_OUT (the leader's epoch not committed yet,
        an upgrade or voter change in progress) is retried until
        delivery_timeout_ms; INVALID_UPDATE_VERSION (a voter's directory id
        unknown, a downgrade, a level not supported) raises MetalogError."""
        await self._leader_request(
            ApiKey.UPDATE_FEATURES,
            lambda: m.UpdateFeaturesRequest(
                cluster_id=self.cluster_id, feature_updates=[m.FeatureUpdate(m.KRAFT_VERSION_FEATURE, level)],
                timeout_ms=self._server_wait_ms, validate_only=validate_only),
            self.request_timeout_ms)

    async def describe_features(self) -> m.ApiVersionsResponse:
        """The leader's ApiVersions: supported features and the committed
        (finalized) levels, as `kafka-features describe` shows them."""
        return await self._leader_request(ApiKey.API_VERSIONS, lambda: m.ApiVersionsRequest(),
                                          self.request_timeout_ms)

