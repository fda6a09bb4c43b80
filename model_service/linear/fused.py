"""Fuse sibling projections (q/k/v, gate/up) that read the same input into one GEMM.

Works on the loaded transformers model without copying its code: each sibling `nn.Linear` is
replaced by a `FusedSlice` that shares one concatenated weight. The first sibling called with
an input computes the fused product once (through the group's planned product, set by
`plan_model`); the others return their slice of it. Each output column is the same dot product
as before, so results are bitwise unchanged (checked by the greedy-identity tests); an input
seen for the first time by a later sibling falls back to `F.linear` with its own slice of the
weight (what transformers computes for it), so an unusual call order is still correct.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

SIBLING_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedGroup:
    """The concatenated weight of sibling projections and the last fused product."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.weight = torch.cat([lin.weight.detach() for lin in linears])  # [sum(out), in]
        has_bias = [lin.bias is not None for lin in linears]
        self.bias = torch.cat([lin.bias.detach() for lin in linears]) if all(has_bias) else None
        self.sizes = [lin.out_features for lin in linears]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(linears))]
        # x -> x @ weight.T + bias: the planned product (plan_model sets it), F.linear until then
        self.product: Callable[[torch.Tensor], torch.Tensor] = lambda x: F.linear(x, self.weight, self.bias)
        self._input: torch.Tensor | None = None
        self._outputs: tuple[torch.Tensor, ...] = ()

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if index == 0:
            self._input = x
            self._outputs = torch.split(self.product(x), self.sizes, dim=-1)
        elif x is not self._input:
            start, size = self.offsets[index], self.sizes[index]
            bias = self.bias[start:start + size] if self.bias is not None else None
            return F.linear(x, self.weight[start:start + size], bias)
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


def fuse_sibling_projections(model: nn.Module) -> list[tuple[str, FusedGroup]]:
    """Fuses every q/k/v and gate/up group of plain `nn.Linear`s; returns the groups, each with
    a name for the plan table (the parent module's path and the first sibling's name)."""
    groups = []
    for parent_name, module in list(model.named_modules()):
        for names in SIBLING_GROUPS:
            linears = [getattr(module, n, None) for n in names]
            if not all(type(lin) is nn.Linear for lin in linears):
                continue
            if len({(lin.in_features, lin.weight.dtype, lin.weight.device) for lin in linears}) != 1:
                continue
            group = FusedGroup(linears)
            for index, (name, lin) in enumerate(zip(names, linears, strict=True)):
                setattr(module, name, FusedSlice(group, index, lin.in_features))
            prefix = f"{parent_name}." if parent_name else ""
            groups.append((prefix + "+".join(n.removesuffix("_proj") for n in names), group))
    return groups
