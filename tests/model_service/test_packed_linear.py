"""bf16 linear layers with oneDNN-packed weights (packed_linear) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from model_service.fused_linear import fuse_sibling_projections
from model_service.packed_linear import _available, pack_weight, packed_linear
from model_service.short_gemm import ShortInputLinear, use_short_input_gemm

needs_onednn_bf16 = pytest.mark.skipif(not _available(), reason="torch has no oneDNN bf16 on this CPU")


def test_only_cpu_bfloat16_weights_are_packed():
    assert pack_weight(torch.randn(8, 4)) is None  # float32 keeps F.linear (bitwise = transformers)
    assert pack_weight(torch.randn(8, 4, dtype=torch.float16)) is None
    assert pack_weight(torch.randn(8, dtype=torch.bfloat16)) is None


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 5, 32, 300])
@pytest.mark.parametrize("shape", [(960, 576), (64, 1536), (7, 3)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_matches_f_linear(rows, shape, bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(shape, generator=gen).bfloat16()
    b = torch.randn(shape[0], generator=gen).bfloat16() if bias else None
    x = torch.randn(2, rows, shape[1], generator=gen).bfloat16()  # [..., in] with a leading dim
    packed = pack_weight(weight)
    assert packed is not None
    got = packed_linear(x, packed, b)
    want = F.linear(x, weight, b)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    # Both accumulate in fp32 and round once to bf16: at most a rounding step apart.
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-2)


@needs_onednn_bf16
def test_the_model_layers_take_the_packed_path():
    layer = nn.ModuleDict({"q_proj": nn.Linear(16, 16, bias=False), "k_proj": nn.Linear(16, 8, bias=False),
                           "v_proj": nn.Linear(16, 8, bias=False), "o_proj": nn.Linear(16, 16)}).bfloat16()
    x = torch.randn(4, 16).bfloat16()
    want = {name: F.linear(x, m.weight, m.bias) for name, m in layer.items()}
    assert fuse_sibling_projections(layer) == 1 and use_short_input_gemm(layer) == 1
    assert isinstance(layer["o_proj"], ShortInputLinear) and layer["o_proj"].packed_weight is not None
    assert layer["q_proj"].group.packed_weight is not None
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        torch.testing.assert_close(layer[name](x).float(), want[name].float(), rtol=2**-7, atol=1e-2)
