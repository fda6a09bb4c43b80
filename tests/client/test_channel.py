"""Client behaviour that needs no model: gRPC retries from the service config, deadlines,
bearer metadata, request building. Runs against an in-process fake ModelService."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import grpc
import pytest

from client import AsyncRadixKVClient, RadixKVClient, RadixKVError, RetryPolicy
from client.channel import service_config
from client.messages import generate_request, tokenize_request
from protos import model_pb2
from tests.client.fake_model_service import Script, start_fake


@pytest.fixture
def fake():
    servers: list[grpc.Server] = []

    def start(script: Script, port: int = 0) -> str:
        server, addr = start_fake(script, port)
        servers.append(server)
        return addr

    yield start
    for server in servers:
        server.stop(0)


def test_service_config_retries_unavailable_for_every_client_method():
    config = json.loads(service_config(RetryPolicy(), wait_for_ready=False))
    (method,) = config["methodConfig"]
    names = {(n["service"], n["method"]) for n in method["name"]}
    assert ("radixkv.v1.ModelService", "Generate") in names
    assert ("radixkv.v1.CacheManager", "Stats") in names
    assert method["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert method["waitForReady"] is False
    assert "retryPolicy" not in json.loads(service_config(None, True))["methodConfig"][0]


def test_generate_is_retried_on_unavailable_before_the_first_message(fake):
    script = Script(fail_first=2)
    with RadixKVClient(fake(script)) as client:
        result = client.generate("hi", timeout=10)
    assert result.text == "Hello, world!"
    assert result.token_ids == [100, 101, 102, 103]
    assert result.finish_reason == "length"
    assert result.usage.completion_tokens == 4
    assert script.calls["Generate"] == 3


def test_generate_is_not_retried_after_the_first_message(fake):
    script = Script(fail_after_first_chunk=True)
    chunks = []
    with RadixKVClient(fake(script)) as client, pytest.raises(RadixKVError) as raised:
        for chunk in client.stream("hi", timeout=10):
            chunks.append(chunk)
    assert raised.value.code == grpc.StatusCode.UNAVAILABLE
    assert [c.text for c in chunks] == ["Hello"]  # no duplicate tokens from a replay
    assert script.calls["Generate"] == 1


def test_other_errors_are_not_retried(fake):
    script = Script(fail_first=1, fail_code=grpc.StatusCode.INVALID_ARGUMENT)
    with RadixKVClient(fake(script)) as client, pytest.raises(RadixKVError) as raised:
        client.tokenize("hi", timeout=10)
    assert raised.value.code_name == "INVALID_ARGUMENT"
    assert "scripted failure" in str(raised.value)
    assert script.calls["Tokenize"] == 1


def test_unary_calls_are_retried_and_carry_the_bearer_token(fake):
    script = Script(fail_first=1)
    with RadixKVClient(fake(script), token="s3cret") as client:
        assert client.tokenize("hi", timeout=10).token_ids == [1, 2]
        assert client.model_info(timeout=10).model_name == "fake"
    assert script.calls == {"Tokenize": 2, "ModelInfo": 2}
    assert all(m.get("authorization") == "Bearer s3cret" for m in script.metadata)


def test_timeout_raises_deadline_exceeded(fake):
    addr = fake(Script(delay_s=2.0))
    with RadixKVClient(addr) as client:
        start = time.monotonic()
        with pytest.raises(RadixKVError) as raised:
            client.generate("hi", timeout=0.3)
        assert time.monotonic() - start < 1.5
    assert raised.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "0.3 s timeout" in str(raised.value)


def test_client_default_timeout_applies_to_every_call(fake):
    with (
        RadixKVClient(fake(Script(delay_s=2.0)), timeout=0.3) as client,
        pytest.raises(RadixKVError) as raised,
    ):
        client.model_info()
    assert raised.value.code_name == "DEADLINE_EXCEEDED"


def test_unreachable_server_fails_fast_with_unavailable():
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    start = time.monotonic()
    with RadixKVClient(f"127.0.0.1:{port}") as client, pytest.raises(RadixKVError) as raised:
        client.generate("hi", timeout=20)
    assert raised.value.code == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - start < 10  # retries back off, but give up long before the deadline


def test_wait_for_ready_waits_for_a_server_that_starts_later(fake):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    timer = threading.Timer(0.5, fake, args=(Script(), port))
    timer.start()
    try:
        with RadixKVClient(f"127.0.0.1:{port}", wait_for_ready=True) as client:
            assert client.generate("hi", timeout=15).text == "Hello, world!"
    finally:
        timer.join()


def test_async_client_retries_streams_and_times_out(fake):
    script = Script(fail_first=1)
    addr = fake(script)
    slow = fake(Script(delay_s=2.0))

    async def run() -> None:
        async with AsyncRadixKVClient(addr, token="t") as client:
            chunks = [c async for c in client.stream("hi", timeout=10)]
            assert [c.text for c in chunks] == ["Hello", ",", " world", "!"]
            assert chunks[-1].finish_reason == "length" and chunks[0].finish_reason is None
            assert (await client.generate("hi", timeout=10)).text == "Hello, world!"
            assert (await client.tokenize("x", timeout=10)).tokens == ["a", "b"]
        async with AsyncRadixKVClient(slow) as client:
            with pytest.raises(RadixKVError) as raised:
                await client.generate("hi", timeout=0.3)
            assert raised.value.code_name == "DEADLINE_EXCEEDED"

    asyncio.run(asyncio.wait_for(run(), 30))
    assert script.calls["Generate"] == 3  # stream: failed once, retried; generate: first try
    assert script.metadata[0]["authorization"] == "Bearer t"


def test_generate_request_building():
    request = generate_request(
        "hi", {"max_tokens": 8, "temperature": 0.0, "stop": ["\n"], "seed": 7, "top_k": None}
    )
    assert request.prompt == "hi"
    assert request.sampling.HasField("temperature") and request.sampling.temperature == 0.0
    assert request.sampling.max_tokens == 8 and request.sampling.seed == 7
    assert not request.sampling.HasField("top_p")
    assert list(request.sampling.stop) == ["\n"]
    chat = generate_request(None, {"messages": [{"role": "user", "content": "Hi"}]})
    assert chat.WhichOneof("input") == "chat" and chat.chat.messages[0].role == "user"
    ids = generate_request(None, {"token_ids": [1, 2, 3]})
    assert list(ids.token_ids.ids) == [1, 2, 3]
    with pytest.raises(ValueError):
        generate_request("hi", {"token_ids": [1]})
    with pytest.raises(ValueError):
        generate_request(None, {})
    assert tokenize_request("x", None) == model_pb2.TokenizeRequest(text="x")
    with pytest.raises(ValueError):
        tokenize_request(None, None)
