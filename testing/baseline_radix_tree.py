"""FROZEN COPY of cache_service/radix_tree.py as of git b173a19 (before issue 12: tuple keys,
blake2b page hashes on every insert). The baseline of testing/tree_trace.py and the reference of
tests/cache/test_tree_differential.py; nothing in the service imports it. Do not edit.
"""

from __future__ import annotations

import heapq
import itertools
import sys
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from hashlib import blake2b
from typing import NamedTuple

from cache_service.errors import IntegrityError


def page_hashes(parent_hash: int, namespace: str, tokens: Sequence[int], page_size: int) -> list[int]:
    """Chained uint64 hash of each page of `tokens`: blake2b-8(parent_hash, namespace, page).

    A page's hash depends only on the namespace and the tokens of the whole prefix up to it, so
    equal prefixes hash equally in every pool. Tokens are hashed as little-endian uint32.
    """
    ns = namespace.encode()
    ns_bytes = len(ns).to_bytes(4, "little") + ns
    data = array("I", tokens)
    if sys.byteorder == "big":
        data.byteswap()
    raw = data.tobytes()
    step = 4 * page_size
    hashes = []
    h = parent_hash
    for start in range(0, len(raw) - step + 1, step):
        digest = blake2b(h.to_bytes(8, "little") + ns_bytes + raw[start : start + step], digest_size=8).digest()
        h = int.from_bytes(digest, "little")
        hashes.append(h)
    return hashes


def page_hash(parent_hash: int, namespace: str, page: Sequence[int]) -> int:
    """Hash of a single page (see `page_hashes`)."""
    return page_hashes(parent_hash, namespace, page, len(page))[0]


@dataclass(slots=True, eq=False)
class TreeNode:
    """An edge of whole pages. `lock_ref` counts running requests whose path passes here."""

    key: tuple[int, ...]
    value: list[int]
    hashes: list[int]
    parent: TreeNode | None
    namespace: str
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    in_tree: bool = True

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def last_hash(self) -> int:
        """Hash of this node's last page (0 for a root): the parent hash of its children."""
        return self.hashes[-1] if self.hashes else 0


class MatchResult(NamedTuple):
    block_ids: list[int]
    last_node: TreeNode | None  # deepest matched node (a root when nothing matched)
    num_tokens: int


class InsertResult(NamedTuple):
    num_existing_pages: int  # leading pages that were already cached (caller frees its copies)
    new_node: TreeNode | None  # the leaf holding the newly cached pages, if any
    last_node: TreeNode | None  # the node that ends exactly at the inserted key (None if empty)


class EvictedNode(NamedTuple):
    namespace: str
    block_ids: list[int]
    hashes: list[int]


class RadixTree:
    """Page-aligned prefix tree with lock refs, LRU eviction and evictable/protected counters.

    Sizes are in pages (= blocks). `evictable_size` counts cached pages on unlocked nodes,
    `protected_size` those on nodes locked by a running request.
    """

    def __init__(self, page_size: int, heap_slack: int = 1024) -> None:
        """`heap_slack`: stale heap entries tolerated beyond 2 per node before a compaction."""
        if page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {page_size}")
        self.page_size = page_size
        self.heap_slack = heap_slack
        self.evictable_size = 0
        self.protected_size = 0
        self.num_nodes = 0  # excluding roots
        self._roots: dict[str, TreeNode] = {}
        self._clock = 0  # logical access time: one tick per touching operation
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._seq = itertools.count()
        # First page of every root child -> the namespaces that have it (other-namespace lookups).
        self._first_pages: dict[tuple[int, ...], set[str]] = {}
        self._hashes: set[int] = set()  # every cached page's hash (lookups by hash chain)

    # ------------------------------------------------------------------ queries

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def aligned_len(self, num_tokens: int) -> int:
        return num_tokens // self.page_size * self.page_size

    def match_prefix(self, tokens: Sequence[int], namespace: str = "") -> MatchResult:
        """Longest cached page-aligned prefix of `tokens`; touches the path's access times.

        When the match ends inside an edge, the edge is split there, so `last_node` ends
        exactly at the match and locking it protects exactly the matched pages.
        """
        return self._walk(tokens, namespace, mutate=True)

    def peek_prefix(self, tokens: Sequence[int], namespace: str = "") -> MatchResult:
        """Like `match_prefix` but read-only: no split, no access-time update."""
        return self._walk(tokens, namespace, mutate=False)

    def peek_key(self, key: tuple[int, ...], namespace: str = "") -> int:
        """Cached tokens of the longest page-aligned prefix of `key` (a tuple, not copied):
        read-only, for callers that look one prompt up in many trees."""
        root = self._roots.get(namespace)
        if root is None:
            return 0
        ps = self.page_size
        n = len(key) // ps * ps
        node, pos = root, 0
        while pos < n:
            child = node.children.get(key[pos : pos + ps])
            if child is None:
                break
            clen = len(child.key)
            if key[pos : pos + clen] == child.key:
                pos += clen
                node = child
                continue
            return pos + self._common_pages(child.key, key, pos) * ps
        return pos

    def _walk(self, tokens: Sequence[int], namespace: str, mutate: bool) -> MatchResult:
        root = self._roots.get(namespace)
        if root is None:
            return MatchResult([], None, 0)
        ps = self.page_size
        key = tuple(tokens[: self.aligned_len(len(tokens))])
        n = len(key)
        tick = self._tick() if mutate else 0
        node, pos, blocks = root, 0, []
        while pos < n:
            child = node.children.get(key[pos : pos + ps])
            if child is None:
                break
            clen = len(child.key)
            if key[pos : pos + clen] == child.key:
                blocks.extend(child.value)
                pos += clen
                node = child
                if mutate:
                    child.last_access = tick
                continue
            m = self._common_pages(child.key, key, pos)
            if mutate:
                node = self._split(child, m)
                node.last_access = tick
                blocks.extend(node.value)
            else:
                blocks.extend(child.value[:m])
                node = child
            pos += m * ps
            break
        if mutate:
            self._push_if_evictable_leaf(node)
        return MatchResult(blocks, node, pos)

    def _common_pages(self, edge: tuple[int, ...], key: tuple[int, ...], pos: int) -> int:
        """Pages of `edge` equal to `key[pos:]`; the first page is known to be equal."""
        ps = self.page_size
        limit = min(len(edge), len(key) - pos)
        i = ps
        while i + ps <= limit and edge[i : i + ps] == key[pos + i : pos + i + ps]:
            i += ps
        return i // ps

    # ------------------------------------------------------------------ updates

    def insert(self, tokens: Sequence[int], block_ids: Sequence[int], namespace: str = "") -> InsertResult:
        """Cache `tokens` (page-aligned, one block per page) and touch the path.

        Returns how many leading pages were already present: the caller's blocks for those
        pages are not taken by the tree (free the ones the caller owns). The remaining pages
        become a new leaf owning the caller's blocks.
        """
        ps = self.page_size
        key = tuple(tokens)
        n = len(key)
        if n % ps or n // ps != len(block_ids):
            raise ValueError(f"insert needs whole pages: {n} tokens, {len(block_ids)} blocks, page {ps}")
        if n == 0:
            return InsertResult(0, None, None)  # nothing to cache; never leave an empty root behind
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = TreeNode((), [], [], None, namespace)
        tick = self._tick()
        node, pos = root, 0
        while pos < n:
            child = node.children.get(key[pos : pos + ps])
            if child is None:
                break
            clen = len(child.key)
            if key[pos : pos + clen] == child.key:
                child.last_access = tick
                node = child
                pos += clen
                continue
            m = self._common_pages(child.key, key, pos)
            node = self._split(child, m)
            node.last_access = tick
            pos += m * ps
            break
        existing = pos // ps
        if pos == n:
            self._push_if_evictable_leaf(node)
            return InsertResult(existing, None, node)
        hashes = page_hashes(node.last_hash, namespace, key[pos:], ps)
        leaf = TreeNode(key[pos:], list(block_ids[existing:]), hashes, node, namespace, last_access=tick)
        first = key[pos : pos + ps]
        node.children[first] = leaf
        self._hashes.update(hashes)
        if node.parent is None:
            self._first_pages.setdefault(first, set()).add(namespace)
        self.num_nodes += 1
        self.evictable_size += len(leaf.value)
        self._push_if_evictable_leaf(leaf)
        return InsertResult(existing, leaf, leaf)

    def path_blocks(self, node: TreeNode | None, num_pages: int) -> list[int]:
        """The last `num_pages` block ids on the path from the root down to `node`."""
        parts: list[list[int]] = []
        need = num_pages
        while need > 0 and node is not None and node.parent is not None:
            take = node.value if len(node.value) <= need else node.value[-need:]
            parts.append(take)
            need -= len(take)
            node = node.parent
        if need > 0:
            raise ValueError(f"path holds fewer than {num_pages} pages")
        return [b for part in reversed(parts) for b in part]

    def peek_hashes(self, hashes: Sequence[int]) -> int:
        """Leading pages of a page hash chain (see `page_hashes`) that are cached: read-only."""
        n = 0
        for h in hashes:
            if h not in self._hashes:
                break
            n += 1
        return n

    def peek_other_namespaces(self, tokens: Sequence[int], namespace: str) -> int:
        """Longest cached page-aligned prefix of `tokens` in any namespace but `namespace`.

        Only namespaces whose tree starts with the same first page are walked.
        """
        ps = self.page_size
        if len(tokens) < ps:
            return 0
        others = self._first_pages.get(tuple(tokens[:ps]), ())
        return max((self.peek_prefix(tokens, ns).num_tokens for ns in others if ns != namespace), default=0)

    def _split(self, child: TreeNode, num_pages: int) -> TreeNode:
        """Cut `child` after `num_pages` pages; returns the new parent holding the head.

        `child` keeps its identity (and any lock holder's reference) as the tail.
        """
        ps = self.page_size
        cut = num_pages * ps
        parent = child.parent
        assert parent is not None and 0 < cut < len(child.key)
        head = TreeNode(
            child.key[:cut], child.value[:num_pages], child.hashes[:num_pages], parent, child.namespace,
            lock_ref=child.lock_ref, last_access=child.last_access,
        )
        parent.children[child.key[:ps]] = head
        child.key = child.key[cut:]
        child.value = child.value[num_pages:]
        child.hashes = child.hashes[num_pages:]
        child.parent = head
        head.children[child.key[:ps]] = child
        self.num_nodes += 1
        return head

    def inc_lock_ref(self, node: TreeNode | None) -> None:
        """Lock the path from `node` up to its root (locked pages cannot be evicted)."""
        while node is not None and node.parent is not None:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.value)
                self.protected_size += len(node.value)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode | None) -> None:
        """Undo one `inc_lock_ref(node)`."""
        while node is not None and node.parent is not None:
            if node.lock_ref <= 0:
                raise IntegrityError("dec_lock_ref on an unlocked node")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.value)
                self.protected_size -= len(node.value)
                self._push_if_evictable_leaf(node)
            node = node.parent

    def touch(self, node: TreeNode | None) -> None:
        """Mark the path from `node` up to its root as used now (LRU refresh without an insert)."""
        if node is None or node.parent is None:
            return
        tick = self._tick()
        bottom = node
        while node is not None and node.parent is not None:
            node.last_access = tick
            node = node.parent
        self._push_if_evictable_leaf(bottom)  # only the bottom node can be a leaf

    def evict(self, num_pages: int) -> list[EvictedNode]:
        """Evict `num_pages` unlocked pages (fewer only when fewer are evictable).

        Least recently used leaves go first; a leaf larger than what is still needed loses only
        its tail pages. A parent that becomes an unlocked leaf joins the candidates.
        """
        evicted: list[EvictedNode] = []
        remaining = num_pages
        heap = self._heap  # compaction rewrites this list in place, so the reference stays valid
        while remaining > 0 and heap:
            stamp, _, node = heapq.heappop(heap)
            if not node.in_tree or node.children or node.lock_ref or node.last_access != stamp:
                continue  # stale entry
            if len(node.value) > remaining:
                self._split(node, len(node.value) - remaining)  # only the tail goes
            self._remove_leaf(node)
            remaining -= len(node.value)
            evicted.append(EvictedNode(node.namespace, node.value, node.hashes))
        return evicted

    def evict_all(self) -> list[EvictedNode]:
        """Evict every unlocked page."""
        return self.evict(self.evictable_size)

    def _remove_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None
        first = node.key[: self.page_size]
        del parent.children[first]
        node.in_tree = False
        self._hashes.difference_update(node.hashes)
        self.num_nodes -= 1
        self.evictable_size -= len(node.value)
        if parent.parent is None:
            namespaces = self._first_pages[first]
            namespaces.discard(parent.namespace)
            if not namespaces:
                del self._first_pages[first]
            if not parent.children:
                del self._roots[parent.namespace]
        else:
            self._push_if_evictable_leaf(parent)

    # ------------------------------------------------------------------ heap upkeep

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _push_if_evictable_leaf(self, node: TreeNode) -> None:
        if node.parent is not None and not node.children and node.lock_ref == 0:
            self._push(node)

    def _push(self, node: TreeNode) -> None:
        heapq.heappush(self._heap, (node.last_access, next(self._seq), node))
        if len(self._heap) > 2 * self.num_nodes + self.heap_slack:
            self._compact_heap()  # amortized: at most once per num_nodes pushes

    def _compact_heap(self) -> None:
        valid = {}
        for stamp, seq, node in self._heap:
            if node.in_tree and not node.children and not node.lock_ref and node.last_access == stamp:
                valid[id(node)] = (stamp, seq, node)
        # In place: a caller in the middle of `evict` holds a reference to this very list.
        self._heap[:] = valid.values()
        heapq.heapify(self._heap)

    # ------------------------------------------------------------------ inspection

    def namespaces(self) -> list[str]:
        return list(self._roots)

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every non-root node, parents before children."""
        for root in list(self._roots.values()):
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                yield node
                stack.extend(node.children.values())

    def iter_pages(self) -> Iterator[tuple[str, tuple[int, ...], int]]:
        """(namespace, tokens of the whole prefix up to and including the page, block id) per page."""
        ps = self.page_size
        for ns, root in list(self._roots.items()):
            stack = [(child, ()) for child in root.children.values()]
            while stack:
                node, prefix = stack.pop()
                for i, block in enumerate(node.value):
                    yield ns, prefix + node.key[: (i + 1) * ps], block
                full = prefix + node.key
                stack.extend((child, full) for child in node.children.values())

    def check_integrity(self, check_hashes: bool = True) -> list[int]:
        """Verify structure, counters and the heap; returns every block id the tree owns."""
        ps = self.page_size
        blocks: list[int] = []
        evictable = protected = count = 0
        leaves: list[TreeNode] = []
        for ns, root in self._roots.items():
            if root.parent is not None or root.namespace != ns or root.key or root.lock_ref:
                raise IntegrityError(f"bad root for namespace {ns!r}")
            if not root.children:
                raise IntegrityError(f"empty root kept for namespace {ns!r}")
            stack = [root]
            while stack:
                node = stack.pop()
                child_locks = 0
                for first, child in node.children.items():
                    if child.parent is not node or not child.in_tree or child.namespace != ns:
                        raise IntegrityError("broken parent link")
                    if not child.key or len(child.key) != ps * len(child.value) or first != child.key[:ps]:
                        raise IntegrityError("edge key is not whole pages or mis-keyed")
                    if len(child.hashes) != len(child.value):
                        raise IntegrityError("hash count differs from page count")
                    if check_hashes and page_hashes(node.last_hash, ns, child.key, ps) != child.hashes:
                        raise IntegrityError("page hash chain broken")
                    if child.lock_ref < 0:
                        raise IntegrityError("negative lock_ref")
                    child_locks += child.lock_ref
                    count += 1
                    blocks.extend(child.value)
                    if child.lock_ref:
                        protected += len(child.value)
                    else:
                        evictable += len(child.value)
                        if not child.children:
                            leaves.append(child)
                    stack.append(child)
                if node.parent is not None and child_locks > node.lock_ref:
                    raise IntegrityError("a child holds more locks than its parent")
        if (evictable, protected, count) != (self.evictable_size, self.protected_size, self.num_nodes):
            raise IntegrityError(
                f"counters evictable/protected/nodes {self.evictable_size}/{self.protected_size}/"
                f"{self.num_nodes}, tree has {evictable}/{protected}/{count}"
            )
        if len(set(blocks)) != len(blocks):
            raise IntegrityError("a block is cached twice")
        index: dict[tuple[int, ...], set[str]] = {}
        for ns, root in self._roots.items():
            for first in root.children:
                index.setdefault(first, set()).add(ns)
        if index != self._first_pages:
            raise IntegrityError("first-page namespace index differs from the roots' children")
        hashes = {h for node in self.iter_nodes() for h in node.hashes}
        if hashes != self._hashes:
            raise IntegrityError("page hash index differs from the tree's pages")
        queued = {id(n) for stamp, _, n in self._heap if n.last_access == stamp}
        if any(id(leaf) not in queued for leaf in leaves):
            raise IntegrityError("an evictable leaf is missing from the eviction heap")
        return blocks
