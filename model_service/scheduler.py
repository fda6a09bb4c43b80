"""Continuous-batching scheduler: waiting/running queues, token budget, chunked prefill, preemption.

Knows nothing of gRPC. Each step is two calls around one cache-manager round trip:
`plan_cache_step()` says what the cache must do (finishes, releases, commits of freshly
computed prompt pages, block extensions, admissions), `apply_cache_reply()` applies the answer and returns the batch to execute.
Prefill and decode are one concept: a running request computes tokens
[num_computed_tokens, num_tokens) -- a chunk of them per step within the token budget.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from model_service.model_runner import SequenceChunk
from model_service.request import FinishReason, Request, RequestStatus


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


class CommitItem(NamedTuple):
    request: Request
    num_computed_tokens: int  # admitted tokens whose KV is written (a multiple of the block size)


class AdmitReply(NamedTuple):
    request_id: str
    admitted: bool
    cached_tokens: int
    block_table: list[int]


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


@dataclass(slots=True)
class CachePlan:
    """One cache Step: what to tell the cache manager before this scheduler step runs."""

    releases: list[FinishRecord] = field(default_factory=list)
    finishes: list[FinishRecord] = field(default_factory=list)
    extends: list[ExtendItem] = field(default_factory=list)
    admits: list[Request] = field(default_factory=list)
    # Running requests whose newly computed prompt pages the cache should share right away.
    commits: list[CommitItem] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.releases or self.finishes or self.extends or self.admits or self.commits)


class ScheduledBatch(NamedTuple):
    requests: list[Request]
    chunks: list[SequenceChunk]


@dataclass(slots=True)
class SchedulerConfig:
    block_size: int
    max_batch_tokens: int = 2048
    max_num_seqs: int = 64
    max_waiting: int = 1024


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._pending_finishes: list[FinishRecord] = []
        self._pending_releases: list[FinishRecord] = []
        self._pause_admission = False
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queues

    def add(self, request: Request) -> None:
        """Queues a request (the engine enforces the max_waiting bound before it gets here)."""
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._pending_finishes or self._pending_releases)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Ends a request; a running one's KV goes to the cache in the next step."""
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._pending_finishes.append(self._record(request))
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def reset(self) -> None:
        """The cache pool was lost: every running request goes back to waiting to be recomputed."""
        for request in reversed(self.running):
            request.reset_cache_state()
            request.num_preemptions += 1
            self.waiting.appendleft(request)
        self.running.clear()
        self._pending_finishes.clear()
        self._pending_releases.clear()
        self._pause_admission = False

    # ------------------------------------------------------------------ step

    def plan_cache_step(self) -> CachePlan:
        plan = CachePlan(releases=self._pending_releases, finishes=self._pending_finishes)
        self._pending_releases, self._pending_finishes = [], []
        bs = self.config.block_size
        budget = self.config.max_batch_tokens
        for request in self.running:
            budget -= request.num_uncomputed_tokens
            if len(request.block_table) * bs < request.num_tokens:
                plan.extends.append(ExtendItem(request, request.num_tokens))
            # Pages of the admitted tokens (the prompt) computed since the last commit: cache them
            # now, so requests admitted from this step on share them (not only after this one ends).
            committable = min(request.num_computed_tokens, request.num_admitted_tokens) // bs * bs
            if committable > request.num_shared_tokens:
                plan.commits.append(CommitItem(request, committable))
        if self._pause_admission:
            self._pause_admission = False
            return plan
        slots = self.config.max_num_seqs - len(self.running)
        for request in self.waiting:
            if budget <= 0 or slots <= 0:
                break
            plan.admits.append(request)
            budget -= request.num_tokens
            slots -= 1
        return plan

    def apply_cache_reply(self, plan: CachePlan, reply: CacheReply) -> ScheduledBatch:
        for item, com in zip(plan.commits, reply.commits, strict=True):
            item.request.block_table[:len(com.cached_block_ids)] = com.cached_block_ids
            item.request.num_shared_tokens = com.cached_tokens
        for item, ext in zip(plan.extends, reply.extends, strict=True):
            if ext.ok:
                item.request.block_table.extend(ext.new_block_ids)
            elif item.request.status is RequestStatus.RUNNING:
                self._preempt_newest()
        for request, adm in zip(plan.admits, reply.admits, strict=True):
            if not adm.admitted:
                break
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            request.block_table = list(adm.block_table)
            request.num_computed_tokens = adm.cached_tokens
            request.num_shared_tokens = adm.cached_tokens
            request.num_admitted_tokens = request.num_tokens
            if request.cached_prompt_tokens is None:
                request.cached_prompt_tokens = adm.cached_tokens
            self.running.append(request)
        return self._build_batch()

    def on_executed(self, batch: ScheduledBatch) -> None:
        for request, chunk in zip(batch.requests, batch.chunks, strict=True):
            request.num_computed_tokens += len(chunk.token_ids)

    # ------------------------------------------------------------------ internals

    def _build_batch(self) -> ScheduledBatch:
        bs = self.config.block_size
        budget = self.config.max_batch_tokens
        requests: list[Request] = []
        chunks: list[SequenceChunk] = []
        # Decodes first: one token each, latency-sensitive; then prefills in arrival order.
        ordered = sorted(self.running, key=lambda r: r.num_uncomputed_tokens > 1)
        for request in ordered:
            if budget <= 0:
                break
            start = request.num_computed_tokens
            end = min(request.num_tokens, start + budget, len(request.block_table) * bs)
            if end <= start:
                continue  # no block for its next token this step (extension failed)
            requests.append(request)
            chunks.append(SequenceChunk(self._token_slice(request, start, end), start,
                                        request.block_table, end == request.num_tokens))
            budget -= end - start
        return ScheduledBatch(requests, chunks)

    @staticmethod
    def _token_slice(request: Request, start: int, end: int) -> list[int]:
        prompt = request.prompt_token_ids
        if start >= len(prompt):
            n = len(prompt)
            return request.output_token_ids[start - n:end - n]
        return request.all_token_ids[start:end]

    def _preempt_newest(self) -> None:
        """Out of blocks: release the newest running request, keeping its computed pages cached."""
        if not self.running:
            return
        victim = self.running.pop()
        self._pending_releases.append(self._record(victim))
        victim.reset_cache_state()
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        self._pause_admission = True

    @staticmethod
    def _record(request: Request) -> FinishRecord:
        admitted = request.num_admitted_tokens
        return FinishRecord(request.request_id, request.all_token_ids[admitted:],
                            request.num_computed_tokens, list(request.block_table))
