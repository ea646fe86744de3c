package main

// What ties the objects together. Each check reports through m.problem, one
// line per problem, naming the object and the field.

import (
	"fmt"
	"strconv"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// workload is a StatefulSet or a Deployment: its pods' template and how to
// name the pods it makes (ordinal -1 for a Deployment's one sample pod).
type workload struct {
	obj       *object
	template  *corev1.PodTemplateSpec
	selector  *metav1.LabelSelector
	claims    []corev1.PersistentVolumeClaim
	ordinals  []int
	podName   func(ordinal int) string
	namespace string
}

func (m *manifests) check() {
	m.checkNamespaces()
	var works []*workload
	for _, o := range m.objects {
		switch v := o.value.(type) {
		case *appsv1.StatefulSet:
			works = append(works, statefulSetWorkload(o, v))
		case *appsv1.Deployment:
			works = append(works, &workload{obj: o, template: &v.Spec.Template, selector: v.Spec.Selector,
				ordinals: []int{-1}, podName: func(int) string { return v.Name + "-0" }, namespace: v.Namespace})
		}
	}
	for _, w := range works {
		m.checkWorkload(w)
	}
	for _, o := range m.objects {
		switch v := o.value.(type) {
		case *appsv1.StatefulSet:
			m.checkGoverningService(o, v)
		case *corev1.Service:
			m.checkService(o, v, works)
		case *policyv1.PodDisruptionBudget:
			m.checkPDB(o, v, works)
		}
	}
	m.checkMetalog(works)
}

func statefulSetWorkload(o *object, v *appsv1.StatefulSet) *workload {
	start, replicas := 0, 1
	if v.Spec.Ordinals != nil {
		start = int(v.Spec.Ordinals.Start)
	}
	if v.Spec.Replicas != nil {
		replicas = int(*v.Spec.Replicas)
	}
	w := &workload{obj: o, template: &v.Spec.Template, selector: v.Spec.Selector,
		claims: v.Spec.VolumeClaimTemplates, namespace: v.Namespace,
		podName: func(i int) string { return fmt.Sprintf("%s-%d", v.Name, i) }}
	for i := start; i < start+replicas && i < start+1000; i++ {
		w.ordinals = append(w.ordinals, i)
	}
	return w
}

func (m *manifests) checkNamespaces() {
	declared := map[string]bool{}
	for _, o := range m.objects {
		if o.kind == "Namespace" {
			declared[o.meta.Name] = true
		}
	}
	for _, o := range m.objects {
		if o.kind == "Namespace" {
			continue
		}
		if o.meta.Namespace == "" {
			m.problem(o, "metadata.namespace is not set (the names baked into the config and certificates assume one)")
		} else if len(declared) > 0 && !declared[o.meta.Namespace] {
			m.problem(o, "namespace %q is not one of the manifests' Namespaces", o.meta.Namespace)
		}
	}
}

// selects: does the label selector match the labels?
func selects(sel *metav1.LabelSelector, set map[string]string) bool {
	if sel == nil {
		return false
	}
	s, err := metav1.LabelSelectorAsSelector(sel)
	return err == nil && !s.Empty() && s.Matches(labels.Set(set))
}

func (m *manifests) find(kind, namespace, name string) *object {
	for _, o := range m.objects {
		if o.kind == kind && o.meta.Namespace == namespace && o.meta.Name == name {
			return o
		}
	}
	return nil
}

func (m *manifests) checkGoverningService(o *object, v *appsv1.StatefulSet) {
	svc := m.find("Service", v.Namespace, v.Spec.ServiceName)
	if svc == nil {
		m.problem(o, "spec.serviceName %q: no such Service in namespace %q", v.Spec.ServiceName, v.Namespace)
		return
	}
	s := svc.value.(*corev1.Service)
	if s.Spec.ClusterIP != corev1.ClusterIPNone {
		m.problem(o, "spec.serviceName %q is not headless (clusterIP: None): pods get no stable DNS names", s.Name)
	}
	if !selects(&metav1.LabelSelector{MatchLabels: s.Spec.Selector}, v.Spec.Template.Labels) {
		m.problem(o, "spec.serviceName %q does not select this StatefulSet's pods", s.Name)
	}
	if !s.Spec.PublishNotReadyAddresses {
		m.problem(o, "spec.serviceName %q does not publish not-ready pods: voters cannot find each other before one is ready", s.Name)
	}
}

// hasPort: is the probe's or Service's port (a name or a number) one the pod declares?
func hasPort(containers []corev1.Container, port intstr.IntOrString) bool {
	for _, c := range containers {
		for _, p := range c.Ports {
			if (port.Type == intstr.String && p.Name == port.StrVal) ||
				(port.Type == intstr.Int && p.ContainerPort == port.IntVal) {
				return true
			}
		}
	}
	return false
}

func (m *manifests) checkService(o *object, s *corev1.Service, works []*workload) {
	if len(s.Spec.Selector) == 0 {
		m.problem(o, "spec.selector is empty")
		return
	}
	var matched []*workload
	for _, w := range works {
		if w.namespace == s.Namespace && selects(&metav1.LabelSelector{MatchLabels: s.Spec.Selector}, w.template.Labels) {
			matched = append(matched, w)
		}
	}
	if len(matched) == 0 {
		m.problem(o, "spec.selector %v selects no pods of the manifests", s.Spec.Selector)
	}
	for _, p := range s.Spec.Ports {
		target := p.TargetPort
		if target.Type == intstr.Int && target.IntVal == 0 {
			target = intstr.FromInt32(p.Port)
		}
		for _, w := range matched {
			if !hasPort(w.template.Spec.Containers, target) {
				m.problem(o, "port %q: targetPort %s is no containerPort of %s's pods", p.Name, target.String(), w.obj)
			}
		}
	}
}

// checkPDB: the budget selects a StatefulSet's pods and keeps a majority of them.
func (m *manifests) checkPDB(o *object, p *policyv1.PodDisruptionBudget, works []*workload) {
	var sets []*workload
	for _, w := range works {
		if w.obj.kind == "StatefulSet" && w.namespace == p.Namespace && selects(p.Spec.Selector, w.template.Labels) {
			sets = append(sets, w)
		}
	}
	if len(sets) == 0 {
		m.problem(o, "spec.selector selects no StatefulSet's pods")
		return
	}
	for _, w := range sets {
		replicas := len(w.ordinals)
		majority := replicas/2 + 1
		switch {
		case p.Spec.MaxUnavailable != nil && p.Spec.MinAvailable != nil:
			m.problem(o, "both maxUnavailable and minAvailable are set")
		case p.Spec.MaxUnavailable != nil:
			n, err := intstr.GetScaledValueFromIntOrPercent(p.Spec.MaxUnavailable, replicas, true)
			if err != nil {
				m.problem(o, "maxUnavailable: %v", err)
			} else if replicas-n < majority {
				m.problem(o, "maxUnavailable %s lets %d of %s's %d voters go: %d left, below the majority of %d",
					p.Spec.MaxUnavailable.String(), n, w.obj, replicas, replicas-n, majority)
			}
		case p.Spec.MinAvailable != nil:
			n, err := intstr.GetScaledValueFromIntOrPercent(p.Spec.MinAvailable, replicas, true)
			if err != nil {
				m.problem(o, "minAvailable: %v", err)
			} else if n < majority {
				m.problem(o, "minAvailable %s keeps %d of %s's %d voters: below the majority of %d",
					p.Spec.MinAvailable.String(), n, w.obj, replicas, majority)
			}
		default:
			m.problem(o, "neither maxUnavailable nor minAvailable is set")
		}
	}
}

func (m *manifests) checkWorkload(w *workload) {
	o, spec := w.obj, &w.template.Spec
	if !selects(w.selector, w.template.Labels) {
		m.problem(o, "spec.selector does not match the pod template's labels")
	}
	volumes := map[string]*corev1.Volume{}
	for i := range spec.Volumes {
		volumes[spec.Volumes[i].Name] = &spec.Volumes[i]
	}
	claims := map[string]bool{}
	for _, c := range w.claims {
		claims[c.Name] = true
	}
	used := map[string]bool{}
	all := append(append([]corev1.Container{}, spec.InitContainers...), spec.Containers...)
	for _, c := range all {
		paths := map[string]bool{}
		for _, vm := range c.VolumeMounts {
			used[vm.Name] = true
			if volumes[vm.Name] == nil && !claims[vm.Name] {
				m.problem(o, "container %q mounts volume %q: no such volume or volumeClaimTemplate", c.Name, vm.Name)
			}
			if paths[vm.MountPath] {
				m.problem(o, "container %q mounts two volumes at %s", c.Name, vm.MountPath)
			}
			paths[vm.MountPath] = true
		}
		m.checkProbes(o, c)
		m.checkEnvRefs(o, c, w.namespace)
	}
	for name := range volumes {
		if !used[name] {
			m.problem(o, "volume %q is mounted by no container", name)
		}
	}
	for name := range claims {
		if !used[name] {
			m.problem(o, "volumeClaimTemplate %q is mounted by no container", name)
		}
	}
	for _, v := range spec.Volumes {
		m.checkVolumeSources(o, v, w.namespace)
	}
	for _, ordinal := range w.ordinals {
		for _, c := range all {
			m.checkPaths(w, c, ordinal)
		}
	}
}

func (m *manifests) checkProbes(o *object, c corev1.Container) {
	for name, p := range map[string]*corev1.Probe{"startupProbe": c.StartupProbe,
		"readinessProbe": c.ReadinessProbe, "livenessProbe": c.LivenessProbe} {
		if p == nil {
			continue
		}
		var port *intstr.IntOrString
		switch {
		case p.HTTPGet != nil:
			port = &p.HTTPGet.Port
		case p.TCPSocket != nil:
			port = &p.TCPSocket.Port
		case p.GRPC != nil:
			v := intstr.FromInt32(p.GRPC.Port)
			port = &v
		}
		if port != nil && !hasPort([]corev1.Container{c}, *port) {
			m.problem(o, "container %q %s: port %s is none of the container's ports", c.Name, name, port.String())
		}
	}
}

// configMap returns the ConfigMap of the manifests, or nil.
func (m *manifests) configMap(namespace, name string) *corev1.ConfigMap {
	if o := m.find("ConfigMap", namespace, name); o != nil {
		return o.value.(*corev1.ConfigMap)
	}
	return nil
}

// certificateFor returns the Certificate that makes the secret, or nil.
func (m *manifests) certificateFor(namespace, secret string) *Certificate {
	for _, o := range m.objects {
		if c, ok := o.value.(*Certificate); ok && c.Namespace == namespace && c.Spec.SecretName == secret {
			return c
		}
	}
	return nil
}

// certificateKeys are what cert-manager writes into a Certificate's secret.
var certificateKeys = map[string]bool{"ca.crt": true, "tls.crt": true, "tls.key": true}

func (m *manifests) checkConfigMapKeys(o *object, where, namespace, name string, optional bool, keys []string) {
	cm := m.configMap(namespace, name)
	if cm == nil {
		if !optional {
			m.problem(o, "%s: ConfigMap %q is not in the manifests", where, name)
		}
		return
	}
	for _, k := range keys {
		if _, ok := cm.Data[k]; !ok {
			m.problem(o, "%s: ConfigMap %q has no key %q", where, name, k)
		}
	}
}

func (m *manifests) checkSecretKeys(o *object, where, namespace, name string, optional bool, keys []string) {
	if m.certificateFor(namespace, name) == nil && m.find("Secret", namespace, name) == nil {
		if !optional {
			m.problem(o, "%s: secret %q is made by no Certificate or Secret of the manifests", where, name)
		}
		return
	}
	for _, k := range keys {
		if !certificateKeys[k] {
			m.problem(o, "%s: secret %q has no key %q (a Certificate's secret holds ca.crt, tls.crt, tls.key)", where, name, k)
		}
	}
}

func itemKeys(items []corev1.KeyToPath) []string {
	var keys []string
	for _, it := range items {
		keys = append(keys, it.Key)
	}
	return keys
}

func optional(b *bool) bool { return b != nil && *b }

func (m *manifests) checkVolumeSources(o *object, v corev1.Volume, namespace string) {
	where := fmt.Sprintf("volume %q", v.Name)
	if cm := v.ConfigMap; cm != nil {
		m.checkConfigMapKeys(o, where, namespace, cm.Name, optional(cm.Optional), itemKeys(cm.Items))
	}
	if s := v.Secret; s != nil {
		m.checkSecretKeys(o, where, namespace, s.SecretName, optional(s.Optional), itemKeys(s.Items))
	}
	if p := v.Projected; p != nil {
		for _, src := range p.Sources {
			if cm := src.ConfigMap; cm != nil {
				m.checkConfigMapKeys(o, where, namespace, cm.Name, optional(cm.Optional), itemKeys(cm.Items))
			}
			if s := src.Secret; s != nil {
				m.checkSecretKeys(o, where, namespace, s.Name, optional(s.Optional), itemKeys(s.Items))
			}
		}
	}
}

func (m *manifests) checkEnvRefs(o *object, c corev1.Container, namespace string) {
	for _, e := range c.Env {
		if e.ValueFrom == nil {
			continue
		}
		if r := e.ValueFrom.ConfigMapKeyRef; r != nil {
			m.checkConfigMapKeys(o, fmt.Sprintf("container %q env %s", c.Name, e.Name), namespace, r.Name,
				optional(r.Optional), []string{r.Key})
		}
		if r := e.ValueFrom.SecretKeyRef; r != nil {
			m.checkSecretKeys(o, fmt.Sprintf("container %q env %s", c.Name, e.Name), namespace, r.Name,
				optional(r.Optional), []string{r.Key})
		}
	}
}

func atoi(s string) int {
	n, err := strconv.Atoi(s)
	if err != nil {
		return -1
	}
	return n
}

func trimPort(hostPort string) string {
	if i := strings.LastIndex(hostPort, ":"); i >= 0 {
		return hostPort[:i]
	}
	return hostPort
}
