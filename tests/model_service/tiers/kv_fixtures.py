"""Small KV pools and pages for the tier tests (CPU, float32 and bfloat16)."""

from __future__ import annotations

import torch

from cache_service.page_hash import page_hashes
from common.token_bytes import TOKEN_BYTES, encode_tokens
from model_service.kv_cache import KVCache, KVCacheSpec
from model_service.tiers.disk_tier import PageInfo

BLOCK_SIZE = 4


def small_spec(dtype: torch.dtype) -> KVCacheSpec:
    return KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=BLOCK_SIZE, dtype=dtype)


def random_kv(spec: KVCacheSpec, num_blocks: int, seed: int) -> KVCache:
    """A CPU pool whose every element is random (so a misplaced copy can't pass as equal)."""
    kv = KVCache(spec, num_blocks, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    for layer in range(spec.num_layers):
        kv.k[layer].copy_(torch.randn(kv.k[layer].shape, generator=gen))
        kv.v[layer].copy_(torch.randn(kv.v[layer].shape, generator=gen))
    return kv


def block_bytes(kv: KVCache, block: int) -> list[bytes]:
    """Block `block` of every layer's K and V as raw bytes (bit-exact comparison, bfloat16 too)."""
    out = []
    for tensors in (kv.k, kv.v):
        for t in tensors:
            out.append(t[block].contiguous().view(torch.uint8).numpy().tobytes())
    return out


def pool_bytes(kv: KVCache) -> list[bytes]:
    return [b"".join(block_bytes(kv, b)) for b in range(kv.num_blocks)]


def sequence_pages(namespace: str, tokens: list[int], parent_hash: int = 0) -> list[PageInfo]:
    """The PageInfo of each whole page of `tokens`, chained from `parent_hash`."""
    raw = encode_tokens(tokens)
    hashes = page_hashes(parent_hash, namespace, raw, BLOCK_SIZE)
    step = TOKEN_BYTES * BLOCK_SIZE
    parents = [parent_hash, *hashes[:-1]]
    return [PageInfo(namespace, parents[i], hashes[i], raw[i * step:(i + 1) * step]) for i in range(len(hashes))]
