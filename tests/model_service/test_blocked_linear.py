"""radixkv's blocked float32 linear kernel: the packing, its summation order, its probe against
F.linear and where a weight's plan uses it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from model_service import native
from model_service.linear import blocked as blocked_linear
from model_service.linear.blocked import MIN_ROWS, BlockedWeight, pack, pack_weight
from model_service.linear.blocked import blocked_linear as run_blocked
from model_service.linear.planner import plan_weight
from model_service.linear.short import SingleTokenStep
from model_service.linear.tuning import Timing
from model_service.linear.verify import Verifier
from model_service.native import registry

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.unavailable_reason()}")

# SmolLM2-135M shapes (out, in): fused q/k/v, o, fused gate/up, down, lm_head.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def _weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=g) * in_features ** -0.5  # [out, in]


def _blocked_order_reference(x: torch.Tensor, weight: torch.Tensor, block: int) -> torch.Tensor:
    """The kernel's order, emulated: per block a float32 FMA chain from 0 over k (product exact in
    float64, one rounding to float32 per step), block sums added left to right in float32."""
    x64, w64 = x.double(), weight.double()
    out = None
    for k0 in range(0, x.shape[1], block):
        acc = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32)
        for k in range(k0, min(k0 + block, x.shape[1])):
            acc = (torch.outer(x64[:, k], w64[:, k]) + acc.double()).float()
        out = acc if out is None else out + acc
    return out


def _four_lane_order_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """MKL's order for 2-3 rows, emulated: four partial sums (partial l over k = l, l + 4, ...) of
    products rounded to float32, then (p0 + p2) + (p1 + p3)."""
    products = (x[:, None, :].double() * weight[None, :, :].double()).float()  # [rows, out, in], rounded
    partial = torch.zeros(x.shape[0], weight.shape[0], 4, dtype=torch.float32)
    for k0 in range(0, x.shape[1], 4):
        partial = partial + products[:, :, k0:k0 + 4]
    return (partial[..., 0] + partial[..., 2]) + (partial[..., 1] + partial[..., 3])


def test_pack_weight_layout() -> None:
    weight = _weight(37, 5, seed=0)
    packed = pack_weight(weight)
    assert packed.shape == (3, 5, 16) and packed.is_contiguous()
    for n in range(37):
        assert torch.equal(packed[n // 16, :, n % 16], weight[n])
    assert torch.count_nonzero(packed[2, :, 37 - 32:]) == 0  # padding


@needs_native
@pytest.mark.parametrize("block", [1, 7, 64, 192, 1000])
def test_kernel_sums_in_the_blocked_order(block: int) -> None:
    """Bit for bit the order the module documents (so the probe below can only match an MKL that
    sums that way); rows cover 1-8 row micro-kernels, 40 outputs a partial stripe."""
    g = torch.Generator().manual_seed(block)
    weight = torch.randn(40, 300, generator=g)
    x = torch.randn(21, 300, generator=g)
    got = run_blocked(x, BlockedWeight(pack_weight(weight), 40, block))
    assert torch.equal(got, _blocked_order_reference(x, weight, block))


@needs_native
@pytest.mark.parametrize("blocked_rows", [0, 4, 8, 9, 100])
def test_rows_from_blocked_rows_sum_in_the_four_lane_order(blocked_rows: int) -> None:
    """Rows before `blocked_rows` in the blocked order, the others (1-3 at a time) in the four-lane
    order; 40 outputs: a partial stripe."""
    g = torch.Generator().manual_seed(blocked_rows)
    weight = torch.randn(40, 296, generator=g)
    x = torch.randn(13, 296, generator=g)
    got = run_blocked(x, BlockedWeight(pack_weight(weight), 40, 64), blocked_rows)
    split = min(blocked_rows, 13)
    assert torch.equal(got[:split], _blocked_order_reference(x[:split], weight, 64))
    assert torch.equal(got[split:], _four_lane_order_reference(x[split:], weight))


@needs_native
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 150), out_features=st.integers(1, 100), in_features=st.integers(1, 100).map(lambda k: 4 * k),
       block=st.integers(1, 400), seed=st.integers(0, 2**16), row_stride_pad=st.integers(0, 3),
       blocked_rows=st.integers(0, 160))
def test_kernel_matches_float64(rows: int, out_features: int, in_features: int, block: int, seed: int,
                                row_stride_pad: int, blocked_rows: int) -> None:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g)
    x = torch.randn(rows, in_features + row_stride_pad, generator=g)[:, :in_features]  # strided rows
    got = run_blocked(x, BlockedWeight(pack_weight(weight), out_features, block), blocked_rows)
    want = x.double() @ weight.double().T
    bound = 1e-5 * (x.double().abs() @ weight.double().abs().T) + 1e-6
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    assert torch.all((got.double() - want).abs() <= bound)


@needs_native
def test_kernel_rejects_bad_inputs() -> None:
    weight = _weight(32, 8, seed=0)
    packed = pack_weight(weight)
    with pytest.raises(RuntimeError, match="in_features"):
        torch.ops.radixkv.blocked_linear(torch.randn(4, 9), packed, 32, 4, 4)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.radixkv.blocked_linear(torch.randn(4, 8).double(), packed, 32, 4, 4)
    with pytest.raises(RuntimeError, match="stripes"):
        torch.ops.radixkv.blocked_linear(torch.randn(4, 8), packed, 33, 4, 4)
    with pytest.raises(RuntimeError, match="block"):
        torch.ops.radixkv.blocked_linear(torch.randn(4, 8), packed, 32, 0, 4)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.radixkv.blocked_linear(torch.randn(8, 4).T, packed, 32, 4, 8)
    odd = pack_weight(_weight(32, 6, seed=0))
    with pytest.raises(RuntimeError, match="divisible by 4"):
        torch.ops.radixkv.blocked_linear(torch.randn(4, 6), odd, 32, 4, 2)
    assert torch.ops.radixkv.blocked_linear(torch.randn(4, 6), odd, 32, 4, 4).shape == (4, 32)


@needs_native
@pytest.mark.parametrize("shape", SHAPES)
def test_probed_weights_are_bitwise_f_linear(shape: tuple[int, int]) -> None:
    """Where the probe accepts a shape (MKL sums in a block order), every row count from MIN_ROWS
    up, and every shorter one it takes, gives F.linear's bits; where it does not, pack says so
    with None."""
    weight = _weight(*shape, seed=1)
    blocked = pack(weight)
    if blocked is None:
        expected = registry.KERNELS["linear"].expected_mismatch()  # Intel: MKL's own kernels, another order
        pytest.skip(f"as expected on this CPU: {expected}" if expected else
                    "native kernels: this machine's MKL sums these products in an order the kernel does not reproduce")
    g = torch.Generator().manual_seed(2)
    rows_list = [16, 19, 40, 64, 65] if shape[0] > 10000 else [16, 17, 23, 32, 50, 64, 100, 300, 1056]
    short = [rows for rows in range(1, MIN_ROWS) if blocked.takes(rows)]
    assert 1 not in short  # one row keeps F.linear's matrix-vector order
    for rows in short + rows_list:
        x = torch.randn(rows, shape[1], generator=g)
        assert torch.equal(run_blocked(x, blocked), F.linear(x, weight)), rows


@needs_native
def test_probe_rejects_an_order_that_does_not_match(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blocked_linear, "BLOCK_CANDIDATES", (5,))
    monkeypatch.setattr(blocked_linear, "probed", {})
    weight = _weight(64, 1000, seed=3)  # candidates 5 and 1000 (one chain): MKL blocks k otherwise
    assert blocked_linear.find_block(weight, pack_weight(weight), torch.Generator().manual_seed(0)) is None
    assert pack(weight) is None
    assert blocked_linear.probed == {(64, 1000, torch.get_num_threads()): None}
    assert pack(weight) is None  # answered from the probed shapes, nothing packed


def test_pack_declines_what_it_does_not_take() -> None:
    assert pack(_weight(32, 16, seed=0).double()) is None
    assert pack(_weight(32, 16, seed=0).bfloat16()) is None
    assert pack(torch.empty(0, 16)) is None


@needs_native
def test_short_splits_are_the_first_order_that_matches() -> None:
    """find_short_splits on a weight whose 'F.linear' is made to be one of the kernel's orders."""
    weight = _weight(48, 64, seed=5)
    splits = blocked_linear.find_short_splits(weight, pack_weight(weight), 192, torch.Generator().manual_seed(0))
    assert len(splits) == MIN_ROWS and splits[:2] == (-1, -1)
    # This machine's F.linear for these rows is whatever it is; each accepted split reproduces it.
    g = torch.Generator().manual_seed(6)
    x = torch.randn(MIN_ROWS - 1, 64, generator=g)
    blocked = BlockedWeight(pack_weight(weight), 48, 192, splits)
    for rows in range(2, MIN_ROWS):
        assert splits[rows] in (-1, rows, rows // 4 * 4, 0)
        if splits[rows] >= 0:
            assert blocked.takes(rows)
            assert torch.equal(run_blocked(x[:rows], blocked), F.linear(x[:rows], weight)), rows


def _planned(weight: torch.Tensor, bias: torch.Tensor | None = None):
    """The weight's product as an exact-mode plan makes it (no short-input paths offered)."""
    return plan_weight("w", weight, bias, mode="exact", fp32_gemm="mkl", linear_kernels="auto",
                       timing=Timing(transposed=False, split_one_row=False), step=SingleTokenStep(),
                       verifier=Verifier())


@needs_native
def test_the_plan_uses_the_kernel_for_the_rows_it_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = _weight(48, 64, seed=4)
    calls = []
    monkeypatch.setattr(blocked_linear, "blocked_linear",
                        lambda x, w, split=None: calls.append(x.shape) or run_blocked(x, w, split))
    blocked = BlockedWeight(pack_weight(weight), 48, 192)  # no short splits: from MIN_ROWS only
    monkeypatch.setattr(blocked_linear, "pack", lambda w: blocked)
    product = _planned(weight)
    assert [(r.rows(), r.path) for r in product.plan.ranges] == [(f"1-{MIN_ROWS - 1}", "F.linear"),
                                                                  (f"{MIN_ROWS}+", "blocked")]
    for rows in (1, 2, MIN_ROWS - 1):
        x = torch.randn(1, rows, 64)
        assert torch.equal(product(x), F.linear(x, weight))
    assert calls == []
    x = torch.randn(1, MIN_ROWS, 64)  # [1, rows, in] as the model passes it
    out = product(x)
    assert calls == [x.shape] and out.shape == (1, MIN_ROWS, 48)
    assert torch.equal(out, run_blocked(x[0], blocked).unsqueeze(0))
    with_bias = _planned(weight, torch.randn(48))  # a bias keeps F.linear (its addition order is MKL's)
    assert not with_bias.plan.uses("blocked") and with_bias.blocked is None
    assert torch.equal(with_bias(x), F.linear(x, weight, with_bias.bias))
    assert len(calls) == 1
    splits = (-1, -1, -1, 0) + (-1,) * (MIN_ROWS - 4)  # takes 3 rows, in the four-lane order
    monkeypatch.setattr(blocked_linear, "pack", lambda w: blocked._replace(short_splits=splits))
    product = _planned(weight)
    x3 = torch.randn(1, 3, 64)
    product(x3)
    assert calls[-1] == x3.shape
    product(torch.randn(1, 2, 64))
    assert len(calls) == 2  # 2 rows: not taken
