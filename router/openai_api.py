"""OpenAI-compatible HTTP door of the router (FastAPI): /v1/completions, /v1/chat/completions
(both also as server-sent events with ``stream: true``), /v1/models, /health, /metrics.

The translation is pure (request JSON -> GenerateRequest, GenerateResponse messages -> OpenAI
JSON), and the handlers call the same RouterCore.generate the gRPC servicer does.

Parameters: max_tokens (chat: max_completion_tokens first), temperature, top_p, seed, stop (a
string or a list), n / best_of = 1 only; the extensions vLLM also takes: top_k, ignore_eos,
stop_token_ids, and ``cache_salt`` (the request's cache namespace: prefixes are never shared
across salts). Unsupported features (echo, logprobs, penalties, logit_bias, tools, non-text
content, several prompts) are a 400. Any other field (a misspelling, another server's
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

Errors are OpenAI's JSON ``{"error": {"message", "type", "param", "code"}}``: 400 invalid, 404
unknown model or path, 429 replica queue full, 503 no replica, 504 deadline, 500 otherwise. Once
a stream has started, an error arrives as one ``data: {"error": ...}`` event before ``[DONE]``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import reprlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from common.auth import UNAUTHENTICATED, AuthError, Principal, TokenStore, bearer_token
from protos import model_pb2
from router import errors
from router.core import RouterCore
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

log = logging.getLogger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
INT32_MAX = 2**31 - 1

_HTTP_STATUS = {
    errors.INVALID_ARGUMENT: 400,
    errors.FAILED_PRECONDITION: 400,
    "OUT_OF_RANGE": 400,
    errors.PERMISSION_DENIED: 403,  # a namespace (cache_salt) the token may not use
    errors.NOT_FOUND: 404,
    "ALREADY_EXISTS": 409,  # an X-Request-Id still in flight
    errors.RESOURCE_EXHAUSTED: 429,
    errors.UNIMPLEMENTED: 501,
    errors.UNAVAILABLE: 503,
    errors.DEADLINE_EXCEEDED: 504,
}
_ERROR_TYPES = {400: "invalid_request_error", 403: "permission_error", 404: "not_found_error",
                413: "invalid_request_error",
                429: "rate_limit_error", 503: "service_unavailable_error", 504: "timeout_error"}

# Client values quoted in error messages: a few elements, a few dozen characters (a body may
# hold megabytes in the field that is wrong).
_short = reprlib.Repr()
_short.maxlevel, _short.maxlist, _short.maxdict, _short.maxstring, _short.maxother = 2, 4, 4, 60, 60
_short.maxlong = 60
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
        raise invalid(f"'{name}' must be {what}, got {_short.repr(value)}", name)
    if not isinstance(value, kinds):
        raise invalid(f"'{name}' must be {what}, got {_short.repr(value)}", name)
    if isinstance(value, float) and not math.isfinite(value):  # 1e400 parses as inf
        raise invalid(f"'{name}' must be a finite number, got {value!r}", name)
    return value


def _int32(body: dict[str, Any], name: str) -> int | None:
    """An integer field of a protobuf int32: a 400 naming it when out of range (not a 500)."""
    value = _get(body, name, (int,), "an integer")
    if value is not None and not -INT32_MAX - 1 <= value <= INT32_MAX:
        raise invalid(f"'{name}' must be at most {INT32_MAX} in magnitude, got {_short.repr(value)}", name)
    return value


def _reject(body: dict[str, Any], name: str, allowed: tuple[Any, ...] = (None,)) -> None:
    """A 400 when the unsupported parameter `name` has a value other than `allowed` (its no-ops)."""
    if body.get(name) not in allowed:
        raise invalid(f"'{name}' is not supported by this server", name, "unsupported_parameter")


def _sampling(body: dict[str, Any], max_tokens_names: tuple[str, ...], default_max_tokens: int | None
              ) -> model_pb2.SamplingParams:
    sampling = model_pb2.SamplingParams()
    for name in max_tokens_names:
        value = _int32(body, name)
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
    top_k = _int32(body, "top_k")
    if top_k is not None:
        if top_k == -1:  # vLLM's "disabled"
            top_k = 0
        sampling.top_k = top_k
    seed = _get(body, "seed", (int,), "an integer")
    if seed is not None:
        if not 0 <= seed < 2**64:
            raise invalid(f"'seed' must be in [0, 2**64), got {_short.repr(seed)}", "seed")
        sampling.seed = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise invalid(f"'stop' must be a string or a list of strings, got {_short.repr(stop)}", "stop")
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


_Translation = Callable[[dict[str, Any]], tuple[model_pb2.GenerateRequest, bool, bool]]


def _valid_unicode(translate: _Translation) -> _Translation:
    """A lone UTF-16 surrogate ("\\ud800" in JSON) cannot be encoded into the protobuf request:
    a 400 saying so, not a 500."""

    @functools.wraps(translate)
    def checked(body: dict[str, Any]) -> tuple[model_pb2.GenerateRequest, bool, bool]:
        try:
            return translate(body)
        except UnicodeEncodeError:
            raise invalid("the request holds a lone UTF-16 surrogate (\\ud800-\\udfff): not valid Unicode",
                          code="invalid_unicode") from None

    return checked


@_valid_unicode
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


@_valid_unicode
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
    ignored_log = IgnoredFieldsLog()

    @app.middleware("http")
    async def count(request: Request, call_next):
        refused = None
        request.state.principal = None  # the caller (request ids, Abort and namespaces are its own)
        if tokens is not None and request.url.path not in OPEN_PATHS:
            request.state.principal, refused = authenticate(tokens, request.headers.get("authorization"))
        if refused is None:
            refused = announced_body_error(request.headers.get("content-length"), max_body_bytes)
        response = refused if refused is not None else await call_next(request)
        metrics.http_requests.labels(_metric_path(request.url.path), str(response.status_code)).inc()
        return response

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

    async def read_body(request: Request) -> dict[str, Any]:
        """The body's JSON object: at most max_body_bytes read (413 past them), hostile JSON a 400
        (router/http_body.py)."""
        try:
            return parse_object(await read_limited(request.stream(), max_body_bytes))
        except BodyError as e:
            raise _body_error(e) from None
        except ClientDisconnect:  # the client left mid-body: nobody reads this answer
            raise invalid("the client closed the connection before the whole body arrived") from None

    async def generate(request: Request, chat: bool) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = {"x-request-id": request_id}
        try:
            body = await read_body(request)
            ignored = ignored_fields(body, chat)
            if ignored:  # on every answer from here on, errors and streams included
                headers[IGNORED_HEADER] = header_value(ignored)
                ignored_log.warn(request.url.path, ignored)
            generate_request, stream, include_usage = (chat_request if chat else completion_request)(body)
            model = _get(body, "model", (str,), "a string")
            if not model:
                raise invalid("'model' is required", "model")
            info = await served_model()
            if model != info.model_name:
                raise OpenAIError(404, f"the model {_short.repr(model)} does not exist (this server serves "
                                  f"'{info.model_name}')", "model", "model_not_found")
            generate_request.request_id = request_id
            reply = Reply(chat, model, request_id)
            messages = core.generate(generate_request, principal=request.state.principal)
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
_METRIC_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"})


def _metric_path(path: str) -> str:
    if path in _METRIC_PATHS:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


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
