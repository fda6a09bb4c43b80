"""`python -m tests.common.runner_app --port 0`: the smallest real server on common/server_runner.py,
for tests/common/test_server_runner.py.

It serves one raw-bytes method, ``/radixkv.test.Runner/Sleep`` (the request is a number of
seconds as ASCII; the answer ``b"slept"``), with health and reflection, and prints a ``hook NAME``
line from each run_server hook so the test can check their order. With ``--auth-token-file`` the
method needs a token with the client role (reread on SIGHUP, like the real servers).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import grpc
from prometheus_client import CollectorRegistry

from common.auth import TokenStore, server_interceptors
from common.grpc_server import add_health_and_reflection, format_address, new_server, set_health
from common.limits import ServerLimits
from common.metrics_server import MetricsServer, add_metrics_args
from common.parent_death import die_with_parent_if_asked
from common.security import add_port
from common.server_runner import ServerHooks, StartupError, run_server

NAME = "runner_app"
SERVICE_NAME = "radixkv.test.Runner"
FAIL_BOUND_EXIT_CODE = 3

log = logging.getLogger(__name__)


async def _sleep(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    await asyncio.sleep(float(request.decode()))
    return b"slept"


def _hook(name: str) -> None:
    print(f"hook {name}", flush=True)


async def serve(args: argparse.Namespace) -> int:
    tokens = TokenStore(args.auth_token_file) if args.auth_token_file is not None else None
    server = new_server(ServerLimits(), server_interceptors(tokens, {SERVICE_NAME: {"Sleep": "client"}}))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        SERVICE_NAME, {"Sleep": grpc.unary_unary_rpc_method_handler(_sleep)}),))
    health_servicer = add_health_and_reflection(server, SERVICE_NAME)
    address = format_address(args.host, args.port)

    async def create() -> tuple[grpc.aio.Server, int]:
        return server, add_port(server, address, None)

    def bound(port: int) -> None:
        _hook(f"bound {port}")
        if args.fail_bound:
            raise StartupError("the bound hook refused to go on", FAIL_BOUND_EXIT_CODE)

    async def starting() -> None:
        _hook("starting")

    async def started() -> None:
        await set_health(health_servicer, [SERVICE_NAME])
        _hook("started")

    async def stopping() -> None:
        _hook("stopping")
        await asyncio.sleep(args.stopping_pause)  # health still SERVING: the test checks it meanwhile

    async def stop_server(grpc_server: grpc.aio.Server, grace_seconds: float) -> None:
        # Health already says NOT_SERVING here; the pause lets the test see it before the port closes.
        _hook("stop_server")
        await asyncio.sleep(args.drain_pause)
        await grpc_server.stop(grace_seconds)

    async def stopped() -> None:
        _hook("stopped")

    return await run_server(
        NAME, log, address, create, health_servicer,
        lambda port: f"{NAME} listening on {format_address(args.host, port)}",
        hooks=ServerHooks(bound=bound, starting=starting, started=started, stopping=stopping,
                          stop_server=stop_server, stopped=stopped),
        grace_seconds=args.grace_seconds, metrics=MetricsServer(CollectorRegistry()),
        metrics_port=args.metrics_port, metrics_host=args.metrics_host, tokens=tokens)


def main(argv: list[str] | None = None) -> int:
    die_with_parent_if_asked()
    parser = argparse.ArgumentParser(prog="python -m tests.common.runner_app")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--grace-seconds", type=float, default=5.0)
    parser.add_argument("--drain-pause", type=float, default=0.0)
    parser.add_argument("--stopping-pause", type=float, default=0.0)
    parser.add_argument("--auth-token-file", default=None)
    parser.add_argument("--fail-bound", action="store_true")
    add_metrics_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
