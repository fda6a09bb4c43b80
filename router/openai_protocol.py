"""Request translation of the OpenAI door (router/openai_api.py), pure (no server): request JSON
-> GenerateRequest / TokenizeRequest / DetokenizeRequest, model cards and tokenize answers,
errors as OpenAI's error JSON (responses: router/openai_reply.py). Every bad value is an
OpenAIError (a 400 naming the parameter), never a 500."""

from __future__ import annotations

import functools
import json
import reprlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from protos import model_pb2
from router import errors
from router.errors import RouterError
from router.openai_models import (
    BodyValueError,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    TokenizeBody,
    parse,
)
from router.structured_formats import FormatError, structured_output
from router.tool_calls import ToolPlan, plan_tools, template_tools

COMPLETIONS_DEFAULT_MAX_TOKENS = 16

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


MAX_PROMPTS = 1024  # prompts in one completions request (each is a Generate of its own)


@dataclass(slots=True)
class DoorRequest:
    """A parsed OpenAI request: the Generate calls to make (one per prompt, run at once) and how
    to answer them (router/openai_reply.py)."""

    generate: list[model_pb2.GenerateRequest]
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (with include_usage)
    n: int = 1  # choices returned per prompt
    choices: int = 1  # choices each Generate asks for (best_of, else n)
    echo: bool = False
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone
    logprobs: bool = False  # the client asked for log probabilities of the output
    top_logprobs: int = 0  # the alternatives asked for per token
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs, as asked
    tools: ToolPlan | None = None  # chat


def _parse(model: type[_B], body: dict[str, Any]) -> _B:
    try:
        return parse(model, body, short_repr)
    except BodyValueError as e:
        raise invalid(str(e), e.param) from None


def _sampling(body: CompletionBody | ChatBody, max_tokens: int | None) -> model_pb2.SamplingParams:
    """The sampling fields both endpoints map as they are (types and ranges: router/openai_models.py)."""
    sampling = model_pb2.SamplingParams(top_k=0 if body.top_k in (None, -1) else body.top_k,  # -1: vLLM's "off"
                                        stop=body.stop or [], stop_token_ids=body.stop_token_ids or [],
                                        ignore_eos=bool(body.ignore_eos))
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    for name in ("temperature", "top_p", "seed", "repetition_penalty"):
        value = getattr(body, name)
        if value is not None:
            setattr(sampling, name, value)
    for name in ("presence_penalty", "frequency_penalty", "min_p", "min_tokens"):
        setattr(sampling, name, getattr(body, name) or 0)
    if body.min_tokens and max_tokens is not None and body.min_tokens > max_tokens:
        raise invalid(f"'min_tokens' ({body.min_tokens}) must be at most max_tokens ({max_tokens})", "min_tokens")
    for key, value in (body.logit_bias or {}).items():
        token = int(key) if key.isascii() and key.isdigit() and len(key) <= 10 else -1
        if not 0 <= token < 2**32:
            raise invalid(f"'logit_bias' keys must be token ids (decimal strings), got {_short.repr(key)}",
                          "logit_bias")
        if isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
            raise invalid(f"'logit_bias' values must be numbers in [-100, 100], got {_short.repr(value)} "
                          f"for token {token}", "logit_bias")
        sampling.logit_bias[token] = value
    if body.n is not None and body.n > 1:
        sampling.n = body.n
    if body.prompt_logprobs is not None:
        if body.stream:  # as vLLM: the whole prompt's are on the first message, not a stream's thing
            raise invalid("'prompt_logprobs' is not available with 'stream': true", "prompt_logprobs")
        sampling.prompt_logprobs = body.prompt_logprobs
    return sampling


def _stream_flags(body: CompletionBody | ChatBody) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage)."""
    options = body.stream_options
    if options is not None and not body.stream:
        raise invalid("'stream_options' is only allowed with 'stream': true", "stream_options")
    include_usage = bool(options and options.include_usage)
    return bool(body.stream), include_usage, include_usage and bool(options and options.continuous_usage_stats)


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32


def _prompts(prompt: Any) -> list[str | list[int]]:
    """`prompt`: a string, a list of strings, a list of token ids or a list of token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(_is_token(t) for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt) or \
                all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt):
            if len(prompt) > MAX_PROMPTS:
                raise invalid(f"'prompt' holds {len(prompt)} prompts; at most {MAX_PROMPTS} per request", "prompt")
            return prompt
    raise invalid("'prompt' must be a string, a list of strings, a non-empty list of token ids or a list of "
                  f"them, got {_short.repr(prompt)}", "prompt")


_T = TypeVar("_T")
_B = TypeVar("_B", CompletionBody, ChatBody)


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
def completion_request(body: dict[str, Any]) -> DoorRequest:
    """POST /v1/completions body -> DoorRequest (one Generate per prompt). Raises OpenAIError."""
    parsed = _parse(CompletionBody, body)
    stream, include_usage, continuous_usage = _stream_flags(parsed)
    n = parsed.n or 1
    choices = parsed.best_of or n
    if choices < n:
        raise invalid(f"'best_of' ({choices}) must be at least n ({n})", "best_of")
    if stream and choices > n:  # as vLLM: the best are known only at the end
        raise invalid("'best_of' can't be used with 'stream': true", "best_of")
    if parsed.suffix:
        raise invalid("'suffix' is not supported by this server", "suffix", "unsupported_parameter")
    echo = bool(parsed.echo)
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if parsed.max_tokens is None else parsed.max_tokens
    echo_only = echo and max_tokens == 0
    if max_tokens <= 0 and not echo_only:
        raise invalid(f"'max_tokens' must be at least 1 (0 only with 'echo'), got {max_tokens}", "max_tokens")
    sampling = _sampling(parsed, max_tokens)
    if echo_only:  # as vLLM: one token runs the prompt through the model, then is dropped
        sampling.max_tokens, sampling.min_tokens = 1, 0
    if choices > 1:
        sampling.n = choices
    if parsed.logprobs is not None:
        sampling.logprobs = parsed.logprobs
    elif choices > n:
        sampling.logprobs = 0  # best_of ranks choices by the chosen tokens' log probabilities
    if echo and parsed.logprobs is not None:  # the echoed prompt's tokens come with theirs
        sampling.prompt_logprobs = max(parsed.logprobs, parsed.prompt_logprobs or 0)
    output_format = _format(body)
    if output_format is not None:
        sampling.structured_output.CopyFrom(output_format)
    namespace = parsed.cache_salt or ""
    generate = []
    for prompt in _prompts(parsed.prompt):
        request = model_pb2.GenerateRequest(namespace=namespace, sampling=sampling)
        if isinstance(prompt, str):
            request.prompt = prompt
        else:
            request.token_ids.ids.extend(prompt)
        generate.append(request)
    return DoorRequest(generate, stream, include_usage, continuous_usage, n=n, choices=choices, echo=echo,
                       echo_only=echo_only, logprobs=parsed.logprobs is not None, top_logprobs=parsed.logprobs or 0,
                       prompt_logprobs=parsed.prompt_logprobs)


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


def _chat_messages(messages: list[dict[str, Any]] | None) -> model_pb2.ChatMessages:
    if not messages:
        raise invalid("'messages' must be a non-empty list", "messages")
    chat = model_pb2.ChatMessages()
    for i, message in enumerate(messages):
        if not isinstance(message.get("role"), str):
            raise invalid(f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]")
        chat.messages.add(role=message["role"], content=_content(message, i), **_tool_turn(message, i))
    return chat


def _tool_turn(message: dict[str, Any], index: int) -> dict[str, str]:
    """An assistant turn's `tool_calls` and a tool turn's `tool_call_id` / `name`, for the template."""
    out: dict[str, str] = {}
    calls = message.get("tool_calls")
    if calls not in (None, []):
        if not (isinstance(calls, list) and all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                 for c in calls)):
            raise invalid("'tool_calls' must be a list of {'type': 'function', 'function': {...}} objects",
                          f"messages[{index}].tool_calls")
        out["tool_calls_json"] = json.dumps(calls)
    for name in ("tool_call_id", "name"):
        value = message.get(name)
        if value is not None:
            if not isinstance(value, str):
                raise invalid(f"'{name}' must be a string", f"messages[{index}].{name}")
            out[name] = value
    return out


@_valid_unicode
def chat_request(body: dict[str, Any]) -> DoorRequest:
    """POST /v1/chat/completions body -> DoorRequest (one Generate). Raises OpenAIError."""
    parsed = _parse(ChatBody, body)
    stream, include_usage, continuous_usage = _stream_flags(parsed)
    if parsed.top_logprobs is not None and not parsed.logprobs:
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    plan = tool_plan(body)
    output_format = _format(body)
    if plan.constraint is not None and output_format is not None:
        raise invalid("a 'tool_choice' that calls a tool and an output format can't both constrain the output",
                      "tool_choice")
    max_tokens = parsed.max_completion_tokens if parsed.max_completion_tokens is not None else parsed.max_tokens
    request = model_pb2.GenerateRequest(chat=_chat_messages(parsed.messages), namespace=parsed.cache_salt or "",
                                        sampling=_sampling(parsed, max_tokens))
    if parsed.logprobs:
        request.sampling.logprobs = parsed.top_logprobs or 0
    if plan.mode != "none":
        request.chat.tools_json = template_tools(body)
    constraint = plan.constraint or output_format
    if constraint is not None:
        request.sampling.structured_output.CopyFrom(constraint)
    return DoorRequest([request], stream, include_usage, continuous_usage, n=parsed.n or 1, choices=parsed.n or 1,
                       logprobs=bool(parsed.logprobs), top_logprobs=parsed.top_logprobs or 0,
                       prompt_logprobs=parsed.prompt_logprobs, tools=plan)


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
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid(f"'model' must be a string, got {_short.repr(model)}", "model")
    return model


def _flag(value: bool | None, name: str, default: bool, honoured: bool, why: str) -> bool:
    """A boolean option of /tokenize: a 400 when the value asks for what the replica's Tokenize
    cannot do (never silently ignored)."""
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
    parsed = _parse(TokenizeBody, body)
    return_strs = bool(parsed.return_token_strs)
    if parsed.messages is not None:
        if parsed.prompt is not None:
            raise invalid("give either 'prompt' or 'messages', not both", "prompt")
        _flag(parsed.add_special_tokens, "add_special_tokens", False, False,
              "the chat template places the special tokens")
        _flag(parsed.add_generation_prompt, "add_generation_prompt", True, True,
              "messages are rendered as chat requests are")
        return model_pb2.TokenizeRequest(chat=_chat_messages(parsed.messages)), return_strs
    _flag(parsed.add_special_tokens, "add_special_tokens", True, True, "prompts are tokenized as completions are")
    if not parsed.prompt:
        raise invalid("'prompt' must be a non-empty string (or give 'messages')", "prompt")
    return model_pb2.TokenizeRequest(text=parsed.prompt), return_strs


def tokenize_json(response: model_pb2.TokenizeResponse, max_model_len: int, return_strs: bool) -> dict[str, Any]:
    """vLLM's /tokenize answer."""
    return {"count": len(response.token_ids), "max_model_len": max_model_len, "tokens": list(response.token_ids),
            "token_strs": list(response.tokens) if return_strs else None}


def detokenize_request(body: dict[str, Any]) -> model_pb2.DetokenizeRequest:
    """POST /detokenize body ``{"tokens": [ids]}`` -> DetokenizeRequest (ids below the vocabulary
    size are the replica's check: a 400 from there)."""
    tokens = _parse(DetokenizeBody, body).tokens
    if tokens is None:
        raise invalid("'tokens' must be a list of token ids", "tokens")
    return model_pb2.DetokenizeRequest(token_ids=tokens)
