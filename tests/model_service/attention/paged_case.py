"""Random paged-attention scenarios and a naive dense reference, shared by the backend tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_service.attention.base import BatchLayout


@dataclass
class PagedCase:
    """One scheduler step: packed new tokens, a pre-filled paged cache and the full K/V."""

    layout: BatchLayout
    q: torch.Tensor  # [num_tokens, Hq, D]
    k: torch.Tensor  # [num_tokens, Hkv, D]
    v: torch.Tensor  # [num_tokens, Hkv, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D] (cached prefixes + garbage)
    v_cache: torch.Tensor
    full_k: list[torch.Tensor]  # per sequence [seq_len, Hkv, D]
    full_v: list[torch.Tensor]
    query_lens: list[int]
    seq_lens: list[int]

    def expected_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The caches after a correct write: new K/V at their slots, everything else unchanged."""
        k_exp, v_exp = self.k_cache.clone(), self.v_cache.clone()
        hkv, d = self.k.shape[1], self.k.shape[2]
        k_exp.view(-1, hkv, d)[self.layout.slot_mapping] = self.k
        v_exp.view(-1, hkv, d)[self.layout.slot_mapping] = self.v
        return k_exp, v_exp


def make_case(seq_lens: list[int], query_lens: list[int], *, block_size: int, num_q_heads: int,
              num_kv_heads: int, head_dim: int, seed: int = 0, layout_seed: int | None = None,
              spare_blocks: int = 3, garbage: float | None = None, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu", group_of: list[int] | None = None,
              shared_blocks: list[int] | None = None) -> PagedCase:
    """Build a step whose sequences own shuffled, non-contiguous blocks of one pool.

    Sequence i has `seq_lens[i]` context tokens of which the last `query_lens[i]` are new;
    its cached prefix is already in the cache. Unused blocks and slots hold random garbage.
    `layout_seed` (default `seed`) picks the blocks, `seed` the tensor values, so cases with
    one layout seed are the same step seen by different layers. `garbage` (e.g. NaN) fills
    every slot that holds no cached token instead of random values.

    Shared prefixes, as a radix tree hands them out: with `group_of` (a group id per
    sequence, -1 for none) and `shared_blocks` (per group), the members of group g start with
    the same `shared_blocks[g]` physical blocks holding the same K/V; each member's cached
    prefix must cover them (`seq_len - query_len >= shared_blocks[g] * block_size`).
    """
    assert len(seq_lens) == len(query_lens)
    group_of = list(group_of) if group_of is not None else [-1] * len(seq_lens)
    shared_blocks = list(shared_blocks or [])
    assert len(group_of) == len(seq_lens) and max(group_of, default=-1) < len(shared_blocks)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    own_blocks = [nb - (shared_blocks[g] if g >= 0 else 0) for nb, g in zip(blocks_per_seq, group_of, strict=True)]
    for s, ql, g in zip(seq_lens, query_lens, group_of, strict=True):
        assert g < 0 or s - ql >= shared_blocks[g] * block_size, "a shared block must be cached, full"
    num_blocks = sum(own_blocks) + sum(shared_blocks) + spare_blocks
    layout_gen = torch.Generator().manual_seed(seed if layout_seed is None else layout_seed)
    perm = torch.randperm(num_blocks, generator=layout_gen)
    gen = torch.Generator().manual_seed(seed)
    # Each group's shared blocks and their K/V (the members' common first tokens).
    group_tables, group_k, group_v, used = [], [], [], 0
    for nb in shared_blocks:
        group_tables.append(perm[used:used + nb])
        used += nb
        group_k.append(torch.randn(nb * block_size, num_kv_heads, head_dim, generator=gen))
        group_v.append(torch.randn(nb * block_size, num_kv_heads, head_dim, generator=gen))
    width = max(blocks_per_seq) + 1  # one padding column, as a real scheduler may have
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen)
    v_cache = torch.randn(shape, generator=gen)
    if garbage is not None:
        k_cache.fill_(garbage)
        v_cache.fill_(garbage)
    full_k, full_v, slots, news_k, news_v = [], [], [], [], []
    for i, (s, ql) in enumerate(zip(seq_lens, query_lens, strict=True)):
        g = group_of[i]
        table = perm[used:used + own_blocks[i]]
        used += own_blocks[i]
        kk = torch.randn(s, num_kv_heads, head_dim, generator=gen)
        vv = torch.randn(s, num_kv_heads, head_dim, generator=gen)
        if g >= 0:
            table = torch.cat([group_tables[g], table])
            kk[:len(group_k[g])] = group_k[g]
            vv[:len(group_v[g])] = group_v[g]
        block_tables[i, :len(table)] = table.to(torch.int32)
        pos = torch.arange(s)
        seq_slots = table[pos // block_size] * block_size + pos % block_size  # [s]
        prefix = s - ql
        k_cache.view(-1, num_kv_heads, head_dim)[seq_slots[:prefix]] = kk[:prefix]
        v_cache.view(-1, num_kv_heads, head_dim)[seq_slots[:prefix]] = vv[:prefix]
        full_k.append(kk)
        full_v.append(vv)
        slots.append(seq_slots[prefix:])
        news_k.append(kk[prefix:])
        news_v.append(vv[prefix:])
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen)
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)

    layout = BatchLayout(
        query_start_loc=dev(qsl),
        seq_lens=dev(torch.tensor(seq_lens, dtype=torch.int32)),
        block_tables=dev(block_tables),
        slot_mapping=dev(torch.cat(slots).to(torch.long)),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )
    return PagedCase(layout=layout, q=dev(q), k=dev(torch.cat(news_k)), v=dev(torch.cat(news_v)),
                     k_cache=dev(k_cache), v_cache=dev(v_cache), full_k=[dev(t) for t in full_k],
                     full_v=[dev(t) for t in full_v], query_lens=list(query_lens), seq_lens=list(seq_lens))


def reference_attention(case: PagedCase, scale: float) -> torch.Tensor:
    """Naive dense causal attention per sequence, in float64. Returns [num_tokens, Hq, D]."""
    hq = case.q.shape[1]
    outs = []
    start = 0
    for ql, s, kk, vv in zip(case.query_lens, case.seq_lens, case.full_k, case.full_v, strict=True):
        q = case.q[start:start + ql].double().transpose(0, 1)  # [Hq, ql, D]
        start += ql
        group = hq // kk.shape[1]
        keys = kk.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, s, D]
        values = vv.double().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = q @ keys.transpose(1, 2) * scale  # [Hq, ql, s]
        q_pos = torch.arange(s - ql, s, device=q.device)[:, None]
        scores = scores.masked_fill(torch.arange(s, device=q.device)[None, :] > q_pos, float("-inf"))
        outs.append((scores.softmax(-1) @ values).transpose(0, 1))  # [ql, Hq, D]
    return torch.cat(outs)
