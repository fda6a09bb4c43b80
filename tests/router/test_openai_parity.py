"""What vLLM's benchmark client (``vllm bench serve --backend openai``) needs of the OpenAI door
(issue 30), through real processes on loopback: /v1/models entries with vLLM's fields, vLLM's
/tokenize and /detokenize (and the Detokenize RPC through the router), one stream event per
token step with the finish reason on the last token's, and the sampling fields vLLM and OpenAI
take reaching the replica. Responses and chunks are validated with the ``openai`` package's
own types.

A recording replica (an in-process ModelService behind a router of its own) captures the
GenerateRequest the router forwards and answers with a scripted stream, so that the door's
handling of empty text deltas is checked on cue (a random model cannot be made to split a
character when wanted)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from client import AsyncRadixKVClient, RadixKVClient, RadixKVError
from protos import model_pb2, model_pb2_grpc
from tests.client.helpers import run_cli
from tests.router.conftest import Fleet, StandInReplica, free_port, http_url, serving
from tests.services import Running, start_router

pytestmark = pytest.mark.timeout(180)

# The scripted stream: (text, token ids) per message; the last one finishes (LENGTH).
SCRIPT = [("He", [11]), ("", [12]), ("", [13]), ("llo", [14]), ("!", [15])]


class RecordingReplica(StandInReplica):
    """A ModelService that records each GenerateRequest and answers with SCRIPT, serving the real
    replica's model info and tokenizer so that a router takes it for a replica of the model."""

    pool_id = "recording"

    def __init__(self, real_addr: str) -> None:
        super().__init__(real_addr)
        self.requests: list[model_pb2.GenerateRequest] = []

    def Generate(self, request, context):
        with self._lock:
            self.requests.append(request)
        for i, (text, ids) in enumerate(SCRIPT):
            message = model_pb2.GenerateResponse(request_id=request.request_id, text=text, token_ids=ids)
            if i == len(SCRIPT) - 1:
                message.finish_reason = model_pb2.FINISH_REASON_LENGTH
                message.usage.CopyFrom(model_pb2.Usage(prompt_tokens=3, completion_tokens=len(SCRIPT),
                                                       served_by=self.addr))
            yield message


@pytest.fixture(scope="module")
def recording(fleet: Fleet) -> Iterator[tuple[RecordingReplica, Running]]:
    """The recording replica and a router (HTTP door) in front of it alone."""
    with serving(RecordingReplica(fleet.a.addr), workers=4) as servicer:
        # No cache manager (a dead port): it would name the fleet's real replicas to route to.
        router = start_router(f"127.0.0.1:{free_port()}", "--http-port", "0", "--check-interval", "0.3",
                              "--replica", servicer.addr)
        try:
            yield servicer, router
        finally:
            router.process.stop(10.0)


@pytest.fixture(scope="module")
def url(fleet: Fleet) -> str:
    return http_url(fleet.router)


@pytest.fixture(scope="module")
def model_name(url: str) -> str:
    return get(url, "/v1/models")[1]["data"][0]["id"]


def get(url: str, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + path, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def post(url: str, path: str, body: dict) -> tuple[int, dict | bytes]:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            raw = reply.read()
            kind = reply.headers.get("content-type", "")
            return reply.status, (json.loads(raw) if kind.startswith("application/json") else raw)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def events(raw: bytes) -> list[dict | str]:
    """The data of each server-sent event, JSON decoded except [DONE]."""
    out: list[dict | str] = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def completion_chunk(data: dict) -> Completion:
    """A /v1/completions stream chunk validated as openai.types.Completion, whose finish_reason
    is not optional although OpenAI's own streams send null until the last token: null is
    checked here, then validated as "stop"."""
    choices = []
    for choice in data["choices"]:
        assert choice["finish_reason"] in (None, "stop", "length")
        choices.append({**choice, "finish_reason": choice["finish_reason"] or "stop"})
    return Completion.model_validate({**data, "choices": choices})


# ---------------------------------------------------------------------- /v1/models


def test_model_entries_have_vllms_fields(url: str) -> None:
    status, body = get(url, "/v1/models")
    assert status == 200
    card = body["data"][0]
    for name in ("id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"):
        assert name in card, name
    assert card["root"] == card["id"] and card["parent"] is None and card["permission"] == []
    assert card["max_model_len"] > 0 and card["created"] > 0
    Model.model_validate(card)
    status, one = get(url, "/v1/models/" + card["id"])
    assert status == 200 and one == card


# ---------------------------------------------------------------------- /tokenize, /detokenize


def test_tokenize_and_detokenize_round_trip(url: str, model_name: str) -> None:
    status, body = post(url, "/tokenize", {"model": model_name, "prompt": "Hello world 🎉",
                                           "return_token_strs": True})
    assert status == 200, body
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] > 0
    assert len(body["token_strs"]) == body["count"] and all(isinstance(s, str) for s in body["token_strs"])
    status, back = post(url, "/detokenize", {"model": model_name, "tokens": body["tokens"]})
    assert status == 200 and back == {"prompt": "Hello world 🎉"}
    # No model named: fine (vLLM's model is optional there); no token strings unless asked.
    status, plain = post(url, "/tokenize", {"prompt": "Hello world 🎉"})
    assert status == 200 and plain["tokens"] == body["tokens"] and plain["token_strs"] is None


def test_tokenize_chat_messages_counts_what_chat_completions_count(url: str, model_name: str) -> None:
    messages = [{"role": "user", "content": "Name a color."}]
    status, body = post(url, "/tokenize", {"model": model_name, "messages": messages})
    assert status == 200, body
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    chat = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=1)
    assert body["count"] == chat.usage.prompt_tokens


@pytest.mark.parametrize("path, body, param, status", [
    ("/tokenize", {"prompt": 5}, "prompt", 400),
    ("/tokenize", {}, "prompt", 400),
    ("/tokenize", {"prompt": "x", "add_special_tokens": False}, "add_special_tokens", 400),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False},
     "add_generation_prompt", 400),
    ("/tokenize", {"prompt": "x", "model": "other"}, "model", 404),
    ("/detokenize", {"tokens": "12"}, "tokens", 400),
    ("/detokenize", {"tokens": [1, -1]}, "tokens", 400),
    ("/detokenize", {"tokens": [1], "model": "other"}, "model", 404),
])
def test_bad_tokenize_requests(url: str, path: str, body: dict, param: str, status: int) -> None:
    got, error = post(url, path, body)
    assert got == status and error["error"]["param"] == param, error


def test_detokenize_outside_the_vocabulary_is_a_400_from_the_replica(url: str, fleet: Fleet) -> None:
    status, error = post(url, "/detokenize", {"tokens": [1, 2**31]})
    assert status == 400 and "vocabulary" in error["error"]["message"], error
    with grpc.insecure_channel(fleet.router.addr) as channel:
        stub = model_pb2_grpc.ModelServiceStub(channel)
        ids = list(stub.Tokenize(model_pb2.TokenizeRequest(text="Hi there"), timeout=30).token_ids)
        assert stub.Detokenize(model_pb2.DetokenizeRequest(token_ids=ids), timeout=30).text == "Hi there"
        with pytest.raises(grpc.RpcError) as info:
            stub.Detokenize(model_pb2.DetokenizeRequest(token_ids=[2**31]), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in info.value.details()


# ---------------------------------------------------------------------- streams


def test_one_completion_event_per_token_step_finish_on_the_last(recording) -> None:
    replica, router = recording
    url = http_url(router)
    model = get(url, "/v1/models")[1]["data"][0]["id"]
    status, raw = post(url, "/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 5, "stream": True,
                                                "stream_options": {"include_usage": True}})
    assert status == 200
    data = events(raw)
    assert data[-1] == "[DONE]"
    for chunk in data[:-1]:
        completion_chunk(chunk)
    token_chunks, usage = data[:-2], Completion.model_validate(data[-2])
    assert [c["choices"][0]["text"] for c in token_chunks] == [text for text, _ in SCRIPT]
    assert [c["choices"][0]["finish_reason"] for c in token_chunks] == [None] * (len(SCRIPT) - 1) + ["length"]
    assert usage.choices == [] and usage.usage.completion_tokens == len(SCRIPT)


def test_one_chat_event_per_token_step_finish_on_the_last(recording) -> None:
    replica, router = recording
    url = http_url(router)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                 stream=True, stream_options={"include_usage": True}))
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk.model_dump())
    assert chunks[0].choices[0].delta.role == "assistant"
    token_chunks = chunks[1:-1]
    assert [c.choices[0].delta.content for c in token_chunks] == [text for text, _ in SCRIPT]
    assert [c.choices[0].finish_reason for c in token_chunks] == [None] * (len(SCRIPT) - 1) + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(SCRIPT)
    whole = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}])
    ChatCompletion.model_validate(whole.model_dump())
    assert whole.choices[0].message.content == "Hello!" and whole.choices[0].finish_reason == "length"


def test_real_replica_streams_one_event_per_token(url: str, model_name: str) -> None:
    """As vllm bench serve counts: with ignore_eos, as many content events as tokens asked for."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    chunks = list(client.completions.create(model=model_name, prompt="Count on", max_tokens=12, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    token_chunks = [c for c in chunks if c.choices]
    assert len(token_chunks) == chunks[-1].usage.completion_tokens == 12
    assert token_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in token_chunks[:-1])


# ---------------------------------------------------------------------- sampling fields


def test_sampling_fields_reach_the_replica(recording) -> None:
    replica, router = recording
    client = openai.OpenAI(base_url=http_url(router) + "/v1", api_key="none", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    raw = client.completions.with_raw_response.create(
        model=model, prompt="Hi", max_tokens=5, presence_penalty=0.5, frequency_penalty=-1.5,
        logit_bias={"7": 3.5, "42": -100},
        extra_body={"repetition_penalty": 1.2, "min_tokens": 2, "min_p": 0.25})
    assert "x-ignored-fields" not in raw.headers
    Completion.model_validate(raw.parse().model_dump())
    s = replica.requests[-1].sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_tokens, s.min_p) == \
        pytest.approx((0.5, -1.5, 1.2, 2, 0.25))
    assert dict(s.logit_bias) == {7: 3.5, 42: -100.0}
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], presence_penalty=1,
                                   logit_bias={"3": 1}, extra_body={"min_p": 0.5, "repetition_penalty": 0.9})
    s = replica.requests[-1].sampling
    assert (s.presence_penalty, s.min_p, s.repetition_penalty) == pytest.approx((1.0, 0.5, 0.9))
    assert dict(s.logit_bias) == {3: 1.0}


@pytest.mark.parametrize("extra, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": "lots"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9}, "min_tokens"),  # more than max_tokens
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias"),
])
def test_bad_sampling_values_are_400_naming_the_field(recording, extra: dict, param: str) -> None:
    replica, router = recording
    url = http_url(router)
    model = get(url, "/v1/models")[1]["data"][0]["id"]
    before = len(replica.requests)
    status, error = post(url, "/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 5, **extra})
    assert status == 400 and error["error"]["param"] == param, error
    assert len(replica.requests) == before  # refused at the door


# ---------------------------------------------------------------------- the python client


def test_client_detokenize_through_the_router(fleet: Fleet) -> None:
    with RadixKVClient(fleet.router.addr, timeout=30) as client:
        ids = client.tokenize("Hi there 🎉").token_ids
        assert client.detokenize(ids) == "Hi there 🎉"
        with pytest.raises(RadixKVError) as info:
            client.detokenize([2**31])
    assert info.value.code_name == "INVALID_ARGUMENT"

    async def round_trip() -> str:
        async with AsyncRadixKVClient(fleet.router.addr, timeout=30) as client:
            return await client.detokenize((await client.tokenize("Hi there 🎉")).token_ids)

    assert asyncio.run(round_trip()) == "Hi there 🎉"
    result = run_cli("detokenize", "--addr", fleet.router.addr, *map(str, ids))
    assert result.returncode == 0 and result.stdout == "Hi there 🎉\n", result.stderr
    result = run_cli("detokenize", "--addr", fleet.router.addr, "--json", *map(str, ids))
    assert json.loads(result.stdout) == {"text": "Hi there 🎉"}
    result = run_cli("detokenize", "--addr", fleet.router.addr, "1", "x")
    assert result.returncode == 2 and "not a token id: 'x'" in result.stderr
