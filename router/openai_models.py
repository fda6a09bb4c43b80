"""The OpenAI door's request bodies as pydantic models (FastAPI's convention, as vLLM's protocol
module does): each field's type and range, checked once; a value that does not fit is a 400
naming the parameter (`parse`). What no type can say (a format, a tool, a chat message's
content parts, cross-field rules) is checked where the body is translated
(router/openai_protocol.py).

Types are strict: JSON `true` is not the integer 1, `"3"` is not a number, a float is not an
integer, and numbers are finite. Unknown fields are accepted as vLLM accepts them and left out
of the models; the door names them in X-Ignored-Fields (router/ignored_fields.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from pydantic import (
    AllowInfNan,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictStr,
    ValidationError,
)

from common.limits import MAX_CHOICES, MAX_LOGPROBS

INT32_MAX = 2**31 - 1
FLOAT_MAX = 3.4028234663852886e38  # the largest float32 (SamplingParams' floats)

Int32 = Annotated[int, Strict(), Field(ge=-INT32_MAX - 1, le=INT32_MAX)]
Number = Annotated[float, Strict(), AllowInfNan(False), Field(le=FLOAT_MAX, ge=-FLOAT_MAX)]
TokenId = Annotated[int, Strict(), Field(ge=0, lt=2**32)]
Logprobs = Annotated[int, Strict(), Field(ge=0, le=MAX_LOGPROBS)]
Choices = Annotated[int, Strict(), Field(ge=1, le=MAX_CHOICES)]


def _listed(value: Any) -> Any:
    """`stop`: one string stands for a list of one."""
    return [value] if isinstance(value, str) else value


class _Open(BaseModel):
    # Unknown fields are left out of the model (not refused): router/ignored_fields.py names them
    # from the raw body. Keeping them would have pydantic check their names, and a name holding a
    # lone surrogate is no valid string to it (a 400 the door does not give for unknown fields).
    model_config = ConfigDict(extra="ignore", frozen=True)


class StreamOptions(_Open):
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None  # vLLM's: usage on every chunk too


class _Sampling(_Open):
    """Fields both endpoints take."""

    model: StrictStr | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: Int32 | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: Int32 | None = None
    seed: Annotated[int, Strict(), Field(ge=0, lt=2**64)] | None = None
    stop: Annotated[list[StrictStr] | None, BeforeValidator(_listed)] = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool | None = None
    cache_salt: StrictStr | None = None
    n: Choices | None = None
    presence_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[Number, Field(gt=0)] | None = None
    min_tokens: Annotated[Int32, Field(ge=0)] | None = None
    min_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    logit_bias: dict[str, Any] | None = None  # keys and values: router/openai_protocol.py
    prompt_logprobs: Logprobs | None = None  # vLLM's: the prompt tokens' own log probabilities


class CompletionBody(_Sampling):
    """POST /v1/completions."""

    prompt: Any = None  # a string, strings, token ids or lists of them: router/openai_protocol.py
    best_of: Choices | None = None
    echo: StrictBool | None = None
    logprobs: Logprobs | None = None
    suffix: StrictStr | None = None


class ChatBody(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[dict[str, Any]] | None = None  # roles and content parts: router/openai_protocol.py
    max_completion_tokens: Int32 | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Logprobs | None = None


class TokenizeBody(_Open):
    """POST /tokenize (vLLM's)."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool | None = None
    return_token_strs: StrictBool | None = None


class DetokenizeBody(_Open):
    """POST /detokenize (vLLM's)."""

    model: StrictStr | None = None
    tokens: list[TokenId] | None = None


class BodyValueError(ValueError):
    """A value does not fit its field: `param` names the body's field, the message the exact place
    (`messages[0].role`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


_M = TypeVar("_M", bound=BaseModel)


def param_name(loc: tuple[int | str, ...]) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'."""
    name = ""
    for part in loc:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name


def parse(model: type[_M], body: dict[str, Any], quote: Callable[[Any], str] = repr) -> _M:
    """`body` as `model`; BodyValueError naming the first field whose value does not fit (quoted
    with `quote`, which keeps it short)."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        error = e.errors(include_url=False)[0]
        param = param_name(error["loc"])
        # The param is the body's field (as OpenAI's errors name it); the message the exact place.
        raise BodyValueError(f"'{param}': {error['msg']}, got {quote(error['input'])}", str(error["loc"][0])) from None
