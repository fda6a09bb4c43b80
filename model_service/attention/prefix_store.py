"""Head-major copies of a step's shared-prefix K/V, kept across decode steps while still valid.

The cascade attends each group's shared prefix from a contiguous `[groups, Hkv, len, D]` copy
gathered out of the paged cache. While the same requests decode, the same prefixes are gathered
in every layer of every step, although their blocks do not change: they are full blocks before
every member's current one, shared through the radix tree and written once. Re-gathering them
was about 60% of the decode gather (and 10-20% of a whole decode step of 4 groups x 8 sharing
1024 tokens). This store keeps each layer's copy for as long as it provably equals the cache:

- the step's prefixes must be the same (`key`: the same blocks and lengths as when copied);
- no slot of those blocks was written by a step since (checked against each step's slot
  mapping in `begin_step`);
- nothing else wrote to the layer's cache tensors (their in-place version counter is unchanged
  since our own last write; a cache whose version is not tracked, an inference-mode tensor, is
  never stored).

Any change drops the copies and the next gather rebuilds them; what is attended is then the
same bytes as the gather produces, so results are bitwise unchanged. Memory is bounded by
`max_bytes` (layers past the bound gather into the step's scratch as before).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

PREFIX_STORE_MAX_BYTES = 512 << 20


@dataclass(slots=True)
class PrefixCopy:
    """One layer's copy of the step's cascade prefixes."""

    k: torch.Tensor  # [groups, Hkv, len, D] contiguous
    v: torch.Tensor
    k_version: int  # the cache tensors' version counters after our last write
    v_version: int
    # The layer's cache tensors, held so that their memory (and so the data_ptr key) cannot
    # pass to another tensor while the copy is kept.
    k_cache: torch.Tensor
    v_cache: torch.Tensor

    @property
    def num_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


def tracked_version(t: torch.Tensor) -> int | None:
    """t's in-place version counter, None where it is not tracked (an inference-mode tensor)."""
    try:
        return t._version
    except RuntimeError:  # inference tensors do not track a version counter
        return None


class PrefixKVStore:
    """Per-layer copies of the current step's cascade prefixes (see the module docstring)."""

    def __init__(self, max_bytes: int = PREFIX_STORE_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._key: tuple | None = None
        self._layers: dict[tuple[int, int], PrefixCopy] = {}  # (k data_ptr, v data_ptr) -> copy
        self.hits = 0  # layers served from a copy
        self.misses = 0  # layers gathered

    def begin_step(self, key: tuple | None, blocks: torch.Tensor | None, written_slots: torch.Tensor,
                   block_size: int) -> None:
        """Start a step whose cascade prefixes are `key` over `blocks` (None: no cascade).

        written_slots: [num_tokens] int64 slots this step writes (host or device)."""
        if key is None or key != self._key:
            self.clear()
            self._key = key
            return
        assert blocks is not None
        written = torch.div(written_slots, block_size, rounding_mode="floor").to(blocks.device)
        if bool(torch.isin(written, blocks).any()):
            self.clear()
            self._key = key

    @property
    def num_bytes(self) -> int:
        return sum(copy.num_bytes for copy in self._layers.values())

    def clear(self) -> None:
        self._layers.clear()
        self._key = None

    def lookup(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> PrefixCopy | None:
        """The layer's copy if still valid; call before this step writes the layer's cache."""
        layer = (k_cache.data_ptr(), v_cache.data_ptr())
        copy = self._layers.get(layer)
        if copy is None:
            return None
        if copy.k_version != tracked_version(k_cache) or copy.v_version != tracked_version(v_cache):
            del self._layers[layer]
            return None
        return copy

    def allocate(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Fresh K and V buffers of `shape` to gather this layer's prefixes into and keep, or
        None when the store is full or the cache's writes cannot be tracked."""
        if tracked_version(k_cache) is None or tracked_version(v_cache) is None:
            return None
        if self.num_bytes + 2 * math.prod(shape) * k_cache.element_size() > self.max_bytes:
            return None
        return (torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device),
                torch.empty(shape, dtype=v_cache.dtype, device=v_cache.device))

    def keep(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Record (or refresh) the layer's copy; call after this step's write of the layer."""
        layer = (k_cache.data_ptr(), v_cache.data_ptr())
        k_version, v_version = tracked_version(k_cache), tracked_version(v_cache)
        assert k_version is not None and v_version is not None
        self._layers[layer] = PrefixCopy(k, v, k_version, v_version, k_cache, v_cache)
