"""Local multi-broker cluster: real broker processes on loopback.

``LocalCluster`` is used by ``metalog cluster up`` (the README's first
command), by the real-process tests, by drills and by benchmarks. Each node
gets ``<root>/node-<id>/`` with its ``broker.yaml``, data dir and
``broker.log`` (structured JSON lines). Nodes listed in ``voters`` vote;
the rest are observers that replicate without voting.

A cluster is dynamic by default (KIP-853, kraft.version 1, as Kafka 4.x
formats new clusters): before its first start each data dir is formatted the
way ``metalog storage format`` does it, the first voters with
``--initial-controllers`` naming every first voter by its directory id, the
others with ``--no-initial-controllers``; ``voters`` in the brokers' config is
then only whom to ask for the leader, and the voter set changes online
(``add_voter`` / ``remove_voter`` here, ``metalog cluster add-node|remove-node``).
``dynamic=False`` keeps static voters from the config (kraft.version 0).
A data dir wiped later is not formatted again: the broker binds it with a new
directory id and it comes back as an observer, never as the old voter.

Everything another process needs to find and manage the cluster is in
``<root>/cluster.json`` (``save_state``/``load``): node ids, ports, voters,
TLS or not and where the certificates are (``<root>/certs``, or the compose
layout's certs volume), so every ``metalog cluster`` subcommand sees the
cluster the way ``cluster up`` started it. Broker settings a user gives
(``cluster up --set``/``--node-set``, ``apply_settings``) are kept there too:
``node-N/broker.yaml`` is written from it at every start, and a broker.yaml
edited by hand since is never overwritten (``ConfigEditedError``).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import yaml

from metalog.broker.client.config import ClientConfig
from metalog.broker.server.config import SECTIONS, ConfigError, config_from_dict, normalize
from metalog.broker.server.recovery import META_FILE, format_data_dir, new_directory_id
from metalog.broker.net.tls import TlsFiles, TlsPaths
from metalog.storage.atomic import atomic_write
from metalog.tools.cluster.certs import cluster_certs

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Listen ports come from below the kernel's ephemeral range (32768-60999 by
# default): a port picked from that range can be taken by some process's
# outgoing connection while its broker is down, and the restart then fails
# with "address already in use".
LISTEN_PORT_RANGE = (20000, 32000)
_port_rng = random.Random()


def free_ports(n: int) -> list[int]:
    """n distinct loopback ports, free now, outside the ephemeral range."""
    socks, ports = [], []
    try:
        for _ in range(50 * n):  # bounded: give up rather than loop forever
            if len(ports) == n:
                break
            port = _port_rng.randrange(*LISTEN_PORT_RANGE)
            if port in ports:
                continue
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            ports.append(port)
    finally:
        for s in socks:
            s.close()
    if len(ports) < n:
        raise OSError(f"could not find {n} free ports in {LISTEN_PORT_RANGE}")
    return ports


def _under(path: str, root: str) -> bool:
    return os.path.commonpath([os.path.abspath(path), root]) == root


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state letter, start time in clock ticks) of a process from /proc, None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], fields[19]  # fields 3 and 22 of proc(5), counted after the comm field


@dataclass
class NodeSpec:
    node_id: int
    port: int
    admin_port: int
    voter: bool
    extra: dict[str, Any] = field(default_factory=dict)
    command: list[str] | None = None  # default: python -m metalog.broker.server.main --config <file>
    # Dynamic clusters: the directory id the launcher formats the data dir with
    # (a first voter's is in every first voter's bootstrap checkpoint), and
    # whether that format is done (never again: a wiped dir is a new replica).
    directory_id: str | None = None
    formatted: bool = False
    # Taken out by `cluster remove-node`: kept (its dir too) but not started by `cluster up`.
    removed: bool = False
    # sha256 of the node-N/broker.yaml the launcher last wrote: a file that no
    # longer matches it was edited by hand, and is not overwritten.
    config_sha256: str | None = None
    # A node on its own host (a drill's network namespace): the address it listens on and is
    # dialled at (default: the cluster's host), and what its command line runs under
    # (e.g. ["ip", "netns", "exec", "mlg-1a2b-n1"]).
    host: str | None = None
    exec_prefix: list[str] | None = None
    kafka_port: int | None = None  # its Kafka-protocol listener (kafka_listen); None: none


# Set by the launcher from the cluster's layout (ids, addresses, directories,
# voters, TLS files): `cluster up --set` cannot change them, the layout flags do.
LAYOUT_KEYS = frozenset({"node_id", "cluster_id", "data_dir", "listen", "admin_listen", "voters", "log_file",
                         "kafka_listen", "kafka_endpoints",
                         "dynamic_voters", "security_protocol", "ssl_ca_file", "ssl_cert_file", "ssl_key_file"})


class ConfigEditedError(Exception):
    """node-N/broker.yaml was edited by hand since the launcher wrote it; the
    message (one line) says where settings belong and how to keep the edit."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _flag_value(value: Any) -> str | None:
    """A broker.yaml value as `--set` takes it, None if it has no such form."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return str(value)
    return None


class LocalCluster:
    def __init__(self, root: str, nodes: list[NodeSpec], cluster_id: str = "metalog-local",
                 host: str = "127.0.0.1", common: dict[str, Any] | None = None,
                 voter_addrs: dict[int, tuple[str, int]] | None = None, insecure: bool = False,
                 dynamic: bool = False, cert_dir: str | None = None):
        self.root = os.path.abspath(root)
        # Secure by default: a CA, node certificates and an `admin` user certificate in
        # <root>/certs, or where the layout keeps them (a compose file's certs volume).
        self.insecure = insecure
        self.cert_dir = os.path.join(self.root, cert_dir or "certs")
        self._client_tls: Any = None
        self._admin_conns: dict[tuple[int, int], Any] = {}  # (thread, node) -> kept-alive admin connection
        self.nodes = {n.node_id: n for n in nodes}
        self.cluster_id = cluster_id
        self.host = host
        self.common = dict(common or {})
        # Where voters are dialled (a fault proxy may stand in between).
        self.voter_addrs = voter_addrs or {n.node_id: (n.host or host, n.port) for n in nodes if n.voter}
        self.procs: dict[int, subprocess.Popen] = {}
        self.dynamic = dynamic
        if dynamic:
            for spec in nodes:
                if spec.directory_id is None:
                    spec.directory_id = new_directory_id()

    @classmethod
    def create(cls, root: str, voters: int = 3, observers: int = 1, base_port: int | None = None,
               common: dict[str, Any] | None = None, cluster_id: str = "metalog-local",
               insecure: bool = False, dynamic: bool = True) -> "LocalCluster":
        n = voters + observers
        if base_port:
            ports = [base_port + i for i in range(n)]
            admin_ports = [base_port + 1000 + i for i in range(n)]
            kafka_ports = [base_port + 2000 + i for i in range(n)]
        else:
            got = free_ports(3 * n)
            ports, admin_ports, kafka_ports = got[:n], got[n:2 * n], got[2 * n:]
        specs = [NodeSpec(i + 1, ports[i], admin_ports[i], voter=i < voters, kafka_port=kafka_ports[i])
                 for i in range(n)]
        return cls(root, specs, cluster_id=cluster_id, common=common, insecure=insecure, dynamic=dynamic)

    # ----------------------------------------------------------- config
    @property
    def voters_string(self) -> str:
        return ",".join(f"{nid}@{h}:{p}" for nid, (h, p) in sorted(self.voter_addrs.items()))

    def node_host(self, node_id: int) -> str:
        return self.nodes[node_id].host or self.host

    def node_dir(self, node_id: int) -> str:
        return os.path.join(self.root, f"node-{node_id}")

    def data_dir(self, node_id: int) -> str:
        return os.path.join(self.node_dir(node_id), "data")

    def log_path(self, node_id: int) -> str:
        return os.path.join(self.node_dir(node_id), "broker.log")

    def config_for(self, node_id: int) -> dict[str, Any]:
        spec = self.nodes[node_id]
        cfg = {
            "node_id": node_id,
            "cluster_id": self.cluster_id,
            "data_dir": self.data_dir(node_id),
            "listen": f"{self.node_host(node_id)}:{spec.port}",
            "admin_listen": f"{self.node_host(node_id)}:{spec.admin_port}",
            "voters": self.voters_string,
            "log_file": self.log_path(node_id),
            **self._kafka_settings(node_id),
            # The launcher's admin user certificate bypasses ACLs (Kafka's super.users).
            "super_users": ["User:admin"],
        }
        if self.dynamic:
            cfg["dynamic_voters"] = True
        if self.insecure:
            cfg["security_protocol"] = "PLAINTEXT"
        else:
            cfg.update(security_protocol="SSL", ssl_ca_file=os.path.join(self.cert_dir, "ca.crt"),
                       ssl_cert_file=os.path.join(self.cert_dir, f"node-{node_id}.crt"),
                       ssl_key_file=os.path.join(self.cert_dir, f"node-{node_id}.key"))
        cfg.update(self.common)
        cfg.update(spec.extra)
        return cfg

    def kafka_bootstrap(self) -> list[tuple[int, str, int]]:
        """(node id, host, port) of every node's Kafka listener: Kafka clients' bootstrap.servers."""
        return [(nid, self.node_host(nid), spec.kafka_port) for nid, spec in sorted(self.nodes.items())
                if spec.kafka_port is not None and not spec.removed]

    def _kafka_settings(self, node_id: int) -> dict[str, str]:
        port = self.nodes[node_id].kafka_port
        if port is None:
            return {}
        return {"kafka_listen": f"{self.node_host(node_id)}:{port}",
                "kafka_endpoints": ",".join(f"{nid}@{h}:{p}" for nid, h, p in self.kafka_bootstrap())}

    @property
    def kafka_properties_path(self) -> str:
        """<root>/kafka-client.properties: librdkafka's and Java's client
        properties for this cluster (``kcat -F``, confluent-kafka, kafka-*.sh --command-config)."""
        return os.path.join(self.root, "kafka-client.properties")

    def _write_kafka_properties(self) -> None:
        lines = ["# Kafka clients of this local cluster (written by metalog cluster up)",
                 "bootstrap.servers=" + ",".join(f"{h}:{p}" for _, h, p in self.kafka_bootstrap())]
        if self.insecure:
            lines.append("security.protocol=PLAINTEXT")
        else:
            d = self.cert_dir
            lines += ["security.protocol=SSL", f"ssl.ca.location={d}/ca.crt",
                      f"ssl.certificate.location={d}/admin.crt", f"ssl.key.location={d}/admin.key"]
        atomic_write(self.kafka_properties_path, ("\n".join(lines) + "\n").encode())

    def ensure_certs(self) -> None:
        """CA + one certificate per node (SANs: the host it listens on and the
        hosts it is dialled by, e.g. a fault proxy's) + the `admin` user; kept
        across restarts. Also writes <root>/client.yaml for the CLI."""
        os.makedirs(self.root, exist_ok=True)
        if not self.insecure:
            hosts = {nid: sorted({self.host, self.node_host(nid), "127.0.0.1", "localhost",
                                  *(h for vid, (h, _) in self.voter_addrs.items() if vid == nid)})
                     for nid in self.nodes}
            cluster_certs(self.cert_dir, hosts, users=("admin",))
        first = min(self.nodes)
        ClientConfig(
            bootstrap=",".join(f"{h}:{p}" for h, p in self.bootstrap()), cluster_id=self.cluster_id,
            admin=f"{self.admin_scheme}://{self.node_host(first)}:{self.nodes[first].admin_port}",
            security_protocol="PLAINTEXT" if self.insecure else "SSL",
            ssl_ca_file=None if self.insecure else os.path.join(self.cert_dir, "ca.crt"),
            ssl_cert_file=None if self.insecure else os.path.join(self.cert_dir, "admin.crt"),
            ssl_key_file=None if self.insecure else os.path.join(self.cert_dir, "admin.key"),
        ).write(self.client_config_path)
        if self.kafka_bootstrap():
            self._write_kafka_properties()

    @property
    def client_config_path(self) -> str:
        return os.path.join(self.root, "client.yaml")

    @property
    def admin_scheme(self) -> str:
        return "http" if self.insecure else "https"

    def client_tls(self) -> Any:
        """The `admin` user's TLS files for clients in this process (None when insecure)."""
        if self.insecure:
            return None
        if self._client_tls is None:
            self.ensure_certs()
            d = self.cert_dir
            self._client_tls = TlsFiles(TlsPaths(f"{d}/ca.crt", f"{d}/admin.crt", f"{d}/admin.key"))
        return self._client_tls

    # ----------------------------------------------------------- state on disk
    @property
    def state_path(self) -> str:
        return os.path.join(self.root, "cluster.json")

    def pid_path(self, node_id: int) -> str:
        return os.path.join(self.node_dir(node_id), "broker.pid")

    def save_state(self) -> None:
        """<root>/cluster.json: what `metalog cluster status|down|restart ...` need
        to find and restart the nodes from another process."""
        os.makedirs(self.root, exist_ok=True)
        state = {
            "cluster_id": self.cluster_id, "host": self.host, "insecure": self.insecure, "dynamic": self.dynamic,
            # Relative to root when under it: a moved cluster directory still finds its certificates.
            "cert_dir": os.path.relpath(self.cert_dir, self.root) if _under(self.cert_dir, self.root)
            else self.cert_dir,
            "common": self.common, "voter_addrs": {str(k): list(v) for k, v in self.voter_addrs.items()},
            "nodes": [{"node_id": n.node_id, "port": n.port, "admin_port": n.admin_port, "voter": n.voter,
                       "extra": n.extra, "command": n.command, "directory_id": n.directory_id,
                       "formatted": n.formatted, "removed": n.removed, "config_sha256": n.config_sha256,
                       "host": n.host, "exec_prefix": n.exec_prefix, "kafka_port": n.kafka_port}
                      for n in sorted(self.nodes.values(), key=lambda n: n.node_id)],
        }
        atomic_write(self.state_path, (json.dumps(state, indent=2) + "\n").encode())

    @classmethod
    def load(cls, root: str) -> "LocalCluster":
        """The cluster a `metalog cluster up` started in root (raises FileNotFoundError
        naming cluster.json when there is none)."""
        path = os.path.join(os.path.abspath(root), "cluster.json")
        with open(path) as f:
            state = json.load(f)
        nodes = [NodeSpec(n["node_id"], n["port"], n["admin_port"], n["voter"], n.get("extra") or {},
                          n.get("command"), n.get("directory_id"), bool(n.get("formatted")),
                          bool(n.get("removed")), n.get("config_sha256"), n.get("host"), n.get("exec_prefix"),
                          n.get("kafka_port"))
                 for n in state["nodes"]]
        voter_addrs = {int(k): (v[0], int(v[1])) for k, v in state.get("voter_addrs", {}).items()} or None
        return cls(root, nodes, cluster_id=state["cluster_id"], host=state["host"],
                   common=state.get("common"), voter_addrs=voter_addrs, insecure=state["insecure"],
                   dynamic=bool(state.get("dynamic", False)), cert_dir=state.get("cert_dir"))

    def running_pid(self, node_id: int) -> int | None:
        """The pid in node-N/broker.pid if that process is still the one started
        (same pid and kernel start time), else None: a stale pid file, or a pid
        reused by another program, is never signalled."""
        try:
            with open(self.pid_path(node_id)) as f:
                pid_s, start_s = f.read().split()
            pid = int(pid_s)
        except (OSError, ValueError):
            return None
        stat = _proc_stat(pid)
        if stat is None or stat[0] in ("Z", "X") or stat[1] != start_s:
            return None
        return pid

    def paused(self, node_id: int) -> bool:
        pid = self.running_pid(node_id)
        if pid is None:
            return False
        stat = _proc_stat(pid)
        return stat is not None and stat[0] in ("T", "t")

    def config_path(self, node_id: int) -> str:
        return os.path.join(self.node_dir(node_id), "broker.yaml")

    def write_config(self, node_id: int) -> str:
        """Write node-N/broker.yaml from the cluster's state (ConfigEditedError
        if the file there was edited by hand since the last write)."""
        edit = self.hand_edit(node_id)
        if edit is not None:
            raise ConfigEditedError(edit)
        self.ensure_certs()
        os.makedirs(self.node_dir(node_id), exist_ok=True)
        text = yaml.safe_dump(self.config_for(node_id), sort_keys=False).encode()
        path = self.config_path(node_id)
        atomic_write(path, text)
        self.nodes[node_id].config_sha256 = _sha256(text)
        return path

    def hand_edit(self, node_id: int) -> str | None:
        """None if node-N/broker.yaml may be (re)written: absent, as the launcher
        last wrote it, or saying what the launcher would write now; else the
        one-line refusal: what changed, where settings belong, how to keep it."""
        path, spec = self.config_path(node_id), self.nodes[node_id]
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        # No record: written by a launcher from before the records (or never by one); ours to write.
        if spec.config_sha256 is None or _sha256(data) == spec.config_sha256:
            return None
        want = self.config_for(node_id)
        try:
            edited = yaml.safe_load(data)
        except yaml.YAMLError:
            edited = None
        if edited == want:
            return None
        changed = {k: v for k, v in edited.items() if want.get(k) != v} if isinstance(edited, dict) else {}
        flags = [f"{node_id}:{k}={_flag_value(v)}" for k, v in changed.items()
                 if k not in LAYOUT_KEYS and _flag_value(v) is not None]
        keep = (f"to keep this edit, add `{' '.join(f'--node-set {shlex.quote(f)}' for f in flags)}` to "
                f"`metalog cluster up`; " if flags and len(flags) == len(changed) else "")
        return (f"{path} was edited by hand since `metalog cluster up` wrote it (it is rewritten from cluster.json "
                f"at every start): broker settings belong in `--set KEY=VALUE` (every broker) or "
                f"`--node-set {node_id}:KEY=VALUE` (this one), which cluster.json keeps; {keep}"
                f"to drop it, delete {path}")

    def hand_edits(self, node_ids: list[int] | None = None) -> list[str]:
        """hand_edit's refusals for the nodes the launcher writes a broker.yaml for."""
        ids = node_ids or sorted(self.nodes)
        return [e for e in (self.hand_edit(nid) for nid in ids if self.nodes[nid].command is None) if e]

    def apply_settings(self, common: dict[str, str], per_node: dict[int, dict[str, str]]) -> None:
        """Broker settings for every node (`common`) or one (`per_node`), each as
        ``key=value`` text: checked against the broker's config schema and typed
        as the broker reads them, then kept (cluster.json's `common`, each
        node's `extra`). Raises ValueError, one line naming the setting."""
        for nid in per_node:
            if nid not in self.nodes:
                raise ValueError(f"--node-set {nid}:...: no node {nid} in the cluster "
                                 f"(nodes: {', '.join(map(str, sorted(self.nodes)))})")
        typed_common = dict(self._typed_setting(f"--set {k}={v}", min(self.nodes), k, v) for k, v in common.items())
        typed_nodes = {nid: dict(self._typed_setting(f"--node-set {nid}:{k}={v}", nid, k, v) for k, v in s.items())
                       for nid, s in per_node.items()}
        self.common.update(typed_common)
        for nid, settings in typed_nodes.items():
            self.nodes[nid].extra.update(settings)
        for nid in sorted(self.nodes):  # together, too: the cross-setting rules
            try:
                config_from_dict(self.config_for(nid), check_files=False)
            except ConfigError as exc:
                raise ValueError(f"node {nid} with --set/--node-set: {exc}") from None

    def _typed_setting(self, flag: str, node_id: int, key: str, text: str) -> tuple[str, Any]:
        """(canonical flat key, value as the broker reads it) for one `--set`."""
        try:
            nested, _ = normalize({key: text})
        except ConfigError as exc:
            raise ValueError(f"{flag}: {exc}") from None
        section, value = next(iter(nested.items()))
        name = next(iter(value)) if section in SECTIONS else section
        if name in LAYOUT_KEYS:
            raise ValueError(f"{flag}: {name} comes from the cluster's layout (--voters, --observers, "
                             f"--base-port, --cluster-id, --insecure, --static-voters), not from --set")
        first_error: Exception | None = None
        # As text first (what `metalog broker --set` passes), then as YAML (lists: super_users=[User:a]).
        for as_yaml in (False, True):
            try:
                candidate = yaml.safe_load(text) if as_yaml else text
                cfg = config_from_dict({**self.config_for(node_id), name: candidate}, check_files=False)
            except (ConfigError, yaml.YAMLError) as exc:
                first_error = first_error or exc
                continue
            got = getattr(getattr(cfg, section), name) if section in SECTIONS else getattr(cfg, name)
            return (name, list(got) if isinstance(got, tuple) else got)
        raise ValueError(f"{flag}: {first_error}")

    # ----------------------------------------------------------- lifecycle
    def start(self, node_ids: list[int] | None = None) -> None:
        """Start the nodes (all by default); nothing starts if a node's
        broker.yaml was edited by hand (ConfigEditedError)."""
        ids = node_ids or sorted(self.nodes)
        edits = self.hand_edits(ids)
        if edits:
            raise ConfigEditedError(edits[0])
        self.save_state()
        for nid in ids:
            self.start_node(nid)

    def initial_controllers(self) -> list[tuple[int, str, int, str]]:
        """The first voter set, as --initial-controllers takes it: (id, host, port, directory id)."""
        return [(nid, h, p, self.nodes[nid].directory_id) for nid, (h, p) in sorted(self.voter_addrs.items())
                if self.nodes[nid].directory_id]

    def format_node(self, node_id: int) -> None:
        """Format a dynamic cluster's data dir once, before the node first starts:
        a first voter gets the bootstrap checkpoint naming every first voter
        (``--initial-controllers``), any other node none (``--no-initial-controllers``).
        Never again after that: a wiped dir must come back as a new replica."""
        spec = self.nodes[node_id]
        assert self.dynamic and not spec.formatted and spec.directory_id
        if not os.path.exists(os.path.join(self.data_dir(node_id), META_FILE)):
            first_voters = self.initial_controllers()
            controllers = first_voters if any(c[0] == node_id for c in first_voters) else None
            format_data_dir(self.data_dir(node_id), self.cluster_id, node_id, spec.directory_id, controllers)
        spec.formatted = True
        self.save_state()

    def start_node(self, node_id: int) -> subprocess.Popen:
        assert node_id not in self.procs or self.procs[node_id].poll() is not None, f"node {node_id} running"
        spec = self.nodes[node_id]
        cmd = spec.command
        if cmd is None:  # a node with its own command line (a compose service) has its own config
            written = spec.config_sha256
            path = self.write_config(node_id)
            if spec.config_sha256 != written:  # another process must know this file is the launcher's
                self.save_state()
            cmd = [sys.executable, "-m", "metalog.broker.server.main", "--config", path]
        else:
            self.ensure_certs()
            os.makedirs(self.node_dir(node_id), exist_ok=True)
        if self.dynamic and not spec.formatted:
            self.format_node(node_id)
        cmd = (spec.exec_prefix or []) + cmd
        stderr = open(os.path.join(self.node_dir(node_id), "stderr.log"), "ab")
        env = dict(os.environ)
        proc = subprocess.Popen(cmd, stdout=stderr, stderr=stderr, env=env, cwd=REPO_ROOT,
                                start_new_session=True)
        stderr.close()
        self.procs[node_id] = proc
        stat = _proc_stat(proc.pid)
        with open(self.pid_path(node_id), "w") as f:
            f.write(f"{proc.pid} {stat[1] if stat else 0}\n")
        return proc

    def alive(self, node_id: int) -> bool:
        """Running: a process this object started, else (a cluster loaded from
        cluster.json by another process) the one its pid file names."""
        p = self.procs.get(node_id)
        if p is not None:
            return p.poll() is None
        return self.running_pid(node_id) is not None

    def terminate(self, node_id: int, timeout_s: float = 15.0) -> None:
        """SIGTERM the node wherever it was started from (SIGCONT first: a paused
        broker cannot handle it); SIGKILL if it has not exited after timeout_s."""
        if node_id in self.procs:
            self.signal(node_id, signal.SIGCONT)
            self.stop_node(node_id, timeout_s)
            return
        pid = self.running_pid(node_id)
        if pid is None:
            return
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGTERM)
        try:
            self.wait_for(lambda: self.running_pid(node_id) is None, timeout_s, f"node {node_id} to exit")
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self.wait_for(lambda: self.running_pid(node_id) is None, 10.0, f"node {node_id} to exit after SIGKILL")

    def signal(self, node_id: int, sig: int) -> None:
        p = self.procs.get(node_id)
        if p is not None and p.poll() is None:
            os.kill(p.pid, sig)

    def kill(self, node_id: int) -> None:
        """kill -9: the node loses whatever it had not fsynced."""
        self.signal(node_id, signal.SIGKILL)
        p = self.procs.get(node_id)
        if p is not None:
            p.wait(timeout=30)

    def stop_node(self, node_id: int, timeout_s: float = 15.0) -> int | None:
        p = self.procs.get(node_id)
        if p is None or p.poll() is not None:
            return p.returncode if p else None
        os.kill(p.pid, signal.SIGTERM)
        try:
            return p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            return p.wait(timeout=30)

    def stop(self) -> None:
        for nid in list(self.procs):
            self.signal(nid, signal.SIGCONT)  # a paused node cannot handle SIGTERM
            self.stop_node(nid)

    # ----------------------------------------------------------- observing
    def admin(self, node_id: int, path: str, timeout_s: float = 2.0) -> dict | None:
        """GET an admin path as JSON, None if the node does not answer 200.

        Connections are kept alive per thread and node: drills poll /quorum
        many times a second, and a TLS handshake per poll would cost the
        brokers real CPU."""
        key = (threading.get_ident(), node_id)
        for attempt in (0, 1):  # a kept connection may have died with its broker: retry once, fresh
            conn = self._admin_conns.get(key)
            fresh = conn is None
            try:
                if conn is None:
                    port, host = self.nodes[node_id].admin_port, self.node_host(node_id)
                    conn = (http.client.HTTPConnection(host, port, timeout=timeout_s) if self.insecure else
                            http.client.HTTPSConnection(host, port, timeout=timeout_s,
                                                        context=self.client_tls().client()))
                    self._admin_conns[key] = conn
                conn.timeout = timeout_s
                if conn.sock is not None:
                    conn.sock.settimeout(timeout_s)
                conn.request("GET", path)
                resp = conn.getresponse()
                body = resp.read()
                return json.loads(body) if resp.status == 200 else None
            except (OSError, http.client.HTTPException, ValueError):
                self._admin_conns.pop(key, None)
                if conn is not None:
                    conn.close()
                if fresh or attempt:
                    return None
        return None

    def quorum(self, node_id: int) -> dict | None:
        return self.admin(node_id, "/quorum")

    def metadata_state(self, node_id: int) -> dict | None:
        """The node's whole controller state, read page by page through the
        admin API (for tests and drills on small states: the API never serves
        it in one answer). Same shape as ControllerState.to_json(); None if a
        page fails or the state moved while it was being read."""
        def pages(path: str, key: str) -> list | None:
            items: list = []
            after = None
            for _ in range(100_000):  # bounded: a page holds up to 1000 items
                q = f"{path}{'&' if '?' in path else '?'}limit=1000" + (
                    "" if after is None else f"&after={urllib.parse.quote(str(after))}")
                page = self.admin(node_id, q)
                if page is None:
                    return None
                got = page[key]
                items += [got] if isinstance(got, dict) else got  # a page of configs is one dict
                after = page["next"]
                if after is None:
                    return items
            return None

        summary = self.admin(node_id, "/metadata")
        brokers = pages("/metadata/brokers", "brokers")
        topics = pages("/metadata/topics", "topics")
        acls = pages("/metadata/acls", "acls")
        if summary is None or brokers is None or topics is None or acls is None:
            return None
        partitions: list = []
        configs: list = []
        resources = [("topic", t["name"]) for t in topics] + [("broker", str(b["broker_id"])) for b in brokers]
        for t in topics:
            got = pages(f"/metadata/topics/{urllib.parse.quote(t['name'], safe='')}/partitions", "partitions")
            if got is None:
                return None
            partitions += got
        for kind, name in resources + [("broker", "")]:
            got = pages(f"/metadata/configs?type={kind}&name={urllib.parse.quote(name)}", "configs")
            if got is None:
                return None
            rt = 2 if kind == "topic" else 4
            configs += [{"resource_type": rt, "resource_name": name, "name": k, "value": v}
                        for page in got for k, v in page.items()]
        if self.admin(node_id, "/metadata") != summary:
            return None  # it moved while we read: the caller polls again
        partitions.sort(key=lambda p: (p["topic"], p["partition"]))
        configs.sort(key=lambda c: (c["resource_type"], c["resource_name"], c["name"]))
        return {"offset": summary["offset"], "brokers": brokers, "topics": topics, "partitions": partitions,
                "configs": configs, "features": summary["features"], "acls": acls}

    def leader(self) -> tuple[int, int] | None:
        """(leader id, epoch) that a live leader itself reports, the highest epoch."""
        best = None
        for nid in self.nodes:
            if not self.alive(nid):
                continue
            q = self.quorum(nid)
            if q and q.get("role") == "leader" and (best is None or q["epoch"] > best[1]):
                best = (nid, q["epoch"])
        return best

    def wait_for(self, predicate, timeout_s: float, what: str, poll_s: float = 0.05):
        deadline = time.monotonic() + timeout_s
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
            time.sleep(poll_s)

    def wait_for_leader(self, timeout_s: float = 20.0, exclude: set[int] = frozenset()) -> tuple[int, int]:
        def has_leader():
            found = self.leader()
            return found if found and found[0] not in exclude else None

        return self.wait_for(has_leader, timeout_s, "a leader")

    def bootstrap(self) -> list[tuple[str, int]]:
        return [(spec.host or self.host, spec.port) for spec in self.nodes.values()]

    def read_log_lines(self, node_id: int) -> list[dict]:
        out = []
        try:
            with open(self.log_path(node_id)) as f:
                for line in f:
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        continue
        except FileNotFoundError:
            pass
        return out
