"""docker-compose.yml checked against BrokerConfig, and run as local processes."""

import copy
import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from metalog.broker.server.config import parse_voters
from metalog.tools.cluster.compose import ComposeError, cluster_from_compose, load_topology, parse_topology
from metalog.tools.cluster.launcher import REPO_ROOT, free_ports
from metalog.tools.cluster.monitoring import check_monitoring, exported_metric_names

COMPOSE = os.path.join(REPO_ROOT, "docker-compose.yml")


def doc():
    with open(COMPOSE) as f:
        return yaml.safe_load(f)


def test_shipped_compose_is_three_voters_one_observer():
    topo = load_topology(COMPOSE)
    nodes = topo.by_node()
    assert sorted(nodes) == [1, 2, 3, 4]
    assert topo.voter_ids == {1, 2, 3}
    ports = topo.container_ports()
    assert len(ports) == len(set(ports)) == 12  # listen, admin and Kafka ports of 4 brokers
    # Kafka clients on the Docker host: each broker's Kafka listener published
    # and advertised at localhost on the same port.
    for b in topo.brokers:
        kafka = b.config.kafka_endpoint()
        assert kafka is not None and kafka.port == 11090 + b.config.node_id
        assert (kafka.port, kafka.port) in b.published
        assert str(b.config.kafka_node_endpoints()[b.config.node_id]) == f"localhost:{kafka.port}"
    for b in topo.brokers:
        assert b.health_url[1] == b.config.admin_endpoint().port
        assert b.config.data_dir.startswith("/var/lib/metalog/")
    data_vols = [b.mounts["/var/lib/metalog"] for b in topo.brokers]
    assert len(data_vols) == len(set(data_vols)) == 4 and set(data_vols) <= topo.volumes
    # mutual TLS: every broker mounts the certs volume the one-shot `certs` service fills
    for b in topo.brokers:
        assert b.config.security.security_protocol == "SSL"
        assert b.mounts["/etc/metalog/certs"] == "certs"
        assert b.config.security.ssl_cert_file == f"/etc/metalog/certs/node-{b.config.node_id}.crt"
    d0 = doc()
    assert d0["services"]["certs"]["command"][:3] == ["metalog", "certs", "cluster"]
    assert all(d0["services"][b.name]["depends_on"]["certs"]["condition"] == "service_completed_successfully"
               for b in topo.brokers)
    d = doc()
    assert {"spark", "drill"} <= set(d["services"])
    assert d["services"]["spark"]["build"]["target"] == "spark"  # Java only in the Spark image
    assert d["services"]["broker1"]["build"]["target"] == "broker"


def test_dockerfile_has_nonroot_user_and_java_only_in_spark_stage():
    text = open(os.path.join(REPO_ROOT, "Dockerfile")).read()
    stages = text.split("\nFROM ")
    broker = next(s for s in stages if s.startswith("python:3.11-slim AS broker"))
    spark = next(s for s in stages if s.startswith("broker AS spark"))
    assert "USER metalog" in broker and "jre" not in broker
    assert "openjdk-17-jre-headless" in spark and spark.rstrip().endswith("USER metalog")


def _svc_cmd(d, name):
    return d["services"][name]["command"]


def _set(cmd, key, value):
    i = next(i for i, a in enumerate(cmd) if isinstance(a, str) and a.startswith(key + "="))
    cmd[i] = f"{key}={value}"


@pytest.mark.parametrize("mutate, message", [
    (lambda d: _set(_svc_cmd(d, "broker2"), "listen", "0.0.0.0:9091"),
     "service broker2: listen port 9091 is also used by service broker1"),
    (lambda d: _set(_svc_cmd(d, "broker3"), "admin_listen", "0.0.0.0:8091"),
     "service broker3: admin_listen port 8091 is also used by service broker1"),
    (lambda d: _set(_svc_cmd(d, "broker2"), "node_id", "1"),
     "service broker2: node_id 1 is also used by service broker1"),
    (lambda d: _svc_cmd(d, "broker3").extend(["--set", "voters=1@broker1:9091,2@broker2:9092"]),
     "service broker3: voters '1@broker1:9091,2@broker2:9092' differ from service broker1's"),
    (lambda d: d["services"]["broker2"].update(volumes=["broker1-data:/var/lib/metalog"]),
     "service broker2: volume 'broker1-data' is also used by service broker1; each broker needs its own"),
    (lambda d: d["services"]["broker2"].pop("volumes"),
     "service broker2: data_dir /var/lib/metalog/data is not on a named volume"),
    (lambda d: d["volumes"].pop("broker3-data"),
     "service broker3: volume 'broker3-data' is not declared under top-level volumes"),
    (lambda d: d["services"]["observer4"]["healthcheck"].update(
        test=["CMD", "python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9094/health')"]),
     "service observer4: healthcheck hits 127.0.0.1:9094 but the admin API listens on port 8094"),
    (lambda d: d["services"]["broker1"].pop("healthcheck"),
     "service broker1: healthcheck must request http(s)://127.0.0.1:<admin port>/health"),
    (lambda d: d["services"]["broker3"].update(volumes=["broker3-data:/var/lib/metalog"]),
     "service broker3: ssl_ca_file /etc/metalog/certs/ca.crt is not on a mounted volume"),
    (lambda d: _svc_cmd(d, "broker1").extend(["--set", "election_timeout_ms=-5"]),
     "service broker1: election_timeout_ms: must be > 0, got -5"),
    (lambda d: d["configs"]["broker-config"].update(
        content="cluster_id: x\nvoters: \"1@broker1:9091,2@broker2:9092,3@nobody:9093\"\n"),
     "voter 3@nobody:9093 names host 'nobody', which is no broker service"),
    (lambda d: d["configs"]["broker-config"].update(
        content="cluster_id: x\nvoters: \"1@broker1:9091,2@broker2:9092,3@broker3:9999\"\n"),
     "voter 3@broker3:9999: service broker3 listens on port 9093"),
    (lambda d: _set(_svc_cmd(d, "broker2"), "kafka_listen", "0.0.0.0:9091"),
     "service broker2: kafka_listen port 9091 is also used by service broker1"),
    (lambda d: d["services"]["broker3"].update(ports=["9093:9093", "8093:8093"]),
     "service broker3: kafka_endpoints advertises 3@localhost:11093 but the service does not publish 11093:11093"),
    (lambda d: _svc_cmd(d, "observer4").extend(["--set", "kafka_endpoints=1@localhost:11091"]),
     "service observer4: kafka_endpoints '1@localhost:11091' differ from service broker1's"),
    (lambda d: d["configs"]["broker-config"].update(content=d["configs"]["broker-config"]["content"].replace(
        ",4@localhost:11094", "")),
     "service observer4: kafka_listen is set but kafka_endpoints does not name node 4"),
    (lambda d: d["configs"]["broker-config"].update(content=d["configs"]["broker-config"]["content"].replace(
        "2@localhost:11092", "2@broker3:11092")),
     "service broker2: kafka_endpoints advertises 2@broker3:11092, which is not this service's hostname and "
     "kafka_listen port (broker2:11092)"),
])
def test_broken_compose_files_are_refused_with_the_reason(mutate, message):
    d = copy.deepcopy(doc())
    mutate(d)
    with pytest.raises(ComposeError) as err:
        parse_topology(d, "docker-compose.yml")
    assert message in str(err.value)


def test_local_mapping_is_deterministic(tmp_path):
    c = cluster_from_compose(COMPOSE, str(tmp_path), port_offset=1000)
    assert {n: (s.port, s.admin_port, s.voter) for n, s in c.nodes.items()} == {
        1: (10091, 9091, True), 2: (10092, 9092, True), 3: (10093, 9093, True), 4: (10094, 9094, False)}
    cmd = c.nodes[2].command
    assert cmd[:4] == [sys.executable, "-m", "metalog.tools.cli", "broker"]
    assert f"data_dir={tmp_path}/node-2/data" in cmd and f"log_file={tmp_path}/node-2/broker.log" in cmd
    assert "listen=127.0.0.1:10092" in cmd
    assert "kafka_listen=127.0.0.1:12092" in cmd
    assert {n: s.kafka_port for n, s in c.nodes.items()} == {1: 12091, 2: 12092, 3: 12093, 4: 12094}
    cfg = yaml.safe_load(open(cmd[cmd.index("--config") + 1]))
    assert {k: str(v) for k, v in parse_voters(cfg["voters"]).items()} == {
        1: "127.0.0.1:10091", 2: "127.0.0.1:10092", 3: "127.0.0.1:10093"}
    assert {k: str(v) for k, v in parse_voters(cfg["kafka_endpoints"], "kafka_endpoints").items()} == {
        n: f"127.0.0.1:{12090 + n}" for n in (1, 2, 3, 4)}


def _free_offset() -> int:
    """An offset that puts all 12 container ports (8091-8094, 9091-9094, 11091-11094) on free local ports."""
    for base in free_ports(20):
        offset = base - 8091
        if offset < 1000 or base + 3010 > 65000:
            continue
        probe = [p + offset for p in (8091, 8092, 8093, 8094, 9091, 9092, 9093, 9094, 11091, 11092, 11093, 11094)]
        import socket
        ok = True
        for p in probe:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return offset
    raise RuntimeError("no free port range")


@pytest.mark.slow
def test_cluster_up_from_compose_elects_a_leader(tmp_path):
    env = dict(os.environ, METALOG_COMPOSE_PORT_OFFSET=str(_free_offset()))
    proc = subprocess.run(
        [sys.executable, "-m", "metalog.tools.cli", "cluster", "up", "--compose", COMPOSE, "--dir", str(tmp_path),
         "--exit-when-ready", "--ready-timeout-s", "30"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "metalog cluster 'metalog-compose' is up: leader" in proc.stdout
    roles = [line.split()[1] for line in proc.stdout.splitlines() if line.strip()[:1] in "1234" and "https://" in line]
    assert sorted(roles) == ["follower", "follower", "leader", "observer"], proc.stdout
    # the brokers really ran with the compose settings: logs on the mapped volume dirs
    for n in (1, 2, 3, 4):
        assert os.path.getsize(tmp_path / f"node-{n}" / "broker.log") > 0
        assert (tmp_path / f"node-{n}" / "data").is_dir()


# ------------------------------------------------------------ monitoring
@pytest.mark.slow
def test_a_compose_cluster_serves_kafka_clients(tmp_path):
    """The compose file's brokers, run locally: kcat with the cluster's
    kafka-client.properties lists the 4 brokers at their advertised Kafka
    ports (the compose file's localhost:1109N, shifted by the offset) and the
    leader of __cluster_metadata, as against `metalog cluster up`."""
    offset = _free_offset()
    cluster = cluster_from_compose(COMPOSE, str(tmp_path), port_offset=offset)
    try:
        cluster.start()
        leader, _ = cluster.wait_for_leader(30)
        with open(cluster.kafka_properties_path) as f:
            props = f.read()
        assert f"bootstrap.servers={','.join(f'127.0.0.1:{11090 + n + offset}' for n in (1, 2, 3, 4))}" in props
        kcat = shutil.which("kcat")
        assert kcat, "kcat is not installed: bash run.sh setup installs it (Debian package kcat)"
        out = subprocess.run([kcat, "-F", cluster.kafka_properties_path, "-L", "-J", "-m", "30"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        meta = json.loads(out.stdout)
        assert {b["id"]: b["name"] for b in meta["brokers"]} == {
            n: f"127.0.0.1:{11090 + n + offset}" for n in (1, 2, 3, 4)}
        (partition,) = meta["topics"][0]["partitions"]
        assert partition["leader"] == leader
    finally:
        cluster.stop()


def test_shipped_monitoring_is_valid_and_scrapes_every_broker():
    """The shipped prometheus and grafana services pass the whole check
    (promtool check config and rules included); Prometheus scrapes each
    broker's admin endpoint over https with the node label, and every
    dashboard query names a metric the broker exports."""
    topo = load_topology(COMPOSE)
    check_monitoring(topo)
    prom = yaml.safe_load(open(os.path.join(REPO_ROOT, "monitoring", "prometheus", "prometheus.yml")))
    (job,) = prom["scrape_configs"]
    assert job["scheme"] == "https"
    targets = {t: sc["labels"]["node"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {f"{b.hostname}:{b.config.admin_endpoint().port}": str(b.config.node_id) for b in topo.brokers}
    dash = json.load(open(os.path.join(REPO_ROOT, "monitoring", "grafana", "dashboards", "metalog-raft.json")))
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    for name in ("current_state", "current_leader", "current_epoch", "high_watermark", "log_end_offset",
                 "commit_latency_max", "election_latency_max", "fetch_records_rate", "append_records_rate"):
        assert f"kafka_server_raft_metrics_{name}" in exprs
    assert "metalog_corrupt_batches_total" in exprs and "metalog_divergence_detected_total" in exprs
    assert exported_metric_names() >= {"kafka_server_raft_metrics_current_epoch", "metalog_corrupt_batches_total",
                                       "metalog_divergence_detected_total", "metalog_log_flush_seconds_bucket"}


def _monitoring_copy(tmp_path):
    """The compose file and monitoring/ copied to tmp_path, for breaking."""
    shutil.copytree(os.path.join(REPO_ROOT, "monitoring"), tmp_path / "monitoring")
    return copy.deepcopy(doc()), tmp_path / "monitoring"


def _edit(path, old, new):
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))


PROM = "prometheus/prometheus.yml"
DASH = "grafana/dashboards/metalog-raft.json"


@pytest.mark.parametrize("file, old, new, message", [
    (PROM, '      - targets: ["observer4:8094"]\n        labels: {node: "4"}\n', "",
     "no job scrapes observer4:8094"),
    (PROM, 'labels: {node: "2"}', 'labels: {node: "3"}',
     'target broker2:8092 (service broker2) must carry label node="2", has \'3\''),
    (PROM, "broker3:8093", "broker3:9093", "target broker3:9093 is no broker's admin endpoint"),
    (PROM, "scheme: https", "scheme: http", "job metalog: scheme http but the brokers' admin API speaks https"),
    (PROM, "scrape_interval: 15s", "scrape_interval: fifteen", "promtool check config failed (exit 1)"),
    (PROM, "      key_file: /etc/prometheus/certs/prometheus.key\n", "",
     "tls_config.key_file is required (the admin API asks for a client certificate)"),
    (DASH, '"kafka_server_raft_metrics_current_epoch"', '"kafka_server_raft_metrics_current_epoc"',
     "panel 'Epoch per node': kafka_server_raft_metrics_current_epoc is not a metric the broker exports"),
    (DASH, '"kafka_server_raft_metrics_current_epoch"', '"up"', "panel 'Epoch per node': query 'up' names no broker metric"),
    (DASH, '"kafka_server_raft_metrics_current_epoch"', '"rate(kafka_server_raft_metrics_current_epoch[5m]"',
     "dashboards: a query is not valid PromQL (promtool check rules, exit 1)"),
    (DASH, '"uid": "metalog-raft"', '"uid": metalog-raft', "not valid JSON"),
    ("grafana/provisioning/datasources/prometheus.yml", "http://prometheus:9090", "http://localhost:9090",
     "datasource 'Prometheus' url 'http://localhost:9090' must be http://prometheus:9090"),
])
def test_broken_monitoring_files_are_refused_with_the_reason(tmp_path, file, old, new, message):
    d, mon = _monitoring_copy(tmp_path)
    _edit(mon / file, old, new)
    with pytest.raises(ComposeError) as err:
        check_monitoring(parse_topology(d, str(tmp_path / "docker-compose.yml")))
    assert message in str(err.value)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["services"].pop("metrics-acl"), "no service grants User:prometheus Describe on the cluster"),
    (lambda d: d["services"]["certs"]["command"].remove("prometheus"),
     "service certs does not make the `prometheus` certificate"),
    (lambda d: d["services"].pop("prometheus-certs"),
     "no service copies the certificates from the brokers' volume (certs) into volume 'prometheus-certs'"),
    (lambda d: d["services"]["prometheus"]["volumes"].__setitem__(0, "./monitoring/nothing.yml:/etc/prometheus/prometheus.yml:ro"),
     "monitoring/nothing.yml does not exist"),
    (lambda d: d["services"]["grafana"]["volumes"].pop(1),
     "provider 'metalog' path /var/lib/grafana/dashboards is not a bind-mounted directory of the grafana service"),
    (lambda d: d["configs"]["admin-client"].update(content="bootstrap: broker1:9091\ncluster_id: other\n"),
     "service metrics-acl: client config 'admin-client': cluster_id 'other', the brokers run 'metalog-compose'"),
    (lambda d: d["services"].pop("grafana"), "no `grafana` service (the metrics stack)"),
])
def test_broken_monitoring_services_are_refused_with_the_reason(tmp_path, mutate, message):
    d, _ = _monitoring_copy(tmp_path)
    mutate(d)
    with pytest.raises(ComposeError) as err:
        check_monitoring(parse_topology(d, str(tmp_path / "docker-compose.yml")))
    assert message in str(err.value)
