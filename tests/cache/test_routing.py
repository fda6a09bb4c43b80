"""Route: ranking from each pool's own tree and load, routed-but-not-cached prompts, reservations,
and the miss breakdown of first admissions. In-process, on a registry with a fake clock."""

from __future__ import annotations

import pytest

from cache_service.errors import InvalidArgument
from cache_service.page_hash import page_hashes
from cache_service.pool_registry import PoolRegistry
from cache_service.routing import RouteQuery, RouteWeights
from cache_service.schema import Admit, Finish, ReplicaLoad, StepInput
from tests.cache.conftest import ManualClock

BS = 4
PREFIX = list(range(100, 132))  # 8 pages


@pytest.fixture
def fleet():
    clock = ManualClock()
    registry = PoolRegistry(lease_seconds=30, clock=clock)
    for name in ("a", "b"):
        registry.register(name, 64, BS, "fp", 0, f"127.0.0.1:{ord(name)}")
    registry.register("other-model", 64, BS, "fp2", 0, "127.0.0.1:9")
    registry.register("no-addr", 64, BS, "fp", 0, "")
    yield registry, clock
    registry.check_integrity()


def cache_prompt(registry: PoolRegistry, pool_id: str, tokens: list[int], rid: str = "seed") -> None:
    pool = registry.pools[pool_id]
    pool.step(StepInput(admits=[Admit(rid, tokens)]))
    pool.step(StepInput(finishes=[Finish(rid, [], len(tokens))]))


def ranked(registry: PoolRegistry, tokens: list[int], **kw) -> list:
    return registry.route(RouteQuery(token_ids=tuple(tokens), model_fingerprint="fp", **kw)).candidates


def test_the_pool_holding_the_prefix_ranks_first_with_exact_counts(fleet) -> None:
    registry, _ = fleet
    cache_prompt(registry, "b", PREFIX)
    prompt = PREFIX + [7, 8, 9]
    best, second = ranked(registry, prompt)  # no-addr and other-model are not candidates
    assert (best.pool_id, best.serving_addr) == ("b", "127.0.0.1:98")
    assert best.matched_tokens == 32 and best.prefill_tokens == 3
    assert second.pool_id == "a" and second.matched_tokens == 0 and second.prefill_tokens == 35
    assert best.score == 2 * 3 and second.score == 2 * 35  # no load: only the prefill term


def test_load_reported_in_step_and_heartbeat_enters_the_score(fleet) -> None:
    registry, _ = fleet
    cache_prompt(registry, "b", PREFIX)
    pool_b = registry.pools["b"]
    pool_b.step(StepInput(load=ReplicaLoad(3, 500, 2)))
    best = ranked(registry, PREFIX + [1])[0]
    assert best.pool_id == "a"  # 2*33 < 2*1 + 500 + 16*2
    registry.heartbeat("b", pool_b.epoch, ReplicaLoad(0, 0, 0))
    assert ranked(registry, PREFIX + [1])[0].pool_id == "b"
    weights = RouteWeights(prefill_weight=1, queue_weight=1, running_weight=1000)
    registry.heartbeat("b", pool_b.epoch, ReplicaLoad(0, 0, 1))
    assert ranked(registry, PREFIX + [1], weights=weights)[0].pool_id == "a"


def test_a_burst_sharing_a_new_prefix_follows_the_first_routing_decision(fleet) -> None:
    registry, _ = fleet
    first = ranked(registry, PREFIX + [1], request_id="r1")[0]
    again = ranked(registry, PREFIX + [2], request_id="r2")[0]
    assert again.pool_id == first.pool_id and again.routed_prefix_tokens == 32 and again.prefill_tokens == 1
    other = ranked(registry, list(range(500, 532)) + [3], request_id="r3")[0]
    assert other.pool_id != first.pool_id  # the first pool has work queued now
    # Admission moves the request from queued to running; its commit/finish ends the promise.
    pool = registry.pools[first.pool_id]
    assert pool.routing.routed.queued_tokens == 33 + 1
    pool.step(StepInput(admits=[Admit("r1", PREFIX + [1])]))
    assert pool.routing.routed.queued_tokens == 1
    pool.step(StepInput(finishes=[Finish("r1", [], 33)]))
    assert len(pool.routing.routed) == 1  # r2 is still on its way
    assert ranked(registry, PREFIX + [4], dry_run=True)[0].matched_tokens == 32  # now really cached


def test_routed_requests_are_forgotten_after_their_ttl(fleet) -> None:
    registry, clock = fleet
    chosen = ranked(registry, PREFIX + [1], request_id="lost")[0].pool_id
    assert registry.pools[chosen].routing.routed.queued_tokens == 33
    clock.now += 31
    registry.expire_routed()
    assert len(registry.pools[chosen].routing.routed) == 0 and registry.pools[chosen].routing.routed.queued_tokens == 0


def test_a_reservation_pins_the_prefix_until_admission(fleet) -> None:
    registry, _ = fleet
    cache_prompt(registry, "b", PREFIX)
    pool = registry.pools["b"]
    best = ranked(registry, PREFIX + [5], request_id="r", reserve_ms=5000)[0]
    assert best.pool_id == "b" and best.reserved
    assert pool.stats().num_reservations == 1 and pool.tree.protected_size == 8
    assert pool.evict(100) == 0  # pinned: nothing evictable
    (adm,) = pool.step(StepInput(admits=[Admit("r", PREFIX + [5])])).admits
    assert adm.cached_tokens == 32
    assert pool.stats().num_reservations == 0 and pool.tree.protected_size == 8  # the request's own lock
    pool.step(StepInput(finishes=[Finish("r", [], 33)]))
    assert pool.tree.protected_size == 0


def test_a_reservation_expires_by_itself(fleet) -> None:
    registry, clock = fleet
    cache_prompt(registry, "b", PREFIX)
    pool = registry.pools["b"]
    assert ranked(registry, PREFIX + [5], request_id="r", reserve_ms=200)[0].reserved
    clock.now += 0.1
    registry.expire_routed()
    assert pool.tree.protected_size == 8
    clock.now += 0.2
    registry.expire_routed()
    assert pool.tree.protected_size == 0 and pool.stats().num_reservations == 0
    assert pool.evict(100) == 8


def test_a_retired_pool_drops_its_pins(fleet) -> None:
    registry, clock = fleet
    cache_prompt(registry, "b", PREFIX)
    ranked(registry, PREFIX + [5], request_id="r", reserve_ms=60_000)
    clock.now += 31
    assert "b" in registry.expire_leases()
    assert ranked(registry, PREFIX + [5], dry_run=True) == []  # every lease ran out


def test_route_by_page_hash_chain_equals_route_by_tokens(fleet) -> None:
    registry, _ = fleet
    cache_prompt(registry, "a", PREFIX)
    hashes = tuple(page_hashes(0, "", PREFIX + [1, 2, 3, 4], BS))
    by_hash = registry.route(RouteQuery(page_hashes=hashes, model_fingerprint="fp", dry_run=True)).candidates
    assert by_hash[0].pool_id == "a" and by_hash[0].matched_tokens == 32 and by_hash[0].prefill_tokens == 4
    assert ranked(registry, PREFIX + [1], namespace="tenant")[0].matched_tokens == 0  # salts keep apart


@pytest.mark.parametrize("query, message", [
    (RouteQuery(), "either token_ids or page_hashes"),
    (RouteQuery(token_ids=(1,), page_hashes=(2,)), "either token_ids or page_hashes"),
    (RouteQuery(token_ids=(1,), reserve_ms=10), "needs the request_id"),
    (RouteQuery(token_ids=(1,), reserve_ms=60_001, request_id="x"), "reserve_ms must be"),
])
def test_bad_route_queries_are_invalid(fleet, query, message) -> None:
    registry, _ = fleet
    with pytest.raises(InvalidArgument, match=message):
        registry.route(query)


# ---------------------------------------------------------------------- miss reasons


def admit_miss(registry: PoolRegistry, pool_id: str, rid: str, tokens: list[int], namespace: str = ""):
    (adm,) = registry.pools[pool_id].step(StepInput(admits=[Admit(rid, tokens, namespace)])).admits
    assert adm.admitted
    assert sum(adm.miss) == len(tokens) - adm.cached_tokens
    return adm.miss


def test_miss_reasons_name_evicted_other_replica_and_new(fleet) -> None:
    registry, _ = fleet
    new = admit_miss(registry, "a", "n", PREFIX + [1])
    assert new.new_tokens == 33 and new.evicted_tokens == new.other_replica_tokens == 0
    registry.pools["a"].step(StepInput(finishes=[Finish("n", [], 33)]))
    elsewhere = admit_miss(registry, "b", "x", PREFIX + [1, 2])
    assert (elsewhere.other_replica_tokens, elsewhere.new_tokens) == (32, 2)
    # Another namespace's copy (here, on both pools) is new to the caller: only the operator's
    # aggregated counter knows of it.
    salted = admit_miss(registry, "a", "s", PREFIX + [1, 2], namespace="tenant")
    assert salted == (0, 0, 34)
    assert registry.pools["a"].miss_other_namespace_tokens == 32
    registry.pools["a"].step(StepInput(releases=[Finish("s", [], 0)]))
    registry.pools["b"].step(StepInput(releases=[Finish("x", [], 0)]))
    pool = registry.pools["a"]
    pool.evict(100)
    # Remembered evicted pages are per namespace: another namespace's evicted copy is new too.
    other = admit_miss(registry, "a", "t", PREFIX + [1, 2, 3], namespace="tenant")
    assert other == (0, 0, 35)
    pool.step(StepInput(releases=[Finish("t", [], 0)]))
    again = admit_miss(registry, "a", "e", PREFIX + [1, 2, 3])
    assert (again.evicted_tokens, again.new_tokens) == (32, 3)
    pool.step(StepInput(releases=[Finish("e", [], 0)]))  # preempted, then resumed
    (adm,) = pool.step(StepInput(admits=[Admit("e", PREFIX + [1, 2, 3], "", 0, True)])).admits
    assert adm.miss is None  # resumed admissions carry no breakdown
    assert pool.stats().num_remembered_evicted_pages >= 8


def test_a_route_larger_than_every_live_pool_is_refused_though_a_lapsed_one_is_larger() -> None:
    """The size limit is the largest live pool's: a pool whose lease ran out (not yet retired)
    does not raise it, in Route and in the registry's check before the prompt is copied."""
    clock = ManualClock()
    registry = PoolRegistry(lease_seconds=30, clock=clock)
    registry.register("big", 64, BS, "fp", 0, "127.0.0.1:1")
    clock.now += 20
    registry.register("small", 8, BS, "fp", 0, "127.0.0.1:2")
    prompt = tuple(range(40))  # 40 tokens: more than small's 32, less than big's 256
    assert ranked(registry, list(prompt), dry_run=True)[0].pool_id == "big"
    registry.check_route_size("fp", len(prompt), 0)
    clock.now += 15  # big's lease ran out; small's runs
    with pytest.raises(InvalidArgument, match="at most 32 token ids"):
        registry.route(RouteQuery(token_ids=prompt, model_fingerprint="fp", dry_run=True))
    registry.check_route_size("fp", len(prompt), 0)  # within the lapsed pool: left to Route
    with pytest.raises(InvalidArgument, match="at most 32 token ids"):
        registry.check_route_size("fp", 257, 0)  # larger than every pool: refused before the copy, as Route would
    assert [c.pool_id for c in ranked(registry, list(range(20)), dry_run=True)] == ["small"]


def test_the_miss_breakdown_matches_each_pools_own_tree_in_random_fleets() -> None:
    """Evicted here, then held by another live pool, then new: checked against the pools' trees
    and the pool's evicted pages directly, after random caching, eviction and lapsed leases."""
    import random

    from common.token_bytes import encode_tokens
    rng = random.Random(5)
    clock = ManualClock()
    registry = PoolRegistry(lease_seconds=30, clock=clock)
    for name in "abcd":
        registry.register(name, 20, BS, "fp", 0, f"127.0.0.1:{ord(name)}")
    stems = [[rng.randrange(500) for _ in range(48)] for _ in range(3)]
    seen = [0, 0]  # admissions with evicted, with other-replica pages
    for i in range(150):
        pool = registry.pools[rng.choice("abcd")]
        prompt = rng.choice(stems)[: rng.randrange(1, 49)] + [rng.randrange(500) for _ in range(rng.randrange(1, 9))]
        if i == 90:
            registry.pools["d"].lease_deadline = clock.now  # lapsed: its pages explain nothing
        key = encode_tokens(prompt)
        cacheable = (len(prompt) - 1) // BS
        chain = page_hashes(0, "", key[: cacheable * BS * 4], BS)
        others = [p for p in registry.pools.values() if p is not pool and clock.now < p.lease_deadline]
        held_elsewhere = max((p.tree.peek_key(key[: cacheable * BS * 4]) // BS for p in others), default=0)
        (adm,) = pool.step(StepInput(admits=[Admit(f"r{i}", prompt)])).admits
        if not adm.admitted:
            continue
        cached = adm.cached_tokens // BS
        run = 0
        while cached + run < cacheable and chain[cached + run] in pool.evicted_pages:  # as of the admission
            run += 1
        other = max(0, held_elsewhere - cached - run)
        assert (adm.miss.evicted_tokens, adm.miss.other_replica_tokens) == (run * BS, other * BS), i
        seen[0] += run > 0
        seen[1] += other > 0
        pool.step(StepInput(finishes=[Finish(f"r{i}", [], len(prompt))]))
        clock.now += 0.1
    assert min(seen) >= 5, seen
    registry.check_integrity()
