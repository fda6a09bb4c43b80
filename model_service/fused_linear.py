"""Fuse sibling projections (q/k/v, gate/up) that read the same input into one GEMM.

Works on the loaded transformers model without copying its code: each sibling `nn.Linear` is
replaced by a `FusedSlice` that shares one concatenated weight. The first sibling called with
an input computes the fused product once; the others return their slice of it. Each output
column is the same dot product as before, so results are bitwise unchanged (checked by the
greedy-identity tests); an input seen for the first time by a later sibling falls back to its
own slice of the weight, so an unusual call order is still correct.
"""

from __future__ import annotations

import torch
from torch import nn

from model_service.short_gemm import model_linear, pack_for_cpu, short_linear

SIBLING_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedGroup:
    """The concatenated weight of sibling projections and the last fused product."""

    def __init__(self, linears: list[nn.Linear], fp32_gemm: str = "mkl", linear_kernels: str = "auto") -> None:
        self.weight = torch.cat([lin.weight.detach() for lin in linears])  # [sum(out), in]
        has_bias = [lin.bias is not None for lin in linears]
        self.bias = torch.cat([lin.bias.detach() for lin in linears]) if all(has_bias) else None
        self.sizes = [lin.out_features for lin in linears]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(linears))]
        # oneDNN's layout (bf16 on CPU) or the blocked kernel's (float32), once
        self.packed_weight, self.blocked_weight = pack_for_cpu(self.weight, self.bias, fp32_gemm, linear_kernels)
        self._input: torch.Tensor | None = None
        self._outputs: tuple[torch.Tensor, ...] = ()

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if index == 0:
            self._input = x
            fused = model_linear(x, self.weight, self.bias, self.packed_weight, self.blocked_weight)
            self._outputs = torch.split(fused, self.sizes, dim=-1)
        elif x is not self._input:
            start, size = self.offsets[index], self.sizes[index]
            bias = self.bias[start:start + size] if self.bias is not None else None
            return short_linear(x, self.weight[start:start + size], bias)
        out = self._outputs[index]
        if index == len(self.sizes) - 1:  # last sibling: drop references
            self._input, self._outputs = None, ()
        return out


class FusedSlice(nn.Module):
    """Stands in for one sibling projection."""

    def __init__(self, group: FusedGroup, index: int, in_features: int) -> None:
        super().__init__()
        self.group = group
        self.index = index
        self.in_features = in_features
        self.out_features = group.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(x, self.index)


def fuse_sibling_projections(model: nn.Module, fp32_gemm: str = "mkl", linear_kernels: str = "auto") -> int:
    """Fuses every q/k/v and gate/up group of plain `nn.Linear`s; returns how many groups.
    fp32_gemm, linear_kernels: how the fused weights are packed (short_gemm.pack_for_cpu)."""
    fused = 0
    for module in list(model.modules()):
        for names in SIBLING_GROUPS:
            linears = [getattr(module, n, None) for n in names]
            if not all(type(lin) is nn.Linear for lin in linears):
                continue
            if len({(lin.in_features, lin.weight.dtype, lin.weight.device) for lin in linears}) != 1:
                continue
            group = FusedGroup(linears, fp32_gemm, linear_kernels)
            for index, (name, lin) in enumerate(zip(names, linears, strict=True)):
                setattr(module, name, FusedSlice(group, index, lin.in_features))
            fused += 1
    return fused
