"""The replica side of the fleet contract through real processes, on the tiny random Llama (fast):
Abort by id from a second client, GetLoad, client-chosen request ids (duplicates rejected),
--advertise-addr, the miss breakdown and served_by in Usage, decode pages shared while their
request still runs, and the pool's hit rate agreeing with the replica's under preemption."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from protos import model_pb2, model_pb2_grpc
from tests.model_service.checks import expect_status, pool_stats, wait_for, wait_until_idle
from tests.model_service.generation import greedy, reference_greedy
from tests.services import Running, start_model

POOL_ID = "tiny-replica-api"
ADVERTISED = "replica-a.example:7000"
NUM_BLOCKS = 1024  # of 4 tokens: three long streams never run out of blocks
LONG = 900  # max_tokens of a stream that is aborted long before it ends


@pytest.fixture(scope="module")
def replica(cache_service: Running, tiny_dir: Path) -> Iterator[Running]:
    running = start_model(cache_service.addr, "--model", str(tiny_dir), "--worker-id", POOL_ID,
                          "--block-size", "4", "--num-blocks", str(NUM_BLOCKS), "--max-num-seqs", "2",
                          "--advertise-addr", ADVERTISED)
    try:
        yield running
    finally:
        running.process.stop(10.0)


@pytest.fixture(scope="module")
def stub(replica: Running) -> Iterator[model_pb2_grpc.ModelServiceStub]:
    with grpc.insecure_channel(replica.addr) as channel:
        yield model_pb2_grpc.ModelServiceStub(channel)


@pytest.fixture
def other_client(replica: Running) -> Iterator[model_pb2_grpc.ModelServiceStub]:
    """A second client of the same replica (a router or an operator)."""
    with grpc.insecure_channel(replica.addr) as channel:
        yield model_pb2_grpc.ModelServiceStub(channel)


_rng = random.Random(23)


def random_prompt(n: int) -> list[int]:
    return [_rng.randrange(3, 49152) for _ in range(n)]


def open_stream(stub: model_pb2_grpc.ModelServiceStub, prompt: list[int], request_id: str = "",
                max_tokens: int = LONG):
    request = model_pb2.GenerateRequest(request_id=request_id, token_ids=model_pb2.TokenIds(ids=prompt),
                                        sampling=model_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                          ignore_eos=True))
    return stub.Generate(request, timeout=120)


def get_load(stub: model_pb2_grpc.ModelServiceStub) -> model_pb2.GetLoadResponse:
    return stub.GetLoad(model_pb2.GetLoadRequest(), timeout=30)


def abort(stub: model_pb2_grpc.ModelServiceStub, request_id: str) -> None:
    stub.Abort(model_pb2.AbortRequest(request_id=request_id), timeout=30)


def test_abort_from_another_client_ends_the_stream_with_abort(stub, other_client, cache_stub):
    stream = open_stream(stub, random_prompt(20), "abort-me")
    first = next(stream)
    assert first.request_id == "abort-me" and first.token_ids
    abort(other_client, "abort-me")
    rest = list(stream)  # ends normally: no error
    last = rest[-1]
    assert last.finish_reason == model_pb2.FINISH_REASON_ABORT and last.request_id == "abort-me"
    tokens = [t for m in [first, *rest] for t in m.token_ids]
    assert last.usage.completion_tokens == len(tokens) < LONG
    assert last.usage.prompt_tokens == 20 and last.usage.served_by == ADVERTISED
    stats = wait_until_idle(cache_stub, POOL_ID)  # no running request, no private block
    assert stats.num_locked_blocks == 0
    expect_status(lambda: abort(other_client, "abort-me"), grpc.StatusCode.NOT_FOUND, "'abort-me'",
                  "unknown or already finished")
    expect_status(lambda: abort(other_client, "never-seen"), grpc.StatusCode.NOT_FOUND, "'never-seen'")
    expect_status(lambda: abort(other_client, ""), grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")


def test_get_load_counts_running_and_waiting_requests(stub, other_client, cache_stub):
    wait_until_idle(cache_stub, POOL_ID)
    before = get_load(stub)
    prompts = [random_prompt(n) for n in (21, 13, 30)]
    streams = [open_stream(stub, p, f"load-{i}") for i, p in enumerate(prompts)]
    for s in streams[:2]:  # --max-num-seqs 2: these two run, the third waits
        next(s)
    wait_for(lambda: get_load(stub).num_waiting_requests == 1, 10, "the third request to wait")
    load = get_load(stub)
    assert (load.num_running_requests, load.num_waiting_requests) == (2, 1)
    assert load.num_waiting_tokens == 30  # the waiting prompt; the running ones are prefilled
    assert load.num_blocks == NUM_BLOCKS and 0 < load.num_free_blocks < NUM_BLOCKS
    assert load.kv_usage == pytest.approx(1 - load.num_free_blocks / NUM_BLOCKS)
    assert (load.serving_addr, load.pool_id) == (ADVERTISED, POOL_ID)
    # A waiting request aborted: its stream ends with ABORT before it computed anything.
    abort(other_client, "load-2")
    (final,) = list(streams[2])
    assert final.finish_reason == model_pb2.FINISH_REASON_ABORT and final.usage.completion_tokens == 0
    for i in (0, 1):
        abort(other_client, f"load-{i}")
    finals = [list(s)[-1] for s in streams[:2]]
    wait_until_idle(cache_stub, POOL_ID)
    wait_for(lambda: get_load(stub).num_running_requests == 0, 10, "the load to show no running request")
    after = get_load(stub)
    assert (after.num_waiting_requests, after.num_waiting_tokens) == (0, 0)
    assert after.prompt_tokens - before.prompt_tokens == 21 + 13  # first admissions only
    cached = sum(f.usage.cached_prompt_tokens for f in finals)
    assert after.cached_prompt_tokens - before.cached_prompt_tokens == cached
    assert after.prefix_hit_rate == pytest.approx(after.cached_prompt_tokens / after.prompt_tokens)


def test_a_live_request_id_cannot_be_reused_until_it_ends(stub, other_client):
    stream = open_stream(stub, random_prompt(9), "dup")
    next(stream)
    expect_status(lambda: list(open_stream(stub, random_prompt(5), "dup", max_tokens=2)),
                  grpc.StatusCode.ALREADY_EXISTS, "'dup'", "live request")
    abort(other_client, "dup")
    assert list(stream)[-1].finish_reason == model_pb2.FINISH_REASON_ABORT
    # The id is free once the final message is out: reused at once, again and again.
    for _ in range(8):
        again = list(open_stream(stub, random_prompt(5), "dup", max_tokens=2))
        assert {m.request_id for m in again} == {"dup"}
        assert again[-1].finish_reason == model_pb2.FINISH_REASON_LENGTH


def test_model_info_reports_the_advertised_address(stub):
    info = stub.ModelInfo(model_pb2.ModelInfoRequest(), timeout=30)
    assert info.serving_addr == ADVERTISED and info.pool_id == POOL_ID


def test_usage_carries_the_miss_breakdown_and_served_by(stub):
    prompt = random_prompt(22)
    first = greedy(stub, prompt, 2).final.usage
    assert first.served_by == ADVERTISED and first.cached_prompt_tokens == 0
    assert first.miss_new_tokens == 22  # never seen anywhere
    assert first.miss_evicted_tokens == first.miss_other_replica_tokens == first.miss_other_namespace_tokens == 0
    second = greedy(stub, prompt, 2).final.usage
    assert second.cached_prompt_tokens == 20
    assert second.miss_new_tokens == 2  # the partial last page (and the last token, always computed)


def test_decode_pages_are_shared_while_their_request_runs(stub, other_client, tiny_reference):
    """A request's pages filled during decode are cached as they fill: a request whose prompt is
    the first one's prompt and output so far hits them while the first still runs, and its
    output (computed on that shared KV) matches transformers."""
    prompt = random_prompt(20)
    stream = open_stream(stub, prompt, "decoder")
    outputs: list[int] = []
    while len(outputs) < 20:
        outputs.extend(next(stream).token_ids)
    follower = prompt + outputs[:16] + [5]  # 37 tokens: 9 full pages, 4 of them decode pages
    result = greedy(stub, follower, 6)
    abort(other_client, "decoder")
    assert list(stream)[-1].finish_reason == model_pb2.FINISH_REASON_ABORT
    assert result.final.usage.cached_prompt_tokens == 36  # not only the prompt's 20
    assert result.token_ids == reference_greedy(tiny_reference, follower, 6)


@pytest.mark.replica  # starts its own model service (tests/conftest.py)
def test_pool_hit_rate_agrees_with_first_admissions_under_preemption(cache_service, tiny_dir, cache_stub):
    """In a pool too small for the requests together, preempted requests are re-admitted as
    resumed: the pool counts first admissions only, as the replica's GetLoad and the clients'
    usage do. Without --advertise-addr the replica reports its own host:port."""
    running = start_model(cache_service.addr, "--model", str(tiny_dir), "--worker-id", "tiny-resumed",
                          "--block-size", "4", "--num-blocks", "32")
    try:
        with grpc.insecure_channel(running.addr) as channel:
            small = model_pb2_grpc.ModelServiceStub(channel)
            assert small.ModelInfo(model_pb2.ModelInfoRequest(), timeout=30).serving_addr == running.addr
            prompts = [random_prompt(n) for n in (3, 17, 40, 61, 9, 33)]
            with ThreadPoolExecutor(len(prompts)) as pool:
                usages = [g.final.usage for g in pool.map(lambda p: greedy(small, p, 60), prompts)]
            assert sum(u.num_preemptions for u in usages) > 0
            assert {u.served_by for u in usages} == {running.addr}
            stats = wait_until_idle(cache_stub, "tiny-resumed")
            load = get_load(small)
    finally:
        running.process.stop(10.0)
    assert stats.num_released > 0
    assert stats.queried_tokens == load.prompt_tokens == sum(len(p) for p in prompts)
    assert stats.hit_tokens == load.cached_prompt_tokens == sum(u.cached_prompt_tokens for u in usages)


def test_cache_manager_knows_the_serving_address_and_load(cache_stub, stub):
    """The pool registered with --advertise-addr; every Step and Heartbeat carries the load."""
    stats = pool_stats(cache_stub, POOL_ID)
    assert stats.serving_addr == ADVERTISED
    stream = open_stream(stub, random_prompt(12), "reported")
    next(stream)
    wait_for(lambda: pool_stats(cache_stub, POOL_ID).load.num_running_requests == 1, 10,
             "the cache manager to see one running request")
    stream.cancel()
    wait_until_idle(cache_stub, POOL_ID)
