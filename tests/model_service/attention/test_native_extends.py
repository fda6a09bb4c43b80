"""native.attend_extends_tiles (chunks of new tokens over cached prefixes packed for the AMX
tiles) against dense float64 attention. Skipped where attention does not run on AMX tiles."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model_service import native

pytestmark = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AMX"),
                                reason="native kernels: this CPU has no AVX-512")


@pytest.fixture(autouse=True)
def tiles() -> None:
    assert native.available(), native.unavailable_reason()
    if not native.cascade_on_tiles(64):
        pytest.skip("native attention tiles: no AMX here (or turned off)")


def make_extends(seed: int, hq: int, hkv: int, d: int, lens: list[int], prefix_lens: list[int]) -> dict:
    """Chunks packed one after another (a spare row before and after), q/k/v as strided views of
    one fused projection as the model hands them over, each prefix packed apart."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens) + 2
    qkv = torch.randn(total, hq + 2 * hkv, d, generator=gen).bfloat16()
    starts = [1 + sum(lens[:i]) for i in range(len(lens))]
    prefixes = [(torch.randn(1, hkv, max(p, 1), d, generator=gen).bfloat16(),
                 torch.randn(1, hkv, max(p, 1), d, generator=gen).bfloat16()) for p in prefix_lens]
    tiles = [native.pack_prefix_tiles(k, v, torch.tensor([p]))[0] for (k, v), p in zip(prefixes, prefix_lens, strict=True)]
    return dict(q=qkv[:, :hq], k=qkv[:, hq:hq + hkv], v=qkv[:, hq + hkv:], starts=torch.tensor(starts),
                lens=torch.tensor(lens), tiles=tiles, prefix_lens=torch.tensor(prefix_lens), prefixes=prefixes)


def dense(case: dict, b: int, scale: float) -> torch.Tensor:
    """float64 attention of chunk b's tokens over its prefix and its tokens up to each one."""
    s, n, p = int(case["starts"][b]), int(case["lens"][b]), int(case["prefix_lens"][b])
    pk, pv = case["prefixes"][b]
    r = case["q"].shape[1] // pk.shape[1]
    keys = torch.cat([pk[0, :, :p].double().transpose(0, 1), case["k"][s:s + n].double()]).repeat_interleave(r, 1)
    values = torch.cat([pv[0, :, :p].double().transpose(0, 1), case["v"][s:s + n].double()]).repeat_interleave(r, 1)
    scores = torch.einsum("thd,lhd->htl", case["q"][s:s + n].double(), keys) * scale
    seen = torch.arange(p + n)[None, :] <= (p + torch.arange(n))[:, None]  # [n, p + n]
    scores = scores.masked_fill(~seen[None], float("-inf"))
    return torch.einsum("htl,lhd->thd", torch.softmax(scores, -1), values)


def run(case: dict, scale: float) -> torch.Tensor:
    out = torch.full((case["q"].shape[0], *case["q"].shape[1:]), 7.0, dtype=torch.bfloat16)
    native.attend_extends_tiles(case["q"], case["k"], case["v"], case["starts"], case["lens"], case["tiles"],
                                case["prefix_lens"], scale, out)
    return out


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    heads=st.sampled_from([(9, 3), (4, 4), (8, 1), (16, 2)]),
    head_dim=st.sampled_from([32, 64, 128]),
    chunks=st.lists(st.tuples(st.integers(1, 70), st.integers(0, 300)), min_size=1, max_size=4),
    seed=st.integers(0, 1000),
)
def test_matches_dense_attention(heads, head_dim, chunks, seed):
    """Chunks of 1-70 new tokens (folded rows filling part of a tile or several) over prefixes of
    0-300 keys (within and across 64-key blocks): each new token's output is dense attention over
    the prefix and the chunk up to itself; rows outside the chunks stay untouched."""
    hq, hkv = heads
    case = make_extends(seed, hq, hkv, head_dim, [n for n, _ in chunks], [p for _, p in chunks])
    scale = head_dim ** -0.5
    out = run(case, scale)
    for b in range(len(chunks)):
        s, n = int(case["starts"][b]), int(case["lens"][b])
        torch.testing.assert_close(out[s:s + n].double(), dense(case, b, scale), rtol=2 ** -7, atol=2 ** -7)
    assert torch.all(out[0] == 7.0) and torch.all(out[-1] == 7.0)


def test_same_result_on_one_thread_and_many():
    case = make_extends(3, 9, 3, 64, [32, 5, 40], [1024, 64, 130])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(case, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, run(case, 0.125))


def test_bad_arguments_raise_clear_errors():
    case = make_extends(1, 9, 3, 64, [4, 3], [64, 16])
    out = torch.zeros(case["q"].shape, dtype=torch.bfloat16)
    args = [case["q"], case["k"], case["v"], case["starts"], case["lens"], case["tiles"], case["prefix_lens"], 0.125,
            out]

    def call(**change):
        names = ["q", "k", "v", "starts", "lens", "tiles", "prefix_lens", "scale", "out"]
        native.attend_extends_tiles(*[change.get(n, a) for n, a in zip(names, args, strict=True)])

    call()
    with pytest.raises(RuntimeError, match="must be bfloat16 CPU"):
        call(q=case["q"].float())
    with pytest.raises(RuntimeError, match="not within q's"):
        call(starts=torch.tensor([1, 7]))
    with pytest.raises(RuntimeError, match="not within q's"):
        call(lens=torch.tensor([4, 0]))
    with pytest.raises(RuntimeError, match="one per prefix_tiles"):
        call(lens=torch.tensor([4]))
    with pytest.raises(RuntimeError, match=r"prefix_lens\[1\]=65 is not within"):
        call(prefix_lens=torch.tensor([64, 65]))
    with pytest.raises(RuntimeError, match=r"prefix_tiles\[0\] must be"):
        call(tiles=[case["tiles"][0][:2].contiguous(), case["tiles"][1]])
    with native.without_attention_tiles(), pytest.raises(RuntimeError, match="does not run here"):
        call()
