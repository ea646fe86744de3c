"""Replay throughput of the Spark job (records/s), local mode by default.

    .venv/bin/python -m metalog.tools.bench.spark                      # 10,000,000 records
    .venv/bin/python -m metalog.tools.bench.spark --records 1000000 --master 'local[2]'
    .venv/bin/python -m metalog.tools.bench.spark --kafka --master 'local[2]'  # a real Kafka log

With ``--kafka`` the log is a real one, written by Apache Kafka 4.3.1 (the
harness of metalog.tools.kafka.quorum: three controllers and a broker from
.kafka/lib) while Kafka's own admin client (librdkafka, confluent_kafka)
drives it: 1000 topics x 10 partitions, then IncrementalAlterConfigs of 8
topic configs over every topic per request (8,000 ConfigRecords, under the
controller's 10,000 records per operation) until the log holds --records
records. Kafka keeps every segment (metadata.max.retention.bytes/ms = -1), rolled at
64 MiB (the job reads one file per task), and takes no snapshot while the
workload runs; then its controllers are restarted with a 1 s snapshot
interval until controller 1 has a snapshot of the whole log (snapshot_at_end),
so the job's compare stage checks its final state against Kafka's own.
The first controller's dir is cached under .bench/ (git-ignored) and reused
by the next run with the same record count; generation prints its time.

Generates one broker data dir once (kept in --dir and reused when the record
count matches): 100 brokers, 1000 topics x 10 partitions, then a stream of
mostly PartitionChange and Config records with broker fences/unfences mixed
in (each fence is an upgraded old log's FenceBrokerImplicit, which expands to
the partitions it leads or is in-sync for, as every fence did before format 3). Then
runs ``metalog spark snapshot`` on it and prints the figures: the job's
stages (report.json's ``stages_s``), the Spark rate over read + vote +
replay + checkpoint beside the broker's own replay rate of the same log in
the same run, and the CPU seconds of every process of the job (the JVM and
the Python workers, from /proc: on a shared machine the wall clock mostly
measures the neighbours).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time

from metalog.broker.controller.state import Controller
from metalog.storage import batch as b
from metalog.storage import metadata_records as r
from metalog.storage.segments import SegmentedLog
from metalog.tools.spark import job as spark_job

BATCH_RECORDS = 500


def generate(data_dir: str, records: int, seed: int = 1) -> None:
    rng = random.Random(seed)
    pdir = os.path.join(data_dir, "__cluster_metadata-0")
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, "meta.properties"), "w") as fh:
        fh.write("version=1\ncluster.id=bench\nnode.id=1\n")
    enc = r.encode_record
    brokers = list(range(100))
    head = [enc(r.RegisterBroker(x, f"00000000-0000-4000-8000-{x:012d}", 1, (r.Endpoint("PLAINTEXT", f"h{x}", 9092),), None, False))
            for x in brokers]
    parts = []
    for t in range(1000):
        tid = f"{t:08d}-0000-0000-0000-000000000000"
        head.append(enc(r.Topic(f"topic-{t}", tid)))
        for p in range(10):
            reps = tuple(rng.sample(brokers, 3))
            head.append(enc(r.Partition(tid, p, reps, reps, reps[0])))
            parts.append((tid, p, reps))
    fenced: set[int] = set()
    log = SegmentedLog.open(pdir, verify_appends=False)
    try:
        offset, i = 0, 0
        pending = list(head)
        t0 = time.monotonic()
        while i < records:
            while len(pending) < BATCH_RECORDS and i + len(pending) < records:
                x = rng.random()
                if x < 0.8:
                    tid, p, reps = rng.choice(parts)
                    isr = tuple(y for y in reps if rng.random() < 0.8) or reps[:1]
                    pending.append(enc(r.PartitionChange(tid, p, isr, rng.choice(isr))))
                elif x < 0.95:
                    t = rng.randrange(1000)
                    pending.append(enc(r.Config(r.RESOURCE_TOPIC, f"topic-{t}", "retention.ms",
                                                str(rng.randrange(1, 10**9)))))
                else:
                    bid = rng.choice(brokers)
                    if bid in fenced:
                        fenced.discard(bid)
                        pending.append(enc(r.UnfenceBroker(bid, 1)))
                    else:
                        fenced.add(bid)
                        # An old log's fence, which expands as it did before format 3
                        # (keeps this workload comparable across builds).
                        pending.append(enc(r.FenceBrokerImplicit(bid, 1)))
            chunk = pending[:BATCH_RECORDS]
            pending = pending[BATCH_RECORDS:]
            log.append(b.encode_batch(offset, 1, chunk, 1_700_000_000_000 + offset))
            offset += len(chunk)
            i += len(chunk)
            if i % 1_000_000 < BATCH_RECORDS:
                print(f"generated {i:,} records ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
        log.flush()
    finally:
        log.close()
    with open(os.path.join(data_dir, "bench.json"), "w") as fh:
        json.dump({"records": records, "seed": seed}, fh)


KAFKA_TOPICS = 1000
KAFKA_CONFIG_KEYS = ("retention.ms", "segment.ms", "retention.bytes", "segment.bytes", "max.message.bytes",
                     "flush.ms", "delete.retention.ms", "min.compaction.lag.ms")
KAFKA_INFLIGHT_MAX = 8  # requests in flight: keeps Kafka's controller busy without an unbounded queue
KAFKA_KEEP_ALL = {"metadata.max.retention.bytes": "-1", "metadata.max.retention.ms": "-1",
                  # No snapshot while the workload runs (the job replays the whole log; they
                  # would cost Kafka's write rate): snapshot_at_end takes one of the whole log.
                  "metadata.log.max.snapshot.interval.ms": "3600000",
                  "metadata.log.max.record.bytes.between.snapshots": str(1 << 40),
                  # 64 MiB segments, not Kafka's 1 GiB: the job reads a file per task, so
                  # one file would be one core's work (our own logs roll at 8 MiB).
                  "metadata.log.segment.bytes": str(64 << 20)}


def generate_kafka(root: str, records: int, seed: int = 1) -> str:
    """A real Kafka controller quorum writes a metadata log of at least
    `records` records under root; returns the first controller's log dir."""
    from confluent_kafka.admin import (AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, NewTopic,
                                       ResourceType)

    from metalog.tools.kafka import quorum as kq

    rng = random.Random(seed)
    cluster = kq.KafkaCluster.create(root, brokers=1, heap_mb=512, overrides=KAFKA_KEEP_ALL)
    cluster.start()
    try:
        admin = AdminClient({"bootstrap.servers": cluster.bootstrap_servers(), "log_level": 0})
        topics = [f"topic-{t}" for t in range(KAFKA_TOPICS)]
        for i in range(0, len(topics), 500):  # 500 x 11 records: under 10,000 per operation
            for fut in admin.create_topics([NewTopic(t, 10, 1) for t in topics[i:i + 500]],
                                           operation_timeout=120).values():
                fut.result()
        sent, inflight, t0 = 0, [], time.monotonic()
        set_op = AlterConfigOpType.SET
        while sent < records:
            request = [ConfigResource(ResourceType.TOPIC, t, incremental_configs=[
                ConfigEntry(k, str(rng.randrange(1 << 20, 1 << 30)), incremental_operation=set_op)
                for k in KAFKA_CONFIG_KEYS]) for t in topics]
            inflight.append(admin.incremental_alter_configs(request))
            sent += len(topics) * len(KAFKA_CONFIG_KEYS)
            if len(inflight) >= KAFKA_INFLIGHT_MAX:
                for fut in inflight.pop(0).values():
                    fut.result()
            if sent % 1_000_000 < len(topics) * len(KAFKA_CONFIG_KEYS):
                print(f"kafka: {sent:,} config records sent ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
        for futs in inflight:
            for fut in futs.values():
                fut.result()
    finally:
        cluster.stop()
    snapshot_at_end(root)
    return cluster.controllers[0].log_dir


FINAL_SNAPSHOT_INTERVAL_MS = 1000
FINAL_SNAPSHOT_TIMEOUT_S = 900.0  # the controllers first replay the whole log (10M records)


def _log_end_base(metadata_dir: str) -> int:
    """Base offset of the newest segment: a snapshot past it is near the log's end."""
    return max(int(n[:20]) for n in os.listdir(metadata_dir) if n.endswith(".log"))


def _checkpoints(metadata_dir: str) -> list[int]:
    return sorted(int(n[:20]) for n in os.listdir(metadata_dir) if n.endswith(".checkpoint"))


def snapshot_at_end(root: str) -> int:
    """Restart the three controllers of the stopped Kafka cluster under root
    (same ports and dirs: the voter set in the log names them) with a snapshot
    interval of FINAL_SNAPSHOT_INTERVAL_MS, so each writes a snapshot of the
    whole log (the workload ran with snapshots off: they would have cost it),
    then stop them. Returns the end offset of controller 1's newest snapshot,
    past the base of its last segment: what the job's compare stage checks its
    final state against."""
    from metalog.tools.kafka import quorum as kq

    cluster = kq.KafkaCluster(root, "", heap_mb=512)
    for node_id in kq.CONTROLLER_IDS:
        props_path = os.path.join(root, f"controller-{node_id}.properties")
        props = dict(line.rstrip("\n").split("=", 1) for line in open(props_path) if "=" in line)
        props["metadata.log.max.snapshot.interval.ms"] = str(FINAL_SNAPSHOT_INTERVAL_MS)
        with open(props_path, "w") as fh:
            fh.writelines(f"{k}={v}\n" for k, v in props.items())
        port = int(props["listeners"].rsplit(":", 1)[1])
        cluster.nodes[node_id] = kq.KafkaNode(node_id, "controller", port, props["log.dirs"], props_path,
                                              out_path=os.path.join(root, f"controller-{node_id}.out"))
    first = cluster.controllers[0].metadata_dir
    wanted = _log_end_base(first)
    t0 = time.monotonic()
    cluster.launch(cluster.controllers)
    try:
        cluster.wait_for(lambda: any(o > wanted for o in _checkpoints(first)), FINAL_SNAPSHOT_TIMEOUT_S,
                         "controller 1's snapshot of the whole log")
    finally:
        cluster.stop()
    end = _checkpoints(first)[-1]
    print(f"kafka: controllers restarted with snapshots on; controller 1 wrote a snapshot at offset "
          f"{end:,} ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    return end


def broker_replay(data_dir: str, records_max: int) -> tuple[int, float]:
    """The broker's own single-process replay of the same log (what
    ``python -m metalog.tools.bench.snapshot`` measures: Controller.apply_batches over
    whole segments), up to records_max records: (records applied, seconds)."""
    pdir = os.path.join(data_dir, "__cluster_metadata-0")
    c = Controller()
    applied = 0
    elapsed = 0.0
    for name in sorted(f for f in os.listdir(pdir) if f.endswith(".log")):
        if c.state.offset >= records_max:
            break
        with open(os.path.join(pdir, name), "rb") as fh:
            data = fh.read()
        t0 = time.perf_counter()
        applied += c.apply_batches(data, end_offset=records_max)
        elapsed += time.perf_counter() - t0
    return applied, elapsed


class TreeCpu:
    """CPU seconds of this process and every descendant (the JVM, Spark's
    Python daemon and workers), from Linux's /proc, sampled every
    interval_s while the job runs: a worker that exits between two samples
    loses at most one interval. None where /proc is not there."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.cpu_by_pid: dict[int, float] = {}
        self.name_by_pid: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-cpu", daemon=True)
        self.tick_s = 1 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
        self.available = os.path.exists("/proc/self/stat")

    def _sample(self) -> None:
        parents: dict[int, int] = {}
        cpu: dict[int, float] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as fh:
                    stat = fh.read()
            except OSError:  # exited since the listing
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # after "(comm)": state, ppid, ...
            parents[int(name)] = int(fields[1])
            self.name_by_pid[int(name)] = stat[stat.index("(") + 1:stat.rindex(")")]  # after exec: java
            cpu[int(name)] = (int(fields[11]) + int(fields[12])) * self.tick_s  # utime + stime
        ours = {os.getpid()}
        grew = True
        while grew:
            grew = False
            for pid, ppid in parents.items():
                if ppid in ours and pid not in ours:
                    ours.add(pid)
                    grew = True
        for pid in ours:
            self.cpu_by_pid[pid] = max(self.cpu_by_pid.get(pid, 0.0), cpu.get(pid, 0.0))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> "TreeCpu":
        if self.available:
            self._sample()
            self.base_by_pid = dict(self.cpu_by_pid)  # what this process had spent before the job
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.available:
            self._stop.set()
            self._thread.join()
            self._sample()

    def by_name(self) -> dict[str, float]:
        """CPU seconds per process name (java: the JVM; python: the driver,
        Spark's Python daemon and its workers)."""
        out: dict[str, float] = {}
        for pid, sec in self.cpu_by_pid.items():
            name = self.name_by_pid.get(pid, "?")
            out[name] = round(out.get(name, 0.0) + sec - self.base_by_pid.get(pid, 0.0), 1)
        return out

    @property
    def seconds(self) -> float | None:
        if not self.available:
            return None
        return round(sum(self.cpu_by_pid.values()) - sum(self.base_by_pid.values()), 1)


def own_data(args) -> str:
    """Our own generated log (cached in a temp dir per record count)."""
    base = args.dir or os.path.join(tempfile.gettempdir(), f"metalog-bench-spark-{args.records}")
    data_dir = os.path.join(base, "data")
    marker = os.path.join(data_dir, "bench.json")
    if not (os.path.exists(marker) and json.load(open(marker))["records"] == args.records):
        shutil.rmtree(base, ignore_errors=True)
        t0 = time.monotonic()
        generate(data_dir, args.records)
        print(f"generated {args.records:,} records in {time.monotonic() - t0:.1f} s into {data_dir}")
    return data_dir


def kafka_data(args) -> str:
    """A real Kafka log, cached under .bench/ of the checkout (git-ignored)."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    base = args.dir or os.path.join(repo, ".bench", f"spark-kafka-{args.records}")
    marker = os.path.join(base, "bench.json")
    if os.path.exists(marker):
        info = json.load(open(marker))
        if "final_snapshot" not in info:  # cached before the bench took one: take it now
            info["final_snapshot"] = snapshot_at_end(os.path.dirname(info["data_dir"]))
            with open(marker, "w") as fh:
                json.dump(info, fh)
        return info["data_dir"]
    shutil.rmtree(base, ignore_errors=True)
    t0 = time.monotonic()
    data_dir = generate_kafka(os.path.join(base, "kafka"), args.records)
    seconds = time.monotonic() - t0
    final = _checkpoints(os.path.join(data_dir, "__cluster_metadata-0"))[-1]
    print(f"Kafka wrote {args.records:,}+ records in {seconds:.1f} s into {data_dir}")
    with open(marker, "w") as fh:
        json.dump({"records": args.records, "data_dir": data_dir, "generate_seconds": round(seconds, 1),
                   "final_snapshot": final}, fh)
    return data_dir


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=10_000_000)
    ap.add_argument("--dir", default=None, help="input dir (default: a temp dir per record count)")
    ap.add_argument("--master", default="local[*]")
    ap.add_argument("--shuffle-partitions", type=int, default=16)
    ap.add_argument("--broker-records", type=int, default=200_000,
                    help="replay this many records (a prefix of the same log) with the broker's own "
                         "controller for its rate (default 200,000: every fence scans all partitions)")
    ap.add_argument("--tables", action="store_true",
                    help="also write the Parquet tables and plots (default: --no-tables, the "
                         ".checkpoint and report only)")
    ap.add_argument("--kafka", action="store_true",
                    help="replay a real Kafka log (generated once by Kafka 4.3.1, cached under .bench/)")
    args = ap.parse_args()
    data_dir = kafka_data(args) if args.kafka else own_data(args)
    base = os.path.dirname(data_dir)
    broker_n, broker_s = 0, 0.0
    if not args.kafka:  # our controller's rate on our own log only: Kafka's log has Kafka's records
        broker_n, broker_s = broker_replay(data_dir, min(args.broker_records, args.records))
        print(f"broker replay (Controller.apply_batches, one process): {broker_n:,} records in "
              f"{broker_s:.1f} s = {broker_n / broker_s:,.0f} records/s", file=sys.stderr)
    out = os.path.join(base, "out")
    t0 = time.monotonic()
    with TreeCpu() as cpu:
        code = spark_job.main(["snapshot", data_dir, "--out", out, "--master", args.master,
                               "--shuffle-partitions", str(args.shuffle_partitions)]
                              + ([] if args.tables else ["--no-tables"]))
    wall = time.monotonic() - t0
    rep = json.load(open(os.path.join(out, "report.json")))
    replay = rep.get("replay", {})
    read = rep.get("read", {})
    vote_s = rep.get("vote", {}).get("seconds")
    after_start = (read.get("seconds") or 0) + (vote_s or 0) + (replay.get("seconds") or 0)
    stages = rep.get("stages_s", {})
    records = read.get("records") or args.records  # Kafka's log: what Kafka wrote, a little over --records
    spark_rate = round(records / after_start) if after_start else None
    broker_rate = round(broker_n / broker_s) if broker_s else None
    print("stages (s): " + ", ".join(f"{k} {v}" for k, v in stages.items()), file=sys.stderr)
    print(f"path: {read.get('path')} ({read.get('path_why')}); {replay.get('shuffled_rows')} rows shuffled",
          file=sys.stderr)
    print(f"spark {args.master}: {spark_rate:,} records/s (read, vote, replay, checkpoint) beside the "
          f"broker's own replay: {broker_rate} records/s (one process); job CPU {cpu.seconds} s "
          f"(all processes) for {records:,} records", file=sys.stderr)
    print(json.dumps({
        "records": records, "kafka": args.kafka, "master": args.master, "exit_code": code, "tables": args.tables,
        "read_decode_seconds": read.get("seconds"), "read_records_per_s": read.get("records_per_s"),
        "vote_seconds": vote_s,
        "replay_records": replay.get("records"), "replay_seconds": replay.get("seconds"),
        "replay_records_per_s": replay.get("records_per_s"),
        "read_vote_replay_seconds": round(after_start, 1),
        "read_vote_replay_records_per_s": spark_rate,
        "stages_s": stages,
        "path": read.get("path"), "path_why": read.get("path_why"), "shuffled_rows": replay.get("shuffled_rows"),
        "job_cpu_seconds": cpu.seconds,
        "job_cpu_seconds_by_process": cpu.by_name() if cpu.available else None,
        "cpu_us_per_record": round(cpu.seconds / records * 1e6, 1) if cpu.seconds else None,
        "job_wall_seconds": round(wall, 1),
        "end_to_end_records_per_s": round(records / wall),
        "broker_replay_records": broker_n, "broker_replay_seconds": round(broker_s, 2),
        "broker_replay_records_per_s": broker_rate,
        "snapshot_records": rep.get("snapshot", {}).get("records"),
    }, indent=2))
    return code


if __name__ == "__main__":
    sys.exit(main())
