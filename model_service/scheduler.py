"""Continuous-batching scheduler: waiting/running queues, token budget, chunked prefill, preemption.

Knows nothing of gRPC. Each step is two calls around one cache-manager round trip:
`plan_cache_step()` says what the cache must do (finishes, releases, commits of freshly
computed pages, block extensions, admissions) and the replica's load, `apply_cache_reply()`
applies the answer and returns the batch to execute. Pipelined (model_service/cache_pipeline.py),
the plan for the step after a batch is built before that batch runs (`plan_cache_step(ahead=batch)`),
its reply is applied later (`apply_reply()`), and `build_batch()` runs whatever the blocks at hand
allow; a running request may then hold `lookahead_blocks` spare blocks, asked for ahead of need.
Prefill and decode are one concept: a running request computes tokens
[num_computed_tokens, num_tokens) -- a chunk of them per step within the token budget.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import NamedTuple

from model_service.forks import ready_source
from model_service.model_runner import SequenceChunk
from model_service.prefill_index import PrefillIndex
from model_service.request import FinishReason, MissBreakdown, Request, RequestStatus

# Most prompt positions one step scores for a request's prompt_logprobs (their logits rows,
# [positions, vocab] in float32, are kept until the step's end).
MAX_SCORED_TOKENS = 512
# Most requests running at once unless configured: vLLM's default for a CPU server.
DEFAULT_MAX_NUM_SEQS = 128


class QueueFullError(Exception):
    """The waiting queue is at its bound (backpressure)."""


class FinishRecord(NamedTuple):
    """What the cache manager needs to cache a request's KV and take its blocks back."""

    request_id: str
    output_token_ids: list[int]  # tokens after those sent at admission
    num_computed_tokens: int  # tokens (from the admitted ones on) whose KV is written
    block_table: list[int]


class ExtendItem(NamedTuple):
    request: Request
    num_tokens: int  # capacity the request needs after this step
    num_lookahead_tokens: int = 0  # spare capacity asked for beyond it (pipelined mode)


class CommitItem(NamedTuple):
    request: Request
    # Tokens (those sent at admission, then output_token_ids) whose KV is written: a multiple of
    # the block size.
    num_computed_tokens: int
    # The request's tokens after those sent at admission, up to num_computed_tokens at least
    # (empty for a prompt-only commit); always a prefix of what later commits and the finish send.
    output_token_ids: list[int]


class ReplicaLoad(NamedTuple):
    """The replica's queues as routers see them (cache.proto ReplicaLoad)."""

    num_waiting_requests: int = 0
    num_waiting_tokens: int = 0  # tokens still to prefill, of waiting and running requests
    num_running_requests: int = 0


class AdmitReply(NamedTuple):
    request_id: str
    admitted: bool
    cached_tokens: int
    block_table: list[int]
    miss: MissBreakdown | None = None  # first admissions only
    # Lower-tier pages to copy into block_table after the cached ones (cache.proto TierCopy), and
    # the tokens of them the replica did load (set once it performed the copies): computed from then on.
    loads: Sequence[object] = ()
    loaded_host_tokens: int = 0
    loaded_disk_tokens: int = 0
    # Then pages to pull from another replica (cache.proto PeerPull), and the pull under way (a
    # future of (outcomes, tokens pulled), set by the engine: Request.pull from then on).
    pulls: Sequence[object] = ()
    pulling: Future | None = None


class ExtendReply(NamedTuple):
    request_id: str
    ok: bool
    new_block_ids: list[int]


class CommitReply(NamedTuple):
    request_id: str
    cached_tokens: int
    cached_block_ids: list[int]  # the request's block_table[:cached_tokens // block_size] from now on


class CacheReply(NamedTuple):
    admits: list[AdmitReply]
    extends: list[ExtendReply]
    commits: Sequence[CommitReply] = ()
    num_free_blocks: int | None = None  # the pool's free blocks after the step (None: unknown)
    offloads: Sequence[object] = ()  # copies down a tier (cache.proto TierCopy), performed first


@dataclass(slots=True)
class CachePlan:
    """One cache Step: what to tell the cache manager before this scheduler step runs."""

    releases: list[FinishRecord] = field(default_factory=list)
    finishes: list[FinishRecord] = field(default_factory=list)
    extends: list[ExtendItem] = field(default_factory=list)
    admits: list[Request] = field(default_factory=list)
    # Running requests whose newly computed full pages the cache should share right away.
    commits: list[CommitItem] = field(default_factory=list)
    # The replica's load once this step is applied, assuming its admissions succeed (one that does
    # not is planned again, so the next step's RPC corrects it).
    load: ReplicaLoad = ReplicaLoad()
    # Outcomes of tier copies performed since the last Step (cache.proto CopyOutcome).
    copy_outcomes: list[object] = field(default_factory=list)
    # Outcomes of the peer pulls of the last reply (cache.proto StepRequest.pull_outcomes).
    pull_outcomes: list[object] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.releases or self.finishes or self.extends or self.admits or self.commits
                    or self.copy_outcomes or self.pull_outcomes)


class ScheduledBatch(NamedTuple):
    requests: list[Request]
    chunks: list[SequenceChunk]


@dataclass(slots=True)
class SchedulerConfig:
    block_size: int
    max_batch_tokens: int = 2048
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_waiting: int = 1024
    # A waiting request that shares at least this many leading tokens with one being prefilled
    # right now, whose pages are not cached yet, waits for that request's commit and then hits
    # them instead of computing the same prefix a second time in the same step (SGLang's in-batch
    # prefix check). 0 disables. Default (None): 4 blocks.
    defer_shared_prefix_tokens: int | None = None
    # Spare blocks a running request may hold beyond its need, asked for ahead of it; used by
    # plans built ahead of a batch (pipelined mode) only.
    lookahead_blocks: int = 0

    def __post_init__(self) -> None:
        if self.defer_shared_prefix_tokens is None:
            self.defer_shared_prefix_tokens = 4 * self.block_size

    @property
    def long_prefill_tokens(self) -> int:
        """A prefill with more tokens than this left is long: a long prompt that stops short of its
        end in a step takes the rest of it (`build_batch`), and one admitted to stop short lets the
        hits behind it by (`_plan_admissions`)."""
        return self.max_batch_tokens // 4

    @property
    def long_step_tokens(self) -> int:
        """A long prompt computing this many tokens in a step, not reaching its end, takes the step's
        long-prompt turn: the long prompts behind it wait (`build_batch`)."""
        return self.max_batch_tokens // 2


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished requests whose KV goes to the cache in the next plan; their record is taken
        # then, once every reply in flight has updated their block table.
        self.pending_finishes: list[Request] = []
        # Preempted (or, after a re-attach, stale) requests whose blocks go back in the next plan.
        self.pending_releases: list[FinishRecord] = []
        # Outcomes of tier copies the engine performed, for the next plan (cache.proto CopyOutcome),
        # and where the ones finishing later (disk writes) come from.
        self.pending_copy_outcomes: list[object] = []
        self.pending_pull_outcomes: list[object] = []
        # (urgent) -> outcomes finished since; not urgent: may keep them for a Step made anyway.
        self.finished_copy_outcomes: Callable[[bool], list[object]] = lambda urgent: []
        # Called before a running request's blocks are given back (finish, preemption, reset): the
        # engine waits there for a pull still writing into them (Request.pull).
        self.before_release: Callable[[Request], None] = lambda request: None
        self._pause_admission = False
        self._lookahead_paused = False  # a lookahead ask failed: ask for need only until space returns
        self._held_back_long = False  # the last batch left a long prefill out for short ones
        self._admission_refused = False  # the pool had no room for an admission (until blocks return)
        self.num_preemptions = 0
        self.generation = 0  # bumped by reset(): replies to plans of an older generation are void

    # ------------------------------------------------------------------ queues

    def add(self, request: Request) -> None:
        """Queues a request (the engine enforces the max_waiting bound before it gets here)."""
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.pending_finishes or self.pending_releases)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Ends a request; a running one's KV goes to the cache in the next step."""
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.before_release(request)
            self.running.remove(request)
            self.pending_finishes.append(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        # FORKING: a choice not forked yet, in no queue
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def add_forks(self, choices: list[Request]) -> None:
        """Queues choices that fork from their choice 0 now (model_service/forks.py), at the head
        of the waiting queue: admitted in the next Step while choice 0 still holds the KV their
        prompt tail is copied from, each costs one token of compute."""
        for choice in reversed(choices):
            choice.status = RequestStatus.WAITING
            choice.fork_source = choice.choices[0]
            self.waiting.appendleft(choice)

    def admissible_waiting_tokens(self, limit: int) -> int:
        """Tokens of the waiting requests (cache hits included) a Step could admit now, counted up
        to `limit`: 0 while every sequence slot is taken, or after the pool refused an admission
        until a finish or release returns blocks."""
        if self._admission_refused or len(self.running) >= self.config.max_num_seqs:
            return 0
        total = 0
        for request in self.waiting:
            total += request.num_tokens
            if total >= limit:
                return limit
        return total

    def num_prefill_tokens(self) -> int:
        """Prompt tokens the running requests still have to compute."""
        return sum(max(0, r.num_admitted_tokens - r.num_computed_tokens) for r in self.running)

    def load(self) -> ReplicaLoad:
        """Requests waiting and running, and the tokens they still have to prefill: running ones,
        those of the admitted tokens not computed yet; waiting ones, theirs beyond the longest
        page-aligned prefix they share with a running or earlier waiting prompt (that part will be
        a cache hit), so a router does not see a queue of requests sharing one prefix as if each
        had to compute it."""
        bs = self.config.block_size
        prompts = PrefillIndex(bs, bs)
        tokens = self.num_prefill_tokens()
        for r in self.running:
            prompts.add(r, 0)
        for r in self.waiting:
            tokens += r.num_tokens - prompts.longest_shared(r)[0]
            prompts.add(r, 0)
        return ReplicaLoad(len(self.waiting), tokens, len(self.running))

    def reset(self) -> None:
        """The cache pool was lost: every running request goes back to waiting to be recomputed."""
        for request in reversed(self.running):
            self.before_release(request)
            self.requeue(request)
        self.running.clear()
        self.pending_finishes.clear()
        self.pending_releases.clear()
        self.pending_copy_outcomes.clear()  # of the old pool's copies
        self.pending_pull_outcomes.clear()
        self._pause_admission = False
        self._lookahead_paused = False
        self.generation += 1

    def requeue(self, request: Request) -> None:
        """Puts a request taken off `running` (by the caller) back at the head of the waiting
        queue, to be recomputed from its tokens: its cache state is dropped, its preemption counted."""
        request.reset_cache_state()
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    # ------------------------------------------------------------------ step

    def plan_cache_step(self, ahead: ScheduledBatch | None = None) -> CachePlan:
        """The next cache Step. With `ahead` (pipelined mode: nothing in flight, `ahead` about to
        run), the Step is for the step after `ahead`: each of its requests that reaches its last
        token will have one more (its sampled token), and extensions carry lookahead."""
        plan = CachePlan(releases=self.pending_releases,
                         finishes=[self._record(r) for r in self.pending_finishes],
                         copy_outcomes=self.pending_copy_outcomes, pull_outcomes=self.pending_pull_outcomes)
        for request in self.pending_finishes:
            request.returned_by = plan
        self.pending_copy_outcomes = []
        self.pending_pull_outcomes = []
        if plan.releases or plan.finishes:
            self._admission_refused = False
        self.pending_releases, self.pending_finishes = [], []
        bs = self.config.block_size
        budget = self.config.max_batch_tokens
        # What `ahead` does to each of its requests: tokens computed, and one sampled (or not).
        runs = {} if ahead is None else {id(r): (len(c.token_ids), c.needs_logits) for r, c in zip(*ahead, strict=True)}
        lookahead = 0 if ahead is None or self._lookahead_paused else self.config.lookahead_blocks * bs
        for request in self.running:
            computes, samples = runs.get(id(request), (0, False))
            need = request.num_tokens + samples
            budget -= need - request.num_computed_tokens - computes
            want = need
            if lookahead:  # never beyond what the request can still generate
                want = max(need, min(need + lookahead, len(request.prompt_token_ids) + request.max_tokens))
            extending = len(request.block_table) * bs < want
            if extending:
                plan.extends.append(ExtendItem(request, need, want - need))
            # Full pages computed since the last commit go to the tree now, so requests admitted
            # from this step on share them (not only after this one ends): the admitted tokens'
            # (the prompt's) after each prefill chunk, and decode pages as they fill (as vLLM
            # shares full blocks), with the extension into the next block, so no RPC of their own.
            computed = request.num_computed_tokens
            committable = (computed if extending else min(computed, request.num_admitted_tokens)) // bs * bs
            if committable > request.num_shared_tokens:
                plan.commits.append(CommitItem(request, committable, request.tokens_after_admitted(computed)))
        if self._pause_admission:
            self._pause_admission = False
        else:
            self._plan_admissions(plan, budget)
        # Finished disk writes ride with a Step made anyway; one of their own only when idle (or late).
        plan.copy_outcomes.extend(self.finished_copy_outcomes(not plan.is_empty or not self.running))
        queues, admitted = self.load(), len(plan.admits)
        plan.load = queues._replace(num_waiting_requests=queues.num_waiting_requests - admitted,
                                    num_running_requests=queues.num_running_requests + admitted)
        return plan

    def _plan_admissions(self, plan: CachePlan, budget: int) -> None:
        """Admits waiting requests in arrival order within the step's token budget left after the
        running ones (a hit charged its miss only), so a step's budget is filled, as vLLM's chunked
        prefill does. A long prompt that would stop short of its end in this step is admitted last:
        the requests behind it with short misses (say, the followers of a prefix group whose leader
        just committed) go first, within half the budget it found, so they reach their first token
        in this step rather than after it; it takes the rest. Long ones behind it wait their turn."""
        # A new request may reuse the id of one whose finish is in this step; the cache manager
        # takes an id once per step, so it waits for the next one (and so does everyone after it).
        leaving = {r.request_id for r in plan.finishes} | {r.request_id for r in plan.releases}
        bs = self.config.block_size
        big = self.config.long_prefill_tokens
        slots = self.config.max_num_seqs - len(self.running)
        prefilling = PrefillIndex(bs, self.config.defer_shared_prefix_tokens or 0)
        in_tree = PrefillIndex(bs, bs, cached=True)
        committing = {id(c.request): c.num_computed_tokens for c in plan.commits}  # applied before admits
        for request in self.running:
            cached_tokens = committing.get(id(request), request.num_shared_tokens)
            prefilling.add(request, cached_tokens)
            in_tree.add(request, cached_tokens)
        partial: Request | None = None  # the long prompt that stops short, admitted last
        passing = 0  # the budget the requests that pass it may take
        for request in self.waiting:
            if budget <= 0 or slots <= 0 or request.request_id in leaving:
                break
            if prefilling.shares_uncached_prefix(request):
                continue  # admitted after the other request's commit, as a cache hit
            expected_hit = in_tree.expected_hit(request)
            if ready_source(request, plan) is not None:  # a forked choice: its prompt KV is copied
                expected_hit = request.num_tokens - 1
            miss = request.num_tokens - expected_hit
            if partial is not None:
                if miss > big or miss > passing:
                    continue  # long ones keep their order behind it; short ones only while room lasts
                passing -= miss
            elif miss > big and miss > budget:
                partial, passing = request, budget // 2
                prefilling.add(request, expected_hit)  # those sharing its prompt wait for its commit
                slots -= 1
                continue
            plan.admits.append(request)
            prefilling.add(request, expected_hit)
            # A hit computes only its miss: charging the whole prompt would admit a prefix group's
            # followers a few per step, each behind a full prompt's worth of budget. The pages of
            # running requests are locked in the tree, so the expected hit is a sure one.
            budget -= miss
            slots -= 1
        if partial is not None:
            plan.admits.append(partial)

    def apply_cache_reply(self, plan: CachePlan, reply: CacheReply) -> ScheduledBatch:
        """Applies the reply to `plan` and returns the batch to execute (synchronous mode)."""
        self.apply_reply(plan, reply)
        return self.build_batch()

    def apply_reply(self, plan: CachePlan, reply: CacheReply) -> None:
        """Applies the cache's reply to `plan`. Requests that finished while it was in flight
        still take their new blocks (their finish record is taken later); one admitted meanwhile
        after it finished goes straight back to the cache as a finish."""
        for item, com in zip(plan.commits, reply.commits, strict=True):
            item.request.block_table[:len(com.cached_block_ids)] = com.cached_block_ids
            item.request.num_shared_tokens = com.cached_tokens
        failed: list[ExtendItem] = []
        for item, ext in zip(plan.extends, reply.extends, strict=True):
            if ext.ok:  # first, so a victim's release below includes the blocks it just got
                item.request.block_table.extend(ext.new_block_ids)
            elif item.num_lookahead_tokens:
                # Drop lookahead before preempting anyone: the next plan asks for the need alone.
                self._lookahead_paused = True
            elif item.request.status is RequestStatus.RUNNING:
                failed.append(item)
        if failed:
            self._make_room(failed)
        if (self._lookahead_paused and reply.num_free_blocks is not None
                and reply.num_free_blocks >= self.config.lookahead_blocks * (len(self.running) + 1)):
            self._lookahead_paused = False
        for request, adm in zip(plan.admits, reply.admits, strict=True):
            if not adm.admitted:
                self._admission_refused = not request.is_finished
                break
            loaded = adm.loaded_host_tokens + adm.loaded_disk_tokens  # pages copied in from a lower tier
            if request.is_finished:  # cancelled or aborted while its admission was in flight
                request.block_table = list(adm.block_table)
                request.num_computed_tokens = adm.cached_tokens + loaded
                request.num_admitted_tokens = request.num_tokens
                request.pull = adm.pulling
                self.before_release(request)
                self.pending_finishes.append(request)
                continue
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            request.block_table = list(adm.block_table)
            request.num_computed_tokens = adm.cached_tokens + loaded
            request.num_shared_tokens = adm.cached_tokens
            request.num_admitted_tokens = request.num_tokens
            if request.cached_prompt_tokens is None:
                request.cached_prompt_tokens = adm.cached_tokens + loaded
                request.cached_tier_tokens = (adm.loaded_host_tokens, adm.loaded_disk_tokens, 0)
                request.miss = adm.miss
            request.pull = adm.pulling  # its pulled pages count once they arrived (Engine._pull_done)
            self.running.append(request)

    def on_executed(self, batch: ScheduledBatch) -> None:
        for request, chunk in zip(batch.requests, batch.chunks, strict=True):
            # A chunk scoring a prompt (prompt_logprobs) may start before the request's KV ends.
            end = chunk.start_position + len(chunk.token_ids)
            request.num_computed_tokens = max(request.num_computed_tokens, end)

    def needs_reply(self) -> bool:
        """True when a running request has no block for its next token (it waits for an extension)."""
        bs = self.config.block_size
        return any(len(r.block_table) * bs < r.num_tokens for r in self.running)

    def build_batch(self) -> ScheduledBatch:
        """The requests and token chunks to run now, within the token budget and the blocks held."""
        bs = self.config.block_size
        budget = self.config.max_batch_tokens
        half, big = self.config.long_step_tokens, self.config.long_prefill_tokens
        requests: list[Request] = []
        chunks: list[SequenceChunk] = []
        decodes, shorts, longs = self._run_order(budget)
        num_first = len(decodes) + len(shorts)
        long_tokens = 0
        # Short prefills reach their first token in this step: a prompt's chunk larger than all of
        # them together would make them wait as long as it takes (say, a prefix group's followers
        # behind the next group's prompt). It runs in the next step instead, when the shorts are
        # a step's worth of work themselves (at least half the chunk: a step of a few short ones
        # would cost more in per-step overhead than they wait), and only once: a long prompt is
        # never held back two steps running, so short arrivals cannot starve it.
        short_tokens = sum(r.num_uncomputed_tokens for r in shorts)
        hold_big = bool(shorts) and not self._held_back_long
        held = False
        cut_short = False  # a long prompt before it stops short of its end in this step
        for i, request in enumerate(decodes + shorts + longs):
            if budget <= 0:
                break
            is_long = i >= num_first
            if is_long and request.num_uncomputed_tokens > big:
                if hold_big and short_tokens < min(request.num_uncomputed_tokens, budget) <= 2 * short_tokens:
                    held = True
                    continue
                if cut_short and long_tokens >= half:
                    # One long prompt at a time: it reaches its first token a whole step sooner.
                    # Once the long ones before it end in this step, it takes the rest of it.
                    continue
            start = request.next_position
            end = min(request.num_tokens, start + budget, len(request.block_table) * bs)
            scoring = request.scoring_prompt
            if scoring:  # its logits rows come back whole: a bounded number per step
                end = min(end, start + MAX_SCORED_TOKENS)
            if end <= start:
                continue  # no block for its next token this step (extension failed)
            requests.append(request)
            chunks.append(SequenceChunk(
                self._token_slice(request, start, end), start, request.block_table, end == request.num_tokens,
                num_cached=max(0, min(request.num_computed_tokens, end) - start),
                num_scored=max(0, min(end, len(request.prompt_token_ids) - 1) - start) if scoring else 0))
            budget -= end - start
            if is_long:
                long_tokens += end - start
                cut_short = cut_short or end < request.num_tokens
        self._held_back_long = held
        return ScheduledBatch(requests, chunks)

    # ------------------------------------------------------------------ internals

    def _run_order(self, budget: int) -> tuple[list[Request], list[Request], list[Request]]:
        """The running requests in the order a step serves them, as (decodes, short prefills, long
        prefills). Decodes first (one token each, latency-sensitive); then the prefills that fit
        together in half the budget, shortest first, so a cache hit's few tokens are not queued
        behind a long prompt's chunk; then the other (long) prefills in arrival order. Long ones
        always get at least half the budget, so short arrivals never starve a long prompt; and one
        with over a quarter of the budget left to compute runs only while those before it took
        under half the budget or end in this step, so two long prompts do not share every step
        and both reach their first token late, while a step's budget is still filled.
        `build_batch` may also hold a long chunk back one step for the short ones (see there)."""
        decodes: list[Request] = []
        prefills: list[Request] = []
        for request in self.running:
            if request.pull is not None:
                continue  # its pages are still arriving
            (decodes if request.num_uncomputed_tokens <= 1 else prefills).append(request)
        room = (budget - len(decodes)) // 2
        shorts: list[Request] = []
        for request in sorted(prefills, key=lambda r: r.num_uncomputed_tokens):
            if request.num_uncomputed_tokens > room:
                break
            shorts.append(request)
            room -= request.num_uncomputed_tokens
        chosen = {id(r) for r in shorts}
        return decodes, shorts, [r for r in prefills if id(r) not in chosen]

    @staticmethod
    def _token_slice(request: Request, start: int, end: int) -> list[int]:
        prompt = request.prompt_token_ids
        if start >= len(prompt):
            n = len(prompt)
            return request.output_token_ids[start - n:end - n]
        return request.all_token_ids[start:end]

    def _make_room(self, failed: list[ExtendItem]) -> None:
        """Some extensions failed (no free block even after eviction): preempt the newest running
        requests, but only as many as needed. A victim's blocks come back only in the next step
        (its release), so the blocks this step's victims give back are a credit: a request whose
        extension failed but that the credit covers is not preempted, it skips this step and is
        extended again in the next one, which admits nothing (the freed blocks are its)."""
        bs = self.config.block_size
        credit = 0
        for item in failed:
            request = item.request
            need = max(1, -(-item.num_tokens // bs) - len(request.block_table))
            while request.status is RequestStatus.RUNNING and credit < need:
                victim, freed = self._preempt_newest()
                credit += freed
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                credit -= need
        self._pause_admission = True

    def _preempt_newest(self) -> tuple[Request, int]:
        """Releases the newest running request (its computed pages stay cached); returns it and
        how many blocks its release makes free or evictable at least: those of its blocks no other
        running request holds (its private ones, and tree pages only it locks)."""
        victim = self.running[-1]
        self.before_release(victim)
        self.running.pop()
        held = {block for r in self.running for block in r.block_table}
        freed = len(set(victim.block_table) - held)
        self.pending_releases.append(self._record(victim))
        self.requeue(victim)
        self.num_preemptions += 1
        self._pause_admission = True
        return victim, freed

    @staticmethod
    def _record(request: Request) -> FinishRecord:
        return FinishRecord(request.request_id, request.tokens_after_admitted(),
                            request.num_computed_tokens, list(request.block_table))
