"""The host-memory tier: `num_slots` pages of KV in one CPU tensor (pinned when the pool is on
CUDA), slot ids allocated by the cache manager (TierConfig.num_host_slots).

Layout `[num_slots, num_layers, 2, block_size, num_kv_heads, head_dim]`, the pool's dtype: a slot
is one contiguous page, byte for byte the disk tier's payload, so host -> disk writes need no
copy. `store` and `load` copy whole pages with one gather/scatter per layer (page_copy.py); on
CUDA through a dedicated copy stream with non_blocking copies, synchronized before the call
returns: when `store` returns the host slots hold the data and the device blocks may be reused;
when `load` returns the device blocks hold it. Round trips are bit-exact (plain copies).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from model_service.kv_cache import KVCache, KVCacheSpec
from model_service.tiers.page_copy import PageCopier, check_unique, index_tensor, page_shape


class HostTier:
    """Pages of KV in host memory, addressed by slot id (see the module docstring)."""

    def __init__(self, spec: KVCacheSpec, num_slots: int, pin_memory: bool) -> None:
        if num_slots <= 0:
            raise ValueError(f"the host tier needs at least one slot, got {num_slots}")
        self.spec = spec
        self.num_slots = num_slots
        self.data = torch.zeros((num_slots, *page_shape(spec)), dtype=spec.dtype, pin_memory=pin_memory)
        self._copier: PageCopier | None = None

    @classmethod
    def for_bytes(cls, spec: KVCacheSpec, num_bytes: int, device: torch.device) -> HostTier:
        """As many slots as `num_bytes` holds whole pages (`spec.bytes_per_block` each); pinned
        when the pool is on CUDA. ValueError when that is not a single page."""
        pin = torch.device(device).type == "cuda" and torch.cuda.is_available()
        return cls(spec, num_bytes // spec.bytes_per_block, pin)

    @property
    def num_bytes(self) -> int:
        return self.num_slots * self.spec.bytes_per_block

    def copier(self, kv: KVCache) -> PageCopier:
        """The copier for `kv` (kept: it owns the copy stream and the pinned bounce buffer)."""
        if kv.spec != self.spec:
            raise ValueError(f"the KV pool's layout {kv.spec} is not the host tier's {self.spec}")
        if self._copier is None or self._copier.kv is not kv:
            self._copier = PageCopier(kv)
        return self._copier

    def slot(self, slot: int) -> torch.Tensor:
        """Slot `slot`'s page, [num_layers, 2, block_size, num_kv_heads, head_dim] (a view)."""
        return self.data[slot]

    def store(self, kv: KVCache, blocks: Sequence[int], slots: Sequence[int]) -> None:
        """Copy device block blocks[i] to host slot slots[i], all layers. ValueError on ids out of
        range, unequal lengths or a repeated slot (nothing copied then)."""
        blk, dst = self._indices(kv, blocks, slots)
        check_unique(dst, "host slots")
        self.copier(kv).to_rows(blk, dst, self.data)

    def load(self, kv: KVCache, slots: Sequence[int], blocks: Sequence[int]) -> None:
        """Copy host slot slots[i] to device block blocks[i], all layers. ValueError on ids out of
        range, unequal lengths or a repeated block (nothing copied then)."""
        blk, src = self._indices(kv, blocks, slots)
        check_unique(blk, "device blocks")
        self.copier(kv).from_rows(self.data, src, blk)

    def _indices(self, kv: KVCache, blocks: Sequence[int], slots: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if len(blocks) != len(slots):
            raise ValueError(f"{len(blocks)} blocks but {len(slots)} host slots")
        return index_tensor(blocks, kv.num_blocks, "blocks"), index_tensor(slots, self.num_slots, "host slots")
