"""Radix tree: splits, sharing, locks, LRU + cascading eviction, namespaces, hashes."""

from __future__ import annotations

import pytest

from cache_service.page_hash import page_hashes
from cache_service.radix_tree import RadixTree
from tests.cache.conftest import CheckedTree

BS = 4


def seq(*pages: int) -> list[int]:
    """Tokens of pages whose tokens are all equal to the given values: seq(1, 2) -> 1,1,1,1,2,2,2,2."""
    return [p for p in pages for _ in range(BS)]


def test_match_splits_on_partial_edge_match() -> None:
    tree = CheckedTree(BS)
    tree.insert(seq(1, 2, 3), [10, 11, 12])
    assert tree.num_nodes == 1
    result = tree.match_prefix(seq(1, 2, 9))
    assert result.block_ids == [10, 11] and result.num_tokens == 8
    assert tree.num_nodes == 2  # the edge 1,2,3 became 1,2 -> 3
    assert result.last_node.token_ids == seq(1, 2)
    assert list(result.last_node.children.values())[0].value == [12]


def test_match_ignores_partial_last_page() -> None:
    tree = CheckedTree(BS)
    tree.insert(seq(1, 2), [10, 11])
    result = tree.match_prefix(seq(1, 2) + [7, 7])  # 10 tokens: only 2 whole pages count
    assert result.num_tokens == 8
    assert tree.match_prefix(seq(1)[:3]).num_tokens == 0  # less than a page matches nothing


def test_insert_reports_existing_pages_of_a_shared_prefix() -> None:
    tree = CheckedTree(BS)
    first = tree.insert(seq(1, 2, 3), [10, 11, 12])
    assert first.num_existing_pages == 0 and first.new_node.value == [10, 11, 12]
    second = tree.insert(seq(1, 2, 4, 5), [20, 21, 22, 23])
    assert second.num_existing_pages == 2  # caller frees its 20, 21
    assert second.new_node.value == [22, 23]
    assert tree.match_prefix(seq(1, 2, 4, 5)).block_ids == [10, 11, 22, 23]
    assert tree.match_prefix(seq(1, 2, 3)).block_ids == [10, 11, 12]
    assert tree.num_nodes == 3 and tree.evictable_size == 5
    # Inserting something already fully cached adds nothing.
    again = tree.insert(seq(1, 2), [30, 31])
    assert again.num_existing_pages == 2 and again.new_node is None


def test_insert_rejects_partial_pages() -> None:
    tree = RadixTree(BS)
    with pytest.raises(ValueError):
        tree.insert([1, 2, 3], [0])
    with pytest.raises(ValueError):
        tree.insert(seq(1, 2), [0])


def test_locked_path_survives_eviction() -> None:
    tree = CheckedTree(BS)
    tree.insert(seq(1, 2, 3), [10, 11, 12])
    tree.insert(seq(1, 2, 4), [20, 21, 22])
    locked = tree.match_prefix(seq(1, 2, 3)).last_node
    tree.inc_lock_ref(locked)
    assert tree.protected_size == 3 and tree.evictable_size == 1
    evicted = tree.evict(10)
    assert [e.block_ids for e in evicted] == [[22]]
    assert tree.match_prefix(seq(1, 2, 3)).block_ids == [10, 11, 12]
    assert tree.evictable_size == 0 and tree.evict(1) == []
    tree.dec_lock_ref(locked)
    assert tree.protected_size == 0 and tree.evictable_size == 3
    assert sorted(b for e in tree.evict(3) for b in e.block_ids) == [10, 11, 12]
    assert tree.total_size == 0 and tree.namespaces() == []


def test_lock_is_reference_counted() -> None:
    tree = CheckedTree(BS)
    tree.insert(seq(1, 2), [10, 11])
    node = tree.match_prefix(seq(1, 2)).last_node
    tree.inc_lock_ref(node)
    tree.inc_lock_ref(node)
    tree.dec_lock_ref(node)
    assert tree.evict(2) == [] and tree.protected_size == 2
    tree.dec_lock_ref(node)
    assert len(tree.evict(2)) == 1


def test_eviction_is_lru_and_cascades_to_parents() -> None:
    tree = CheckedTree(BS)
    tree.insert(seq(1, 2), [10, 11])
    tree.insert(seq(1, 2, 3), [10, 11, 12])  # child of the first
    tree.insert(seq(5), [50])
    tree.match_prefix(seq(1, 2, 3))  # 1,2,3 is now the most recently used path
    order = [b for e in tree.evict(1) for b in e.block_ids]
    assert order == [50]
    # The leaf 3 goes, then its parent 1,2 became an unlocked leaf and follows.
    order = [b for e in tree.evict(3) for b in e.block_ids]
    assert order == [12, 10, 11]
    assert tree.total_size == 0


def test_evict_takes_only_the_tail_of_a_large_leaf() -> None:
    tree = CheckedTree(BS)
    tree.insert(seq(1, 2, 3, 4), [10, 11, 12, 13])
    evicted = tree.evict(1)
    assert [e.block_ids for e in evicted] == [[13]]
    assert tree.match_prefix(seq(1, 2, 3, 4)).block_ids == [10, 11, 12]
    assert tree.evictable_size == 3


def test_namespaces_isolate_prefixes() -> None:
    tree = CheckedTree(BS)
    tree.insert(seq(1, 2), [10, 11], namespace="tenant-a")
    assert tree.match_prefix(seq(1, 2), "tenant-b").num_tokens == 0
    assert tree.match_prefix(seq(1, 2)).num_tokens == 0  # default namespace too
    assert tree.match_prefix(seq(1, 2), "tenant-a").block_ids == [10, 11]
    result = tree.insert(seq(1, 2), [20, 21], namespace="tenant-b")
    assert result.num_existing_pages == 0  # nothing shared across tenants
    assert sorted(tree.namespaces()) == ["tenant-a", "tenant-b"]
    assert result.new_node.hashes != tree.match_prefix(seq(1, 2), "tenant-a").last_node.hashes


def test_peek_is_read_only() -> None:
    tree = CheckedTree(BS)
    tree.insert(seq(1, 2, 3), [10, 11, 12])
    tree.insert(seq(7), [70])
    result = tree.peek_prefix(seq(1, 2, 9))
    assert result.block_ids == [10, 11] and result.num_tokens == 8
    assert tree.num_nodes == 2  # no split
    tree.check_integrity()
    # No LRU touch either: 1,2,3 (inserted first) is still the least recently used.
    assert [b for e in tree.evict(3) for b in e.block_ids] == [10, 11, 12]


def test_page_hashes_chain_and_agree_across_trees() -> None:
    a, b = CheckedTree(BS), CheckedTree(BS)
    a.insert(seq(1, 2, 3), [10, 11, 12])
    b.insert(seq(1, 2), [0, 1])
    b.insert(seq(1, 2, 3), [0, 1, 5])  # same prefix, built in two steps, other block ids
    node_a = a.match_prefix(seq(1, 2, 3)).last_node
    assert node_a.computed_hashes is None  # lazy: nothing asked for them yet
    hashes_a = node_a.hashes
    node_b = b.match_prefix(seq(1, 2, 3)).last_node
    assert node_b.hashes == hashes_a[2:] and node_b.parent.hashes == hashes_a[:2]
    assert len(set(hashes_a)) == 3 and all(0 <= h < 2**64 for h in hashes_a)
    assert hashes_a == page_hashes(0, "", seq(1, 2, 3), BS)  # the chain of protos/cache.proto
    # Splitting a node whose hashes are known splits them; an evicted node still knows its own.
    a.match_prefix(seq(1, 9))
    assert a.match_prefix(seq(1)).last_node.hashes == hashes_a[:1]
    (evicted,) = a.evict(2)
    assert evicted.hashes == hashes_a[1:]


def test_eviction_heap_stays_bounded_under_repeated_touches() -> None:
    tree = RadixTree(BS)
    for i in range(50):
        tree.insert(seq(i, 1), [2 * i, 2 * i + 1])
    for _ in range(200):
        for i in range(50):
            tree.match_prefix(seq(i, 1))
    assert len(tree._heap) <= 2 * tree.num_nodes + 1024
    tree.check_integrity()
    assert len([b for e in tree.evict(100) for b in e.block_ids]) == 100


# ---------------------------------------------------------------------- regressions (issue 8)


def test_evict_survives_a_heap_compaction_in_the_middle_of_its_cascade() -> None:
    """The push of a parent that just became a leaf may compact the heap; evict() used to keep
    popping the old list, freeing fewer pages than were evictable and breaking LRU order."""
    tree = RadixTree(BS, heap_slack=8)
    for i in range(1, 21):  # 20 parents with one child each: every eviction cascades
        tree.insert(seq(i, 100 + i), [2 * i, 2 * i + 1])
        tree.insert(seq(i, 200 + i), [1000 + i, 2000 + i])  # splits: parent seq(i), two children
    for i in range(1, 21):
        tree.evict(0)
        tree.match_prefix(seq(i, 100 + i))
    # Stale entries from re-touching leaves until the very next push compacts.
    leaf = seq(1, 200 + 1)
    while len(tree._heap) < 2 * tree.num_nodes + tree.heap_slack:
        tree.match_prefix(leaf)
    evictable = tree.evictable_size
    evicted = tree.evict(evictable)
    assert sum(len(e.block_ids) for e in evicted) == evictable
    assert tree.total_size == 0 and tree.num_nodes == 0
    tree.check_integrity()


def test_insert_of_nothing_in_a_new_namespace_leaves_no_empty_root() -> None:
    tree = CheckedTree(BS)  # checks integrity (no empty root) after the insert
    result = tree.insert([], [], "fresh")
    assert result.num_existing_pages == 0 and result.new_node is None and result.last_node is None
    assert tree.namespaces() == []


def test_touch_refreshes_a_path_in_lru_order() -> None:
    tree = CheckedTree(BS)
    old = tree.insert(seq(1, 2), [10, 11]).last_node
    tree.insert(seq(3), [12])
    tree.inc_lock_ref(old)
    tree.touch(old)  # used until now, by a request that adds nothing new
    tree.dec_lock_ref(old)
    assert [e.block_ids for e in tree.evict(1)] == [[12]]


def test_peek_other_namespaces_finds_the_same_tokens_under_another_salt() -> None:
    tree = CheckedTree(BS)
    tree.insert(seq(1, 2, 3), [10, 11, 12], "a")
    tree.insert(seq(1, 5), [20, 21], "b")
    assert tree.peek_other_namespaces(seq(1, 2, 3, 4), "") == 3 * BS
    assert tree.peek_other_namespaces(seq(1, 2, 3, 4), "a") == 1 * BS  # only b's page 1 matches
    assert tree.peek_other_namespaces(seq(9), "") == 0
    tree.evict_all()
    assert tree.peek_other_namespaces(seq(1, 2, 3), "") == 0
