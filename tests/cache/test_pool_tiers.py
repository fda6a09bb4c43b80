"""Pool with lower tiers (cache_service/tiers/): copies down on eviction / write-through, loads on
admission, outcomes, ordering, namespaces, accounting. Every pool is a CheckedPool (integrity,
tiers included, after every call)."""

from __future__ import annotations

import pytest

from cache_service.errors import InvalidArgument
from cache_service.events import BlockRemoved, BlockStored, EventLog
from cache_service.schema import Admit, CopyOutcome, DiskRun, Finish, StepInput, TierSpec
from cache_service.tiers.lower_tier import TIER_DEVICE, TIER_DISK, TIER_HOST
from common.token_bytes import encode_tokens
from tests.cache.conftest import CheckedPool

BS = 4


def make(num_blocks=8, host=0, disk=0, policy="evict", runs=(), events=None) -> CheckedPool:
    pool = CheckedPool("p", 1, num_blocks, BS, "fp", 1000, events,
                       tiers=TierSpec(host, disk, policy, list(runs)))
    if pool.tiers is not None:
        pool.tiers.restore_disk(list(runs), 1000)
    return pool


def step(pool, admits=(), finishes=(), outcomes=()):
    return pool.step(StepInput(admits=list(admits), finishes=list(finishes), copy_outcomes=list(outcomes)))


def run(pool, rid, tokens, namespace="", outcomes=()):
    """Admit and finish `tokens` fully computed; returns (admit result, step results)."""
    first = step(pool, [Admit(rid, tokens, namespace)], outcomes=outcomes)
    (adm,) = first.admits
    assert adm.admitted
    second = step(pool, finishes=[Finish(rid, [], len(tokens))], outcomes=done(first.offloads))
    return adm, first, second


def done(copies, pages=None):
    return [CopyOutcome(c.copy_id, len(c.src) if pages is None else pages) for c in copies]


def prompt(seed, n=12):
    return [seed * 100 + i for i in range(n)]


def test_evicted_pages_are_copied_down_and_loaded_back() -> None:
    pool = make(num_blocks=6, host=8)
    a = prompt(1, 13)  # 3 whole pages cached after the finish
    adm_a, _, fin = run(pool, "a", a)
    assert fin.offloads == []  # evict policy: nothing copied while the device holds it
    # b needs 4 fresh blocks: 1 free + ... -> a's pages are evicted and copied to the host tier first
    b = prompt(2, 16)
    res = step(pool, [Admit("b", b)], outcomes=[])
    (adm_b,) = res.admits
    assert adm_b.admitted and res.num_evicted_blocks >= 1
    offloads = res.offloads
    assert offloads and all(c.src_tier == TIER_DEVICE and c.dst_tier == TIER_HOST for c in offloads)
    copied = [b_ for c in offloads for b_ in c.src]
    assert set(copied) <= set(adm_a.block_table[:3])
    host = pool.tiers.host
    assert host.num_pending == len(copied) and host.tree.total_size == 0  # not held before its outcome
    # the host tier holds them once reported; a's re-admission loads them into fresh blocks
    step(pool, finishes=[Finish("b", [], 16)], outcomes=done(offloads))
    assert host.tree.total_size == len(copied) and host.num_pending == 0
    res = step(pool, [Admit("a2", a)])
    (adm,) = res.admits
    device = adm.cached_tokens // BS
    assert adm.loads, "a host-tier hit"
    (load,) = adm.loads
    assert load.src_tier == TIER_HOST and load.dst_tier == TIER_DEVICE
    assert load.dst == adm.block_table[device:device + len(load.src)]
    assert device + len(load.src) == 3  # every cacheable page of a: device hit + host loads
    assert pool.tiers.host.counters.hit_tokens == len(load.src) * BS


def test_reused_block_is_copied_before_the_reply_hands_it_out() -> None:
    """The offload reading an evicted block is in the same reply that gives the block to another request
    (the replica performs offloads first)."""
    pool = make(num_blocks=4, host=8)
    adm_a, _, _ = run(pool, "a", prompt(1, 13))
    res = step(pool, [Admit("b", prompt(2, 15))])
    (adm_b,) = res.admits
    reused = set(adm_b.block_table) & set(adm_a.block_table[:3])
    assert reused
    copied = {b for c in res.offloads for b in c.src}
    assert reused <= copied


def test_failed_copy_loses_only_its_pages() -> None:
    pool = make(num_blocks=4, host=8)
    run(pool, "a", prompt(1, 13))
    res = step(pool, [Admit("b", prompt(2, 15))])
    (copy,) = res.offloads
    step(pool, finishes=[Finish("b", [], 15)], outcomes=[CopyOutcome(copy.copy_id, 1)])
    host = pool.tiers.host
    assert host.tree.total_size == 1 and host.counters.num_failed_pages == len(copy.src) - 1
    assert host.allocator.num_free_blocks == 8 - 1


def test_outcomes_checked() -> None:
    pool = make(num_blocks=4, host=8)
    run(pool, "a", prompt(1, 13))
    res = step(pool, [Admit("b", prompt(2, 15))])
    (copy,) = res.offloads
    with pytest.raises(InvalidArgument, match="exceeds"):
        step(pool, outcomes=[CopyOutcome(copy.copy_id, 99)])
    with pytest.raises(InvalidArgument, match="more than once"):
        step(pool, outcomes=[CopyOutcome(copy.copy_id, 1), CopyOutcome(copy.copy_id, 1)])
    step(pool, outcomes=[CopyOutcome(12345, 1)])  # not waited for: changes nothing
    no_tiers = make()
    with pytest.raises(InvalidArgument, match="without lower tiers"):
        step(no_tiers, outcomes=[CopyOutcome(1, 1)])


def test_write_through_copies_as_cached() -> None:
    pool = make(num_blocks=8, host=8, policy="write-through")
    _, _, fin = run(pool, "a", prompt(1, 13))
    assert [len(c.src) for c in fin.offloads] == [3]
    step(pool, outcomes=done(fin.offloads))
    assert pool.tiers.host.tree.total_size == 3
    # evicting it later copies nothing more
    res = step(pool, [Admit("b", prompt(2, 29))])
    assert res.num_evicted_blocks and not res.offloads


def test_host_evicts_to_disk_then_disk_hit() -> None:
    pool = make(num_blocks=4, host=3, disk=16)
    run(pool, "a", prompt(1, 13))
    res = step(pool, [Admit("b", prompt(2, 13))])
    step(pool, finishes=[Finish("b", [], 13)], outcomes=done(res.offloads))
    assert pool.tiers.host.tree.total_size == 3
    # c evicts b from the device -> host; the host is full of a: a goes host -> disk, first in the list
    res = step(pool, [Admit("c", prompt(3, 13))])
    kinds = [(c.src_tier, c.dst_tier) for c in res.offloads]
    assert kinds == [(TIER_HOST, TIER_DISK), (TIER_DEVICE, TIER_HOST)]
    to_disk = res.offloads[0]
    assert to_disk.namespace == "" and len(to_disk.page_hashes) == len(to_disk.src)
    assert to_disk.token_bytes == encode_tokens(prompt(1, 12))[: len(to_disk.src) * BS * 4]
    assert set(to_disk.src) & set(res.offloads[1].dst)  # host slots reused after their copy to disk
    step(pool, finishes=[Finish("c", [], 13)], outcomes=done(res.offloads))
    res = step(pool, [Admit("a2", prompt(1, 13))])
    (adm,) = res.admits
    assert [(c.src_tier, len(c.src)) for c in adm.loads] == [(TIER_DISK, 3)]
    assert adm.loads[0].page_hashes == to_disk.page_hashes


def test_tiers_never_share_across_namespaces() -> None:
    pool = make(num_blocks=4, host=8)
    run(pool, "a", prompt(1, 13), namespace="t1")
    res = step(pool, [Admit("b", prompt(2, 15), "t2")])
    step(pool, finishes=[Finish("b", [], 15)], outcomes=done(res.offloads))
    (adm,) = step(pool, [Admit("x", prompt(1, 13), "t2")]).admits
    assert adm.cached_tokens == 0 and not adm.loads
    step(pool, finishes=[Finish("x", [], 0)])
    (adm,) = step(pool, [Admit("y", prompt(1, 13), "t1")]).admits
    assert adm.loads


def test_disk_runs_restore_and_validate() -> None:
    tokens = encode_tokens(prompt(1, 8))
    pool = make(num_blocks=4, disk=8, runs=[DiskRun("", tokens, [5, 2])])
    assert pool.tiers.disk.tree.total_size == 2
    (adm,) = step(pool, [Admit("a", prompt(1, 9))]).admits
    assert [(c.src_tier, c.src) for c in adm.loads] == [(TIER_DISK, [5, 2])]
    # runs sharing their leading pages name the same slots for them
    shared = make(num_blocks=4, disk=8, runs=[DiskRun("", tokens, [5, 2]),
                                              DiskRun("", encode_tokens(prompt(1, 4) + prompt(7, 4)), [5, 6])])
    assert shared.tiers.disk.tree.total_size == 3
    for runs, why in (([DiskRun("", tokens, [5])], "one slot per whole page"),
                      ([DiskRun("", tokens, [5, 9])], "out of range"),
                      ([DiskRun("", tokens, [1, 2]), DiskRun("x", tokens, [2, 3])], "two different pages"),
                      ([DiskRun("", tokens, [1, 2]), DiskRun("", encode_tokens(prompt(1, 4)), [3])],
                       "two different pages")):
        with pytest.raises(InvalidArgument, match=why):
            make(num_blocks=4, disk=8, runs=runs)


def test_events_carry_the_tier() -> None:
    events = EventLog()
    pool = make(num_blocks=4, host=3, events=events)
    run(pool, "a", prompt(1, 13))
    res = step(pool, [Admit("b", prompt(2, 13))])
    step(pool, finishes=[Finish("b", [], 13)], outcomes=done(res.offloads))
    res = step(pool, [Admit("c", prompt(3, 13))])  # host full: a leaves the host tier (no disk: dropped)
    step(pool, outcomes=done(res.offloads))
    payloads = [e.payload for e in events.replay(1)]
    assert any(isinstance(p, BlockStored) and p.tier == TIER_HOST for p in payloads)
    assert any(isinstance(p, BlockRemoved) and p.tier == TIER_HOST for p in payloads)
    assert any(isinstance(p, BlockRemoved) and p.tier == TIER_DEVICE for p in payloads)


def test_reattach_drops_pending_copies() -> None:
    pool = make(num_blocks=4, host=8)
    run(pool, "a", prompt(1, 13))
    res = step(pool, [Admit("b", prompt(2, 15))])
    assert pool.tiers.host.num_pending
    pool.tiers.drop_pending()
    pool.check_integrity()
    assert pool.tiers.host.num_pending == 0 and pool.tiers.host.allocator.num_free_blocks == 8
    step(pool, outcomes=done(res.offloads))  # a late report changes nothing
    assert pool.tiers.host.tree.total_size == 0


def test_tier_slots_count_against_the_memory_cap() -> None:
    from cache_service.errors import ResourceExhausted
    from cache_service.pool_registry import PoolRegistry
    from cache_service.registry_limits import RegistryLimits, pool_memory_bytes

    limits = RegistryLimits(max_memory_bytes=pool_memory_bytes(1000, BS))
    registry = PoolRegistry(limits=limits)
    registry.register_replica("a", 400, BS, tiers=TierSpec(num_host_slots=400))  # 800 pages: fits
    with pytest.raises(ResourceExhausted, match="memory"):
        registry.register_replica("b", 100, BS, tiers=TierSpec(num_disk_slots=200))  # 300 more: does not
    registry.register_replica("b", 100, BS)


def test_route_prices_tier_hits_between_a_device_hit_and_a_miss() -> None:
    from cache_service.pool_registry import PoolRegistry
    from cache_service.routing import RouteQuery
    from cache_service.schema import ReplicaLoad

    registry = PoolRegistry()
    tiers = TierSpec(num_host_slots=16)
    for name in ("device", "host", "miss"):
        registry.register_replica(name, 8, BS, "fp", 1000, f"127.0.0.1:{len(name)}", tiers=tiers)
    long = prompt(1, 21)  # 5 cacheable pages
    for name in ("device", "host"):
        pool = registry.pools[name]
        step(pool, [Admit("a", long)])
        step(pool, finishes=[Finish("a", [], 21)])
    host = registry.pools["host"]  # flood its device pool: the prompt goes to its host tier
    res = step(host, [Admit("b", prompt(2, 29))])
    step(host, finishes=[Finish("b", [], 0)], outcomes=done(res.offloads))
    host.step(StepInput(load=ReplicaLoad(host_load_cost=0.1)))
    by_name = {c.pool_id: c for c in registry.route(RouteQuery(token_ids=tuple(long), model_fingerprint="fp")).candidates}
    assert [c.pool_id for c in registry.route(RouteQuery(token_ids=tuple(long), model_fingerprint="fp")).candidates] == [
        "device", "host", "miss"]
    assert by_name["host"].matched_tokens == 0 and by_name["host"].matched_host_tokens == 20
    assert by_name["host"].prefill_tokens == 1
    assert by_name["host"].score == pytest.approx(2 * (1 + 20 * 0.1) + 16 * 0)
    assert by_name["miss"].prefill_tokens == 21
    # a tier measured slower than computing is neither loaded from nor priced as a hit
    host.step(StepInput(load=ReplicaLoad(host_load_cost=1.5)))
    assert registry.route(RouteQuery(token_ids=tuple(long), model_fingerprint="fp")).candidates[1].matched_host_tokens == 0
    (adm,) = step(host, [Admit("c", long)]).admits
    assert adm.admitted and not adm.loads


def test_a_failed_load_drops_the_bad_pages_and_the_recomputed_ones_are_copied_down_again() -> None:
    p = prompt(1, 21)  # 5 cacheable pages, all on disk
    pool = make(num_blocks=12, disk=8, runs=[DiskRun("", encode_tokens(p[:20]), [0, 1, 2, 3, 4])])
    (adm,) = step(pool, [Admit("a", p)]).admits
    (load,) = adm.loads
    assert len(load.src) == 5
    # the replica found the third page corrupt: two loaded, the rest recomputed and finished
    step(pool, finishes=[Finish("a", [], len(p))], outcomes=[CopyOutcome(load.copy_id, 2)])
    disk = pool.tiers.disk
    assert disk.tree.total_size == 2 and disk.counters.num_failed_pages == 3
    assert disk.allocator.num_free_blocks == 6
    pool.clear()  # the device evicts the recomputed pages: they go down again
    res = step(pool, [])
    assert [(c.src_tier, c.dst_tier, len(c.src)) for c in res.offloads] == [(TIER_DEVICE, TIER_DISK, 3)]
    step(pool, outcomes=done(res.offloads))
    (adm,) = step(pool, [Admit("b", p)]).admits
    assert [len(c.src) for c in adm.loads] == [5]


def test_a_load_outcome_counts_only_in_the_next_step() -> None:
    p = prompt(1, 21)
    pool = make(num_blocks=12, disk=8, runs=[DiskRun("", encode_tokens(p[:20]), [0, 1, 2, 3, 4])])
    (adm,) = step(pool, [Admit("a", p)]).admits
    step(pool)
    step(pool, outcomes=[CopyOutcome(adm.loads[0].copy_id, 0)])  # too late: ignored
    assert pool.tiers.disk.tree.total_size == 5


def test_pages_a_copy_is_still_writing_are_not_copied_again() -> None:
    """A leaf's copy takes the pages before it that the tier lacks; a later copy through those
    pages, ordered before the first is reported, does not write them a second time: it extends
    the first and commits after it (outcomes come in copy order)."""
    pool = make(num_blocks=12, host=12)
    a = prompt(1, 8)
    run(pool, "a", a)  # node A: 2 pages
    run(pool, "b", a + prompt(2, 8))  # B below A: 2 more
    run(pool, "c", a + prompt(3, 8))  # C below A, B's sibling
    assert pool.evict(2) == 2  # the LRU leaf B: its copy takes A's pages too
    first = step(pool).offloads
    assert [len(c.src) for c in first] == [4]
    assert pool.evict(2) == 2  # C, while A + B is in flight: only C's own pages
    second = step(pool).offloads
    assert [len(c.src) for c in second] == [2]
    assert pool.evict(2) == 2  # A, in flight: nothing to copy
    assert step(pool).offloads == [] and pool.tiers.host.num_pending == 6
    step(pool, outcomes=done(first) + done(second))
    host = pool.tiers.host
    assert host.tree.total_size == 6 and host.num_pending == 0
    assert host.peek_pages(encode_tokens(a + prompt(3, 8)), "") == 4  # C after A: a whole prefix


def test_a_copy_extending_a_failed_one_is_dropped_whole() -> None:
    """When the copy whose pages a later copy skipped fails, the later one has no prefix to hang
    from: its pages are released, never held without the pages before them."""
    pool = make(num_blocks=12, host=12)
    a = prompt(1, 8)
    run(pool, "a", a)
    run(pool, "b", a + prompt(2, 8))
    run(pool, "c", a + prompt(3, 8))
    pool.evict(2)
    first = step(pool).offloads
    pool.evict(2)
    second = step(pool).offloads
    step(pool, outcomes=done(first, pages=0) + done(second))
    host = pool.tiers.host
    assert host.tree.total_size == 0 and host.num_pending == 0 and host.allocator.num_free_blocks == 12
