"""float32 linear layers on CPU through radixkv's AVX-512 kernel, bitwise what `F.linear` gives.

Greedy output must equal transformers' token for token, and transformers' float32 products are
`F.linear`, i.e. MKL's sgemm. On AMD CPUs MKL takes a generic code path (it dispatches by vendor,
not by instruction set), a fraction of what AVX-512 FMAs reach. On AMD EPYC with torch 2.13,
MKL sums every output of 4 or more rows in one fixed order: FMA chains
over blocks of 192 consecutive k, the block sums added left to right. `radixkv::blocked_linear`
(native/linear.cpp) computes exactly that order with AVX-512, so its results are F.linear's bit
for bit, several times faster.

That MKL's order is an observation, not a contract: another CPU, MKL version or thread count may
sum differently (with 2 threads MKL splits 5-15 rows into per-thread parts of under 4 rows, which
take another kernel). So at load `pack` probes each weight: the kernel must equal F.linear bit for
bit on random inputs of many row counts from MIN_ROWS up, with one of BLOCK_CANDIDATES as the block;
a weight that fails keeps F.linear. The order depends on the shape, not on the values, so each
distinct shape is probed once per process (about a second in all for SmolLM2-135M). Inputs of
fewer than MIN_ROWS rows take the kernel only where the probe finds their order too: MKL sums 2-3
rows (and, with 2 threads, the 1-3 rows left over after 4-row tiles of 5-11 rows) in another order,
four partial sums over k mod 4 of rounded products, which the kernel computes for the rows from
`blocked_rows` on (linear.cpp); one row keeps F.linear's matrix-vector path (short.py). MKL's
few-row path is slow enough that a decode step of 8 sequences took longer through it than one of
32. The packed copy costs as much memory as the float32 weight itself.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
import torch.nn.functional as F

from model_service import native

log = logging.getLogger(__name__)

LANES = 16  # output features per packed stripe
MIN_ROWS = 16  # fewer rows keep F.linear / short.py's paths (MKL sums 2-15 rows in other orders)
BLOCK_CANDIDATES = (192, 256, 128, 384, 512, 96, 64)  # k per block; 192 is MKL's on AMD EPYC (torch 2.13)
# Row counts the probe checks, most telling first: every decode batch size from 16 to 64, then prefill chunks.
PROBE_ROWS = (16, 17, 31, 32, 33, 47, 64, *range(18, 31), *range(34, 47), *range(48, 64), 96, 257, 1056, 2048)
PROBE_FLOPS = 1e10  # per weight shape: rows are probed while their products stay under this many flops


class BlockedWeight(NamedTuple):
    """A float32 weight [out, in] packed for `blocked_linear`, with the block that matches F.linear."""

    packed: torch.Tensor  # [ceil(out / 16), in, 16], zero padded
    out_features: int
    block: int
    # short_splits[r], r < MIN_ROWS: how many leading rows of an r-row input the blocked order sums
    # (the others: the four-lane order) for F.linear's bits, or -1: the kernel does not take r rows.
    short_splits: tuple[int, ...] = ()

    def split(self, rows: int) -> int | None:
        """How many of an input's `rows` rows the blocked order sums for F.linear's bits (the
        others: the four-lane order), or None where the kernel does not take that row count."""
        if rows >= MIN_ROWS:
            return rows
        found = self.short_splits[rows] if rows < len(self.short_splits) else -1
        return found if found >= 0 else None

    def takes(self, rows: int) -> bool:
        """Whether `blocked_linear` gives F.linear's bits for inputs of `rows` rows."""
        return self.split(rows) is not None


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> [ceil(out / 16), in, 16]: stripes of 16 output features, k-major."""
    out_features, in_features = weight.shape
    stripes = -(-out_features // LANES)
    padded = F.pad(weight.detach().float(), (0, 0, 0, stripes * LANES - out_features))  # [stripes * 16, in]
    return padded.view(stripes, LANES, in_features).transpose(1, 2).contiguous()


def blocked_linear(x: torch.Tensor, weight: BlockedWeight, blocked_rows: int | None = None) -> torch.Tensor:
    """`F.linear(x, W)` for `weight = pack(W)` where `weight.takes` the row count. x: [..., in]
    float32 on CPU -> [..., out]. `blocked_rows`: rows summed in the blocked order (default: all, or
    what the probe found for fewer than MIN_ROWS rows); the rest in the four-lane order."""
    rows = x.reshape(-1, x.shape[-1])  # [rows, in]
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if blocked_rows is None:
        blocked_rows = weight.split(rows.shape[0])
        if blocked_rows is None:
            blocked_rows = rows.shape[0]
    out = torch.ops.radixkv.blocked_linear(rows, weight.packed, weight.out_features, weight.block,
                                           blocked_rows)  # [rows, out]
    return out.view(*x.shape[:-1], weight.out_features)


def probe_rows(weight: torch.Tensor, candidates: tuple[int, ...]) -> tuple[int, ...]:
    """The first of `candidates` (at least one) whose products with `weight` stay under PROBE_FLOPS."""
    flops_per_row = 2 * weight.shape[0] * weight.shape[1]
    rows, spent = [], 0.0
    for r in candidates:
        if spent + r * flops_per_row > PROBE_FLOPS and rows:
            continue
        rows.append(r)
        spent += r * flops_per_row
    return tuple(rows)


def find_block(weight: torch.Tensor, packed: torch.Tensor, generator: torch.Generator) -> int | None:
    """The block size with which `blocked_linear` equals F.linear bit for bit on every probed row
    count, or None."""
    weight = weight.detach()
    candidates = [b for b in BLOCK_CANDIDATES if b < weight.shape[1]] + [weight.shape[1]]
    rows_list = list(probe_rows(weight, PROBE_ROWS))
    inputs = {r: torch.randn(r, weight.shape[1], generator=generator) for r in rows_list}  # [rows, in]
    wants = {}
    for block in dict.fromkeys(candidates):
        candidate = BlockedWeight(packed, weight.shape[0], block)
        for rows in rows_list:
            if rows not in wants:
                wants[rows] = F.linear(inputs[rows], weight)
            if not torch.equal(blocked_linear(inputs[rows], candidate), wants[rows]):
                break
        else:
            return block
        if len(wants) > 1:  # it matched some row counts and not others: no block will match them all
            return None
    return None


def find_short_splits(weight: torch.Tensor, packed: torch.Tensor, block: int,
                      generator: torch.Generator) -> tuple[int, ...]:
    """`BlockedWeight.short_splits` for 2 .. MIN_ROWS - 1 rows: for each, the first of (all rows
    blocked, whole 4-row tiles blocked, none) with which the kernel equals F.linear bit for bit
    (one row always keeps F.linear: -1)."""
    weight = weight.detach()
    candidate = BlockedWeight(packed, weight.shape[0], block)
    x = torch.randn(MIN_ROWS - 1, weight.shape[1], generator=generator)  # [rows, in]
    splits = [-1] * MIN_ROWS
    for rows in range(2, MIN_ROWS):
        want = F.linear(x[:rows], weight)
        orders = (rows,) if weight.shape[1] % 4 else (rows, rows // 4 * 4, 0)
        for blocked_rows in dict.fromkeys(orders):
            if torch.equal(blocked_linear(x[:rows], candidate, blocked_rows), want):
                splits[rows] = blocked_rows
                break
    return tuple(splits)


# (out, in, threads) -> what the probe found: (block, short_splits), or None (the shape keeps F.linear)
probed: dict[tuple[int, int, int], tuple[int, tuple[int, ...]] | None] = {}


def pack(weight: torch.Tensor) -> BlockedWeight | None:
    """`weight` packed for `blocked_linear` if the kernel runs here and reproduces F.linear on its
    shape bit for bit (probed once per shape and thread count), else None."""
    if (weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu"
            or min(weight.shape) == 0 or not native.available()):
        return None
    key = (*weight.shape, torch.get_num_threads())
    if probed.get(key, 0) is None:  # this shape was probed and failed: no copy to pack
        return None
    packed = pack_weight(weight)
    if key not in probed:
        with torch.inference_mode():
            generator = torch.Generator().manual_seed(0)
            block = find_block(weight, packed, generator)
            probed[key] = None if block is None else (block, find_short_splits(weight, packed, block, generator))
        if probed[key] is None:
            log.info("float32 %s products: MKL sums in an order not reproduced here; they keep F.linear",
                     tuple(weight.shape))
            return None
    block, short_splits = probed[key]
    return BlockedWeight(packed, weight.shape[0], block, short_splits)
