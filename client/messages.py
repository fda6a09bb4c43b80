"""Builds the protobuf requests from plain Python arguments (shared by both clients)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypedDict

from protos import model_pb2

ChatMessage = Mapping[str, str]
"""A chat message: ``{"role": "user", "content": "Hi"}``."""


class GenerateOptions(TypedDict, total=False):
    """Keyword options of ``generate()`` / ``stream()`` besides the prompt and timeout.

    Give exactly one input: the ``prompt`` argument, ``token_ids`` or ``messages`` (chat,
    rendered with the model's chat template). Unset sampling values take the server's
    defaults (temperature 1.0, top_p 1.0, max_tokens 128; the penalties, ``logit_bias``,
    ``min_tokens`` and ``min_p`` off). Their semantics: ``SamplingParams`` in docs/grpc-api.md.
    ``logprobs`` (0-20): each generated token's log probability and that many alternatives;
    ``prompt_logprobs`` (0-20): the same for the prompt's tokens (a full prefill: see
    docs/grpc-api.md); ``n`` (1-64): choices forked from one prefill (with ``seed`` s, choice i
    samples as a single request with seed s + i would).
    """

    token_ids: Sequence[int]
    messages: Sequence[ChatMessage]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: Sequence[str]
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: Mapping[int, float]
    min_tokens: int
    min_p: float
    logprobs: int
    prompt_logprobs: int
    n: int
    namespace: str
    request_id: str


def chat_messages(messages: Sequence[ChatMessage]) -> model_pb2.ChatMessages:
    return model_pb2.ChatMessages(
        messages=[model_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages]
    )


def generate_request(prompt: str | None, options: GenerateOptions) -> model_pb2.GenerateRequest:
    """The GenerateRequest for ``prompt`` (or ``options``' token_ids / messages)."""
    inputs = [x for x in (prompt, options.get("token_ids"), options.get("messages")) if x is not None]
    if len(inputs) != 1:
        raise ValueError("give exactly one of prompt, token_ids= or messages=")
    sampling = model_pb2.SamplingParams(
        top_k=options.get("top_k") or 0,
        stop=list(options.get("stop") or ()),
        stop_token_ids=list(options.get("stop_token_ids") or ()),
        ignore_eos=bool(options.get("ignore_eos")),
        presence_penalty=options.get("presence_penalty") or 0.0,
        frequency_penalty=options.get("frequency_penalty") or 0.0,
        logit_bias=dict(options.get("logit_bias") or {}),
        min_tokens=options.get("min_tokens") or 0,
        min_p=options.get("min_p") or 0.0,
    )
    if options.get("n") is not None:
        if options["n"] < 0:  # the server judges the range (1-64); a uint32 cannot even hold this
            raise ValueError(f"n must be >= 1, got {options['n']}")
        sampling.n = options["n"]
    for name in ("temperature", "top_p", "seed", "max_tokens", "repetition_penalty", "logprobs", "prompt_logprobs"):
        value = options.get(name)
        if value is not None:
            setattr(sampling, name, value)
    request = model_pb2.GenerateRequest(
        sampling=sampling,
        namespace=options.get("namespace") or "",
        request_id=options.get("request_id") or "",
    )
    if prompt is not None:
        request.prompt = prompt
    elif options.get("token_ids") is not None:
        request.token_ids.ids.extend(options["token_ids"])
    else:
        request.chat.CopyFrom(chat_messages(options["messages"]))
    return request


def single_choice(options: GenerateOptions) -> None:
    """``generate()`` joins one choice: n > 1 belongs to ``generate_choices()``."""
    if (options.get("n") or 1) > 1:
        raise ValueError("generate() returns one choice: use generate_choices() for n > 1")


def tokenize_request(text: str | None, messages: Sequence[ChatMessage] | None) -> model_pb2.TokenizeRequest:
    if (text is None) == (messages is None):
        raise ValueError("give exactly one of text or messages=")
    if text is not None:
        return model_pb2.TokenizeRequest(text=text)
    return model_pb2.TokenizeRequest(chat=chat_messages(messages or ()))
