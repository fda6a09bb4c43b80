"""Timing, per machine, whether bfloat16 prompts attend faster through torch's SDPA than through
the native kernel.

A fresh prompt's attention is a dense causal product over its own K/V. In bfloat16 torch's CPU
flash kernel computes its blocks with oneDNN's bf16 GEMMs, which run on AMX tiles where the CPU has
them: on an AMX Xeon that was 2.5-3x faster than the native kernel's AVX512-BF16 dot products (256-
1056 tokens, 9 query and 3 KV heads of 64); on CPUs without AMX the native kernel is the faster one.
So the backend times both once, on a prompt of the model's head shape, and takes the faster (the
native kernel unless SDPA saves at least MIN_GAIN). Both compute float32 sums of bf16 products
with one rounding of the probabilities to bf16; neither is transformers' exact bits in bf16.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from model_service import native
from model_service.median_time import median_seconds

log = logging.getLogger(__name__)

LENGTH = 384  # tokens of the timed prompt: a typical chunk of a prompt
REPEATS = 5
MIN_GAIN = 0.05


@functools.cache
def sdpa_faster_for_bf16_prompts(num_q_heads: int, num_kv_heads: int, head_dim: int,
                                 length: int = LENGTH, repeats: int = REPEATS) -> bool:
    """Whether torch's SDPA beats the native kernel on a fresh bf16 prompt of this head shape here
    (timed once per process and shape; needs the native library loaded)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, length, head_dim, generator=gen).bfloat16()
               for heads in (num_q_heads, num_kv_heads, num_kv_heads))
    scale = head_dim ** -0.5
    lengths, offsets = torch.tensor([length]), torch.tensor([0])
    gqa = num_q_heads != num_kv_heads
    with torch.inference_mode():
        kernel = median_seconds(lambda: native.attend(q, k, v, lengths, offsets, scale), repeats)
        sdpa = median_seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                 enable_gqa=gqa), repeats)
    faster = sdpa < (1 - MIN_GAIN) * kernel
    log.info("bf16 prompt attention, %d tokens: native %.2f ms, torch SDPA %.2f ms -> %s", length, 1e3 * kernel,
             1e3 * sdpa, "torch SDPA" if faster else "native")
    return faster
