"""Parallel sampling (SamplingParams.n > 1): a request's choices share one prefill.

Choice 0 runs as any request. The other choices wait (RequestStatus.FORKING) until the step
that samples choice 0's first token: that step's logits row is sampled once per choice, each
with its own generator (seed + i), logits processors and grammar, and the choices join the
waiting queue holding their first token. Each is then admitted as a request of prompt + that
token: the cache manager hands it the prompt's full pages, which choice 0 committed to the tree
(shared, no copy), and fresh blocks for the rest; the prompt's partial last page is copied from
choice 0's block (`copy_prompt_tails`), so a choice computes no prompt token at all, only its
own tokens from the first on. The prompt is computed once, whatever n.

A choice admitted once choice 0's blocks are gone (choice 0 finished and its blocks went back
in an earlier Step, or it was preempted) computes its prompt's tail itself: the same tokens,
a few more of them.
"""

from __future__ import annotations

from collections.abc import Sequence

from model_service.kv_cache import KVCache
from model_service.model_runner import SequenceChunk
from model_service.request import MissBreakdown, Request, RequestStatus


def sampling_rows(requests: Sequence[Request], chunks: Sequence[SequenceChunk]) -> tuple[list[Request], list[int] | None]:
    """The requests sampled after a forward, in logits order, with choices that fork now right
    after their choice 0; and the logits row each samples from (None when no choice forks: row i
    is logits row i)."""
    rows: list[Request] = []
    sources: list[int] = []
    forking = False
    row = -1
    for request, chunk in zip(requests, chunks, strict=True):
        if not chunk.needs_logits:
            continue
        row += 1
        rows.append(request)
        sources.append(row)
        if request.choices and request.index == 0 and not request.output_token_ids:
            waiting = unforked(request)
            rows.extend(waiting)
            sources.extend([row] * len(waiting))
            forking = forking or bool(waiting)
    return rows, sources if forking else None


def ready_source(choice: Request, plan: object) -> Request | None:
    """The request whose blocks hold `choice`'s prompt KV now (its choice 0 while it holds
    them), or None. `plan`: the cache plan being built or applied; blocks a finish gave back in
    that very Step are still intact (nothing writes them before its reply is applied)."""
    source = choice.fork_source
    if source is None or source.num_computed_tokens < len(choice.prompt_token_ids):
        return None
    if source.status is RequestStatus.RUNNING or (source.is_finished and source.returned_by in (None, plan)):
        return source
    return None


def copy_prompt_tails(admitted: Sequence[Request], plan: object, kv_cache: KVCache) -> None:
    """For each newly admitted forked choice: copies its prompt KV beyond its cache hit from its
    choice 0's blocks into its own fresh ones, so it starts at its first token. Choices whose
    source is gone keep their hit and compute the rest."""
    bs = kv_cache.block_size
    for choice in admitted:
        source = ready_source(choice, plan)
        choice.fork_source = None  # the first admission only (a preempted choice recomputes)
        num_prompt = len(choice.prompt_token_ids)
        if choice.is_finished:
            continue
        if choice.num_computed_tokens < num_prompt:
            if source is None:
                continue
            first, end = choice.num_computed_tokens // bs, -(-num_prompt // bs)
            kv_cache.copy_blocks(source.block_table[first:end], choice.block_table[first:end])
            choice.num_computed_tokens = num_prompt
        choice.cached_prompt_tokens = num_prompt  # all of its prompt came from the prefix's KV
        choice.miss = MissBreakdown()


def unforked(request: Request) -> list[Request]:
    """The choices of `request`'s prompt still waiting for choice 0's first token."""
    return [c for c in request.choices[1:] if c.status is RequestStatus.FORKING]

