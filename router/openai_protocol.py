"""Request translation of the OpenAI door (router/openai_api.py), pure (no server): request JSON
-> GenerateRequest / TokenizeRequest / DetokenizeRequest, model cards and tokenize answers,
errors as OpenAI's error JSON (responses: router/openai_reply.py). Every bad value is an
OpenAIError (a 400 naming the parameter), never a 500."""

from __future__ import annotations

import functools
import math
import reprlib
from collections.abc import Callable
from typing import Any, TypeVar

from protos import model_pb2
from router import errors
from router.errors import RouterError
from router.structured_formats import FormatError, structured_output
from router.tool_calls import ToolPlan, plan_tools, template_tools

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_LOGPROBS = 20  # alternatives per token (vLLM's default cap; OpenAI's is 20 for chat)
INT32_MAX = 2**31 - 1
_FLOAT_MAX = 3.4028234663852886e38  # the largest float32 (SamplingParams' floats)

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
short_repr = _short.repr


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
    _penalties(body, sampling)
    return sampling


def _in_range(body: dict[str, Any], name: str, low: float, high: float, what: str) -> float | None:
    """A number field within [low, high] (a 400 naming it otherwise)."""
    value = _get(body, name, (int, float), "a number")
    if value is not None and not low <= value <= high:
        raise invalid(f"'{name}' must be {what}, got {_short.repr(value)}", name)
    return value


def _penalties(body: dict[str, Any], sampling: model_pb2.SamplingParams) -> None:
    """OpenAI's penalties and logit_bias, vLLM's repetition_penalty, min_tokens and min_p: checked
    against the ranges of SamplingParams (protos/model.proto), mapped as they are."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = _in_range(body, name, -2.0, 2.0, "in [-2, 2]")
        if value is not None:
            setattr(sampling, name, value)
    repetition = _get(body, "repetition_penalty", (int, float), "a number")
    if repetition is not None:
        if not 0 < repetition <= _FLOAT_MAX:
            raise invalid(f"'repetition_penalty' must be > 0, got {_short.repr(repetition)}", "repetition_penalty")
        sampling.repetition_penalty = repetition
    min_p = _in_range(body, "min_p", 0.0, 1.0, "in [0, 1]")
    if min_p is not None:
        sampling.min_p = min_p
    min_tokens = _int32(body, "min_tokens")
    if min_tokens is not None:
        if min_tokens < 0:
            raise invalid(f"'min_tokens' must be >= 0, got {min_tokens}", "min_tokens")
        if sampling.HasField("max_tokens") and min_tokens > sampling.max_tokens:
            raise invalid(f"'min_tokens' ({min_tokens}) must be at most max_tokens ({sampling.max_tokens})",
                          "min_tokens")
        sampling.min_tokens = min_tokens
    bias = _get(body, "logit_bias", (dict,), "an object mapping token ids to numbers")
    for key, value in (bias or {}).items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10 else -1
        if not 0 <= token < 2**32:
            raise invalid(f"'logit_bias' keys must be token ids (decimal strings), got {_short.repr(key)}",
                          "logit_bias")
        if isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
            raise invalid(f"'logit_bias' values must be numbers in [-100, 100], got {_short.repr(value)} "
                          f"for token {token}", "logit_bias")
        sampling.logit_bias[token] = value


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32


def _common(body: dict[str, Any]) -> tuple[str, bool, bool]:
    """Checks shared by both endpoints; returns (namespace, stream, include_usage)."""
    n = _get(body, "n", (int,), "an integer")
    if n not in (None, 1):
        raise invalid("only n=1 is supported", "n", "unsupported_parameter")
    namespace = _get(body, "cache_salt", (str,), "a string") or ""
    stream = bool(_get(body, "stream", (bool,), "a boolean"))
    options = _get(body, "stream_options", (dict,), "an object") or {}
    include_usage = bool(options.get("include_usage"))
    if options and not stream:
        raise invalid("'stream_options' is only allowed with 'stream': true", "stream_options")
    return namespace, stream, include_usage


_T = TypeVar("_T")


def _valid_unicode(translate: Callable[[dict[str, Any]], _T]) -> Callable[[dict[str, Any]], _T]:
    """A lone UTF-16 surrogate ("\\ud800" in JSON) cannot be encoded into the protobuf request:
    a 400 saying so, not a 500."""

    @functools.wraps(translate)
    def checked(body: dict[str, Any]) -> _T:
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
    logprobs = _int32(body, "logprobs")
    _reject(body, "suffix", (None, ""))
    request = model_pb2.GenerateRequest(namespace=namespace,
                                        sampling=_sampling(body, ("max_tokens",), COMPLETIONS_DEFAULT_MAX_TOKENS))
    output_format = _format(body)
    if output_format is not None:
        request.sampling.structured_output.CopyFrom(output_format)
    if logprobs is not None:
        request.sampling.logprobs = _logprobs_k(logprobs, "logprobs")
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


def _chat_messages(body: dict[str, Any]) -> model_pb2.ChatMessages:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list", "messages")
    chat = model_pb2.ChatMessages()
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid(f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]")
        chat.messages.add(role=message["role"], content=_content(message, i))
    return chat


@_valid_unicode
def chat_request(body: dict[str, Any]) -> tuple[model_pb2.GenerateRequest, bool, bool]:
    """POST /v1/chat/completions body -> (GenerateRequest, stream, include_usage). Raises OpenAIError."""
    namespace, stream, include_usage = _common(body)
    logprobs = _get(body, "logprobs", (bool,), "a boolean")
    top_logprobs = _int32(body, "top_logprobs")
    if top_logprobs is not None and not logprobs:
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    plan = tool_plan(body)
    output_format = _format(body)
    if plan.constraint is not None and output_format is not None:
        raise invalid("a 'tool_choice' that calls a tool and an output format can't both constrain the output",
                      "tool_choice")
    request = model_pb2.GenerateRequest(
        chat=_chat_messages(body), namespace=namespace, sampling=_sampling(body, ("max_completion_tokens", "max_tokens"), None))
    if logprobs:
        request.sampling.logprobs = _logprobs_k(top_logprobs or 0, "top_logprobs")
    if plan.mode != "none":
        request.chat.tools_json = template_tools(body)
    constraint = plan.constraint or output_format
    if constraint is not None:
        request.sampling.structured_output.CopyFrom(constraint)
    return request, stream, include_usage


def _logprobs_k(k: int, name: str) -> int:
    if not 0 <= k <= MAX_LOGPROBS:
        raise invalid(f"'{name}' must be in [0, {MAX_LOGPROBS}], got {k}", name)
    return k


def tool_plan(body: dict[str, Any]) -> ToolPlan:
    """The chat request's tools and tool_choice (router/tool_calls.py). Raises OpenAIError."""
    try:
        return plan_tools(body)
    except FormatError as e:
        raise invalid(str(e), e.param) from None


def _format(body: dict[str, Any]) -> model_pb2.StructuredOutput | None:
    try:
        return structured_output(body)
    except FormatError as e:
        raise invalid(str(e), e.param) from None


# ---------------------------------------------------------------------- models, tokenize, detokenize


def model_card(info: model_pb2.ModelInfoResponse, created: int) -> dict[str, Any]:
    """The /v1/models entry of the served model, with every field vLLM's has (its benchmark
    client reads ``root``)."""
    return {"id": info.model_name, "object": "model", "created": created, "owned_by": "radixkv",
            "root": info.model_name, "parent": None, "max_model_len": info.max_context_tokens,
            "permission": [], "fingerprint": info.model_fingerprint}


def requested_model(body: dict[str, Any]) -> str | None:
    """The body's ``model`` (a 400 when not a string)."""
    return _get(body, "model", (str,), "a string")


def _flag(body: dict[str, Any], name: str, default: bool, honoured: bool, why: str) -> bool:
    """A boolean option of /tokenize: a 400 when the value asks for what the replica's Tokenize
    cannot do (never silently ignored)."""
    value = _get(body, name, (bool,), "a boolean")
    value = default if value is None else value
    if value != honoured:
        raise invalid(f"'{name}': {value} is not supported here ({why})", name, "unsupported_parameter")
    return value


@_valid_unicode
def tokenize_request(body: dict[str, Any]) -> tuple[model_pb2.TokenizeRequest, bool]:
    """POST /tokenize body (vLLM's: ``prompt`` or ``messages``) -> (TokenizeRequest,
    return_token_strs). Tokenize adds the tokenizer's special tokens to a prompt and renders
    messages with the chat template and its generation prompt (vLLM's defaults for each), so
    other values of add_special_tokens / add_generation_prompt are a 400."""
    return_strs = bool(_get(body, "return_token_strs", (bool,), "a boolean"))
    if "messages" in body and body["messages"] is not None:
        if body.get("prompt") is not None:
            raise invalid("give either 'prompt' or 'messages', not both", "prompt")
        _flag(body, "add_special_tokens", False, False, "the chat template places the special tokens")
        _flag(body, "add_generation_prompt", True, True, "messages are rendered as chat requests are")
        return model_pb2.TokenizeRequest(chat=_chat_messages(body)), return_strs
    _flag(body, "add_special_tokens", True, True, "prompts are tokenized as completions are")
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise invalid("'prompt' must be a non-empty string (or give 'messages')", "prompt")
    return model_pb2.TokenizeRequest(text=prompt), return_strs


def tokenize_json(response: model_pb2.TokenizeResponse, max_model_len: int, return_strs: bool) -> dict[str, Any]:
    """vLLM's /tokenize answer."""
    return {"count": len(response.token_ids), "max_model_len": max_model_len, "tokens": list(response.token_ids),
            "token_strs": list(response.tokens) if return_strs else None}


def detokenize_request(body: dict[str, Any]) -> model_pb2.DetokenizeRequest:
    """POST /detokenize body ``{"tokens": [ids]}`` -> DetokenizeRequest (ids below the vocabulary
    size are the replica's check: a 400 from there)."""
    tokens = body.get("tokens")
    if not (isinstance(tokens, list) and all(_is_token(t) for t in tokens)):
        raise invalid(f"'tokens' must be a list of token ids, got {_short.repr(tokens)}", "tokens")
    return model_pb2.DetokenizeRequest(token_ids=tokens)
