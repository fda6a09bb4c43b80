"""Why a prompt's uncached tokens missed: evicted here, cached elsewhere, kept apart, or new.

Pages after the cached prefix are classified in prompt order (see cache.proto MissBreakdown):
first the run of pages this pool evicted earlier, then those another live pool of the same
model has cached in the same namespace, then those this pool has cached under another
namespace; the rest, with the partial last page and the last prompt token, are new.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from cache_service.page_hash import TOKEN_BYTES, encode_tokens, iter_page_hashes
from cache_service.radix_tree import RadixTree

MAX_REMEMBERED_PAGES = 1 << 20


class MissBreakdown(NamedTuple):
    evicted_tokens: int
    other_replica_tokens: int
    other_namespace_tokens: int
    new_tokens: int


class EvictedPages:
    """Page hashes of recently evicted pages, oldest forgotten first (bounded memory)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, min(capacity, MAX_REMEMBERED_PAGES))
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, page_hash: int) -> bool:
        return page_hash in self._hashes

    def add(self, hashes: Iterable[int]) -> None:
        remembered = self._hashes
        hashes = list(hashes)
        for h in hashes:
            if h in remembered:  # rare (evicted again): refresh its place
                remembered.move_to_end(h)
        remembered.update(dict.fromkeys(hashes))  # new ones go last, in order
        popitem = remembered.popitem
        for _ in range(len(remembered) - self.capacity):
            popitem(last=False)

    def clear(self) -> None:
        self._hashes.clear()

    def hashes(self) -> list[int]:
        """The remembered hashes, oldest first (for snapshots; `add` restores them)."""
        return list(self._hashes)


def classify_miss(
    tree: RadixTree,
    evicted: EvictedPages,
    peer_trees: Iterable[RadixTree],
    tokens: Sequence[int],
    namespace: str,
    num_cached_pages: int,
    parent_hash: int,
    encoded: bytes | None = None,
) -> MissBreakdown:
    """Break down the len(tokens) - cached tokens a first admission must compute.

    `parent_hash` is the hash of the last cached page (0 when nothing is cached); `encoded`, if
    given, is `encode_tokens(tokens)` (saves encoding the prompt again).
    """
    ps = tree.page_size
    uncached = len(tokens) - num_cached_pages * ps
    cacheable = (len(tokens) - 1) // ps  # pages that could have been hits
    if cacheable <= num_cached_pages:
        return MissBreakdown(0, 0, 0, uncached)
    prefix = (encoded or encode_tokens(tokens))[: cacheable * ps * TOKEN_BYTES]  # once for every lookup
    covered = num_cached_pages
    evicted_pages = 0
    if len(evicted):  # hashed page by page: most misses stop at the first page
        for h in iter_page_hashes(parent_hash, namespace, prefix[covered * ps * TOKEN_BYTES :], ps):
            if h not in evicted:
                break
            evicted_pages += 1
        covered += evicted_pages
    elsewhere = max((t.peek_prefix(prefix, namespace).num_tokens // ps for t in peer_trees), default=0)
    other_replica_pages = max(0, elsewhere - covered)
    covered += other_replica_pages
    other_namespace_pages = max(0, tree.peek_other_namespaces(prefix, namespace) // ps - covered)
    explained = (evicted_pages + other_replica_pages + other_namespace_pages) * ps
    return MissBreakdown(evicted_pages * ps, other_replica_pages * ps, other_namespace_pages * ps,
                         uncached - explained)
