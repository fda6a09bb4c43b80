"""HostTier: device blocks <-> host slots, bit-exact, vectorised, bad ids refused whole."""

from __future__ import annotations

import pytest
import torch

from model_service.tiers.host_tier import HostTier
from tests.model_service.tiers.kv_fixtures import block_bytes, pool_bytes, random_kv, small_spec

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_device_host_device_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    spec = small_spec(dtype)
    src = random_kv(spec, 10, seed=1)
    host = HostTier.for_bytes(spec, 7 * spec.bytes_per_block + spec.bytes_per_block // 2, torch.device("cpu"))
    assert host.num_slots == 7 and host.data.dtype == dtype and not host.data.is_pinned()
    assert host.data.shape == (7, spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)

    # scattered and reversed ids (the gather path) and a contiguous range (the slice path)
    host.store(src, [9, 2, 5], [6, 0, 3])
    host.store(src, [0, 1], [4, 5])
    dst = random_kv(spec, 10, seed=2)
    before = pool_bytes(dst)
    host.load(dst, [0, 6, 3, 4, 5], [1, 8, 7, 3, 4])
    for block_src, block_dst in [(2, 1), (9, 8), (5, 7), (0, 3), (1, 4)]:
        assert block_bytes(dst, block_dst) == block_bytes(src, block_src)
    after = pool_bytes(dst)
    untouched = [b for b in range(10) if b not in (1, 8, 7, 3, 4)]
    assert [after[b] for b in untouched] == [before[b] for b in untouched]
    host.load(dst, [4, 5], [9, 0])  # a contiguous range of slots (the slice path) into scattered blocks
    assert block_bytes(dst, 9) == block_bytes(src, 0) and block_bytes(dst, 0) == block_bytes(src, 1)


def test_a_slot_is_the_page_of_every_layer_k_then_v() -> None:
    spec = small_spec(torch.float32)
    kv = random_kv(spec, 4, seed=3)
    host = HostTier(spec, 2, pin_memory=False)
    host.store(kv, [3], [1])
    for layer in range(spec.num_layers):
        assert torch.equal(host.slot(1)[layer, 0], kv.k[layer][3])
        assert torch.equal(host.slot(1)[layer, 1], kv.v[layer][3])


# out of range, unequal lengths, negative, a repeated destination (a slot for store, a block for load)
@pytest.mark.parametrize("blocks, slots", [([0, 4], [0, 1]), ([0], [2]), ([0, 1], [0]), ([-1], [0]),
                                           ([1, 1], [1, 1])])
def test_bad_ids_copy_nothing(blocks: list[int], slots: list[int]) -> None:
    spec = small_spec(torch.float32)
    kv = random_kv(spec, 4, seed=4)
    host = HostTier(spec, 2, pin_memory=False)
    with pytest.raises(ValueError):
        host.store(kv, blocks, slots)
    assert not host.data.any()
    before = pool_bytes(kv)
    with pytest.raises(ValueError):
        host.load(kv, slots, blocks)
    assert pool_bytes(kv) == before


def test_empty_copies_and_layout_checks() -> None:
    spec = small_spec(torch.float32)
    kv = random_kv(spec, 4, seed=5)
    host = HostTier(spec, 2, pin_memory=False)
    host.store(kv, [], [])
    host.load(kv, [], [])
    with pytest.raises(ValueError):
        host.store(random_kv(small_spec(torch.bfloat16), 4, seed=5), [0], [0])
    with pytest.raises(ValueError):
        HostTier.for_bytes(spec, spec.bytes_per_block - 1, torch.device("cpu"))
