"""Structured outputs through the real gRPC API on the bundled model: every kind's output is
what it names (JSON parses and validates, greedy and sampled), the request ends with the format,
bad formats are INVALID_ARGUMENT, and unconstrained requests in the same batch are unchanged."""

from __future__ import annotations

import concurrent.futures
import json
import re

import grpc
import jsonschema
import pytest

from protos import model_pb2
from tests.model_service.generation import generate, greedy

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
CITIES = {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 2, "maxItems": 3}
FLAGS = {"type": "object", "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
         "required": ["ok", "level"], "additionalProperties": False}
SCHEMAS = [PERSON, CITIES, FLAGS]


def chat(text: str) -> model_pb2.ChatMessages:
    return model_pb2.ChatMessages(messages=[model_pb2.ChatMessage(role="user", content=text)])


def run(stub, text: str, structured: model_pb2.StructuredOutput, **sampling):
    request = model_pb2.GenerateRequest(chat=chat(text), sampling=model_pb2.SamplingParams(
        structured_output=structured, max_tokens=sampling.pop("max_tokens", 160), **sampling))
    messages = list(stub.Generate(request, timeout=300))
    return "".join(m.text for m in messages), messages[-1]


@pytest.mark.parametrize("schema", SCHEMAS)
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "seed": 7}])
def test_json_schema_output_validates(model_stub, schema, sampling) -> None:
    text, last = run(model_stub, "Reply with JSON about a person and some cities.",
                     model_pb2.StructuredOutput(json_schema=json.dumps(schema)), **sampling)
    assert last.finish_reason == model_pb2.FINISH_REASON_STOP, text
    jsonschema.validate(json.loads(text), schema)


def test_json_object_regex_choice_grammar(model_stub) -> None:
    # A free object lets a small model ramble inside a key until max_tokens under some batch
    # numerics: the prompt asks for one it can copy.
    text, last = run(model_stub, 'Reply with this JSON object and nothing else: {"name": "Tom", "age": 3}',
                     model_pb2.StructuredOutput(json_object=True), temperature=0.0)  # sampled, it may ramble
    assert last.finish_reason == model_pb2.FINISH_REASON_STOP, text
    assert isinstance(json.loads(text), dict)
    text, last = run(model_stub, "What is 12 times 12?", model_pb2.StructuredOutput(regex=r"[0-9]{1,4}"))
    assert re.fullmatch(r"[0-9]{1,4}", text) and last.finish_reason == model_pb2.FINISH_REASON_STOP
    choices = ["Paris", "London", "Rome"]
    text, _ = run(model_stub, "The capital of France is?",
                  model_pb2.StructuredOutput(choice=model_pb2.Choices(choices=choices)))
    assert text in choices
    text, _ = run(model_stub, "Answer yes or no: is the sky blue?",
                  model_pb2.StructuredOutput(grammar='root ::= "yes" | "no"'))
    assert text in ("yes", "no")


def test_max_tokens_cuts_a_format_short(model_stub) -> None:
    text, last = run(model_stub, "Describe a person as JSON.",  # needs more than 3 tokens to be complete
                     model_pb2.StructuredOutput(json_schema=json.dumps(PERSON)), max_tokens=3)
    assert last.finish_reason == model_pb2.FINISH_REASON_LENGTH and text.startswith('{"')


@pytest.mark.parametrize("structured", [
    model_pb2.StructuredOutput(json_schema="{not json"),
    model_pb2.StructuredOutput(regex="a(b"),
    model_pb2.StructuredOutput(grammar="start: missing_rule"),
    model_pb2.StructuredOutput(choice=model_pb2.Choices()),
])
def test_bad_formats_are_invalid_argument(model_stub, structured) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        run(model_stub, "x", structured)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details()


def test_unconstrained_requests_beside_guided_ones_are_unchanged(model_stub, reference_model) -> None:
    tokenizer = reference_model.tokenizer
    prompts = [tokenizer(p).input_ids for p in ("The capital of France is", "List three colours:")]
    alone = [greedy(model_stub, ids, 24).token_ids for ids in prompts]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        guided = [pool.submit(run, model_stub, "JSON please.", model_pb2.StructuredOutput(json_schema=json.dumps(s)))
                  for s in SCHEMAS]
        free = [pool.submit(generate, model_stub, ids, max_tokens=24, temperature=0.0) for ids in prompts]
        assert [f.result().token_ids for f in free] == alone
        for future, schema in zip(guided, SCHEMAS, strict=True):
            jsonschema.validate(json.loads(future.result()[0]), schema)


TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def test_chat_tools_reach_the_template(model_stub, reference_model) -> None:
    messages = [{"role": "user", "content": "What time is it?"}]
    request = model_pb2.TokenizeRequest(chat=model_pb2.ChatMessages(
        messages=[model_pb2.ChatMessage(**m) for m in messages], tools_json=json.dumps(TOOLS)))
    ids = list(model_stub.Tokenize(request, timeout=30).token_ids)
    expected = reference_model.tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True,
                                                             tokenize=True, return_dict=True).input_ids
    assert ids == list(expected)
    for bad in ("not json", '{"a": 1}', "[1, 2]"):
        request.chat.tools_json = bad
        with pytest.raises(grpc.RpcError) as caught:
            model_stub.Tokenize(request, timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tools_json" in caught.value.details()
