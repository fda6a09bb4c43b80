"""The tiers with the pool on CUDA: pinned host memory, the copy stream, ordering after the work
queued on the current stream. Skips without CUDA (the CPU paths: test_host_tier, test_disk_tier)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_service.kv_cache import KVCache, KVCacheSpec
from model_service.tiers.disk_tier import DiskTier
from model_service.tiers.host_tier import HostTier
from tests.model_service.tiers.kv_fixtures import block_bytes, random_kv, sequence_pages, small_spec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def cuda_copy(kv: KVCache) -> KVCache:
    out = KVCache(kv.spec, kv.num_blocks, torch.device("cuda"))
    for layer in range(kv.spec.num_layers):
        out.k[layer].copy_(kv.k[layer])
        out.v[layer].copy_(kv.v[layer])
    return out


def cpu_copy(kv: KVCache) -> KVCache:
    out = KVCache(kv.spec, kv.num_blocks, torch.device("cpu"))
    for layer in range(kv.spec.num_layers):
        out.k[layer].copy_(kv.k[layer])
        out.v[layer].copy_(kv.v[layer])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_and_disk_round_trips_on_cuda(tmp_path: Path, dtype: torch.dtype) -> None:
    spec = small_spec(dtype)
    ref = random_kv(spec, 10, seed=1)
    src = cuda_copy(ref)
    host = HostTier.for_bytes(spec, 8 * spec.bytes_per_block, torch.device("cuda"))
    assert host.data.is_pinned()
    host.store(src, [9, 2, 5], [6, 0, 3])     # scattered slots: the pinned bounce buffer
    host.store(src, [0, 1], [4, 5])           # a slot range: straight into the tier
    dst = cuda_copy(random_kv(spec, 10, seed=2))
    host.load(dst, [0, 6, 3], [1, 8, 7])      # scattered
    host.load(dst, [4, 5], [3, 4])            # range
    out = cpu_copy(dst)
    for s, d in [(2, 1), (9, 8), (5, 7), (0, 3), (1, 4)]:
        assert block_bytes(out, d) == block_bytes(ref, s)

    pages = sequence_pages("ns", list(range(12)))
    with DiskTier.open(str(tmp_path / "d"), spec, "m", 8 * DiskTier.slot_size_for(spec)) as tier:
        assert tier.write_from_device(src, [7, 8, 9], [0, 1, 2], pages) == 3
        assert tier.write_from_host(host, [6, 0], [3, 4], sequence_pages("h", list(range(8)))) == 2
        dst2 = cuda_copy(random_kv(spec, 10, seed=3))
        assert tier.load_to_device(dst2, [0, 1, 2], [5, 3, 1], [(p.namespace, p.page_hash) for p in pages]) == 3
        h = sequence_pages("h", list(range(8)))
        assert tier.load_to_device(dst2, [3, 4], [0, 9], [(p.namespace, p.page_hash) for p in h]) == 2
        out2 = cpu_copy(dst2)
        for s, d in [(7, 5), (8, 3), (9, 1), (9, 0), (2, 9)]:
            assert block_bytes(out2, d) == block_bytes(ref, s)


def test_store_waits_for_the_work_queued_on_the_current_stream() -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=8, head_dim=128, block_size=64, dtype=torch.float32)
    kv = KVCache(spec, 64, torch.device("cuda"))
    host = HostTier(spec, 64, pin_memory=True)
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # keep the current stream busy, then write the KV behind it
        big = big @ big / 64
    for layer in range(spec.num_layers):
        kv.k[layer].fill_(layer + 1.0)
        kv.v[layer].fill_(-(layer + 1.0))
    host.store(kv, list(range(64)), list(range(64)))
    for layer in range(spec.num_layers):
        assert bool((host.data[:, layer, 0] == layer + 1.0).all())
        assert bool((host.data[:, layer, 1] == -(layer + 1.0)).all())
