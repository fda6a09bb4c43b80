"""Unit tests of the OpenAI <-> radixkv translation (router/openai_api.py), no server."""

from __future__ import annotations

import json

import pytest

from protos import model_pb2
from router import errors
from router.errors import RouterError
from router.openai_api import OpenAIError, Reply, chat_request, completion_request, sse


def test_completion_params_map_to_sampling() -> None:
    request, stream, include_usage = completion_request({
        "model": "m", "prompt": "Hi", "max_tokens": 7, "temperature": 0, "top_p": 0.5, "seed": 3,
        "stop": "\n", "n": 1, "user": "u", "cache_salt": "tenant-1", "top_k": 4, "stream": True,
        "stream_options": {"include_usage": True}, "presence_penalty": 0, "logit_bias": {},
    })
    assert request.prompt == "Hi" and request.namespace == "tenant-1"
    s = request.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, list(s.stop), s.top_k) == (7, 0.0, 0.5, 3, ["\n"], 4)
    assert s.HasField("temperature") and (stream, include_usage) == (True, True)


def test_completion_defaults_and_prompt_forms() -> None:
    request, stream, include_usage = completion_request({"model": "m", "prompt": ["only one"]})
    assert request.prompt == "only one" and request.sampling.max_tokens == 16  # OpenAI's default
    assert not request.sampling.HasField("temperature") and (stream, include_usage) == (False, False)
    request, _, _ = completion_request({"model": "m", "prompt": [1, 2, 3], "stop": ["a", "b"]})
    assert list(request.token_ids.ids) == [1, 2, 3] and list(request.sampling.stop) == ["a", "b"]
    request, _, _ = completion_request({"model": "m", "prompt": [[4, 5]], "ignore_eos": True,
                                        "stop_token_ids": [9]})
    assert list(request.token_ids.ids) == [4, 5] and request.sampling.ignore_eos
    assert list(request.sampling.stop_token_ids) == [9]


def test_chat_messages_and_max_completion_tokens() -> None:
    request, _, _ = chat_request({"model": "m", "max_tokens": 5, "max_completion_tokens": 9, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None},
    ]})
    assert [(m.role, m.content) for m in request.chat.messages] == [
        ("system", "Be brief."), ("user", "Hi there"), ("assistant", "")]
    assert request.sampling.max_tokens == 9
    request, _, _ = chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert not request.sampling.HasField("max_tokens")  # the model service's default


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "logprobs": 2}, "logprobs"),
    ({"prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({}, "prompt"),
])
def test_bad_completion_requests_are_400_naming_the_param(body: dict, param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        completion_request({"model": "m", **body})
    assert info.value.status == 400 and info.value.param == param
    error = info.value.body()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
])
def test_bad_chat_requests_are_400(body: dict, param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        chat_request({"model": "m", **body})
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize("code, message, status", [
    (errors.INVALID_ARGUMENT, "bad", 400),
    (errors.RESOURCE_EXHAUSTED, "waiting queue is full (4 requests)", 429),
    (errors.RESOURCE_EXHAUSTED, "prompt has 9000 tokens; the whole KV pool holds 4096 tokens", 400),
    (errors.UNAVAILABLE, "no model replica is reachable", 503),
    (errors.DEADLINE_EXCEEDED, "late", 504),
    (errors.NOT_FOUND, "x", 404),
    (errors.INTERNAL, "boom", 500),
])
def test_router_errors_map_to_http_statuses(code: str, message: str, status: int) -> None:
    error = OpenAIError.from_router(RouterError(code, message))
    assert error.status == status
    assert error.body() == {"error": {"message": message, "type": error.type, "param": None, "code": code.lower()}}


def _messages() -> list[model_pb2.GenerateResponse]:
    final = model_pb2.GenerateResponse(text="!", token_ids=[3], finish_reason=model_pb2.FINISH_REASON_STOP)
    # cached_prompt_tokens is the sum of the tier split (docs/tiers.md): the OpenAI door reports the sum
    final.usage.CopyFrom(model_pb2.Usage(prompt_tokens=10, cached_prompt_tokens=8, completion_tokens=3,
                                         cached_device_tokens=4, cached_host_tokens=3, cached_disk_tokens=1))
    return [model_pb2.GenerateResponse(text="Hel", token_ids=[1]), model_pb2.GenerateResponse(token_ids=[2]), final]


def test_completion_reply_and_chunks() -> None:
    reply = Reply(chat=False, model="m", request_id="abc")
    chunks = [c for m in _messages() for c in reply.add(m)]
    assert [c["choices"][0]["text"] for c in chunks] == ["Hel", "!", ""]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "stop"]
    assert all(c["object"] == "text_completion" and c["id"] == "cmpl-abc" for c in chunks)
    body = reply.response()
    assert body["choices"][0]["text"] == "Hel!" and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                             "prompt_tokens_details": {"cached_tokens": 8}}
    usage = reply.usage_chunk()
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens_details"]["cached_tokens"] == 8


def test_chat_reply_and_chunks() -> None:
    reply = Reply(chat=True, model="m", request_id="abc")
    first = reply.first_chunk()
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"
    chunks = [c for m in _messages() for c in reply.add(m)]
    assert [c["choices"][0]["delta"] for c in chunks] == [{"content": "Hel"}, {"content": "!"}, {}]
    body = reply.response()
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-abc"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hel!"}


def test_sse_framing() -> None:
    assert sse("[DONE]") == b"data: [DONE]\n\n"
    assert json.loads(sse({"a": 1})[len(b"data: "):]) == {"a": 1}


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": 2**31}, "max_tokens"),
    ({"prompt": "x", "top_k": -(2**31) - 1}, "top_k"),
    ({"prompt": "x", "temperature": float("inf")}, "temperature"),
    ({"prompt": "x", "top_p": float("nan")}, "top_p"),
    ({"prompt": "\ud800"}, None),
    ({"prompt": "x", "stop": ["ok", "\udfff"]}, None),
    ({"prompt": "x", "cache_salt": "\ud800"}, None),
])
def test_out_of_range_and_lone_surrogates_are_400(body: dict, param: str | None) -> None:
    with pytest.raises(OpenAIError) as info:
        completion_request({"model": "m", **body})
    assert info.value.status == 400 and info.value.param == param
    if param is None:
        assert info.value.code == "invalid_unicode" and "surrogate" in info.value.message


def test_error_messages_quote_values_briefly() -> None:
    with pytest.raises(OpenAIError) as info:
        completion_request({"model": "m", "prompt": "x", "temperature": ["y" * 100_000, [[[[1]]]]] * 1000})
    assert len(info.value.message) < 300
    with pytest.raises(OpenAIError) as info:
        chat_request({"model": "m", "messages": [{"role": "\ud800", "content": "x"}]})
    assert info.value.code == "invalid_unicode"
