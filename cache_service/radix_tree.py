"""Radix tree of page-aligned token prefixes, mapping each cached page to a physical block.

One root per namespace (tenant / cache salt), so prefixes never match across namespaces.
Edges hold whole pages: a node's key is the `page_size * k` tokens encoded as little-endian
uint32 bytes (`common.token_bytes.encode_tokens`) and its value the k block ids. Children are keyed by
their first page's bytes, so walking compares bytes (memcmp) and never builds tuples of ints.

Page hashes (`page_hash`) are computed lazily: a node's `hashes` on first use (events, Route by
hash chain, miss reasons), then kept. This is sound because the prefix a node object stands for
never changes (a split keeps the tail's identity, a removed node is never changed again), so its
hashes can be computed at any later time, even after it was evicted. The hash index behind
`peek_hashes` is built on the first such call and kept up to date from then on; it is kept per
namespace, because the hash is public (anyone can compute another namespace's chain): a lookup
can only ever find pages of the namespace it names.

The tree does not own the allocator: `insert` reports how many pages were already present
(the caller frees its duplicate blocks) and `evict` returns the evicted nodes' blocks (the
caller frees them). Unlocked leaves wait in a min-heap ordered by last access with lazy
invalidation: an entry is valid only while its node is still an unlocked leaf in the tree
with the same access stamp, so eviction never scans or re-heapifies the tree.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from cache_service.errors import IntegrityError
from cache_service.page_hash import page_hashes
from cache_service.page_index import PageListener
from common.token_bytes import TOKEN_BYTES, decode_tokens, encode_tokens


@dataclass(slots=True, eq=False)
class TreeNode:
    """An edge of whole pages. `lock_ref` counts running requests whose path passes here."""

    key: bytes  # the edge's tokens, encode_tokens()
    value: list[int]
    parent: TreeNode | None
    namespace: str
    children: dict[bytes, TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    in_tree: bool = True
    # Page hashes once computed (a root: []). Computed nodes are closed upwards: a node's are
    # computed only after its parent's.
    computed_hashes: list[int] | None = None

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def hashes(self) -> list[int]:
        """Hash of each page of this edge (see `page_hashes`), computed on first use."""
        hashes = self.computed_hashes
        return hashes if hashes is not None else self._compute_hashes()

    @hashes.setter
    def hashes(self, hashes: list[int]) -> None:
        """Set known hashes (e.g. restored ones); they must be this node's chain."""
        self.computed_hashes = hashes

    @property
    def last_hash(self) -> int:
        """Hash of this node's last page (0 for a root): the parent hash of its children."""
        hashes = self.hashes
        return hashes[-1] if hashes else 0

    def _compute_hashes(self) -> list[int]:
        pending = []
        node: TreeNode | None = self
        while node is not None and node.computed_hashes is None:
            pending.append(node)
            node = node.parent
        parent_hash = node.computed_hashes[-1] if node is not None and node.computed_hashes else 0
        for n in reversed(pending):
            page_size = len(n.key) // (TOKEN_BYTES * len(n.value)) if n.value else 1
            n.computed_hashes = page_hashes(parent_hash, n.namespace, n.key, page_size)
            parent_hash = n.computed_hashes[-1] if n.computed_hashes else parent_hash
        return self.computed_hashes  # type: ignore[return-value]

    @property
    def token_ids(self) -> list[int]:
        """The edge's tokens as ints."""
        return decode_tokens(self.key)


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
    node: TreeNode  # out of the tree now; kept for its page hashes

    @property
    def hashes(self) -> list[int]:
        """The evicted pages' hashes (computed on first use)."""
        return self.node.hashes


def path_values(node: TreeNode | None, num_pages: int) -> list[int]:
    """The last `num_pages` values (block ids, or a lower tier's slots) on the path from the root
    through `node`, which may have left its tree (an evicted node keeps its parent links); fewer
    when the path is shorter."""
    parts: list[list[int]] = []
    need = num_pages
    while need > 0 and node is not None and node.parent is not None:
        take = node.value if len(node.value) <= need else node.value[-need:]
        parts.append(take)
        need -= len(take)
        node = node.parent
    return [b for part in reversed(parts) for b in part]


def path_hashes(node: TreeNode | None, num_pages: int) -> list[int]:
    """Page hashes of the last `num_pages` pages of the prefix through `node` (as `path_values`)."""
    parts: list[list[int]] = []
    need = num_pages
    while need > 0 and node is not None and node.parent is not None:
        hashes = node.hashes
        take = hashes if len(hashes) <= need else hashes[-need:]
        parts.append(take)
        need -= len(take)
        node = node.parent
    return [h for part in reversed(parts) for h in part]


def path_tokens(node: TreeNode | None) -> list[int]:
    """The tokens from the root down to the end of `node` (what matching them finds it by)."""
    parts = []
    while node is not None and node.parent is not None:
        parts.append(node.token_ids)
        node = node.parent
    return [t for part in reversed(parts) for t in part]


def path_key(node: TreeNode | None) -> bytes:
    """The encoded tokens of the whole prefix from the root through `node` (as `path_values`)."""
    parts = []
    while node is not None and node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return b"".join(reversed(parts))


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
        self._page_bytes = TOKEN_BYTES * page_size
        self.heap_slack = heap_slack
        self.evictable_size = 0
        self.protected_size = 0
        self.num_nodes = 0  # excluding roots
        self._roots: dict[str, TreeNode] = {}
        self._clock = 0  # logical access time: one tick per touching operation
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._seq = itertools.count()
        # First page of every root child -> the namespaces that have it (other-namespace lookups).
        self._first_pages: dict[bytes, set[str]] = {}
        # Namespace -> its cached pages' hashes, once peek_hashes is used (never one set for all:
        # see the module docstring).
        self._hash_index: dict[str, set[int]] | None = None
        # Told of every page that joins or leaves the tree (a fleet's page index, page_index.py).
        self._listener: PageListener | None = None

    # ------------------------------------------------------------------ queries

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def aligned_len(self, num_tokens: int) -> int:
        return num_tokens // self.page_size * self.page_size

    def match_prefix(self, tokens: Sequence[int] | bytes, namespace: str = "") -> MatchResult:
        """Longest cached page-aligned prefix of `tokens`; touches the path's access times.

        When the match ends inside an edge, the edge is split there, so `last_node` ends
        exactly at the match and locking it protects exactly the matched pages. `tokens` may be
        ints or already encoded (`encode_tokens`).
        """
        return self._walk(tokens, namespace, mutate=True)

    def peek_prefix(self, tokens: Sequence[int] | bytes, namespace: str = "") -> MatchResult:
        """Like `match_prefix` but read-only: no split, no access-time update."""
        return self._walk(tokens, namespace, mutate=False)

    def peek_key(self, key: Sequence[int] | bytes, namespace: str = "") -> int:
        """Cached tokens of the longest page-aligned prefix of `key`: read-only, for callers that
        look one prompt up in many trees (pass it encoded once, `encode_tokens`, to avoid
        re-encoding it per tree)."""
        root = self._roots.get(namespace)
        if root is None:
            return 0
        key = encode_tokens(key)
        ps = self._page_bytes
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
            pos += self._common_pages(child.key, key, pos) * ps
            break
        return pos // TOKEN_BYTES

    def _walk(self, tokens: Sequence[int] | bytes, namespace: str, mutate: bool) -> MatchResult:
        root = self._roots.get(namespace)
        if root is None:
            return MatchResult([], None, 0)
        ps = self._page_bytes
        key = encode_tokens(tokens)
        n = len(key) // ps * ps
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
        return MatchResult(blocks, node, pos // TOKEN_BYTES)

    def _common_pages(self, edge: bytes, key: bytes, pos: int) -> int:
        """Leading whole pages of `edge` equal to `key[pos:]`, where the first page is known to be
        equal and the whole edge known not to be (binary search over prefix compares)."""
        ps = self._page_bytes
        lo, hi = 1, min(len(edge), len(key) - pos) // ps
        while lo < hi:
            mid = (lo + hi + 1) // 2
            end = mid * ps
            if edge[:end] == key[pos : pos + end]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # ------------------------------------------------------------------ updates

    def insert(self, tokens: Sequence[int] | bytes, block_ids: Sequence[int], namespace: str = "") -> InsertResult:
        """Cache `tokens` (page-aligned, one block per page) and touch the path.

        Returns how many leading pages were already present: the caller's blocks for those
        pages are not taken by the tree (free the ones the caller owns). The remaining pages
        become a new leaf owning the caller's blocks.
        """
        ps = self._page_bytes
        key = encode_tokens(tokens)
        n = len(key)
        if n % ps or n // ps != len(block_ids):
            raise ValueError(f"insert needs whole pages: {n // TOKEN_BYTES} tokens, {len(block_ids)} blocks, "
                             f"page {self.page_size}")
        if n == 0:
            return InsertResult(0, None, None)  # nothing to cache; never leave an empty root behind
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = TreeNode(b"", [], None, namespace, computed_hashes=[])
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
        leaf = TreeNode(key[pos:], list(block_ids[existing:]), node, namespace, last_access=tick)
        first = key[pos : pos + ps]
        node.children[first] = leaf
        if self._hash_index is not None:
            self._hash_index.setdefault(namespace, set()).update(leaf.hashes)
        if self._listener is not None:
            self._listener.added(namespace, leaf.hashes)
        if node.parent is None:
            self._first_pages.setdefault(first, set()).add(namespace)
        self.num_nodes += 1
        self.evictable_size += len(leaf.value)
        self._push_if_evictable_leaf(leaf)
        return InsertResult(existing, leaf, leaf)

    def path_blocks(self, node: TreeNode | None, num_pages: int) -> list[int]:
        """The last `num_pages` block ids on the path from the root down to `node`."""
        blocks = path_values(node, num_pages)
        if len(blocks) < num_pages:
            raise ValueError(f"path holds fewer than {num_pages} pages")
        return blocks

    def set_listener(self, listener: PageListener | None) -> None:
        """Tell `listener` of every page cached now and of every change from now on (None: stop
        telling; the caller forgets the old listener's pages itself)."""
        self._listener = listener
        if listener is not None:
            for node in self.iter_nodes():
                listener.added(node.namespace, node.hashes)

    def peek_hashes(self, hashes: Sequence[int], namespace: str) -> int:
        """Leading pages of a page hash chain (see `page_hashes`) cached in `namespace`: read-only.

        Only `namespace`'s pages are looked at, whatever namespace the chain was computed for.
        The first call builds the hash index (hashing every cached page); it is kept from then on.
        """
        if self._hash_index is None:
            self._hash_index = self._build_hash_index()
        index = self._hash_index.get(namespace)
        if index is None:
            return 0
        n = 0
        for h in hashes:
            if h not in index:
                break
            n += 1
        return n

    def _build_hash_index(self) -> dict[str, set[int]]:
        index: dict[str, set[int]] = {}
        for node in self.iter_nodes():
            index.setdefault(node.namespace, set()).update(node.hashes)
        return index

    def holds_first_page(self, page: bytes, namespace: str) -> bool:
        """Whether `namespace` has a prefix starting with `page` (one encoded page) cached."""
        return namespace in self._first_pages.get(page, ())

    def peek_other_namespaces(self, tokens: Sequence[int] | bytes, namespace: str) -> int:
        """Longest cached page-aligned prefix of `tokens` in any namespace but `namespace`.

        Only namespaces whose tree starts with the same first page are walked. For the operator's
        aggregated metric only (miss_reasons.py): never answer a caller with it.
        """
        ps = self._page_bytes
        key = encode_tokens(tokens)
        if len(key) < ps:
            return 0
        others = self._first_pages.get(key[:ps], ())
        return max((self.peek_key(key, ns) for ns in others if ns != namespace), default=0)

    def _split(self, child: TreeNode, num_pages: int) -> TreeNode:
        """Cut `child` after `num_pages` pages; returns the new parent holding the head.

        `child` keeps its identity (and any lock holder's reference) as the tail.
        """
        ps = self._page_bytes
        cut = num_pages * ps
        parent = child.parent
        assert parent is not None and 0 < cut < len(child.key)
        head = TreeNode(
            child.key[:cut], child.value[:num_pages], parent, child.namespace,
            lock_ref=child.lock_ref, last_access=child.last_access,
        )
        hashes = child.computed_hashes
        if hashes is not None:
            head.computed_hashes = hashes[:num_pages]
            child.computed_hashes = hashes[num_pages:]
        parent.children[child.key[:ps]] = head
        child.key = child.key[cut:]
        child.value = child.value[num_pages:]
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
            evicted.append(EvictedNode(node.namespace, node.value, node))
        return evicted

    def remove_subtree(self, node: TreeNode) -> list[EvictedNode]:
        """Remove `node` and every node below it (pages found bad); nothing when any is locked.
        Returns the removed nodes, children before parents (the caller frees their blocks)."""
        order, stack = [], [node]
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        if not node.in_tree or node.parent is None or any(n.lock_ref for n in order):
            return []
        removed = []
        for n in reversed(order):  # preorder reversed: every child before its parent
            self._remove_leaf(n)
            removed.append(EvictedNode(n.namespace, n.value, n))
        return removed

    def evict_all(self) -> list[EvictedNode]:
        """Evict every unlocked page."""
        return self.evict(self.evictable_size)

    def _remove_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None
        first = node.key[: self._page_bytes]
        del parent.children[first]
        node.in_tree = False
        if self._hash_index is not None:
            pages = self._hash_index[node.namespace]
            pages.difference_update(node.hashes)
            if not pages:
                del self._hash_index[node.namespace]
        if self._listener is not None:
            self._listener.removed(node.namespace, node.hashes)
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

    def root(self, namespace: str) -> TreeNode | None:
        """The root of a namespace's subtree (None while the namespace holds no page)."""
        return self._roots.get(namespace)

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
            stack: list[tuple[TreeNode, tuple[int, ...]]] = [(child, ()) for child in root.children.values()]
            while stack:
                node, prefix = stack.pop()
                tokens = tuple(node.token_ids)
                for i, block in enumerate(node.value):
                    yield ns, prefix + tokens[: (i + 1) * ps], block
                full = prefix + tokens
                stack.extend((child, full) for child in node.children.values())

    def check_integrity(self, check_hashes: bool = True) -> list[int]:
        """Verify structure, counters and the heap; returns every block id the tree owns."""
        ps = self._page_bytes
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
                    computed = child.computed_hashes
                    if computed is not None:
                        if node.computed_hashes is None:
                            raise IntegrityError("page hashes computed below a node without them")
                        if len(computed) != len(child.value):
                            raise IntegrityError("hash count differs from page count")
                        if check_hashes and page_hashes(node.last_hash, ns, child.key, self.page_size) != computed:
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
        index: dict[bytes, set[str]] = {}
        for ns, root in self._roots.items():
            for first in root.children:
                index.setdefault(first, set()).add(ns)
        if index != self._first_pages:
            raise IntegrityError("first-page namespace index differs from the roots' children")
        if self._hash_index is not None:
            if any(node.computed_hashes is None for node in self.iter_nodes()):
                raise IntegrityError("a node without page hashes while the hash index is kept")
            if self._build_hash_index() != self._hash_index:
                raise IntegrityError("page hash index differs from the tree's pages")
        queued = {id(n) for stamp, _, n in self._heap if n.last_access == stamp}
        if any(id(leaf) not in queued for leaf in leaves):
            raise IntegrityError("an evictable leaf is missing from the eviction heap")
        return blocks
