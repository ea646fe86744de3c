"""The Spark job end to end on a real local SparkSession (local[2], UI off),
over segment files written by metalog.storage.segments.SegmentedLog as a broker writes them."""

from __future__ import annotations

import argparse
import json
import os
import random

import pytest

from metalog.broker.controller.state import ControllerState, load_snapshot, write_controller_snapshot
from metalog.protocol.messages import SnapshotId
from metalog.storage import batch as b
from metalog.storage import metadata_records as r
from metalog.storage import control_records as cr
from metalog.storage.segments import SegmentedLog
from metalog.storage.snapshot import SnapshotStore, read_snapshot, read_snapshot_voters, verify_snapshot
from tests.spark.workload import PARTITION_DIR, random_records, sequential_state, write_log
from metalog.tools.spark import job as spark_job

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spark():
    session = spark_job.get_spark("local[2]", ui=False, shuffle_partitions=2)
    yield session
    session.stop()


def run_job(spark, *argv: str) -> tuple[int, dict]:
    import argparse

    parser = argparse.ArgumentParser()
    spark_job.register_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["spark", *argv, "--quiet", "--shuffle-partitions", "2",
                              "--master", "local[2]"])
    args.keep_session = True  # the module's session is reused (JVM start is slow)
    code = spark_job.run(args)
    return code, json.load(open(args.report)) if args.report and os.path.exists(args.report) else {}


def broker_snapshot(data_dir: str, state: ControllerState, epoch: int, cluster_id: str) -> SnapshotId:
    store = SnapshotStore(os.path.join(data_dir, PARTITION_DIR))
    sid = SnapshotId(state.offset, epoch)
    write_controller_snapshot(store, state, sid, 123, cluster_id)
    return sid


def state_of_checkpoint(path: str) -> ControllerState:
    sid, _header, values = read_snapshot(path)
    st = ControllerState.from_records((r.decode_record(v) for v in values), sid.end_offset)
    assert st.invalid_records == 0
    return st


def test_snapshot_equals_state_machine_and_broker_snapshot(spark, tmp_path):
    values = random_records(random.Random(11), 700)
    dirs = [str(tmp_path / f"n{i}") for i in (1, 2, 3)]
    recs = [write_log(d, values, node_id=i + 1, seed=5) for i, d in enumerate(dirs)][0]
    by_offset = [(o, v) for o, _e, v in recs]
    end = recs[-1][0] + 1
    mid = recs[400][0]
    mid_epoch = recs[399][1]
    broker_snapshot(dirs[1], sequential_state(by_offset, mid), mid_epoch, "test-cluster")
    out = tmp_path / "out"
    code, rep = run_job(spark, "snapshot", *dirs, "--out", str(out), "--report", str(out / "r.json"))
    assert code == 0, rep
    assert rep["hw"] == end and rep["hw_source"] == "majority"
    expected = sequential_state(by_offset, end)
    path = rep["snapshot"]["path"]
    assert os.path.basename(path) == f"{end:020d}-{recs[-1][1]:010d}.checkpoint"
    assert state_of_checkpoint(path) == expected
    assert rep["snapshot"]["published"] is True
    # The workload's garbage values (unknown api key) are not metadata records:
    # counted as data records; the controller's rule violations stay invalid.
    replay = rep["replay"]
    assert replay["data_records"] > 0 and replay["invalid_records"] > 0
    assert replay["invalid_records"] + replay["data_records"] == expected.invalid_records
    # No staging dir left: the checkpoint, the report, the tables and the plots.
    assert sorted(os.listdir(out)) == sorted([os.path.basename(path), "r.json", "tables", "report.html",
                                              "records_per_type.png", "replicas.png"])
    assert rep["read"]["records"] == 3 * end and rep["read"]["batches"] > 0  # control records too
    # A broker boots from it: the broker's own loader accepts it, same /metadata.
    loaded = load_snapshot(SnapshotStore(str(out)), SnapshotId(end, recs[-1][1]))
    assert loaded.to_json() == expected.to_json()
    [cmp] = rep["comparisons"]
    assert cmp["equal"] and cmp["end_offset"] == mid

    # --upto: the state at an earlier offset.
    code, rep = run_job(spark, "snapshot", *dirs, "--upto", str(mid), "--out", str(tmp_path / "o2"),
                        "--report", str(tmp_path / "o2" / "r.json"))
    assert code == 0, rep
    assert state_of_checkpoint(rep["snapshot"]["path"]) == sequential_state(by_offset, mid)


def test_snapshot_mismatch_names_the_entity(spark, tmp_path):
    tid = "00000000-0000-0000-0000-0000000000aa"
    recs_in = [r.RegisterBroker(1, "00000000-0000-0000-0000-0000000000b1", 1, fenced=False), r.RegisterBroker(2, "00000000-0000-0000-0000-0000000000b2", 1, fenced=False),
               r.Topic("orders", tid), r.Partition(tid, 0, (1, 2), (1, 2), 1),
               r.FenceBroker(1, 1), r.PartitionChange(tid, 0, isr=(2,), leader=2),
               r.Config(r.RESOURCE_TOPIC, "orders", "retention.ms", "5")]
    values = [r.encode_record(x) for x in recs_in]
    d = str(tmp_path / "n1")
    recs = write_log(d, values, node_id=1, epochs=[1] * len(values))
    end = recs[-1][0] + 1
    wrong = sequential_state([(o, v) for o, _e, v in recs], end)
    p = wrong.partitions[(tid, 0)]
    assert p.leader == 2  # the fence's PartitionChange moved leadership
    wrong.partitions[(tid, 0)] = r.Partition(tid, 0, p.replicas, p.isr, 1, 0, 0)
    broker_snapshot(d, wrong, 1, "test-cluster")
    code, rep = run_job(spark, "snapshot", d, "--out", str(tmp_path / "out"),
                        "--report", str(tmp_path / "out" / "r.json"))
    assert code == spark_job.EXIT_VALIDATION
    # Nothing a broker would boot from: the built checkpoint was not published.
    assert not [f for f in os.listdir(tmp_path / "out") if ".checkpoint" in f or f.startswith(".staging")]
    assert rep["snapshot"]["published"] is False and rep["snapshot"]["path"] is None
    assert rep["first_failure"]["category"] == "divergence"
    assert "broker snapshot differs from the rebuilt state in 1 entity" in rep["first_failure"]["check"]
    [cmp] = rep["comparisons"]
    assert not cmp["equal"] and cmp["differing_entities"] == 1
    diff = cmp["differences"][0]
    assert diff["entity"] == f"partition {tid}/0"
    assert diff["rebuilt"]["leader"] == 2 and diff["broker"]["leader"] == 1


def _flip_bit(data_dir: str, offset: int) -> tuple[str, int]:
    """Flip one payload bit of the batch holding `offset`; returns (file, position)."""
    pdir = os.path.join(data_dir, PARTITION_DIR)
    for name in sorted(os.listdir(pdir)):
        if not name.endswith(".log"):
            continue
        path = os.path.join(pdir, name)
        data = bytearray(open(path, "rb").read())
        for pos, h in b.iter_batches(bytes(data)):
            if h.base_offset <= offset < h.next_offset:
                data[pos + h.size - 1] ^= 0x10
                open(path, "wb").write(bytes(data))
                return name, pos
    raise AssertionError(f"offset {offset} not found")


def test_audit_catches_divergence_bit_flip_and_tail(spark, tmp_path, capsys):
    rng = random.Random(3)
    values = random_records(rng, 300)
    tail = random_records(rng, 20)
    other = random_records(random.Random(99), 100)
    n1, n2, n3 = (str(tmp_path / f"n{i}") for i in (1, 2, 3))
    good = write_log(n1, values + tail, node_id=1, epochs=[1] * 320, leader_changes=False)
    write_log(n2, values, node_id=2, epochs=[1] * 300, leader_changes=False)
    # n3: the same log up to offset 200, then records no majority has (epoch 2).
    write_log(n3, values[:200] + other, node_id=3, epochs=[1] * 200 + [2] * 100,
              leader_changes=False)
    flip_file, flip_pos = _flip_bit(n2, 50)
    flipped = next(o for o, _e, _v in good if o == 50)
    code, rep = run_job(spark, "audit", n1, n2, n3, "--report", str(tmp_path / "audit.json"))
    assert code == spark_job.EXIT_VALIDATION
    assert rep["hw"] == 300  # n1's tail has no majority
    audit = {v["node_id"]: v for v in rep["audit"].values()}
    assert audit["3"]["first_diff_offset"] == 200 and audit["3"]["first_diff_epoch"] == 2
    # Epoch 2 where the majority committed epoch 1: a committed record was lost.
    assert audit["3"]["category"] == "safety violation"
    assert audit["3"]["status"].startswith("safety violation: committed record lost")
    assert audit["2"]["below_hw"] and audit["2"]["category"] == "corruption"
    assert audit["2"]["why"].startswith("corruption: ")
    assert audit["2"]["first_diff_offset"] <= flipped
    assert audit["1"]["first_diff_offset"] == 300
    assert audit["1"]["status"].startswith("uncommitted tail")
    [err] = [e for e in rep["errors"] if e["file"] == flip_file]
    assert err["position"] == flip_pos and "CRC mismatch" in err["error"]
    assert err["category"] == "corruption"  # a CRC error is corruption, not a safety violation
    assert rep["first_failure"]["category"] == "corruption"

    # The same damage under `snapshot`: exit 1, the first failing check on
    # stderr, and nothing named *.checkpoint anywhere under --out.
    out = tmp_path / "snap-out"
    code, rep = run_job(spark, "snapshot", n1, n2, n3, "--out", str(out), "--report", str(out / "r.json"))
    assert code == spark_job.EXIT_VALIDATION
    assert [p.name for p in out.rglob("*") if ".checkpoint" in p.name] == []
    page = (out / "report.html").read_text()
    assert "<title>metalog spark snapshot: validation FAILED</title>" in page
    assert "<b>first failing check</b>: corruption: " in page and "CRC mismatch" in page
    err_text = capsys.readouterr().err
    assert "metalog spark: validation FAILED: corruption: " in err_text and "CRC mismatch" in err_text


def test_lone_replica_corrupt_batch_is_called_corruption(spark, tmp_path):
    """One replica with a CRC-damaged batch: its valid prefix is the HW, and the
    audit names the damage at the HW as corruption (it said "uncommitted tail")."""
    d = str(tmp_path / "n1")
    write_log(d, random_records(random.Random(12), 60), node_id=1, epochs=[1] * 60, leader_changes=False)
    _file, _pos = _flip_bit(d, 30)
    code, rep = run_job(spark, "audit", d, "--report", str(tmp_path / "r.json"))
    assert code == spark_job.EXIT_VALIDATION
    [a] = rep["audit"].values()
    assert a["first_diff_offset"] == rep["hw"] and not a["below_hw"]
    assert a["category"] == "corruption"
    assert a["status"].startswith("corruption: corrupt batch: CRC mismatch")
    assert a["status"].endswith(f"(at or above the HW {rep['hw']})")


def test_bad_inputs_get_clear_messages(spark, tmp_path, capsys):
    code, rep = run_job(spark, "snapshot", str(tmp_path / "nope"), "--out", str(tmp_path / "o"),
                        "--report", str(tmp_path / "o" / "r.json"))
    assert code == spark_job.EXIT_INPUT
    assert "does not exist" in rep["errors"][0]["error"]
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    code, rep = run_job(spark, "audit", str(tmp_path / "empty"), "--report", str(tmp_path / "r2.json"))
    assert code == spark_job.EXIT_INPUT
    assert "holds no metadata log files" in rep["errors"][0]["error"]

    # A non-segment file and a snapshot from another cluster in an otherwise good dir.
    d = str(tmp_path / "n1")
    recs = write_log(d, random_records(random.Random(5), 50), node_id=1)
    with open(os.path.join(d, PARTITION_DIR, "notes.log"), "w") as fh:
        fh.write("hello")
    state = sequential_state([(o, v) for o, _e, v in recs], 20)
    broker_snapshot(d, state, recs[19][1], "some-other-cluster")
    code, rep = run_job(spark, "snapshot", d, "--out", str(tmp_path / "o3"),
                        "--report", str(tmp_path / "o3" / "r.json"))
    assert code == spark_job.EXIT_VALIDATION
    msgs = {e["file"]: e for e in rep["errors"]}
    assert "is not a segment or snapshot file" in msgs["notes.log"]["error"]
    assert msgs["notes.log"]["category"] == "configuration"
    # The foreign snapshot is a warning (configuration), not used, not a failure by itself.
    assert not [f for f in msgs if f.endswith(".checkpoint")]
    # (no quorum-state in these dirs: the voters are unknown, a warning of its own)
    [warn] = [w for w in rep["warnings"] if w["replica"] != "(all replicas)"]
    assert warn["category"] == "configuration" and warn["file"].endswith(".checkpoint")
    assert "snapshot from another cluster" in warn["warning"] and "some-other-cluster" in warn["warning"]
    captured = capsys.readouterr()
    assert "validation FAILED" in captured.out and "notes.log" in captured.out
    assert f"warning: file:{d}/{warn['file']}: snapshot from another cluster" in captured.err
    assert "validation FAILED: configuration: 'notes.log' is not a segment" in captured.err


def test_a_setting_spark_rejects_is_a_usage_error(spark, tmp_path, capsys):
    """--conf with a value Spark rejects: exit 2 and one line naming the setting
    (it was "the job failed" mid-job, exit 3); a bad --driver-memory is refused
    by the argument parser before any JVM starts."""
    d = str(tmp_path / "n1")
    write_log(d, random_records(random.Random(6), 30), node_id=1)
    out = tmp_path / "o"
    code, rep = run_job(spark, "snapshot", d, "--out", str(out), "--report", str(out / "r.json"),
                        "--conf", "spark.sql.shuffle.partitions=lots")
    assert code == spark_job.EXIT_INPUT, rep
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("metalog spark: Spark rejects a setting (--conf or spark-defaults): ")
    assert "'lots'" in err[-1] and "spark.sql.shuffle.partitions" in err[-1]
    assert rep["result"] == "bad input" and not list(out.glob("*.checkpoint"))
    assert spark.conf.get("spark.sql.shuffle.partitions") == "2"  # the session is unharmed
    with pytest.raises(SystemExit) as exit_info:
        run_job(spark, "snapshot", d, "--out", str(out), "--driver-memory", "lots")
    assert exit_info.value.code == spark_job.EXIT_INPUT
    assert "--driver-memory wants a size such as 600m or 4g, got 'lots'" in capsys.readouterr().err
    # A master URL of no form Spark takes: spark-submit printed a Java stack
    # trace and the job said the gateway exited (exit 3).
    parser = argparse.ArgumentParser()
    spark_job.register_cli(parser.add_subparsers(dest="command"))
    for bad in ("bogus", "spark:/host"):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(["spark", "snapshot", d, "--master", bad])
        assert exit_info.value.code == spark_job.EXIT_INPUT
        assert f"--master wants local[N], local[*], spark://HOST:PORT, yarn or k8s://URL, got {bad!r}" in \
            capsys.readouterr().err
    for good in ("local", "local[2]", "local[*]", "local[2,3]", "spark://h:7077", "yarn", "k8s://https://a:6443"):
        assert parser.parse_args(["spark", "snapshot", d, "--master", good]).master == good


def test_foreign_replica_is_excluded_from_the_vote_with_a_warning(spark, tmp_path, capsys):
    """Two replicas of test-cluster and one of another cluster whose log differs:
    the foreign one does not vote (HW and checkpoint from the two), a warning names it."""
    values = random_records(random.Random(21), 120)
    n1, n2, n3 = (str(tmp_path / f"n{i}") for i in (1, 2, 3))
    recs = write_log(n1, values, node_id=1, seed=2)
    write_log(n2, values, node_id=2, seed=2)
    write_log(n3, random_records(random.Random(77), 60), node_id=3, cluster_id="other-cluster")
    out = tmp_path / "out"
    code, rep = run_job(spark, "snapshot", n1, n2, n3, "--out", str(out), "--report", str(out / "r.json"))
    assert code == spark_job.EXIT_OK, rep
    assert rep["cluster_id"] == "test-cluster" and rep["hw"] == recs[-1][0] + 1
    assert {os.path.basename(r) for r in rep["audit"]} == {"n1", "n2"}
    [warn, unknown] = rep["warnings"]
    assert unknown["replica"] == "(all replicas)" and "voters unknown" in unknown["warning"]
    assert warn["replica"] == f"file:{n3}" and "belongs to cluster 'other-cluster'" in warn["warning"]
    captured = capsys.readouterr()
    assert "excluded from the vote" in captured.err
    # The summary on stdout says so too: it lists only the voting replicas.
    assert (f"  warning: file:{n3}/meta.properties: replica belongs to cluster 'other-cluster', "
            "not 'test-cluster': excluded from the vote") in captured.out.splitlines()


def test_a_foreign_replica_is_never_the_replay_source(spark, tmp_path):
    """A foreign replica whose name sorts first and whose log covers the whole
    committed range is not picked to read the committed records from (its
    records are not this cluster's): the replay reads a voting replica and
    replays every committed record."""
    values = random_records(random.Random(23), 100)
    n1, n2 = (str(tmp_path / f"n{i}") for i in (1, 2))
    recs = write_log(n1, values, node_id=1, seed=3)
    write_log(n2, values, node_id=2, seed=3)
    write_log(str(tmp_path / "a-foreign"), random_records(random.Random(78), 300), node_id=3,
              cluster_id="other-cluster")
    out = tmp_path / "out"
    code, rep = run_job(spark, "snapshot", str(tmp_path / "a-foreign"), n1, n2, "--out", str(out),
                        "--report", str(out / "r.json"))
    assert code == spark_job.EXIT_OK, rep
    assert rep["hw"] == recs[-1][0] + 1
    assert "a-foreign" not in rep["replay"]["source"]
    assert rep["replay"]["records"] > 0


def test_truncated_checkpoint_input_exits_1(spark, tmp_path, capsys):
    """A data dir holding only a truncated .checkpoint: a validation failure
    (exit 1, corruption named on stderr), not a usage error."""
    values = random_records(random.Random(8), 80)
    src = str(tmp_path / "src")
    recs = write_log(src, values, node_id=1)
    by_offset = [(o, v) for o, _e, v in recs]
    sid = broker_snapshot(src, sequential_state(by_offset, 40), recs[39][1], "test-cluster")
    d = tmp_path / "n1"
    (d / PARTITION_DIR).mkdir(parents=True)
    (d / "meta.properties").write_text(open(os.path.join(src, "meta.properties")).read())
    name = f"{sid.end_offset:020d}-{sid.epoch:010d}.checkpoint"
    data = open(os.path.join(src, PARTITION_DIR, name), "rb").read()
    (d / PARTITION_DIR / name).write_bytes(data[: len(data) // 2])
    code, rep = run_job(spark, "snapshot", str(d), "--out", str(tmp_path / "out"),
                        "--report", str(tmp_path / "r.json"))
    assert code == spark_job.EXIT_VALIDATION
    assert rep["first_failure"]["category"] == "corruption"
    assert "corrupt snapshot" in rep["first_failure"]["check"]
    assert "validation FAILED: corruption: corrupt snapshot" in capsys.readouterr().err


def test_cause_chain_keeps_the_root_cause(spark):
    """Java failures show every link of getCause(), root cause last, not the first line only."""
    jvm = spark.sparkContext._jvm
    root = jvm.java.lang.IllegalStateException("disk quota exceeded on /data")
    outer = jvm.java.lang.RuntimeException("Job aborted due to stage failure", root)

    class FakePy4J(Exception):  # the shape of py4j's Py4JJavaError: .java_exception
        java_exception = outer

    chain = spark_job.cause_chain(FakePy4J("An error occurred while calling o1.collect.\n  trace"))
    assert chain == ("java.lang.RuntimeException: Job aborted due to stage failure <- caused by: "
                     "java.lang.IllegalStateException: disk quota exceeded on /data")
    try:
        try:
            raise OSError("No space left on device")
        except OSError as exc:
            raise RuntimeError("writing the checkpoint\nmore lines") from exc
    except RuntimeError as exc:
        assert spark_job.cause_chain(exc) == ("RuntimeError: writing the checkpoint <- caused by: "
                                              "OSError: No space left on device")


def test_hadoop_uris_in_and_out(spark, tmp_path, monkeypatch):
    """Inputs and --out as Hadoop URIs (file:// here; hdfs://, s3a:// take the same
    path): the checkpoint and report are copied through Hadoop's FileSystem API,
    and the driver's local staging copy is removed."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    values = random_records(random.Random(31), 90)
    d = str(tmp_path / "n1")
    recs = write_log(d, values, node_id=1)
    end = recs[-1][0] + 1
    out_uri = f"file://{tmp_path}/uri-out"
    code, _ = run_job(spark, "snapshot", f"file://{d}", "--out", out_uri)
    assert code == spark_job.EXIT_OK
    out = tmp_path / "uri-out"
    name = f"{end:020d}-{recs[-1][1]:010d}.checkpoint"
    # The tables and the plots go through Hadoop's FileSystem API too.
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == sorted(
        [name, "report.json", "tables", "report.html", "records_per_type.png", "replicas.png"])
    import pyarrow.parquet as pq

    assert pq.read_table(str(out / "tables" / "history")).num_rows == end
    rep = json.loads((out / "report.json").read_text())
    assert rep["snapshot"]["path"] == f"{out_uri}/{name}" and rep["snapshot"]["published"]
    assert state_of_checkpoint(str(out / name)) == sequential_state([(o, v) for o, _e, v in recs], end)
    assert list((tmp_path / "tmp").iterdir()) == []


def _voters(*pairs: tuple[int, str]) -> cr.VotersRecord:
    return cr.VotersRecord([cr.Voter(n, d, [cr.VoterEndpoint("CONTROLLER", "127.0.0.1", 9090 + n)])
                            for n, d in pairs])


def test_checkpoint_carries_the_latest_committed_voter_set(spark, tmp_path):
    """KIP-853: replicas formatted with --initial-controllers (bootstrap
    checkpoint: voters 1, 2, 3), whose log then holds a voter change
    (KRaftVersionRecord 1 + VotersRecord: 3 replaced by 4). The job's
    checkpoint carries the set in force at its end offset, right after the
    SnapshotHeader (read back by the broker's reader): the changed set at the
    HW, the bootstrap set with --upto before the change; a log of static
    voters (no set anywhere) gives a checkpoint without one."""
    first = _voters((1, "AAAAAAAAAAAAAAAAAAAAAQ"), (2, "AAAAAAAAAAAAAAAAAAAAAg"), (3, "AAAAAAAAAAAAAAAAAAAAAw"))
    changed = _voters((1, "AAAAAAAAAAAAAAAAAAAAAQ"), (2, "AAAAAAAAAAAAAAAAAAAAAg"), (4, "AAAAAAAAAAAAAAAAAAAABA"))
    values = random_records(random.Random(3), 200)
    dirs = [str(tmp_path / f"n{i}") for i in (1, 2, 3)]
    for i, d in enumerate(dirs):
        recs = write_log(d, values, node_id=i + 1, seed=9)
        SnapshotStore(os.path.join(d, PARTITION_DIR)).write_bootstrap(first, "test-cluster")
        log = SegmentedLog.open(os.path.join(d, PARTITION_DIR))
        change_at, epoch = recs[-1][0] + 1, recs[-1][1]
        log.append(b.encode_batch(change_at, epoch, [cr.encode_control(cr.KRaftVersionRecord(1)),
                                                     cr.encode_control(changed)], 5000, is_control=True))
        log.append(b.encode_batch(change_at + 2, epoch, values[:3], 5001))
        log.flush()
        log.close()
    end = change_at + 5
    out = tmp_path / "out"
    code, rep = run_job(spark, "snapshot", *dirs, "--out", str(out), "--report", str(out / "r.json"),
                        "--no-tables")
    assert code == 0, rep
    assert rep["hw"] == end
    assert read_snapshot_voters(rep["snapshot"]["path"]) == changed
    assert rep["snapshot"]["voters"] == {"1": "AAAAAAAAAAAAAAAAAAAAAQ", "2": "AAAAAAAAAAAAAAAAAAAAAg",
                                         "4": "AAAAAAAAAAAAAAAAAAAABA"}
    # The broker's loader takes it, voters and all.
    _, layout = verify_snapshot(rep["snapshot"]["path"])
    assert layout.voters == changed and layout.records > 0

    code, rep = run_job(spark, "snapshot", *dirs, "--upto", str(change_at), "--out", str(tmp_path / "o2"),
                        "--report", str(tmp_path / "o2" / "r.json"), "--no-tables")
    assert code == 0, rep
    assert read_snapshot_voters(rep["snapshot"]["path"]) == first

    static = [str(tmp_path / f"s{i}") for i in (1, 2, 3)]
    for i, d in enumerate(static):
        write_log(d, values, node_id=i + 1, seed=9)
    code, rep = run_job(spark, "snapshot", *static, "--out", str(tmp_path / "o3"),
                        "--report", str(tmp_path / "o3" / "r.json"), "--no-tables")
    assert code == 0, rep
    assert read_snapshot_voters(rep["snapshot"]["path"]) is None and rep["snapshot"]["voters"] is None


def test_observers_do_not_vote_for_the_hw(spark, tmp_path, capsys):
    """3 voters + 2 observers: the leader (n1) and both observers hold a tail the
    other two voters lack. 3 of 5 replicas hold it, but only 1 of 3 voters: it
    is not committed (a leader elected from n2, n3 would truncate it), so the
    HW and the checkpoint stop where the voters' majority does. The observers
    are audited (in_vote false) with a warning each."""
    from metalog.storage.quorum_state import QuorumStateFile
    from metalog.tools.spark import tables

    values = random_records(random.Random(31), 160)
    dirs = {i: str(tmp_path / f"n{i}") for i in range(1, 6)}
    full = {}
    for i in (1, 4, 5):  # the leader and the observers: the whole log
        full[i] = write_log(dirs[i], values, node_id=i, seed=3)
    short = [write_log(dirs[i], values[:100], node_id=i, seed=3) for i in (2, 3)][0]
    assert full[1] == full[4] == full[5] and full[1][:len(short)] == short
    last_epoch = full[1][-1][1]
    for i, d in dirs.items():
        qs = QuorumStateFile(os.path.join(d, PARTITION_DIR, "quorum-state"))
        if i == 3:  # an older epoch's (larger) set: the newest quorum-state wins
            qs.write(0, 1, 1, [1, 2, 3, 4, 5])
        else:
            qs.write(last_epoch, 1, 1, [1, 2, 3])
    hw = short[-1][0] + 1
    assert full[1][-1][0] + 1 > hw
    out = tmp_path / "out"
    code, rep = run_job(spark, "snapshot", *dirs.values(), "--out", str(out), "--report", str(out / "r.json"))
    assert code == spark_job.EXIT_OK, rep
    assert rep["voters"] == [1, 2, 3]
    assert rep["hw"] == hw and rep["majority_end_offset"] == hw, (rep["hw"], hw)
    assert rep["quorum"] == "2 of 3 voters given (2 observer(s) not voting)"
    path = rep["snapshot"]["path"]
    assert os.path.basename(path).startswith(f"{hw:020d}-")
    assert state_of_checkpoint(path) == sequential_state([(o, v) for o, _e, v in full[1]], hw)
    audit = {os.path.basename(k): a for k, a in rep["audit"].items()}
    assert set(audit) == {"n1", "n2", "n3", "n4", "n5"}
    assert [n for n, a in sorted(audit.items()) if not a["in_vote"]] == ["n4", "n5"]
    for n in ("n1", "n4", "n5"):  # the tail past the HW is uncommitted, not a failure
        assert audit[n]["first_diff_offset"] == hw and audit[n]["category"] == "uncommitted tail", audit[n]
    assert audit["n2"]["status"] == audit["n3"]["status"] == "agrees"
    rows = {os.path.basename(r[0]): r for r in tables.audit_rows(rep)}
    assert [n for n, r in sorted(rows.items()) if r[3] is False] == ["n4", "n5"]
    warned = sorted(w["replica"] for w in rep["warnings"] if "is not a voter" in w["warning"])
    assert warned == [f"file:{dirs[4]}", f"file:{dirs[5]}"]
    assert all(w["category"] == "configuration" for w in rep["warnings"])
    err = capsys.readouterr().err
    assert f"warning: file:{dirs[4]}/{PARTITION_DIR}/quorum-state: node 4 is not a voter" in err
    assert "excluded from the HW vote" in err
