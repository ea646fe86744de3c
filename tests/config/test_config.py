"""BrokerConfig: one declaration per setting, flat and nested broker.yaml forms,
--set overrides in both spellings, the errors a user sees, --help-config and
docs/config.md generated from the declarations."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import yaml

from metalog.broker.server.config import (SECTION_OF, SECTIONS, BrokerConfig, ConfigError, all_settings, config_from_dict,
                           help_text, load_config, markdown)
from metalog.broker.server.main import main as broker_main
from metalog.broker.quorum.api import QuorumConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = {"node_id": 2, "cluster_id": "c1", "data_dir": "data", "listen": "127.0.0.1:9092",
        "voters": "1@127.0.0.1:9091,2@127.0.0.1:9092,3@127.0.0.1:9093", "security_protocol": "PLAINTEXT"}


def write(tmp_path, data: dict, name="broker.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_flat_file_still_loads_into_the_sections(tmp_path):
    """The historical flat form (what the launcher, compose file and drills write)."""
    cfg = load_config(write(tmp_path, {**BASE, "election_timeout_ms": 700, "append_linger_ms": 2.5,
                                       "max_connections": 10, "max_connections_per_ip": 5,
                                       "super_users": ["User:admin"]}))
    assert cfg.quorum.election_timeout_ms == 700
    assert cfg.storage.append_linger_ms == 2.5
    assert (cfg.network.max_connections, cfg.network.max_connections_per_ip) == (10, 5)
    assert cfg.security.super_users == ["User:admin"]
    assert cfg.data_dir == str(tmp_path / "data")  # relative to the config file


def test_nested_file_is_the_same_config_as_the_flat_one(tmp_path):
    flat = load_config(write(tmp_path, {**BASE, "election_timeout_ms": 700, "segment_bytes_max": 1 << 20},
                             "flat.yaml"))
    nested = load_config(write(tmp_path, {**BASE, "quorum": {"election_timeout_ms": 700},
                                          "storage": {"segment_bytes_max": 1 << 20}}, "nested.yaml"))
    assert flat == nested


def test_the_core_gets_the_quorum_section_with_the_node_identity():
    cfg = config_from_dict({**BASE, "quorum": {"fetch_timeout_ms": 3000}})
    assert cfg.quorum == QuorumConfig(
        node_id=2, voters=(1, 2, 3), cluster_id="c1", fetch_timeout_ms=3000,
        # KIP-853: the static voters' endpoints (an online upgrade records them)
        # and what this node advertises (UpdateRaftVoter): its `listen`.
        voter_endpoints=((1, "CONTROLLER", "127.0.0.1", 9091), (2, "CONTROLLER", "127.0.0.1", 9092),
                         (3, "CONTROLLER", "127.0.0.1", 9093)),
        listeners=(("CONTROLLER", "127.0.0.1", 9092),))
    assert cfg.quorum.is_voter


def test_a_wildcard_listen_address_is_never_advertised_to_the_leader():
    """Peers cannot reach 0.0.0.0: a node listening there sends no
    UpdateRaftVoter; the voter set keeps the endpoint add-voter gave it."""
    assert config_from_dict({**BASE, "listen": "0.0.0.0:9092"}).quorum.listeners == ()


@pytest.mark.parametrize("override", ["election_timeout_ms", "quorum.election_timeout_ms"])
@pytest.mark.parametrize("in_file", [{"election_timeout_ms": 700}, {"quorum": {"election_timeout_ms": 700}}])
def test_set_overrides_the_file_in_either_spelling(tmp_path, override, in_file):
    cfg = load_config(write(tmp_path, {**BASE, **in_file}), {override: "450"})  # --set gives strings
    assert cfg.quorum.election_timeout_ms == 450


@pytest.mark.parametrize("data, message", [
    ({"election_timeout_ms": -5}, "election_timeout_ms: must be > 0, got -5"),
    ({"quorum": {"election_timeout_ms": -5}}, "quorum.election_timeout_ms: must be > 0, got -5"),
    ({"quorum.election_timeout_ms": "x"}, "quorum.election_timeout_ms: Expected `int`, got `str`"),
    ({"fetch_max_wait_ms": 5000}, "fetch_max_wait_ms: must be below fetch_timeout_ms (1000), got 5000"),
    ({"fetch_timeout_ms": 400, "fetch_max_wait_ms": 400},
     "fetch_max_wait_ms: must be below fetch_timeout_ms (400), got 400"),
    ({"no_such_key": 1}, "no_such_key: Object contains unknown field `no_such_key`"),
    ({"election_timeout": 1}, "election_timeout: Object contains unknown field `election_timeout`; "
                              "did you mean `election_timeout_ms`?"),
    ({"quorum": {"segment_bytes_max": 4096}},
     "quorum.segment_bytes_max: Object contains unknown field `segment_bytes_max`; "
     "it belongs in `storage.segment_bytes_max`"),
    ({"quorum": {"node_id": 3}}, "quorum.node_id: Object contains unknown field `node_id`; "
                                 "it belongs in the top level"),
    ({"quorum": 5}, "quorum: expected a mapping of settings, got int"),
    ({"segment_bytes_max": 100}, "segment_bytes_max: must be >= 4096, got 100"),
    ({"max_connections": 10, "max_connections_per_ip": 20}, "max_connections_per_ip: must be <= max_connections (10)"),
    ({"network.failed_connection_backoff_ms": 5000, "failed_connection_backoff_max_ms": 1000},
     "network.failed_connection_backoff_ms: must be <= failed_connection_backoff_max_ms"),
    ({"log_scrub_bytes_per_s": -1}, "log_scrub_bytes_per_s: must be >= 0 (0 disables the scrubber), got -1"),
    ({"snapshot_cpu_share": 1.5}, "snapshot_cpu_share: must be <= 1, got 1.5"),
    ({"snapshot_cpu_share": 0}, "snapshot_cpu_share: must be > 0, got 0"),
    ({"security_protocol": "TLS"}, "security_protocol: must be one of SSL/PLAINTEXT, got 'TLS'"),
    ({"security_protocol": "SSL"}, "ssl_ca_file: required with security_protocol SSL"),
    ({"super_users": ["admin"]}, "super_users: "),
    ({"log_level": "loud"}, "log_level: must be one of debug/info/warning/error, got 'loud'"),
    ({"cluster_id": " "}, "cluster_id: must not be empty"),
    ({"node_id": -1}, "node_id: must be >= 0, got -1"),
    ({"leader_slice_us": 50}, "leader_slice_us: 0 (the kernel's default) or 100-100000: the kernel's range"),
    ({"leader_slice_us": 200_000}, "leader_slice_us: must be <= 100000, got 200000"),
])
def test_a_bad_value_is_refused_naming_the_key_as_written(data, message):
    with pytest.raises(ConfigError) as err:
        config_from_dict({**BASE, **data})
    assert message in str(err.value)


def test_quorum_config_validate_holds_the_cross_field_rule_for_any_driver():
    """The simulator and the core build QuorumConfig directly: the same rule applies."""
    with pytest.raises(ValueError, match=r"fetch_max_wait_ms: must be below fetch_timeout_ms \(1000\), got 1000"):
        QuorumConfig(node_id=1, voters=(1,), cluster_id="c", fetch_timeout_ms=1000, fetch_max_wait_ms=1000).validate()
    with pytest.raises(ValueError, match="election_timeout_ms: must be > 0, got 0"):
        QuorumConfig(node_id=1, voters=(1,), cluster_id="c", election_timeout_ms=0).validate()
    with pytest.raises(ValueError, match="QuorumConfig.voters is empty"):
        QuorumConfig(node_id=1, voters=(), cluster_id="c").validate()
    ok = QuorumConfig(node_id=1, voters=(1, 2, 3), cluster_id="c")
    assert ok.validate() is ok


def test_every_setting_is_declared_once_with_a_description():
    names = [f.name for _, f, _ in all_settings()]
    assert len(names) == len(set(names))
    assert all(spec.doc for _, _, spec in all_settings())
    # Every section field of BrokerConfig is a declared section, and vice versa.
    section_fields = {f.name for f in dataclasses.fields(BrokerConfig) if f.name in SECTIONS}
    assert section_fields == set(SECTIONS)
    assert SECTION_OF["election_timeout_ms"] == "quorum" and SECTION_OF["ssl_ca_file"] == "security"


def test_help_config_prints_every_key(capsys):
    assert broker_main(["--help-config"]) == 0
    out = capsys.readouterr().out
    assert out == help_text()
    lines = out.splitlines()
    for section, f, spec in all_settings():
        row = next((line for line in lines if line.split()[1:2] == [f.name]), None)
        assert row is not None, f"{f.name} missing from --help-config"
        assert row.split()[0] == (section or "(top)")
        assert spec.doc[:30] in row


def test_help_config_through_the_metalog_cli():
    result = subprocess.run([sys.executable, "-m", "metalog.tools.cli", "broker", "--help-config"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "election_timeout_ms" in result.stdout and "quorum" in result.stdout


def test_broker_without_config_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        broker_main([])
    assert exit_info.value.code == 2
    assert "the following arguments are required: --config" in capsys.readouterr().err


def test_docs_config_md_is_generated_from_the_code():
    with open(os.path.join(REPO, "docs", "config.md")) as f:
        on_disk = f.read()
    assert on_disk == markdown(), ("docs/config.md is stale: run "
                                   "`python -m metalog.broker.server.config --markdown > docs/config.md`")
    for _, f, _ in all_settings():
        assert f"`{f.name}`" in on_disk


def test_broker_process_refuses_a_bad_nested_override_with_exit_code_2(tmp_path):
    """What the user sees: `metalog: config error: <key as written>: ...` on stderr, exit 2."""
    path = write(tmp_path, {**BASE, "quorum": {"election_timeout_ms": 700}})
    result = subprocess.run([sys.executable, "-m", "metalog.broker.server.main", "--config", path,
                             "--set", "quorum.election_timeout_ms=-5"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == "metalog: config error: quorum.election_timeout_ms: must be > 0, got -5"
