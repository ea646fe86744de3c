"""The answers the core and the runtime both give, built in one place.

* ``error_response``: the error answer of the right type for a request
  (a client decodes the response type its request's api key names).
* ``check_cluster_id``: THE cluster-id check; the core runs it on every
  request it is handed, the runtime on the few it serves itself (Produce and
  ControllerCommand it batches, ConsistencyCheck).
* ``api_versions_response`` and ``metadata_response``: the answers to
  ApiVersions and Metadata, whoever serves them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from metalog.protocol import messages as m
from metalog.protocol.errors import Errors


def error_response(req: m.Body, code: int, message: str | None,
                   current_leader: m.LeaderIdAndEpoch) -> m.Body:
    """The response type `req` expects, carrying `code` (and, where the type
    has them, the message and the leader as we know it)."""
    cl = current_leader
    t = type(req)
    if t is m.FetchRequest:
        return m.FetchResponse(error_code=code, current_leader=cl, error_message=message)
    if t is m.OffsetsForLeaderEpochRequest:
        # No leader: Kafka's OffsetForLeaderEpoch answer has no field for it,
        # so no requester ever sees one (the simulator on Kafka's wire found
        # the flat answer carrying a hint the brokers' never can).
        return m.OffsetsForLeaderEpochResponse(error_code=code)
    if t is m.FetchSnapshotRequest:
        return m.FetchSnapshotResponse(error_code=code, current_leader=cl)
    if t is m.ProduceRequest:
        return m.ProduceResponse(error_code=code, current_leader=cl, error_message=message)
    if t is m.ListOffsetsRequest:
        return m.ListOffsetsResponse(error_code=code, current_leader=cl)
    if t is m.InitProducerIdRequest:
        return m.InitProducerIdResponse(error_code=code, current_leader=cl, error_message=message)
    if t is m.VoteRequest:
        return m.VoteResponse(error_code=code, leader_id=cl.leader_id, leader_epoch=cl.leader_epoch)
    if t is m.BeginQuorumEpochRequest:
        return m.BeginQuorumEpochResponse(error_code=code, leader_id=cl.leader_id, leader_epoch=cl.leader_epoch)
    if t is m.EndQuorumEpochRequest:
        return m.EndQuorumEpochResponse(error_code=code, leader_id=cl.leader_id, leader_epoch=cl.leader_epoch)
    if t is m.DescribeQuorumRequest:
        return m.DescribeQuorumResponse(error_code=code, leader_id=cl.leader_id, leader_epoch=cl.leader_epoch)
    if t is m.ControllerCommandRequest:
        return m.ControllerCommandResponse(error_code=code, error_message=message, current_leader=cl)
    if t is m.ConsistencyCheckRequest:
        return m.ConsistencyCheckResponse(error_code=code, error_message=message)
    if t is m.AddRaftVoterRequest:
        return m.AddRaftVoterResponse(error_code=code, error_message=message)
    if t is m.RemoveRaftVoterRequest:
        return m.RemoveRaftVoterResponse(error_code=code, error_message=message)
    if t is m.UpdateRaftVoterRequest:
        return m.UpdateRaftVoterResponse(error_code=code, error_message=message, current_leader=cl)
    if isinstance(req, m.UpdateFeaturesRequest):
        return m.UpdateFeaturesResponse(error_code=code, error_message=message, results=[
            m.UpdatableFeatureResult(u.feature, code, message) for u in req.feature_updates])
    return m.ErrorResponse(error_code=code, error_message=message or "")


def check_cluster_id(expected: str, req: m.Body, current_leader: m.LeaderIdAndEpoch) -> m.Body | None:
    """None if `req` carries no cluster id or ours; else the
    INCONSISTENT_CLUSTER_ID answer naming both ids."""
    got = getattr(req, "cluster_id", None)
    if got is None or got == expected:
        return None
    return error_response(req, Errors.INCONSISTENT_CLUSTER_ID,
                          f"cluster id {got!r} does not match ours {expected!r}", current_leader)


# kraft.version levels this build supports (KIP-853): 0 static voters, 1 the set in the log.
KRAFT_VERSION_MIN, KRAFT_VERSION_MAX = 0, 1
# The core says which features it supports; the api version ranges are the
# listener's (metalog.broker.server.kafka: each port answers ApiVersions with
# the versions its handlers serve), so the core's answer lists no api.
_API_VERSIONS = m.ApiVersionsResponse(
    api_keys=[],
    supported_features=[m.SupportedFeature(m.KRAFT_VERSION_FEATURE, KRAFT_VERSION_MIN, KRAFT_VERSION_MAX)])


def api_versions_response(kraft_version: int | None = None, features_epoch: int = -1) -> m.ApiVersionsResponse:
    """The features this build supports (immutable: shared; the api ranges
    are the listener's, see _API_VERSIONS). With `kraft_version` (the committed
    level this node knows; `features_epoch` the offset that set it) the
    answer also carries it as finalized, as Kafka's ApiVersions v3 does."""
    if kraft_version is None:
        return _API_VERSIONS
    return m.ApiVersionsResponse(
        api_keys=_API_VERSIONS.api_keys, supported_features=_API_VERSIONS.supported_features,
        finalized_features_epoch=features_epoch,
        finalized_features=[m.FinalizedFeature(m.KRAFT_VERSION_FEATURE, kraft_version, kraft_version)])


def metadata_response(*, cluster_id: str, node_id: int, leader_id: int, leader_epoch: int,
                      high_watermark: int, log_start_offset: int, voters: Iterable[int],
                      observers: Iterable[int],
                      endpoints: Mapping[int, tuple[str, int]] | None = None) -> m.MetadataResponse:
    """Leader, epoch, HW and log start as this node knows them. Voters carry
    their endpoint from `endpoints` (the runtime's configuration); without one
    (the pure core), and always for observers (known to the leader only by
    their fetches), host "" and port 0."""
    ep = endpoints or {}
    return m.MetadataResponse(
        cluster_id=cluster_id, node_id=node_id, leader_id=leader_id, leader_epoch=leader_epoch,
        high_watermark=high_watermark, log_start_offset=log_start_offset,
        voters=[m.NodeEndpoint(v, *ep.get(v, ("", 0))) for v in voters],
        observers=[m.NodeEndpoint(o, "", 0) for o in observers],
    )
