"""The radix tree on a fixed trace shaped like SGLang's radix-cache benchmarks (issue 12).

100 shared prefixes of 512 random token ids; 10,000 requests, each a prefix + 512 fresh random
tokens (1,024 tokens); a pool of 2,000,000 token slots. Per request, as `cache_service.pool.Pool`
drives its tree and allocator on an admission and its finish: match the cacheable prefix and lock
it, allocate the rest (evicting LRU unlocked leaves when short), insert the prompt, unlock. What
the pool does besides (events, miss-reason bookkeeping) is not part of the tree and not timed.

The current tree, the current tree also reading every new and evicted page's hash (what Pool's
events and miss-reason bookkeeping ask of it) and the frozen previous tree
(testing/baseline_radix_tree.py, which hashes every inserted page) run the same trace in lockstep,
one request each in turn, so all see the same machine load.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np

from cache_service.block_allocator import BlockAllocator
from cache_service.radix_tree import RadixTree
from common.token_bytes import TOKEN_BYTES, encode_tokens
from testing import baseline_radix_tree

VOCAB = 32000


def make_trace(num_requests: int = 10_000, num_prefixes: int = 100, prefix_len: int = 512,
               fresh_len: int = 512, seed: int = 0) -> list[tuple[int, ...]]:
    """The requests' token ids (tuples, as `Pool` holds a prompt), deterministic for `seed`."""
    rng = np.random.default_rng(seed)
    prefixes = rng.integers(0, VOCAB, (num_prefixes, prefix_len)).tolist()
    which = rng.integers(0, num_prefixes, num_requests).tolist()
    fresh = rng.integers(0, VOCAB, (num_requests, fresh_len)).tolist()
    return [tuple(prefixes[p] + f) for p, f in zip(which, fresh, strict=True)]


@dataclass(slots=True)
class Driver:
    """One tree + allocator and the time spent in each call kind."""

    name: str
    tree: Any  # RadixTree or the baseline's
    allocator: BlockAllocator
    page_size: int
    encode: Callable[[tuple[int, ...]], bytes] | None = None  # the current tree's key encoding
    hashes: bool = False  # also read the new and evicted pages' hashes, as Pool's events and miss reasons do
    times: dict[str, float] = field(default_factory=lambda: {"match": 0.0, "insert": 0.0, "evict": 0.0})
    calls: dict[str, int] = field(default_factory=lambda: {"match": 0, "insert": 0, "evict": 0})
    total_s: float = 0.0
    requests: int = 0
    hit_tokens: int = 0
    evicted_pages: int = 0

    def request(self, tokens: tuple[int, ...]) -> None:
        clock = time.perf_counter
        tree, alloc, ps, times, calls = self.tree, self.allocator, self.page_size, self.times, self.calls
        start = clock()
        max_cached = (len(tokens) - 1) // ps * ps  # at least one prompt token is computed
        full = len(tokens) // ps
        # As Pool: the old tree takes tuples, the current one the prompt encoded once per request.
        key = tokens if self.encode is None else self.encode(tokens)
        cut = 1 if self.encode is None else TOKEN_BYTES
        t0 = clock()
        match = tree.match_prefix(key[: max_cached * cut])
        t1 = clock()
        times["match"] += t1 - t0
        calls["match"] += 1
        tree.inc_lock_ref(match.last_node)
        cached = len(match.block_ids)
        fresh = -(-len(tokens) // ps) - cached
        short = fresh - alloc.num_free_blocks
        if short > 0:
            t0 = clock()
            evicted = tree.evict(short)
            t1 = clock()
            times["evict"] += t1 - t0
            calls["evict"] += 1
            if self.hashes:
                for node in evicted:
                    node.hashes  # noqa: B018 - computes them (lazily kept by the current tree)
            blocks = list(chain.from_iterable(node.block_ids for node in evicted))
            alloc.free(blocks)
            self.evicted_pages += len(blocks)
        alloc.incref(match.block_ids)
        table = match.block_ids + alloc.allocate(fresh)
        t0 = clock()
        result = tree.insert(key[: full * ps * cut], table[:full])
        t1 = clock()
        times["insert"] += t1 - t0
        calls["insert"] += 1
        if self.hashes and result.new_node is not None:
            result.new_node.hashes  # noqa: B018
        existing = result.num_existing_pages
        alloc.free(chain(table[:existing], table[full:]))
        tree.dec_lock_ref(match.last_node)
        self.total_s += clock() - start
        self.requests += 1
        self.hit_tokens += cached * ps

    def summary(self) -> dict[str, float]:
        return summarize(self, self.tree.total_size)


def summarize(driver: Any, cached_pages: int) -> dict[str, float]:
    """A driver's counters (`Driver`'s, or a peer's driver keeping the same ones: requests,
    total_s, hit_tokens, evicted_pages, times and calls per kind) as rates and means."""
    out = {"req_s": driver.requests / driver.total_s, "us_per_req": 1e6 * driver.total_s / driver.requests,
           "hit_rate": driver.hit_tokens / max(1, driver.requests * 1024), "evicted_pages": driver.evicted_pages,
           "cached_pages": cached_pages}
    for kind in ("match", "insert", "evict"):
        out[f"{kind}_us"] = 1e6 * driver.times[kind] / max(1, driver.calls[kind])
        out[f"{kind}_calls"] = driver.calls[kind]
    return out


def run_trace(page_size: int, trace: list[tuple[int, ...]], pool_tokens: int,
              check: Callable[[Any], object] | None = None,
              peers: Sequence[Callable[[int, int], Any]] = ()) -> dict[str, Any]:
    """New vs old tree in lockstep on `trace` at `page_size`; `check(tree)` after the run.

    `peers`: factories (page_size, pool_tokens) -> a driver of another project's tree (with a
    `name`, `request(tokens)` and `summary()`, e.g. bench/sglang_tree.py) that takes its turns in
    the same lockstep; its summary is under "peers" and radixkv's ratio to it under
    "new_over_<name>"."""
    num_blocks = pool_tokens // page_size
    drivers = [Driver("new", RadixTree(page_size), BlockAllocator(num_blocks), page_size, encode_tokens),
               Driver("new_hashed", RadixTree(page_size), BlockAllocator(num_blocks), page_size, encode_tokens,
                      hashes=True),
               Driver("old", baseline_radix_tree.RadixTree(page_size), BlockAllocator(num_blocks), page_size)]
    others = [make(page_size, pool_tokens) for make in peers]
    everyone = drivers + others
    gc.collect()
    for i, tokens in enumerate(trace):
        shift = i % len(everyone)  # rotate who goes first
        for d in everyone[shift:] + everyone[:shift]:
            d.request(tokens)
    if check is not None:
        for d in drivers:
            check(d.tree)
    new, hashed, old = (d.summary() for d in drivers)
    for other in (hashed, old):
        if (new["hit_rate"], new["evicted_pages"]) != (other["hit_rate"], other["evicted_pages"]):
            raise AssertionError(f"the trees disagree on the trace: {new} vs {other}")
    result = {"page_size": page_size, "requests": len(trace), "pool_tokens": pool_tokens, "new": new,
              "new_hashed": hashed, "old": old, "new_over_old": new["req_s"] / old["req_s"],
              "new_hashed_over_old": hashed["req_s"] / old["req_s"], "peers": {}}
    for peer in others:
        result["peers"][peer.name] = summary = peer.summary()
        if abs(summary["hit_rate"] - new["hit_rate"]) > 0.01:  # LRU tie-breaks may differ, not more
            raise AssertionError(f"{peer.name}'s tree does not cache as radixkv's does: {summary} vs {new}")
        result[f"new_over_{peer.name}"] = new["req_s"] / summary["req_s"]
    return result

