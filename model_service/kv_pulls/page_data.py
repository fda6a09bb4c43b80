"""Pages of the KV pool as KvTransfer sends them (kv_transfer.proto PageData).

A pull's pages travel in groups of consecutive pages; per group, one message per layer holding
K then V of those pages exactly as the pool's tensors hold them ([pages, block_size, kv_heads,
head_dim], the pool's dtype), with a CRC-32 of the bytes. A group counts once all its layers
arrived and checked; a pull's result is the leading pages of its complete groups.
"""

from __future__ import annotations

import zlib

import torch

from model_service.kv_cache import KVCache
from model_service.tiers.host_tier import HostTier

MAX_MESSAGE_BYTES = 1 << 20  # per PageData: well under gRPC's default 4 MiB receive limit


def page_layer_bytes(kv: KVCache) -> int:
    """Bytes of one page's K and V in one layer."""
    spec = kv.spec
    return 2 * spec.block_size * spec.num_kv_heads * spec.head_dim * kv.k[0].element_size()


def group_pages(kv: KVCache) -> int:
    """Pages per message (at least one)."""
    return max(1, MAX_MESSAGE_BYTES // page_layer_bytes(kv))


def read_layer(kv: KVCache, layer: int, blocks: torch.Tensor) -> tuple[bytes, int]:
    """(K then V of `blocks` in `layer` as bytes, their CRC-32)."""
    return _pack(kv.k[layer].index_select(0, blocks), kv.v[layer].index_select(0, blocks))


def read_host_layer(host: HostTier, layer: int, slots: torch.Tensor) -> tuple[bytes, int]:
    """`read_layer` of host-tier slots (each slot is [num_layers, 2, ...]: K and V of every layer)."""
    pages = host.data.index_select(0, slots)[:, layer]
    return _pack(pages[:, 0], pages[:, 1])


def _pack(k: torch.Tensor, v: torch.Tensor) -> tuple[bytes, int]:
    data = torch.cat((k.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))).cpu().numpy().tobytes()
    return data, zlib.crc32(data)


def write_layer(kv: KVCache, layer: int, blocks: torch.Tensor, data: bytes) -> None:
    """Writes K then V (as `read_layer` made them) into `blocks` of `layer`; ValueError when
    `data` is not exactly that many pages."""
    k_cache, v_cache = kv.k[layer], kv.v[layer]
    n = blocks.numel()
    expected = n * page_layer_bytes(kv)
    if len(data) != expected:
        raise ValueError(f"layer {layer}: {len(data)} bytes for {n} pages, expected {expected}")
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(k_cache.dtype)
    shape = (n, *k_cache.shape[1:])
    half = raw.numel() // 2
    device = k_cache.device
    k_cache.index_copy_(0, blocks, raw[:half].view(shape).to(device, non_blocking=False))
    v_cache.index_copy_(0, blocks, raw[half:].view(shape).to(device, non_blocking=False))
