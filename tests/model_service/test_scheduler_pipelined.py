"""Scheduler planning for the pipelined engine: plans built ahead of a batch, lookahead asks,
replies applied after requests finished or were cancelled. The cache manager's answers are
given as plain `CacheReply` values (what the real one returns)."""

from __future__ import annotations

import pytest

from model_service.request import FinishReason, RequestStatus
from model_service.scheduler import AdmitReply, CacheReply, ExtendReply, Scheduler, SchedulerConfig
from tests.model_service.test_scheduler import commit_all, make_request

BS = 4


@pytest.fixture
def scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(block_size=BS, max_batch_tokens=64, max_num_seqs=8,
                                     defer_shared_prefix_tokens=0, lookahead_blocks=2))


def _admit(scheduler: Scheduler, rid: str, num_prompt: int, max_tokens: int = 40):
    """Admits one request (prompt + 1 token of blocks, as the cache does) and runs its prefill
    batch; returns the request and that batch (not executed yet)."""
    request = make_request(rid, num_prompt, max_tokens)
    scheduler.add(request)
    plan = scheduler.plan_cache_step()
    blocks = list(range(100, 100 + -(-(num_prompt + 1) // BS)))
    scheduler.apply_reply(plan, CacheReply([AdmitReply(rid, True, 0, blocks)], [], commit_all(plan, BS)))
    return request, scheduler.build_batch()


def test_plan_ahead_asks_for_the_sampled_token_plus_lookahead(scheduler):
    request, batch = _admit(scheduler, "a", 7)  # 8 tokens after the prefill: 2 blocks held
    plan = scheduler.plan_cache_step(ahead=batch)
    (ext,) = plan.extends
    assert ext.num_tokens == 8 and ext.num_lookahead_tokens == 2 * BS
    # Synchronous planning of the same state asks for nothing: 7 tokens fit in 2 blocks.
    assert scheduler.plan_cache_step().extends == []


def test_lookahead_never_goes_past_what_the_request_can_generate(scheduler):
    request, batch = _admit(scheduler, "a", 7, max_tokens=2)
    (ext,) = scheduler.plan_cache_step(ahead=batch).extends
    assert ext.num_tokens + ext.num_lookahead_tokens == 9  # prompt + max_tokens


def test_a_failed_lookahead_ask_preempts_nobody_and_the_next_asks_need_only(scheduler):
    a, batch = _admit(scheduler, "a", 7)  # 2 blocks: the prompt and its first sampled token
    b, _ = _admit(scheduler, "b", 3)
    plan = scheduler.plan_cache_step(ahead=batch)
    assert [(e.request.request_id, e.num_lookahead_tokens) for e in plan.extends] == [("a", 2 * BS), ("b", 2 * BS)]
    scheduler.apply_reply(plan, CacheReply([], [ExtendReply("a", False, []), ExtendReply("b", False, [])],
                                           commit_all(plan, BS), num_free_blocks=0))
    assert scheduler.num_preemptions == 0 and scheduler.running == [a, b]
    scheduler.on_executed(batch)
    a.output_token_ids.append(5)  # 8 tokens in 2 blocks: not blocked yet, the next one needs a third
    assert not scheduler.needs_reply()
    plan = scheduler.plan_cache_step(ahead=scheduler.build_batch())
    assert [(e.request.request_id, e.num_tokens, e.num_lookahead_tokens) for e in plan.extends][0] == ("a", 9, 0)
    # That one fails too: now a is preempted as in the synchronous path (b is newer: it goes first).
    scheduler.apply_reply(plan, CacheReply([], [ExtendReply(e.request.request_id, False, []) for e in plan.extends],
                                           commit_all(plan, BS), num_free_blocks=0))
    assert scheduler.num_preemptions >= 1 and b.status is RequestStatus.WAITING


def test_a_finish_record_taken_after_the_reply_holds_the_new_blocks(scheduler):
    a, batch = _admit(scheduler, "a", 7)
    plan = scheduler.plan_cache_step(ahead=batch)  # in flight: a's extension
    scheduler.on_executed(batch)
    a.output_token_ids.append(5)
    scheduler.finish(a, FinishReason.STOP)  # finished while the Step is in flight
    scheduler.apply_reply(plan, CacheReply([], [ExtendReply("a", True, [7, 8, 9])], commit_all(plan, BS)))
    (record,) = scheduler.plan_cache_step().finishes
    assert record.block_table == [100, 101, 7, 8, 9] and record.num_computed_tokens == 7


def test_a_request_cancelled_while_its_admission_is_in_flight_goes_back_as_a_finish(scheduler):
    request = make_request("a", 9)
    scheduler.add(request)
    plan = scheduler.plan_cache_step(ahead=scheduler.build_batch())
    scheduler.finish(request, FinishReason.CANCELLED)
    scheduler.apply_reply(plan, CacheReply([AdmitReply("a", True, 4, [1, 2, 3])], []))
    assert scheduler.running == [] and request.status is RequestStatus.FINISHED
    (record,) = scheduler.plan_cache_step().finishes
    assert record.block_table == [1, 2, 3] and record.num_computed_tokens == 4 and record.output_token_ids == []


def test_a_reset_voids_the_plans_of_the_older_generation(scheduler):
    _admit(scheduler, "a", 7)
    before = scheduler.generation
    scheduler.reset()
    assert scheduler.generation == before + 1 and scheduler.running == []
