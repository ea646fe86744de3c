"""A real Apache Kafka KRaft cluster run from the jars, for metalog to judge
its files (issue 33 item 3: "we judge Kafka's files").

``KafkaCluster.create(root)`` lays out three controller-only nodes (node ids
1-3, ``process.roles=controller``) and, unless ``brokers=0``, one broker
(node id 100: topics need one), each with its own ``server.properties`` and
``log.dirs`` under `root`, on free local ports, PLAINTEXT, with Kafka's
StandardAuthorizer (so ACLs can be written; everyone is allowed when no ACL
matches). Kafka's own StorageTool formats every dir: the controllers as a
dynamic quorum (``--initial-controllers id@host:port:directory-id``,
kraft.version 1), the broker with ``--no-initial-controllers``. ``start()``
runs ``kafka.Kafka`` per node (``-Xmx256m``, serial GC, C1 only: the machine
is small) and waits for each to say it started; ``tool()`` runs one of
Kafka's command-line tools (``kafka-topics``, ``kafka-configs``,
``kafka-acls``, ``kafka-features``, ``kafka-metadata-quorum``) against it;
``stop()`` ends the broker, then the controllers, with SIGTERM (Kafka's
orderly shutdown) and waits for them. Snapshots come often
(``metadata.log.max.snapshot.interval.ms``) and the active controller writes
a NoOpRecord every ``metadata.max.idle.interval.ms``, so a short run leaves
segments and snapshots to read.

With ``tls_dir`` (a directory holding a CA as ``metalog certs`` makes it,
``ca.crt``/``ca.key``; one is made there if absent) every listener is SSL with
``ssl.client.auth=required``: each node gets a node certificate of that CA
(CN ``node-<id>``, SAN 127.0.0.1) as a PKCS12 keystore built with Python's
cryptography, the CA as a PEM truststore (Kafka reads PEM, KIP-651), and
``ssl.principal.mapping.rules`` maps a certificate to ``User:<CN>``, as
metalog does; ``client_tls()`` issues the ``admin`` user's PEM files for a
client, and ``quorum()``/``admin()`` pass Kafka's tools ``command_config()``,
the same files as an SSL client's properties. ``overrides`` replaces any property (the bench restores Kafka's
defaults where COMMON shrinks them for tests) and ``jvm_flags`` the JVM's
flags (the bench runs Kafka's stock ``kafka-server-start.sh`` flags).
``launch()`` spawns every node without waiting and ``elected_leader()``
reads the highest-epoch leader a controller's log announced. ``observers=N``
lays out N more controller-only nodes (ids 4, 5, ...) formatted with
``--no-initial-controllers``: observers of the dynamic quorum, never started
by ``start()``/``launch()`` (``launch(cluster.observers)`` starts them; the
bench's new node catching up).

Nothing here is metalog: the dirs are Kafka's, written by Kafka.
"""

from __future__ import annotations

import base64
import os
import re
import signal
import socket
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

from metalog.tools import kafka

STORAGE_TOOL = "kafka.tools.StorageTool"
SERVER = "kafka.Kafka"
TOPICS = "org.apache.kafka.tools.TopicCommand"
CONFIGS = "kafka.admin.ConfigCommand"
ACLS = "org.apache.kafka.tools.AclCommand"
FEATURES = "org.apache.kafka.tools.FeatureCommand"
METADATA_QUORUM = "org.apache.kafka.tools.MetadataQuorumCommand"

SERVER_LOG4J2 = os.path.join(kafka.HERE, "log4j2-server.properties")
CONTROLLER_IDS = (1, 2, 3)
BROKER_ID = 100
STARTED = "Kafka Server started"  # KafkaRaftServer's line once a node serves
START_TIMEOUT_S = 120.0
STORE_PASSWORD = "metalog-kafka"  # of the generated local keystores; nothing secret is in them
# KafkaRaftClient's QuorumState logs "Completed transition to Leader(localVoterNode=..., epoch=N, ...".
LEADER_LINE = re.compile(r"Completed transition to Leader\(.*?, epoch=(\d+)")
STOP_TIMEOUT_S = 60.0

# What every node shares; small snapshot interval and idle NoOps so a short run snapshots.
COMMON = {
    "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
    "controller.listener.names": "CONTROLLER",
    "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
    "allow.everyone.if.no.acl.found": "true",
    "super.users": "User:ANONYMOUS",
    "metadata.log.max.snapshot.interval.ms": "3000",
    "metadata.max.idle.interval.ms": "500",
    "num.network.threads": "1",
    "num.io.threads": "2",
    "background.threads": "2",
}
BROKER = {
    "offsets.topic.replication.factor": "1",
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "group.initial.rebalance.delay.ms": "0",
    "num.partitions": "1",
    "log.cleaner.enable": "false",
}


def kafka_uuid() -> str:
    """A random id in Kafka's printed form (url-safe base64 of 16 bytes, no
    padding), not starting with '-' (Kafka's Uuid.randomUuid avoids it too)."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class KafkaNode:
    node_id: int
    role: str  # "controller" or "broker"
    port: int
    log_dir: str  # log.dirs: meta.properties and __cluster_metadata-0 are in it
    props_path: str
    directory_id: str = ""  # a controller's, given to the format (KIP-853)
    proc: subprocess.Popen | None = None
    out_path: str = ""

    @property
    def metadata_dir(self) -> str:
        return os.path.join(self.log_dir, "__cluster_metadata-0")

    def output(self) -> str:
        try:
            with open(self.out_path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""


@dataclass
class KafkaCluster:
    root: str
    cluster_id: str
    nodes: dict[int, KafkaNode] = field(default_factory=dict)
    heap_mb: int = 256
    tls_dir: str = ""  # a CA's dir: SSL with client auth on every listener (see the module doc)
    overrides: dict[str, str] = field(default_factory=dict)  # properties over COMMON/BROKER/TLS
    jvm_flags: list[str] | None = None  # instead of the small-machine flags of _spawn

    @classmethod
    def create(cls, root: str, brokers: int = 1, heap_mb: int = 256, tls_dir: str = "",
               overrides: dict[str, str] | None = None, jvm_flags: list[str] | None = None,
               observers: int = 0) -> "KafkaCluster":
        """Write every node's properties and format its dir with Kafka's StorageTool."""
        os.makedirs(root, exist_ok=True)
        c = cls(root, kafka_uuid(), heap_mb=heap_mb, tls_dir=tls_dir, overrides=dict(overrides or {}),
                jvm_flags=jvm_flags)
        for node_id in CONTROLLER_IDS:
            c.nodes[node_id] = c._node(node_id, "controller")
            c.nodes[node_id].directory_id = kafka_uuid()
        for i in range(brokers):
            c.nodes[BROKER_ID + i] = c._node(BROKER_ID + i, "broker")
        for i in range(observers):
            node_id = max(CONTROLLER_IDS) + 1 + i
            c.nodes[node_id] = c._node(node_id, "observer")
        for node in c.nodes.values():
            c._write_props(node)
        c._format()
        return c

    def _node(self, node_id: int, role: str) -> KafkaNode:
        log_dir = os.path.join(self.root, f"{role}-{node_id}")
        return KafkaNode(node_id, role, free_port(), log_dir, os.path.join(self.root, f"{role}-{node_id}.properties"),
                         out_path=os.path.join(self.root, f"{role}-{node_id}.out"))

    @property
    def controllers(self) -> list[KafkaNode]:
        return [n for n in self.nodes.values() if n.role == "controller"]

    @property
    def observers(self) -> list[KafkaNode]:
        """Controller-only nodes outside the voter set (``create(observers=N)``)."""
        return [n for n in self.nodes.values() if n.role == "observer"]

    @property
    def brokers(self) -> list[KafkaNode]:
        return [n for n in self.nodes.values() if n.role == "broker"]

    def bootstrap_controllers(self) -> str:
        return ",".join(f"127.0.0.1:{n.port}" for n in self.controllers)

    def bootstrap_servers(self) -> str:
        return ",".join(f"127.0.0.1:{n.port}" for n in self.brokers)

    def _write_props(self, node: KafkaNode) -> None:
        props = dict(COMMON, **{"node.id": str(node.node_id), "log.dirs": node.log_dir,
                                "controller.quorum.bootstrap.servers": self.bootstrap_controllers()})
        if node.role in ("controller", "observer"):
            props.update({"process.roles": "controller", "listeners": f"CONTROLLER://127.0.0.1:{node.port}"})
        else:
            props.update(BROKER, **{"process.roles": "broker", "listeners": f"PLAINTEXT://127.0.0.1:{node.port}",
                                    "advertised.listeners": f"PLAINTEXT://127.0.0.1:{node.port}",
                                    "inter.broker.listener.name": "PLAINTEXT"})
        if self.tls_dir:
            props.update(self._tls_props(node))
        props.update(self.overrides)
        with open(node.props_path, "w") as f:
            f.writelines(f"{k}={v}\n" for k, v in props.items())

    # ------------------------------------------------------------------- TLS

    def _tls_props(self, node: KafkaNode) -> dict[str, str]:
        """SSL on every listener (the broker's is named SSL), client certificates
        required, principals User:<CN>; super users: the admin and every node."""
        keystore = self._keystore(node.node_id)
        out = {"listener.security.protocol.map": "CONTROLLER:SSL,SSL:SSL",
               "ssl.client.auth": "required",
               "ssl.keystore.type": "PKCS12", "ssl.keystore.location": keystore,
               "ssl.keystore.password": STORE_PASSWORD, "ssl.key.password": STORE_PASSWORD,
               "ssl.truststore.type": "PEM", "ssl.truststore.location": os.path.join(self.tls_dir, "ca.crt"),
               "ssl.principal.mapping.rules": "RULE:^CN=([^,]+)$/$1/,DEFAULT",
               "super.users": ";".join(["User:admin", *(f"User:node-{n}" for n in sorted(self.nodes))])}
        if node.role == "broker":
            out.update({"listeners": f"SSL://127.0.0.1:{node.port}",
                        "advertised.listeners": f"SSL://127.0.0.1:{node.port}", "inter.broker.listener.name": "SSL"})
        return out

    def _keystore(self, node_id: int) -> str:
        """<tls_dir>/kafka/node-<id>.p12: the node's certificate and key of the CA in tls_dir."""
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.serialization import pkcs12

        from metalog.tools.cluster import certs

        if not os.path.exists(os.path.join(self.tls_dir, "ca.crt")):
            certs.init_ca(self.tls_dir)
        out = os.path.join(self.tls_dir, "kafka")
        issued = certs.issue_node(self.tls_dir, out, node_id, ["127.0.0.1", "localhost"])
        with open(issued.key_path, "rb") as f:
            key = serialization.load_pem_private_key(f.read(), None)
        with open(issued.cert_path, "rb") as f:
            cert = x509.load_pem_x509_certificate(f.read())
        path = os.path.join(out, f"node-{node_id}.p12")
        with open(path, "wb") as f:
            f.write(pkcs12.serialize_key_and_certificates(
                f"node-{node_id}".encode(), key, cert, None,  # type: ignore[arg-type]
                serialization.BestAvailableEncryption(STORE_PASSWORD.encode())))
        return path

    def client_tls(self, user: str = "admin") -> dict[str, str]:
        """librdkafka's SSL settings for `user` (a user certificate of the CA in tls_dir, issued once)."""
        from metalog.tools.cluster import certs

        out = os.path.join(self.tls_dir, "kafka")
        if not os.path.exists(os.path.join(out, f"{user}.crt")):
            certs.issue_user(self.tls_dir, out, user)
        return {"security.protocol": "SSL", "ssl.ca.location": os.path.join(self.tls_dir, "ca.crt"),
                "ssl.certificate.location": os.path.join(out, f"{user}.crt"),
                "ssl.key.location": os.path.join(out, f"{user}.key")}

    def _format(self) -> None:
        """Kafka's StorageTool on every node, the JVMs side by side (each
        spends seconds starting; one at a time they would add up)."""
        initial = ",".join(f"{n.node_id}@127.0.0.1:{n.port}:{n.directory_id}" for n in self.controllers)

        def one(node: KafkaNode) -> subprocess.CompletedProcess[str]:
            extra = ["--initial-controllers", initial] if node.role == "controller" else ["--no-initial-controllers"]
            return kafka.run_class(STORAGE_TOOL, ["format", "-t", self.cluster_id, "-c", node.props_path, *extra],
                                   timeout_s=180, heap_mb=128)

        nodes = list(self.nodes.values())
        with ThreadPoolExecutor(len(nodes)) as pool:
            results = list(pool.map(one, nodes))
        for node, out in zip(nodes, results):
            if out.returncode != 0:
                raise RuntimeError(f"Kafka's StorageTool could not format node {node.node_id}: "
                                   f"{out.stdout[-1500:]}{out.stderr[-1500:]}")

    # ------------------------------------------------------------- processes

    def start(self, timeout_s: float = START_TIMEOUT_S) -> float:
        """Start every node (controllers first) and wait until each says it
        started; returns the seconds that took."""
        t0 = time.monotonic()
        for node in self.controllers + self.brokers:
            self._spawn(node)
        for node in self.controllers + self.brokers:
            self.wait_for(lambda n=node: STARTED in n.output(), t0 + timeout_s - time.monotonic(),
                          f"Kafka node {node.node_id} to start", node)
        return time.monotonic() - t0

    def launch(self, nodes: Sequence[KafkaNode] | None = None) -> None:
        """Spawn `nodes` (every node, controllers first, by default) without waiting for any."""
        for node in nodes if nodes is not None else self.controllers + self.brokers:
            self._spawn(node)

    def elected_leader(self) -> tuple[int, int] | None:
        """(node id, epoch) of the highest-epoch Leader state a controller's
        log announced (a killed leader's last line stays: a caller after a
        failover looks for a higher epoch)."""
        best = None
        for node in self.controllers:
            epochs = [int(e) for e in LEADER_LINE.findall(node.output())]
            if epochs and (best is None or max(epochs) > best[1]):
                best = (node.node_id, max(epochs))
        return best

    def _spawn(self, node: KafkaNode) -> None:
        flags = self.jvm_flags if self.jvm_flags is not None else [
            f"-Xmx{self.heap_mb}m", "-Xms32m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-XX:CICompilerCount=1"]
        command = [kafka.java(), *flags, f"-Dlog4j2.configurationFile={SERVER_LOG4J2}",
                   "-cp", kafka.classpath(), SERVER, node.props_path]
        with open(node.out_path, "ab") as out:
            node.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    def wait_for(self, cond: Callable[[], bool], timeout_s: float, what: str, node: KafkaNode | None = None) -> None:
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while not cond():
            dead = [n for n in self.nodes.values() if n.proc is not None and n.proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                tail = (dead[0] if dead else node or self.controllers[0]).output()[-3000:]
                raise TimeoutError(f"waiting for {what}: " + (f"node {dead[0].node_id} exited" if dead else
                                                              f"timed out after {timeout_s:.0f} s") + f"\n{tail}")
            time.sleep(0.2)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM (Kafka's orderly shutdown), broker first; SIGKILL past the timeout."""
        for group in (self.brokers, self.observers, self.controllers):
            for node in group:
                if node.proc is not None and node.proc.poll() is None:
                    node.proc.send_signal(signal.SIGTERM)
            for node in group:
                if node.proc is None:
                    continue
                try:
                    node.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    node.proc.kill()
                    node.proc.wait(10)

    def kill(self, timeout_s: float = 30.0) -> None:
        """kill -9 every node still running (a test's teardown: nothing to shut down in order)."""
        for node in self.nodes.values():
            if node.proc is not None and node.proc.poll() is None:
                node.proc.kill()
                node.proc.wait(timeout_s)

    # ----------------------------------------------------------------- tools

    def tool(self, main_class: str, args: Sequence[str], timeout_s: float = 120.0,
             check: bool = True) -> subprocess.CompletedProcess[str]:
        """One of Kafka's command-line tools; raises with its output if it failed (check)."""
        out = kafka.run_class(main_class, list(args), timeout_s=timeout_s, heap_mb=128)
        if check and out.returncode != 0:
            raise RuntimeError(f"{main_class} {' '.join(args)} exited {out.returncode}:\n"
                               f"{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
        return out

    def quorum(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """kafka-metadata-quorum against the controllers (bootstrap.controllers)."""
        return self.tool(METADATA_QUORUM, ["--bootstrap-controller", self.bootstrap_controllers(),
                                           *self.command_config(), *args], check=check)

    def admin(self, main_class: str, *args: str) -> subprocess.CompletedProcess[str]:
        """kafka-topics / -configs / -acls / -features against the broker."""
        return self.tool(main_class, ["--bootstrap-server", self.bootstrap_servers(), *self.command_config(), *args])

    def command_config(self, user: str = "admin") -> list[str]:
        """`--command-config FILE` for Kafka's tools as `user` over SSL (none without tls_dir):
        the CA as a PEM truststore, the user's key and certificate as a PEM keystore."""
        if not self.tls_dir:
            return []
        path = os.path.join(self.root, f"{user}-client.properties")
        if not os.path.exists(path):
            pem = self.client_tls(user)
            keystore = os.path.join(self.root, f"{user}-keystore.pem")
            with open(keystore, "w") as out:
                for part in ("ssl.key.location", "ssl.certificate.location"):
                    with open(pem[part]) as f:
                        out.write(f.read())
            with open(path, "w") as out:
                out.write(f"security.protocol=SSL\nssl.truststore.type=PEM\n"
                          f"ssl.truststore.location={pem['ssl.ca.location']}\n"
                          f"ssl.keystore.type=PEM\nssl.keystore.location={keystore}\n")
        return ["--command-config", path]


def describe_status(text: str) -> dict[str, str]:
    """`kafka-metadata-quorum describe --status`: its `Key: value` lines."""
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines()) if v}
