"""The bf16 dot-product linear (linear/dot.py, native/dot_linear.cpp) against F.linear, and where
the plan takes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from model_service import native
from model_service.linear import dot as dot_kernel
from model_service.linear import plan_model, tuning
from model_service.linear.tuning import DOT_TIMED_ROWS, Timing, time_dot_rows
from tests.native_required import SKIP_PREFIX

needs_dot = pytest.mark.skipif(not dot_kernel.available(), reason=(
    f"{SKIP_PREFIX}: library not loaded ({native.unavailable_reason()})" if not native.available()
    else "this CPU has no AVX512-BF16"))


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The product in float64 from the same bf16 values (what both float32 sums approximate)."""
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


TILES = [False, pytest.param(True, marks=pytest.mark.skipif(not dot_kernel.has_tiles(), reason="no AMX tiles here"))]


@needs_dot
@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 11, 15, 16, 17, 31, 32, 33, 48, 65])
@pytest.mark.parametrize("shape", [(16, 2), (32, 64), (48, 576), (64, 96), (80, 1538), (960, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_product_is_the_float32_sum_rounded_once(tiles, rows, shape, bias):
    if tiles and shape[1] % 32:
        pytest.skip("AMX tiles take in % 32 == 0 only")
    gen = torch.Generator().manual_seed(rows * 7 + shape[0])
    weight = torch.randn(shape, generator=gen).bfloat16()
    b = torch.randn(shape[0], generator=gen).bfloat16() if bias else None
    x = torch.randn(3, rows, shape[1], generator=gen).bfloat16()  # a leading dim, as the model passes
    striped = dot_kernel.pack(weight)
    assert striped is not None and striped.dtype == torch.int32 and striped.shape == (shape[0] // 16, shape[1] // 2, 16)
    got = dot_kernel.dot_linear(x, striped, b, tiles)
    assert got.shape == (3, rows, shape[0]) and got.dtype == torch.bfloat16
    want = _reference(x, weight, b)
    # Exact products summed in float32 (error ~ K * 2^-24 of the magnitudes), one rounding to bf16
    # (2^-8 relative), and with a bias a second one: within a bf16 step of the exact value.
    magnitude = (x.double().abs() @ weight.double().abs().T) + (0 if b is None else b.double().abs())
    assert ((got.double() - want).abs() <= magnitude * 2**-7 + 1e-6).all()
    torch.testing.assert_close(got.float(), F.linear(x, weight, b).float(), rtol=2**-6, atol=2e-2 * shape[1] ** 0.5)


@needs_dot
@pytest.mark.parametrize("tiles", TILES)
def test_rows_are_independent_of_the_batch(tiles):
    """A row's output is the same bits whichever rows share its call (each row sums alone)."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 128, generator=gen).bfloat16()
    striped = dot_kernel.pack(weight)
    x = torch.randn(41, 128, generator=gen).bfloat16()
    whole = dot_kernel.dot_linear(x, striped, None, tiles)
    for i in (0, 7, 8, 15, 16, 20, 31, 32, 40):
        assert torch.equal(dot_kernel.dot_linear(x[i:i + 1], striped, None, tiles), whole[i:i + 1])
    assert torch.equal(dot_kernel.dot_linear(x[::2], striped, None, tiles), whole[::2])  # strided input


def test_only_bf16_cpu_matrices_it_can_stripe_are_packed():
    assert dot_kernel.pack(torch.randn(32, 8)) is None  # float32
    assert dot_kernel.pack(torch.randn(24, 8).bfloat16()) is None  # out not a multiple of 16
    assert dot_kernel.pack(torch.randn(32, 7).bfloat16()) is None  # in odd
    assert dot_kernel.pack(torch.randn(32).bfloat16()) is None


@needs_dot
def test_bad_inputs_get_a_clear_error():
    striped = dot_kernel.pack(torch.randn(32, 8).bfloat16())
    with pytest.raises(RuntimeError, match="x has 6 features, the weight 8"):
        torch.ops.radixkv.dot_linear(torch.zeros(2, 6, dtype=torch.bfloat16), striped)
    with pytest.raises(RuntimeError, match="contiguous bfloat16"):
        torch.ops.radixkv.dot_linear(torch.zeros(2, 8), striped)
    with pytest.raises(RuntimeError, match="int32"):
        torch.ops.radixkv.dot_linear(torch.zeros(2, 8, dtype=torch.bfloat16), striped.view(torch.float32))
    assert dot_kernel.dot_linear(torch.zeros(0, 8, dtype=torch.bfloat16), striped, None).shape == (0, 32)
    if dot_kernel.has_tiles():  # 8 inputs: not whole tiles of 32
        with pytest.raises(RuntimeError, match="AMX tiles need in % 32 == 0, got 8"):
            torch.ops.radixkv.dot_linear(torch.zeros(2, 8, dtype=torch.bfloat16), striped, True)
    else:
        with pytest.raises(RuntimeError, match="cannot use AMX tiles"):
            torch.ops.radixkv.dot_linear(torch.zeros(2, 8, dtype=torch.bfloat16), striped, True)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 96, bias=False)
        self.down = nn.Linear(96, 64, bias=True)
        self.odd = nn.Linear(64, 40, bias=False)  # 40 outputs: not whole stripes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x)) + self.odd(x).sum(-1, keepdim=True)


@needs_dot
def test_the_plan_takes_it_up_to_the_timed_rows_and_only_with_native_kernels():
    model = _Block().bfloat16()
    linears = plan_model(model, timing=Timing(transposed=False, split_one_row=False, dot_rows=8))
    by_name = {p.plan.name: p for p in linears.products}
    for name in ("up", "down"):
        product = by_name[name]
        assert [(r.first, r.last, r.path) for r in product.plan.ranges] == [(1, 8, "dot"), (9, None, "packed")]
        assert product.dot is not None
        x = torch.randn(5, product.weight.shape[1]).bfloat16()
        assert torch.equal(product(x), dot_kernel.dot_linear(x, product.dot, product.bias))
        assert dot_kernel.uses_tiles(product.dot) == (dot_kernel.has_tiles() and product.weight.shape[1] % 32 == 0)
    assert not by_name["odd"].plan.uses("dot") and by_name["odd"].dot is None
    torch_only = plan_model(_Block().bfloat16(), linear_kernels="torch", timing=Timing(dot_rows=8))
    assert not any(p.plan.uses("dot") for p in torch_only.products)
    untimed = plan_model(_Block().bfloat16(), timing=Timing())  # dot_rows 0: oneDNN at every row count
    assert not any(p.plan.uses("dot") for p in untimed.products)


@needs_dot
def test_timing_answers_a_probed_row_count_and_nothing_for_float32(monkeypatch):
    monkeypatch.setattr(tuning, "timed", {})  # what earlier timing runs of this process found
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(192, 128, generator=gen).bfloat16() for _ in range(4)]
    rows, copies = time_dot_rows(weights, repeats=1)
    assert rows in (0, *DOT_TIMED_ROWS)
    assert sorted(copies) == sorted(id(w) for w in weights)  # the plan keeps these instead of packing again
    assert time_dot_rows(weights, repeats=1) == (rows, {})  # timed once per shapes: no copies the second time
    assert time_dot_rows([w.float() for w in weights], repeats=1) == (0, {})
