"""native.attend_cascade (the fused cascade decode kernel) against dense float64 attention.

Random groups of decode sequences share prefixes of random lengths; each member has its own
ragged suffix in shuffled cache blocks, and some sequences belong to no group. Skipped only on
CPUs without AVX-512.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model_service import native

pytestmark = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AMX"),
                                reason="native kernels: this CPU has no AVX-512")

BLOCK = 16


@pytest.fixture(autouse=True, scope="module")
def library() -> None:
    """A missing or broken build fails here (`make install` builds it)."""
    assert native.available(), native.unavailable_reason()


def make_cascade(seed: int, hq: int, hkv: int, d: int, group_sizes: list[int], ungrouped: int,
                 dtype: torch.dtype) -> dict:
    """A batch of decode sequences in the paged cache: groups sharing prefix blocks, the rest alone."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 300
    free = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = torch.randn(num_blocks, BLOCK, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, hkv, d, generator=gen).to(dtype)
    contexts: list[list[int]] = []  # each sequence's blocks
    lengths: list[int] = []  # each sequence's context tokens
    starts: list[int] = []  # first own token (after its group's prefix)
    prefix_blocks: list[list[int]] = []
    order = []  # (group or -1) per sequence, shuffled into decode order below
    for g, size in enumerate(group_sizes):
        shared = [free.pop() for _ in range(int(torch.randint(1, 5, (1,), generator=gen)))]
        prefix_blocks.append(shared)
        order += [g] * size
    order += [-1] * ungrouped
    perm = torch.randperm(len(order), generator=gen).tolist()
    order = [order[i] for i in perm]
    for g in order:
        own_tokens = int(torch.randint(1, 40, (1,), generator=gen))
        shared = prefix_blocks[g] if g >= 0 else []
        own = [free.pop() for _ in range(-(-own_tokens // BLOCK))]
        contexts.append(shared + own)
        lengths.append(len(shared) * BLOCK + own_tokens)
        starts.append(len(shared) * BLOCK)
    n = len(order)
    width = max(len(c) for c in contexts)
    tables = torch.tensor([c + [0] * (width - len(c)) for c in contexts])
    gm = max(group_sizes) if group_sizes else 1
    members = torch.full((max(len(group_sizes), 1), gm), -1, dtype=torch.long)
    for g in range(len(group_sizes)):
        rows = [i for i, og in enumerate(order) if og == g]
        members[g, :len(rows)] = torch.tensor(rows)
    lp = max((len(b) for b in prefix_blocks), default=1) * BLOCK
    prefix_k = torch.zeros(len(group_sizes), hkv, lp, d, dtype=dtype)
    prefix_v = torch.zeros_like(prefix_k)
    for g, blocks in enumerate(prefix_blocks):
        for j, blk in enumerate(blocks):
            prefix_k[g, :, j * BLOCK:(j + 1) * BLOCK] = k_cache[blk].transpose(0, 1)
            prefix_v[g, :, j * BLOCK:(j + 1) * BLOCK] = v_cache[blk].transpose(0, 1)
    return dict(q=torch.randn(n, hq, d, generator=gen).to(dtype), prefix_k=prefix_k, prefix_v=prefix_v,
                prefix_lens=torch.tensor([len(b) * BLOCK for b in prefix_blocks], dtype=torch.long),
                members=members[:len(group_sizes)], k_cache=k_cache, v_cache=v_cache, tables=tables,
                starts=torch.tensor(starts), own=torch.tensor(lengths) - torch.tensor(starts),
                lengths=torch.tensor(lengths))


def dense(case: dict, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention of every sequence over its whole context, gathered token by token."""
    q, k_cache, v_cache = case["q"].double(), case["k_cache"].double(), case["v_cache"].double()
    n, hq, _ = q.shape
    r = hq // k_cache.shape[2]
    outs, lses = [], []
    for i in range(n):
        tokens = torch.arange(int(case["lengths"][i]))
        slots = case["tables"][i, tokens // BLOCK]
        keys = k_cache[slots, tokens % BLOCK].repeat_interleave(r, 1)  # [L, Hq, D]
        values = v_cache[slots, tokens % BLOCK].repeat_interleave(r, 1)
        scores = torch.einsum("hd,lhd->hl", q[i], keys) * scale
        outs.append(torch.einsum("hl,lhd->hd", torch.softmax(scores, -1), values))
        lses.append(torch.logsumexp(scores, -1))
    return torch.stack(outs), torch.stack(lses)


def cascade(case: dict, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return native.attend_cascade(case["q"], case["prefix_k"], case["prefix_v"], case["prefix_lens"], case["members"],
                                 case["k_cache"], case["v_cache"], case["tables"], case["starts"], case["own"], scale)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    heads=st.sampled_from([(9, 3), (4, 4), (8, 1), (6, 2), (16, 2)]),
    head_dim=st.sampled_from([32, 64, 128]),
    group_sizes=st.lists(st.integers(1, 30), min_size=0, max_size=4),
    ungrouped=st.integers(0, 3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 1000),
)
def test_matches_dense_attention(heads, head_dim, group_sizes, ungrouped, dtype, seed):
    """Random groups (up to 30 members: more than one item's rows), ragged own keys, shuffled
    blocks, sequences in no group: o and lse equal dense float64 attention over each whole context."""
    if not group_sizes and not ungrouped:
        ungrouped = 1
    hq, hkv = heads
    case = make_cascade(seed, hq, hkv, head_dim, group_sizes, ungrouped, dtype)
    if not group_sizes:  # no group: an empty [0, 1] member table and a [0, Hkv, 1, D] prefix
        case["members"] = torch.empty(0, 1, dtype=torch.long)
        case["prefix_k"] = case["prefix_v"] = torch.zeros(0, hkv, BLOCK, head_dim, dtype=dtype)
        case["prefix_lens"] = torch.empty(0, dtype=torch.long)
    scale = head_dim ** -0.5
    out, lse = cascade(case, scale)
    want_out, want_lse = dense(case, scale)
    tol = dict(rtol=1e-5, atol=3e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
    torch.testing.assert_close(out.double(), want_out, **tol)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("path", ["default", "no tiles", "no dot products"])
def test_bf16_on_tiles_dot_products_or_fmas(path):
    """bfloat16 prefixes run on AMX tiles where the CPU has them (the members then continue on the
    row kernels), else on AVX512-BF16 dot products where it has those, else FMAs: all near dense."""
    case = make_cascade(7, 9, 3, 64, [8, 5, 1], 2, torch.bfloat16)
    paths = {"default": contextlib.nullcontext, "no tiles": native.without_attention_tiles,
             "no dot products": native.without_bf16_dot_products}
    with paths[path]():
        out, lse = cascade(case, 0.125)
    want, want_lse = dense(case, 0.125)
    torch.testing.assert_close(out.double(), want, rtol=2 ** -7, atol=2 ** -7)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-4)


def test_bf16_prefixes_take_the_tiles_where_they_run():
    if native.attention_tiles_min_queries(64) is None:
        pytest.skip("native attention tiles: no AMX here (or the library is not built)")
    case = make_cascade(8, 9, 3, 64, [12, 4], 0, torch.bfloat16)
    tiles, tiles_lse = cascade(case, 0.125)
    with native.without_attention_tiles():
        rows, rows_lse = cascade(case, 0.125)
    # The prefix pass summed in the tiles' order: float32 sums differ in their last bits (the bf16
    # outputs mostly round alike).
    assert not torch.equal(tiles_lse, rows_lse)
    torch.testing.assert_close(tiles_lse, rows_lse, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(tiles.double(), rows.double(), rtol=2 ** -7, atol=2 ** -7)


def _needs_tiles(head_dim: int = 64) -> None:
    if not native.cascade_on_tiles(head_dim):
        pytest.skip("native attention tiles: no AMX here (or turned off)")


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    heads=st.sampled_from([(9, 3), (4, 4), (8, 1), (16, 2)]),
    head_dim=st.sampled_from([32, 64, 128]),
    group_sizes=st.lists(st.integers(1, 30), min_size=1, max_size=4),
    ungrouped=st.integers(0, 2),
    seed=st.integers(0, 1000),
)
def test_prefixes_packed_once_give_the_same_bits(heads, head_dim, group_sizes, ungrouped, seed):
    """attend_cascade_tiles over pack_prefix_tiles' copies is attend_cascade's result bit for bit
    (the same tiles over the same bytes): prefixes of unequal lengths packed together (each zero
    past its own length inside a longer buffer), or each group packed apart at its own length."""
    _needs_tiles(head_dim)
    hq, hkv = heads
    case = make_cascade(seed, hq, hkv, head_dim, group_sizes, ungrouped, torch.bfloat16)
    together = native.pack_prefix_tiles(case["prefix_k"], case["prefix_v"], case["prefix_lens"])
    assert together.dtype == torch.int32 and together.shape[:3] == (len(group_sizes), hkv, 2)
    apart = []
    for g, length in enumerate(case["prefix_lens"].tolist()):
        k, v = (case[name][g:g + 1, :, :length].contiguous() for name in ("prefix_k", "prefix_v"))
        apart.append(native.pack_prefix_tiles(k, v, case["prefix_lens"][g:g + 1])[0])
    want, want_lse = cascade(case, 0.125)
    for tiles in (list(together), apart):
        out, lse = native.attend_cascade_tiles(case["q"], tiles, case["prefix_lens"], case["members"],
                                               case["k_cache"], case["v_cache"], case["tables"], case["starts"],
                                               case["own"], 0.125)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_packed_prefixes_stay_right_with_the_dot_products_off():
    """Members continue on the FMA row kernels then; the prefix pass is the tiles' either way."""
    _needs_tiles()
    case = make_cascade(5, 9, 3, 64, [6, 3], 1, torch.bfloat16)
    tiles = list(native.pack_prefix_tiles(case["prefix_k"], case["prefix_v"], case["prefix_lens"]))
    with native.without_bf16_dot_products():
        out, lse = native.attend_cascade_tiles(case["q"], tiles, case["prefix_lens"], case["members"],
                                               case["k_cache"], case["v_cache"], case["tables"], case["starts"],
                                               case["own"], 0.125)
    want, want_lse = dense(case, 0.125)
    torch.testing.assert_close(out.double(), want, rtol=2 ** -7, atol=2 ** -7)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-4)


def test_packed_prefixes_refuse_bad_arguments():
    _needs_tiles()
    case = make_cascade(2, 9, 3, 64, [2], 0, torch.bfloat16)
    tiles = list(native.pack_prefix_tiles(case["prefix_k"], case["prefix_v"], case["prefix_lens"]))
    rest = (case["prefix_lens"], case["members"], case["k_cache"], case["v_cache"], case["tables"], case["starts"],
            case["own"], 0.125)
    with pytest.raises(RuntimeError, match="takes bfloat16 prefixes"):
        native.pack_prefix_tiles(case["prefix_k"].float(), case["prefix_v"].float(), case["prefix_lens"])
    with pytest.raises(RuntimeError, match=r"prefix_lens\[0\]=.* not in \[0, "):
        native.pack_prefix_tiles(case["prefix_k"], case["prefix_v"], case["prefix_lens"] + 1000)
    with pytest.raises(RuntimeError, match="takes bfloat16 q"):
        native.attend_cascade_tiles(case["q"].float(), tiles, *rest)
    with pytest.raises(RuntimeError, match=r"prefix_tiles\[0\] must be"):
        native.attend_cascade_tiles(case["q"], [tiles[0][..., :-1].contiguous()], *rest)
    with pytest.raises(RuntimeError, match=r"prefix_tiles\[0\] must be"):
        native.attend_cascade_tiles(case["q"], [tiles[0].float()], *rest)
    with pytest.raises(RuntimeError, match="prefix_lens must be"):
        native.attend_cascade_tiles(case["q"], tiles + tiles, *rest)  # one prefix per group
    with pytest.raises(RuntimeError, match=r"prefix_lens\[0\]=.* not in \[1, "):
        native.attend_cascade_tiles(case["q"], tiles, case["prefix_lens"] + 1000, *rest[1:])
    two = make_cascade(3, 9, 3, 64, [2, 1], 0, torch.bfloat16)
    short = native.pack_prefix_tiles(*(two[n][:1, :, :16].contiguous() for n in ("prefix_k", "prefix_v")),
                                     torch.tensor([16]))[0]  # room for 64 keys
    long = native.pack_prefix_tiles(*(torch.zeros(1, 3, 128, 64, dtype=torch.bfloat16) for _ in range(2)),
                                    torch.tensor([128]))[0]
    with pytest.raises(RuntimeError, match=r"prefix_lens\[0\]=65 is longer than prefix_tiles\[0\] holds"):
        native.attend_cascade_tiles(two["q"], [short, long], torch.tensor([65, 1]), two["members"], two["k_cache"],
                                    two["v_cache"], two["tables"], two["starts"], two["own"], 0.125)
    with native.without_attention_tiles(), pytest.raises(RuntimeError, match="does not run here"):
        native.attend_cascade_tiles(case["q"], tiles, *rest)


def test_same_result_on_one_thread_and_many():
    """Items are independent: the thread count does not change a bit."""
    case = make_cascade(3, 9, 3, 64, [8, 8, 3, 20], 3, torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = cascade(case, 0.125)
    finally:
        torch.set_num_threads(threads)
    many, _ = cascade(case, 0.125)
    assert torch.equal(one, many)


@pytest.mark.parametrize(("change", "message"), [
    (dict(members=torch.tensor([[0, 0]])), "more than one group slot"),
    (dict(members=torch.tensor([[0, 9]])), r"position 9 not in \[0, 3\)"),
    (dict(members=torch.tensor([[-1, 0]])), "after its -1 padding"),
    (dict(members=torch.tensor([[-1, -1]])), "has no member"),
    (dict(prefix_lens=torch.tensor([17])), r"prefix_lens\[0\]=17 not in \[1, 16\]"),
    (dict(prefix_lens=torch.tensor([0])), "prefix_lens"),
    (dict(tables=torch.tensor([[0, 1], [2, 40], [4, 5]])), "block 40"),
    (dict(own=torch.tensor([3, 0, 3])), "kv_lens >= 1"),
    (dict(q=torch.randn(3, 9, 64).transpose(0, 1).contiguous().transpose(0, 1)), "contiguous CPU"),
    (dict(q=torch.randn(3, 24, 16)), "head_dim"),
    (dict(q=torch.randn(3, 27, 64)), "at most 8 query heads per KV head"),
    (dict(prefix_k=torch.zeros(1, 2, 16, 64)), "prefix_k must be"),
])
def test_bad_arguments_raise_clear_errors(change, message):
    gen = torch.Generator().manual_seed(0)
    case = dict(q=torch.randn(3, 9, 64, generator=gen), prefix_k=torch.randn(1, 3, 16, 64, generator=gen),
                prefix_v=torch.randn(1, 3, 16, 64, generator=gen), prefix_lens=torch.tensor([16]),
                members=torch.tensor([[0, 2]]), k_cache=torch.randn(10, BLOCK, 3, 64, generator=gen),
                v_cache=torch.randn(10, BLOCK, 3, 64, generator=gen), tables=torch.tensor([[0, 1], [2, 3], [4, 5]]),
                starts=torch.tensor([16, 0, 16]), own=torch.tensor([3, 20, 3]))
    cascade(case, 0.125)  # fine as it is
    case.update(change)
    if "prefix_k" in change:
        case["prefix_v"] = change["prefix_k"]
    with pytest.raises(RuntimeError, match=message):
        cascade(case, 0.125)
