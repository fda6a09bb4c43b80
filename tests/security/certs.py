"""A throwaway certificate authority for the security tests, made with `cryptography` at test time
(nothing is committed): a CA, a server certificate for localhost / 127.0.0.1, and client
certificates signed by that CA or by a stranger CA; `client_cert` issues more client certificates
of the CA, with subject alternative names (a replica's worker id under mutual TLS)."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class KeyPair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    ca: Path  # the CA certificate (trust root of servers and of mutual-TLS clients)
    server: KeyPair  # localhost, 127.0.0.1, ::1
    client: KeyPair  # signed by `ca`
    stranger: KeyPair  # a client certificate signed by another CA
    ca_key: Path | None = None  # the CA's private key (client_cert signs with it)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)
    return path


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _builder(subject: str, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1)))


def _ca(directory: Path, name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (_builder(name, _name(name), key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    _write_cert(cert, directory / f"{name}.pem")
    return cert, key


def _leaf(directory: Path, name: str, ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
          server: bool, dns: Sequence[str] = (), uris: Sequence[str] = ()) -> KeyPair:
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (_builder(name, ca_cert.subject, key.public_key())
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                                     else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                              critical=False))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address("::1"))]), critical=False)
    elif dns or uris:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName(d) for d in dns] + [x509.UniformResourceIdentifier(u) for u in uris]), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return KeyPair(_write_cert(cert, directory / f"{name}.pem"), _write_key(key, directory / f"{name}-key.pem"))


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca = _ca(directory, "radixkv-test-ca")
    stranger_ca = _ca(directory, "stranger-ca")
    return Pki(
        ca=directory / "radixkv-test-ca.pem",
        server=_leaf(directory, "server", ca, server=True),
        client=_leaf(directory, "client", ca, server=False),
        stranger=_leaf(directory, "stranger-client", stranger_ca, server=False),
        ca_key=_write_key(ca[1], directory / "radixkv-test-ca-key.pem"),
    )


def client_cert(pki: Pki, name: str, dns: Sequence[str] = (), uris: Sequence[str] = ()) -> KeyPair:
    """Another client certificate of `pki`'s CA (common name `name`), with these DNS and URI
    subject alternative names, written next to the CA certificate."""
    assert pki.ca_key is not None, "a Pki from make_pki"
    ca_cert = x509.load_pem_x509_certificate(pki.ca.read_bytes())
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    return _leaf(pki.ca.parent, name, (ca_cert, ca_key), server=False, dns=dns, uris=uris)
