"""FlashInferAttentionBackend against the torch backend on the same CUDA tensors.

Skips cleanly without CUDA or without the flashinfer-python package.
"""

from __future__ import annotations

import math

import pytest
import torch

from model_service.attention import create_attention_backend
from model_service.attention.torch_backend import TorchAttentionBackend
from tests.attention.paged_case import make_case

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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_matches_torch_backend(flashinfer, name, block_size, dtype):
    seq_lens, query_lens = SCENARIOS[name]
    hq, hkv, d = 9, 3, 64
    scale = 1.0 / math.sqrt(d)
    case = make_case(seq_lens, query_lens, block_size=block_size, num_q_heads=hq, num_kv_heads=hkv,
                     head_dim=d, dtype=dtype, device="cuda")
    fi = create_attention_backend("flashinfer", hq, hkv, d, block_size, dtype, torch.device("cuda"))
    assert fi.name == "flashinfer"
    ref = TorchAttentionBackend(hq, hkv, d, block_size, dtype, torch.device("cuda"))
    outs, caches = [], []
    for backend in (fi, ref):
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        backend.plan(case.layout)
        outs.append(backend.forward(case.q, case.k, case.v, k_cache, v_cache, scale))
        caches.append((k_cache, v_cache))
    torch.cuda.synchronize()
    assert outs[0].shape == outs[1].shape == case.q.shape
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=tol, atol=tol)
    k_exp, v_exp = case.expected_caches()
    assert torch.equal(caches[0][0], k_exp) and torch.equal(caches[0][1], v_exp)


def test_scale_change_replans(flashinfer):
    hq, hkv, d, bs = 8, 2, 64, 16
    case = make_case([30, 50], [30, 4], block_size=bs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                     dtype=torch.float16, device="cuda")
    fi = create_attention_backend("flashinfer", hq, hkv, d, bs, torch.float16, "cuda")
    ref = TorchAttentionBackend(hq, hkv, d, bs, torch.float16, torch.device("cuda"))
    outs = []
    for backend in (fi, ref):
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        backend.plan(case.layout)
        outs.append(backend.forward(case.q, case.k, case.v, k_cache, v_cache, 0.3))
    torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=5e-3, atol=5e-3)


def test_auto_picks_flashinfer_on_cuda(flashinfer):
    backend = create_attention_backend("auto", 9, 3, 64, 16, torch.bfloat16, torch.device("cuda"))
    assert backend.name == "flashinfer"
