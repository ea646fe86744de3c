package main

// The cert-manager (cert-manager.io/v1) fields these manifests use, mirrored
// from cert-manager's API reference: its Go module drags in a controller
// runtime this checker does not need. Strict decoding still refuses any
// field not listed here, so a field of cert-manager that we do not mirror
// reads as a mistake: add it here (with cert-manager's exact JSON name) when
// the manifests start using it.

import metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

type Certificate struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Spec              CertificateSpec `json:"spec"`
}

type CertificateSpec struct {
	SecretName  string                 `json:"secretName"`
	CommonName  string                 `json:"commonName,omitempty"`
	DNSNames    []string               `json:"dnsNames,omitempty"`
	IPAddresses []string               `json:"ipAddresses,omitempty"`
	URIs        []string               `json:"uris,omitempty"`
	IsCA        bool                   `json:"isCA,omitempty"`
	Duration    string                 `json:"duration,omitempty"`
	RenewBefore string                 `json:"renewBefore,omitempty"`
	Usages      []string               `json:"usages,omitempty"`
	PrivateKey  *CertificatePrivateKey `json:"privateKey,omitempty"`
	IssuerRef   IssuerRef              `json:"issuerRef"`
}

type CertificatePrivateKey struct {
	Algorithm      string `json:"algorithm,omitempty"`
	Size           int    `json:"size,omitempty"`
	Encoding       string `json:"encoding,omitempty"`
	RotationPolicy string `json:"rotationPolicy,omitempty"`
}

type IssuerRef struct {
	Name  string `json:"name"`
	Kind  string `json:"kind,omitempty"`
	Group string `json:"group,omitempty"`
}

type Issuer struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Spec              IssuerSpec `json:"spec"`
}

type IssuerSpec struct {
	SelfSigned *struct{} `json:"selfSigned,omitempty"`
	CA         *CAIssuer `json:"ca,omitempty"`
}

type CAIssuer struct {
	SecretName string `json:"secretName"`
}
