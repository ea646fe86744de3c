"""``metalog kafka follow``: replicate a running Apache Kafka controller
quorum's metadata log as an observer (issue 33 item 5, "we follow Kafka live").

We speak to Kafka's controllers as Kafka's own observers (brokers) do
(KafkaRaftClient.buildFetchRequest / buildFetchSnapshotRequest, Kafka 4.x):

* ApiVersions first (v3, stepping down to v0 on UNSUPPORTED_VERSION as
  Kafka's clients do); Fetch and FetchSnapshot go out at the highest version
  both sides have, at least Fetch v17 (ReplicaState, NodeEndpoints,
  ReplicaDirectoryId: KIP-853) and FetchSnapshot v1. DescribeCluster
  (controller endpoints, KIP-919) tells the cluster id, which every Fetch
  then carries, as Kafka's do.
* Fetch: one topic (``__cluster_metadata``, topic id ``Uuid(0, 1)``), one
  partition, ``CurrentLeaderEpoch`` = the epoch we know, ``FetchOffset`` =
  our log end, ``LastFetchedEpoch`` = our last batch's epoch (our snapshot's
  when the log is empty, 0 when we have nothing), ``ReplicaState{ReplicaId =
  --node-id or -1, ReplicaEpoch -1}``, our ``ReplicaDirectoryId`` (kept in
  meta.properties), MaxWaitMs 500 (Kafka's), and at v18 our high watermark.
* The answer: records are appended to our segmented log as they came
  (Kafka's batches, byte for byte: CRC-checked, never re-encoded) and
  fsynced; a ``DivergingEpoch`` truncates the log as Kafka's
  ``ReplicatedLog.truncateToEndOffset`` does (never below our high
  watermark); a ``SnapshotId`` starts a FetchSnapshot download, by
  Position, chunk after chunk, into a ``.part`` file checked batch by batch
  (storage.snapshot.PartialSnapshot) that becomes ``<end>-<epoch>.checkpoint``
  once whole, after which the log restarts empty at the snapshot's end.
* ``NOT_LEADER_OR_FOLLOWER`` / ``FENCED_LEADER_EPOCH``: the answer's
  ``CurrentLeader`` names the leader and epoch, its ``NodeEndpoints`` where
  it listens; we go there. With no leader known (an election, a dead
  socket) we ask the bootstrap controllers in turn, with a bounded back-off.
* Any other error code, an api or version we cannot use, an answer that
  does not decode: one line naming it (``KafkaAnswerError``), exit 1.

What we write, under ``--data-dir D``: ``D/meta.properties`` (node.id,
directory.id, cluster.id) and ``D/__cluster_metadata-0/`` with Kafka's
segment files and indexes, ``.checkpoint`` snapshots and a
leader-epoch-checkpoint: what ``metalog storage verify`` and ``metalog dump``
read. On stdout, one JSON line per event (connected, leader, snapshot,
truncated, progress at most once a second, caught_up). TLS: ``--tls-ca`` (and
``--tls-cert``/``--tls-key`` for mutual TLS) wrap every connection; the
controller's certificate must name the host we dial (Kafka's default
``ssl.endpoint.identification.algorithm=https``; ``--tls-no-hostname-check``
turns that off, loudly). A TLS failure (their certificate not verified by
our CA or not naming the host, ours refused by them) is one line and exit 1:
retrying cannot fix a configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import ssl
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO, TypeVar

from metalog.broker.net.tls import tls_error_text
from metalog.protocol.kafka.framing import NEED_DATA, FrameDecoder
from metalog.protocol.errors import Errors, error_name
from metalog.protocol.kafka import messages as km
from metalog.protocol.kafka.errors import KafkaDecodeError, UnsupportedVersionError
from metalog.protocol.kafka.primitives import Message, uuid_from_str, uuid_to_str
from metalog.protocol.kafka.wire import RequestHeader, decode_response, encode_request
from metalog.protocol.messages import SnapshotId
from metalog.storage import batch as B
from metalog.storage.atomic import atomic_write
from metalog.storage.epochs import NO_EPOCH, EpochHistory, write_checkpoint
from metalog.storage.segments import SegmentedLog
from metalog.storage.snapshot import CorruptSnapshotError, PartialSnapshot, SnapshotStore

METADATA_TOPIC = "__cluster_metadata"
METADATA_TOPIC_ID = bytes(15) + b"\x01"  # Kafka's Uuid.METADATA_TOPIC_ID = Uuid(0, 1)
PARTITION_DIR = METADATA_TOPIC + "-0"
FETCH_VERSION_MIN = 17  # ReplicaState (15), NodeEndpoints (16), ReplicaDirectoryId (17)
FETCH_SNAPSHOT_VERSION_MIN = 1  # ReplicaDirectoryId and NodeEndpoints
FETCH_MAX_WAIT_MS = 500  # KafkaRaftClient's fetchMaxWaitMs
FETCH_BYTES_MAX = 8 << 20  # KafkaRaftClient.MAX_FETCH_SIZE_BYTES
FRAME_BYTES_MAX = 2 * FETCH_BYTES_MAX + (1 << 20)
READ_CHUNK_BYTES = 1 << 16
BACKOFF_MS_MIN, BACKOFF_MS_MAX = 50, 2000
PROGRESS_EVERY_S = 1.0
CLIENT_ID = "metalog-kafka-follow"
HW_UNKNOWN = -1

# Errors after which another controller (or the same, later) can answer.
_RETRY_ELSEWHERE = {Errors.NOT_LEADER_OR_FOLLOWER, Errors.FENCED_LEADER_EPOCH, Errors.UNKNOWN_LEADER_EPOCH,
                    Errors.BROKER_NOT_AVAILABLE, Errors.NOT_CONTROLLER, Errors.REQUEST_TIMED_OUT,
                    Errors.LEADER_NOT_AVAILABLE}

M = TypeVar("M", bound=Message)


class KafkaAnswerError(RuntimeError):
    """A Kafka answer we cannot use: the message is the one line the CLI prints."""


def _code_text(code: int) -> str:
    return f"error {code} {error_name(code)}"


# ----------------------------------------------------------------- the wire


class KafkaConnection:
    """One connection to one Kafka node; one request in flight at a time
    (answers come in request order), every request bounded by a timeout."""

    def __init__(self, address: tuple[str, int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 timeout_s: float) -> None:
        self.address = address
        self._reader, self._writer = reader, writer
        self._timeout_s = timeout_s
        self._decoder = FrameDecoder(FRAME_BYTES_MAX)
        self._correlation_id = 0
        self.versions: dict[int, tuple[int, int]] = {}  # api key -> Kafka's (lowest, highest)

    @property
    def name(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    @classmethod
    async def open(cls, address: tuple[str, int], tls: ssl.SSLContext | None, timeout_s: float) -> "KafkaConnection":
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(address[0], address[1], ssl=tls, limit=READ_CHUNK_BYTES), timeout_s)
        conn = cls(address, reader, writer, timeout_s)
        try:
            await conn._api_versions()
        except BaseException:
            conn.close()
            raise
        return conn

    async def _api_versions(self) -> None:
        """ApiVersions v3; a v0 answer with UNSUPPORTED_VERSION carries Kafka's ranges too."""
        answer = await self.call(km.ApiVersionsResponse, km.ApiVersionsRequest(
            client_software_name="metalog", client_software_version="kafka-follow"), 3)
        if answer.error_code not in (Errors.NONE, Errors.UNSUPPORTED_VERSION) or not answer.api_keys:
            raise KafkaAnswerError(f"Kafka's ApiVersions answer from {self.name}: {_code_text(answer.error_code)}")
        self.versions = {k.api_key: (k.min_version, k.max_version) for k in answer.api_keys}

    def version(self, request: type[Message], lowest: int) -> int:
        """The highest version of `request` both sides have, at least `lowest`."""
        name = request.__name__.removesuffix("Request")
        theirs = self.versions.get(request.API_KEY)
        if theirs is None:
            raise KafkaAnswerError(f"{self.name} does not serve {name} (api key {request.API_KEY}): "
                                   "is it a Kafka controller listener?")
        version = min(request.HIGHEST_VERSION, theirs[1])
        if version < max(lowest, theirs[0]):
            raise KafkaAnswerError(f"{self.name} serves {name} v{theirs[0]}-v{theirs[1]}; following needs "
                                   f"v{lowest}-v{request.HIGHEST_VERSION} (unsupported version)")
        return version

    async def call(self, response: type[M], body: Message, version: int) -> M:
        self._correlation_id += 1
        header = RequestHeader(body.API_KEY, version, self._correlation_id, CLIENT_ID)
        self._writer.write(encode_request(header, body))
        frame = await asyncio.wait_for(self._next_frame(), self._timeout_s)
        try:
            correlation_id, answer = decode_response(frame, body.API_KEY, version)
        except KafkaDecodeError as exc:
            raise KafkaAnswerError(f"Kafka's {response.__name__} v{version} from {self.name} "
                                   f"does not decode: {exc}") from None
        if correlation_id != header.correlation_id or not isinstance(answer, response):
            raise KafkaAnswerError(f"{self.name} answered correlation id {correlation_id} to request "
                                   f"{header.correlation_id} ({type(answer).__name__})")
        return answer

    async def _next_frame(self) -> bytes | bytearray:
        await self._writer.drain()
        while True:  # bounded by the caller's timeout and the frame size cap
            frame = self._decoder.next_frame()
            if frame is not NEED_DATA:
                return frame  # type: ignore[return-value]
            data = await self._reader.read(READ_CHUNK_BYTES)
            if not data:
                raise ConnectionResetError(f"{self.name} closed the connection")
            self._decoder.feed(data)

    def close(self) -> None:
        self._writer.close()


# ---------------------------------------------------------------- our copy


def read_properties(path: str) -> dict[str, str]:
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return {}
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))


class LocalReplica:
    """Our copy: the segmented log, its snapshots, the epoch history, and the
    identity Kafka sees (node id, directory id) in ``meta.properties``."""

    def __init__(self, data_dir: str, node_id: int) -> None:
        self.data_dir = data_dir
        self.part_dir = os.path.join(data_dir, PARTITION_DIR)
        os.makedirs(self.part_dir, exist_ok=True)
        self.meta_path = os.path.join(data_dir, "meta.properties")
        meta = read_properties(self.meta_path)
        if meta and int(meta.get("node.id", "-1")) != node_id:
            raise KafkaAnswerError(f"{data_dir} belongs to node {meta.get('node.id')}, not {node_id}")
        self.node_id = node_id
        self.directory_id = uuid_from_str(meta["directory.id"]) if "directory.id" in meta else uuid.uuid4().bytes
        self.cluster_id: str | None = meta.get("cluster.id")
        self._write_meta()
        self.log = SegmentedLog.open(self.part_dir, verify_appends=False)  # CRCs checked off the wire
        self.snapshots = SnapshotStore(self.part_dir)
        self.epochs = EpochHistory(self.log.batch_epochs())
        self._epochs_changed = False
        self.high_watermark = HW_UNKNOWN

    def _write_meta(self) -> None:
        lines = ["version=1", f"node.id={self.node_id}", f"directory.id={uuid_to_str(self.directory_id)}"]
        if self.cluster_id:
            lines.append(f"cluster.id={self.cluster_id}")
        atomic_write(self.meta_path, ("\n".join(lines) + "\n").encode())

    def bind_cluster(self, cluster_id: str) -> None:
        if self.cluster_id not in (None, cluster_id):
            raise KafkaAnswerError(f"{self.data_dir} holds cluster {self.cluster_id}'s log; "
                                   f"Kafka says it is cluster {cluster_id}")
        if self.cluster_id is None:
            self.cluster_id = cluster_id
            self._write_meta()

    @property
    def end_offset(self) -> int:
        return self.log.log_end_offset

    def last_fetched_epoch(self) -> int:
        """Kafka's KafkaMetadataLog.lastFetchedEpoch: the last batch's epoch,
        else the snapshot's at the log start, else 0."""
        if self.log.log_end_offset > self.log.log_start_offset:
            return self.log.last_batch_epoch
        latest = self.snapshots.latest()
        return latest.epoch if latest is not None and latest.end_offset == self.log.log_start_offset else 0

    def append(self, records: memoryview) -> tuple[int, int]:
        """Append the whole batches of a Fetch answer that start at our log
        end (CRC-checked); fsync. Returns (batches, bytes) appended."""
        spans: list[tuple[int, int]] = []
        next_offset = self.end_offset
        try:
            for pos, h in B.iter_batches(records, verify=True):
                if h.next_offset <= next_offset:
                    continue  # already ours (an answer from before a truncation cannot get here: one in flight)
                if h.base_offset != next_offset:
                    raise KafkaAnswerError(f"Kafka's Fetch answer has a batch at offset {h.base_offset}, "
                                           f"our log ends at {next_offset}")
                spans.append((pos, pos + h.size))
                next_offset = h.next_offset
                if self.epochs.assign(h.leader_epoch, h.base_offset):
                    self._epochs_changed = True
        except B.CorruptBatchError as exc:
            raise KafkaAnswerError(f"Kafka's Fetch answer holds a damaged batch: {exc}") from None
        if not spans:
            if len(records) and not any(True for _ in B.iter_batches(records, verify=False)):
                raise KafkaAnswerError(f"Kafka's Fetch answer holds {len(records)} bytes but no whole batch")
            return 0, 0
        data = bytes(records[spans[0][0]:spans[-1][1]])
        self.log.append(data)
        self.log.flush()
        if self._epochs_changed:
            self._write_epochs()
        return len(spans), len(data)

    def _write_epochs(self) -> None:
        self._epochs_changed = False
        write_checkpoint(os.path.join(self.part_dir, "leader-epoch-checkpoint"), self.epochs)

    def truncate_to_end_offset(self, epoch: int, end_offset: int) -> int:
        """Kafka's ReplicatedLog.truncateToEndOffset for a DivergingEpoch."""
        leo = self.end_offset
        if epoch == 0:
            offset = min(end_offset, leo)
        else:
            local_epoch, local_end = self.epochs.end_offset_for_epoch(epoch, leo)
            if local_epoch == NO_EPOCH:
                offset = self.log.log_start_offset
            else:
                offset = min(local_end, end_offset) if local_epoch == epoch else local_end
        if offset < self.high_watermark:
            raise KafkaAnswerError(f"Kafka's leader asked to truncate to offset {offset} (diverging epoch {epoch} "
                                   f"ends at {end_offset}), below our high watermark {self.high_watermark}")
        if offset < self.log.log_start_offset:
            raise KafkaAnswerError(f"Kafka's leader asked to truncate to offset {offset}, below our "
                                   f"snapshot at {self.log.log_start_offset}")
        self.log.truncate_to(offset)
        self.epochs.truncate_from_end(self.end_offset)
        self._write_epochs()
        return self.end_offset

    def install(self, snapshot_id: SnapshotId) -> None:
        """A snapshot is whole: the log restarts empty at its end (Kafka's truncateToLatestSnapshot)."""
        self.log.truncate_fully(snapshot_id.end_offset)
        self.snapshots.delete_before(snapshot_id)
        self.epochs = EpochHistory()
        self._write_epochs()

    def close(self) -> None:
        self.log.close()


# ------------------------------------------------------------ the follower


@dataclass
class FollowOptions:
    bootstrap: list[tuple[str, int]]
    data_dir: str
    node_id: int = -1
    until_caught_up: bool = False
    timeout_s: float = 120.0  # --until-caught-up only: give up after this long
    fetch_bytes_max: int = FETCH_BYTES_MAX
    snapshot_chunk_bytes_max: int = FETCH_BYTES_MAX
    request_timeout_ms: int = 5000
    tls: ssl.SSLContext | None = None
    out: TextIO = field(default_factory=lambda: sys.stdout)


@dataclass
class Leader:
    leader_id: int = -1
    epoch: int = 0
    address: tuple[str, int] | None = None


class Follower:
    """The observer's loop: Fetch from the leader, append, repeat; find the
    leader again when Kafka says it moved or its socket dies."""

    def __init__(self, options: FollowOptions) -> None:
        self.opts = options
        self.replica = LocalReplica(options.data_dir, options.node_id)
        self.leader = Leader(epoch=self.replica.last_fetched_epoch())
        self.endpoints: dict[int, tuple[str, int]] = {}  # node id -> address, from NodeEndpoints
        self._conn: KafkaConnection | None = None
        self._target: tuple[str, int] | None = None  # the address being asked
        self._bootstrap_next = 0
        self._backoff_ms = BACKOFF_MS_MIN
        self._stop = asyncio.Event()
        self._last_progress = 0.0
        self._caught_up_reported: tuple[int, int] | None = None
        self.caught_up = False
        self.batches = 0
        self.bytes = 0

    def emit(self, event: str, **fields: Any) -> None:
        print(json.dumps({"event": event, **fields}), file=self.opts.out, flush=True)

    def stop(self) -> None:
        self._stop.set()

    # -- connections -----------------------------------------------------

    async def _connection(self) -> KafkaConnection:
        address = self.leader.address
        if address is None:  # no leader known: a bootstrap controller, in turn, redirects us
            address = self.opts.bootstrap[self._bootstrap_next % len(self.opts.bootstrap)]
            self._bootstrap_next += 1
        self._target = address
        if self._conn is not None and self._conn.address == address:
            return self._conn
        self._drop()
        conn = await KafkaConnection.open(address, self.opts.tls, self.opts.request_timeout_ms / 1000)
        self._conn = conn
        fetch_v = conn.version(km.FetchRequest, FETCH_VERSION_MIN)
        snap_v = conn.version(km.FetchSnapshotRequest, FETCH_SNAPSHOT_VERSION_MIN)
        await self._learn_cluster_id(conn)
        self.emit("connected", address=conn.name, fetch_version=fetch_v, fetch_snapshot_version=snap_v,
                  cluster_id=self.replica.cluster_id)
        return conn

    async def _learn_cluster_id(self, conn: KafkaConnection) -> None:
        """DescribeCluster at the controller endpoints (KIP-919): the id every Fetch carries."""
        if km.DescribeClusterRequest.API_KEY not in conn.versions:
            return
        version = conn.version(km.DescribeClusterRequest, 1)
        answer = await conn.call(km.DescribeClusterResponse, km.DescribeClusterRequest(endpoint_type=2), version)
        if answer.error_code != Errors.NONE:
            raise KafkaAnswerError(f"Kafka's DescribeCluster answer from {conn.name}: {_code_text(answer.error_code)}"
                                   + (f" ({answer.error_message})" if answer.error_message else ""))
        self.replica.bind_cluster(answer.cluster_id)

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    async def _back_off(self) -> None:
        delay_ms = self._backoff_ms * (0.5 + random.random() / 2)
        self._backoff_ms = min(self._backoff_ms * 2, BACKOFF_MS_MAX)
        try:
            await asyncio.wait_for(self._stop.wait(), delay_ms / 1000)
        except asyncio.TimeoutError:
            pass

    # -- leader discovery --------------------------------------------------

    def _learn(self, leader_id: int, epoch: int, where: str) -> bool:
        """Take a CurrentLeader from an answer if it tells more than we know
        (a newer epoch, or this epoch's leader); returns whether it did."""
        known = self.leader
        if epoch < known.epoch or (epoch == known.epoch and (leader_id < 0 or leader_id == known.leader_id)):
            return False
        address = self.endpoints.get(leader_id) if leader_id >= 0 else None
        self.leader = Leader(leader_id if address is not None else -1, epoch, address)
        if address is not None:
            self.emit("leader", leader_id=leader_id, epoch=epoch, address=f"{address[0]}:{address[1]}", told_by=where)
        return True

    def _leader_lost(self) -> None:
        self.leader = Leader(-1, self.leader.epoch, None)
        self._drop()

    # -- the loop ------------------------------------------------------------

    async def run(self) -> int:
        deadline = time.monotonic() + self.opts.timeout_s
        try:
            while not self._stop.is_set():
                if self.opts.until_caught_up and time.monotonic() > deadline:
                    raise KafkaAnswerError(f"not caught up with Kafka within {self.opts.timeout_s:g} s (log end "
                                           f"{self.replica.end_offset}, Kafka's high watermark "
                                           f"{self.replica.high_watermark}, leader {self.leader.leader_id})")
                try:
                    await self._fetch_once()
                except (OSError, asyncio.TimeoutError, ConnectionError) as exc:
                    where = f"{self._target[0]}:{self._target[1]}" if self._target else "?"
                    if is_tls_refusal(exc):  # a configuration, not a network fault: retrying cannot fix it
                        raise KafkaAnswerError(f"TLS with {where} failed: {tls_error_text(exc)}") from None
                    self.emit("disconnected", address=where, reason=str(exc) or type(exc).__name__)
                    self._leader_lost()
                    await self._back_off()
                    continue
                if self.opts.until_caught_up and self.caught_up:
                    break
        finally:
            self._drop()
            self.replica.close()
        self._report(force=True)
        return 0

    async def _fetch_once(self) -> None:
        conn = await self._connection()
        version = conn.version(km.FetchRequest, FETCH_VERSION_MIN)
        answer = await conn.call(km.FetchResponse, self._fetch_request(version), version)
        if answer.error_code != Errors.NONE:
            self._retry_or_fail(answer.error_code, "Fetch", conn, top_level=True)
            return
        part = self._the_partition(answer, conn)
        self.endpoints.update({e.node_id: (e.host, e.port) for e in answer.node_endpoints})
        leader = part.current_leader
        if part.error_code != Errors.NONE:
            if not self._learn(leader.leader_id, leader.leader_epoch, conn.name):
                self._retry_or_fail(part.error_code, "Fetch", conn)
            return
        if self.leader.address != conn.address:  # a bootstrap controller that leads: stay with it
            self.leader = Leader(leader.leader_id, leader.leader_epoch, conn.address)
            self.emit("leader", leader_id=leader.leader_id, epoch=leader.leader_epoch, address=conn.name,
                      told_by=conn.name)
        self._backoff_ms = BACKOFF_MS_MIN
        if part.diverging_epoch.epoch >= 0:
            d = part.diverging_epoch
            to = self.replica.truncate_to_end_offset(d.epoch, d.end_offset)
            self.emit("truncated", to=to, diverging_epoch=d.epoch, diverging_end_offset=d.end_offset)
        elif part.snapshot_id.epoch >= 0 or part.snapshot_id.end_offset >= 0:
            await self._fetch_snapshot(conn, SnapshotId(part.snapshot_id.end_offset, part.snapshot_id.epoch))
        else:
            self._appended(part)

    def _fetch_request(self, version: int) -> km.FetchRequest:
        r = self.replica
        partition = km.FetchRequestFetchPartition(
            partition=0, current_leader_epoch=self.leader.epoch, fetch_offset=r.end_offset,
            last_fetched_epoch=r.last_fetched_epoch(), replica_directory_id=r.directory_id)
        if version >= 18:  # KIP-1166: the follower's high watermark, -1 while unknown
            partition.high_watermark = r.high_watermark
        return km.FetchRequest(
            cluster_id=r.cluster_id, replica_state=km.FetchRequestReplicaState(replica_id=r.node_id),
            max_wait_ms=FETCH_MAX_WAIT_MS, max_bytes=self.opts.fetch_bytes_max,
            topics=[km.FetchRequestFetchTopic(topic=METADATA_TOPIC, topic_id=METADATA_TOPIC_ID,
                                              partitions=[partition])])

    @staticmethod
    def _the_partition(answer: km.FetchResponse, conn: KafkaConnection) -> km.FetchResponsePartitionData:
        if (len(answer.responses) != 1 or answer.responses[0].topic_id != METADATA_TOPIC_ID
                or len(answer.responses[0].partitions) != 1 or answer.responses[0].partitions[0].partition_index):
            raise KafkaAnswerError(f"Kafka's Fetch answer from {conn.name} is not about {PARTITION_DIR} alone")
        return answer.responses[0].partitions[0]

    def _retry_or_fail(self, code: int, api: str, conn: KafkaConnection, top_level: bool = False) -> None:
        """An error code: one we wait out elsewhere, or the end of following."""
        if code not in _RETRY_ELSEWHERE:
            where = "" if top_level else f" for {PARTITION_DIR}"
            raise KafkaAnswerError(f"Kafka's {api} answer from {conn.name}{where}: {_code_text(code)}")
        self.emit("retry", address=conn.name, api=api, error=error_name(code))
        self._leader_lost()
        raise ConnectionError(f"{_code_text(code)}: asking another controller")

    def _appended(self, part: km.FetchResponsePartitionData) -> None:
        r = self.replica
        if part.records is not None and len(part.records):
            batches, n = r.append(memoryview(part.records))
            self.batches += batches
            self.bytes += n
        if part.high_watermark >= 0:
            r.high_watermark = min(r.end_offset, part.high_watermark)
        self.caught_up = part.high_watermark >= 0 and r.end_offset >= part.high_watermark
        if self.caught_up and self._caught_up_reported != (self.leader.leader_id, self.leader.epoch):
            self._caught_up_reported = (self.leader.leader_id, self.leader.epoch)
            self.emit("caught_up", **self._status())
        self._report()

    def _status(self) -> dict[str, Any]:
        r = self.replica
        return {"log_start_offset": r.log.log_start_offset, "log_end_offset": r.end_offset,
                "high_watermark": r.high_watermark, "leader_id": self.leader.leader_id, "epoch": self.leader.epoch,
                "batches": self.batches, "bytes": self.bytes}

    def _report(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_progress >= PROGRESS_EVERY_S:
            self._last_progress = now
            self.emit("progress", **self._status())

    # -- snapshots -----------------------------------------------------------

    async def _fetch_snapshot(self, conn: KafkaConnection, sid: SnapshotId) -> None:
        """FetchSnapshot by Position until the file is whole, then install it."""
        store = self.replica.snapshots
        if store.size(sid) is not None:  # already ours (a restart after the download)
            self.replica.install(sid)
            return
        part = store.partial(sid)
        part.abort()  # a download cut off earlier starts again at position 0
        version = conn.version(km.FetchSnapshotRequest, FETCH_SNAPSHOT_VERSION_MIN)
        chunks = 0
        try:
            while not self._stop.is_set():  # bounded: every answer moves the position on or ends the loop
                answer = await conn.call(km.FetchSnapshotResponse, self._snapshot_request(sid, part), version)
                got = self._snapshot_chunk(answer, conn, part)
                if got is None:
                    return  # the leader dropped it or moved: fetch again
                chunks += 1
                if got.size <= part.size_bytes():
                    break
            else:
                return
            path = part.complete(got.size)
        except CorruptSnapshotError as exc:
            raise KafkaAnswerError(f"the snapshot {sid.end_offset}-{sid.epoch} from {conn.name} is damaged: "
                                   f"{exc}") from None
        finally:
            if not os.path.exists(store.path(sid)):
                part.abort()
        self.replica.install(sid)
        self.emit("snapshot", end_offset=sid.end_offset, epoch=sid.epoch, bytes=os.path.getsize(path),
                  chunks=chunks, leader_id=self.leader.leader_id, address=conn.name)

    def _snapshot_request(self, sid: SnapshotId, part: PartialSnapshot) -> km.FetchSnapshotRequest:
        r = self.replica
        wanted = km.FetchSnapshotRequestPartitionSnapshot(
            partition=0, current_leader_epoch=self.leader.epoch,
            snapshot_id=km.FetchSnapshotRequestSnapshotId(end_offset=sid.end_offset, epoch=sid.epoch),
            position=part.size_bytes(), replica_directory_id=r.directory_id)
        return km.FetchSnapshotRequest(
            cluster_id=r.cluster_id, replica_id=r.node_id, max_bytes=self.opts.snapshot_chunk_bytes_max,
            topics=[km.FetchSnapshotRequestTopicSnapshot(name=METADATA_TOPIC, partitions=[wanted])])

    def _snapshot_chunk(self, answer: km.FetchSnapshotResponse, conn: KafkaConnection, part: PartialSnapshot,
                        ) -> km.FetchSnapshotResponsePartitionSnapshot | None:
        """Write the chunk of a FetchSnapshot answer; None when the download must start over."""
        if answer.error_code != Errors.NONE:
            self._retry_or_fail(answer.error_code, "FetchSnapshot", conn, top_level=True)
        topics = [t for t in answer.topics if t.name == METADATA_TOPIC]
        if len(topics) != 1 or len(topics[0].partitions) != 1 or topics[0].partitions[0].index != 0:
            raise KafkaAnswerError(f"Kafka's FetchSnapshot answer from {conn.name} is not about {PARTITION_DIR}")
        got = topics[0].partitions[0]
        self.endpoints.update({e.node_id: (e.host, e.port) for e in answer.node_endpoints})
        if got.error_code == Errors.SNAPSHOT_NOT_FOUND:  # the leader deleted it meanwhile: Fetch again
            self.emit("retry", address=conn.name, api="FetchSnapshot", error="SNAPSHOT_NOT_FOUND")
            return None
        if got.error_code != Errors.NONE:
            if not self._learn(got.current_leader.leader_id, got.current_leader.leader_epoch, conn.name):
                self._retry_or_fail(got.error_code, "FetchSnapshot", conn)
            return None
        have = part.size_bytes()
        if got.position != have or SnapshotId(got.snapshot_id.end_offset, got.snapshot_id.epoch) != part.snapshot_id:
            raise KafkaAnswerError(f"Kafka's FetchSnapshot answer from {conn.name} is snapshot "
                                   f"{got.snapshot_id.end_offset}-{got.snapshot_id.epoch} at position "
                                   f"{got.position}; we asked for {part.snapshot_id.end_offset}-"
                                   f"{part.snapshot_id.epoch} at {have}")
        if not len(got.unaligned_records) and got.size > have:
            raise KafkaAnswerError(f"Kafka's FetchSnapshot answer from {conn.name} is empty at position {have} "
                                   f"of {got.size}")
        part.write_at(got.position, bytes(got.unaligned_records))
        return got


# --------------------------------------------------------------------- CLI


def parse_bootstrap(text: str) -> list[tuple[str, int]]:
    """HOST:PORT[,HOST:PORT...] (an IPv6 host in brackets)."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        host, sep, port = item.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise KafkaAnswerError(f"--bootstrap-controller: {item!r} is not HOST:PORT")
        out.append((host.strip("[]"), int(port)))
    if not out:
        raise KafkaAnswerError("--bootstrap-controller: no HOST:PORT given")
    return out


def tls_context(ca: str | None, cert: str | None, key: str | None,
                check_hostname: bool = True) -> ssl.SSLContext | None:
    """Kafka's SSL controller listener: verify it with `ca` (and that its certificate names
    the host we dial, as Kafka's clients do by default); `cert`/`key` for mutual TLS."""
    if ca is None and cert is None:
        return None
    try:
        ctx = ssl.create_default_context(cafile=ca)
        ctx.check_hostname = check_hostname
        if cert is not None:
            ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise KafkaAnswerError(f"--tls-ca {ca} / --tls-cert {cert} / --tls-key {key}: "
                               f"{tls_error_text(exc)}") from None
    return ctx


def is_tls_refusal(exc: BaseException) -> bool:
    """Whether a TLS error says one side refused the other (an unverified certificate, an
    alert: unknown CA, bad certificate, certificate required, access denied; a plaintext
    listener), not that a connection broke (an unclean EOF when a controller dies)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return True
    reason = exc.reason if isinstance(exc, ssl.SSLError) else None
    return bool(reason) and ("ALERT" in reason or reason == "WRONG_VERSION_NUMBER")


async def follow(options: FollowOptions) -> int:
    follower = Follower(options)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, follower.stop)
    try:
        return await follower.run()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def cmd_follow(args: argparse.Namespace) -> int:
    try:
        options = FollowOptions(
            bootstrap=parse_bootstrap(args.bootstrap_controller), data_dir=args.data_dir, node_id=args.node_id,
            until_caught_up=args.until_caught_up, timeout_s=args.timeout_s,
            snapshot_chunk_bytes_max=args.snapshot_chunk_bytes_max,
            tls=tls_context(args.tls_ca, args.tls_cert, args.tls_key, check_hostname=not args.tls_no_hostname_check))
        if args.tls_no_hostname_check:
            print("metalog: warning: --tls-no-hostname-check: any certificate of the CA is taken for any "
                  "controller (a man in the middle holding one is not detected)", file=sys.stderr)
        return asyncio.run(follow(options))
    except (KafkaAnswerError, UnsupportedVersionError) as exc:
        print(f"metalog: error: {exc}", file=sys.stderr)
        return 1


def register_cli(sub: Any) -> None:
    p = sub.add_parser("kafka", help="meet a real Apache Kafka: follow its controller quorum")
    ksub = p.add_subparsers(dest="kafka_command", required=True)
    f = ksub.add_parser("follow", help="replicate a running Kafka controller quorum's metadata log as an "
                                       "observer (Fetch/FetchSnapshot as Kafka's own), byte for byte")
    f.add_argument("--bootstrap-controller", required=True, metavar="HOST:PORT[,HOST:PORT...]",
                   help="Kafka controllers' listener (controller.quorum.bootstrap.servers)")
    f.add_argument("--data-dir", required=True, help="where our copy goes (meta.properties, __cluster_metadata-0/)")
    f.add_argument("--node-id", type=int, default=-1,
                   help="the observer's replica id Kafka sees (default -1: an anonymous observer)")
    f.add_argument("--until-caught-up", action="store_true",
                   help="exit 0 once our log reaches the leader's high watermark (default: follow until SIGTERM)")
    f.add_argument("--timeout-s", type=float, default=120.0, help="with --until-caught-up: give up after this long")
    f.add_argument("--snapshot-chunk-bytes-max", type=int, default=FETCH_BYTES_MAX,
                   help="FetchSnapshot MaxBytes (Kafka's observers: 8 MiB)")
    f.add_argument("--tls-ca", help="CA file: speak TLS to an SSL controller listener")
    f.add_argument("--tls-cert", help="our certificate (mutual TLS)")
    f.add_argument("--tls-key", help="its key")
    f.add_argument("--tls-no-hostname-check", action="store_true",
                   help="accept a controller certificate that does not name the host dialled (insecure; "
                        "Kafka's ssl.endpoint.identification.algorithm= empty)")
    f.set_defaults(func=cmd_follow)
