"""Controller snapshots written by a forked child process (issue 19 item 2).

Encoding a 2-million-partition state is ~20 s of pure Python. On a worker
thread it holds the GIL, and the event loop waits up to a switch interval
(5 ms) at every hand-over, several per commit: commit p99 went 12x up while
a snapshot was written. Here, as Redis's BGSAVE does, ``os.fork()`` makes a
child whose memory is a copy-on-write image of the parent at that instant:
the state is already frozen there (no copy on the loop), and the child
encodes, writes, fsyncs and renames it with its own interpreter and GIL.

The child runs only the given write function and ``os._exit``: no logging,
no imports, no asyncio, no SSL objects (locks other threads held at the
fork stay held in the child forever, so touching anything they guard could
hang it). It reports one short JSON line on a pipe; the parent waits for it
in a worker thread blocked in ``waitpid`` (no GIL held, the loop runs).
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Callable

from metalog.protocol.invariants import InvariantViolation, invariant

# The child runs under SCHED_IDLE where the OS has it (else nice 19): on a
# machine short of cores every other runnable process, the quorum's event
# loops first of all, preempts it at once; the snapshot just takes longer.
CHILD_NICE = 19
# The child's report is one line (result or error); a pipe holds 64 KiB, so
# a report this short never blocks the child's write.
REPORT_BYTES_MAX = 4096
# Exit codes of the child: 0 written, EXIT_FAILED the write raised (message
# on the pipe); anything else (a signal, another code) means it died.
EXIT_FAILED = 3
EXIT_DIED = 4


# prctl(PR_SET_PDEATHSIG) makes the kernel kill the child if the broker dies
# first (a fatal error, SIGKILL): no orphan writing into a data dir that a
# restarted broker owns. Looked up here: the child must not import or load.
PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def fork_available() -> bool:
    return hasattr(os, "fork") and hasattr(os, "waitpid")


@dataclass
class ChildResult:
    """What the child reported, or how it died."""

    ok: bool
    pid: int
    exit_status: str  # "exit 0", "exit 3", "signal 9 (SIGKILL)"
    value: dict | None = None  # the write function's result (ok)
    error: str | None = None  # the failure (not ok)
    seconds: float = 0.0  # fork to reaped, seen by the parent


class ForkedWrite:
    """One child writing one snapshot. ``start()`` on the loop thread (the
    fork is the state's copy: nothing may change it between the caller's
    read of the state's offset and this call), then ``await wait()``."""

    def __init__(self, write: Callable[[], dict], part_path: str):
        self._write = write
        self.part_path = part_path  # removed by the parent if the child dies mid-write
        self.pid: int | None = None
        self._read_fd: int | None = None
        self._t0_s = 0.0

    def start(self) -> int:
        invariant(self.pid is None, "a ForkedWrite forks once")
        r, w = os.pipe()
        parent = os.getpid()
        self._t0_s = time.perf_counter()
        try:
            pid = os.fork()
        except OSError:
            os.close(r)
            os.close(w)
            raise
        if pid == 0:  # the child: never returns from this branch
            try:
                os.close(r)
                _child(self._write, w, parent)
            finally:
                os._exit(EXIT_DIED)
        os.close(w)
        self.pid, self._read_fd = pid, r
        return pid

    async def wait(self) -> ChildResult:
        """Reap the child without blocking the loop; a child that did not
        report success has its partial file removed here."""
        pid, fd = self.pid, self._read_fd
        if pid is None or fd is None:
            raise InvariantViolation("ForkedWrite.wait() before start()")
        try:
            try:
                _, status = await asyncio.to_thread(os.waitpid, pid, 0)
            except ChildProcessError:
                status = None  # reaped by someone else: its report is all there is
            report = _read_report(fd)
        finally:
            os.close(fd)
            self._read_fd = None
        seconds = time.perf_counter() - self._t0_s
        exit_status = "unknown (reaped elsewhere)" if status is None else _describe(status)
        code = 0 if status is None else os.waitstatus_to_exitcode(status)
        if code == 0 and report is not None and "error" not in report:
            return ChildResult(True, pid, exit_status, value=report, seconds=seconds)
        # The child's SnapshotWriter aborts its own .part on an exception; a
        # child killed mid-write cannot, so the parent does.
        try:
            os.unlink(self.part_path)
        except FileNotFoundError:
            pass
        error = (report or {}).get("error") or f"snapshot child process died ({exit_status}) without a report"
        return ChildResult(False, pid, exit_status, error=error, seconds=seconds)

    def kill(self) -> None:
        """Stop a child still writing (the broker is stopping); wait() then
        reports it as died and removes its partial file."""
        if self.pid is not None and self._read_fd is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _child(write: Callable[[], dict], fd: int, parent: int) -> None:
    """Runs in the child; ends the process with os._exit, always."""
    code = EXIT_FAILED
    try:
        if _prctl is not None:
            _prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:
            raise RuntimeError("the broker died before its snapshot child started")
        # The parent's asyncio signal handling writes caught signals to a
        # wake-up fd shared with the parent: a SIGTERM sent to the child alone
        # must end the child, not be read by the parent's loop as its own.
        try:
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)
        except ValueError:
            pass  # not the interpreter's main thread: it never set a wake-up fd either
        # A collection would write to every tracked object's header: pages
        # copied for nothing in a process that lives for one write.
        gc.disable()
        _lower_priority()
        value = write()
        value["child_memory"] = _memory()
        report = json.dumps(value)
        code = 0
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which logs it
        report = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
    data = report.encode()[:REPORT_BYTES_MAX - 1] + b"\n"
    os.write(fd, data)
    os._exit(code)


def _lower_priority() -> None:
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return
        except OSError:
            pass  # refused (a container's seccomp policy): nice is the next best
    os.nice(CHILD_NICE)


def _memory() -> dict:
    """The child's memory at the end: peak RSS, and the pages it holds
    privately (copied on write by either side: what the fork cost)."""
    out: dict[str, int] = {}
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith((b"VmHWM:", b"VmRSS:")):
                out[line.split(b":")[0].decode().lower() + "_kib"] = int(line.split()[1])
    try:
        with open("/proc/self/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith((b"Private_Clean:", b"Private_Dirty:")):
                    out["private_kib"] = out.get("private_kib", 0) + int(line.split()[1])
    except FileNotFoundError:
        pass
    return out


def _read_report(fd: int) -> dict | None:
    os.set_blocking(fd, False)
    try:
        data = os.read(fd, REPORT_BYTES_MAX)
    except BlockingIOError:
        return None
    if not data.endswith(b"\n"):
        return None  # died mid-report
    try:
        report = json.loads(data)
    except ValueError:
        return None
    return report if isinstance(report, dict) else None


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = "?"
        return f"signal {sig} ({name})"
    return f"exit {os.waitstatus_to_exitcode(status)}"
