"""The life of every radixkv gRPC server process, in one place: bind, metrics, signals, serve,
drain, stop.

The cache manager, the model service and the router build their own parts (servicers, engine,
HTTP door, background tasks) and hand `run_server` what differs as hooks; the order of the steps,
the lines they print, the exit codes and the graceful stop are then the same for all three:

1. `create()` builds the gRPC server and binds its port. RuntimeError (the port cannot be bound)
   prints ``NAME: cannot listen on ADDRESS (port in use?): ...`` on stderr; exit code 1.
2. `bound(port)`: whatever needs the bound port (the advertised address, another listening
   socket); a StartupError prints ``NAME: MESSAGE`` on stderr and ends with its exit code.
3. The /metrics endpoint on `metrics_host:metrics_port` (when a port is given); a failed bind
   prints ``NAME: cannot serve metrics on HOST:PORT: ...`` on stderr; exit code 1.
4. SIGTERM and SIGINT ask for the graceful stop; SIGHUP rereads the token files.
5. `starting()`, `server.start()`, `started()`, then the ``listening on`` line on stdout that
   launchers and tests wait for (scripts/service_process.py), until a stop signal.
6. On stop (also when a step of 5 raised): `stopping()`; health goes NOT_SERVING (new calls
   are refused); `stop_server(server, grace)` (default ``server.stop(grace)``: in-flight calls
   get the grace period); `stopped()`; the metrics endpoint closes. Exit code 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health

from common.auth import ClientToken, TokenStore, reload_on_sighup
from common.grpc_server import DEFAULT_GRACE_SECONDS, format_address
from common.metrics_server import DEFAULT_METRICS_HOST, MetricsServer

Hook = Callable[[], Awaitable[None]]


class StartupError(Exception):
    """A start-up step failed: run_server prints ``NAME: message`` and returns `exit_code`."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancels a background task (None: nothing) and waits until it has ended."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _stop_grpc(server: grpc.aio.Server, grace_seconds: float) -> None:
    await server.stop(grace_seconds)


@dataclass(slots=True)
class ServerHooks:
    """The server-specific steps, in the order run_server calls them; each is optional.

    bound: the bound gRPC port, before the metrics endpoint; may raise StartupError.
    starting: just before the gRPC server starts (background tasks, the engine's thread).
    started: after it started, before the ``listening on`` line (health SERVING, more doors).
    stopping: on stop, while health still says SERVING (work that must not run during drain).
    stop_server: stops the gRPC server with the grace period (default: ``server.stop(grace)``).
    stopped: after the gRPC server stopped (close clients, files, other doors).
    """

    bound: Callable[[int], None] | None = None
    starting: Hook | None = None
    started: Hook | None = None
    stopping: Hook | None = None
    stop_server: Callable[[grpc.aio.Server, float], Awaitable[None]] = _stop_grpc
    stopped: Hook | None = None


async def run_server(
    name: str,
    log: logging.Logger,
    address: str,
    create: Callable[[], Awaitable[tuple[grpc.aio.Server, int]]],
    health_servicer: health.aio.HealthServicer,
    listening: Callable[[int], str],
    *,
    hooks: ServerHooks | None = None,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    metrics: MetricsServer | None = None,
    metrics_port: int | None = None,
    metrics_host: str = DEFAULT_METRICS_HOST,
    metrics_on_stdout: bool = False,
    tokens: TokenStore | None = None,
    client_tokens: Sequence[ClientToken] = (),
) -> int:
    """Runs one server process's gRPC server until SIGTERM/SIGINT; returns the exit code.

    `name`: the prefix of its error lines (``cache_service``). `log`: the server module's logger
    (its records keep their logger name). `address`: what `create()` binds, as printed in the
    bind error. `listening(port)`: the line printed once serving (it must contain
    ``listening on HOST:PORT``). `metrics`: served when `metrics_port` is given, closed at the
    end; its address is logged (printed on stdout with `metrics_on_stdout`). `tokens`,
    `client_tokens`: the token files SIGHUP rereads. Call from inside the event loop
    (asyncio.run).
    """
    hooks = hooks if hooks is not None else ServerHooks()
    try:
        server, port = await create()
    except RuntimeError as err:
        print(f"{name}: cannot listen on {address} (port in use?): {err}", file=sys.stderr, flush=True)
        return 1
    try:
        if hooks.bound is not None:
            hooks.bound(port)
    except StartupError as err:
        print(f"{name}: {err.message}", file=sys.stderr, flush=True)
        return err.exit_code
    if metrics is not None and metrics_port is not None:
        try:
            metrics_bound = metrics.serve(metrics_port, metrics_host)  # not the gRPC host: private by default
        except OSError as err:
            print(f"{name}: cannot serve metrics on {format_address(metrics_host, metrics_port)}: "
                  f"{err.strerror or err}", file=sys.stderr, flush=True)
            return 1
        url = f"http://{format_address(metrics_host, metrics_bound)}/metrics"
        if metrics_on_stdout:
            print(f"{name} metrics on {url}", flush=True)
        else:
            log.info("metrics on %s", url)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reload_on_sighup(loop, tokens, *client_tokens)
    if hooks.starting is not None:
        await hooks.starting()
    try:
        await server.start()
        if hooks.started is not None:
            await hooks.started()
        print(listening(port), flush=True)
        await stop.wait()
        log.info("shutting down")
    finally:
        if hooks.stopping is not None:
            await hooks.stopping()
        await health_servicer.enter_graceful_shutdown()
        await hooks.stop_server(server, grace_seconds)
        if hooks.stopped is not None:
            await hooks.stopped()
        if metrics is not None:
            metrics.stop()
    return 0
