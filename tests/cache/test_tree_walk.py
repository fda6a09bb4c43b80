"""walk_live: a snapshot walked a node at a time while the pool keeps changing, plus the events
published after it started, rebuilds exactly the pool's pages (cache_service/tree_walk.py)."""

from __future__ import annotations

import random

import pytest

from cache_service.events import AllCleared, BlockRemoved, BlockStored, EventLog
from cache_service.radix_tree import RadixTree
from cache_service.schema import Admit, Finish, StepInput
from cache_service.tree_walk import walk_live

NAMESPACES = ("", "tenant-a", "tenant-b")


def cached_pages(pool) -> set[tuple[str, int]]:
    return {(node.namespace, h) for node in pool.tree.iter_nodes() for h in node.hashes}


class Workload:
    """Random admits / finishes / evictions / clears over prompts that share prefixes (splits)."""

    def __init__(self, pool, seed: int) -> None:
        self.pool = pool
        self.rng = random.Random(seed)
        self.running: list[str] = []
        self.next_id = 0

    def op(self) -> None:
        rng, pool = self.rng, self.pool
        roll = rng.random()
        if roll < 0.45 or not self.running:
            stem = rng.choice(([1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], []))
            tokens = stem + [rng.randrange(1, 6) for _ in range(rng.randrange(1, 14))]
            rid = f"r{self.next_id}"
            self.next_id += 1
            (result,) = pool.step(StepInput(admits=[Admit(rid, tokens, rng.choice(NAMESPACES))])).admits
            if result.admitted:
                self.running.append(rid)
        elif roll < 0.8:
            rid = self.running.pop(rng.randrange(len(self.running)))
            computed = len(pool.requests[rid].prompt)
            pool.step(StepInput(finishes=[Finish(rid, [], computed)]))
        elif roll < 0.95:
            pool.evict(rng.randrange(1, 4))  # a leaf may lose only its tail pages: a split
        else:
            pool.clear()


@pytest.mark.parametrize("seed", range(40))
def test_fuzzy_snapshot_plus_later_events_is_the_tree(make_pool, seed: int) -> None:
    log = EventLog()
    pool = make_pool(num_blocks=48, block_size=2, events=log)
    work = Workload(pool, seed)
    for _ in range(work.rng.randrange(10, 60)):
        work.op()
    later = []
    log.subscribe(later.append)  # the events after the walk starts (sequence S + 1 on)
    mirror: set[tuple[str, int]] = set()
    for payload in walk_live(pool.tree, sorted(pool.tree.namespaces())):
        # parents first: a payload continues a page already given (or starts a sequence)
        assert payload.parent_block_hash == 0 or (payload.namespace, payload.parent_block_hash) in mirror
        mirror.update((payload.namespace, h) for h in payload.block_hashes)
        for _ in range(work.rng.randrange(0, 4)):
            work.op()
    for event in later:  # applied in order; idempotent per page
        p = event.payload
        if isinstance(p, BlockStored):
            mirror.update((p.namespace, h) for h in p.block_hashes)
        elif isinstance(p, BlockRemoved):
            mirror.difference_update((p.namespace, h) for h in p.block_hashes)
        else:
            assert isinstance(p, AllCleared)
            mirror.clear()
    assert mirror == cached_pages(pool)


def _listed_then_split(cut) -> tuple[list[BlockStored], dict[tuple[int, ...], list[int]]]:
    """Root children B then A (3 pages); the walk gives B and has A listed; `cut(tree)` changes
    the tree; returns what the walk gave and the tree's nodes then (tokens -> page hashes)."""
    tree = RadixTree(2)
    tree.insert([5, 5], [0])
    tree.insert([1, 1, 2, 2, 3, 3], [1, 2, 3])
    walk = walk_live(tree, [""])
    first = next(walk)
    assert list(first.token_ids) == [5, 5]
    cut(tree)
    given = [first, *walk]
    return given, {tuple(node.token_ids): tuple(node.hashes) for node in tree.iter_nodes()}


def test_a_head_split_off_a_listed_node_by_an_insert_is_given_before_it() -> None:
    given, nodes = _listed_then_split(lambda tree: tree.insert([1, 1, 7, 7], [1, 4]))
    assert [list(p.token_ids) for p in given] == [[5, 5], [1, 1], [2, 2, 3, 3]]  # [7, 7]: its own event
    assert given[2].parent_block_hash == given[1].block_hashes[-1]
    assert [p.block_hashes for p in given] == [nodes[(5, 5)], nodes[(1, 1)], nodes[(2, 2, 3, 3)]]


def test_a_head_split_off_a_listed_node_by_an_eviction_is_still_given() -> None:
    """Evicting a leaf's last page splits it (no event for the head): the listed node is gone but
    its head, cached all along, must come out."""
    def evict_the_tail(tree: RadixTree) -> None:
        tree.match_prefix([5, 5])  # used now: the 3-page leaf is the least recently used
        (gone,) = tree.evict(1)
        assert gone.block_ids == [3]

    given, nodes = _listed_then_split(evict_the_tail)
    assert [list(p.token_ids) for p in given] == [[5, 5], [1, 1, 2, 2]]
    assert [p.block_hashes for p in given] == [nodes[(5, 5)], nodes[(1, 1, 2, 2)]]
