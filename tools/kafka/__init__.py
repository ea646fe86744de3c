"""Apache Kafka as the judge of metalog's files (issue 33).

metalog writes Kafka's file formats; this package runs the reference
implementation's own tools over what it wrote, so that Kafka, not a reader of
ours, says whether the bytes are Kafka's. Nothing of Kafka is in the repo:
``tools/kafka/pom.xml`` pins an Apache Kafka 4.x release and ``bash run.sh
setup`` copies its jars into ``.kafka/lib`` (git-ignored; the fetch is skipped
once they are there). This module finds those jars and runs a tool class of
Kafka's with ``java -cp '.kafka/lib/*'``:

* ``dump_log_segments(files)``: ``org.apache.kafka.tools.DumpLogSegments``
  (``kafka-dump-log.sh``) over segments and ``.checkpoint`` snapshots, by
  default with ``--cluster-metadata-decoder`` (which implies
  ``--print-data-log`` and ``--deep-iteration``); ``parse_dump`` in
  ``metalog.tools.kafka.dump_output`` turns what it prints into batches and
  records;
* ``metadata_shell(snapshot, command)``: ``org.apache.kafka.shell.MetadataShell``
  (``kafka-metadata-shell.sh``) loads a snapshot and runs one command
  (``ls /topics``, ``tree /``, ``cat ...``) without a terminal.

``KafkaMissing`` is raised, naming ``bash run.sh setup``, when java or the
jars are missing. ``METALOG_KAFKA_LIB`` points elsewhere than ``.kafka/lib``.
tests/kafka/ is where Kafka judges a real cluster's files.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from typing import Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
POM = os.path.join(HERE, "pom.xml")
LOG4J2_CONF = os.path.join(HERE, "log4j2.properties")
LIB_ENV = "METALOG_KAFKA_LIB"
DEFAULT_LIB = os.path.join(REPO_ROOT, ".kafka", "lib")

DUMP_LOG_SEGMENTS = "org.apache.kafka.tools.DumpLogSegments"
METADATA_SHELL = "org.apache.kafka.shell.MetadataShell"

TIMED_OUT = -9  # run_class's return code for a tool killed at its timeout

# The jars whose presence says the fetch was done (the tools above live in them).
_REQUIRED_JARS = ("kafka-tools-*.jar", "kafka-shell-*.jar", "kafka-metadata-*.jar", "kafka-clients-*.jar")


class KafkaMissing(RuntimeError):
    """Java or Kafka's jars are not on this machine; the message says how to get them."""


def lib_dir() -> str:
    return os.environ.get(LIB_ENV) or DEFAULT_LIB


def kafka_version() -> str:
    """The Kafka release of the fetched jars (from kafka-clients-<version>.jar)."""
    jars = glob.glob(os.path.join(lib_dir(), "kafka-clients-*.jar"))
    if not jars:
        raise KafkaMissing(f"Kafka's jars are not in {lib_dir()}: run `bash run.sh setup` (Maven fetches them)")
    return os.path.basename(jars[0])[len("kafka-clients-"):-len(".jar")]


def java() -> str:
    found = shutil.which("java")
    if found is None:
        raise KafkaMissing("java not found: run `bash run.sh setup` (it installs Java 17 and Kafka's jars)")
    return found


def classpath() -> str:
    """``<lib>/*``, after checking that the jars Kafka's tools need are there."""
    lib = lib_dir()
    missing = [pattern for pattern in _REQUIRED_JARS if not glob.glob(os.path.join(lib, pattern))]
    if missing:
        raise KafkaMissing(f"Kafka's jars are not in {lib} (no {', '.join(missing)}): run `bash run.sh setup` "
                           f"(Maven fetches Apache Kafka as pinned in {os.path.relpath(POM, REPO_ROOT)})")
    return os.path.join(lib, "*")


def run_class(main_class: str, args: Sequence[str], timeout_s: float = 300.0,
              heap_mb: int = 512) -> subprocess.CompletedProcess[str]:
    """Run one of Kafka's tool classes to its end; stdout and stderr captured
    as text. A tool that outlives `timeout_s` is killed and its return code is
    TIMED_OUT, with what it printed until then: the metadata shell, for one,
    waits for ever on a snapshot it cannot load."""
    command = [java(), f"-Xmx{heap_mb}m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
               f"-Dlog4j2.configurationFile={LOG4J2_CONF}", "-cp", classpath(), main_class, *args]
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        # What the tool said before it was killed is the evidence: keep it.
        def text(out: str | bytes | None) -> str:
            return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")
        return subprocess.CompletedProcess(command, TIMED_OUT, text(exc.stdout), text(exc.stderr)
                                           + f"\nmetalog.tools.kafka: {main_class} killed after {timeout_s:g} s\n")


def dump_log_segments(files: Sequence[str], cluster_metadata: bool = True, deep_iteration: bool = True,
                      timeout_s: float = 300.0) -> subprocess.CompletedProcess[str]:
    """Kafka's DumpLogSegments over `files` (segments, snapshots, indexes) in
    one JVM. cluster_metadata: decode each data record as a metadata record
    (``--cluster-metadata-decoder``); else print values as text
    (``--print-data-log`` with Kafka's StringDecoder)."""
    if not files:
        raise ValueError("dump_log_segments needs at least one file")
    if any("," in f for f in files):
        raise ValueError("DumpLogSegments takes a comma-separated list: a path holding a comma cannot be named")
    args = ["--files", ",".join(files)]
    if deep_iteration:
        args.append("--deep-iteration")
    args.append("--cluster-metadata-decoder" if cluster_metadata else "--print-data-log")
    return run_class(DUMP_LOG_SEGMENTS, args, timeout_s=timeout_s)


def metadata_shell(snapshot: str, command: Sequence[str], timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Kafka's metadata shell: load `snapshot` and run `command` (e.g.
    ``["ls", "/topics"]``, ``["tree", "/"]``) non-interactively. The shell
    takes the ``.lock`` of the data dir two levels above the snapshot when
    there is one: give it a copy of a live broker's snapshot."""
    return run_class(METADATA_SHELL, ["--snapshot", snapshot, *command], timeout_s=timeout_s)
