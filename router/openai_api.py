"""OpenAI-compatible HTTP door of the router (FastAPI): /v1/completions, /v1/chat/completions
(both also as server-sent events with ``stream: true``), /v1/models, vLLM's /tokenize and
/detokenize, /health, /metrics.

The translation is pure (router/openai_protocol.py: request JSON -> GenerateRequest,
GenerateResponse messages -> OpenAI JSON), and the handlers call the same RouterCore methods
the gRPC servicer does.

Bodies are parsed with pydantic models (router/openai_models.py: strict types and ranges);
the translation (router/openai_protocol.py) adds what types cannot say. Parameters:
max_tokens (chat: max_completion_tokens first), temperature, top_p, seed, stop (a string or a
list), presence_penalty and frequency_penalty ([-2, 2]), logit_bias (token id strings ->
[-100, 100]), n (1-64 choices, forked from one prefill by the replica; seeded choice i samples
with seed + i), completions' best_of (n-64, not with stream: best_of choices ranked by
cumulative log probability, the n best returned), echo (the prompt's text before each
choice's; with logprobs its tokens first, the first scoring nothing; max_tokens 0 with echo
returns the prompt alone: one token is generated and dropped); the extensions vLLM also
takes: top_k, ignore_eos, stop_token_ids, repetition_penalty (> 0), min_tokens (<=
max_tokens), min_p ([0, 1]), prompt_logprobs (0-20, not with stream; vLLM's format: per choice
in completions, on the response in chat) and ``cache_salt`` (the request's cache namespace:
prefixes are never shared across salts). Each is checked here (a 400 naming it) and passed to
the replica in SamplingParams.
Completions take a prompt as a string, a list of strings, a list of token ids or a list of
token-id lists (at most 1024 prompts): one Generate per prompt, all at once (request ids
``ID-0``, ``ID-1`` ... when several), choices numbered prompt-major (prompt * n + choice, as
vLLM); streams interleave their chunks, each with its index. Usage counts each prompt once and
every choice's completion tokens (best_of's too); cached_tokens is each prompt's first
choice's. ``stream_options``: include_usage (a last chunk with the usage), and vLLM's
continuous_usage_stats (with include_usage: every chunk carries the usage so far of its
choice; the prompt's length is asked of Tokenize first).
Output formats (``response_format`` json_object / json_schema, vLLM's ``structured_outputs`` and
``guided_*``: router/structured_formats.py) and chat ``tools`` / ``tool_choice``
(router/tool_calls.py; calls come back as ``tool_calls``) are enforced by the replica
(docs/structured-outputs.md). Log probabilities: completions ``logprobs: k``, chat ``logprobs:
true`` with ``top_logprobs: k`` (k <= 20), in streams too. ``suffix`` and non-text content are
a 400.
Any other field (a misspelling, another server's
extension, OpenAI's ``user``) is accepted as vLLM accepts it, but never silently: the response
lists it in ``X-Ignored-Fields`` and the router logs a warning (router/ignored_fields.py).
Completions default to max_tokens 16 as OpenAI's do; chat defaults to the model service's (128,
capped by the context). An ``X-Request-Id`` header sets the request id (for Abort over gRPC,
with the same token: ids are the token's own); responses echo it. A token limited to namespaces
(``ns=``) may only use those as ``cache_salt`` (else 403).

Bodies: at most --max-http-body-mb (default 16 MiB; 413 ``request_too_large``, the connection
closed, at once when Content-Length says so), JSON objects at most 64 levels deep with at most
100,000 arrays and objects, no NaN / Infinity (router/http_body.py); any of that, a number out
of its field's range or a lone surrogate is a 400, never a 500.

With the router's --auth-token-file, every path but /health needs ``Authorization: Bearer TOKEN``
(a token of that file with the ``client`` role): 401 when missing or unknown, 403 without the
role, both as OpenAI error JSON (code ``invalid_api_key`` / ``permission_denied``). /health is
open (200 ``{"status": "ok"}``, 503 when no replica is reachable) but its details (the replicas'
addresses, the cache manager's state) need such a token; without a token file the whole door,
details included, is open.

Streams send one chunk per replica message that carries tokens (vLLM's one event per token
step), with the text complete so far ("" while a multi-byte character is incomplete); the
finish reason rides on each choice's last token's chunk; chat streams open with one role chunk
per choice; with ``stream_options.include_usage`` a last chunk holds the usage and no choices.

/tokenize takes vLLM's ``{"model"?, "prompt" | "messages", "add_special_tokens"?,
"add_generation_prompt"?, "return_token_strs"?}`` and answers ``{"count", "max_model_len",
"tokens", "token_strs"}``; /detokenize takes ``{"model"?, "tokens"}`` and answers
``{"prompt"}`` (special tokens included, so the two round-trip).

Errors are OpenAI's JSON ``{"error": {"message", "type", "param", "code"}}``: 400 invalid, 404
unknown model or path, 429 replica queue full, 503 no replica, 504 deadline, 500 otherwise. Once
a stream has started, an error arrives as one ``data: {"error": ...}`` event before ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from common.auth import UNAUTHENTICATED, AuthError, Principal, TokenStore, bearer_token
from protos import model_pb2
from router.core import RouterCore
from router.door_gate import DoorGate
from router.errors import RouterError
from router.http_body import (
    DEFAULT_MAX_BODY_BYTES,
    BodyError,
    check_content_length,
    parse_object,
    read_limited,
)
from router.ignored_fields import HEADER as IGNORED_HEADER
from router.ignored_fields import IgnoredFieldsLog, header_value, ignored_fields
from router.openai_fanout import close_all, merged, opened
from router.openai_protocol import (  # re-exported: the door's translation, tested on its own
    DoorRequest,
    OpenAIError,
    chat_request,
    completion_request,
    detokenize_request,
    invalid,
    model_card,
    requested_model,
    short_repr,
    tokenize_json,
    tokenize_request,
)
from router.openai_reply import Reply, sse

__all__ = ["OpenAIError", "Reply", "build_app", "chat_request", "completion_request", "sse"]

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------- the app


def _error_response(error: OpenAIError, headers: dict[str, str] | None = None) -> Response:
    """The error as OpenAI's JSON, ASCII only (messages quote client input, which may hold lone
    surrogates); a 413 closes the connection (the rest of the body is never read)."""
    if error.status == 413:
        headers = {**(headers or {}), "connection": "close"}
    return Response(json.dumps(error.body(), separators=(",", ":")), status_code=error.status, headers=headers,
                    media_type="application/json")


def _body_error(error: BodyError) -> OpenAIError:
    return OpenAIError(error.status, error.message, code=error.code)


def announced_body_error(content_length: str | None, limit: int) -> Response | None:
    """The 413 to a request whose Content-Length passes `limit`: sent before reading any of the
    body, closing the connection."""
    try:
        check_content_length(content_length, limit)
    except BodyError as e:
        return _error_response(_body_error(e))
    return None


OPEN_PATHS = frozenset({"/health"})


def authenticate(tokens: TokenStore, authorization: str | None) -> tuple[Principal | None, Response | None]:
    """(the caller's Principal, None), or (None, the 401 / 403 answer) when the token file
    refuses the request's Authorization header."""
    try:
        return tokens.authorize(bearer_token(authorization), "client", "this API"), None
    except AuthError as e:
        if e.code == UNAUTHENTICATED:
            return None, _error_response(OpenAIError(401, f"{e.message} (send 'Authorization: Bearer <token>')",
                                                     code="invalid_api_key", type_="invalid_request_error"),
                                         {"www-authenticate": "Bearer"})
        return None, _error_response(OpenAIError(403, e.message, code="permission_denied",
                                                 type_="permission_error"))


def auth_error(tokens: TokenStore, authorization: str | None) -> Response | None:
    """The 401 / 403 answer to a request whose Authorization header the token file refuses."""
    return authenticate(tokens, authorization)[1]


def build_app(core: RouterCore, tokens: TokenStore | None = None, *,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The HTTP door; with `tokens`, every path but /health needs a bearer token with role client
    (/health's details too); request bodies over `max_body_bytes` are a 413."""
    app = FastAPI(title="radixkv router", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = core.metrics
    started = int(time.time())  # the model cards' "created"
    ignored_log = IgnoredFieldsLog()

    def admit(request: Request) -> tuple[Principal | None, Response | None]:
        principal, refused = None, None
        if tokens is not None and request.url.path not in OPEN_PATHS:
            principal, refused = authenticate(tokens, request.headers.get("authorization"))
        if refused is None:
            refused = announced_body_error(request.headers.get("content-length"), max_body_bytes)
        return principal, refused

    def count(path: str, status: int) -> None:
        metrics.http_requests.labels(_metric_path(path), str(status)).inc()

    app.add_middleware(DoorGate, admit=admit, count=count)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> Response:
        return _error_response(OpenAIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> Response:
        return _error_response(invalid(str(exc)))

    async def served_model() -> model_pb2.ModelInfoResponse:
        try:
            return await core.served_model()
        except RouterError as e:
            raise OpenAIError.from_router(e) from None

    async def checked_model(model: str | None) -> model_pb2.ModelInfoResponse:
        """The served model's info; a 404 when the request names another model."""
        info = await served_model()
        if model is not None and model != info.model_name:
            raise OpenAIError(404, f"the model {short_repr(model)} does not exist (this server serves "
                              f"'{info.model_name}')", "model", "model_not_found")
        return info

    async def read_body(request: Request) -> dict[str, Any]:
        """The body's JSON object: at most max_body_bytes read (413 past them), hostile JSON a 400
        (router/http_body.py)."""
        try:
            return parse_object(await read_limited(request.stream(), max_body_bytes))
        except BodyError as e:
            raise _body_error(e) from None
        except ClientDisconnect:  # the client left mid-body: nobody reads this answer
            raise invalid("the client closed the connection before the whole body arrived") from None

    async def prompt_texts(door: DoorRequest) -> list[str]:
        """Echo: each prompt's text (a token-id prompt's through the replica's Detokenize)."""
        deadline = time.monotonic() + core.config.call_timeout_s

        async def text(request: model_pb2.GenerateRequest) -> str:
            if request.WhichOneof("input") == "prompt":
                return request.prompt
            answer = await core.detokenize(model_pb2.DetokenizeRequest(token_ids=request.token_ids.ids), deadline)
            return answer.text

        return list(await asyncio.gather(*(text(r) for r in door.generate)))

    async def prompt_lengths(door: DoorRequest) -> list[int]:
        """Continuous usage: each prompt's tokens before the first answer (Usage comes at the end)."""
        deadline = time.monotonic() + core.config.call_timeout_s

        async def length(request: model_pb2.GenerateRequest) -> int:
            kind = request.WhichOneof("input")
            if kind == "token_ids":
                return len(request.token_ids.ids)
            tokenize_ = model_pb2.TokenizeRequest(text=request.prompt) if kind == "prompt" else \
                model_pb2.TokenizeRequest(chat=request.chat)
            return len((await core.tokenize(tokenize_, deadline)).token_ids)

        return list(await asyncio.gather(*(length(r) for r in door.generate)))

    async def generate(request: Request, chat: bool) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = {"x-request-id": request_id}
        try:
            body = await read_body(request)
            ignored = ignored_fields(body, chat)
            if ignored:  # on every answer from here on, errors and streams included
                headers[IGNORED_HEADER] = header_value(ignored)
                ignored_log.warn(request.url.path, ignored)
            door = (chat_request if chat else completion_request)(body)
            model = requested_model(body)
            if not model:
                raise invalid("'model' is required", "model")
            await checked_model(model)
            for i, generate_request in enumerate(door.generate):  # several prompts: ID-0, ID-1 ...
                generate_request.request_id = request_id if len(door.generate) == 1 else f"{request_id}-{i}"
            reply = Reply(chat, model, request_id, tools=door.tools, logprobs=door.logprobs,
                          top_logprobs=door.top_logprobs, prompts=len(door.generate), n=door.n, choices=door.choices,
                          echo=door.echo, echo_only=door.echo_only, prompt_logprobs=door.prompt_logprobs,
                          continuous_usage=door.continuous_usage,
                          prompt_texts=await prompt_texts(door) if door.echo else [],
                          prompt_tokens=await prompt_lengths(door) if door.continuous_usage else [])
            streams = [core.generate(r, principal=request.state.principal) for r in door.generate]
            try:
                firsts = await opened(streams)  # routing, retries: errors here are HTTP statuses
            except StopAsyncIteration:
                raise OpenAIError(502, "the replica's stream ended without a message") from None
        except RouterError as e:
            return _error_response(OpenAIError.from_router(e), headers)
        except OpenAIError as e:
            return _error_response(e, headers)
        if door.stream:
            return StreamingResponse(_stream(reply, merged(firsts, streams), door.include_usage),
                                     media_type="text/event-stream", headers={**headers, "cache-control": "no-cache"})
        messages = merged(firsts, streams)
        try:
            async for prompt, message in messages:
                reply.add(message, prompt)
        except RouterError as e:
            return _error_response(OpenAIError.from_router(e), headers)
        finally:
            await messages.aclose()
            await close_all(streams)
        answer = reply.response()
        if reply.served_by():
            headers["x-radixkv-served-by"] = reply.served_by()
        return JSONResponse(answer, headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    @app.get("/v1/models")
    async def models() -> Response:
        try:
            info = await served_model()
        except OpenAIError as e:
            return _error_response(e)
        return JSONResponse({"object": "list", "data": [model_card(info, started)]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        try:
            info = await served_model()
        except OpenAIError as e:
            return _error_response(e)
        if model_id != info.model_name:
            return _error_response(OpenAIError(404, f"the model '{model_id}' does not exist", "model",
                                               "model_not_found"))
        return JSONResponse(model_card(info, started))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        """vLLM's /tokenize: the replica's Tokenize of a prompt or of chat messages."""
        try:
            body = await read_body(request)
            tokenize_request_, return_strs = tokenize_request(body)
            info = await checked_model(requested_model(body))
            answer = await core.tokenize(tokenize_request_, time.monotonic() + core.config.call_timeout_s)
        except RouterError as e:
            return _error_response(OpenAIError.from_router(e))
        except OpenAIError as e:
            return _error_response(e)
        return JSONResponse(tokenize_json(answer, info.max_context_tokens, return_strs))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        """vLLM's /detokenize: the replica's Detokenize of token ids."""
        try:
            body = await read_body(request)
            detokenize_request_ = detokenize_request(body)
            await checked_model(requested_model(body))
            answer = await core.detokenize(detokenize_request_, time.monotonic() + core.config.call_timeout_s)
        except RouterError as e:
            return _error_response(OpenAIError.from_router(e))
        except OpenAIError as e:
            return _error_response(e)
        return JSONResponse({"prompt": answer.text})

    @app.get("/health")
    async def health(request: Request) -> Response:
        """Status for anyone (probes carry no token); the replicas' addresses and the cache
        manager's state only for a caller the door would serve (a client token; anyone
        without a token file)."""
        reachable = [r.addr for r in core.replicas.all() if r.reachable]
        body: dict[str, Any] = {"status": "ok" if reachable else "no replica reachable"}
        if tokens is None or auth_error(tokens, request.headers.get("authorization")) is None:
            body.update(replicas=reachable, cache_manager_up=bool(core.cache_up))
        return JSONResponse(body, status_code=200 if reachable else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.text(), media_type="text/plain; version=0.0.4")

    return app


# The paths the metrics label as they are; anything else (404s) is one "other" series, so that
# requests to made-up paths cannot grow the metrics without bound.
_METRIC_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize",
                           "/health", "/metrics"})


def _metric_path(path: str) -> str:
    if path in _METRIC_PATHS:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


async def _stream(reply: Reply, messages: AsyncGenerator[tuple[int, model_pb2.GenerateResponse], None],
                  include_usage: bool) -> AsyncIterator[bytes]:
    try:
        for chunk in reply.first_chunks():
            yield sse(chunk)
        try:
            async for prompt, message in messages:
                for chunk in reply.add(message, prompt):
                    yield sse(chunk)
        except RouterError as e:
            yield sse(OpenAIError.from_router(e).body())
        else:
            for chunk in reply.flush():
                yield sse(chunk)
            if include_usage:
                yield sse(reply.usage_chunk())
        yield sse("[DONE]")
    finally:
        with contextlib.suppress(Exception):
            await messages.aclose()  # a client gone mid-stream: every replica stops generating
