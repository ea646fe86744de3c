"""The job's queryable output on a real local SparkSession: the Parquet tables
read back (pyarrow and Spark) against the state the broker's own controller
computes from the same records, `metalog spark sql`, and the plots."""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import shutil

import pyarrow.parquet as pq
import pytest

from metalog.storage import metadata_records as r
from tests.spark.test_job import _flip_bit, run_job
from tests.spark.workload import random_records, sequential_state, write_log
from metalog.tools.spark import job as spark_job
from metalog.tools.spark import plots
from metalog.tools.spark import tables as TB

pytestmark = pytest.mark.slow

PRODUCED = b"hello from a producer"


@pytest.fixture(scope="module")
def spark():
    session = spark_job.get_spark("local[2]", ui=False, shuffle_partitions=2)
    yield session
    session.stop()


@pytest.fixture(scope="module")
def job(spark, tmp_path_factory):
    """One snapshot run over three identical replicas; its output and the expected state."""
    tmp = tmp_path_factory.mktemp("tables")
    values = random_records(random.Random(45), 600)
    values.insert(100, PRODUCED)  # a produced (non-metadata) value: UTF-8 in the history
    dirs = [str(tmp / f"n{i}") for i in (1, 2, 3)]
    recs = [write_log(d, values, node_id=i + 1, seed=9) for i, d in enumerate(dirs)][0]
    out = tmp / "out"
    code, rep = run_job(spark, "snapshot", *dirs, "--out", str(out), "--report", str(out / "r.json"))
    assert code == 0, rep
    end = rep["hw"]
    assert end == recs[-1][0] + 1
    expected = sequential_state([(o, v) for o, _e, v in recs], end)
    return {"out": str(out), "rep": rep, "recs": recs, "end": end, "expected": expected, "dirs": dirs}


def table(job, view: str) -> list[dict]:
    return pq.read_table(os.path.join(job["out"], "tables", view)).to_pylist()


def test_state_tables_equal_the_controller_state(job):
    st, end = job["expected"], job["end"]
    topics = table(job, "topics")
    assert {x["topic_id"]: x["name"] for x in topics} == {k: v.name for k, v in st.topics.items()}
    parts = table(job, "partitions")
    assert {(x["topic_id"], x["partition_id"]): (tuple(x["replicas"]), tuple(x["isr"]), x["leader"],
                                                 x["leader_epoch"], x["partition_epoch"]) for x in parts} == {
        k: (p.replicas, p.isr, p.leader, p.leader_epoch, p.partition_epoch) for k, p in st.partitions.items()}
    brokers = table(job, "brokers")
    assert {x["broker_id"]: (x["broker_epoch"], x["fenced"], x["endpoints"]) for x in brokers} == {
        k: (b.broker_epoch, b.fenced, [f"{e.name}://{e.host}:{e.port}" for e in b.endpoints])
        for k, b in st.brokers.items()}
    configs = table(job, "configs")
    assert {(x["resource_type"], x["resource_name"], x["name"]): x["value"] for x in configs} == st.configs
    assert {x["name"]: x["feature_level"] for x in table(job, "features")} == st.features
    assert {x["id"]: (x["principal"], x["operation"], x["permission_type"]) for x in table(job, "acls")} == {
        k: (a.principal, a.operation, a.permission_type) for k, a in st.acls.items()}
    # Every state row says which offset the state reflects: the HW (= the checkpoint's end offset).
    for view in ("topics", "partitions", "brokers", "configs", "features", "acls"):
        assert {x["state_offset"] for x in table(job, view)} <= {end}
    assert st.partitions and st.topics and st.brokers  # the workload is not trivially empty
    assert job["rep"]["tables"]["rows"]["partitions"] == len(st.partitions)


def test_history_is_every_committed_record_decoded(job):
    hist = sorted(table(job, "history"), key=lambda x: x["offset"])
    data = {o: v for o, _e, v in job["recs"]}
    assert [x["offset"] for x in hist] == list(range(job["end"]))  # control records included
    for row in hist:
        if row["control"]:
            assert row["record_type"] == "LeaderChange"
            continue
        value = data[row["offset"]]
        try:
            rec = r.decode_record(value)
        except r.MetadataRecordError:
            body = json.loads(row["body"])
            assert row["record_type"] == "data" and row["version"] is None
            raw = body["value"].encode() if body["encoding"] == "utf-8" else base64.b64decode(body["value"])
            assert raw == value
            continue
        assert row["record_type"] == type(rec).__name__
        assert json.loads(row["body"]) == json.loads(json.dumps(r.record_to_dict(rec)))
    [produced] = [x for x in hist if x["record_type"] == "data" and PRODUCED.decode() in x["body"]]
    assert json.loads(produced["body"]) == {"value": PRODUCED.decode(), "encoding": "utf-8"}
    # The batch timestamps the workload wrote (1000 + base offset of the batch).
    assert all(1000 <= x["timestamp_ms"] <= 1000 + x["offset"] for x in hist)


def test_voters_and_audit_tables(job):
    # write_log's LeaderChange names voters 1, 2, 3 with votes granted by 1 and 2.
    voters = table(job, "voters")
    assert sorted((x["voter_id"], x["granted_vote"]) for x in voters) == [(1, True), (2, True), (3, False)]
    last_lc = max(o for o in range(job["end"]) if o not in {x[0] for x in job["recs"]})
    assert {x["record_offset"] for x in voters} == {last_lc}
    audit = table(job, "audit")
    assert sorted(x["replica"].rstrip("/").rsplit("/", 1)[-1] for x in audit) == ["n1", "n2", "n3"]
    for x in audit:
        assert x["verdict"] == "agrees" and x["category"] == "ok" and x["in_vote"]
        assert (x["log_start_offset"], x["log_end_offset"], x["hw"], x["lag_records"]) == (0, job["end"],
                                                                                          job["end"], 0)
        assert x["cluster_id"] == "test-cluster" and x["first_diff_offset"] is None


def sql(spark, out: str, query: str, *extra: str) -> int:
    parser = argparse.ArgumentParser()
    spark_job.register_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["spark", "sql", query, "--out", out, *extra])
    args.session = spark
    return spark_job.run_sql(args)


def test_sql_answers_when_and_why_a_leader_changed(spark, job, capsys):
    # The partition whose leader the workload moved most often by records.
    changes: dict[tuple[str, int], list[tuple[int, str, int]]] = {}
    st = sequential_state([], 0)
    for o, _e, v in job["recs"]:
        try:
            rec = r.decode_record(v)
        except r.MetadataRecordError:
            st.apply_value(o, v)
            continue
        key = (rec.topic_id, rec.partition_id) if type(rec) in (r.Partition, r.PartitionChange) else None
        before = st.partitions.get(key) if key else None
        st.apply_value(o, v)
        after = st.partitions.get(key) if key else None
        if after is not None and after is not before and (before is None or before.leader != after.leader):
            changes.setdefault(key, []).append((o, type(rec).__name__, after.leader))
    (tid, pid), expected = max(changes.items(), key=lambda kv: len(kv[1]))
    assert len(expected) >= 2
    query = (f"SELECT offset, record_type, CAST(get_json_object(body, '$.leader') AS INT) AS leader "
             f"FROM history WHERE record_type IN ('Partition', 'PartitionChange') "
             f"AND get_json_object(body, '$.topic_id') = '{tid}' "
             f"AND get_json_object(body, '$.partition_id') = {pid} ORDER BY offset")
    capsys.readouterr()
    assert sql(spark, job["out"], query, "--json") == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    # Every valid record that moved the leader is in the history with its new leader
    # (the history also lists records that did not move it, or that the controller rejected).
    by_offset = {x["offset"]: x for x in rows}
    for o, rtype, leader in expected:
        assert by_offset[o]["record_type"] == rtype
        assert by_offset[o]["leader"] == leader

    # The text form: a header line, a rule, then the rows.
    assert sql(spark, job["out"], f"SELECT COUNT(*) AS n FROM partitions WHERE topic_id = '{tid}'") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].strip() == "n"
    assert int(lines[2]) == sum(1 for k in job["expected"].partitions if k[0] == tid)


def test_sql_bad_query_and_missing_tables(spark, job, tmp_path, capsys):
    """What the user sees: one line naming the problem (and the views there are), exit 2."""
    assert sql(spark, job["out"], "SELECT nope FROM history") == spark_job.EXIT_INPUT
    err = capsys.readouterr().err
    assert err.startswith("metalog spark sql: bad query: ") and "views: acls, audit, brokers" in err
    assert sql(spark, str(tmp_path / "empty"), "SELECT 1") == spark_job.EXIT_INPUT
    assert f"no tables under {tmp_path / 'empty'}/tables" in capsys.readouterr().err


def test_plots_and_html_report(job):
    out = job["out"]
    for name in ("records_per_type.png", "replicas.png"):
        with open(os.path.join(out, name), "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    page = open(os.path.join(out, "report.html")).read()
    assert "<img src='records_per_type.png'>" in page and "<img src='replicas.png'>" in page
    assert page.count("<td>agrees</td>") == 3
    assert "<title>metalog spark snapshot: ok</title>" in page  # the outcome, not "running"
    assert "first failing check" not in page
    assert job["rep"]["plots"]["files"][-1].endswith("report.html")


def test_records_per_type_plot_has_every_bucket_and_replicas_are_told_apart(spark, job):
    """Empty time buckets are zeros (a line used to slant across a quiet gap,
    drawing records that were never committed), and replicas whose dirs all
    end in "data" get labels that tell them apart (they were all "data")."""
    hist = spark.createDataFrame([(1_000, "Topic"), (1_000, "Partition"), (1_500, "Partition"),
                                  (100_000, "Topic")], "timestamp_ms long, record_type string")
    rows, width = plots.type_counts(hist)
    buckets, series = plots.type_series(rows, width)
    assert width == 991 and len(buckets) == plots.TIME_BUCKETS
    assert buckets == [1_000 + i * width for i in range(plots.TIME_BUCKETS)]
    assert series["Topic"][0] == 1 and series["Topic"][-1] == 1 and sum(series["Topic"][1:-1]) == 0
    assert series["Partition"][:2] == [2, 0]
    assert sum(series["Partition"]) == 2 and "other" not in series
    # The job's own history: one bucket per step from the first to the last.
    rows, width = plots.type_counts(spark.read.parquet(os.path.join(job["out"], "tables", "history")))
    buckets, series = plots.type_series(rows, width)
    assert all(b2 - b1 == width for b1, b2 in zip(buckets, buckets[1:]))
    assert all(len(c) == len(buckets) for c in series.values())
    assert sum(map(sum, series.values())) == len(table(job, "history"))

    audit = [{"replica": f"file:/tmp/c/node-{n}/data", "node_id": str(n)} for n in (1, 2, 3)]
    assert plots.replica_labels(audit) == [f"node-{n}/data (node {n})" for n in (1, 2, 3)]
    assert plots.replica_labels(table(job, "audit")) == [
        f"{os.path.basename(a['replica'].rstrip('/'))} (node {a['node_id']})" for a in table(job, "audit")]


def test_failed_rerun_leaves_no_earlier_checkpoint_or_state_tables(spark, job, tmp_path, capsys):
    """A snapshot run that fails validation into an --out an earlier valid run
    filled: the earlier run's .checkpoint (another name: another HW) is removed,
    and so are its state tables, history and plot (they would pass for this
    run's in `metalog spark sql`); the new audit table is there."""
    out = tmp_path / "out"
    shutil.copytree(job["out"], out)
    d = tmp_path / "n1"
    shutil.copytree(job["dirs"][0], d)
    _flip_bit(str(d), 10)
    code, rep = run_job(spark, "snapshot", str(d), "--out", str(out), "--report", str(out / "r.json"))
    assert code == spark_job.EXIT_VALIDATION, rep
    assert sorted(os.listdir(out / "tables")) == ["audit"]
    assert sorted(rep["tables"]["removed_earlier"]) == sorted(TB.STATE_AND_HISTORY_VIEWS)
    assert not (out / "records_per_type.png").exists() and (out / "replicas.png").exists()
    assert not list(out.glob("*.checkpoint"))
    assert rep["removed_earlier_checkpoint"] == job["rep"]["snapshot"]["name"]
    assert f"  removed {job['rep']['snapshot']['name']}, an earlier run's output" in capsys.readouterr().out
    for view in TB.STATE_AND_HISTORY_VIEWS:  # registered by the sql tests on this shared session
        spark.catalog.dropTempView(view)
    assert sql(spark, str(out), "SELECT count(*) FROM history") == spark_job.EXIT_INPUT
    assert "views: audit)" in capsys.readouterr().err


def test_without_matplotlib_the_job_succeeds_and_says_plots_were_skipped(spark, job, tmp_path, monkeypatch,
                                                                       capsys):
    """The user sees one stderr line `metalog spark: plots skipped (...)`; exit 0, tables written."""
    monkeypatch.setattr(plots, "PLOT_MODULES", ("metalog_test_no_such_plot_module",))
    out = tmp_path / "out"
    code, rep = run_job(spark, "audit", *job["dirs"], "--out", str(out), "--report", str(out / "r.json"))
    assert code == 0, rep
    err = capsys.readouterr().err
    assert ("metalog spark: plots skipped (metalog_test_no_such_plot_module is not installed: "
            "pip install 'metalog[spark]')") in err
    assert rep["plots"]["skipped"].startswith("metalog_test_no_such_plot_module is not installed")
    # audit writes the audit table only (no state was rebuilt), no pictures.
    assert sorted(os.listdir(out / "tables")) == ["audit"]
    assert not [f for f in os.listdir(out) if f.endswith((".png", ".html"))]
