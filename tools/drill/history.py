"""The drill's history for an independent checker: every operation as JSON lines.

``<dir>/history.jsonl`` (format ``metalog-history/1``, documented in
docs/drills.md) records every produce and every read the drill's clients made,
in the shape Jepsen-style checkers read: an ``invoke`` line when a process
starts an operation and one completion line when it ends -- ``ok``, ``fail``
(it did not happen) or ``info`` (unknown: a produce that timed out may or may
not be stored). Each process (``w<N>`` a writer, ``c<N>`` a consumer,
``final`` the log read back from the brokers' files at the end) has at most
one operation outstanding. Times are monotonic nanoseconds since the drill
began, taken just before the request and just after the answer, so every
operation took effect inside its [invoke, completion] interval.

``metalog-porcupine`` (tools/drill/porcupine, Go, built by ``bash run.sh
setup``) checks the file with Porcupine, a linearizability checker we did not
write, against a model of the log; ``run_porcupine`` runs it and returns its
verdict. The drill fails when it finds a violation or cannot run.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass

from metalog.tools.cluster.launcher import REPO_ROOT

FORMAT = "metalog-history/1"
PORCUPINE_BIN = os.path.join(REPO_ROOT, ".bin", "metalog-porcupine")
PORCUPINE_TIMEOUT_S = 300
OUTPUT_LINES_MAX = 60  # of the checker's output kept in the report


def text(value: bytes) -> str:
    """A record value as JSON text (the drill's values are ASCII; other bytes escaped)."""
    return value.decode("utf-8", "backslashreplace")


class HistoryFile:
    """Appends history lines as they happen (a crash leaves every completed line)."""

    def __init__(self, path: str, t0_ns: int | None = None):
        self.path = path
        self.t0_ns = time.monotonic_ns() if t0_ns is None else t0_ns
        self._f = open(path, "w", buffering=1 << 16)
        self._write({"type": "meta", "format": FORMAT, "t0_unix_s": time.time(),
                     "clock": "time: monotonic ns since t0"})

    def now_ns(self) -> int:
        return time.monotonic_ns() - self.t0_ns

    def _write(self, line: dict) -> None:
        self._f.write(json.dumps(line, separators=(",", ":")) + "\n")

    def invoke(self, process: str, f: str, value: dict) -> None:
        self._write({"type": "invoke", "process": process, "f": f, "value": value, "time": self.now_ns()})

    def complete(self, process: str, f: str, kind: str, value: dict, error: str | None = None) -> None:
        line = {"type": kind, "process": process, "f": f, "value": value, "time": self.now_ns()}
        if error:
            line["error"] = error[:200]
        self._write(line)

    def final_reads(self, log: dict[int, bytes], control: set[int], commit_end: int) -> int:
        """The committed log read back from the brokers' files after the run, as reads by
        process ``final``: one per contiguous run of offsets below `commit_end` that some
        copy holds (an offset no copy holds is claimed by no read). Returns the reads made."""
        reads, lo = 0, None
        for off in range(commit_end + 1):
            held = off < commit_end and (off in log or off in control)
            if held and lo is None:
                lo = off
            elif not held and lo is not None:
                value = {"from": lo}
                self.invoke("final", "read", value)
                value = {"from": lo, "next": off, "records": [[o, text(log[o]), -1] for o in range(lo, off) if o in log]}
                self.complete("final", "read", "ok", value)
                reads, lo = reads + 1, None
        return reads

    def close(self) -> None:
        self._f.close()


@dataclass
class Verdict:
    ok: bool
    checker: str  # "porcupine"
    rc: int | None  # the binary's exit status; None: it could not run
    summary: str  # its first line, or why it could not run
    output: list[str]

    def to_json(self) -> dict:
        return {"ok": self.ok, "rc": self.rc, "summary": self.summary, "output": self.output}


def run_porcupine(history_path: str, vis_path: str | None = None, binary: str = PORCUPINE_BIN,
                  timeout_s: float = PORCUPINE_TIMEOUT_S) -> Verdict:
    """Porcupine's verdict on a history file. A missing binary is a failed check, never a skip."""
    if not os.access(binary, os.X_OK):
        return Verdict(False, "porcupine", None, f"porcupine: {binary} is missing: build it with "
                       "`bash run.sh setup` (needs Go); the history was not checked", [])
    argv = [binary, f"-timeout={int(timeout_s)}s"] + (["-vis", vis_path] if vis_path else []) + [history_path]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s + 60)
    except subprocess.TimeoutExpired:
        return Verdict(False, "porcupine", None, f"porcupine: no verdict within {timeout_s + 60:.0f} s", [])
    lines = (proc.stdout + proc.stderr).splitlines()
    first = lines[0] if lines else f"porcupine: exit {proc.returncode} and no output"
    return Verdict(proc.returncode == 0, "porcupine", proc.returncode, first, lines[:OUTPUT_LINES_MAX])
