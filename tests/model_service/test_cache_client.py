"""CacheClient against the real cache service (no model), its Steps over a StepStream and as unary
calls: the serving address at registration, the load in every Step and Heartbeat, the miss
breakdown of first admissions, decode pages committed with their output tokens, resumed
admissions; a refused streamed Step loses the pool and the next registration's Steps go on a new
stream; a cache manager without StepStream gets unary Steps."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from model_service.cache_client import CacheClient, CachePoolLost
from model_service.request import FinishReason, MissBreakdown, Request
from model_service.scheduler import ReplicaLoad, Scheduler, SchedulerConfig
from tests.model_service.checks import pool_stats
from tests.model_service.test_scheduler import make_request
from tests.services import Running, start_service

POOL_ID = "cache-client-test"
ADVERTISED = "replica-b.example:7001"


@pytest.fixture(params=["stream", "unary"])
def client(cache_service: Running, request) -> Iterator[CacheClient]:
    client = CacheClient(cache_service.addr, POOL_ID, num_blocks=16, block_size=4, model_fingerprint="cc-test",
                         vocab_size=1000, serving_addr=ADVERTISED, step_stream=request.param == "stream")
    client.register()
    try:
        yield client
    finally:
        client.close()


def load_of(cache_stub) -> ReplicaLoad:
    load = pool_stats(cache_stub, POOL_ID).load
    return ReplicaLoad(load.num_waiting_requests, load.num_waiting_tokens, load.num_running_requests)


def run_step(scheduler: Scheduler, client: CacheClient):
    """One step against the real cache; every chunk that ends its tokens samples token 7."""
    plan = scheduler.plan_cache_step()
    reply = client.step(plan)
    batch = scheduler.apply_cache_reply(plan, reply)
    scheduler.on_executed(batch)
    for request, chunk in zip(batch.requests, batch.chunks, strict=True):
        if chunk.needs_logits:
            request.output_token_ids.append(7)
    return plan, reply


def test_pool_sees_the_serving_address_the_load_and_decode_pages(client: CacheClient, cache_stub):
    assert pool_stats(cache_stub, POOL_ID).serving_addr == ADVERTISED
    scheduler = Scheduler(SchedulerConfig(block_size=4, max_batch_tokens=64, max_num_seqs=1))
    first, second = make_request("first", 10, max_tokens=20), make_request("second", 6)
    scheduler.add(first)
    scheduler.add(second)
    plan, reply = run_step(scheduler, client)
    # second's first page equals first's (make_request's prompts are 1..n): only its 2 other tokens count
    assert plan.load == ReplicaLoad(1, 12, 1) == load_of(cache_stub)  # the Step carried it
    assert reply.num_free_blocks == pool_stats(cache_stub, POOL_ID).num_free_blocks == 16 - 3
    assert first.miss == MissBreakdown(new_tokens=10)  # nothing cached anywhere: all new
    # Decode until the request crosses into its fourth block: that step commits 12 tokens, the
    # last two of them output tokens, and the cache takes them.
    while len(first.block_table) < 4:
        plan, reply = run_step(scheduler, client)
    (commit,) = plan.commits
    assert (commit.num_computed_tokens, commit.output_token_ids) == (12, [7, 7])
    assert reply.commits[0].cached_tokens == 12 and first.num_shared_tokens == 12
    # The heartbeat reports the snapshot the engine keeps.
    client.load = ReplicaLoad(5, 123, 1)
    client.heartbeat()
    assert load_of(cache_stub) == ReplicaLoad(5, 123, 1)
    scheduler.finish(first, FinishReason.STOP)
    scheduler.finish(second, FinishReason.STOP)
    run_step(scheduler, client)
    stats = pool_stats(cache_stub, POOL_ID)
    assert stats.num_running_requests == 0 and stats.num_private_blocks == 0


def test_resumed_admission_is_not_counted_in_the_pool_hit_rate(client: CacheClient, cache_stub):
    scheduler = Scheduler(SchedulerConfig(block_size=4, max_batch_tokens=64, max_num_seqs=4))
    request: Request = make_request("resumed", 9)
    scheduler.add(request)
    run_step(scheduler, client)
    before = pool_stats(cache_stub, POOL_ID)
    scheduler.reset()  # as after a lost pool: the request is admitted again, as resumed
    client.incarnation = ""  # new KV tensors (as after a replica restart): the next registration is a fresh pool
    assert not client.register().restored
    run_step(scheduler, client)
    after = pool_stats(cache_stub, POOL_ID)
    assert request.was_admitted and request.num_preemptions == 1
    assert before.queried_tokens == 9 and after.queried_tokens == 0 and after.num_admitted == 1
    scheduler.finish(request, FinishReason.STOP)
    run_step(scheduler, client)


def test_a_refused_streamed_step_loses_the_pool_and_a_new_stream_serves_the_next_registration(
        cache_service: Running, cache_stub):
    def new_client() -> CacheClient:
        return CacheClient(cache_service.addr, "stream-refused", num_blocks=16, block_size=4,
                           model_fingerprint="cc-test", vocab_size=1000)

    first, second = new_client(), new_client()
    try:
        first.register()
        scheduler = Scheduler(SchedulerConfig(block_size=4, max_batch_tokens=64, max_num_seqs=4))
        scheduler.add(make_request("r", 6, max_tokens=4))
        run_step(scheduler, first)
        second.register()  # a new epoch for the worker id: first's next Step is refused
        with pytest.raises(CachePoolLost, match="FAILED_PRECONDITION"):
            run_step(scheduler, first)
        assert not first.registered and first.step_stream  # refused, not UNIMPLEMENTED: still streaming
        first.incarnation = ""
        first.register()  # takes the worker id back (second's pool is retired)
        scheduler.reset()
        run_step(scheduler, first)
        assert pool_stats(cache_stub, "stream-refused").num_running_requests == 1
        assert first.num_steps_acknowledged == 1
    finally:
        first.close()
        second.close()


@pytest.fixture
def older_cache_manager() -> Iterator[str]:
    """A cache manager process without StepStream (tests/older_cache_manager.py)."""
    running = start_service("tests.older_cache_manager", ["--without", "StepStream"], 30.0)
    try:
        yield running.addr
    finally:
        running.process.stop(5.0)


def test_a_cache_manager_without_step_stream_gets_unary_steps(older_cache_manager: str):
    client = CacheClient(older_cache_manager, "older", num_blocks=16, block_size=4, model_fingerprint="cc-test",
                         vocab_size=1000)
    try:
        client.register()
        scheduler = Scheduler(SchedulerConfig(block_size=4, max_batch_tokens=64, max_num_seqs=4))
        request = make_request("r", 6, max_tokens=4)
        scheduler.add(request)
        _, reply = run_step(scheduler, client)  # sent on the stream, UNIMPLEMENTED, sent again as a call
        assert reply.admits[0].admitted and not client.step_stream and client.registered
        _, reply = run_step(scheduler, client)
        assert reply.num_free_blocks == 16 - 2 and client.num_steps_acknowledged == 2
    finally:
        client.close()
