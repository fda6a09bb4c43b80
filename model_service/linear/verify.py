"""Checking a path against `F.linear` bit for bit, on this machine, for one weight shape.

A path's summation order depends on the shape, the row count, the dtype, the library and the
thread count, not on the values: so each check runs once per (path, shape, dtype, bias, rows,
threads) on random inputs and the answer is kept for the process (`shared`). The blocked kernel
has its own probe (blocked.pack); this covers the other paths.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from model_service.linear import dot as dot_kernel
from model_service.linear.blocked import probe_rows
from model_service.linear.packed import packed_linear
from model_service.linear.short import split_linear, transposed_linear

# Row counts checked for the transposed path from MIN_ROWS up (each row count below is checked
# on its own), most telling first, while their products stay under PROBE_FLOPS per shape.
TRANSPOSED_PROBE_ROWS = (16, 17, 31, 32, 33, 64, 100, 128, 255, 256)
PACKED_PROBE_ROWS = (1, 2, 3, 5, 16, 32, 33, 64, 257)
DOT_PROBE_ROWS = (1, 2, 3, 5, 16, 32)


class Verifier:
    """Answers whether a path gives F.linear's bits for a weight at some row counts (memoized)."""

    def __init__(self) -> None:
        self.answers: dict[tuple, bool] = {}

    def _key(self, path: str, weight: torch.Tensor, bias: torch.Tensor | None, rows: tuple[int, ...]) -> tuple:
        return (path, tuple(weight.shape), weight.dtype, bias is not None, rows, torch.get_num_threads())

    def _memo(self, key: tuple, check) -> bool:
        if key not in self.answers:
            with torch.inference_mode():
                self.answers[key] = bool(check())
        return self.answers[key]

    @staticmethod
    def _inputs(weight: torch.Tensor, rows: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(rows, weight.shape[1], generator=g).to(weight.dtype)  # [rows, in]

    def _equals_f_linear(self, weight: torch.Tensor, bias: torch.Tensor | None, rows: Iterable[int],
                         product: Callable[[torch.Tensor], torch.Tensor]) -> bool:
        """Whether product(x) equals F.linear(x, weight, bias) bit for bit at every row count."""
        for r in rows:
            x = self._inputs(weight, r, r)
            if not torch.equal(product(x), F.linear(x, weight, bias)):
                return False
        return True

    def transposed(self, weight: torch.Tensor, bias: torch.Tensor | None, rows: tuple[int, ...]) -> bool:
        """Whether (W @ x.T).T equals F.linear at every one of `rows` (a budget may skip some of
        the larger ones: `probe_rows`)."""
        return self._memo(self._key("transposed", weight, bias, rows),
                          lambda: self._equals_f_linear(weight, bias, rows, lambda x: transposed_linear(x, weight, bias)))

    def split(self, weight: torch.Tensor, bias: torch.Tensor | None, parts: int) -> bool:
        """Whether the one-row split, run as a one-token step runs it (one intra-op thread), equals
        F.linear as the rest of the process runs it."""
        def check() -> bool:
            x = self._inputs(weight, 1, 1)
            want = F.linear(x, weight, bias)
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                got = split_linear(x, weight, bias, parts)
            finally:
                torch.set_num_threads(threads)
            return torch.equal(got, want)
        return self._memo(self._key("split", weight, bias, (1, parts)), check)

    def packed(self, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor) -> bool:
        """Whether oneDNN's packed product equals F.linear at every row count of PACKED_PROBE_ROWS."""
        return self._memo(self._key("packed", weight, bias, PACKED_PROBE_ROWS),
                          lambda: self._equals_f_linear(weight, bias, probe_rows(weight, PACKED_PROBE_ROWS),
                                                        lambda x: packed_linear(x, packed, bias)))

    def dot(self, weight: torch.Tensor, bias: torch.Tensor | None, striped: torch.Tensor) -> bool:
        """Whether dot.py's product equals F.linear at every row count of DOT_PROBE_ROWS."""
        return self._memo(self._key("dot", weight, bias, DOT_PROBE_ROWS),
                          lambda: self._equals_f_linear(weight, bias, DOT_PROBE_ROWS,
                                                        lambda x: dot_kernel.dot_linear(x, striped, bias)))


shared = Verifier()  # the process's answers (a memo: every plan_model call asks the same questions)
