"""Channel settings shared by the sync and async clients: retry policy, TLS, bearer token.

Retries are gRPC's own (the ``retryPolicy`` of the channel's service config), not a loop of
ours. Every radixkv RPC the client makes is safe to retry on ``UNAVAILABLE``: Tokenize,
Detokenize, ModelInfo and Stats are read-only, and gRPC commits a call (stops retrying it) as soon as the
server sends response headers, so a streaming Generate is only retried before its first
message arrives, when no token has been produced for the caller yet.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from common.security import channel_credentials

MODEL_SERVICE = "radixkv.v1.ModelService"
CACHE_SERVICE = "radixkv.v1.CacheManager"

# Methods the client calls; all of them are retried on UNAVAILABLE (see the module docstring).
RETRIED_METHODS: tuple[tuple[str, str], ...] = (
    (MODEL_SERVICE, "Generate"),
    (MODEL_SERVICE, "Tokenize"),
    (MODEL_SERVICE, "Detokenize"),
    (MODEL_SERVICE, "ModelInfo"),
    (CACHE_SERVICE, "Stats"),
    (CACHE_SERVICE, "Match"),
)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """gRPC retry policy (gRFC A6): attempts with exponential backoff and jitter."""

    max_attempts: int = 5
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    backoff_multiplier: float = 2.0
    retryable_status_codes: tuple[str, ...] = ("UNAVAILABLE",)


DEFAULT_RETRY = RetryPolicy()


def service_config(retry: RetryPolicy | None, wait_for_ready: bool) -> str:
    """The JSON service config that turns on retries (and optionally waitForReady).

    ``wait_for_ready``: calls wait (up to their timeout) for the server to come up instead of
    failing fast with UNAVAILABLE while it cannot be reached. Useful right after starting
    the servers; leave it off to learn quickly that an address is wrong.
    """
    method_config: dict[str, object] = {
        "name": [{"service": service, "method": method} for service, method in RETRIED_METHODS],
        "waitForReady": wait_for_ready,
    }
    if retry is not None and retry.max_attempts > 1:
        method_config["retryPolicy"] = {
            "maxAttempts": retry.max_attempts,
            "initialBackoff": f"{retry.initial_backoff_s}s",
            "maxBackoff": f"{retry.max_backoff_s}s",
            "backoffMultiplier": retry.backoff_multiplier,
            "retryableStatusCodes": list(retry.retryable_status_codes),
        }
    return json.dumps({"methodConfig": [method_config]})


def channel_options(retry: RetryPolicy | None, wait_for_ready: bool) -> list[tuple[str, object]]:
    return [
        ("grpc.enable_retries", 1 if retry is not None else 0),
        ("grpc.service_config", service_config(retry, wait_for_ready)),
        # Use exactly this config (no DNS TXT lookups replacing it).
        ("grpc.service_config_disable_resolution", 1),
        # Token streams can be long; never cap what a server sends.
        ("grpc.max_receive_message_length", -1),
    ]


def call_metadata(token: str | None) -> Sequence[tuple[str, str]] | None:
    """``authorization: Bearer <token>`` on every call when a token is given (passed through)."""
    return (("authorization", f"Bearer {token}"),) if token else None


def tls_credentials(
    tls: bool,
    root_certificates: bytes | str | Path | None,
    client_cert: bytes | str | Path | None = None,
    client_key: bytes | str | Path | None = None,
) -> grpc.ChannelCredentials | None:
    """TLS credentials, or None for a plaintext channel.

    ``root_certificates``: PEM bytes, or the path of a PEM file; implies TLS. With ``tls=True``
    and no roots, the system's default roots are used. ``client_cert`` and ``client_key`` (PEM
    bytes or paths, both or neither; imply TLS): this client's certificate for mutual TLS.
    """
    if root_certificates is None and client_cert is None and client_key is None and not tls:
        return None
    return channel_credentials(root_certificates, client_cert, client_key)


@dataclass(frozen=True, slots=True)
class ClientSettings:
    """What both clients are configured with; see ``RadixKVClient`` for the meaning."""

    addr: str
    cache_addr: str | None = None
    timeout: float | None = None
    retry: RetryPolicy | None = DEFAULT_RETRY
    wait_for_ready: bool = False
    tls: bool = False
    root_certificates: bytes | str | Path | None = None
    token: str | None = None
    client_cert: bytes | str | Path | None = None
    client_key: bytes | str | Path | None = None

    def options(self) -> list[tuple[str, object]]:
        return channel_options(self.retry, self.wait_for_ready)

    def credentials(self) -> grpc.ChannelCredentials | None:
        return tls_credentials(self.tls, self.root_certificates, self.client_cert, self.client_key)

    def metadata(self) -> Sequence[tuple[str, str]] | None:
        return call_metadata(self.token)

    def call_timeout(self, timeout: float | None) -> float | None:
        """The per-call timeout if given, else the client's default (None: no deadline)."""
        return self.timeout if timeout is None else timeout


def open_channel(settings: ClientSettings, addr: str) -> grpc.Channel:
    credentials = settings.credentials()
    if credentials is None:
        return grpc.insecure_channel(addr, options=settings.options())
    return grpc.secure_channel(addr, credentials, options=settings.options())


def open_aio_channel(settings: ClientSettings, addr: str) -> grpc.aio.Channel:
    credentials = settings.credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(addr, options=settings.options())
    return grpc.aio.secure_channel(addr, credentials, options=settings.options())
