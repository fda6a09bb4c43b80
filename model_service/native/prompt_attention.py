"""Causal attention of one float32 prompt, bitwise torch's (prompt_attention.cpp), and where it applies.

`F.scaled_dot_product_attention(q, k, v, is_causal=True)` over a whole prompt is the call
transformers makes; the model service keeps that call's exact result for fresh prompts so that
greedy output stays transformers' own. `prompt_attention` computes the same result about 3x faster
by summing in the order torch's CPU flash kernel and MKL sum in (the .cpp file says which order).
MKL sums some small products differently (fewer than 4 query rows, fewer than 12 keys), so lengths
whose split would make such a product (`takes_length`) keep torch's call, and the registry's probe
(registry.py, `prompt_attention`) checks at first use, on random inputs of PROBE_LENGTHS, that this
torch and MKL sum as expected.
"""

from __future__ import annotations

import torch

from model_service import native

MAX_HEAD_DIM = 192  # q.k is then one MKL chain
KV_SPLIT = 512  # torch's key block
MIN_KEYS = 12  # a key block of fewer keys: MKL takes another path for q.k
MIN_QUERY_ROWS = 4  # a query block of fewer rows: MKL takes another path
PROBE_LENGTHS = (12, 16, 37, 100, 200, 300, 511, 530, 777, 1056, 1300)  # the registry's probe: every one it takes


def torch_query_split(length: int) -> int:
    """Query rows per block in torch's CPU flash kernel for a prompt of `length` tokens."""
    return 256 if length >= 768 else 64 if length >= 192 else 32


def takes_length(length: int) -> bool:
    """Whether every product torch's kernel makes for this length is one MKL sums as reproduced."""
    if length < MIN_KEYS or (length - 1) % KV_SPLIT + 1 < MIN_KEYS:
        return False
    split = torch_query_split(length)
    return length <= split or length % split == 0 or length % split >= MIN_QUERY_ROWS


def takes_head_dim(head_dim: int) -> bool:
    """Whether q.k over this head_dim is one MKL chain (the order the kernel reproduces)."""
    return head_dim <= MAX_HEAD_DIM


def supports(dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int,
             device: torch.device) -> bool:
    """Whether this model's float32 prompts can take the kernel (library loaded, shapes it takes);
    whether it then matches torch here is the registry's probe."""
    return (dtype == torch.float32 and device.type == "cpu" and takes_head_dim(head_dim)
            and native.supports(dtype, num_q_heads, num_kv_heads, head_dim, device))


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one prompt. q [1, Hq, T, D], k, v [1, Hkv, T, D] float32 (last dim
    contiguous); returns o [1, Hq, T, D] (a transposed view of [1, T, Hq, D])."""
    return torch.ops.radixkv.prompt_attention(q, k, v, scale)
