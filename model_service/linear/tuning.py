"""Timing, per machine, whether the short-input paths of short.py are faster than `F.linear`,
and up to how many rows the bfloat16 dot-product kernel (dot.py) is faster than oneDNN's.

Both paths compute what `F.linear` computes (bit for bit where the plan verified them), but
whether they are faster depends on the CPU: on AMD EPYC cores both beat `F.linear`; on Intel Xeon
(AMX) cores both lost to it (the one-token split against plain two-thread `F.linear`). So at load
the plan times each path against `F.linear` on the model's own
weights (passes over all of them, as a step makes; about a second for the bundled model) and
offers a path only where it is clearly faster.

bfloat16 weights: dot.py's kernel streams the weight at the memory's speed for few rows, but
where it runs on dot products their throughput decides how many rows it takes before oneDNN wins
(on its AMX tiles, 32 rows and more); so the run times both at DOT_TIMED_ROWS.

A timing run decides speed only, never bits: it can take a path away from the plan, and the plan
then still refuses (in exact mode) every path that was not verified bit-identical to `F.linear`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from model_service.linear import dot
from model_service.linear.packed import pack_weight, packed_linear
from model_service.linear.short import split_linear, split_parts, splits, transposed_linear
from model_service.median_time import median_seconds

log = logging.getLogger(__name__)

ROWS = 32  # a typical decode batch
REPEATS = 5
MIN_GAIN = 0.05  # a path is kept when it saves at least this share of F.linear's time
DOT_TIMED_ROWS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)  # kept up to the last of these it wins at
DOT_TIMING_BYTES = 512 << 20  # bf16 weights timed at most (packed twice more for the run)


# What the timing runs found in this process (and, restored by probe_memo.py, earlier starts on
# this machine), by what they timed: (run, weight shapes, dtype, repeats, threads) -> answer.
timed: dict[tuple, object] = {}


def _timed_key(run: str, weights: list[torch.Tensor], repeats: int) -> tuple:
    return (run, tuple(tuple(w.shape) for w in weights), weights[0].dtype, repeats, torch.get_num_threads())


@dataclass(slots=True, frozen=True)
class Timing:
    """Which short-input paths the timing run found faster than F.linear here."""

    transposed: bool = True  # 2/16-256 rows: (W @ x.T).T instead of F.linear
    split_one_row: bool = True  # one token: one thread, large products split across the cores
    dot_rows: int = 0  # bf16: inputs of up to this many rows take dot.py's kernel (0: none)


def _pass_s(weights: list[torch.Tensor], rows: int,
            linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], repeats: int) -> float:
    """Median time of one pass over every weight, in the model's order: each weight streams from
    memory as in a real step (timing one shape in a loop would keep it in cache)."""
    inputs = {w.shape[1]: torch.randn(1, rows, w.shape[1]).to(w.dtype) for w in weights}  # [1, rows, in]

    def one_pass() -> None:
        for w in weights:
            linear(inputs[w.shape[1]], w)

    return median_seconds(one_pass, repeats)


def _split_pass_s(weights: list[torch.Tensor], repeats: int) -> float:
    """`_pass_s` of the one-row split, run as a single-token step runs it (one intra-op thread)."""
    parts = split_parts()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _pass_s(weights, 1, lambda x, w: split_linear(x, w, None, parts) if splits(w) else F.linear(x, w),
                       repeats)
    finally:
        torch.set_num_threads(threads)


def time_paths(weights: Iterable[torch.Tensor], repeats: int = REPEATS) -> Timing:
    """Times short.py's paths against F.linear on these float32 CPU weights ([out, in] each)."""
    weights = [w.detach() for w in weights if w.dim() == 2 and w.dtype == torch.float32 and w.device.type == "cpu"]
    if not weights:
        return Timing()
    key = _timed_key("paths", weights, repeats)
    if isinstance(timed.get(key), Timing):
        log.info("short-input GEMMs: as timed before on this machine -> %s", timed[key])
        return timed[key]
    with torch.inference_mode():
        plain = _pass_s(weights, ROWS, F.linear, repeats)
        transposed = _pass_s(weights, ROWS, transposed_linear, repeats)
        plain_one = _pass_s(weights, 1, F.linear, repeats)
        split_one = _split_pass_s(weights, repeats) if split_parts() > 1 else plain_one
    timing = Timing(transposed=transposed < (1 - MIN_GAIN) * plain,
                    split_one_row=split_one < (1 - MIN_GAIN) * plain_one)
    log.info("short-input GEMMs: %d rows %.1f ms F.linear vs %.1f ms transposed; one row %.1f ms vs %.1f ms "
             "split -> %s", ROWS, 1e3 * plain, 1e3 * transposed, 1e3 * plain_one, 1e3 * split_one, timing)
    timed[key] = timing
    return timing


class DotTiming(NamedTuple):
    """time_dot_rows' answer, and the copies it made, for the plan to keep instead of making them again."""

    rows: int  # dot.py's kernel is faster up to this many rows (0: at none)
    copies: dict[int, tuple[torch.Tensor, torch.Tensor]]  # id(weight) -> (oneDNN's copy, dot.py's copy)


def time_dot_rows(weights: Iterable[torch.Tensor], repeats: int = 3) -> DotTiming:
    """Up to how many rows dot.py's kernel beats oneDNN's packed product on these bf16 CPU weights
    ([out, in] each): the largest of DOT_TIMED_ROWS at which it, and at every smaller one, saved
    at least MIN_GAIN of the time. 0 where it never does or either cannot take the weights. An
    answer found before for the same weight shapes is returned without copies."""
    weights = [w for w in weights if w.dim() == 2 and w.dtype == torch.bfloat16 and w.device.type == "cpu"]
    key = _timed_key("dot", weights, repeats) if weights else None
    if key is not None and type(timed.get(key)) is int:
        log.info("bf16 GEMMs: as timed before on this machine -> radixkv up to %d rows", timed[key])
        return DotTiming(timed[key], {})
    pairs, size = [], 0
    for w in weights:
        if size >= DOT_TIMING_BYTES:
            break
        packed, striped = pack_weight(w.detach()), dot.pack(w)
        if packed is None or striped is None:
            continue
        pairs.append((w, packed, striped))
        size += w.numel() * w.element_size()
    by_id = {id(w): (packed, striped) for w, packed, striped in pairs}
    if not pairs:
        return DotTiming(0, by_id)
    ws = [w for w, _, _ in pairs]
    best, times = 0, []
    with torch.inference_mode():
        for rows in DOT_TIMED_ROWS:
            onednn = _pass_s(ws, rows, lambda x, w: packed_linear(x, by_id[id(w)][0], None), repeats)
            striped = _pass_s(ws, rows, lambda x, w: dot.dot_linear(x, by_id[id(w)][1], None), repeats)
            times.append(f"{rows}: {1e3 * onednn:.1f}/{1e3 * striped:.1f}")
            if striped >= (1 - MIN_GAIN) * onednn:
                break
            best = rows
    log.info("bf16 GEMMs, ms per pass (oneDNN / radixkv on %s) at rows %s -> radixkv up to %d rows",
             dot.engine(), ", ".join(times), best)
    timed[key] = best
    return DotTiming(best, by_id)
