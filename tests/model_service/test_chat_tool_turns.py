"""Chat tool turns reach the chat template: an assistant turn's tool calls (their arguments as
objects, as vLLM hands them to templates) and a tool turn's call id and name, through the real
replica's Tokenize (Generate renders chats the same way), on the tiny model with a template that
shows them."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import grpc
import pytest

from protos import model_pb2, model_pb2_grpc
from tests.model_service.checks import expect_status
from tests.services import serve_model

TEMPLATE = (
    "{%- for m in messages -%}<|{{ m.role }}|>{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}[call {{ c.function.name }} city={{ c.function.arguments.city }}]{% endfor %}"
    "{%- if m.tool_call_id %}[answers {{ m.tool_call_id }} from {{ m.name }}]{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tool_template_replica(cache_service, tiny_dir, tmp_path_factory) -> Iterator[model_pb2_grpc.ModelServiceStub]:
    folder = tmp_path_factory.mktemp("tiny-tool-template") / "model"
    shutil.copytree(tiny_dir, folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    yield from serve_model(cache_service.addr, "--model", str(folder), "--worker-id", "tiny-tool-template",
                           "--num-blocks", "64")


def _text(stub, chat: model_pb2.ChatMessages) -> str:
    ids = list(stub.Tokenize(model_pb2.TokenizeRequest(chat=chat), timeout=30).token_ids)
    return stub.Detokenize(model_pb2.DetokenizeRequest(token_ids=ids), timeout=30).text


def test_tool_calls_and_tool_answers_are_rendered(tool_template_replica) -> None:
    calls = [{"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]
    chat = model_pb2.ChatMessages(messages=[
        model_pb2.ChatMessage(role="user", content="Weather?"),
        model_pb2.ChatMessage(role="assistant", tool_calls_json=json.dumps(calls)),
        model_pb2.ChatMessage(role="tool", content="-3 C", tool_call_id="call_1", name="weather"),
    ])
    text = _text(tool_template_replica, chat)
    assert "<|assistant|>[call weather city=Oslo]" in text  # arguments reached the template as an object
    assert "<|tool|>-3 C[answers call_1 from weather]" in text


def test_bad_tool_calls_json_is_invalid_argument(tool_template_replica) -> None:
    chat = model_pb2.ChatMessages(messages=[model_pb2.ChatMessage(role="assistant", tool_calls_json="{not json")])
    expect_status(lambda: tool_template_replica.Tokenize(model_pb2.TokenizeRequest(chat=chat), timeout=30),
                  grpc.StatusCode.INVALID_ARGUMENT, "tool_calls_json")



