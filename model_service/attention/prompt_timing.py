"""Timing, per machine, whether bfloat16 prompt chunks attend faster through torch's SDPA than
through the native kernel's row kernels (calls with many queries per head run on its AMX tiles
where the CPU has them, faster than both, and are not timed: tile_attention.cpp).

A fresh prompt's attention is a dense causal product over its own K/V; a chunk after a cached
prefix (a cache hit's new tokens, a later chunk of a long prompt) attends over the gathered
context with the causal mask offset by the prefix. In bfloat16 torch's CPU flash kernel computes
its blocks with oneDNN's bf16 GEMMs, which run on AMX tiles where the CPU has them: on an AMX Xeon
that was 2.5-3x faster than the native kernel's AVX512-BF16 dot products for fresh prompts of
256-1056 tokens, and 2-3.5x for chunks of 16-256 tokens over 600-1300 cached (9 query and 3 KV
heads of 64); on CPUs without AMX the native kernel is the faster one. So the backend times both
once per kind, on the model's head shape, in turns, and takes the faster by their best times (the
native kernel unless SDPA saves at least MIN_GAIN): with medians of a few calls each, another
process busy during the start-up once made the slower kernel win. Both compute float32 sums of
bf16 products with one rounding of the probabilities to bf16; neither is transformers' exact bits
in bf16.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from model_service import native
from model_service.median_time import best_seconds

log = logging.getLogger(__name__)

LENGTH = 384  # tokens of the timed fresh prompt: a typical chunk of a prompt
# The timed extend: sequences, new tokens of each, cached tokens before them (a few cache hits' tails).
EXTEND = (4, 64, 512)
REPEATS = 9
MIN_GAIN = 0.05


def _sdpa_faster(what: str, kernel: Callable[[], object], sdpa: Callable[[], object], repeats: int) -> bool:
    # The calls this decides are the ones AMX tiles do not take (few queries per head): the row kernels'.
    with torch.inference_mode(), native.without_attention_tiles():
        kernel_s, sdpa_s = best_seconds([kernel, sdpa], repeats)
    faster = sdpa_s < (1 - MIN_GAIN) * kernel_s
    log.info("bf16 %s attention: native %.2f ms, torch SDPA %.2f ms -> %s", what, 1e3 * kernel_s, 1e3 * sdpa_s,
             "torch SDPA" if faster else "native")
    return faster


def _random(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).bfloat16()


@functools.cache
def sdpa_faster_for_bf16_prompts(num_q_heads: int, num_kv_heads: int, head_dim: int,
                                 length: int = LENGTH, repeats: int = REPEATS) -> bool:
    """Whether torch's SDPA beats the native kernel on a fresh bf16 prompt of this head shape here
    (timed once per process and shape; needs the native library loaded)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (_random((1, heads, length, head_dim), gen) for heads in (num_q_heads, num_kv_heads, num_kv_heads))
    scale = head_dim ** -0.5
    lengths, offsets = torch.tensor([length]), torch.tensor([0])
    return _sdpa_faster(f"prompt ({length} tokens)", lambda: native.attend(q, k, v, lengths, offsets, scale),
                        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                               enable_gqa=num_q_heads != num_kv_heads), repeats)


@functools.cache
def sdpa_faster_for_bf16_extends(num_q_heads: int, num_kv_heads: int, head_dim: int,
                                 shape: tuple[int, int, int] = EXTEND, repeats: int = REPEATS) -> bool:
    """Whether torch's SDPA (with the additive causal mask the backend builds) beats the native
    kernel on bf16 chunks after a cached prefix of this head shape here (`shape`: sequences, new
    tokens of each, cached tokens before them; timed once per process and shape)."""
    num_seqs, new, cached = shape
    r = num_q_heads // num_kv_heads
    gen = torch.Generator().manual_seed(0)
    q = _random((num_seqs, num_q_heads, new, head_dim), gen)
    k, v = (_random((num_seqs, num_kv_heads, cached + new, head_dim), gen) for _ in range(2))
    scale = head_dim ** -0.5
    lengths, offsets = torch.full((num_seqs,), cached + new), torch.full((num_seqs,), cached)
    allowed = torch.arange(cached + new)[None, :] <= cached + torch.arange(new)[:, None]  # [new, context]
    mask = torch.zeros(allowed.shape, dtype=torch.bfloat16).masked_fill(~allowed, float("-inf"))
    mask = mask.repeat(r, 1).expand(num_seqs, 1, r * new, cached + new)  # as the backend folds GQA
    folded = q.reshape(num_seqs, num_kv_heads, r * new, head_dim)
    return _sdpa_faster(f"extend ({num_seqs} x {new} tokens after {cached} cached)",
                        lambda: native.attend(q, k, v, lengths, offsets, scale),
                        lambda: F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scale), repeats)
