package main

// metalog's own ties: the broker of pod <sts>-<n> is node <n>, advertises the
// pod's stable name under the governing Service, is listed so in the voters
// (and the bootstrap's initial controllers), and its certificate names that
// address, the client Services' names and urn:metalog:node:<n>.

import (
	"fmt"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"
)

const clusterDomain = "cluster.local"

// brokerArgs: --config and the --set key=value pairs of `metalog broker`.
func brokerArgs(argv []string) (string, map[string]string, bool) {
	if len(argv) < 2 || argv[0] != "metalog" || argv[1] != "broker" {
		return "", nil, false
	}
	config, sets := "", map[string]string{}
	for i := 2; i+1 < len(argv); i++ {
		switch argv[i] {
		case "--config":
			config = argv[i+1]
			i++
		case "--set":
			k, v, _ := strings.Cut(argv[i+1], "=")
			sets[k] = v
			i++
		}
	}
	return config, sets, true
}

// parseNodes: Kafka's "id@host:port,..." as id -> "host:port".
func parseNodes(text string) map[int]string {
	out := map[int]string{}
	for _, item := range strings.Split(text, ",") {
		id, addr, ok := strings.Cut(strings.TrimSpace(item), "@")
		if ok {
			out[atoi(id)] = addr
		}
	}
	return out
}

func (m *manifests) checkMetalog(works []*workload) {
	for _, w := range works {
		ss, ok := w.obj.value.(*appsv1.StatefulSet)
		if !ok {
			continue
		}
		for _, c := range ss.Spec.Template.Spec.Containers {
			for _, ordinal := range w.ordinals {
				m.checkBroker(w, ss, c, ordinal)
			}
		}
	}
}

// brokerConfig: the broker.yaml the --config path resolves to, with --set applied.
func (m *manifests) brokerConfig(w *workload, c corev1.Container, path string, sets map[string]string) map[string]any {
	src, _ := m.resolve(w, c, path)
	cm := m.configMap(w.namespace, src.configMap)
	if cm == nil {
		m.problem(w.obj, "container %q: --config %s is in no ConfigMap of the manifests", c.Name, path)
		return nil
	}
	cfg := map[string]any{}
	if err := yaml.Unmarshal([]byte(cm.Data[src.key]), &cfg); err != nil {
		m.problem(w.obj, "ConfigMap %q key %q: not YAML: %v", cm.Name, src.key, err)
		return nil
	}
	for k, v := range sets {
		cfg[k] = v
	}
	return cfg
}

func (m *manifests) checkBroker(w *workload, ss *appsv1.StatefulSet, c corev1.Container, ordinal int) {
	argv, _ := m.commandLine(w, c, ordinal)
	config, sets, ok := brokerArgs(argv)
	if !ok {
		return
	}
	cfg := m.brokerConfig(w, c, config, sets)
	if cfg == nil {
		return
	}
	str := func(k string) string { s, _ := cfg[k].(string); return s }
	pod := w.podName(ordinal)
	if fmt.Sprint(cfg["node_id"]) != fmt.Sprint(ordinal) {
		m.problem(w.obj, "pod %s: node_id %v is not the pod's ordinal %d", pod, cfg["node_id"], ordinal)
	}
	stable := fmt.Sprintf("%s.%s.%s.svc.%s", pod, ss.Spec.ServiceName, w.namespace, clusterDomain)
	listen, kafka := str("listen"), str("kafka_listen")
	if trimPort(listen) != stable {
		m.problem(w.obj, "pod %s: listen %q does not advertise the pod's stable name %s", pod, listen, stable)
	}
	if kafka != "" && trimPort(kafka) != stable {
		m.problem(w.obj, "pod %s: kafka_listen %q does not advertise the pod's stable name %s", pod, kafka, stable)
	}
	if str("security_protocol") == "PLAINTEXT" {
		m.problem(w.obj, "pod %s: security_protocol PLAINTEXT: mutual TLS must be on", pod)
	}
	voters := parseNodes(str("voters"))
	for id := range voters {
		if id < w.ordinals[0] || id > w.ordinals[len(w.ordinals)-1] {
			m.problem(w.obj, "voters: node %d is no pod of the StatefulSet (ordinals %d..%d)", id, w.ordinals[0], w.ordinals[len(w.ordinals)-1])
		}
	}
	if addr, ok := voters[ordinal]; ok && addr != listen {
		m.problem(w.obj, "pod %s: voters lists node %d at %s, the broker advertises %s", pod, ordinal, addr, listen)
	}
	if addr, ok := parseNodes(str("kafka_endpoints"))[ordinal]; ok && kafka != "" && addr != kafka {
		m.problem(w.obj, "pod %s: kafka_endpoints lists node %d at %s, the broker listens at %s", pod, ordinal, addr, kafka)
	}
	m.checkInitialControllers(w, voters)
	m.checkNodeCertificate(w, c, ordinal, cfg, []string{trimPort(listen), trimPort(kafka)})
}

// checkInitialControllers: the bootstrap's first voters are the voters.
func (m *manifests) checkInitialControllers(w *workload, voters map[int]string) {
	for _, o := range m.objects {
		cm, ok := o.value.(*corev1.ConfigMap)
		if !ok || cm.Namespace != w.namespace {
			continue
		}
		text, ok := cm.Data["initial-controllers"]
		if !ok {
			continue
		}
		for id, addr := range parseNodes(text) {
			hostPort := addr[:max(0, strings.LastIndex(addr, ":"))]
			if voters[id] != hostPort {
				m.problem(o, "initial-controllers: node %d at %q, voters say %q", id, hostPort, voters[id])
			}
		}
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// checkNodeCertificate: the certificate files come from one Certificate's
// secret, which names every address the node is dialled at and its node URI.
func (m *manifests) checkNodeCertificate(w *workload, c corev1.Container, ordinal int, cfg map[string]any, hosts []string) {
	pod := w.podName(ordinal)
	secrets := map[string]bool{}
	for _, key := range []string{"ssl_ca_file", "ssl_cert_file", "ssl_key_file"} {
		path, _ := cfg[key].(string)
		if path == "" {
			m.problem(w.obj, "pod %s: %s is not set (mutual TLS needs it)", pod, key)
			continue
		}
		if src, _ := m.resolve(w, c, path); src.secret != "" {
			secrets[src.secret] = true
		}
	}
	if len(secrets) != 1 {
		m.problem(w.obj, "pod %s: the ssl_*_file paths come from %d secrets, not from one node certificate", pod, len(secrets))
		return
	}
	var secret string
	for s := range secrets {
		secret = s
	}
	cert := m.certificateFor(w.namespace, secret)
	if cert == nil {
		return // reported by resolve
	}
	where := fmt.Sprintf("pod %s: Certificate %q", pod, cert.Name)
	if uri := fmt.Sprintf("urn:metalog:node:%v", cfg["node_id"]); !contains(cert.Spec.URIs, uri) {
		m.problem(w.obj, "%s does not carry %s (the broker's node id)", where, uri)
	}
	for _, h := range append(hosts, m.clientNames(w)...) {
		if h != "" && !contains(cert.Spec.DNSNames, h) {
			m.problem(w.obj, "%s does not name %s, where the broker is dialled", where, h)
		}
	}
	if !contains(cert.Spec.Usages, "server auth") || !contains(cert.Spec.Usages, "client auth") {
		m.problem(w.obj, "%s: usages must hold server auth and client auth (a node both serves and dials)", where)
	}
}

// clientNames: the DNS names clients bootstrap at: every Service with a
// cluster IP selecting the pods, and the hosts of a client.yaml's bootstrap.
func (m *manifests) clientNames(w *workload) []string {
	var out []string
	for _, o := range m.objects {
		switch v := o.value.(type) {
		case *corev1.Service:
			if v.Namespace == w.namespace && v.Spec.ClusterIP != corev1.ClusterIPNone &&
				selects(&metav1.LabelSelector{MatchLabels: v.Spec.Selector}, w.template.Labels) {
				out = append(out, fmt.Sprintf("%s.%s.svc.%s", v.Name, v.Namespace, clusterDomain))
			}
		case *corev1.ConfigMap:
			text, ok := v.Data["client.yaml"]
			if !ok || v.Namespace != w.namespace {
				continue
			}
			var client struct {
				Bootstrap string `json:"bootstrap"`
			}
			_ = yaml.Unmarshal([]byte(text), &client)
			for _, hp := range strings.Split(client.Bootstrap, ",") {
				if h := trimPort(strings.TrimSpace(hp)); h != "" && !contains(out, h) {
					out = append(out, h)
				}
			}
		}
	}
	return out
}
