"""``AsyncRadixKVClient``: the asyncio (grpc.aio) Python client."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, Unpack

import grpc
from google.protobuf.message import Message

from common.shards import parse_shards
from protos import cache_pb2, cache_pb2_grpc, model_pb2, model_pb2_grpc

from .channel import DEFAULT_RETRY, ClientSettings, RetryPolicy, open_aio_channel
from .errors import RadixKVError
from .messages import ChatMessage, GenerateOptions, generate_request, single_choice, tokenize_request
from .results import (
    GenerateChunk,
    GenerateResult,
    Load,
    ModelInfo,
    PoolStats,
    TokenizeResult,
    choices_from_chunks,
    from_proto,
    shard_pool_stats,
)
from .sync import DEFAULT_MODEL_ADDR


class AsyncRadixKVClient:
    """The asyncio twin of ``RadixKVClient`` (same arguments, same results, awaitable).

    Create it inside the running event loop:

    >>> async with AsyncRadixKVClient("127.0.0.1:50052") as client:
    ...     async for chunk in client.stream("Once upon a time", max_tokens=32):
    ...         print(chunk.text, end="", flush=True)
    """

    def __init__(
        self,
        addr: str = DEFAULT_MODEL_ADDR,
        *,
        cache_addr: str | None = None,
        timeout: float | None = None,
        retry: RetryPolicy | None = DEFAULT_RETRY,
        wait_for_ready: bool = False,
        tls: bool = False,
        root_certificates: bytes | str | Path | None = None,
        token: str | None = None,
        client_cert: bytes | str | Path | None = None,
        client_key: bytes | str | Path | None = None,
    ) -> None:
        self.settings = ClientSettings(
            addr, cache_addr, timeout, retry, wait_for_ready, tls, root_certificates, token, client_cert, client_key
        )
        self._channel = open_aio_channel(self.settings, addr)
        self._model = model_pb2_grpc.ModelServiceStub(self._channel)
        self._cache_channels: list[grpc.aio.Channel] = []
        self._caches: list[cache_pb2_grpc.CacheManagerStub] = []  # one per cache-manager shard

    async def generate(
        self, prompt: str | None = None, *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> GenerateResult:
        """Generates a completion and returns it whole (see ``GenerateOptions``); one choice
        (``n`` > 1 is ``generate_choices()``'s)."""
        single_choice(options)
        chunks = [chunk async for chunk in self.stream(prompt, timeout=timeout, **options)]
        return GenerateResult.from_chunks(chunks)

    async def generate_choices(
        self, prompt: str | None = None, *, n: int, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> list[GenerateResult]:
        """``n`` completions of one prompt in one request, in ``index`` order (see
        ``RadixKVClient.generate_choices``)."""
        options["n"] = n
        chunks = [chunk async for chunk in self.stream(prompt, timeout=timeout, **options)]
        return choices_from_chunks(chunks)

    def stream(
        self, prompt: str | None = None, *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> AsyncIterator[GenerateChunk]:
        """Yields the completion chunk by chunk; ``timeout`` bounds the whole stream.

        Leaving the ``async for`` early cancels the request on the server.
        """
        request = generate_request(prompt, options)
        timeout = self.settings.call_timeout(timeout)
        call = self._model.Generate(request, timeout=timeout, metadata=self.settings.metadata())
        return _chunks(call, timeout)

    async def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Sequence[ChatMessage] | None = None,
        timeout: float | None = None,
    ) -> TokenizeResult:
        """Token ids (and token strings) of ``text`` or of chat ``messages``."""
        request = tokenize_request(text, messages)
        response = await self._unary(self._model.Tokenize, request, "Tokenize", timeout)
        return TokenizeResult(token_ids=list(response.token_ids), tokens=list(response.tokens))

    async def detokenize(self, token_ids: Sequence[int], *, timeout: float | None = None) -> str:
        """The text of ``token_ids`` as the model's tokenizer decodes them (special tokens
        included). INVALID_ARGUMENT for an id outside the vocabulary."""
        request = model_pb2.DetokenizeRequest(token_ids=list(token_ids))
        return (await self._unary(self._model.Detokenize, request, "Detokenize", timeout)).text

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """The served model and its KV pool."""
        response = await self._unary(
            self._model.ModelInfo, model_pb2.ModelInfoRequest(), "ModelInfo", timeout
        )
        return from_proto(ModelInfo, response)

    async def abort(self, request_id: str, *, timeout: float | None = None) -> None:
        """Ends the live request ``request_id``, whoever opened it (see ``RadixKVClient.abort``)."""
        await self._unary(self._model.Abort, model_pb2.AbortRequest(request_id=request_id), "Abort", timeout)

    async def get_load(self, *, timeout: float | None = None) -> Load:
        """The replica's load now: running and waiting requests, KV usage, prefix hit rate."""
        response = await self._unary(self._model.GetLoad, model_pb2.GetLoadRequest(), "GetLoad", timeout)
        return from_proto(Load, response)

    async def stats(self, pool_id: str = "", *, timeout: float | None = None) -> list[PoolStats]:
        """The cache service's per-pool block accounting, hit rate and evictions. With several
        cache-manager shards (`cache_addr` "host:port,host:port"), every shard's pools; a `pool_id`
        is looked for on each (NOT_FOUND only when no shard has it)."""
        request = cache_pb2.StatsRequest(pool_id=pool_id)
        answers: list[cache_pb2.StatsResponse | RadixKVError] = []
        for stub in await self._cache_stubs(timeout):
            try:
                answers.append(await self._unary(stub.Stats, request, "Stats", timeout))
            except RadixKVError as error:
                answers.append(error)
        return shard_pool_stats(answers, pool_id)

    async def close(self) -> None:
        """Closes the channels (pending calls are cancelled)."""
        await self._channel.close()
        for channel in self._cache_channels:
            await channel.close()

    async def __aenter__(self) -> AsyncRadixKVClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _unary(
        self, method: Callable[..., Any], request: Message, name: str, timeout: float | None
    ) -> Any:
        timeout = self.settings.call_timeout(timeout)
        try:
            return await method(request, timeout=timeout, metadata=self.settings.metadata())
        except grpc.RpcError as error:
            raise RadixKVError.from_rpc_error(error, name, timeout) from None

    async def _cache_stubs(self, timeout: float | None) -> list[cache_pb2_grpc.CacheManagerStub]:
        if not self._caches:
            spec = self.settings.cache_addr or (await self.model_info(timeout=timeout)).cache_addr
            self._cache_channels = [open_aio_channel(self.settings, addr) for addr in parse_shards(spec)]
            self._caches = [cache_pb2_grpc.CacheManagerStub(channel) for channel in self._cache_channels]
        return self._caches


async def _chunks(call: grpc.aio.UnaryStreamCall, timeout: float | None) -> AsyncIterator[GenerateChunk]:
    try:
        async for message in call:
            yield GenerateChunk.from_proto(message)
    except grpc.RpcError as error:
        raise RadixKVError.from_rpc_error(error, "Generate", timeout) from None
    finally:
        call.cancel()  # a no-op once the stream ended; stops the server when we stop early
