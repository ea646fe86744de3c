package main

// A pod as the kubelet would see it for one ordinal: its environment, its
// command line with $(VAR) expanded, and where a path on that command line
// comes from (which volume, ConfigMap key or secret).

import (
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
)

const podIndexLabel = "apps.kubernetes.io/pod-index"

// expandVars replaces $(VAR) as the kubelet does: a known variable by its
// value, $$ by $, an unknown reference left as written (and returned).
func expandVars(s string, env map[string]string) (string, []string) {
	var b strings.Builder
	var unknown []string
	for i := 0; i < len(s); i++ {
		if s[i] != '$' || i+1 == len(s) {
			b.WriteByte(s[i])
			continue
		}
		switch s[i+1] {
		case '$':
			b.WriteByte('$')
			i++
		case '(':
			end := strings.IndexByte(s[i:], ')')
			if end < 0 {
				b.WriteString(s[i:])
				return b.String(), unknown
			}
			name := s[i+2 : i+end]
			if v, ok := env[name]; ok {
				b.WriteString(v)
			} else {
				b.WriteString(s[i : i+end+1])
				unknown = append(unknown, name)
			}
			i += end
		default:
			b.WriteByte(s[i])
		}
	}
	return b.String(), unknown
}

// podLabels: the template's labels plus those the StatefulSet controller adds.
func podLabels(w *workload, ordinal int) map[string]string {
	out := map[string]string{}
	for k, v := range w.template.Labels {
		out[k] = v
	}
	if ordinal >= 0 {
		out["statefulset.kubernetes.io/pod-name"] = w.podName(ordinal)
		out[podIndexLabel] = fmt.Sprint(ordinal)
	}
	return out
}

// containerEnv: the variables of container c in the pod of `ordinal`;
// staticOnly keeps only literal values (what the kubelet expands in probes).
func (m *manifests) containerEnv(w *workload, c corev1.Container, ordinal int, staticOnly bool) map[string]string {
	env := map[string]string{}
	lbls := podLabels(w, ordinal)
	for _, e := range c.Env {
		if e.ValueFrom == nil {
			v, _ := expandVars(e.Value, env)
			env[e.Name] = v
			continue
		}
		if staticOnly {
			continue
		}
		if f := e.ValueFrom.FieldRef; f != nil {
			switch path := f.FieldPath; {
			case path == "metadata.name":
				env[e.Name] = w.podName(ordinal)
			case path == "metadata.namespace":
				env[e.Name] = w.namespace
			case strings.HasPrefix(path, "metadata.labels['") && strings.HasSuffix(path, "']"):
				if v, ok := lbls[path[len("metadata.labels['"):len(path)-2]]; ok {
					env[e.Name] = v
				}
			}
		}
		if r := e.ValueFrom.ConfigMapKeyRef; r != nil {
			if cm := m.configMap(w.namespace, r.Name); cm != nil {
				if v, ok := cm.Data[r.Key]; ok {
					env[e.Name] = v
				}
			}
		}
	}
	return env
}

// source is where a file of a container comes from.
type source struct {
	volume    string
	configMap string // ConfigMap name, with key
	secret    string // secret name, with key
	key       string
}

// resolve finds the file at `path` in container c: ok=false with why when a
// mounted ConfigMap or secret holds no such file.
func (m *manifests) resolve(w *workload, c corev1.Container, path string) (source, string) {
	var mount *corev1.VolumeMount
	for i, vm := range c.VolumeMounts {
		if (path == vm.MountPath || strings.HasPrefix(path, strings.TrimSuffix(vm.MountPath, "/")+"/")) &&
			(mount == nil || len(vm.MountPath) > len(mount.MountPath)) {
			mount = &c.VolumeMounts[i]
		}
	}
	if mount == nil {
		return source{}, ""
	}
	rel := strings.TrimPrefix(strings.TrimPrefix(path, mount.MountPath), "/")
	var vol *corev1.Volume
	for i := range w.template.Spec.Volumes {
		if w.template.Spec.Volumes[i].Name == mount.Name {
			vol = &w.template.Spec.Volumes[i]
		}
	}
	if vol == nil { // a volumeClaimTemplate or a missing volume (reported elsewhere)
		return source{volume: mount.Name}, ""
	}
	var found []source
	add := func(cm, secret string, items []corev1.KeyToPath, keys map[string]bool) {
		if len(items) == 0 {
			if keys[rel] {
				found = append(found, source{vol.Name, cm, secret, rel})
			}
			return
		}
		for _, it := range items {
			if it.Path == rel {
				found = append(found, source{vol.Name, cm, secret, it.Key})
			}
		}
	}
	switch {
	case vol.ConfigMap != nil:
		add(vol.ConfigMap.Name, "", vol.ConfigMap.Items, m.configMapKeys(w.namespace, vol.ConfigMap.Name))
	case vol.Secret != nil:
		add("", vol.Secret.SecretName, vol.Secret.Items, certificateKeys)
	case vol.Projected != nil:
		for _, s := range vol.Projected.Sources {
			if s.ConfigMap != nil {
				add(s.ConfigMap.Name, "", s.ConfigMap.Items, m.configMapKeys(w.namespace, s.ConfigMap.Name))
			}
			if s.Secret != nil {
				add("", s.Secret.Name, s.Secret.Items, certificateKeys)
			}
		}
	default:
		return source{volume: vol.Name}, ""
	}
	if len(found) == 0 {
		return source{}, fmt.Sprintf("%s: volume %q mounted at %s holds no %q", path, vol.Name, mount.MountPath, rel)
	}
	f := found[0]
	if f.secret != "" && m.certificateFor(w.namespace, f.secret) == nil && m.find("Secret", w.namespace, f.secret) == nil {
		return f, fmt.Sprintf("%s: comes from secret %q, which no Certificate or Secret of the manifests makes", path, f.secret)
	}
	return f, ""
}

func (m *manifests) configMapKeys(namespace, name string) map[string]bool {
	keys := map[string]bool{}
	if cm := m.configMap(namespace, name); cm != nil {
		for k := range cm.Data {
			keys[k] = true
		}
	}
	return keys
}

// commandLine: the container's argv as the kubelet runs it for `ordinal`.
func (m *manifests) commandLine(w *workload, c corev1.Container, ordinal int) ([]string, []string) {
	env := m.containerEnv(w, c, ordinal, false)
	var out, unknown []string
	for _, a := range append(append([]string{}, c.Command...), c.Args...) {
		v, u := expandVars(a, env)
		out = append(out, v)
		unknown = append(unknown, u...)
	}
	return out, unknown
}

// checkPaths: every absolute path on the command lines (and the probes'
// exec commands) that lies in a ConfigMap or secret volume names a file there.
func (m *manifests) checkPaths(w *workload, c corev1.Container, ordinal int) {
	pod := w.podName(ordinal)
	argv, unknown := m.commandLine(w, c, ordinal)
	for _, name := range unknown {
		m.problem(w.obj, "pod %s container %q: $(%s) on the command line is no variable of the container", pod, c.Name, name)
	}
	static := m.containerEnv(w, c, ordinal, true)
	for _, p := range []*corev1.Probe{c.StartupProbe, c.ReadinessProbe, c.LivenessProbe} {
		if p == nil || p.Exec == nil {
			continue
		}
		for _, a := range p.Exec.Command {
			v, u := expandVars(a, static)
			for _, name := range u {
				m.problem(w.obj, "container %q probe: $(%s): the kubelet expands only literal env values in probes", c.Name, name)
			}
			argv = append(argv, v)
		}
	}
	for _, a := range argv {
		if i := strings.IndexByte(a, '='); i >= 0 {
			a = a[i+1:]
		}
		if !strings.HasPrefix(a, "/") {
			continue
		}
		if _, why := m.resolve(w, c, a); why != "" {
			m.problem(w.obj, "pod %s container %q: %s", pod, c.Name, why)
		}
	}
}
