"""``metalog bench --vs kafka``: metalog's quorum against Apache Kafka's own
KRaft quorum, both secured, driven by the same Kafka client library, in one run.

The two sides:

* metalog: 3 voters (tools/cluster LocalCluster, mutual TLS, default config),
  reached on their Kafka listeners (``kafka_listen``) as ``bootstrap.servers``;
  one broker (id 1) is registered through our CLI so that a topic can be
  placed (no broker process runs: metalog's controller only records it).
* Kafka: Apache Kafka 4.3.1 from the jars in .kafka/lib (tools/kafka/quorum.py),
  three controller-only nodes plus ONE broker node (id 100), every listener SSL
  with ``ssl.client.auth=required``, certificates of the same CA as metalog's,
  Kafka's stock JVM flags (``kafka-server-start.sh``: G1, -Xmx1G -Xms1G, full
  JIT) and Kafka's default properties (tools/kafka's test-sized thread counts
  and snapshot interval undone). The broker is there because the client
  library cannot reach a controller: librdkafka (confluent-kafka 2.16) has no
  ``bootstrap.controllers`` (KIP-919 is Java-only), so its admin requests go
  to a broker, which forwards them to the active controller, as every
  librdkafka or Kafka-client application's admin writes do in production;
  the broker also makes topic creation possible (replicas need a registered
  broker on both sides).

The workload (confluent-kafka's AdminClient, the same code for both sides, in
this process; each client is its own AdminClient, so its own connections:
a Kafka server reads one request of a connection at a time, so clients
multiplexed over one connection would be one client; each writes and awaits
its answer in a loop): topics created (1 partition, replication
factor 1, a new name each), configs altered (incrementalAlterConfigs SET
``retention.ms`` of one topic to a new value each), ACLs created (a new
principal each), at 1 and 100 clients, each for ``--duration-s`` after
``--warmup-s``. Writes/s and latency p50/p99 per phase; the 1-client phases
are the commit latency of one client's admin write. Then RSS of every quorum
node (Kafka's broker listed apart), and a kill -9 of the leader: the time
from the kill to the first ACL write that succeeds afterwards (one client,
nothing in flight at the kill). Start-up: from spawning the 3 quorum nodes
(dirs formatted before: Kafka's StorageTool, our format) to the first
elected leader (our admin API's /quorum, Kafka's "Completed transition to
Leader" log line; both polled every 50 ms).

Rounds interleave (metalog then Kafka, then Kafka then metalog, ...), each
side on a fresh cluster alone on the machine, so load from other work hurts
both alike; figures are medians over rounds, every round is in the JSON.
Then the killed node is restarted and a new node catches up on 1M records
(tools/bench/vs_kafka_catchup.py: what is written on each side, how, and
what is measured).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from metalog.tools.bench import vs_kafka_catchup as catchup
from metalog.tools.bench.common import latency_summary_ms, metalog_cluster

OPS = ("topics", "configs", "acls")
CLIENT_COUNTS = (1, 100)
CONFIG_TOPIC = "bench-config-target"
ACL_TOPIC = "bench-acl-target"
REQUEST_TIMEOUT_S = 30.0
FAILOVER_DEADLINE_S = 60.0
FAILOVER_EVERY_S = 0.1
LEADER_TIMEOUT_S = 180.0  # four JVMs starting on a loaded 2-core machine take tens of seconds
POLL_S = 0.05
# kafka-server-start.sh's heap and kafka-run-class.sh's performance options (Kafka 4.3.1).
KAFKA_STOCK_JVM = ["-Xmx1G", "-Xms1G", "-server", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20",
                   "-XX:InitiatingHeapOccupancyPercent=35", "-XX:+ExplicitGCInvokesConcurrent",
                   "-XX:MaxInlineLevel=15", "-Djava.awt.headless=true"]
# Kafka's defaults where tools/kafka/quorum.py's COMMON shrinks them for short tests.
KAFKA_DEFAULTS = {"metadata.log.max.snapshot.interval.ms": "3600000", "num.network.threads": "3",
                  "num.io.threads": "8", "background.threads": "10"}


class Side(Protocol):
    """What the bench needs of a quorum under test."""
    name: str

    def start(self) -> float: ...            # spawn the quorum; seconds to the first elected leader
    def ready(self) -> None: ...             # everything the workload needs is up
    def client_conf(self) -> dict[str, Any]: ...
    def quorum_pids(self) -> dict[int, int]: ...
    def extra_pids(self) -> dict[str, int]: ...
    def leader(self) -> int: ...
    def kill(self, node_id: int) -> None: ...
    def restart(self, node_id: int) -> None: ...
    def stop(self) -> None: ...
    # and what the catch-up needs: vs_kafka_catchup.CatchupSide
    def controller_endpoints(self) -> list[tuple[str, int]]: ...
    def tls_files(self) -> tuple[str, str, str]: ...
    def start_observer(self) -> None: ...
    def observer_dir(self) -> str: ...
    def metadata_dir(self, node_id: int) -> str: ...
    def applied_offset(self) -> int | None: ...


# ---------------------------------------------------------------- the sides
class MetalogSide:
    name = "metalog"

    def __init__(self, root: str, cert_dir: str):
        # Observer 4 is the catch-up's new node: formatted with the others, started last.
        self.cluster = metalog_cluster(root, cert_dir=cert_dir, observers=1)
        self.voters = sorted(self.cluster.voter_addrs)

    def start(self) -> float:
        c = self.cluster
        c.ensure_certs()
        for nid in sorted(c.nodes):  # formatting is not start-up (Kafka's StorageTool runs before too)
            os.makedirs(c.node_dir(nid), exist_ok=True)
            c.format_node(nid)
        t0 = time.monotonic()
        c.start(self.voters)
        c.wait_for(c.leader, LEADER_TIMEOUT_S, "metalog's first leader", poll_s=POLL_S)
        return time.monotonic() - t0

    def ready(self) -> None:
        c = self.cluster
        for _, host, port in (x for x in c.kafka_bootstrap() if x[0] in self.voters):
            c.wait_for(lambda h=host, p=port: _accepts(h, p), 60, f"Kafka listener {host}:{port}")
        # A registered broker, so that a topic's replica can be placed (Kafka's broker registers itself).
        out = subprocess.run([sys.executable, "-m", "metalog.tools.cli", "brokers", "register", "1",
                              "--bootstrap", ",".join(f"{h}:{p}" for h, p in self.controller_endpoints()),
                              "--cluster-id", c.cluster_id, "--client-config", c.client_config_path,
                              "--endpoint", "SSL:127.0.0.1:9001"], capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"metalog brokers register failed: {out.stdout}{out.stderr}")

    def client_conf(self) -> dict[str, Any]:
        d = self.cluster.cert_dir
        return {"bootstrap.servers": ",".join(f"{h}:{p}" for nid, h, p in self.cluster.kafka_bootstrap()
                                              if nid in self.voters),
                "security.protocol": "SSL", "ssl.ca.location": f"{d}/ca.crt",
                "ssl.certificate.location": f"{d}/admin.crt", "ssl.key.location": f"{d}/admin.key"}

    def quorum_pids(self) -> dict[int, int]:
        return {nid: p.pid for nid, p in self.cluster.procs.items() if p.poll() is None and nid in self.voters}

    def extra_pids(self) -> dict[str, int]:
        return {}

    def leader(self) -> int:
        return int(self.cluster.wait_for(self.cluster.leader, 60, "metalog's leader", poll_s=POLL_S)[0])

    def kill(self, node_id: int) -> None:
        os.kill(self.cluster.procs[node_id].pid, signal.SIGKILL)

    def restart(self, node_id: int) -> None:
        self.cluster.procs[node_id].wait(10)
        self.cluster.start_node(node_id)

    def stop(self) -> None:
        self.cluster.stop()

    def controller_endpoints(self) -> list[tuple[str, int]]:
        return [self.cluster.voter_addrs[nid] for nid in self.voters]

    def tls_files(self) -> tuple[str, str, str]:
        d = self.cluster.cert_dir
        return f"{d}/ca.crt", f"{d}/admin.crt", f"{d}/admin.key"

    def start_observer(self) -> None:
        self.cluster.start_node(catchup.OBSERVER_ID)

    def observer_dir(self) -> str:
        return self.metadata_dir(catchup.OBSERVER_ID)

    def metadata_dir(self, node_id: int) -> str:
        from metalog.broker.server.recovery import PARTITION_DIR

        return os.path.join(self.cluster.data_dir(node_id), PARTITION_DIR)

    def applied_offset(self) -> int | None:
        return (self.cluster.quorum(catchup.OBSERVER_ID) or {}).get("applied_offset")


class KafkaSide:
    name = "kafka"

    def __init__(self, root: str, cert_dir: str):
        from metalog.tools.kafka.quorum import KafkaCluster  # on use: every metalog command imports the bench CLI

        self.cluster = KafkaCluster.create(root, brokers=1, tls_dir=cert_dir, overrides=KAFKA_DEFAULTS,
                                           jvm_flags=KAFKA_STOCK_JVM, observers=1)

    def start(self) -> float:
        c = self.cluster
        t0 = time.monotonic()
        c.launch(c.controllers)
        c.wait_for(lambda: c.elected_leader() is not None, LEADER_TIMEOUT_S, "Kafka's first leader")
        took = time.monotonic() - t0
        c.launch(c.brokers)  # after the election: the broker's JVM does not slow the controllers' start
        return took

    def ready(self) -> None:
        from metalog.tools.kafka.quorum import STARTED

        c = self.cluster
        c.wait_for(lambda: all(STARTED in n.output() for n in c.controllers + c.brokers), LEADER_TIMEOUT_S,
                   "every Kafka node to start")

    def client_conf(self) -> dict[str, Any]:
        return {"bootstrap.servers": self.cluster.bootstrap_servers(), **self.cluster.client_tls()}

    def quorum_pids(self) -> dict[int, int]:
        return {n.node_id: n.proc.pid for n in self.cluster.controllers if n.proc and n.proc.poll() is None}

    def extra_pids(self) -> dict[str, int]:
        return {f"broker-{n.node_id}": n.proc.pid for n in self.cluster.brokers if n.proc and n.proc.poll() is None}

    def leader(self) -> int:
        found = self.cluster.elected_leader()
        if found is None:
            raise RuntimeError("no Kafka controller announced leadership")
        return found[0]

    def kill(self, node_id: int) -> None:
        proc = self.cluster.nodes[node_id].proc
        assert proc is not None
        os.kill(proc.pid, signal.SIGKILL)

    def restart(self, node_id: int) -> None:
        node = self.cluster.nodes[node_id]
        assert node.proc is not None
        node.proc.wait(10)
        self.cluster.launch([node])

    def stop(self) -> None:
        self.cluster.stop()

    def controller_endpoints(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", n.port) for n in self.cluster.controllers]

    def tls_files(self) -> tuple[str, str, str]:
        tls = self.cluster.client_tls()
        return tls["ssl.ca.location"], tls["ssl.certificate.location"], tls["ssl.key.location"]

    def start_observer(self) -> None:
        self.cluster.launch(self.cluster.observers)

    def observer_dir(self) -> str:
        return self.cluster.observers[0].metadata_dir

    def metadata_dir(self, node_id: int) -> str:
        return self.cluster.nodes[node_id].metadata_dir

    def applied_offset(self) -> int | None:
        return None  # Kafka tells it in JMX metrics only; the leader's DescribeQuorum view is the measure


def _accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False


def rss_mb(pid: int) -> float | None:
    """VmRSS of a live process, in MiB (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


# ---------------------------------------------------------------- the workload
@dataclass
class Writer:
    """One admin write of each kind through confluent-kafka's AdminClient."""
    admin: Any
    tag: str

    def write(self, op: str, phase: str, client: int, seq: int, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        """One write, awaited (raises what the client raised)."""
        for future in self.submit(op, phase, client, seq, timeout_s):
            future.result(timeout=timeout_s + 5)

    def submit(self, op: str, phase: str, client: int, seq: int, timeout_s: float = REQUEST_TIMEOUT_S) -> list[Any]:
        """One write sent; its futures (concurrent.futures.Future). Names hold
        the phase, so that no write repeats an earlier one (a repeated ACL
        would write nothing; a repeated topic is refused)."""
        from confluent_kafka.admin import (AclBinding, AclOperation, AclPermissionType, AlterConfigOpType,
                                           ConfigEntry, ConfigResource, NewTopic, ResourcePatternType,
                                           ResourceType)

        if op == "topics":
            futures = self.admin.create_topics([NewTopic(f"bench-{self.tag}-{phase}-{client}-{seq}", 1, 1)],
                                               request_timeout=timeout_s)
        elif op == "configs":
            entry = ConfigEntry("retention.ms", str(86_400_000 + client * 1_000_000 + seq),
                                incremental_operation=AlterConfigOpType.SET)
            futures = self.admin.incremental_alter_configs(
                [ConfigResource(ResourceType.TOPIC, CONFIG_TOPIC, incremental_configs=[entry])],
                request_timeout=timeout_s)
        else:
            binding = AclBinding(ResourceType.TOPIC, ACL_TOPIC, ResourcePatternType.LITERAL,
                                 f"User:bench-{self.tag}-{phase}-{client}-{seq}", "*", AclOperation.READ,
                                 AclPermissionType.ALLOW)
            futures = self.admin.create_acls([binding], request_timeout=timeout_s)
        return list(futures.values())


def admin_client(conf: dict[str, Any]) -> Any:
    from confluent_kafka.admin import AdminClient

    return AdminClient({**conf, "log_level": 0})  # connection errors during a failover are expected


def prepare(writer: Writer) -> None:
    """The topic whose config is altered, created once (with retries: a broker may still be registering)."""
    from confluent_kafka.admin import NewTopic

    deadline = time.monotonic() + 60
    while True:
        try:
            writer.admin.create_topics([NewTopic(CONFIG_TOPIC, 1, 1)], request_timeout=10)[CONFIG_TOPIC].result(20)
            return
        except Exception as exc:  # noqa: BLE001 (any refusal: retried until the deadline, then raised)
            if "TOPIC_ALREADY_EXISTS" in str(exc):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"could not create {CONFIG_TOPIC}: {exc}") from exc
            time.sleep(0.5)


def run_phase(writers: list[Writer], op: str, clients: int, warmup_s: float, duration_s: float) -> dict[str, Any]:
    """`clients` threads (client i writes through writers[i]) in a closed loop;
    counts and latencies of the writes that finished inside the measured window."""
    start = time.monotonic()
    window = (start + warmup_s, start + warmup_s + duration_s)
    lock = threading.Lock()
    latencies_us: list[int] = []
    totals = {"ops": 0, "errors": 0}
    first_error: list[str] = []

    def one(client: int) -> None:
        seq, ops, errors, lat = 0, 0, 0, []
        while time.monotonic() < window[1]:
            t0 = time.monotonic()
            try:
                writers[client].write(op, f"{clients}c", client, seq)
                ok = True
            except Exception as exc:  # noqa: BLE001 (counted and reported, the loop goes on)
                ok = False
                if not first_error:
                    first_error.append(repr(exc)[:300])
            t1 = time.monotonic()
            seq += 1
            if window[0] <= t1 <= window[1]:
                if ok:
                    ops += 1
                    lat.append(int((t1 - t0) * 1e6))
                else:
                    errors += 1
        with lock:
            totals["ops"] += ops
            totals["errors"] += errors
            latencies_us.extend(lat)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(warmup_s + duration_s + REQUEST_TIMEOUT_S + 30)
    out = {"op": op, "clients": clients, "duration_s": duration_s, **totals,
           "writes_per_s": round(totals["ops"] / duration_s, 1), **latency_summary_ms(latencies_us)}
    if first_error:
        out["first_error"] = first_error[0]
    return out


def _refresh_metadata(admin: Any) -> None:
    """A Metadata request now (a client that saw a write fail asks who the controller is)."""
    try:
        admin.list_topics(timeout=FAILOVER_EVERY_S * 5)
    except Exception:  # noqa: BLE001 (nobody answered yet: the next round asks again)
        pass


def measure_failover(side: Side, writer: Writer) -> dict[str, Any]:
    """kill -9 of the leader with no write in flight, then one client sends
    an ACL write and asks for metadata (list_topics) every FAILOVER_EVERY_S
    or so (each write a new ACL, none cancelled) until a write succeeds:
    milliseconds from the kill to the first success. Not one write retried:
    librdkafka keeps a write waiting for the controller it chose (the dead
    one, on our side) until the write's timeout, and learns the new one only
    from a Metadata answer, which it asks for every 5 minutes by itself
    (topic.metadata.refresh.interval.ms), see docs/bench.md."""
    for seq in range(3):  # the connections are up and warm before the kill
        writer.write("acls", "warm", 0, seq)
    leader = side.leader()
    first_ok: list[float] = []
    errors: list[str] = []
    done = threading.Event()

    def finished(future: Any) -> None:
        if future.exception() is None:
            first_ok.append(time.monotonic())
            done.set()
        elif len(errors) < 5:
            errors.append(repr(future.exception())[:200])

    killed_at, killed_at_unix = time.monotonic(), time.time()  # the wall clock: to read the logs against
    side.kill(leader)
    attempts = 0
    while not done.is_set() and time.monotonic() - killed_at < FAILOVER_DEADLINE_S:
        attempts += 1
        for future in writer.submit("acls", "failover", 0, attempts, timeout_s=FAILOVER_DEADLINE_S):
            future.add_done_callback(finished)
        _refresh_metadata(writer.admin)
        done.wait(FAILOVER_EVERY_S)
    next_ms = round((min(first_ok) - killed_at) * 1000, 1) if first_ok else None
    return {"leader_killed": leader, "next_write_ms": next_ms, "attempts": attempts, "errors": errors,
            "killed_at_unix": round(killed_at_unix, 3)}


# ---------------------------------------------------------------- one side, one round
def run_side(side: Side, warmup_s: float, duration_s: float, tag: str,
             progress: Callable[[str], None], catchup_records: int = catchup.RECORDS) -> dict[str, Any]:
    result: dict[str, Any] = {}
    try:
        result["startup_s"] = round(side.start(), 3)
        side.ready()
        writers = [Writer(admin_client(side.client_conf()), tag) for _ in range(max(CLIENT_COUNTS))]
        prepare(writers[0])
        phases = []
        for op in OPS:
            for clients in CLIENT_COUNTS:
                res = run_phase(writers, op, clients, warmup_s, duration_s)
                phases.append(res)
                progress(f"{tag} {side.name} {op} x{clients}: {res['writes_per_s']} writes/s "
                         f"p50 {res['p50_ms']} p99 {res['p99_ms']} ms, {res['errors']} errors")
        result["phases"] = phases
        result["rss_mb"] = {str(nid): rss_mb(pid) for nid, pid in side.quorum_pids().items()}
        result["rss_mb_other"] = {name: rss_mb(pid) for name, pid in side.extra_pids().items()}
        result["failover"] = measure_failover(side, Writer(admin_client(side.client_conf()), tag + "f"))
        progress(f"{tag} {side.name} start-up {result['startup_s']} s, failover {result['failover']}")
        # The killed leader comes back as it would (the writes below need no more than a majority).
        side.restart(result["failover"]["leader_killed"])
        writer = catchup.write_metalog if side.name == "metalog" else catchup.write_kafka
        result["catchup"] = catchup.run_catchup(side, writer, catchup_records, tag, progress)
    finally:
        side.stop()
    return result


# ---------------------------------------------------------------- the run
def run(root: str, rounds: int, warmup_s: float, duration_s: float,
        progress: Callable[[str], None] = lambda s: None, catchup_records: int = catchup.RECORDS) -> dict[str, Any]:
    """Interleaved rounds of both sides; the report (figures, ratios, rounds)."""
    from metalog.tools import kafka

    cert_dir = os.path.join(root, "certs")  # one CA for both sides
    report: dict[str, Any] = {"kafka_version": kafka.kafka_version(), "rounds": rounds, "warmup_s": warmup_s,
                              "duration_s": duration_s, "client_counts": list(CLIENT_COUNTS),
                              "catchup_records": catchup_records,
                              "load_before": [round(x, 2) for x in os.getloadavg()]}
    runs: dict[str, list[dict[str, Any]]] = {"metalog": [], "kafka": []}
    makers: dict[str, Callable[[str, str], Side]] = {"metalog": MetalogSide, "kafka": KafkaSide}
    for r in range(rounds):
        order = ("metalog", "kafka") if r % 2 == 0 else ("kafka", "metalog")
        for name in order:
            side = makers[name](os.path.join(root, f"{name}-{r}"), cert_dir)
            runs[name].append(run_side(side, warmup_s, duration_s, f"r{r}", progress, catchup_records))
    report["load_after"] = [round(x, 2) for x in os.getloadavg()]
    report["rounds_detail"] = runs
    report["figures"] = figures(runs)
    return report


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 3) if vals else None


def summarize(rounds: list[dict[str, Any]]) -> dict[str, float | None]:
    """One side's figures: the median over rounds of each."""
    out: dict[str, float | None] = {}
    for op in OPS:
        for clients in CLIENT_COUNTS:
            phases = [p for r in rounds for p in r["phases"] if p["op"] == op and p["clients"] == clients]
            out[f"{op}_per_s_{clients}"] = _median([p["writes_per_s"] for p in phases])
            if clients == 1:
                out[f"{op}_p50_ms_1"] = _median([p["p50_ms"] for p in phases])
                out[f"{op}_p99_ms_1"] = _median([p["p99_ms"] for p in phases])
    out["failover_ms"] = _median([r["failover"]["next_write_ms"] for r in rounds])
    out["startup_s"] = _median([r["startup_s"] for r in rounds])
    out["catchup_s"] = _median([r["catchup"]["seconds"] for r in rounds])
    out["catchup_records_per_s"] = _median([r["catchup"]["records_per_s"] for r in rounds])
    out["rss_mb_mean"] = _median([statistics.mean(v for v in r["rss_mb"].values() if v) for r in rounds])
    out["rss_mb_max"] = _median([max(v for v in r["rss_mb"].values() if v) for r in rounds])
    return out


# (key, label, higher is better)
ROWS: list[tuple[str, str, bool]] = [
    *[(f"{op}_per_s_{c}", f"{label} /s, {c} client{'s' if c > 1 else ''}", True)
      for op, label in (("topics", "topics created"), ("configs", "configs altered"), ("acls", "ACLs created"))
      for c in CLIENT_COUNTS],
    *[(f"{op}_{q}_ms_1", f"{label} {q}, 1 client (ms)", False)
      for op, label in (("topics", "create topic"), ("configs", "alter config"), ("acls", "create ACL"))
      for q in ("p50", "p99")],
    ("failover_ms", "next write after kill -9 (ms)", False),
    ("startup_s", "start-up to leader (s)", False),
    ("catchup_s", "new node caught up (s)", False),
    ("catchup_records_per_s", "new node catch-up (records/s)", True),
    ("rss_mb_mean", "RSS per quorum node, mean (MiB)", False),
    ("rss_mb_max", "RSS per quorum node, max (MiB)", False),
]


def figures(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    m, k = summarize(runs["metalog"]), summarize(runs["kafka"])
    out = []
    for key, label, higher_better in ROWS:
        a, b = m.get(key), k.get(key)
        ratio = round(a / b, 2) if a is not None and b else None
        better = None
        if a is not None and b is not None and a != b:
            better = "metalog" if (a > b) == higher_better else "kafka"
        out.append({"key": key, "label": label, "metalog": a, "kafka": b, "ratio_metalog_over_kafka": ratio,
                    "better": better})
    return out


def format_table(report: dict[str, Any]) -> str:
    lines = [f"metalog vs Apache Kafka {report['kafka_version']} (both mutual TLS, librdkafka AdminClient), "
             f"{report['rounds']} interleaved round(s), {report['duration_s']} s per phase; medians",
             f"{'measure':36}  {'metalog':>10}  {'kafka':>10}  {'metalog/kafka':>13}  better"]
    for row in report["figures"]:
        cells = [f"{row['label']:36}", f"{row['metalog']!s:>10}", f"{row['kafka']!s:>10}",
                 f"{row['ratio_metalog_over_kafka']!s:>13}", f"{row['better'] or '-'}"]
        lines.append("  ".join(cells))
    lines.append(f"load average before {report['load_before']}, after {report['load_after']} (1/5/15 min); "
                 f"catch-up: a new node after {report['catchup_records']:,} ACLs written (docs/bench.md)")
    return "\n".join(lines)


def cmd_vs_kafka(args: Any) -> int:
    """``metalog bench --vs kafka``: --rounds, --duration-s, --warmup-s, --json, --dir, --keep, --smoke."""
    import json

    from metalog.tools import kafka

    try:
        kafka.classpath()
        kafka.java()
    except kafka.KafkaMissing as exc:
        print(f"metalog bench --vs kafka: {exc}", file=sys.stderr)
        return 2
    warmup_s, duration_s, rounds = args.warmup_s, args.duration_s, args.rounds
    catchup_records = catchup.RECORDS
    if args.smoke:
        warmup_s, duration_s, rounds, catchup_records = 0.5, 1.5, 1, catchup.SMOKE_RECORDS
    root = args.dir or tempfile.mkdtemp(prefix="metalog-bench-kafka-")
    os.makedirs(root, exist_ok=True)
    try:
        report = run(root, rounds, warmup_s, duration_s,
                     progress=lambda s: print(f"[bench] {s}", file=sys.stderr, flush=True),
                     catchup_records=catchup_records)
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    report["argv"] = sys.argv[1:]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print(format_table(report))
    if args.json:
        print(f"JSON report: {args.json}")
    return 0
