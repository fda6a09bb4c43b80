"""Route: rank the live pools of a model for one prompt, from each pool's own tree and load.

score (lower is better, in token units: the work between the request and its first token):
    prefill_weight * prefill_tokens
  + queue_weight   * (num_waiting_tokens + routed_tokens)
  + running_weight * num_running_requests
  + pool_full_penalty  (the pool cannot hold the request now, even after evicting)

`prefill_tokens` is what the pool would compute: the prompt minus its exact cached prefix, or
minus the prefix a request routed there moments ago will have cached (counted as matched), and
minus the pages after it its replica's host, then disk tier holds (cache_service/tiers/): those
count in the prefill term at their measured load cost (ReplicaLoad.host_load_cost, a share of a
computed token's cost), so a device hit is free, a tier hit cheap, a miss full price. Between
replicas that pull from each other (cache_service/peer_pulls.py), the pages after those that
another candidate holds count at the pool's measured pull cost (ReplicaLoad.peer_load_cost), so
a busy holder of a hot prefix loses to an idle replica that would pull it.
`routed_tokens` are the expected prefill tokens of requests routed there and not yet admitted.
A prefill token saved counts twice a queued token by default (llm-d's prefix:load 2:1): sending
a request where its prefix is costs the fleet only its suffix, recomputing it elsewhere costs the
whole prefix again, and every other request pays for that work.

Each call walks the prompt's page hash chain once in the model's page index (fleet_pages.py):
every pool's cached and promised pages at once, however many pools. A Route that asks for at most
`max_candidates` (the router does) over pools without lower tiers or peer pulls, at the default
weights, reads the pools from the least loaded up and stops once no further pool could enter its
answer (`_least_loaded_first`): a fixed number of pools however large the fleet, with the answer
a full ranking would give. Otherwise a fleet larger than FULL_RANK_POOLS is ranked over the pools
that hold or were promised the prompt's first page, those whose lower tiers hold it, and a few
least loaded others (see `route`).

Namespaces: every lookup is made in the query's namespace only (the tree's root of that namespace,
its page-hash index, its routed requests), so an answer never depends on what another namespace
has cached, routed or pinned. Pool-wide numbers remain: the replica's reported load and the
routed load. The block counts are shown as a namespace-limited caller may see them unless the
query says `all_namespaces`: cached blocks nobody holds count as free (num_evictable_blocks 0),
because how much other namespaces keep cached is theirs to know (free + evictable, what the
score and the "pool full" test use, does not depend on it).

Size: a Route takes at most as many token ids (page hashes) as the largest live pool of the
model holds tokens (blocks): `check_route_size`. A routed request is remembered with at most
its pool's number of pages, within the pool's bounded routed memory (routed.py), and a
reservation pins only while the pool's pinned pages stay within its cap (`Pool.may_pin`).
"""

from __future__ import annotations

import heapq
from bisect import insort
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from cache_service.errors import InvalidArgument
from cache_service.fleet_pages import ModelPages
from cache_service.load_order import QUEUE_WEIGHT, RUNNING_WEIGHT, load_terms
from cache_service.page_hash import iter_page_hashes, page_hashes
from cache_service.peer_pulls import held_pages, peer_load_cost
from cache_service.pool import Pool
from cache_service.radix_tree import RadixTree
from cache_service.routed import DEFAULT_ROUTED_TTL_SECONDS, RoutedRequest
from cache_service.schema import ReplicaLoad
from cache_service.tiers.lower_tier import TIER_DISK, TIER_HOST
from common.token_bytes import TOKEN_BYTES, encode_tokens

POOL_FULL_PENALTY = 1e9
MAX_RESERVE_MS = 60_000
# Route ranks every live pool of a fleet this size or smaller; a larger one, those likely best.
FULL_RANK_POOLS = 16
LEAST_LOADED_OTHERS = 4
# Route's answers of at most this many candidates read pools least loaded first (`_least_loaded_first`:
# a sorted insert per pool read; a longer answer is a full ranking's anyway).
LEAST_LOADED_FIRST_MAX_CANDIDATES = 64
# The size limit of a Route when no live pool of its model is registered (the answer is empty then).
DEFAULT_MAX_ROUTE_TOKENS = 1 << 16


@dataclass(slots=True)
class RouteWeights:
    prefill_weight: float = 2.0
    queue_weight: float = QUEUE_WEIGHT
    running_weight: float = RUNNING_WEIGHT


DEFAULT_WEIGHTS = RouteWeights()


@dataclass(slots=True)
class RouteQuery:
    token_ids: Sequence[int] = ()  # a tuple, or an array('I') from packed_token_ids
    page_hashes: tuple[int, ...] = ()  # instead of token_ids: the prompt's page hash chain
    namespace: str = ""
    model_fingerprint: str = ""
    request_id: str = ""
    reserve_ms: int = 0
    max_candidates: int = 0
    dry_run: bool = False
    weights: RouteWeights | None = None
    # The caller may see every namespace (a token without ns=): block counts split free and
    # evictable. False: the namespace-limited view (see the module docstring).
    all_namespaces: bool = False


class RouteCandidate(NamedTuple):
    pool_id: str
    worker_id: str
    serving_addr: str
    matched_tokens: int
    routed_prefix_tokens: int
    prefill_tokens: int
    load: ReplicaLoad
    routed_tokens: int
    num_free_blocks: int
    num_evictable_blocks: int
    num_blocks: int
    score: float
    reserved: bool = False
    matched_host_tokens: int = 0  # after the (routed) matched prefix, loaded from the host tier
    matched_disk_tokens: int = 0  # then from the disk tier
    matched_peer_tokens: int = 0  # then pulled from another replica (cache_service/peer_pulls.py)
    pull_from_worker_id: str = ""


class RouteResult(NamedTuple):
    candidates: list[RouteCandidate]
    num_prompt_pages: int


def route_size_limits(pools: Iterable[Pool]) -> tuple[int, int]:
    """(token ids, page hashes) a Route over `pools` may carry: the largest pool's tokens and
    blocks (DEFAULT_MAX_ROUTE_TOKENS for both when there is no pool)."""
    max_tokens = max_pages = 0
    for pool in pools:
        max_tokens = max(max_tokens, pool.num_blocks * pool.block_size)
        max_pages = max(max_pages, pool.num_blocks)
    if not max_pages:
        return DEFAULT_MAX_ROUTE_TOKENS, DEFAULT_MAX_ROUTE_TOKENS
    return max_tokens, max_pages


def check_route_size(pools: Iterable[Pool], num_tokens: int, num_pages: int) -> None:
    """InvalidArgument when a prompt of `num_tokens` token ids / `num_pages` page hashes is
    larger than any of `pools` (the live pools of its model) could hold."""
    pools = list(pools)
    max_tokens, max_pages = route_size_limits(pools)
    why = "the largest live pool of this model" if pools else "no live pool of this model: the default"
    if num_tokens > max_tokens:
        raise InvalidArgument(f"token_ids has {num_tokens} ids; Route takes at most {max_tokens} token ids "
                              f"({why})")
    if num_pages > max_pages:
        raise InvalidArgument(f"page_hashes has {num_pages} hashes; Route takes at most {max_pages} page hashes "
                              f"({why})")


def within_group_sizes(groups: Sequence[ModelPages], num_tokens: int, num_pages: int) -> bool:
    """Whether a prompt of `num_tokens` / `num_pages` fits the largest pool of `groups`, lease
    running or not (every live pool is among them: False means `check_route_size` refuses it)."""
    max_tokens = max((g.max_blocks * g.page_size for g in groups), default=0)
    max_pages = max((g.max_blocks for g in groups), default=0)
    return bool(max_pages) and num_tokens <= max_tokens and num_pages <= max_pages


def fits_every_pool(groups: Sequence[ModelPages], num_tokens: int, num_pages: int) -> bool:
    """Whether `check_route_size` surely passes a prompt of `num_tokens` / `num_pages`: it fits the
    smallest pool of every group, and the default limit (what applies when no pool is live)."""
    return (bool(groups) and num_tokens <= DEFAULT_MAX_ROUTE_TOKENS and num_pages <= DEFAULT_MAX_ROUTE_TOKENS
            and all(num_tokens <= g.min_blocks * g.page_size and num_pages <= g.min_blocks for g in groups))


def route(groups: Sequence[ModelPages], query: RouteQuery, now: float) -> RouteResult:
    """Rank the live pools of `groups` (those without a serving address are skipped).

    The best `max_candidates` of plain pools at the default weights: `_least_loaded_first`.
    Else a fleet of at most FULL_RANK_POOLS candidates is ranked whole. A larger one is ranked over
    the pools that hold or were promised the prompt's first page, those whose lower tiers hold
    it, and the LEAST_LOADED_OTHERS least loaded of the rest: a pool outside those would compute
    the whole prompt, so one of the least loaded is at least as good."""
    num_tokens, num_hashes = len(query.token_ids), len(query.page_hashes)
    if not fits_every_pool(groups, num_tokens, num_hashes):
        check_route_size([p for g in groups for p in g.pools.values() if now < p.lease_deadline], num_tokens, num_hashes)
    if bool(query.token_ids) == bool(query.page_hashes):
        raise InvalidArgument("give either token_ids or page_hashes (exactly one of them, non-empty; "
                              "packed_token_ids are token_ids)")
    if query.reserve_ms < 0 or query.reserve_ms > MAX_RESERVE_MS:
        raise InvalidArgument(f"reserve_ms must be in [0, {MAX_RESERVE_MS}]")
    if query.reserve_ms and not query.request_id:
        raise InvalidArgument("reserve_ms needs the request_id the request will carry")
    weights = query.weights or RouteWeights()
    hash_chains: dict[int, list[int]] = {}  # per block size, computed only when needed
    recording = bool(query.request_id) and not query.dry_run

    def chain(block_size: int) -> list[int]:
        if block_size not in hash_chains:
            hash_chains[block_size] = (list(query.page_hashes) if query.page_hashes else
                                       page_hashes(0, query.namespace, cacheable(block_size)[2], block_size))
        return hash_chains[block_size]

    keys: dict[int, bytes] = {}  # per block size: the cacheable prompt prefix, sliced once
    encoded = encode_tokens(query.token_ids) if query.token_ids else b""  # encoded once for all pools
    wp = weights.prefill_weight

    def cacheable(bs: int) -> tuple[int, int, bytes]:
        """(prompt tokens, pages that may be cached, their key) for pools of page size `bs`."""
        if not query.token_ids:
            return len(query.page_hashes) * bs, len(query.page_hashes), b""
        max_cached = (len(query.token_ids) - 1) // bs  # pages: the last prompt token is always computed
        key = keys.get(bs)
        if key is None:
            key = keys[bs] = encoded[: max_cached * bs * TOKEN_BYTES]
        return len(query.token_ids), max_cached, key

    def walk(bs: int) -> Iterable[int]:
        """The prompt's hash chain for pools of page size `bs`: whole when it is needed anyway
        (recording, or given), else lazily (the index walk stops at the first page no one holds)."""
        if query.page_hashes or recording:
            return chain(bs)
        return iter_page_hashes(0, query.namespace, cacheable(bs)[2], bs)

    for group in groups:  # routed prompts whose time is up promise nothing (before the walk)
        group.expire_due(now)
    if (0 < query.max_candidates <= LEAST_LOADED_FIRST_MAX_CANDIDATES and len(groups) == 1 and not groups[0].special
            and query.max_candidates < len(groups[0].pools) and (query.weights is None or query.weights == DEFAULT_WEIGHTS)):
        group = groups[0]
        scored = _least_loaded_first(group, query, now, cacheable(group.page_size), walk(group.page_size))
        num_pages = cacheable(group.page_size)[0] // group.page_size if scored else 0
        return _answer(scored, query, now, recording, chain, num_pages)
    candidates = [p for g in groups for p in g.pools.values() if now < p.lease_deadline and p.serving_addr
                  and (not query.model_fingerprint or p.model_fingerprint == query.model_fingerprint)]
    # One walk of the page index per group: every pool's cached and promised leading pages.
    device: dict[str, int] = {}
    promised: dict[str, int] = {}
    for group in groups:
        held = group.held(query.namespace, walk(group.page_size))
        device.update(held.device)
        promised.update(held.routed)
    if len(candidates) > FULL_RANK_POOLS:
        candidates = _likely_best(candidates, device, promised, query, encoded, weights)

    def held_by(tree: RadixTree, bs: int) -> int:
        """Pages of the prompt `tree` (a host tier's) holds (read-only)."""
        if query.token_ids:
            return tree.peek_key(cacheable(bs)[2], query.namespace) // bs
        return tree.peek_hashes(query.page_hashes, query.namespace)

    # Pools that pull from each other (kv_transfer_addr): the two that hold the most of the prompt
    # (device blocks or host tier), so each candidate's best other source is found without a
    # second pass over the pools.
    sources = sorted(((held_pages(p, lambda tree, p=p: device.get(p.pool_id, 0) if tree is p.tree
                                  else held_by(tree, p.block_size))[0], p.block_size, p)
                      for p in candidates if p.pulls.enabled and p.pulls.brokered), key=lambda item: -item[0])[:2]
    scored: list[Scored] = []
    sizes: dict[int, tuple[int, int, bytes]] = {}  # cacheable(bs) per page size of the candidates
    queue_weight, running_weight = weights.queue_weight, weights.running_weight
    for pool in candidates:  # every pool of a small fleet, every Route: kept lean (no calls a pool)
        bs = pool.block_size
        sized = sizes.get(bs)
        if sized is None:
            sized = sizes[bs] = cacheable(bs)
        num_tokens, max_cached, key = sized
        pid = pool.pool_id
        routed = pool.routing.routed
        matched = min(device.get(pid, 0), max_cached)
        effective = max(matched, min(promised.get(pid, 0), max_cached)) if len(routed) else matched
        host = disk = peer = 0
        peer_id = ""
        tier_cost = 0.0
        if pool.tiers is not None:  # pages a lower tier holds are loaded, at their measured cost
            host, disk = (pool.tiers.peek(key, query.namespace, effective) if query.token_ids else
                          pool.tiers.peek_hashes(query.page_hashes, query.namespace, effective))
            tier_cost = bs * (host * pool.tiers.load_cost(TIER_HOST) + disk * pool.tiers.load_cost(TIER_DISK))
        if pool.pulls.enabled and pool.pulls.brokered and peer_load_cost(pool) < 1.0:
            covered = effective + host + disk
            for pages, source_bs, source in sources:
                if source is not pool and source_bs == bs:
                    if pages > covered:
                        peer, peer_id = pages - covered, source.worker_id
                    break
            tier_cost += bs * peer * peer_load_cost(pool)
        prefill = num_tokens - (effective + host + disk + peer) * bs
        # visible_blocks and queue_score, written out
        free, evictable = pool.allocator.num_free_blocks, pool.tree.evictable_size
        if not query.all_namespaces:
            free, evictable = free + evictable, 0
        load = pool.load
        score = (wp * (prefill + tier_cost) + queue_weight * (load.num_waiting_tokens + routed.queued_tokens)
                 + running_weight * load.num_running_requests)
        if -(-(num_tokens + 1) // bs) - matched > free + evictable:
            score += POOL_FULL_PENALTY
        scored.append((score, -free, pid, pool, matched * bs, (effective - matched) * bs, prefill,
                       evictable, host * bs, disk * bs, peer * bs, peer_id))
    num_pages = max((num_tokens // bs for bs, (num_tokens, _, _) in sizes.items()), default=0)
    scored.sort()  # by (score, -free, pool id): pool ids are unique, so the pools are never compared
    if query.max_candidates:
        scored = scored[: query.max_candidates]
    return _answer(scored, query, now, recording, chain, num_pages)


# (score, -free, pool_id, pool, matched tokens, promised tokens, prefill tokens, evictable,
#  host tokens, disk tokens, peer tokens, peer worker id)
Scored = tuple[float, int, str, Pool, int, int, int, int, int, int, int, str]


def _answer(scored: list[Scored], query: RouteQuery, now: float, recording: bool,
            chain: Callable[[int], list[int]], num_pages: int) -> RouteResult:
    """The ranked candidates of `scored` (best first), the best one recorded when asked to."""
    ranked = [
        RouteCandidate(pool.pool_id, pool.worker_id, pool.serving_addr, matched, promised, prefill, pool.load,
                       pool.routing.routed.queued_tokens, -neg_free, evictable, pool.num_blocks, score,
                       matched_host_tokens=host, matched_disk_tokens=disk, matched_peer_tokens=peer,
                       pull_from_worker_id=peer_id)
        for score, neg_free, _, pool, matched, promised, prefill, evictable, host, disk, peer, peer_id in scored
    ]
    if ranked and recording:
        pool = scored[0][3]
        ranked[0] = _record(pool, ranked[0], query, chain(pool.block_size), now)
    return RouteResult(ranked, num_pages)


def _least_loaded_first(group: ModelPages, query: RouteQuery, now: float, cacheable: tuple[int, int, bytes],
                        hashes: Iterable[int]) -> list[Scored]:
    """The best `query.max_candidates` pools of a group without lower tiers or peer pulls, at the
    default weights, as a full ranking would give them, reading pools from the least loaded up.

    Such a pool's score is its load terms (the order's key) plus the prefill weight times what it
    would compute, and no pool computes less than the prompt minus the deepest hit of any pool.
    So once that floor plus the next pool's load exceeds the worst score kept, neither it nor any
    pool after it can enter the answer. With a popular prefix cached everywhere, a few pools past
    the k least loaded are read, however large the fleet."""
    num_tokens, max_cached, _ = cacheable
    bs = group.page_size
    depths = group.depth_bits(query.namespace, hashes)
    deepest = min(max(depths.values(), default=0), max_cached)
    wp = DEFAULT_WEIGHTS.prefill_weight
    floor = wp * (num_tokens - deepest * bs)
    k = query.max_candidates
    need_blocks = -(-(num_tokens + 1) // bs)
    best: list[Scored] = []  # ascending, at most k
    pools = group.pools
    for load, pool_id in group.order:
        if len(best) == k:
            worst = best[-1][0]
            if floor + load > worst + abs(worst) * 1e-12:  # the slack: rounding of huge reported loads
                break
        pool = pools[pool_id]
        if now >= pool.lease_deadline or not pool.serving_addr:
            continue
        bits = group.bits(pool_id)
        routed = pool.routing.routed
        matched = min(depths.get(bits.device.bit, 0), max_cached)
        effective = max(matched, min(depths.get(bits.routed.bit, 0), max_cached)) if len(routed) else matched
        prefill = num_tokens - effective * bs
        free, evictable = visible_blocks(pool, query.all_namespaces)
        load_now = pool.load
        score = (wp * (prefill + 0.0) + QUEUE_WEIGHT * (load_now.num_waiting_tokens + routed.queued_tokens)
                 + RUNNING_WEIGHT * load_now.num_running_requests)  # as `route` computes it, to the bit
        if need_blocks - matched > free + evictable:
            score += POOL_FULL_PENALTY
        insort(best, (score, -free, pool_id, pool, matched * bs, (effective - matched) * bs, prefill, evictable,
                      0, 0, 0, ""))
        if len(best) > k:
            best.pop()
    return best


def _likely_best(candidates: list[Pool], device: dict[str, int], promised: dict[str, int], query: RouteQuery,
                 encoded: bytes, weights: RouteWeights) -> list[Pool]:
    """The pools of a large fleet worth scoring for a prompt (see `route`)."""
    chosen: list[Pool] = []
    rest: list[Pool] = []
    for pool in candidates:
        pid = pool.pool_id
        if pid in device or pid in promised or (pool.tiers is not None and pool.tiers.holds_first_page(
                encoded[: pool.block_size * TOKEN_BYTES], query.page_hashes[:1], query.namespace)):
            chosen.append(pool)
        else:
            rest.append(pool)
    # Least loaded: the score's load terms, then the most room (free + evictable).
    chosen.extend(heapq.nsmallest(LEAST_LOADED_OTHERS, rest,
                                  key=lambda p: (queue_score(p, weights), -visible_blocks(p, False)[0])))
    return chosen


def queue_score(pool: Pool, weights: RouteWeights) -> float:
    """The score's load terms: what the pool has queued and running, whatever the prompt."""
    return load_terms(pool, weights.queue_weight, weights.running_weight)


def visible_blocks(pool: Pool, all_namespaces: bool) -> tuple[int, int]:
    """(free, evictable) blocks of `pool` as a caller sees them: apart when it may see every
    namespace, else cached blocks nobody holds count as free (see the module docstring)."""
    free, evictable = pool.allocator.num_free_blocks, pool.tree.evictable_size
    return (free, evictable) if all_namespaces else (free + evictable, 0)


def _record(pool: Pool, best: RouteCandidate, query: RouteQuery, hashes: Sequence[int],
            now: float) -> RouteCandidate:
    """Count the request as routed to `pool`; pin its matched prefix when asked to (token ids
    only: a hash chain names no tree node to lock) and the pool's pin cap allows it."""
    bs = pool.block_size
    max_cached = (len(query.token_ids) - 1) // bs if query.token_ids else len(hashes)
    max_cached = min(max_cached, pool.num_blocks)  # the pool can never cache more of it
    pin = None
    if query.reserve_ms and best.matched_tokens and query.token_ids and pool.may_pin(best.matched_tokens // bs):
        pin = pool.pin_prefix(query.token_ids[: best.matched_tokens], query.namespace)
    entry = RoutedRequest(query.request_id, query.namespace, list(hashes[:max_cached]), best.prefill_tokens,
                          now + max(DEFAULT_ROUTED_TTL_SECONDS, query.reserve_ms / 1000), pin,
                          now + query.reserve_ms / 1000)
    pool.add_routed(entry)
    return best._replace(routed_tokens=pool.routing.routed.queued_tokens, reserved=pin is not None)
