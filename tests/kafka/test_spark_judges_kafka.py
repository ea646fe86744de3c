"""The Spark job judges Kafka's files (issue 33, item 3).

The real Kafka 4.3.1 cluster of tests/kafka/conftest.py's `reported` (three
KRaft controllers and a broker, driven by Kafka's own tools, then stopped;
shared with test_we_judge_kafka.py) is read by the Spark job, one local[2]
session for the module:

* ``spark snapshot --upto`` the first snapshot Kafka took past its tools'
  reports writes a checkpoint whose state is, field by field, what Kafka's
  tools reported (test_we_judge_kafka's own expectations), with Kafka's voter
  set; the Parquet tables hold Kafka's values; ``spark sql`` answers which
  partitions each topic has and who leads them, and when a topic was deleted
  (the offset Kafka's DumpLogSegments gives); the record types the job does
  not model are listed with the counts Kafka's decoder finds;
* ``spark audit`` over the three controllers and the broker (Kafka's voter
  set read from its snapshots and log, quorum-state has none since KIP-853)
  finds Kafka's high watermark by Kafka's rule and every replica consistent;
  with one bit flipped in a copy of a real segment it names the replica, the
  segment and the offset;
* a record of a type we model at a version past the ones we read is listed
  by type and version, not counted as invalid (no Spark needed for that).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from collections import Counter

import pytest

from metalog.storage import batch as b
from metalog.storage import metadata_records as mr
from metalog.storage.snapshot import SnapshotStore
from metalog.tools import kafka
from metalog.tools.kafka import quorum as kq
from metalog.tools.kafka.dump_output import parse_dump
from metalog.tools.spark import decode as D
from metalog.tools.spark import fold as F
from metalog.tools.spark import job as spark_job
from tests.kafka.test_we_judge_kafka import (GONE, OPERATIONS, TOPICS, assert_state_is_kafkas,
                                             kafka_metadata_version_level, kafka_uuid_text, normalized, read_voters)
from tests.spark.test_job import run_job, state_of_checkpoint
from tests.spark.test_tables import sql

pytestmark = pytest.mark.slow

# Our record types by Kafka's normalized name (RegisterBrokerRecord -> registerbroker).
MODELLED = {normalized(cls.__name__) for cls, _top in mr.RECORD_TYPES.values()}


@pytest.fixture(scope="module")
def spark():
    session = spark_job.get_spark("local[2]", ui=False, shuffle_partitions=2)
    yield session
    session.stop()


def controller_dirs(rep) -> list[str]:
    return [n.log_dir for n in rep.cluster.controllers]


def first_snapshot_past_the_reports(rep) -> int:
    """As test_we_judge_kafka: only NoOps lie between the reports and it."""
    store = SnapshotStore(rep.cluster.controllers[0].metadata_dir)
    return min(s.end_offset for s in store.list() if s.end_offset >= rep.last_change_offset)


@pytest.fixture(scope="module")
def kafka_dump(reported):
    """Kafka's DumpLogSegments over every controller's segments (one JVM)."""
    segments = {n.node_id: sorted(glob.glob(os.path.join(n.metadata_dir, "*.log")))
                for n in reported.cluster.controllers}
    dump = parse_dump(kafka.dump_log_segments([p for paths in segments.values() for p in paths]).stdout)
    assert not dump.unparsed, dump.unparsed[:5]
    return {node: [r for p in paths for batch in dump.files[p].batches for r in batch.records]
            for node, paths in segments.items()}


@pytest.fixture(scope="module")
def snapshot_run(spark, reported, tmp_path_factory):
    out = tmp_path_factory.mktemp("spark-kafka") / "out"
    upto = first_snapshot_past_the_reports(reported)
    code, rep = run_job(spark, "snapshot", *controller_dirs(reported), "--upto", str(upto), "--out", str(out),
                        "--report", str(out / "report.json"))
    assert code == spark_job.EXIT_OK, rep.get("first_failure") or rep.get("errors")
    return {"out": str(out), "report": rep, "upto": upto}


def test_spark_snapshot_of_kafka_dirs_is_the_state_kafkas_tools_reported(reported, snapshot_run):
    rep, upto = snapshot_run["report"], snapshot_run["upto"]
    assert rep["snapshot"]["published"] and rep["snapshot"]["end_offset"] == upto
    state = state_of_checkpoint(rep["snapshot"]["path"])
    assert state.offset == upto
    assert_state_is_kafkas(state, reported)
    assert not state.brokers[kq.BROKER_ID].fenced  # serving when the tools asked
    # The checkpoint carries Kafka's voter set (KIP-853) as kafka-metadata-quorum describes it.
    voters = read_voters(rep["snapshot"]["path"])
    theirs = sorted((v["id"], v["directoryId"], v["endpoints"]) for v in json.loads(reported.status["CurrentVoters"]))
    assert sorted((v.voter_id, v.directory_id, [f"{e.name}://{e.host}:{e.port}" for e in v.endpoints])
                  for v in voters.voters) == theirs
    assert rep["voters"] == [t[0] for t in theirs]
    # Kafka's own snapshots up to that offset equal the rebuilt state, Kafka's at `upto` among them.
    assert rep["comparisons"] and all(c["equal"] for c in rep["comparisons"]), rep["comparisons"]
    assert upto in {c["end_offset"] for c in rep["comparisons"]}


def test_kafka_record_types_we_do_not_model_are_listed_with_kafkas_counts(reported, snapshot_run, kafka_dump, capsys):
    """Counted as Kafka's DumpLogSegments decodes the same offsets: the metadata
    types outside ours by name, and the control records by Kafka's word."""
    rep, upto = snapshot_run["report"], snapshot_run["upto"]
    records = [r for r in kafka_dump[1] if r.offset < upto]
    assert all(r.error is None for r in records)
    theirs = Counter(normalized(r.metadata["type"]) for r in records
                     if r.control is None and normalized(r.metadata["type"]) not in MODELLED)
    assert theirs, "Kafka wrote no type we do not model: the check has nothing to check"
    assert Counter({normalized(k): v for k, v in rep["replay"]["unmodelled_records"].items()}) == theirs
    assert rep["replay"]["control_records"] == dict(Counter(r.control for r in records if r.control))
    assert rep["replay"]["invalid_records"] == 0 and rep["replay"]["data_records"] == 0
    # Kafka's snapshots hold RegisterController records: listed, not compared.
    assert all(c["unmodelled_records"].get("RegisterController") for c in rep["comparisons"])


def test_the_parquet_tables_hold_kafkas_values_and_sql_answers(spark, reported, snapshot_run, kafka_dump, capsys):
    out, upto = snapshot_run["out"], snapshot_run["upto"]

    def rows(query: str) -> list[dict]:
        capsys.readouterr()
        assert sql(spark, out, query, "--json") == spark_job.EXIT_OK
        return [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    assert rows(" UNION ".join(f"SELECT DISTINCT state_offset FROM {v}" for v in (
        "topics", "partitions", "configs", "acls", "brokers", "features"))) == [{"state_offset": upto}]
    # Which partitions has each topic, who leads them, which replicas are in sync: kafka-topics --describe.
    held: dict[str, dict] = {}
    for x in rows("SELECT t.name, t.topic_id, p.partition_id, p.leader, p.replicas, p.isr FROM partitions p "
                  "JOIN topics t ON p.topic_id = t.topic_id ORDER BY t.name, p.partition_id"):
        topic = held.setdefault(x["name"], {"id": x["topic_id"], "partitions": {}})
        topic["partitions"][x["partition_id"]] = (x["leader"], tuple(x["replicas"]), tuple(x["isr"]))
    assert held == {k: v for k, v in reported.topics.items() if not k.startswith("__")}
    configs = rows("SELECT resource_type, resource_name, name, value FROM configs")
    assert {(x["resource_type"], x["resource_name"]): {} for x in configs}.keys() <= reported.configs.keys()
    for key, expected in reported.configs.items():
        assert {x["name"]: x["value"] for x in configs if (x["resource_type"], x["resource_name"]) == key} == expected
    names = {v: k for k, v in OPERATIONS.items()}
    acls = {({2: "TOPIC", 4: "CLUSTER"}[x["resource_type"]], x["resource_name"],
             {3: "LITERAL", 4: "PREFIXED"}[x["pattern_type"]], x["principal"], x["host"], names[x["operation"]],
             {2: "DENY", 3: "ALLOW"}[x["permission_type"]]) for x in rows("SELECT * FROM acls")}
    assert acls == reported.acls
    broker = reported.cluster.brokers[0]
    assert [(x["broker_id"], x["endpoints"], x["fenced"]) for x in rows("SELECT * FROM brokers")] == [
        (broker.node_id, [f"PLAINTEXT://127.0.0.1:{broker.port}"], False)]
    features = {x["name"]: x["feature_level"] for x in rows("SELECT name, feature_level FROM features")}
    assert features["metadata.version"] == kafka_metadata_version_level(reported.features["metadata.version"])
    assert {k: v for k, v in features.items() if k != "metadata.version"} == {
        k: v for k, v in reported.features.items() if k not in ("metadata.version", "kraft.version") and v}
    # When was the deleted topic deleted: the offset of Kafka's RemoveTopicRecord, of the id its TopicRecord gave.
    kafka_records = [r for r in kafka_dump[1] if r.offset < upto and r.metadata]
    [gone_id] = [r.metadata["data"]["topicId"] for r in kafka_records
                 if r.metadata["type"] == "TOPIC_RECORD" and r.metadata["data"]["name"] == GONE]
    [removed_at] = [r.offset for r in kafka_records if r.metadata["type"] == "REMOVE_TOPIC_RECORD"]
    [x] = rows("SELECT offset, get_json_object(body, '$.topic_id') AS topic_id FROM history "
               "WHERE record_type = 'RemoveTopic'")
    assert x["offset"] == removed_at
    assert x["topic_id"] == kafka_uuid_text(gone_id)


def kafka_rule_hw(kafka_dump: dict[int, list], voters: list[int]) -> int:
    """Kafka's high watermark at rest by Kafka's rule (the largest offset a
    majority of the voters hold), from the log ends DumpLogSegments prints."""
    ends = sorted((max(r.offset for r in kafka_dump[v]) + 1 for v in voters), reverse=True)
    return ends[len(ends) // 2]


def test_spark_audit_agrees_with_kafkas_high_watermark(spark, reported, kafka_dump, tmp_path, capsys):
    """The three controllers and the broker. The broker's log dir also holds its
    topics' partitions: in a copy, records a client produced to judge-alpha-0
    (Kafka's fixture produces none), which the job must not take for a replica
    of the metadata log (it did: 'two leaders in epoch 1' at offset 0)."""
    broker = reported.cluster.brokers[0]
    broker_copy = str(tmp_path / "broker")
    shutil.copytree(broker.log_dir, broker_copy)
    with open(os.path.join(broker_copy, "judge-alpha-0", "00000000000000000000.log"), "wb") as f:
        f.write(b.encode_batch(0, 1, [b"order-1", b"order-2", b"order-3"], 1_700_000_000_000))
    code, rep = run_job(spark, "audit", *controller_dirs(reported), broker_copy, "--report",
                        str(tmp_path / "audit.json"))
    said = capsys.readouterr()
    assert code == spark_job.EXIT_OK, said.out
    voters = sorted(v["id"] for v in json.loads(reported.status["CurrentVoters"]))
    # Kafka's voters are in its snapshots and log (its quorum-state lists none): the broker is an observer.
    assert rep["voters"] == voters and "voters unknown" not in said.out
    hw = rep["hw"]
    assert hw == kafka_rule_hw(kafka_dump, voters)
    assert int(reported.status["HighWatermark"]) <= hw  # the tools saw it live, before the last NoOps
    # Kafka snapshots only committed offsets.
    assert max(s.end_offset for n in reported.cluster.controllers
               for s in SnapshotStore(n.metadata_dir).list()) <= hw
    assert not rep["errors"]
    for name, a in rep["audit"].items():
        node = int(a["node_id"])
        assert a["in_vote"] == (node in voters), name
        # Kafka's nodes stop one by one while the leader writes NoOps: a log may end
        # short of the HW (behind) or past it (an uncommitted tail), never differ below it.
        assert a["status"] in ("agrees", "behind", "uncommitted tail (differs at or above the HW)"), (name, a)
        assert a.get("first_diff_offset") is None or a["first_diff_offset"] >= hw
    assert any(line in said.out.splitlines() for line in (
        f"  replica file:{broker_copy} (node {broker.node_id}, observer: not voting): {status}"
        for status in ("agrees", "behind"))), said.out
    partitions = sorted(f"file:{broker_copy}/{t}-{p}" for t, n in TOPICS.items() for p in range(n))
    # Kafka may not have removed the deleted topic's partition dirs (renamed *-delete) yet: skipped too.
    skipped = rep["skipped_dirs"]
    assert set(partitions) <= set(skipped) and all(d.startswith(f"file:{broker_copy}/judge-") for d in skipped)
    assert len(rep["audit"]) == 4
    assert (f"  not read: {len(skipped)} dir(s) beside a __cluster_metadata-0 (a Kafka broker's topic "
            f"partitions), e.g. {skipped[0]}") in said.out.splitlines()


def test_spark_audit_names_a_bit_flipped_into_a_kafka_segment(spark, reported, tmp_path, capsys):
    copies = []
    for node in reported.cluster.controllers:
        copies.append(str(tmp_path / f"controller-{node.node_id}"))
        shutil.copytree(node.log_dir, copies[-1])
    victim_dir = copies[1]
    segment = sorted(glob.glob(os.path.join(victim_dir, D.PARTITION_DIR, "*.log")))[0]
    with open(segment, "rb") as f:
        data = bytearray(f.read())
    pos, victim = list(b.iter_batches(bytes(data)))[len(list(b.iter_batches(bytes(data)))) // 2]
    data[pos + victim.size - 2] ^= 0x04  # inside its last record: the CRC no longer matches
    with open(segment, "wb") as f:
        f.write(data)
    code, rep = run_job(spark, "audit", *copies, "--report", str(tmp_path / "audit.json"))
    said = capsys.readouterr()
    assert code == spark_job.EXIT_VALIDATION, said.out
    name = os.path.basename(segment)
    # What the user sees, on stdout: the replica, the segment, the byte and the offset.
    lines = said.out.splitlines()
    assert f"  corruption: file:{victim_dir}/{name} at byte {pos} offset {victim.base_offset}: corrupt batch: " \
        "CRC" in "\n".join(lines), said.out
    [replica_line] = [x for x in lines if x.startswith(f"  replica file:{victim_dir} ")]
    assert replica_line.startswith(f"  replica file:{victim_dir} (node 2): corruption: corrupt batch: "), replica_line
    assert replica_line.endswith(f"at offset {victim.base_offset} epoch {victim.leader_epoch}"), replica_line
    # ... and on stderr, the first failing check.
    last = said.err.splitlines()[-1]
    assert last.startswith("metalog spark: validation FAILED: corruption: corrupt batch: "), last
    assert last.endswith(f"(file:{victim_dir}/{name})"), last
    # The other two are consistent (the leader may hold an uncommitted tail).
    others = {n: a for n, a in rep["audit"].items() if n != f"file:{victim_dir}"}
    assert len(others) == 2 and not any(a.get("below_hw") for a in others.values()), others


def test_a_newer_version_of_a_modelled_type_is_listed_not_invalid(reported):
    """A Kafka newer than 4.3.1 may write RegisterBroker v5: the job cannot read
    it, so it lists it by type and version (log and snapshot alike), never as
    an invalid record and never applied."""
    node = reported.cluster.controllers[0]
    [segment] = sorted(glob.glob(os.path.join(node.metadata_dir, "*.log")))[:1]
    with open(segment, "rb") as f:
        data = f.read()
    values = [bytes(v) for pos, h in b.iter_batches(data) if not h.is_control
              for v in b.decode_records(data[pos:pos + h.size], h)]
    [register] = [v for v in values if isinstance(mr.decode_record(v), mr.RegisterBroker)][:1]
    top = mr.RECORD_TYPES[mr.REGISTER_BROKER][1]
    newer = register[:2] + bytes([top + 1]) + register[3:]
    assert F.key_of(register)[0] == F.K_BROKER
    assert F.key_of(newer) == (F.K_UNKNOWN, f"RegisterBroker v{top + 1}")
    assert D.entity_key(newer)[:2] == (F.SEC_UNMODELLED, f"RegisterBroker v{top + 1}")


def test_a_metadata_transaction_kafka_aborted_is_not_applied(spark, reported, tmp_path, capsys):
    """KIP-868: a controller that fails over mid-transaction leaves it open and
    the next leader writes AbortTransaction; Kafka never applies its records.
    Appended to a copy of a real controller's log (Kafka's own bootstrap
    transaction, Begin ... End, stays applied): a transaction creating a topic,
    aborted, then a topic created outside any transaction."""
    node = reported.cluster.controllers[0]
    copy = str(tmp_path / "controller-1")
    shutil.copytree(node.log_dir, copy)
    for snapshot in glob.glob(os.path.join(copy, D.PARTITION_DIR, "*.checkpoint")):
        os.unlink(snapshot)  # the log starts at 0: the replay needs none, and comparing them is slow
    segment = sorted(glob.glob(os.path.join(copy, D.PARTITION_DIR, "*.log")))[-1]
    with open(segment, "rb") as f:
        data = f.read()
    *_, (_pos, last) = b.iter_batches(data)
    ids = {name: f"00000000-0000-4000-8000-00000000000{i}" for i, name in enumerate(("judge-aborted", "judge-kept"))}
    # Kafka's v0 bodies: Name / Reason are tagged fields, here absent (no tags: one 0 byte).
    appended = [mr.UnknownRecord(23, 0, b"\x00"),  # BeginTransaction
                mr.Topic("judge-aborted", ids["judge-aborted"]),
                mr.UnknownRecord(25, 0, b"\x00"),  # AbortTransaction
                mr.Topic("judge-kept", ids["judge-kept"])]
    begin = last.next_offset
    with open(segment, "ab") as f:
        for i, rec in enumerate(appended):
            f.write(b.encode_batch(begin + i, last.leader_epoch, [mr.encode_record(rec)], last.max_timestamp_ms))
    out = tmp_path / "out"
    code, rep = run_job(spark, "snapshot", copy, "--out", str(out), "--report", str(out / "r.json"), "--no-tables")
    said = capsys.readouterr()
    assert code == spark_job.EXIT_OK, said.out
    assert rep["hw"] == begin + len(appended)
    assert rep["replay"]["aborted_transactions"] == [[begin, begin + 2]]
    assert rep["replay"]["open_transaction_at"] is None  # Kafka's bootstrap transaction ended
    names = {t.name for t in state_of_checkpoint(rep["snapshot"]["path"]).topics.values()}
    assert "judge-kept" in names and "judge-aborted" not in names
    # The records of Kafka's bootstrap transaction (it ended) and the later ones are applied.
    assert {t for t in reported.topics if not t.startswith("__")} <= names
    assert (f"  metadata transaction aborted at offset {begin + 2}: its records {begin}..{begin + 2} not applied"
            in said.out.splitlines())
