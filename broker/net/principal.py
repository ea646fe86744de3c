"""Who is on the other end of a connection: the principal a request acts as.

The TLS layer derives it from the peer's verified certificate; the
authorizer (ACLs, replica identity binding) decides what it may do. Kept in
its own small module so both depend on it and not on each other.

Certificates issued by ``metalog certs`` (all signed by the cluster CA):

* a node certificate carries the SAN URI ``urn:metalog:node:<id>`` and the
  common name ``node-<id>``: principal ``Node:<id>``. Only such a
  certificate may send replica RPCs, and only under its own id.
* a user certificate carries ``urn:metalog:user:<name>`` (or just the common
  name ``<name>``): principal ``User:<name>``, the form Kafka ACLs use.

Without TLS (the opt-in insecure mode) every connection is ``User:ANONYMOUS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NODE_URI_PREFIX = "urn:metalog:node:"
USER_URI_PREFIX = "urn:metalog:user:"


@dataclass(frozen=True, slots=True)
class Principal:
    kind: str  # "Node" or "User"
    name: str  # the node id as a string for "Node", the user name for "User"

    @property
    def node_id(self) -> int | None:
        """The replica id this principal may act as, or None for a user."""
        return int(self.name) if self.kind == "Node" else None

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}"

    @classmethod
    def parse(cls, text: str) -> "Principal":
        """``User:alice`` or ``Node:2`` (as written in ACLs and super_users)."""
        kind, sep, name = text.partition(":")
        if not sep or not name or kind not in ("User", "Node"):
            raise ValueError(f"principal must look like User:<name> or Node:<id>, got {text!r}")
        if kind == "Node" and not name.isdigit():
            raise ValueError(f"a Node principal names a node id, got {text!r}")
        return cls(kind, name)


ANONYMOUS = Principal("User", "ANONYMOUS")


def node_principal(node_id: int) -> Principal:
    return Principal("Node", str(int(node_id)))


def principal_from_cert(cert: dict[str, Any] | None) -> Principal:
    """The principal of a verified peer certificate, in the form returned by
    ``ssl.SSLObject.getpeercert()``. A certificate without a name is refused."""
    if not cert:
        raise ValueError("peer presented no certificate")
    for kind, value in cert.get("subjectAltName", ()):
        if kind != "URI":
            continue
        if value.startswith(NODE_URI_PREFIX):
            node = value[len(NODE_URI_PREFIX):]
            if not node.isdigit():
                raise ValueError(f"malformed node URI in certificate: {value!r}")
            return node_principal(int(node))
        if value.startswith(USER_URI_PREFIX) and len(value) > len(USER_URI_PREFIX):
            return Principal("User", value[len(USER_URI_PREFIX):])
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName" and value:
                return Principal("User", value)
    raise ValueError("peer certificate has neither a metalog URI nor a common name")
