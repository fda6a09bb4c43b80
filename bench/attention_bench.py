"""Per-layer cost of the torch paged attention backend vs plain SDPA on contiguous tensors.

    .venv/bin/python -m bench.attention_bench [--repeats N] [--threads N]

SmolLM2-135M shapes (9 query heads, 3 KV heads, head_dim 64), fp32, block_size 16, blocks
shuffled through a pool. "paged" is one `forward()` (KV write + block gather + SDPA), what
each of the ~30 layers pays per step; "plan" is paid once per step. "dense" is
`scaled_dot_product_attention` on contiguous [batch, heads, len, head_dim] tensors of the
same shapes (with the same key-padding mask for ragged decode batches); for decode,
"dense+cat" adds the torch.cat append that transformers' DynamicCache does per layer. Timings are
medians over interleaved repetitions (on a shared machine, expect noise; --threads 1 is
steadier there).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from model_service.attention.base import BatchLayout
from model_service.attention.torch_backend import TorchAttentionBackend

HQ, HKV, D, BS = 9, 3, 64, 16
SCALE = 1.0 / math.sqrt(D)


def make_step(seq_lens: list[int], query_lens: list[int], gen: torch.Generator):
    """A step over shuffled blocks: layout, new q/k/v, caches, and dense equivalents."""
    blocks = [-(-s // BS) for s in seq_lens]
    num_blocks = sum(blocks) + 8
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    k_cache = torch.randn(num_blocks, BS, HKV, D, generator=gen)
    v_cache = torch.randn(num_blocks, BS, HKV, D, generator=gen)
    slots, used = [], 0
    for i, (s, ql) in enumerate(zip(seq_lens, query_lens, strict=True)):
        tables[i, :blocks[i]] = perm[used:used + blocks[i]].to(torch.int32)
        used += blocks[i]
        pos = torch.arange(s - ql, s)
        slots.append(tables[i].long()[pos // BS] * BS + pos % BS)
    t = sum(query_lens)
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    layout = BatchLayout(query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                         block_tables=tables, slot_mapping=torch.cat(slots), max_query_len=max(query_lens),
                         max_seq_len=max(seq_lens), query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)
    q = torch.randn(t, HQ, D, generator=gen)  # [num_tokens, Hq, D]
    k = torch.randn(t, HKV, D, generator=gen)  # [num_tokens, Hkv, D]
    v = torch.randn(t, HKV, D, generator=gen)
    return layout, q, k, v, k_cache, v_cache


def interleaved_medians(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Median ms of each function, timed alternately so load drift hits all of them alike."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, acc in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - start)
    return [statistics.median(t) * 1e3 for t in times]


def bench_case(label: str, seq_lens: list[int], query_lens: list[int], repeats: int,
               gen: torch.Generator) -> None:
    layout, q, k, v, k_cache, v_cache = make_step(seq_lens, query_lens, gen)
    backend = TorchAttentionBackend(HQ, HKV, D, BS, torch.float32, torch.device("cpu"))
    backend.plan(layout)
    b, max_len, max_q = len(seq_lens), max(seq_lens), max(query_lens)
    # Dense equivalent: contiguous [b, H, len, D], one query row per decode sequence.
    dq = torch.randn(b, HQ, max_q, D, generator=gen)
    dk = torch.randn(b, HKV, max_len, D, generator=gen)
    dv = torch.randn(b, HKV, max_len, D, generator=gen)
    mask = None
    if max_q == 1 and len(set(seq_lens)) > 1:
        lens = torch.tensor(seq_lens)
        keep = (torch.arange(max_len)[None, :] < lens[:, None])[:, None, None, :]  # [b, 1, 1, max_len]
        mask = torch.zeros(keep.shape).masked_fill_(~keep, float("-inf"))
    causal = max_q == max_len > 1
    if 1 < max_q < max_len:  # chunk after a cached prefix: bottom-right causal mask
        keep = torch.ones(max_q, max_len, dtype=torch.bool).tril(max_len - max_q)
        mask = torch.zeros(keep.shape).masked_fill_(~keep, float("-inf"))

    def paged() -> torch.Tensor:
        return backend.forward(q, k, v, k_cache, v_cache, SCALE)

    def dense() -> torch.Tensor:
        return F.scaled_dot_product_attention(dq, dk, dv, attn_mask=mask, is_causal=causal, scale=SCALE,
                                              enable_gqa=True)

    fns = [paged, dense, lambda: backend.plan(layout)]
    if max_q == 1:
        # What transformers' DynamicCache does per layer per decode step: append by torch.cat
        # (a copy of the whole context), then the same SDPA.
        old_k, old_v = dk[:, :, :-1].contiguous(), dv[:, :, :-1].contiguous()
        new_k, new_v = dk[:, :, -1:].contiguous(), dv[:, :, -1:].contiguous()

        def dense_cat() -> torch.Tensor:
            kk, vv = torch.cat([old_k, new_k], dim=-2), torch.cat([old_v, new_v], dim=-2)
            return F.scaled_dot_product_attention(dq, kk, vv, attn_mask=mask, scale=SCALE, enable_gqa=True)

        fns.append(dense_cat)
    p, d, plan_ms, *cat = interleaved_medians(fns, repeats)
    extra = f"   dense+cat {cat[0]:7.3f} ms" if cat else ""
    print(f"{label:<34} paged {p:8.3f} ms   dense {d:8.3f} ms   ratio {p / d:5.2f}x   plan {plan_ms:6.3f} ms{extra}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; Hq={HQ} Hkv={HKV} D={D} "
          f"block={BS} fp32; per-layer times (paged = KV write + gather + SDPA)")
    for batch in (1, 16, 32):
        lens = torch.randint(512, 1025, (batch,), generator=gen).tolist()
        bench_case(f"decode batch {batch:>2} ctx 512-1024", lens, [1] * batch, args.repeats, gen)
    bench_case("decode batch 16 ctx 1024 (equal)", [1024] * 16, [1] * 16, args.repeats, gen)
    bench_case("prefill 1024 tokens", [1024], [1024], max(3, args.repeats // 3), gen)
    bench_case("prefill 512 after 512 cached", [1024], [512], max(3, args.repeats // 3), gen)


if __name__ == "__main__":
    main()
