"""bfloat16 linear layers on CPU through oneDNN with the weight reordered once, at load.

`F.linear` on a bf16 CPU tensor also reaches oneDNN (AMX / AVX-512 BF16 kernels), but gives it
the weight in PyTorch's plain layout, which oneDNN reorders into its blocked layout on every
call: for the short inputs of decode steps that is most of the work. Reordering each weight once
(`torch.ops.mkldnn._reorder_linear_weight`, the packing torch.compile's CPU backend does) and
calling `mkldnn::_linear_pointwise` with it is measured on 2 Xeon cores (AMX), SmolLM2-135M,
every linear layer of one step: 11.6 -> 7.8 ms at 32 rows, 9.5 -> 5.3 ms at one row, the same
(166 -> 163 ms) for a 1056-token prefill. A decode step of 32 sequences: 75 -> 69 ms.

Only for bfloat16 (float32 keeps `F.linear`/MKL: greedy output must equal transformers' bit for
bit there, and oneDNN's fp32 kernels sum in another order). Where torch has no oneDNN bf16 (no
mkldnn build, a CPU without bf16 support) or the packed product disagrees with `F.linear` on a
probe at load, weights stay unpacked and `F.linear` is used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACK_FOR_ROWS = 32  # oneDNN's layout hint; measured the same or better than others for 1-1056 rows


def _available() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight [out, in] in oneDNN's layout, or None when it should stay as it is."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2 or not _available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_FOR_ROWS)
        probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [None], "")
    except RuntimeError:
        return None
    want = F.linear(probe, weight.detach())
    if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2):
        return None
    return packed


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with `packed = pack_weight(weight)`. x: [..., in] -> [..., out]."""
    rows = x.reshape(-1, x.shape[-1])  # [rows, in]
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [None], "")  # [rows, out]
    return out.view(*x.shape[:-1], out.shape[-1])
