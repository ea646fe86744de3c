"""While this node leads, its event-loop thread asks the kernel for short scheduler slices.

Why: every write waits on the leader twice (its Produce, then the Fetch that
acknowledges it), and with peers and clients sharing cores (the local
cluster, one host of containers) the leader lost its core in the middle of a
commit: its write to the first follower woke that follower, which took the
leader's core before the leader had written to the second follower or
started its own fdatasync (``perf sched``: 0.6 such preemptions a commit),
and a Fetch that woke the leader waited for whoever held the core. Linux's
EEVDF scheduler (6.6+) orders runnable tasks by virtual deadline, and since
6.12 a fair task may ask for its own slice (``sched_setattr`` with
``sched_runtime``, 0.1-100 ms): a shorter slice is an earlier deadline, so
the leader runs first when it wakes and is not preempted by the tasks it
wakes. Its share of the CPU does not change (that is the nice value's job).
docs/bench.md has the measurements.

How: ``LeaderSlice.apply(leading)`` after every change of role (the runtime
calls it); the thread asks for itself, which needs no privilege, and keeps
its policy and nice value. 0 (``leader_slice_us``) leaves the kernel's
default. Where the call is refused (seccomp, another OS) the broker logs it
once and runs on; a kernel older than 6.12 takes the call and ignores the
slice.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from typing import Any, Callable

SLICE_US_MIN = 100  # the kernel clamps a fair task's slice to 0.1-100 ms
SLICE_US_MAX = 100_000
_SCHED_OTHER, _SCHED_BATCH = 0, 3  # the fair policies: a real-time or idle thread is left alone
# sched_setattr / sched_getattr: the generic numbers (arm64, riscv) and x86-64's own.
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275), "riscv64": (274, 275)}


class _SchedAttr(ctypes.Structure):
    """struct sched_attr (SCHED_ATTR_SIZE_VER1, 56 bytes)."""

    _fields_ = [("size", ctypes.c_uint32), ("policy", ctypes.c_uint32), ("flags", ctypes.c_uint64),
                ("nice", ctypes.c_int32), ("priority", ctypes.c_uint32), ("runtime_ns", ctypes.c_uint64),
                ("deadline_ns", ctypes.c_uint64), ("period_ns", ctypes.c_uint64),
                ("util_min", ctypes.c_uint32), ("util_max", ctypes.c_uint32)]


def set_thread_slice_ns(slice_ns: int) -> str | None:
    """Ask for `slice_ns` (0: the kernel's default) for the calling thread,
    keeping its policy and nice value. None when done, else why not."""
    numbers = _SYSCALLS.get(platform.machine()) if sys.platform.startswith("linux") else None
    if numbers is None:
        return f"no sched_setattr on {platform.system()} {platform.machine()}"
    setattr_nr, getattr_nr = numbers
    libc = ctypes.CDLL(None, use_errno=True)
    attr = _SchedAttr()
    if libc.syscall(getattr_nr, 0, ctypes.byref(attr), ctypes.sizeof(attr), 0) != 0:
        return f"sched_getattr: {os.strerror(ctypes.get_errno())}"
    if attr.policy not in (_SCHED_OTHER, _SCHED_BATCH):
        return f"the thread's scheduling policy is {attr.policy}, not a fair one: left as it is"
    attr.size = ctypes.sizeof(attr)
    attr.flags = 0
    attr.runtime_ns = slice_ns
    attr.deadline_ns = attr.period_ns = 0
    if libc.syscall(setattr_nr, 0, ctypes.byref(attr), 0) != 0:
        return f"sched_setattr: {os.strerror(ctypes.get_errno())}"
    return None


class LeaderSlice:
    """The event-loop thread's slice follows the role (see the module doc)."""

    def __init__(self, slice_us: int, logger: Any,
                 set_slice_ns: Callable[[int], str | None] = set_thread_slice_ns):
        if not (slice_us == 0 or SLICE_US_MIN <= slice_us <= SLICE_US_MAX):
            raise ValueError(f"leader_slice_us must be 0 or {SLICE_US_MIN}-{SLICE_US_MAX}, got {slice_us}")
        self._slice_ns = slice_us * 1000
        self._log = logger
        self._set = set_slice_ns
        self._short = False  # the thread asked for the leader's slice and has it
        self._failed = False  # refused once: not asked again

    def apply(self, leading: bool) -> None:
        """On the event-loop thread, after a change of role."""
        if not self._slice_ns or self._failed or leading == self._short:
            return
        why = self._set(self._slice_ns if leading else 0)
        if why is not None:
            self._failed = True
            self._log.warning("leader_slice_unavailable", reason=why, leader_slice_us=self._slice_ns // 1000)
            return
        self._short = leading
