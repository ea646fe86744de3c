"""The async Python client of a metalog cluster: produce, consume, metadata.

``MetalogClient`` finds the cluster from a bootstrap list (MetadataRequest to
any reachable node), tracks the leader (from Metadata answers and from the
``current_leader`` hint carried by NOT_LEADER_OR_FOLLOWER / FENCED_LEADER_EPOCH
/ UNKNOWN_LEADER_EPOCH answers) and retries retriable failures with
exponential backoff, at most ``max_retries`` times and never past the call's
``delivery_timeout_ms``. Each attempt waits at most ``request_timeout_ms``
(Kafka's request.timeout.ms vs delivery.timeout.ms); an attempt that times out
or breaks marks that broker suspect, so rediscovery asks the others first and
a frozen leader costs one attempt, not one per retry. Permanent refusals (a
controller command naming an unknown broker, an invalid request, a record
larger than ``max_request_bytes``) fail at once with their message. ``produce``
splits many records into requests of at most ``max_request_bytes``.

Idempotent by default (``idempotent=True``, KIP-98): the client obtains a
producer id once (InitProducerId), numbers its records per producer (each
request carries the sequence of its first record) and a retry of a request
reuses its sequence, so the leader answers a retry of an already appended
request with the original offset instead of appending it again: a produce
call that returns was stored exactly once. See docs/client.md.

``Consumer`` (``client.consumer(reset_policy)``) reads committed records with
Fetch (replica_id = CONSUMER_REPLICA_ID) and detects log truncation as KIP-320
asks of consumers:

* it remembers the leader epoch of the last record it consumed;
* after a leader change (a new leader epoch seen in metadata or in a hint, a
  FENCED_LEADER_EPOCH / UNKNOWN_LEADER_EPOCH answer) or after ``seek(offset,
  epoch)``, it asks the leader OffsetsForLeaderEpoch(last consumed epoch)
  before fetching again; a Fetch answer carrying ``diverging_epoch`` is the
  same answer delivered early;
* if the leader's end offset for that epoch is below the consumer's position,
  the records from that end offset on were truncated: with reset_policy
  "none" ``poll`` raises ``LogTruncationError(first_diverging_offset, epoch)``
  (and keeps raising until the user seeks); with "earliest" or "latest" the
  consumer resets precisely to that end offset (KIP-320's precise auto-reset;
  the policy name only matters when there is no position at all).
* an undefined answer (the leader knows no epoch <= ours) or
  OFFSET_OUT_OF_RANGE is out of range: "none" raises OffsetOutOfRangeError,
  the others reset to the earliest / latest offset via ListOffsets.

Every batch received is checked (Kafka's ``check.crcs``: header, length, CRC-32C)
before any record of it is handed out. A damaged batch raises
``CorruptRecordError`` naming the offset, the epoch and the broker that sent
it; the records before it in the same answer are returned first, and the
position stays at the damaged batch (the next poll raises). Never a silent stop.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import structlog

from metalog.broker.net.backoff import Backoff
from metalog.broker.net.channel import ConnectionLost, NetError, Overloaded, PeerChannel, RequestTimeout, TlsHandshakeError
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.protocol.errors import Errors, error_name
from metalog.storage.batch import HEADER_SIZE, CorruptBatchError, decode_header, decode_records, verify_crc

NO_EPOCH = m.NO_EPOCH
# Slack on top of a server-side wait (fetch long poll) before the client gives
# up on the answer.
NETWORK_SLACK_MS = 1000
# Bytes a record costs in a request besides its value (msgpack framing, generous).
RECORD_OVERHEAD_BYTES = 16
# Request framing besides the records (header, cluster id, timeout).
REQUEST_OVERHEAD_BYTES = 512
RETRY_BACKOFF_MAX_MS = 2000

# Answers that mean "ask again, maybe elsewhere".
LEADER_ERRORS = frozenset({
    Errors.NOT_LEADER_OR_FOLLOWER, Errors.FENCED_LEADER_EPOCH, Errors.UNKNOWN_LEADER_EPOCH,
    Errors.LEADER_NOT_AVAILABLE, Errors.BROKER_NOT_AVAILABLE,
})
RETRIABLE = LEADER_ERRORS | {Errors.REQUEST_TIMED_OUT, Errors.KAFKA_STORAGE_ERROR}


class MetalogError(Exception):
    """An error answer from the cluster, with its Kafka error code."""

    def __init__(self, error_code: int, message: str = ""):
        self.error_code = error_code
        self.error_name = error_name(error_code)
        super().__init__(f"{self.error_name}: {message}" if message else self.error_name)


AUTHORIZATION_ERRORS = frozenset({Errors.TOPIC_AUTHORIZATION_FAILED, Errors.CLUSTER_AUTHORIZATION_FAILED})


class AuthorizationError(MetalogError):
    """The cluster refused this principal (TOPIC/CLUSTER_AUTHORIZATION_FAILED):
    permanent until an admin adds an ACL, so never retried."""

    def __init__(self, error_code: int, message: str = ""):
        super().__init__(error_code, message)
        self.args = (message or f"not authorized ({self.error_name})",)


def _error(code: int, message: str) -> MetalogError:
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
    def __init__(self, position: int | None, reason: str):
        self.position = position
        super().__init__(f"consumer position {position} is out of range: {reason}")


class NoOffsetError(Exception):
    pass


@dataclass(frozen=True, slots=True)
class ConsumedRecord:
    offset: int
    leader_epoch: int
    value: bytes


# The consumer handles fencing and range errors itself (they trigger validation or reset).
_FETCH_PASSTHROUGH = frozenset({Errors.FENCED_LEADER_EPOCH, Errors.UNKNOWN_LEADER_EPOCH, Errors.OFFSET_OUT_OF_RANGE})
_FETCH_RETRIABLE = RETRIABLE - _FETCH_PASSTHROUGH


class _Revalidate(Exception):
    """The leader epoch changed under a pending fetch: validate the position first."""


@dataclass
class _Producer:
    """One idempotent producer of a client (KIP-98)."""

    producer_id: int
    producer_epoch: int
    next_sequence: int = 0


class MetalogClient:
    def __init__(
        self,
        bootstrap: Iterable[tuple[str, int]],
        cluster_id: str,
        *,
        request_timeout_ms: int = 2000,
        delivery_timeout_ms: int = 120000,  # Kafka producer's delivery.timeout.ms default
        max_request_bytes: int = 1 << 20,
        retry_backoff_ms: int = 100,
        max_retries: int = 10,
        connect_timeout_ms: int = 1000,
        client_id: str = "metalog-client",
        logger: Any = None,
        tls: Any = None,
        resolve_address: Callable[[tuple[str, int]], tuple[str, int]] | None = None,
        idempotent: bool = True,
    ):
        # tls: metalog.broker.net.tls.TlsFiles (or an ssl.SSLContext) with our client certificate; None = plaintext.
        self.tls = tls
        # resolve_address: the public hook for where to connect to a broker that Metadata
        # names at (host, port); default as advertised. E.g. the fault drill maps the
        # brokers' proxy listeners back to the brokers themselves.
        self._resolve_address = resolve_address or (lambda addr: addr)
        self.bootstrap = [(h, int(p)) for h, p in bootstrap]
        if not self.bootstrap:
            raise ValueError("bootstrap must name at least one host:port")
        self.cluster_id = cluster_id
        if request_timeout_ms <= 0 or delivery_timeout_ms < request_timeout_ms:
            raise ValueError(f"need 0 < request_timeout_ms ({request_timeout_ms}) <= delivery_timeout_ms "
                             f"({delivery_timeout_ms})")
        if max_request_bytes <= REQUEST_OVERHEAD_BYTES:
            raise ValueError(f"max_request_bytes must be > {REQUEST_OVERHEAD_BYTES}, got {max_request_bytes}")
        self.request_timeout_ms = request_timeout_ms
        self.delivery_timeout_ms = delivery_timeout_ms
        self.max_request_bytes = max_request_bytes
        # Brokers whose last attempt timed out or broke -> (leader epoch then, loop
        # time until which they are not sent requests as leader): asked last when
        # rediscovering, and not retried while metadata still names them at the
        # same epoch (a frozen leader is still "leader" to its followers until
        # they time out; polling metadata finds its successor sooner).
        self._suspects: dict[tuple[str, int], tuple[int, float]] = {}
        self.retry_backoff_ms = retry_backoff_ms
        # Between retries: doubling per attempt up to RETRY_BACKOFF_MAX_MS; while
        # polling metadata for a new leader: retry_backoff_ms each time.
        self._retry_backoff = Backoff(min(retry_backoff_ms, RETRY_BACKOFF_MAX_MS), RETRY_BACKOFF_MAX_MS)
        self._poll_backoff = Backoff(retry_backoff_ms, retry_backoff_ms)
        self.max_retries = max_retries
        self.connect_timeout_ms = connect_timeout_ms
        self.client_id = client_id
        self._log = logger if logger is not None else structlog.get_logger("metalog.client")
        self._channels: dict[tuple[str, int], PeerChannel] = {}
        self._endpoints: dict[int, tuple[str, int]] = {}
        self.leader_id = m.NO_LEADER
        self.answered_by: tuple[int, str] = (m.NO_LEADER, "")  # (node id, host:port) of the last answer
        self.leader_epoch = NO_EPOCH
        # Idempotent produce: producers (id and epoch from InitProducerId, the
        # sequence of the next record) not in use. Each produce call takes one
        # for its duration, so a producer has one request in flight and the
        # leader sees its sequences in order; concurrent calls use several
        # producers (as many as ever ran at once) instead of waiting in line.
        self.idempotent = idempotent
        self._idle_producers: list[_Producer] = []
        self.producers_initialized = 0

    # -- public calls ------------------------------------------------------

    async def metadata(self) -> m.MetadataResponse:
        """Fresh metadata from the first node that answers (the leader first if known)."""
        return await self._refresh_metadata()

    async def describe_quorum(self) -> m.DescribeQuorumResponse:
        return await self._leader_request(
            ApiKey.DESCRIBE_QUORUM, lambda: m.DescribeQuorumRequest(), self.request_timeout_ms
        )

    async def list_offsets(self, timestamp_ms: int, current_leader_epoch: int = NO_EPOCH) -> m.ListOffsetsResponse:
        """Offset for LIST_OFFSETS_EARLIEST, LIST_OFFSETS_LATEST or a timestamp, with its epoch.

        With an explicit current_leader_epoch the answer is fenced (KIP-320): a
        FENCED_LEADER_EPOCH / UNKNOWN_LEADER_EPOCH answer is raised as
        MetalogError instead of retried, since retrying cannot change it.
        """
        retriable = RETRIABLE
        if current_leader_epoch != NO_EPOCH:
            retriable = RETRIABLE - {Errors.FENCED_LEADER_EPOCH, Errors.UNKNOWN_LEADER_EPOCH}
        return await self._leader_request(
            ApiKey.LIST_OFFSETS,
            lambda: m.ListOffsetsRequest(cluster_id=self.cluster_id, current_leader_epoch=current_leader_epoch,
                                         timestamp_ms=timestamp_ms),
            self.request_timeout_ms, retriable=retriable,
        )

    @property
    def _server_wait_ms(self) -> int:
        """How long the leader may wait for a commit: below request_timeout_ms, so
        its REQUEST_TIMED_OUT answer arrives before the attempt gives up."""
        return max(1, self.request_timeout_ms * 3 // 4)

    def split_requests(self, records: list[bytes]) -> list[list[bytes]]:
        """Consecutive chunks of `records`, each fitting in max_request_bytes."""
        budget = self.max_request_bytes - REQUEST_OVERHEAD_BYTES
        chunks: list[list[bytes]] = []
        current: list[bytes] = []
        size = 0
        for i, value in enumerate(records):
            cost = len(value) + RECORD_OVERHEAD_BYTES
            if cost > budget:
                raise MetalogError(Errors.MESSAGE_TOO_LARGE,
                                   f"record {i} has {len(value)} bytes; max_request_bytes "
                                   f"{self.max_request_bytes} fits at most {budget - RECORD_OVERHEAD_BYTES}")
            if current and size + cost > budget:
                chunks.append(current)
                current, size = [], 0
            current.append(value)
            size += cost
        if current:
            chunks.append(current)
        return chunks

    async def produce(self, records: list[bytes]) -> tuple[int, int]:
        """Append `records` and wait for commit; returns (base_offset, leader_epoch)
        of the first record.

        Records beyond max_request_bytes go in several requests, in order, each
        committed before the next is sent: the records of one request are
        consecutive, but another producer's records may fall between two
        requests, and if a later request fails the earlier ones stay appended.
        Retried on leader changes and timeouts within delivery_timeout_ms.
        Idempotent (the default): every retry of a request carries the same
        producer id, epoch and sequence, and the leader answers a retry of an
        appended request with its original offset, so each record is stored
        once. If a request fails for good (the call raises), the client takes
        a new producer id for the next call: the failed request may or may not
        be stored. With ``idempotent=False`` a retry after a lost answer can
        store the records twice (at-least-once).
        """
        if not records:
            raise ValueError("produce needs at least one record")
        chunks = self.split_requests(records)
        if not self.idempotent:
            first: tuple[int, int] | None = None
            for chunk in chunks:
                resp = await self._leader_request(
                    ApiKey.PRODUCE,
                    lambda chunk=chunk: m.ProduceRequest(cluster_id=self.cluster_id, records=chunk,
                                                         timeout_ms=self._server_wait_ms),
                    self.request_timeout_ms,
                )
                if first is None:
                    first = (resp.base_offset, resp.leader_epoch)
            assert first is not None
            return first
        producer = self._idle_producers.pop() if self._idle_producers else None
        first: tuple[int, int] | None = None
        for chunk in chunks:
            producer, resp = await self._produce_chunk(producer, chunk)
            if first is None:
                first = (resp.base_offset, resp.leader_epoch)
        assert first is not None and producer is not None
        # Only a producer whose every request was answered is used again: after a
        # failure its next sequence could not be judged against the unknown outcome.
        self._idle_producers.append(producer)
        return first

    async def init_producer_id(self) -> tuple[int, int]:
        """A new producer id and epoch from the leader (InitProducerId)."""
        resp = await self._leader_request(
            ApiKey.INIT_PRODUCER_ID,
            lambda: m.InitProducerIdRequest(cluster_id=self.cluster_id, timeout_ms=self._server_wait_ms),
            self.request_timeout_ms,
        )
        self.producers_initialized += 1
        self._log.debug("producer_id_initialized", producer_id=resp.producer_id, producer_epoch=resp.producer_epoch)
        return resp.producer_id, resp.producer_epoch

    async def _produce_chunk(self, producer: "_Producer | None",
                             chunk: list[bytes]) -> tuple["_Producer", m.ProduceResponse]:
        """One request of an idempotent producer, retried with the same
        sequence; UNKNOWN_PRODUCER_ID (its state expired on the leader) takes a
        new producer id once and sends the request again as its first."""
        for renewal in range(2):
            if producer is None:
                producer = _Producer(*await self.init_producer_id())
            pid, epoch, seq = producer.producer_id, producer.producer_epoch, producer.next_sequence
            resp = await self._leader_request(
                ApiKey.PRODUCE,
                # Every attempt of this request carries the same producer fields.
                lambda: m.ProduceRequest(cluster_id=self.cluster_id, records=chunk, timeout_ms=self._server_wait_ms,
                                         producer_id=pid, producer_epoch=epoch, base_sequence=seq),
                self.request_timeout_ms,
                passthrough=frozenset({Errors.UNKNOWN_PRODUCER_ID}) if renewal == 0 else frozenset(),
            )
            if resp.error_code == Errors.NONE:
                producer.next_sequence = seq + len(chunk)
                return producer, resp
            self._log.info("producer_id_unknown", producer_id=pid, message=resp.error_message)
            producer = None
        raise AssertionError("unreachable: the second attempt raises or succeeds")

    async def command(self, command: str, **args: Any) -> tuple[int, int]:
        """Run a controller command on the leader (create_topic, delete_topic,
        register_broker, unregister_broker, fence_broker, unfence_broker,
        set_config); returns (base_offset, leader_epoch) once its records are
        committed. A refused command raises MetalogError with the controller's
        message (e.g. "topic 'x' already exists"). Like produce, a retry after
        a timeout may run the command twice; the second run is then refused or
        a no-op by the controller's validation."""
        resp = await self._leader_request(
            ApiKey.CONTROLLER_COMMAND,
            lambda: m.ControllerCommandRequest(cluster_id=self.cluster_id, command=command, args=args,
                                               timeout_ms=self._server_wait_ms),
            self.request_timeout_ms,
        )
        return resp.base_offset, resp.leader_epoch

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

    async def list_acls(self) -> list[dict]:
        """Every ACL in the leader's committed state (needs Describe on the
        cluster), by id, read a page of up to 1000 at a time."""
        acls: list[dict] = []
        after = None
        while True:
            args = {} if after is None else {"after": after}
            resp = await self._leader_request(
                ApiKey.CONTROLLER_COMMAND,
                lambda: m.ControllerCommandRequest(cluster_id=self.cluster_id, command="list_acls", args=args,
                                                   timeout_ms=self.request_timeout_ms),
                self.request_timeout_ms + NETWORK_SLACK_MS,
            )
            page = resp.result or {}
            if isinstance(page, list):  # a broker from before paging answers every ACL at once
                return page
            acls += page["acls"]
            after = page["next"]
            if after is None:
                return acls

    def consumer(self, reset_policy: str = "earliest") -> Consumer:
        return Consumer(self, reset_policy)

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for ch in channels.values():
            await ch.close()

    # -- leader tracking -----------------------------------------------------

    def _channel(self, addr: tuple[str, int]) -> PeerChannel:
        ch = self._channels.get(addr)
        if ch is None:
            ch = self._channels[addr] = PeerChannel(
                addr[0], addr[1], client_id=self.client_id, connect_timeout_ms=self.connect_timeout_ms,
                reconnect_backoff_ms=self.retry_backoff_ms, logger=self._log, tls=self.tls,
            )
        return ch

    def _set_leader(self, leader_id: int, leader_epoch: int) -> None:
        if leader_epoch < self.leader_epoch:
            return  # stale news
        if (leader_id, leader_epoch) != (self.leader_id, self.leader_epoch):
            self._log.info("leader_changed", leader_id=leader_id, leader_epoch=leader_epoch,
                           previous_leader_id=self.leader_id, previous_epoch=self.leader_epoch)
        self.leader_id = leader_id
        self.leader_epoch = leader_epoch

    def _apply_hint(self, hint: m.LeaderIdAndEpoch | None) -> bool:
        """Take a current_leader hint; True if it names a leader we can reach now."""
        if hint is None or hint.leader_epoch < self.leader_epoch:
            return False
        self._set_leader(hint.leader_id, hint.leader_epoch)
        return hint.leader_id != m.NO_LEADER and hint.leader_id in self._endpoints

    async def _refresh_metadata(self) -> m.MetadataResponse:
        candidates: list[tuple[str, int]] = []
        if self.leader_id in self._endpoints:
            candidates.append(self._endpoints[self.leader_id])
        candidates += [a for a in self._endpoints.values() if a not in candidates]
        candidates += [a for a in self.bootstrap if a not in candidates]
        # A broker that just timed out is probably frozen or gone: ask it last.
        candidates.sort(key=lambda a: a in self._suspects)
        failures = []
        tls_failure: TlsHandshakeError | None = None
        for addr in candidates:
            try:
                resp = await self._channel(addr).request(ApiKey.METADATA, m.MetadataRequest(), self.request_timeout_ms)
            except TlsHandshakeError as exc:
                tls_failure = tls_failure or exc
                failures.append(str(exc))
                continue
            except NetError as exc:
                failures.append(f"{addr[0]}:{addr[1]}: {exc}")
                continue
            if resp.error_code in AUTHORIZATION_ERRORS:
                raise AuthorizationError(resp.error_code, resp.error_message or "")  # another node says the same
            if resp.error_code != Errors.NONE:
                failures.append(f"{addr[0]}:{addr[1]}: {error_name(resp.error_code)}")
                continue
            if resp.cluster_id != self.cluster_id:
                failures.append(
                    f"{addr[0]}:{addr[1]}: cluster id {resp.cluster_id!r}, expected {self.cluster_id!r}"
                )
                continue
            for node in [*resp.voters, *resp.observers]:
                self._endpoints[node.node_id] = self._resolve_address((node.host, node.port))
            self._set_leader(resp.leader_id, resp.leader_epoch)
            return resp
        if tls_failure is not None:
            raise TlsFailure(str(tls_failure))
        raise ClusterUnavailable("no node answered Metadata: " + "; ".join(failures))

    async def _backoff(self, attempt: int) -> None:
        await asyncio.sleep(self._retry_backoff.delay_ms(attempt, random) / 1000)

    async def _leader_request(
        self,
        api_key: ApiKey,
        make_body: Callable[[], m.Body],
        timeout_ms: int,
        retriable: frozenset[int] = RETRIABLE,
        passthrough: frozenset[int] = frozenset(),
    ) -> Any:
        """Send to the leader, retrying per `retriable`; answers with a code in
        `passthrough` are returned; any other error code is raised as MetalogError.

        `make_body` is called per attempt, so bodies pick up the latest leader
        epoch. Exceptions it raises propagate (the consumer uses that).
        """
        last_error: Exception | None = None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.delivery_timeout_ms / 1000
        attempts = 0
        attempt = 0
        polling = False
        while attempt <= self.max_retries:  # bounded too by the deadline (every turn sleeps or sends)
            if polling:
                await asyncio.sleep(self._poll_backoff.delay_ms(1, random) / 1000)
            elif attempt:
                await self._backoff(attempt)
            polling = False
            remaining_ms = int((deadline - loop.time()) * 1000)
            if remaining_ms <= 0:
                break
            if self.leader_id not in self._endpoints:
                try:
                    await self._refresh_metadata()
                except TlsFailure:
                    raise
                except ClusterUnavailable as exc:
                    last_error = exc
                    attempt += 1
                    attempts += 1
                    continue
                if self.leader_id not in self._endpoints:
                    last_error = MetalogError(Errors.LEADER_NOT_AVAILABLE, "metadata names no reachable leader")
                    attempt += 1
                    attempts += 1
                    continue
            addr = self._endpoints[self.leader_id]
            suspect = self._suspects.get(addr)
            if suspect is not None and suspect[0] == self.leader_epoch and loop.time() < suspect[1]:
                # Metadata still names the leader that just timed out, at the same epoch:
                # poll metadata (not counted as an attempt) until a new leader appears.
                self.leader_id = m.NO_LEADER
                polling = True
                continue
            attempt += 1
            attempts += 1
            ch = self._channel(addr)
            try:
                resp = await ch.request(api_key, make_body(), min(timeout_ms, remaining_ms))
                self.answered_by = (self.leader_id, f"{addr[0]}:{addr[1]}")
                self._suspects.pop(addr, None)
            except Overloaded as exc:
                last_error = exc
                continue
            except TlsHandshakeError as exc:
                raise TlsFailure(str(exc)) from None
            except (RequestTimeout, ConnectionLost) as exc:
                last_error = exc
                # Maybe dead or frozen: rediscover, asking others first, and do not send
                # to it again at this epoch for one request timeout.
                self._suspects[addr] = (self.leader_epoch, loop.time() + self.request_timeout_ms / 1000)
                self.leader_id = m.NO_LEADER
                continue
            code = resp.error_code
            if code == Errors.NONE or code in passthrough:
                return resp
            message = getattr(resp, "error_message", None) or ""
            if code not in retriable or (code == Errors.BROKER_NOT_AVAILABLE and message):
                # BROKER_NOT_AVAILABLE with a message is the controller refusing a
                # command about a broker that is unknown or not live: asking again
                # cannot change it. Without one, the broker itself is not ready.
                raise _error(code, message)
            last_error = MetalogError(code, message)
            if code in LEADER_ERRORS and not self._apply_hint(getattr(resp, "current_leader", None)):
                if code != Errors.UNKNOWN_LEADER_EPOCH:  # that one: the leader just lags; ask it again
                    self.leader_id = m.NO_LEADER
            self._log.info("retrying", api_key=api_key.name, error=error_name(code), attempt=attempt + 1,
                           leader_id=self.leader_id, leader_epoch=self.leader_epoch)
        raise ClusterUnavailable(
            f"{api_key.name} failed after {attempts} attempt(s) in {self.delivery_timeout_ms} ms "
            f"(delivery_timeout_ms) or {self.max_retries + 1} attempts (max_retries): {last_error}"
        ) from last_error


class Consumer:
    """Reads committed records in order; see the module docstring for truncation handling."""

    def __init__(self, client: MetalogClient, reset_policy: str = "earliest"):
        if reset_policy not in ("earliest", "latest", "none"):
            raise ValueError(f"reset_policy must be 'earliest', 'latest' or 'none', not {reset_policy!r}")
        self._client = client
        self.reset_policy = reset_policy
        self.position: int | None = None  # next offset to return
        self.last_epoch = NO_EPOCH  # leader epoch of the last consumed record (or of the seek)
        self._validated_leader_epoch = NO_EPOCH  # leader epoch the position was last checked under
        self._needs_validation = False
        self._max_wait_ms = 500  # of the poll in progress, read by _fetch_body

    def seek(self, offset: int, epoch: int = NO_EPOCH) -> None:
        """Continue at `offset`; with the `epoch` of the record before it, the position is validated first."""
        if offset < 0:
            raise ValueError(f"seek offset must be >= 0, not {offset}")
        self.position = offset
        self.last_epoch = epoch
        self._needs_validation = epoch != NO_EPOCH

    async def poll(self, max_wait_ms: int = 500) -> list[ConsumedRecord]:
        """Records from the position on (possibly none after max_wait_ms); advances the position."""
        c = self._client
        for attempt in range(c.max_retries + 1):
            if attempt:
                await c._backoff(attempt)
            if self.position is None:
                await self._reset()
            # Validate after every leader change; bounded, each round follows a newer epoch.
            for _ in range(c.max_retries + 1):
                if self.last_epoch == NO_EPOCH or not (
                    self._needs_validation or c.leader_epoch != self._validated_leader_epoch
                ):
                    break
                await self._validate()
            if self.position is None:
                continue  # validation found us out of range: reset first
            resp = await self._fetch_checked(max_wait_ms)
            if resp is None:
                continue  # the leader epoch moved while fetching: validate again
            code = resp.error_code
            if code in (Errors.FENCED_LEADER_EPOCH, Errors.UNKNOWN_LEADER_EPOCH):
                if not c._apply_hint(resp.current_leader) and code == Errors.FENCED_LEADER_EPOCH:
                    c.leader_id = m.NO_LEADER
                self._needs_validation = True
                continue
            if code == Errors.OFFSET_OUT_OF_RANGE:
                self._out_of_range("the leader answered OFFSET_OUT_OF_RANGE")
                continue
            if code != Errors.NONE:
                raise _error(code, resp.error_message or "")
            if resp.diverging_epoch is not None:
                d = resp.diverging_epoch
                if d.end_offset < self.position:
                    self._truncated(d.end_offset, d.epoch)
                else:
                    self._needs_validation = True
                continue
            if resp.snapshot_id is not None:
                self._out_of_range(f"offset below the log start (snapshot {resp.snapshot_id})")
                continue
            return self._take(resp)
        raise ClusterUnavailable(f"poll gave up after {c.max_retries + 1} attempts")

    # -- internals -----------------------------------------------------------

    def _fetch_body(self) -> m.FetchRequest:
        c = self._client
        if self.last_epoch != NO_EPOCH and c.leader_epoch != self._validated_leader_epoch:
            raise _Revalidate()
        assert self.position is not None
        return m.FetchRequest(
            cluster_id=c.cluster_id, replica_id=m.CONSUMER_REPLICA_ID, max_wait_ms=self._max_wait_ms,
            current_leader_epoch=c.leader_epoch, fetch_offset=self.position,
            last_fetched_epoch=self.last_epoch,
        )

    async def _fetch_checked(self, max_wait_ms: int) -> m.FetchResponse | None:
        self._max_wait_ms = max_wait_ms
        try:
            return await self._client._leader_request(
                ApiKey.FETCH, self._fetch_body, max_wait_ms + self._client.request_timeout_ms,
                retriable=_FETCH_RETRIABLE, passthrough=_FETCH_PASSTHROUGH,
            )
        except _Revalidate:
            return None

    def _take(self, resp: m.FetchResponse) -> list[ConsumedRecord]:
        assert self.position is not None
        hw = resp.high_watermark
        out: list[ConsumedRecord] = []
        records = resp.records
        view = memoryview(records)
        pos = 0
        while pos < len(view):
            try:
                h = self._checked_header(view, pos)
            except CorruptRecordError:
                if out:
                    return out  # the good records first; the next poll raises
                raise
            batch_pos, pos = pos, pos + h.size
            if h.next_offset <= self.position:
                continue
            if hw != m.NO_OFFSET and h.base_offset >= hw:
                break  # never hand out an uncommitted record, whatever the server sent
            if h.base_offset > self.position:
                # A gap would silently skip records: a server bug, never papered over.
                raise MetalogError(Errors.CORRUPT_MESSAGE,
                                   f"fetch at offset {self.position} answered from offset {h.base_offset}")
            end = h.next_offset if hw == m.NO_OFFSET else min(h.next_offset, hw)
            if not h.is_control:
                values = decode_records(view[batch_pos:batch_pos + h.size], h)
                for off in range(max(self.position, h.base_offset), end):
                    out.append(ConsumedRecord(off, h.leader_epoch, values[off - h.base_offset]))
            self.position = end
            self.last_epoch = h.leader_epoch
        return out

    def _checked_header(self, view: memoryview, pos: int):
        """The header of the batch at `pos`, after checking it is whole and its CRC."""
        try:
            left = len(view) - pos
            if left < HEADER_SIZE:
                raise CorruptBatchError(f"{left} trailing bytes, fewer than a batch header", pos)
            h = decode_header(view, pos)
            if h.size > left:
                raise CorruptBatchError(f"batch of {h.size} bytes but only {left} in the answer", pos,
                                        h.base_offset, leader_epoch=h.leader_epoch)
            verify_crc(view, pos, h)
            return h
        except CorruptBatchError as exc:
            broker_id, address = self._client.answered_by
            offset = exc.base_offset if exc.base_offset is not None else self.position
            raise CorruptRecordError(offset, exc.leader_epoch, broker_id, address, pos, str(exc)) from None

    async def _reset(self) -> None:
        if self.reset_policy == "none":
            raise NoOffsetError("consumer has no position and reset_policy='none': call seek() first")
        ts = m.LIST_OFFSETS_EARLIEST if self.reset_policy == "earliest" else m.LIST_OFFSETS_LATEST
        resp = await self._client.list_offsets(ts)
        self.position = resp.offset
        self.last_epoch = resp.leader_epoch
        self._validated_leader_epoch = self._client.leader_epoch
        self._needs_validation = False

    async def _validate(self) -> None:
        c = self._client
        used_epoch = NO_EPOCH

        def body() -> m.OffsetsForLeaderEpochRequest:
            nonlocal used_epoch
            used_epoch = c.leader_epoch
            return m.OffsetsForLeaderEpochRequest(
                cluster_id=c.cluster_id, replica_id=m.CONSUMER_REPLICA_ID,
                current_leader_epoch=used_epoch, leader_epoch=self.last_epoch,
            )

        resp = await c._leader_request(ApiKey.OFFSET_FOR_LEADER_EPOCH, body, c.request_timeout_ms)
        assert self.position is not None
        if resp.end_offset == m.NO_OFFSET or resp.leader_epoch == NO_EPOCH:
            self._out_of_range(f"the leader knows no epoch <= {self.last_epoch}")
        elif resp.end_offset < self.position:
            self._truncated(resp.end_offset, resp.leader_epoch)
        self._validated_leader_epoch = used_epoch
        self._needs_validation = False

    def _truncated(self, end_offset: int, epoch: int) -> None:
        assert self.position is not None
        self._client._log.warning("log_truncation_detected", position=self.position,
                                  diverging_offset=end_offset, epoch=epoch, reset_policy=self.reset_policy)
        if self.reset_policy == "none":
            self._needs_validation = True  # keep raising until the user seeks
            raise LogTruncationError(end_offset, epoch, self.position)
        self.position = end_offset
        self.last_epoch = epoch

    def _out_of_range(self, reason: str) -> None:
        if self.reset_policy == "none":
            raise OffsetOutOfRangeError(self.position, reason)
        self._client._log.warning("offset_out_of_range", position=self.position, reason=reason,
                                  reset_policy=self.reset_policy)
        self.position = None
        self.last_epoch = NO_EPOCH
