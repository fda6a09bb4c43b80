"""The radix tree against its frozen previous version (testing/baseline_radix_tree.py) on random
operation sequences: same matches, inserts, evictions (in LRU order), locks and pages; both checked
after every operation. The current tree's lazily computed page hashes, read at random moments (even
for nodes evicted long before), must equal the documented chain of the node's whole prefix."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service.page_hash import page_hashes
from cache_service.radix_tree import RadixTree, TreeNode
from common.token_bytes import encode_tokens
from testing import baseline_radix_tree as old_tree

NAMESPACES = ["", "b"]


def prefix_tokens(node: TreeNode) -> list[int]:
    parts = []
    while node.parent is not None:
        parts.append(node.token_ids)
        node = node.parent
    return [t for part in reversed(parts) for t in part]


def expected_hashes(node: TreeNode, page_size: int) -> list[int]:
    return page_hashes(0, node.namespace, prefix_tokens(node), page_size)[-len(node.value):]


op = st.one_of(
    st.tuples(st.just("insert"), st.sampled_from(NAMESPACES), st.lists(st.integers(0, 1), max_size=8)),
    st.tuples(st.just("match"), st.sampled_from(NAMESPACES), st.lists(st.integers(0, 1), max_size=9)),
    st.tuples(st.just("match_lock"), st.sampled_from(NAMESPACES), st.lists(st.integers(0, 1), max_size=8)),
    st.tuples(st.just("peek"), st.sampled_from(NAMESPACES), st.lists(st.integers(0, 1), max_size=9)),
    st.tuples(st.just("unlock"), st.integers(0, 7)),
    st.tuples(st.just("touch"), st.integers(0, 7)),
    st.tuples(st.just("evict"), st.integers(0, 6)),
    st.tuples(st.just("read_hashes"), st.integers(0, 50)),
    st.tuples(st.just("peek_hashes"), st.sampled_from(NAMESPACES), st.lists(st.integers(0, 1), max_size=8)),
)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([1, 2, 3]), st.lists(op, max_size=40), st.booleans())
def test_current_tree_behaves_like_the_previous_one(page_size: int, ops: list[tuple], bytes_in: bool) -> None:
    new, old = RadixTree(page_size), old_tree.RadixTree(page_size)
    locks: list[tuple[TreeNode | None, object]] = []
    seen: list[TreeNode] = []  # nodes of the current tree, some evicted later
    next_block = 0

    def tokens_of(pages: list[int]) -> list[int]:
        # Page i holds tokens (v, i) so that prefixes share and diverge at page boundaries.
        return [v * 100 + i for i, v in enumerate(pages) for _ in range(page_size)]

    for kind, *args in ops:
        if kind == "insert":
            ns, pages = args
            tokens = tokens_of(pages)
            blocks = list(range(next_block, next_block + len(pages)))
            next_block += len(pages)
            a, b = new.insert(tokens, blocks, ns), old.insert(tokens, blocks, ns)
            assert a.num_existing_pages == b.num_existing_pages
            assert (a.new_node is None) == (b.new_node is None)
            if a.new_node is not None:
                assert a.new_node.value == b.new_node.value
                seen.append(a.new_node)
            if a.last_node is not None:
                assert new.path_blocks(a.last_node, len(pages)) == old.path_blocks(b.last_node, len(pages))
        elif kind in ("match", "match_lock", "peek"):
            ns, pages = args
            tokens = tokens_of(pages)[: len(pages) * page_size - (1 if pages and kind == "match" else 0)]
            key = tokens
            if bytes_in:
                key = encode_tokens(tokens)
            if kind == "peek":
                a, b = new.peek_prefix(key, ns), old.peek_prefix(tokens, ns)
                assert new.peek_key(key, ns) == b.num_tokens == old.peek_key(tuple(tokens), ns)
            else:
                a, b = new.match_prefix(key, ns), old.match_prefix(tokens, ns)
            assert (a.block_ids, a.num_tokens) == (b.block_ids, b.num_tokens)
            if kind == "match_lock":
                new.inc_lock_ref(a.last_node)
                old.inc_lock_ref(b.last_node)
                locks.append((a.last_node, b.last_node))
        elif kind in ("unlock", "touch") and locks:
            a, b = locks[args[0] % len(locks)]
            if kind == "unlock":
                locks.remove((a, b))
                new.dec_lock_ref(a)
                old.dec_lock_ref(b)
            else:
                new.touch(a)
                old.touch(b)
        elif kind == "evict":
            a, b = new.evict(args[0]), old.evict(args[0])
            assert [(e.namespace, e.block_ids) for e in a] == [(e.namespace, e.block_ids) for e in b]
            seen.extend(e.node for e in a)
        elif kind == "read_hashes" and seen:
            node = seen[args[0] % len(seen)]
            assert node.hashes == expected_hashes(node, page_size)
        elif kind == "peek_hashes":
            ns, pages = args
            tokens = tokens_of(pages)
            chain = page_hashes(0, ns, tokens, page_size)
            assert new.peek_hashes(chain, ns) == old.peek_prefix(tokens, ns).num_tokens // page_size
            # The chain names a namespace, but the lookup is made in the one asked for only.
            assert all(new.peek_hashes(chain, other) == 0 for other in NAMESPACES if other != ns)
        new.check_integrity()
        old.check_integrity()
        assert (new.evictable_size, new.protected_size, new.num_nodes) == (
            old.evictable_size, old.protected_size, old.num_nodes)
        assert sorted(new.iter_pages()) == sorted(old.iter_pages())
        assert sorted(new.namespaces()) == sorted(old.namespaces())
    for node in seen + list(new.iter_nodes()):  # evicted or not, split since or not
        assert node.hashes == expected_hashes(node, page_size)
    new.check_integrity()
