"""Unit tests of the OpenAI <-> radixkv translation (router/openai_protocol.py, re-exported by
router/openai_api.py), no server."""

from __future__ import annotations

import json

import pytest
from openai.types import Model
from openai.types.chat import ChatCompletionChunk

from protos import model_pb2
from router import errors
from router.errors import RouterError
from router.openai_api import OpenAIError, Reply, chat_request, completion_request, sse
from router.openai_protocol import detokenize_request, model_card, tokenize_json, tokenize_request


def one_completion(body: dict) -> model_pb2.GenerateRequest:
    """The one Generate of a one-prompt completions body."""
    (request,) = completion_request(body).generate
    return request


def one_chat(body: dict) -> model_pb2.GenerateRequest:
    (request,) = chat_request(body).generate
    return request


def test_completion_params_map_to_sampling() -> None:
    door = completion_request({
        "model": "m", "prompt": "Hi", "max_tokens": 7, "temperature": 0, "top_p": 0.5, "seed": 3,
        "stop": "\n", "n": 1, "user": "u", "cache_salt": "tenant-1", "top_k": 4, "stream": True,
        "stream_options": {"include_usage": True}, "presence_penalty": 0, "logit_bias": {},
    })
    request, stream, include_usage = door.generate[0], door.stream, door.include_usage
    assert request.prompt == "Hi" and request.namespace == "tenant-1"
    s = request.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, list(s.stop), s.top_k) == (7, 0.0, 0.5, 3, ["\n"], 4)
    assert s.HasField("temperature") and (stream, include_usage) == (True, True)


def test_completion_defaults_and_prompt_forms() -> None:
    door = completion_request({"model": "m", "prompt": ["only one"]})
    request, stream, include_usage = door.generate[0], door.stream, door.include_usage
    assert request.prompt == "only one" and request.sampling.max_tokens == 16  # OpenAI's default
    assert not request.sampling.HasField("temperature") and (stream, include_usage) == (False, False)
    request = one_completion({"model": "m", "prompt": [1, 2, 3], "stop": ["a", "b"]})
    assert list(request.token_ids.ids) == [1, 2, 3] and list(request.sampling.stop) == ["a", "b"]
    request = one_completion({"model": "m", "prompt": [[4, 5]], "ignore_eos": True,
                                        "stop_token_ids": [9]})
    assert list(request.token_ids.ids) == [4, 5] and request.sampling.ignore_eos
    assert list(request.sampling.stop_token_ids) == [9]


def test_chat_messages_and_max_completion_tokens() -> None:
    request = one_chat({"model": "m", "max_tokens": 5, "max_completion_tokens": 9, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None},
    ]})
    assert [(m.role, m.content) for m in request.chat.messages] == [
        ("system", "Be brief."), ("user", "Hi there"), ("assistant", "")]
    assert request.sampling.max_tokens == 9
    request = one_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert not request.sampling.HasField("max_tokens")  # the model service's default


def test_chat_tool_turns_reach_the_template() -> None:
    calls = [{"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]
    request = one_chat({"model": "m", "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "name": "weather", "content": "-3 C"},
    ]})
    assistant, tool = request.chat.messages[1], request.chat.messages[2]
    assert json.loads(assistant.tool_calls_json) == calls and not assistant.tool_call_id
    assert (tool.tool_call_id, tool.name, tool.content, tool.tool_calls_json) == ("call_1", "weather", "-3 C", "")
    with pytest.raises(OpenAIError) as info:
        one_chat({"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"function": 3}]}]})
    assert info.value.status == 400 and info.value.param == "messages[0].tool_calls"


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 65}, "n"),
    ({"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
    ({"prompt": "x", "best_of": 3, "stream": True}, "best_of"),
    ({"prompt": "x", "echo": 1}, "echo"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": "yes"}}, "stream_options"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "frequency_penalty": -2.5}, "frequency_penalty"),
    ({"prompt": "x", "logit_bias": {"1.5": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"4294967296": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"3": True}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"3": float("nan")}}, "logit_bias"),
    ({"prompt": "x", "repetition_penalty": -1}, "repetition_penalty"),
    ({"prompt": "x", "min_p": -0.1}, "min_p"),
    ({"prompt": "x", "min_tokens": 2**31}, "min_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": ["a", [1]]}, "prompt"),
    ({"prompt": [[1], []]}, "prompt"),
    ({"prompt": ["x"] * 1025}, "prompt"),
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
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"},
      "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
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
    # One chunk per token step, "" while a character is incomplete; the finish on the last token's.
    assert [c["choices"][0]["text"] for c in chunks] == ["Hel", "", "!"]
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
    (first,) = reply.first_chunks()
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"
    chunks = [c for m in _messages() for c in reply.add(m)]
    assert [c["choices"][0]["delta"] for c in chunks] == [{"content": "Hel"}, {"content": ""}, {"content": "!"}]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "stop"]
    for chunk in [first, *chunks, reply.usage_chunk()]:
        ChatCompletionChunk.model_validate(chunk)
    body = reply.response()
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-abc"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hel!"}


def test_a_finish_without_tokens_is_a_chunk_of_its_own() -> None:
    """An abort ends the stream with a message that carries no token: its finish still arrives."""
    reply = Reply(chat=True, model="m", request_id="abc")
    assert reply.add(model_pb2.GenerateResponse()) == []  # nothing to tell
    chunks = reply.add(model_pb2.GenerateResponse(finish_reason=model_pb2.FINISH_REASON_ABORT))
    assert [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks] == [({}, "abort")]


def test_penalties_and_vllm_sampling_fields_map_to_sampling() -> None:
    for translate, body in ((one_completion, {"prompt": "x"}),
                            (one_chat, {"messages": [{"role": "user", "content": "x"}]})):
        request = translate({"model": "m", **body, "max_tokens": 8, "presence_penalty": -2, "frequency_penalty": 2,
                                   "repetition_penalty": 1.3, "min_tokens": 8, "min_p": 1,
                                   "logit_bias": {"0": -100, "4294967295": 100, "17": 0.5}})
        s = request.sampling
        assert (s.presence_penalty, s.frequency_penalty, s.min_tokens, s.min_p) == (-2, 2, 8, 1)
        assert s.repetition_penalty == pytest.approx(1.3) and s.HasField("repetition_penalty")
        assert dict(s.logit_bias) == {0: -100, 2**32 - 1: 100, 17: 0.5}
    request = one_completion({"model": "m", "prompt": "x", "logit_bias": None, "min_p": None})
    assert not request.sampling.HasField("repetition_penalty") and not request.sampling.logit_bias


def test_model_card_has_vllms_fields() -> None:
    info = model_pb2.ModelInfoResponse(model_name="org/m", max_context_tokens=2048, model_fingerprint="f")
    card = model_card(info, 1700000000)
    assert Model.model_validate(card).id == "org/m"
    assert (card["root"], card["parent"], card["permission"], card["max_model_len"]) == ("org/m", None, [], 2048)


def test_tokenize_and_detokenize_requests() -> None:
    request, strs = tokenize_request({"prompt": "Hi", "add_special_tokens": True})
    assert request.text == "Hi" and not strs
    request, strs = tokenize_request({"messages": [{"role": "user", "content": "Hi"}], "return_token_strs": True,
                                      "add_generation_prompt": True, "add_special_tokens": False})
    assert [m.content for m in request.chat.messages] == ["Hi"] and strs
    answer = model_pb2.TokenizeResponse(token_ids=[5, 6], tokens=["a", "b"])
    assert tokenize_json(answer, 99, True) == {"count": 2, "max_model_len": 99, "tokens": [5, 6],
                                               "token_strs": ["a", "b"]}
    assert list(detokenize_request({"tokens": [1, 2]}).token_ids) == [1, 2]
    with pytest.raises(OpenAIError) as info:
        tokenize_request({"prompt": "\ud800"})
    assert info.value.code == "invalid_unicode"
    with pytest.raises(OpenAIError) as info:
        tokenize_request({"prompt": "x", "messages": [{"role": "user", "content": "y"}]})
    assert info.value.param == "prompt"


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


def test_output_formats_and_tools_reach_the_request() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    request = one_chat({**chat, "response_format": {"type": "json_object"}})
    assert request.sampling.structured_output.json_object
    request = one_completion({"model": "m", "prompt": "x", "structured_outputs": {"regex": "[a-z]+"}})
    assert request.sampling.structured_output.regex == "[a-z]+"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    request = one_chat({**chat, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert request.sampling.structured_output.json_schema == '{"type": "object"}'
    assert json.loads(request.chat.tools_json) == tools
    request = one_chat({**chat, "tools": tools, "tool_choice": "none"})
    assert not request.chat.tools_json and not request.sampling.HasField("structured_output")
    request = one_chat({**chat, "tools": tools})  # auto: the template sees them, the output is free
    assert request.chat.tools_json and not request.sampling.HasField("structured_output")


def _tool_messages(text: str) -> list[model_pb2.GenerateResponse]:
    half = len(text) // 2
    return [model_pb2.GenerateResponse(text=text[:half], token_ids=[1]),
            model_pb2.GenerateResponse(text=text[half:], token_ids=[2], finish_reason=model_pb2.FINISH_REASON_STOP,
                                       usage=model_pb2.Usage(prompt_tokens=3, completion_tokens=2))]


def test_tool_calls_in_responses_and_streams() -> None:
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    from router.tool_calls import plan_tools

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    named = plan_tools({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}})
    reply = Reply(True, "m", "r1", tools=named)
    chunks = [c for m in _tool_messages('{"a": 1}') for c in reply.add(m)]
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    calls = [c["choices"][0]["delta"].get("tool_calls") for c in chunks]
    assert calls[0][0]["function"]["name"] == "f" and calls[0][0]["id"].startswith("call_")
    assert "".join(c[0]["function"]["arguments"] for c in calls if c) == '{"a": 1}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    body = reply.response()
    ChatCompletion.model_validate(body)
    message = body["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'
    assert body["choices"][0]["finish_reason"] == "tool_calls"

    required = plan_tools({"tools": tools, "tool_choice": "required"})
    reply = Reply(True, "m", "r2", tools=required)
    chunks = [c for m in _tool_messages('[{"name": "f", "parameters": {"b": 2}}]') for c in reply.add(m)]
    assert len(chunks) == 1  # decided on the whole output
    ChatCompletionChunk.model_validate(chunks[0])
    (call,) = chunks[0]["choices"][0]["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "f", "arguments": '{"b": 2}'}
    assert chunks[0]["choices"][0]["finish_reason"] == "tool_calls"

    auto = plan_tools({"tools": tools})
    reply = Reply(True, "m", "r3", tools=auto)
    for m in _tool_messages("just text"):
        reply.add(m)
    body = reply.response()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "just text"}
    assert body["choices"][0]["finish_reason"] == "stop"


def _logprob_messages() -> list[model_pb2.GenerateResponse]:
    def position(token_id: int, token: str, logprob: float) -> model_pb2.PositionLogprobs:
        chosen = model_pb2.TokenLogprob(token_id=token_id, logprob=logprob, token=token,
                                        token_bytes=token.encode(), rank=1)
        alt = model_pb2.TokenLogprob(token_id=9, logprob=-3.0, token="z", token_bytes=b"z", rank=2)
        return model_pb2.PositionLogprobs(chosen=chosen, top=[chosen, alt])
    return [model_pb2.GenerateResponse(text="Hi", token_ids=[1], logprobs=[position(1, "Hi", -0.5)]),
            model_pb2.GenerateResponse(text=" there", token_ids=[2], logprobs=[position(2, " there", -0.25)],
                                       finish_reason=model_pb2.FINISH_REASON_LENGTH,
                                       usage=model_pb2.Usage(prompt_tokens=1, completion_tokens=2))]


def test_logprobs_requests_and_replies() -> None:
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    request = one_completion({"model": "m", "prompt": "x", "logprobs": 3})
    assert request.sampling.logprobs == 3
    request = one_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                  "top_logprobs": 2})
    assert request.sampling.logprobs == 2
    request = one_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert not request.sampling.HasField("logprobs")

    chat = Reply(True, "m", "r", logprobs=True)
    chunks = [c for m in _logprob_messages() for c in chat.add(m)]
    assert [c["choices"][0]["logprobs"]["content"][0]["token"] for c in chunks] == ["Hi", " there"]
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    body = chat.response()
    ChatCompletion.model_validate(body)
    content = body["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["logprob"], c["bytes"]) for c in content] == [("Hi", -0.5, list(b"Hi")),
                                                                         (" there", -0.25, list(b" there"))]
    assert [t["token"] for t in content[1]["top_logprobs"]] == [" there", "z"]

    completion = Reply(False, "m", "r", logprobs=True)
    for m in _logprob_messages():
        completion.add(m)
    body = completion.response()
    Completion.model_validate(body)
    assert body["choices"][0]["logprobs"] == {"tokens": ["Hi", " there"], "token_logprobs": [-0.5, -0.25],
                                              "top_logprobs": [{"Hi": -0.5, "z": -3.0}, {" there": -0.25, "z": -3.0}],
                                              "text_offset": [0, 2]}
    plain = Reply(False, "m", "r")
    for m in _logprob_messages():
        plain.add(m)
    assert plain.response()["choices"][0]["logprobs"] is None  # not asked for: none


def test_unknown_fields_with_odd_names_are_accepted() -> None:
    """Unknown fields are not the models' business (router/ignored_fields.py names them): not even
    a name pydantic could not read as a string (a lone surrogate) is refused."""
    door = completion_request({"model": "m", "prompt": "x", "\ud800": 1, "k" * 10_000: [1],
                               "stream": True, "stream_options": {"\udfff": True, "include_usage": True}})
    assert door.include_usage and door.generate[0].prompt == "x"
    (request,) = chat_request({"model": "m", "messages": [{"role": "user", "content": "x", "\ud800": 1}]}).generate
    assert request.chat.messages[0].content == "x"
