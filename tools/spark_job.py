"""Offline Spark job over metalog data dirs: rebuild and validate controller
snapshots (``snapshot``) and audit the replicas' logs (``audit``).

    metalog spark snapshot DATA_DIR... [--upto OFFSET] [--out DIR] [--master URL]
    metalog spark audit    DATA_DIR... [--hw OFFSET]
    spark-submit tools/spark_job.py snapshot DATA_DIR ...

Plan (details in docs/spark.md):

1. Spark's binaryFile source lists ``*.log``, ``*.checkpoint``,
   ``meta.properties`` and ``log-start-offset`` under every input (recursive,
   any Hadoop path). ``mapInArrow`` decodes each file inside the executors
   with the broker's own decoders (``tools.spark.decode``): one row per
   record, plus small per-file summaries and error rows -- only those small
   rows reach the driver.
2. Every batch is validated (CRC, contiguous offsets, non-decreasing epochs)
   inside its file; the driver checks continuity across segments.
3. Votes: for each offset, the (epoch, value digest) held by a strict majority
   of the replicas covering it, and by a majority of all replicas given
   (a replica whose log starts later has snapshotted the offset away and
   abstains in favour). **HW** = the first offset from the earliest log start
   with no such majority, unless ``--upto/--hw`` names one. Per replica: the
   first offset where it differs from the majority, and on which side of the
   HW it lies.
4. Replay (``tools.spark.fold``): committed data records keyed by entity,
   folded per key with grouped ``applyInArrow``; topic lifecycle and broker status
   timelines are small side tables broadcast to the partition/config folds.
5. The state at the HW is streamed to the driver in ``to_records()`` order and
   written with ``storage.snapshot.SnapshotWriter``: the broker's format and
   name. States at the offsets of the brokers' own snapshots are compared
   with those snapshots entity by entity (a distributed outer join).

Exit codes: 0 ok, 1 validation failed (corrupt batch, divergence below the HW,
snapshot mismatch), 2 unusable input (missing/empty dir, nothing to replay).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
import zipfile

if __package__ in (None, ""):  # spark-submit tools/spark_job.py: make the repo importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.spark import decode as D  # noqa: E402
from tools.spark import fold as F  # noqa: E402

EXIT_OK, EXIT_VALIDATION, EXIT_INPUT, EXIT_FAILED = 0, 1, 2, 3
GLOB = "{*.log,*.checkpoint,meta.properties,log-start-offset}"
SNAPSHOTS_COMPARED_MAX = 8
DIFFS_LISTED_MAX = 50
ARROW_ROWS_PER_BATCH = 8192


class InputError(Exception):
    """Input the job cannot work with; the message is what the user sees."""


# ------------------------------------------------------------------ Spark plumbing


def _spark_type(name: str):
    from pyspark.sql import types as T

    return {"string": T.StringType(), "long": T.LongType(), "int": T.IntegerType(),
            "bool": T.BooleanType(), "binary": T.BinaryType()}[name]


def _arrow_type(name: str):
    import pyarrow as pa

    return {"string": pa.string(), "long": pa.int64(), "int": pa.int32(), "bool": pa.bool_(),
            "binary": pa.binary()}[name]


def _schema(fields):
    from pyspark.sql import types as T

    return T.StructType([T.StructField(n, _spark_type(t), True) for n, t in fields])


def _arrow_schema(fields):
    import pyarrow as pa

    return pa.schema([(n, _arrow_type(t)) for n, t in fields])


def _decode_partition(batches):
    """mapInArrow body: binaryFile rows in, DECODED_FIELDS rows out."""
    import pyarrow as pa

    from tools.spark.decode import DECODED_FIELDS, FIELD_NAMES, decode_file

    schema = _arrow_schema(DECODED_FIELDS)
    cols = {n: [] for n in FIELD_NAMES}
    count = 0
    for rb in batches:
        paths = rb.column("path").to_pylist()
        contents = rb.column("content")
        for i, path in enumerate(paths):
            for row in decode_file(path, contents[i].as_py()):
                for n in FIELD_NAMES:
                    cols[n].append(row[n])
                count += 1
                if count >= ARROW_ROWS_PER_BATCH:
                    yield pa.RecordBatch.from_pydict(cols, schema=schema)
                    cols = {n: [] for n in FIELD_NAMES}
                    count = 0
    if count:
        yield pa.RecordBatch.from_pydict(cols, schema=schema)


KEYED_FIELDS = [("offset", "long"), ("kind", "string"), ("key", "string"), ("value", "binary")]


def _key_partition(batches):
    import pyarrow as pa

    from tools.spark.fold import key_of

    schema = _arrow_schema(KEYED_FIELDS)
    def col(rb, name):
        c = rb.column(name)
        return c.combine_chunks() if isinstance(c, pa.ChunkedArray) else c

    for rb in batches:
        values = rb.column("value").to_pylist()
        kinds, keys = [], []
        for v in values:
            k, key = key_of(v)
            kinds.append(k)
            keys.append(key)
        table = pa.Table.from_arrays(
            [col(rb, "offset"), pa.array(kinds, pa.string()), pa.array(keys, pa.string()),
             col(rb, "value")], schema=schema)
        yield from table.to_batches()


FOLD_FIELDS = [
    ("rowtype", "string"), ("cut", "long"), ("sec", "int"), ("s1", "string"), ("n1", "long"),
    ("s2", "string"), ("s3", "string"), ("value", "binary"), ("offset", "long"), ("a", "long"),
    ("b1", "bool"), ("b2", "bool"), ("b3", "bool"), ("invalid", "long"), ("name", "string"),
]
_FOLD_NAMES = [n for n, _ in FOLD_FIELDS]


def _fold_table(rows: list[dict]):
    import pyarrow as pa

    return pa.Table.from_pydict({n: [row.get(n) for row in rows] for n in _FOLD_NAMES},
                                schema=_arrow_schema(FOLD_FIELDS))


def _state_dicts(states) -> list[dict]:
    return [{"rowtype": "state", "cut": s.cut, "sec": s.sec, "s1": s.s1, "n1": s.n1, "s2": s.s2,
             "s3": s.s3, "value": s.value} for s in states]


def _make_fold_fn(cuts, tables_bc):
    """Grouped-Arrow fold body (one call per key) for every key kind; tables_bc is None for the first
    stage (topics, brokers) and the broadcast (topic, broker) tables after."""

    def fn(table):
        kind = table.column("kind")[0].as_py()
        key = table.column("key")[0].as_py()
        recs = list(zip(table.column("offset").to_pylist(), table.column("value").to_pylist()))
        out: list[dict] = []
        if kind == F.K_TOPICS:
            intervals, states, invalid = F.fold_topics(recs, cuts)
            out += [{"rowtype": "interval", "s1": iv.topic_id, "name": iv.name,
                     "offset": iv.start, "a": iv.end} for iv in intervals]
        elif kind == F.K_BROKER:
            changes, states, invalid = F.fold_broker(recs, cuts)
            out += [{"rowtype": "change", "n1": c.broker_id, "offset": c.offset,
                     "b1": c.registered, "b2": c.fenced, "b3": c.is_fence} for c in changes]
        elif kind == F.K_PARTITION:
            topics, brokers = tables_bc.value
            states, invalid = F.fold_partition(key, recs, cuts, topics, brokers)
        elif kind == F.K_CONFIG:
            topics, _ = tables_bc.value
            states, invalid = F.fold_config(key, recs, cuts, topics)
        elif kind == F.K_FEATURE:
            states, invalid = F.fold_feature(key, recs, cuts)
        elif kind == F.K_ACL:
            states, invalid = F.fold_acl(key, recs, cuts)
        else:  # undecodable (X) records are invalid; NoOps (N) change nothing
            states, invalid = [], len(recs) if kind == F.K_INVALID else 0
        out += _state_dicts(states)
        if invalid:
            out.append({"rowtype": "invalid", "invalid": invalid})
        return _fold_table(out)

    return fn


class Progress:
    """A progress line on stderr from Spark's status tracker (stage, tasks
    done/total) plus the job's own phase, printed when it changes."""

    def __init__(self, spark, enabled: bool, interval_s: float = 1.0) -> None:
        self.sc = spark.sparkContext
        self.enabled = enabled
        self.interval_s = interval_s
        self.phase = "starting"
        self._stop = threading.Event()
        self._last = ""
        self._thread = threading.Thread(target=self._run, name="spark-progress", daemon=True)
        self.t0 = time.monotonic()

    def start(self) -> "Progress":
        if self.enabled:
            self._thread.start()
        return self

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self._print()

    def _print(self) -> None:
        if not self.enabled:
            return
        parts = []
        try:
            tracker = self.sc.statusTracker()
            for sid in tracker.getActiveStageIds()[:3]:
                info = tracker.getStageInfo(sid)
                if info:
                    parts.append(f"stage {sid} {info.numCompletedTasks}/{info.numTasks} tasks")
        except Exception:  # the tracker is best effort; never kill the job for it
            pass
        line = f"[metalog spark {time.monotonic() - self.t0:6.1f}s] {self.phase}" + (
            "  (" + ", ".join(parts) + ")" if parts else "")
        body = line.split("]", 1)[1]
        if body != self._last:
            self._last = body
            print(line, file=sys.stderr, flush=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._print()

    def stop(self) -> None:
        self._stop.set()


def _code_zip() -> str:
    """The packages executors import, zipped for a real cluster (--py-files)."""
    import tempfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(tempfile.mkdtemp(prefix="metalog-spark-"), "metalog_code.zip")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for pkg in ("storage", "broker", "protocol", "tools"):
            for dirpath, _dirs, files in os.walk(os.path.join(root, pkg)):
                for f in files:
                    if f.endswith(".py"):
                        full = os.path.join(dirpath, f)
                        z.write(full, os.path.relpath(full, root))
    return path


def get_spark(master: str = "local[*]", ui: bool = False, shuffle_partitions: int = 8,
              ship_code: bool | None = None, extra_conf: dict | None = None, driver_memory: str = "4g"):
    """A SparkSession for the job. Executors run this interpreter in local
    mode; elsewhere the code is shipped as a zip (deps must be installed)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = (SparkSession.builder.master(master).appName("metalog-spark")
               .config("spark.ui.enabled", "true" if ui else "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
               .config("spark.sql.execution.arrow.pyspark.enabled", "true")
               .config("spark.sql.adaptive.enabled", "true")
               # Whole segment files (up to 64 MiB each) are rows of the binaryFile
               # source; in local mode the executors live in the driver JVM.
               .config("spark.driver.memory", driver_memory)
               # One segment (<= 64 MiB by default) per input split: bounds a task's memory.
               .config("spark.sql.files.maxPartitionBytes", str(64 << 20)))
    for k, v in (extra_conf or {}).items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    if ship_code if ship_code is not None else not master.startswith("local"):
        spark.sparkContext.addPyFile(_code_zip())
    return spark


# ------------------------------------------------------------------ analysis


def _parse_props(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


DISCOVERY_ENTRIES_MAX = 200_000  # bound on the directory walk
DISCOVERY_DEPTH_MAX = 8


def discover(spark, inputs: list[str]) -> list[str]:
    """Directories under the inputs that hold metadata log files, found with
    the Hadoop FileSystem API (so any Hadoop path works). Spark's own recursive
    listing skips names starting with '_' -- and every log lives in
    ``__cluster_metadata-0`` -- so the job passes these directories explicitly."""
    jvm = spark.sparkContext._jvm
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    wanted = re.compile(r".*\.(log|checkpoint)|meta\.properties|log-start-offset")
    dirs: list[str] = []
    seen = 0
    for p in inputs:
        path = jvm.org.apache.hadoop.fs.Path(p)
        try:
            fs = path.getFileSystem(conf)
            exists = fs.exists(path)
        except Exception as exc:
            raise InputError(f"cannot open input {p!r}: {str(exc).splitlines()[0]}") from None
        matches = list(fs.globStatus(path) or []) if exists or any(c in p for c in "*?[{") else []
        if not matches:
            raise InputError(f"input {p!r} does not exist")
        if not all(st.isDirectory() for st in matches):
            raise InputError(f"input {p!r} is not a directory (give broker data dirs)")
        found_logs = False
        stack = [(st.getPath(), 0) for st in matches]
        while stack:
            d, depth = stack.pop()
            has = False
            for st in fs.listStatus(d):
                seen += 1
                if seen > DISCOVERY_ENTRIES_MAX:
                    raise InputError(f"more than {DISCOVERY_ENTRIES_MAX} entries under the inputs: "
                                     "point the job at the broker data dirs")
                name = st.getPath().getName()
                if st.isDirectory():
                    if depth < DISCOVERY_DEPTH_MAX and not name.startswith("."):
                        stack.append((st.getPath(), depth + 1))
                elif wanted.fullmatch(name):
                    has = True
                    found_logs |= name.endswith((".log", ".checkpoint"))
            if has:
                dirs.append(d.toString())
        if not found_logs:
            raise InputError(f"input {p!r} holds no metadata log files (*.log, *.checkpoint): "
                             "is it a broker data dir?")
    return sorted(set(dirs))


class Analysis:
    """Loads and validates the inputs, votes, and finds the HW (steps 1-3)."""

    def __init__(self, spark, inputs: list[str], progress: Progress, report: dict,
                 cluster_id: str | None = None) -> None:
        self.spark = spark
        self.inputs = inputs
        self.progress = progress
        self.report = report
        self.cluster_id = cluster_id

    def load(self) -> None:
        from pyspark import StorageLevel
        from pyspark.errors import AnalysisException
        from pyspark.sql import functions as f

        self.progress.set_phase("listing input directories")
        dirs = discover(self.spark, self.inputs)
        self.progress.set_phase("decoding files")
        try:
            files = (self.spark.read.format("binaryFile").option("pathGlobFilter", GLOB)
                     .load(dirs))
        except AnalysisException as exc:
            raise InputError(f"cannot read the inputs: {str(exc).splitlines()[0]}") from None
        self.decoded = files.mapInArrow(_decode_partition, _schema(D.DECODED_FIELDS))
        self.decoded.persist(StorageLevel.MEMORY_AND_DISK)
        small = (self.decoded.filter(~f.col("kind").isin("rec", "snaprec"))
                 .drop("value").collect())
        self._summarize(small)

    def _summarize(self, small) -> None:
        rep = self.report
        self.replicas: dict[str, dict] = {}
        errors, ignored, snaps = [], [], []
        for row in small:
            d = row.asDict()
            rp = self.replicas.setdefault(d["replica"], {"segments": [], "props": {}, "snapshots": []})
            if d["kind"] == "file":
                info = json.loads(d["info"])
                info["file"] = d["file"]
                rp["segments"].append(info)
            elif d["kind"] == "err":
                errors.append({"replica": d["replica"], "file": d["file"], "position": d["position"],
                               "offset": d["offset"], "epoch": d["epoch"], "error": d["info"]})
            elif d["kind"] == "meta":
                if d["file"] == "meta.properties":
                    rp["props"] = _parse_props(d["info"])
                else:
                    try:
                        rp["log_start_file"] = int(json.loads(d["info"]).get("log_start_offset", 0))
                    except (ValueError, AttributeError):
                        pass
            elif d["kind"] == "snap":
                info = json.loads(d["info"])
                info.update(replica=d["replica"], file=d["file"])
                rp["snapshots"].append(info)
                snaps.append(info)
            elif d["kind"] == "ignored":
                ignored.append(f"{d['replica']}/{d['file']}")
        # Replicas with only a meta.properties and no log files are not replicas.
        self.replicas = {k: v for k, v in self.replicas.items() if v["segments"] or v["snapshots"]
                         or any(e["replica"] == k for e in errors)}
        if not self.replicas:
            raise InputError(f"no metadata log segments found under {', '.join(self.inputs)}")
        # Continuity across segments and cluster ids.
        ids = {p["props"].get("cluster.id") for p in self.replicas.values()} - {None}
        if self.cluster_id is None:
            if len(ids) > 1:
                errors.append({"replica": None, "file": "meta.properties", "position": None,
                               "offset": None, "epoch": None,
                               "error": f"replicas from different clusters: {sorted(ids)}"})
            self.cluster_id = next(iter(ids)) if len(ids) == 1 else ""
        for name, rp in sorted(self.replicas.items()):
            segs = sorted(rp["segments"], key=lambda s: s["base_offset"])
            rp["segments"] = segs
            rp["node_id"] = rp["props"].get("node.id")
            cid = rp["props"].get("cluster.id")
            if self.cluster_id and cid and cid != self.cluster_id:
                errors.append({"replica": name, "file": "meta.properties", "position": None,
                               "offset": None, "epoch": None,
                               "error": f"replica belongs to cluster {cid!r}, not {self.cluster_id!r}"})
            for prev, nxt in zip(segs, segs[1:]):
                if prev["end_offset"] != nxt["base_offset"]:
                    errors.append({"replica": name, "file": nxt["file"], "position": 0,
                                   "offset": nxt["base_offset"], "epoch": nxt["first_epoch"],
                                   "error": f"segment starts at {nxt['base_offset']} but the previous "
                                            f"one ({prev['file']}) ends at {prev['end_offset']}"})
                if nxt["first_epoch"] >= 0 and nxt["first_epoch"] < prev["last_epoch"]:
                    errors.append({"replica": name, "file": nxt["file"], "position": 0,
                                   "offset": nxt["base_offset"], "epoch": nxt["first_epoch"],
                                   "error": f"epoch went backwards across segments: "
                                            f"{nxt['first_epoch']} after {prev['last_epoch']}"})
            # The log-start-offset file may be past the first segment's base
            # (whole segments are deleted lazily): records below it do not count.
            rp["log_start"] = (max(segs[0]["base_offset"], rp.get("log_start_file", 0))
                               if segs else None)
            rp["log_end"] = segs[-1]["end_offset"] if segs else None
            for s in rp["snapshots"]:
                if self.cluster_id and s["cluster_id"] and s["cluster_id"] != self.cluster_id:
                    s["foreign"] = True
                    errors.append({"replica": name, "file": s["file"], "position": 0,
                                   "offset": s["end_offset"], "epoch": s["epoch"],
                                   "error": f"snapshot from another cluster: its header says cluster "
                                            f"{s['cluster_id']!r}, this cluster is {self.cluster_id!r}"})
        self.errors = errors
        self.snapshots = [s for s in snaps if not s.get("foreign")]
        rep["cluster_id"] = self.cluster_id
        rep["errors"] = errors
        rep["ignored_files"] = ignored[:DIFFS_LISTED_MAX]
        rep["replicas"] = {
            name: {"node_id": rp["node_id"], "log_start_offset": rp["log_start"],
                   "log_end_offset": rp["log_end"], "segments": len(rp["segments"]),
                   "records": sum(s["records"] for s in rp["segments"]),
                   "snapshots": [s["file"] for s in rp["snapshots"]]}
            for name, rp in sorted(self.replicas.items())}

    def vote(self, hw_override: int | None) -> None:
        """Majority per offset, the HW, and each replica's first difference."""
        from pyspark import StorageLevel
        from pyspark.sql import functions as f

        self.progress.set_phase("voting: majority value per offset")
        with_log = {k: v for k, v in self.replicas.items() if v["log_start"] is not None}
        if not with_log:
            raise InputError("no replica holds log segments: nothing to replay")
        n = len(with_log)
        quorum = n // 2 + 1
        self.start = min(v["log_start"] for v in with_log.values())
        recs = self.decoded.filter(f.col("kind") == "rec")
        for name, rp in with_log.items():
            if rp["log_start"] > rp["segments"][0]["base_offset"]:
                recs = recs.filter(~((f.col("replica") == name) & (f.col("offset") < rp["log_start"])))
        self.recs = recs
        abstain = f.lit(0)
        for rp in with_log.values():
            if rp["log_start"] > self.start:
                abstain = abstain + f.when(f.col("offset") < rp["log_start"], 1).otherwise(0)
        counts = (recs.groupBy("offset", "epoch", "digest")
                  .agg(f.count(f.lit(1)).alias("cnt"), f.max("ts").alias("ts"),
                       f.first("control").alias("control")))
        self.majority = (counts.withColumn("abstain", abstain)
                         .filter((f.col("cnt") * 2 > f.lit(n) - f.col("abstain"))
                                 & (f.col("cnt") + f.col("abstain") >= quorum))
                         .select("offset", "epoch", "digest", "ts"))
        self.majority.persist(StorageLevel.MEMORY_AND_DISK)
        moff = self.majority.select("offset")
        first_nonmajority = (recs.select("offset").distinct().join(moff, "offset", "left_anti")
                             .agg(f.min("offset")).first()[0])
        first_gap = (moff.select((f.col("offset") + 1).alias("offset")).join(moff, "offset", "left_anti")
                     .agg(f.min("offset")).first()[0])
        has_start = moff.filter(f.col("offset") == self.start).limit(1).count() > 0
        derived = self.start if not has_start else min(
            x for x in (first_nonmajority, first_gap) if x is not None)
        self.derived_hw = derived
        self.hw = derived if hw_override is None else hw_override
        self.report["majority_end_offset"] = derived
        self.report["hw"] = self.hw
        self.report["hw_source"] = "majority" if hw_override is None else "given"
        self.report["quorum"] = f"{quorum} of {n} replicas"

        # Per replica: first offset whose (epoch, digest) is not the majority's.
        self.progress.set_phase("voting: first difference per replica")
        mj = self.majority.select("offset", f.col("epoch").alias("m_epoch"),
                                  f.col("digest").alias("m_digest"))
        diffs = (recs.select("replica", "offset", "epoch", "digest").join(mj, "offset", "left")
                 .filter(f.col("m_digest").isNull() | (f.col("m_epoch") != f.col("epoch"))
                         | (f.col("m_digest") != f.col("digest")))
                 .groupBy("replica").agg(f.min(f.struct("offset", "epoch")).alias("first"))
                 .collect())
        first_diff = {row["replica"]: (row["first"]["offset"], row["first"]["epoch"], "differs")
                      for row in diffs}
        for e in self.errors:  # a corrupt batch is a difference where it starts
            rname, off = e["replica"], e["offset"]
            if rname in with_log and off is not None:
                cur = first_diff.get(rname)
                if cur is None or off < cur[0]:
                    first_diff[rname] = (off, e["epoch"], "corrupt: " + e["error"])
        audit = {}
        self.breach = False
        for name, rp in sorted(with_log.items()):
            fd = first_diff.get(name)
            entry = {"node_id": rp["node_id"], "log_start_offset": rp["log_start"],
                     "log_end_offset": rp["log_end"]}
            if fd is None:
                entry.update(status="agrees", first_diff_offset=None)
                if rp["log_end"] < self.hw:
                    entry["status"] = "behind"
            else:
                below = fd[0] < self.hw
                entry.update(first_diff_offset=fd[0], first_diff_epoch=fd[1], why=fd[2],
                             below_hw=below,
                             status="safety breach (differs below the HW)" if below
                             else "uncommitted tail (differs above the HW)")
                self.breach |= below
            audit[name] = entry
        self.first_diff = first_diff
        self.report["audit"] = audit


def _entity_name(sec: int, s1: str, n1: int, s2: str, s3: str) -> str:
    return {F.SEC_FEATURE: f"feature {s1}", F.SEC_BROKER: f"broker {n1}",
            F.SEC_TOPIC: f"topic {s1}", F.SEC_PARTITION: f"partition {s1}/{n1}",
            F.SEC_CONFIG: f"config ({n1}, {s2!r}, {s3!r})", F.SEC_ACL: f"acl {s1}"}.get(sec, f"unknown record {s1}")


def _record_json(value: bytes | None):
    from storage import metadata_records as r

    if value is None:
        return None
    try:
        return r.record_to_dict(r.decode_record(value))
    except r.MetadataRecordError as exc:
        return f"undecodable: {exc}"


class Replay:
    """Steps 4-5: the committed prefix folded per key, at several cuts."""

    def __init__(self, an: Analysis, target: int, progress: Progress) -> None:
        self.an = an
        self.target = target
        self.progress = progress

    def run(self, cuts: list[int]) -> None:
        from pyspark import StorageLevel
        from pyspark.sql import functions as f

        an = self.an
        spark = an.spark
        self.cuts = cuts = sorted(set(cuts))
        recs = an.recs
        start = an.start
        self.base = None
        if start > 0:
            # The log was truncated under a snapshot: start from one of those.
            usable = sorted((s for s in an.snapshots if start <= s["end_offset"] <= self.target),
                            key=lambda s: s["end_offset"])
            if not usable:
                raise InputError(f"every log starts at offset {start} or later and no snapshot "
                                 f"between {start} and {self.target} exists to start the replay from")
            self.base = usable[0]
            start = self.base["end_offset"]
        # One source replica that agrees with the majority over the whole range
        # avoids a join; otherwise take the majority value per offset.
        src = None
        for name, rp in sorted(an.replicas.items(), key=lambda kv: kv[0]):
            fd = an.first_diff.get(name)
            if (rp["log_start"] is not None and rp["log_start"] <= start
                    and rp["log_end"] >= self.target and (fd is None or fd[0] >= self.target)):
                src = name
                break
        rng = (f.col("offset") >= start) & (f.col("offset") < self.target)
        if src is not None:
            committed = recs.filter((f.col("replica") == src) & rng)
        else:
            mj = an.majority.filter(rng).select("offset", "epoch", "digest")
            committed = recs.filter(rng).join(mj, ["offset", "epoch", "digest"]).dropDuplicates(["offset"])
        self.source = src or "majority of replicas"
        data = committed.filter(~f.col("control")).select("offset", "value")
        if self.base is not None:
            b = self.base
            snap = an.decoded.filter((f.col("kind") == "snaprec") & (f.col("replica") == b["replica"])
                                     & (f.col("file") == b["file"]))
            # Snapshot records replay first, in file order, at offsets below the log's.
            data = snap.select((f.col("position") - f.lit(b["records"] + 1) - f.lit(0)).alias("offset"),
                               "value").unionByName(data)
        keyed = data.mapInArrow(_key_partition, _schema(KEYED_FIELDS))
        keyed.persist(StorageLevel.MEMORY_AND_DISK)
        fold_schema = _schema(FOLD_FIELDS)

        self.progress.set_phase("replay: topic directory and broker folds")
        stage_a = (keyed.filter(f.col("kind").isin(F.K_TOPICS, F.K_BROKER))
                   .groupBy("kind", "key").applyInArrow(_make_fold_fn(cuts, None), fold_schema))
        stage_a.persist(StorageLevel.MEMORY_AND_DISK)
        side = stage_a.filter(f.col("rowtype").isin("interval", "change")).collect()
        intervals = [F.TopicInterval(x["s1"], x["name"], x["offset"], x["a"])
                     for x in side if x["rowtype"] == "interval"]
        changes = [F.BrokerChange(x["n1"], x["offset"], x["b1"], x["b2"], x["b3"])
                   for x in side if x["rowtype"] == "change"]
        tables = spark.sparkContext.broadcast((F.topic_table(intervals), F.broker_table(changes)))
        self.side_rows = len(side)

        self.progress.set_phase("replay: partition, config and feature folds")
        stage_b = (keyed.filter(~f.col("kind").isin(F.K_TOPICS, F.K_BROKER))
                   .groupBy("kind", "key").applyInArrow(_make_fold_fn(cuts, tables), fold_schema))
        out = stage_a.unionByName(stage_b)
        out.persist(StorageLevel.MEMORY_AND_DISK)
        agg = out.groupBy("rowtype").agg(f.count(f.lit(1)).alias("n"),
                                         f.sum("invalid").alias("invalid")).collect()
        self.invalid = int(sum(x["invalid"] or 0 for x in agg if x["rowtype"] == "invalid"))
        self.states = out.filter(f.col("rowtype") == "state")
        self.records_replayed = keyed.count()

    def state_rows(self, cut: int):
        """The state at `cut`, streamed in to_records() order."""
        from pyspark.sql import functions as f

        ordered = (self.states.filter(f.col("cut") == cut)
                   .orderBy("sec", "s1", "n1", "s2", "s3").select("value"))
        for row in ordered.toLocalIterator():
            yield bytes(row["value"])

    def compare(self, snap: dict) -> dict:
        """Entities where the broker's snapshot differs from the rebuilt state."""
        from pyspark.sql import functions as f

        keys = ["sec", "s1", "n1", "s2", "s3"]
        built = (self.states.filter(f.col("cut") == snap["end_offset"])
                 .select(*keys, f.col("value").alias("built")))
        theirs = (self.an.decoded.filter((f.col("kind") == "snaprec")
                                         & (f.col("replica") == snap["replica"])
                                         & (f.col("file") == snap["file"]))
                  .select(*keys, f.col("value").alias("broker")))
        diff = (built.join(theirs, keys, "full_outer")
                .filter(~f.col("built").eqNullSafe(f.col("broker"))))
        n = diff.count()
        rows = diff.orderBy(*keys).limit(DIFFS_LISTED_MAX).collect()
        return {"snapshot": f"{snap['replica']}/{snap['file']}", "end_offset": snap["end_offset"],
                "equal": n == 0, "differing_entities": n,
                "differences": [{"entity": _entity_name(x["sec"], x["s1"], x["n1"], x["s2"], x["s3"]),
                                 "rebuilt": _record_json(x["built"]),
                                 "broker": _record_json(x["broker"])} for x in rows]}


# ------------------------------------------------------------------ commands


def _epoch_and_ts_at(an: Analysis, offset: int) -> tuple[int, int]:
    from pyspark.sql import functions as f

    if offset < 0:
        return 0, 0
    row = an.majority.filter(f.col("offset") == offset).select("epoch", "ts").first()
    if row is None:
        return 0, 0
    return int(row["epoch"]), int(row["ts"] or 0)


def _finish(report: dict, args, started: float) -> None:
    report["elapsed_s"] = round(time.monotonic() - started, 2)
    path = args.report or (os.path.join(args.out, "report.json") if getattr(args, "out", None) else None)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as fh:
            json.dump(report, fh, indent=2, default=str)
        report["report_path"] = path


def _summary_lines(report: dict) -> list[str]:
    lines = [f"metalog spark {report['command']}: {report['result']}"]
    if "cluster_id" in report:
        lines.append(f"  cluster {report['cluster_id']!r}, {len(report.get('replicas', {}))} replica(s), "
                     f"HW {report.get('hw')} ({report.get('hw_source', '-')}), "
                     f"majority agrees up to {report.get('majority_end_offset')}")
    for name, a in sorted(report.get("audit", {}).items()):
        where = ("" if a.get("first_diff_offset") is None else
                 f" at offset {a['first_diff_offset']} epoch {a.get('first_diff_epoch')}")
        lines.append(f"  replica {name} (node {a.get('node_id')}): {a['status']}{where}")
    for e in report.get("errors", [])[:10]:
        where = "/".join(str(e[k]) for k in ("replica", "file") if e.get(k) is not None)
        if e.get("position") is not None:
            where += f" at byte {e['position']}"
        if e.get("offset") is not None:
            where += f" offset {e['offset']}"
        lines.append(f"  error: {where + ': ' if where else ''}{e['error']}")
    if len(report.get("errors", [])) > 10:
        lines.append(f"  ... {len(report['errors']) - 10} more error(s) in the report")
    if "snapshot" in report:
        s = report["snapshot"]
        lines.append(f"  wrote {s['path']} ({s['records']} records, {s['bytes']} bytes) from "
                     f"{report['replay']['records']} log records of {report['replay']['source']}")
    for c in report.get("comparisons", []):
        lines.append(f"  vs broker snapshot {c['snapshot']}: "
                     + ("equal" if c["equal"] else f"{c['differing_entities']} entity(ies) differ"))
        for d in c["differences"][:5]:
            lines.append(f"    {d['entity']}: rebuilt {d['rebuilt']} / broker {d['broker']}")
    if report.get("report_path"):
        lines.append(f"  report: {report['report_path']}")
    return lines


def run(args) -> int:
    """Both commands; returns the exit code and prints the summary."""
    started = time.monotonic()
    report: dict = {"command": args.spark_command, "inputs": args.inputs, "result": "running"}
    code = EXIT_OK
    spark = progress = None
    try:
        try:
            spark = get_spark(args.master, ui=args.ui, shuffle_partitions=args.shuffle_partitions,
                              driver_memory=args.driver_memory)
        except Exception as exc:  # no Java, bad master URL ...
            raise InputError(f"cannot start Spark ({args.master}): {str(exc).splitlines()[0]}") from None
        progress = Progress(spark, enabled=not args.quiet).start()
        an = Analysis(spark, args.inputs, progress, report, cluster_id=args.cluster_id)
        an.load()
        an.vote(args.upto)
        failed = bool(an.errors) or an.breach
        if args.spark_command == "snapshot":
            code = _snapshot(args, an, report, progress)
        if failed:
            code = EXIT_VALIDATION
        report["result"] = {EXIT_OK: "ok", EXIT_VALIDATION: "validation FAILED"}.get(code, "error")
    except InputError as exc:
        report["result"] = "bad input"
        report.setdefault("errors", []).append({"error": str(exc)})
        print(f"metalog spark: {exc}", file=sys.stderr)
        code = EXIT_INPUT
    except Exception as exc:  # a bug or an environment failure: still a report and a clear line
        import traceback

        traceback.print_exc()
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        report["result"] = "job failed"
        report.setdefault("errors", []).append({"error": f"{type(exc).__name__}: {first}"})
        print(f"metalog spark: the job failed: {type(exc).__name__}: {first}", file=sys.stderr)
        code = EXIT_FAILED
    finally:
        if progress is not None:
            progress.set_phase("done")
            progress.stop()
        if spark is not None and not args.keep_session:
            spark.stop()
    _finish(report, args, started)
    print("\n".join(_summary_lines(report)))
    return code


def _snapshot(args, an: Analysis, report: dict, progress: Progress) -> int:
    from protocol.messages import SnapshotId
    from storage.snapshot import SnapshotWriter, snapshot_filename

    target = an.hw
    if target > an.derived_hw:
        raise InputError(f"--upto {target} is past the offsets a majority of the replicas agree on "
                         f"(up to {an.derived_hw})")
    if target <= an.start and not an.snapshots:
        raise InputError(f"nothing to replay: the committed prefix [{an.start}, {target}) is empty")
    compare = sorted({s["end_offset"] for s in an.snapshots if an.start <= s["end_offset"] <= target})
    compare = compare[-SNAPSHOTS_COMPARED_MAX:]
    replay = Replay(an, target, progress)
    t0 = time.monotonic()
    replay.run(compare + [target])
    epoch, ts = _epoch_and_ts_at(an, target - 1)
    sid = SnapshotId(target, epoch)
    os.makedirs(args.out, exist_ok=True)
    final = os.path.join(args.out, snapshot_filename(sid))
    if os.path.exists(final):
        os.unlink(final)  # a rerun replaces its own output
    progress.set_phase(f"writing {snapshot_filename(sid)}")
    writer = SnapshotWriter(args.out, sid, ts, an.cluster_id or "")
    path, size, count = writer.write_all(replay.state_rows(target))
    elapsed = time.monotonic() - t0
    report["replay"] = {"source": replay.source, "records": replay.records_replayed,
                        "invalid_records": replay.invalid, "start_offset": an.start,
                        "base_snapshot": replay.base and replay.base["file"],
                        "side_table_rows": replay.side_rows, "seconds": round(elapsed, 2),
                        "records_per_s": round(replay.records_replayed / elapsed) if elapsed else None}
    report["snapshot"] = {"path": path, "end_offset": sid.end_offset, "epoch": sid.epoch,
                          "records": count, "bytes": size}
    progress.set_phase("comparing with the brokers' snapshots")
    comparisons = [replay.compare(s) for s in an.snapshots if s["end_offset"] in compare]
    report["comparisons"] = comparisons
    return EXIT_OK if all(c["equal"] for c in comparisons) else EXIT_VALIDATION


# ------------------------------------------------------------------ CLI


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", help="broker data dirs (or copies; any Hadoop path)")
    p.add_argument("--master", default="local[*]", help="Spark master URL (default local[*])")
    p.add_argument("--report", help="where the JSON report goes (default OUT/report.json)")
    p.add_argument("--cluster-id", help="expected cluster id (default: from meta.properties)")
    p.add_argument("--shuffle-partitions", type=int, default=8)
    p.add_argument("--driver-memory", default="4g",
                   help="JVM heap of the driver (in local mode the executors' too); default 4g")
    p.add_argument("--ui", action="store_true", help="enable the Spark UI")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=run, keep_session=False)


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("spark", help="offline Spark job: rebuild snapshots, audit replicas")
    sub = p.add_subparsers(dest="spark_command", required=True)
    s = sub.add_parser("snapshot", help="replay the committed log into a .checkpoint and validate it")
    _add_common(s)
    s.add_argument("--upto", type=int, help="end offset of the snapshot (default: the majority HW)")
    s.add_argument("--out", default="spark-out", help="output dir for the .checkpoint and report")
    a = sub.add_parser("audit", help="compare all replicas' logs with the majority")
    _add_common(a)
    a.add_argument("--hw", dest="upto", type=int, help="the HW to judge against (default: majority)")
    a.add_argument("--out", default=None, help="dir for report.json (default: none; see --report)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spark_job.py")
    register_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["spark"] + list(sys.argv[1:] if argv is None else argv))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
