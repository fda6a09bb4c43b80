"""TorchAttentionBackend against naive dense causal attention, and its KV writes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from model_service.attention.torch_backend import TorchAttentionBackend
from tests.model_service.attention.paged_case import make_case, reference_attention

SMOLLM2 = dict(num_q_heads=9, num_kv_heads=3, head_dim=64)


def run_backend(case, *, num_q_heads, num_kv_heads, head_dim, block_size, scale, kernels="auto"):
    backend = TorchAttentionBackend(num_q_heads, num_kv_heads, head_dim, block_size,
                                    torch.float32, torch.device("cpu"), kernels=kernels)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    backend.plan(case.layout)
    out = backend.forward(case.q, case.k, case.v, k_cache, v_cache, scale)
    return backend, out, k_cache, v_cache


def check_case(seq_lens, query_lens, *, block_size, num_q_heads, num_kv_heads, head_dim, seed=0, kernels="auto"):
    case = make_case(seq_lens, query_lens, block_size=block_size, num_q_heads=num_q_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, seed=seed)
    scale = 1.0 / math.sqrt(head_dim)
    backend, out, k_cache, v_cache = run_backend(case, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                                 head_dim=head_dim, block_size=block_size, scale=scale,
                                                 kernels=kernels)
    assert out.shape == (sum(query_lens), num_q_heads, head_dim)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference_attention(case, scale).float(), rtol=1e-5, atol=2e-6)
    k_exp, v_exp = case.expected_caches()
    assert torch.equal(k_cache, k_exp), "K written to the wrong slots or other slots changed"
    assert torch.equal(v_cache, v_exp), "V written to the wrong slots or other slots changed"
    return backend


SCENARIOS = {
    # name: (seq_lens, query_lens)
    "prefill_single_no_prefix": ([37], [37]),
    "prefill_single_unaligned_prefix": ([41], [9]),
    "prefill_single_one_new_token_after_prefix": ([23, 50], [23, 2]),
    "prefill_batch_ragged_prefixes": ([37, 16, 70, 5], [37, 3, 11, 5]),
    "decode_single": ([33], [1]),
    "decode_batch_equal_lengths": ([21, 21, 21], [1, 1, 1]),
    "decode_batch_ragged": ([1, 16, 17, 64, 33], [1, 1, 1, 1, 1]),
    "mixed_prefill_and_decode": ([40, 17, 9, 80, 3], [1, 12, 1, 7, 3]),
    "mixed_one_prefill_many_decodes": ([30, 31, 32, 50], [1, 1, 1, 50]),
    # Chunks of EXTEND_ALONE_TOKENS (128) or more get an SDPA call each, the short ones one call.
    "long_prompts_and_short_hits": ([200, 214, 120, 133], [200, 150, 5, 20]),
    "long_prompts_hits_and_decodes": ([131, 50, 260, 70, 140], [131, 1, 140, 1, 17]),
}


@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_matches_dense_reference_gqa(name, block_size, kernels):
    seq_lens, query_lens = SCENARIOS[name]
    check_case(seq_lens, query_lens, block_size=block_size, kernels=kernels, **SMOLLM2)


@pytest.mark.parametrize("heads", [(4, 4, 32), (8, 1, 16)])
def test_matches_dense_reference_mha_and_mqa(heads):
    hq, hkv, d = heads
    check_case([40, 17, 9, 26], [1, 12, 1, 26], block_size=4, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 24)), min_size=1, max_size=5),
    block_size=st.sampled_from([1, 3, 5, 16]),
    heads=st.sampled_from([(9, 3, 64), (4, 2, 8), (2, 2, 16)]),
    decode_only=st.booleans(),
    seed=st.integers(0, 2**16),
    kernels=st.sampled_from(["auto", "torch"]),
)
def test_random_batches_property(seqs, block_size, heads, decode_only, seed, kernels):
    """Any mix of cached prefix (0..40, unaligned) and new tokens matches the reference."""
    query_lens = [1 if decode_only else ql for _, ql in seqs]
    seq_lens = [prefix + ql for (prefix, _), ql in zip(seqs, query_lens, strict=True)]
    hq, hkv, d = heads
    check_case(seq_lens, query_lens, block_size=block_size, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
               seed=seed, kernels=kernels)


def test_single_sequence_matches_dense_sdpa_bitwise():
    """One sequence uses the very SDPA call dense (HF sdpa) attention makes: same bits."""
    hq, hkv, d, bs = 9, 3, 64, 16
    scale = 1.0 / math.sqrt(d)
    # Prefill without cached prefix.
    case = make_case([45], [45], block_size=bs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, seed=1)
    _, out, _, _ = run_backend(case, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, scale=scale)
    dense = F.scaled_dot_product_attention(
        case.q.transpose(0, 1).unsqueeze(0), case.full_k[0].transpose(0, 1).unsqueeze(0).contiguous(),
        case.full_v[0].transpose(0, 1).unsqueeze(0).contiguous(), is_causal=True, scale=scale, enable_gqa=True)
    assert torch.equal(out, dense[0].transpose(0, 1))
    # Decode over a context gathered from shuffled blocks.
    case = make_case([45], [1], block_size=bs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, seed=2)
    _, out, _, _ = run_backend(case, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, scale=scale)
    dense = F.scaled_dot_product_attention(
        case.q.unsqueeze(2), case.full_k[0].transpose(0, 1).unsqueeze(0).contiguous(),
        case.full_v[0].transpose(0, 1).unsqueeze(0).contiguous(), scale=scale, enable_gqa=True)
    assert torch.equal(out, dense[:, :, 0])


def test_fast_paths_are_planned():
    mk = dict(block_size=16, seed=0, **SMOLLM2)
    backend = TorchAttentionBackend(9, 3, 64, 16, torch.float32, torch.device("cpu"))
    backend.plan(make_case([30], [30], **mk).layout)
    (g,) = backend._groups
    assert backend._decode is None
    assert g.block_ids is None and g.is_causal and g.attn_mask is None  # dense causal, no gather
    backend.plan(make_case([20, 20, 20], [1, 1, 1], **mk).layout)
    d = backend._decode
    assert not backend._groups and d.cascade is None and d.rows is None and d.plain_seqs is None
    assert d.plain.attn_mask is None and d.plain.kv_len == 20  # equal lengths: no mask
    backend.plan(make_case([20, 33], [1, 1], **mk).layout)
    assert backend._decode.plain.attn_mask.shape == (2, 1, 1, 33)  # key padding only
    backend.plan(make_case([20, 33, 40], [1, 30, 1], **mk).layout)
    (g,) = backend._groups
    assert g.max_query_len == 30 and backend._decode.num_seqs == 2  # decode rows not padded to 30
    # The pre-cascade path, kept for comparisons: decode planned like an extend group.
    legacy = TorchAttentionBackend(9, 3, 64, 16, torch.float32, torch.device("cpu"), decode_gather="blocks")
    legacy.plan(make_case([20, 33, 40], [1, 30, 1], **mk).layout)
    assert legacy._decode is None and [grp.max_query_len for grp in legacy._groups] == [1, 30]


def test_long_extend_chunks_are_not_padded_with_short_ones():
    """A prompt's chunk and a few cache hits' short suffixes: the short ones share one padded
    call, each long one has its own (padding every hit to the prompt's length multiplies the
    attention cost by the number of hits)."""
    mk = dict(block_size=16, seed=0, **SMOLLM2)
    backend = TorchAttentionBackend(9, 3, 64, 16, torch.float32, torch.device("cpu"))
    backend.plan(make_case([200, 214, 120, 133, 60], [200, 150, 5, 20, 1], **mk).layout)
    assert [(g.num_seqs, g.max_query_len) for g in backend._groups] == [(2, 20), (1, 200), (1, 150)]
    assert backend._groups[1].block_ids is None and backend._groups[1].is_causal  # no cached prefix
    assert backend._decode is not None and backend._decode.num_seqs == 1
    backend.plan(make_case([200, 300], [200, 130], **mk).layout)
    assert [(g.num_seqs, g.max_query_len) for g in backend._groups] == [(1, 200), (1, 130)]


def test_plan_is_shared_by_layers():
    """plan() once, forward() per layer with that layer's own cache and tensors."""
    hq, hkv, d, bs = 9, 3, 64, 5
    seq_lens, query_lens = [40, 17, 9, 30], [1, 12, 1, 7]
    cases = [make_case(seq_lens, query_lens, block_size=bs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                       seed=layer, layout_seed=7) for layer in range(3)]
    assert all(torch.equal(c.layout.slot_mapping, cases[0].layout.slot_mapping) for c in cases)
    backend = TorchAttentionBackend(hq, hkv, d, bs, torch.float32, torch.device("cpu"))
    backend.plan(cases[0].layout)
    for case in cases:
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        out = backend.forward(case.q, case.k, case.v, k_cache, v_cache, 0.125)
        torch.testing.assert_close(out, reference_attention(case, 0.125).float(), rtol=1e-5, atol=2e-6)
        k_exp, v_exp = case.expected_caches()
        assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp)


def test_forward_before_plan_raises():
    backend = TorchAttentionBackend(2, 1, 8, 4, torch.float32, torch.device("cpu"))
    x = torch.zeros(1, 2, 8)
    with pytest.raises(RuntimeError, match="plan"):
        backend.forward(x, x[:, :1], x[:, :1], torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8), 1.0)


def test_non_contiguous_inputs():
    """q/k/v as the model hands them over: transposed views of [1, H, T, D] tensors."""
    hq, hkv, d, bs = 9, 3, 64, 16
    case = make_case([12, 40], [12, 5], block_size=bs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    q = case.q.transpose(0, 1).contiguous().transpose(0, 1)
    k = case.k.transpose(0, 1).contiguous().transpose(0, 1)
    v = case.v.transpose(0, 1).contiguous().transpose(0, 1)
    assert not q.is_contiguous()
    backend = TorchAttentionBackend(hq, hkv, d, bs, torch.float32, torch.device("cpu"))
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    backend.plan(case.layout)
    out = backend.forward(q, k, v, k_cache, v_cache, 0.125)
    torch.testing.assert_close(out, reference_attention(case, 0.125).float(), rtol=1e-5, atol=2e-6)
    k_exp, v_exp = case.expected_caches()
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp)


@pytest.mark.parametrize("name", ["decode_batch_ragged", "prefill_batch_ragged_prefixes",
                                  "mixed_prefill_and_decode", "prefill_single_unaligned_prefix"])
@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_stale_non_finite_slots_do_not_leak(name, kernels):
    """Slots past a sequence's end (stale data of a block's previous owner, padding blocks)
    are never attended to, even when they hold NaN."""
    seq_lens, query_lens = SCENARIOS[name]
    hq, hkv, d, bs = 9, 3, 64, 16
    case = make_case(seq_lens, query_lens, block_size=bs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                     garbage=float("nan"))
    _, out, k_cache, v_cache = run_backend(case, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                                           scale=0.125, kernels=kernels)
    assert not out.isnan().any()
    torch.testing.assert_close(out, reference_attention(case, 0.125).float(), rtol=1e-5, atol=2e-6)
    k_exp, v_exp = case.expected_caches()
    torch.testing.assert_close(k_cache, k_exp, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_exp, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 32), (8, 1, 16)])
@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_16_bit_decode_attends_query_heads_as_rows(dtype, heads, kernels):
    """In 16 bits on CPU ungrouped decodes run the r query heads of a KV head as r query rows
    (torch: the flash kernel's fast form; auto: the native kernel's rows, where it runs): still
    the dense reference, ragged lengths and masks included."""
    hq, hkv, d = heads
    case = make_case([1, 16, 17, 64, 33, 70], [1, 1, 1, 1, 1, 1], block_size=16, num_q_heads=hq,
                     num_kv_heads=hkv, head_dim=d, seed=3, dtype=dtype)
    backend = TorchAttentionBackend(hq, hkv, d, 16, dtype, torch.device("cpu"), cascade="never", kernels=kernels)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    backend.plan(case.layout)
    out = backend.forward(case.q, case.k, case.v, k_cache, v_cache, d ** -0.5)
    assert backend._decode is not None and backend._decode.plain is not None
    assert out.shape == case.q.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), reference_attention(case, d ** -0.5), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("prompts_on_sdpa", [False, True])
@pytest.mark.parametrize("extends_on_sdpa", [False, True])
def test_bf16_prompt_chunks_take_the_timed_paths_and_stay_the_reference(monkeypatch, prompts_on_sdpa,
                                                                        extends_on_sdpa):
    """A fresh bf16 prompt, and chunks after a cached prefix, attend through torch's SDPA where the
    start-up timing found it faster for that kind (prompt_timing.py), else through the native
    kernel: either is the dense reference within bf16 rounding, padded chunks of unequal lengths
    and contexts included (the padding gathered for SDPA is zeroed: a stale NaN would spread)."""
    from model_service import native

    if not native.available():
        pytest.skip(f"native kernels: library not loaded ({native.unavailable_reason()})")
    calls = _sdpa_calls_with_timing(monkeypatch, prompts_on_sdpa, extends_on_sdpa)
    # The calls the timing decides: those AMX tiles do not take (all of them with the tiles off).
    with native.without_attention_tiles():
        _attend_bf16_cases(CHUNK_CASES)
    assert calls == ["causal"] * prompts_on_sdpa + ["masked"] * (2 * extends_on_sdpa)


def _sdpa_calls_with_timing(monkeypatch, prompts_on_sdpa: bool, extends_on_sdpa: bool) -> list[str]:
    """Backends built from here on see this start-up timing; the returned list records each
    torch SDPA call they make ("causal" or "masked")."""
    from model_service.attention import torch_backend

    monkeypatch.setattr(torch_backend, "sdpa_faster_for_bf16_prompts", lambda *shape: prompts_on_sdpa)
    monkeypatch.setattr(torch_backend, "sdpa_faster_for_bf16_extends", lambda *shape: extends_on_sdpa)
    calls: list[str] = []
    real_sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(torch_backend.F, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append("causal" if k.get("is_causal") else "masked")
                        or real_sdpa(*a, **k))
    return calls


# A fresh prompt; one extend over 260 cached; three over unequal prefixes (one padded call).
CHUNK_CASES = (([300], [300]), ([300], [40]), ([300, 90, 177], [40, 7, 33]))


def _attend_bf16_cases(cases) -> None:
    """Each case through a fresh bf16 backend, checked against the dense reference."""
    hq, hkv, d = 9, 3, 64
    for seq_lens, query_lens in cases:
        case = make_case(seq_lens, query_lens, block_size=16, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                         seed=5, dtype=torch.bfloat16, garbage=float("nan"))  # NaN in every stale slot
        backend = TorchAttentionBackend(hq, hkv, d, 16, torch.bfloat16, torch.device("cpu"))
        assert backend.native
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        backend.plan(case.layout)
        out = backend.forward(case.q, case.k, case.v, k_cache, v_cache, d ** -0.5)
        torch.testing.assert_close(out.double(), reference_attention(case, d ** -0.5), rtol=2e-2, atol=2e-2)


def test_bf16_prompts_and_chunks_of_16_queries_take_amx_tiles_whatever_the_timing(monkeypatch):
    """Where the native kernel runs bf16 calls on AMX tiles, prompts and chunks of 16+ queries per
    head go there even where the timing found SDPA faster than the row kernels; fewer go by it."""
    from model_service import native

    if not native.available() or native.attention_tiles_min_queries(64) is None:
        pytest.skip("native attention tiles: no AMX here (or the library is not built)")
    calls = _sdpa_calls_with_timing(monkeypatch, prompts_on_sdpa=True, extends_on_sdpa=True)
    _attend_bf16_cases(CHUNK_CASES)
    assert calls == []
    _attend_bf16_cases([([12], [12]), ([300, 90], [9, 15])])  # under 16 queries per head
    assert calls == ["causal", "masked"]


def test_bf16_prompt_timing_answers_once_per_shape():
    from model_service import native
    from model_service.attention.prompt_timing import (
        sdpa_faster_for_bf16_extends,
        sdpa_faster_for_bf16_prompts,
    )

    if not native.available():
        pytest.skip(f"native kernels: library not loaded ({native.unavailable_reason()})")
    first = sdpa_faster_for_bf16_prompts(4, 2, 32, length=64, repeats=1)
    assert isinstance(first, bool) and sdpa_faster_for_bf16_prompts(4, 2, 32, length=64, repeats=1) is first
    assert sdpa_faster_for_bf16_prompts.cache_info().hits >= 1
    first = sdpa_faster_for_bf16_extends(4, 2, 32, shape=(2, 8, 40), repeats=1)
    assert isinstance(first, bool) and sdpa_faster_for_bf16_extends(4, 2, 32, shape=(2, 8, 40), repeats=1) is first
    assert sdpa_faster_for_bf16_extends.cache_info().hits >= 1
