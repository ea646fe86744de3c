"""Queryable output of the Spark job: Parquet tables and the ``sql`` command.

Besides the ``.checkpoint``, ``metalog spark snapshot`` writes under
``OUT/tables/`` one Parquet table (a directory) per view:

* the rebuilt state at the HW, one table per entity kind (``brokers``,
  ``topics``, ``partitions``, ``configs``, ``acls``, ``features``, and
  ``voters`` from the last LeaderChange control record when there is one);
  every row carries ``state_offset``, the offset the state reflects (records
  below it are applied, as a snapshot's end offset);
* ``history``: every committed record (offset, leader epoch, batch
  timestamp, control bit, record type, version, JSON body), decoded with
  ``metalog.tools.record_json`` exactly as ``metalog consume`` prints it;
* ``audit``: one row per replica (log start/end, the HW, verdict, category).

``metalog spark sql "SELECT ..."`` registers each table directory as a
temporary view of that name in a local Spark session and prints the result.

The row builders here are pure Python (run inside executors by
``mapInArrow``); pyspark and pyarrow are imported in the functions that
need them (the [spark] extra).
"""

from __future__ import annotations

import json
import re
from typing import Callable, Iterable, Iterator

from metalog.storage import metadata_records as r
from metalog.tools.record_json import record_json
from metalog.tools.spark import fold as F

TABLES_DIR = "tables"
ARROW_ROWS_PER_BATCH = 8192
SQL_ROWS_PRINTED_MAX = 10_000  # `metalog spark sql` prints at most this many rows

_RESOURCE_TYPES = {r.RESOURCE_TOPIC: "topic", r.RESOURCE_BROKER: "broker"}


def _endpoints(rec: r.RegisterBroker) -> list[str]:
    return [f"{e.name}://{e.host}:{e.port}" for e in rec.endpoints]


# view name -> (snapshot section, columns after state_offset, row builder from the decoded record)
STATE_TABLES: dict[str, tuple[int, list[tuple[str, str]], Callable]] = {
    "brokers": (F.SEC_BROKER,
                [("broker_id", "int"), ("incarnation_id", "string"), ("broker_epoch", "long"),
                 ("endpoints", "array<string>"), ("rack", "string"), ("fenced", "bool")],
                lambda x: (x.broker_id, x.incarnation_id, x.broker_epoch, _endpoints(x), x.rack, x.fenced)),
    "topics": (F.SEC_TOPIC, [("topic_id", "string"), ("name", "string")],
               lambda x: (x.topic_id, x.name)),
    "partitions": (F.SEC_PARTITION,
                   [("topic_id", "string"), ("partition_id", "int"), ("replicas", "array<int>"),
                    ("isr", "array<int>"), ("leader", "int"), ("leader_epoch", "int"),
                    ("partition_epoch", "int")],
                   lambda x: (x.topic_id, x.partition_id, list(x.replicas), list(x.isr), x.leader,
                              x.leader_epoch, x.partition_epoch)),
    "configs": (F.SEC_CONFIG,
                [("resource_type", "int"), ("resource_kind", "string"), ("resource_name", "string"),
                 ("name", "string"), ("value", "string")],
                lambda x: (x.resource_type, _RESOURCE_TYPES.get(x.resource_type, str(x.resource_type)),
                           x.resource_name, x.name, x.value)),
    "acls": (F.SEC_ACL,
             [("id", "string"), ("resource_type", "int"), ("resource_name", "string"),
              ("pattern_type", "int"), ("principal", "string"), ("host", "string"),
              ("operation", "int"), ("permission_type", "int")],
             lambda x: (x.id, x.resource_type, x.resource_name, x.pattern_type, x.principal, x.host,
                        x.operation, x.permission_type)),
    "features": (F.SEC_FEATURE, [("name", "string"), ("feature_level", "int")],
                 lambda x: (x.name, x.feature_level)),
}

VOTER_FIELDS = [("state_offset", "long"), ("voter_id", "int"), ("leader_id", "int"),
                ("leader_epoch", "int"), ("granted_vote", "bool"), ("record_offset", "long")]

HISTORY_FIELDS = [("offset", "long"), ("leader_epoch", "int"), ("timestamp_ms", "long"),
                  ("control", "bool"), ("record_type", "string"), ("version", "int"),
                  ("body", "string")]

AUDIT_FIELDS = [("replica", "string"), ("node_id", "string"), ("cluster_id", "string"),
                ("in_vote", "bool"), ("log_start_offset", "long"), ("log_end_offset", "long"),
                ("hw", "long"), ("majority_end_offset", "long"), ("lag_records", "long"),
                ("verdict", "string"), ("category", "string"), ("first_diff_offset", "long"),
                ("first_diff_epoch", "int")]

VIEWS = list(STATE_TABLES) + ["voters", "history", "audit"]


def state_fields(view: str) -> list[tuple[str, str]]:
    return [("state_offset", "long")] + STATE_TABLES[view][1]


def state_rows(view: str, state_offset: int, values: Iterable[bytes]) -> Iterator[tuple]:
    """Rows of one state table from the encoded state records of its section."""
    build = STATE_TABLES[view][2]
    for value in values:
        yield (state_offset,) + tuple(build(r.decode_record(value)))


def history_row(offset: int, epoch: int, ts: int, control: bool, value: bytes) -> tuple:
    """One committed record as a history row: the body is what `metalog consume`
    prints (fields for metadata/control records; value + encoding for data)."""
    d = record_json(offset, epoch, value, control)
    if "fields" in d:
        rtype, version, body = d["type"], d.get("version"), d["fields"]
    else:  # produced data, or a control record that does not decode
        rtype, version = d.get("type", "data"), None
        body = {k: d[k] for k in ("value", "encoding", "error") if k in d}
    return (offset, epoch, ts, bool(control), rtype, version, json.dumps(body, sort_keys=True))


def voter_rows(state_offset: int, leader_change: dict | None) -> list[tuple]:
    """The voter set named by the last LeaderChange control record (a history row as a dict)."""
    if not leader_change:
        return []
    body = json.loads(leader_change["body"])
    granted = set(body.get("granting_voters") or [])
    return [(state_offset, v, body["leader_id"], leader_change["leader_epoch"], v in granted,
             leader_change["offset"]) for v in body.get("voters") or []]


def audit_rows(report: dict) -> list[tuple]:
    """One row per replica from the job's report (voters, observers and excluded ones)."""
    hw = report.get("hw")
    mend = report.get("majority_end_offset")
    cluster = report.get("cluster_id")
    audit = report.get("audit", {})
    foreign = {w["replica"]: w["warning"] for w in report.get("warnings", [])
               if w.get("file") == "meta.properties"}
    rows = []
    for name, rp in sorted(report.get("replicas", {}).items()):
        a = audit.get(name)
        end = rp.get("log_end_offset")
        lag = max(0, hw - end) if hw is not None and end is not None else None
        if a is None:
            verdict = foreign.get(name, "not in the vote (no log segments)")
            category = "configuration" if name in foreign else None
            rows.append((name, rp.get("node_id"), None if name in foreign else cluster, False,
                         rp.get("log_start_offset"), end, hw, mend, lag, verdict, category, None, None))
            continue
        # An observer (not in the voter set) is audited but did not vote.
        rows.append((name, rp.get("node_id"), cluster, a.get("in_vote", True), rp.get("log_start_offset"),
                     end, hw, mend,
                     lag, a["status"], a.get("category") or ("ok" if a["status"] == "agrees" else a["status"]),
                     a.get("first_diff_offset"), a.get("first_diff_epoch")))
    return rows


# ------------------------------------------------------------------ Spark side


def _spark_schema(fields):
    from pyspark.sql import types as T

    def typ(name: str):
        if name.startswith("array<"):
            return T.ArrayType(typ(name[6:-1]))
        return {"string": T.StringType(), "long": T.LongType(), "int": T.IntegerType(),
                "bool": T.BooleanType(), "binary": T.BinaryType()}[name]

    return T.StructType([T.StructField(n, typ(t), True) for n, t in fields])


def _arrow_schema(fields):
    import pyarrow as pa

    def typ(name: str):
        if name.startswith("array<"):
            return pa.list_(typ(name[6:-1]))
        return {"string": pa.string(), "long": pa.int64(), "int": pa.int32(), "bool": pa.bool_(),
                "binary": pa.binary()}[name]

    return pa.schema([(n, typ(t)) for n, t in fields])


def _batches(rows: Iterable[tuple], fields) -> Iterator:
    """Arrow record batches of at most ARROW_ROWS_PER_BATCH rows."""
    import pyarrow as pa

    schema = _arrow_schema(fields)
    chunk: list[tuple] = []

    def flush():
        cols = list(zip(*chunk))
        return pa.RecordBatch.from_arrays([pa.array(c, t.type) for c, t in zip(cols, schema)],
                                          schema=schema)

    for row in rows:
        chunk.append(row)
        if len(chunk) >= ARROW_ROWS_PER_BATCH:
            yield flush()
            chunk = []
    if chunk:
        yield flush()


def _state_fn(view: str, state_offset: int):
    fields = state_fields(view)

    def fn(batches):
        for rb in batches:
            yield from _batches(state_rows(view, state_offset, rb.column("value").to_pylist()), fields)

    return fn


def _history_fn(batches):
    def rows(rb):
        cols = [rb.column(n).to_pylist() for n in ("offset", "epoch", "ts", "control", "value")]
        for o, e, t, c, v in zip(*cols):
            yield history_row(o, e, t or 0, c, v)

    for rb in batches:
        yield from _batches(rows(rb), HISTORY_FIELDS)


def table_path(out: str, view: str) -> str:
    return out.rstrip("/") + f"/{TABLES_DIR}/{view}"


def write_state_and_history(spark, states, committed, state_offset: int, out: str) -> dict:
    """Writes the state tables (from the fold's state rows at state_offset), the
    history (from the committed records) and the voters; returns rows per view."""
    from pyspark.sql import functions as f

    counts: dict[str, int] = {}
    at = states.filter(f.col("cut") == state_offset)
    for view, (sec, _cols, _build) in STATE_TABLES.items():
        df = (at.filter(f.col("sec") == sec).select("value")
              .mapInArrow(_state_fn(view, state_offset), _spark_schema(state_fields(view))))
        df.write.mode("overwrite").parquet(table_path(out, view))
        counts[view] = spark.read.parquet(table_path(out, view)).count()
    hist = (committed.select("offset", "epoch", "ts", "control", "value")
            .mapInArrow(_history_fn, _spark_schema(HISTORY_FIELDS)))
    hist.write.mode("overwrite").parquet(table_path(out, "history"))
    hist = spark.read.parquet(table_path(out, "history"))
    counts["history"] = hist.count()
    last = (hist.filter(f.col("record_type") == "LeaderChange").orderBy(f.col("offset").desc())
            .limit(1).collect())
    voters = voter_rows(state_offset, last[0].asDict() if last else None)
    spark.createDataFrame(voters, _spark_schema(VOTER_FIELDS)).write.mode("overwrite").parquet(
        table_path(out, "voters"))
    counts["voters"] = len(voters)
    return counts


def write_audit(spark, report: dict, out: str) -> int:
    rows = audit_rows(report)
    spark.createDataFrame(rows, _spark_schema(AUDIT_FIELDS)).write.mode("overwrite").parquet(
        table_path(out, "audit"))
    return len(rows)


STATE_AND_HISTORY_VIEWS = (*STATE_TABLES, "history", "voters")


def remove_state_tables(spark, out: str) -> list[str]:
    """Removes the state tables, history and voters an earlier run left under
    OUT/tables (a run that publishes no checkpoint writes none: old ones would
    describe a state this run did not validate). Returns the views removed."""
    jvm = spark.sparkContext._jvm
    removed = []
    for view in STATE_AND_HISTORY_VIEWS:
        path = jvm.org.apache.hadoop.fs.Path(table_path(out, view))
        fs = path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
        if fs.exists(path):
            fs.delete(path, True)
            removed.append(view)
    return removed


def register_views(spark, out: str) -> list[str]:
    """Every table under OUT/tables as a temporary view named after its directory."""
    names = []
    jvm = spark.sparkContext._jvm
    root = jvm.org.apache.hadoop.fs.Path(out.rstrip("/") + "/" + TABLES_DIR)
    fs = root.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    if not fs.exists(root):
        return names
    for st in fs.listStatus(root):
        name = st.getPath().getName()
        if st.isDirectory() and re.fullmatch(r"[a-z_]+", name):
            spark.read.parquet(st.getPath().toString()).createOrReplaceTempView(name)
            names.append(name)
    return sorted(names)


def format_rows(columns: list[str], rows: list[tuple]) -> list[str]:
    """An aligned text table (as spark-sql prints), NULL for None."""
    def cell(v):
        if v is None:
            return "NULL"
        if isinstance(v, (list, tuple)):
            return "[" + ",".join(cell(x) for x in v) + "]"
        return str(v)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max([len(c)] + [len(t[i]) for t in text]) for i, c in enumerate(columns)]
    line = lambda cells: " | ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [line(columns), "-+-".join("-" * w for w in widths)] + [line(t) for t in text]


def json_default(v):
    if isinstance(v, (bytes, bytearray)):
        return v.hex()
    return str(v)

