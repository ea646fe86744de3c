"""Certificates for a metalog cluster, made with the ``cryptography`` library.

A cluster has one CA; every broker gets a node certificate and every person
or program a user certificate, both signed by that CA (see
``broker/net/principal.py`` for how a certificate becomes a principal):

* node certificate: CN ``node-<id>``, SAN URI ``urn:metalog:node:<id>``, SAN
  DNS/IP entries for the names the node is dialled by, serverAuth+clientAuth
  (a broker is a server to clients and a client to its peers);
* user certificate: CN ``<name>``, SAN URI ``urn:metalog:user:<name>``,
  clientAuth only.

Files are PEM: ``<name>.crt`` and ``<name>.key`` (key mode 0600), written
atomically so a broker reloading them never sees half a file. Used by the
launcher (``metalog cluster up``), by ``metalog certs`` and by the tests.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from metalog.broker.net.principal import NODE_URI_PREFIX, USER_URI_PREFIX
from metalog.storage.atomic import atomic_write

CA_VALID_DAYS = 3650
CERT_VALID_DAYS = 365
# A certificate is valid from a little before "now": clocks of a cluster differ.
_BACKDATE = dt.timedelta(minutes=5)


@dataclass(frozen=True)
class Issued:
    cert_path: str
    key_path: str


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _new_key() -> ec.EllipticCurvePrivateKey:
    # P-256: fast handshakes, accepted by every TLS 1.2/1.3 stack (etcd's too).
    return ec.generate_private_key(ec.SECP256R1())


def _write_pair(directory: str, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Issued:
    os.makedirs(directory, exist_ok=True)
    cert_path = os.path.join(directory, f"{name}.crt")
    key_path = os.path.join(directory, f"{name}.key")
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    # Key first: a reader that sees the new certificate must find its key.
    atomic_write(key_path, key_pem, mode=0o600)
    atomic_write(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return Issued(cert_path, key_path)


def load_cert(path: str) -> x509.Certificate:
    with open(path, "rb") as f:
        return x509.load_pem_x509_certificate(f.read())


def _load_key(path: str):
    with open(path, "rb") as f:
        return serialization.load_pem_private_key(f.read(), password=None)


def init_ca(directory: str, name: str = "metalog-ca", valid_days: int = CA_VALID_DAYS,
            not_before: dt.datetime | None = None) -> Issued:
    """Create a self-signed CA as ``<directory>/ca.crt`` and ``ca.key``."""
    key = _new_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    start = not_before or (_now() - _BACKDATE)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(start + dt.timedelta(days=valid_days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _write_pair(directory, "ca", cert, key)


def _san_entries(hosts: list[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for h in hosts:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            out.append(x509.DNSName(h))
    return out


def _issue(ca_dir: str, out_dir: str, file_name: str, common_name: str, uri: str, hosts: list[str],
           server: bool, valid_days: int, not_before: dt.datetime | None) -> Issued:
    ca_cert = load_cert(os.path.join(ca_dir, "ca.crt"))
    ca_key = _load_key(os.path.join(ca_dir, "ca.key"))
    key = _new_key()
    start = not_before or (_now() - _BACKDATE)
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if server else [])
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(start + dt.timedelta(days=valid_days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, key_cert_sign=False,
                                     crl_sign=False, content_commitment=False, data_encipherment=False,
                                     key_agreement=True, encipher_only=False, decipher_only=False),
                       critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri), *_san_entries(hosts)]),
                       critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return _write_pair(out_dir, file_name, cert, key)


def issue_node(ca_dir: str, out_dir: str, node_id: int, hosts: list[str],
               valid_days: int = CERT_VALID_DAYS, not_before: dt.datetime | None = None) -> Issued:
    """``<out_dir>/node-<id>.crt|.key``; `hosts` are the DNS names / IPs clients dial it by."""
    assert node_id >= 0
    return _issue(ca_dir, out_dir, f"node-{node_id}", f"node-{node_id}", f"{NODE_URI_PREFIX}{node_id}",
                  list(hosts), True, valid_days, not_before)


def issue_user(ca_dir: str, out_dir: str, name: str,
               valid_days: int = CERT_VALID_DAYS, not_before: dt.datetime | None = None) -> Issued:
    """``<out_dir>/<name>.crt|.key`` for principal ``User:<name>`` (client use only)."""
    if not name or any(c in name for c in "/\\:\0") or name.startswith("node-"):
        raise ValueError(f"user name must be non-empty, without / \\ : and not start with node-, got {name!r}")
    return _issue(ca_dir, out_dir, name, name, f"{USER_URI_PREFIX}{name}", [], False, valid_days, not_before)


def describe(path: str) -> dict:
    """What ``metalog certs show`` prints for one certificate."""
    cert = load_cert(path)
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        san = [str(getattr(g, "value", g)) for g in sans]
    except x509.ExtensionNotFound:
        san = []
    not_after = cert.not_valid_after_utc
    return {
        "path": path,
        "subject": cert.subject.rfc4514_string(),
        "issuer": cert.issuer.rfc4514_string(),
        "serial": format(cert.serial_number, "x"),
        "not_before": cert.not_valid_before_utc.isoformat(),
        "not_after": not_after.isoformat(),
        "days_left": round((not_after - _now()).total_seconds() / 86400, 1),
        "san": san,
    }


def cluster_certs(cert_dir: str, node_hosts: dict[int, list[str]], users: tuple[str, ...] = ("admin",)) -> None:
    """Create (once) a CA, node certificates and user certificates in `cert_dir`;
    existing files are kept, so restarting a cluster keeps its identities."""
    if not os.path.exists(os.path.join(cert_dir, "ca.crt")):
        init_ca(cert_dir)
    for node_id, hosts in node_hosts.items():
        if not os.path.exists(os.path.join(cert_dir, f"node-{node_id}.crt")):
            issue_node(cert_dir, cert_dir, node_id, hosts)
    for user in users:
        if not os.path.exists(os.path.join(cert_dir, f"{user}.crt")):
            issue_user(cert_dir, cert_dir, user)
