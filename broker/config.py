"""Broker configuration: one typed struct, loaded from a YAML/JSON file or a dict.

Keys use Kafka's spirit with units in the names. A bad value fails at start
with a message naming the key (``ConfigError: quorum.voters: ...``), never a
stack trace deep inside the broker.

Example (YAML)::

    node_id: 1
    cluster_id: metalog-local
    data_dir: ./data/node-1
    listen: 127.0.0.1:9091
    admin_listen: 127.0.0.1:8091
    voters: "1@127.0.0.1:9091,2@127.0.0.1:9092,3@127.0.0.1:9093"
"""

from __future__ import annotations

import json
import os
from typing import Any

import msgspec
import yaml

from broker.principal import Principal
from broker.quorum.api import QuorumConfig


class ConfigError(ValueError):
    pass


class Endpoint(msgspec.Struct, frozen=True):
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


_Q = QuorumConfig(node_id=0, voters=(0,), cluster_id="")  # the quorum defaults, stated once


class BrokerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    node_id: int
    cluster_id: str
    data_dir: str
    listen: str  # host:port of the binary protocol
    voters: str  # "id@host:port,..." (Kafka's controller.quorum.voters)
    admin_listen: str | None = None  # host:port of the HTTP admin API
    election_timeout_ms: int = _Q.election_timeout_ms
    fetch_timeout_ms: int = _Q.fetch_timeout_ms
    election_backoff_max_ms: int = _Q.election_backoff_max_ms
    request_timeout_ms: int = _Q.request_timeout_ms
    fetch_max_wait_ms: int = _Q.fetch_max_wait_ms
    fetch_max_bytes: int = _Q.fetch_max_bytes
    replica_lag_time_max_ms: int = _Q.replica_lag_time_max_ms
    follower_fetch_pending_reads_insync_enable: bool = _Q.follower_fetch_pending_reads_insync_enable
    max_replication_lag_ms: int = _Q.max_replication_lag_ms
    append_linger_ms: float = 0.0  # fixed group-commit window; 0 = adaptive (batch while the disk is busy)
    append_batch_records_max: int = 4096
    segment_bytes_max: int = 64 << 20
    # Background re-reading of sealed segments and snapshots (storage.scrub):
    # 1 GiB in about an hour; 0 disables the scrubber.
    log_scrub_bytes_per_s: int = 300_000
    snapshot_min_records: int = 20000  # controller.snapshot.minimum.records
    snapshot_chunk_bytes: int = _Q.snapshot_chunk_bytes
    max_frame_bytes: int = 8 << 20
    # Cross-replica consistency check (broker.consistency): how often the leader
    # compares its committed log's digest with every voter's. 0 turns it off.
    consistency_check_interval_ms: int = 60000
    connect_timeout_ms: int = 1000
    reconnect_backoff_max_ms: int = 1000
    log_level: str = "info"
    log_file: str | None = None
    # -- security (docs/security.md) ----------------------------------------
    security_protocol: str = "SSL"  # "SSL" (mutual TLS) or "PLAINTEXT" (opt-in, insecure, warned about)
    ssl_ca_file: str | None = None  # PEM; relative paths are resolved against the config file's directory
    ssl_cert_file: str | None = None
    ssl_key_file: str | None = None
    ssl_reload_check_ms: int = 1000  # how often the cert files' mtimes are checked for rotation
    ssl_handshake_timeout_ms: int = 5000
    connections_max_idle_ms: int = 600_000  # Kafka's name; also cuts a half-sent frame that stalls
    max_connections: int = 4096  # per listener
    max_connections_per_ip: int = 1024
    failed_connections_before_backoff: int = 5  # consecutive failed handshakes / bad frames per address
    failed_connection_backoff_ms: int = 1000  # first refusal period; doubles per further failure
    failed_connection_backoff_max_ms: int = 60_000
    # Principals ("User:admin", "Node:1") that bypass ACLs (Kafka's super.users).
    # They never bypass replica identity binding: see broker/authz.py.
    super_users: list[str] = []

    # -- derived -------------------------------------------------------------
    def voter_endpoints(self) -> dict[int, Endpoint]:
        return parse_voters(self.voters)

    def listen_endpoint(self) -> Endpoint:
        return parse_endpoint("listen", self.listen)

    def admin_endpoint(self) -> Endpoint | None:
        return parse_endpoint("admin_listen", self.admin_listen) if self.admin_listen else None

    @property
    def tls_enabled(self) -> bool:
        return self.security_protocol == "SSL"

    def tls_paths(self):
        from broker.tls import TlsPaths

        assert self.tls_enabled and self.ssl_ca_file and self.ssl_cert_file and self.ssl_key_file
        return TlsPaths(self.ssl_ca_file, self.ssl_cert_file, self.ssl_key_file)

    def quorum_config(self) -> QuorumConfig:
        return QuorumConfig(
            node_id=self.node_id,
            voters=tuple(sorted(self.voter_endpoints())),
            cluster_id=self.cluster_id,
            election_timeout_ms=self.election_timeout_ms,
            fetch_timeout_ms=self.fetch_timeout_ms,
            election_backoff_max_ms=self.election_backoff_max_ms,
            request_timeout_ms=self.request_timeout_ms,
            fetch_max_wait_ms=self.fetch_max_wait_ms,
            fetch_max_bytes=self.fetch_max_bytes,
            replica_lag_time_max_ms=self.replica_lag_time_max_ms,
            follower_fetch_pending_reads_insync_enable=self.follower_fetch_pending_reads_insync_enable,
            max_replication_lag_ms=self.max_replication_lag_ms,
            snapshot_chunk_bytes=self.snapshot_chunk_bytes,
        )

    def validate(self, check_files: bool = True) -> "BrokerConfig":
        """`check_files=False` skips checking that the TLS files exist (a compose
        file names paths inside containers)."""
        def need(cond: bool, key: str, why: str) -> None:
            if not cond:
                raise ConfigError(f"{key}: {why}")

        need(self.node_id >= 0, "node_id", f"must be >= 0, got {self.node_id}")
        need(bool(self.cluster_id.strip()), "cluster_id", "must not be empty")
        need(bool(self.data_dir), "data_dir", "must not be empty")
        self.listen_endpoint()
        self.admin_endpoint()
        voters = self.voter_endpoints()
        need(len(voters) >= 1, "voters", "at least one voter is required")
        for key in ("election_timeout_ms", "fetch_timeout_ms", "request_timeout_ms",
                    "election_backoff_max_ms", "fetch_max_bytes", "segment_bytes_max",
                    "snapshot_min_records", "snapshot_chunk_bytes", "max_frame_bytes",
                    "append_batch_records_max", "connect_timeout_ms", "replica_lag_time_max_ms",
                    "max_replication_lag_ms", "reconnect_backoff_max_ms", "ssl_reload_check_ms",
                    "ssl_handshake_timeout_ms", "connections_max_idle_ms", "max_connections",
                    "max_connections_per_ip", "failed_connections_before_backoff",
                    "failed_connection_backoff_ms", "failed_connection_backoff_max_ms"):
            value = getattr(self, key)
            need(value > 0, key, f"must be > 0, got {value}")
        need(self.fetch_max_wait_ms >= 0, "fetch_max_wait_ms", "must be >= 0")
        need(self.consistency_check_interval_ms >= 0, "consistency_check_interval_ms",
             f"must be >= 0 (0 = off), got {self.consistency_check_interval_ms}")
        need(self.append_linger_ms >= 0, "append_linger_ms", "must be >= 0")
        need(self.fetch_max_wait_ms < self.fetch_timeout_ms, "fetch_max_wait_ms",
             f"must be below fetch_timeout_ms ({self.fetch_timeout_ms}), got {self.fetch_max_wait_ms}")
        need(self.segment_bytes_max >= 4096, "segment_bytes_max", "must be >= 4096")
        need(self.security_protocol in ("SSL", "PLAINTEXT"), "security_protocol",
             f"must be SSL or PLAINTEXT, got {self.security_protocol!r}")
        if self.tls_enabled:
            for key in ("ssl_ca_file", "ssl_cert_file", "ssl_key_file"):
                path = getattr(self, key)
                need(bool(path), key, "required with security_protocol SSL (the default); "
                     "`metalog certs` creates the files, `security_protocol: PLAINTEXT` turns TLS off (insecure)")
                need(not check_files or os.path.isfile(path), key, f"no such file: {path}")
        need(self.max_connections_per_ip <= self.max_connections, "max_connections_per_ip",
             f"must be <= max_connections ({self.max_connections})")
        need(self.failed_connection_backoff_ms <= self.failed_connection_backoff_max_ms,
             "failed_connection_backoff_ms", "must be <= failed_connection_backoff_max_ms")
        need(self.log_scrub_bytes_per_s >= 0, "log_scrub_bytes_per_s",
             f"must be >= 0 (0 disables the scrubber), got {self.log_scrub_bytes_per_s}")
        for text in self.super_users:
            try:
                Principal.parse(text)
            except ValueError as exc:
                raise ConfigError(f"super_users: {exc}") from None
        need(self.log_level in ("debug", "info", "warning", "error"), "log_level",
             f"must be one of debug/info/warning/error, got {self.log_level!r}")
        return self


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


def parse_voters(text: str) -> dict[int, Endpoint]:
    """Parse Kafka's "id@host:port,id@host:port" voter list."""
    voters: dict[int, Endpoint] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        id_s, sep, addr = item.partition("@")
        if not sep:
            raise ConfigError(f"voters: expected id@host:port, got {item!r}")
        try:
            node_id = int(id_s)
        except ValueError:
            raise ConfigError(f"voters: node id must be a number, got {id_s!r}") from None
        if node_id in voters:
            raise ConfigError(f"voters: node id {node_id} listed twice")
        voters[node_id] = parse_endpoint("voters", addr)
    return voters


def config_from_dict(data: dict[str, Any], check_files: bool = True) -> BrokerConfig:
    try:
        cfg = msgspec.convert(data, BrokerConfig, strict=False)
    except msgspec.ValidationError as exc:
        # msgspec says e.g. "Expected `int`, got `str` - at `$.node_id`": lead with the key.
        msg = str(exc)
        key = msg.rsplit("at `$.", 1)[-1].rstrip("`") if "at `$." in msg else "config"
        raise ConfigError(f"{key}: {msg}") from None
    return cfg.validate(check_files)


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
    data.update(overrides or {})
    base = os.path.dirname(os.path.abspath(path))
    for key in ("data_dir", "ssl_ca_file", "ssl_cert_file", "ssl_key_file"):
        if data.get(key) and not os.path.isabs(str(data[key])):
            data[key] = os.path.join(base, str(data[key]))
    return config_from_dict(data)
