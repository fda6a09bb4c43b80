"""gRPC clients of the router: the replicas (one cached grpc.aio channel per address) and the
cache manager. They implement router.core's ReplicaPort and CachePort; every failure becomes an
UpstreamError carrying the status name.

With TLS, gRPC verifies each replica's certificate against the host dialled (never overridden
to a fixed name); an address a --replica-dns name resolved to is verified against that name
(router/trust.py). No channel is ever opened to an address the trust does not cover."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.auth import ClientToken
from common.security import open_aio_channel
from protos import cache_pb2, cache_pb2_grpc, model_pb2, model_pb2_grpc
from router import errors
from router.errors import UpstreamError
from router.route_stream import RouteStream
from router.trust import ReplicaTrust

log = logging.getLogger(__name__)

# Fail fast (no waitForReady), no gRPC retries (the router retries on other replicas itself), and
# reconnect quickly to a replica or cache manager that comes back (gRPC's default backoff grows
# to two minutes).
CHANNEL_OPTIONS: list[tuple[str, object]] = [
    ("grpc.enable_retries", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
]


def _error(error: grpc.aio.AioRpcError) -> UpstreamError:
    return UpstreamError(error.code().name, error.details() or "")


class ReplicaClients:
    """ModelService (and health) calls by replica address: TLS when credentials are given, the
    token (if any) on every call; with `trust`, only to the addresses it covers (defence in
    depth: the router's ReplicaSet holds no other)."""

    def __init__(self, credentials: grpc.ChannelCredentials | None = None, token: ClientToken | None = None,
                 trust: ReplicaTrust | None = None) -> None:
        self._channels: dict[tuple[str, str | None], grpc.aio.Channel] = {}
        self._credentials = credentials
        self.token = token if token is not None else ClientToken(None)
        self.trust = trust

    def _channel(self, addr: str) -> grpc.aio.Channel:
        if self.trust is not None and not self.trust.trusted(addr):
            raise UpstreamError(errors.UNAVAILABLE, f"{addr} is not a trusted replica address")
        name = self.trust.tls_name(addr) if self.trust is not None and self._credentials is not None else None
        channel = self._channels.get((addr, name))
        if channel is None:
            options = list(CHANNEL_OPTIONS)
            if name is not None:  # the --replica-dns name this IP came from, not a name the replica chose
                options.append(("grpc.ssl_target_name_override", name))
            channel = self._channels[(addr, name)] = open_aio_channel(addr, self._credentials, options)
        return channel

    def _stub(self, addr: str) -> model_pb2_grpc.ModelServiceStub:
        return model_pb2_grpc.ModelServiceStub(self._channel(addr))

    async def generate(self, addr: str, request: model_pb2.GenerateRequest,
                       timeout: float | None) -> AsyncIterator[model_pb2.GenerateResponse]:
        call = self._stub(addr).Generate(request, timeout=timeout, metadata=self.token.metadata)
        try:
            async for message in call:
                yield message
        except grpc.aio.AioRpcError as e:
            raise _error(e) from None
        finally:
            call.cancel()  # a no-op once the call is done; else the replica stops generating

    async def _unary(self, method, request, timeout: float | None):
        try:
            return await method(request, timeout=timeout, metadata=self.token.metadata)
        except grpc.aio.AioRpcError as e:
            raise _error(e) from None

    async def tokenize(self, addr: str, request: model_pb2.TokenizeRequest,
                       timeout: float | None) -> model_pb2.TokenizeResponse:
        return await self._unary(self._stub(addr).Tokenize, request, timeout)

    async def detokenize(self, addr: str, request: model_pb2.DetokenizeRequest,
                         timeout: float | None) -> model_pb2.DetokenizeResponse:
        return await self._unary(self._stub(addr).Detokenize, request, timeout)

    async def model_info(self, addr: str, timeout: float | None) -> model_pb2.ModelInfoResponse:
        return await self._unary(self._stub(addr).ModelInfo, model_pb2.ModelInfoRequest(), timeout)

    async def abort(self, addr: str, request: model_pb2.AbortRequest, timeout: float | None) -> model_pb2.AbortResponse:
        return await self._unary(self._stub(addr).Abort, request, timeout)

    async def get_load(self, addr: str, timeout: float | None) -> model_pb2.GetLoadResponse:
        return await self._unary(self._stub(addr).GetLoad, model_pb2.GetLoadRequest(), timeout)

    async def check(self, addr: str, timeout: float | None) -> bool:
        try:
            stub = health_pb2_grpc.HealthStub(self._channel(addr))
        except UpstreamError:
            return False
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            with contextlib.suppress(Exception):
                await channel.close()


class CacheManagerClient:
    def __init__(self, addr: str, credentials: grpc.ChannelCredentials | None = None,
                 token: ClientToken | None = None, route_stream: bool = True) -> None:
        """`route_stream`: Routes over one RouteStream (router/route_stream.py) rather than a unary
        call each; a cache manager without RouteStream gets unary calls from its first
        UNIMPLEMENTED on."""
        self.addr = addr
        self.token = token if token is not None else ClientToken(None)
        self._channel = open_aio_channel(addr, credentials, CHANNEL_OPTIONS)
        self._stub = cache_pb2_grpc.CacheManagerStub(self._channel)
        self.route_stream = route_stream
        self._stream: RouteStream | None = None

    async def route(self, request: cache_pb2.RouteRequest, timeout: float | None) -> cache_pb2.RouteResponse:
        if self.route_stream:
            stream = self._open_stream()
            try:
                return await stream.ask(request, timeout)
            except UpstreamError as e:
                if e.code == "UNIMPLEMENTED":
                    log.warning("the cache manager at %s has no RouteStream: unary Route calls from now on",
                                self.addr)
                    self.route_stream = False
                    await self._close_stream()
                elif not (e.code == "INTERNAL" and stream.failed is e and not stream.answered):
                    raise
                # Else a stream that failed before its first reply as INTERNAL: grpc's client says so
                # when a write races the refusal of a method an older cache manager lacks. This ask
                # goes as a call; the next opens a stream again (and learns UNIMPLEMENTED).
        try:
            return await self._stub.Route(request, timeout=timeout, metadata=self.token.metadata)
        except grpc.aio.AioRpcError as e:
            raise _error(e) from None

    def _open_stream(self) -> RouteStream:
        """The Route stream, opened anew when there is none, it failed, or the token was reloaded."""
        stream = self._stream
        if stream is None or stream.failed is not None or stream.metadata is not self.token.metadata:
            if stream is not None:
                asyncio.get_running_loop().create_task(stream.close())
            stream = self._stream = RouteStream(self._stub, self.token.metadata)
        return stream

    async def _close_stream(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await stream.close()

    async def stats(self, timeout: float | None) -> cache_pb2.StatsResponse:
        try:
            return await self._stub.Stats(cache_pb2.StatsRequest(), timeout=timeout, metadata=self.token.metadata)
        except grpc.aio.AioRpcError as e:
            raise _error(e) from None

    async def close(self) -> None:
        await self._close_stream()
        with contextlib.suppress(Exception):
            await self._channel.close()
