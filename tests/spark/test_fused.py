"""The fused path of the Spark job (one clean replica: the decode keys and
combines the records itself, so only the combined rows are cached) against
the general path (a cached row per record, keyed after the vote) on the same
inputs: the same checkpoint byte for byte, at the log end and at an --upto
inside a run of config writes, with a broker snapshot inside another, with an
aborted metadata transaction whose config writes follow earlier ones; and the
general path wherever the fused one's assumptions fail (a corrupt batch, two
replicas). The report says which path ran; the tests check it did."""

from __future__ import annotations

import os
import random

import pytest

from metalog.storage import metadata_records as r
from metalog.tools.spark import job as spark_job
from tests.spark.test_job import _flip_bit, broker_snapshot, run_job, spark, state_of_checkpoint  # noqa: F401
from tests.spark.workload import random_records, sequential_state, write_log

pytestmark = pytest.mark.slow

TOPIC_ID = "00000000-0000-0000-0000-0000000000f1"


def _cfg(value: str | None) -> bytes:
    return r.encode_record(r.Config(r.RESOURCE_TOPIC, "fz", "retention.ms", value))


def _workload() -> tuple[list[bytes], int, int]:
    """A random workload with runs of writes to one config key: (values, the
    index of the first write of a run in the middle, the index of the
    AbortTransaction). The transaction aborts writes to a key written just
    before it: were a run to span BeginTransaction, the earlier write would be
    dropped with the aborted range."""
    rng = random.Random(23)
    values = [r.encode_record(r.Topic("fz", TOPIC_ID))]
    for i, v in enumerate(random_records(rng, 360)):
        values.append(v)
        if i % 40 == 39:
            values += [_cfg(f"{i}-{k}") for k in range(12)]
    mid = len(values)
    values += [_cfg(f"mid-{k}") for k in range(30)]
    values += [_cfg("kept"), r.encode_record(r.UnknownRecord(23, 0, b"\x00")),  # BeginTransaction
               _cfg("aborted-1"), _cfg("aborted-2")]
    abort = len(values)
    values += [r.encode_record(r.UnknownRecord(25, 0, b"\x00"))]  # AbortTransaction
    values += random_records(rng, 40)
    return values, mid, abort


def _both_paths(spark, monkeypatch, tmp_path, d: str, *extra: str) -> tuple[dict, dict, bytes, bytes]:
    reports, checkpoints = [], []
    for fused in ("1", "0"):
        monkeypatch.setenv(spark_job.FUSED_ENV, fused)
        out = tmp_path / f"out-{fused}"
        code, rep = run_job(spark, "snapshot", d, "--out", str(out), "--report", str(out / "r.json"), *extra)
        assert code == spark_job.EXIT_OK, rep
        reports.append(rep)
        checkpoints.append(open(rep["snapshot"]["path"], "rb").read())
    return reports[0], reports[1], checkpoints[0], checkpoints[1]


def test_fused_path_writes_the_general_paths_checkpoint(spark, tmp_path, monkeypatch):
    values, mid, abort = _workload()
    d = str(tmp_path / "n1")
    recs = write_log(d, values, node_id=1, seed=4, batch_records_max=9)
    by_offset = [(o, v) for o, _e, v in recs]
    offset_of = [o for o, _e, _v in recs]
    # A broker snapshot inside the middle run of config writes: a cut there.
    snap_at = offset_of[mid + 10]
    expected_snap = sequential_state(by_offset, snap_at)
    broker_snapshot(d, expected_snap, recs[mid + 9][1], "test-cluster")
    # --upto inside the same run, past the snapshot: the HW below the log end.
    upto = offset_of[mid + 20]
    for extra in ((), ("--upto", str(upto))):
        fused, general, fused_bytes, general_bytes = _both_paths(spark, monkeypatch, tmp_path, d, *extra, "--no-tables")
        assert fused["read"]["path"] == fused["replay"]["path"] == "fused", fused["read"]
        assert general["read"]["path"] == "general" and general["read"]["path_why"] == f"{spark_job.FUSED_ENV}=0"
        assert fused_bytes == general_bytes
        assert fused["snapshot"]["name"] == general["snapshot"]["name"]
        for key in ("records", "invalid_records", "data_records", "unmodelled_records", "control_records",
                    "aborted_transactions"):
            assert fused["replay"][key] == general["replay"][key], key
        # The combine in the decode did drop the superseded writes (as the
        # general path's after the vote does, with one source replica).
        assert fused["replay"]["shuffled_rows"] < fused["replay"]["records"] - 100
        assert fused["replay"]["shuffled_rows"] <= general["replay"]["shuffled_rows"]
        assert [c["equal"] for c in fused["comparisons"]] == [True]
    # The last run's --upto: the state ControllerState holds there.
    assert fused["hw"] == upto and fused["snapshot"]["end_offset"] == upto
    assert state_of_checkpoint(fused["snapshot"]["path"]) == sequential_state(by_offset, upto)
    # At the log end: the aborted writes are not applied, the one before them is.
    fused, general, fused_bytes, _ = _both_paths(spark, monkeypatch, tmp_path, d, "--no-tables")
    [(lo, hi)] = fused["replay"]["aborted_transactions"]
    assert (lo, hi) == (offset_of[abort - 3], offset_of[abort])
    kept = [(o, v) for o, v in by_offset if not lo <= o <= hi]
    end = fused["hw"]
    assert state_of_checkpoint(fused["snapshot"]["path"]) == sequential_state(kept, end)
    configs = state_of_checkpoint(fused["snapshot"]["path"]).configs
    assert ("kept" in str(configs)) and ("aborted" not in str(configs))


def test_fused_path_writes_the_history_table(spark, tmp_path, monkeypatch):
    """The history table is every committed record although the fused path
    caches none of them: it is decoded again from the files."""
    values = random_records(random.Random(5), 120) + [_cfg(str(k)) for k in range(20)]
    d = str(tmp_path / "n1")
    recs = write_log(d, values, node_id=1, seed=2)
    out = tmp_path / "out"
    code, rep = run_job(spark, "snapshot", d, "--out", str(out), "--report", str(out / "r.json"))
    assert code == spark_job.EXIT_OK, rep
    assert rep["read"]["path"] == "fused"
    history = spark.read.parquet(str(out / "tables" / "history"))
    assert history.filter("NOT control").count() == len(recs)
    assert history.count() == rep["hw"]  # control records too: every offset of the log


def test_general_path_where_the_fused_one_does_not_hold(spark, tmp_path):
    values = random_records(random.Random(8), 200) + [_cfg(str(k)) for k in range(20)]
    # A corrupt batch mid-log in a lone replica: decoded again on the general
    # path, which names the damage and fails the run (the HW is its valid prefix).
    d = str(tmp_path / "n1")
    write_log(d, values, node_id=1, seed=3)
    _flip_bit(d, 100)
    code, rep = run_job(spark, "snapshot", d, "--out", str(tmp_path / "o1"), "--report", str(tmp_path / "r1.json"))
    assert code == spark_job.EXIT_VALIDATION
    assert rep["read"]["path"] == "general" and "error(s) in the files" in rep["read"]["path_why"]
    assert rep["first_failure"]["category"] == "corruption"
    assert rep["replay"]["path"] == "general"
    # Two replicas: the majority vote, the general path.
    dirs = [str(tmp_path / f"m{i}") for i in (1, 2)]
    recs = [write_log(x, values, node_id=i + 1, seed=3) for i, x in enumerate(dirs)][0]
    code, rep = run_job(spark, "snapshot", *dirs, "--out", str(tmp_path / "o2"), "--report", str(tmp_path / "r2.json"))
    assert code == spark_job.EXIT_OK, rep
    assert rep["read"]["path"] == "general" and rep["read"]["path_why"] == "2 replicas"
    assert state_of_checkpoint(rep["snapshot"]["path"]) == sequential_state(
        [(o, v) for o, _e, v in recs], rep["hw"])
    assert os.path.basename(rep["snapshot"]["path"]).startswith(f"{rep['hw']:020d}-")
