"""Token ids as bytes: the packed form of protos/cache.proto (`Admit.packed_token_ids`) and the
key the cache manager's radix tree stores and hashes (cache_service/page_hash.py).

Each id is 4 bytes, unsigned little-endian, in order. The model service packs its prompts with
`encode_tokens`; the cache manager reads them back with `unpack_tokens` into an array('I'),
which its core takes like any token sequence and `encode_tokens` turns back into the buffer with
one copy.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import numpy as np

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
