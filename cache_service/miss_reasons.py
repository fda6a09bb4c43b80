"""Why a prompt's uncached tokens missed: evicted here, cached on another replica, or new.

Pages after the cached prefix are classified in prompt order (see cache.proto MissBreakdown):
first the run of pages this pool evicted earlier, then those another live pool of the same
model has cached in the same namespace; the rest, with the partial last page and the last
prompt token, are new. Every figure the caller is told depends on its own namespace only (the
evicted page hashes are chained from the namespace, see page_hash.py): what other namespaces
hold must not show, or a tenant could confirm guesses of another tenant's prompt page by page.
Pages this pool holds under other namespaces are counted as new for the caller and reported
apart (`MissClassification.other_namespace_tokens`) for the operator's aggregated metric only.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from cache_service.page_hash import iter_page_hashes
from cache_service.radix_tree import RadixTree
from common.token_bytes import TOKEN_BYTES, encode_tokens

MAX_REMEMBERED_PAGES = 1 << 20


class MissBreakdown(NamedTuple):
    """What the caller is told (cache.proto MissBreakdown; its other_namespace_tokens is always 0)."""

    evicted_tokens: int
    other_replica_tokens: int
    new_tokens: int


class MissClassification(NamedTuple):
    """A first admission's miss breakdown, and what only the operator may see."""

    miss: MissBreakdown  # for the caller
    # Of miss.new_tokens, those this pool has cached under another namespace: summed into an
    # operator metric, never sent with a request.
    other_namespace_tokens: int


class EvictedPages:
    """Page hashes of recently evicted pages in bounded memory: at most `capacity` hashes, and
    always at least the `capacity // 2` most recently evicted ones.

    Two generations of plain dicts: new hashes go into `recent`; once it holds `capacity // 2`,
    it becomes `older` and the previous `older` is forgotten whole (a page evicted again is in
    `recent` too, so it may count twice in len()). Adding costs about one C-level dict insert per
    hash (an OrderedDict kept to the exact last `capacity` paid an insert, reorder and pop per
    hash: a large share of a Step that evicts). The content depends only on the sequence of
    hashes added, however it is cut into calls, so a snapshot restored with one `add(hashes())`
    is the same state.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(2, min(capacity, MAX_REMEMBERED_PAGES))
        self._half = self.capacity // 2
        self._recent: dict[int, None] = {}
        self._older: dict[int, None] = {}

    def __len__(self) -> int:
        return len(self._recent) + len(self._older)

    def __contains__(self, page_hash: int) -> bool:
        return page_hash in self._recent or page_hash in self._older

    def add(self, hashes: Iterable[int]) -> None:
        hashes = hashes if isinstance(hashes, list | tuple) else list(hashes)
        start = 0
        while start < len(hashes):
            recent = self._recent
            chunk = hashes[start : start + self._half - len(recent)]  # cannot overfill `recent`
            start += len(chunk)
            recent.update(dict.fromkeys(chunk))
            if len(recent) >= self._half:
                self._older, self._recent = recent, {}

    def clear(self) -> None:
        self._recent.clear()
        self._older.clear()

    def hashes(self) -> list[int]:
        """The remembered hashes, oldest generation first (for snapshots; `add` restores them)."""
        return [*self._older, *self._recent]


def classify_miss(
    tree: RadixTree,
    evicted: EvictedPages,
    peer_pages: Callable[[str, Iterable[int], int], int],
    tokens: Sequence[int],
    namespace: str,
    num_cached_pages: int,
    parent_hash: int,
    encoded: bytes | None = None,
) -> MissClassification:
    """Break down the len(tokens) - cached tokens a first admission must compute.

    `parent_hash` is the hash of the last cached page (0 when nothing is cached); `encoded`, if
    given, is `encode_tokens(tokens)` (saves encoding the prompt again). `peer_pages(namespace,
    chain, skip)`: the most leading pages of the prompt another live pool of the model holds
    (RoutingState.peer_pages), of those that hold page `skip`; the chain is given lazily, from
    that page on (the pages before it are explained already, and a pool that holds a page holds
    the pages before it: page_index.py).
    """
    ps = tree.page_size
    uncached = len(tokens) - num_cached_pages * ps
    cacheable = (len(tokens) - 1) // ps  # pages that could have been hits
    if cacheable <= num_cached_pages:
        return MissClassification(MissBreakdown(0, 0, uncached), 0)
    prefix = (encoded or encode_tokens(tokens))[: cacheable * ps * TOKEN_BYTES]  # once for every lookup
    covered = num_cached_pages
    evicted_pages = 0
    last = parent_hash  # the hash of page covered - 1
    # The uncached pages' hashes, chained from `namespace`, computed once as the lookups go.
    rest: Iterable[int] = iter_page_hashes(parent_hash, namespace, prefix[covered * ps * TOKEN_BYTES :], ps)
    if len(evicted):  # most misses stop at the first page
        for h in rest:
            if h not in evicted:
                rest = itertools.chain((h,), rest)
                break
            evicted_pages += 1
            last = h
        covered += evicted_pages
    # Another pool can explain more only if it holds page covered - 1: walk from there.
    elsewhere = peer_pages(namespace, itertools.chain((last,), rest), covered - 1) if covered else \
        peer_pages(namespace, rest, 0)
    other_replica_pages = max(0, elsewhere - covered)
    covered += other_replica_pages
    other_namespace_pages = max(0, tree.peek_other_namespaces(prefix, namespace) // ps - covered)
    explained = (evicted_pages + other_replica_pages) * ps
    return MissClassification(MissBreakdown(evicted_pages * ps, other_replica_pages * ps, uncached - explained),
                              other_namespace_pages * ps)
