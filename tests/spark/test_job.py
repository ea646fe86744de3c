"""The Spark job end to end on a real local SparkSession (local[2], UI off),
over segment files written by storage.log.SegmentedLog as a broker writes them."""

from __future__ import annotations

import json
import os
import random

import pytest

from broker.controller import ControllerState, load_snapshot, write_controller_snapshot
from protocol.messages import SnapshotId
from storage import batch as b
from storage import metadata_records as r
from storage.snapshot import SnapshotStore, read_snapshot
from tests.spark.workload import PARTITION_DIR, random_records, sequential_state, write_log
from tools import spark_job

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
    assert rep["replay"]["invalid_records"] == expected.invalid_records > 0
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
    recs_in = [r.RegisterBroker(1, "a", 1, fenced=False), r.RegisterBroker(2, "b", 1, fenced=False),
               r.Topic("orders", tid), r.Partition(tid, 0, (1, 2), (1, 2), 1),
               r.FenceBroker(1, 1), r.Config(r.RESOURCE_TOPIC, "orders", "retention.ms", "5")]
    values = [r.encode_record(x) for x in recs_in]
    d = str(tmp_path / "n1")
    recs = write_log(d, values, node_id=1, epochs=[1] * len(values))
    end = recs[-1][0] + 1
    wrong = sequential_state([(o, v) for o, _e, v in recs], end)
    p = wrong.partitions[(tid, 0)]
    assert p.leader == 2  # the fence moved leadership
    wrong.partitions[(tid, 0)] = r.Partition(tid, 0, p.replicas, p.isr, 1, 0, 0)
    broker_snapshot(d, wrong, 1, "test-cluster")
    code, rep = run_job(spark, "snapshot", d, "--out", str(tmp_path / "out"),
                        "--report", str(tmp_path / "out" / "r.json"))
    assert code == spark_job.EXIT_VALIDATION
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


def test_audit_catches_divergence_bit_flip_and_tail(spark, tmp_path):
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
    assert audit["3"]["status"].startswith("safety breach")
    assert audit["2"]["below_hw"] and audit["2"]["why"].startswith("corrupt")
    assert audit["2"]["first_diff_offset"] <= flipped
    assert audit["1"]["first_diff_offset"] == 300
    assert audit["1"]["status"].startswith("uncommitted tail")
    [err] = [e for e in rep["errors"] if e["file"] == flip_file]
    assert err["position"] == flip_pos and "CRC mismatch" in err["error"]


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
    msgs = {e["file"]: e["error"] for e in rep["errors"]}
    assert "is not a segment or snapshot file" in msgs["notes.log"]
    [snap_msg] = [m for f, m in msgs.items() if f.endswith(".checkpoint")]
    assert "snapshot from another cluster" in snap_msg and "some-other-cluster" in snap_msg
    out = capsys.readouterr().out
    assert "validation FAILED" in out and "notes.log" in out
