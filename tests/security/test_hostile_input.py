"""Hostile input to the real cache manager, model service and router, as an attacker would send
it: bytes that are not the request message, generated and random protobuf, NaN/inf floats,
huge and negative numbers, oversized ids, foreign ids, a buggy replica's Steps. Each gets a
clear status (never UNKNOWN or INTERNAL); afterwards every server is SERVING, a normal request
answers the same, the block accounting is whole, and no server logged a traceback."""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.limits import (
    DEFAULT_MAX_PROMPT_BYTES,
    DEFAULT_MAX_STOP_BYTES,
    DEFAULT_MAX_STOP_STRINGS,
    MAX_ID_BYTES,
)
from protos import cache_pb2, cache_pb2_grpc, model_pb2, model_pb2_grpc
from tests.model_service.checks import assert_pool_whole, expect_status, wait_until_idle
from tests.services import SHARED_POOL_ID, Running, start_router

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NEVER = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
MODEL_SERVICE = model_pb2.DESCRIPTOR.services_by_name["ModelService"]
CACHE_SERVICE = cache_pb2.DESCRIPTOR.services_by_name["CacheManager"]
BAD_UTF8 = b"\xff\xfe\xc3("
CORRUPT_VARINT = b"\x10" + b"\xff" * 11  # field 2 varint that never ends
HUGE_ID = "x" * 100_000


def field_bytes(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2)."""
    length, size = b"", len(payload)
    while True:
        byte, size = size & 0x7F, size >> 7
        length += bytes([byte | (0x80 if size else 0)])
        if not size:
            break
    key = bytes([(number << 3) | 2])
    return key + length + payload


# ---------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def router(cache_service: Running, model_service: Running) -> Iterator[Running]:
    running = start_router(cache_service.addr, "--replica", model_service.addr, "--check-interval", "0.5")
    try:
        yield running
    finally:
        running.process.stop(5.0)


@pytest.fixture(scope="module")
def channels(cache_service: Running, model_service: Running, router: Running) -> Iterator[dict[str, grpc.Channel]]:
    opened = {name: grpc.insecure_channel(r.addr) for name, r in
              (("cache", cache_service), ("model", model_service), ("router", router))}
    try:
        yield opened
    finally:
        for channel in opened.values():
            channel.close()


def raw_call(channel: grpc.Channel, service, method_name: str, data: bytes, timeout: float = 10.0):
    """Sends `data` as the request bytes; returns the status code (OK when it answered)."""
    method = service.methods_by_name[method_name]
    path = f"/{service.full_name}/{method_name}"
    try:
        if method.server_streaming:
            for _ in channel.unary_stream(path, request_serializer=None, response_deserializer=None)(
                    data, timeout=timeout):
                pass
        else:
            channel.unary_unary(path, request_serializer=None, response_deserializer=None)(data, timeout=timeout)
    except grpc.RpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


def generate(channel: grpc.Channel, request: model_pb2.GenerateRequest, timeout: float = 60.0) -> str:
    stub = model_pb2_grpc.ModelServiceStub(channel)
    return "".join(m.text for m in stub.Generate(request, timeout=timeout))


def normal_request() -> model_pb2.GenerateRequest:
    return model_pb2.GenerateRequest(prompt="The capital of France is",
                                     sampling=model_pb2.SamplingParams(temperature=0, max_tokens=4))


@pytest.fixture(scope="module")
def baseline(channels) -> str:
    return generate(channels["model"], normal_request())


# ---------------------------------------------------------------------- bytes that do not parse

MALFORMED_MODEL = {
    "prompt invalid UTF-8": field_bytes(2, BAD_UTF8),
    "request_id invalid UTF-8": field_bytes(1, BAD_UTF8) + field_bytes(2, b"hi"),
    "namespace invalid UTF-8": field_bytes(2, b"hi") + field_bytes(6, BAD_UTF8),
    "stop string invalid UTF-8": field_bytes(2, b"hi") + field_bytes(5, field_bytes(6, BAD_UTF8)),
    "chat role invalid UTF-8": field_bytes(4, field_bytes(1, field_bytes(1, BAD_UTF8))),
    "corrupt varint": CORRUPT_VARINT,
    "truncated field": b"\x12\x10hi",
}


@pytest.mark.parametrize("server", ["model", "router"])
@pytest.mark.parametrize("case", list(MALFORMED_MODEL))
@pytest.mark.parametrize("method", ["Generate", "Tokenize", "Abort"])
def test_model_service_bytes_that_do_not_parse_are_invalid_argument(channels, baseline, server, case,
                                                                    method) -> None:
    code, details = raw_call(channels[server], MODEL_SERVICE, method, MALFORMED_MODEL[case])
    if method != "Generate":  # the same field numbers mean other things there
        assert code not in NEVER, (code, details)
        return
    assert code == INVALID, (code, details)
    assert "not a valid radixkv.v1.GenerateRequest" in details


MALFORMED_CACHE = {
    ("RegisterPool", "worker_id invalid UTF-8"): field_bytes(1, BAD_UTF8),
    ("Step", "pool_id invalid UTF-8"): field_bytes(1, BAD_UTF8),
    ("Step", "admit request_id invalid UTF-8"): field_bytes(1, b"p") + field_bytes(6, field_bytes(1, BAD_UTF8)),
    ("Step", "admit namespace invalid UTF-8"): field_bytes(1, b"p") + field_bytes(6, field_bytes(3, BAD_UTF8)),
    ("Match", "namespace invalid UTF-8"): field_bytes(3, BAD_UTF8),
    ("Stats", "pool_id invalid UTF-8"): field_bytes(1, BAD_UTF8),
    ("Heartbeat", "corrupt varint"): CORRUPT_VARINT,
    ("WatchEvents", "pool_id invalid UTF-8"): field_bytes(1, BAD_UTF8),
    ("Route", "namespace invalid UTF-8"): field_bytes(3, BAD_UTF8),
    ("Evict", "truncated"): b"\x0a\x40abc",
}


@pytest.mark.parametrize("method,case", list(MALFORMED_CACHE))
def test_cache_service_bytes_that_do_not_parse_are_invalid_argument(channels, method, case) -> None:
    code, details = raw_call(channels["cache"], CACHE_SERVICE, method, MALFORMED_CACHE[(method, case)])
    assert code == INVALID, (code, details)
    assert "not a valid radixkv.v1" in details


# ---------------------------------------------------------------------- random bytes (hypothesis)

RANDOM_TARGETS = [("model", MODEL_SERVICE, m) for m in ("Generate", "Tokenize", "Detokenize", "Abort", "GetLoad",
                                                        "ModelInfo")] + \
    [("router", MODEL_SERVICE, m) for m in ("Generate", "Tokenize", "Detokenize", "Abort")] + \
    [("cache", CACHE_SERVICE, m) for m in ("Step", "Match", "Heartbeat", "Stats", "Route", "Evict", "Clear")]


@pytest.mark.parametrize("server,service,method", RANDOM_TARGETS, ids=[f"{s}-{m}" for s, _, m in RANDOM_TARGETS])
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.binary(max_size=64))
def test_random_bytes_get_a_clear_status(channels, server, service, method, data) -> None:
    # Generate: random bytes may be a valid request; the deadline bounds its cost.
    code, details = raw_call(channels[server], service, method, data, timeout=3.0)
    assert code not in NEVER, (code, details)


sampling_values = st.builds(
    model_pb2.SamplingParams,
    temperature=st.floats(allow_nan=True, allow_infinity=True, width=32),
    top_p=st.floats(allow_nan=True, allow_infinity=True, width=32),
    top_k=st.integers(-2**31, 2**31 - 1),
    seed=st.integers(0, 2**64 - 1),
    max_tokens=st.integers(-2**31, 2**31 - 1),
    stop=st.lists(st.text(max_size=8), max_size=3),
    stop_token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=3),
    ignore_eos=st.booleans(),
)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(prompt=st.text(max_size=16), sampling=sampling_values, namespace=st.text(max_size=8))
def test_generated_generate_requests_get_a_clear_status(channels, prompt, sampling, namespace) -> None:
    if sampling.max_tokens > 0:
        sampling.max_tokens = min(sampling.max_tokens, 2) if sampling.max_tokens < 10**6 else sampling.max_tokens
    request = model_pb2.GenerateRequest(prompt=prompt, sampling=sampling, namespace=namespace)
    try:
        generate(channels["model"], request, timeout=10.0)
    except grpc.RpcError as error:
        assert error.code() not in NEVER, (error.code(), error.details())
        if not math.isfinite(sampling.temperature) or not math.isfinite(sampling.top_p):
            assert error.code() == INVALID


# ---------------------------------------------------------------------- explicit catalogue


def gen(**kwargs) -> model_pb2.GenerateRequest:
    sampling = kwargs.pop("sampling", {})
    sampling.setdefault("max_tokens", 2)
    return model_pb2.GenerateRequest(sampling=model_pb2.SamplingParams(**sampling), **kwargs)


MODEL_CASES = {
    "temperature NaN": (gen(prompt="hi", sampling={"temperature": float("nan")}), {INVALID}),
    "temperature inf": (gen(prompt="hi", sampling={"temperature": float("inf")}), {INVALID}),
    "temperature negative": (gen(prompt="hi", sampling={"temperature": -1}), {INVALID}),
    "top_p NaN": (gen(prompt="hi", sampling={"top_p": float("nan")}), {INVALID}),
    "top_p -inf": (gen(prompt="hi", sampling={"top_p": float("-inf")}), {INVALID}),
    "top_k negative": (gen(prompt="hi", sampling={"top_k": -5}), {INVALID}),
    "top_k huge": (gen(prompt="hi", sampling={"top_k": 2**31 - 1}), {grpc.StatusCode.OK, INVALID}),
    "max_tokens negative": (gen(prompt="hi", sampling={"max_tokens": -1}), {INVALID}),
    "max_tokens huge": (gen(prompt="hi", sampling={"max_tokens": 2**31 - 1}), {INVALID}),
    "seed huge": (gen(prompt="hi", sampling={"seed": 2**64 - 1, "temperature": 1.0}), {grpc.StatusCode.OK}),
    "stop token id huge": (gen(prompt="hi", sampling={"stop_token_ids": [2**32 - 1]}), {INVALID}),
    "token id huge": (gen(token_ids=model_pb2.TokenIds(ids=[2**32 - 1])), {INVALID}),
    "empty token ids": (gen(token_ids=model_pb2.TokenIds()), {INVALID}),
    "empty chat": (gen(chat=model_pb2.ChatMessages()), {INVALID}),
    "unknown chat role": (gen(chat=model_pb2.ChatMessages(messages=[model_pb2.ChatMessage(role="wizard",
                                                                                          content="hi")])),
                          {grpc.StatusCode.OK, INVALID}),
    "no input": (gen(), {INVALID}),
    "empty stop string": (gen(prompt="hi", sampling={"stop": [""]}), {INVALID}),
    "empty stop list": (gen(prompt="hi", sampling={"stop": []}), {grpc.StatusCode.OK}),
    "100 KB request_id": (gen(prompt="hi", request_id=HUGE_ID), {INVALID}),
    "100 KB namespace": (gen(prompt="hi", namespace=HUGE_ID), {INVALID}),
    "1 MB stop string": (gen(prompt="hi", sampling={"stop": ["ab" * 500_000]}), {INVALID}),
}


@pytest.mark.parametrize("server", ["model", "router"])
@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_model_service_catalogue(channels, baseline, server, case) -> None:
    request, expected = MODEL_CASES[case]
    try:
        generate(channels[server], request, timeout=30.0)
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as error:
        code, details = error.code(), error.details() or ""
    assert code in expected, (code, details)
    assert len(details) < 2048


LIMITS = {
    "max_stop_strings": gen(prompt="hi", sampling={"stop": ["s"] * (DEFAULT_MAX_STOP_STRINGS + 1)}),
    "max_stop_bytes": gen(prompt="hi", sampling={"stop": ["s" * (DEFAULT_MAX_STOP_BYTES + 1)]}),
    "max_prompt_bytes": gen(prompt="x" * (DEFAULT_MAX_PROMPT_BYTES + 1)),
    "max_id_bytes": gen(prompt="hi", request_id="r" * (MAX_ID_BYTES + 1)),
}


@pytest.mark.parametrize("limit", list(LIMITS))
def test_model_service_request_limits(channels, limit) -> None:
    expect_status(lambda: generate(channels["model"], LIMITS[limit]), INVALID, limit)


def test_request_limits_are_inclusive(channels) -> None:
    """Exactly at each limit is still accepted."""
    request = gen(prompt="hi", request_id="r" * MAX_ID_BYTES,
                  sampling={"stop": ["s"] * (DEFAULT_MAX_STOP_STRINGS - 1) + ["q" * 64]})
    generate(channels["model"], request)


@pytest.mark.parametrize("server", ["model", "router"])
def test_abort_with_a_huge_id_is_invalid_argument_not_resource_exhausted(channels, server) -> None:
    stub = model_pb2_grpc.ModelServiceStub(channels[server])
    expect_status(lambda: stub.Abort(model_pb2.AbortRequest(request_id=HUGE_ID)), INVALID, "max_id_bytes")
    error = expect_status(lambda: stub.Abort(model_pb2.AbortRequest(request_id="q" * MAX_ID_BYTES)),
                          grpc.StatusCode.NOT_FOUND)
    assert len(error.details()) < 300  # the id is quoted shortened


def test_duplicate_and_foreign_request_ids(channels) -> None:
    stub = model_pb2_grpc.ModelServiceStub(channels["model"])
    rid = f"hostile-{uuid.uuid4().hex}"
    stream = stub.Generate(gen(prompt="Count to one hundred:", request_id=rid,
                               sampling={"max_tokens": 200, "ignore_eos": True}), timeout=60)
    next(stream)
    expect_status(lambda: generate(channels["model"], gen(prompt="hi", request_id=rid)),
                  grpc.StatusCode.ALREADY_EXISTS)
    expect_status(lambda: stub.Abort(model_pb2.AbortRequest(request_id=rid + "-other")), grpc.StatusCode.NOT_FOUND)
    stub.Abort(model_pb2.AbortRequest(request_id=rid))
    for _ in stream:
        pass


# ---------------------------------------------------------------------- the cache manager


def test_cache_ids_over_the_limit_are_invalid_argument(channels) -> None:
    stub = cache_pb2_grpc.CacheManagerStub(channels["cache"])
    for call in (lambda: stub.Step(cache_pb2.StepRequest(pool_id=HUGE_ID)),
                 lambda: stub.Stats(cache_pb2.StatsRequest(pool_id=HUGE_ID)),
                 lambda: stub.RegisterPool(cache_pb2.RegisterPoolRequest(worker_id=HUGE_ID, num_blocks=1,
                                                                         block_size=1)),
                 lambda: stub.Match(cache_pb2.MatchRequest(token_ids=[1], namespace=HUGE_ID)),
                 lambda: stub.Step(cache_pb2.StepRequest(pool_id="p", admits=[cache_pb2.Admit(
                     request_id=HUGE_ID, token_ids=[1])]))):
        expect_status(call, INVALID, "max_id_bytes")
    error = expect_status(lambda: stub.Stats(cache_pb2.StatsRequest(pool_id="p" * MAX_ID_BYTES)),
                          grpc.StatusCode.NOT_FOUND)
    assert len(error.details()) < 300


def test_buggy_replica_steps(channels) -> None:
    stub = cache_pb2_grpc.CacheManagerStub(channels["cache"])
    reg = stub.RegisterPool(cache_pb2.RegisterPoolRequest(worker_id=f"hostile-{uuid.uuid4().hex}", num_blocks=32,
                                                          block_size=4, model_fingerprint="hostile",
                                                          vocab_size=100))
    pool, epoch = reg.pool_id, reg.epoch

    def step(**kwargs) -> cache_pb2.StepResponse:
        return stub.Step(cache_pb2.StepRequest(pool_id=pool, epoch=epoch, **kwargs))

    admitted = step(admits=[cache_pb2.Admit(request_id="r1", token_ids=list(range(1, 11)))]).admits[0]
    assert admitted.status == cache_pb2.ADMIT_STATUS_ADMITTED
    table = list(admitted.block_table)
    bad = {
        "foreign block ids": (dict(finishes=[cache_pb2.Finish(request_id="r1", num_computed_tokens=10,
                                                               block_table=[b + 1 for b in table])]),
                              {grpc.StatusCode.FAILED_PRECONDITION}),
        "out-of-range block ids": (dict(finishes=[cache_pb2.Finish(request_id="r1", num_computed_tokens=10,
                                                                    block_table=[10**6] * len(table))]),
                                   {grpc.StatusCode.FAILED_PRECONDITION}),
        "finish beyond the tokens": (dict(finishes=[cache_pb2.Finish(request_id="r1", num_computed_tokens=10**6)]),
                                     {INVALID, grpc.StatusCode.FAILED_PRECONDITION}),
        "commit beyond the computed tokens": (dict(commits=[cache_pb2.Commit(request_id="r1",
                                                                             num_computed_tokens=10**6)]),
                                              {INVALID, grpc.StatusCode.FAILED_PRECONDITION}),
        "finish of an unknown request": (dict(finishes=[cache_pb2.Finish(request_id="nobody")]),
                                         {grpc.StatusCode.NOT_FOUND}),
        "duplicate admits": (dict(admits=[cache_pb2.Admit(request_id="r2", token_ids=[1]),
                                          cache_pb2.Admit(request_id="r2", token_ids=[1])]), {INVALID}),
        "admit of a running id": (dict(admits=[cache_pb2.Admit(request_id="r1", token_ids=[1])]), {INVALID}),
        "token id beyond the vocabulary": (dict(admits=[cache_pb2.Admit(request_id="r3", token_ids=[2**32 - 1])]),
                                           {INVALID}),
        "empty admit": (dict(admits=[cache_pb2.Admit(request_id="r4")]), {INVALID}),
        "extend to 2^32-1 tokens": (dict(extends=[cache_pb2.Extend(request_id="r1", num_tokens=2**32 - 1)]),
                                    {grpc.StatusCode.OK, INVALID, grpc.StatusCode.RESOURCE_EXHAUSTED}),
    }
    for name, (kwargs, expected) in bad.items():
        try:
            response = step(**kwargs)
            code = grpc.StatusCode.OK
            for extend in response.extends:  # undo a grant, if any
                assert not extend.ok or extend.new_block_ids is not None
        except grpc.RpcError as error:
            code = error.code()
        assert code in expected, (name, code)
    # Ids of other pools: the shared pool with a stale epoch; unknown requests with its epoch.
    (shared,) = stub.Stats(cache_pb2.StatsRequest(pool_id=SHARED_POOL_ID)).pools
    expect_status(lambda: stub.Step(cache_pb2.StepRequest(pool_id=SHARED_POOL_ID, epoch=shared.epoch + 1)),
                  grpc.StatusCode.FAILED_PRECONDITION)
    expect_status(lambda: stub.Step(cache_pb2.StepRequest(pool_id=SHARED_POOL_ID, epoch=shared.epoch, finishes=[
        cache_pb2.Finish(request_id="r1")])), grpc.StatusCode.NOT_FOUND)
    expect_status(lambda: stub.Heartbeat(cache_pb2.HeartbeatRequest(pool_id=pool, epoch=epoch + 7)),
                  grpc.StatusCode.FAILED_PRECONDITION)
    stub.Evict(cache_pb2.EvictRequest(pool_id=pool, epoch=epoch, num_blocks=2**32 - 1))
    current = stub.Stats(cache_pb2.StatsRequest(pool_id=pool)).pools[0]
    step(finishes=[cache_pb2.Finish(request_id="r1", num_computed_tokens=10)])
    (stats,) = stub.Stats(cache_pb2.StatsRequest(pool_id=pool)).pools
    assert_pool_whole(stats)
    assert stats.num_locked_blocks == 0 and stats.num_running_requests == 0, (current, stats)


# ---------------------------------------------------------------------- afterwards: still whole


def test_afterwards_every_server_is_healthy_and_whole(channels, baseline, cache_service, model_service,
                                                      router) -> None:
    for channel in channels.values():
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    assert generate(channels["model"], normal_request()) == baseline
    assert generate(channels["router"], normal_request()) == baseline
    stats = wait_until_idle(cache_pb2_grpc.CacheManagerStub(channels["cache"]), SHARED_POOL_ID)
    assert stats.num_locked_blocks == 0, stats
    for running in (cache_service, model_service, router):
        output = running.output()
        assert "Traceback" not in output, output[-4000:]
