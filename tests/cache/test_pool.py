"""Pool: Step semantics (admit / extend / finish / release), accounting, and bad input.

Every pool here is a CheckedPool: check_integrity() runs after every call, failed or not.
"""

from __future__ import annotations

import gc

import pytest

from cache_service.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from cache_service.events import AllCleared, BlockRemoved, BlockStored, EventLog
from cache_service.schema import Admit, Commit, Extend, Finish, StepInput


def admit(pool, rid, tokens, namespace="", lookahead=0):
    (result,) = pool.step(StepInput(admits=[Admit(rid, tokens, namespace, lookahead)])).admits
    return result


def finish(pool, rid, computed, output=(), release=False):
    item = Finish(rid, list(output), computed)
    return pool.step(StepInput(releases=[item]) if release else StepInput(finishes=[item]))


def test_page_alignment_20_tokens_cache_one_page(make_pool) -> None:
    pool = make_pool(num_blocks=8, block_size=16)
    prompt = list(range(20))
    first = admit(pool, "a", prompt)
    assert first.admitted and first.cached_tokens == 0 and len(first.block_table) == 2
    finish(pool, "a", computed=20)
    stats = pool.stats()
    assert stats.num_cached_blocks == 1 and stats.num_free_blocks == 7  # the partial page was freed
    second = admit(pool, "b", prompt)
    assert second.cached_tokens == 16 and second.block_table[0] == first.block_table[0]


def test_at_least_one_prompt_token_is_recomputed(make_pool) -> None:
    pool = make_pool(num_blocks=8, block_size=4)
    prompt = list(range(8))  # exactly two pages
    admit(pool, "a", prompt)
    finish(pool, "a", computed=8)
    assert pool.stats().num_cached_blocks == 2
    again = admit(pool, "b", prompt)
    assert again.cached_tokens == 4  # not 8: the last page is recomputed so logits exist
    longer = admit(pool, "c", prompt + [99])
    assert longer.cached_tokens == 8


def test_two_requests_share_a_prefix(make_pool) -> None:
    pool = make_pool(num_blocks=16, block_size=4)
    admit(pool, "a", list(range(12)))
    finish(pool, "a", computed=12)
    results = pool.step(
        StepInput(admits=[Admit("b", list(range(8)) + [50, 51, 52]), Admit("c", list(range(12)) + [60])])
    ).admits
    b, c = results
    assert b.cached_tokens == 8 and c.cached_tokens == 12
    assert b.block_table[:2] == c.block_table[:2]
    stats = pool.stats()
    assert stats.num_locked_blocks == 3 and stats.num_running_requests == 2
    assert stats.hit_tokens == 20 and stats.queried_tokens == 12 + 11 + 13


def test_duplicates_freed_on_insert(make_pool) -> None:
    pool = make_pool(num_blocks=16, block_size=4)
    prompt = list(range(9))
    a = admit(pool, "a", prompt)
    b = admit(pool, "b", prompt)  # both miss: a has not finished yet
    assert b.cached_tokens == 0 and set(a.block_table).isdisjoint(b.block_table)
    finish(pool, "a", computed=9)
    finish(pool, "b", computed=9)  # b's two full pages are duplicates of a's
    stats = pool.stats()
    assert stats.num_cached_blocks == 2 and stats.num_free_blocks == 14
    assert pool.match(prompt).block_ids == a.block_table[:2]


def test_matched_pages_are_not_freed_as_duplicates(make_pool) -> None:
    pool = make_pool(num_blocks=16, block_size=4)
    admit(pool, "a", list(range(8)))
    finish(pool, "a", computed=8)
    b = admit(pool, "b", list(range(8)) + [8, 9, 10, 11, 12])
    assert b.cached_tokens == 8
    finish(pool, "b", computed=13, output=[13, 14])  # computed 13 of 15 tokens -> 3 full pages
    stats = pool.stats()
    assert stats.num_cached_blocks == 3 and stats.num_private_blocks == 0
    assert pool.match(list(range(13))).block_ids == b.block_table[:3]


def test_output_tokens_are_cached_on_finish(make_pool) -> None:
    pool = make_pool(num_blocks=16, block_size=4)
    admit(pool, "a", [1, 2, 3], lookahead=5)
    assert len(pool.requests["a"].block_table) == 2
    finish(pool, "a", computed=8, output=[4, 5, 6, 7, 8])
    assert pool.match([1, 2, 3, 4, 5, 6, 7, 8]).matched_tokens == 8


def test_released_request_hits_its_own_pages_when_readmitted(make_pool) -> None:
    pool = make_pool(num_blocks=8, block_size=4)
    first = admit(pool, "a", list(range(10)))
    finish(pool, "a", computed=10, output=[], release=True)
    again = admit(pool, "a", list(range(10)))  # same id again after a release is fine
    assert again.admitted and again.cached_tokens == 8 and again.block_table[:2] == first.block_table[:2]
    assert pool.stats().num_released == 1


def test_freed_blocks_are_reusable_in_the_same_step(make_pool) -> None:
    pool = make_pool(num_blocks=4, block_size=4)
    admit(pool, "a", list(range(16)))
    assert pool.stats().num_free_blocks == 0
    result = pool.step(StepInput(finishes=[Finish("a", [], 0)], admits=[Admit("b", [7] * 16)]))
    assert result.admits[0].admitted and result.num_free_blocks == 0


def test_admission_evicts_lru_and_no_space_is_fcfs(make_pool) -> None:
    pool = make_pool(num_blocks=6, block_size=4)
    for rid, base in (("a", 100), ("b", 200)):
        admit(pool, rid, [base + i for i in range(9)])
        finish(pool, rid, computed=9)
    assert pool.stats().num_evictable_blocks == 4
    result = pool.step(StepInput(admits=[Admit("c", list(range(16)))]))
    assert result.admits[0].admitted and result.num_evicted_blocks == 2
    assert pool.match([100 + i for i in range(8)]).matched_tokens == 0  # a was least recent
    assert pool.match([200 + i for i in range(8)]).matched_tokens == 8
    result = pool.step(
        StepInput(admits=[Admit("d", list(range(300, 316))), Admit("e", [1]), Admit("f", [2])])
    )
    assert [r.admitted for r in result.admits] == [False, False, False]  # e, f would fit: FCFS
    assert result.num_evicted_blocks == 0  # nothing taken for a request that cannot fit
    assert pool.stats().num_evictable_blocks == 2


def test_extend_adds_blocks_and_reports_shortage(make_pool) -> None:
    pool = make_pool(num_blocks=4, block_size=4)
    admit(pool, "a", [1, 2, 3])
    (ext,) = pool.step(StepInput(extends=[Extend("a", 4)])).extends
    assert ext.ok and ext.new_block_ids == []  # already covered
    (ext,) = pool.step(StepInput(extends=[Extend("a", 9)])).extends
    assert ext.ok and len(ext.new_block_ids) == 2
    assert pool.requests["a"].block_table[1:] == ext.new_block_ids
    admit(pool, "b", [5])
    (ext,) = pool.step(StepInput(extends=[Extend("a", 13)])).extends
    assert not ext.ok and ext.new_block_ids == []
    assert pool.stats().num_free_blocks == 0


def test_extend_evicts_unlocked_cache(make_pool) -> None:
    pool = make_pool(num_blocks=4, block_size=4)
    admit(pool, "a", list(range(9)))
    finish(pool, "a", computed=9)  # 2 cached pages
    admit(pool, "b", [50])
    result = pool.step(StepInput(extends=[Extend("b", 12)]))
    assert result.extends[0].ok and result.num_evicted_blocks == 1


def test_finish_with_matching_block_table_check(make_pool) -> None:
    pool = make_pool(num_blocks=8, block_size=4)
    a = admit(pool, "a", list(range(6)))
    pool.step(StepInput(finishes=[Finish("a", [], 6, a.block_table)]))
    assert pool.stats().num_cached_blocks == 1


def test_clear_keeps_locked_blocks(make_pool) -> None:
    pool = make_pool(num_blocks=8, block_size=4)
    admit(pool, "a", list(range(9)))
    finish(pool, "a", computed=9)
    admit(pool, "b", list(range(5)) + [77])  # locks the first page
    admit(pool, "c", [9] * 9)
    finish(pool, "c", computed=9)
    result = pool.clear()
    assert result.num_evicted_blocks == 3 and result.num_locked_blocks == 1
    assert pool.evict(5) == 0


def test_retire_reclaims_everything(make_pool) -> None:
    pool = make_pool(num_blocks=8, block_size=4)
    admit(pool, "a", list(range(9)))
    finish(pool, "a", computed=9)
    admit(pool, "b", list(range(9)) + [1, 2, 3, 4])
    pool.retire()
    stats = pool.stats()
    assert stats.num_free_blocks == 8 and stats.num_running_requests == 0 and stats.num_cached_blocks == 0


def test_events_stored_removed_cleared(make_pool) -> None:
    log = EventLog()
    seen = []
    log.subscribe(seen.append)
    pool = make_pool(num_blocks=4, block_size=4, events=log)
    a = admit(pool, "a", list(range(9)))
    finish(pool, "a", computed=9)
    admit(pool, "b", [1] * 16)  # evicts both cached pages
    finish(pool, "b", computed=16)
    pool.clear()  # empties the tree: still one BlockRemoved per namespace (AllCleared: the pool went)
    pool.retire()
    kinds = [type(e.payload) for e in seen]
    assert kinds == [BlockStored, BlockRemoved, BlockStored, BlockRemoved, AllCleared]
    assert [e.sequence for e in seen] == [1, 2, 3, 4, 5]
    assert seen[3].payload.block_hashes == seen[2].payload.block_hashes and pool.tree.total_size == 0
    stored = seen[0].payload
    assert list(stored.block_ids) == a.block_table[:2] and list(stored.token_ids) == list(range(8))
    assert stored.parent_block_hash == 0
    # Ids in forms the cyclic collector does not walk id by id (events.py): tuples of ints are
    # untracked after one collection, an array shows the collector no ids at all.
    gc.collect()
    assert not any(gc.is_tracked(v) for e in seen if not isinstance(e.payload, AllCleared)
                   for v in (e.payload.block_hashes, e.payload.block_ids))
    assert not any(isinstance(r, int) for r in gc.get_referents(stored.token_ids))
    assert seen[1].payload.block_hashes == stored.block_hashes
    assert seen[1].payload.block_ids == stored.block_ids


def test_an_eviction_batch_is_one_block_removed_per_namespace(make_pool) -> None:
    log = EventLog()
    seen = []
    log.subscribe(seen.append)
    pool = make_pool(num_blocks=8, block_size=4, events=log)
    for rid, namespace in (("a", "tenant-a"), ("b", "tenant-b"), ("c", "tenant-a")):
        admit(pool, rid, [ord(rid)] * 5, namespace)
        finish(pool, rid, computed=5)
    stored = {e.payload.block_ids[0]: e.payload.namespace for e in seen}
    del seen[:]
    assert pool.evict(8) == 3
    removed = [e.payload for e in seen]
    assert [type(p) for p in removed] == [BlockRemoved, BlockRemoved]
    assert sorted(p.namespace for p in removed) == ["tenant-a", "tenant-b"]
    for p in removed:
        assert {stored[b] for b in p.block_ids} == {p.namespace} and len(p.block_hashes) == len(p.block_ids)
    assert sorted(b for p in removed for b in p.block_ids) == sorted(stored)


# ---------------------------------------------------------------------- bad input


def _populated(make_pool, vocab_size=0):
    pool = make_pool(num_blocks=8, block_size=4, vocab_size=vocab_size)
    admit(pool, "done", list(range(6)))
    finish(pool, "done", computed=6)
    admit(pool, "live", list(range(10)))
    return pool


BAD_STEPS = [
    ("empty prompt", InvalidArgument, StepInput(admits=[Admit("x", [])])),
    ("token out of vocab", InvalidArgument, StepInput(admits=[Admit("x", [1, 2, 1000])])),
    ("output token out of vocab", InvalidArgument, StepInput(finishes=[Finish("live", [5000], 10)])),
    ("empty request id", InvalidArgument, StepInput(admits=[Admit("", [1])])),
    ("duplicate ids", InvalidArgument, StepInput(admits=[Admit("x", [1]), Admit("x", [2])])),
    ("finish and extend one id", InvalidArgument, StepInput(finishes=[Finish("live")], extends=[Extend("live", 12)])),
    ("admit of a live id", InvalidArgument, StepInput(admits=[Admit("live", [1])])),
    ("computed beyond tokens", InvalidArgument, StepInput(finishes=[Finish("live", [1], 12)])),
    ("computed beyond blocks", InvalidArgument, StepInput(finishes=[Finish("live", [1] * 10, 13)])),
    ("unknown finish", NotFound, StepInput(finishes=[Finish("ghost")])),
    ("unknown release", NotFound, StepInput(releases=[Finish("ghost")])),
    ("unknown extend", NotFound, StepInput(extends=[Extend("ghost", 5)])),
    ("finish twice", FailedPrecondition, StepInput(finishes=[Finish("done", [], 6)])),
    ("extend finished", FailedPrecondition, StepInput(extends=[Extend("done", 20)])),
    ("foreign block table", FailedPrecondition, StepInput(finishes=[Finish("live", [], 10, [0, 1, 7])])),
    ("too large prompt", ResourceExhausted, StepInput(admits=[Admit("x", [1] * 33)])),
    ("too large lookahead", ResourceExhausted, StepInput(admits=[Admit("x", [1], "", 40)])),
    ("too large extend", ResourceExhausted, StepInput(extends=[Extend("live", 33)])),
    ("commit beyond admitted tokens", InvalidArgument, StepInput(commits=[Commit("live", 11)])),
    ("negative commit", InvalidArgument, StepInput(commits=[Commit("live", -4)])),
    ("commit and finish one id", InvalidArgument, StepInput(finishes=[Finish("live")], commits=[Commit("live", 8)])),
    ("commit twice", InvalidArgument, StepInput(commits=[Commit("live", 4), Commit("live", 8)])),
    ("unknown commit", NotFound, StepInput(commits=[Commit("ghost", 4)])),
    ("commit finished", FailedPrecondition, StepInput(commits=[Commit("done", 4)])),
]


@pytest.mark.parametrize("name,error,step", BAD_STEPS, ids=[b[0] for b in BAD_STEPS])
def test_bad_step_is_rejected_whole(make_pool, name, error, step) -> None:
    pool = _populated(make_pool, vocab_size=1000)
    # A valid admit rides along in front of the bad item: it must not be applied either.
    step.admits.insert(0, Admit("innocent", [3, 3, 3, 3, 3]))
    before = (pool.stats(), list(pool.requests), pool.allocator.free_block_ids())
    with pytest.raises(error):
        pool.step(step)
    assert (pool.stats(), list(pool.requests), pool.allocator.free_block_ids()) == before


def test_error_messages_name_the_request(make_pool) -> None:
    pool = _populated(make_pool)
    with pytest.raises(NotFound, match="ghost"):
        pool.step(StepInput(finishes=[Finish("ghost")]))
    with pytest.raises(FailedPrecondition, match="already finished"):
        pool.step(StepInput(finishes=[Finish("done")]))


# ---------------------------------------------------------------------- regressions (issue 8)


def test_finish_without_new_pages_refreshes_its_prefix_in_lru_order(make_pool) -> None:
    """A finish that adds no full page used to leave its path's LRU stamp at admission time, so
    a prefix used until the end of a long request went before colder content cached meanwhile."""
    pool = make_pool(num_blocks=8, block_size=4)
    hot = list(range(100, 108))  # two pages
    admit(pool, "seed", hot)
    finish(pool, "seed", computed=8)
    long_running = admit(pool, "long", hot + [1])  # hits both pages, holds them while it decodes
    assert long_running.cached_tokens == 8
    admit(pool, "cold", list(range(200, 208)))
    finish(pool, "cold", computed=8)  # cached after "long" started
    finish(pool, "long", computed=8)  # nothing new to insert: only the partial page
    assert pool.evict(2) == 2
    assert admit(pool, "again", hot + [1]).cached_tokens == 8  # the hot prefix survived


def test_a_short_eviction_fails_the_item_not_the_step(make_pool) -> None:
    """If eviction frees less than the evictable counter promised, the admission is answered
    NO_SPACE with its lock released; it must never raise in the middle of a Step."""
    from cache_service.pool import Pool

    pool = Pool("p", 1, num_blocks=6, block_size=4)
    admit(pool, "a", list(range(8)))
    finish(pool, "a", computed=8)  # 2 cached pages
    admit(pool, "c", list(range(30, 38)))  # 2 private blocks; 2 free
    pool.tree.evictable_size += 3  # a counter that lies, as the lost heap made it
    result = admit(pool, "b", list(range(50, 70)))  # needs 5 blocks: only 4 can be had
    assert not result.admitted
    pool.tree.evictable_size -= 3
    pool.check_integrity()
    assert pool.stats().num_locked_blocks == 0 and pool.stats().num_running_requests == 1


def test_resumed_admissions_do_not_count_in_the_hit_rate(make_pool) -> None:
    pool = make_pool(num_blocks=16, block_size=4)
    prompt = list(range(100, 109))
    admit(pool, "a", prompt)
    finish(pool, "a", computed=9, release=True)  # preempted
    (again,) = pool.step(StepInput(admits=[Admit("a", prompt, "", 0, True)])).admits
    assert again.cached_tokens == 8
    stats = pool.stats()
    assert (stats.queried_tokens, stats.hit_tokens) == (9, 0)  # only the first admission counts


def test_the_extends_of_a_step_evict_together_the_pages_one_by_one_would(make_pool) -> None:
    """A full pool: three extends in one step evict the three LRU pages in one pass, published as
    one BlockRemoved; the same extends in three steps evict the same pages."""
    def run(batched: bool) -> tuple[list[int], int]:
        log = EventLog()
        seen = []
        log.subscribe(seen.append)
        pool = make_pool(num_blocks=6, block_size=4, events=log)
        admit(pool, "old", list(range(12)))
        finish(pool, "old", computed=12)  # 3 cached pages, one leaf: the LRU
        for rid in ("x", "y", "z"):
            admit(pool, rid, [ord(rid)] * 4)  # a block each
        assert pool.stats().num_free_blocks == 0
        del seen[:]
        extends = [Extend(rid, 5) for rid in ("x", "y", "z")]  # one more block each
        steps = [extends] if batched else [[e] for e in extends]
        for items in steps:
            assert all(r.ok for r in pool.step(StepInput(extends=items)).extends)
        removed = [e.payload for e in seen if isinstance(e.payload, BlockRemoved)]
        return sorted(b for p in removed for b in p.block_ids), len(removed)

    together, events_together = run(batched=True)
    one_by_one, events_one_by_one = run(batched=False)
    assert together == one_by_one and len(together) == 3
    assert (events_together, events_one_by_one) == (1, 3)


@pytest.mark.parametrize("num_blocks, batch", [(511, 1), (1024, 4), (4096, 16), (1 << 16, 64)])
def test_a_full_pool_evicts_a_batch_of_lru_pages_at_a_time(make_pool, num_blocks, batch) -> None:
    """A full pool frees `evict_batch` blocks when one block is short (1/256 of the pool, at most
    64; exactly what is needed under 512 blocks): the least recently used ones, oldest leaf first,
    in one BlockRemoved; the next extends take blocks from the free list without evicting."""
    from cache_service.pool import evict_batch

    assert evict_batch(num_blocks) == batch
    log = EventLog()
    seen = []
    log.subscribe(seen.append)
    pool = make_pool(num_blocks=num_blocks, block_size=1, events=log)
    assert pool.evict_batch == batch
    sizes = [num_blocks - 3 - 2 * 64, 64, 64]  # three cached leaves, oldest first; 3 blocks left
    leaves = []
    for i, size in enumerate(sizes):
        tokens = [i + 1] + [1000 + i] * (size - 1)
        admit(pool, f"doc{i}", tokens + [7])
        finish(pool, f"doc{i}", computed=size)
        leaves.append(tokens)
    admit(pool, "run", [5, 6])  # 2 blocks: 1 left free
    assert pool.stats().num_free_blocks == 1
    first = pool.step(StepInput(extends=[Extend("run", 3)])).extends[0]  # takes the free block
    assert first.ok and pool.stats().num_free_blocks == 0
    del seen[:]
    step = pool.step(StepInput(extends=[Extend("run", 4)]))  # one block short
    assert step.extends[0].ok and step.num_evicted_blocks == batch
    assert pool.stats().num_free_blocks == batch - 1
    removed = [e.payload for e in seen if isinstance(e.payload, BlockRemoved)]
    assert len(removed) == 1 and len(removed[0].block_ids) == batch
    # The oldest leaf lost its tail; the newer ones are whole.
    assert pool.match(leaves[0] + [0], "").matched_tokens == sizes[0] - batch
    assert pool.match(leaves[2] + [0], "").matched_tokens == sizes[2]
    for n in range(5, 5 + batch - 1):  # the rest of the batch serves the next extends
        assert pool.step(StepInput(extends=[Extend("run", n)])).num_evicted_blocks == 0
    assert pool.stats().num_free_blocks == 0
    assert pool.step(StepInput(extends=[Extend("run", 5 + batch - 1)])).num_evicted_blocks == batch
