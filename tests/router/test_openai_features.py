"""Structured outputs, tool calls and log probabilities through the OpenAI door, with the
`openai` SDK against a real router and tiny-model replicas (processes on loopback). The tiny
model is random: formats hold because they are enforced, not because it is good at JSON."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.router.conftest import Fleet, http_url

pytestmark = pytest.mark.timeout(300)

FLAGS = {"type": "object", "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
         "required": ["ok", "level"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "set_level", "parameters": FLAGS}},
         {"type": "function", "function": {"name": "ping", "parameters": {
             "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["n"], "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "Set the level."}]


@pytest.fixture(scope="module")
def sdk(fleet: Fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=http_url(fleet.router) + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(sdk: openai.OpenAI) -> str:
    return sdk.models.list().data[0].id


def test_json_schema_and_vllm_forms(sdk, model) -> None:
    reply = sdk.chat.completions.create(model=model, messages=MESSAGES, max_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "flags", "schema": FLAGS}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), FLAGS)
    assert reply.choices[0].finish_reason == "stop"
    reply = sdk.completions.create(model=model, prompt="Pick:", max_tokens=10,
                                   extra_body={"structured_outputs": {"choice": ["red", "green"]}})
    assert reply.choices[0].text in ("red", "green")
    reply = sdk.completions.create(model=model, prompt="Code:", max_tokens=10, extra_body={"guided_regex": "[A-F]{3}"})
    assert len(reply.choices[0].text) == 3 and set(reply.choices[0].text) <= set("ABCDEF")
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.completions.create(model=model, prompt="x", max_tokens=4, extra_body={"guided_regex": "a(b"})
    assert "regex" in str(caught.value)


@pytest.mark.parametrize("stream", [False, True])
def test_named_and_required_tool_calls(sdk, model, stream: bool) -> None:
    choice = {"type": "function", "function": {"name": "ping"}}
    for tool_choice, names in ((choice, {"ping"}), ("required", {"ping", "set_level"})):
        if stream:
            calls: dict[int, dict] = {}
            finish = None
            for chunk in sdk.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                                     temperature=0, tool_choice=tool_choice, stream=True):
                for delta_call in chunk.choices[0].delta.tool_calls or []:
                    call = calls.setdefault(delta_call.index, {"name": "", "arguments": ""})
                    call["name"] += delta_call.function.name or ""
                    call["arguments"] += delta_call.function.arguments or ""
                finish = chunk.choices[0].finish_reason or finish
            found = list(calls.values())
        else:
            reply = sdk.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                                temperature=0, tool_choice=tool_choice)
            finish = reply.choices[0].finish_reason
            found = [{"name": c.function.name, "arguments": c.function.arguments}
                     for c in reply.choices[0].message.tool_calls]
        assert finish == "tool_calls" and found
        for call in found:
            assert call["name"] in names
            schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call["name"])
            jsonschema.validate(json.loads(call["arguments"]), schema)


def test_chat_and_completion_logprobs(sdk, model) -> None:
    reply = sdk.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=0,
                                        logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the top one
    reply = sdk.completions.create(model=model, prompt="Hello", max_tokens=5, temperature=0, logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    streamed = [c.choices[0].logprobs for c in sdk.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, stream=True) if c.choices]
    assert sum(len(lp.content) for lp in streamed if lp is not None) == 4
