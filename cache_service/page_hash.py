"""Token encoding and the chained page hash shared by every pool (see protos/cache.proto).

Tokens are stored and hashed as one contiguous buffer of little-endian uint32
(`common.token_bytes.encode_tokens`, the form `Admit.packed_token_ids` carries too), so a page
is a bytes slice: comparing pages is a memcmp and hashing a prompt walks one buffer.

The chain, per page i of a sequence in namespace `ns`:

    ns_seed = xxh3_64(utf8(ns), seed=0)
    hash_i  = xxh3_64(uint32_le(token) * page_size, seed=hash_{i-1} XOR ns_seed)

with hash_{-1} = 0, so a page's hash depends only on the namespace and the whole prefix up to it.

The loop runs in the cache manager's C core where it is built (cache_service/native/hash_ops.c:
one pass over the buffer instead of a slice and a call per page), else here; both give the same
hashes (tests/cache/test_page_hash.py runs both).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from functools import lru_cache

from xxhash import xxh3_64_intdigest

from cache_service import native
from common.token_bytes import TOKEN_BYTES, encode_tokens

_ops = native.hash_ops()  # None: the C core is not built here (the loops below run)


@lru_cache(maxsize=4096)
def namespace_seed(namespace: str) -> int:
    """xxh3_64 of the namespace's UTF-8 bytes: XORed into every page's seed."""
    return xxh3_64_intdigest(namespace.encode())


def iter_page_hashes(parent_hash: int, namespace: str, raw: bytes, page_size: int) -> Iterator[int]:
    """`page_hashes` of already encoded tokens (`encode_tokens`), one page at a time, for callers
    that usually stop after a few pages; a trailing partial page is ignored."""
    ns_seed = namespace_seed(namespace)
    step = TOKEN_BYTES * page_size
    if _ops is not None:
        return itertools.chain.from_iterable(_runs(raw, step, parent_hash, ns_seed))
    return _iter_hashes(raw, step, parent_hash, ns_seed)


def _runs(raw: bytes, step: int, h: int, ns_seed: int) -> Iterator[list[int]]:
    """The C core's hashes of `raw` in runs of 4, 16, 64 ... pages: one call per run, and a
    walk that stops early hashes little past its stop."""
    view, start, run = memoryview(raw), 0, 4
    while start + step <= len(raw):
        hashes = _ops.page_hashes(view[start : start + run * step], step, h, ns_seed)
        yield hashes
        h, start, run = hashes[-1], start + run * step, run * 4


def _iter_hashes(raw: bytes, step: int, h: int, ns_seed: int) -> Iterator[int]:
    for start in range(0, len(raw) - step + 1, step):
        h = xxh3_64_intdigest(raw[start : start + step], h ^ ns_seed)
        yield h


def page_hashes(parent_hash: int, namespace: str, tokens: Sequence[int] | bytes, page_size: int) -> list[int]:
    """Chained uint64 hash of each whole page of `tokens`, continuing from `parent_hash`
    (0 at the start of a sequence). Equal prefixes hash equally in every pool. Encoded tokens
    (`encode_tokens`) are hashed as they are, without a copy."""
    # The loop of iter_page_hashes again, not list() of it: a generator costs ~15% at page size 1.
    raw = encode_tokens(tokens)
    ns_seed = namespace_seed(namespace)
    step = TOKEN_BYTES * page_size
    if _ops is not None:
        return _ops.page_hashes(raw, step, parent_hash, ns_seed)
    hashes = []
    append = hashes.append
    h = parent_hash
    for start in range(0, len(raw) - step + 1, step):
        h = xxh3_64_intdigest(raw[start : start + step], h ^ ns_seed)
        append(h)
    return hashes


def page_hash(parent_hash: int, namespace: str, page: Sequence[int]) -> int:
    """Hash of a single page (see `page_hashes`)."""
    return page_hashes(parent_hash, namespace, page, len(page))[0]
