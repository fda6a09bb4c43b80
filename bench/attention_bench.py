"""Per-layer cost of the torch paged attention backend vs plain SDPA on contiguous tensors.

    .venv/bin/python -m bench.attention_bench [--repeats N] [--threads N] [--only decode|shared|threshold|prefill]

SmolLM2-135M shapes (9 query heads, 3 KV heads, head_dim 64), fp32, block_size 16, blocks
shuffled through a pool. A backend time is one `forward()` (KV write + gather + attention),
what each of the ~30 layers pays per step; "plan" is paid once per step. Decode variants:

- blocks:  the path before the cascade: block-by-block gather into a [seqs, len, Hkv, D]
           scratch, stale slots zeroed, SDPA on the transposed (head-strided) view;
- rows:    token-row gather straight into a contiguous head-major [seqs, Hkv, len, D], SDPA
           (the backend's path for decode sequences sharing nothing);
- cascade: rows + shared-prefix cascade (the backend's default): each group's shared prefix
           attended once for all its members, suffixes per member, merged by log-sum-exp.

"dense" is `scaled_dot_product_attention` on contiguous [batch, heads, len, head_dim] tensors
of the same shapes (no gather at all: what a per-request contiguous cache would pay), and
"dense+cat" adds the torch.cat append transformers' DynamicCache does per layer. Timings are
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


def make_step(seq_lens: list[int], query_lens: list[int], gen: torch.Generator,
              shared_blocks: list[int] | None = None, group_of: list[int] | None = None):
    """A step over shuffled blocks: layout, new q/k/v and caches.

    With `group_of` (group id per sequence, -1 none) and `shared_blocks` (per group), the
    members of a group use the same physical blocks for their first shared_blocks[g] blocks,
    as a radix tree hands out a cached prefix.
    """
    batch = len(seq_lens)
    blocks = [-(-s // BS) for s in seq_lens]
    group_of = group_of or [-1] * batch
    shared_blocks = shared_blocks or []
    own = [b - (shared_blocks[g] if g >= 0 else 0) for b, g in zip(blocks, group_of, strict=True)]
    num_blocks = sum(own) + sum(shared_blocks) + 8
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    group_blocks, used = [], 0
    for nb in shared_blocks:
        group_blocks.append(perm[used:used + nb])
        used += nb
    tables = torch.zeros(batch, max(blocks), dtype=torch.int32)
    k_cache = torch.randn(num_blocks, BS, HKV, D, generator=gen)
    v_cache = torch.randn(num_blocks, BS, HKV, D, generator=gen)
    slots = []
    for i, (s, ql) in enumerate(zip(seq_lens, query_lens, strict=True)):
        head = group_blocks[group_of[i]] if group_of[i] >= 0 else perm[:0]
        tables[i, :blocks[i]] = torch.cat([head, perm[used:used + own[i]]])
        used += own[i]
        pos = torch.arange(s - ql, s)
        slots.append(tables[i].long()[pos // BS] * BS + pos % BS)
    t = sum(query_lens)
    qsl = torch.zeros(batch + 1, dtype=torch.int32)
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


VARIANTS = {
    "blocks": dict(decode_gather="blocks"),
    "rows": dict(cascade="never"),
    "cascade": dict(),
}


def backends(**overrides) -> dict[str, TorchAttentionBackend]:
    return {name: TorchAttentionBackend(HQ, HKV, D, BS, torch.float32, torch.device("cpu"), **{**kw, **overrides})
            for name, kw in VARIANTS.items()}


def bench_decode_variants(label: str, step, repeats: int, dense_lens: list[int] | None = None,
                          **overrides) -> dict[str, float]:
    """Per-layer forward of each decode variant (+ dense SDPA) on one step, interleaved."""
    layout, q, k, v, k_cache, v_cache = step
    impls = backends(**overrides)
    outs = {}
    for name, b in impls.items():
        b.plan(layout)
        outs[name] = b.forward(q, k, v, k_cache.clone(), v_cache.clone(), SCALE)
    for name, out in outs.items():  # same step, same answer
        torch.testing.assert_close(out, outs["blocks"], rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    cascaded = impls["cascade"]._decode is not None and impls["cascade"]._decode.cascade is not None
    fns: list[Callable[[], object]] = [
        (lambda b=b: b.forward(q, k, v, k_cache, v_cache, SCALE)) for b in impls.values()]
    names = list(impls)
    if dense_lens is not None:
        gen = torch.Generator().manual_seed(1)
        b, max_len = len(dense_lens), max(dense_lens)
        dq = torch.randn(b, HQ, 1, D, generator=gen)
        dk = torch.randn(b, HKV, max_len, D, generator=gen)
        dv = torch.randn(b, HKV, max_len, D, generator=gen)
        mask = None
        if len(set(dense_lens)) > 1:
            keep = (torch.arange(max_len)[None, :] < torch.tensor(dense_lens)[:, None])[:, None, None, :]
            mask = torch.zeros(keep.shape).masked_fill_(~keep, float("-inf"))
        fns.append(lambda: F.scaled_dot_product_attention(dq, dk, dv, attn_mask=mask, scale=SCALE, enable_gqa=True))
        names.append("dense")
    fns.append(lambda: impls["cascade"].plan(layout))
    names.append("plan")
    res = dict(zip(names, interleaved_medians(fns, repeats), strict=True))
    base = res["blocks"]
    cols = "   ".join(f"{n} {t:7.3f}" + (f" ({base / t:4.2f}x)" if n in ("rows", "cascade") else "")
                      for n, t in res.items())
    print(f"{label:<40} {cols}   {'[cascade]' if cascaded else '[no cascade]'}")
    return res


def shared_prefix_step(groups: int, members: int, prefix: int, suffix: list[int] | int, gen: torch.Generator,
                       extra_unshared: list[int] = ()):
    """Decode step: `groups` x `members` sequences, each group sharing a `prefix`-token cached
    prefix (whole blocks), each member `suffix` more tokens (question + generated so far)."""
    n = groups * members
    suf = [suffix] * n if isinstance(suffix, int) else list(suffix)
    seq_lens = [prefix + s for s in suf] + list(extra_unshared)
    group_of = [i // members for i in range(n)] + [-1] * len(extra_unshared)
    return make_step(seq_lens, [1] * len(seq_lens), gen, [prefix // BS] * groups, group_of), seq_lens


def bench_prefill(label: str, seq_lens: list[int], query_lens: list[int], repeats: int,
                  gen: torch.Generator) -> None:
    layout, q, k, v, k_cache, v_cache = make_step(seq_lens, query_lens, gen)
    backend = TorchAttentionBackend(HQ, HKV, D, BS, torch.float32, torch.device("cpu"))
    backend.plan(layout)
    b, max_len, max_q = len(seq_lens), max(seq_lens), max(query_lens)
    dq = torch.randn(b, HQ, max_q, D, generator=gen)
    dk = torch.randn(b, HKV, max_len, D, generator=gen)
    dv = torch.randn(b, HKV, max_len, D, generator=gen)
    mask, causal = None, max_q == max_len > 1
    if 1 < max_q < max_len:  # chunk after a cached prefix: bottom-right causal mask
        keep = torch.ones(max_q, max_len, dtype=torch.bool).tril(max_len - max_q)
        mask = torch.zeros(keep.shape).masked_fill_(~keep, float("-inf"))

    def paged() -> torch.Tensor:
        return backend.forward(q, k, v, k_cache, v_cache, SCALE)

    def dense() -> torch.Tensor:
        return F.scaled_dot_product_attention(dq, dk, dv, attn_mask=mask, is_causal=causal, scale=SCALE,
                                              enable_gqa=True)

    p, d, plan_ms = interleaved_medians([paged, dense, lambda: backend.plan(layout)], repeats)
    print(f"{label:<40} paged {p:8.3f}   dense {d:8.3f}   ratio {p / d:5.2f}x   plan {plan_ms:6.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--only", choices=["decode", "shared", "threshold", "prefill"], action="append")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    only = set(args.only or ["decode", "shared", "threshold", "prefill"])
    gen = torch.Generator().manual_seed(0)
    reps = args.repeats
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; Hq={HQ} Hkv={HKV} D={D} "
          f"block={BS} fp32; per-layer ms (backend forward = KV write + gather + attention)")
    if "shared" in only:
        # The workload: 4 groups x 8 requests, 1024-token cached prefix each, 32-token
        # question, decoding together (here 32 and 63 tokens generated; ragged: 0..63).
        for gen_tokens in (32, 63):
            step, lens = shared_prefix_step(4, 8, 1024, 32 + gen_tokens, gen)
            bench_decode_variants(f"shared 4x8 prefix 1024 +{32 + gen_tokens}", step, reps, lens)
        ragged = (32 + torch.randint(0, 64, (32,), generator=gen)).tolist()
        step, lens = shared_prefix_step(4, 8, 1024, ragged, gen)
        bench_decode_variants("shared 4x8 prefix 1024 +32..95 ragged", step, reps, lens)
        step, lens = shared_prefix_step(4, 8, 1024, 64, gen, extra_unshared=[1100] * 8)
        bench_decode_variants("shared 4x8 +64, plus 8 unshared 1100", step, reps, lens)
        step, lens = shared_prefix_step(1, 32, 1024, 64, gen)
        bench_decode_variants("shared 1x32 prefix 1024 +64", step, reps, lens)
    if "decode" in only:
        step = make_step([1100] * 32, [1] * 32, gen)
        bench_decode_variants("no sharing 32 x 1100", step, reps, [1100] * 32)
        for batch in (1, 16, 32):
            lens = torch.randint(512, 1025, (batch,), generator=gen).tolist()
            step = make_step(lens, [1] * batch, gen)
            bench_decode_variants(f"no sharing {batch:>2} x 512-1024", step, reps, lens)
    if "threshold" in only:
        # What a small shared prefix is worth: 16 pairs of 1100-token contexts sharing k blocks,
        # and one pair among 32 unshared; the cascade is forced on (thresholds at their minimum).
        for k_blocks in (1, 2, 4, 8, 16):
            step, lens = shared_prefix_step(16, 2, 16 * k_blocks, 1100 - 16 * k_blocks, gen)
            bench_decode_variants(f"16 pairs sharing {k_blocks:>2} blocks, 1100 ctx", step, reps, lens,
                                  cascade="always")
        for k_blocks in (1, 4, 16):
            step, lens = shared_prefix_step(1, 2, 16 * k_blocks, 1100 - 16 * k_blocks, gen,
                                            extra_unshared=[1100] * 30)
            bench_decode_variants(f"1 pair sharing {k_blocks:>2} blocks + 30 unshared", step, reps, lens,
                                  cascade="always")
    if "prefill" in only:
        bench_prefill("prefill 1024 tokens", [1024], [1024], max(3, reps // 3), gen)
        bench_prefill("prefill 512 after 512 cached", [1024], [512], max(3, reps // 3), gen)


if __name__ == "__main__":
    main()
