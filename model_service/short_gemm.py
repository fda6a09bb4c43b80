"""Faster float32 linear layers on CPU for the short inputs of decode and cache-hit steps.

One token (batch-1 decode): every op is too small for intra-op threads, and MKL's
matrix-vector product runs on one core, so the step is memory-bound on a single core while
the others idle. Inside `single_token_step()` the step runs with one intra-op thread (no
OpenMP workers spinning between ops) and each large matrix-vector product is split by weight
rows into one part per core, run concurrently on torch's inter-op pool (`torch.jit.fork`).
Each output element is still the same single-core dot product, so results are bitwise those
of `F.linear` (measured on 2 EPYC cores, a whole SmolLM2 decode step: ~100 -> ~85 ms).

Several tokens: `F.linear(x, W)` on CPU asks MKL for `x @ W.T` with the weight as the transposed
right-hand operand. For inputs of a few dozen rows (a decode step of a batch, the suffix after a cache
hit, the logits of a few sequences) the same product computed as `(W @ x.T).T` streams the
weight as the left-hand operand and is much faster on this kind of machine: measured on
2 EPYC cores, 16 rows x SmolLM2 shapes, 0.85 -> 0.60 ms for gate/up and 38 -> 22 ms for the
49152-wide lm_head. It loses for long inputs (prefill: 512+ rows), so long inputs keep
`F.linear`.

Every output element is still one dot product over the same weight row. For the bundled
model's shapes and 16 or more rows MKL computes it bitwise like `F.linear` (checked by
tests/model_service/test_short_gemm.py); other shapes may round differently in the last bit,
as `F.linear` itself does between batch sizes. Between 2 and 15 rows the results differ in the
last bit more often, so there only the very wide logits projection, where the gain is 3x,
uses it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model_service import blocked_linear
from model_service.blocked_linear import BlockedWeight
from model_service.packed_linear import pack_weight, packed_linear

MIN_ROWS = 16  # below this, only very wide layers switch (results may differ in the last bit)
MAX_ROWS = 256  # above this, F.linear is faster
WIDE_RATIO = 8  # out_features >= WIDE_RATIO * in_features: a logits projection
MIN_SPLIT_ELEMENTS = 1 << 18  # smaller weights: a fork costs more than it saves

_split_parts = 0  # > 1 inside single_token_step(): one-row products are split this many ways


@dataclass(slots=True)
class ShortInputPaths:
    """Which of the paths above this process takes (set per machine by short_gemm_tuning)."""

    transposed: bool = True  # 2/16-256 rows: (W @ x.T).T instead of F.linear
    split_one_row: bool = True  # one token: single_token_step() (one thread, large products split)


paths = ShortInputPaths()


@contextmanager
def single_token_step() -> Iterator[None]:
    """Runs the body with one intra-op thread, splitting large one-row products across the cores.
    Process-wide (torch's thread count is): for the one thread that runs model steps."""
    global _split_parts
    threads = torch.get_num_threads()
    parts = min(threads, torch.get_num_interop_threads())
    if parts < 2 or not paths.split_one_row:
        yield
        return
    torch.set_num_threads(1)
    _split_parts = parts
    try:
        yield
    finally:
        _split_parts = 0
        torch.set_num_threads(threads)


def _split_rows_linear_eager(x: torch.Tensor, weight: torch.Tensor, num_parts: int) -> torch.Tensor:
    """F.linear (no bias) with the weight's rows split into `num_parts` products run concurrently."""
    weights = weight.chunk(num_parts, 0)
    futures = [torch.jit.fork(F.linear, x, weights[i]) for i in range(1, len(weights))]
    outputs = [F.linear(x, weights[0])]
    for future in futures:
        outputs.append(torch.jit.wait(future))
    return torch.cat(outputs, -1)


# torch.jit.fork runs concurrently only from TorchScript (called from Python it runs inline).
# torch 2.13 deprecates torch.jit.script but offers no other inter-op fork, hence the filter.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    _split_rows_linear = torch.jit.script(_split_rows_linear_eager)


def short_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, computed faster for short float32 CPU inputs (see the module
    docstring for when results are bitwise the same)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    out_features, in_features = weight.shape
    if rows == 1 and _split_parts > 1 and weight.numel() >= MIN_SPLIT_ELEMENTS and x.device.type == "cpu":
        out = _split_rows_linear(x, weight, _split_parts)
        return out if bias is None else out + bias
    wide = out_features >= WIDE_RATIO * in_features
    if (not paths.transposed or x.device.type != "cpu" or x.dtype != torch.float32 or rows > MAX_ROWS
            or rows < (2 if wide else MIN_ROWS)):
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, in_features)  # [rows, in]
    if bias is None:
        out_t = torch.mm(weight, x2.t())  # [out, rows]
    else:
        out_t = torch.addmm(bias.unsqueeze(1), weight, x2.t())
    return out_t.t().contiguous().view(*x.shape[:-1], out_features)  # [..., out]


def model_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 packed_weight: torch.Tensor | None, blocked_weight: BlockedWeight | None = None) -> torch.Tensor:
    """A model layer's product: through `packed_weight` (packed_linear.pack_weight of `weight`)
    when there is one for x's dtype; float32 inputs of a row count `blocked_weight` takes through it
    (blocked_linear.pack of `weight`, bitwise F.linear) when there is one; else
    `short_linear`."""
    if packed_weight is not None and x.dtype == packed_weight.dtype:
        return packed_linear(x, packed_weight, bias)
    if (blocked_weight is not None and bias is None and x.dtype == torch.float32 and x.device.type == "cpu"
            and x.shape[-1] and blocked_weight.takes(x.numel() // x.shape[-1])):
        return blocked_linear.blocked_linear(x, blocked_weight)
    return short_linear(x, weight, bias)


class ShortInputLinear(nn.Linear):
    """`nn.Linear` whose forward is `model_linear`: `short_linear`, the bitwise AVX-512 kernel for
    float32 inputs of many rows, or for bf16 on CPU the oneDNN-packed copy of its weight; same
    parameters."""

    packed_weight: torch.Tensor | None = None
    blocked_weight: BlockedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return model_linear(x, self.weight, self.bias, self.packed_weight, self.blocked_weight)


def pack_for_cpu(weight: torch.Tensor, bias: torch.Tensor | None, fp32_gemm: str,
                 linear_kernels: str) -> tuple[torch.Tensor | None, BlockedWeight | None]:
    """The packed copies `model_linear` takes for this weight: oneDNN's (bf16; float32 with
    fp32_gemm="onednn") and the blocked kernel's (float32 with fp32_gemm="mkl" and
    linear_kernels="auto", where it is bitwise F.linear)."""
    packed = pack_weight(weight, fp32_gemm)
    blocked = None
    if packed is None and bias is None and fp32_gemm == "mkl" and linear_kernels == "auto":
        blocked = blocked_linear.pack(weight)
    return packed, blocked


def use_short_input_gemm(model: nn.Module, fp32_gemm: str = "mkl", linear_kernels: str = "auto") -> int:
    """Switches every plain `nn.Linear` of the model to `ShortInputLinear` in place (parameters
    and weight tying untouched) and packs CPU weights for it (`pack_for_cpu`); returns how many.
    Only CPU float32 and bfloat16 inputs take another path than `F.linear`."""
    switched = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = ShortInputLinear
            module.packed_weight, module.blocked_weight = pack_for_cpu(module.weight, module.bias, fp32_gemm,
                                                                       linear_kernels)
            switched += 1
    return switched
