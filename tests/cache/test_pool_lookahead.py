"""Lookahead blocks (Extend.num_lookahead_tokens): spare capacity beyond a request's need,
private, counted in PoolStats.num_lookahead_blocks, freed (never cached) on finish or release.

Every pool here is a CheckedPool: check_integrity() runs after every call, failed or not.
"""

from __future__ import annotations

from cache_service.schema import Admit, Extend, Finish, StepInput


def _extend(pool, rid, num_tokens, lookahead):
    (ext,) = pool.step(StepInput(extends=[Extend(rid, num_tokens, lookahead)])).extends
    return ext


def test_lookahead_blocks_are_private_counted_and_freed_on_finish(make_pool) -> None:
    pool = make_pool(num_blocks=16, block_size=4)
    pool.step(StepInput(admits=[Admit("a", list(range(6)), "", 1)]))  # 7 tokens: 2 blocks, none spare
    assert pool.stats().num_lookahead_blocks == 0
    ext = _extend(pool, "a", 9, 8)  # needs 3 blocks, asks for 5
    assert ext.ok and len(ext.new_block_ids) == 3
    stats = pool.stats()
    assert stats.num_lookahead_blocks == 2 and stats.num_private_blocks == 5
    assert _extend(pool, "a", 13, 0).new_block_ids == []  # the need grew into a spare block
    assert pool.stats().num_lookahead_blocks == 1
    pool.step(StepInput(finishes=[Finish("a", list(range(6, 13)), 12)]))
    stats = pool.stats()
    assert stats.num_cached_blocks == 3  # the computed full pages only: spare blocks go back free
    assert stats.num_free_blocks == 13 and stats.num_private_blocks == 0 and stats.num_lookahead_blocks == 0


def test_release_frees_lookahead_blocks(make_pool) -> None:
    pool = make_pool(num_blocks=8, block_size=4)
    pool.step(StepInput(admits=[Admit("a", [1, 2, 3], "", 1)]))
    assert _extend(pool, "a", 5, 8).ok
    assert pool.stats().num_lookahead_blocks == 2
    pool.step(StepInput(releases=[Finish("a", [9], 4)]))
    stats = pool.stats()
    assert stats.num_free_blocks == 7 and stats.num_cached_blocks == 1 and stats.num_lookahead_blocks == 0


def test_an_ask_that_does_not_fit_with_lookahead_takes_nothing(make_pool) -> None:
    pool = make_pool(num_blocks=6, block_size=4)
    pool.step(StepInput(admits=[Admit("a", [1, 2, 3], "", 1), Admit("b", [7, 8, 9, 10], "", 1)]))
    ext = _extend(pool, "a", 8, 12)  # 2 blocks needed, 5 asked: more than the pool has free
    assert not ext.ok and pool.stats().num_free_blocks == 3
    ext = _extend(pool, "a", 8, 0)  # the need alone fits
    assert ext.ok and len(ext.new_block_ids) == 1


def test_lookahead_is_capped_at_the_pool_size(make_pool) -> None:
    pool = make_pool(num_blocks=4, block_size=4)
    pool.step(StepInput(admits=[Admit("a", [1, 2, 3], "", 1)]))
    ext = _extend(pool, "a", 5, 1000)
    assert ext.ok and len(ext.new_block_ids) == 3 and pool.stats().num_free_blocks == 0
