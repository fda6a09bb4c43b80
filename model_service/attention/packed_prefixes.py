"""bf16 shared prefixes packed for the AMX tiles, kept across steps prefix by prefix.

Where bf16 attention runs on AMX tiles (tile_attention.cpp), a cascade decode reads each group's
shared prefix as the tiles' B operands (`native.pack_prefix_tiles`). Packing a prefix costs about
as much as reading it, and the same prefixes are read in every layer of every step while their
requests decode, so this keeps each layer's packed copy of each prefix. A prefix is named by its
blocks: the radix tree shares a prefix's blocks among the requests that hold it, so while no step
writes them the same blocks hold the same tokens. Copies are per prefix, not per step, so a group
whose members come and go, or a step where other groups join or leave, keeps what it had (a
step's whole set of groups changes at every arrival and finish while requests turn over).

A copy is dropped when it may no longer equal the cache:
- a step writes a slot of one of its blocks (`begin_step` checks every kept prefix, not only the
  step's: a freed block can come back holding other tokens under the same id);
- anything else wrote the layer's cache tensors: their in-place version counter moved since our
  own last write (`before_write` / `after_write` bracket the backend's write of each layer); a cache
  whose version is not tracked (an inference-mode tensor) keeps nothing.
Memory is bounded by `max_bytes`: the prefixes read longest ago go first, and a prefix that does
not fit is packed for its step only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from model_service import native
from model_service.attention.prefix_store import PREFIX_STORE_MAX_BYTES, tracked_version

Blocks = tuple[int, ...]


@dataclass(slots=True)
class _LayerCopies:
    """One layer's packed prefixes and the version of its caches after our last write."""

    k_version: int
    v_version: int
    # Held so that their memory (and so the data_ptr key) cannot pass to another tensor meanwhile.
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    prefixes: dict[Blocks, torch.Tensor] = field(default_factory=dict)  # blocks -> int32 [Hkv, 2, words]


class PackedPrefixes:
    """Per (layer, prefix blocks) packed copies for the AMX tiles (see the module docstring)."""

    def __init__(self, block_size: int, max_bytes: int = PREFIX_STORE_MAX_BYTES) -> None:
        self.block_size = block_size
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.hits = 0  # (layer, prefix) copies read from the store
        self.misses = 0  # packed anew
        self._layers: dict[tuple[int, int], _LayerCopies] = {}
        self._holders: dict[int, set[Blocks]] = {}  # block id -> kept prefixes holding it
        self._last_read: dict[Blocks, int] = {}  # kept prefix -> the step that last read it
        self._step = 0

    def begin_step(self, written_slots: torch.Tensor) -> None:
        """Start a step that writes `written_slots` (int64, host or device): drops every kept
        prefix holding one of their blocks."""
        self._step += 1
        if not self._holders or written_slots.numel() == 0:
            return
        blocks = torch.unique(torch.div(written_slots, self.block_size, rounding_mode="floor")).tolist()
        for block in blocks:
            for prefix in list(self._holders.get(block, ())):
                self._drop(prefix)

    def before_write(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Call before this step writes the layer's caches: drops its copies if anything else
        wrote them since our last write."""
        layer = self._layers.get((k_cache.data_ptr(), v_cache.data_ptr()))
        if layer is not None and (layer.k_version != tracked_version(k_cache)
                                  or layer.v_version != tracked_version(v_cache)):
            del self._layers[(k_cache.data_ptr(), v_cache.data_ptr())]
            for prefix, tiles in layer.prefixes.items():
                self.num_bytes -= tiles.numel() * tiles.element_size()
                if not any(prefix in other.prefixes for other in self._layers.values()):
                    self._untrack(prefix)

    def after_write(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Call after this step's write of the layer: our write moved the version counters."""
        layer = self._layers.get((k_cache.data_ptr(), v_cache.data_ptr()))
        if layer is not None:
            layer.k_version, layer.v_version = tracked_version(k_cache), tracked_version(v_cache)

    def tiles(self, k_cache: torch.Tensor, v_cache: torch.Tensor, prefixes: list[Blocks], lengths: torch.Tensor,
              gather: Callable[[list[int]], tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """The packed tiles of each of `prefixes` (lengths: int64 [len(prefixes)] tokens) in this
        layer, after this step's write: kept copies where there are, the others packed from
        `gather(indices)` (their K and V, [len(indices), Hkv, len, D] each) and kept where the
        budget allows."""
        key = (k_cache.data_ptr(), v_cache.data_ptr())
        layer = self._layers.get(key)
        found: dict[Blocks, torch.Tensor] = {}
        missing: list[int] = []  # the first index of each prefix not kept (one may be asked twice)
        asked: set[Blocks] = set()
        for i, p in enumerate(prefixes):
            if p in asked:
                continue
            asked.add(p)
            tiles = None if layer is None else layer.prefixes.get(p)
            if tiles is None:
                missing.append(i)
            else:
                found[p] = tiles
                self._last_read[p] = self._step
        self.hits += len(prefixes) - len(missing)
        self.misses += len(missing)
        if missing:
            k, v = gather(missing)  # [m, Hkv, len, D] each
            k_version, v_version = tracked_version(k_cache), tracked_version(v_cache)
            for j, i in enumerate(missing):
                # One packing per prefix: a copy owns its memory, so the budget counts what is held.
                tiles = native.pack_prefix_tiles(k[j:j + 1], v[j:j + 1], lengths[i:i + 1].contiguous())[0]
                found[prefixes[i]] = tiles
                if k_version is None or v_version is None or not self._room(tiles.numel() * tiles.element_size()):
                    continue
                if layer is None:
                    layer = self._layers[key] = _LayerCopies(k_version, v_version, k_cache, v_cache)
                self._keep(layer, prefixes[i], tiles)
        return [found[p] for p in prefixes]

    def _keep(self, layer: _LayerCopies, prefix: Blocks, tiles: torch.Tensor) -> None:
        assert prefix not in layer.prefixes
        layer.prefixes[prefix] = tiles
        self.num_bytes += tiles.numel() * tiles.element_size()
        if prefix not in self._last_read:
            for block in set(prefix):
                self._holders.setdefault(block, set()).add(prefix)
        self._last_read[prefix] = self._step

    def _room(self, num_bytes: int) -> bool:
        """Makes room for `num_bytes` by dropping the prefixes read longest ago (never one read in
        this step); False when that is not enough."""
        if num_bytes > self.max_bytes:
            return False
        while self.num_bytes + num_bytes > self.max_bytes:
            oldest = min(self._last_read, key=self._last_read.__getitem__, default=None)
            if oldest is None or self._last_read[oldest] == self._step:
                return False
            self._drop(oldest)
        return True

    def _drop(self, prefix: Blocks) -> None:
        """Drops every layer's copy of `prefix`."""
        for layer in self._layers.values():
            tiles = layer.prefixes.pop(prefix, None)
            if tiles is not None:
                self.num_bytes -= tiles.numel() * tiles.element_size()
        self._untrack(prefix)

    def _untrack(self, prefix: Blocks) -> None:
        """Forgets `prefix`'s blocks and last read; call when no layer holds a copy of it."""
        self._last_read.pop(prefix, None)
        for block in set(prefix):
            holders = self._holders.get(block)
            if holders is not None:
                holders.discard(prefix)
                if not holders:
                    del self._holders[block]
