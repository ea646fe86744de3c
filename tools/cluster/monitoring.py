"""The compose file's monitoring: Prometheus scrape config and Grafana provisioning.

``check_monitoring(topo)`` validates the `prometheus` and `grafana` services
of a docker-compose file that ``metalog.tools.cluster.compose.load_topology`` already
accepted, without a Docker engine:

* Prometheus: the config file the service mounts at its ``--config.file``
  exists; ``promtool check config`` passes on it (certificate paths point at
  stand-in files: promtool only checks that they exist); its targets are
  exactly the broker services' admin endpoints (``hostname:admin port``, one
  each, label ``node`` = the node id), over https when the brokers run TLS,
  path /metrics; the TLS files sit on a named volume that a one-shot service
  fills from the `certs` volume; the `certs` service makes that user's
  certificate and a service grants the user Describe on the cluster (all
  /metrics needs).
* Grafana: the provisioning directory exists; a Prometheus datasource points
  at the prometheus service's port; the dashboard provider's path is a
  mounted directory; every dashboard JSON parses, each panel queries that
  datasource, each query names at least one metric the broker exports
  (checked against ``metalog.broker.server.metrics.BrokerMetrics``'s registry) and no other
  metalog_/kafka_ name, and every query is valid PromQL (``promtool check
  rules``).

Any breach raises ``ComposeError`` naming the file and what is wrong.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import tempfile
from typing import Any

import yaml

from metalog.broker.client.config import ClientConfig
from metalog.broker.server.metrics import BrokerMetrics
from metalog.tools.cluster.compose import ComposeError, Topology

PROMETHEUS_DEFAULT_CONFIG = "/etc/prometheus/prometheus.yml"
PROMETHEUS_DEFAULT_PORT = 9090
PROMTOOL_TIMEOUT_S = 60
# Names a dashboard query may use: our own and Kafka's raft metrics.
_METRIC_NAME = re.compile(r"\b(?:metalog|kafka_server_raft_metrics)_[a-zA-Z0-9_]*")


def exported_metric_names() -> set[str]:
    """Every sample name a broker's /metrics can carry (counters as *_total,
    histograms as *_bucket/_count/_sum), from a fresh broker registry."""
    names: set[str] = set()
    for family in BrokerMetrics(0).registry.collect():
        names.update(s.name for s in family.samples)
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names.update(family.name + suffix for suffix in ("_bucket", "_count", "_sum"))
        else:
            names.add(family.name)
    return names


def _promtool(promtool: str | None) -> str:
    path = promtool or shutil.which("promtool")
    if path is None:
        raise ComposeError("promtool not found: it checks the Prometheus config and the dashboard queries "
                           "(`bash run.sh setup` installs the Debian package prometheus)")
    return path


def _bind_mounts(svc: dict, base_dir: str, where: str) -> dict[str, str]:
    """Container path -> absolute host path, for the service's bind mounts."""
    out = {}
    for item in svc.get("volumes") or []:
        if isinstance(item, str):
            parts = item.split(":")
            if len(parts) < 2:
                continue
            source, target = parts[0], parts[1]
        elif isinstance(item, dict):
            if item.get("type") not in (None, "bind"):
                continue
            source, target = item.get("source"), item.get("target")
        else:
            raise ComposeError(f"{where}: volumes: unreadable entry {item!r}")
        if source and target and source.startswith((".", "/")):
            out[target] = os.path.normpath(os.path.join(base_dir, source))
    return out


def _named_mounts(svc: dict) -> dict[str, str]:
    """Container path -> named volume."""
    out = {}
    for item in svc.get("volumes") or []:
        if isinstance(item, str) and ":" in item:
            source, target = item.split(":")[:2]
        elif isinstance(item, dict) and item.get("type") in (None, "volume"):
            source, target = item.get("source"), item.get("target")
        else:
            continue
        if source and target and not source.startswith((".", "/", "~")):
            out[target] = source
    return out


def _under(path: str, mount: str) -> bool:
    return path == mount or path.startswith(mount.rstrip("/") + "/")


def _host_path(container_path: str, binds: dict[str, str]) -> str | None:
    for target, source in sorted(binds.items(), key=lambda kv: -len(kv[0])):
        if _under(container_path, target):
            return source + container_path[len(target.rstrip("/")):]
    return None


def _command(svc: dict) -> list[str]:
    cmd = svc.get("command") or []
    return cmd.split() if isinstance(cmd, str) else [str(c) for c in cmd]


def _flag(cmd: list[str], name: str, default: str) -> str:
    for i, arg in enumerate(cmd):
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
        if arg == name and i + 1 < len(cmd):
            return cmd[i + 1]
    return default


def _load_yaml(path: str, what: str) -> Any:
    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except OSError as exc:
        raise ComposeError(f"{what} {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ComposeError(f"{what} {path}: not valid YAML: {exc}") from None


def check_monitoring(topo: Topology, promtool: str | None = None) -> None:
    """Validate the `prometheus` and `grafana` services (module docstring)."""
    base_dir = os.path.dirname(os.path.abspath(topo.path))
    services = topo.services
    for name in ("prometheus", "grafana"):
        if not isinstance(services.get(name), dict):
            raise ComposeError(f"{topo.path}: no `{name}` service (the metrics stack)")
    tool = _promtool(promtool)
    port = _check_prometheus(topo, base_dir, tool)
    _check_grafana(topo, base_dir, tool, port)


def _check_prometheus(topo: Topology, base_dir: str, tool: str) -> int:
    svc = topo.services["prometheus"]
    where = f"{topo.path}: service prometheus"
    cmd = _command(svc)
    config_in_container = _flag(cmd, "--config.file", PROMETHEUS_DEFAULT_CONFIG)
    listen = _flag(cmd, "--web.listen-address", f":{PROMETHEUS_DEFAULT_PORT}")
    port = int(listen.rpartition(":")[2])
    binds = _bind_mounts(svc, base_dir, where)
    config_path = _host_path(config_in_container, binds)
    if config_path is None:
        raise ComposeError(f"{where}: --config.file {config_in_container} is not bind-mounted from the repo "
                           f"(bind mounts: {sorted(binds) or 'none'})")
    if not os.path.isfile(config_path):
        raise ComposeError(f"{where}: the scrape config {config_path} does not exist")
    doc = _load_yaml(config_path, "Prometheus config")
    jobs = (doc or {}).get("scrape_configs") or []
    if not jobs:
        raise ComposeError(f"{config_path}: no scrape_configs")

    # Targets: exactly the broker services' admin endpoints, labelled with their node id.
    tls = any(b.config.tls_enabled for b in topo.brokers)
    want = {f"{b.hostname}:{b.config.admin_endpoint().port}": b for b in topo.brokers}
    seen: dict[str, str] = {}
    tls_files: dict[str, str] = {}
    for job in jobs:
        name = job.get("job_name", "?")
        for sc in job.get("static_configs") or []:
            for target in sc.get("targets") or []:
                b = want.get(target)
                if b is None:
                    raise ComposeError(f"{config_path}: job {name}: target {target} is no broker's admin endpoint "
                                       f"(brokers: {', '.join(sorted(want))})")
                if target in seen:
                    raise ComposeError(f"{config_path}: target {target} is scraped twice (jobs {seen[target]}, {name})")
                seen[target] = name
                node = str((sc.get("labels") or {}).get("node", ""))
                if node != str(b.config.node_id):
                    raise ComposeError(f"{config_path}: target {target} (service {b.name}) must carry "
                                       f"label node=\"{b.config.node_id}\", has {node!r}")
                scheme = job.get("scheme", "http")
                if scheme != ("https" if tls else "http"):
                    raise ComposeError(f"{config_path}: job {name}: scheme {scheme} but the brokers' admin API "
                                       f"speaks {'https (mutual TLS)' if tls else 'http'}")
                if job.get("metrics_path", "/metrics") != "/metrics":
                    raise ComposeError(f"{config_path}: job {name}: metrics_path must be /metrics")
                if tls:
                    tc = job.get("tls_config") or {}
                    for key in ("ca_file", "cert_file", "key_file"):
                        if not tc.get(key):
                            raise ComposeError(f"{config_path}: job {name}: tls_config.{key} is required "
                                               "(the admin API asks for a client certificate)")
                        tls_files[key] = tc[key]
    missing = sorted(set(want) - set(seen))
    if missing:
        raise ComposeError(f"{config_path}: no job scrapes {', '.join(missing)}")
    if tls:
        _check_scrape_credentials(topo, tls_files, config_path)

    # promtool, with the in-container certificate paths pointed at stand-ins.
    with tempfile.TemporaryDirectory(prefix="metalog-promtool-") as tmp:
        text = open(config_path).read()
        for key, p in tls_files.items():
            stand_in = os.path.join(tmp, key)
            open(stand_in, "w").close()
            text = text.replace(p, stand_in)
        checked = os.path.join(tmp, "prometheus.yml")
        with open(checked, "w") as f:
            f.write(text)
        proc = subprocess.run([tool, "check", "config", checked], capture_output=True, text=True,
                              timeout=PROMTOOL_TIMEOUT_S)
        if proc.returncode != 0:
            raise ComposeError(f"{config_path}: promtool check config failed (exit {proc.returncode}): "
                               f"{(proc.stdout + proc.stderr).strip().replace(checked, config_path)}")
    return port


def _check_scrape_credentials(topo: Topology, tls_files: dict[str, str], config_path: str) -> None:
    """The client certificate Prometheus uses exists in the compose setup: on a
    named volume of the prometheus service, filled by a service that reads the
    `certs` volume; the `certs` service makes it; an ACL lets it read /metrics."""
    services = topo.services
    where = f"{topo.path}: service prometheus"
    mounts = _named_mounts(services["prometheus"])
    volumes = set()
    for key, p in tls_files.items():
        vol = next((v for m, v in mounts.items() if _under(p, m)), None)
        if vol is None:
            raise ComposeError(f"{where}: tls_config.{key} {p} ({config_path}) is not on a mounted named volume "
                               f"(mounts: {mounts or 'none'})")
        if vol not in topo.volumes:
            raise ComposeError(f"{where}: volume {vol!r} is not declared under top-level volumes")
        volumes.add(vol)
    broker_certs = {v for b in topo.brokers for m, v in b.mounts.items()
                    if _under(b.config.security.ssl_ca_file or "", m)}
    for vol in volumes - broker_certs:
        fillers = [n for n, s in services.items() if isinstance(s, dict) and n != "prometheus"
                   and vol in _named_mounts(s).values() and broker_certs & set(_named_mounts(s).values())]
        if not fillers:
            raise ComposeError(f"{where}: no service copies the certificates from the brokers' volume "
                               f"({', '.join(sorted(broker_certs))}) into volume {vol!r}")
    user = os.path.splitext(os.path.basename(tls_files["cert_file"]))[0]
    certs_cmd = _command(services.get("certs") or {})
    if not any(certs_cmd[i:i + 2] == ["--user", user] for i in range(len(certs_cmd))):
        raise ComposeError(f"{topo.path}: service certs does not make the `{user}` certificate that "
                           f"{config_path} uses (add --user {user})")
    granted = False
    for name, s in services.items():
        cmd = _command(s) if isinstance(s, dict) else []
        if cmd[:3] == ["metalog", "acls", "add"] and f"User:{user}" in cmd and "--cluster" in cmd \
                and _flag(cmd, "--operation", "") in ("Describe", "All"):
            _check_admin_client(topo, name, s, _flag(cmd, "--client-config", ""))
            granted = True
    if not granted:
        raise ComposeError(f"{topo.path}: no service grants User:{user} Describe on the cluster "
                           f"(`metalog acls add --allow-principal User:{user} --operation Describe --cluster`); "
                           "without it every scrape is refused 403")


def _check_admin_client(topo: Topology, name: str, svc: dict, path: str) -> None:
    """The one-shot ACL service's --client-config is a mounted config the CLI
    accepts, for this cluster, naming broker services and mounted certificates."""
    where = f"{topo.path}: service {name}"
    refs = {}
    for ref in svc.get("configs") or []:
        src, tgt = (ref, f"/{ref}") if isinstance(ref, str) else (ref.get("source"), ref.get("target"))
        refs[tgt] = src
    if path not in refs or refs[path] not in topo.configs:
        raise ComposeError(f"{where}: --client-config {path!r} is not a mounted config (mounted: {sorted(refs) or 'none'})")
    data = yaml.safe_load(topo.configs[refs[path]]) or {}
    known = {f.name for f in dataclasses.fields(ClientConfig)} - {"path"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ComposeError(f"{where}: client config {refs[path]!r}: unknown keys {unknown} (known: {sorted(known)})")
    cluster_id = topo.brokers[0].config.cluster_id
    if data.get("cluster_id") != cluster_id:
        raise ComposeError(f"{where}: client config {refs[path]!r}: cluster_id {data.get('cluster_id')!r}, "
                           f"the brokers run {cluster_id!r}")
    listeners = {f"{b.hostname}:{b.config.listen_endpoint().port}" for b in topo.brokers}
    for item in str(data.get("bootstrap", "")).split(","):
        if item.strip() not in listeners:
            raise ComposeError(f"{where}: client config {refs[path]!r}: bootstrap {item.strip()!r} is no broker "
                               f"listener ({', '.join(sorted(listeners))})")
    mounts = _named_mounts(svc)
    for key in ("ssl_ca_file", "ssl_cert_file", "ssl_key_file"):
        p = data.get(key)
        if data.get("security_protocol", "SSL") == "SSL" and not (p and any(_under(p, m) for m in mounts)):
            raise ComposeError(f"{where}: client config {refs[path]!r}: {key} {p!r} is not on a mounted volume")


def _check_grafana(topo: Topology, base_dir: str, tool: str, prometheus_port: int) -> None:
    svc = topo.services["grafana"]
    where = f"{topo.path}: service grafana"
    binds = _bind_mounts(svc, base_dir, where)
    provisioning = _host_path("/etc/grafana/provisioning", binds)
    if provisioning is None or not os.path.isdir(provisioning):
        raise ComposeError(f"{where}: /etc/grafana/provisioning must be bind-mounted from an existing directory "
                           f"(bind mounts: {binds or 'none'})")
    uid = None
    for path in sorted(glob.glob(os.path.join(provisioning, "datasources", "*.y*ml"))):
        for ds in (_load_yaml(path, "Grafana datasource") or {}).get("datasources") or []:
            if ds.get("type") != "prometheus":
                continue
            url = str(ds.get("url", ""))
            if url != f"http://prometheus:{prometheus_port}":
                raise ComposeError(f"{path}: datasource {ds.get('name')!r} url {url!r} must be "
                                   f"http://prometheus:{prometheus_port} (the prometheus service)")
            uid = ds.get("uid")
    if uid is None:
        raise ComposeError(f"{provisioning}/datasources: no Prometheus datasource with a uid")
    dashboards = []
    for path in sorted(glob.glob(os.path.join(provisioning, "dashboards", "*.y*ml"))):
        for provider in (_load_yaml(path, "Grafana dashboard provider") or {}).get("providers") or []:
            in_container = str((provider.get("options") or {}).get("path", ""))
            host = _host_path(in_container, binds)
            if host is None or not os.path.isdir(host):
                raise ComposeError(f"{path}: provider {provider.get('name')!r} path {in_container} is not a "
                                   f"bind-mounted directory of the grafana service")
            dashboards += sorted(glob.glob(os.path.join(host, "*.json")))
    if not dashboards:
        raise ComposeError(f"{provisioning}/dashboards: no dashboard provider with a dashboard JSON")
    exported = exported_metric_names()
    exprs: list[str] = []
    for path in dashboards:
        try:
            with open(path) as f:
                dash = json.load(f)
        except ValueError as exc:
            raise ComposeError(f"dashboard {path}: not valid JSON: {exc}") from None
        panels = dash.get("panels") or []
        if not panels:
            raise ComposeError(f"dashboard {path}: no panels")
        for panel in panels:
            title = panel.get("title", f"id {panel.get('id')}")
            targets = panel.get("targets") or []
            if not targets:
                raise ComposeError(f"dashboard {path}: panel {title!r} has no query")
            for t in targets:
                ds = t.get("datasource") or panel.get("datasource") or {}
                if ds.get("uid") != uid:
                    raise ComposeError(f"dashboard {path}: panel {title!r} uses datasource {ds.get('uid')!r}, "
                                       f"not the provisioned {uid!r}")
                expr = str(t.get("expr", ""))
                names = set(_METRIC_NAME.findall(expr))
                if not names:
                    raise ComposeError(f"dashboard {path}: panel {title!r}: query {expr!r} names no broker metric")
                unknown = sorted(names - exported)
                if unknown:
                    raise ComposeError(f"dashboard {path}: panel {title!r}: {', '.join(unknown)} is not a metric "
                                       "the broker exports")
                exprs.append(expr)
    # PromQL syntax: every query as a recording rule, checked by promtool.
    with tempfile.TemporaryDirectory(prefix="metalog-promtool-") as tmp:
        rules = {"groups": [{"name": "dashboard", "rules": [
            {"record": f"dashboard:query_{i}", "expr": e} for i, e in enumerate(exprs)]}]}
        rules_path = os.path.join(tmp, "dashboard-queries.yml")
        with open(rules_path, "w") as f:
            yaml.safe_dump(rules, f)
        proc = subprocess.run([tool, "check", "rules", rules_path], capture_output=True, text=True,
                              timeout=PROMTOOL_TIMEOUT_S)
        if proc.returncode != 0:
            raise ComposeError(f"dashboards: a query is not valid PromQL (promtool check rules, exit "
                               f"{proc.returncode}): {(proc.stdout + proc.stderr).strip()}")
