"""The torch backend's shared-prefix (cascade) decode attention and its group detection."""

from __future__ import annotations

import math
import random

import pytest
import torch

from model_service.attention.indexing import shared_prefix_groups
from model_service.attention.merge_state import attention_with_lse, attention_with_lse_matmul, merge_states
from model_service.attention.torch_backend import TorchAttentionBackend
from tests.model_service.attention.paged_case import make_case, reference_attention

SMOLLM2 = dict(num_q_heads=9, num_kv_heads=3, head_dim=64)


def backend_for(case_heads: dict, block_size: int, **kwargs) -> TorchAttentionBackend:
    return TorchAttentionBackend(case_heads["num_q_heads"], case_heads["num_kv_heads"], case_heads["head_dim"],
                                 block_size, torch.float32, torch.device("cpu"), **kwargs)


def run(backend: TorchAttentionBackend, case, scale: float) -> torch.Tensor:
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    backend.plan(case.layout)
    out = backend.forward(case.q, case.k, case.v, k_cache, v_cache, scale)
    k_exp, v_exp = case.expected_caches()
    torch.testing.assert_close(k_cache, k_exp, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_exp, rtol=0, atol=0, equal_nan=True)
    return out


def shared_case(groups: list[tuple[int, list[int]]], *, block_size: int, unshared: list[int] = (),
                prefill: list[tuple[int, int]] = (), seed: int = 0, layout_seed: int | None = None,
                heads: dict = SMOLLM2, **kwargs):
    """Decode members of groups (shared blocks, [member context lengths]), unshared decode
    contexts and prefill (seq_len, query_len) sequences, in a random order (by layout seed)."""
    layout_seed = seed if layout_seed is None else layout_seed
    seqs = [(s, 1, g) for g, (_, lens) in enumerate(groups) for s in lens]
    seqs += [(s, 1, -1) for s in unshared] + [(s, ql, -1) for s, ql in prefill]
    random.Random(layout_seed).shuffle(seqs)
    return make_case([s for s, _, _ in seqs], [ql for _, ql, _ in seqs], block_size=block_size, seed=seed,
                     layout_seed=layout_seed, group_of=[g for _, _, g in seqs],
                     shared_blocks=[nb for nb, _ in groups], **heads, **kwargs)


def check_against_reference(case, out, scale):
    ref = reference_attention(case, scale)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=2e-6)
    return (out.double() - ref).abs().max().item()


def random_groups(rng: random.Random, block_size: int, max_groups: int = 4) -> list[tuple[int, list[int]]]:
    groups = []
    for _ in range(rng.randint(1, max_groups)):
        shared = rng.randint(1, 6)
        size = rng.choice([1, 2, 3, 5])  # size 1: a "group" that shares nothing
        # Contexts end anywhere after the shared blocks (a new token never lands in them).
        groups.append((shared, [shared * block_size + rng.randint(1, 3 * block_size) for _ in range(size)]))
    return groups


@pytest.mark.parametrize("heads", [SMOLLM2, dict(num_q_heads=4, num_kv_heads=4, head_dim=32),
                                   dict(num_q_heads=8, num_kv_heads=1, head_dim=16)])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_random_shared_prefixes_match_reference(seed, heads, kernels):
    """Random groups sharing prefixes of random lengths, ragged suffixes, groups of one,
    unshared decodes and prefills in the same step, over shuffled blocks."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 5, 16])
    groups = random_groups(rng, block_size)
    unshared = [rng.randint(1, 80) for _ in range(rng.randint(0, 3))]
    prefill = [(p + ql, ql) for p, ql in ((rng.randint(0, 40), rng.randint(2, 20)) for _ in range(rng.randint(0, 2)))]
    case = shared_case(groups, block_size=block_size, unshared=unshared, prefill=prefill, seed=seed, heads=heads)
    scale = 1.0 / math.sqrt(heads["head_dim"])
    backend = backend_for(heads, block_size, cascade="always", kernels=kernels)
    out = run(backend, case, scale)
    check_against_reference(case, out, scale)
    if any(len(lens) >= 2 for _, lens in groups):
        assert backend._decode.cascade is not None
    plain = run(backend_for(heads, block_size, cascade="never", kernels=kernels), case, scale)
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-6)


def test_issue_shape_takes_the_cascade_and_matches_plain_path():
    """4 groups x 8 sharing a 1024-token prefix, 32-token questions, decoding (+ ragged)."""
    bs = 16
    rng = random.Random(0)
    groups = [(64, [1024 + 32 + rng.randint(1, 64) for _ in range(8)]) for _ in range(4)]
    case = shared_case(groups, block_size=bs, seed=3)
    scale = 0.125
    backend = backend_for(SMOLLM2, bs)
    out = run(backend, case, scale)
    c = backend._decode.cascade
    assert c is not None and backend._decode.plain is None
    assert (c.num_groups, c.max_members, c.prefix.kv_len) == (4, 8, 1024)
    assert c.prefix.attn_mask is None  # equal shared prefixes: no padding
    assert c.rest.kv_len == max(case.seq_lens) - 1024
    # Every member reads back its own prefix result slot: (group, rank in group) is a bijection.
    slots = c.pick_group.flatten() * c.max_members + c.pick_slot[:, 0, 0] // 3
    assert sorted(slots.tolist()) == list(range(32))
    assert torch.equal(c.prefix_q_seq[c.pick_group, c.pick_head, c.pick_slot].flatten(0),
                       c.members[:, None, None].expand(32, 3, 3).flatten(0))
    err = check_against_reference(case, out, scale)
    assert err < 1e-5
    plain = run(backend_for(SMOLLM2, bs, cascade="never"), case, scale)
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-6)
    legacy = run(backend_for(SMOLLM2, bs, decode_gather="blocks"), case, scale)
    torch.testing.assert_close(out, legacy, rtol=1e-5, atol=1e-6)


def test_groups_of_different_sizes_and_prefixes_with_unshared_and_prefill():
    bs = 5
    groups = [(1, [9, 7]), (7, [40, 41, 36, 50, 44]), (3, [19]), (2, [11, 12, 20])]
    case = shared_case(groups, block_size=bs, unshared=[33, 1, 70], prefill=[(30, 9), (12, 12)], seed=5)
    backend = backend_for(SMOLLM2, bs, cascade="always")
    out = run(backend, case, 0.2)
    d = backend._decode
    assert d.cascade is not None and d.rows is not None and len(backend._groups) == 1
    assert d.cascade.num_groups == 3 and d.cascade.max_members == 5  # the group of one is no group
    assert d.cascade.prefix.attn_mask is not None  # prefixes of 1, 7 and 2 blocks, padded to 7
    check_against_reference(case, out, 0.2)


def test_stale_non_finite_slots_do_not_leak_into_the_cascade():
    bs = 16
    groups = [(2, [40, 45, 33]), (1, [17, 30])]
    case = shared_case(groups, block_size=bs, unshared=[5, 64], seed=1, garbage=float("nan"))
    backend = backend_for(SMOLLM2, bs, cascade="always")
    out = run(backend, case, 0.125)
    assert backend._decode.cascade is not None
    assert not out.isnan().any()
    check_against_reference(case, out, 0.125)


def test_plan_is_shared_by_layers_with_cascade():
    """plan() once, forward() per layer with that layer's own cache and tensors."""
    bs = 4
    groups = [(3, [20, 15, 13]), (2, [9, 30])]
    cases = [shared_case(groups, block_size=bs, unshared=[7], prefill=[(10, 4)], seed=100 + layer, layout_seed=0)
             for layer in range(3)]
    assert all(torch.equal(c.layout.block_tables, cases[0].layout.block_tables) for c in cases)
    backend = backend_for(SMOLLM2, bs, cascade="always")
    backend.plan(cases[0].layout)
    assert backend._decode.cascade is not None
    for case in cases:
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        out = backend.forward(case.q, case.k, case.v, k_cache, v_cache, 0.3)
        check_against_reference(case, out, 0.3)
        k_exp, v_exp = case.expected_caches()
        assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp)


def test_cost_model_keeps_small_sharing_on_the_plain_path():
    bs = 16
    case = shared_case([(1, [40, 50])], block_size=bs, unshared=[60], seed=2)
    backend = backend_for(SMOLLM2, bs)  # default "auto": sparing 16 tokens is not worth the extra calls
    out = run(backend, case, 0.125)
    assert backend._decode.cascade is None
    check_against_reference(case, out, 0.125)
    backend = backend_for(SMOLLM2, bs, cascade="always", min_shared_blocks=2)
    run(backend, case, 0.125)
    assert backend._decode.cascade is None  # shares 1 block < 2
    backend = backend_for(SMOLLM2, bs, cascade="always")
    out = run(backend, case, 0.125)
    assert backend._decode.cascade is not None
    check_against_reference(case, out, 0.125)


@pytest.mark.parametrize("combined", [True, False])
def test_suffixes_with_or_apart_from_ungrouped_contexts(combined):
    """Suffixes and ungrouped contexts of similar lengths share one padded call; short
    suffixes next to long unshared contexts are attended apart (the cost model picks)."""
    bs = 16
    if combined:  # one pair sharing 32 blocks (suffixes < 90) among contexts of ~300
        case = shared_case([(32, [600, 590])], block_size=bs, unshared=[300, 290, 280, 299], seed=6)
    else:  # 3 groups x 4 sharing 16 blocks (suffixes < 40) and 2 unshared contexts of 300
        case = shared_case([(16, [256 + 20 + i for i in range(4)])] * 3, block_size=bs, unshared=[300, 290], seed=6)
    backend = backend_for(SMOLLM2, bs)
    out = run(backend, case, 0.125)
    d = backend._decode
    assert d.cascade is not None and d.cascade.combined == combined
    assert (d.plain is None) == combined
    check_against_reference(case, out, 0.125)
    torch.testing.assert_close(out, run(backend_for(SMOLLM2, bs, cascade="never"), case, 0.125),
                               rtol=1e-5, atol=1e-6)


def test_single_decode_and_cascade_off_unchanged():
    bs = 16
    case = shared_case([(2, [40, 50, 45])], block_size=bs, seed=4)
    backend = backend_for(SMOLLM2, bs, cascade="never")
    run(backend, case, 0.125)
    assert backend._decode.cascade is None


# ------------------------------------------------------------- group detection
def groups_of(tables, shareable, min_shared=1):
    group, shared = shared_prefix_groups(torch.tensor(tables), torch.tensor(shareable), min_shared)
    return group.tolist(), shared.tolist()


def test_detection_groups_by_common_leading_blocks():
    tables = [[9, 1, 2, 3], [9, 1, 2, 4], [9, 5, 6, 7], [9, 5, 6, 8], [3, 4, 5, 6], [9, 1, 2, 5]]
    group, shared = groups_of(tables, [4] * 6)
    assert shared == [3, 3]
    assert group[0] == group[1] == group[5] != group[2] == group[3] and group[4] == -1
    assert groups_of(tables, [4] * 6, min_shared=4) == ([-1] * 6, [])


def test_detection_prefers_deep_groups_below_a_common_system_prompt():
    # 4 groups x 3 share 6 blocks, all 12 share the first 2 (a system prompt).
    tables, rng = [], random.Random(0)
    for g in range(4):
        for m in range(3):
            tables.append([0, 1] + [10 + 10 * g + j for j in range(4)] + [100 + 3 * g + m])
    order = list(range(12))
    rng.shuffle(order)
    group, shared = groups_of([tables[i] for i in order], [7] * 12)
    assert shared == [6] * 4
    by_group = {}
    for pos, i in enumerate(order):
        by_group.setdefault(group[pos], set()).add(i // 3)
    assert all(len(v) == 1 for v in by_group.values()) and len(by_group) == 4


def test_detection_respects_shareable_length():
    tables = [[5, 6, 7], [5, 6, 7], [5, 6, 8]]
    assert groups_of(tables, [2, 2, 2]) == ([0, 0, 0], [2])
    assert groups_of(tables, [0, 2, 2]) == ([-1, 0, 0], [2])  # row 0 may share nothing
    assert groups_of(tables, [1, 3, 3]) == ([0, 0, 0], [1])  # common = min over members
    assert groups_of([[5, 6]], [2]) == ([-1], [])
    assert groups_of(tables, [0, 0, 0]) == ([-1, -1, -1], [])


# ------------------------------------------------------------------ merge math
@pytest.mark.parametrize("attend", [attention_with_lse, attention_with_lse_matmul])
def test_attention_lse_and_merge_split_softmax_exactly(attend):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 4, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 3, 50, 16, generator=gen, dtype=torch.float64) * 3
    v = torch.randn(2, 3, 50, 16, generator=gen, dtype=torch.float64)
    scores = q @ k.transpose(-1, -2) * 0.5
    expected = torch.softmax(scores, -1) @ v
    full, lse = attend(q, k, v, None, 0.5)
    torch.testing.assert_close(full, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-12, atol=1e-12)
    o1, l1 = attend(q, k[:, :, :17].contiguous(), v[:, :, :17].contiguous(), None, 0.5)
    o2, l2 = attend(q, k[:, :, 17:].contiguous(), v[:, :, 17:].contiguous(), None, 0.5)
    torch.testing.assert_close(merge_states(o1, l1, o2, l2), expected, rtol=1e-12, atol=1e-12)
    # Key padding: an additive mask hides the keys past each batch row's length.
    lens = torch.tensor([50, 9])
    mask = torch.zeros(2, 1, 1, 50, dtype=torch.float64).masked_fill_(
        (torch.arange(50)[None, :] >= lens[:, None])[:, None, None, :], float("-inf"))
    out, lse = attend(q, k, v, mask, 0.5)
    torch.testing.assert_close(out[1], torch.softmax(scores[1, :, :, :9], -1) @ v[1, :, :9], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse[1], torch.logsumexp(scores[1, :, :, :9], -1), rtol=1e-12, atol=1e-12)


def test_matmul_lse_in_the_backend_matches(monkeypatch):
    """The backend's cascade without torch's CPU flash kernel (as on CUDA): same results."""
    import model_service.attention.merge_state as tb

    case = shared_case([(3, [60, 50, 70]), (2, [40, 33])], block_size=16, unshared=[20], seed=7)
    fused = run(backend_for(SMOLLM2, 16, cascade="always", kernels="torch"), case, 0.125)
    monkeypatch.setattr(tb, "_FLASH_CPU", None)
    backend = backend_for(SMOLLM2, 16, cascade="always", kernels="torch")
    out = run(backend, case, 0.125)
    assert backend._decode.cascade is not None
    torch.testing.assert_close(out, fused, rtol=1e-5, atol=1e-6)
    check_against_reference(case, out, 0.125)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cascade_in_16_bit(dtype, monkeypatch):
    import model_service.attention.merge_state as tb

    case = shared_case([(3, [60, 50, 70]), (2, [40, 33])], block_size=16, unshared=[20], prefill=[(30, 5)],
                       seed=8, dtype=dtype)
    ref = reference_attention(case, 0.125)
    # torch's CPU flash kernel, the matmul path CUDA takes, and the native kernels (bf16, where built)
    for flash, kernels in ((tb._FLASH_CPU, "torch"), (None, "torch"), (tb._FLASH_CPU, "auto")):
        monkeypatch.setattr(tb, "_FLASH_CPU", flash)
        backend = TorchAttentionBackend(9, 3, 64, 16, dtype, torch.device("cpu"), cascade="always", kernels=kernels)
        out = run(backend, case, 0.125)
        assert backend._decode.cascade is not None and out.dtype == dtype
        torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
