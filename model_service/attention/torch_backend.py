"""Reference paged attention in plain PyTorch (CPU and CUDA).

Per layer: scatter the step's new K/V into their slots, gather every sequence's context
block by block (`index_select` over the flattened block axis), and run
`scaled_dot_product_attention` with GQA, batched over sequences (padded, with masks).

A step is split into at most two groups that are attended separately, so that a long
prefill chunk does not pad every decode row of a mixed batch to its length:

- decode group: sequences with one new token; keys padded to the group's longest context,
  a key-padding mask only when context lengths differ;
- extend group: sequences with several new tokens (prefill or prefill chunk after a cached
  prefix); queries padded to the longest chunk, a causal mask offset by each cached prefix.
  A single sequence without cached prefix attends over its own new K/V with `is_causal=True`,
  exactly the call dense attention makes.

Everything shared by the layers (gather indices, query padding indices, additive masks,
rows to zero after the gather) is built once in `plan()`; `forward()` per layer only writes
K/V, gathers into a grow-only scratch buffer, and calls SDPA. Gathered slots past a
sequence's end are zeroed, so stale non-finite values there can never leak (0 * NaN).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model_service.attention.base import AttentionBackend, BatchLayout
from model_service.attention.indexing import segments


@dataclass(slots=True)
class _Group:
    """Plan of one SDPA call over a subset of the step's sequences."""

    num_seqs: int
    max_query_len: int
    # Packed token indices of this group's tokens, in packed order; None = all tokens.
    rows: torch.Tensor | None  # [group_tokens] int64
    # Index into the group's tokens that builds the padded query [num_seqs * max_query_len];
    # None when no padding is needed (one sequence, or every query_len == 1).
    q_pad_index: torch.Tensor | None  # [num_seqs * max_query_len] int64
    # Index into padded output rows that picks the group's tokens back; None when unpadded.
    out_index: torch.Tensor | None  # [group_tokens] int64
    # Physical blocks to gather, num_ctx_blocks per sequence; None = the new K/V are the
    # whole context (single sequence without cached prefix): no gather at all.
    block_ids: torch.Tensor | None  # [num_seqs * num_ctx_blocks] int64
    num_ctx_blocks: int
    kv_len: int  # padded context length (longest context in the group)
    attn_mask: torch.Tensor | None  # [num_seqs, 1, max_query_len, kv_len] additive (0 / -inf)
    # Gathered rows past a sequence's end (stale slots, padding blocks), zeroed after each
    # gather: masked keys still enter the matmuls, and 0 * NaN from a stale slot is NaN.
    pad_rows: torch.Tensor | None  # [num_padded] int64 rows of the [num_seqs * span] buffer
    is_causal: bool


class TorchAttentionBackend(AttentionBackend):
    """Paged attention with `torch.nn.functional.scaled_dot_product_attention`."""

    name = "torch"

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(num_q_heads, num_kv_heads, head_dim, block_size, dtype, device)
        if num_q_heads % num_kv_heads != 0:
            raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self._enable_gqa = num_q_heads != num_kv_heads
        self._slot_mapping: torch.Tensor | None = None
        self._groups: list[_Group] = []
        self._num_tokens = 0
        # Gather destinations, flat and grow-only: shared by every layer and group of a step and
        # kept across steps (a fresh large CPU allocation per layer costs page faults).
        self._k_scratch: torch.Tensor | None = None  # allocated by plan()
        self._v_scratch: torch.Tensor | None = None

    # ------------------------------------------------------------------ plan
    def plan(self, layout: BatchLayout) -> None:
        """Build gather indices, padding indices and masks shared by all layers of the step."""
        query_lens = layout.query_lens_cpu
        seq_lens = layout.seq_lens_cpu
        if not seq_lens or len(query_lens) != len(seq_lens):
            raise ValueError("a step needs at least one sequence and one query length per sequence")
        if any(q < 1 or q > s for q, s in zip(query_lens, seq_lens, strict=True)):
            raise ValueError("every sequence needs 1 <= query_len <= seq_len")
        self._slot_mapping = layout.slot_mapping.to(device=self.device, dtype=torch.long)
        self._num_tokens = layout.num_tokens
        if sum(query_lens) != self._num_tokens:
            raise ValueError(f"query lengths sum to {sum(query_lens)}, slot_mapping has {self._num_tokens}")

        qlens = torch.tensor(query_lens, dtype=torch.long)  # [batch]
        is_decode = qlens == 1  # [batch]
        num_decode = int(is_decode.sum())
        batch = len(query_lens)
        if num_decode == batch or num_decode == 0:
            self._groups = [self._plan_group(layout, None, qlens, torch.tensor(seq_lens, dtype=torch.long))]
            return
        # Mixed step: decode rows and extend rows are attended separately.
        starts = torch.cumsum(qlens, 0) - qlens  # [batch]
        token_seq, _ = segments(qlens)  # [num_tokens] sequence of each packed token
        slens = torch.tensor(seq_lens, dtype=torch.long)
        dec_idx = torch.nonzero(is_decode).flatten()  # [num_decode]
        ext_idx = torch.nonzero(~is_decode).flatten()  # [batch - num_decode]
        dec_rows = starts[dec_idx]  # packed token of each decode sequence
        ext_rows = torch.nonzero(~is_decode[token_seq]).flatten()  # packed tokens of extend sequences
        self._groups = [
            self._plan_group(layout, dec_idx, qlens[dec_idx], slens[dec_idx], dec_rows),
            self._plan_group(layout, ext_idx, qlens[ext_idx], slens[ext_idx], ext_rows),
        ]

    def _plan_group(self, layout: BatchLayout, seq_idx: torch.Tensor | None, qlens: torch.Tensor,
                    slens: torch.Tensor, rows: torch.Tensor | None = None) -> _Group:
        """Plan one SDPA call for the sequences `seq_idx` (None = all, in order)."""
        dev = self.device
        n = int(qlens.shape[0])
        max_q = int(qlens.max())
        kv_len = int(slens.max())
        prefix = slens - qlens  # [n] cached tokens before this step's tokens

        # Single sequence, nothing cached: the new K/V are the entire context.
        if n == 1 and int(prefix[0]) == 0:
            return _Group(num_seqs=1, max_query_len=max_q, rows=_to(rows, dev), q_pad_index=None,
                          out_index=None, block_ids=None, num_ctx_blocks=0, kv_len=kv_len,
                          attn_mask=None, pad_rows=None, is_causal=max_q > 1)

        nb = -(-kv_len // self.block_size)
        tables = layout.block_tables
        if nb > tables.shape[1]:
            raise ValueError(f"a sequence of {kv_len} tokens needs {nb} blocks, block_tables has {tables.shape[1]}")
        if seq_idx is not None:
            tables = tables.index_select(0, seq_idx.to(tables.device))
        block_ids = tables[:, :nb].reshape(-1).to(device=dev, dtype=torch.long)  # [n * nb]

        q_pad_index = out_index = None
        if n > 1 and max_q > 1:
            starts = torch.cumsum(qlens, 0) - qlens  # [n] within the group's tokens
            j = torch.arange(max_q)
            q_pad_index = (starts[:, None] + torch.minimum(j[None, :], qlens[:, None] - 1)).reshape(-1)
            tok_seq, tok_offset = segments(qlens)  # [group_tokens] each
            out_index = tok_seq * max_q + tok_offset

        attn_mask = None
        pos = torch.arange(kv_len)  # [kv_len]
        if max_q > 1:
            # Query j of sequence b sits at position prefix_b + j and sees keys up to there.
            # Padded query rows see the whole context (never an empty row) and are dropped.
            q_pos = prefix[:, None] + torch.arange(max_q)[None, :]  # [n, max_q]
            last_key = torch.minimum(q_pos, slens[:, None] - 1)  # [n, max_q]
            attn_mask = self._additive(pos[None, None, :] <= last_key[:, :, None])[:, None]  # [n, 1, max_q, kv_len]
        elif bool((slens != kv_len).any()):
            attn_mask = self._additive(pos[None, :] < slens[:, None])[:, None, None, :]  # [n, 1, 1, kv_len]

        pad_rows = None
        if bool((slens < kv_len).any()):  # gathered positions past a sequence's end
            pad_seq, pad_pos = (pos[None, :] >= slens[:, None]).nonzero(as_tuple=True)  # [num_padded] each
            pad_rows = pad_seq * (nb * self.block_size) + pad_pos

        numel = n * nb * self.block_size * self.num_kv_heads * self.head_dim
        if self._k_scratch is None or self._k_scratch.numel() < numel:
            self._k_scratch = torch.empty(numel, dtype=self.dtype, device=dev)
            self._v_scratch = torch.empty(numel, dtype=self.dtype, device=dev)
        return _Group(
            num_seqs=n, max_query_len=max_q, rows=_to(rows, dev), q_pad_index=_to(q_pad_index, dev),
            out_index=_to(out_index, dev), block_ids=block_ids, num_ctx_blocks=nb, kv_len=kv_len,
            attn_mask=_to(attn_mask, dev), pad_rows=_to(pad_rows, dev), is_causal=False,
        )

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """Bool mask -> additive mask in the model dtype (SDPA converts bool masks every call)."""
        zero = torch.zeros((), dtype=self.dtype)
        return torch.where(allowed, zero, torch.full((), float("-inf"), dtype=self.dtype))

    # --------------------------------------------------------------- forward
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """Write k/v into the planned slots, then attend (see `AttentionBackend.forward`)."""
        if self._slot_mapping is None:
            raise RuntimeError("plan() must be called before forward()")
        if q.shape[0] != self._num_tokens:
            raise ValueError(f"q has {q.shape[0]} tokens, the plan has {self._num_tokens}")
        # [num_blocks * block_size, num_kv_heads, head_dim] views of the paged cache.
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, self._slot_mapping, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, self._slot_mapping, v)

        if len(self._groups) == 1:
            return self._attend(self._groups[0], q, k, v, k_cache, v_cache, scale)
        out = q.new_empty(q.shape[0], self.num_q_heads, self.head_dim)  # [num_tokens, Hq, D]
        for group in self._groups:
            rows = group.rows
            assert rows is not None
            if group.block_ids is None:  # attends over its own new K/V
                gk, gv = k.index_select(0, rows), v.index_select(0, rows)
            else:  # reads K/V from the cache
                gk, gv = k, v
            out.index_copy_(0, rows, self._attend(group, q.index_select(0, rows), gk, gv, k_cache, v_cache, scale))
        return out

    def _attend(self, g: _Group, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """SDPA for one group. q: [group_tokens, Hq, D]; returns [group_tokens, Hq, D]."""
        n, max_q = g.num_seqs, g.max_query_len
        if g.block_ids is None:
            keys = k.transpose(0, 1).unsqueeze(0)  # [1, Hkv, T, D]
            values = v.transpose(0, 1).unsqueeze(0)
        else:
            assert self._k_scratch is not None and self._v_scratch is not None
            span = g.num_ctx_blocks * self.block_size
            shape = (n * g.num_ctx_blocks, self.block_size, self.num_kv_heads, self.head_dim)
            numel = math.prod(shape)
            k_buf = self._k_scratch[:numel].view(shape)  # [n * nb, bs, Hkv, D]
            v_buf = self._v_scratch[:numel].view(shape)
            torch.index_select(k_cache, 0, g.block_ids, out=k_buf)
            torch.index_select(v_cache, 0, g.block_ids, out=v_buf)
            if g.pad_rows is not None:
                k_buf.view(-1, self.num_kv_heads, self.head_dim).index_fill_(0, g.pad_rows, 0.0)
                v_buf.view(-1, self.num_kv_heads, self.head_dim).index_fill_(0, g.pad_rows, 0.0)
            keys = k_buf.view(n, span, self.num_kv_heads, self.head_dim)[:, :g.kv_len].transpose(1, 2)
            values = v_buf.view(n, span, self.num_kv_heads, self.head_dim)[:, :g.kv_len].transpose(1, 2)
            # keys, values: [n, Hkv, kv_len, D]
        if max_q == 1:
            queries = q.unsqueeze(2)  # [n, Hq, 1, D]
        elif g.q_pad_index is None:
            queries = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]
        else:
            queries = q.index_select(0, g.q_pad_index).view(n, max_q, self.num_q_heads, self.head_dim)
            queries = queries.transpose(1, 2)  # [n, Hq, max_q, D]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=g.attn_mask,
                                             is_causal=g.is_causal, scale=scale, enable_gqa=self._enable_gqa)
        # out: [n, Hq, max_q, D] -> [n * max_q, Hq, D]
        out = out.transpose(1, 2).reshape(n * max_q, self.num_q_heads, self.head_dim)
        if g.out_index is not None:
            out = out.index_select(0, g.out_index)  # [group_tokens, Hq, D]
        return out


def _to(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device, non_blocking=True)
