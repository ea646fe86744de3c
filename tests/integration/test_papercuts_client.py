"""Issue 36, item 2: credentials from the wrong cluster. From a directory whose
run/cluster/client.yaml belongs to cluster A, `metalog produce --bootstrap
<a broker of cluster B>` says it borrows A's CA and certificate, and the
failed handshake names the client config and CA it used and `--client-config`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from metalog.tools.cluster.launcher import LocalCluster

pytestmark = pytest.mark.slow


def metalog(*args: str, cwd: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "METALOG_CLIENT_CONFIG"}
    return subprocess.run([sys.executable, "-m", "metalog.tools.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=90, env=env)


def test_a_bootstrap_of_another_cluster_says_whose_credentials_it_borrowed(tmp_path, make_cluster):
    # Cluster A: only its certificates and client.yaml, where the CLI looks by default.
    workdir = tmp_path / "work"
    other = LocalCluster.create(str(workdir / "run" / "cluster"), voters=1, observers=0)
    other.ensure_certs()
    found = os.path.join(other.root, "client.yaml")
    # Cluster B: a running broker with a CA of its own.
    cluster = make_cluster(voters=1)
    cluster.wait_for_leader(20)
    port = cluster.nodes[1].port

    out = metalog("produce", "--bootstrap", f"127.0.0.1:{port}", "hello", cwd=str(workdir))
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert lines[0] == (f"metalog: --bootstrap 127.0.0.1:{port} names none of the brokers of {found} (found in "
                        f"the current directory); using its CA and certificate anyway (`--client-config FILE` "
                        f"names the credentials of another cluster)")
    assert lines[-1].startswith(f"metalog: error: TLS handshake with 127.0.0.1:{port} failed: ")
    assert lines[-1].endswith(f" (credentials from client config {found}, CA {other.cert_dir}/ca.crt; "
                              f"`--client-config FILE` names another cluster's)")

    # Named: B's own config is used without a word, and the write succeeds.
    out = metalog("produce", "--client-config", cluster.client_config_path, "--bootstrap", f"127.0.0.1:{port}",
                  "hello", cwd=str(workdir))
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
