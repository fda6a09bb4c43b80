"""The router in front of real processes on loopback: its own cache manager, two replicas of the
tiny random Llama (tests/router/conftest.py). Every ModelService call through the router, the
OpenAI HTTP door with the official `openai` package, and failures: cache manager unreachable,
a replica failing before its first message or mid-stream, a replica going down, router and
cache manager restarts. Destructive tests come last (they run in file order)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos import cache_pb2, cache_pb2_grpc, model_pb2, model_pb2_grpc
from tests.router.conftest import CHECK_INTERVAL, LEASE_SECONDS, Fleet, ScriptedReplica, http_url, metric
from tests.services import Running, start_cache, start_router

pytestmark = pytest.mark.timeout(120)

# A prompt of several full 16-token pages, so a repeat hits the prefix cache.
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 8


def stub(addr: str) -> tuple[grpc.Channel, model_pb2_grpc.ModelServiceStub]:
    channel = grpc.insecure_channel(addr)
    return channel, model_pb2_grpc.ModelServiceStub(channel)


@pytest.fixture(scope="module")
def router(fleet: Fleet):
    channel, s = stub(fleet.router.addr)
    yield s
    channel.close()


@pytest.fixture(scope="module")
def direct(fleet: Fleet):
    channel, s = stub(fleet.a.addr)
    yield s
    channel.close()


@pytest.fixture(scope="module")
def client(fleet: Fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=http_url(fleet.router) + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def model_name(direct) -> str:
    return direct.ModelInfo(model_pb2.ModelInfoRequest(), timeout=10).model_name


def greedy(max_tokens: int = 8, **sampling) -> model_pb2.SamplingParams:
    return model_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, **sampling)


def generate(s, timeout: float = 30, **fields) -> list[model_pb2.GenerateResponse]:
    fields.setdefault("sampling", greedy())
    return list(s.Generate(model_pb2.GenerateRequest(**fields), timeout=timeout))


def token_ids(messages: list[model_pb2.GenerateResponse]) -> list[int]:
    return [t for m in messages for t in m.token_ids]


def text(messages: list[model_pb2.GenerateResponse]) -> str:
    return "".join(m.text for m in messages)


# ---------------------------------------------------------------------- gRPC through the router


def test_generate_through_the_router_equals_a_replica(fleet: Fleet, router, direct) -> None:
    via_router = generate(router, prompt="Once upon a time", request_id="router-gen-1",
                          sampling=greedy(12, ignore_eos=True))
    reference = generate(direct, prompt="Once upon a time", sampling=greedy(12, ignore_eos=True))
    assert token_ids(via_router) == token_ids(reference) and len(token_ids(via_router)) == 12
    assert text(via_router) == text(reference)
    assert len(via_router) > 1  # streamed, not buffered
    assert all(m.request_id == "router-gen-1" for m in via_router)
    final = via_router[-1]
    assert final.finish_reason == model_pb2.FINISH_REASON_LENGTH
    assert final.usage.served_by in fleet.replica_addrs
    assert final.usage.prompt_tokens == reference[-1].usage.prompt_tokens


def test_token_ids_and_chat_inputs(router, direct) -> None:
    ids = list(direct.Tokenize(model_pb2.TokenizeRequest(text="Hello there"), timeout=10).token_ids)
    by_ids = generate(router, token_ids=model_pb2.TokenIds(ids=ids))
    assert token_ids(by_ids) == token_ids(generate(direct, token_ids=model_pb2.TokenIds(ids=ids)))
    chat = model_pb2.ChatMessages(messages=[model_pb2.ChatMessage(role="user", content="Hi!")])
    assert token_ids(generate(router, chat=chat)) == token_ids(generate(direct, chat=chat))


def test_tokenize_model_info_and_get_load(fleet: Fleet, router, direct) -> None:
    request = model_pb2.TokenizeRequest(text="tokens, please")
    assert router.Tokenize(request, timeout=10) == direct.Tokenize(request, timeout=10)
    info = router.ModelInfo(model_pb2.ModelInfoRequest(), timeout=10)
    replica_info = direct.ModelInfo(model_pb2.ModelInfoRequest(), timeout=10)
    assert info.serving_addr == fleet.router.addr
    assert (info.model_name, info.model_fingerprint) == (replica_info.model_name, replica_info.model_fingerprint)
    load = router.GetLoad(model_pb2.GetLoadRequest(), timeout=10)
    assert load.num_blocks == 2 * 256 and load.serving_addr == fleet.router.addr
    assert load.prompt_tokens > 0


def test_invalid_input_passes_through_unretried(fleet: Fleet, router) -> None:
    retries = metric(fleet.router, "radixkv_router_route_decisions_total", reason="retry")
    with pytest.raises(grpc.RpcError) as info:
        generate(router, token_ids=model_pb2.TokenIds(ids=[1, 10**6]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        generate(router, prompt="")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert metric(fleet.router, "radixkv_router_route_decisions_total", reason="retry") == retries


def test_abort_through_the_router(router) -> None:
    with pytest.raises(grpc.RpcError) as info:
        router.Abort(model_pb2.AbortRequest(request_id="no-such-request"), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    stream = router.Generate(model_pb2.GenerateRequest(prompt="Count to a thousand:", request_id="router-abort-1",
                                                       sampling=greedy(900, ignore_eos=True)), timeout=60)
    first = next(stream)
    assert first.request_id == "router-abort-1"
    router.Abort(model_pb2.AbortRequest(request_id="router-abort-1"), timeout=10)
    rest = list(stream)
    assert rest and rest[-1].finish_reason == model_pb2.FINISH_REASON_ABORT
    assert len(token_ids([first, *rest])) < 900


def wait_idle(router, what: str) -> None:
    """Until no replica runs a request (long before a 900-token generation would end)."""
    deadline = time.monotonic() + 20
    while router.GetLoad(model_pb2.GetLoadRequest(), timeout=10).num_running_requests:
        assert time.monotonic() < deadline, f"the replica kept generating after {what}"
        time.sleep(0.1)


def test_client_cancel_cancels_upstream(router) -> None:
    stream = router.Generate(model_pb2.GenerateRequest(prompt="Go on and on", request_id="router-cancel-1",
                                                       sampling=greedy(900, ignore_eos=True)), timeout=60)
    next(stream)
    stream.cancel()
    wait_idle(router, "the client cancelled")


def test_deadline_propagates(router) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(router.Generate(model_pb2.GenerateRequest(prompt="Never ending", sampling=greedy(900, ignore_eos=True)),
                             timeout=0.5))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(router, "the deadline passed")


def test_health_and_reflection(fleet: Fleet) -> None:
    with grpc.insecure_channel(fleet.router.addr) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "radixkv.v1.ModelService"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = list(reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"radixkv.v1.ModelService", "grpc.health.v1.Health"} <= names


def test_repeated_prompt_is_routed_to_its_cache(fleet: Fleet, router) -> None:
    first = generate(router, prompt=LONG_PROMPT + "first", namespace="router-repeat")
    second = generate(router, prompt=LONG_PROMPT + "again", namespace="router-repeat")
    assert second[-1].usage.served_by == first[-1].usage.served_by
    assert second[-1].usage.cached_prompt_tokens >= 64
    assert metric(fleet.router, "radixkv_router_route_decisions_total", reason="kv_hit") >= 1


# ---------------------------------------------------------------------- the OpenAI HTTP door


def test_openai_completion_equals_grpc(client: openai.OpenAI, router, model_name: str) -> None:
    reply = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=10, temperature=0)
    reference = generate(router, prompt="Once upon a time", sampling=greedy(10))
    choice = reply.choices[0]
    assert choice.text == text(reference)
    assert choice.finish_reason == ("length" if reference[-1].finish_reason == model_pb2.FINISH_REASON_LENGTH
                                    else "stop")
    assert reply.object == "text_completion" and reply.model == model_name
    assert reply.usage.prompt_tokens == reference[-1].usage.prompt_tokens
    assert reply.usage.completion_tokens == reference[-1].usage.completion_tokens
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_openai_chat_streamed_equals_unstreamed(client: openai.OpenAI, model_name: str) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    whole = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=12,
                                           temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=12,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_openai_streamed_completion(client: openai.OpenAI, model_name: str) -> None:
    whole = client.completions.create(model=model_name, prompt="Twice upon a time", max_tokens=8, temperature=0)
    chunks = list(client.completions.create(model=model_name, prompt="Twice upon a time", max_tokens=8,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_openai_cached_tokens_after_a_repeated_prompt(client: openai.OpenAI, model_name: str) -> None:
    prompt = LONG_PROMPT + "openai"
    first = client.completions.create(model=model_name, prompt=prompt, max_tokens=2, extra_body={"cache_salt": "oa"})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(client.completions.create(model=model_name, prompt=prompt, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"cache_salt": "oa"}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 64
    other_salt = client.completions.create(model=model_name, prompt=prompt, max_tokens=2,
                                           extra_body={"cache_salt": "other"})
    assert other_salt.usage.prompt_tokens_details.cached_tokens == 0


def test_openai_errors(client: openai.OpenAI, fleet: Fleet, model_name: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt="x", n=0)  # choices: 1-64
    assert info.value.status_code == 400 and info.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="x")
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:  # the replica's validation, passed through
        client.completions.create(model=model_name, prompt="x", max_tokens=1, extra_body={"top_k": -2})
    assert "top_k" in info.value.message
    # The raw shape, and a bad body.
    request = urllib.request.Request(http_url(fleet.router) + "/v1/chat/completions", data=b"{not json",
                                     headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as http_error:
        urllib.request.urlopen(request, timeout=10)
    assert http_error.value.code == 400
    body = json.loads(http_error.value.read())
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"


def test_openai_stream_closed_early_cancels_upstream(client: openai.OpenAI, router, model_name: str) -> None:
    stream = client.completions.create(model=model_name, prompt="Keep talking", max_tokens=900, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    wait_idle(router, "the HTTP client went away")


def test_openai_models_and_health(client: openai.OpenAI, fleet: Fleet, model_name: str) -> None:
    assert [m.id for m in client.models.list()] == [model_name]
    with urllib.request.urlopen(http_url(fleet.router) + "/health", timeout=5) as reply:
        assert reply.status == 200 and json.loads(reply.read())["status"] == "ok"


# ---------------------------------------------------------------------- failures


def wait_reachable(router: Running, addr: str, timeout_s: float = 10.0) -> None:
    """Until the router's checks see `addr` up (a failure marks a replica down until the next)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(http_url(router) + "/health", timeout=5) as reply:
                if addr in json.loads(reply.read())["replicas"]:
                    return
        except urllib.error.HTTPError:
            pass
        assert time.monotonic() < deadline, f"the router never saw {addr} up"
        time.sleep(0.05)


def test_cache_manager_unreachable_falls_back(fallback_router: Running, scripted: ScriptedReplica,
                                              fleet: Fleet) -> None:
    scripted.mode = "unavailable"
    wait_reachable(fallback_router, scripted.addr)
    channel, s = stub(fallback_router.addr)
    with channel:
        served = []
        for i in range(6):  # round-robin over two: one of the first two tries the scripted replica first
            served.append(generate(s, prompt=f"fallback please {i}")[-1].usage.served_by)
            if scripted.generate_calls:
                break
    assert set(served) == {fleet.a.addr}
    assert scripted.generate_calls == 1  # failed before its first message, retried on A
    assert metric(fallback_router, "radixkv_router_route_decisions_total", reason="retry") >= 1
    assert metric(fallback_router, "radixkv_router_route_decisions_total", reason="fallback_no_cache_manager") >= 1
    assert metric(fallback_router, "radixkv_router_cache_manager_up") == 0
    metrics_url = next(line.split(" on ", 1)[1] for line in fallback_router.log if "router metrics on" in line)
    with urllib.request.urlopen(metrics_url, timeout=5) as reply:  # --metrics-port serves the same
        assert 'radixkv_router_route_decisions_total{reason="fallback_no_cache_manager"}' in reply.read().decode()
    with grpc.insecure_channel(fallback_router.addr) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _until_scripted(router: Running, scripted: ScriptedReplica, mode: str, attempts: int = 6):
    """Requests until one reaches the scripted replica; returns (messages before the error, the
    error or None) of that one."""
    scripted.mode = mode
    before = scripted.generate_calls
    channel, s = stub(router.addr)
    with channel:
        for _ in range(attempts):
            wait_reachable(router, scripted.addr)
            got: list[model_pb2.GenerateResponse] = []
            try:
                for message in s.Generate(model_pb2.GenerateRequest(prompt="scripted", sampling=greedy()), timeout=30):
                    got.append(message)
            except grpc.RpcError as e:
                assert scripted.generate_calls > before
                return got, e
            if scripted.generate_calls > before:
                return got, None
    raise AssertionError(f"no request reached the scripted replica in {attempts} tries")


def test_queue_full_before_first_message_is_retried(fallback_router: Running, scripted: ScriptedReplica,
                                                    fleet: Fleet) -> None:
    got, error = _until_scripted(fallback_router, scripted, "exhausted")
    assert error is None and got[-1].usage.served_by == fleet.a.addr


def test_invalid_argument_from_a_replica_is_not_retried(fallback_router: Running, scripted: ScriptedReplica) -> None:
    got, error = _until_scripted(fallback_router, scripted, "invalid")
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "scripted replica: bad request" and got == []


def test_mid_stream_failure_is_unavailable_with_partial_output(fallback_router: Running,
                                                               scripted: ScriptedReplica) -> None:
    got, error = _until_scripted(fallback_router, scripted, "partial")
    assert [m.text for m in got] == ["partial"]
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE
    assert "partial output was sent" in error.details()


def test_router_restart_on_the_same_port(fleet: Fleet) -> None:
    port = fleet.router.addr.rsplit(":", 1)[1]
    http_port = http_url(fleet.router).rsplit(":", 1)[1]
    assert fleet.router.process.stop(10.0) == 0  # SIGTERM: graceful, exit code 0
    fleet.router = start_router(fleet.cache.addr, "--port", port, "--http-port", http_port,
                                "--check-interval", CHECK_INTERVAL, "--replica", fleet.a.addr,
                                "--replica", fleet.b.addr)
    assert fleet.router.addr.endswith(f":{port}")
    channel, s = stub(fleet.router.addr)
    with channel:
        assert generate(s, prompt="after the restart")[-1].finish_reason != model_pb2.FINISH_REASON_UNSPECIFIED


def test_cache_manager_restart_requests_complete_and_routing_resumes(fleet: Fleet) -> None:
    port = fleet.cache.addr.rsplit(":", 1)[1]
    channel, s = stub(fleet.router.addr)
    with channel:
        fleet.cache.process.stop(5.0)
        outcome: dict[str, object] = {}

        def during_outage() -> None:
            try:
                outcome["messages"] = generate(s, timeout=60, prompt=LONG_PROMPT + "outage")
            except grpc.RpcError as e:
                outcome["error"] = e

        thread = threading.Thread(target=during_outage)
        thread.start()
        deadline = time.monotonic() + 10
        while not metric(fleet.router, "radixkv_router_route_decisions_total", reason="fallback_no_cache_manager"):
            assert time.monotonic() < deadline, "the router did not fall back"
            time.sleep(0.1)
        fleet.cache = start_cache(["--port", port, "--lease-seconds", str(LEASE_SECONDS)])
        thread.join(60)
        assert "error" not in outcome, outcome.get("error")
        assert outcome["messages"][-1].finish_reason != model_pb2.FINISH_REASON_UNSPECIFIED
        # Routing by prefix resumes: a repeated prompt lands where it is cached.
        hits = metric(fleet.router, "radixkv_router_route_decisions_total", reason="kv_hit")
        deadline = time.monotonic() + 30
        while True:
            first = generate(s, prompt=LONG_PROMPT + "resumed", namespace="resumed")
            second = generate(s, prompt=LONG_PROMPT + "resumed", namespace="resumed")
            if second[-1].usage.cached_prompt_tokens and metric(
                    fleet.router, "radixkv_router_route_decisions_total", reason="kv_hit") > hits:
                break
            assert time.monotonic() < deadline, "routing by prefix did not resume"
            time.sleep(0.5)
        assert second[-1].usage.served_by == first[-1].usage.served_by


def wait_registered(fleet: Fleet, pool_ids: set[str]) -> None:
    """Until the cache manager lists these pools (a replica re-registers after a restart within
    a third of its lease)."""
    channel = grpc.insecure_channel(fleet.cache.addr)
    with channel:
        cache = cache_pb2_grpc.CacheManagerStub(channel)
        deadline = time.monotonic() + 3 * LEASE_SECONDS
        while not pool_ids <= {p.pool_id for p in cache.Stats(cache_pb2.StatsRequest(), timeout=5).pools}:
            assert time.monotonic() < deadline, f"pools {pool_ids} did not register"
            time.sleep(0.1)


def test_unrelated_requests_spread_over_both_replicas(fleet: Fleet) -> None:
    wait_registered(fleet, {"router-a", "router-b"})
    prompts = [f"unrelated request number {i}: " + "lorem ipsum " * (4 + i) for i in range(8)]
    channel, s = stub(fleet.router.addr)
    with channel, ThreadPoolExecutor(8) as pool:
        finals = list(pool.map(lambda p: generate(s, prompt=p, sampling=greedy(24, ignore_eos=True))[-1], prompts))
    served = [f.usage.served_by for f in finals]
    assert set(served) == fleet.replica_addrs, served
    assert min(served.count(a) for a in fleet.replica_addrs) >= 2  # load spreads them, not one each by luck


def _stream(s, prompt: str, out: dict) -> None:
    """Reads one long stream to its end, recording its messages and how it ended."""
    out["messages"] = []
    try:
        for message in s.Generate(model_pb2.GenerateRequest(prompt=prompt, sampling=greedy(400, ignore_eos=True)),
                                  timeout=60):
            out["messages"].append(message)
        out["code"] = grpc.StatusCode.OK
    except grpc.RpcError as err:
        out["code"], out["details"] = err.code(), err.details()


def test_replica_sigkilled_mid_load_survivor_serves_and_pool_is_reclaimed(fleet: Fleet) -> None:
    channel, s = stub(fleet.router.addr)
    with channel:
        outs = [{} for _ in range(6)]
        threads = [threading.Thread(target=_stream, args=(s, f"long stream {i} " * (3 + i), out))
                   for i, out in enumerate(outs)]
        for t in threads:
            t.start()
        load_channel, b_stub = stub(fleet.b.addr)
        with load_channel:
            deadline = time.monotonic() + 30
            while b_stub.GetLoad(model_pb2.GetLoadRequest(), timeout=5).num_running_requests == 0:
                assert time.monotonic() < deadline, "replica b never got a request"
                time.sleep(0.05)
        while not all(o.get("messages") for o in outs) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(fleet.b.process.pid, signal.SIGKILL)  # no goodbye: streams and lease just stop
        killed_at = time.monotonic()
        for t in threads:
            t.join(timeout=40)
        assert not any(t.is_alive() for t in threads), "a stream hung after its replica died"
        assert time.monotonic() - killed_at < 40
        codes = [o["code"] for o in outs]
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, codes
        assert grpc.StatusCode.UNAVAILABLE in codes  # b's streams end, with their partial output
        for o in outs:
            if o["code"] == grpc.StatusCode.UNAVAILABLE:
                assert o["messages"] and "partial output" in o["details"]
            else:
                assert o["messages"][-1].usage.served_by == fleet.a.addr
        for i in range(4):  # new requests go to the survivor
            assert generate(s, prompt=f"after the kill {i}")[-1].usage.served_by == fleet.a.addr
    cache_channel = grpc.insecure_channel(fleet.cache.addr)
    with cache_channel:
        cache = cache_pb2_grpc.CacheManagerStub(cache_channel)
        deadline = time.monotonic() + 3 * LEASE_SECONDS
        while any(p.pool_id == "router-b" for p in cache.Stats(cache_pb2.StatsRequest(), timeout=5).pools):
            assert time.monotonic() < deadline, "the dead replica's pool outlived its lease"
            time.sleep(0.2)
    with urllib.request.urlopen(http_url(fleet.router) + "/health", timeout=5) as reply:
        assert json.loads(reply.read())["replicas"] == [fleet.a.addr]
