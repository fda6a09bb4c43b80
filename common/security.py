"""TLS for every radixkv server and for the connections between them, with gRPC's own credentials.

Servers: ``--tls-cert PEM --tls-key PEM`` serve TLS; ``--tls-client-ca PEM`` adds mutual TLS (a
client without a certificate signed by that CA is refused during the handshake). Connections a
server makes to another one take ``--PREFIX-tls-ca`` (the CA that signed the peer's certificate:
turns TLS on), ``--PREFIX-tls-cert`` / ``--PREFIX-tls-key`` (this side's certificate, for a peer
that asks for one) and ``--PREFIX-token-file`` (the bearer token to send, see common/auth.py).
Certificates and keys are read once, at start.
"""

from __future__ import annotations

import argparse
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

Pem = bytes | str | Path


def read_pem(value: Pem | None) -> bytes | None:
    """PEM bytes as given, or read from a path (str / Path)."""
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


def server_credentials(cert: Pem, key: Pem, client_ca: Pem | None = None) -> grpc.ServerCredentials:
    """TLS server credentials; with ``client_ca``, clients must present a certificate it signed."""
    return grpc.ssl_server_credentials(
        [(read_pem(key), read_pem(cert))],
        root_certificates=read_pem(client_ca),
        require_client_auth=client_ca is not None,
    )


def channel_credentials(root_certificates: Pem | None = None, certificate_chain: Pem | None = None,
                        private_key: Pem | None = None) -> grpc.ChannelCredentials:
    """TLS channel credentials: the roots that signed the server's certificate (None: the
    system's), and this client's certificate and key for mutual TLS (both or neither)."""
    if (certificate_chain is None) != (private_key is None):
        raise ValueError("a client certificate needs its key and a key its certificate")
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(root_certificates),
        private_key=read_pem(private_key),
        certificate_chain=read_pem(certificate_chain),
    )


def add_port(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Binds `address` (TLS when credentials are given); returns the bound port."""
    if credentials is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, credentials)


def open_channel(addr: str, credentials: grpc.ChannelCredentials | None,
                 options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    if credentials is None:
        return grpc.insecure_channel(addr, options=list(options))
    return grpc.secure_channel(addr, credentials, options=list(options))


def open_aio_channel(addr: str, credentials: grpc.ChannelCredentials | None,
                     options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    if credentials is None:
        return grpc.aio.insecure_channel(addr, options=list(options))
    return grpc.aio.secure_channel(addr, credentials, options=list(options))


def check_pem(ca: Path | None = None, cert: Path | None = None, key: Path | None = None) -> None:
    """Fails early, with a clear ValueError, on files that are not PEM certificates / a key
    matching its certificate (gRPC would only say that the port cannot be bound). The standard
    library's ssl only reads them here; the connections use gRPC's credentials."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        if ca is not None:
            context.load_verify_locations(cafile=str(ca))
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"{ca}: not a PEM CA certificate ({e})") from None
    try:
        if cert is not None:
            context.load_cert_chain(str(cert), str(key) if key is not None else None)
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"{cert} / {key}: not a PEM certificate and its private key ({e})") from None


@dataclass(frozen=True, slots=True)
class ServerTLS:
    """A server's certificate and key, and the CA of its clients' certificates (mutual TLS)."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    def credentials(self) -> grpc.ServerCredentials:
        return server_credentials(self.cert, self.key, self.client_ca)


@dataclass(frozen=True, slots=True)
class ClientTLS:
    """How to reach a TLS peer: its CA, and this side's certificate and key for mutual TLS."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return channel_credentials(self.ca, self.cert, self.key)


def add_server_tls_args(parser: argparse.ArgumentParser, what: str = "the gRPC port") -> None:
    group = parser.add_argument_group("TLS (server)")
    group.add_argument("--tls-cert", type=Path, metavar="PEM",
                       help=f"serve {what} over TLS with this certificate (chain); needs --tls-key")
    group.add_argument("--tls-key", type=Path, metavar="PEM", help="private key of --tls-cert")
    group.add_argument("--tls-client-ca", type=Path, metavar="PEM",
                       help="mutual TLS: refuse clients without a certificate signed by this CA")


def server_tls_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ServerTLS | None:
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    if args.tls_cert is None:
        if args.tls_client_ca is not None:
            parser.error("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    for path in (args.tls_cert, args.tls_key, args.tls_client_ca):
        if path is not None and not path.is_file():
            parser.error(f"no such file: {path}")
    try:
        check_pem(args.tls_client_ca, args.tls_cert, args.tls_key)
    except ValueError as e:
        parser.error(str(e))
    return ServerTLS(args.tls_cert, args.tls_key, args.tls_client_ca)


def add_client_tls_args(parser: argparse.ArgumentParser, prefix: str, what: str) -> None:
    """``--PREFIX-tls-ca/-cert/-key`` and ``--PREFIX-token-file`` for connections to `what`."""
    group = parser.add_argument_group(f"connections to {what}")
    group.add_argument(f"--{prefix}-tls-ca", type=Path, metavar="PEM",
                       help=f"connect to {what} over TLS, trusting this CA")
    group.add_argument(f"--{prefix}-tls-cert", type=Path, metavar="PEM",
                       help=f"client certificate for {what} (mutual TLS); needs --{prefix}-tls-key")
    group.add_argument(f"--{prefix}-tls-key", type=Path, metavar="PEM", help=f"private key of --{prefix}-tls-cert")
    group.add_argument(f"--{prefix}-token-file", type=Path, metavar="PATH",
                       help=f"send the first token of this file to {what} (authorization: Bearer)")


def client_tls_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser, prefix: str) -> ClientTLS | None:
    name = prefix.replace("-", "_")
    ca, cert, key = (getattr(args, f"{name}_tls_{part}") for part in ("ca", "cert", "key"))
    if (cert is None) != (key is None):
        parser.error(f"--{prefix}-tls-cert and --{prefix}-tls-key go together")
    for path in (ca, cert, key, getattr(args, f"{name}_token_file")):
        if path is not None and not path.is_file():
            parser.error(f"no such file: {path}")
    if ca is None and cert is None:
        return None
    try:
        check_pem(ca, cert, key)
    except ValueError as e:
        parser.error(str(e))
    return ClientTLS(ca, cert, key)
