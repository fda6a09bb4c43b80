"""OpenAI-compatible HTTP door of the router (FastAPI): /v1/completions, /v1/chat/completions
(both also as server-sent events with ``stream: true``), /v1/models, /health, /metrics.

The translation is pure (request JSON -> GenerateRequest, GenerateResponse messages -> OpenAI
JSON), and the handlers call the same RouterCore.generate the gRPC servicer does.

Parameters: max_tokens (chat: max_completion_tokens first), temperature, top_p, seed, stop (a
string or a list), n / best_of = 1 only, user ignored; the extensions vLLM also takes: top_k,
ignore_eos, stop_token_ids, and ``cache_salt`` (the request's cache namespace: prefixes are
never shared across salts). Unsupported features (echo, logprobs, penalties, logit_bias, tools,
non-text content, several prompts) are a 400, never silently dropped. Completions default to
max_tokens 16 as OpenAI's do; chat defaults to the model service's (128, capped by the context).
An ``X-Request-Id`` header sets the request id (for Abort over gRPC); responses echo it.

With the router's --auth-token-file, every path but /health needs ``Authorization: Bearer TOKEN``
(a token of that file with the ``client`` role): 401 when missing or unknown, 403 without the
role, both as OpenAI error JSON (code ``invalid_api_key`` / ``permission_denied``).

Errors are OpenAI's JSON ``{"error": {"message", "type", "param", "code"}}``: 400 invalid, 404
unknown model or path, 429 replica queue full, 503 no replica, 504 deadline, 500 otherwise. Once
a stream has started, an error arrives as one ``data: {"error": ...}`` event before ``[DONE]``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.auth import UNAUTHENTICATED, AuthError, TokenStore, bearer_token
from protos import model_pb2
from router import errors
from router.core import RouterCore
from router.errors import RouterError

log = logging.getLogger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16

_HTTP_STATUS = {
    errors.INVALID_ARGUMENT: 400,
    errors.FAILED_PRECONDITION: 400,
    "OUT_OF_RANGE": 400,
    errors.NOT_FOUND: 404,
    "ALREADY_EXISTS": 409,  # an X-Request-Id still in flight
    errors.RESOURCE_EXHAUSTED: 429,
    errors.UNIMPLEMENTED: 501,
    errors.UNAVAILABLE: 503,
    errors.DEADLINE_EXCEEDED: 504,
}
_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error",
                503: "service_unavailable_error", 504: "timeout_error"}
_FINISH_REASONS = {
    model_pb2.FINISH_REASON_STOP: "stop",
    model_pb2.FINISH_REASON_LENGTH: "length",
    model_pb2.FINISH_REASON_ABORT: "abort",
}


# ---------------------------------------------------------------------- errors


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _ERROR_TYPES.get(status, "internal_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def from_router(cls, error: RouterError) -> OpenAIError:
        status = _HTTP_STATUS.get(error.code, 500)
        if error.code == errors.RESOURCE_EXHAUSTED and "queue" not in error.message:
            status = 400  # a prompt larger than the KV pool: retrying will not help (not a 429)
        return cls(status, error.message, code=error.code.lower())


def invalid(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param, code)


# ---------------------------------------------------------------------- request translation


def _get(body: dict[str, Any], name: str, kinds: tuple[type, ...], what: str) -> Any:
    """body[name] when present and not null; a 400 naming the parameter when of the wrong type."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in kinds:  # bool is an int in Python
        raise invalid(f"'{name}' must be {what}, got {value!r}", name)
    if not isinstance(value, kinds):
        raise invalid(f"'{name}' must be {what}, got {value!r}", name)
    return value


def _reject(body: dict[str, Any], name: str, allowed: tuple[Any, ...] = (None,)) -> None:
    """A 400 when the unsupported parameter `name` has a value other than `allowed` (its no-ops)."""
    if body.get(name) not in allowed:
        raise invalid(f"'{name}' is not supported by this server", name, "unsupported_parameter")


def _sampling(body: dict[str, Any], max_tokens_names: tuple[str, ...], default_max_tokens: int | None
              ) -> model_pb2.SamplingParams:
    sampling = model_pb2.SamplingParams()
    for name in max_tokens_names:
        value = _get(body, name, (int,), "an integer")
        if value is not None:
            sampling.max_tokens = value
            break
    else:
        if default_max_tokens is not None:
            sampling.max_tokens = default_max_tokens
    temperature = _get(body, "temperature", (int, float), "a number")
    if temperature is not None:
        sampling.temperature = temperature
    top_p = _get(body, "top_p", (int, float), "a number")
    if top_p is not None:
        sampling.top_p = top_p
    top_k = _get(body, "top_k", (int,), "an integer")
    if top_k is not None:
        if top_k == -1:  # vLLM's "disabled"
            top_k = 0
        sampling.top_k = top_k
    seed = _get(body, "seed", (int,), "an integer")
    if seed is not None:
        if not 0 <= seed < 2**64:
            raise invalid(f"'seed' must be in [0, 2**64), got {seed}", "seed")
        sampling.seed = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise invalid(f"'stop' must be a string or a list of strings, got {stop!r}", "stop")
    sampling.stop.extend(stop or [])
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None:
        if not (isinstance(stop_token_ids, list) and all(_is_token(t) for t in stop_token_ids)):
            raise invalid("'stop_token_ids' must be a list of token ids", "stop_token_ids")
        sampling.stop_token_ids.extend(stop_token_ids)
    ignore_eos = _get(body, "ignore_eos", (bool,), "a boolean")
    sampling.ignore_eos = bool(ignore_eos)
    return sampling


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32


def _common(body: dict[str, Any]) -> tuple[str, bool, bool]:
    """Checks shared by both endpoints; returns (namespace, stream, include_usage)."""
    n = _get(body, "n", (int,), "an integer")
    if n not in (None, 1):
        raise invalid("only n=1 is supported", "n", "unsupported_parameter")
    for name in ("presence_penalty", "frequency_penalty"):
        value = _get(body, name, (int, float), "a number")
        if value not in (None, 0):
            raise invalid(f"'{name}' is not supported by this server", name, "unsupported_parameter")
    _reject(body, "logit_bias", (None, {}))
    namespace = _get(body, "cache_salt", (str,), "a string") or ""
    stream = bool(_get(body, "stream", (bool,), "a boolean"))
    options = _get(body, "stream_options", (dict,), "an object") or {}
    include_usage = bool(options.get("include_usage"))
    if options and not stream:
        raise invalid("'stream_options' is only allowed with 'stream': true", "stream_options")
    return namespace, stream, include_usage


def completion_request(body: dict[str, Any]) -> tuple[model_pb2.GenerateRequest, bool, bool]:
    """POST /v1/completions body -> (GenerateRequest, stream, include_usage). Raises OpenAIError."""
    namespace, stream, include_usage = _common(body)
    best_of = _get(body, "best_of", (int,), "an integer")
    if best_of not in (None, 1):
        raise invalid("only best_of=1 is supported", "best_of", "unsupported_parameter")
    _reject(body, "echo", (None, False))
    _reject(body, "logprobs", (None,))
    _reject(body, "suffix", (None, ""))
    request = model_pb2.GenerateRequest(namespace=namespace,
                                        sampling=_sampling(body, ("max_tokens",), COMPLETIONS_DEFAULT_MAX_TOKENS))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        request.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
        request.token_ids.ids.extend(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise invalid("only one prompt per request is supported", "prompt", "unsupported_parameter")
    else:
        raise invalid("'prompt' must be a string or a list of token ids", "prompt")
    return request, stream, include_usage


def _content(message: dict[str, Any], index: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise invalid("only text content parts are supported", f"messages[{index}].content",
                              "unsupported_content")
            parts.append(part["text"])
        return "".join(parts)
    raise invalid("'content' must be a string or a list of text parts", f"messages[{index}].content")


def chat_request(body: dict[str, Any]) -> tuple[model_pb2.GenerateRequest, bool, bool]:
    """POST /v1/chat/completions body -> (GenerateRequest, stream, include_usage). Raises OpenAIError."""
    namespace, stream, include_usage = _common(body)
    if body.get("logprobs"):
        raise invalid("'logprobs' is not supported by this server", "logprobs", "unsupported_parameter")
    for name in ("tools", "functions"):
        _reject(body, name, (None, []))
    _reject(body, "tool_choice", (None, "none"))
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise invalid("only response_format {'type': 'text'} is supported", "response_format", "unsupported_parameter")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list", "messages")
    chat = model_pb2.ChatMessages()
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid(f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]")
        chat.messages.add(role=message["role"], content=_content(message, i))
    request = model_pb2.GenerateRequest(
        chat=chat, namespace=namespace, sampling=_sampling(body, ("max_completion_tokens", "max_tokens"), None))
    return request, stream, include_usage


# ---------------------------------------------------------------------- response translation


def usage_json(usage: model_pb2.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


@dataclass(slots=True)
class Reply:
    """What one request produced, built from its GenerateResponse messages in order."""

    chat: bool
    model: str
    request_id: str
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: model_pb2.Usage | None = None

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request_id

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _choice(self, text: str | None, finish_reason: str | None, chunk: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            if chunk:
                choice["delta"] = {} if text is None else {"content": text}
            else:
                choice["message"] = {"role": "assistant", "content": text or ""}
        else:
            choice["text"] = text or ""
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        return choice

    def add(self, message: model_pb2.GenerateResponse) -> list[dict[str, Any]]:
        """Records one message; returns the stream chunks it makes (usage chunk not included)."""
        chunks = []
        if message.text:
            self.text.append(message.text)
            chunks.append({**self._envelope(True), "choices": [self._choice(message.text, None, True)]})
        if message.finish_reason != model_pb2.FINISH_REASON_UNSPECIFIED:
            self.finish_reason = _FINISH_REASONS.get(message.finish_reason, "stop")
            self.usage = message.usage
            chunks.append({**self._envelope(True), "choices": [self._choice(None, self.finish_reason, True)]})
        return chunks

    def first_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant role."""
        if not self.chat:
            return None
        return {**self._envelope(True), "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None}]}

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        return {**self._envelope(True), "choices": [],
                "usage": usage_json(self.usage if self.usage is not None else model_pb2.Usage())}

    def response(self) -> dict[str, Any]:
        """The non-streamed response body."""
        return {**self._envelope(False), "choices": [self._choice("".join(self.text), self.finish_reason, False)],
                "usage": usage_json(self.usage if self.usage is not None else model_pb2.Usage())}


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


# ---------------------------------------------------------------------- the app


def _error_response(error: OpenAIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


OPEN_PATHS = frozenset({"/health"})


def auth_error(tokens: TokenStore, authorization: str | None) -> JSONResponse | None:
    """The 401 / 403 answer to a request whose Authorization header the token file refuses."""
    try:
        tokens.authorize(bearer_token(authorization), "client", "this API")
    except AuthError as e:
        if e.code == UNAUTHENTICATED:
            return _error_response(OpenAIError(401, f"{e.message} (send 'Authorization: Bearer <token>')",
                                               code="invalid_api_key", type_="invalid_request_error"),
                                   {"www-authenticate": "Bearer"})
        return _error_response(OpenAIError(403, e.message, code="permission_denied", type_="permission_error"))
    return None


def build_app(core: RouterCore, tokens: TokenStore | None = None) -> FastAPI:
    """The HTTP door; with `tokens`, every path but /health needs a bearer token with role client."""
    app = FastAPI(title="radixkv router", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = core.metrics

    @app.middleware("http")
    async def count(request: Request, call_next):
        refused = None
        if tokens is not None and request.url.path not in OPEN_PATHS:
            refused = auth_error(tokens, request.headers.get("authorization"))
        response = refused if refused is not None else await call_next(request)
        metrics.http_requests.labels(request.url.path, str(response.status_code)).inc()
        return response

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error_response(OpenAIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(invalid(str(exc)))

    async def served_model() -> model_pb2.ModelInfoResponse:
        try:
            return await core.served_model()
        except RouterError as e:
            raise OpenAIError.from_router(e) from None

    async def read_body(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise invalid(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise invalid("the request body must be a JSON object")
        return body

    async def generate(request: Request, chat: bool) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = {"x-request-id": request_id}
        try:
            body = await read_body(request)
            generate_request, stream, include_usage = (chat_request if chat else completion_request)(body)
            model = _get(body, "model", (str,), "a string")
            if not model:
                raise invalid("'model' is required", "model")
            info = await served_model()
            if model != info.model_name:
                raise OpenAIError(404, f"the model '{model}' does not exist (this server serves "
                                  f"'{info.model_name}')", "model", "model_not_found")
            generate_request.request_id = request_id
            reply = Reply(chat, model, request_id)
            messages = core.generate(generate_request)
            try:
                first = await anext(messages)  # routing, retries: errors here are HTTP statuses
            except StopAsyncIteration:
                raise OpenAIError(502, "the replica's stream ended without a message") from None
            except RouterError as e:
                raise OpenAIError.from_router(e) from None
        except OpenAIError as e:
            return _error_response(e, headers)
        if stream:
            return StreamingResponse(_stream(reply, first, messages, include_usage), media_type="text/event-stream",
                                     headers={**headers, "cache-control": "no-cache"})
        try:
            reply.add(first)
            async for message in messages:
                reply.add(message)
        except RouterError as e:
            return _error_response(OpenAIError.from_router(e), headers)
        finally:
            await messages.aclose()
        if reply.usage is not None and reply.usage.served_by:
            headers["x-radixkv-served-by"] = reply.usage.served_by
        return JSONResponse(reply.response(), headers=headers)

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
        return JSONResponse({"object": "list", "data": [_model_card(info)]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        try:
            info = await served_model()
        except OpenAIError as e:
            return _error_response(e)
        if model_id != info.model_name:
            return _error_response(OpenAIError(404, f"the model '{model_id}' does not exist", "model",
                                               "model_not_found"))
        return JSONResponse(_model_card(info))

    @app.get("/health")
    async def health() -> Response:
        reachable = [r.addr for r in core.replicas.all() if r.reachable]
        status = 200 if reachable else 503
        return JSONResponse({"status": "ok" if reachable else "no replica reachable", "replicas": reachable,
                             "cache_manager_up": bool(core.cache_up)}, status_code=status)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.text(), media_type="text/plain; version=0.0.4")

    return app


def _model_card(info: model_pb2.ModelInfoResponse) -> dict[str, Any]:
    return {"id": info.model_name, "object": "model", "created": 0, "owned_by": "radixkv",
            "max_model_len": info.max_context_tokens, "fingerprint": info.model_fingerprint}


async def _stream(reply: Reply, first: model_pb2.GenerateResponse,
                  messages: AsyncIterator[model_pb2.GenerateResponse], include_usage: bool) -> AsyncIterator[bytes]:
    try:
        opening = reply.first_chunk()
        if opening is not None:
            yield sse(opening)
        for chunk in reply.add(first):
            yield sse(chunk)
        try:
            async for message in messages:
                for chunk in reply.add(message):
                    yield sse(chunk)
        except RouterError as e:
            yield sse(OpenAIError.from_router(e).body())
        else:
            if include_usage:
                yield sse(reply.usage_chunk())
        yield sse("[DONE]")
    finally:
        with contextlib.suppress(Exception):
            await messages.aclose()  # a client gone mid-stream: the replica stops generating
