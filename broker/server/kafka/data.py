"""The data path in Kafka's protocol (issue 32 item 3): Produce v3-v10,
Fetch v4-v17 (consumers here; a replica's, ReplicaId >= 0, in ``quorum.py``), ListOffsets v1-v7, InitProducerId v0-v4 and
OffsetForLeaderEpoch v2-v4, each mapped onto the broker's own handlers
through ``KafkaContext.ask`` (see the package docstring), so a Kafka client
meets the same refusals, ACLs, group commit, idempotence and long-poll as
our own client.

The log is one partition: ``__cluster_metadata`` partition 0 (Kafka's fixed
topic id for Fetch v13+). Any other topic or partition is answered
UNKNOWN_TOPIC_OR_PARTITION (by id: UNKNOWN_TOPIC_ID), per partition, as
Kafka answers it; the rest of the request is served.

* Produce: the partition's Records must be one RecordBatch v2, checked whole
  (``batch_check``: CRC -> CORRUPT_MESSAGE, records, no compression) and
  handed to the produce path as built (``PrebuiltProduce``): stored with the
  client's keys, values, headers and timestamps; only the base offset and
  partition leader epoch are assigned on append. acks=-1 and acks=1 are
  both answered once the batch is committed (the path answers at commit
  only: acks=1 is acks=-1 here, docs/kafka-listener.md); acks=0 gets no
  answer. The batch's producer fields are judged by the producer state (up
  to 5 batches remembered per producer, a duplicate answered with its
  original's offset, OUT_OF_ORDER_SEQUENCE_NUMBER, INVALID_PRODUCER_EPOCH,
  UNKNOWN_PRODUCER_ID). A non-leader answers NOT_LEADER_OR_FOLLOWER with
  CurrentLeader and the leader's endpoint (v10's tagged fields).
* Fetch (replica id -1): the consumer read of the core (committed records
  only, long-poll up to MaxWaitMs while nothing is there, KIP-320 fencing),
  records as the log stores them; LastStableOffset = HighWatermark (no
  transactions), AbortedTransactions empty, PreferredReadReplica -1,
  sessionless (SessionId 0: every fetch is a full one). An offset only a
  snapshot covers (below the log start) is OFFSET_OUT_OF_RANGE, as Kafka
  answers a consumer below its log start; past the end too.
* ListOffsets: earliest (-2), latest (-1, the high watermark), by timestamp
  (the first batch whose max timestamp reaches it); -3 (max timestamp,
  KIP-734) is not served (UNSUPPORTED_VERSION for that partition).
* OffsetForLeaderEpoch: the end offset of the asked epoch, capped at the
  high watermark for a consumer (KIP-320's truncation check).
* InitProducerId: a fresh producer id from the leader (no transactions: a
  transactional id is refused).
"""

from __future__ import annotations

from typing import Any, Callable

from metalog.broker.net.kafka_conn import KafkaExchange
from metalog.broker.server.kafka.api import (CONTROLLER_LISTENER, METADATA_PARTITION, METADATA_TOPIC,
                                             METADATA_TOPIC_ID, KafkaApi, KafkaContext)
from metalog.broker.server.kafka import quorum
from metalog.broker.server.kafka.batch_check import check_batch
from metalog.broker.server.produce import PrebuiltProduce
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.protocol.errors import Errors
from metalog.protocol.kafka import messages as km

UNKNOWN_TOPIC_ID = 100
TRANSACTIONAL_ID_NOT_SERVED = Errors.INVALID_REQUEST  # no transaction coordinator here
LIST_OFFSETS_MAX_TIMESTAMP = -3
_NO_LEADER = (m.NO_LEADER, m.NO_EPOCH)


class _Gather:
    """One Kafka request's partitions, answered when the last one is: each
    partition's slot filled now (an error at the edge) or when the broker's
    handler answers (``ask``). Responds once, in the request's order."""

    def __init__(self, ex: KafkaExchange, build: Callable[[], Any]):
        self._ex = ex
        self._build = build  # the whole response, from the filled slots
        self._waiting = 1  # the request's own walk, closed by done()
        self.silent = False  # acks=0: nothing is sent, whatever the answers

    def ask(self, ctx: KafkaContext, api_key: ApiKey, body: Any, fill: Callable[[Any], None]) -> None:
        self._waiting += 1

        def on_answer(resp: Any) -> None:
            fill(resp)
            self._one_done()

        ctx.ask(self._ex, api_key, body, on_answer)

    def done(self) -> None:
        """Every partition is asked or filled."""
        self._one_done()

    def _one_done(self) -> None:
        self._waiting -= 1
        if self._waiting == 0 and not self.silent:
            self._ex.respond(self._build())


def _leader_endpoint(ctx: KafkaContext, leader: m.LeaderIdAndEpoch | None) -> list[tuple[int, str, int]]:
    """The leader's Kafka endpoint for NodeEndpoints (clients refresh from it)."""
    if leader is None or leader.leader_id < 0:
        return []
    ep = ctx.endpoints().get(leader.leader_id)
    return [] if ep is None else [(leader.leader_id, ep[0], ep[1])]


def _ours(name: str, partition: int) -> bool:
    return name == METADATA_TOPIC and partition == METADATA_PARTITION


# -------------------------------------------------------------------- Produce
def produce(ctx: KafkaContext, ex: KafkaExchange) -> None:
    req = ex.body
    version = ex.version
    topics: list[km.ProduceResponseTopicProduceResponse] = []
    leaders: dict[int, m.LeaderIdAndEpoch] = {}

    def build() -> km.ProduceResponse:
        out = km.ProduceResponse(responses=topics)
        if version >= 10:
            out.node_endpoints = [km.ProduceResponseNodeEndpoint(node_id=nid, host=host, port=port)
                                  for leader in leaders.values() for nid, host, port in _leader_endpoint(ctx, leader)]
        return out

    gather = _Gather(ex, build)
    if req.acks == 0:
        gather.silent = True
        ex.respond_nothing()  # Kafka never answers acks=0; later answers may leave
    for t in req.topic_data:
        parts: list[km.ProduceResponsePartitionProduceResponse] = []
        topics.append(km.ProduceResponseTopicProduceResponse(name=t.name, partition_responses=parts))
        for p in t.partition_data:
            slot = km.ProduceResponsePartitionProduceResponse(index=p.index, base_offset=-1)
            parts.append(slot)
            if not _ours(t.name, p.index):
                slot.error_code = Errors.UNKNOWN_TOPIC_OR_PARTITION
            elif req.acks not in (0, 1, -1):
                slot.error_code = 21  # INVALID_REQUIRED_ACKS
            elif req.transactional_id is not None:
                slot.error_code, slot.error_message = TRANSACTIONAL_ID_NOT_SERVED, "no transactions in metalog"
            else:
                _produce_partition(ctx, gather, slot, p.records, leaders, version)
    gather.done()


def _produce_partition(ctx: KafkaContext, gather: _Gather, slot: Any, records: Any,
                       leaders: dict[int, m.LeaderIdAndEpoch], version: int) -> None:
    checked = check_batch(records)
    if not isinstance(checked, PrebuiltProduce):
        slot.error_code, message = checked
        if version >= 8:
            slot.error_message = message
        return

    def fill(resp: m.ProduceResponse) -> None:
        slot.error_code = resp.error_code
        if resp.error_code == Errors.NONE:
            slot.base_offset = resp.base_offset
            return
        if version >= 8:
            slot.error_message = resp.error_message
        if resp.current_leader is not None and version >= 10:
            slot.current_leader = km.ProduceResponseLeaderIdAndEpoch(
                leader_id=resp.current_leader.leader_id, leader_epoch=resp.current_leader.leader_epoch)
            if resp.error_code == Errors.NOT_LEADER_OR_FOLLOWER:
                leaders[resp.current_leader.leader_id] = resp.current_leader

    gather.ask(ctx, ApiKey.PRODUCE, checked, fill)


# --------------------------------------------------------------------- Fetch
def fetch(ctx: KafkaContext, ex: KafkaExchange) -> None:
    req = ex.body
    version = ex.version
    replica_id = req.replica_id if version <= 14 else req.replica_state.replica_id
    topics: list[km.FetchResponseFetchableTopicResponse] = []
    leaders: dict[int, m.LeaderIdAndEpoch] = {}

    def build() -> km.FetchResponse:
        out = km.FetchResponse(responses=topics)
        if replica_id >= 0:  # about the request as a whole: Kafka's raft leader says so at the top level
            out.error_code = next((p.error_code for t in topics for p in t.partitions
                                   if p.error_code in quorum.TOP_LEVEL_ERRORS), Errors.NONE)
        if version >= 16:
            out.node_endpoints = [km.FetchResponseNodeEndpoint(node_id=nid, host=host, port=port)
                                  for leader in leaders.values() for nid, host, port in _leader_endpoint(ctx, leader)]
        return out

    gather = _Gather(ex, build)
    # MinBytes 0: answer now; else wait while nothing is committed past the
    # offset (the core's consumer long-poll: any committed record ends it).
    max_wait_ms = max(req.max_wait_ms, 0) if req.min_bytes > 0 else 0
    for t in req.topics:
        parts: list[km.FetchResponsePartitionData] = []
        topics.append(km.FetchResponseFetchableTopicResponse(topic=t.topic, topic_id=t.topic_id, partitions=parts))
        known = t.topic_id == METADATA_TOPIC_ID if version >= 13 else t.topic == METADATA_TOPIC
        for p in t.partitions:
            slot = km.FetchResponsePartitionData(partition_index=p.partition, high_watermark=-1, records=b"")
            parts.append(slot)
            if not known or p.partition != METADATA_PARTITION:
                slot.error_code = UNKNOWN_TOPIC_ID if version >= 13 and not known else Errors.UNKNOWN_TOPIC_OR_PARTITION
            elif replica_id >= 0 and ctx.listener_name != CONTROLLER_LISTENER:
                # Replicas fetch on the controller listener only (as from a
                # Kafka broker, which hosts no replica of the metadata log).
                slot.error_code = Errors.UNKNOWN_TOPIC_OR_PARTITION
            elif replica_id >= 0:  # a replica (quorum.py): raft's semantics, the replica-identity gate
                gather.ask(ctx, ApiKey.FETCH, quorum.replica_fetch_body(ctx, req, p, replica_id, version),
                           quorum.replica_fetch_fill(slot, version, leaders))
            else:
                body = m.FetchRequest(
                    cluster_id=ctx.cluster_id, replica_id=m.CONSUMER_REPLICA_ID, max_wait_ms=max_wait_ms,
                    current_leader_epoch=p.current_leader_epoch, fetch_offset=p.fetch_offset,
                    last_fetched_epoch=p.last_fetched_epoch if version >= 12 else m.NO_EPOCH,
                    max_bytes=max(1, min(p.partition_max_bytes, req.max_bytes)))
                gather.ask(ctx, ApiKey.FETCH, body, _fetch_fill(slot, leaders, version))
    gather.done()


def _fetch_fill(slot: km.FetchResponsePartitionData, leaders: dict[int, m.LeaderIdAndEpoch],
                version: int) -> Callable[[m.FetchResponse], None]:
    def fill(resp: m.FetchResponse) -> None:
        code = resp.error_code
        if code == Errors.NONE and resp.snapshot_id is not None:
            code = Errors.OFFSET_OUT_OF_RANGE  # below the log start: a consumer resets, as with Kafka
        slot.error_code = code
        slot.high_watermark = resp.high_watermark
        slot.last_stable_offset = resp.high_watermark  # no transactions: nothing is unstable
        slot.log_start_offset = resp.log_start_offset
        if code == Errors.NONE and resp.snapshot_id is None:
            slot.records = resp.records
        if version >= 12:
            if resp.diverging_epoch is not None:
                slot.diverging_epoch = km.FetchResponseEpochEndOffset(epoch=resp.diverging_epoch.epoch,
                                                                      end_offset=resp.diverging_epoch.end_offset)
            if resp.current_leader is not None:
                slot.current_leader = km.FetchResponseLeaderIdAndEpoch(
                    leader_id=resp.current_leader.leader_id, leader_epoch=resp.current_leader.leader_epoch)
        if code == Errors.NOT_LEADER_OR_FOLLOWER and resp.current_leader is not None:
            leaders[resp.current_leader.leader_id] = resp.current_leader

    return fill


# --------------------------------------------------------------- ListOffsets
def list_offsets(ctx: KafkaContext, ex: KafkaExchange) -> None:
    req = ex.body
    topics: list[km.ListOffsetsResponseListOffsetsTopicResponse] = []
    gather = _Gather(ex, lambda: km.ListOffsetsResponse(topics=topics))
    for t in req.topics:
        parts: list[km.ListOffsetsResponseListOffsetsPartitionResponse] = []
        topics.append(km.ListOffsetsResponseListOffsetsTopicResponse(name=t.name, partitions=parts))
        for p in t.partitions:
            slot = km.ListOffsetsResponseListOffsetsPartitionResponse(partition_index=p.partition_index)
            parts.append(slot)
            if not _ours(t.name, p.partition_index):
                slot.error_code = Errors.UNKNOWN_TOPIC_OR_PARTITION
            elif p.timestamp < m.LIST_OFFSETS_EARLIEST:
                slot.error_code = Errors.UNSUPPORTED_VERSION  # -3 max timestamp, -4/-5 tiered: not served
            else:
                body = m.ListOffsetsRequest(cluster_id=ctx.cluster_id, current_leader_epoch=p.current_leader_epoch,
                                            timestamp_ms=p.timestamp)
                gather.ask(ctx, ApiKey.LIST_OFFSETS, body, _list_offsets_fill(slot, ex.version))
    gather.done()


def _list_offsets_fill(slot: Any, version: int) -> Callable[[m.ListOffsetsResponse], None]:
    def fill(resp: m.ListOffsetsResponse) -> None:
        slot.error_code = resp.error_code
        if resp.error_code == Errors.NONE:
            slot.offset, slot.timestamp = resp.offset, resp.timestamp_ms
            if version >= 4:
                slot.leader_epoch = resp.leader_epoch

    return fill


# ------------------------------------------------------- OffsetForLeaderEpoch
def offset_for_leader_epoch(ctx: KafkaContext, ex: KafkaExchange) -> None:
    req = ex.body
    topics: list[km.OffsetForLeaderEpochResponseOffsetForLeaderTopicResult] = []
    gather = _Gather(ex, lambda: km.OffsetForLeaderEpochResponse(topics=topics))
    for t in req.topics:
        parts: list[km.OffsetForLeaderEpochResponseEpochEndOffset] = []
        topics.append(km.OffsetForLeaderEpochResponseOffsetForLeaderTopicResult(topic=t.topic, partitions=parts))
        for p in t.partitions:
            slot = km.OffsetForLeaderEpochResponseEpochEndOffset(partition=p.partition)
            parts.append(slot)
            if not _ours(t.topic, p.partition):
                slot.error_code = Errors.UNKNOWN_TOPIC_OR_PARTITION
            else:  # a replica (ReplicaId >= 0) is judged by the replica-identity gate
                body = m.OffsetsForLeaderEpochRequest(
                    cluster_id=ctx.cluster_id, replica_id=max(req.replica_id, m.CONSUMER_REPLICA_ID),
                    current_leader_epoch=p.current_leader_epoch, leader_epoch=p.leader_epoch)
                gather.ask(ctx, ApiKey.OFFSET_FOR_LEADER_EPOCH, body, _epoch_fill(slot))
    gather.done()


def _epoch_fill(slot: km.OffsetForLeaderEpochResponseEpochEndOffset) -> Callable[[Any], None]:
    def fill(resp: m.OffsetsForLeaderEpochResponse) -> None:
        slot.error_code = resp.error_code
        if resp.error_code == Errors.NONE:
            slot.leader_epoch, slot.end_offset = resp.leader_epoch, resp.end_offset

    return fill


# ------------------------------------------------------------- InitProducerId
def init_producer_id(ctx: KafkaContext, ex: KafkaExchange) -> None:
    if ex.body.transactional_id is not None:
        ex.respond(km.InitProducerIdResponse(error_code=TRANSACTIONAL_ID_NOT_SERVED))
        return

    def answer(resp: m.InitProducerIdResponse) -> None:
        if resp.error_code != Errors.NONE:
            # A follower cannot hand out ids (they come from the leader's
            # epoch): the client retries, at the leader once it asks it.
            ex.respond(km.InitProducerIdResponse(error_code=_init_error(resp.error_code)))
            return
        ex.respond(km.InitProducerIdResponse(producer_id=resp.producer_id, producer_epoch=resp.producer_epoch))

    ctx.ask(ex, ApiKey.INIT_PRODUCER_ID, m.InitProducerIdRequest(cluster_id=ctx.cluster_id), answer)


def _init_error(code: int) -> int:
    """A follower's refusal as a coordinator's retriable one: Kafka's clients
    ask any broker for an idempotent producer id and retry elsewhere on
    COORDINATOR_NOT_AVAILABLE (librdkafka after 500 ms, at a random broker)."""
    return COORDINATOR_NOT_AVAILABLE if code in (Errors.NOT_LEADER_OR_FOLLOWER, Errors.LEADER_NOT_AVAILABLE) else code


COORDINATOR_NOT_AVAILABLE = 15

APIS: dict[int, KafkaApi] = {
    ApiKey.PRODUCE: KafkaApi(km.ProduceRequest, 3, 10, produce),
    ApiKey.FETCH: KafkaApi(km.FetchRequest, 4, 17, fetch),
    ApiKey.LIST_OFFSETS: KafkaApi(km.ListOffsetsRequest, 1, 7, list_offsets),
    ApiKey.INIT_PRODUCER_ID: KafkaApi(km.InitProducerIdRequest, 0, 4, init_producer_id),
    ApiKey.OFFSET_FOR_LEADER_EPOCH: KafkaApi(km.OffsetForLeaderEpochRequest, 2, 4, offset_for_leader_epoch),
}
