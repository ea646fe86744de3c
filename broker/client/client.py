"""The async Python client of a metalog cluster: produce, consume, metadata.

The shortest way in reads the client config that ``metalog cluster up``
writes (the same search as the CLI: ``$METALOG_CLIENT_CONFIG``, else
``./run/cluster/client.yaml``)::

    client = MetalogClient.from_config()
    offset, epoch = await client.produce([b"hello"])

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

``client.consumer(reset_policy)`` reads records (``metalog.broker.client.consumer``);
what the client raises is in ``metalog.broker.client.errors``.

Logging: a library is silent. Without a logger argument the client logs
through ``metalog.broker.net.library_logging``: to structlog if the
application configured it (the broker's tools do), else to the standard
``logging`` logger ``metalog.client``, which prints nothing unless the
application configures logging.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import msgspec

from metalog.broker.client.batching import PRODUCE_INFLIGHT_MAX, ProduceBatcher
from metalog.broker.client.config import ClientConfigError, find_client_config
from metalog.broker.client.quorum_admin import QuorumAdminCalls
from metalog.broker.client.consumer import Consumer
from metalog.broker.client.errors import (
    AUTHORIZATION_ERRORS,
    LEADER_ERRORS,
    RETRIABLE,
    AuthorizationError,
    ClusterUnavailable,
    MetalogError,
    TlsFailure,
    error_for,
)
from metalog.broker.client.request_size import REQUEST_OVERHEAD_BYTES, split_records
from metalog.broker.net.backoff import Backoff
from metalog.broker.net.channel import (
    ConnectionLost,
    NetError,
    Overloaded,
    PeerChannel,
    RequestTimeout,
    TlsHandshakeError,
)
from metalog.broker.net.library_logging import library_logger
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.protocol.errors import Errors, error_name
from metalog.protocol.invariants import InvariantViolation

NO_EPOCH = m.NO_EPOCH
# Slack on top of a server-side wait (fetch long poll) before the client gives
# up on the answer.
NETWORK_SLACK_MS = 1000
RETRY_BACKOFF_MAX_MS = 2000


async def _with_offsets(client: "MetalogClient", resp: m.MetadataResponse) -> m.MetadataResponse:
    """Kafka's Metadata (the answer over Kafka's protocol) carries no high
    watermark or log start: then they are asked of the leader, where Kafka
    has them (ListOffsets latest and earliest)."""
    if resp.high_watermark != m.NO_OFFSET or resp.leader_id == m.NO_LEADER:
        return resp
    latest = await client.list_offsets(m.LIST_OFFSETS_LATEST)
    earliest = await client.list_offsets(m.LIST_OFFSETS_EARLIEST)
    return msgspec.structs.replace(resp, high_watermark=latest.offset, log_start_offset=earliest.offset)


def _written_epoch(resp: m.ProduceResponse, answered_epoch: int) -> int:
    """The epoch a produce answer's records were written under. Kafka's
    Produce answer does not say it: then it is the epoch of the leader that
    answered as the client knew it when it sent (``answered_epoch``, read
    right after the answer, before any other task ran). One case differs
    from the truth: a retried write answered as a duplicate by a later leader
    was written under an earlier epoch than the one reported."""
    return resp.leader_epoch if resp.leader_epoch != NO_EPOCH else answered_epoch


@dataclass
class _Producer:
    """One idempotent producer of a client (KIP-98)."""

    producer_id: int
    producer_epoch: int
    next_sequence: int = 0


class MetalogClient(QuorumAdminCalls):
    """One application's connection to a cluster (see the module docstring);
    ``MetalogClient.from_config()`` builds one from the client config file."""

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
        produce_inflight_max: int = PRODUCE_INFLIGHT_MAX,
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
        self._log = logger if logger is not None else library_logger("metalog.client")
        self._channels: dict[tuple[str, int], PeerChannel] = {}
        self._endpoints: dict[int, tuple[str, int]] = {}
        self.leader_id = m.NO_LEADER
        self.answered_by: tuple[int, str] = (m.NO_LEADER, "")  # (node id, host:port) of the last answer
        self._answered_epoch = NO_EPOCH  # the leader epoch this client knew when it sent the last answered request
        self.leader_epoch = NO_EPOCH
        # Idempotent produce: producers (id and epoch from InitProducerId, the
        # sequence of the next record) not in use. Each produce call takes one
        # for its duration, so a producer has one request in flight and the
        # leader sees its sequences in order; concurrent calls use several
        # producers (as many as ever ran at once) instead of waiting in line.
        self.idempotent = idempotent
        self._idle_producers: list[_Producer] = []
        self.producers_initialized = 0
        # Concurrent produce calls share requests (metalog.broker.client.batching).
        self._batcher = ProduceBatcher(self._produce_one_request, max_request_bytes, produce_inflight_max)

    @classmethod
    def from_config(cls, path: str | None = None, **options: Any) -> MetalogClient:
        """A client of the cluster a client config file names (bootstrap,
        cluster id, TLS files): `path`, else ``$METALOG_CLIENT_CONFIG``, else
        ``./run/cluster/client.yaml`` (the search the CLI does). `options`:
        the constructor's keywords (``delivery_timeout_ms=...``). Raises
        ClientConfigError if no file is found or it is not valid."""
        config = find_client_config(path)
        if config is None:
            raise ClientConfigError(
                "no client config: pass a path, set $METALOG_CLIENT_CONFIG, or run from the directory where "
                "`bash run.sh cluster` wrote run/cluster/client.yaml")
        return cls(config.endpoints(), config.cluster_id, tls=config.tls(), **options)

    # -- public calls ------------------------------------------------------

    async def metadata(self) -> m.MetadataResponse:
        """Fresh metadata from the first node that answers (the leader first if known)."""
        return await _with_offsets(self, await self._refresh_metadata())

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
        return split_records(records, self.max_request_bytes)

    async def produce(self, records: list[bytes]) -> tuple[int, int]:
        """Append `records` and wait for commit; returns (base_offset, leader_epoch)
        of the first record.

        Calls made at the same time share requests, as a Kafka producer's
        records share batches (``metalog.broker.client.batching``): a call
        that fits in one request waits only while ``produce_inflight_max``
        requests are out, and its records stay consecutive.
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
        if self._batcher.fits(records):
            return await self._batcher.produce(records)
        producer: _Producer | None = None
        first: tuple[int, int] | None = None
        for chunk in self.split_requests(records):
            producer, answer = await self._send_records(producer, chunk)
            first = answer if first is None else first
        if first is None:
            raise InvariantViolation("split_requests made no request of a non-empty list")
        if producer is not None:
            self._idle_producers.append(producer)
        return first

    async def _produce_one_request(self, records: list[bytes]) -> tuple[int, int]:
        """One request of `records` (the batcher's calls)."""
        producer, answer = await self._send_records(None, records)
        if producer is not None:
            self._idle_producers.append(producer)
        return answer

    async def _send_records(self, producer: _Producer | None,
                            records: list[bytes]) -> tuple[_Producer | None, tuple[int, int]]:
        """One request, retried: (the producer to use next, (base offset, epoch)).
        Only a producer whose every request was answered is used again: after a
        failure its next sequence could not be judged against the unknown outcome."""
        if not self.idempotent:
            resp = await self._leader_request(
                ApiKey.PRODUCE,
                lambda: m.ProduceRequest(cluster_id=self.cluster_id, records=records, timeout_ms=self._server_wait_ms),
                self.request_timeout_ms,
            )
            return None, (resp.base_offset, _written_epoch(resp, self._answered_epoch))
        if producer is None and self._idle_producers:
            producer = self._idle_producers.pop()
        used, resp = await self._produce_chunk(producer, records)
        return used, (resp.base_offset, _written_epoch(resp, self._answered_epoch))

    @property
    def produce_requests_sent(self) -> int:
        """Requests that carried the produce calls that fit in one (calls / this: the batching)."""
        return self._batcher.requests_sent

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
        raise InvariantViolation("unreachable: the second attempt raises or succeeds")

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
        deadline_s = loop.time() + self.delivery_timeout_ms / 1000
        attempts = 0
        attempt = 0
        polling = False
        while attempt <= self.max_retries:  # bounded too by the deadline (every turn sleeps or sends)
            if polling:
                await asyncio.sleep(self._poll_backoff.delay_ms(1, random) / 1000)
            elif attempt:
                await self._backoff(attempt)
            polling = False
            remaining_ms = int((deadline_s - loop.time()) * 1000)
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
            sent_epoch = self.leader_epoch
            try:
                resp = await ch.request(api_key, make_body(), min(timeout_ms, remaining_ms))
                self.answered_by = (self.leader_id, f"{addr[0]}:{addr[1]}")
                self._answered_epoch = sent_epoch
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
                raise error_for(code, message)
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
