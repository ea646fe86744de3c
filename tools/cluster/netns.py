"""Test hosts on Linux network namespaces: one per broker, one for clients, on a private bridge.

A drill whose faults are in the network itself needs brokers that talk over a
network it can break: ``NetnsHosts`` makes one network namespace per broker
(``mlg-<run>-n<id>``) and one for the clients (``mlg-<run>-c``), each with a
veth pair whose outer end is enslaved to a bridge (``mlg<run>br``) in the root
namespace. Addresses are on a private /24 that exists only inside the
namespaces: the bridge has no address, so the root namespace has no route to
them, and two runs on one machine (each with its own bridge) never meet even
though both use the same subnet.

A broker runs as ``ip netns exec mlg-<run>-n<id> <its usual command>``
(``exec_prefix``) with its namespace's address as its listen, advertised and
certificate address: the command line of a real deployment. The drill's own
clients (writers, consumers, the /quorum monitor) run in the client namespace:
``client_namespace()`` moves the calling thread there (threads it starts
inherit it), so every byte between a client and a broker crosses the bridge.

``<run>`` is the creating process's pid in hex: ``cleanup_leftovers()`` (run
before every ``create()``) removes every namespace and bridge of a run whose
process is gone -- a drill that crashed or was killed -- and kills the brokers
still running inside them. A live run's hosts are never touched.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and ``ip`` (iproute2);
``unavailable()`` says in one line why namespaces cannot be made here.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

PREFIX = "mlg-"
SUBNET = "10.213.0"  # /24; private to each run's bridge (see the module docstring)
CLIENT_HOST_INDEX = 2
NODE_HOST_BASE = 10  # node N is SUBNET.(10 + N)
MAX_NODE_ID = 200  # keeps addresses in the /24 and interface names short
COMMAND_TIMEOUT_S = 15.0
LEFTOVERS_MAX = 1000  # namespaces looked at per cleanup (bounded)
CLONE_NEWNET = 0x40000000
NETNS_DIR = "/var/run/netns"
_NS_RE = re.compile(r"^mlg-([0-9a-f]+)-(n\d+|c|probe)$")
_LINK_RE = re.compile(r"^mlg([0-9a-f]+)(br|v\w+)$")  # a bridge or a veth's outer end


class NetnsError(Exception):
    """A namespace command failed; the message is one line naming it."""


def run(argv: list[str], *, check: bool = True, input_text: str | None = None) -> str:
    """Run a command (ip, nft, tc), return its stdout; NetnsError with its stderr on failure."""
    try:
        p = subprocess.run(argv, input=input_text, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"{' '.join(argv)}: {exc}") from None
    if check and p.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {(p.stderr or p.stdout).strip().splitlines()[-1:] or p.returncode}")
    return p.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def unavailable() -> str | None:
    """Why namespaces cannot be made here (one line), None when they can: a probe is made and removed."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add: CAP_SYS_ADMIN)"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid():x}-probe"
    try:
        run(["ip", "netns", "add", probe])
        run(["ip", "netns", "exec", probe, "ip", "link", "set", "lo", "up"])
    except NetnsError as exc:
        return f"cannot create a network namespace: {exc}"
    finally:
        run(["ip", "netns", "del", probe], check=False)
    return None


def cleanup_leftovers() -> list[str]:
    """Remove the namespaces and bridges of runs whose creating process is gone,
    killing any process still inside them (a crashed drill's brokers); their names."""
    removed = []
    try:
        names = sorted(os.listdir(NETNS_DIR))[:LEFTOVERS_MAX]
    except FileNotFoundError:
        names = []
    for name in names:
        m = _NS_RE.match(name)
        if not m or _pid_alive(int(m.group(1), 16)):
            continue
        for pid in run(["ip", "netns", "pids", name], check=False).split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        run(["ip", "netns", "del", name], check=False)
        removed.append(name)
    # A deleted namespace's veth can outlive it for a while (the kernel frees it once the
    # last reference goes), so the outer ends are deleted by name, and the bridge.
    for line in run(["ip", "-o", "link", "show"], check=False).splitlines()[:LEFTOVERS_MAX]:
        parts = line.split(":")
        link = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        m = _LINK_RE.match(link)
        if m and not _pid_alive(int(m.group(1), 16)):
            run(["ip", "link", "del", link], check=False)
            removed.append(link)
    return removed


class NetnsHosts:
    """One namespace per node id plus one for clients, on one bridge; ``create()`` / ``remove()``."""

    def __init__(self, node_ids: list[int], run_id: str | None = None):
        bad = [n for n in node_ids if not 0 <= n <= MAX_NODE_ID]
        if bad:
            raise ValueError(f"node ids must be 0..{MAX_NODE_ID} to get a host address, got {bad}")
        self.node_ids = sorted(node_ids)
        self.run_id = run_id or f"{os.getpid():x}"
        self.bridge = f"mlg{self.run_id}br"
        self.created: list[str] = []  # namespaces made so far (removed even after a half-made create)

    # ------------------------------------------------------------ names and addresses
    def ns(self, node_id: int) -> str:
        return f"{PREFIX}{self.run_id}-n{node_id}"

    @property
    def client_ns(self) -> str:
        return f"{PREFIX}{self.run_id}-c"

    def addr(self, node_id: int) -> str:
        return f"{SUBNET}.{NODE_HOST_BASE + node_id}"

    @property
    def client_addr(self) -> str:
        return f"{SUBNET}.{CLIENT_HOST_INDEX}"

    def exec_prefix(self, node_id: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns(node_id)]

    def run_in(self, node_id: int, argv: list[str], *, check: bool = True, input_text: str | None = None) -> str:
        """Run a command (nft, tc) inside node_id's namespace."""
        return run(self.exec_prefix(node_id) + argv, check=check, input_text=input_text)

    # ------------------------------------------------------------ lifecycle
    def create(self) -> "NetnsHosts":
        cleanup_leftovers()
        try:
            run(["ip", "link", "add", self.bridge, "type", "bridge"])
            run(["ip", "link", "set", self.bridge, "up"])
            for key, ns, address in [("c", self.client_ns, self.client_addr)] + [
                    (str(n), self.ns(n), self.addr(n)) for n in self.node_ids]:
                self._add_host(key, ns, address)
        except NetnsError:
            self.remove()
            raise
        return self

    def _add_host(self, key: str, ns: str, address: str) -> None:
        outer, inner = f"mlg{self.run_id}v{key}", f"mlg{self.run_id}i{key}"
        run(["ip", "netns", "add", ns])
        self.created.append(ns)
        run(["ip", "link", "add", outer, "type", "veth", "peer", "name", inner])
        run(["ip", "link", "set", inner, "netns", ns])
        run(["ip", "link", "set", outer, "master", self.bridge, "up"])
        inside = ["ip", "netns", "exec", ns, "ip"]
        run(inside + ["link", "set", inner, "name", "eth0"])
        run(inside + ["addr", "add", f"{address}/24", "dev", "eth0"])
        run(inside + ["link", "set", "eth0", "up"])
        run(inside + ["link", "set", "lo", "up"])

    def remove(self) -> None:
        """Kill what still runs inside, delete every namespace (their veths go with them) and the bridge."""
        for ns in self.created:
            for pid in run(["ip", "netns", "pids", ns], check=False).split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            run(["ip", "netns", "del", ns], check=False)
        for key in ["c"] + [str(n) for n in self.node_ids]:
            if os.path.exists(f"/sys/class/net/mlg{self.run_id}v{key}"):
                run(["ip", "link", "del", f"mlg{self.run_id}v{key}"], check=False)
        self.created = []
        run(["ip", "link", "del", self.bridge], check=False)

    @contextmanager
    def client_namespace(self) -> Iterator[None]:
        """Run the calling thread (and the threads it starts meanwhile) in the client namespace."""
        libc = ctypes.CDLL(None, use_errno=True)
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(os.path.join(NETNS_DIR, self.client_ns), os.O_RDONLY)
        try:
            if libc.setns(target, CLONE_NEWNET) != 0:
                raise NetnsError(f"setns into {self.client_ns}: {os.strerror(ctypes.get_errno())}")
            try:
                yield
            finally:
                if libc.setns(home, CLONE_NEWNET) != 0:  # never leave the caller's thread elsewhere
                    raise NetnsError(f"setns back home: {os.strerror(ctypes.get_errno())}")
        finally:
            os.close(home)
            os.close(target)
