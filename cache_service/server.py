"""The grpc.aio server: CacheManager + standard health + reflection, leases, graceful stop."""

from __future__ import annotations

import asyncio
import logging
import sys

import grpc
from grpc_health.v1 import health

from cache_service import native
from cache_service.collector import keep_full_collections_rare
from cache_service.durable import DEFAULT_FSYNC_SECONDS, DEFAULT_SNAPSHOT_BYTES, DurableState
from cache_service.events import DEFAULT_BUFFER_BYTES, EventLog
from cache_service.metrics import Metrics
from cache_service.open_streams import OpenStreams
from cache_service.peer_pulls import DEFAULT_PIN_SECONDS
from cache_service.pool_registry import DEFAULT_MAX_PINNED_FRACTION, PoolRegistry
from cache_service.registry_limits import RegistryLimits
from cache_service.servicer import METHOD_ROLES, SERVICE_NAME, CacheManagerServicer
from cache_service.stream_slots import DEFAULT_MAX_WATCH_STREAMS
from cache_service.watch import follow_token_namespaces
from common.auth import TokenStore, server_interceptors
from common.grpc_server import add_health_and_reflection, add_servicer, format_address, new_server, set_health
from common.limits import ServerLimits, id_error
from common.metrics_server import DEFAULT_METRICS_HOST
from common.security import ServerTLS, add_port
from common.server_runner import ServerHooks, cancel_and_wait, run_server
from protos import cache_pb2

log = logging.getLogger(__name__)


async def create_server(
    address: str,
    registry: PoolRegistry | None = None,
    metrics: Metrics | None = None,
    health_servicer: health.aio.HealthServicer | None = None,
    watch_queue_size: int = 65536,
    credentials: grpc.ServerCredentials | None = None,
    tokens: TokenStore | None = None,
    limits: ServerLimits | None = None,
    durable: DurableState | None = None,
    worker_san_check: bool = False,
    max_watch_streams: int = DEFAULT_MAX_WATCH_STREAMS,
    streams: OpenStreams | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Build (not start) a server bound to `address`; returns it and the bound port.

    Port 0 picks a free port. `credentials`: TLS (plaintext when None); `tokens`: require a
    bearer token with the method's role (common/auth.py) on every call but health.
    `worker_san_check` (mutual TLS only): RegisterPool's worker id must be a DNS or URI subject
    alternative name of the client's certificate. `streams`: where the servicer keeps its open
    StepStream / RouteStream calls (stop_with_streams ends them). Raises RuntimeError when the address cannot be bound (in use).
    Call from inside a running event loop.
    """
    registry = registry if registry is not None else PoolRegistry()
    health_servicer = health_servicer if health_servicer is not None else health.aio.HealthServicer()
    # Transport limits (common/limits.py): a Step of a big batch of long prompts can exceed
    # gRPC's default 4 MiB request limit, so the default is 64 MiB. Requests are parsed in the
    # handler: bytes that are not the message, or ids over MAX_ID_BYTES, are INVALID_ARGUMENT.
    server = new_server(limits or ServerLimits(), server_interceptors(tokens, {SERVICE_NAME: METHOD_ROLES}))
    servicer = CacheManagerServicer(registry, metrics, watch_queue_size, durable, worker_san_check,
                                    max_watch_streams=max_watch_streams, streams=streams)
    if tokens is not None:  # number the views of ns= tokens (after a durable recovery: it replays them)
        follow_token_namespaces(registry.events, tokens, durable)
    add_servicer(server, servicer, cache_pb2.DESCRIPTOR.services_by_name["CacheManager"], id_error)
    add_health_and_reflection(server, SERVICE_NAME, health_servicer)
    await set_health(health_servicer, [SERVICE_NAME])
    port = add_port(server, address, credentials)
    return server, port


async def stop_with_streams(server: grpc.aio.Server, grace_seconds: float, streams: OpenStreams) -> None:
    """server.stop(grace), the open streams ended at once once new calls are refused (they never
    finish by themselves: each would hold the stop for the whole grace period)."""
    stopping = asyncio.get_running_loop().create_task(server.stop(grace_seconds))
    await asyncio.sleep(0)  # stop() runs up to its first wait: new calls are refused from here
    streams.end_all()
    await stopping


async def expire_leases_forever(registry: PoolRegistry, interval: float) -> None:
    """Background task: retire pools whose lease ran out."""
    while True:
        await asyncio.sleep(interval)
        for pool_id in registry.expire_leases():
            log.warning("lease expired pool=%s: its requests and cached blocks were reclaimed", pool_id)
        registry.expire_routed()  # reservation pins end on time even when nobody routes


async def serve(
    host: str = "127.0.0.1",
    port: int = 50051,
    lease_seconds: float = 30.0,
    metrics_port: int | None = None,
    grace_seconds: float = 2.0,
    event_buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    tls: ServerTLS | None = None,
    tokens: TokenStore | None = None,
    limits: ServerLimits | None = None,
    state_dir: str | None = None,
    snapshot_bytes: int = DEFAULT_SNAPSHOT_BYTES,
    fsync_seconds: float = DEFAULT_FSYNC_SECONDS,
    metrics_host: str = DEFAULT_METRICS_HOST,
    max_pinned_fraction: float = DEFAULT_MAX_PINNED_FRACTION,
    registry_limits: RegistryLimits | None = None,
    worker_san_check: bool = True,
    max_watch_streams: int = DEFAULT_MAX_WATCH_STREAMS,
    peer_pulls: bool = True,
    pull_pin_seconds: float = DEFAULT_PIN_SECONDS,
) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit code.

    `state_dir`: durable mode (cache_service/durable/): rebuild every pool from it first, then
    journal every applied change there. `registry_limits`: caps on pools and their memory (None:
    the defaults). `peer_pulls`: broker pulls between replicas, each
    pinning its pages for at most `pull_pin_seconds`.
    `worker_san_check`: with mutual TLS (`tls.client_ca`), bind worker ids to
    the client certificates' subject alternative names.
    """
    registry_limits = registry_limits if registry_limits is not None else RegistryLimits()
    worker_san_check = worker_san_check and tls is not None and tls.client_ca is not None
    registry = PoolRegistry(lease_seconds=lease_seconds, events=EventLog(max_bytes=event_buffer_bytes),
                            max_pinned_fraction=max_pinned_fraction, limits=registry_limits)
    registry.peer_pulls = peer_pulls
    registry.pull_pin_seconds = pull_pin_seconds
    durable = None
    if state_dir is not None:
        durable = DurableState(state_dir, registry, snapshot_bytes, fsync_seconds)
        try:
            durable.recover()
        except (RuntimeError, OSError) as err:
            print(f"cache_service: cannot use state dir {state_dir}: {err}", file=sys.stderr, flush=True)
            return 1
    metrics = Metrics(registry, durable) if metrics_port is not None else None
    health_servicer = health.aio.HealthServicer()
    streams = OpenStreams()
    expiry: asyncio.Task | None = None
    syncer: asyncio.Task | None = None
    collector: asyncio.Task | None = None

    async def starting() -> None:
        nonlocal expiry, syncer, collector
        expiry = asyncio.create_task(expire_leases_forever(registry, min(0.25, lease_seconds / 4)))
        syncer = asyncio.create_task(durable.sync_forever()) if durable is not None else None
        collector = asyncio.create_task(keep_full_collections_rare())

    async def started() -> None:
        log.info("lease_seconds=%s tls=%s auth=%s worker_san_check=%s max_pools=%d max_pools_per_principal=%d "
                 "max_cache_memory_mib=%d", lease_seconds,
                 "off" if tls is None else "mutual" if tls.client_ca else "on",
                 "off" if tokens is None else f"{len(tokens)} tokens", "on" if worker_san_check else "off",
                 registry_limits.max_pools, registry_limits.max_pools_per_owner,
                 registry_limits.max_memory_bytes >> 20)
        reason = native.unavailable_reason()
        log.info("block allocator and page index: %s", "C core" if reason is None else f"Python code (C core {reason})")

    async def stopping() -> None:  # no lease runs out while the server drains
        await cancel_and_wait(expiry)
        await cancel_and_wait(collector)

    async def stopped() -> None:  # the journal kept syncing what the drained calls applied
        await cancel_and_wait(syncer)
        if durable is not None:
            durable.close()

    address = format_address(host, port)
    return await run_server(
        "cache_service", log, address,
        lambda: create_server(address, registry, metrics, health_servicer,
                              credentials=tls.credentials() if tls is not None else None, tokens=tokens,
                              limits=limits, durable=durable, worker_san_check=worker_san_check,
                              max_watch_streams=max_watch_streams, streams=streams),
        health_servicer, lambda bound: f"cache_service listening on {format_address(host, bound)}",
        hooks=ServerHooks(starting=starting, started=started, stopping=stopping, stopped=stopped,
                          stop_server=lambda server, grace: stop_with_streams(server, grace, streams)),
        grace_seconds=grace_seconds, metrics=metrics, metrics_port=metrics_port, metrics_host=metrics_host,
        tokens=tokens)

