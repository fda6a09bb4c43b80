"""The model-wide page index (page_index.py, fleet_pages.py): one walk of a prompt's hash chain
gives every pool's cached and promised leading pages, as each pool's own tree and routed prompts
would; Route on a large fleet ranks only the pools likely best. Every test runs against the C core
(cache_service/native/page_ops.c) and the Python code, which must give the same answers."""

from __future__ import annotations

import random

import pytest

from cache_service import native, page_index, routing
from cache_service.page_hash import iter_page_hashes, page_hashes
from cache_service.page_index import PageIndex
from cache_service.pool_registry import PoolRegistry
from cache_service.routing import RouteQuery
from cache_service.schema import Admit, Extend, Finish, ReplicaLoad, StepInput
from common.token_bytes import encode_tokens
from tests.cache.conftest import ManualClock
from tests.native_required import SKIP_PREFIX

BS = 4


@pytest.fixture(autouse=True, params=["c", "python"])
def core(request, monkeypatch) -> str:
    """Which implementation every page index of the test uses (the registry's too)."""
    if request.param == "c":
        if native.page_ops() is None:
            pytest.skip(f"{SKIP_PREFIX}: the cache manager's C core ({native.unavailable_reason()})")
    else:
        monkeypatch.setattr(page_index.native, "page_ops", lambda: None)
    return request.param


def test_the_core_asked_for_runs(core) -> None:
    assert (PageIndex()._ops is not None) is (core == "c")


def test_a_fleet_of_many_holders_gives_what_the_python_loops_give(core) -> None:
    """Masks past 64 bits (two bits a pool: 48 pools are 96), random adds and removes, chains
    walked whole and lazily: both cores agree on every answer and every stored mask."""
    if core == "python":
        pytest.skip("compares the C core with the Python code")
    rng = random.Random(11)
    fast, slow = PageIndex(native_core=True), PageIndex(native_core=False)
    holders = [(fast.holder(), slow.holder()) for _ in range(100)]
    chains = [page_hashes(0, ns, [rng.randrange(50) for _ in range(24)] * 2, BS) for ns in ("", "t") for _ in range(6)]
    for _ in range(400):
        (f, s), chain = rng.choice(holders), rng.choice(chains)
        ns = rng.choice(("", "t"))
        cut = rng.randrange(len(chain) + 1)
        if rng.random() < 0.6:
            f.added(ns, iter(chain[:cut]))
            s.added(ns, chain[:cut])
        else:
            f.removed(ns, chain[cut:])
            s.removed(ns, iter(chain[cut:]))
        assert (f.num_pages, fast.snapshot()) == (s.num_pages, slow.snapshot())
        mask = rng.choice((-1, rng.getrandbits(200)))
        walk = rng.choice(chains)
        assert fast.depths(ns, iter(walk), mask) == slow.depths(ns, walk, mask)
    assert fast.depths("", iter(())) == slow.depths("", ()) == {}
    holders[0][0].added("", chains[0])
    holders[0][1].added("", chains[0])
    for index in (fast, slow):  # what is not a chain is refused alike
        with pytest.raises(TypeError):
            index.depths("", None)
        with pytest.raises(TypeError):
            index.depths("", chains[0], None)


def test_depths_follow_each_holders_leading_run_and_stop_where_nobody_holds() -> None:
    index = PageIndex()
    a, b, c = index.holder(), index.holder(), index.holder()
    chain = page_hashes(0, "", list(range(40)), BS)  # 10 pages
    a.added("", chain[:6])
    b.added("", chain[:2])
    c.added("", page_hashes(0, "", [9] * 8, BS))  # another prompt
    assert index.depths("", chain) == {a.bit: 6, b.bit: 2}
    assert index.depths("", chain, mask=b.bit | c.bit) == {b.bit: 2}
    assert index.depths("", iter(chain[:1])) == {a.bit: 1, b.bit: 1}
    assert index.depths("tenant", chain) == {}  # the same hashes read in another namespace
    a.removed("", chain[3:6])
    assert index.depths("", chain) == {a.bit: 3, b.bit: 2}


def test_a_released_holder_leaves_no_page_behind_and_its_bit_is_reused() -> None:
    index = PageIndex()
    a, b = index.holder(), index.holder()
    chain = page_hashes(0, "ns", list(range(16)), BS)
    a.added("ns", chain)
    b.added("ns", chain[:1])
    index.release(a)  # still holding pages: taken out of every page
    assert index.depths("ns", chain) == {b.bit: 1}
    b.removed("ns", chain[:1])
    index.release(b)  # empty: nothing to scan
    assert index.snapshot() == {}
    assert {index.holder().bit, index.holder().bit} == {a.bit, b.bit}


def _random_fleet(seed: int) -> tuple[PoolRegistry, ManualClock, list[list[int]]]:
    """Three pools of one model under random admits, finishes, extends (evicting), Routes that
    record, and one pool retired and registered again."""
    rng = random.Random(seed)
    clock = ManualClock()
    registry = PoolRegistry(lease_seconds=30, clock=clock)
    for name in ("a", "b", "c"):
        registry.register(name, 24, BS, "fp", 0, f"{name}:1")
    stems = [[rng.randrange(1000) for _ in range(12)] for _ in range(3)]
    prompts = [rng.choice(stems)[: rng.randrange(4, 13)] + [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
               for _ in range(30)]
    running: dict[str, tuple[str, list[int]]] = {}
    extended: set[str] = set()
    for i in range(120):
        pool = registry.pools[rng.choice(sorted(registry.pools))]
        op = rng.random()
        mine = [rid for rid, (p, _) in running.items() if p == pool.pool_id]
        if op < 0.4:
            prompt = rng.choice(prompts)
            rid = f"r{i}"
            if pool.step(StepInput(admits=[Admit(rid, prompt)])).admits[0].admitted:
                running[rid] = (pool.pool_id, prompt)
        elif op < 0.7 and mine:
            rid = rng.choice(mine)
            prompt = running.pop(rid)[1]
            computed = len(prompt) + (3 if rid in extended else 0)  # decoded into the extended blocks
            pool.step(StepInput(finishes=[Finish(rid, [7, 7, 7], computed)]))
        elif op < 0.8 and mine:
            rid = rng.choice(mine)
            result = pool.step(StepInput(extends=[Extend(rid, len(running[rid][1]) + 8)])).extends[0]
            if result.ok:
                extended.add(rid)
        elif op < 0.95:
            registry.route(RouteQuery(token_ids=tuple(rng.choice(prompts)), model_fingerprint="fp",
                                      request_id=f"q{i}", dry_run=rng.random() < 0.3))
        else:
            for rid in mine:
                del running[rid]
            registry.retire(pool.pool_id, "test")
            registry.register(pool.pool_id, 24, BS, "fp", 0, f"{pool.pool_id}:1")
        clock.now += 0.5
        registry.expire_routed()
    return registry, clock, prompts


@pytest.mark.parametrize("seed", range(8))
def test_the_index_answers_what_each_pools_tree_and_routed_prompts_say(seed: int) -> None:
    registry, _, prompts = _random_fleet(seed)
    registry.check_integrity()  # the index equals one rebuilt from the pools
    (model,) = registry.pages.of_model("fp")
    for prompt in prompts:
        key = encode_tokens(prompt[: (len(prompt) - 1) // BS * BS])
        chain = page_hashes(0, "", key, BS)
        held = model.held("", iter_page_hashes(0, "", key, BS))
        for pool in registry.pools.values():
            assert held.device.get(pool.pool_id, 0) == pool.tree.peek_key(key) // BS
            assert held.routed.get(pool.pool_id, 0) == pool.routing.routed.promised_pages("", chain)


def _big_fleet(n: int) -> PoolRegistry:
    registry = PoolRegistry(lease_seconds=30, clock=ManualClock())
    for i in range(n):
        pool = registry.register(f"p{i:02d}", 64, BS, "fp", 0, f"p{i}:1")
        pool.step(StepInput(load=ReplicaLoad(0, 100 + i, 4)))  # p00 is the least loaded
    return registry


def test_a_large_fleet_ranks_the_holders_the_promised_and_a_few_least_loaded() -> None:
    n = routing.FULL_RANK_POOLS + 10
    registry = _big_fleet(n)
    prefix = list(range(100, 132))
    holder = registry.pools["p20"]
    holder.step(StepInput(admits=[Admit("seed", prefix)]))
    holder.step(StepInput(finishes=[Finish("seed", [], len(prefix))]))
    other = list(range(500, 532))
    promised = registry.route(RouteQuery(token_ids=tuple(other + [1]), model_fingerprint="fp",
                                         request_id="burst-1")).candidates[0].pool_id
    ranked = registry.route(RouteQuery(token_ids=tuple(prefix + [1]), model_fingerprint="fp", dry_run=True)).candidates
    assert ranked[0].pool_id == "p20" and ranked[0].matched_tokens == 32
    least = [f"p{i:02d}" for i in range(routing.LEAST_LOADED_OTHERS + 1) if f"p{i:02d}" != promised]
    assert {c.pool_id for c in ranked} == {"p20", *least[: routing.LEAST_LOADED_OTHERS]}
    # A burst of the new prefix finds the pool it was routed to, however loaded.
    registry.pools[promised].step(StepInput(load=ReplicaLoad(0, 1000, 4)))
    follow = registry.route(RouteQuery(token_ids=tuple(other + [2]), model_fingerprint="fp", dry_run=True)).candidates
    assert promised in {c.pool_id for c in follow}
    assert next(c for c in follow if c.pool_id == promised).routed_prefix_tokens == 32


def test_a_large_fleet_picks_the_pool_ranking_everyone_would(monkeypatch) -> None:
    rng = random.Random(3)
    registry = _big_fleet(routing.FULL_RANK_POOLS + 12)
    stems = [list(range(s * 100, s * 100 + 24)) for s in range(6)]
    for i, pool in enumerate(registry.pools.values()):
        for j in range(rng.randrange(3)):
            prompt = rng.choice(stems)[: rng.randrange(4, 25)] + [i, j]
            pool.step(StepInput(admits=[Admit(f"s{j}", prompt)]))
            pool.step(StepInput(finishes=[Finish(f"s{j}", [], len(prompt))]))
        pool.step(StepInput(load=ReplicaLoad(0, rng.randrange(100), rng.randrange(8))))
    for stem in stems:
        query = RouteQuery(token_ids=tuple(stem + [1, 2, 3]), model_fingerprint="fp", dry_run=True)
        pruned = registry.route(query).candidates
        monkeypatch.setattr(routing, "FULL_RANK_POOLS", 1 << 20)
        everyone = registry.route(query).candidates
        monkeypatch.undo()
        assert len(everyone) == len(registry.pools) > len(pruned)
        assert pruned[0] == everyone[0]


def test_a_promise_whose_time_is_up_counts_for_nothing_in_the_route_that_finds_it() -> None:
    clock = ManualClock()
    registry = PoolRegistry(lease_seconds=300, clock=clock)
    for name in ("a", "b"):
        registry.register(name, 64, BS, "fp", 0, f"{name}:1")
    registry.pools["b"].step(StepInput(load=ReplicaLoad(0, 10_000, 0)))  # every decision goes to a
    old, new = list(range(100, 132)), list(range(500, 532))
    for rid, prompt in (("r1", old), ("r2", new)):
        routed = registry.route(RouteQuery(token_ids=tuple(prompt + [1]), model_fingerprint="fp", request_id=rid))
        assert routed.candidates[0].pool_id == "a"
        clock.now += 20
    clock.now += 1  # r1's 30 s are up, r2's are not; nobody called expire_routed
    again = registry.route(RouteQuery(token_ids=tuple(old + [2]), model_fingerprint="fp", dry_run=True))
    assert {c.pool_id: c.routed_prefix_tokens for c in again.candidates}["a"] == 0
    registry.check_integrity()


def test_routed_prompts_count_each_promised_page_once_in_both_cores(core) -> None:
    """A pool's routed prompts that share pages promise each page once (the index hears of a page
    when the first prompt promises it and when the last one goes), counted in C or in Python."""
    from cache_service.routed import RoutedRequest, RoutedRequests

    heard: list[tuple[str, str, list[int]]] = []

    class Listener:
        def added(self, namespace, hashes):
            heard.append(("added", namespace, list(hashes)))

        def removed(self, namespace, hashes):
            heard.append(("removed", namespace, list(hashes)))

    routed = RoutedRequests(max_entries=8, max_pages=64)
    assert (routed._ops is not None) is (core == "c")
    routed.set_listener(Listener())
    routed.add(RoutedRequest("a", "", [1, 2, 3], 10, 100.0))
    routed.add(RoutedRequest("b", "", [1, 2, 4], 10, 100.0))
    routed.add(RoutedRequest("c", "t", [1], 10, 100.0))
    assert routed.promised_pages("", [1, 2, 4]) == 3 and routed.promised_pages("t", [1, 2]) == 1
    routed.drop("", "a")
    routed.drop("", "b")
    routed.drop("t", "c")
    assert heard == [("added", "", [1, 2, 3]), ("added", "", [4]), ("added", "t", [1]),
                     ("removed", "", [3]), ("removed", "", [1, 2, 4]), ("removed", "t", [1])]
    assert routed.num_pages == 0 and routed.queued_tokens == 0 and routed.promised_pages("", [1]) == 0


def test_the_least_loaded_first_answer_is_the_full_rankings_head(monkeypatch) -> None:
    """Route with max_candidates over a group of plain pools reads pools from the least loaded up
    and stops early; its answer must be the first k of ranking every pool, whatever the loads,
    the cached and promised prefixes, lapsed leases, pools without an address and full pools."""
    monkeypatch.setattr(routing, "FULL_RANK_POOLS", 1 << 20)  # the reference ranks every pool
    rng = random.Random(7)
    clock = ManualClock()
    registry = PoolRegistry(lease_seconds=30, clock=clock)
    stems = [[rng.randrange(1000) for _ in range(40)] for _ in range(4)]
    for i in range(40):
        addr = "" if i % 13 == 5 else f"p{i}:1"
        pool = registry.register(f"p{i:02d}", rng.choice((12, 64)), BS, "fp", 0, addr)
        for j in range(rng.randrange(4)):
            prompt = rng.choice(stems)[: rng.randrange(4, 41)] + [i, j]
            if pool.step(StepInput(admits=[Admit(f"s{j}", prompt)])).admits[0].admitted:
                pool.step(StepInput(finishes=[Finish(f"s{j}", [], len(prompt))]))
    lapsed = registry.pools["p07"]
    for step in range(60):
        clock.now += 0.4
        if step == 20:
            lapsed.lease_deadline = clock.now  # lapsed, not yet retired
        for pool in rng.sample(sorted(registry.pools.values(), key=lambda p: p.pool_id), 8):
            pool.step(StepInput(load=ReplicaLoad(0, rng.choice((0, 50, 50, 400)), rng.randrange(3))))
        prompt = tuple(rng.choice(stems)[: rng.randrange(4, 41)] + [rng.randrange(1000) for _ in range(5)])
        if rng.random() < 0.5:  # a recorded Route: a promise, routed tokens and a pin move the order
            registry.route(RouteQuery(token_ids=prompt, model_fingerprint="fp", request_id=f"q{step}",
                                      reserve_ms=rng.choice((0, 500)), max_candidates=rng.choice((0, 2))))
        for k in (1, 3, 8):
            fast = registry.route(RouteQuery(token_ids=prompt, model_fingerprint="fp", dry_run=True, max_candidates=k))
            full = registry.route(RouteQuery(token_ids=prompt, model_fingerprint="fp", dry_run=True))
            assert fast.candidates == full.candidates[:k]
            assert fast.num_prompt_pages == full.num_prompt_pages
        registry.check_integrity()  # the load order among the rest


def test_a_large_namespace_is_split_into_shards_and_answers_the_same(core) -> None:
    """Past SPLIT_PAGES pages a namespace's dict becomes SHARDS dicts (a dict's rebuild under churn
    is a pause of its size); depths, removal, snapshot and emptying work across the split; a small
    namespace keeps one dict."""
    rng = random.Random(5)
    index = PageIndex()
    a, b = index.holder(), index.holder()
    chain = page_hashes(0, "big", list(range(400)), BS)  # 100 pages
    filler = [rng.getrandbits(64) for _ in range(page_index.SPLIT_PAGES)]
    a.added("small", chain[:3])
    a.added("big", chain)
    assert not index.is_split("big")
    a.added("big", filler)
    assert index.is_split("big") and not index.is_split("small")
    b.added("big", chain[:50])
    assert index.depths("big", chain) == {a.bit: 100, b.bit: 50}
    assert index.depths("big", iter(chain), mask=b.bit) == {b.bit: 50}
    assert index.depths("small", chain) == {a.bit: 3}
    snap = index.snapshot()["big"]
    assert len(snap) == 100 + len(filler) and snap[chain[0]] == a.bit | b.bit and snap[chain[99]] == a.bit
    a.removed("big", filler + chain)
    assert index.is_split("big") and index.depths("big", chain) == {b.bit: 50}
    b.removed("big", chain[:50])
    assert "big" not in index.snapshot() and a.num_pages == 3 and b.num_pages == 0
