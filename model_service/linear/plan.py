"""What a model's linear layers compute with: one `LinearPlan` per weight, made at load.

A plan says, for every input row count, which path computes the weight's product and whether
that path was verified bit-identical to `F.linear` for this shape on this machine (and why it was
chosen or refused). Paths (`PATHS`):

- `F.linear`: what transformers runs; the reference, so verified by definition.
- `blocked`: radixkv's AVX-512 kernel summing in MKL's order (blocked.py), verified by its probe.
- `transposed`: `(W @ x.T).T` for short inputs (short.py), verified per row count.
- `split`: one row split across the cores in one-token steps (short.py), verified per shape.
- `dot`: radixkv's kernel for few bf16 rows on AMX tiles or AVX512-BF16 dot products (dot.py), up
  to the row count the timing run found it faster than `packed` here.
- `packed`: oneDNN with the weight reordered once (packed.py): bf16, or float32 with
  `--fp32-gemm onednn`; verified where it happens to equal F.linear bit for bit.

In `exact` mode (the default for float32) a path that was not verified is refused and the row
count takes the next candidate, in the end `F.linear`; in `fast` mode it is taken and the table
says `no`. A timing run (tuning.py) only takes paths away where they are not faster: it never
decides whether an unverified path is taken.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

PATHS = ("F.linear", "dot", "packed", "blocked", "transposed", "split")
MODES = ("auto", "exact", "fast")  # --linear-mode; auto: exact for float32 with --fp32-gemm mkl, else fast


@dataclass(slots=True, frozen=True)
class RowRange:
    """Inputs of `first`..`last` rows (last None: no bound) take `path`."""

    first: int
    last: int | None
    path: str
    verified: bool  # bit-identical to F.linear for this shape and these rows, checked on this machine
    why: str

    def rows(self) -> str:
        if self.last is None:
            return f"{self.first}+"
        return str(self.first) if self.last == self.first else f"{self.first}-{self.last}"


@dataclass(slots=True, frozen=True)
class LinearPlan:
    """The plan of one weight [out, in] (a layer's, or a fused group's concatenated one)."""

    name: str  # module path, e.g. "model.layers.0.self_attn.q+k+v"
    shape: tuple[int, int]  # (out, in)
    dtype: str
    mode: str  # "exact" or "fast"
    ranges: tuple[RowRange, ...]  # ascending, covering 1.. with no gap; the last has last=None

    def range_for(self, rows: int) -> RowRange:
        for r in self.ranges:
            if rows >= r.first and (r.last is None or rows <= r.last):
                return r
        return self.ranges[0]  # 0 rows: the first range's path (F.linear's shape rules)

    def uses(self, path: str) -> bool:
        return any(r.path == path for r in self.ranges)

    @property
    def exact(self) -> bool:
        """Whether every row count takes a path verified bit-identical to F.linear."""
        return all(r.verified for r in self.ranges)


def merge_rows(per_row: list[tuple[str, bool, str]], tail: tuple[str, bool, str]) -> tuple[RowRange, ...]:
    """RowRanges from the choice for rows 1..len(per_row) and `tail` for every row count after."""
    ranges: list[RowRange] = []
    start = 1
    choices = [*per_row, tail]
    for i, choice in enumerate(choices, start=1):
        last = i == len(choices)
        if last or choices[i] != choice:  # choices[i] is the choice for rows i + 1
            ranges.append(RowRange(start, None if last else i, *choice))
            start = i + 1
    return tuple(ranges)


def table(plans: Iterable[LinearPlan]) -> str:
    """The plans as one text table, weights of one shape and plan on one line each."""
    grouped: dict[tuple, list[str]] = {}
    for plan in plans:
        grouped.setdefault((plan.shape, plan.dtype, plan.mode, plan.ranges), []).append(plan.name)
    header = ("weights", "shape", "dtype", "mode", "rows", "path", "verified", "why")
    lines = [header]
    for (shape, dtype, mode, ranges), names in grouped.items():
        label = names[0] if len(names) == 1 else f"{len(names)} x {_common_name(names)}"
        for i, r in enumerate(ranges):
            lines.append((label if i == 0 else "", f"{shape[0]}x{shape[1]}" if i == 0 else "",
                          dtype if i == 0 else "", mode if i == 0 else "", r.rows(), r.path,
                          "yes" if r.verified else "NO", r.why))
    widths = [max(len(line[c]) for line in lines) for c in range(len(header) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=False)) + "  " + line[-1]
                     for line in lines)


def _common_name(names: list[str]) -> str:
    """'model.layers.*.mlp.down_proj' for the names of one weight in every layer."""
    parts = [name.split(".") for name in names]
    if len({len(p) for p in parts}) != 1:
        return names[0] + ", ..."
    return ".".join(column[0] if len(set(column)) == 1 else "*" for column in zip(*parts, strict=True))
