"""A weight's product as its plan computes it: `PlannedProduct` (a plain callable, the decode hot
path) and `PlannedLinear`, the module that stands in for an `nn.Linear` and calls it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from model_service.linear.blocked import BlockedWeight
from model_service.linear.plan import LinearPlan

Product = Callable[[torch.Tensor], torch.Tensor]


class PlannedProduct:
    """x [..., in] -> x @ weight.T + bias, each row count through the path its plan gives it.

    The plan is resolved at load into one callable per row count up to MAX_ROWS and one for
    longer inputs, so a call costs a row count and an index (no per-call rules). An input of
    another dtype than the weight's (not one the model passes) takes F.linear."""

    __slots__ = ("plan", "weight", "bias", "packed", "blocked", "dot", "dtype", "_by_rows", "_tail")

    def __init__(self, plan: LinearPlan, weight: torch.Tensor, bias: torch.Tensor | None,
                 packed: torch.Tensor | None, blocked: BlockedWeight | None, dot: torch.Tensor | None,
                 by_rows: Sequence[Product], tail: Product) -> None:
        self.plan = plan
        self.weight = weight  # [out, in]
        self.bias = bias
        self.packed = packed  # oneDNN's copy, kept only where the plan takes it
        self.blocked = blocked  # the blocked kernel's copy, kept only where the plan takes it
        self.dot = dot  # the bf16 dot-product kernel's copy, kept only where the plan takes it
        self.dtype = weight.dtype
        self._by_rows = tuple(by_rows)  # [rows] -> the path for inputs of that many rows
        self._tail = tail  # inputs of len(by_rows) rows or more

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype is not self.dtype:
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        by_rows = self._by_rows
        return (by_rows[rows] if rows < len(by_rows) else self._tail)(x)


class PlannedLinear(nn.Module):
    """Stands in for an `nn.Linear`: the same `weight` and `bias` Parameters (so names, tying and
    state dicts are unchanged), its product through `product`."""

    def __init__(self, linear: nn.Linear, product: PlannedProduct) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.product = product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
