"""The pipelined engine step (CachePipeline) against the real cache service, with the real
scheduler: which step a request joins. The forward pass is stood in for by a recorder that marks
each batch's tokens computed and samples token 7 where a chunk ends (no model: what is checked is
the planning). A prompt long enough to be worth a cache round trip joins the step it arrives
before, also when that step would only decode; a short one is admitted by the Step in flight and
joins the step after; a prefix group's followers join the step right after their leader's prompt."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from model_service.cache_client import CacheClient
from model_service.cache_pipeline import SYNC_ADMIT_TOKENS, CachePipeline
from model_service.detokenizer import IncrementalDetokenizer
from model_service.metrics import ModelMetrics
from model_service.request import FinishReason, Request
from model_service.sampler import SamplingOptions
from model_service.scheduler import (
    AdmitReply,
    CachePlan,
    CacheReply,
    ScheduledBatch,
    Scheduler,
    SchedulerConfig,
)
from tests.model_service.checks import assert_pool_whole, pool_stats
from tests.model_service.test_scheduler import _NoText, make_request
from tests.services import Running

BS = 4
NUM_BLOCKS = 400


def _request(rid: str, prompt: list[int], max_tokens: int = 50) -> Request:
    return Request(request_id=rid, prompt_token_ids=prompt, sampling=SamplingOptions(temperature=0.0),
                   max_tokens=max_tokens, stop_token_ids=frozenset(), namespace="", ignore_eos=False,
                   arrival_time=0.0, detokenizer=IncrementalDetokenizer(_NoText(), prompt))


class Stepper:
    """A CachePipeline over the real cache with a recording stand-in for the forward pass."""

    def __init__(self, client: CacheClient) -> None:
        self.scheduler = Scheduler(SchedulerConfig(block_size=BS, max_batch_tokens=2048, max_num_seqs=16,
                                                   lookahead_blocks=2))
        self.metrics = ModelMetrics()
        self.pipeline = CachePipeline(client, self.scheduler, self.metrics)
        self.batches: list[dict[str, int]] = []  # per executed step: request id -> tokens computed

    def apply(self, plan: CachePlan, reply: CacheReply) -> None:
        self.scheduler.apply_reply(plan, reply)

    def execute(self, batch: ScheduledBatch) -> None:
        # A forward pass outlasts a loopback round trip: this one ends once the Step sent before it
        # is back, so which step a request joins does not depend on this machine's speed.
        flight = self.pipeline._flight
        deadline = time.monotonic() + 30
        while flight is not None and not flight.call.done() and time.monotonic() < deadline:
            time.sleep(0.001)
        self.batches.append({r.request_id: len(c.token_ids) for r, c in zip(*batch, strict=True)})
        self.scheduler.on_executed(batch)
        for request, chunk in zip(*batch, strict=True):
            if chunk.needs_logits:
                request.output_token_ids.append(7)
                if len(request.output_token_ids) >= request.max_tokens:
                    self.scheduler.finish(request, FinishReason.LENGTH)

    def step(self) -> dict[str, int]:
        """One engine step; the batch it executed ({} when none)."""
        executed = len(self.batches)
        self.pipeline.step(self.apply, self.execute)
        return self.batches[-1] if len(self.batches) > executed else {}

    def run_until(self, done, limit: int = 200) -> None:
        for _ in range(limit):
            if done():
                return
            self.step()
        raise AssertionError("the engine did not get there")

    def drain(self, cache_stub, pool_id: str) -> None:
        """Finishes everything and checks the pool's accounting is whole again."""
        for request in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.finish(request, FinishReason.ABORT)
        self.run_until(lambda: not self.scheduler.has_work() and not self.pipeline.in_flight)
        stats = pool_stats(cache_stub, pool_id)
        assert_pool_whole(stats)
        assert stats.num_private_blocks == 0 and stats.num_locked_blocks == 0 and stats.num_running_requests == 0


@pytest.fixture
def stepper(cache_service: Running, request) -> Iterator[tuple[Stepper, str]]:
    pool_id = f"pipeline-{request.node.name}"[:60]
    client = CacheClient(cache_service.addr, pool_id, num_blocks=NUM_BLOCKS, block_size=BS,
                         model_fingerprint="pipeline-test", vocab_size=50000)
    client.register()
    try:
        yield Stepper(client), pool_id
    finally:
        client.close()


def _decoding(stepper: Stepper, rid: str) -> Request:
    """A request that is past its prompt and decodes one token per step."""
    request = make_request(rid, 8, max_tokens=200)
    stepper.scheduler.add(request)
    stepper.run_until(lambda: len(request.output_token_ids) >= 2)
    return request


def test_a_long_prompt_joins_the_step_it_arrives_before(stepper, cache_stub) -> None:
    s, pool_id = stepper
    _decoding(s, "decoding")
    long = _request("long", list(range(1000, 1000 + SYNC_ADMIT_TOKENS + 40)))
    s.scheduler.add(long)
    waits = s.metrics.cache_waits._value.get()
    assert s.step() == {"decoding": 1, "long": SYNC_ADMIT_TOKENS + 40}
    assert s.metrics.cache_waits._value.get() == waits + 1  # it waited for that admission, once
    s.drain(cache_stub, pool_id)


def test_a_short_prompt_is_admitted_ahead_and_joins_the_next_step(stepper, cache_stub) -> None:
    s, pool_id = stepper
    _decoding(s, "decoding")
    s.scheduler.add(_request("short", list(range(2000, 2010))))
    waits = s.metrics.cache_waits._value.get()
    assert s.step() == {"decoding": 1}  # not worth a round trip: the Step in flight admits it
    assert s.step() == {"decoding": 1, "short": 10}
    assert s.metrics.cache_waits._value.get() == waits  # the decodes never waited for it
    s.drain(cache_stub, pool_id)


def test_followers_join_the_step_right_after_their_leaders_prompt(stepper, cache_stub) -> None:
    """All sent at once: the followers wait for the leader's pages (computed once), then join the
    very next step as cache hits, not after a step of the leader's decode alone."""
    s, pool_id = stepper
    shared = list(range(3000, 3000 + 300))
    leader = _request("leader", shared + [1, 2, 3, 4])
    followers = [_request(f"follower-{i}", shared + [10 + i] * 6) for i in range(3)]
    for request in [leader, *followers]:
        s.scheduler.add(request)
    s.run_until(lambda: bool(s.batches))
    assert s.batches[0] == {"leader": 304}
    assert s.step() == {"leader": 1, **{f.request_id: 6 for f in followers}}
    assert all(f.num_shared_tokens == 300 for f in followers)  # the leader's pages, hit
    s.drain(cache_stub, pool_id)


def test_no_wait_for_admissions_while_the_pool_refused_one() -> None:
    """After the pool had no room for an admission, waiting requests are not worth a round trip
    per step until a finish or release returns blocks."""
    scheduler = Scheduler(SchedulerConfig(block_size=BS, max_batch_tokens=2048, max_num_seqs=4))
    small = make_request("small", 8)
    scheduler.add(small)
    plan = scheduler.plan_cache_step()
    scheduler.apply_reply(plan, CacheReply([AdmitReply("small", True, 0, [0, 1, 2])], []))
    scheduler.add(make_request("big", 400))
    assert scheduler.admissible_waiting_tokens(256) == 256  # counted up to the limit
    plan = scheduler.plan_cache_step()
    scheduler.apply_reply(plan, CacheReply([AdmitReply("big", False, 0, [])], []))
    assert scheduler.admissible_waiting_tokens(256) == 0
    scheduler.finish(small, FinishReason.LENGTH)
    assert scheduler.admissible_waiting_tokens(256) == 0  # its blocks are not back yet
    assert scheduler.plan_cache_step().finishes  # this Step returns them
    assert scheduler.admissible_waiting_tokens(256) == 256


def test_no_wait_for_admissions_without_a_free_sequence_slot() -> None:
    scheduler = Scheduler(SchedulerConfig(block_size=BS, max_batch_tokens=2048, max_num_seqs=1))
    scheduler.add(make_request("running", 8))
    plan = scheduler.plan_cache_step()
    scheduler.apply_reply(plan, CacheReply([AdmitReply("running", True, 0, [0, 1, 2])], []))
    scheduler.add(make_request("waiting", 400))
    assert scheduler.admissible_waiting_tokens(256) == 0
