"""Token encoding and the chained page hash shared by every pool (see protos/cache.proto).

Tokens are stored and hashed as one contiguous buffer of little-endian uint32 (`encode_tokens`),
so a page is a bytes slice: comparing pages is a memcmp and hashing a prompt walks one buffer.
`Admit.packed_token_ids` (protos/cache.proto) carries a prompt in this very form; `unpack_tokens`
reads it into an array('I'), which the core takes like any token sequence, and `encode_tokens`
turns back into the buffer with one copy.

The chain, per page i of a sequence in namespace `ns`:

    ns_seed = xxh3_64(utf8(ns), seed=0)
    hash_i  = xxh3_64(uint32_le(token) * page_size, seed=hash_{i-1} XOR ns_seed)

with hash_{-1} = 0, so a page's hash depends only on the namespace and the whole prefix up to it.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterator, Sequence
from functools import lru_cache

import numpy as np
from xxhash import xxh3_64_intdigest

if array("I").itemsize != 4:  # pragma: no cover - every platform CPython supports today
    raise ImportError("array('I') is not 4 bytes wide on this platform")

TOKEN_BYTES = 4
_BIG_ENDIAN = sys.byteorder == "big"


def encode_tokens(tokens: Sequence[int] | bytes) -> bytes:
    """`tokens` as little-endian uint32 bytes (bytes are returned as they are; an array('I'),
    e.g. from `unpack_tokens`, is copied out whole)."""
    if isinstance(tokens, bytes):
        return tokens
    if isinstance(tokens, array) and tokens.typecode == "I" and not _BIG_ENDIAN:
        return tokens.tobytes()
    data = array("I", tokens)
    if _BIG_ENDIAN:  # pragma: no cover
        data.byteswap()
    return data.tobytes()


def unpack_tokens(raw: bytes) -> array:
    """Little-endian uint32 bytes (`encode_tokens`, `Admit.packed_token_ids`) as an array('I') of
    the token ids: one copy, no int object per token. Raises ValueError when len(raw) is not a
    multiple of TOKEN_BYTES."""
    if len(raw) % TOKEN_BYTES:
        raise ValueError(f"{len(raw)} bytes is not a whole number of {TOKEN_BYTES}-byte token ids")
    data = array("I")
    data.frombytes(raw)
    if _BIG_ENDIAN:  # pragma: no cover
        data.byteswap()
    return data


def decode_tokens(raw: bytes) -> list[int]:
    """Inverse of `encode_tokens`."""
    return unpack_tokens(raw).tolist()


def max_token(tokens: Sequence[int]) -> int:
    """The largest id of non-empty `tokens`; an array('I') is scanned by numpy, not id by id."""
    if isinstance(tokens, array) and tokens.typecode == "I":
        return int(np.frombuffer(tokens, dtype=np.uint32).max())
    return max(tokens)


@lru_cache(maxsize=4096)
def namespace_seed(namespace: str) -> int:
    """xxh3_64 of the namespace's UTF-8 bytes: XORed into every page's seed."""
    return xxh3_64_intdigest(namespace.encode())


def iter_page_hashes(parent_hash: int, namespace: str, raw: bytes, page_size: int) -> Iterator[int]:
    """`page_hashes` of already encoded tokens (`encode_tokens`), one page at a time, for callers
    that usually stop after a few pages; a trailing partial page is ignored."""
    ns_seed = namespace_seed(namespace)
    step = TOKEN_BYTES * page_size
    h = parent_hash
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
