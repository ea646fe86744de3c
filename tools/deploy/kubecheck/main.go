// metalog-kubecheck: offline validation of metalog's Kubernetes manifests
// (tools/deploy/kubernetes), since no cluster runs where the suite runs.
//
//	metalog-kubecheck DIR_OR_FILE...
//
// Every YAML document is decoded strictly into its Kubernetes API type
// (k8s.io/api, through sigs.k8s.io/yaml's UnmarshalStrict, the decoder
// kubectl's own types use): an unknown, misspelled or duplicated field is an
// error, as a wrong type is. Then the checks of checks.go tie the objects
// together (Services and their pods, probes and ports, the PDB and the quorum,
// volumes and mounts, ConfigMap keys, what a broker advertises and what its
// certificate names). One line per problem, `file:line: Kind/name: what`;
// exit 1 if there is any, 2 for bad usage.
package main

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"
)

// maxDocuments bounds what one run reads: the manifests are a handful of objects.
const maxDocuments = 1000

// object is one decoded document and where it came from.
type object struct {
	where string // file:line of the document's first line
	kind  string
	meta  *metav1.ObjectMeta
	value any
}

func (o *object) String() string { return o.kind + "/" + o.meta.Name }

type manifests struct {
	objects  []*object
	problems []string
}

func (m *manifests) problem(o *object, format string, args ...any) {
	prefix := ""
	if o != nil {
		prefix = o.where + ": " + o.String() + ": "
	}
	m.problems = append(m.problems, prefix+fmt.Sprintf(format, args...))
}

// newObject returns an empty value of the API type for apiVersion/kind.
func newObject(apiVersion, kind string) (any, *metav1.ObjectMeta) {
	switch apiVersion + " " + kind {
	case "v1 Namespace":
		o := &corev1.Namespace{}
		return o, &o.ObjectMeta
	case "v1 ConfigMap":
		o := &corev1.ConfigMap{}
		return o, &o.ObjectMeta
	case "v1 Secret":
		o := &corev1.Secret{}
		return o, &o.ObjectMeta
	case "v1 Service":
		o := &corev1.Service{}
		return o, &o.ObjectMeta
	case "v1 ServiceAccount":
		o := &corev1.ServiceAccount{}
		return o, &o.ObjectMeta
	case "apps/v1 StatefulSet":
		o := &appsv1.StatefulSet{}
		return o, &o.ObjectMeta
	case "apps/v1 Deployment":
		o := &appsv1.Deployment{}
		return o, &o.ObjectMeta
	case "policy/v1 PodDisruptionBudget":
		o := &policyv1.PodDisruptionBudget{}
		return o, &o.ObjectMeta
	case "cert-manager.io/v1 Certificate":
		o := &Certificate{}
		return o, &o.ObjectMeta
	case "cert-manager.io/v1 Issuer":
		o := &Issuer{}
		return o, &o.ObjectMeta
	}
	return nil, nil
}

// documents splits a YAML stream at its `---` lines: (first line, text).
func documents(data []byte) [][2]any {
	var out [][2]any
	var cur bytes.Buffer
	start := 1
	lines := strings.SplitAfter(string(data), "\n")
	flush := func(next int) {
		if strings.TrimSpace(stripComments(cur.String())) != "" {
			out = append(out, [2]any{start, cur.String()})
		}
		cur.Reset()
		start = next
	}
	for i, line := range lines {
		if strings.HasPrefix(strings.TrimRight(line, "\r\n"), "---") {
			flush(i + 2)
			continue
		}
		cur.WriteString(line)
	}
	flush(len(lines) + 1)
	return out
}

func stripComments(text string) string {
	var b strings.Builder
	for _, line := range strings.Split(text, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(line), "#") {
			b.WriteString(line + "\n")
		}
	}
	return b.String()
}

func (m *manifests) load(path string) {
	data, err := os.ReadFile(path)
	if err != nil {
		m.problem(nil, "%s: %v", path, err)
		return
	}
	for _, doc := range documents(data) {
		if len(m.objects) >= maxDocuments {
			m.problem(nil, "%s: more than %d documents: stopped reading", path, maxDocuments)
			return
		}
		m.decode(fmt.Sprintf("%s:%d", path, doc[0].(int)), []byte(doc[1].(string)))
	}
}

func (m *manifests) decode(where string, text []byte) {
	var tm metav1.TypeMeta
	if err := yaml.Unmarshal(text, &tm); err != nil {
		m.problems = append(m.problems, fmt.Sprintf("%s: not YAML: %v", where, err))
		return
	}
	value, meta := newObject(tm.APIVersion, tm.Kind)
	if value == nil {
		m.problems = append(m.problems, fmt.Sprintf("%s: unknown kind %q of apiVersion %q", where, tm.Kind, tm.APIVersion))
		return
	}
	if err := yaml.UnmarshalStrict(text, value); err != nil {
		m.problems = append(m.problems, fmt.Sprintf("%s: %s: %v", where, tm.Kind, err))
		return
	}
	m.objects = append(m.objects, &object{where: where, kind: tm.Kind, meta: meta, value: value})
}

// expand turns the command line's arguments into files: a directory's *.yaml
// and *.yml, sorted (as `kubectl apply -f DIR` reads them, not recursing).
func expand(args []string) ([]string, error) {
	var files []string
	for _, arg := range args {
		info, err := os.Stat(arg)
		if err != nil {
			return nil, err
		}
		if !info.IsDir() {
			files = append(files, arg)
			continue
		}
		for _, pattern := range []string{"*.yaml", "*.yml"} {
			found, _ := filepath.Glob(filepath.Join(arg, pattern))
			files = append(files, found...)
		}
	}
	sort.Strings(files)
	return files, nil
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: metalog-kubecheck DIR_OR_FILE...")
		os.Exit(2)
	}
	files, err := expand(os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, "metalog-kubecheck:", err)
		os.Exit(2)
	}
	m := &manifests{}
	for _, f := range files {
		m.load(f)
	}
	if len(m.problems) == 0 { // relations only between objects that decoded
		m.check()
	}
	seen := map[string]bool{} // a per-ordinal check may say the same thing for every pod
	for _, p := range m.problems {
		if !seen[p] {
			seen[p] = true
			fmt.Println(p)
		}
	}
	if len(m.problems) > 0 {
		os.Exit(1)
	}
	fmt.Printf("metalog-kubecheck: %d objects in %d files: decoded strictly, consistent\n", len(m.objects), len(files))
}
