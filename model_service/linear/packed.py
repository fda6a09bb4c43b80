"""bfloat16 (and, opted in, float32) linear layers on CPU through oneDNN with the weight
reordered once, at load.

`F.linear` on a bf16 CPU tensor also reaches oneDNN (AMX / AVX-512 BF16 kernels), but gives it
the weight in PyTorch's plain layout, which oneDNN reorders into its blocked layout on every
call: for the short inputs of decode steps that is most of the work. Reordering each weight once
(`torch.ops.mkldnn._reorder_linear_weight`, the packing torch.compile's CPU backend does) and
calling `mkldnn::_linear_pointwise` with it skips that per-call reorder: decode-sized inputs get
faster, long prefills (where the reorder is a small part of the product) stay the same.

float32 keeps `F.linear`/MKL by default: greedy output must equal transformers' bit for bit, and
oneDNN's fp32 kernels sum in another order. `--fp32-gemm onednn` (FP32_GEMMS) packs float32
weights too: on CPUs where MKL takes a slow path (AMD: it dispatches by vendor, not by ISA) that
is over twice as fast at every row count, and outputs differ from transformers' in the last bits,
so greedy output may part where the top-2 logits nearly tie (as vLLM's does). Where torch has no
oneDNN (no mkldnn build, a CPU without bf16 support for bf16) or the packed product disagrees
with `F.linear` on a probe at load, weights stay unpacked and `F.linear` is used.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

PACK_FOR_ROWS = 32  # oneDNN's layout hint; measured the same or better than others for 1-1056 rows
FP32_GEMMS = ("mkl", "onednn")  # --fp32-gemm: F.linear (bitwise transformers) or packed oneDNN


def _available(dtype: torch.dtype = torch.bfloat16) -> bool:
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        return dtype == torch.float32 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def pack_weight(weight: torch.Tensor, fp32_gemm: str = "mkl") -> torch.Tensor | None:
    """The weight [out, in] in oneDNN's layout, or None when it should stay as it is: bfloat16
    weights are packed, float32 ones only with fp32_gemm="onednn"."""
    packable = weight.dtype == torch.bfloat16 or (weight.dtype == torch.float32 and fp32_gemm == "onednn")
    if weight.device.type != "cpu" or not packable or weight.dim() != 2 or not _available(weight.dtype):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_FOR_ROWS)
        probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [None], "")
    except RuntimeError:
        return None
    want = F.linear(probe, weight.detach())
    tol = 2e-2 if weight.dtype == torch.bfloat16 else 1e-4
    if got.shape != want.shape or got.dtype != want.dtype or \
            not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol):
        return None
    return packed


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with `packed = pack_weight(weight)`. x: [..., in] -> [..., out]."""
    rows = x.reshape(-1, x.shape[-1])  # [rows, in]
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [None], "")  # [rows, out]
    return out.view(*x.shape[:-1], out.shape[-1])


def warm_up(weights: Iterable[tuple[torch.Tensor, torch.Tensor]], max_rows: int) -> int:
    """Runs every distinct packed weight shape of `weights` ((weight, packed copy) pairs, as
    `ModelLinears.packed_weights()` lists them) once for each row count 1..max_rows.

    oneDNN builds (JIT-compiles) its kernel on the first call of a new (rows, weight) shape:
    without this, the first steps that meet each decode batch size pay those builds, a stall
    spread over the first workload after start. Returns the calls made.
    """
    shapes: dict[tuple, tuple[torch.Tensor, int]] = {}
    for weight, packed in weights:
        shapes.setdefault((tuple(weight.shape), weight.dtype), (packed, weight.shape[1]))
    calls = 0
    with torch.inference_mode():
        for (_, dtype), (packed, in_features) in shapes.items():
            for rows in range(1, max_rows + 1):
                packed_linear(torch.zeros(rows, in_features, dtype=dtype), packed, None)
                calls += 1
    return calls
