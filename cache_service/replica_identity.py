"""Who registers a pool: the owner key a pool is bound to, and the names a client certificate gives.

Read from a call's principal (common/auth.py) and its gRPC auth context (a mapping of property
name -> list of bytes, `ServicerContext.auth_context()`), so this module needs no gRPC objects.
gRPC core fills the auth context of a TLS connection from the verified client certificate:
`peer_dns` (its DNS subject alternative names), `peer_uri` (URI SANs, SPIFFE ids included),
`x509_pem_cert` (the certificate itself), `x509_common_name` and others (grpcio 1.85).
"""

from __future__ import annotations

import hashlib
import ssl
from collections.abc import Mapping, Sequence

from common.auth import Principal

AuthContext = Mapping[str, Sequence[bytes]]

# The SAN kinds a worker id may be: DNS names and URIs (not IP addresses or e-mail addresses).
WORKER_NAME_PROPERTIES = ("peer_dns", "peer_uri")


def certificate_names(auth_context: AuthContext) -> frozenset[str]:
    """The DNS and URI subject alternative names of the peer's certificate (empty without one)."""
    return frozenset(value.decode(errors="replace") for prop in WORKER_NAME_PROPERTIES
                     for value in auth_context.get(prop, ()))


def certificate_digest(auth_context: AuthContext) -> str | None:
    """A stable id of the peer's certificate (SHA-256 of its DER bytes, shortened); None without one."""
    pems = auth_context.get("x509_pem_cert")
    if not pems:
        return None
    der = ssl.PEM_cert_to_DER_cert(pems[0].decode("ascii"))
    return hashlib.sha256(der).hexdigest()[:32]


def owner_key(principal: Principal | None, auth_context: AuthContext) -> str:
    """Who a registration is from: the bearer token's principal when the server checks tokens,
    else the client certificate (mutual TLS), else "" (anonymous: every caller is the same one)."""
    if principal is not None:
        return principal.key
    digest = certificate_digest(auth_context)
    return f"x509:{digest}" if digest is not None else ""
