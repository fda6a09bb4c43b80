"""Scheduler unit tests: planning, admission order, chunking, preemption, finishes, reset.
The cache manager's answers are given as plain `CacheReply` values (what the real one returns)."""

from __future__ import annotations

import pytest

from model_service.detokenizer import IncrementalDetokenizer
from model_service.request import FinishReason, MissBreakdown, Request, RequestStatus
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
    # make_request's prompts all start alike: without the in-batch prefix check, so these tests
    # see plain FCFS admission (the check has tests of its own below).
    return Scheduler(SchedulerConfig(block_size=16, max_batch_tokens=150, max_num_seqs=8,
                                     defer_shared_prefix_tokens=0))


def test_admission_stops_at_the_token_budget_and_chunks_the_last_prompt(scheduler):
    for i in range(4):
        scheduler.add(make_request(f"r{i}", 60))
    plan = scheduler.plan_cache_step()
    assert [r.request_id for r in plan.admits] == ["r0", "r1", "r2"]
    batch = scheduler.apply_cache_reply(plan, admit_all(plan))
    assert [len(c.token_ids) for c in batch.chunks] == [60, 60, 30]
    assert [c.needs_logits for c in batch.chunks] == [True, True, False]
    assert [c.start_position for c in batch.chunks] == [0, 0, 0]
    scheduler.on_executed(batch)
    assert [r.num_computed_tokens for r in scheduler.running] == [60, 60, 30]
    assert [r.request_id for r in scheduler.waiting] == ["r3"]


def test_a_long_prompt_takes_the_rest_of_a_step_the_one_before_it_ends_in(scheduler):
    """The step's budget is filled: once the first long prompt's last chunk is in, the next one's
    first chunk takes the rest (as vLLM's chunked prefill does), instead of a half-empty step."""
    for i in range(2):
        scheduler.add(make_request(f"r{i}", 100))
    plan = scheduler.plan_cache_step()
    batch = scheduler.apply_cache_reply(plan, admit_all(plan))
    assert [(r.request_id, len(c.token_ids)) for r, c in zip(*batch, strict=True)] == [("r0", 100), ("r1", 50)]
    assert [c.needs_logits for c in batch.chunks] == [True, False]
    scheduler.on_executed(batch)
    scheduler.running[0].output_token_ids.append(7)
    plan = scheduler.plan_cache_step()
    batch = scheduler.apply_cache_reply(plan, admit_all(plan))
    assert [(r.request_id, len(c.token_ids)) for r, c in zip(*batch, strict=True)] == [("r0", 1), ("r1", 50)]


def test_long_prompts_that_stop_short_are_computed_one_at_a_time(scheduler):
    """Two prompts that each take more than a step do not share steps: the first reaches its first
    token a step sooner, the second no later than if they had shared every step."""
    for i in range(2):
        scheduler.add(make_request(f"r{i}", 300))
    for expected in ([("r0", 150)], [("r0", 150)], [("r0", 1), ("r1", 149)]):
        plan = scheduler.plan_cache_step()
        batch = scheduler.apply_cache_reply(plan, admit_all(plan))
        assert [(r.request_id, len(c.token_ids)) for r, c in zip(*batch, strict=True)] == expected
        scheduler.on_executed(batch)
        for request, chunk in zip(*batch, strict=True):
            if chunk.needs_logits:
                request.output_token_ids.append(7)


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
    scheduler.add(make_request("r0", 70))
    scheduler.add(make_request("r1", 200))
    plan = scheduler.plan_cache_step()
    assert plan.commits == []
    batch = scheduler.apply_cache_reply(plan, admit_all(plan))
    assert [len(c.token_ids) for c in batch.chunks] == [70]  # r1 waits one step for the short r0
    scheduler.on_executed(batch)
    r0, r1 = scheduler.running
    plan = scheduler.plan_cache_step()
    assert [(c.request.request_id, c.num_computed_tokens) for c in plan.commits] == [("r0", 64)]
    batch = scheduler.apply_cache_reply(plan, admit_all(plan))
    assert [(c.block_table is r1.block_table, len(c.token_ids)) for c in batch.chunks] == [(True, 150)]
    scheduler.on_executed(batch)  # r1's first chunk; r0 decodes nothing new (no token sampled here)
    plan = scheduler.plan_cache_step()
    assert [(c.request.request_id, c.num_computed_tokens) for c in plan.commits] == [("r1", 144)]
    # Another request cached r1's first pages first: r1 uses that copy from now on.
    fourth = r1.block_table[3]
    reply = admit_all(plan)._replace(commits=[CommitReply("r1", 48, [900, 901, 902])])
    batch = scheduler.apply_cache_reply(plan, reply)
    assert r1.block_table[:4] == [900, 901, 902, fourth] and r1.num_shared_tokens == 48
    assert r0.num_shared_tokens == 64
    assert [c.block_table[:3] for c in batch.chunks if c.block_table is r1.block_table] == [[900, 901, 902]]
    scheduler.on_executed(batch)  # r1's second chunk
    r0.output_token_ids.append(7)
    plan = scheduler.plan_cache_step()
    assert [(c.request.request_id, c.num_computed_tokens) for c in plan.commits] == [("r1", 192)]
    scheduler.apply_cache_reply(plan, admit_all(plan))
    assert scheduler.plan_cache_step().commits == []  # decode steps commit nothing


def test_finished_and_preempted_requests_are_not_committed(scheduler):
    done = _decode_ready(scheduler, "done", 40)
    scheduler.finish(done, FinishReason.STOP)
    plan = scheduler.plan_cache_step()
    assert plan.commits == [] and [f.request_id for f in plan.finishes] == ["done"]


# ---------------------------------------------------------------- preemption under a full pool


class SyntheticPool:
    """The cache manager's block accounting for one pool, without a radix tree: a released or
    finished request's blocks are free again at once (as the real pool's unlocked cached pages
    are evictable at once), commits keep the request's own blocks. Checks, as the real one does,
    that a release's block table is exactly what the pool gave the request."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.free = list(range(num_blocks))
        self.block_size = block_size
        self.tables: dict[str, list[int]] = {}

    def _take(self, num_tokens: int, table: list[int]) -> list[int] | None:
        need = -(-num_tokens // self.block_size) - len(table)
        if need > len(self.free):
            return None
        new, self.free = self.free[:need], self.free[need:]
        table.extend(new)
        return new

    def step(self, plan) -> CacheReply:
        for record in [*plan.releases, *plan.finishes]:
            assert record.block_table == self.tables[record.request_id]
            self.free.extend(self.tables.pop(record.request_id))
        extends = []
        for item in plan.extends:
            new = self._take(item.num_tokens, self.tables[item.request.request_id])
            extends.append(ExtendReply(item.request.request_id, new is not None, new or []))
        admits, full = [], False
        for request in plan.admits:
            table: list[int] = []
            full = full or self._take(request.num_tokens + 1, table) is None
            if not full:
                self.tables[request.request_id] = table
            admits.append(AdmitReply(request.request_id, not full, 0, [] if full else table))
        return CacheReply(admits, extends, commit_all(plan, self.block_size), len(self.free))


def run_step(scheduler: Scheduler, pool: SyntheticPool, max_tokens: int):
    """One engine step: plan, the pool's answer, execute, sample token 7 for every finished chunk."""
    plan = scheduler.plan_cache_step()
    preempted_before = scheduler.num_preemptions
    batch = scheduler.apply_cache_reply(plan, pool.step(plan))
    scheduler.on_executed(batch)
    for request, chunk in zip(batch.requests, batch.chunks, strict=True):
        if chunk.needs_logits:
            request.output_token_ids.append(7)
            if len(request.output_token_ids) >= max_tokens:
                scheduler.finish(request, FinishReason.LENGTH)
    return plan, batch, scheduler.num_preemptions - preempted_before


def test_lockstep_decodes_in_a_full_pool_preempt_only_as_many_as_needed():
    """Regression: 8 requests decoding in lockstep in a 40-block pool (5 blocks each) all cross
    into a 6th block in the same step; every failed extension preempted another request (the
    victims' blocks come back only in the next step), 4 in all, where 2 free enough (10 blocks
    for the 6 left). Their full pages are committed in that step too, so counting only blocks
    outside the tree as a victim's credit would preempt 4 again."""
    bs, max_tokens = 16, 20
    scheduler = Scheduler(SchedulerConfig(block_size=bs, max_batch_tokens=1024, max_num_seqs=8))
    pool = SyntheticPool(40, bs)
    requests = [make_request(f"r{i}", 64, max_tokens) for i in range(8)]
    for request in requests:
        scheduler.add(request)
    per_step = []
    for _ in range(200):
        if not scheduler.has_work():
            break
        plan, batch, preempted = run_step(scheduler, pool, max_tokens)
        per_step.append(preempted)
        if preempted:
            assert len(plan.extends) == 8 and len(plan.commits) == 8  # the crossing step
            assert [r.request_id for r in scheduler.waiting] == ["r6", "r7"]
            assert batch.requests == []  # the six left skip this step, and get the blocks next step
            plan, batch, preempted = run_step(scheduler, pool, max_tokens)
            assert preempted == 0 and plan.admits == []
            assert [e.request.request_id for e in plan.extends] == [f"r{i}" for i in range(6)]
            assert [r.request_id for r in batch.requests] == [f"r{i}" for i in range(6)]
    assert not scheduler.has_work()
    assert sum(per_step) == scheduler.num_preemptions == 2
    assert [r.num_preemptions for r in requests] == [0] * 6 + [1, 1]
    assert all(len(r.output_token_ids) == max_tokens for r in requests)
    assert sorted(pool.free) == list(range(40))


def _admitted(scheduler: Scheduler, tables: dict[str, list[int]], num_prompt: int, cached: int) -> list[Request]:
    """Admits one request per entry with the given block tables and cache hit, prefills it and
    samples one token."""
    for rid in tables:
        scheduler.add(make_request(rid, num_prompt))
    plan = scheduler.plan_cache_step()
    reply = CacheReply([AdmitReply(r.request_id, True, cached, list(tables[r.request_id])) for r in plan.admits], [])
    scheduler.on_executed(scheduler.apply_cache_reply(plan, reply))
    for request in scheduler.running:
        request.output_token_ids.append(7)
    return list(scheduler.running)


def test_blocks_survivors_still_hold_are_no_credit():
    """Three requests share a two-page prefix; each fills its third page and needs a fourth, none
    is free. Preempting the newest frees only its own third page (the prefix stays locked by the
    others): enough for the oldest alone, so the middle one must go too -- not all three (a credit
    of only non-tree blocks), not one (a credit of every block of the victim)."""
    scheduler = Scheduler(SchedulerConfig(block_size=16, max_batch_tokens=1024, max_num_seqs=8))
    a, b, c = _admitted(scheduler, {"a": [0, 1, 2], "b": [0, 1, 3], "c": [0, 1, 4]}, 40, cached=32)
    for request in (a, b, c):
        request.output_token_ids.extend(range(8))
        request.num_computed_tokens = request.num_tokens - 1  # 48: three full pages, next one needs a block
    plan = scheduler.plan_cache_step()
    assert [(i.request.request_id, i.num_computed_tokens) for i in plan.commits] == [("a", 48), ("b", 48), ("c", 48)]
    reply = CacheReply([], [ExtendReply(r, False, []) for r in "abc"], commit_all(plan))
    batch = scheduler.apply_cache_reply(plan, reply)
    assert scheduler.num_preemptions == 2 and scheduler.running == [a]
    assert batch.requests == []  # a waits one step for the blocks c releases
    plan = scheduler.plan_cache_step()
    assert [r.request_id for r in plan.releases] == ["c", "b"]
    assert [e.request for e in plan.extends] == [a] and plan.admits == []


def test_a_victim_release_includes_the_blocks_it_got_in_the_same_step():
    """The oldest request needs two blocks and gets none; the newest got its one: preempting it
    must release that block too (the cache's record of its table includes it)."""
    scheduler = Scheduler(SchedulerConfig(block_size=16, max_batch_tokens=1024, max_num_seqs=8))
    old, new = _admitted(scheduler, {"old": [0, 1], "new": [2, 3]}, 20, cached=0)
    old.output_token_ids.extend(range(29))  # 50 tokens: needs 4 blocks, has 2
    old.num_computed_tokens = 32
    new.output_token_ids.extend(range(12))  # 32 tokens computed, the 33rd needs a third block
    new.num_computed_tokens = 32
    plan = scheduler.plan_cache_step()
    reply = CacheReply([], [ExtendReply("old", False, []), ExtendReply("new", True, [9])], commit_all(plan))
    batch = scheduler.apply_cache_reply(plan, reply)
    assert scheduler.running == [old] and new.block_table == []
    assert batch.requests == []  # old's credit: new's three blocks cover its two
    (release,) = scheduler.plan_cache_step().releases
    assert release.request_id == "new" and release.block_table == [2, 3, 9]


def test_failing_request_that_is_the_newest_preempts_only_itself():
    scheduler = Scheduler(SchedulerConfig(block_size=16, max_batch_tokens=1024, max_num_seqs=8))
    old, new = _admitted(scheduler, {"old": [0, 1], "new": [2, 3]}, 20, cached=0)
    for request in (old, new):
        request.output_token_ids.extend(range(12))
        request.num_computed_tokens = 32
    plan = scheduler.plan_cache_step()
    reply = CacheReply([], [ExtendReply("old", True, [5]), ExtendReply("new", False, [])], commit_all(plan))
    batch = scheduler.apply_cache_reply(plan, reply)
    assert scheduler.num_preemptions == 1 and scheduler.running == [old]
    assert batch.requests == [old]


# ---------------------------------------------------------------- decode commits, ids, load, misses


def test_decode_pages_are_committed_with_the_extension_into_the_next_block(scheduler):
    request = _decode_ready(scheduler, "r0", 32)  # 32 prompt + 1 lookahead: 3 blocks
    assert request.num_admitted_tokens == 32
    plan = scheduler.plan_cache_step()
    assert [(c.num_computed_tokens, c.output_token_ids) for c in plan.commits] == [(32, [])]
    scheduler.apply_cache_reply(plan, admit_all(plan))
    outputs = [7]
    for step in range(40):
        token = 100 + step
        request.num_computed_tokens += 1  # the last sampled token is computed ...
        request.output_token_ids.append(token)  # ... and the next one sampled
        outputs.append(token)
        plan = scheduler.plan_cache_step()
        crossing = request.num_tokens - 1 in (48, 64)
        assert bool(plan.extends) == bool(plan.commits) == crossing, step
        if crossing:
            (commit,) = plan.commits
            assert commit.num_computed_tokens == request.num_tokens - 1
            assert commit.output_token_ids == outputs[:commit.num_computed_tokens - 32]
        scheduler.apply_cache_reply(plan, admit_all(plan))
    assert request.num_shared_tokens == 64
    scheduler.finish(request, FinishReason.STOP)
    (finish,) = scheduler.plan_cache_step().finishes
    assert finish.output_token_ids == outputs  # starts with what the commits sent


def test_a_resumed_request_commits_the_tokens_after_its_readmission(scheduler):
    request = _decode_ready(scheduler, "r0", 20)
    request.output_token_ids.extend(range(100, 120))  # 41 tokens
    scheduler.reset()
    plan = scheduler.plan_cache_step()
    assert request.was_admitted and request.num_preemptions == 1
    scheduler.on_executed(scheduler.apply_cache_reply(plan, admit_all(plan)))  # 41 admitted, 3 blocks
    assert request.num_admitted_tokens == 41 and request.num_computed_tokens == 41
    request.output_token_ids.extend(range(200, 208))  # 49 tokens: crosses into the 4th block
    request.num_computed_tokens = 48
    plan = scheduler.plan_cache_step()
    (commit,) = plan.commits
    assert commit.num_computed_tokens == 48 and commit.output_token_ids == list(range(200, 207))


def test_reused_id_waits_for_the_finish_of_its_predecessor(scheduler):
    old = _decode_ready(scheduler, "same", 10)
    scheduler.finish(old, FinishReason.STOP)
    scheduler.add(make_request("same", 5))
    plan = scheduler.plan_cache_step()
    assert [f.request_id for f in plan.finishes] == ["same"] and plan.admits == []
    scheduler.apply_cache_reply(plan, admit_all(plan))
    assert [r.request_id for r in scheduler.plan_cache_step().admits] == ["same"]


def test_load_counts_tokens_left_to_prefill(scheduler):
    for i, n in enumerate((100, 100, 30)):
        request = make_request(f"r{i}", n)
        request.prompt_token_ids = [1000 * (i + 1) + t for t in range(n)]  # nothing shared
        scheduler.add(request)
    plan = scheduler.plan_cache_step()
    # r1 takes the rest of r0's step; r2 would take more than half of it, so waits. As if the
    # admissions succeed.
    assert [r.request_id for r in plan.admits] == ["r0", "r1"] and plan.load == (1, 230, 2)
    batch = scheduler.apply_cache_reply(plan, admit_all(plan))
    scheduler.on_executed(batch)  # r0 whole, r1's first 50; r2 to be admitted
    assert scheduler.load() == (1, 80, 2)


def test_miss_breakdown_is_kept_from_the_first_admission_only(scheduler):
    request = make_request("r0", 40)
    scheduler.add(request)
    plan = scheduler.plan_cache_step()
    miss = MissBreakdown(evicted_tokens=16, other_replica_tokens=8, new_tokens=16)
    reply = admit_all(plan)
    reply = reply._replace(admits=[reply.admits[0]._replace(miss=miss)])
    scheduler.apply_cache_reply(plan, reply)
    scheduler.reset()
    plan = scheduler.plan_cache_step()
    scheduler.apply_cache_reply(plan, admit_all(plan, cached=32))
    assert request.miss == miss and request.cached_prompt_tokens == 0


# ---------------------------------------------------------------------- in-batch prefix check


def shared_prefix_request(rid: str, prefix: list[int], tail: list[int]) -> Request:
    request = make_request(rid, 1)
    request.prompt_token_ids = prefix + tail
    return request


def test_a_request_sharing_an_uncached_prefix_waits_for_the_commit_and_hits_it():
    scheduler = Scheduler(SchedulerConfig(block_size=16, max_batch_tokens=4096, max_num_seqs=8))
    prefix = list(range(1000, 1160))  # 10 pages
    first, second = shared_prefix_request("a", prefix, [1, 2]), shared_prefix_request("b", prefix, [3, 4])
    other = shared_prefix_request("c", list(range(5000, 5100)), [5])
    for r in (first, second, other):
        scheduler.add(r)
    plan = scheduler.plan_cache_step()
    assert [r.request_id for r in plan.admits] == ["a", "c"]  # b would compute a's prefix again
    batch = scheduler.apply_cache_reply(plan, admit_all(plan))
    scheduler.on_executed(batch)
    plan = scheduler.plan_cache_step()  # a's prompt is computed: it commits, b is admitted with it
    assert [c.request.request_id for c in plan.commits] == ["a", "c"]
    assert [r.request_id for r in plan.admits] == ["b"]  # the Step applies commits before admits


def test_the_same_prefix_in_another_namespace_neither_waits_nor_counts_once():
    """Namespaces never share cached blocks: a request does not wait for another namespace's
    prefill of the same tokens (a needless delay and a timing signal across tenants), and the
    load counts both prefills."""
    scheduler = Scheduler(SchedulerConfig(block_size=16, max_batch_tokens=4096, max_num_seqs=8))
    prefix = list(range(1000, 1160))  # 10 pages
    first, second = shared_prefix_request("a", prefix, [1]), shared_prefix_request("b", prefix, [2])
    second.namespace = "tenant-b"
    for r in (first, second):
        scheduler.add(r)
    assert scheduler.load() == (2, 2 * 161, 0)
    assert [r.request_id for r in scheduler.plan_cache_step().admits] == ["a", "b"]


def test_a_short_shared_prefix_does_not_delay_admission():
    scheduler = Scheduler(SchedulerConfig(block_size=16, max_batch_tokens=4096, max_num_seqs=8))
    system = list(range(1000, 1048))  # 3 pages: under the 4-block threshold
    for rid in ("a", "b"):
        scheduler.add(shared_prefix_request(rid, system, [ord(rid)] * 20))
    assert [r.request_id for r in scheduler.plan_cache_step().admits] == ["a", "b"]


def test_a_prefix_already_committed_does_not_delay_admission():
    scheduler = Scheduler(SchedulerConfig(block_size=16, max_batch_tokens=4096, max_num_seqs=8))
    prefix = list(range(1000, 1160))
    scheduler.add(shared_prefix_request("a", prefix, [1]))
    plan = scheduler.plan_cache_step()
    scheduler.on_executed(scheduler.apply_cache_reply(plan, admit_all(plan)))
    plan = scheduler.plan_cache_step()
    scheduler.apply_cache_reply(plan, admit_all(plan))  # a's 10 pages committed
    scheduler.add(shared_prefix_request("b", prefix, [2]))
    assert [r.request_id for r in scheduler.plan_cache_step().admits] == ["b"]


def test_load_does_not_count_a_shared_prefix_twice():
    """Waiting requests sharing a prompt prefix will hit it once the first computed it: a router
    must not see each of them as a full prefill (it would spread a group over replicas)."""
    scheduler = Scheduler(SchedulerConfig(block_size=16, max_batch_tokens=4096, max_num_seqs=8))
    prefix = list(range(1000, 1160))  # 10 pages
    for rid, tail in (("a", [1, 2]), ("b", [3, 4, 5]), ("c", [6])):
        scheduler.add(shared_prefix_request(rid, prefix, tail))
    scheduler.add(shared_prefix_request("d", list(range(5000, 5040)), []))
    assert scheduler.load() == (4, 162 + 3 + 1 + 40, 0)  # b and c count only their tails


# ---------------------------------------------------------------------- hits and time to first token


def _leader_committed(scheduler: Scheduler, prefix: list[int]) -> Request:
    """Admits and computes a prompt `prefix + [1]`, then plans the step that commits its pages."""
    leader = shared_prefix_request("leader", prefix, [1])
    scheduler.add(leader)
    plan = scheduler.plan_cache_step()
    scheduler.on_executed(scheduler.apply_cache_reply(plan, admit_all(plan)))
    plan = scheduler.plan_cache_step()
    scheduler.on_executed(scheduler.apply_cache_reply(plan, admit_all(plan)))
    assert leader.num_shared_tokens == len(prefix)
    return leader


def test_a_cache_hit_is_charged_only_its_expected_miss_against_the_budget():
    """Followers of a committed prompt are admitted together (a hit computes only its tail), not
    one per step as if each had to compute the whole prefix."""
    scheduler = Scheduler(SchedulerConfig(block_size=16, max_batch_tokens=200, max_num_seqs=8))
    prefix = list(range(1000, 1160))  # 10 pages
    _leader_committed(scheduler, prefix)
    for rid in ("a", "b", "c", "d"):
        scheduler.add(shared_prefix_request(rid, prefix, [ord(rid)] * 20))
    scheduler.add(make_request("other", 150))  # nothing cached: charged in full
    plan = scheduler.plan_cache_step()
    assert [r.request_id for r in plan.admits] == ["a", "b", "c", "d", "other"]
    reply = admit_all(plan, cached=160)
    reply = reply._replace(admits=reply.admits[:4] + [reply.admits[4]._replace(cached_tokens=0)])
    scheduler.apply_cache_reply(plan, reply)
    scheduler.add(make_request("late", 10))
    assert scheduler.plan_cache_step().admits == []  # other's 150 (and the tails) used the budget up


def test_a_finished_prompt_is_not_expected_to_hit():
    """Its pages are unlocked once it finishes (evictable, or cleared): a waiting request sharing
    them is charged in full, and the in-batch prefix check still holds back the second one."""
    scheduler = Scheduler(SchedulerConfig(block_size=16, max_batch_tokens=400, max_num_seqs=8))
    prefix = list(range(1000, 1160))
    leader = _leader_committed(scheduler, prefix)
    scheduler.finish(leader, FinishReason.LENGTH)
    scheduler.apply_cache_reply(plan := scheduler.plan_cache_step(), admit_all(plan))  # its finish
    for rid in ("a", "b", "c"):
        scheduler.add(shared_prefix_request(rid, prefix, [ord(rid)] * 20))
    assert [r.request_id for r in scheduler.plan_cache_step().admits] == ["a"]


def test_short_prefills_run_first_and_a_larger_long_chunk_waits_one_step():
    """Short prefills reach their first token in the step they run: a long prompt's chunk larger
    than all of them together waits for the next step (one step, never two in a row); small
    leftovers still join."""
    scheduler = Scheduler(SchedulerConfig(block_size=16, max_batch_tokens=200, max_num_seqs=8,
                                          defer_shared_prefix_tokens=0))
    long = make_request("long", 500)
    long.prompt_token_ids = list(range(5000, 5500))
    scheduler.add(long)
    plan = scheduler.plan_cache_step()
    scheduler.on_executed(scheduler.apply_cache_reply(plan, admit_all(plan)))
    assert long.num_computed_tokens == 200
    shorts = []
    for i in range(6):  # 6 x 30 tokens: more than half the budget
        shorts.append(make_request(f"s{i}", 30))
        shorts[-1].prompt_token_ids = [100 * (i + 1) + t for t in range(30)]
        scheduler.add(shorts[-1])
    plan = scheduler.plan_cache_step()
    assert len(plan.admits) == 0  # the long prompt's 300 left take the whole budget
    scheduler.on_executed(scheduler.apply_cache_reply(plan, admit_all(plan)))
    plan = scheduler.plan_cache_step()  # long has 100 left: room for the shorts
    assert [r.request_id for r in plan.admits] == ["s0", "s1", "s2", "s3"]
    batch = scheduler.apply_cache_reply(plan, admit_all(plan))
    # Three shorts fit in half the budget and go first; the long prompt's 100 (more than their
    # 90, at most twice it) wait; s3 (small) runs.
    assert [r.request_id for r in batch.requests] == ["s0", "s1", "s2", "s3"]
    assert [len(c.token_ids) for c in batch.chunks] == [30, 30, 30, 30]
    scheduler.on_executed(batch)
    for request, chunk in zip(*batch, strict=True):
        if chunk.needs_logits:
            request.output_token_ids.append(7)  # as the engine samples
    plan = scheduler.plan_cache_step()
    assert [r.request_id for r in plan.admits] == ["s4", "s5"]
    batch = scheduler.apply_cache_reply(plan, admit_all(plan))
    # Decodes first, the shorts s4, s5, and the long chunk now: it was held back last step.
    assert [r.request_id for r in batch.requests] == ["s0", "s1", "s2", "s3", "s4", "s5", "long"]
    assert [len(c.token_ids) for c in batch.chunks] == [1, 1, 1, 1, 30, 30, 100]


def test_a_long_chunk_runs_with_a_few_short_prefills():
    """Shorts that are less than half the long chunk are no step's worth of work of their own
    (a step's overhead would cost more than they wait): they run together."""
    scheduler = Scheduler(SchedulerConfig(block_size=16, max_batch_tokens=200, max_num_seqs=8,
                                          defer_shared_prefix_tokens=0))
    for i, n in enumerate((160, 30)):
        scheduler.add(make_request(f"r{i}", n))
        scheduler.waiting[-1].prompt_token_ids = [1000 * (i + 1) + t for t in range(n)]
    plan = scheduler.plan_cache_step()
    batch = scheduler.apply_cache_reply(plan, admit_all(plan))
    assert [(r.request_id, len(c.token_ids)) for r, c in zip(*batch, strict=True)] == [("r1", 30), ("r0", 160)]


def test_shortest_prefills_first_never_take_more_than_half_the_budget():
    scheduler = Scheduler(SchedulerConfig(block_size=16, max_batch_tokens=200, max_num_seqs=16,
                                          defer_shared_prefix_tokens=0))
    requests = []
    for i, n in enumerate((300, 60, 50, 40, 30)):
        requests.append(make_request(f"r{i}", n))
        requests[-1].prompt_token_ids = [1000 * (i + 1) + t for t in range(n)]
    for r in requests:  # all running, nothing computed yet (as if admitted earlier)
        r.status = RequestStatus.RUNNING
        r.block_table = list(range(-(-(r.num_tokens + 1) // 16)))
        scheduler.running.append(r)
    batch = scheduler.build_batch()
    # 30 + 40 fit in 100; 50 does not -> the rest in arrival order: r0's chunk (130 of the 130
    # left, more than the shorts' 70 and at most twice it) waits a step, r1 and r2 take the rest.
    assert [r.request_id for r in batch.requests] == ["r4", "r3", "r1", "r2"]
    assert [len(c.token_ids) for c in batch.chunks] == [30, 40, 60, 50]
    scheduler.on_executed(batch)
    batch = scheduler.build_batch()  # nothing sampled: only r0 has tokens left, held no longer
    assert [(r.request_id, len(c.token_ids)) for r, c in zip(*batch, strict=True)] == [("r0", 200)]


def test_a_long_prompt_that_stops_short_lets_a_leaders_followers_by():
    """A long prompt that would stop short of its end in this step is admitted last: the followers
    of a leader whose pages are committed now join this step as hits (reaching their first token
    in it) before it takes the rest of the budget; long ones behind it keep their turn."""
    scheduler = Scheduler(SchedulerConfig(block_size=16, max_batch_tokens=512, max_num_seqs=8))

    def distinct(rid: str, n: int, base: int) -> Request:
        request = make_request(rid, n)
        request.prompt_token_ids = [base + t for t in range(n)]
        return request

    leader = distinct("A", 320, 1000)
    scheduler.add(leader)
    plan = scheduler.plan_cache_step()
    scheduler.on_executed(scheduler.apply_cache_reply(plan, admit_all(plan)))
    leader.output_token_ids.append(7)
    follower = distinct("A-follower", 336, 1000)  # A's 320 tokens, then 16 of its own
    follower.prompt_token_ids[320:] = range(90000, 90016)
    for request in (distinct("C", 300, 5000), distinct("D", 300, 9000), distinct("E", 300, 13000), follower):
        scheduler.add(request)
    plan = scheduler.plan_cache_step()
    assert [c.request.request_id for c in plan.commits] == ["A"]
    assert [r.request_id for r in plan.admits] == ["C", "A-follower", "D"]
    reply = admit_all(plan)
    reply = reply._replace(admits=[reply.admits[0], reply.admits[1]._replace(cached_tokens=320), reply.admits[2]])
    batch = scheduler.apply_cache_reply(plan, reply)
    assert [(r.request_id, len(c.token_ids)) for r, c in zip(*batch, strict=True)] == [
        ("A", 1), ("A-follower", 16), ("C", 300), ("D", 195)]
    scheduler.on_executed(batch)
    assert [r.request_id for r in scheduler.plan_cache_step().admits] == ["E"]
