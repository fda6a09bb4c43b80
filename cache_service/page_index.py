"""Which pools hold each cached page, for all pools of one model: page hash -> bit mask of holders.

Route and the miss breakdown ask, for one prompt, how many of its leading pages each pool holds.
Walking every pool's tree costs a tree walk per pool per request, so a fleet's routing work grew
with the square of its size. Here one walk of the prompt's page hash chain answers for every
pool at once: the holders of page i are the mask stored under the chain's i-th hash, and since a
page's hash covers its whole prefix (page_hash.py) and every holder is prefix-closed (a tree, or
the pages of routed prompts: whole leading runs), a holder that has page i has pages 0..i-1 too.
The walk stops at the first page no holder has, so its cost is the prompt's deepest hit, whatever
the number of pools.

Holders: each pool's device tree and its routed-but-not-cached prompts (cache_service/routed.py),
one bit each, recycled when a pool leaves. Pages are kept per namespace: page hashes are public
(anyone can compute another namespace's chain), so a walk only ever sees the pages of the
namespace it names, as each tree's own hash index does (radix_tree.py).

A namespace's pages live in one dict, and past SPLIT_PAGES pages in SHARDS dicts chosen by the
hash's low bits (for good: a namespace that held that many keeps them until it is empty). A dict
rebuilds its table now and then as entries come and go (every few hundred thousand changes), and
one dict of a fleet's 300k pages took 15-17 ms to do it: a pause in the middle of some Step or
Route. A shard's rebuild is 1/SHARDS of that, at the same cost in all. Small namespaces keep one
dict: 64 empty dicts are ~5 KB, and a tenant may spread its pages over many namespaces.

The loops over a chain (add, remove, depths) run in the cache manager's C core where it is built
(cache_service/native/page_ops.c, on the same dicts and ints), else here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

from cache_service import native

SHARDS = 64  # dicts of a large namespace (a power of two: page_ops.c picks one by hash & (SHARDS - 1))
SPLIT_PAGES = 1 << 14  # a namespace's dict is split into SHARDS once it holds more pages than this
_LOW = SHARDS - 1

# A namespace's pages: one dict, or SHARDS of them (see the module docstring).
Pages = dict[int, int] | list[dict[int, int]]


def _shard(pages: Pages, h: int) -> dict[int, int]:
    return pages if type(pages) is dict else pages[h & _LOW]


def _shards(pages: Pages) -> list[dict[int, int]]:
    return pages if type(pages) is list else [pages]


def _split(pages: dict[int, int]) -> list[dict[int, int]]:
    shards: list[dict[int, int]] = [{} for _ in range(SHARDS)]
    for h, mask in pages.items():
        shards[h & _LOW][h] = mask
    return shards


class PageListener(Protocol):
    """What a holder of pages (a tree, a pool's routed prompts) tells when its page set changes."""

    def added(self, namespace: str, hashes: Iterable[int]) -> None: ...

    def removed(self, namespace: str, hashes: Iterable[int]) -> None: ...


class PageHolder:
    """One holder's bit in a PageIndex: the listener its tree (or routed prompts) calls."""

    __slots__ = ("_index", "bit", "num_pages")

    def __init__(self, index: PageIndex, bit: int) -> None:
        self._index = index
        self.bit = bit
        self.num_pages = 0  # pages it holds: each is added once and removed once

    def added(self, namespace: str, hashes: Iterable[int]) -> None:
        pages = self._index._pages.get(namespace)
        if pages is None:
            pages = self._index._pages[namespace] = {}
        bit = self.bit
        if self._index._ops is not None:
            self.num_pages += self._index._ops.add(pages, hashes, bit)
        else:
            n = 0
            for h in hashes:
                shard = _shard(pages, h)
                held = shard.get(h)
                # A page one pool holds stores that pool's own bit object: no new int per page.
                shard[h] = bit if held is None else held | bit
                n += 1
            self.num_pages += n
        if type(pages) is dict and len(pages) > SPLIT_PAGES:
            self._index._pages[namespace] = _split(pages)

    def removed(self, namespace: str, hashes: Iterable[int]) -> None:
        pages = self._index._pages.get(namespace)
        if pages is None:
            return
        keep = ~self.bit
        if self._index._ops is not None:
            self.num_pages -= self._index._ops.remove(pages, hashes, keep)
        else:
            n = 0
            for h in hashes:
                shard = _shard(pages, h)
                mask = shard.get(h, 0) & keep
                if mask:
                    shard[h] = mask
                else:
                    shard.pop(h, None)
                n += 1
            self.num_pages -= n
        if not (any(pages) if type(pages) is list else pages):  # any(): stops at the first shard with a page
            del self._index._pages[namespace]


def bits_of(mask: int) -> Iterator[int]:
    """The set bits of `mask`, each as an int with that bit alone."""
    while mask:
        low = mask & -mask
        yield low
        mask ^= low


class PageIndex:
    """Page hash -> holders, per namespace (see the module docstring). Not thread-safe.

    `native_core`: run the loops in the C core (None: where it is built; True: it must be)."""

    def __init__(self, native_core: bool | None = None) -> None:
        self._ops = native.page_ops() if native_core is None or native_core else None
        if native_core and self._ops is None:
            raise RuntimeError(f"the cache manager's C core is unavailable: {native.unavailable_reason()}")
        self._pages: dict[str, Pages] = {}
        self._free_bits: list[int] = []
        self._next_bit = 1

    def holder(self) -> PageHolder:
        """A new holder with a bit of its own (a released one first)."""
        if self._free_bits:
            bit = self._free_bits.pop()
        else:
            bit, self._next_bit = self._next_bit, self._next_bit << 1
        return PageHolder(self, bit)

    def release(self, holder: PageHolder) -> None:
        """Forget a holder and give its bit back. One that still holds pages (its tree was not
        emptied first) is taken out of every page: a scan of the whole index."""
        if holder.num_pages:
            for namespace, pages in list(self._pages.items()):
                holder.removed(namespace, [h for shard in _shards(pages) for h, mask in shard.items()
                                           if mask & holder.bit])
        holder.num_pages = 0
        self._free_bits.append(holder.bit)

    def depths(self, namespace: str, hashes: Iterable[int], mask: int = -1) -> dict[int, int]:
        """Leading pages of the chain `hashes` each holder in `mask` has: {holder bit: pages},
        holders with none left out. Reads only `namespace`'s pages; stops at the first page no
        holder has (pass the chain lazily: iter_page_hashes)."""
        pages = self._pages.get(namespace)
        out: dict[int, int] = {}
        if not pages:
            return out
        if self._ops is not None:
            return self._ops.depths(pages, hashes, mask)
        held = mask
        depth = 0
        for h in hashes:
            deeper = _shard(pages, h).get(h, 0) & held
            if deeper != held:  # some holders end here (most pages: none do)
                if depth:  # holders without the first page are left out
                    for bit in bits_of(held & ~deeper):
                        out[bit] = depth
                if not deeper:
                    return out
                held = deeper
            depth += 1
        for bit in bits_of(held if depth else 0):
            out[bit] = depth
        return out

    def snapshot(self) -> dict[str, dict[int, int]]:
        """A copy of the index (integrity checks compare it with one rebuilt from the holders)."""
        return {ns: {h: mask for shard in _shards(pages) for h, mask in shard.items()}
                for ns, pages in self._pages.items()}

    def is_split(self, namespace: str) -> bool:
        """Whether `namespace`'s pages are in SHARDS dicts (tests)."""
        return type(self._pages.get(namespace)) is list

