"""Random metadata workloads (mostly valid, some invalid on purpose) and
segment files written by metalog.storage.segments.SegmentedLog exactly as a broker writes
them. Shared by the fold tests, the Spark job tests and the benchmark."""

from __future__ import annotations

import os
import random

from metalog.broker.controller.state import ControllerState
from metalog.storage import batch as b
from metalog.storage import control_records as cr
from metalog.storage import metadata_records as r
from metalog.storage.segments import SegmentedLog

PARTITION_DIR = "__cluster_metadata-0"


def random_records(rng: random.Random, n: int, brokers: int = 5) -> list[bytes]:
    """n record values; biased by a live state so that fences hit ISRs and
    leaders, topics get deleted and re-created with the same name (and
    sometimes the same id), and a few records are invalid or undecodable."""
    st = ControllerState()
    out: list[bytes] = []
    names = ["alpha", "beta", "gamma"]
    ids = [f"00000000-0000-0000-0000-00000000000{i}" for i in range(5)]
    while len(out) < n:
        op = rng.random()
        rec: r.MetadataRecord | None = None
        bid = rng.randrange(brokers)
        cur = st.brokers.get(bid)
        if op < 0.12:
            epoch = (cur.broker_epoch + rng.choice([1, 1, 0, -1])) if cur else 1
            rec = r.RegisterBroker(bid, f"00000000-0000-0000-0001-{len(out):012d}", max(epoch, 0),
                                   (r.Endpoint("PLAINTEXT", "h", 9000 + bid),), None,
                                   rng.random() < 0.3)
        elif op < 0.24:
            # Kafka's fence (marks only) and an upgraded old log's (shrinks ISRs, moves leaders).
            fence = r.FenceBroker if rng.random() < 0.5 else r.FenceBrokerImplicit
            if cur and rng.random() < 0.9:
                rec = fence(bid, cur.broker_epoch)
            else:
                rec = fence(bid, rng.randrange(3))
        elif op < 0.33:
            rec = r.UnfenceBroker(bid, cur.broker_epoch if cur else 1)
        elif op < 0.36:
            rec = r.UnregisterBroker(bid, cur.broker_epoch if cur else 1)
        elif op < 0.45:
            rec = r.Topic(rng.choice(names), rng.choice(ids))
        elif op < 0.50:
            live = list(st.topics)
            rec = r.RemoveTopic(rng.choice(live) if live and rng.random() < 0.9 else rng.choice(ids))
        elif op < 0.64:
            live = list(st.topics)
            tid = rng.choice(live) if live and rng.random() < 0.9 else rng.choice(ids)
            rf = rng.randint(1, 3)
            replicas = tuple(rng.sample(range(brokers), rf))
            isr = tuple(x for x in replicas if rng.random() < 0.8) or replicas[:1]
            leader = rng.choice(list(isr) + [r.NO_LEADER]) if rng.random() < 0.95 else 99
            rec = r.Partition(tid, rng.randrange(3), replicas, isr, leader)
        elif op < 0.80:
            keys = list(st.partitions)
            if keys and rng.random() < 0.9:
                tid, pid = rng.choice(keys)
                p = st.partitions[(tid, pid)]
                isr = tuple(x for x in p.replicas if rng.random() < 0.7) or p.replicas[:1]
                leader = rng.choice([r.LEADER_NO_CHANGE, r.NO_LEADER] + list(isr))
                rec = r.PartitionChange(tid, pid, isr if rng.random() < 0.7 else None, leader)
            else:
                rec = r.PartitionChange(rng.choice(ids), rng.randrange(3), (0,), 0)
        elif op < 0.92:
            if rng.random() < 0.6:
                rtype, rname = r.RESOURCE_TOPIC, rng.choice(names)
            else:
                rtype, rname = rng.choice([(r.RESOURCE_BROKER, str(bid)), (r.RESOURCE_BROKER, ""), (7, "x")])
            rec = r.Config(rtype, rname, rng.choice(["retention.ms", "cleanup.policy"]),
                           rng.choice([None, "1", "2", "compact"]))
        elif op < 0.95:
            rec = r.FeatureLevel(rng.choice(["metadata.version", "kraft.version"]), rng.randrange(-1, 3))
        elif op < 0.975:
            # ACLs: re-used ids (a duplicate add is invalid), removals of live and
            # unknown ids, and now and then a malformed entry (operation 99).
            acl_id = rng.choice(ids)
            if rng.random() < 0.6:
                rec = r.AccessControlEntry(acl_id, rng.choice([2, 4]) if rng.random() < 0.9 else 7,
                                           rng.choice(names) if rng.random() < 0.5 else "kafka-cluster",
                                           rng.choice([3, 4]), rng.choice(["User:alice", "Node:2", "User:*"]),
                                           "*", rng.choice([2, 3, 4, 8, 99]), rng.choice([2, 3]))
            else:
                rec = r.RemoveAccessControlEntry(acl_id)
        elif op < 0.985:
            rec = r.NoOp()
        else:
            out.append(b"\x00\x63\x00\x00garbage")  # unknown api key 99: invalid everywhere
            st.apply_value(len(out) - 1, out[-1])
            continue
        out.append(r.encode_record(rec))
        st.apply(len(out) - 1, rec)
    return out


def sequential_state(values_by_offset: list[tuple[int, bytes]], end_offset: int) -> ControllerState:
    st = ControllerState()
    for offset, value in values_by_offset:
        if offset < end_offset:
            st.apply_value(offset, value)
    st.skip_to(max(st.offset, end_offset))
    return st


def write_log(data_dir: str, values: list[bytes], *, cluster_id: str = "test-cluster",
              node_id: int = 1, epochs: list[int] | None = None, batch_records_max: int = 7,
              segment_bytes_max: int = 4096, leader_changes: bool = True,
              seed: int = 0) -> list[tuple[int, int, bytes]]:
    """Write `values` as a broker would: batches of 1..batch_records_max data
    records, a LeaderChange control batch at each epoch start, segments rolled
    at segment_bytes_max. Returns (offset, epoch, value) of the data records."""
    rng = random.Random(seed)
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, "meta.properties"), "w") as f:
        f.write(f"version=1\ncluster.id={cluster_id}\nnode.id={node_id}\n")
    log = SegmentedLog.open(os.path.join(data_dir, PARTITION_DIR), segment_bytes_max=segment_bytes_max)
    out: list[tuple[int, int, bytes]] = []
    try:
        offset, i, epoch = 0, 0, 0
        while i < len(values):
            if epochs is None:
                new_epoch = epoch + 1 if (i == 0 or rng.random() < 0.05) else epoch
            else:
                new_epoch = epochs[i]
            if new_epoch != epoch and leader_changes:
                epoch = new_epoch
                log.append(b.encode_batch(offset, epoch, [cr.encode_control(
                    cr.LeaderChange(1, [1, 2, 3], [1, 2]))], 1000 + offset, is_control=True))
                offset += 1
            epoch = new_epoch
            n = rng.randint(1, batch_records_max)
            if epochs is not None:  # a batch never spans an epoch change
                while n > 1 and (i + n > len(values) or epochs[i + n - 1] != epoch):
                    n -= 1
            chunk = values[i:i + n]
            log.append(b.encode_batch(offset, epoch, chunk, 1000 + offset))
            out.extend((offset + k, epoch, v) for k, v in enumerate(chunk))
            offset += len(chunk)
            i += len(chunk)
        log.flush()
    finally:
        log.close()
    return out
