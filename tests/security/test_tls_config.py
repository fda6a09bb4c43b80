"""common/security.py on its own: the flags and the early checks of certificate files."""

from __future__ import annotations

import argparse

import pytest

from common.security import (
    add_client_tls_args,
    add_server_tls_args,
    channel_credentials,
    check_pem,
    client_tls_from_args,
    server_tls_from_args,
)
from tests.security.certs import make_pki


def parse(argv: list[str]):
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_server_tls_args(parser)
    add_client_tls_args(parser, "cache", "the cache manager")
    parser.error = lambda message: (_ for _ in ()).throw(ValueError(message))  # type: ignore[method-assign]
    args = parser.parse_args(argv)
    return server_tls_from_args(args, parser), client_tls_from_args(args, parser, "cache")


def test_flags_and_checks(tmp_path):
    pki = make_pki(tmp_path)
    server, client = parse(["--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key),
                            "--tls-client-ca", str(pki.ca), "--cache-tls-ca", str(pki.ca)])
    assert server.client_ca == pki.ca and client.ca == pki.ca and client.cert is None
    server.credentials()
    client.credentials()
    assert parse([]) == (None, None)
    for argv, fragment in (
        (["--tls-cert", str(pki.server.cert)], "go together"),
        (["--tls-client-ca", str(pki.ca)], "needs --tls-cert"),
        (["--tls-cert", str(pki.server.cert), "--tls-key", str(pki.client.key)], "its private key"),
        (["--tls-cert", str(pki.server.key), "--tls-key", str(pki.server.key)], "its private key"),
        (["--cache-tls-ca", str(pki.server.key)], "not a PEM CA certificate"),
        (["--cache-tls-cert", str(pki.client.cert)], "go together"),
        (["--cache-tls-ca", str(tmp_path / "missing.pem")], "no such file"),
    ):
        with pytest.raises(ValueError, match=fragment):
            parse(argv)
    check_pem(pki.ca, pki.client.cert, pki.client.key)
    with pytest.raises(ValueError, match="needs its key"):
        channel_credentials(pki.ca, pki.client.cert, None)


def test_the_http_door_uses_the_grpc_ports_certificate_and_client_ca(tmp_path):
    import socket
    import ssl

    from fastapi import FastAPI

    from common.security import ServerTLS
    from router.server import _http_server

    pki = make_pki(tmp_path)
    with socket.socket() as sock:
        for tls, verify in ((ServerTLS(pki.server.cert, pki.server.key), ssl.CERT_NONE),
                            (ServerTLS(pki.server.cert, pki.server.key, pki.ca), ssl.CERT_REQUIRED)):
            server = _http_server(FastAPI(), sock, "INFO", tls)
            server.config.load()
            assert server.config.ssl is not None and server.config.ssl.verify_mode == verify
