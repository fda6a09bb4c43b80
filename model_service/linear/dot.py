"""bfloat16 linear layers for few rows on AMX tiles or AVX512-BF16 dot products (native/dot_linear.cpp).

A decode step multiplies a few rows by every weight, so its products are bound by streaming the
weights from memory. oneDNN's packed bf16 products (packed.py) do not reach the memory's speed at
few rows on every CPU; the native kernel reads a weight packed once as stripes of 16 output
features, k-pair-major, and sums each output in float32, rounding to bfloat16 once. Whether it is
faster, and up to how many rows, depends on the CPU (its dot-product throughput against its
memory bandwidth), so the planner offers it only up to the row count a timing run at load found
it faster (tuning.time_dot_rows). On CPUs with AMX the kernel feeds the same packed weight to the
tile unit (16 rows x 4 stripes x 32 k per group of instructions) where the input size is a
multiple of 32 (`uses_tiles`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from model_service import native

STRIPE = 16  # output features per stripe: one 512-bit register of float32 sums
PROBE_TOLERANCE = 2e-2  # as packed.py's: a bf16 product in another summation order
TILE_PAIRS = 16  # k pairs per AMX B tile: the tile path needs in % 32 == 0


def available() -> bool:
    """Whether the native kernel runs here (the library is loaded and the CPU has AVX512-BF16)."""
    return native.available() and native.has_bf16_dot_products()


@functools.cache
def has_tiles() -> bool:
    """Whether the kernel can use AMX tiles here (the CPU has them and Linux lets this process)."""
    return available() and bool(torch.ops.radixkv.has_amx_tiles())


def uses_tiles(packed: torch.Tensor) -> bool:
    """Whether products with this packed weight run on AMX tiles (else on dot products)."""
    return has_tiles() and packed.shape[1] % TILE_PAIRS == 0


def engine(packed: torch.Tensor | None = None) -> str:
    """What the kernel runs on here, for logs: for this packed weight, or where the tiles are usable."""
    tiles = has_tiles() if packed is None else uses_tiles(packed)
    return "AMX tiles" if tiles else "AVX512-BF16 dot products"


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight [out, in] as int32 [out / 16, in / 2, 16] (lane l of stripe s at pair p holds
    W[16 s + l][2 p : 2 p + 2]), or None when the kernel does not take it (not a bf16 CPU matrix,
    out not a multiple of 16, in odd, the kernel unavailable, or a probe that disagrees with F.linear)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return None
    out_features, in_features = weight.shape
    if out_features % STRIPE or in_features % 2 or not out_features or not in_features or not available():
        return None
    w = weight.detach().contiguous()
    packed = (w.view(out_features // STRIPE, STRIPE, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()
              .view(torch.int32).view(out_features // STRIPE, in_features // 2, STRIPE))
    probe = torch.randn(3, in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    got, want = dot_linear(probe, packed, None), F.linear(probe, w)
    if not torch.allclose(got.float(), want.float(), rtol=PROBE_TOLERANCE, atol=PROBE_TOLERANCE):
        return None
    return packed


def dot_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
               tiles: bool | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with `packed = pack(weight)`. x: [..., in] bf16 -> [..., out].
    tiles: on AMX tiles (default: `uses_tiles(packed)`, which callers on hot paths pass once)."""
    rows = x.reshape(-1, x.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.ops.radixkv.dot_linear(rows, packed, uses_tiles(packed) if tiles is None else tiles)  # [rows, out]
    if bias is not None:
        out.add_(bias)
    return out.view(*x.shape[:-1], out.shape[-1])
