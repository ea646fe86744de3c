"""docker-compose topology: validate it against BrokerConfig and run it locally.

No Docker engine runs on our machines, so the compose file is exercised two
ways without one:

* ``load_topology(path)`` parses ``docker-compose.yml`` and checks every broker
  service against the broker's own config schema (``metalog.broker.server.config``): each
  service's effective config (the ``configs:`` file it mounts at the path its
  ``--config`` names, plus its ``--set`` overrides) must validate; node ids,
  listen, admin and Kafka ports and published ports are unique; every broker
  lists the same voters and every voter names a broker service by hostname
  and listen port; data and log live on a named, declared volume that no
  other broker mounts; the healthcheck requests ``/health`` on the admin port;
  every broker lists the same ``kafka_endpoints``, which name each Kafka
  listener where a client reaches it (``_check_kafka``).
  Any breach raises ``ComposeError`` naming the service and the key. The
  metrics services (``prometheus``, ``grafana`` and their one-shot helpers)
  are checked on top of this by ``metalog.tools.cluster.monitoring.check_monitoring``.

* ``cluster_from_compose(path, root_dir)`` turns the broker services into a
  ``LocalCluster`` that runs the services' own command lines as local
  processes. The mapping is deterministic:

  - ``metalog broker ARGS`` -> ``<python> -m metalog.tools.cli broker ARGS`` (the
    console script's own entry point);
  - a service hostname (or ``0.0.0.0``) -> ``127.0.0.1``;
  - container port P -> local port ``P + port_offset`` (container ports are
    distinct across brokers, checked above, so this never collides);
  - named volume V mounted by the broker with node id N -> ``<root>/node-N``
    (the LocalCluster node dir, so data sits in ``node-N/data`` and the log in
    ``node-N/broker.log`` exactly as for ``metalog cluster up``); any other
    volume -> ``<root>/volumes/V``;
  - a ``configs:`` entry -> ``<root>/configs/<name>.yaml`` with the same
    content, rewritten by the same host/port/path rules.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any

import yaml

from metalog.broker.server.config import BrokerConfig, ConfigError, config_from_dict, parse_voters
from metalog.tools.cluster.launcher import LocalCluster, NodeSpec


class ComposeError(ValueError):
    """The compose file cannot describe a working metalog cluster; says why."""


LOOPBACK = "127.0.0.1"
_HEALTH_URL = re.compile(r"https?://([A-Za-z0-9_.\-]+):(\d+)/health\b")


@dataclass
class BrokerService:
    name: str
    hostname: str
    command: list[str]
    config_path: str  # in-container path given to --config
    config: BrokerConfig  # effective config, validated
    mounts: dict[str, str]  # container path -> named volume
    published: list[tuple[int, int]]  # (host port, container port)
    health_url: tuple[str, int] | None


@dataclass
class Topology:
    path: str
    brokers: list[BrokerService]
    configs: dict[str, str]  # config name -> content
    config_targets: dict[str, str] = field(default_factory=dict)  # container path -> config name
    volumes: set[str] = field(default_factory=set)
    services: dict[str, dict] = field(default_factory=dict)

    def by_node(self) -> dict[int, BrokerService]:
        return {b.config.node_id: b for b in self.brokers}

    @property
    def voter_ids(self) -> set[int]:
        return set(parse_voters(self.brokers[0].config.voters)) if self.brokers else set()

    def container_ports(self) -> list[int]:
        out = []
        for b in self.brokers:
            out.append(b.config.listen_endpoint().port)
            for ep in (b.config.admin_endpoint(), b.config.kafka_endpoint()):
                if ep is not None:
                    out.append(ep.port)
        return out


def _as_list(command: Any, where: str) -> list[str]:
    if isinstance(command, str):
        return shlex.split(command)
    if isinstance(command, list) and all(isinstance(c, (str, int, float)) for c in command):
        return [str(c) for c in command]
    raise ComposeError(f"{where}: command must be a string or a list of strings")


def _is_broker_command(cmd: list[str]) -> bool:
    return len(cmd) >= 2 and os.path.basename(cmd[0]) == "metalog" and cmd[1] == "broker"


def _broker_args(cmd: list[str], where: str) -> tuple[str, dict[str, str]]:
    config_path, overrides = None, {}
    i = 2
    while i < len(cmd):
        arg = cmd[i]
        if arg in ("--config", "--set"):
            if i + 1 >= len(cmd):
                raise ComposeError(f"{where}: {arg} needs a value")
            value = cmd[i + 1]
            if arg == "--config":
                config_path = value
            else:
                key, sep, val = value.partition("=")
                if not sep:
                    raise ComposeError(f"{where}: --set {value!r}: expected key=value")
                overrides[key] = val
            i += 2
        elif arg.startswith("--config="):
            config_path = arg.split("=", 1)[1]
            i += 1
        else:
            raise ComposeError(f"{where}: unexpected broker argument {arg!r}")
    if config_path is None:
        raise ComposeError(f"{where}: the broker command needs --config")
    return config_path, overrides


def _mounts(svc: dict, where: str) -> dict[str, str]:
    out = {}
    for item in svc.get("volumes") or []:
        if isinstance(item, str):
            parts = item.split(":")
            if len(parts) < 2:
                continue  # anonymous volume: not persistent across re-creation
            source, target = parts[0], parts[1]
        elif isinstance(item, dict):
            source, target = item.get("source"), item.get("target")
        else:
            raise ComposeError(f"{where}: volumes: unreadable entry {item!r}")
        if source and target and not source.startswith((".", "/", "~")):
            out[target] = source
    return out


def _published(svc: dict, where: str) -> list[tuple[int, int]]:
    out = []
    for item in svc.get("ports") or []:
        text = str(item) if not isinstance(item, dict) else f"{item.get('published')}:{item.get('target')}"
        parts = text.split(":")
        try:
            host, container = (int(parts[-2]), int(parts[-1])) if len(parts) >= 2 else (int(parts[0]), int(parts[0]))
        except ValueError:
            raise ComposeError(f"{where}: ports: expected HOST:CONTAINER numbers, got {item!r}") from None
        out.append((host, container))
    return out


def _health(svc: dict) -> tuple[str, int] | None:
    test = (svc.get("healthcheck") or {}).get("test")
    text = " ".join(test) if isinstance(test, list) else str(test or "")
    m = _HEALTH_URL.search(text)
    return (m.group(1), int(m.group(2))) if m else None


def _under(path: str, mount: str) -> bool:
    return path == mount or path.startswith(mount.rstrip("/") + "/")


def parse_topology(doc: Any, path: str = "docker-compose.yml") -> Topology:
    """Validate a parsed compose document; raise ComposeError naming the breach."""
    if not isinstance(doc, dict) or not isinstance(doc.get("services"), dict):
        raise ComposeError(f"{path}: expected a compose file with a `services:` mapping")
    configs = {}
    for name, spec in (doc.get("configs") or {}).items():
        if not isinstance(spec, dict) or "content" not in spec:
            raise ComposeError(f"{path}: configs.{name}: only inline `content:` configs are supported")
        configs[name] = str(spec["content"])
    declared_volumes = set((doc.get("volumes") or {}).keys())
    topo = Topology(path=path, brokers=[], configs=configs, volumes=declared_volumes, services=doc["services"])

    for name, svc in doc["services"].items():
        where = f"{path}: service {name}"
        if not isinstance(svc, dict) or "command" not in svc:
            continue
        cmd = _as_list(svc["command"], where)
        if not _is_broker_command(cmd):
            continue
        config_path, overrides = _broker_args(cmd, where)
        targets = {}
        for ref in svc.get("configs") or []:
            src, tgt = (ref, f"/{ref}") if isinstance(ref, str) else (ref.get("source"), ref.get("target") or f"/{ref.get('source')}")
            if src not in configs:
                raise ComposeError(f"{where}: configs: {src!r} is not declared under top-level configs")
            targets[tgt] = src
        if config_path not in targets:
            raise ComposeError(f"{where}: --config {config_path} is not a mounted config "
                               f"(mounted: {sorted(targets) or 'none'})")
        topo.config_targets.update(targets)
        base = yaml.safe_load(configs[targets[config_path]]) or {}
        if not isinstance(base, dict):
            raise ComposeError(f"{where}: config {targets[config_path]!r} must be a mapping of keys")
        data = {**base, **overrides}
        try:
            cfg = config_from_dict(data, check_files=False)  # TLS paths are inside the container
        except ConfigError as exc:
            raise ComposeError(f"{where}: {exc}") from None
        topo.brokers.append(BrokerService(
            name=name, hostname=str(svc.get("hostname") or name), command=cmd, config_path=config_path,
            config=cfg, mounts=_mounts(svc, where), published=_published(svc, where), health_url=_health(svc)))

    if not topo.brokers:
        raise ComposeError(f"{path}: no service runs `metalog broker`")
    _check(topo)
    return topo


def _check(topo: Topology) -> None:
    path = topo.path
    seen_ids: dict[int, str] = {}
    seen_ports: dict[int, str] = {}
    seen_published: dict[int, str] = {}
    seen_volumes: dict[str, str] = {}
    voters_text = topo.brokers[0].config.voters
    by_host = {b.hostname: b for b in topo.brokers} | {b.name: b for b in topo.brokers}
    for b in topo.brokers:
        where = f"{path}: service {b.name}"
        cfg = b.config
        if cfg.node_id in seen_ids:
            raise ComposeError(f"{where}: node_id {cfg.node_id} is also used by service {seen_ids[cfg.node_id]}")
        seen_ids[cfg.node_id] = b.name
        admin = cfg.admin_endpoint()
        if admin is None:
            raise ComposeError(f"{where}: admin_listen is required (healthchecks use the admin API)")
        kafka = cfg.kafka_endpoint()
        for key, port in (("listen", cfg.listen_endpoint().port), ("admin_listen", admin.port),
                          ("kafka_listen", kafka.port if kafka else None)):
            if port is None:
                continue
            if port in seen_ports:
                raise ComposeError(f"{where}: {key} port {port} is also used by {seen_ports[port]} "
                                   "(container ports must be distinct so the local mapping is 1:1)")
            seen_ports[port] = f"service {b.name}"
        for host_port, _ in b.published:
            if host_port in seen_published:
                raise ComposeError(f"{where}: published port {host_port} is also published by {seen_published[host_port]}")
            seen_published[host_port] = f"service {b.name}"
        if parse_voters(cfg.voters) != parse_voters(voters_text):
            raise ComposeError(f"{where}: voters {cfg.voters!r} differ from service "
                               f"{topo.brokers[0].name}'s {voters_text!r}; every broker must list the same voters")
        # data and log on a declared named volume of their own
        for key, p in (("data_dir", cfg.data_dir), ("log_file", cfg.log_file)):
            if p is None:
                continue
            vol = next((v for m, v in b.mounts.items() if _under(p, m)), None)
            if vol is None:
                raise ComposeError(f"{where}: {key} {p} is not on a named volume (mounts: {b.mounts or 'none'})")
            if vol not in topo.volumes:
                raise ComposeError(f"{where}: volume {vol!r} is not declared under top-level volumes")
            if seen_volumes.get(vol, b.name) != b.name:
                raise ComposeError(f"{where}: volume {vol!r} is also used by service {seen_volumes[vol]}; "
                                   "each broker needs its own")
            seen_volumes[vol] = b.name
        if cfg.tls_enabled:
            for key in ("ssl_ca_file", "ssl_cert_file", "ssl_key_file"):
                p = getattr(cfg.security, key)
                if not any(_under(p, m) for m in b.mounts):
                    raise ComposeError(f"{where}: {key} {p} is not on a mounted volume (mounts: {b.mounts or 'none'}); "
                                       "mount the volume the `certs` service writes")
        if b.health_url is None:
            raise ComposeError(f"{where}: healthcheck must request http(s)://127.0.0.1:<admin port>/health")
        if b.health_url[1] != admin.port or b.health_url[0] not in ("127.0.0.1", "localhost", b.hostname):
            raise ComposeError(f"{where}: healthcheck hits {b.health_url[0]}:{b.health_url[1]} "
                               f"but the admin API listens on port {admin.port}")
    for vid, ep in parse_voters(voters_text).items():
        owner = by_host.get(ep.host)
        if owner is None:
            raise ComposeError(f"{path}: voter {vid}@{ep} names host {ep.host!r}, which is no broker service")
        if owner.config.node_id != vid:
            raise ComposeError(f"{path}: voter {vid}@{ep} points at service {owner.name}, which runs node {owner.config.node_id}")
        if owner.config.listen_endpoint().port != ep.port:
            raise ComposeError(f"{path}: voter {vid}@{ep}: service {owner.name} listens on port "
                               f"{owner.config.listen_endpoint().port}")
    _check_kafka(topo, by_host)


def _check_kafka(topo: Topology, by_host: dict[str, BrokerService]) -> None:
    """Kafka clients find every broker: the same kafka_endpoints everywhere,
    naming each broker with a Kafka listener at an address that reaches it --
    its service hostname and kafka_listen port (clients inside the compose
    network), or localhost / 127.0.0.1 and a port published to it (clients
    on the Docker host, as the shipped file does)."""
    path = topo.path
    first = topo.brokers[0]
    endpoints = first.config.kafka_node_endpoints() if first.config.kafka_endpoints else {}
    for b in topo.brokers:
        where = f"{path}: service {b.name}"
        cfg = b.config
        if (cfg.kafka_endpoints or None) != (first.config.kafka_endpoints or None):
            raise ComposeError(f"{where}: kafka_endpoints {cfg.kafka_endpoints!r} differ from service "
                               f"{first.name}'s {first.config.kafka_endpoints!r}; every broker must list the same")
        kafka = cfg.kafka_endpoint()
        if kafka is None:
            continue
        ep = endpoints.get(cfg.node_id)
        if ep is None:
            raise ComposeError(f"{where}: kafka_listen is set but kafka_endpoints does not name node "
                               f"{cfg.node_id}: Kafka clients would never be told where it is")
        if ep.host in ("localhost", LOOPBACK):
            if (ep.port, kafka.port) not in b.published:
                raise ComposeError(f"{where}: kafka_endpoints advertises {cfg.node_id}@{ep} but the service does "
                                   f"not publish {ep.port}:{kafka.port} (its kafka_listen port)")
        elif by_host.get(ep.host) is not b or ep.port != kafka.port:
            raise ComposeError(f"{where}: kafka_endpoints advertises {cfg.node_id}@{ep}, which is not this "
                               f"service's hostname and kafka_listen port ({b.hostname}:{kafka.port})")
    unknown = sorted(set(endpoints) - {b.config.node_id for b in topo.brokers if b.config.kafka_endpoint()})
    if unknown:
        raise ComposeError(f"{path}: kafka_endpoints names node {unknown[0]}, which runs no Kafka listener here")


def load_topology(path: str) -> Topology:
    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except OSError as exc:
        raise ComposeError(f"compose file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ComposeError(f"compose file {path}: not valid YAML: {exc}") from None
    return parse_topology(doc, path)


# ---------------------------------------------------------------- local run
class LocalMapping:
    """The deterministic container -> local mapping (module docstring)."""

    def __init__(self, topo: Topology, root: str, port_offset: int):
        self.topo = topo
        self.root = os.path.abspath(root)
        self.port_offset = port_offset
        self.hosts = {b.hostname for b in topo.brokers} | {b.name for b in topo.brokers} | {"0.0.0.0", "localhost", LOOPBACK}
        self.ports = set(topo.container_ports())
        self.volume_dirs: dict[str, str] = {}
        users: dict[str, int] = {}
        for b in topo.brokers:
            for vol in b.mounts.values():
                users[vol] = users.get(vol, 0) + 1
        for b in topo.brokers:
            for vol in b.mounts.values():
                if users[vol] == 1:  # a broker's own volume; shared ones (certs) go to <root>/volumes/V
                    self.volume_dirs.setdefault(vol, os.path.join(self.root, f"node-{b.config.node_id}"))
        self._addr = re.compile(r"\b(" + "|".join(re.escape(h) for h in sorted(self.hosts, key=len, reverse=True))
                                + r"):(\d+)\b")

    def port(self, container_port: int) -> int:
        return container_port + self.port_offset

    def volume_dir(self, volume: str) -> str:
        return self.volume_dirs.get(volume) or os.path.join(self.root, "volumes", volume)

    def config_file(self, name: str) -> str:
        return os.path.join(self.root, "configs", f"{name}.yaml")

    def rewrite(self, text: str, mounts: dict[str, str]) -> str:
        def addr(m: re.Match) -> str:
            port = int(m.group(2))
            return f"{LOOPBACK}:{self.port(port) if port in self.ports else port}"

        text = self._addr.sub(addr, text)
        if text in self.topo.config_targets:
            return self.config_file(self.topo.config_targets[text])
        for target, vol in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
            if _under(text, target):
                return self.volume_dir(vol) + text[len(target.rstrip("/")):]
            text = text.replace("=" + target.rstrip("/") + "/", "=" + self.volume_dir(vol) + "/")
            if text.endswith("=" + target):
                text = text[: -len(target)] + self.volume_dir(vol)
        return text

    def rewrite_block(self, content: str) -> str:
        """A config file's text with container addresses mapped (paths come from --set)."""
        def addr(m: re.Match) -> str:
            port = int(m.group(2))
            return f"{LOOPBACK}:{self.port(port) if port in self.ports else port}"

        return self._addr.sub(addr, content)

    def command(self, b: BrokerService) -> list[str]:
        args = [self.rewrite(a, b.mounts) for a in b.command[2:]]
        # The service's own command line, through the same CLI entry point the
        # console script runs (`metalog` -> metalog.tools.cli:main).
        return [sys.executable, "-m", "metalog.tools.cli", "broker", *args]


def cluster_from_compose(path: str, root_dir: str, port_offset: int | None = None, insecure: bool = False):
    """A LocalCluster running the compose file's broker services as processes.

    ``port_offset`` shifts every container port (tests pass a free range);
    default: $METALOG_COMPOSE_PORT_OFFSET or 0. The `certs` service's work
    (CA, node and admin certificates) is done by the launcher into the mapped
    certs volume; `insecure` runs the brokers with security_protocol PLAINTEXT."""
    if port_offset is None:
        port_offset = int(os.environ.get("METALOG_COMPOSE_PORT_OFFSET", "0"))

    topo = load_topology(path)
    mapping = LocalMapping(topo, root_dir, port_offset)
    os.makedirs(os.path.join(mapping.root, "configs"), exist_ok=True)
    for name, content in topo.configs.items():
        with open(mapping.config_file(name), "w") as f:
            f.write(mapping.rewrite_block(content))
    voters = parse_voters(topo.brokers[0].config.voters)
    specs = []
    for b in topo.brokers:
        cfg = b.config
        kafka = cfg.kafka_endpoint()
        specs.append(NodeSpec(node_id=cfg.node_id, port=mapping.port(cfg.listen_endpoint().port),
                              admin_port=mapping.port(cfg.admin_endpoint().port),
                              voter=cfg.node_id in voters, command=mapping.command(b),
                              kafka_port=mapping.port(kafka.port) if kafka else None))
    voter_addrs = {vid: (LOOPBACK, mapping.port(ep.port)) for vid, ep in voters.items()}
    first = topo.brokers[0]
    secure = first.config.tls_enabled and not insecure
    if insecure:
        for spec in specs:
            assert spec.command is not None
            spec.command += ["--set", "security_protocol=PLAINTEXT"]
    cert_dir = None
    if secure:
        # The certs volume: kept in cluster.json, so `metalog cluster status|restart ...`
        # from another process reach the brokers with the same CA and admin certificate.
        cert_file = first.config.security.ssl_cert_file
        if cert_file is None:
            raise ComposeError(f"{path}: service {first.name}: ssl_cert_file is required with TLS")
        cert_dir = os.path.dirname(mapping.rewrite(cert_file, first.mounts))
    cluster = LocalCluster(mapping.root, specs, cluster_id=first.config.cluster_id,
                           host=LOOPBACK, voter_addrs=voter_addrs, insecure=not secure, cert_dir=cert_dir)
    cluster.compose_mapping = mapping
    return cluster

