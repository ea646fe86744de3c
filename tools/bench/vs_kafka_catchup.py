"""``metalog bench --vs kafka``, the catch-up part: a new node catching up on
1M metadata records, on both quorums, measured alike.

The records: ACLs (Kafka's AccessControlEntryRecord, one per ACL: topic
``bench-acl-target``, literal, a new principal ``User:cu-<tag>-<i>`` each,
host ``*``, READ, ALLOW), so that the state a new node must hold is 1M ACLs
on both sides (configs would overwrite a few keys: a new node would get a
tiny state whatever the log held). Each side is written the fastest way it
offers that goes through its leader and commits:

* Kafka: CreateAcls through the broker, ``ACLS_PER_REQUEST`` bindings per
  request (one AccessControlEntryRecord each), ``KAFKA_WRITERS`` AdminClients
  with one request each in flight (the broker forwards one at a time anyway).
* metalog: its admin path runs one controller command per ACL, one at a time
  (about 150/s here: 1M would take two hours), so the same records, encoded
  as Kafka's controller encodes them (``encode_record``), are produced with
  librdkafka's Producer to ``__cluster_metadata`` partition 0 on the Kafka
  listener (acks=all: the leader appends, the quorum commits, every replica's
  controller state applies them as ACLs).

Then a new node with an empty dir starts: on Kafka a controller-only node
(``process.roles=controller``, formatted ``--no-initial-controllers``: an
observer of the dynamic quorum; a controller because it replays the
metadata log and nothing else, as our observer does; a broker would also
register, create its logs and serve clients); on metalog observer 4 of the
cluster's layout. Measured: from its spawn to the leader's DescribeQuorum
(Kafka's API on the controller listener, the same code for both, what
``kafka-metadata-quorum describe --replication`` shows) listing it with a
log end offset at or past the leader's high watermark read just before the
spawn; polled every ``POLL_S``. metalog's observer's applied offset (our
/quorum) is recorded beside it. Both sides keep their default snapshot
policies (Kafka: every 20 MiB of records; metalog: every 20,000 records);
whether the new node installed a snapshot is read from its dir.

Afterwards the leader's newest snapshot and log past it are counted, per
record type, with their value bytes (what the new node had to get).
"""

from __future__ import annotations

import asyncio
import glob
import os
import ssl
import threading
import time
import uuid
from collections import Counter
from typing import Any, Callable, Protocol

from metalog.storage import batch as b
from metalog.storage import metadata_records as r

RECORDS = 1_000_000
SMOKE_RECORDS = 3_000  # --smoke: the same code, three Kafka requests
ACLS_PER_REQUEST = 1000
KAFKA_WRITERS = 4
PRODUCE_POLL_EVERY = 1000
WRITE_TIMEOUT_S = 3600.0
CATCHUP_DEADLINE_S = 1800.0
POLL_S = 0.1
CONNECT_TIMEOUT_S = 5.0
OBSERVER_ID = 4
METADATA_TOPIC = "__cluster_metadata"
ACL_TOPIC = "bench-acl-target"
# Kafka's codes (metalog.broker.controller.acl holds the same): topic, literal, READ, ALLOW.
TOPIC, LITERAL, READ, ALLOW = 2, 3, 3, 3


class CatchupSide(Protocol):
    """What the catch-up needs of a quorum under test (tools/bench/vs_kafka.py's sides)."""
    name: str

    def client_conf(self) -> dict[str, Any]: ...
    def controller_endpoints(self) -> list[tuple[str, int]]: ...  # the voters' controller listeners
    def tls_files(self) -> tuple[str, str, str]: ...               # CA, admin certificate, admin key
    def start_observer(self) -> None: ...                          # spawn the new node (dir formatted, empty)
    def observer_dir(self) -> str: ...                             # its __cluster_metadata-0
    def metadata_dir(self, node_id: int) -> str: ...
    def applied_offset(self) -> int | None: ...                    # the new node's, where the side tells it


# ---------------------------------------------------------------- writing
def principal(tag: str, i: int) -> str:
    return f"User:cu-{tag}-{i}"


def write_kafka(conf: dict[str, Any], count: int, tag: str, progress: Callable[[str], None]) -> None:
    """`count` ACLs through CreateAcls, ACLS_PER_REQUEST per request, KAFKA_WRITERS clients."""
    from confluent_kafka.admin import (AclBinding, AclOperation, AclPermissionType, AdminClient,
                                       ResourcePatternType, ResourceType)

    requests = [range(i, min(i + ACLS_PER_REQUEST, count)) for i in range(0, count, ACLS_PER_REQUEST)]
    lock, failures = threading.Lock(), []

    def one(worker: int) -> None:
        admin = AdminClient({**conf, "log_level": 0})  # as vs_kafka.admin_client (which imports this module)
        for req in requests[worker::KAFKA_WRITERS]:
            bindings = [AclBinding(ResourceType.TOPIC, ACL_TOPIC, ResourcePatternType.LITERAL, principal(tag, i),
                                   "*", AclOperation.READ, AclPermissionType.ALLOW) for i in req]
            for attempt in range(3):  # a request refused under load is sent again (same ACLs: no duplicates)
                try:
                    for future in admin.create_acls(bindings, request_timeout=120).values():
                        future.result(timeout=180)
                    break
                except Exception as exc:  # noqa: BLE001 (retried, then counted)
                    if attempt == 2:
                        with lock:
                            failures.append(repr(exc)[:300])
            if req.start % 100_000 == 0:
                progress(f"kafka: {req.start:,} ACLs written")

    threads = [threading.Thread(target=one, args=(w,), daemon=True) for w in range(KAFKA_WRITERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WRITE_TIMEOUT_S)
    if failures:
        raise RuntimeError(f"{len(failures)} CreateAcls requests failed on Kafka: {failures[0]}")


def write_metalog(conf: dict[str, Any], count: int, tag: str, progress: Callable[[str], None]) -> None:
    """`count` AccessControlEntryRecords produced to __cluster_metadata-0 (acks=all)."""
    from confluent_kafka import Producer

    producer = Producer({**conf, "acks": "all", "linger.ms": 20, "batch.size": 1 << 20,
                         "batch.num.messages": 10_000, "log_level": 3})
    failures: list[str] = []

    def delivered(err: Any, _msg: Any) -> None:
        if err is not None and len(failures) < 5:
            failures.append(str(err))

    for i in range(count):
        value = r.encode_record(r.AccessControlEntry(str(uuid.uuid4()), TOPIC, ACL_TOPIC, LITERAL,
                                                     principal(tag, i), "*", READ, ALLOW))
        for _ in range(100_000):  # a full local queue waits for answers (bounded: then the flush below says)
            try:
                producer.produce(METADATA_TOPIC, value=value, partition=0, on_delivery=delivered)
                break
            except BufferError:
                producer.poll(0.05)
        if i % PRODUCE_POLL_EVERY == 0:
            producer.poll(0)
        if i and i % 100_000 == 0:
            progress(f"metalog: {i:,} ACLs produced")
    left = producer.flush(WRITE_TIMEOUT_S)
    if left or failures:
        raise RuntimeError(f"metalog: {left} records undelivered, errors {failures}")


# ---------------------------------------------------------------- DescribeQuorum
class QuorumProbe:
    """DescribeQuorum to the leader among `endpoints` over one kept connection
    (reopened, trying each endpoint, when it fails or stops being the leader's)."""

    def __init__(self, endpoints: list[tuple[str, int]], tls: ssl.SSLContext) -> None:
        self.endpoints, self.tls = endpoints, tls
        self.conn: Any = None

    async def partition(self) -> Any | None:
        """The leader's partition data, or None when no endpoint answered as leader."""
        from metalog.protocol.kafka import messages as km
        from metalog.tools.kafka.follow import KafkaConnection

        body = km.DescribeQuorumRequest(topics=[km.DescribeQuorumRequestTopicData(
            topic_name=METADATA_TOPIC, partitions=[km.DescribeQuorumRequestPartitionData(partition_index=0)])])
        for addr in ([None] if self.conn is not None else []) + list(self.endpoints):
            try:
                if addr is not None:
                    self.conn = await KafkaConnection.open(addr, self.tls, CONNECT_TIMEOUT_S)
                answer = await self.conn.call(km.DescribeQuorumResponse, body,
                                              self.conn.version(km.DescribeQuorumRequest, 0))
            except (OSError, asyncio.TimeoutError, RuntimeError):
                self.close()
                continue
            parts = [p for t in answer.topics for p in t.partitions]
            if answer.error_code == 0 and parts and parts[0].error_code == 0:
                return parts[0]
            self.close()
        return None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def tls_context(ca: str, cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=ca)
    ctx.check_hostname = False  # the nodes' certificates name node ids and 127.0.0.1, not what we dial
    ctx.load_cert_chain(cert, key)
    return ctx


async def _leader_view(probe: QuorumProbe, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        part = await probe.partition()
        if part is not None:
            return part
        await asyncio.sleep(POLL_S)
    raise TimeoutError("no leader answered DescribeQuorum")


async def _measure(side: CatchupSide, deadline_s: float) -> dict[str, Any]:
    probe = QuorumProbe(side.controller_endpoints(), tls_context(*side.tls_files()))
    try:
        before = await _leader_view(probe, 120)
        target = before.high_watermark
        t0 = time.monotonic()
        side.start_observer()
        applied_s = None
        while True:
            part = await probe.partition()
            seen = [o.log_end_offset for o in (part.observers if part else []) if o.replica_id == OBSERVER_ID]
            now = time.monotonic()
            if applied_s is None and (side.applied_offset() or -1) >= target:
                applied_s = now - t0
            if seen and seen[0] >= target:
                break
            if now - t0 > deadline_s:
                raise TimeoutError(f"{side.name}'s new node did not reach offset {target} in {deadline_s:.0f} s "
                                   f"(leader's view: {seen})")
            await asyncio.sleep(POLL_S)
        seconds = time.monotonic() - t0
        while applied_s is None and side.applied_offset() is not None and time.monotonic() - t0 < deadline_s:
            if (side.applied_offset() or -1) >= target:
                applied_s = time.monotonic() - t0
            await asyncio.sleep(POLL_S)
        return {"target_offset": target, "leader_id": before.leader_id, "seconds": round(seconds, 3),
                "applied_seconds": round(applied_s, 3) if applied_s is not None else None,
                "records_per_s": round(target / seconds, 1)}
    finally:
        probe.close()


# ---------------------------------------------------------------- counting the log
def _offset_of(path: str) -> int:
    return int(os.path.basename(path).split(".")[0].split("-")[0])


def count_records(metadata_dir: str) -> dict[str, Any]:
    """Records by type (count, value bytes) in the newest snapshot of the dir
    and its log past that snapshot: what a new node must get."""
    snaps = sorted(glob.glob(os.path.join(metadata_dir, "*.checkpoint")), key=_offset_of)
    snap = snaps[-1] if snaps and _offset_of(snaps[-1]) > 0 else None
    start = _offset_of(snap) if snap else 0
    counts: Counter[str] = Counter()
    value_bytes: Counter[str] = Counter()
    files = ([snap] if snap else []) + sorted(glob.glob(os.path.join(metadata_dir, "*.log")), key=_offset_of)
    batch_bytes = 0
    for path in files:
        with open(path, "rb") as f:
            data = f.read()
        for pos, h in b.iter_batches(data, verify=False):
            if h.is_control or (path != snap and h.last_offset < start):
                continue
            batch_bytes += h.size
            first = 0 if path == snap else max(0, start - h.base_offset)
            for value in b.decode_records(memoryview(data)[pos:pos + h.size], h)[first:]:
                name = r.record_type_name(value[1]) if len(value) > 1 else "empty"
                counts[name] += 1
                value_bytes[name] += len(value)
    return {"snapshot": os.path.basename(snap) if snap else None, "from_offset": start,
            "records": dict(counts), "value_bytes": dict(value_bytes), "batch_bytes": batch_bytes}


def snapshot_installed(observer_dir: str) -> bool:
    """Whether the new node holds a snapshot past offset 0 (its bootstrap checkpoint is at 0)."""
    return any(_offset_of(p) > 0 for p in glob.glob(os.path.join(observer_dir, "*.checkpoint")))


# ---------------------------------------------------------------- the part
def run_catchup(side: CatchupSide, writer: Callable[..., None], count: int, tag: str,
                progress: Callable[[str], None]) -> dict[str, Any]:
    """Write `count` ACLs, start the new node, measure; then count the leader's records."""
    t0 = time.monotonic()
    writer(side.client_conf(), count, tag, progress)
    write_s = time.monotonic() - t0
    progress(f"{tag} {side.name}: {count:,} ACLs written in {write_s:.1f} s; starting the new node")
    out: dict[str, Any] = {"acls_written": count, "write_seconds": round(write_s, 1),
                           "write_records_per_s": round(count / write_s, 1)}
    out.update(asyncio.run(_measure(side, CATCHUP_DEADLINE_S)))
    out["snapshot_installed"] = snapshot_installed(side.observer_dir())
    out["leader_log"] = count_records(side.metadata_dir(out["leader_id"]))
    progress(f"{tag} {side.name} catch-up: {out['seconds']} s to offset {out['target_offset']:,} "
             f"({out['records_per_s']:,} records/s), snapshot installed: {out['snapshot_installed']}")
    return out
