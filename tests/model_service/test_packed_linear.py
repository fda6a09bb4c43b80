"""bf16 linear layers with oneDNN-packed weights (linear/packed.py) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from model_service.linear import PlannedLinear, plan_model
from model_service.linear.packed import _available, pack_weight, packed_linear, warm_up
from model_service.linear.tuning import Timing

needs_onednn_bf16 = pytest.mark.skipif(not _available(), reason="torch has no oneDNN bf16 on this CPU")


def test_only_cpu_bfloat16_weights_are_packed():
    assert pack_weight(torch.randn(8, 4)) is None  # float32 keeps F.linear (bitwise = transformers)
    assert pack_weight(torch.randn(8, 4, dtype=torch.float16)) is None
    assert pack_weight(torch.randn(8, dtype=torch.bfloat16)) is None
    assert pack_weight(torch.randn(8, 4, dtype=torch.float16), "onednn") is None


needs_onednn = pytest.mark.skipif(not _available(torch.float32), reason="torch has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 5, 32, 300])
@pytest.mark.parametrize("shape", [(960, 576), (64, 1536), (7, 3)])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_packed_only_when_asked_and_close_to_f_linear(rows, shape, bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(shape, generator=gen)
    b = torch.randn(shape[0], generator=gen) if bias else None
    x = torch.randn(2, rows, shape[1], generator=gen)
    assert pack_weight(weight) is None and pack_weight(weight, "mkl") is None
    packed = pack_weight(weight, "onednn")
    assert packed is not None and packed.dtype == torch.float32
    got = packed_linear(x, packed, b)
    want = F.linear(x, weight, b)
    assert got.shape == want.shape and got.dtype == torch.float32
    # Another summation order, float32 accumulation: a few ulps of the sums apart.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * shape[1] ** 0.5)


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
    # bf16: fast mode, oneDNN's packed products (no timing run: the dot-product kernel not offered)
    linears = plan_model(layer, timing=Timing())
    assert linears.mode == "fast" and len(linears.products) == 2
    assert isinstance(layer["o_proj"], PlannedLinear) and layer["o_proj"].product.packed is not None
    assert layer["q_proj"].group.product.packed is not None
    assert all(r.path == "packed" for p in linears.plans for r in p.ranges)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        torch.testing.assert_close(layer[name](x).float(), want[name].float(), rtol=2**-7, atol=1e-2)


@needs_onednn
def test_float32_layers_take_the_packed_path_only_with_onednn():
    def layer() -> nn.ModuleDict:
        torch.manual_seed(0)
        return nn.ModuleDict({"gate_proj": nn.Linear(16, 32, bias=False), "up_proj": nn.Linear(16, 32, bias=False),
                              "down_proj": nn.Linear(32, 16)})

    x = torch.randn(4, 16)
    default, onednn = layer(), layer()
    want = {name: F.linear(x, m.weight, m.bias) for name, m in default.items() if name != "down_proj"}
    plan_model(default)
    assert default["gate_proj"].group.product.packed is None and default["down_proj"].product.packed is None
    linears = plan_model(onednn, fp32_gemm="onednn")
    assert linears.mode == "fast"  # oneDNN's float32 products are not F.linear's bits: never exact
    assert onednn["gate_proj"].group.product.packed is not None and onednn["down_proj"].product.packed is not None
    assert all(r.path == "packed" and not r.verified for p in linears.plans for r in p.ranges)
    with pytest.raises(ValueError, match="exact refuses --fp32-gemm onednn"):
        plan_model(layer(), mode="exact", fp32_gemm="onednn")
    for name, expected in want.items():
        assert torch.equal(default[name](x), expected)  # mkl: F.linear's bits
        torch.testing.assert_close(onednn[name](x), expected, rtol=1e-5, atol=1e-5)


@needs_onednn_bf16
def test_warm_up_runs_each_packed_shape_for_every_batch_size():
    layer = nn.ModuleDict({"q_proj": nn.Linear(16, 16, bias=False), "k_proj": nn.Linear(16, 8, bias=False),
                           "v_proj": nn.Linear(16, 8, bias=False), "o_proj": nn.Linear(16, 16),
                           "out": nn.Linear(16, 16)}).bfloat16()
    linears = plan_model(layer)
    x = torch.randn(5, 16).bfloat16()
    before = {name: m(x) for name, m in layer.items()}
    # Two packed shapes: the fused q/k/v [32, 16] and o_proj/out [16, 16] (one shape, counted once).
    assert warm_up(linears.packed_weights(), 7) == 2 * 7
    for name, m in layer.items():
        assert torch.equal(m(x), before[name])  # nothing changed
    unpacked = nn.ModuleDict({"o_proj": nn.Linear(16, 16)})
    # float32, mkl: nothing packed, nothing to warm
    assert warm_up(plan_model(unpacked).packed_weights(), 7) == 0
