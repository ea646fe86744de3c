"""Offline Spark job over metalog data dirs: rebuild and validate controller
snapshots (``snapshot``) and audit the replicas' logs (``audit``).

    metalog spark snapshot DATA_DIR... [--upto OFFSET] [--out DIR] [--master URL]
    metalog spark audit    DATA_DIR... [--hw OFFSET]
    metalog spark package  [--out metalog_code.zip]
    metalog spark sql      "SELECT ..." [--out DIR] [--json]
    spark-submit tools/spark/job.py snapshot DATA_DIR ...

Plan (details in docs/spark.md):

1. Spark's binaryFile source lists ``*.log``, ``*.checkpoint``,
   ``meta.properties``, ``log-start-offset`` and ``quorum-state`` under every input (recursive,
   any Hadoop path). ``mapInArrow`` decodes each file inside the executors
   with the broker's own decoders (``metalog.tools.spark.decode``): one row per
   record, plus small per-file summaries and error rows -- only those small
   rows reach the driver.
2. Every batch is validated (CRC, contiguous offsets, non-decreasing epochs)
   inside its file; the driver checks continuity across segments.
3. Votes: for each offset, the (epoch, value digest) held by a strict majority
   of the voters covering it, and by a majority of all voters given
   (a replica whose log starts later has snapshotted the offset away and
   abstains in favour). The voters are the ``currentVoters`` of the newest
   ``quorum-state`` (highest leader epoch); observers are audited but do
   not vote (they copy the leader's uncommitted tail). **HW** = the first offset from the earliest log start
   with no such majority, unless ``--upto/--hw`` names one. Per replica: the
   first offset where it differs from the majority, and on which side of the
   HW it lies.
4. Replay (``metalog.tools.spark.fold``): committed data records keyed by entity,
   hash-partitioned and sorted by key in one shuffle, each partition's runs
   of one key folded by one ``mapInArrow`` call; topic lifecycle and broker status
   timelines are small side tables broadcast to the partition/config folds.
5. The state at the HW is streamed to the driver in ``to_records()`` order and
   written with ``metalog.storage.snapshot.SnapshotWriter``: the broker's format and
   name. States at the offsets of the brokers' own snapshots are compared
   with those snapshots entity by entity (a distributed outer join).

6. Queryable output (``metalog.tools.spark.tables``, ``metalog.tools.spark.plots``): Parquet
   tables of the state at the HW, the committed history and the audit under
   ``OUT/tables``, plots and ``report.html``; ``metalog spark sql`` queries them.

With one replica (``snapshot``), steps 1 and 4 fuse: the decode keys and
combines the records itself (``decode.Fused``), so the cache holds the
combined rows, not one row per record; the files are decoded again on the
general path above if they turn out damaged or not this cluster's voter
(``report.read.path``).

Under spark-submit the session takes spark-submit's master and conf; run
directly, the job starts the JVM itself (PYSPARK_SUBMIT_ARGS). The
.checkpoint is staged and published only when every check passed.

Exit codes: 0 valid, 1 validation failed (corruption, divergence, safety
violation, configuration; the first failing check on stderr), 2 usage or
unusable input, 3 environment (no pyspark, no Java, Spark failed).
"""

from __future__ import annotations

import argparse
import json
import logging
import importlib
import os
import re
import shlex
import shutil
import struct
import sys
import tempfile
import threading
import time
import traceback
import warnings as pywarnings
import zipfile
from collections import Counter

if __package__ in (None, ""):  # spark-submit tools/spark/job.py: make the repo importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from metalog.protocol.invariants import InvariantViolation  # noqa: E402
from metalog.protocol.messages import SnapshotId  # noqa: E402
from metalog.storage import control_records as cr  # noqa: E402
from metalog.storage import metadata_records  # noqa: E402
from metalog.storage.atomic import fsync_dir  # noqa: E402
from metalog.storage.errors import QuorumStateError  # noqa: E402
from metalog.storage.quorum_state import QuorumStateFile  # noqa: E402
from metalog.storage.snapshot import SnapshotWriter, parse_snapshot_filename, snapshot_filename  # noqa: E402
from metalog.tools.extras import SPARK_MODULES, missing  # noqa: E402
from metalog.tools.spark import decode as D  # noqa: E402
from metalog.tools.spark import fold as F  # noqa: E402
from metalog.tools.spark.decode import DECODED_FIELDS, FIELD_NAMES, decode_file_columns  # noqa: E402
from metalog.tools.spark.fold import key_of  # noqa: E402

# pyspark and pyarrow are imported inside the functions that use them: they are
# the optional [spark] extra, and they cost ~0.8 s of start-up that every
# `metalog` command would pay (the CLI imports this module for `metalog spark`).

EXIT_OK, EXIT_VALIDATION, EXIT_INPUT, EXIT_FAILED = 0, 1, 2, 3
GLOB = "{*.log,*.checkpoint,meta.properties,log-start-offset,quorum-state}"
SNAPSHOTS_COMPARED_MAX = 8
DIFFS_LISTED_MAX = 50
ARROW_ROWS_PER_BATCH = 32768


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


def _make_decode_fn(fused: D.Fused | None = None):
    """mapInArrow body: binaryFile rows in, DECODED_FIELDS rows out (with
    `fused`, a segment's data records keyed and combined: decode.Fused)."""

    def fn(batches):
        import pyarrow as pa

        schema = _arrow_schema(DECODED_FIELDS)
        cols: dict[str, list] = {n: [] for n in FIELD_NAMES}
        for rb in batches:
            paths = rb.column("path").to_pylist()
            contents = rb.column("content")
            for i, path in enumerate(paths):
                for count in decode_file_columns(path, contents[i].as_py(), cols, fused):
                    if count >= ARROW_ROWS_PER_BATCH:
                        yield pa.RecordBatch.from_pydict(cols, schema=schema)  # copies: then reuse the lists
                        for column in cols.values():  # in place: decode_file_columns holds this dict
                            column.clear()
        if cols["kind"]:
            yield pa.RecordBatch.from_pydict(cols, schema=schema)

    return fn


_decode_partition = _make_decode_fn()  # the general path's decode


KEYED_FIELDS = [("offset", "long"), ("kind", "string"), ("key", "string"), ("value", "binary"), ("n", "long")]


def _make_key_fn(cuts: list[int], combine: bool):
    """mapInArrow body: (offset, value, file) rows in each file's order ->
    KEYED_FIELDS rows, the superseded config writes dropped before the
    shuffle (fold.Combiner; combine=False keys every record)."""

    def fn(batches):
        import pyarrow as pa

        schema = _arrow_schema(KEYED_FIELDS)
        combiner = F.Combiner(cuts, combine)
        out: list[F.KeyedRow] = []
        for rb in batches:
            combiner.feed_columns(rb.column("offset").to_pylist(), rb.column("value").to_pylist(),
                                  rb.column("file").to_pylist(), out)
            if len(out) >= ARROW_ROWS_PER_BATCH:
                yield pa.RecordBatch.from_arrays([pa.array(c) for c in zip(*out)], schema=schema)
                out = []
        out.extend(combiner.flush())
        if out:
            yield pa.RecordBatch.from_arrays([pa.array(c) for c in zip(*out)], schema=schema)

    return fn


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


def _fold_group(kind: str, key: str, recs: list, cuts, tables) -> list[dict]:
    """FOLD_FIELDS rows of one key's fold; tables is None for the first stage
    (topics, brokers) and the (topic, broker) side tables after."""
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
        topics, brokers = tables
        states, invalid = F.fold_partition(key, recs, cuts, topics, brokers)
    elif kind == F.K_CONFIG:
        topics, _ = tables
        states, invalid = F.fold_config(key, recs, cuts, topics)
    elif kind == F.K_FEATURE:
        states, invalid = F.fold_feature(key, recs, cuts)
    elif kind == F.K_ACL:
        states, invalid = F.fold_acl(key, recs, cuts)
    elif kind == F.K_PRODUCER_IDS:
        states, invalid, valid = F.fold_producer_ids(recs, cuts)
        if valid:  # a Kafka type kept whole: listed by type too, as the controller counts it
            out.append({"rowtype": "unknown", "name": "ProducerIds", "invalid": valid})
    else:  # undecodable (X) records are invalid; NoOps (N) change nothing
        states, invalid = [], len(recs) if kind == F.K_INVALID else 0
        if kind == F.K_DATA:  # produced records: counted, not invalid
            out.append({"rowtype": "data", "invalid": len(recs)})
        elif kind == F.K_UNKNOWN:  # a Kafka type we do not model: counted by type, in the report
            out.append({"rowtype": "unknown", "name": key, "invalid": len(recs)})
    out += _state_dicts(states)
    if invalid:
        out.append({"rowtype": "invalid", "invalid": invalid})
    return out


FOLD_ROWS_PER_BATCH = 8192


def _make_fold_fn(cuts, tables_bc):
    """mapInArrow body over one shuffle partition of keyed records sorted by
    (kind, key, offset): each run of one key is folded as it ends, so a task
    is one Python call however many keys it holds (a grouped applyInArrow
    pays a call, an Arrow stream and an output table per key: ~11k keys per
    million records on the bench log)."""

    def fn(batches):
        tables = None if tables_bc is None else tables_bc.value
        out: list[dict] = []
        cur_kind = cur_key = None
        recs: list = []
        folded: set[tuple[str, str]] = set()  # keys whose run has ended
        for rb in batches:
            kinds = rb.column("kind").to_pylist()
            keys = rb.column("key").to_pylist()
            offsets = rb.column("offset").to_pylist()
            values = rb.column("value").to_pylist()
            weights = rb.column("n").to_pylist()
            for kind, key, offset, value, n in zip(kinds, keys, offsets, values, weights):
                if key != cur_key or kind != cur_kind:
                    if recs:
                        out += _fold_group(cur_kind, cur_key, recs, cuts, tables)
                        folded.add((cur_kind, cur_key))
                        recs = []
                    # A key folded twice would emit two partial states for one entity.
                    if (kind, key) in folded:
                        raise InvariantViolation(f"key {kind}/{key!r} not contiguous in its partition")
                    cur_kind, cur_key = kind, key
                recs.append((offset, value, n) if kind == F.K_CONFIG else (offset, value))
            if len(out) >= FOLD_ROWS_PER_BATCH:
                yield from _fold_table(out).to_batches()
                out = []
        if recs:
            out += _fold_group(cur_kind, cur_key, recs, cuts, tables)
        if out:
            yield from _fold_table(out).to_batches()

    return fn


def _fold_stage(keyed, cuts, tables_bc):
    """keyed records, hash-partitioned by (kind, key) and sorted by (kind, key,
    offset) inside each partition -> FOLD_FIELDS rows (_make_fold_fn)."""
    return keyed.mapInArrow(_make_fold_fn(cuts, tables_bc), _schema(FOLD_FIELDS))


_jvm_stderr = None  # the JVM's System.err under spark-submit (see err_line)


def err_line(text: str) -> None:
    """One line for the user's stderr. Under spark-submit the Python driver's
    stderr is merged into spark-submit's stdout, so the line goes through the
    JVM's System.err (spark-submit's real stderr) instead."""
    sink = _jvm_stderr
    if sink is not None:
        try:
            sink.println(text)
            sink.flush()
            return
        except Exception as exc:  # the gateway is gone (JVM stopping): fall back, say why
            text = f"{text}  [via Python stderr: {type(exc).__name__}]"
    print(text, file=sys.stderr, flush=True)


def _reset_stderr() -> None:
    global _jvm_stderr
    _jvm_stderr = None


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
            err_line(line)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._print()

    def stop(self) -> None:
        self._stop.set()


CODE_PACKAGES = ("storage", "broker", "protocol", "tools")
LOG4J2_CONF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "log4j2.properties")


def build_package(path: str) -> str:
    """The packages executors import, zipped (for --py-files) as the installed
    namespace lays them out (metalog/<package>/..., `metalog` a namespace
    package, so an executor's own install and the zip can both hold parts of
    it; the zip comes first on the executor's path); returns the path."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        # zipimport sees a namespace package only by its directory entry
        z.writestr(zipfile.ZipInfo("metalog/"), b"")
        for pkg in CODE_PACKAGES:
            src = importlib.import_module(f"metalog.{pkg}").__path__[0]
            for dirpath, _dirs, files in os.walk(src):
                for f in sorted(files):
                    if f.endswith(".py"):
                        full = os.path.join(dirpath, f)
                        z.write(full, os.path.join("metalog", pkg, os.path.relpath(full, src)))
    return path


def under_spark_submit() -> bool:
    """spark-submit starts the JVM first and hands the Python driver its
    gateway; then spark-submit's --master/--conf are already in force."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def _submit_args(driver_memory: str, conf: dict, quiet_log: bool = True) -> str:
    """PYSPARK_SUBMIT_ARGS for a JVM the job starts itself: settings that only
    take effect when the JVM starts (heap, log4j2 file) must be given here.
    Without quiet_log (--verbose) Spark keeps its own log4j2 defaults, which
    for a PySpark driver show warnings."""
    parts = ["--driver-memory", driver_memory]
    if quiet_log:
        parts += ["--driver-java-options", f"-Dlog4j.configurationFile=file:{LOG4J2_CONF}"]
    for k, v in conf.items():
        parts += ["--conf", f"{k}={v}"]
    return " ".join(shlex.quote(x) for x in parts) + " pyspark-shell"


def quiet_python_warnings() -> None:
    """Hide PySpark's FutureWarning about the installed pandas version (the job
    uses Arrow, not pandas): printed on every run it is noise on stderr, and
    under spark-submit, where the Python driver's stderr is merged into
    spark-submit's stdout, it lands before the summary. --verbose keeps it."""
    pywarnings.filterwarnings("ignore", message=r"PySpark does not yet fully support pandas",
                              category=FutureWarning)


class SparkSetup:
    """How the session was made, and the temp files to remove afterwards."""

    def __init__(self) -> None:
        self.submitted = under_spark_submit()
        self.temp_dirs: list[str] = []
        self.session = None  # the SparkSession once made

    def cleanup(self) -> None:
        for d in self.temp_dirs:
            shutil.rmtree(d, ignore_errors=True)
        self.temp_dirs.clear()


def get_spark(master: str | None = None, ui: bool = False, shuffle_partitions: int = 8,
              ship_code: bool | None = None, extra_conf: dict | None = None, driver_memory: str = "4g",
              setup: SparkSetup | None = None, quiet_log: bool = True):
    """A SparkSession for the job.

    Under spark-submit the session takes spark-submit's master and conf
    (never overridden); `master`, `driver_memory` and the log4j2 file then
    belong on the spark-submit line. Run directly, the job starts the JVM
    itself with them (PYSPARK_SUBMIT_ARGS) on `master` (default local[*]);
    a non-local master gets the code shipped as a zip, removed by
    setup.cleanup()."""
    setup = setup or SparkSetup()
    extra_conf = dict(extra_conf or {})
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("metalog-spark")
    if not setup.submitted:
        master = master or "local[*]"
        builder = builder.master(master)
        os.environ.setdefault("PYSPARK_SUBMIT_ARGS", _submit_args(driver_memory, extra_conf, quiet_log))
    defaults = {"spark.ui.enabled": "true" if ui else "false",
                "spark.ui.showConsoleProgress": "false",
                "spark.sql.shuffle.partitions": str(shuffle_partitions),
                "spark.sql.execution.arrow.pyspark.enabled": "true",
                "spark.sql.adaptive.enabled": "true",
                # One segment (<= 64 MiB by default) per input split: bounds a task's memory.
                "spark.sql.files.maxPartitionBytes": str(64 << 20)}
    for k, v in {**defaults, **extra_conf}.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    if setup.submitted:
        master = spark.sparkContext.master
    if ship_code if ship_code is not None else not (setup.submitted or master.startswith("local")):
        tmp = tempfile.mkdtemp(prefix="metalog-spark-")
        setup.temp_dirs.append(tmp)
        spark.sparkContext.addPyFile(build_package(os.path.join(tmp, "metalog_code.zip")))
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


def discover(spark, inputs: list[str], skipped: list[str] | None = None) -> list[str]:
    """Directories under the inputs that hold metadata log files, found with
    the Hadoop FileSystem API (so any Hadoop path works). Spark's own recursive
    listing skips names starting with '_' -- and every log lives in
    ``__cluster_metadata-0`` -- so the job passes these directories explicitly.

    Beside a ``__cluster_metadata-0`` only that one is read: a Kafka broker's
    log dir also holds its topics' partitions (``orders-0``, ...), whose
    segments are no replica of the metadata log (read as one, the audit called
    them a second leader at offset 0). Those dirs go to `skipped`."""
    jvm = spark.sparkContext._jvm
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    wanted = re.compile(r".*\.(log|checkpoint)|meta\.properties|log-start-offset|quorum-state")
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
            entries = list(fs.listStatus(d))
            seen += len(entries)
            if seen > DISCOVERY_ENTRIES_MAX:
                raise InputError(f"more than {DISCOVERY_ENTRIES_MAX} entries under the inputs: "
                                 "point the job at the broker data dirs")
            metadata_only = any(st.isDirectory() and st.getPath().getName() == D.PARTITION_DIR for st in entries)
            for st in entries:
                name = st.getPath().getName()
                if st.isDirectory():
                    if metadata_only and name != D.PARTITION_DIR:
                        if skipped is not None and not name.startswith("."):
                            skipped.append(st.getPath().toString())
                    elif depth < DISCOVERY_DEPTH_MAX and not name.startswith("."):
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

    def load(self, upto: int | None = None, fuse: bool = False) -> None:
        """Lists, decodes and summarizes the inputs. With `fuse` (a snapshot
        run) and one replica in the listing, the decode keys and combines the
        data records itself (decode.Fused), so only the combined rows are
        cached; if the files then show that the fused path's assumptions do
        not hold (damage, another cluster, an observer), they are decoded
        again on the general path (`report.read.path` and `path_why` say which ran)."""
        from pyspark import StorageLevel
        from pyspark.errors import AnalysisException

        self.progress.set_phase("listing input directories")
        skipped: list[str] = []
        dirs = discover(self.spark, self.inputs, skipped)
        self.report["skipped_dirs"] = sorted(skipped)[:DIFFS_LISTED_MAX]
        self.progress.set_phase("decoding files")
        try:
            self.files = (self.spark.read.format("binaryFile").option("pathGlobFilter", GLOB)
                          .load(dirs))
        except AnalysisException as exc:
            raise InputError(f"cannot read the inputs: {str(exc).splitlines()[0]}") from None
        self.fused, why = _fused_plan(self.spark, dirs, upto) if fuse else (None, "not a snapshot run")
        self.decoded = self.files.mapInArrow(_make_decode_fn(self.fused), _schema(D.DECODED_FIELDS))
        self.decoded.persist(StorageLevel.MEMORY_AND_DISK)
        t0 = time.monotonic()
        self._collect_small()
        if self.fused is not None:
            why = self._fused_unfit()
            if why is not None:  # the general path: decoded again, each record a cached row
                self.decoded.unpersist()
                self.fused = None
                self.decoded = self.files.mapInArrow(_decode_partition, _schema(D.DECODED_FIELDS))
                self.decoded.persist(StorageLevel.MEMORY_AND_DISK)
            else:
                why = f"one clean replica; cut at {list(self.fused.cuts)} and its log end"
        segs = [sg for rp in self.replicas.values() for sg in rp["segments"]]
        records = sum(sg["records"] for sg in segs)
        batches = sum(sg.get("batches", 0) for sg in segs)
        elapsed = max(time.monotonic() - t0, 1e-6)
        self.report["read"] = {"files": len(segs), "batches": batches, "records": records,
                               "seconds": round(elapsed, 2), "records_per_s": round(records / elapsed),
                               "path": "general" if self.fused is None else "fused", "path_why": why}
        lap(self.report, "read_decode", t0)
        self.progress.set_phase(f"read {records} records in {batches} batches from {len(segs)} "
                                f"segment(s) of {len(self.replicas)} replica(s), "
                                f"{records / elapsed:,.0f} records/s")

    def _collect_small(self) -> None:
        """The small rows (file summaries, errors, meta files, snapshots,
        marks) and the KIP-853 voter sets in the logs (VotersRecord control
        records: a few per voter change, for a quorum-state that lists no
        voters, Kafka 4.x's) in one scan of the cache (a scan of 10M cached
        rows costs the JVM seconds); then _summarize."""
        from pyspark.sql import functions as f

        voters_type = bytearray(struct.pack(">hh", cr.KEY_VERSION, cr.KRAFT_VOTERS))  # the record key
        is_voters = ((f.col("kind") == "rec") & f.col("control")
                     & (f.substring("value", 1, 4) == f.lit(voters_type)))
        rows = self.decoded.filter(~f.col("kind").isin("rec", "snaprec", "krec") | is_voters).collect()
        small = [row for row in rows if row["kind"] not in ("rec", "mark")]
        self.log_voter_rows = [row for row in rows if row["kind"] == "rec"]
        # fused path: (epoch, batch timestamp) at the offsets the checkpoint may end before
        self.marks = {row["offset"]: (row["epoch"], row["ts"]) for row in rows if row["kind"] == "mark"}
        self._summarize(small)

    def _fused_unfit(self) -> str | None:
        """Why the fused decode's output cannot stand for the log, or None: it
        assumes one voting replica whose files are clean (so its whole valid
        log is the committed prefix and every record is read in file order)."""
        if len(self.replicas) != 1:
            return f"{len(self.replicas)} replicas"
        if self.errors:
            return f"{len(self.errors)} error(s) in the files (e.g. {self.errors[0]['error'][:80]})"
        [(name, rp)] = self.replicas.items()
        if name in self.excluded or name in self.observers:
            return "the replica is not a voter of this cluster"
        if rp["log_start"] is None:
            return "no log segments"
        return None

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
                # A stray .log/.checkpoint name is a setup problem, not damaged bytes.
                cat = "configuration" if "is not a segment or snapshot file" in d["info"] else "corruption"
                errors.append({"category": cat, "replica": d["replica"], "file": d["file"],
                               "position": d["position"], "offset": d["offset"], "epoch": d["epoch"],
                               "error": d["info"]})
            elif d["kind"] == "meta":
                if d["file"] == "meta.properties":
                    rp["props"] = _parse_props(d["info"])
                elif d["file"] == "quorum-state":
                    path = f"{d['replica']}/{D.PARTITION_DIR}/quorum-state"
                    try:
                        rp["quorum_state"] = QuorumStateFile(path).decode(d["info"])
                    except QuorumStateError as exc:
                        rp["quorum_state_error"] = str(exc)
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
        # Cluster ids: replicas of another cluster are excluded from the vote.
        warnings: list[dict] = []
        ids = [p["props"].get("cluster.id") for p in self.replicas.values()]
        ids = [i for i in ids if i]
        if self.cluster_id is None and ids:
            ranked = Counter(ids).most_common()
            if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
                raise InputError(f"replicas from different clusters and no majority among them: "
                                 f"{sorted(set(ids))}; name the cluster with --cluster-id")
            self.cluster_id = ranked[0][0]
        self.cluster_id = self.cluster_id or ""
        foreign = {name for name, rp in self.replicas.items()
                   if self.cluster_id and rp["props"].get("cluster.id")
                   and rp["props"]["cluster.id"] != self.cluster_id}
        for name in sorted(foreign):
            cid = self.replicas[name]["props"]["cluster.id"]
            warnings.append({"category": "configuration", "replica": name, "file": "meta.properties",
                             "warning": f"replica belongs to cluster {cid!r}, not {self.cluster_id!r}: "
                                        "excluded from the vote"})
        self.excluded = foreign
        for name, rp in sorted(self.replicas.items()):
            self._check_replica(name, rp, errors, warnings)
        self.snapshots_seen = snaps
        self.voters, self.observers = self._voter_set(foreign, warnings)
        # Damage in an excluded replica does not fail the job: it is not this cluster's.
        errors = [e for e in errors if e.get("replica") not in foreign]
        self.errors = errors
        self.warnings = warnings
        for w in warnings:
            err_line(f"metalog spark: warning: {w['replica']}/{w['file']}: {w['warning']}")
        self.snapshots = [s for s in snaps if not s.get("foreign") and s["replica"] not in foreign]
        rep["cluster_id"] = self.cluster_id
        rep["errors"] = errors
        rep["warnings"] = warnings
        rep["ignored_files"] = ignored[:DIFFS_LISTED_MAX]
        rep["replicas"] = {
            name: {"node_id": rp["node_id"], "log_start_offset": rp["log_start"],
                   "log_end_offset": rp["log_end"], "segments": len(rp["segments"]),
                   "records": sum(s["records"] for s in rp["segments"]),
                   "snapshots": [s["file"] for s in rp["snapshots"]]}
            for name, rp in sorted(self.replicas.items())}

    def _check_replica(self, name: str, rp: dict, errors: list[dict], warnings: list[dict]) -> None:
        """One replica's segments in order, checked for continuity across
        files; its log start and end; its snapshots of another cluster marked."""
        segs = sorted(rp["segments"], key=lambda s: s["base_offset"])
        rp["segments"] = segs
        rp["node_id"] = rp["props"].get("node.id")
        for prev, nxt in zip(segs, segs[1:]):
            if prev["end_offset"] != nxt["base_offset"]:
                errors.append({"category": "corruption", "replica": name, "file": nxt["file"],
                               "position": 0, "offset": nxt["base_offset"], "epoch": nxt["first_epoch"],
                               "error": f"segment starts at {nxt['base_offset']} but the previous "
                                        f"one ({prev['file']}) ends at {prev['end_offset']}"})
            if nxt["first_epoch"] >= 0 and nxt["first_epoch"] < prev["last_epoch"]:
                errors.append({"category": "corruption", "replica": name, "file": nxt["file"],
                               "position": 0, "offset": nxt["base_offset"], "epoch": nxt["first_epoch"],
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
                warnings.append({"category": "configuration", "replica": name, "file": s["file"],
                                 "warning": f"snapshot from another cluster: its header says cluster "
                                            f"{s['cluster_id']!r}, this cluster is {self.cluster_id!r}; "
                                            "not used"})

    def _voter_set(self, foreign: set[str], warnings: list[dict]) -> tuple[set[int] | None, set[str]]:
        """(voter ids, names of the replicas that are not voters). The voters are
        the currentVoters of the quorum-state with the highest leader epoch among
        this cluster's replicas (a dynamic quorum's set changes: the newest
        wins). Only voters set the HW in KRaft: an observer replicates the
        leader's log up to its end, uncommitted records included, so counting
        it could call a record committed that a new leader would truncate.
        Unknown voters (no readable quorum-state, or an empty list): every
        replica votes, with a warning."""
        states = []
        for name, rp in sorted(self.replicas.items()):
            if name in foreign:
                continue
            if rp.get("quorum_state_error"):
                warnings.append({"category": "configuration", "replica": name,
                                 "file": f"{D.PARTITION_DIR}/quorum-state",
                                 "warning": f"unreadable quorum-state, not used for the voter set: "
                                            f"{rp['quorum_state_error']}"})
            if rp.get("quorum_state") is not None:
                states.append(rp["quorum_state"])
        newest = max(states, key=lambda q: (q["leader_epoch"], bool(q["voters"])), default=None)
        if newest is not None and newest["voters"]:
            voters = set(newest["voters"])
            source = f"the quorum-state of leader epoch {newest['leader_epoch']}"
        else:
            # Kafka 4.x (KIP-853, quorum-state data_version 1) keeps the voter set in
            # the log and the snapshots only, as Kafka itself reads it.
            found = self._newest_voters_record(foreign)
            if found is None:
                warnings.append({"category": "configuration", "replica": "(all replicas)",
                                 "file": "quorum-state",
                                 "warning": "voters unknown (no replica has a readable quorum-state with a "
                                            "voter list, and no VotersRecord in the logs or snapshots): "
                                            "every replica given votes for the HW"})
                self.report["voters"] = None
                return None, set()
            voters, source = found
        self.report["voters"] = sorted(voters)
        self.report["voters_source"] = source
        observers = set()
        for name, rp in sorted(self.replicas.items()):
            if name in foreign:
                continue
            try:
                node = int(rp["props"].get("node.id"))
            except (TypeError, ValueError):
                node = None
            if node in voters:
                continue
            observers.add(name)
            who = f"node {node}" if node is not None else "replica without a node.id in meta.properties"
            warnings.append({"category": "configuration", "replica": name,
                             "file": f"{D.PARTITION_DIR}/quorum-state",
                             "warning": f"{who} is not a voter (voters {sorted(voters)}, from "
                                        f"{source}): audited but excluded from the HW vote"})
        return voters, observers

    def _newest_voters_record(self, foreign: set[str]) -> tuple[set[int], str] | None:
        """(voter ids, where they come from) of the newest KIP-853 voter set
        among this cluster's replicas: the VotersRecord at the highest log
        offset, or a snapshot's set if a snapshot ends past it (a snapshot
        carries the set in force at its end offset). Kafka reads the latest
        set in its log, committed or not, so this does too; replicas that
        disagree at one offset: the set most of them hold there."""
        at: dict[int, Counter] = {}
        for row in self.log_voter_rows:
            if row["replica"] not in foreign:
                at.setdefault(row["offset"], Counter())[bytes(row["value"])] += 1
        best: tuple[int, bytes, str] | None = None
        if at:
            offset = max(at)
            value = at[offset].most_common(1)[0][0]
            best = (offset + 1, value, f"the VotersRecord at offset {offset} of the log")
        for snap in self.snapshots_seen:
            if snap["replica"] in foreign or snap.get("foreign") or not snap.get("voters"):
                continue
            if best is None or snap["end_offset"] > best[0]:
                best = (snap["end_offset"], bytes.fromhex(snap["voters"]),
                        f"the voter set of snapshot {snap['file']}")
        if best is None:
            return None
        try:
            rec = cr.decode_control(best[1])
        except cr.ControlRecordError:
            return None  # the audit names undecodable records; no voter set from one
        if not isinstance(rec, cr.VotersRecord):
            return None
        return {v.voter_id for v in rec.voters}, best[2]

    def vote(self, hw_override: int | None) -> None:
        """Majority per offset, the HW, and each replica's first difference."""
        from pyspark import StorageLevel
        from pyspark.sql import functions as f

        self.progress.set_phase("voting: majority value per offset")
        t0 = time.monotonic()
        # Audited: every replica of this cluster with a log. Voting: those
        # audited that are voters (observers are audited but do not vote).
        with_log = {k: v for k, v in self.replicas.items()
                    if v["log_start"] is not None and k not in self.excluded}
        if not with_log:
            raise InputError("no replica holds log segments: nothing to replay")
        voting = {k: v for k, v in with_log.items() if k not in self.observers}
        if not voting:
            raise InputError(f"none of the replicas given with log segments is a voter (voters "
                             f"{sorted(self.voters or [])}): give the voters' data dirs")
        n = len(voting)
        quorum = n // 2 + 1
        self.start = min(v["log_start"] for v in voting.values())
        recs = self.decoded.filter(f.col("kind") == "rec")
        if self.excluded:
            recs = recs.filter(~f.col("replica").isin(sorted(self.excluded)))
        for name, rp in with_log.items():
            # An observer's records below the voters' log start are not compared.
            start = max(rp["log_start"], self.start) if name in self.observers else rp["log_start"]
            if start > rp["segments"][0]["base_offset"]:
                recs = recs.filter(~((f.col("replica") == name) & (f.col("offset") < start)))
        self.recs = recs
        vrecs = recs.filter(~f.col("replica").isin(sorted(self.observers))) if self.observers else recs
        abstain = f.lit(0)
        for rp in voting.values():
            if rp["log_start"] > self.start:
                abstain = abstain + f.when(f.col("offset") < rp["log_start"], 1).otherwise(0)
        # One voting replica whose files are clean (offsets contiguous, so one record
        # per offset) and no observer: every record is the majority's and nothing
        # differs. The count shuffle and the two joins below would say the same at 10M-row cost.
        alone = n == 1 and len(with_log) == 1 and not any(e["replica"] in with_log for e in self.errors)
        if alone:
            # The fused path has no row per record: the marks give the epoch at the end.
            self.majority = None if self.fused is not None else recs.select("offset", "epoch", "digest", "ts")
        else:
            counts = (vrecs.groupBy("offset", "epoch", "digest")
                      .agg(f.count(f.lit(1)).alias("cnt"), f.max("ts").alias("ts"),
                           f.first("control").alias("control")))
            self.majority = (counts.withColumn("abstain", abstain)
                             .filter((f.col("cnt") * 2 > f.lit(n) - f.col("abstain"))
                                     & (f.col("cnt") + f.col("abstain") >= quorum))
                             .select("offset", "epoch", "digest", "ts"))
        if self.majority is not None:
            self.majority.persist(StorageLevel.MEMORY_AND_DISK)
        first_nonmajority = None
        if alone:  # clean files: its records are exactly [log start, log end)
            [only] = with_log.values()
            has_start = only["log_start"] < only["log_end"]
            first_gap = only["log_end"] if has_start else None
        else:
            moff = self.majority.select("offset")
            first_nonmajority = (vrecs.select("offset").distinct().join(moff, "offset", "left_anti")
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
        self.report["quorum"] = (f"{quorum} of {n} replicas" if self.voters is None
                                 else f"{quorum} of {n} voters given ({len(with_log) - n} observer(s) not voting)")

        # Per replica: first offset whose (epoch, digest) is not the majority's.
        self.progress.set_phase("voting: first difference per replica")
        mj = None if alone else self.majority.select("offset", f.col("epoch").alias("m_epoch"),
                                                     f.col("digest").alias("m_digest"))
        diffs = [] if alone else (recs.select("replica", "offset", "epoch", "digest").join(mj, "offset", "left")
                 .filter(f.col("m_digest").isNull() | (f.col("m_epoch") != f.col("epoch"))
                         | (f.col("m_digest") != f.col("digest")))
                 .groupBy("replica").agg(f.min(f.struct("offset", "epoch", "m_epoch")).alias("first"))
                 .collect())
        first_diff = {row["replica"]: (row["first"]["offset"], row["first"]["epoch"],
                                       _diff_kind(row["first"]["epoch"], row["first"]["m_epoch"]))
                      for row in diffs}
        for e in self.errors:  # a corrupt batch is a difference where it starts
            rname, off = e["replica"], e["offset"]
            if rname in with_log and off is not None:
                cur = first_diff.get(rname)
                if cur is None or off < cur[0]:
                    first_diff[rname] = (off, e["epoch"], "corruption: " + e["error"])
        audit = self._audit(with_log, voting, first_diff)
        self.first_diff = first_diff
        self.report["audit"] = audit
        self.report["vote"] = {"seconds": round(time.monotonic() - t0, 2)}
        lap(self.report, "vote", t0)

    def _audit(self, with_log: dict, voting: dict, first_diff: dict) -> dict[str, dict]:
        """Per replica: agrees, behind, or where it first differs and on which
        side of the HW (self.breach: some replica differs below it)."""
        audit: dict[str, dict] = {}
        self.breach = False
        for name, rp in sorted(with_log.items()):
            fd = first_diff.get(name)
            entry = {"node_id": rp["node_id"], "log_start_offset": rp["log_start"],
                     "log_end_offset": rp["log_end"], "in_vote": name in voting}
            if fd is None:
                entry.update(status="agrees", first_diff_offset=None)
                if rp["log_end"] < self.hw:
                    entry["status"] = "behind"
            else:
                below = fd[0] < self.hw
                # A corrupt batch at or above the HW is named as such (it fails the
                # job as an error either way), not passed off as an uncommitted tail.
                corrupt = fd[2].startswith("corruption: ")
                category = fd[2].split(":", 1)[0] if below or corrupt else "uncommitted tail"
                entry.update(first_diff_offset=fd[0], first_diff_epoch=fd[1], why=fd[2],
                             below_hw=below, category=category,
                             status=(f"{fd[2]} (below the HW {self.hw})" if below
                                     else f"{fd[2]} (at or above the HW {self.hw})" if corrupt
                                     else "uncommitted tail (differs at or above the HW)"))
                self.breach |= below
            audit[name] = entry
        return audit


FUSED_ENV = "METALOG_SPARK_FUSED"  # "0": always the general path (A/B in the benchmark, tests)


def _fused_plan(spark, dirs: list[str], upto: int | None) -> tuple[D.Fused | None, str]:
    """The fused decode's cuts when the listing shows one replica: the end
    offset of every snapshot file in its dirs (a superset of the cuts the
    replay will ask for) and `upto`; the log end needs no cut (no record
    lies past it). (None, why) otherwise."""
    if os.environ.get(FUSED_ENV, "1") == "0":
        return None, f"{FUSED_ENV}=0"
    replicas = {D.split_path(d.rstrip("/") + "/x")[0] for d in dirs}
    if len(replicas) != 1:
        return None, f"{len(replicas)} replicas"
    jvm = spark.sparkContext._jvm
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    cuts = set() if upto is None else {upto}
    for d in dirs:
        path = jvm.org.apache.hadoop.fs.Path(d)
        for st in path.getFileSystem(conf).listStatus(path):
            sid = parse_snapshot_filename(st.getPath().getName())
            if sid is not None:
                cuts.add(sid.end_offset)
    ordered = sorted(cuts)
    return D.Fused(ordered, [c - 1 for c in ordered if c > 0]), ""


def lap(report: dict, stage: str, since: float) -> float:
    """Seconds since `since` as report["stages_s"][stage] (the bench prints
    them); returns now, the start of the next stage."""
    now = time.monotonic()
    report.setdefault("stages_s", {})[stage] = round(now - since, 2)
    return now


def _diff_kind(epoch: int, majority_epoch: int | None) -> str:
    """Why a replica's record differs from the majority's at one offset:
    the same epoch with other bytes means two leaders in one epoch; a later
    epoch means a leader overwrote a committed record (lost); an earlier
    epoch is a replica holding records a later leader replaced (divergence)."""
    if majority_epoch is None:
        return "divergence: no majority value at this offset"
    if epoch == majority_epoch:
        return f"safety violation: two leaders in epoch {epoch} (different records at one offset)"
    if epoch > majority_epoch:
        return (f"safety violation: committed record lost (the majority holds epoch "
                f"{majority_epoch}, this replica overwrote it in epoch {epoch})")
    return f"divergence: this replica holds epoch {epoch} where the majority holds epoch {majority_epoch}"


def _entity_name(sec: int, s1: str, n1: int, s2: str, s3: str) -> str:
    return {F.SEC_FEATURE: f"feature {s1}", F.SEC_BROKER: f"broker {n1}",
            F.SEC_TOPIC: f"topic {s1}", F.SEC_PARTITION: f"partition {s1}/{n1}",
            F.SEC_CONFIG: f"config ({n1}, {s2!r}, {s3!r})", F.SEC_ACL: f"acl {s1}",
            F.SEC_PRODUCER_IDS: "producer ids"}.get(sec, f"unknown record {s1}")


def _record_json(value: bytes | None):
    if value is None:
        return None
    try:
        return metadata_records.record_to_dict(metadata_records.decode_record(value))
    except metadata_records.MetadataRecordError as exc:
        return f"undecodable: {exc}"


# Kafka's ControlRecordType names (metalog.storage.control_records models 2-6;
# 0 and 1 end transactions, which a metadata log never holds).
CONTROL_TYPE_NAMES = {0: "Abort", 1: "Commit", cr.LEADER_CHANGE: "LeaderChange", cr.SNAPSHOT_HEADER: "SnapshotHeader",
                      cr.SNAPSHOT_FOOTER: "SnapshotFooter", cr.KRAFT_VERSION: "KRaftVersion",
                      cr.KRAFT_VOTERS: "KRaftVoters"}
MODELLED_CONTROL_TYPES = {"LeaderChange", "SnapshotHeader", "SnapshotFooter", "KRaftVersion", "KRaftVoters"}


# Kafka's metadata transactions (KIP-868): BeginTransaction 23, EndTransaction
# 24, AbortTransaction 25, by their frame prefix (frame version 1, api key).
BEGIN_TRANSACTION, END_TRANSACTION, ABORT_TRANSACTION = 23, 24, 25
TRANSACTION_PREFIXES = [bytearray((metadata_records.FRAME_VERSION, k))
                        for k in (BEGIN_TRANSACTION, END_TRANSACTION, ABORT_TRANSACTION)]


def metadata_transactions(rows) -> tuple[list[tuple[int, int]], int | None]:
    """(aborted offset ranges [begin, abort], the begin offset of a transaction
    still open at the end or None) from the transaction markers in offset
    order. Kafka drops an aborted transaction's records (a new leader aborts
    the one its predecessor left open); the markers themselves change no state."""
    aborted: list[tuple[int, int]] = []
    begun: int | None = None
    for row in rows:
        key = bytes(row["value"])[1]
        if key == BEGIN_TRANSACTION:
            begun = row["offset"]
        elif key == ABORT_TRANSACTION and begun is not None:
            aborted.append((begun, row["offset"]))
            begun = None
        elif key == END_TRANSACTION:
            begun = None
    return aborted, begun


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
        self.progress.set_phase("replay: keying, shuffling and sorting the committed records")
        start = self._start()
        src = self._source(start)
        self.source = src or "majority of replicas"
        rng = (f.col("offset") >= start) & (f.col("offset") < self.target)
        keyed = (self._keyed_fused(src, rng, cuts) if an.fused is not None
                 else self._keyed_general(src, rng, cuts))
        # One shuffle for both fold stages: keyed, hash-partitioned by key and
        # sorted by (kind, key, offset) once, cached; each stage filters its
        # kinds out of the cache (a filter keeps the order) and folds.
        partitions = int(spark.conf.get("spark.sql.shuffle.partitions"))
        keyed = keyed.repartition(partitions, "kind", "key").sortWithinPartitions("kind", "key", "offset")
        keyed.persist(StorageLevel.MEMORY_AND_DISK)
        report = an.report
        t = time.monotonic()
        self.records_replayed = int(keyed.agg(f.sum("n")).first()[0]) - len(F.seed_records())
        self.keyed_rows = keyed.count()  # cached by the sum: what the combine left to shuffle
        t = lap(report, "key_shuffle_sort", t)

        self.progress.set_phase("replay: topic directory and broker folds")
        stage_a = _fold_stage(keyed.filter(f.col("kind").isin(F.K_TOPICS, F.K_BROKER)), cuts, None)
        stage_a.persist(StorageLevel.MEMORY_AND_DISK)
        # One row per broker record (5% of the bench log: 500k rows at 10M): fetched
        # as Arrow columns, not as a Row object per row.
        side = (stage_a.filter(f.col("rowtype").isin("interval", "change"))
                .select("rowtype", "s1", "name", "offset", "a", "n1", "b1", "b2", "b3").toArrow())
        c = {n: side.column(n).to_pylist() for n in side.column_names}
        intervals = [F.TopicInterval(s1, name, offset, a) for rowtype, s1, name, offset, a in
                     zip(c["rowtype"], c["s1"], c["name"], c["offset"], c["a"]) if rowtype == "interval"]
        changes = [F.BrokerChange(n1, offset, b1, b2, b3) for rowtype, n1, offset, b1, b2, b3 in
                   zip(c["rowtype"], c["n1"], c["offset"], c["b1"], c["b2"], c["b3"]) if rowtype == "change"]
        tables = spark.sparkContext.broadcast((F.topic_table(intervals), F.broker_table(changes)))
        self.side_rows = side.num_rows
        t = lap(report, "fold_topics_brokers", t)

        self.progress.set_phase("replay: partition, config and feature folds")
        stage_b = _fold_stage(keyed.filter(~f.col("kind").isin(F.K_TOPICS, F.K_BROKER)), cuts, tables)
        out = stage_a.unionByName(stage_b)
        out.persist(StorageLevel.MEMORY_AND_DISK)
        agg = out.groupBy("rowtype").agg(f.count(f.lit(1)).alias("n"),
                                         f.sum("invalid").alias("invalid")).collect()
        self.invalid = int(sum(x["invalid"] or 0 for x in agg if x["rowtype"] == "invalid"))
        self.data_records = int(sum(x["invalid"] or 0 for x in agg if x["rowtype"] == "data"))
        self.unknown_records = {x["name"]: int(x["invalid"]) for x in
                                out.filter(f.col("rowtype") == "unknown").select("name", "invalid").collect()}
        self.states = out.filter(f.col("rowtype") == "state")
        self.control_records = self._control_counts()
        lap(report, "fold_partitions_configs", t)

    def _start(self) -> int:
        """The first offset replayed from the log: the log start, or the end
        of the snapshot the replay starts from (self.base) when the log was
        truncated under one."""
        an = self.an
        self.base = None
        if an.start == 0:
            return 0
        usable = sorted((s for s in an.snapshots if an.start <= s["end_offset"] <= self.target),
                        key=lambda s: s["end_offset"])
        if not usable:
            raise InputError(f"every log starts at offset {an.start} or later and no snapshot "
                             f"between {an.start} and {self.target} exists to start the replay from")
        self.base = usable[0]
        return self.base["end_offset"]

    def _source(self, start: int) -> str | None:
        """One replica that agrees with the majority over the whole range
        (it avoids a join), or None: the majority value per offset is taken."""
        an = self.an
        for name, rp in sorted(an.replicas.items(), key=lambda kv: kv[0]):
            fd = an.first_diff.get(name)
            if name in an.excluded:
                continue  # another cluster's replica: its records are not in an.recs
            if (rp["log_start"] is not None and rp["log_start"] <= start
                    and rp["log_end"] >= self.target and (fd is None or fd[0] >= self.target)):
                return name
        return None

    def _base_and_seed(self, schema):
        """(offset, value, file) rows replayed before the log: the base
        snapshot's records at offsets below the log's, and the seed (what a
        state holds before any record: metadata.version; folded like a
        record, not counted as one)."""
        from pyspark.sql import functions as f

        an = self.an
        rows = an.spark.createDataFrame([(o, v, "") for o, v in F.seed_records()], schema)
        if self.base is not None:
            b = self.base
            snap = an.decoded.filter((f.col("kind") == "snaprec") & (f.col("replica") == b["replica"])
                                     & (f.col("file") == b["file"]))
            rows = rows.unionByName(snap.select((f.col("position") - f.lit(b["records"] + 1)).alias("offset"),
                                                "value", "file"))
        return rows

    def _transactions(self, marker_rows) -> None:
        """KIP-868: the ranges of aborted metadata transactions (never applied)
        and a transaction still open at the end, from the marker records."""
        from pyspark.sql import functions as f

        self.aborted, self.open_transaction = metadata_transactions(
            marker_rows.filter(f.substring("value", 1, 2).isin(*TRANSACTION_PREFIXES))
            .select("offset", "value").orderBy("offset").collect())

    def _keyed_general(self, src: str | None, rng, cuts: list[int]):
        """KEYED_FIELDS rows of the committed range from the cached row per
        record: one source replica's, or the majority's (a join)."""
        from pyspark.sql import functions as f

        an = self.an
        if src is not None:
            committed = an.recs.filter((f.col("replica") == src) & rng)
        else:
            mj = an.majority.filter(rng).select("offset", "epoch", "digest")
            committed = an.recs.filter(rng).join(mj, ["offset", "epoch", "digest"]).dropDuplicates(["offset"])
        self.committed = committed  # control records too: the history table shows them
        self.committed_controls = committed
        data = committed.filter(~f.col("control")).select("offset", "value", "file")
        self._transactions(data)
        for lo, hi in self.aborted:
            data = data.filter(~f.col("offset").between(lo, hi))
        data = data.unionByName(self._base_and_seed(data.schema))
        # The combine needs each file's records in order in one task: so with one
        # source replica; the majority join's rows come in hash order.
        # METALOG_SPARK_COMBINE=0 keys every record (A/B of the combine in the benchmark).
        combine = src is not None and os.environ.get("METALOG_SPARK_COMBINE", "1") != "0"
        return data.mapInArrow(_make_key_fn(cuts, combine), _schema(KEYED_FIELDS))

    def _keyed_fused(self, src: str | None, rng, cuts: list[int]):
        """KEYED_FIELDS rows of the committed range on the fused path: the
        decode's keyed and combined rows (runs cut at every snapshot offset
        and --upto, so none spans a cut of this replay or the range's ends;
        none spans a transaction marker, so an aborted range drops whole)."""
        from pyspark.sql import functions as f

        an = self.an
        if src is None:
            raise InvariantViolation("fused path without a source replica")
        mine = (f.col("replica") == src) & rng
        self.committed_controls = an.recs.filter(mine)  # the decode's rec rows: control records
        # Every committed record for the history table, decoded again from the
        # files when (and only if) the tables are written: nothing caches it.
        full = an.files.mapInArrow(_decode_partition, _schema(D.DECODED_FIELDS))
        self.committed = full.filter((f.col("kind") == "rec") & mine)
        krecs = an.decoded.filter((f.col("kind") == "krec") & mine)
        self._transactions(krecs)
        for lo, hi in self.aborted:
            krecs = krecs.filter(~f.col("offset").between(lo, hi))
        extra = self._base_and_seed(_schema([("offset", "long"), ("value", "binary"), ("file", "string")]))
        return (krecs.select("offset", f.col("s1").alias("kind"), f.col("s2").alias("key"), "value",
                             f.col("n1").alias("n"))
                .unionByName(extra.mapInArrow(_make_key_fn(cuts, False), _schema(KEYED_FIELDS))))

    def _control_counts(self) -> dict[str, int]:
        """Committed control records by type name (the key's type field). They
        change no controller state; the voter sets among them go into the
        checkpoint (voters_at). A type this build does not know is named
        'control type N' so the report lists it instead of passing over it."""
        from pyspark.sql import functions as f

        rows = (self.committed_controls.filter(f.col("control"))
                .groupBy(f.substring("value", 1, 4).alias("key")).count().collect())
        out: dict[str, int] = {}
        for row in rows:
            key = bytes(row["key"])
            rtype = struct.unpack(">hh", key)[1] if len(key) == 4 else -1
            name = CONTROL_TYPE_NAMES.get(rtype, f"control type {rtype}")
            out[name] = out.get(name, 0) + int(row["count"])
        return dict(sorted(out.items()))

    def voters_at(self, cut: int) -> cr.VotersRecord | None:
        """The voter set at `cut` (KIP-853), for the checkpoint to carry as
        Kafka's snapshots do: the set of the latest snapshot at or below
        `cut`, then every KRaftVersionRecord / VotersRecord of the committed
        log from there; None unless kraft.version is 1 with a set (static
        voters: the brokers' config holds them). The replayed range starts at
        or after that snapshot's end (a truncated log starts from a snapshot),
        so no voter change is skipped."""
        from pyspark.sql import functions as f

        kraft_version, voters, since = 0, None, -1
        below = [s for s in self.an.snapshots if s["end_offset"] <= cut]
        if below:
            # Ties (the same end offset on several replicas): one that carries a set.
            latest = max(below, key=lambda s: (s["end_offset"], s.get("voters") is not None))
            since = latest["end_offset"]
            if latest.get("voters"):
                voters = cr.decode_control(bytes.fromhex(latest["voters"]))
                if not isinstance(voters, cr.VotersRecord):
                    raise InvariantViolation(f"snapshot voters are not a VotersRecord: {latest}")
                kraft_version = 1
        controls = (self.committed_controls.filter(f.col("control") & (f.col("offset") >= since)
                                          & (f.col("offset") < cut))
                    .select("offset", "value").orderBy("offset").collect())
        for row in controls:
            try:
                rec = cr.decode_control(bytes(row["value"]))
            except cr.ControlRecordError:
                continue  # the audit reports undecodable records; they change no voter set
            if isinstance(rec, cr.KRaftVersionRecord):
                kraft_version = rec.kraft_version
            elif isinstance(rec, cr.VotersRecord):
                voters = rec
        return voters if kraft_version >= 1 else None

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
        # ProducerIds is folded (next_producer_id) but not compared: a snapshot
        # names the broker that took the last block or -1 (Kafka, ours), so
        # its record is listed with the unmodelled types below.
        built = (self.states.filter((f.col("cut") == snap["end_offset"]) & (f.col("sec") != F.SEC_PRODUCER_IDS))
                 .select(*keys, f.col("value").alias("built")))
        recs = self.an.decoded.filter((f.col("kind") == "snaprec") & (f.col("replica") == snap["replica"])
                                      & (f.col("file") == snap["file"]))
        # Kafka types we do not model (e.g. ProducerIds in Kafka's snapshots):
        # the rebuilt state cannot hold them, so they are counted by type, not compared.
        unmodelled = {x["s1"]: int(x["count"]) for x in
                      recs.filter(f.col("sec") == F.SEC_UNMODELLED).groupBy("s1").count().collect()}
        theirs = (recs.filter(f.col("sec") != F.SEC_UNMODELLED)
                  .select(*keys, f.col("value").alias("broker")))
        # A snapshot without metadata.version (ours before it was written, a
        # bootstrap checkpoint) is at the level a cluster is born at: the
        # broker's loader reads it so (ControllerState starts there).
        mv = (f.col("sec") == F.SEC_FEATURE) & (f.col("s1") == metadata_records.METADATA_VERSION)
        if not theirs.filter(mv).limit(1).collect():
            (_, seed), = F.seed_records()
            born = [(F.SEC_FEATURE, metadata_records.METADATA_VERSION, 0, "", "", seed)]
            theirs = theirs.unionByName(self.an.spark.createDataFrame(born, theirs.schema))
        diff = (built.join(theirs, keys, "full_outer")
                .filter(~f.col("built").eqNullSafe(f.col("broker"))))
        n = diff.count()
        rows = diff.orderBy(*keys).limit(DIFFS_LISTED_MAX).collect()
        return {"snapshot": f"{snap['replica']}/{snap['file']}", "end_offset": snap["end_offset"],
                "equal": n == 0, "differing_entities": n,
                "unmodelled_records": dict(sorted(unmodelled.items())),
                "differences": [{"entity": _entity_name(x["sec"], x["s1"], x["n1"], x["s2"], x["s3"]),
                                 "rebuilt": _record_json(x["built"]),
                                 "broker": _record_json(x["broker"])} for x in rows]}


# ------------------------------------------------------------------ commands


def _epoch_and_ts_at(an: Analysis, offset: int) -> tuple[int, int]:
    from pyspark.sql import functions as f

    if offset < 0:
        return 0, 0
    if an.fused is not None:  # marked in the decode: each cut - 1 and each segment's last record
        if offset not in an.marks:
            if offset < an.start:  # below the log (the general path finds no majority row either)
                return 0, 0
            raise InvariantViolation(f"fused path: no mark at offset {offset} (marks {sorted(an.marks)[:8]})")
        epoch, ts = an.marks[offset]
        return int(epoch), int(ts or 0)
    row = an.majority.filter(f.col("offset") == offset).select("epoch", "ts").first()
    if row is None:
        return 0, 0
    return int(row["epoch"]), int(row["ts"] or 0)


def _finish(report: dict, args, started: float, spark=None) -> None:
    """Writes the JSON report (a local path, or any Hadoop URI while Spark is up)."""
    report["elapsed_s"] = round(time.monotonic() - started, 2)
    out = getattr(args, "out", None)
    path = args.report or ((out.rstrip("/") + "/report.json") if out else None)
    if not path:
        return
    report["report_path"] = path
    if _is_local_path(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as fh:
            json.dump(report, fh, indent=2, default=str)
        return
    if spark is None:
        raise InputError(f"cannot write the report to {path}: Spark is not running (see the error above)")
    with tempfile.TemporaryDirectory(prefix="metalog-spark-report-") as tmp:
        local = os.path.join(tmp, "report.json")
        with open(local, "w") as fh:
            json.dump(report, fh, indent=2, default=str)
        _hadoop_put(spark, local, path)


def _summary_lines(report: dict) -> list[str]:
    lines = [f"metalog spark {report['command']}: {report['result']}"]
    if "cluster_id" in report:
        lines.append(f"  cluster {report['cluster_id']!r}, {len(report.get('replicas', {}))} replica(s), "
                     f"HW {report.get('hw')} ({report.get('hw_source', '-')}), "
                     f"majority agrees up to {report.get('majority_end_offset')}")
    if report.get("voters") is not None:
        lines.append(f"  voters {report['voters']} (from {report.get('voters_source')})")
    for name, a in sorted(report.get("audit", {}).items()):
        where = ("" if a.get("first_diff_offset") is None else
                 f" at offset {a['first_diff_offset']} epoch {a.get('first_diff_epoch')}")
        role = ", observer: not voting" if a.get("in_vote") is False else ""
        lines.append(f"  replica {name} (node {a.get('node_id')}{role}): {a['status']}{where}")
    if report.get("skipped_dirs"):
        lines.append(f"  not read: {len(report['skipped_dirs'])} dir(s) beside a {D.PARTITION_DIR} (a Kafka "
                     f"broker's topic partitions), e.g. {report['skipped_dirs'][0]}")
    for w in report.get("warnings", [])[:10]:  # e.g. a replica of another cluster, left out above
        lines.append(f"  warning: {w['replica']}/{w['file']}: {w['warning']}")
    for e in report.get("errors", [])[:10]:
        where = "/".join(str(e[k]) for k in ("replica", "file") if e.get(k) is not None)
        if e.get("position") is not None:
            where += f" at byte {e['position']}"
        if e.get("offset") is not None:
            where += f" offset {e['offset']}"
        lines.append(f"  {e.get('category', 'error')}: {where + ': ' if where else ''}{e['error']}")
    if len(report.get("errors", [])) > 10:
        lines.append(f"  ... {len(report['errors']) - 10} more error(s) in the report")
    if "snapshot" in report:
        s = report["snapshot"]
        if s.get("published"):
            lines.append(f"  wrote {s['path']} ({s['records']} records, {s['bytes']} bytes) from "
                         f"{report['replay']['records']} log records of {report['replay']['source']}")
        else:
            lines.append(f"  no checkpoint written: {s['name']} was built but failed validation")
    if report.get("removed_earlier_checkpoint"):
        lines.append(f"  removed {report['removed_earlier_checkpoint']}, an earlier run's output, from the out dir")
    unmodelled = dict(report.get("replay", {}).get("unmodelled_records") or {})
    unmodelled.update({name: n for name, n in (report.get("replay", {}).get("control_records") or {}).items()
                       if name not in MODELLED_CONTROL_TYPES})
    if unmodelled:
        lines.append("  record types not modelled (counted, not applied): "
                     + ", ".join(f"{name} x{n}" for name, n in unmodelled.items()))
    for lo, hi in report.get("replay", {}).get("aborted_transactions") or []:
        lines.append(f"  metadata transaction aborted at offset {hi}: its records {lo}..{hi} not applied")
    if report.get("replay", {}).get("open_transaction_at") is not None:
        lines.append(f"  warning: a metadata transaction begun at offset {report['replay']['open_transaction_at']} "
                     "is still open at the end offset: its records are applied")
    for c in report.get("comparisons", []):
        lines.append(f"  vs broker snapshot {c['snapshot']}: "
                     + ("equal" if c["equal"] else f"{c['differing_entities']} entity(ies) differ")
                     + ("; not compared, not modelled: " + ", ".join(
                         f"{name} x{n}" for name, n in c["unmodelled_records"].items())
                        if c.get("unmodelled_records") else ""))
        for d in c["differences"][:5]:
            lines.append(f"    {d['entity']}: rebuilt {d['rebuilt']} / broker {d['broker']}")
    if report.get("report_path"):
        lines.append(f"  report: {report['report_path']}")
    return lines


class EnvironmentFailure(Exception):
    """Spark could not run (no Java, the JVM or the master failed): exit 3."""


CAUSE_LINKS_MAX = 8
CAUSE_LINK_CHARS_MAX = 240


def cause_chain(exc: BaseException) -> str:
    """The whole cause chain of a Python or Java (Py4J) failure, one short line
    per link, root cause last: Spark's first line is rarely the real reason."""
    links: list[str] = []
    java = getattr(exc, "java_exception", None) or getattr(exc, "_origin", None)
    if java is not None:
        try:
            t = java
            while t is not None and len(links) < CAUSE_LINKS_MAX:
                links.append(str(t.toString()))
                t = t.getCause()
        except Exception as jvm_exc:  # the JVM may be gone: keep what we have
            links.append(f"(rest of the Java cause chain unavailable: {type(jvm_exc).__name__})")
    if not links:
        e: BaseException | None = exc
        while e is not None and len(links) < CAUSE_LINKS_MAX:
            first = (str(e).strip().splitlines() or [""])[0]
            links.append(f"{type(e).__name__}: {first}" if first else type(e).__name__)
            e = e.__cause__ or e.__context__
    short = []
    for link in links:
        line = " ".join(link.split())
        if len(line) > CAUSE_LINK_CHARS_MAX:
            line = line[:CAUSE_LINK_CHARS_MAX - 3] + "..."
        if not short or short[-1] != line:
            short.append(line)
    return " <- caused by: ".join(short)


def first_failure(report: dict) -> dict | None:
    """The first failing check, in the order the job runs them: file checks,
    the replicas' audit, the comparison with the brokers' snapshots."""
    for e in report.get("errors", []):
        where = "/".join(str(e[k]) for k in ("replica", "file") if e.get(k) is not None)
        return {"category": e.get("category", "corruption"), "check": e["error"], "where": where}
    audits = [(a["first_diff_offset"], n, a) for n, a in report.get("audit", {}).items() if a.get("below_hw")]
    for off, name, a in sorted(audits, key=lambda x: (x[0], x[1])):
        return {"category": a["category"], "check": a["status"],
                "where": f"replica {name} at offset {off} epoch {a.get('first_diff_epoch')}"}
    for c in report.get("comparisons", []):
        if not c["equal"]:
            return {"category": "divergence", "where": c["snapshot"],
                    "check": f"broker snapshot differs from the rebuilt state in "
                             f"{c['differing_entities']} entity(ies)"}
    return None


def _start_spark(args, setup: SparkSetup, report: dict):
    """The session (the JVM started here unless under spark-submit), its
    settings in the report; EnvironmentFailure or InputError (a setting
    Spark rejects) when it cannot start."""
    global _jvm_stderr
    try:
        absent = missing(SPARK_MODULES, "spark")
        if absent is not None:
            raise EnvironmentFailure(absent)
        if not setup.submitted and not (os.environ.get("JAVA_HOME") or shutil.which("java")):
            raise EnvironmentFailure("no Java found: install a JDK (17 or 21) or set JAVA_HOME")
        if not args.verbose:
            quiet_python_warnings()
        spark = get_spark(args.master, ui=args.ui, shuffle_partitions=args.shuffle_partitions,
                          driver_memory=args.driver_memory, extra_conf=args.conf, setup=setup,
                          quiet_log=not args.verbose)
        report["master"] = spark.sparkContext.master
        setup.session = spark  # run() stops it even if a step below fails
        if setup.submitted:
            _jvm_stderr = spark.sparkContext._jvm.System.err
            if args.master:
                err_line(f"metalog spark: warning: --master {args.master} ignored: under "
                         "spark-submit the master is spark-submit's --master")
        report["spark_submit"] = setup.submitted
        conf = spark.sparkContext.getConf()
        report["spark_conf"] = {k: conf.get(k, None) for k in ("spark.driver.memory", "spark.app.name")}
        report["spark_conf"].update({k: conf.get(k, None) for k in args.conf})
        report["driver_heap_mb"] = round(
            spark.sparkContext._jvm.java.lang.Runtime.getRuntime().maxMemory() / (1 << 20))
        if not args.verbose:
            spark.sparkContext.setLogLevel("ERROR")
        # The SQL session state is built lazily, on first use; build it now, so
        # that a SQL setting Spark rejects is a start-up failure, not a "job failed".
        spark.conf.get("spark.sql.shuffle.partitions")
    except EnvironmentFailure:
        raise
    except Exception as exc:  # the JVM did not start, bad master URL, a --conf Spark rejects ...
        chain = cause_chain(exc)
        if "INVALID_CONF_VALUE" in chain:  # a usage error: say which setting, exit 2
            raise InputError(f"Spark rejects a setting (--conf or spark-defaults): {chain}") from None
        if "JAVA_GATEWAY_EXITED" in chain and not setup.submitted:
            chain += " (the JVM's own message is on the lines above; check --driver-memory and --conf)"
        master = args.master or ("spark-submit's master" if setup.submitted else "local[*]")
        raise EnvironmentFailure(f"cannot start Spark ({master}): {chain}") from None
    return spark


def run(args) -> int:
    """Both commands; returns the exit code and prints the summary."""
    _normalize(args)
    started = time.monotonic()
    report: dict = {"command": args.spark_command, "inputs": args.inputs, "result": "running"}
    code = EXIT_OK
    spark = progress = an = None
    setup = SparkSetup()
    staged = None
    try:
        spark = _start_spark(args, setup, report)
        progress = Progress(spark, enabled=not args.quiet).start()
        an = Analysis(spark, args.inputs, progress, report, cluster_id=args.cluster_id)
        an.load(args.upto, fuse=args.spark_command == "snapshot")
        an.vote(args.upto)
        if args.spark_command == "snapshot":
            staged = _snapshot(args, an, report, progress)
        failure = first_failure(report)
        if failure is not None:
            code = EXIT_VALIDATION
            report["first_failure"] = failure
        elif staged is not None:
            _publish(staged, report)
        # The outcome is known now; set it before the tables, whose report.html shows it.
        report["result"] = "ok" if code == EXIT_OK else "validation FAILED"
        if args.out and not args.no_tables:
            _write_tables(args, an, report, progress, state_too=failure is None and staged is not None)
        _say_first_failure(report)
    except InputError as exc:
        report.setdefault("errors", [])
        failure = first_failure(report) if an is not None else None
        if failure is not None:  # e.g. a corrupt snapshot left nothing to replay from
            report["result"] = "validation FAILED"
            report["first_failure"] = failure
            report["errors"].append({"category": "input", "error": str(exc)})
            code = EXIT_VALIDATION
            _say_first_failure(report)
        else:
            report["result"] = "bad input"
            report["errors"].append({"category": "input", "error": str(exc)})
            code = EXIT_INPUT
        err_line(f"metalog spark: {exc}")
    except EnvironmentFailure as exc:
        report["result"] = "environment failure"
        report.setdefault("errors", []).append({"category": "environment", "error": str(exc)})
        err_line(f"metalog spark: {exc}")
        code = EXIT_FAILED
    except Exception as exc:  # Spark failed mid-job or a bug: a report and the whole cause chain
        if args.verbose:
            traceback.print_exc()
        chain = cause_chain(exc)
        report["result"] = "job failed"
        report.setdefault("errors", []).append({"category": "environment", "error": chain})
        err_line(f"metalog spark: the job failed: {chain}")
        code = EXIT_FAILED
    finally:
        if staged is not None:
            _discard(staged)  # a no-op once published
        if args.spark_command == "snapshot" and spark is not None and code in (EXIT_OK, EXIT_VALIDATION):
            _remove_earlier_checkpoint(spark, args, report)
        if progress is not None:
            progress.set_phase("done")
            progress.stop()
        try:
            _finish(report, args, started, spark)
        except Exception as exc:  # the report could not be written: say so, exit non-zero
            err_line(f"metalog spark: cannot write the report: {cause_chain(exc)}")
            report.pop("report_path", None)
            code = code or EXIT_FAILED
        spark = spark or setup.session
        if spark is not None and not args.keep_session:
            spark.stop()
        setup.cleanup()
        _reset_stderr()
    print("\n".join(_summary_lines(report)))
    return code


def _is_local_path(path: str) -> bool:
    """A plain local path (no URI scheme): written with Python's own file IO."""
    return re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", path) is None


def _hadoop_fs(spark, uri: str):
    jvm = spark.sparkContext._jvm
    path = jvm.org.apache.hadoop.fs.Path(uri)
    return path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()), path


def _hadoop_put(spark, local_file: str, uri: str) -> None:
    """Copy a finished local file to any Hadoop URI (file://, hdfs://, s3a://...):
    to a temp name first, then a rename, so readers never see a partial file."""
    fs, dst = _hadoop_fs(spark, uri)
    jvm = spark.sparkContext._jvm
    tmp = jvm.org.apache.hadoop.fs.Path(uri + ".tmp")
    fs.mkdirs(dst.getParent())
    fs.copyFromLocalFile(False, True, jvm.org.apache.hadoop.fs.Path("file://" + os.path.abspath(local_file)),
                         tmp)
    if fs.exists(dst):
        fs.delete(dst, False)
    if not fs.rename(tmp, dst):
        raise OSError(f"cannot rename {uri}.tmp to {uri} (Hadoop FileSystem.rename returned false)")


def _remove_earlier_checkpoint(spark, args, report: dict) -> None:
    """A rerun replaces its own output: the .checkpoint an earlier run published
    into this --out (as the report it left says) is removed, unless this run
    published the same name. Without this a failed rerun left the earlier,
    differently named checkpoint beside its failure report. Only a name the
    earlier report gives is touched, so other files in --out are safe."""
    path = args.report or args.out.rstrip("/") + "/report.json"
    try:
        if _is_local_path(path):
            if not os.path.isfile(path):
                return
            with open(path) as fh:
                earlier = json.load(fh)
        else:
            fs, p = _hadoop_fs(spark, path)
            if not fs.exists(p):
                return
            stream = fs.open(p)
            try:
                earlier = json.loads(spark.sparkContext._jvm.org.apache.commons.io.IOUtils.toString(
                    stream, "UTF-8"))
            finally:
                stream.close()
        snap = earlier.get("snapshot") or {} if isinstance(earlier, dict) else {}
        name = snap.get("name")
        if (not snap.get("published") or not isinstance(name, str)
                or not re.fullmatch(r"\d{20}-\d{10}\.checkpoint", name)
                or (report.get("snapshot") or {}).get("published") and report["snapshot"].get("name") == name):
            return
        _remove_output(spark, args.out, name)
        report.setdefault("removed_earlier_checkpoint", name)
    except Exception as exc:  # the earlier report is unreadable: leave its output alone, say so
        err_line(f"metalog spark: warning: cannot check {path} for an earlier run's checkpoint: "
                 f"{cause_chain(exc)}")


def _remove_output(spark, out: str, name: str) -> None:
    """Removes OUT/name if an earlier run left it (a plain path or a Hadoop URI)."""
    if _is_local_path(out):
        try:
            os.unlink(os.path.join(out, name))
        except FileNotFoundError:
            pass
    else:
        fs, path = _hadoop_fs(spark, out.rstrip("/") + "/" + name)
        if fs.exists(path):
            fs.delete(path, False)


def _say_first_failure(report: dict) -> None:
    ff = report.get("first_failure")
    if ff:
        err_line(f"metalog spark: validation FAILED: {ff['category']}: {ff['check']}"
                 + (f" ({ff['where']})" if ff.get("where") else ""))


def _publish(staged: dict, report: dict) -> None:
    """Validation passed: move the staged checkpoint to its bootable name."""
    if staged.get("spark") is not None:  # --out is a Hadoop URI
        _hadoop_put(staged["spark"], staged["staged_path"], staged["final_path"])
    else:
        os.replace(staged["staged_path"], staged["final_path"])
        fsync_dir(os.path.dirname(staged["final_path"]))
    _discard(staged)
    report["snapshot"]["path"] = staged["final_path"]
    report["snapshot"]["published"] = True


def _discard(staged: dict) -> None:
    shutil.rmtree(staged["staging_dir"], ignore_errors=True)


def _snapshot(args, an: Analysis, report: dict, progress: Progress) -> dict:
    """Replays and writes the checkpoint into a staging dir under --out (a
    name no broker loads); run() publishes it only if every check passed."""
    target = an.hw
    if target > an.derived_hw:
        raise InputError(f"--upto {target} is past the offsets a majority of the replicas agree on "
                         f"(up to {an.derived_hw})")
    if target <= an.start and not an.snapshots:
        raise InputError(f"nothing to replay: the committed prefix [{an.start}, {target}) is empty")
    compare = sorted({s["end_offset"] for s in an.snapshots if an.start <= s["end_offset"] <= target})
    compare = compare[-SNAPSHOTS_COMPARED_MAX:]
    replay = Replay(an, target, progress)
    an.replay = replay
    t0 = time.monotonic()
    replay.run(compare + [target])
    epoch, ts = _epoch_and_ts_at(an, target - 1)
    sid = SnapshotId(target, epoch)
    if _is_local_path(args.out):
        os.makedirs(args.out, exist_ok=True)
        final = os.path.join(args.out, snapshot_filename(sid))
        if os.path.exists(final):
            os.unlink(final)  # a rerun replaces its own output
        staging = os.path.join(args.out, f".staging-{os.getpid()}")
        if os.path.exists(staging):
            _discard({"staging_dir": staging})
        os.makedirs(staging)
        staged = {"staging_dir": staging, "final_path": final}
    else:  # a Hadoop URI: build on the driver's disk, copy through Hadoop's FileSystem
        staging = tempfile.mkdtemp(prefix="metalog-spark-out-")
        final = args.out.rstrip("/") + "/" + snapshot_filename(sid)
        fs, path = _hadoop_fs(an.spark, final)
        if fs.exists(path):
            fs.delete(path, False)  # a rerun replaces its own output
        staged = {"staging_dir": staging, "final_path": final, "spark": an.spark}
    progress.set_phase(f"writing {snapshot_filename(sid)} (staged until validated)")
    t_write = time.monotonic()
    voters = replay.voters_at(target)
    writer = SnapshotWriter(staging, sid, ts, an.cluster_id or "", voters=voters)
    path, size, count = writer.write_all(replay.state_rows(target))
    staged["staged_path"] = path
    lap(report, "write_checkpoint", t_write)
    elapsed = time.monotonic() - t0
    report["replay"] = {"source": replay.source, "records": replay.records_replayed,
                        "invalid_records": replay.invalid, "data_records": replay.data_records,
                        # Kafka record types we do not model, by name: listed, neither pass nor fail
                        "unmodelled_records": dict(sorted(replay.unknown_records.items())),
                        # by type; the ones outside MODELLED_CONTROL_TYPES are also in the summary line
                        "control_records": replay.control_records,
                        # KIP-868: offset ranges of aborted metadata transactions, not applied
                        "aborted_transactions": [list(x) for x in replay.aborted],
                        "open_transaction_at": replay.open_transaction,
                        "start_offset": an.start,
                        "base_snapshot": replay.base and replay.base["file"],
                        "side_table_rows": replay.side_rows,
                        "shuffled_rows": replay.keyed_rows,  # after the map-side combine
                        # "fused": keyed and combined in the decode (one clean replica; report.read.path_why)
                        "path": "general" if an.fused is None else "fused",
                        "seconds": round(elapsed, 2),
                        "records_per_s": round(replay.records_replayed / elapsed) if elapsed else None}
    report["snapshot"] = {"path": None, "name": os.path.basename(final), "published": False,
                          "end_offset": sid.end_offset, "epoch": sid.epoch,
                          "records": count, "bytes": size,
                          "voters": None if voters is None else {v.voter_id: v.directory_id for v in voters.voters}}
    progress.set_phase("comparing with the brokers' snapshots")
    t_compare = time.monotonic()
    report["comparisons"] = [replay.compare(s) for s in an.snapshots if s["end_offset"] in compare]
    lap(report, "compare_snapshots", t_compare)
    return staged


def _write_tables(args, an: Analysis, report: dict, progress: Progress, state_too: bool) -> None:
    """Queryable output under --out: the audit table always; the state tables
    and the history only when every check passed (they describe the state the
    published .checkpoint holds); then the plots and report.html."""
    from metalog.tools.spark import plots
    from metalog.tools.spark import tables as TB

    out = args.out
    spark = an.spark
    progress.set_phase(f"writing Parquet tables under {out.rstrip('/')}/{TB.TABLES_DIR}")
    counts = {"audit": TB.write_audit(spark, report, out)}
    hist = None
    replay = getattr(an, "replay", None)
    removed: list[str] = []
    if state_too and replay is not None:
        counts.update(TB.write_state_and_history(spark, replay.states, replay.committed, replay.target, out))
        hist = spark.read.parquet(TB.table_path(out, "history"))
    elif args.spark_command == "snapshot":  # failed: an earlier run's state tables would pass for
        # this run's in `metalog spark sql` (audit leaves them: they describe a snapshot run's output)
        removed = TB.remove_state_tables(spark, out)
        _remove_output(spark, out, "records_per_type.png")
    report["tables"] = {"dir": out.rstrip("/") + "/" + TB.TABLES_DIR, "rows": counts}
    if removed:
        report["tables"]["removed_earlier"] = removed
    reason = plots.plots_unavailable()
    if reason is not None:
        report["plots"] = {"skipped": reason}
        err_line(f"metalog spark: plots skipped ({reason}); the tables and the checkpoint are written")
        return
    progress.set_phase("drawing the plots")
    audit = [dict(zip([n for n, _ in TB.AUDIT_FIELDS], row)) for row in TB.audit_rows(report)]
    with tempfile.TemporaryDirectory(prefix="metalog-spark-plots-") as tmp:
        files = plots.write_report(tmp, hist, audit, report)
        if _is_local_path(out):
            os.makedirs(out, exist_ok=True)
            for name in files:
                shutil.copyfile(os.path.join(tmp, name), os.path.join(out, name))
        else:
            for name in files:
                _hadoop_put(spark, os.path.join(tmp, name), out.rstrip("/") + "/" + name)
    report["plots"] = {"files": [out.rstrip("/") + "/" + name for name in files]}


SQL_EXAMPLE = ("SELECT offset, timestamp_ms, record_type, get_json_object(body, '$.leader') AS leader, "
               "get_json_object(body, '$.isr') AS isr FROM history WHERE record_type IN "
               "('Partition', 'PartitionChange') AND get_json_object(body, '$.topic_id') = 'TOPIC-ID' "
               "AND get_json_object(body, '$.partition_id') = 0 ORDER BY offset")


def run_sql(args) -> int:
    """metalog spark sql: one query over the tables of a job's --out dir, each
    registered as a view named after its directory (history, partitions, ...)."""
    from metalog.tools.spark import tables as TB

    absent = missing(SPARK_MODULES, "spark")
    if absent is not None:
        print(f"metalog spark sql: {absent}", file=sys.stderr)
        return EXIT_FAILED
    spark = getattr(args, "session", None)
    own = spark is None
    try:
        if own:
            if not (os.environ.get("JAVA_HOME") or shutil.which("java")):
                print("metalog spark sql: no Java found: install a JDK (17 or 21) or set JAVA_HOME",
                      file=sys.stderr)
                return EXIT_FAILED
            if not args.verbose:
                quiet_python_warnings()
            try:
                spark = get_spark(args.master, shuffle_partitions=2, driver_memory=args.driver_memory,
                                  quiet_log=not args.verbose)
                if not args.verbose:
                    spark.sparkContext.setLogLevel("ERROR")
            except Exception as exc:
                print(f"metalog spark sql: cannot start Spark: {cause_chain(exc)}", file=sys.stderr)
                return EXIT_FAILED
        views = TB.register_views(spark, args.out)
        if not views:
            print(f"metalog spark sql: no tables under {args.out.rstrip('/')}/{TB.TABLES_DIR}: run "
                  f"`metalog spark snapshot ... --out {args.out}` first", file=sys.stderr)
            return EXIT_INPUT
        from pyspark.errors import AnalysisException, ParseException

        if not args.verbose:  # pyspark logs a bad query's error itself, as JSON on stderr: we say it once
            from pyspark.logger import PySparkLogger

            PySparkLogger.getLogger("SQLQueryContextLogger").setLevel(logging.CRITICAL + 1)
        try:
            df = spark.sql(args.query)
            rows = df.limit(TB.SQL_ROWS_PRINTED_MAX + 1).collect()
        except (AnalysisException, ParseException) as exc:
            first = (str(exc).strip().splitlines() or [""])[0]
            print(f"metalog spark sql: bad query: {first} (views: {', '.join(views)})", file=sys.stderr)
            return EXIT_INPUT
        columns = df.columns
        shown = rows[:TB.SQL_ROWS_PRINTED_MAX]
        if args.json:
            for row in shown:
                print(json.dumps(row.asDict(recursive=True), default=TB.json_default))
        else:
            print("\n".join(TB.format_rows(columns, [tuple(x) for x in shown])))
        if len(rows) > TB.SQL_ROWS_PRINTED_MAX:
            print(f"metalog spark sql: only the first {TB.SQL_ROWS_PRINTED_MAX} rows printed; "
                  "add a LIMIT or aggregate", file=sys.stderr)
        return EXIT_OK
    finally:
        if own and spark is not None:
            spark.stop()


# ------------------------------------------------------------------ CLI


EXIT_CODES_HELP = """exit codes:
  0  valid: every check passed (snapshot: the .checkpoint was written)
  1  validation failed: the first failing check is named on stderr; categories
     corruption, divergence, safety violation, configuration; no .checkpoint written
  2  usage or unusable input (missing dir, no log files, nothing to replay, a --conf value
     Spark rejects, a --master or --driver-memory of the wrong form)
  3  environment: no pyspark (pip install 'metalog[spark]'), no Java, Spark failed to start or
     failed mid-job (cause chain on stderr)"""

SPARK_EPILOG = EXIT_CODES_HELP + """

examples:
  metalog spark snapshot run/cluster/node-*/data --out spark-out
  metalog spark audit run/cluster/node-*/data --report audit.json
  metalog spark package --out metalog_code.zip
  spark-submit --master spark://HOST:7077 --driver-memory 4g --py-files metalog_code.zip \\
      tools/spark/job.py snapshot hdfs:///backups/node-1/data ... --out /tmp/spark-out
progress goes to stderr, the summary to stdout, the JSON report to --report/OUT/report.json;
see docs/spark.md."""


def _conf_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"--conf wants KEY=VALUE, got {text!r}")
    return key.strip(), value


def _memory_size(text: str) -> str:
    """A JVM memory size as spark-submit takes it (512m, 4g, 1024): checked here,
    since a bad one only shows up as the JVM refusing to start."""
    if not re.fullmatch(r"\d+[kmgtp]?b?", text.strip(), re.IGNORECASE):
        raise argparse.ArgumentTypeError(f"--driver-memory wants a size such as 600m or 4g, got {text!r}")
    return text.strip()


MASTER_RE = re.compile(r"local(\[[^\]]+\])?|local-cluster\[[^\]]+\]|(spark|k8s)://\S+|yarn")


def _master_url(text: str) -> str:
    """A master URL of a form Spark takes: checked here, since a bad one only
    shows up as spark-submit's Java stack trace and a gateway that exited."""
    if not MASTER_RE.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"--master wants local[N], local[*], spark://HOST:PORT, yarn or "
                                         f"k8s://URL, got {text!r}")
    return text.strip()


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", help="broker data dirs (or copies; any Hadoop path)")
    p.add_argument("--master", default=None, type=_master_url,
                   help="Spark master URL when the job runs directly (default local[*]); "
                        "under spark-submit its --master applies and this is ignored")
    p.add_argument("--conf", type=_conf_pair, action="append", default=[], metavar="KEY=VALUE",
                   help="a Spark setting, passed through (repeatable)")
    p.add_argument("--report", help="where the JSON report goes (default OUT/report.json)")
    p.add_argument("--cluster-id", help="expected cluster id (default: the one most replicas' "
                                        "meta.properties name; other replicas are excluded)")
    p.add_argument("--shuffle-partitions", type=int, default=8)
    p.add_argument("--driver-memory", default="4g", type=_memory_size,
                   help="JVM heap of the driver when the job starts the JVM itself (in local mode "
                        "the executors' too); default 4g. Under spark-submit: its --driver-memory")
    p.add_argument("--ui", action="store_true", help="enable the Spark UI")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--verbose", action="store_true",
                   help="Spark's own warnings and Python tracebacks on failures")
    p.add_argument("--no-tables", action="store_true",
                   help="skip the Parquet tables and the plots under --out (only the .checkpoint "
                        "and report.json)")
    p.set_defaults(func=run, keep_session=False)


def _normalize(args) -> None:
    args.conf = dict(getattr(args, "conf", None) or [])


def run_package(args) -> int:
    """metalog spark package: the code archive for --py-files."""
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = out + ".tmp"
    build_package(tmp)
    os.replace(tmp, out)
    with zipfile.ZipFile(out) as z:
        n = len(z.namelist())
    print(f"wrote {out} ({n} modules, {os.path.getsize(out)} bytes): pass it to spark-submit "
          f"with --py-files {out}")
    return EXIT_OK


def register_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "spark", help="offline Spark job: rebuild snapshots, audit replicas",
        description="Offline Spark job over broker data dirs: validate every batch, vote the "
                    "committed prefix (HW), audit each replica against the majority, and replay "
                    "the committed log into a .checkpoint a broker can boot from.",
        epilog=SPARK_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="spark_command", required=True)
    s = sub.add_parser("snapshot", help="replay the committed log into a .checkpoint and validate it",
                       description="Replay the committed prefix (up to the majority HW or --upto) into "
                                   "a .checkpoint, compare with the brokers' own snapshots; the "
                                   ".checkpoint is published only if every check passes.",
                       epilog=SPARK_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_common(s)
    s.add_argument("--upto", type=int, help="end offset of the snapshot (default: the majority HW)")
    s.add_argument("--out", default="spark-out", help="output dir for the .checkpoint and report")
    a = sub.add_parser("audit", help="compare all replicas' logs with the majority",
                       description="Find the HW and, per replica, the first offset where it differs "
                                   "from the majority and why (corruption, divergence, safety violation).",
                       epilog=SPARK_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_common(a)
    a.add_argument("--hw", dest="upto", type=int, help="the HW to judge against (default: majority)")
    a.add_argument("--out", default=None, help="dir for report.json (default: none; see --report)")
    q = sub.add_parser("sql", help="SQL over the Parquet tables a snapshot/audit run wrote",
                       description="Run one Spark SQL query over the tables under OUT/tables (written by "
                                   "`metalog spark snapshot|audit --out OUT`), each a view named after "
                                   "its directory: brokers, topics, partitions, configs, acls, features, "
                                   "voters (the state at the HW, column state_offset), history (every "
                                   "committed record: offset, leader_epoch, timestamp_ms, control, "
                                   "record_type, version, body as JSON), audit (one row per replica).",
                       epilog="example (when and why did a partition's leader change):\n  metalog spark sql "
                              + shlex.quote(SQL_EXAMPLE) + "\nsee docs/spark.md.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("query", help="a Spark SQL query")
    q.add_argument("--out", default="spark-out", help="the job's output dir (default spark-out)")
    q.add_argument("--json", action="store_true", help="one JSON object per row instead of a text table")
    q.add_argument("--master", default="local[*]", type=_master_url, help="Spark master for the query (default local[*])")
    q.add_argument("--driver-memory", default="1g", type=_memory_size, help="driver heap (default 1g)")
    q.add_argument("--verbose", action="store_true", help="Spark's own warnings")
    q.set_defaults(func=run_sql)
    k = sub.add_parser("package", help="build the code archive shipped to executors (--py-files)",
                       description="Zip the packages the executors import (storage, broker, protocol, "
                                   "tools) for spark-submit --py-files on a standalone, YARN or "
                                   "Kubernetes cluster.")
    k.add_argument("--out", default="metalog_code.zip", help="archive path (default metalog_code.zip)")
    k.set_defaults(func=run_package)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="metalog spark")
    register_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["spark"] + list(sys.argv[1:] if argv is None else argv))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
