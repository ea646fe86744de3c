"""Broker configuration: typed sections, loaded from a YAML/JSON file or a dict.

Every setting is declared once, in its section's class, with its unit in the
name, its default, a one-line description and its range
(``metalog.broker.quorum.settings.setting``); cross-field rules live in the section's
``validate``. ``--help-config`` and docs/config.md are generated from the
same declarations (``python -m metalog.broker.server.config --markdown``).

Sections: the top level (node identity, addresses, logging), ``quorum``
(``QuorumConfig``, handed to the core as is), ``storage``, ``network`` and
``security``. Setting names are unique across sections, so a file may give
them flat (``election_timeout_ms: 1000``, the historical form the launcher,
compose file and drills write) or nested (``quorum: {election_timeout_ms:
1000}``), and ``--set`` takes ``election_timeout_ms=1000`` or
``quorum.election_timeout_ms=1000``. A bad value fails at start with a
message naming the key as it was written (``ConfigError: election_timeout_ms:
must be > 0, got -5``), never a stack trace deep inside the broker.

Example (YAML)::

    node_id: 1
    cluster_id: metalog-local
    data_dir: ./data/node-1
    listen: 127.0.0.1:9091
    admin_listen: 127.0.0.1:8091
    voters: "1@127.0.0.1:9091,2@127.0.0.1:9092,3@127.0.0.1:9093"
    quorum:
      election_timeout_ms: 1000
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import sys
from typing import Any

import msgspec
import yaml

from metalog.broker.net.principal import Principal
from metalog.broker.quorum.api import QuorumConfig
from metalog.broker.quorum.settings import SettingSpec, check_settings, setting, setting_fields
from metalog.broker.server.leader_slice import SLICE_US_MAX, SLICE_US_MIN
from metalog.protocol.invariants import InvariantViolation, invariant


class ConfigError(ValueError):
    pass


_WILDCARD_HOSTS = ("0.0.0.0", "::", "", "[::]")  # bind addresses no peer or client can connect to


class Endpoint(msgspec.Struct, frozen=True):
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclasses.dataclass(kw_only=True)
class StorageConfig:
    """The log on disk: group commit, segments, snapshots, integrity checks."""

    append_linger_ms: float = setting(
        0.0, "fixed group-commit window for client writes; 0 = adaptive (batch while an fdatasync runs)", ge=0)
    append_batch_records_max: int = setting(4096, "client records that end a group-commit batch at once", gt=0)
    leader_flush_thread: bool = setting(
        False, "a leader's fdatasync on a thread of its own instead of the event loop (after the step's "
               "answers leave); for disks whose sync takes milliseconds: the thread hand-off costs "
               "about 0.8 ms per flush")
    segment_bytes_max: int = setting(64 << 20, "size at which a log segment is rolled", ge=4096)
    log_scrub_bytes_per_s: int = setting(
        300_000, "background re-reading of sealed segments and snapshots (1 GiB in about an hour)",
        ge=0, note="0 disables the scrubber")
    log_scrub_idle_wait_ms: int = setting(
        60_000, "longest a scrubber with nothing sealed to read waits before listing the files again; "
                "a segment roll or a new snapshot wakes it at once (mid-pass: after the 1 MiB chunk it is "
                "reading)", gt=0)
    snapshot_min_records: int = setting(
        20000, "committed records since the last snapshot before a new one is written "
               "(controller.snapshot.minimum.records)", gt=0)
    snapshot_generation: str = setting(
        "fork", "how this broker writes its own snapshots: fork = a child process made by fork() encodes a "
                "copy-on-write image of the state (no GIL shared with the event loop, no copy on it); "
                "thread = the state is copied a slice at a time on the loop and encoded on a worker thread "
                "(the fallback where fork() is unavailable: commit latency rises while it runs)",
        choices=("fork", "thread"))
    snapshot_cpu_share: float = setting(
        0.35, "share of one CPU the snapshot writer may use: it pauses after each quarter millisecond of work, so that "
              "the quorum's processes find a CPU idle (on a 2-vCPU VM a busy background process, even at "
              "SCHED_IDLE, cost commit p99 several times over; docs/bench.md); 1 = no pauses",
        gt=0, le=1)
    producer_id_expiration_ms: int = setting(
        86_400_000, "an idempotent producer idle this long is forgotten; its next batch gets "
                    "UNKNOWN_PRODUCER_ID and the client takes a new producer id (producer.id.expiration.ms)",
        gt=0)
    consistency_check_interval_ms: int = setting(
        60000, "how often a leader compares its committed log's digest with every voter's",
        ge=0, note="0 = off")

    def validate(self) -> None:
        _raise_first(self)


@dataclasses.dataclass(kw_only=True)
class NetworkConfig:
    """Connections: frames, peer connects and reconnects, listener limits."""

    max_frame_bytes: int = setting(8 << 20, "largest request or response frame accepted", gt=0)
    connect_timeout_ms: int = setting(1000, "timeout of a TCP (and TLS) connect to a peer", gt=0)
    reconnect_backoff_max_ms: int = setting(
        1000, "cap of the exponential back-off between reconnects to a peer", gt=0)
    connections_max_idle_ms: int = setting(
        600_000, "an idle connection (or a half-sent frame that stalls) is closed after this (Kafka's name)",
        gt=0)
    max_connections: int = setting(4096, "open connections per listener", gt=0)
    max_connections_per_ip: int = setting(1024, "open connections per client address; <= max_connections",
                                          gt=0)
    failed_connections_before_backoff: int = setting(
        5, "consecutive failed handshakes / bad frames from one address before its new connections are "
           "delayed for a while",
        gt=0)
    failed_connection_backoff_ms: int = setting(
        1000, "first delay period for such an address; doubles per further failure", gt=0)
    failed_connection_backoff_max_ms: int = setting(60_000, "cap of that delay period", gt=0)
    failed_connection_backoff_drops_syns: bool = setting(
        True, "during its delay period the kernel drops such an address's new connections before accept "
              "(a socket filter on the listener, Linux and IPv4: a flood from it costs no accept, its "
              "client's SYN retries are its wait); false: they are accepted, and all but one closed")
    # Connection-rate limits (KIP-612): a connection above a rate is accepted and held (nothing read, no
    # handshake) until its turn, not refused. The voters' hosts are exempt from every connection limit.
    max_connection_creation_rate: float = setting(
        1000.0, "new connections a second a listener starts; faster ones wait their turn (Kafka's "
                "max.connection.creation.rate)", ge=0, note="0 = no limit")
    connection_creation_rate_per_ip: float = setting(
        100.0, "new connections a second from one client address, a burst of as many at once; faster ones "
               "wait their turn (Kafka's connection_creation_rate quota of an IP)", ge=0, note="0 = no limit")
    ssl_handshake_loop_share: float = setting(
        0.25, "share of one core TLS handshakes of new connections may take (measured; they run in a "
              "handshake thread), down to a fifth of it while most of them fail; more wait their turn, "
              "addresses with a completed handshake first, so a handshake flood cannot starve open connections",
        ge=0, le=1,
        note="0 = not paced")
    max_delayed_connections: int = setting(
        1024, "accepted connections waiting for their turn, per listener; above it the listener stops "
              "accepting (the kernel's backlog holds the rest)", gt=0)
    connection_limits_exempt_hosts: list[str] = setting(
        default_factory=list, doc="hosts (names or addresses) never delayed or refused by the connection "
                                  "limits, e.g. observers; the voters' hosts always are")
    refusal_log_interval_ms: int = setting(
        10_000, "repeated refusals (failed handshakes, bad frames, limits) are logged in full a few times "
                "per reason per interval, then as one summary line with the count", gt=0)
    refusal_log_lines_max: int = setting(5, "full log lines per refusal reason per interval", ge=0)

    def validate(self) -> None:
        _raise_first(self)
        if self.max_connections_per_ip > self.max_connections:
            raise _SettingError("max_connections_per_ip", f"must be <= max_connections ({self.max_connections})")
        if self.failed_connection_backoff_ms > self.failed_connection_backoff_max_ms:
            raise _SettingError("failed_connection_backoff_ms", "must be <= failed_connection_backoff_max_ms")


@dataclasses.dataclass(kw_only=True)
class SecurityConfig:
    """TLS and authorization (docs/security.md)."""

    security_protocol: str = setting(
        "SSL", "SSL (mutual TLS) or PLAINTEXT (opt-in, insecure, warned about)", choices=("SSL", "PLAINTEXT"))
    ssl_ca_file: str | None = setting(
        None, "PEM CA bundle; relative paths are resolved against the config file's directory")
    ssl_cert_file: str | None = setting(None, "PEM certificate of this node (relative: as ssl_ca_file)")
    ssl_key_file: str | None = setting(None, "PEM private key of this node (relative: as ssl_ca_file)")
    ssl_reload_check_ms: int = setting(1000, "how often the certificate files' mtimes are checked for rotation",
                                       gt=0)
    ssl_handshake_timeout_ms: int = setting(5000, "a TLS handshake not done by then is cut", gt=0)
    # They never bypass replica identity binding: see broker/controller/acl.py.
    super_users: list[str] = setting(
        default_factory=list, doc="principals (User:admin, Node:1) that bypass ACLs (Kafka's super.users)")

    @property
    def tls_enabled(self) -> bool:
        return self.security_protocol == "SSL"

    def validate(self, check_files: bool = True) -> None:
        _raise_first(self)
        if self.tls_enabled:
            for key in ("ssl_ca_file", "ssl_cert_file", "ssl_key_file"):
                path = getattr(self, key)
                if not path:
                    raise _SettingError(key, "required with security_protocol SSL (the default); `metalog certs` "
                                             "creates the files, `security_protocol: PLAINTEXT` turns TLS off "
                                             "(insecure)")
                if check_files and not os.path.isfile(path):
                    raise _SettingError(key, f"no such file: {path}")
        for text in self.super_users:
            try:
                Principal.parse(text)
            except ValueError as exc:
                raise _SettingError("super_users", str(exc)) from None


@dataclasses.dataclass(kw_only=True)
class BrokerConfig:
    node_id: int = setting(doc="this broker's id (Kafka's node.id)", ge=0)
    cluster_id: str = setting(doc="the cluster this broker and its data dir belong to", nonempty=True)
    data_dir: str = setting(doc="directory of the log, snapshots and quorum state (relative: to the config file)",
                            nonempty=True)
    listen: str = setting(doc="host:port of the controller listener: Kafka's wire protocol (Kafka's CONTROLLER "
                                  "listener) for the quorum's peers, our CLI and client, and admin tools with "
                                  "--bootstrap-controller")
    voters: str = setting(doc="id@host:port,... of every voter (Kafka's controller.quorum.voters); with "
                              "dynamic_voters: whom to ask for the leader (controller.quorum.bootstrap.servers)")
    dynamic_voters: bool = setting(
        False, "KIP-853, kraft.version 1: the voter set lives in the log (format the data dir first: metalog "
               "storage format --standalone | --initial-controllers | --no-initial-controllers) and changes "
               "with AddRaftVoter / RemoveRaftVoter; a data dir without a set replicates as an observer and "
               "never takes `voters` as the voter set")
    admin_listen: str | None = setting(None, "host:port of the HTTP admin API (/health, /metrics ...); "
                                             "none if unset")
    kafka_listen: str | None = setting(
        None, "host:port of the client listener, also Kafka's wire protocol (Kafka clients' "
              "bootstrap.servers), with the same security_protocol, certificates and ACLs as `listen` "
              "(docs/kafka-listener.md); none if unset")
    kafka_endpoints: str | None = setting(
        None, "id@host:port,... of every node's Kafka listener, as clients reach it (Metadata's and "
              "DescribeCluster's brokers; Kafka's advertised.listeners of each node); this node's own entry "
              "defaults to kafka_listen")
    kafka_in_voter_set: bool = setting(
        False, "also advertise this node's Kafka listener (named as security_protocol) in its entry of the "
               "log's voter set (KIP-853: AddRaftVoter, UpdateRaftVoter), so that every node's Metadata lists "
               "it without a kafka_endpoints entry; `metalog cluster add-node` sets it on the nodes it adds")
    log_level: str = setting("info", "structured log level", choices=("debug", "info", "warning", "error"))
    log_file: str | None = setting(None, "append the JSON log here instead of stderr")
    broker_session_timeout_ms: int = setting(
        9000, "a Kafka broker that registered through BrokerRegistration and sent no heartbeat for this long "
              "is fenced by the leader (Kafka's broker.session.timeout.ms)", gt=0)
    gc_young_threshold: int = setting(
        10_000, "net new objects between young garbage collections (Python's first gc threshold, 700 by "
                "default): a broker allocates for every request, and at 700 it spent several percent of "
                "its CPU collecting (docs/bench.md)", gt=0)
    leader_slice_us: int = setting(
        100, "the scheduler slice (Linux 6.12+) the event-loop thread asks for while this node leads; the "
             "kernel's default while it follows. A short slice runs the leader first when a peer's Fetch "
             "wakes it and keeps the peers its writes wake from taking its core mid-commit, where brokers "
             "share cores (docs/bench.md); its CPU share is unchanged. 0 = the kernel's default always",
        ge=0, le=SLICE_US_MAX)
    quorum: QuorumConfig = dataclasses.field(default_factory=QuorumConfig)
    storage: StorageConfig = dataclasses.field(default_factory=StorageConfig)
    network: NetworkConfig = dataclasses.field(default_factory=NetworkConfig)
    security: SecurityConfig = dataclasses.field(default_factory=SecurityConfig)

    # -- derived -------------------------------------------------------------
    def voter_endpoints(self) -> dict[int, Endpoint]:
        return parse_voters(self.voters)

    def listen_endpoint(self) -> Endpoint:
        return parse_endpoint("listen", self.listen)

    def admin_endpoint(self) -> Endpoint | None:
        return parse_endpoint("admin_listen", self.admin_listen) if self.admin_listen else None

    def kafka_endpoint(self) -> Endpoint | None:
        return parse_endpoint("kafka_listen", self.kafka_listen) if self.kafka_listen else None

    def kafka_node_endpoints(self) -> dict[int, Endpoint]:
        """Where each node's Kafka listener is reached (kafka_endpoints), ours
        from kafka_listen unless given or a wildcard address."""
        nodes = parse_voters(self.kafka_endpoints, "kafka_endpoints") if self.kafka_endpoints else {}
        own = self.kafka_endpoint()
        if own is not None and self.node_id not in nodes and own.host not in _WILDCARD_HOSTS:
            nodes[self.node_id] = own
        return nodes

    @property
    def tls_enabled(self) -> bool:
        return self.security.tls_enabled

    def tls_paths(self):
        from metalog.broker.net.tls import TlsPaths

        s = self.security
        if not (s.tls_enabled and s.ssl_ca_file and s.ssl_cert_file and s.ssl_key_file):
            # validate() refuses SSL without the three files; PLAINTEXT has none to ask for.
            raise InvariantViolation(f"tls_paths() of a config without TLS files "
                                     f"(security_protocol {s.security_protocol})")
        return TlsPaths(s.ssl_ca_file, s.ssl_cert_file, s.ssl_key_file)

    def _advertised_listeners(self) -> tuple[tuple[str, str, int], ...]:
        """What this node tells the leader it listens on (UpdateRaftVoter,
        KIP-853): `listen`, as `metalog storage format --standalone` records
        it, then the Kafka listener where kafka_in_voter_set asks. A wildcard
        address (0.0.0.0, ::) is not an address peers can reach: then nothing
        is advertised and the voter set keeps what the operator gave add-voter."""
        ep = self.listen_endpoint()
        if ep.host in _WILDCARD_HOSTS:
            return ()
        kafka = self.kafka_node_endpoints().get(self.node_id) if self.kafka_in_voter_set else None
        if kafka is None:
            return (("CONTROLLER", ep.host, ep.port),)
        # A node added online is in no other node's kafka_endpoints: they learn
        # its Kafka listener from the voter set, as they learn its address.
        return (("CONTROLLER", ep.host, ep.port), (self.security.security_protocol, kafka.host, kafka.port))

    def validate(self, check_files: bool = True) -> "BrokerConfig":
        """Every section's ranges and rules. Fills the node identity into
        ``quorum`` (what the core is built from). `check_files=False` skips
        checking that the TLS files exist (a compose file names paths inside
        containers). Raises _SettingError (section, key, why)."""
        _raise_first(self)
        self.listen_endpoint()
        self.admin_endpoint()
        self.kafka_node_endpoints()
        voters = self.voter_endpoints()
        if not voters:
            raise _SettingError("voters", "at least one voter is required")
        if 0 < self.leader_slice_us < SLICE_US_MIN:
            raise _SettingError("leader_slice_us", f"0 (the kernel's default) or {SLICE_US_MIN}-{SLICE_US_MAX}: "
                                                   "the kernel's range")
        self.quorum = dataclasses.replace(self.quorum, node_id=self.node_id, voters=tuple(sorted(voters)),
                                          cluster_id=self.cluster_id, voters_are_bootstrap=self.dynamic_voters,
                                          voter_endpoints=tuple((nid, "CONTROLLER", ep.host, ep.port)
                                                                for nid, ep in sorted(voters.items())),
                                          listeners=self._advertised_listeners())
        for name, section in (("quorum", self.quorum), ("storage", self.storage), ("network", self.network),
                              ("security", self.security)):
            try:
                section.validate(check_files) if name == "security" else section.validate()
            except _SettingError as exc:
                raise _SettingError(exc.key, exc.why, name) from None
            except ValueError as exc:  # QuorumConfig.validate: "<key>: <why>"
                key, _, why = str(exc).partition(": ")
                raise _SettingError(key, why, name) from None
        return self


class _SettingError(ConfigError):
    """A bad setting, before the key is spelled as the user wrote it."""

    def __init__(self, key: str, why: str, section: str = ""):
        super().__init__(f"{key}: {why}")
        self.key, self.why, self.section = key, why, section


def _raise_first(obj) -> None:
    bad = check_settings(obj)
    if bad is not None:
        raise _SettingError(*bad)


# -- the schema: sections and where a key lives ---------------------------------
SECTIONS: dict[str, type] = {"quorum": QuorumConfig, "storage": StorageConfig, "network": NetworkConfig,
                             "security": SecurityConfig}
TOP_LEVEL_KEYS: tuple[str, ...] = tuple(f.name for f, _ in setting_fields(BrokerConfig))
SECTION_OF: dict[str, str] = {}
for _section, _cls in SECTIONS.items():
    for _f, _ in setting_fields(_cls):
        invariant(_f.name not in SECTION_OF and _f.name not in TOP_LEVEL_KEYS, "setting %s defined twice", _f.name)
        SECTION_OF[_f.name] = _section


def all_settings() -> list[tuple[str, dataclasses.Field, SettingSpec]]:
    """(section, field, spec) for every setting; section "" is the top level."""
    out = [("", f, spec) for f, spec in setting_fields(BrokerConfig)]
    for section, cls in SECTIONS.items():
        out += [(section, f, spec) for f, spec in setting_fields(cls)]
    return out


def _unknown(key: str, written: str, known: list[str]) -> ConfigError:
    if key in TOP_LEVEL_KEYS or key in SECTION_OF:  # a real key in the wrong place
        where = f"`{SECTION_OF[key]}.{key}`" if key in SECTION_OF else "the top level"
        return ConfigError(f"{written}: Object contains unknown field `{key}`; it belongs in {where}")
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean `{close[0]}`?" if close else ""
    return ConfigError(f"{written}: Object contains unknown field `{key}`{hint}")


def normalize(data: dict[str, Any]) -> tuple[dict[str, Any], dict[tuple[str, str], str]]:
    """Flat, dotted and nested keys -> the nested form, and how each key was
    written (for error messages). A later spelling of the same key wins, as
    YAML's own duplicate keys do. Unknown keys are refused by name."""
    out: dict[str, Any] = {}
    written: dict[tuple[str, str], str] = {}
    every_key = list(TOP_LEVEL_KEYS) + list(SECTION_OF)

    def put(section: str, key: str, value: Any, as_written: str) -> None:
        if section:
            out.setdefault(section, {})[key] = value
        else:
            out[key] = value
        written[(section, key)] = as_written

    for key, value in data.items():
        key = str(key)
        if key in SECTIONS:
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: expected a mapping of settings, got {type(value).__name__}")
            for sub, sub_value in value.items():
                sub = str(sub)
                if SECTION_OF.get(sub) != key:
                    raise _unknown(sub, f"{key}.{sub}", [k for k, s in SECTION_OF.items() if s == key])
                put(key, sub, sub_value, f"{key}.{sub}")
        elif "." in key:
            section, _, sub = key.partition(".")
            if section not in SECTIONS or SECTION_OF.get(sub) != section:
                raise _unknown(sub, key, [f"{s}.{k}" for k, s in SECTION_OF.items()])
            put(section, sub, value, key)
        elif key in TOP_LEVEL_KEYS:
            put("", key, value, key)
        elif key in SECTION_OF:
            put(SECTION_OF[key], key, value, key)
        else:
            raise _unknown(key, key, every_key)
    return out, written


def parse_endpoint(key: str, text: str) -> Endpoint:
    host, sep, port_s = text.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"{key}: expected host:port, got {text!r}")
    try:
        port = int(port_s)
    except ValueError:
        raise ConfigError(f"{key}: port must be a number, got {port_s!r}") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"{key}: port out of range: {port}")
    return Endpoint(host, port)


def parse_voters(text: str, key: str = "voters") -> dict[int, Endpoint]:
    """Parse Kafka's "id@host:port,id@host:port" voter list (`key`: the setting, for errors)."""
    voters: dict[int, Endpoint] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        id_s, sep, addr = item.partition("@")
        if not sep:
            raise ConfigError(f"{key}: expected id@host:port, got {item!r}")
        try:
            node_id = int(id_s)
        except ValueError:
            raise ConfigError(f"{key}: node id must be a number, got {id_s!r}") from None
        if node_id in voters:
            raise ConfigError(f"{key}: node id {node_id} listed twice")
        voters[node_id] = parse_endpoint(key, addr)
    return voters


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if key in SECTIONS:
            out[key] = {**out.get(key, {}), **value}
        else:
            out[key] = value
    return out


def _normalized(data: dict[str, Any], overrides: dict[str, Any] | None):
    nested, written = normalize(data)
    if overrides:
        nested_over, written_over = normalize(overrides)
        nested = _merge(nested, nested_over)
        written.update(written_over)
    return nested, written


def config_from_dict(data: dict[str, Any], check_files: bool = True,
                     overrides: dict[str, Any] | None = None) -> BrokerConfig:
    """`data` and `overrides` in any of the accepted forms; overrides win."""
    return _build(*_normalized(data, overrides), check_files)


def _build(nested: dict[str, Any], written: dict[tuple[str, str], str], check_files: bool) -> BrokerConfig:
    def spelled(section: str, key: str) -> str:
        return written.get((section, key), f"{section}.{key}" if section else key)

    try:
        cfg = msgspec.convert(nested, BrokerConfig, strict=False)
    except msgspec.ValidationError as exc:
        # msgspec says e.g. "Expected `int`, got `str` - at `$.quorum.node_id`": lead with the key.
        msg = str(exc)
        path = msg.rsplit("at `$.", 1)[-1].rstrip("`") if "at `$." in msg else ""
        section, _, key = path.rpartition(".") if path.count(".") == 1 else ("", "", path)
        raise ConfigError(f"{spelled(section, key) if key else 'config'}: {msg}") from None
    try:
        return cfg.validate(check_files)
    except _SettingError as exc:
        raise ConfigError(f"{spelled(exc.section, exc.key)}: {exc.why}") from None


def load_config(path: str, overrides: dict[str, Any] | None = None) -> BrokerConfig:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None
    try:
        data = json.loads(raw) if path.endswith(".json") else yaml.safe_load(raw)
    except (ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {path}: not valid {'JSON' if path.endswith('.json') else 'YAML'}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of keys to values")
    nested, written = _normalized(data, overrides)
    base = os.path.dirname(os.path.abspath(path))
    for section, key in (("", "data_dir"), ("security", "ssl_ca_file"), ("security", "ssl_cert_file"),
                         ("security", "ssl_key_file")):
        holder = nested.get(section, {}) if section else nested
        if holder.get(key) and not os.path.isabs(str(holder[key])):
            holder[key] = os.path.join(base, str(holder[key]))
    return _build(nested, written, check_files=True)


# -- the table: --help-config and docs/config.md ---------------------------------
def _type_name(f: dataclasses.Field) -> str:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return t.replace(" | None", " (optional)")


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return "none" if f.default is None else json.dumps(f.default)
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return json.dumps(f.default_factory())  # type: ignore[misc]
    return "required"


def _range_text(spec: SettingSpec) -> str:
    parts = []
    if spec.gt is not None:
        parts.append(f"> {spec.gt:g}")
    if spec.ge is not None:
        parts.append(f">= {spec.ge:g}")
    if spec.le is not None:
        parts.append(f"<= {spec.le:g}")
    if spec.choices is not None:
        parts.append("one of " + "/".join(map(str, spec.choices)))
    if spec.nonempty:
        parts.append("not empty")
    if spec.note:
        parts.append(spec.note)
    return "; ".join(parts)


def settings_rows() -> list[tuple[str, str, str, str, str]]:
    """(section, key, type, default, description with range) per setting."""
    rows = []
    for section, f, spec in all_settings():
        rng = _range_text(spec)
        doc = f"{spec.doc} [{rng}]" if rng else spec.doc
        rows.append((section or "(top)", f.name, _type_name(f), _default_text(f), doc))
    return rows


def help_text() -> str:
    rows = [("section", "key", "type", "default", "description")] + settings_rows()
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4] for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * 11)
    footer = ("\nKeys may be given flat (election_timeout_ms: 1000) or in their section "
              "(quorum: {election_timeout_ms: 1000});\n--set takes either spelling "
              "(--set quorum.election_timeout_ms=1000). Units are in the names.")
    return "\n".join(lines) + "\n" + footer + "\n"


def markdown() -> str:
    out = ["# Broker configuration (broker.yaml)", "",
           "Generated from the setting declarations in `broker/server/config.py` and `broker/quorum/api.py` "
           "by `python -m metalog.broker.server.config --markdown > docs/config.md` (a test checks it is up to date); "
           "`metalog broker --help-config` prints the same table.", "",
           "Keys may be given flat (`election_timeout_ms: 1000`, the historical form) or nested in "
           "their section (`quorum: {election_timeout_ms: 1000}`); `--set` takes either spelling "
           "(`--set quorum.election_timeout_ms=1000`). Setting names are unique across sections; an "
           "unknown key fails at start naming it. Units are in the names (`_ms`, `_bytes`, `_per_s`). "
           "Relative paths (`data_dir`, `ssl_*_file`) are resolved against the config file's directory.",
           "", "Cross-field rules: `fetch_max_wait_ms` < `fetch_timeout_ms`; `max_connections_per_ip` <= "
           "`max_connections`; `failed_connection_backoff_ms` <= `failed_connection_backoff_max_ms`; "
           "the three `ssl_*_file` keys are required with `security_protocol: SSL`."]
    current = None
    for section, key, type_name, default, doc in settings_rows():
        if section != current:
            current = section
            out += ["", f"## {section}", "", "| key | type | default | description |", "|---|---|---|---|"]
        out.append(f"| `{key}` | {type_name} | {default} | {doc.replace('|', '/')} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown() if "--markdown" in sys.argv[1:] else help_text())
