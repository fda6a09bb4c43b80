"""Making the plan of every linear layer of a model at load (`plan_model`, the one entry point).

For each weight (a layer's, or a fused q/k/v or gate/up group's) and each row count, the
candidates are tried in order, fastest first:

1. `dot` (radixkv's bf16 kernel on AMX tiles or AVX512-BF16 dot products, dot.py): bf16 with
   --linear-kernels auto, up to the row count the timing run found it faster than `packed` here.
2. `packed` (oneDNN's reordered copy): bf16, or float32 with --fp32-gemm onednn; every row count.
3. `blocked` (radixkv's AVX-512 kernel): float32 with --fp32-gemm mkl and --linear-kernels auto,
   no bias, the row counts its probe reproduces MKL's order for (16+, some of 2-15).
4. `split` (one row in one-token steps): large weights, when the timing run finds it faster.
5. `transposed` (2/16-256 rows): float32, when the timing run finds it faster.
6. `F.linear`.

Exact mode takes the first candidate verified bit-identical to F.linear for this shape and row
count (verify.py; blocked's own probe); fast mode takes the first candidate and records whether
it was verified. The plan is logged as one table (`ModelLinears.table`) and exported as a metric.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from model_service.linear import blocked as blocked_kernel
from model_service.linear import dot as dot_kernel
from model_service.linear.blocked import BlockedWeight, probe_rows
from model_service.linear.fused import fuse_sibling_projections
from model_service.linear.packed import FP32_GEMMS, pack_weight, packed_linear
from model_service.linear.plan import MODES, LinearPlan, merge_rows, table
from model_service.linear.product import PlannedLinear, PlannedProduct, Product
from model_service.linear.short import (
    MAX_ROWS,
    MIN_ROWS,
    SingleTokenStep,
    split_linear,
    split_parts,
    splits,
    transposed_linear,
    transposed_rows,
)
from model_service.linear.tuning import Timing, time_dot_rows, time_paths
from model_service.linear.verify import TRANSPOSED_PROBE_ROWS, Verifier, shared

log = logging.getLogger(__name__)

KERNEL_MODES = ("auto", "torch")  # --linear-kernels


def resolve_mode(mode: str, dtype: torch.dtype, fp32_gemm: str) -> str:
    """--linear-mode: auto is exact for float32 with --fp32-gemm mkl, fast otherwise (bf16 keeps
    oneDNN's packed products, which are not F.linear's bits)."""
    if mode not in MODES:
        raise ValueError(f"linear_mode must be one of {', '.join(MODES)}, got {mode!r}")
    if fp32_gemm not in FP32_GEMMS:
        raise ValueError(f"fp32_gemm must be one of {', '.join(FP32_GEMMS)}, got {fp32_gemm!r}")
    if mode == "auto":
        return "exact" if dtype == torch.float32 and fp32_gemm == "mkl" else "fast"
    if mode == "exact" and fp32_gemm == "onednn" and dtype == torch.float32:
        raise ValueError("--linear-mode exact refuses --fp32-gemm onednn (its float32 products are not "
                         "bit-identical to F.linear): use --linear-mode fast or --fp32-gemm mkl")
    return mode


@dataclass(slots=True)
class ModelLinears:
    """Every planned product of a model, their shared one-token step and the timing run."""

    mode: str
    products: list[PlannedProduct] = field(default_factory=list)
    step: SingleTokenStep = field(default_factory=SingleTokenStep)
    timing: Timing | None = None  # None: not timed (not on CPU, or no float32 weight)

    @property
    def plans(self) -> list[LinearPlan]:
        return [p.plan for p in self.products]

    def table(self) -> str:
        return table(self.plans)

    def packed_weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(weight, oneDNN copy) of every product whose plan takes the packed path."""
        return [(p.weight, p.packed) for p in self.products if p.packed is not None]

    def single_token_step(self):
        """Context for a step of one token (one intra-op thread, large products split)."""
        return self.step.enter()


@dataclass(slots=True)
class _Candidates:
    """What one weight could take, and the verification answers asked so far."""

    name: str
    weight: torch.Tensor
    bias: torch.Tensor | None
    mode: str
    packed: torch.Tensor | None
    blocked: BlockedWeight | None
    dot: torch.Tensor | None  # dot.py's copy
    dot_rows: int  # inputs of up to this many rows may take it
    split_parts: int  # > 1: the split path is a candidate for one row
    transposed: range
    verifier: Verifier
    packed_note: str

    def choose(self, rows: int) -> tuple[str, bool, str]:
        """(path, verified, why) for inputs of `rows` rows (MAX_ROWS + 1: every longer input)."""
        refused: list[str] = []
        for path, verified, why in self._candidates(rows):
            if verified():
                return path, True, _why(why, refused)
            if self.mode == "fast":
                return path, False, _why(f"{why}; not verified bit-identical (fast mode)", refused)
            refused.append(path)
        raise AssertionError("F.linear is always a candidate")

    def _candidates(self, rows: int):
        w, b = self.weight, self.bias
        if self.dot is not None and rows <= self.dot_rows:
            yield ("dot", lambda: self.verifier.dot(w, b, self.dot),
                   f"radixkv kernel on {dot_kernel.engine(self.dot)}, faster than oneDNN here up to {self.dot_rows} rows (timed)")
        if self.packed is not None:
            yield "packed", lambda: self.verifier.packed(w, b, self.packed), self.packed_note
        if self.blocked is not None and self.blocked.takes(rows):
            yield "blocked", lambda: True, f"AVX-512 kernel in MKL's order (block {self.blocked.block}), probed"
        if rows == 1 and self.split_parts > 1:
            yield ("split", lambda: self.verifier.split(w, b, self.split_parts),
                   f"one-token steps: {self.split_parts} concurrent parts (else F.linear)")
        if rows in self.transposed:
            probe = (rows,) if rows < MIN_ROWS else probe_rows(w, TRANSPOSED_PROBE_ROWS)
            where = "that row count" if rows < MIN_ROWS else f"{len(probe)} row counts from {MIN_ROWS}"
            yield ("transposed", lambda: self.verifier.transposed(w, b, probe),
                   f"(W @ x.T).T, faster here; checked at {where}")
        yield "F.linear", lambda: True, "the reference"


def _why(why: str, refused: list[str]) -> str:
    return f"{why}; refused (not bit-identical here): {', '.join(refused)}" if refused else why


def _path_fn(path: str, candidates: _Candidates, rows: int, step: SingleTokenStep) -> Product:
    w, b = candidates.weight, candidates.bias
    if path == "dot":
        striped = candidates.dot
        tiles = dot_kernel.uses_tiles(striped)
        return lambda x: dot_kernel.dot_linear(x, striped, b, tiles)
    if path == "packed":
        packed = candidates.packed
        return lambda x: packed_linear(x, packed, b)
    if path == "blocked":
        blocked = candidates.blocked
        split = blocked.split(rows) if rows <= MAX_ROWS else None
        return lambda x: blocked_kernel.blocked_linear(x, blocked, split)
    if path == "split":
        return lambda x: split_linear(x, w, b, step.parts) if step.parts > 1 else F.linear(x, w, b)
    if path == "transposed":
        return lambda x: transposed_linear(x, w, b)
    return lambda x: F.linear(x, w, b)


def plan_weight(name: str, weight: torch.Tensor, bias: torch.Tensor | None, *, mode: str, fp32_gemm: str,
                linear_kernels: str, timing: Timing | None, step: SingleTokenStep,
                verifier: Verifier, choices: dict | None = None,
                copies: tuple[torch.Tensor, torch.Tensor] | None = None) -> PlannedProduct:
    """The plan of one weight [out, in] (and bias) and the product that follows it. `choices`: a
    memo of the per-row choices by what they depend on (weights of one shape choose alike);
    `copies`: the bf16 timing run's (oneDNN's, dot.py's) copies of this weight, used instead of new ones."""
    weight = weight.detach()
    bias = None if bias is None else bias.detach()
    cpu = weight.device.type == "cpu" and weight.dim() == 2 and min(weight.shape) > 0
    packed = copies[0] if copies is not None else pack_weight(weight, fp32_gemm) if cpu else None
    blocked = None
    if cpu and packed is None and bias is None and fp32_gemm == "mkl" and linear_kernels == "auto":
        blocked = blocked_kernel.pack(weight)
    timed = timing if timing is not None else Timing(transposed=False, split_one_row=False)
    striped = None
    if cpu and linear_kernels == "auto" and timed.dot_rows > 0:
        striped = copies[1] if copies is not None else dot_kernel.pack(weight)
    candidates = _Candidates(
        name, weight, bias, mode, packed, blocked, striped, timed.dot_rows,
        split_parts() if cpu and timed.split_one_row and splits(weight) else 0,
        transposed_rows(weight) if cpu and timed.transposed else range(0),
        verifier,
        "oneDNN, weight reordered once" + (" (--fp32-gemm onednn)" if weight.dtype == torch.float32 else ""))
    key = (tuple(weight.shape), weight.dtype, bias is None, packed is None, striped is None, timed.dot_rows,
           None if blocked is None else (blocked.block, blocked.short_splits), candidates.split_parts,
           candidates.transposed, mode, id(verifier))
    choices = {} if choices is None else choices
    if key not in choices:
        choices[key] = ([candidates.choose(rows) for rows in range(1, MAX_ROWS + 1)], candidates.choose(MAX_ROWS + 1))
    per_row, tail = choices[key]
    plan = LinearPlan(name, (int(weight.shape[0]), int(weight.shape[-1])), str(weight.dtype).removeprefix("torch."),
                      mode, merge_rows(per_row, tail))
    fns: dict[tuple[str, int | None], Product] = {}

    def fn(path: str, rows: int) -> Product:
        key = (path, blocked.split(rows) if path == "blocked" and rows <= MAX_ROWS else None)
        if key not in fns:
            fns[key] = _path_fn(path, candidates, rows, step)
        return fns[key]

    by_rows = [lambda x: F.linear(x, weight, bias)] + [fn(path, r) for r, (path, _, _) in enumerate(per_row, 1)]
    return PlannedProduct(plan, weight, bias, packed if plan.uses("packed") else None,
                          blocked if plan.uses("blocked") else None, striped if plan.uses("dot") else None,
                          by_rows, fn(tail[0], MAX_ROWS + 1))


def _linear_layers(model: nn.Module) -> list[tuple[nn.Module, str, str, nn.Linear]]:
    """(parent, attribute, full name, layer) of every plain nn.Linear."""
    found = []
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            if type(child) is nn.Linear:
                found.append((parent, child_name, f"{parent_name}.{child_name}" if parent_name else child_name, child))
    return found


def plan_model(model: nn.Module, *, mode: str = "auto", fp32_gemm: str = "mkl", linear_kernels: str = "auto",
               timing: Timing | None = None, verifier: Verifier | None = None) -> ModelLinears:
    """Fuses q/k/v and gate/up, plans every linear product of `model` and puts the plans in place:
    each plain `nn.Linear` is replaced by a `PlannedLinear` (same Parameters), each fused group
    gets its `product`. `timing`: the timing run's answer (default: run it, on CPU float32
    weights); `verifier`: who checks paths against F.linear (default: the process's memo)."""
    if linear_kernels not in KERNEL_MODES:
        raise ValueError(f"linear_kernels must be one of {', '.join(KERNEL_MODES)}, got {linear_kernels!r}")
    first = next(model.parameters(), None)
    dtype = first.dtype if first is not None else torch.float32
    mode = resolve_mode(mode, dtype, fp32_gemm)
    groups = fuse_sibling_projections(model)
    layers = _linear_layers(model)
    holders: list[tuple[str, torch.Tensor, torch.Tensor | None, Callable[[PlannedProduct], None]]] = []
    for name, group in groups:
        holders.append((name, group.weight, group.bias, lambda p, g=group: setattr(g, "product", p)))
    replaced: dict[int, PlannedLinear] = {}  # one wrapper per layer object, however often it appears

    def put(product: PlannedProduct, parent: nn.Module, attr: str, layer: nn.Linear) -> None:
        if id(layer) not in replaced:
            replaced[id(layer)] = PlannedLinear(layer, product)
        setattr(parent, attr, replaced[id(layer)])

    for parent, attr, name, layer in layers:
        holders.append((name, layer.weight, layer.bias, lambda p, a=(parent, attr, layer): put(p, *a)))
    cpu_float32 = [w for _, w, _, _ in holders if w.device.type == "cpu" and w.dtype == torch.float32]
    cpu_bf16 = [w for _, w, _, _ in holders if w.device.type == "cpu" and w.dtype == torch.bfloat16]
    on_cpu = any(w.device.type == "cpu" for _, w, _, _ in holders)
    copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # the bf16 timing run's, by id(weight)
    if timing is None and on_cpu:
        timing = time_paths(cpu_float32) if cpu_float32 else Timing()
        if cpu_bf16 and linear_kernels == "auto" and dot_kernel.available():
            dot_rows, copies = time_dot_rows(cpu_bf16)
            timing = dataclasses.replace(timing, dot_rows=dot_rows)
    linears = ModelLinears(mode, timing=timing)
    products: dict[tuple[int, int], PlannedProduct] = {}  # a layer that appears twice is planned once
    choices: dict = {}
    for name, weight, bias, place in holders:
        key = (id(weight), id(bias))
        if key not in products:
            products[key] = plan_weight(name, weight, bias, mode=mode, fp32_gemm=fp32_gemm,
                                        linear_kernels=linear_kernels, timing=timing, step=linears.step,
                                        verifier=verifier or shared, choices=choices,
                                        copies=copies.pop(id(weight), None))
            linears.products.append(products[key])
        place(products[key])
    linears.step.enabled = any(p.plan.uses("split") for p in linears.products)
    return linears
