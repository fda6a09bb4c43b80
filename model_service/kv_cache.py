"""The paged KV pool: per-layer K and V tensors, allocated once at start."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element_size

    def num_blocks_for_memory(self, num_bytes: int) -> int:
        return num_bytes // self.bytes_per_block


class KVCache:
    """k[layer], v[layer]: [num_blocks, block_size, num_kv_heads, head_dim] (NHD, FlashInfer's layout).

    Token position p of a request lives in block `block_table[p // block_size]`, slot
    `p % block_size`. Which blocks a request may use is decided by the cache manager.
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.k = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        self.v = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.spec.bytes_per_block

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copies the K and V of blocks `src` into blocks `dst` (pairwise), in every layer."""
        if not src:
            return
        device = self.k[0].device
        src_t = torch.tensor(src, dtype=torch.int64, device=device)
        dst_t = torch.tensor(dst, dtype=torch.int64, device=device)
        for cache in (*self.k, *self.v):
            cache.index_copy_(0, dst_t, cache.index_select(0, src_t))
