"""Two float32 CPU paths for the short inputs of decode and cache-hit steps: the one-row split
and the transposed product. Which weight takes which for which row count is `plan.py`'s
decision; this module only computes them.

One token (batch-1 decode): every op is too small for intra-op threads, and MKL's
matrix-vector product runs on one core, so the step is memory-bound on a single core while
the others idle. Inside a `SingleTokenStep` the step runs with one intra-op thread (no
OpenMP workers spinning between ops) and each large matrix-vector product is split by weight
rows into one part per core, run concurrently on torch's inter-op pool (`torch.jit.fork`).
Each output element is still the same single-core dot product, so results are bitwise those
of `F.linear`.

Several tokens: `F.linear(x, W)` on CPU asks MKL for `x @ W.T` with the weight as the transposed
right-hand operand. For inputs of a few dozen rows (a decode step of a batch, the suffix after a cache
hit, the logits of a few sequences) the same product computed as `(W @ x.T).T` streams the
weight as the left-hand operand and is much faster on some CPUs (AMD EPYC; tuning.py times it on
the machine at hand). It loses for long inputs (prefill: 512+ rows), so `transposed_rows` stops
at MAX_ROWS.

Every output element is still one dot product over the same weight row, but MKL may sum it in
another order than `F.linear` does: for the bundled model's shapes and 16 or more rows it is
bitwise the same on 2 EPYC cores; other shapes, and 2-15 rows more often, may differ in the
last bit. So the plan verifies each (shape, row count) it would send here, and exact mode
refuses those that differ.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

MIN_ROWS = 16  # below this, only very wide layers are candidates (results differ in the last bit more often)
MAX_ROWS = 256  # above this, F.linear is faster
WIDE_RATIO = 8  # out_features >= WIDE_RATIO * in_features: a logits projection
MIN_SPLIT_ELEMENTS = 1 << 18  # smaller weights: a fork costs more than it saves


class SingleTokenStep:
    """One model's one-token steps: within `enter()`, one intra-op thread and `parts` > 1, the
    number of concurrent parts a one-row product on the split path takes. One per model (held
    by its products), entered by the one thread that runs its steps; not a process global."""

    __slots__ = ("enabled", "parts")

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled  # some product's plan takes the split path for one row
        self.parts = 0  # > 1 only inside enter()

    @contextmanager
    def enter(self) -> Iterator[None]:
        """Runs the body with one intra-op thread (when enabled and the cores allow a split).
        Torch's thread count is process-wide: the caller is the one thread running model steps."""
        threads = torch.get_num_threads()
        parts = split_parts()
        if parts < 2 or not self.enabled:
            yield
            return
        torch.set_num_threads(1)
        self.parts = parts
        try:
            yield
        finally:
            self.parts = 0
            torch.set_num_threads(threads)


def split_parts() -> int:
    """How many concurrent parts a one-row product would be split into here (< 2: none)."""
    return min(torch.get_num_threads(), torch.get_num_interop_threads())


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


def splits(weight: torch.Tensor) -> bool:
    """Whether a one-row product with this weight is a candidate for the split path."""
    return weight.device.type == "cpu" and weight.numel() >= MIN_SPLIT_ELEMENTS


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, parts: int) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a one-row x, the weight's rows in `parts` concurrent parts
    (run it with one intra-op thread: `SingleTokenStep.enter`)."""
    out = _split_rows_linear(x, weight, parts)
    return out if bias is None else out + bias


def transposed_rows(weight: torch.Tensor) -> range:
    """The row counts for which the transposed product is a candidate for this weight [out, in]."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return range(0)
    out_features, in_features = weight.shape
    return range(2 if out_features >= WIDE_RATIO * in_features else MIN_ROWS, MAX_ROWS + 1)


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed as `(weight @ x.T).T` (float32 CPU, x: [..., in])."""
    rows = x.numel() // x.shape[-1]
    out_features, in_features = weight.shape
    x2 = x.reshape(rows, in_features)  # [rows, in]
    if bias is None:
        out_t = torch.mm(weight, x2.t())  # [out, rows]
    else:
        out_t = torch.addmm(bias.unsqueeze(1), weight, x2.t())
    return out_t.t().contiguous().view(*x.shape[:-1], out_features)  # [..., out]
