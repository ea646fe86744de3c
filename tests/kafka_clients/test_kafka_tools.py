"""Kafka's own tools against a default secure metalog quorum (issue 33 item
4): Apache Kafka 4.3.1's kafka-metadata-quorum, kafka-features, kafka-acls,
kafka-configs and kafka-cluster, each with ``--bootstrap-controller`` (Java's
Admin with ``bootstrap.controllers``, KIP-919) and ``--command-config`` SSL
properties: a PKCS12 keystore built at test time from the admin user's
certificate (Python's cryptography) and a PKCS12 truststore of our CA
(the JDK's keytool). Each answer is held against what the same command
printed against a real Kafka quorum.

KAFKA_* below are that reference, taken on 2026-11-28 from Apache Kafka
4.3.1's jars (.kafka/lib) with tools/kafka/quorum.py's harness: three
controllers (ids 1-3, PLAINTEXT, StandardAuthorizer), formatted by Kafka's
StorageTool with ``--initial-controllers`` and ``--release-version 3.9-IV0``
(metalog's metadata.version, so the levels compare), then the same commands
as here (the ids, ports and timestamps differ run to run; the tests compare
shapes, fields and formats, and values where they must agree). Running the
harness here would cost 20-40 s of JVM time for no more than this.
Where metalog deliberately answers otherwise, the difference is written in
docs/kafka-listener.md ("Kafka's own tools") and asserted here as such.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from metalog.tools import kafka

METADATA_QUORUM = "org.apache.kafka.tools.MetadataQuorumCommand"
FEATURES = "org.apache.kafka.tools.FeatureCommand"
ACLS = "org.apache.kafka.tools.AclCommand"
CONFIGS = "kafka.admin.ConfigCommand"
CLUSTER = "org.apache.kafka.tools.ClusterTool"
STORE_PASSWORD = "metalog-test"

# ---- Kafka 4.3.1's answers (see the module doc for when and how) ----------
KAFKA_STATUS = """\
ClusterId:              56QNUfXJR7e8Uz00Z_6q_Q
LeaderId:               1
LeaderEpoch:            1
HighWatermark:          21
MaxFollowerLag:         0
MaxFollowerLagTimeMs:   0
CurrentVoters:          [{"id": 1, "directoryId": "m1W5BrWbS7isFUyifX5LeQ", "endpoints": ["CONTROLLER://127.0.0.1:34165"]}, \
{"id": 2, "directoryId": "xKfiM-SQTuWh5xbxEKamXQ", "endpoints": ["CONTROLLER://127.0.0.1:34077"]}, \
{"id": 3, "directoryId": "hy5Xha6KT6SOLjx0E1tnhQ", "endpoints": ["CONTROLLER://127.0.0.1:52183"]}]
CurrentObservers:       []
"""
# After `remove-controller --controller-id 3`: the removed node stays as an observer.
KAFKA_OBSERVERS_AFTER_REMOVE = '[{"id": 3, "directoryId": "hy5Xha6KT6SOLjx0E1tnhQ"}]'
KAFKA_REPLICATION = (
    "NodeId\tDirectoryId           \tLogEndOffset\tLag\tLastFetchTimestamp\tLastCaughtUpTimestamp\tStatus  \t\n"
    "1     \tm1W5BrWbS7isFUyifX5LeQ\t31          \t0  \t1795829726157     \t1795829726157        \tLeader  \t\n"
    "2     \txKfiM-SQTuWh5xbxEKamXQ\t31          \t0  \t1795829726104     \t1795829726104        \tFollower\t\n")
KAFKA_FEATURES = {  # kafka-features describe, one line per feature the controller supports
    "eligible.leader.replicas.version": "SupportedMinVersion: 0                SupportedMaxVersion: 1                "
                                        "FinalizedVersionLevel: 0                Epoch: 5",
    "kraft.version": "SupportedMinVersion: 0                SupportedMaxVersion: 1                "
                     "FinalizedVersionLevel: 1                Epoch: 5",
    "metadata.version": "SupportedMinVersion: 3.3-IV3          SupportedMaxVersion: 4.3-IV0          "
                        "FinalizedVersionLevel: 3.9-IV0          Epoch: 5",
    # group.version, share.version, streams.version 0..1 and transaction.version 0..2, all finalized at 0
}
KAFKA_ACL_ADDED = {
    "cluster": "Adding ACLs for resource `ResourcePattern(resourceType=CLUSTER, name=kafka-cluster, "
               "patternType=LITERAL)`: \n \t(principal=User:alice, host=*, operation=DESCRIBE, permissionType=ALLOW)"
               "\n\n",
    "topic": "Adding ACLs for resource `ResourcePattern(resourceType=TOPIC, name=t1, patternType=PREFIXED)`: \n"
             " \t(principal=User:bob, host=*, operation=WRITE, permissionType=ALLOW)\n\n",
}
# --list prints one block per resource, in the order of the tool's HashMap (not the server's).
KAFKA_ACL_BLOCKS = {
    "Current ACLs for resource `ResourcePattern(resourceType=CLUSTER, name=kafka-cluster, patternType=LITERAL)`:\n"
    "\t(principal=User:alice, host=*, operation=DESCRIBE, permissionType=ALLOW)",
    "Current ACLs for resource `ResourcePattern(resourceType=TOPIC, name=t1, patternType=PREFIXED)`:\n"
    "\t(principal=User:bob, host=*, operation=WRITE, permissionType=ALLOW)",
}
KAFKA_CONFIGS = {
    "alter": "Completed updating config for broker 1.\n",
    # Kafka adds the static default as a synonym: DEFAULT_CONFIG:log.retention.hours=168 (see the docs).
    "describe": "Dynamic configs for broker 1 are:\n  log.retention.ms=123456 sensitive=false "
                "synonyms={DYNAMIC_BROKER_CONFIG:log.retention.ms=123456, DEFAULT_CONFIG:log.retention.hours=168}\n",
    "alter_default": "Completed updating default config for brokers in the cluster.\n",
    "describe_default": "Default configs for brokers in the cluster are:\n  log.retention.ms=654321 sensitive=false "
                        "synonyms={DYNAMIC_DEFAULT_BROKER_CONFIG:log.retention.ms=654321}\n",
    "described_deleted": "Dynamic configs for broker 1 are:\n",
}
# kafka-cluster (Admin.describeCluster over bootstrap.controllers: the voters, EndpointType 2).
KAFKA_CLUSTER_ID = "Cluster ID: 4_jfmbd-Rc-fzS1J0ktALw\n"
KAFKA_ENDPOINTS = ("ID         HOST      PORT       RACK       ENDPOINT_TYPE  \n"
                   "1          127.0.0.1 59137      null       controller     \n"
                   "2          127.0.0.1 47359      null       controller     \n"
                   "3          127.0.0.1 55871      null       controller     \n")
KAFKA_ADDED = ("Added controller 3 with directory id hy5Xha6KT6SOLjx0E1tnhQ and endpoints: "
               "CONTROLLER://127.0.0.1:52183\n")
KAFKA_REMOVED = "Removed  KRaft controller 3 with directory id hy5Xha6KT6SOLjx0E1tnhQ\n"  # two spaces: Kafka's
KAFKA_REMOVE_UNKNOWN = "org.apache.kafka.common.errors.VoterNotFoundException"

DIRECTORY_ID = re.compile(r"[A-Za-z0-9_-]{22}")


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def client_config(kafka_cluster, tmp_path_factory) -> str:
    """--command-config: SSL with PKCS12 stores made from the cluster's PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.serialization import pkcs12

    d = tmp_path_factory.mktemp("java_stores")
    with open(kafka_cluster.cert("admin.key"), "rb") as f:
        key = serialization.load_pem_private_key(f.read(), None)
    with open(kafka_cluster.cert("admin.crt"), "rb") as f:
        cert = x509.load_pem_x509_certificate(f.read())
    keystore = d / "admin.p12"
    keystore.write_bytes(pkcs12.serialize_key_and_certificates(
        b"admin", key, cert, None, serialization.BestAvailableEncryption(STORE_PASSWORD.encode())))
    truststore = d / "ca.p12"
    made = subprocess.run(["keytool", "-importcert", "-noprompt", "-alias", "metalog-ca", "-file",
                           kafka_cluster.cert("ca.crt"), "-keystore", str(truststore), "-storetype", "PKCS12",
                           "-storepass", STORE_PASSWORD], capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stdout + made.stderr
    props = d / "admin-ssl.properties"
    props.write_text(f"security.protocol=SSL\nssl.keystore.type=PKCS12\nssl.keystore.location={keystore}\n"
                     f"ssl.keystore.password={STORE_PASSWORD}\nssl.key.password={STORE_PASSWORD}\n"
                     f"ssl.truststore.type=PKCS12\nssl.truststore.location={truststore}\n"
                     f"ssl.truststore.password={STORE_PASSWORD}\ndefault.api.timeout.ms=30000\n")
    return str(props)


@pytest.fixture(scope="module")
def controllers(kafka_cluster) -> str:
    """--bootstrap-controller: the voters' Kafka listeners."""
    ports = kafka_cluster.kafka_ports
    return ",".join(f"{ports[n][0]}:{ports[n][1]}" for n in (1, 2, 3))


def _tool(main_class: str, controllers: str, config: str, *args: str, check: bool = True,
          subcommand: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """One of Kafka's tools with --bootstrap-controller and --command-config
    (after `subcommand`, for kafka-cluster's argparse-style parser)."""
    out = kafka.run_class(main_class, [*subcommand, "--bootstrap-controller", controllers, "--command-config", config,
                                       *args], timeout_s=120, heap_mb=128)
    if check:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


def _fields(text: str) -> dict[str, str]:
    return {k: v.strip() for k, _, v in (line.partition(":") for line in text.splitlines()) if v}


def _directory_id(kafka_cluster, node_id: int) -> str:
    props = kafka_cluster.cluster.data_dir(node_id) + "/meta.properties"
    return dict(line.split("=", 1) for line in open(props).read().splitlines() if "=" in line)["directory.id"]


# ------------------------------------------------------------ the quorum
def test_describe_status_gives_kafkas_fields(kafka_cluster, controllers, client_config):
    ours = _fields(_tool(METADATA_QUORUM, controllers, client_config, "describe", "--status").stdout)
    theirs = _fields(KAFKA_STATUS)
    assert list(ours) == list(theirs)  # the same fields, in the same order
    leader, epoch = kafka_cluster.leader()
    assert ours["ClusterId"] == kafka_cluster.cluster.cluster_id
    assert (int(ours["LeaderId"]), int(ours["LeaderEpoch"])) == (leader, epoch)
    assert int(ours["HighWatermark"]) > 0 and int(ours["MaxFollowerLag"]) >= 0
    assert int(ours["MaxFollowerLagTimeMs"]) >= 0

    voters, kafka_voters = json.loads(ours["CurrentVoters"]), json.loads(theirs["CurrentVoters"])
    assert {tuple(v) for v in voters} == {tuple(v) for v in kafka_voters} == {("id", "directoryId", "endpoints")}
    assert [v["id"] for v in voters] == [1, 2, 3]
    for v in voters:
        assert v["directoryId"] == _directory_id(kafka_cluster, v["id"])
        # Kafka's: the controller listener first; ours adds the Kafka listener (docs: a deliberate difference).
        host, port = kafka_cluster.kafka_ports[v["id"]]
        assert v["endpoints"][0].startswith("CONTROLLER://") and v["endpoints"][1:] == [f"SSL://{host}:{port}"]
    observers = json.loads(ours["CurrentObservers"])
    assert observers == [{"id": 4, "directoryId": _directory_id(kafka_cluster, 4)}]
    assert {tuple(o) for o in observers} == {tuple(o) for o in json.loads(KAFKA_OBSERVERS_AFTER_REMOVE)}

    # Admin.describeCluster over bootstrap.controllers (kafka-cluster): Kafka's lines, the voters' endpoints.
    cluster_id = _tool(CLUSTER, controllers, client_config, subcommand=("cluster-id",)).stdout
    assert cluster_id == KAFKA_CLUSTER_ID.replace("4_jfmbd-Rc-fzS1J0ktALw", kafka_cluster.cluster.cluster_id)
    endpoints = _tool(CLUSTER, controllers, client_config, subcommand=("list-endpoints",)).stdout
    rows = [line.split() for line in endpoints.splitlines()]
    assert rows[0] == KAFKA_ENDPOINTS.splitlines()[0].split()
    assert rows[1:] == [[str(n), *map(str, kafka_cluster.kafka_ports[n]), "null", "controller"] for n in (1, 2, 3)]
    assert endpoints.splitlines()[0] == KAFKA_ENDPOINTS.splitlines()[0]  # the same padding


def test_describe_replication_gives_kafkas_columns(kafka_cluster, controllers, client_config):
    text = _tool(METADATA_QUORUM, controllers, client_config, "describe", "--replication").stdout

    def table(t: str) -> list[list[str]]:
        return [[cell.strip() for cell in line.rstrip("\t").split("\t")] for line in t.splitlines() if line.strip()]

    (header, *rows), (kafka_header, *kafka_rows) = table(text), table(KAFKA_REPLICATION)
    assert header == kafka_header
    assert [r[-1] for r in kafka_rows] == ["Leader", "Follower"]  # Kafka: the leader's row first
    leader, _ = kafka_cluster.leader()
    by_id = {int(r[0]): dict(zip(header, r)) for r in rows}
    assert int(rows[0][0]) == leader and sorted(by_id) == [1, 2, 3, 4]
    leader_end = int(by_id[leader]["LogEndOffset"])
    for nid, row in by_id.items():
        assert row["Status"] == ("Leader" if nid == leader else "Observer" if nid == 4 else "Follower")
        assert row["DirectoryId"] == _directory_id(kafka_cluster, nid)
        assert int(row["Lag"]) == leader_end - int(row["LogEndOffset"]) >= 0
        assert int(row["LastCaughtUpTimestamp"]) <= int(row["LastFetchTimestamp"])


def test_features_describe_prints_kraft_and_metadata_version_as_kafka_does(controllers, client_config):
    text = _tool(FEATURES, controllers, client_config, "describe").stdout
    ours = {}
    for line in text.splitlines():
        m = re.fullmatch(r"Feature: (\S+)\s+(SupportedMinVersion: .*)", line.rstrip())
        assert m, line
        ours[m.group(1)] = m.group(2)
    # kraft.version and metadata.version only: metalog has no groups, shares,
    # streams or transactions to version (docs/kafka-listener.md).
    assert sorted(ours) == ["kraft.version", "metadata.version"]

    def cells(rest: str) -> dict[str, str]:
        return dict(re.findall(r"(\w+): (\S+)", rest))

    def without_epoch(rest: str) -> str:
        return re.sub(r"Epoch: \d+", "", rest)

    assert without_epoch(ours["kraft.version"]) == without_epoch(KAFKA_FEATURES["kraft.version"])
    mv, kafka_mv = cells(ours["metadata.version"]), cells(KAFKA_FEATURES["metadata.version"])
    assert list(mv) == list(kafka_mv)
    assert (mv["SupportedMinVersion"], mv["FinalizedVersionLevel"]) == ("3.3-IV3", "3.9-IV0") == (
        kafka_mv["SupportedMinVersion"], kafka_mv["FinalizedVersionLevel"])
    assert mv["SupportedMaxVersion"] == "3.9-IV0"  # Kafka 4.3.1 supports up to 4.3-IV0; we write 3.9-IV0's records
    assert mv["Epoch"] == cells(ours["kraft.version"])["Epoch"]  # one epoch for the finalized set, as Kafka's

    # metadata.version stays where it is: a level we do not write is refused, as Kafka refuses
    # a level beyond its own support (INVALID_UPDATE_VERSION).
    up = _tool(FEATURES, controllers, client_config, "upgrade", "--feature", "metadata.version=22", "--dry-run",
               check=False)
    assert up.returncode == 1 and "Can not upgrade metadata.version to 22" in up.stdout, up.stdout + up.stderr


# ------------------------------------------------------ ACLs and configs
def test_acls_added_listed_and_removed_as_kafka_prints_them(controllers, client_config):
    added = _tool(ACLS, controllers, client_config, "--add", "--allow-principal", "User:alice",
                  "--operation", "Describe", "--cluster").stdout
    assert added == KAFKA_ACL_ADDED["cluster"]
    added = _tool(ACLS, controllers, client_config, "--add", "--allow-principal", "User:bob", "--operation",
                  "Write", "--topic", "t1", "--resource-pattern-type", "prefixed").stdout
    assert added == KAFKA_ACL_ADDED["topic"]

    def blocks(text: str) -> set[str]:
        return {b.strip("\n") for b in text.split("\n\n") if b.strip()}

    listed = _tool(ACLS, controllers, client_config, "--list").stdout
    assert blocks(listed) - {b for b in blocks(listed) if "User:admin" in b} == KAFKA_ACL_BLOCKS
    for args in (["--allow-principal", "User:alice", "--operation", "Describe", "--cluster"],
                 ["--allow-principal", "User:bob", "--operation", "Write", "--topic", "t1",
                  "--resource-pattern-type", "prefixed"]):
        removed = _tool(ACLS, controllers, client_config, "--remove", "--force", *args)
        assert removed.stdout == "" and removed.stderr.strip() == "", removed  # Kafka prints nothing either
    after = _tool(ACLS, controllers, client_config, "--list").stdout
    assert not any("User:alice" in b or "User:bob" in b for b in blocks(after)), after


def test_broker_configs_altered_and_described_as_kafka_prints_them(controllers, client_config):
    broker = ["--entity-type", "brokers", "--entity-name", "1"]
    default = ["--entity-type", "brokers", "--entity-default"]
    out = _tool(CONFIGS, controllers, client_config, *broker, "--alter", "--add-config", "log.retention.ms=123456")
    assert out.stdout == KAFKA_CONFIGS["alter"]
    described = _tool(CONFIGS, controllers, client_config, *broker, "--describe").stdout
    # Kafka's answer less the static default's synonym: metalog knows no broker defaults (docs).
    assert described == KAFKA_CONFIGS["describe"].replace(", DEFAULT_CONFIG:log.retention.hours=168", "")
    out = _tool(CONFIGS, controllers, client_config, *default, "--alter", "--add-config", "log.retention.ms=654321")
    assert out.stdout == KAFKA_CONFIGS["alter_default"]
    assert _tool(CONFIGS, controllers, client_config, *default, "--describe").stdout == \
        KAFKA_CONFIGS["describe_default"]
    out = _tool(CONFIGS, controllers, client_config, *broker, "--alter", "--delete-config", "log.retention.ms")
    assert out.stdout == KAFKA_CONFIGS["alter"]
    assert _tool(CONFIGS, controllers, client_config, *broker, "--describe").stdout == \
        KAFKA_CONFIGS["described_deleted"]


# ------------------------------------------------------------ voters
def test_add_and_remove_controller_as_kafka_does(kafka_cluster, controllers, client_config, tmp_path):
    """The observer (node 4) made a voter with Kafka's add-controller, which
    reads the node's id, directory id (its meta.properties) and controller
    listener from the node's properties, then removed again."""
    cluster = kafka_cluster.cluster
    directory_id = _directory_id(kafka_cluster, 4)
    listen = cluster.config_for(4)["listen"]  # host:port of its CONTROLLER (peers') listener
    props = tmp_path / "node-4-controller.properties"
    props.write_text(open(client_config).read() + f"node.id=4\nprocess.roles=controller\n"
                     f"log.dirs={cluster.data_dir(4)}\ncontroller.listener.names=CONTROLLER\n"
                     f"listeners=CONTROLLER://{listen}\n")

    added = _tool(METADATA_QUORUM, controllers, str(props), "add-controller").stdout
    assert added == re.sub(r"directory id \S+ and endpoints: CONTROLLER://\S+",
                           f"directory id {directory_id} and endpoints: CONTROLLER://{listen}",
                           KAFKA_ADDED.replace("controller 3", "controller 4"))
    status = _fields(_tool(METADATA_QUORUM, controllers, client_config, "describe", "--status").stdout)
    assert [v["id"] for v in json.loads(status["CurrentVoters"])] == [1, 2, 3, 4]
    assert json.loads(status["CurrentObservers"]) == []

    removed = _tool(METADATA_QUORUM, controllers, client_config, "remove-controller", "--controller-id", "4",
                    "--controller-directory-id", directory_id).stdout
    assert removed == KAFKA_REMOVED.replace("controller 3", "controller 4").replace(
        "hy5Xha6KT6SOLjx0E1tnhQ", directory_id)
    cluster.wait_for(
        lambda: _observers(controllers, client_config) == [{"id": 4, "directoryId": directory_id}], 60,
        "node 4 back among the observers")

    unknown = _tool(METADATA_QUORUM, controllers, client_config, "remove-controller", "--controller-id", "9",
                    "--controller-directory-id", "AAAAAAAAAAAAAAAAAAAAAQ", check=False)
    assert unknown.returncode == 1 and KAFKA_REMOVE_UNKNOWN in unknown.stderr, unknown.stderr


def _observers(controllers: str, config: str) -> list[dict]:
    out = _tool(METADATA_QUORUM, controllers, config, "describe", "--status")
    return json.loads(_fields(out.stdout)["CurrentObservers"])
