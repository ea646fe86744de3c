"""The Kubernetes manifests (tools/deploy/kubernetes), validated offline: no
cluster runs here.

- The shipped manifests decode strictly into Kubernetes' own API types and
  agree with each other (.bin/metalog-kubecheck, built by `bash run.sh setup`
  from tools/deploy/kubecheck), and each of a set of plausible mistakes makes
  the checker fail with the line that names it.
- The broker's command line, expanded as the kubelet does for each pod, goes
  through the broker's own argument parser and BrokerConfig: node id = the
  ordinal, advertised address = the pod's stable name, mutual TLS on.
- The CLI commands in docs/kubernetes.md parse with the CLI's own parser.
- The init container's format script, run for real on a temporary dir,
  formats an empty dir once and leaves a formatted one alone.
- The probe script answers as the probes need against a real TLS server.
- The quorum the manifests describe runs on loopback (node <n>'s stable name
  becomes 127.0.0.<n>): the pods' command lines, config, certificate layout,
  format step and probes; then the doc's scale-out and voter replacement
  commands, as written there.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shlex
import shutil
import ssl
import subprocess
import sys
import threading

import pytest
import yaml

from metalog.broker.client.config import load_client_config
from metalog.broker.server import main as broker_main
from metalog.broker.server.config import config_from_dict
from metalog.tools.cli.app import build_parser
from metalog.tools.cluster import certs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MANIFESTS = os.path.join(REPO, "tools", "deploy", "kubernetes")
BOOTSTRAP = os.path.join(MANIFESTS, "bootstrap")
KUBECHECK = os.path.join(REPO, ".bin", "metalog-kubecheck")
DOC = os.path.join(REPO, "docs", "kubernetes.md")
NODE_IDS = (1, 2, 3)


def fqdn(node_id: int) -> str:
    return f"metalog-{node_id}.metalog-peers.metalog.svc.cluster.local"


def load_docs(name: str) -> list[dict]:
    with open(os.path.join(MANIFESTS, name)) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def one(kind: str, name: str | None = None) -> dict:
    found = [d for f in sorted(os.listdir(MANIFESTS)) if f.endswith(".yaml") for d in load_docs(f)
             if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def config_data() -> dict[str, str]:
    return one("ConfigMap", "metalog-config")["data"]


def initial_controllers() -> str:
    with open(os.path.join(BOOTSTRAP, "initial-controllers.yaml")) as f:
        return yaml.safe_load(f)["data"]["initial-controllers"]


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion: known names replaced, $$ -> $, others kept."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def pod_env(container: dict, node_id: int) -> dict[str, str]:
    """The container's variables in pod metalog-<node_id>, as the kubelet makes them."""
    pod = {"metadata.name": f"metalog-{node_id}", "metadata.namespace": "metalog",
           "metadata.labels['apps.kubernetes.io/pod-index']": str(node_id)}
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = pod[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def container(name: str, init: bool = False) -> dict:
    spec = one("StatefulSet", "metalog")["spec"]["template"]["spec"]
    return next(c for c in spec["initContainers" if init else "containers"] if c["name"] == name)


def kubecheck(*paths: str) -> subprocess.CompletedProcess:
    assert os.access(KUBECHECK, os.X_OK), (
        f"{KUBECHECK} is missing: `bash run.sh setup` builds it from tools/deploy/kubecheck (needs Go)")
    return subprocess.run([KUBECHECK, *paths], capture_output=True, text=True, timeout=60)


# -- the checker over the shipped manifests and over broken copies -------------------
def test_shipped_manifests_decode_strictly_and_agree():
    proc = kubecheck(MANIFESTS, BOOTSTRAP)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "decoded strictly, consistent" in proc.stdout
    # Every kind the manifests hold was decoded (an unknown kind is a failure, not a skip).
    assert re.search(r"\b15 objects in 8 files\b", proc.stdout), proc.stdout


MUTATIONS = [
    # (file, text, replacement, a line the checker must print)
    ("40-statefulset.yaml", "periodSeconds: 10", "periodSecond: 10",
     'StatefulSet: error unmarshaling JSON: while decoding JSON: json: unknown field "periodSecond"'),
    ("50-pdb.yaml", "maxUnavailable: 1", "maxUnavailable: one",
     "PodDisruptionBudget/metalog: maxUnavailable: invalid value for IntOrString"),
    ("40-statefulset.yaml", "serviceName: metalog-peers", "serviceName: metalog-peer",
     'StatefulSet/metalog: spec.serviceName "metalog-peer": no such Service in namespace "metalog"'),
    ("40-statefulset.yaml", "serviceName: metalog-peers", "serviceName: metalog",
     'StatefulSet/metalog: spec.serviceName "metalog" is not headless (clusterIP: None)'),
    ("40-statefulset.yaml", "tcpSocket: {port: peer}", "tcpSocket: {port: raft}",
     "StatefulSet/metalog: container \"broker\" startupProbe: port raft is none of the container's ports"),
    ("30-services.yaml", "targetPort: admin\n---", "targetPort: admn\n---",
     'Service/metalog-peers: port "admin": targetPort admn is no containerPort of StatefulSet/metalog\'s pods'),
    ("50-pdb.yaml", "maxUnavailable: 1", "maxUnavailable: 2",
     "PodDisruptionBudget/metalog: maxUnavailable 2 lets 2 of StatefulSet/metalog's 3 voters go: 1 left, "
     "below the majority of 2"),
    ("50-pdb.yaml", "maxUnavailable: 1", "maxUnavailable: 50%",
     "PodDisruptionBudget/metalog: maxUnavailable 50% lets 2 of StatefulSet/metalog's 3 voters go"),
    ("50-pdb.yaml", "maxUnavailable: 1", "minAvailable: 1",
     "PodDisruptionBudget/metalog: minAvailable 1 keeps 1 of StatefulSet/metalog's 3 voters: below the majority of 2"),
    ("50-pdb.yaml", "component: broker", "component: brokers",
     "PodDisruptionBudget/metalog: spec.selector selects no StatefulSet's pods"),
    ("40-statefulset.yaml", "- {key: probe.py, path: probe.py}", "- {key: probes.py, path: probe.py}",
     'StatefulSet/metalog: volume "config": ConfigMap "metalog-config" has no key "probes.py"'),
    ("40-statefulset.yaml", "- name: tmp\n          emptyDir:", "- name: scratch\n          emptyDir:",
     'StatefulSet/metalog: container "broker" mounts volume "tmp": no such volume or volumeClaimTemplate'),
    ("40-statefulset.yaml", '"ssl_key_file=$(CERT_DIR)/tls.key"', '"ssl_key_file=$(CERT_DIR)/tls-key"',
     'pod metalog-1 container "broker": /etc/metalog/certs/node-1/tls-key: volume "certs" mounted at '
     '/etc/metalog/certs holds no "node-1/tls-key"'),
    ("40-statefulset.yaml", '"node_id=$(POD_INDEX)"', '"node_id=$(POD_IDX)"',
     'pod metalog-1 container "broker": $(POD_IDX) on the command line is no variable of the container'),
    ("40-statefulset.yaml", '"listen=$(POD_FQDN):9091"', '"listen=0.0.0.0:9091"',
     'pod metalog-2: listen "0.0.0.0:9091" does not advertise the pod\'s stable name '
     'metalog-2.metalog-peers.metalog.svc.cluster.local'),
    ("20-config.yaml", "2@metalog-2.metalog-peers.metalog.svc.cluster.local:9091,",
     "2@metalog-2.metalog.metalog.svc.cluster.local:9091,",
     "pod metalog-2: voters lists node 2 at metalog-2.metalog.metalog.svc.cluster.local:9091, the broker "
     "advertises metalog-2.metalog-peers.metalog.svc.cluster.local:9091"),
    ("10-certificates.yaml", "    - metalog-3.metalog-peers.metalog.svc.cluster.local\n", "",
     'pod metalog-3: Certificate "metalog-node-3" does not name metalog-3.metalog-peers.metalog.svc.cluster.local'),
    ("10-certificates.yaml", "urn:metalog:node:2", "urn:metalog:node:7",
     'pod metalog-2: Certificate "metalog-node-2" does not carry urn:metalog:node:2'),
    ("10-certificates.yaml", "secretName: metalog-node-1\n", "secretName: metalog-node-one\n",
     'comes from secret "metalog-node-1", which no Certificate or Secret of the manifests makes'),
    ("40-statefulset.yaml", '"ssl_key_file=$(CERT_DIR)/tls.key"]',
     '"ssl_key_file=$(CERT_DIR)/tls.key", --set, security_protocol=PLAINTEXT]',
     "pod metalog-1: security_protocol PLAINTEXT: mutual TLS must be on"),
    ("70-admin.yaml", "namespace: metalog", "namespace: metalg",
     'Deployment/metalog-admin: namespace "metalg" is not one of the manifests\' Namespaces'),
]


@pytest.mark.parametrize("name,text,replacement,expected", MUTATIONS,
                         ids=[f"{m[0]}:{m[2][:30]}" for m in MUTATIONS])
def test_each_mistake_fails_with_its_line(tmp_path, name, text, replacement, expected):
    copy = tmp_path / "kubernetes"
    shutil.copytree(MANIFESTS, copy)
    path = copy / name
    original = path.read_text()
    assert original.count(text) >= 1, f"{name} no longer holds {text!r}: update the mutation"
    path.write_text(original.replace(text, replacement, 1))
    proc = kubecheck(str(copy), str(copy / "bootstrap"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert any(expected in line for line in lines), proc.stdout
    # One line per problem, each naming its file and line (or the file for a decode error).
    assert all(re.match(r"^\S+\.yaml:\d+: ", line) for line in lines), proc.stdout


def test_initial_controllers_must_be_the_voters(tmp_path):
    copy = tmp_path / "kubernetes"
    shutil.copytree(MANIFESTS, copy)
    boot = copy / "bootstrap" / "initial-controllers.yaml"
    boot.write_text(boot.read_text().replace("3@metalog-3.metalog-peers.metalog.svc.cluster.local:9091:",
                                             "3@metalog-3.metalog-peers.metalog.svc.cluster.local:9093:"))
    proc = kubecheck(str(copy), str(copy / "bootstrap"))
    assert proc.returncode == 1
    assert ('ConfigMap/metalog-bootstrap: initial-controllers: node 3 at '
            '"metalog-3.metalog-peers.metalog.svc.cluster.local:9093", voters say '
            '"metalog-3.metalog-peers.metalog.svc.cluster.local:9091"') in proc.stdout


# -- the broker's command line through the broker's own parser and BrokerConfig -------
@pytest.mark.parametrize("node_id", NODE_IDS)
def test_broker_command_line_and_config_for_each_pod(monkeypatch, node_id):
    broker = container("broker")
    env = pod_env(broker, node_id)
    argv = [expand(a, env) for a in broker["command"] + broker.get("args", [])]
    assert argv[:2] == ["metalog", "broker"]
    seen = {}

    def load_config(path, overrides=None):
        # The real parser got here; the files live in the pod, so read the
        # ConfigMap's text instead and skip the existence check of the TLS files.
        assert path == "/etc/metalog/config/broker.yaml"
        seen["cfg"] = config_from_dict(yaml.safe_load(config_data()["broker.yaml"]), check_files=False,
                                       overrides=overrides)
        return seen["cfg"]

    def no_run(coro):
        coro.close()
        return 0

    monkeypatch.setattr(broker_main, "load_config", load_config)
    monkeypatch.setattr(broker_main.uvloop, "run", no_run)
    assert broker_main.main(argv[2:]) == 0
    cfg = seen["cfg"]
    ports = {p["name"]: p["containerPort"] for p in broker["ports"]}
    assert cfg.node_id == node_id
    assert (cfg.listen_endpoint().host, cfg.listen_endpoint().port) == (fqdn(node_id), ports["peer"])
    assert cfg.voter_endpoints()[node_id] == cfg.listen_endpoint()
    assert sorted(cfg.voter_endpoints()) == list(NODE_IDS)
    assert cfg.kafka_endpoint().host == fqdn(node_id) and cfg.kafka_endpoint().port == ports["kafka"]
    assert cfg.kafka_node_endpoints()[node_id] == cfg.kafka_endpoint()
    assert cfg.admin_endpoint().port == ports["admin"]
    # What the node tells the leader it listens on (KIP-853): its stable name.
    assert ("CONTROLLER", fqdn(node_id), ports["peer"]) in cfg.quorum.listeners
    assert cfg.dynamic_voters and cfg.tls_enabled
    assert cfg.security.ssl_cert_file == f"/etc/metalog/certs/node-{node_id}/tls.crt"
    mounts = {m["name"]: m["mountPath"] for m in broker["volumeMounts"]}
    assert cfg.data_dir.startswith(mounts["data"] + "/")
    # The probes ask the admin port the config opens.
    for probe in ("readinessProbe", "livenessProbe"):
        assert broker[probe]["exec"]["command"][-1] == str(ports["admin"])


def test_client_config_loads_and_bootstraps_through_the_client_service(tmp_path):
    text = config_data()["client.yaml"]
    for name in ("ca.crt", "tls.crt", "tls.key"):  # cert-manager's secret keys, mounted in the admin pod
        (tmp_path / name).write_text("")
    path = tmp_path / "client.yaml"
    path.write_text(text.replace("/etc/metalog/admin/", f"{tmp_path}/"))
    client = load_client_config(str(path))
    assert client.endpoints() == [("metalog.metalog.svc.cluster.local", 9091)]
    assert client.cluster_id == yaml.safe_load(config_data()["broker.yaml"])["cluster_id"]
    admin = one("Deployment", "metalog-admin")["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in admin["containers"][0]["volumeMounts"]}
    assert yaml.safe_load(text)["ssl_cert_file"] == mounts["admin-cert"] + "/tls.crt"


def doc_commands() -> list[str]:
    """Every `metalog ...` command of the doc's shell blocks (after `kubectl exec ... --`)."""
    with open(DOC) as f:
        blocks = re.findall(r"```sh\n(.*?)```", f.read(), re.S)
    text = "\n".join(blocks).replace("\\\n", " ")
    return [line.split(" -- ", 1)[1].strip() for line in text.splitlines() if " -- metalog " in line]


def test_the_docs_cli_commands_parse_with_the_cli_parser():
    commands = doc_commands()
    kinds = {" ".join(shlex.split(c)[1:3]) for c in commands}
    assert {"quorum add-voter", "quorum remove-voter", "quorum describe"} <= kinds, kinds
    parser = build_parser()
    for command in commands:
        argv = shlex.split(re.sub(r"<[A-Z_-]+>", "AAAAAAAAAAAAAAAAAAAAAA", command))[1:]
        args = parser.parse_args(argv)
        if argv[:2] == ["quorum", "add-voter"]:
            if args.controller_id == 4:
                assert args.listener == [f"{fqdn(4)}:9091", f"SSL={fqdn(4)}:9092"]


# -- the init container's format step, run for real ------------------------------------
def run_format(tmp_path, node_id: int, with_bootstrap: bool) -> subprocess.CompletedProcess:
    """format.sh as the init container runs it for pod metalog-<node_id>, on a temporary dir."""
    init = container("format", init=True)
    assert init["command"] == ["sh", "/etc/metalog/config/format.sh"]
    env = pod_env(init, node_id)
    assert env["DATA_DIR"] == "/var/lib/metalog/data" and env["METALOG_CONFIG"] == "/etc/metalog/config/broker.yaml"
    config = tmp_path / "broker.yaml"
    config.write_text(config_data()["broker.yaml"])
    script = tmp_path / "format.sh"
    script.write_text(config_data()["format.sh"])
    env.update(DATA_DIR=str(tmp_path / f"data-{node_id}"), METALOG_CONFIG=str(config),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    if with_bootstrap:
        env["INITIAL_CONTROLLERS"] = initial_controllers()
    return subprocess.run(["sh", str(script)], env=env, capture_output=True, text=True, timeout=120)


def meta(tmp_path, node_id: int) -> dict[str, str]:
    with open(tmp_path / f"data-{node_id}" / "meta.properties") as f:
        return dict(line.strip().split("=", 1) for line in f if "=" in line)


def snapshot_files(tmp_path, node_id: int) -> dict[str, bytes]:
    root = tmp_path / f"data-{node_id}"
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_format_step_formats_once_then_leaves_the_dir_alone(tmp_path):
    first = run_format(tmp_path, 2, with_bootstrap=True)
    assert first.returncode == 0, first.stdout + first.stderr
    directory_id = re.search(r"2@[^,]+:9091:([A-Za-z0-9_-]{22})", initial_controllers()).group(1)
    assert meta(tmp_path, 2)["node.id"] == "2"
    assert meta(tmp_path, 2)["directory.id"] == directory_id  # the id the other first voters know
    before = snapshot_files(tmp_path, 2)
    assert any(name.endswith("00000000000000000000-0000000000.checkpoint") for name in before), before
    again = run_format(tmp_path, 2, with_bootstrap=True)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "formatted already: left alone" in again.stdout
    assert snapshot_files(tmp_path, 2) == before


def test_format_step_without_bootstrap_makes_a_new_replica(tmp_path):
    # After the bootstrap ConfigMap is deleted, a lost volume comes back as a
    # new replica (new directory id, no voter set): an observer to add-voter.
    lost = run_format(tmp_path, 2, with_bootstrap=False)
    assert lost.returncode == 0, lost.stdout + lost.stderr
    assert meta(tmp_path, 2)["directory.id"] not in initial_controllers()
    assert not any(n.endswith(".checkpoint") for n in snapshot_files(tmp_path, 2))
    # A node outside the first voters (scale-out) likewise, bootstrap or not.
    added = run_format(tmp_path, 4, with_bootstrap=True)
    assert added.returncode == 0, added.stdout + added.stderr
    assert meta(tmp_path, 4)["node.id"] == "4"
    assert not any(n.endswith(".checkpoint") for n in snapshot_files(tmp_path, 4))


# -- the probe script against a real TLS server ----------------------------------------
class _Health(http.server.BaseHTTPRequestHandler):
    answer = (200, {"status": "ok"})

    def do_GET(self):  # noqa: N802 - http.server's name
        status, body = self.answer
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def tls_health(tmp_path_factory):
    """An HTTPS /health with mutual TLS, like the broker's admin port; node-1/ as the pod mounts it."""
    d = tmp_path_factory.mktemp("certs")
    certs.init_ca(str(d))
    certs.issue_node(str(d), str(d), 1, ["localhost"])
    node = d / "node-1-dir"
    node.mkdir()
    shutil.copy(d / "ca.crt", node / "ca.crt")
    shutil.copy(d / "node-1.crt", node / "tls.crt")
    shutil.copy(d / "node-1.key", node / "tls.key")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(str(node / "ca.crt"))
    ctx.load_cert_chain(str(node / "tls.crt"), str(node / "tls.key"))
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield node, server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("answer,ready,alive", [
    ((200, {"status": "ok"}), 0, 0),
    ((503, {"status": "degraded", "problems": {"log": "quarantined"}}), 1, 0),
    ((503, {"status": "fatal", "reason": "invariant"}), 1, 1),
])
def test_probe_script(tmp_path, tls_health, answer, ready, alive):
    node, port = tls_health
    script = tmp_path / "probe.py"
    script.write_text(config_data()["probe.py"])
    env = dict(os.environ, CERT_DIR=str(node), POD_FQDN="localhost")
    _Health.answer = answer
    for what, expected in (("ready", ready), ("alive", alive)):
        proc = subprocess.run([sys.executable, str(script), what, str(port)], env=env, capture_output=True,
                              text=True, timeout=30)
        assert proc.returncode == expected, (what, proc.stdout, proc.stderr)
        assert f"https://localhost:{port}/health: {answer[0]}" in proc.stdout


def test_probe_script_fails_when_nothing_answers(tmp_path, tls_health):
    node, _port = tls_health
    script = tmp_path / "probe.py"
    script.write_text(config_data()["probe.py"])
    env = dict(os.environ, CERT_DIR=str(node), POD_FQDN="localhost")
    proc = subprocess.run([sys.executable, str(script), "alive", "1"], env=env, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 1 and "https://localhost:1/health:" in proc.stdout


# -- the manifests' quorum, run for real on loopback -----------------------------------
# The pods' own command lines, config, certificate layout, format step and probe,
# with one substitution a machine without Kubernetes needs: node <n>'s stable
# name becomes 127.0.0.<n> (its certificate names that address) and the ports
# free ones. The admin port gets the node's address too: three brokers here
# share one host, where pods have one each.
def loopback(text: str, ports: dict[str, int]) -> str:
    for n in NODE_IDS:
        text = text.replace(fqdn(n), f"127.0.0.{n}")
    return text.replace(":9091", f":{ports['peer']}").replace(":9092", f":{ports['kafka']}")


@pytest.fixture(scope="module")
def loopback_quorum(tmp_path_factory):
    """(root, ports, start, stop): nodes 1-3 started; start(n, bootstrap) formats and starts node n as
    its pod would (bootstrap: while the metalog-bootstrap ConfigMap exists), stop(n) stops it (SIGTERM)."""
    from metalog.tools.cluster.launcher import free_ports

    root = tmp_path_factory.mktemp("quorum")
    ports = dict(zip(("peer", "kafka", "admin"), free_ports(3)))
    certs.init_ca(str(root / "ca"))
    certs.issue_user(str(root / "ca"), str(root / "ca"), "admin")
    config = root / "broker.yaml"
    config.write_text(loopback(config_data()["broker.yaml"], ports))
    (root / "format.sh").write_text(config_data()["format.sh"])
    bin_dir = os.path.dirname(sys.executable)
    procs: dict[int, subprocess.Popen] = {}

    def start(n: int, bootstrap: bool = True) -> None:
        node = root / "certs" / f"node-{n}"  # the projected volume's layout
        if not node.exists():
            certs.issue_node(str(root / "ca"), str(root / "ca"), n, [f"127.0.0.{n}"])
            node.mkdir(parents=True)
            shutil.copy(root / "ca" / "ca.crt", node / "ca.crt")
            shutil.copy(root / "ca" / f"node-{n}.crt", node / "tls.crt")
            shutil.copy(root / "ca" / f"node-{n}.key", node / "tls.key")
        env = dict(pod_env(container("format", init=True), n), DATA_DIR=str(root / f"data-{n}"),
                   METALOG_CONFIG=str(config), POD_FQDN=f"127.0.0.{n}",
                   PATH=bin_dir + os.pathsep + os.environ["PATH"])
        if bootstrap:
            env["INITIAL_CONTROLLERS"] = loopback(initial_controllers(), ports)
        fmt = subprocess.run(["sh", str(root / "format.sh")], env=env, capture_output=True, text=True, timeout=120)
        assert fmt.returncode == 0, fmt.stdout + fmt.stderr
        broker = container("broker")
        env = dict(pod_env(broker, n), DATA_DIR=str(root / f"data-{n}"), POD_FQDN=f"127.0.0.{n}",
                   CERT_DIR=str(node))
        argv = [loopback(expand(a, env), ports) for a in broker["command"]]
        argv[argv.index("/etc/metalog/config/broker.yaml")] = str(config)
        argv = [os.path.join(bin_dir, argv[0]), *argv[1:], "--set", f"admin_listen=127.0.0.{n}:{ports['admin']}"]
        with open(root / f"broker-{n}.log", "a") as log:
            procs[n] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    def stop(n: int) -> None:
        procs[n].terminate()
        assert procs[n].wait(timeout=30) == 0  # a graceful stop

    try:
        for n in NODE_IDS:
            start(n)
        yield root, ports, start, stop
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


def probe(root, ports, n: int, what: str) -> subprocess.CompletedProcess:
    script = root / "probe.py"
    script.write_text(config_data()["probe.py"])
    env = dict(os.environ, CERT_DIR=str(root / "certs" / f"node-{n}"), POD_FQDN=f"127.0.0.{n}")
    return subprocess.run([sys.executable, str(script), what, str(ports["admin"])], env=env, capture_output=True,
                          text=True, timeout=30)


def wait_ready(root, ports, nodes) -> None:
    import time

    deadline = time.monotonic() + 90
    pending = set(nodes)
    while pending and time.monotonic() < deadline:  # each probe call takes its own time: no sleep needed
        pending = {n for n in pending if probe(root, ports, n, "ready").returncode != 0}
    logs = {n: (root / f"broker-{n}.log").read_text()[-2000:] for n in pending}
    assert not pending, f"not ready: {sorted(pending)}\n{logs}"


def admin_cli(root, ports, command: list[str]) -> str:
    """`metalog ...` as the metalog-admin pod runs it, with its client.yaml."""
    client = root / "client.yaml"
    client.write_text(config_data()["client.yaml"].replace("metalog.metalog.svc.cluster.local:9091",
                                                           f"127.0.0.1:{ports['peer']}")
                      .replace("/etc/metalog/admin/ca.crt", str(root / "ca" / "ca.crt"))
                      .replace("/etc/metalog/admin/tls.crt", str(root / "ca" / "admin.crt"))
                      .replace("/etc/metalog/admin/tls.key", str(root / "ca" / "admin.key")))
    proc = subprocess.run([sys.executable, "-m", "metalog.tools.cli", *command], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, METALOG_CLIENT_CONFIG=str(client)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def quorum_status(root, ports) -> dict:
    return json.loads(admin_cli(root, ports, ["quorum", "describe", "--status", "-o", "json"]))


def test_the_manifests_quorum_starts_elects_and_is_ready(loopback_quorum):
    root, ports, _start, _stop = loopback_quorum
    wait_ready(root, ports, NODE_IDS)
    assert all(probe(root, ports, n, "alive").returncode == 0 for n in NODE_IDS)
    status = quorum_status(root, ports)
    voters = {v["id"]: v for v in status["CurrentVoters"]}
    assert sorted(voters) == list(NODE_IDS)
    bootstrap = dict(re.findall(r"(\d)@[^,]+:([A-Za-z0-9_-]{22})", initial_controllers()))
    assert {str(i): v["directoryId"] for i, v in voters.items()} == bootstrap
    assert status["LeaderId"] in voters


def test_scale_out_as_the_doc_says(loopback_quorum):
    # docs/kubernetes.md "Scale out": the new pod formats itself without a voter
    # set, follows as an observer, and the doc's add-voter command makes it a voter.
    root, ports, start, _stop = loopback_quorum
    wait_ready(root, ports, NODE_IDS)
    start(4)
    wait_ready(root, ports, [4])
    with open(root / "data-4" / "meta.properties") as f:
        directory_id = re.search(r"^directory\.id=(\S+)$", f.read(), re.M).group(1)
    assert 4 not in {v["id"] for v in quorum_status(root, ports)["CurrentVoters"]}
    add = next(c for c in doc_commands() if c.startswith("metalog quorum add-voter --controller-id 4 "))
    argv = shlex.split(add.replace("<DIRECTORY-ID>", directory_id).replace(fqdn(4), "127.0.0.4"))
    argv = [a.replace(":9091", f":{ports['peer']}").replace(":9092", f":{ports['kafka']}") for a in argv]
    assert json.loads(admin_cli(root, ports, argv[1:])) == {"added": 4, "directory_id": directory_id}
    voters = {v["id"]: v for v in quorum_status(root, ports)["CurrentVoters"]}
    assert sorted(voters) == [1, 2, 3, 4] and voters[4]["directoryId"] == directory_id
    assert f"SSL://127.0.0.4:{ports['kafka']}" in voters[4]["endpoints"]


def doc_command(prefix: str, ports: dict[str, int], **placeholders: str) -> list[str]:
    """The doc's command that starts with `prefix`, looped back, placeholders filled."""
    command = next(c for c in doc_commands() if c.startswith(prefix))
    for name, value in placeholders.items():
        command = command.replace(f"<{name}>", value)
    return shlex.split(loopback(command, ports))[1:]


def directory_id_of(root, n: int) -> str:
    with open(root / f"data-{n}" / "meta.properties") as f:
        return re.search(r"^directory\.id=(\S+)$", f.read(), re.M).group(1)


def test_replace_a_voter_as_the_doc_says(loopback_quorum):
    # docs/kubernetes.md "Replace a voter": once the bootstrap ConfigMap is gone,
    # node 2's lost volume comes back as a new replica, never as the old voter,
    # and the doc's remove-voter / add-voter swap the identities.
    root, ports, start, stop = loopback_quorum
    wait_ready(root, ports, NODE_IDS)
    old = directory_id_of(root, 2)
    stop(2)
    shutil.rmtree(root / "data-2")  # the PVC deleted: a new, empty volume
    start(2, bootstrap=False)
    new = directory_id_of(root, 2)
    assert new != old
    wait_ready(root, ports, [2])
    voters = {v["id"]: v["directoryId"] for v in quorum_status(root, ports)["CurrentVoters"]}
    assert voters[2] == old  # the new replica does not vote as the old one
    removed = admin_cli(root, ports, doc_command("metalog quorum remove-voter --controller-id 2 ", ports,
                                                 **{"OLD-DIRECTORY-ID": old}))
    assert json.loads(removed) == {"removed": 2, "directory_id": old}
    added = admin_cli(root, ports, doc_command("metalog quorum add-voter --controller-id 2 ", ports,
                                               **{"NEW-DIRECTORY-ID": new}))
    assert json.loads(added) == {"added": 2, "directory_id": new}
    voters = {v["id"]: v["directoryId"] for v in quorum_status(root, ports)["CurrentVoters"]}
    assert voters[2] == new
