"""The router process: grpc.aio ModelService + health + reflection, the OpenAI HTTP door (uvicorn
in the same event loop), background replica checks, metrics, graceful stop on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from common.auth import ClientToken, TokenStore, server_interceptors
from common.grpc_server import (
    NOT_SERVING,
    SERVING,
    add_health_and_reflection,
    add_servicer,
    format_address,
    new_server,
    set_health,
)
from common.limits import ServerLimits, id_error
from common.metrics_server import DEFAULT_METRICS_HOST
from common.security import ClientTLS, ServerTLS, add_port
from common.server_runner import ServerHooks, StartupError, cancel_and_wait, run_server
from common.shards import parse_shards
from protos import model_pb2
from router.cache_shards import ShardedCache
from router.core import CoreConfig, RouterCore
from router.http_body import DEFAULT_MAX_BODY_BYTES
from router.metrics import RouterMetrics
from router.replicas import ReplicaSet
from router.servicer import METHOD_ROLES, RouterServicer
from router.trust import ReplicaTrust
from router.upstream import CacheManagerClient, ReplicaClients

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger(__name__)

SERVICE_NAME = model_pb2.DESCRIPTOR.services_by_name["ModelService"].full_name


@dataclass(slots=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 50050
    cache_addr: str = "127.0.0.1:50051"
    policy: str = "kv"
    http_port: int | None = None
    metrics_port: int | None = None
    metrics_host: str = DEFAULT_METRICS_HOST  # not `host`: the token-less metrics stay private by default
    replicas: list[str] = field(default_factory=list)
    # Which replica addresses the router may call besides `replicas` (router/trust.py): DNS names
    # whose addresses are trusted, and an allowlist of networks / host globs (None: loopback).
    replica_dns: list[str] = field(default_factory=list)
    replica_allow: list[str] | None = None
    advertise_addr: str | None = None
    check_interval_s: float = 1.0
    reserve_ms: int = 2000
    route_timeout_s: float = 1.0
    grace_seconds: float = 2.0
    log_level: str = "INFO"
    # TLS and bearer tokens (role "client") of the gRPC port and the HTTP door; how to reach the
    # cache manager and the replicas.
    tls: ServerTLS | None = None
    tokens: TokenStore | None = None
    cache_tls: ClientTLS | None = None
    cache_token: ClientToken = field(default_factory=lambda: ClientToken(None))
    replica_tls: ClientTLS | None = None
    replica_token: ClientToken = field(default_factory=lambda: ClientToken(None))
    limits: ServerLimits = field(default_factory=ServerLimits)  # of the gRPC port (common/limits.py)
    max_http_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # of the HTTP door: 413 past it (router/http_body.py)


def _bind_http(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError:
        sock.close()
        raise
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def _http_server(app, sock: socket.socket, log_level: str, tls: ServerTLS | None = None,
                 grace_seconds: float = 2.0):
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn without its own signal handling: the router's stops it (should_exit)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    ssl_args: dict[str, object] = {}
    if tls is not None:  # the gRPC port's certificate; mutual TLS with the same client CA
        ssl_args = dict(ssl_certfile=str(tls.cert), ssl_keyfile=str(tls.key))
        if tls.client_ca is not None:
            ssl_args.update(ssl_ca_certs=str(tls.client_ca), ssl_cert_reqs=ssl.CERT_REQUIRED)
    from router.http_linger import LingeringH11Protocol

    config = uvicorn.Config(app, fd=None, http=LingeringH11Protocol, lifespan="off", log_config=None, access_log=False,
                            log_level=log_level.lower(), timeout_graceful_shutdown=max(1, round(grace_seconds)),
                            **ssl_args)
    return Server(config)


async def serve(config: RouterConfig) -> int:
    """Runs until SIGTERM/SIGINT; returns the process exit code."""
    address = format_address(config.host, config.port)
    metrics = RouterMetrics()
    try:
        trust = ReplicaTrust(config.replicas, config.replica_allow, config.replica_dns)
    except ValueError as e:
        print(f"router: {e}", file=sys.stderr, flush=True)
        return 2
    replicas = ReplicaSet(config.replicas, trust=trust)
    upstream = ReplicaClients(config.replica_tls.credentials() if config.replica_tls is not None else None,
                              config.replica_token, trust)
    cache_credentials = config.cache_tls.credentials() if config.cache_tls is not None else None
    cache = ShardedCache([CacheManagerClient(addr, cache_credentials, config.cache_token)
                          for addr in parse_shards(config.cache_addr)], metrics.cache_shards_missing.inc)
    try:
        core_config = CoreConfig(policy=config.policy, reserve_ms=config.reserve_ms,
                                 route_timeout_s=config.route_timeout_s)
    except ValueError as e:
        print(f"router: {e}", file=sys.stderr, flush=True)
        return 2
    core = RouterCore(core_config, replicas, upstream, cache, metrics)

    server = new_server(config.limits, server_interceptors(config.tokens, {SERVICE_NAME: METHOD_ROLES}))
    add_servicer(server, RouterServicer(core), model_pb2.DESCRIPTOR.services_by_name["ModelService"], id_error)
    health_servicer = add_health_and_reflection(server, SERVICE_NAME)
    await set_health(health_servicer, [SERVICE_NAME], NOT_SERVING)
    http: uvicorn.Server | None = None
    sock: socket.socket | None = None
    checks: asyncio.Task | None = None
    http_task: asyncio.Task | None = None

    async def create() -> tuple[grpc.aio.Server, int]:
        return server, add_port(server, address, config.tls.credentials() if config.tls is not None else None)

    def bound(port: int) -> None:
        nonlocal http, sock
        core_config.serving_addr = config.advertise_addr or format_address(config.host, port)
        if config.http_port is not None:
            from router.openai_api import build_app

            try:
                sock = _bind_http(config.host, config.http_port)
            except OSError as e:
                raise StartupError(f"cannot serve HTTP on port {config.http_port}: {e.strerror}") from e
            app = build_app(core, config.tokens, max_body_bytes=config.max_http_body_bytes)
            http = _http_server(app, sock, config.log_level, config.tls, config.grace_seconds)

    async def on_change(reachable: bool) -> None:
        await set_health(health_servicer, [SERVICE_NAME], SERVING if reachable else NOT_SERVING)
        log.info("router is %s", "SERVING" if reachable else "NOT_SERVING (no replica reachable)")

    async def started() -> None:
        nonlocal checks, http_task
        checks = asyncio.create_task(core.run_checks(config.check_interval_s, on_change))
        if http is not None and sock is not None:
            http_task = asyncio.create_task(http.serve(sockets=[sock]))
            scheme = "https" if config.tls is not None else "http"
            print(f"router OpenAI HTTP API on {scheme}://{format_address(config.host, sock.getsockname()[1])}/v1",
                  flush=True)

    async def stop_server(server: grpc.aio.Server, grace_seconds: float) -> None:
        if http is not None:
            http.should_exit = True  # stops accepting, lets in-flight requests finish (bounded)
        await server.stop(grace_seconds)

    async def stopped() -> None:
        if http_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(http_task, config.grace_seconds + 3)
        await cancel_and_wait(checks)
        await upstream.close()
        await cache.close()

    return await run_server(
        "router", log, address, create, health_servicer,
        lambda port: f"router ({config.policy}, cache manager {config.cache_addr}) listening on "
                     f"{format_address(config.host, port)}",
        hooks=ServerHooks(bound=bound, started=started, stop_server=stop_server, stopped=stopped),
        grace_seconds=config.grace_seconds, metrics=metrics, metrics_port=config.metrics_port,
        metrics_host=config.metrics_host, metrics_on_stdout=True, tokens=config.tokens,
        client_tokens=(config.cache_token, config.replica_token))
