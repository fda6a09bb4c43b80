"""Whole pages of KV between the device pool (`KVCache`) and CPU tensors of page rows
`[n, num_layers, 2, block_size, num_kv_heads, head_dim]` (the host tier's and the disk tier's
layout): one gather or scatter per layer for all pages, never a Python loop over pages or tokens.

On CUDA the copies run on a dedicated copy stream, ordered after the work already queued on the
current stream (the forward that wrote the KV), through pinned memory with non_blocking copies;
every call synchronizes the copy stream before it returns, so when it returns the data is at
its destination (the caller may then report the copy complete or reuse the source)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from model_service.kv_cache import KVCache, KVCacheSpec


def page_shape(spec: KVCacheSpec) -> tuple[int, ...]:
    """One page of every layer's K and V: [num_layers, 2, block_size, num_kv_heads, head_dim]."""
    return (spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)


def index_tensor(ids: Sequence[int], limit: int, what: str) -> torch.Tensor:
    """`ids` as an int64 CPU tensor (one conversion, no per-id Python work); ValueError when one
    is outside [0, limit) (an index past the end would be a device-side assert on CUDA)."""
    idx = torch.tensor(ids if isinstance(ids, (list, tuple)) else list(ids), dtype=torch.int64)
    if idx.dim() != 1:
        raise ValueError(f"{what} must be a flat sequence of ids")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= limit):
        raise ValueError(f"{what} {ids!r} out of range [0, {limit})")
    return idx


def check_unique(idx: torch.Tensor, what: str) -> None:
    """Destinations must be distinct: index_copy_ with a repeated index is undefined."""
    if idx.numel() > 1 and torch.unique(idx).numel() != idx.numel():
        raise ValueError(f"{what} repeats an id")


def _range_start(idx: torch.Tensor) -> int | None:
    """idx[0] when idx is idx[0], idx[0]+1, ... (then a plain slice replaces a gather)."""
    if idx.numel() == 0:
        return None
    if idx.numel() > 1 and not bool((idx[1:] - idx[:-1] == 1).all()):
        return None
    return int(idx[0])


class PageCopier:
    """Copies pages between one `KVCache` and CPU page-row tensors (see the module docstring)."""

    def __init__(self, kv: KVCache) -> None:
        self.kv = kv
        self.device = kv.k[0].device
        self.cuda = self.device.type == "cuda"
        self.shape = page_shape(kv.spec)
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        # Pinned bounce rows for gathers/scatters whose CPU side is not one contiguous range;
        # grown on demand and kept.
        self._pinned = torch.empty((0, *self.shape), dtype=kv.spec.dtype)

    @property
    def pin(self) -> bool:
        """Whether CPU page rows used with this copier should be pinned (the pool is on CUDA)."""
        return self.cuda

    def _bounce(self, n: int) -> torch.Tensor:
        if self._pinned.shape[0] < n:
            self._pinned = torch.empty((n, *self.shape), dtype=self.kv.spec.dtype, pin_memory=True)
        return self._pinned[:n]

    def to_rows(self, blocks: torch.Tensor, rows: torch.Tensor, dst: torch.Tensor) -> None:
        """dst[rows[i]] = device block blocks[i], every layer (`dst`: CPU page rows)."""
        kv = self.kv
        if blocks.numel() == 0:
            return
        if not self.cuda:
            for layer in range(kv.spec.num_layers):
                dst[:, layer, 0].index_copy_(0, rows, kv.k[layer].index_select(0, blocks))
                dst[:, layer, 1].index_copy_(0, rows, kv.v[layer].index_select(0, blocks))
            return
        assert self.stream is not None
        n = blocks.numel()
        start = _range_start(rows)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            blk = blocks.to(self.device, non_blocking=False)
            staged = torch.empty((n, *self.shape), dtype=kv.spec.dtype, device=self.device)
            for layer in range(kv.spec.num_layers):
                staged[:, layer, 0] = kv.k[layer].index_select(0, blk)
                staged[:, layer, 1] = kv.v[layer].index_select(0, blk)
            host = dst[start:start + n] if start is not None else self._bounce(n)
            host.copy_(staged, non_blocking=True)
        self.stream.synchronize()
        if start is None:
            dst.index_copy_(0, rows, host)

    def from_rows(self, src: torch.Tensor, rows: torch.Tensor, blocks: torch.Tensor) -> None:
        """Device block blocks[i] = src[rows[i]], every layer (`src`: CPU page rows)."""
        kv = self.kv
        if blocks.numel() == 0:
            return
        if not self.cuda:
            for layer in range(kv.spec.num_layers):
                kv.k[layer].index_copy_(0, blocks, src[:, layer, 0].index_select(0, rows))
                kv.v[layer].index_copy_(0, blocks, src[:, layer, 1].index_select(0, rows))
            return
        assert self.stream is not None
        n = blocks.numel()
        start = _range_start(rows)
        if start is not None and src.is_pinned():
            host = src[start:start + n]
        else:
            host = self._bounce(n)
            torch.index_select(src, 0, rows, out=host)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            blk = blocks.to(self.device, non_blocking=False)
            staged = host.to(self.device, non_blocking=True)
            for layer in range(kv.spec.num_layers):
                kv.k[layer].index_copy_(0, blk, staged[:, layer, 0])
                kv.v[layer].index_copy_(0, blk, staged[:, layer, 1])
        self.stream.synchronize()
