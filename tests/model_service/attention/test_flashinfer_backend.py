"""FlashInferAttentionBackend against the torch backend on the same CUDA tensors.

Skips cleanly without CUDA or without the flashinfer-python package.
"""

from __future__ import annotations

import math

import pytest
import torch

from model_service.attention import create_attention_backend
from model_service.attention.torch_backend import TorchAttentionBackend
from tests.model_service.attention.paged_case import make_case, reference_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SCENARIOS = {
    # name: (seq_lens, query_lens)
    "prefill_no_prefix": ([37, 16, 70], [37, 16, 70]),
    "prefill_unaligned_prefixes": ([37, 16, 70, 5, 33], [5, 3, 11, 5, 1]),
    "decode_ragged": ([1, 16, 17, 64, 33, 200], [1, 1, 1, 1, 1, 1]),  # last page full / one token
    "mixed": ([40, 17, 9, 80, 3], [1, 12, 1, 7, 3]),
}


@pytest.fixture(scope="module")
def flashinfer():
    return pytest.importorskip("flashinfer")


TOL = {torch.float16: 1e-2, torch.bfloat16: 4e-2}


def run_both(fi, ref, case, scale):
    """Run both backends on copies of the case's caches: [(out, k_cache, v_cache)] * 2."""
    results = []
    for backend in (fi, ref):
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        backend.plan(case.layout)
        results.append((backend.forward(case.q, case.k, case.v, k_cache, v_cache, scale), k_cache, v_cache))
    torch.cuda.synchronize()
    return results


def check(fi, ref, case, scale, dtype):
    (out, k_cache, v_cache), (ref_out, _, _) = run_both(fi, ref, case, scale)
    assert out.shape == ref_out.shape == case.q.shape and out.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(out.double(), reference_attention(case, scale), rtol=tol, atol=tol)
    k_exp, v_exp = case.expected_caches()
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp), "KV not appended at exactly its slots"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_matches_torch_backend(flashinfer, name, block_size, dtype):
    seq_lens, query_lens = SCENARIOS[name]
    hq, hkv, d = 9, 3, 64
    case = make_case(seq_lens, query_lens, block_size=block_size, num_q_heads=hq, num_kv_heads=hkv,
                     head_dim=d, dtype=dtype, device="cuda")
    fi = create_attention_backend("flashinfer", hq, hkv, d, block_size, dtype, torch.device("cuda"))
    assert fi.name == "flashinfer"
    ref = TorchAttentionBackend(hq, hkv, d, block_size, dtype, torch.device("cuda"))
    check(fi, ref, case, 1.0 / math.sqrt(d), dtype)


@pytest.mark.parametrize("heads", [(8, 1, 128), (4, 4, 128)])  # tensor-core / CUDA-core decode
def test_one_backend_over_alternating_steps(flashinfer, heads):
    """One instance planned for prefill, decode and mixed steps in turn (both wrappers reused)."""
    hq, hkv, d = heads
    dtype, bs = torch.bfloat16, 16
    fi = create_attention_backend("flashinfer", hq, hkv, d, bs, dtype, "cuda")
    ref = TorchAttentionBackend(hq, hkv, d, bs, dtype, torch.device("cuda"))
    for step, name in enumerate(["prefill_unaligned_prefixes", "decode_ragged", "mixed", "decode_ragged",
                                 "prefill_no_prefix"]):
        seq_lens, query_lens = SCENARIOS[name]
        case = make_case(seq_lens, query_lens, block_size=bs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                         seed=step, dtype=dtype, device="cuda")
        check(fi, ref, case, 1.0 / math.sqrt(d), dtype)


def test_scale_change_replans(flashinfer):
    hq, hkv, d, bs = 8, 2, 64, 16
    case = make_case([30, 50], [30, 4], block_size=bs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                     dtype=torch.float16, device="cuda")
    fi = create_attention_backend("flashinfer", hq, hkv, d, bs, torch.float16, "cuda")
    ref = TorchAttentionBackend(hq, hkv, d, bs, torch.float16, torch.device("cuda"))
    check(fi, ref, case, 0.3, torch.float16)


def test_auto_picks_flashinfer_on_cuda(flashinfer):
    backend = create_attention_backend("auto", 9, 3, 64, 16, torch.bfloat16, torch.device("cuda"))
    assert backend.name == "flashinfer"


def test_append_coordinates_match_flashinfer_helper(flashinfer):
    from model_service.attention.flashinfer_backend import build_paged_kv_table

    case = make_case([40, 17, 9, 80, 3], [1, 12, 1, 7, 3], block_size=16, num_q_heads=2, num_kv_heads=1,
                     head_dim=64, dtype=torch.float16, device="cuda")
    table = build_paged_kv_table(case.layout, 16)
    batch_indices, positions = flashinfer.get_batch_indices_positions(
        case.layout.query_start_loc, case.layout.seq_lens, case.layout.num_tokens)
    assert torch.equal(batch_indices.cpu(), table.batch_indices)
    assert torch.equal(positions.cpu(), table.positions)


CASCADE_SCENARIOS = {  # name: (seq_lens, query_lens, group_of, shared_blocks) at block size 16
    # The shape: 4 groups x 8 sharing a 1024-token prefix, 32-token questions + generated.
    "4x8_shared_1024": ([1024 + 32 + (7 * i) % 64 + 1 for i in range(32)], [1] * 32,
                        [i // 8 for i in range(32)], [64] * 4),
    # Groups of different sizes and prefixes, unshared decodes and prefill chunks in one step.
    "mixed": ([300, 290, 45, 310, 200, 205, 80, 33, 199], [1, 1, 12, 1, 1, 1, 80, 1, 1],
              [0, 0, -1, 0, 1, 1, -1, -1, 1], [16, 8]),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASCADE_SCENARIOS))
def test_cascade_matches_torch_backend(flashinfer, name, dtype):
    """FlashInfer's two-level cascade (shared prefix once per group + own pages, merge_state)
    against the torch backend (its own cascade) and the dense reference."""
    seq_lens, query_lens, group_of, shared = CASCADE_SCENARIOS[name]
    hq, hkv, d, bs = 9, 3, 64, 16
    scale = 1.0 / math.sqrt(d)
    case = make_case(seq_lens, query_lens, block_size=bs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                     dtype=dtype, device="cuda", group_of=group_of, shared_blocks=shared)
    fi = create_attention_backend("flashinfer", hq, hkv, d, bs, dtype, torch.device("cuda"))
    fi.cascade_min_saved_tokens = 0
    ref = TorchAttentionBackend(hq, hkv, d, bs, dtype, torch.device("cuda"))
    (out, k_cache, v_cache), (ref_out, _, _) = run_both(fi, ref, case, scale)
    assert fi._cascade is not None and fi._cascade.num_members == sum(g >= 0 for g in group_of)
    assert ref._decode is not None and ref._decode.cascade is not None
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(out.double(), reference_attention(case, scale), rtol=tol, atol=tol)
    k_exp, v_exp = case.expected_caches()
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp)
    # The same step without the cascade: same answer.
    plain = create_attention_backend("flashinfer", hq, hkv, d, bs, dtype, torch.device("cuda"))
    plain.cascade = False
    (plain_out, _, _), _ = run_both(plain, ref, case, scale)
    assert plain._cascade is None
    torch.testing.assert_close(out.float(), plain_out.float(), rtol=tol, atol=tol)
