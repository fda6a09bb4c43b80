"""`python -m tests.older_cache_manager --without StepStream,RouteStream`: the real cache manager
(its servicer, its health service) with some methods hidden, as an older cache manager that lacks
them serves: calls of those get UNIMPLEMENTED. For the clients' fallback tests; prints the usual
'listening on HOST:PORT' line."""

from __future__ import annotations

import argparse
import asyncio

import grpc

from cache_service.pool_registry import PoolRegistry
from cache_service.servicer import SERVICE_NAME, CacheManagerServicer
from common.grpc_server import add_health_and_reflection, servicer_handler, set_health
from common.limits import id_error
from protos import cache_pb2


class Without(grpc.GenericRpcHandler):
    """A handler with `hidden` method names answered as unknown (None: UNIMPLEMENTED)."""

    def __init__(self, inner: grpc.GenericRpcHandler, hidden: set[str]) -> None:
        self.inner = inner
        self.hidden = hidden

    def service(self, details):
        return None if details.method.rpartition("/")[2] in self.hidden else self.inner.service(details)


async def serve(port: int, hidden: set[str]) -> None:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((Without(servicer_handler(
        CacheManagerServicer(PoolRegistry()), cache_pb2.DESCRIPTOR.services_by_name["CacheManager"], id_error),
        hidden),))
    health = add_health_and_reflection(server, SERVICE_NAME)
    await set_health(health, [SERVICE_NAME])
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"older cache manager listening on 127.0.0.1:{bound}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--without", required=True, help="comma-separated method names to hide")
    args = parser.parse_args()
    asyncio.run(serve(args.port, set(args.without.split(","))))


if __name__ == "__main__":
    main()
