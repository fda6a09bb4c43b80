"""``RadixKVClient``: the blocking Python client."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Unpack

import grpc
from google.protobuf.message import Message

from common.shards import parse_shards
from protos import cache_pb2, cache_pb2_grpc, model_pb2, model_pb2_grpc

from .channel import DEFAULT_RETRY, ClientSettings, RetryPolicy, open_channel
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

DEFAULT_MODEL_ADDR = "127.0.0.1:50052"
DEFAULT_CACHE_ADDR = "127.0.0.1:50051"


class RadixKVClient:
    """Blocking client of the model service (and, for ``stats()``, the cache service).

    >>> with RadixKVClient("127.0.0.1:50052") as client:
    ...     print(client.generate("The capital of France is", max_tokens=8, temperature=0).text)

    Args:
        addr: model service ``host:port``.
        cache_addr: cache service ``host:port`` for ``stats()``; None asks the model service
            where its cache service is (``ModelInfo.cache_addr``).
        timeout: default per-call timeout in seconds (None: no deadline). Every method also
            takes ``timeout=``. A call that runs out fails with ``DEADLINE_EXCEEDED``.
        retry: gRPC retry policy for UNAVAILABLE (None disables retries).
        wait_for_ready: calls wait for an unreachable server (up to their timeout) instead of
            failing fast with UNAVAILABLE.
        tls: use TLS (system roots unless ``root_certificates`` is given).
        root_certificates: PEM bytes or a PEM file path; implies TLS.
        token: sent as ``authorization: Bearer <token>`` metadata on every call.
        client_cert, client_key: this client's certificate and its key (PEM bytes or file
            paths, both or neither; imply TLS), for servers that require mutual TLS.

    Every failed call raises ``RadixKVError`` (``.code``, ``.message``).
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
        self._channel = open_channel(self.settings, addr)
        self._model = model_pb2_grpc.ModelServiceStub(self._channel)
        self._cache_channels: list[grpc.Channel] = []
        self._caches: list[cache_pb2_grpc.CacheManagerStub] = []  # one per cache-manager shard

    # ------------------------------------------------------------------ generation

    def generate(
        self, prompt: str | None = None, *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> GenerateResult:
        """Generates a completion and returns it whole (see ``GenerateOptions``); one choice
        (``n`` > 1 is ``generate_choices()``'s)."""
        single_choice(options)
        return GenerateResult.from_chunks(list(self.stream(prompt, timeout=timeout, **options)))

    def generate_choices(
        self, prompt: str | None = None, *, n: int, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> list[GenerateResult]:
        """Generates ``n`` completions of one prompt in one request (the prompt computed once,
        the choices forked from it) and returns them in ``index`` order, each with its own
        ``finish_reason`` and ``usage``. With ``seed`` s, choice i is what ``generate()`` with
        seed s + i gives."""
        options["n"] = n
        return choices_from_chunks(list(self.stream(prompt, timeout=timeout, **options)))

    def stream(
        self, prompt: str | None = None, *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> Iterator[GenerateChunk]:
        """Yields the completion chunk by chunk as the server produces it.

        ``timeout`` bounds the whole stream. Stopping the iteration early (``break``,
        ``close()``) cancels the request on the server.
        """
        request = generate_request(prompt, options)
        timeout = self.settings.call_timeout(timeout)
        call = self._model.Generate(request, timeout=timeout, metadata=self.settings.metadata())
        return _chunks(call, timeout)

    # ------------------------------------------------------------------ other RPCs

    def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Sequence[ChatMessage] | None = None,
        timeout: float | None = None,
    ) -> TokenizeResult:
        """Token ids (and token strings) of ``text`` or of chat ``messages``, as Generate sees them."""
        response = self._unary(self._model.Tokenize, tokenize_request(text, messages), "Tokenize", timeout)
        return TokenizeResult(token_ids=list(response.token_ids), tokens=list(response.tokens))

    def detokenize(self, token_ids: Sequence[int], *, timeout: float | None = None) -> str:
        """The text of ``token_ids`` as the model's tokenizer decodes them (special tokens
        included): ``detokenize(tokenize(text).token_ids)`` gives ``text`` back.
        INVALID_ARGUMENT for an id outside the vocabulary."""
        request = model_pb2.DetokenizeRequest(token_ids=list(token_ids))
        return self._unary(self._model.Detokenize, request, "Detokenize", timeout).text

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """The served model and its KV pool."""
        response = self._unary(self._model.ModelInfo, model_pb2.ModelInfoRequest(), "ModelInfo", timeout)
        return from_proto(ModelInfo, response)

    def abort(self, request_id: str, *, timeout: float | None = None) -> None:
        """Ends the live request ``request_id``, whoever opened it: its stream ends with
        finish_reason "abort" (and usage). ``NOT_FOUND`` for an unknown or finished id."""
        self._unary(self._model.Abort, model_pb2.AbortRequest(request_id=request_id), "Abort", timeout)

    def get_load(self, *, timeout: float | None = None) -> Load:
        """The replica's load now: running and waiting requests, KV usage, prefix hit rate."""
        response = self._unary(self._model.GetLoad, model_pb2.GetLoadRequest(), "GetLoad", timeout)
        return from_proto(Load, response)

    def stats(self, pool_id: str = "", *, timeout: float | None = None) -> list[PoolStats]:
        """The cache service's per-pool block accounting, hit rate and evictions. With several
        cache-manager shards (`cache_addr` "host:port,host:port"), every shard's pools; a `pool_id`
        is looked for on each (NOT_FOUND only when no shard has it)."""
        request = cache_pb2.StatsRequest(pool_id=pool_id)
        answers: list[cache_pb2.StatsResponse | RadixKVError] = []
        for stub in self._cache_stubs(timeout):
            try:
                answers.append(self._unary(stub.Stats, request, "Stats", timeout))
            except RadixKVError as error:
                answers.append(error)
        return shard_pool_stats(answers, pool_id)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Closes the channels (pending calls are cancelled)."""
        self._channel.close()
        for channel in self._cache_channels:
            channel.close()

    def __enter__(self) -> RadixKVClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers

    def _unary(self, method: Callable[..., Any], request: Message, name: str, timeout: float | None) -> Any:
        timeout = self.settings.call_timeout(timeout)
        try:
            return method(request, timeout=timeout, metadata=self.settings.metadata())
        except grpc.RpcError as error:
            raise RadixKVError.from_rpc_error(error, name, timeout) from None

    def _cache_stubs(self, timeout: float | None) -> list[cache_pb2_grpc.CacheManagerStub]:
        if not self._caches:
            spec = self.settings.cache_addr or self.model_info(timeout=timeout).cache_addr
            self._cache_channels = [open_channel(self.settings, addr) for addr in parse_shards(spec)]
            self._caches = [cache_pb2_grpc.CacheManagerStub(channel) for channel in self._cache_channels]
        return self._caches


def _chunks(call: grpc.Call, timeout: float | None) -> Iterator[GenerateChunk]:
    try:
        for message in call:
            yield GenerateChunk.from_proto(message)
    except grpc.RpcError as error:
        raise RadixKVError.from_rpc_error(error, "Generate", timeout) from None
    finally:
        call.cancel()  # a no-op once the stream ended; stops the server when we stop early
