"""Scheduler unit tests: planning, admission order, chunking, preemption, finishes, reset.
The cache manager's answers are given as plain `CacheReply` values (what the real one returns)."""

from __future__ import annotations

import pytest

from model_service.detokenizer import IncrementalDetokenizer
from model_service.request import FinishReason, Request, RequestStatus
from model_service.sampler import SamplingOptions
from model_service.scheduler import (
    AdmitReply,
    CacheReply,
    CommitReply,
    ExtendReply,
    Scheduler,
    SchedulerConfig,
)


class _NoText:
    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""


def make_request(rid: str, num_prompt: int, max_tokens: int = 8) -> Request:
    prompt = list(range(1, num_prompt + 1))
    return Request(request_id=rid, prompt_token_ids=prompt, sampling=SamplingOptions(temperature=0.0),
                   max_tokens=max_tokens, stop_token_ids=frozenset(), namespace="", ignore_eos=False,
                   arrival_time=0.0, detokenizer=IncrementalDetokenizer(_NoText(), prompt))


def commit_all(plan, bs: int = 16) -> list[CommitReply]:
    """The cache's answer to every commit when no other request cached the pages first."""
    return [CommitReply(c.request.request_id, c.num_computed_tokens, c.request.block_table[:c.num_computed_tokens // bs])
            for c in plan.commits]


def admit_all(plan, cached: int = 0, bs: int = 16) -> CacheReply:
    return CacheReply(
        admits=[AdmitReply(r.request_id, True, cached, list(range(-(-(r.num_tokens + 1) // bs))))
                for r in plan.admits],
        extends=[ExtendReply(e.request.request_id, True, [100]) for e in plan.extends],
        commits=commit_all(plan, bs))


@pytest.fixture
def scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(block_size=16, max_batch_tokens=150, max_num_seqs=8))


def test_admission_stops_at_the_token_budget_and_chunks_the_last_prompt(scheduler):
    for i in range(3):
        scheduler.add(make_request(f"r{i}", 100))
    plan = scheduler.plan_cache_step()
    assert [r.request_id for r in plan.admits] == ["r0", "r1"]
    batch = scheduler.apply_cache_reply(plan, admit_all(plan))
    assert [len(c.token_ids) for c in batch.chunks] == [100, 50]
    assert [c.needs_logits for c in batch.chunks] == [True, False]
    assert [c.start_position for c in batch.chunks] == [0, 0]
    scheduler.on_executed(batch)
    assert [r.num_computed_tokens for r in scheduler.running] == [100, 50]
    assert [r.request_id for r in scheduler.waiting] == ["r2"]


def test_no_space_keeps_first_come_first_served_order(scheduler):
    for i in range(2):
        scheduler.add(make_request(f"r{i}", 10))
    plan = scheduler.plan_cache_step()
    reply = CacheReply(admits=[AdmitReply("r0", False, 0, []), AdmitReply("r1", False, 0, [])], extends=[])
    batch = scheduler.apply_cache_reply(plan, reply)
    assert batch.chunks == [] and [r.request_id for r in scheduler.waiting] == ["r0", "r1"]


def test_cached_prefix_is_skipped_and_recorded_once(scheduler):
    scheduler.add(make_request("r0", 40))
    plan = scheduler.plan_cache_step()
    batch = scheduler.apply_cache_reply(plan, admit_all(plan, cached=32))
    (chunk,) = batch.chunks
    assert chunk.start_position == 32 and chunk.token_ids == list(range(33, 41))
    assert scheduler.running[0].cached_prompt_tokens == 32


def _decode_ready(scheduler: Scheduler, rid: str, num_prompt: int) -> Request:
    scheduler.add(make_request(rid, num_prompt))
    plan = scheduler.plan_cache_step()
    batch = scheduler.apply_cache_reply(plan, admit_all(plan))
    scheduler.on_executed(batch)
    request = scheduler.running[-1]
    request.output_token_ids.append(7)
    return request


def test_decode_crossing_a_block_asks_for_an_extension(scheduler):
    request = _decode_ready(scheduler, "r0", 32)  # 32 prompt + 1 lookahead -> 3 blocks
    request.output_token_ids.extend([8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23])
    request.num_computed_tokens = request.num_tokens - 1
    plan = scheduler.plan_cache_step()
    assert [(e.request.request_id, e.num_tokens) for e in plan.extends] == [("r0", 49)]
    batch = scheduler.apply_cache_reply(plan, admit_all(plan))
    assert request.block_table[-1] == 100
    assert batch.chunks[0].token_ids == [23] and batch.chunks[0].start_position == 48


def test_failed_extension_preempts_the_newest_and_pauses_admission(scheduler):
    old = _decode_ready(scheduler, "old", 32)
    new = _decode_ready(scheduler, "new", 32)
    for r in (old, new):
        r.output_token_ids.extend(range(16))
        r.num_computed_tokens = r.num_tokens - 1
    scheduler.add(make_request("late", 4))
    plan = scheduler.plan_cache_step()
    assert len(plan.extends) == 2
    reply = CacheReply(admits=[AdmitReply("late", False, 0, [])],
                       extends=[ExtendReply("old", True, [100]), ExtendReply("new", False, [])],
                       commits=commit_all(plan))
    batch = scheduler.apply_cache_reply(plan, reply)
    assert [r.request_id for r in batch.requests] == ["old"]
    assert [r.request_id for r in scheduler.waiting] == ["new", "late"]
    assert new.status is RequestStatus.WAITING and new.num_preemptions == 1 and new.block_table == []
    next_plan = scheduler.plan_cache_step()
    (release,) = next_plan.releases
    assert release.request_id == "new" and release.num_computed_tokens == 48
    assert release.output_token_ids == [7, *range(16)]
    assert next_plan.admits == []  # paused for one step after a preemption
    assert [r.request_id for r in scheduler.plan_cache_step().admits] == ["new", "late"]


def test_readmitted_request_recomputes_across_prompt_and_output(scheduler):
    request = _decode_ready(scheduler, "r0", 20)
    request.output_token_ids.append(8)
    scheduler.reset()
    assert request.status is RequestStatus.WAITING and request.num_computed_tokens == 0
    plan = scheduler.plan_cache_step()
    assert plan.admits == [request] and plan.releases == []
    batch = scheduler.apply_cache_reply(plan, admit_all(plan, cached=16))
    assert batch.chunks[0].token_ids == [17, 18, 19, 20, 7, 8]
    assert request.cached_prompt_tokens == 0  # the first admission's hit is what usage reports


def test_finish_reports_running_requests_only(scheduler):
    running = _decode_ready(scheduler, "run", 10)
    waiting = make_request("wait", 10)
    scheduler.add(waiting)
    scheduler.finish(running, FinishReason.STOP)
    scheduler.finish(waiting, FinishReason.CANCELLED)
    scheduler.finish(running, FinishReason.STOP)  # idempotent
    plan = scheduler.plan_cache_step()
    assert [f.request_id for f in plan.finishes] == ["run"]
    assert plan.finishes[0].num_computed_tokens == 10 and plan.finishes[0].output_token_ids == [7]
    assert not scheduler.has_work()


def test_computed_prompt_pages_are_committed_once_per_chunk(scheduler):
    scheduler.add(make_request("r0", 100))
    scheduler.add(make_request("r1", 100))
    plan = scheduler.plan_cache_step()
    assert plan.commits == []
    batch = scheduler.apply_cache_reply(plan, admit_all(plan))
    scheduler.on_executed(batch)  # r0: 100 computed, r1: a 50-token chunk
    r0, r1 = scheduler.running
    plan = scheduler.plan_cache_step()
    assert [(c.request.request_id, c.num_computed_tokens) for c in plan.commits] == [("r0", 96), ("r1", 48)]
    # Another request cached r1's first page first: r1 uses that copy from now on.
    reply = admit_all(plan)
    reply = reply._replace(commits=[reply.commits[0], CommitReply("r1", 48, [900, 901, 902])])
    batch = scheduler.apply_cache_reply(plan, reply)
    assert r1.block_table[:4] == [900, 901, 902, 3] and r1.num_shared_tokens == 48
    assert r0.num_shared_tokens == 96
    assert [c.block_table[:3] for c in batch.chunks if c.block_table is r1.block_table] == [[900, 901, 902]]
    scheduler.on_executed(batch)  # r1's second chunk; r0 decodes nothing new (no token sampled here)
    r0.output_token_ids.append(7)
    plan = scheduler.plan_cache_step()
    assert [(c.request.request_id, c.num_computed_tokens) for c in plan.commits] == [("r1", 96)]
    scheduler.apply_cache_reply(plan, admit_all(plan))
    assert scheduler.plan_cache_step().commits == []  # decode steps commit nothing


def test_finished_and_preempted_requests_are_not_committed(scheduler):
    done = _decode_ready(scheduler, "done", 40)
    scheduler.finish(done, FinishReason.STOP)
    plan = scheduler.plan_cache_step()
    assert plan.commits == [] and [f.request_id for f in plan.finishes] == ["done"]
