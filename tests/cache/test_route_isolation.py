"""Route and Match between namespaces, Route's size limits, routed-request memory and pin caps,
in-process on a registry with a manual clock (the gRPC side: tests/security/test_route_security.py).

The page hash is public (cache.proto: XXH3-64 chained with the namespace's seed), so anyone can
compute another namespace's hash chain: what a lookup may find must depend on the query's
namespace itself, not on the hashes being secret."""

from __future__ import annotations

import pytest

from cache_service.errors import InvalidArgument
from cache_service.page_hash import page_hashes
from cache_service.pool_registry import PoolRegistry
from cache_service.radix_tree import RadixTree
from cache_service.routed import RoutedRequest, RoutedRequests
from cache_service.routing import DEFAULT_MAX_ROUTE_TOKENS, RouteQuery
from cache_service.schema import Admit, Finish, StepInput
from tests.cache.conftest import ManualClock

BS = 4
SECRET = list(range(300, 332))  # 8 pages tenant-a caches
OTHER = list(range(700, 732))  # as many pages of something else


def fleet(max_pinned_fraction: float = 0.25, num_blocks: int = 64) -> PoolRegistry:
    registry = PoolRegistry(lease_seconds=30, clock=ManualClock(), max_pinned_fraction=max_pinned_fraction)
    for name in ("a", "b"):
        registry.register(name, num_blocks, BS, "fp", 0, f"127.0.0.1:{ord(name)}")
    return registry


def cache_prompt(registry: PoolRegistry, pool_id: str, tokens: list[int], namespace: str = "",
                 rid: str = "seed") -> None:
    pool = registry.pools[pool_id]
    (adm,) = pool.step(StepInput(admits=[Admit(rid, tokens + [1], namespace)])).admits
    assert adm.admitted
    pool.step(StepInput(finishes=[Finish(rid, [], len(tokens))]))


def route(registry: PoolRegistry, **kw):
    return registry.route(RouteQuery(model_fingerprint="fp", **kw))


# ---------------------------------------------------------------------- lookups by hash chain


def test_the_tree_looks_hash_chains_up_in_the_query_namespace_only() -> None:
    tree = RadixTree(BS)
    tree.insert(SECRET, list(range(8)), "tenant-a")
    tree.insert(SECRET[:16], list(range(8, 12)), "")
    chain_a = page_hashes(0, "tenant-a", SECRET, BS)
    assert tree.peek_hashes(chain_a, "tenant-a") == 8
    assert tree.peek_hashes(chain_a, "tenant-b") == 0 and tree.peek_hashes(chain_a, "") == 0
    assert tree.peek_hashes(page_hashes(0, "", SECRET, BS), "") == 4
    tree.insert(SECRET + [5, 6, 7, 8], list(range(12, 21)), "tenant-a")  # kept up to date from now on
    assert tree.peek_hashes(page_hashes(0, "tenant-a", SECRET + [5, 6, 7, 8], BS), "tenant-a") == 9
    assert tree.evict(100)
    assert tree.peek_hashes(chain_a, "tenant-a") == 0
    tree.check_integrity()


def test_route_by_another_namespace_s_hash_chain_answers_as_if_it_held_nothing() -> None:
    empty = fleet()
    holding = fleet()
    cache_prompt(holding, "a", SECRET, "tenant-a", "s1")
    cache_prompt(holding, "b", SECRET[:16], "", "s2")
    for namespace in ("tenant-a", ""):
        query = dict(page_hashes=tuple(page_hashes(0, namespace, SECRET, BS)), namespace="tenant-b", dry_run=True)
        seen = route(holding, **query)
        assert [c.matched_tokens for c in seen.candidates] == [0, 0]
        assert seen == route(empty, **query)  # every field: score, order, free blocks
        by_tokens = dict(token_ids=tuple(SECRET + [1]), namespace="tenant-b", dry_run=True)
        assert route(holding, **by_tokens) == route(empty, **by_tokens)
    own = route(holding, page_hashes=tuple(page_hashes(0, "tenant-a", SECRET, BS)), namespace="tenant-a", dry_run=True)
    assert own.candidates[0].matched_tokens == 32  # its own namespace still finds it
    holding.check_integrity()


def test_unlimited_callers_see_free_and_evictable_blocks_apart() -> None:
    registry = fleet()
    cache_prompt(registry, "a", SECRET, "tenant-a")
    limited = {c.pool_id: c for c in route(registry, token_ids=(1, 2, 3), dry_run=True).candidates}
    full = {c.pool_id: c for c in route(registry, token_ids=(1, 2, 3), dry_run=True,
                                        all_namespaces=True).candidates}
    assert (full["a"].num_free_blocks, full["a"].num_evictable_blocks) == (56, 8)
    assert (limited["a"].num_free_blocks, limited["a"].num_evictable_blocks) == (64, 0)


def test_routed_prompts_promise_their_pages_to_their_own_namespace_only() -> None:
    registry = fleet()
    route(registry, token_ids=tuple(SECRET + [1]), namespace="tenant-a", request_id="ra")
    probe = dict(page_hashes=tuple(page_hashes(0, "tenant-a", SECRET, BS)), dry_run=True)
    assert all(c.routed_prefix_tokens == 0 and c.matched_tokens == 0
               for c in route(registry, namespace="tenant-b", **probe).candidates)
    assert max(c.routed_prefix_tokens for c in route(registry, namespace="tenant-a", **probe).candidates) == 32


def test_routed_requests_of_one_namespace_are_not_replaced_or_consumed_by_another() -> None:
    registry = PoolRegistry(lease_seconds=30, clock=ManualClock())
    pool = registry.register("p", 64, BS, "fp", 0, "127.0.0.1:1")
    cache_prompt(registry, "p", SECRET, "tenant-a")
    best = route(registry, token_ids=tuple(SECRET + [1]), namespace="tenant-a", request_id="r",
                 reserve_ms=10_000).candidates[0]
    assert best.reserved and pool.routing.routed.num_pins == 1
    route(registry, token_ids=tuple(OTHER + [1]), namespace="tenant-b", request_id="r")  # same id, other ns
    assert pool.routing.routed.num_pins == 1
    pool.step(StepInput(admits=[Admit("r", OTHER + [2], "tenant-b")]))  # same id admitted in another ns
    assert pool.routing.routed.num_pins == 1 and pool.tree.protected_size == 8
    pool.step(StepInput(releases=[Finish("r", [], 0)]))
    pool.step(StepInput(admits=[Admit("r", SECRET + [1], "tenant-a")]))
    assert pool.routing.routed.num_pins == 0  # its own admission ends it
    registry.check_integrity()


# ---------------------------------------------------------------------- size limits


def test_route_takes_at_most_the_largest_live_pool_of_the_model() -> None:
    registry = fleet(num_blocks=64)  # 64 blocks x 4 tokens
    registry.register("big-other-model", 1000, BS, "fp2", 0, "127.0.0.1:9")
    route(registry, token_ids=tuple(range(256)), dry_run=True)
    with pytest.raises(InvalidArgument, match=r"at most 256 token ids"):
        route(registry, token_ids=tuple(range(257)), request_id="big")
    route(registry, page_hashes=tuple(range(64)), dry_run=True)
    with pytest.raises(InvalidArgument, match=r"at most 64 page hashes"):
        route(registry, page_hashes=tuple(range(65)))
    assert all(len(p.routing.routed) == 0 for p in registry.pools.values())  # nothing remembered
    nothing = RouteQuery(token_ids=tuple(range(DEFAULT_MAX_ROUTE_TOKENS + 1)), model_fingerprint="none")
    with pytest.raises(InvalidArgument, match=f"at most {DEFAULT_MAX_ROUTE_TOKENS} token ids"):
        registry.route(nothing)


def test_routed_memory_is_bounded_in_entries_and_pages_oldest_first() -> None:
    routed = RoutedRequests(max_entries=3, max_pages=10)
    for i in range(3):
        routed.add(RoutedRequest(f"r{i}", "", [i * 10 + k for k in range(3)], 5, 100.0))
    assert len(routed) == 3 and routed.num_pages == 9 and routed.queued_tokens == 15
    routed.add(RoutedRequest("r3", "", [90], 5, 100.0))  # a 4th entry: r0 goes
    assert [e.request_id for e in routed.entries()] == ["r1", "r2", "r3"] and routed.num_pages == 7
    routed.add(RoutedRequest("r4", "ns", [80, 81, 82, 83, 84], 5, 100.0))  # 7 + 5 pages > 10: r1 goes
    assert [e.request_id for e in routed.entries()] == ["r2", "r3", "r4"] and routed.num_pages == 9
    assert routed.promised_pages("", [0, 1, 2]) == 0 and routed.queued_tokens == 15
    assert routed.promised_pages("ns", [80, 81]) == 2 and routed.promised_pages("", [80]) == 0
    routed.add(RoutedRequest("r5", "", list(range(200, 220)), 5, 100.0))  # longer than max_pages alone
    assert [e.request_id for e in routed.entries()] == ["r5"] and routed.num_pages == 10
    assert routed.promised_pages("", list(range(200, 220))) == 10 and routed.queued_tokens == 5
    routed.add(RoutedRequest("r5", "", [1], 7, 100.0))  # the same id again replaces it
    assert len(routed) == 1 and routed.num_pages == 1 and routed.queued_tokens == 7


def test_a_pool_remembers_at_most_its_own_size_of_a_routed_prompt() -> None:
    registry = PoolRegistry(lease_seconds=30, clock=ManualClock())
    registry.register("small", 8, BS, "fp", 0, "127.0.0.1:1")
    registry.register("large", 64, BS, "fp", 0, "127.0.0.1:2")
    registry.pools["large"].load.num_running_requests = 10**8  # worse than the small one's "full" penalty
    best = route(registry, token_ids=tuple(range(200)), request_id="r").candidates[0]
    assert best.pool_id == "small"
    (entry,) = registry.pools["small"].routing.routed.entries()
    assert len(entry.page_hashes) == 8


# ---------------------------------------------------------------------- pins


def test_pins_are_capped_at_a_fraction_of_the_pool_and_admissions_still_fit() -> None:
    registry = PoolRegistry(lease_seconds=30, clock=ManualClock(), max_pinned_fraction=0.25)
    registry.register("p", 64, BS, "fp", 0, "127.0.0.1:1")
    pool = registry.pools["p"]
    prompts = [list(range(1000 * (i + 1), 1000 * (i + 1) + 16)) for i in range(12)]  # 4 pages each
    for i, tokens in enumerate(prompts):
        cache_prompt(registry, "p", tokens, rid=f"seed{i}")
    assert pool.tree.evictable_size == 48
    reserved = [route(registry, token_ids=tuple(tokens + [1]), request_id=f"r{i}", reserve_ms=60_000)
                .candidates[0].reserved for i, tokens in enumerate(prompts)]
    assert reserved == [True] * 4 + [False] * 8  # 16 pinned blocks = 0.25 * 64
    assert pool.routing.routed.pinned_pages == 16 and pool.tree.protected_size == 16
    assert len(pool.routing.routed) == 12  # unpinned ones are still remembered as routed
    (adm,) = pool.step(StepInput(admits=[Admit("big", list(range(5000, 5161)))])).admits  # 41 blocks
    assert adm.admitted
    pool.check_integrity()


def test_a_zero_pin_fraction_pins_nothing_and_bad_fractions_are_refused() -> None:
    registry = PoolRegistry(lease_seconds=30, clock=ManualClock(), max_pinned_fraction=0.0)
    registry.register("p", 64, BS, "fp", 0, "127.0.0.1:1")
    cache_prompt(registry, "p", SECRET)
    best = route(registry, token_ids=tuple(SECRET + [1]), request_id="r", reserve_ms=1000).candidates[0]
    assert best.matched_tokens == 32 and not best.reserved
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="max_pinned_fraction"):
            PoolRegistry(max_pinned_fraction=bad)


def test_routed_entries_without_pages_come_and_go_with_others_of_their_namespace() -> None:
    routed = RoutedRequests()
    routed.add(RoutedRequest("empty", "t", [], 1, 100.0))  # a prompt shorter than a page
    routed.add(RoutedRequest("full", "t", [5], 1, 100.0))
    routed.drop("t", "full")
    routed.drop("t", "empty")
    assert len(routed) == 0 and routed.num_pages == 0 and routed.queued_tokens == 0
