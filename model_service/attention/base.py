"""The attention backend interface: paged KV write + attention over block tables.

A backend is planned once per scheduler step with a `BatchLayout` (where every sequence's
new tokens go and which blocks hold its context), then run once per layer. Sequences are
packed: the step's new tokens of all sequences are concatenated along the token axis.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class BatchLayout:
    """Where this step's tokens sit. All tensors live on the model's device.

    For sequence i: its new (query) tokens are packed tokens
    `query_start_loc[i] : query_start_loc[i+1]`; they are the last `query_len` positions of its
    context of `seq_lens[i]` tokens (so the cached/earlier prefix is `seq_lens[i] - query_len`
    tokens, any length, not necessarily page-aligned). Context position p of sequence i lives in
    physical block `block_tables[i, p // block_size]`, slot `p % block_size`.
    """

    query_start_loc: torch.Tensor  # [batch + 1] int32, cumulative query lengths, starts at 0
    seq_lens: torch.Tensor  # [batch] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [batch, max_blocks_per_seq] int32, padded with 0 past the end
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat slot (block * block_size + offset) per new token
    max_query_len: int
    max_seq_len: int
    # Host copies (lists) for backends that plan on the CPU.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Packed tokens whose K/V is written, ascending; None: every token (the common case). The
    # others' K/V is already at their slots (a cache hit recomputed for its prompt's logits):
    # possibly pages other sequences read, so never rewritten; attention may read either copy.
    written_rows: torch.Tensor | None = None  # [num_written] int64

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def is_decode(self) -> bool:
        """Every sequence has exactly one new token."""
        return self.max_query_len == 1


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache and computes causal attention over it."""

    name: str

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = dtype
        self.device = device

    @abstractmethod
    def plan(self, layout: BatchLayout) -> None:
        """Prepare index structures for this step (called once per step, before any layer)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """Write k/v at the planned slots (only `written_rows`' when the layout names them), then attend.

        q: [num_tokens, num_q_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        (RoPE already applied). k_cache, v_cache: this layer's
        [num_blocks, block_size, num_kv_heads, head_dim]. Returns [num_tokens, num_q_heads, head_dim].
        Query token j of sequence i sits at context position seq_lens[i] - query_len_i + j and
        attends to positions 0..that position (causal, including the cached prefix).
        """
