"""common.grpc_server.end_call: a refused call ends with its status and keeps nothing alive.

context.abort raises; the raised error's traceback holds the handler's frames (the request in
them) in a reference cycle with gRPC aio's own frames, so a refused request's memory waited for a
full cycle collection, which the cache manager runs rarely (cache_service/collector.py). So no
servicer refuses by raising: it calls end_call and returns."""

from __future__ import annotations

import ast
import asyncio
import gc
from pathlib import Path

import grpc

from common.grpc_server import end_call

ROOT = Path(__file__).resolve().parents[2]
SERVER_PACKAGES = ("cache_service", "model_service", "router", "common")


async def _refuse(request: bytes, context: grpc.aio.ServicerContext) -> bytes | None:
    if len(request) > 1000:
        return end_call(context, grpc.StatusCode.INVALID_ARGUMENT, f"{len(request)} bytes is too many")
    return b"ok"


async def _stream_then_refuse(request: bytes, context: grpc.aio.ServicerContext):
    yield b"first"
    end_call(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "no more")


async def _serve_and_call() -> list[tuple[grpc.StatusCode, str | None]]:
    handler = grpc.method_handlers_generic_handler("radixkv.test.Refuser", {
        "Call": grpc.unary_unary_rpc_method_handler(_refuse),
        "Stream": grpc.unary_stream_rpc_method_handler(_stream_then_refuse),
    })
    server = grpc.aio.server(handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    outcomes = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/radixkv.test.Refuser/Call")
            assert await call(b"small", timeout=10) == b"ok"
            for _ in range(3):
                try:
                    await call(b"x" * 100_000, timeout=10)
                except grpc.aio.AioRpcError as error:
                    outcomes.append((error.code(), error.details()))
            stream = channel.unary_stream("/radixkv.test.Refuser/Stream")(b"", timeout=10)
            messages = []
            try:
                async for message in stream:
                    messages.append(message)
            except grpc.aio.AioRpcError as error:
                outcomes.append((error.code(), error.details()))
            assert messages == [b"first"]
    finally:
        await server.stop(None)
    return outcomes


def test_a_refused_call_gets_its_status_and_leaves_no_cycle_behind() -> None:
    gc.collect()
    outcomes = asyncio.run(_serve_and_call())
    assert outcomes == [(grpc.StatusCode.INVALID_ARGUMENT, "100000 bytes is too many")] * 3 + [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "no more")]
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        frames = [o.f_code.co_name for o in gc.garbage if type(o).__name__ == "frame"]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert "_refuse" not in frames and "_stream_then_refuse" not in frames, frames


def test_no_servicer_refuses_by_raising() -> None:
    """Every `context.abort(...)` in the servers' code, by file and line (there must be none)."""
    found = []
    for package in SERVER_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "abort"
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "context"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == [], f"use common.grpc_server.end_call and return instead of context.abort: {found}"
