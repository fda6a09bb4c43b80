"""Choosing, per machine, whether the short-input GEMM paths of short_gemm.py pay off.

Both paths compute what `F.linear` computes (bit for bit for the bundled model's shapes, see
short_gemm.py), but whether they are faster depends on the CPU: measured on 2 AMD EPYC cores, the
transposed product made the GEMMs of a batch-16 decode step 81 -> 68 ms and the one-token split
a batch-1 step ~100 -> ~85 ms; on 2 Intel Xeon (AMX) cores the same transposed GEMMs took 61.9 ms
against `F.linear`'s 51.0, and batch-1 decode ran at 63 ms per token against transformers' 36
with plain two-thread `F.linear`. So at load the model service times each path against
`F.linear` on the model's own weights (passes over all of them, as a step makes; about a second
for the bundled model) and keeps a path only where it is clearly faster.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from model_service import short_gemm
from model_service.fused_linear import FusedGroup, FusedSlice
from model_service.short_gemm import ShortInputLinear, ShortInputPaths, short_linear, single_token_step

log = logging.getLogger(__name__)

ROWS = 32  # a typical decode batch
REPEATS = 5
MIN_GAIN = 0.05  # a path is kept when it saves at least this share of F.linear's time


def _pass_s(weights: list[torch.Tensor], rows: int,
            linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], repeats: int) -> float:
    """Median time of one pass over every weight, in the model's order: each weight streams from
    memory as in a real step (timing one shape in a loop would keep it in cache)."""
    inputs = {w.shape[1]: torch.randn(1, rows, w.shape[1]) for w in weights}  # [1, rows, in]

    def one_pass() -> None:
        for w in weights:
            linear(inputs[w.shape[1]], w)

    one_pass()  # first call: allocation, thread start-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def linear_holders(model: torch.nn.Module) -> list[ShortInputLinear | FusedGroup]:
    """What holds each product the model's linear layers compute: a layer, or a fused group once."""
    holders, groups = [], set()
    for module in model.modules():
        if isinstance(module, ShortInputLinear):
            holders.append(module)
        elif isinstance(module, FusedSlice) and id(module.group) not in groups:
            groups.add(id(module.group))
            holders.append(module.group)
    return holders


def linear_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weight of every product the model's linear layers compute (a fused group's once)."""
    return [holder.weight for holder in linear_holders(model)]


def choose_paths(weights: Iterable[torch.Tensor], repeats: int = REPEATS) -> ShortInputPaths:
    """Times short_gemm's paths against F.linear on these float32 CPU weights ([out, in] each) and
    sets `short_gemm.paths` to the faster choice; returns it."""
    weights = [w.detach() for w in weights if w.dim() == 2 and w.dtype == torch.float32 and w.device.type == "cpu"]
    if not weights:
        short_gemm.paths = ShortInputPaths()
        return short_gemm.paths
    short_gemm.paths = ShortInputPaths(transposed=True, split_one_row=True)  # time the paths themselves
    with torch.inference_mode():
        plain = _pass_s(weights, ROWS, F.linear, repeats)
        transposed = _pass_s(weights, ROWS, short_linear, repeats)
        plain_one = _pass_s(weights, 1, F.linear, repeats)
        with single_token_step():
            split_one = _pass_s(weights, 1, short_linear, repeats)
    chosen = ShortInputPaths(transposed=transposed < (1 - MIN_GAIN) * plain,
                             split_one_row=split_one < (1 - MIN_GAIN) * plain_one)
    short_gemm.paths = chosen
    log.info("short-input GEMMs: %d rows %.1f ms F.linear vs %.1f ms transposed; one row %.1f ms vs %.1f ms "
             "split -> %s", ROWS, 1e3 * plain, 1e3 * transposed, 1e3 * plain_one, 1e3 * split_one, chosen)
    return chosen
