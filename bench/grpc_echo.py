"""A bare grpc.aio echo server: the floor under the cache manager's `Step` latency (issue 12).

`python -m bench.grpc_echo --port 0` prints `listening on 127.0.0.1:PORT` and answers the unary
method `/bench.Echo/Echo` with the request's bytes, unparsed: no protobuf, no Python work beyond
grpc.aio's own. `bench.cache_bench` sends it each `Step` request's serialized bytes, interleaved
with the real `Step` calls, so both see the same payload and the same machine load.
"""

from __future__ import annotations

import argparse
import asyncio

import grpc

METHOD = "/bench.Echo/Echo"


async def _echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


async def serve(host: str, port: int) -> None:
    """Serve until cancelled; prints the bound address (the bench parses it)."""
    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(_echo)}
    )
    server.add_generic_rpc_handlers((handler,))
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    print(f"listening on {host}:{bound}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
