"""Where the CLI and client library find their credentials (broker/client/config.py)."""

from __future__ import annotations

import os

import pytest

from metalog.broker.client.config import ClientConfig, ClientConfigError, find_client_config, load_client_config
from metalog.tools.cluster import certs


def _write(path, cert_dir, bootstrap="127.0.0.1:1") -> str:
    ClientConfig(bootstrap=bootstrap, cluster_id="c", ssl_ca_file=f"{cert_dir}/ca.crt",
                 ssl_cert_file=f"{cert_dir}/admin.crt", ssl_key_file=f"{cert_dir}/admin.key").write(str(path))
    return str(path)


def test_flag_then_env_then_run_cluster_default(tmp_path, monkeypatch):
    certs.cluster_certs(str(tmp_path / "certs"), {}, users=("admin",))
    flag = _write(tmp_path / "flag.yaml", tmp_path / "certs", "127.0.0.1:1")
    env = _write(tmp_path / "env.yaml", tmp_path / "certs", "127.0.0.1:2")
    os.makedirs(tmp_path / "repo" / "run" / "cluster")
    _write(tmp_path / "repo" / "run" / "cluster" / "client.yaml", tmp_path / "certs", "127.0.0.1:3")
    monkeypatch.chdir(tmp_path / "repo")
    monkeypatch.setenv("METALOG_CLIENT_CONFIG", env)
    assert find_client_config(flag).bootstrap == "127.0.0.1:1"
    assert find_client_config(None).bootstrap == "127.0.0.1:2"
    monkeypatch.delenv("METALOG_CLIENT_CONFIG")
    cfg = find_client_config(None)
    assert cfg.bootstrap == "127.0.0.1:3" and cfg.endpoints() == [("127.0.0.1", 3)]
    # paths are written relative to the file and resolved against its directory
    assert open("run/cluster/client.yaml").read().count("../../../certs/") == 3
    assert cfg.ssl_ca_file == str(tmp_path / "repo" / "run" / "cluster" / "../../../certs/ca.crt")
    assert cfg.tls().client() is not None
    monkeypatch.chdir(tmp_path)
    assert find_client_config(None) is None


@pytest.mark.parametrize("text, message", [
    ("bootstrap: h:1\n", "cluster_id is required"),
    ("bootstrap: h:1\ncluster_id: c\n", "ssl_ca_file is required with security_protocol SSL"),
    ("bootstrap: h:1\ncluster_id: c\nssl_ca_file: nope.crt\nssl_cert_file: a\nssl_key_file: b\n",
     "ssl_ca_file: no such file"),
    ("bootstrap: h:1\ncluster_id: c\ncolour: red\n", "unknown keys ['colour']"),
    ("bootstrap: h:1\ncluster_id: c\nsecurity_protocol: TLS\n", "security_protocol must be SSL or PLAINTEXT"),
])
def test_bad_client_config_is_one_clear_error(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ClientConfigError) as info:
        load_client_config(str(path))
    assert str(info.value).startswith(f"client config {path}: ") and message in str(info.value)


def test_plaintext_config_needs_no_files(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("bootstrap: h:1\ncluster_id: c\nsecurity_protocol: PLAINTEXT\n")
    assert load_client_config(str(path)).tls() is None


def test_from_config_searches_as_the_cli_does(tmp_path, monkeypatch):
    """MetalogClient.from_config(): the path given, else $METALOG_CLIENT_CONFIG,
    else ./run/cluster/client.yaml; the file's bootstrap, cluster id and TLS
    files, the constructor's keywords passed through."""
    from metalog.broker.client import MetalogClient

    certs.cluster_certs(str(tmp_path / "certs"), {}, users=("admin",))
    given = _write(tmp_path / "given.yaml", tmp_path / "certs", "127.0.0.1:1")
    env = _write(tmp_path / "env.yaml", tmp_path / "certs", "127.0.0.1:2")
    os.makedirs(tmp_path / "repo" / "run" / "cluster")
    _write(tmp_path / "repo" / "run" / "cluster" / "client.yaml", tmp_path / "certs", "127.0.0.1:3")
    monkeypatch.chdir(tmp_path / "repo")
    monkeypatch.setenv("METALOG_CLIENT_CONFIG", env)
    client = MetalogClient.from_config(given, delivery_timeout_ms=5000)
    assert (client.bootstrap, client.cluster_id, client.delivery_timeout_ms) == ([("127.0.0.1", 1)], "c", 5000)
    assert client.tls.paths.cert_file == str(tmp_path / "certs" / "admin.crt")
    assert MetalogClient.from_config().bootstrap == [("127.0.0.1", 2)]
    monkeypatch.delenv("METALOG_CLIENT_CONFIG")
    assert MetalogClient.from_config().bootstrap == [("127.0.0.1", 3)]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ClientConfigError, match="no client config: pass a path, set \\$METALOG_CLIENT_CONFIG"):
        MetalogClient.from_config()


def test_ssl_config_without_its_files_is_a_config_error_not_an_assert():
    """A ClientConfig built in code (not loaded) that says SSL but lacks files:
    a ClientConfigError naming what is missing, under python -O too."""
    cfg = ClientConfig(bootstrap="h:1", cluster_id="c", ssl_ca_file="ca.crt")
    with pytest.raises(ClientConfigError, match="security_protocol SSL needs ssl_cert_file, ssl_key_file"):
        cfg.tls()


def test_the_client_package_exports_the_user_names_and_loads_nothing_of_the_server():
    """A user's import line: every public name from the package, and in a
    fresh interpreter not one module of the server, the quorum or the controller."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from metalog.broker.client import (MetalogClient, Consumer, ConsumedRecord, MetalogError,\n"
            "    AuthorizationError, CorruptRecordError, ClusterUnavailable, TlsFailure, LogTruncationError,\n"
            "    OffsetOutOfRangeError, NoOffsetError, ClientConfig, ClientConfigError, load_client_config,\n"
            "    find_client_config)\n"
            "print(sorted(m for m in sys.modules if m.startswith(('metalog.broker.server', "
            "'metalog.broker.quorum', 'metalog.broker.controller', 'metalog.tools'))))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
