"""Kafka's raft metrics on a real cluster's /metrics, scraped over mutual TLS
and checked by promtool (the Debian package prometheus; `bash run.sh setup`
installs it)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from metalog.broker.client import MetalogClient
from metalog.broker.server.metrics import RAFT_METRIC_NAMES
from metalog.broker.net.tls import TlsFiles, TlsPaths
from metalog.tools.cluster.certs import issue_user
from metalog.tools.cluster.launcher import REPO_ROOT, free_ports

pytestmark = pytest.mark.slow

FAST = dict(election_timeout_ms=500, fetch_timeout_ms=1000, request_timeout_ms=1000, fetch_max_wait_ms=200)
P = "kafka_server_raft_metrics_"


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: `bash run.sh setup` installs it (Debian package prometheus)")
    return path


def scrape_text(cluster, node_id: int) -> str:
    url = f"https://{cluster.host}:{cluster.nodes[node_id].admin_port}/metrics"
    with urllib.request.urlopen(url, timeout=5, context=cluster.client_tls().client()) as resp:
        assert resp.status == 200
        return resp.read().decode()


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(cluster, node_id: int) -> dict[tuple[str, tuple], float]:
    return samples(scrape_text(cluster, node_id))


def value(metrics: dict, name: str, **labels) -> float:
    return metrics[(P + name, tuple(sorted(labels.items())))]


def test_promtool_accepts_every_brokers_metrics_and_raft_metrics_tell_the_truth(make_cluster):
    """Every broker's /metrics passes `promtool check metrics` (exit 0, no lint
    output) and carries all of Kafka's raft metrics; current-state,
    current-leader, current-vote and current-epoch agree with /quorum on every
    node; the leader's election latency is > 0; after a produce the high
    watermark moved by the records written, the leader's commit latency and
    append rate are > 0 and the followers' fetch rate is > 0."""
    tool = promtool()
    cluster = make_cluster(voters=3, observers=1, **FAST)
    leader, epoch = cluster.wait_for_leader()

    def all_follow():
        views = {n: cluster.quorum(n) for n in cluster.nodes}
        ok = all(v and v["leader_id"] == leader and v["epoch"] == epoch for v in views.values())
        return views if ok else None

    views = cluster.wait_for(all_follow, 20, f"every node to follow leader {leader} in epoch {epoch}")
    before = {}
    for n in cluster.nodes:
        text = scrape_text(cluster, n)
        check = subprocess.run([tool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
        assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), (
            f"promtool on node {n}: exit {check.returncode}: {check.stdout}{check.stderr}")
        families = {f.name for f in text_string_to_metric_families(text)}
        assert set(RAFT_METRIC_NAMES) <= families, set(RAFT_METRIC_NAMES) - families
        m = samples(text)
        before[n] = m
        expected_state = "leader" if n == leader else ("follower" if cluster.nodes[n].voter else "observer")
        assert views[n]["role"] == expected_state
        assert value(m, "current_state", state=expected_state) == 1
        assert sum(v for (name, _), v in m.items() if name == P + "current_state") == 1
        assert value(m, "current_epoch") == views[n]["epoch"] == epoch
        assert value(m, "current_leader") == leader
        assert value(m, "number_unknown_voter_connections") == 0
        # Kafka's current-vote: a leader voted for itself; a follower is not in the voted state
        assert value(m, "current_vote") == (leader if n == leader else -1)
    lm = before[leader]
    assert value(lm, "election_latency_max") > 0
    assert 0 < value(lm, "election_latency_avg") <= value(lm, "election_latency_max")
    assert value(lm, "log_end_epoch") == epoch  # the leader's LeaderChange record is of its epoch
    hw_before = value(lm, "high_watermark")
    assert hw_before >= 1

    async def produce(values: list[bytes]) -> None:
        client = MetalogClient(cluster.bootstrap(), cluster.cluster_id, tls=cluster.client_tls(),
                               request_timeout_ms=5000)
        try:
            for v in values:
                await client.produce([v])
        finally:
            await client.close()

    written = 20
    asyncio.run(produce([f"metric-{i}".encode() for i in range(written)]))
    # An acknowledged produce is committed: the leader's HW is past it already.
    after = scrape(cluster, leader)
    assert value(after, "high_watermark") >= hw_before + written
    assert value(after, "log_end_offset") >= value(after, "high_watermark")
    assert value(after, "commit_latency_max") > 0
    assert 0 < value(after, "commit_latency_avg") <= value(after, "commit_latency_max")
    assert value(after, "append_records_rate") > 0
    assert value(after, "fetch_records_rate") == 0  # a leader appends, it does not fetch
    assert value(after, "current_epoch") == epoch

    def followers_caught_up():
        got = {n: scrape(cluster, n) for n in cluster.nodes if n != leader}
        ok = all(value(m, "high_watermark") >= hw_before + written for m in got.values())
        return got if ok else None

    followers = cluster.wait_for(followers_caught_up, 20, "every follower's high-watermark metric to move")
    for n, m in followers.items():
        assert value(m, "fetch_records_rate") > 0, n
        assert value(m, "log_end_offset") >= hw_before + written, n

    def idle_ratio_known():
        r = value(scrape(cluster, leader), "poll_idle_ratio_avg")
        return r if not math.isnan(r) else None

    ratio = cluster.wait_for(idle_ratio_known, 10, "two poll-idle samples")
    assert 0 <= ratio <= 1


def test_real_prometheus_scrapes_the_cluster_with_the_shipped_config(make_cluster, tmp_path):
    """The shipped scrape config (monitoring/prometheus/prometheus.yml), with
    its targets and certificate paths mapped to a local cluster, run by a real
    Prometheus: the `prometheus` user's certificate is refused (403) until the
    compose file's own metrics-acl command grants Describe on the cluster;
    then every broker is up, each series carries its node label with the
    quorum's epoch, and every query of the Grafana dashboard evaluates."""
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.fail("prometheus not found: `bash run.sh setup` installs it (Debian package prometheus)")
    cluster = make_cluster(voters=3, observers=1, **FAST)
    leader, epoch = cluster.wait_for_leader()
    d = cluster.cert_dir
    issue_user(d, d, "prometheus")
    user_ctx = TlsFiles(TlsPaths(f"{d}/ca.crt", f"{d}/prometheus.crt", f"{d}/prometheus.key")).client()
    url = f"https://{cluster.host}:{cluster.nodes[leader].admin_port}/metrics"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url, timeout=5, context=user_ctx)
    assert refused.value.code == 403
    assert b"CLUSTER_AUTHORIZATION_FAILED" in refused.value.read()

    with open(os.path.join(REPO_ROOT, "docker-compose.yml")) as f:
        compose = yaml.safe_load(f)
    grant = list(compose["services"]["metrics-acl"]["command"])
    assert grant[0] == "metalog"
    grant[grant.index("--client-config") + 1] = cluster.client_config_path
    done = subprocess.run([sys.executable, "-m", "metalog.tools.cli", *grant[1:]], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    cluster.wait_for(lambda: _status(url, user_ctx) == 200, 10, "the ACL to reach the leader")

    with open(os.path.join(REPO_ROOT, "monitoring", "prometheus", "prometheus.yml")) as f:
        config = yaml.safe_load(f)
    config["global"].update(scrape_interval="1s", scrape_timeout="1s")
    (job,) = config["scrape_configs"]
    for sc in job["static_configs"]:
        node = int(sc["labels"]["node"])
        sc["targets"] = [f"{cluster.host}:{cluster.nodes[node].admin_port}"]
    for key, path in job["tls_config"].items():
        job["tls_config"][key] = os.path.join(d, os.path.basename(path))
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    port = free_ports(1)[0]
    api = f"http://127.0.0.1:{port}/api/v1/query?query="
    with open(tmp_path / "prometheus.out", "w") as out:
        proc = subprocess.Popen([prometheus, f"--config.file={config_path}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=out, stderr=subprocess.STDOUT)
    try:
        def query(expr: str) -> list[dict] | None:
            try:
                with urllib.request.urlopen(api + urllib.parse.quote(expr), timeout=5) as resp:
                    body = json.load(resp)
            except (OSError, ValueError):
                return None
            assert body["status"] == "success", body
            return body["data"]["result"]

        def all_up():
            result = query("up")
            return result if result and len(result) == 4 and all(r["value"][1] == "1" for r in result) else None

        try:
            up = cluster.wait_for(all_up, 60, "Prometheus to scrape all four brokers", poll_s=0.5)
        except TimeoutError:
            raise AssertionError(f"targets not up: {query('up')}\n{(tmp_path / 'prometheus.out').read_text()[-3000:]}")
        assert sorted(r["metric"]["node"] for r in up) == ["1", "2", "3", "4"]
        epochs = query("kafka_server_raft_metrics_current_epoch")
        assert {r["metric"]["node"]: float(r["value"][1]) for r in epochs} == {str(n): epoch for n in cluster.nodes}
        leaders = query("kafka_server_raft_metrics_current_state{state=\"leader\"} == 1")
        assert [r["metric"]["node"] for r in leaders] == [str(leader)]
        with open(os.path.join(REPO_ROOT, "monitoring", "grafana", "dashboards", "metalog-raft.json")) as f:
            dashboard = json.load(f)
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                result = query(target["expr"])
                assert result is not None, (panel["title"], target["expr"])
                if panel["title"] in ("Role per node", "Leader seen by each node", "Epoch per node",
                                      "High watermark and log end offset"):
                    assert len(result) >= 4, (panel["title"], target["expr"], result)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _status(url: str, ctx) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5, context=ctx) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
