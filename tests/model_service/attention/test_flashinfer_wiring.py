"""FlashInferAttentionBackend's plan/forward wiring, on CPU, against a strict fake flashinfer.

The fake mirrors flashinfer-python 0.7.x signatures and documented semantics (see
fake_flashinfer.py); the real kernels are tested in test_flashinfer_backend.py on CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch

import model_service.attention.flashinfer_backend as fib
from model_service.attention.torch_backend import TorchAttentionBackend
from tests.model_service.attention import fake_flashinfer
from tests.model_service.attention.paged_case import make_case, reference_attention

DTYPE = torch.bfloat16


@pytest.fixture
def backend_cls(monkeypatch):
    monkeypatch.setattr(fib, "import_flashinfer", lambda: fake_flashinfer)
    monkeypatch.setattr(fib, "_require_cuda", lambda device: None)
    monkeypatch.setattr(fib.FlashInferAttentionBackend, "workspace_bytes", 1024)
    fake_flashinfer.calls.clear()
    return fib.FlashInferAttentionBackend


STEPS = [  # (seq_lens, query_lens): prefill with unaligned prefixes, decode, mixed, decode at page edges
    ([37, 16, 70, 5, 33], [5, 3, 11, 5, 1]),
    ([1, 16, 17, 64, 33], [1, 1, 1, 1, 1]),
    ([40, 17, 9, 80, 3], [1, 12, 1, 7, 3]),
    ([32, 48], [1, 1]),
]


@pytest.mark.parametrize("block_size", [16, 5])
def test_steps_match_reference_and_torch_backend(backend_cls, block_size):
    hq, hkv, d = 9, 3, 64
    scale = 1.0 / math.sqrt(d)
    backend = backend_cls(hq, hkv, d, block_size, DTYPE, torch.device("cpu"))
    ref = TorchAttentionBackend(hq, hkv, d, block_size, DTYPE, torch.device("cpu"))
    for step, (seq_lens, query_lens) in enumerate(STEPS):
        case = make_case(seq_lens, query_lens, block_size=block_size, num_q_heads=hq, num_kv_heads=hkv,
                         head_dim=d, seed=step, dtype=DTYPE)
        outs = []
        for b in (backend, ref):
            k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
            b.plan(case.layout)
            outs.append(b.forward(case.q, case.k, case.v, k_cache, v_cache, scale))
            k_exp, v_exp = case.expected_caches()
            assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp)
        torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(outs[0].double(), reference_attention(case, scale), rtol=2e-2, atol=2e-2)
    decode_steps = [i for i, (_, q) in enumerate(STEPS) if max(q) == 1]
    plans = [c for c in fake_flashinfer.calls if c.endswith(".plan")]
    assert [p == "decode.plan" for p in plans] == [i in decode_steps for i in range(len(STEPS))]


def test_plan_once_run_per_layer_and_scale_replan(backend_cls):
    hq, hkv, d, bs = 4, 2, 32, 16
    case = make_case([30, 50], [30, 4], block_size=bs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=DTYPE)
    backend = backend_cls(hq, hkv, d, bs, DTYPE, torch.device("cpu"))
    backend.plan(case.layout)
    for _ in range(3):  # three layers at the default scale
        backend.forward(case.q, case.k, case.v, case.k_cache.clone(), case.v_cache.clone(), 1 / math.sqrt(d))
    assert fake_flashinfer.calls.count("prefill.plan") == 1
    assert fake_flashinfer.calls.count("prefill.run") == 3
    assert fake_flashinfer.calls.count("append_paged_kv_cache") == 3
    # A model with another softmax scale: one re-plan, then reused.
    for _ in range(2):
        out = backend.forward(case.q, case.k, case.v, case.k_cache.clone(), case.v_cache.clone(), 0.3)
    assert fake_flashinfer.calls.count("prefill.plan") == 2
    torch.testing.assert_close(out.double(), reference_attention(case, 0.3), rtol=2e-2, atol=2e-2)


def test_rejects_cpu_float32_and_unplanned(backend_cls, monkeypatch):
    with pytest.raises(ValueError, match="float16/bfloat16"):
        backend_cls(4, 2, 32, 16, torch.float32, torch.device("cpu"))
    backend = backend_cls(4, 2, 32, 16, DTYPE, torch.device("cpu"))
    x = torch.zeros(1, 4, 32, dtype=DTYPE)
    with pytest.raises(RuntimeError, match="plan"):
        backend.forward(x, x[:, :2], x[:, :2], torch.zeros(1, 16, 2, 32, dtype=DTYPE),
                        torch.zeros(1, 16, 2, 32, dtype=DTYPE), 1.0)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="CUDA"):
        fib.FlashInferAttentionBackend(4, 2, 32, 16, DTYPE, torch.device("cpu"))


CASCADE_STEPS = {  # name: (seq_lens, query_lens, group_of, shared_blocks), block size 16
    # 2 groups (3 and 2 members) sharing 8 / 4 pages, ragged suffixes, one unshared decode.
    "decode": ([140, 133, 150, 70, 80, 45], [1] * 6, [0, 0, 0, 1, 1, -1], [8, 4]),
    # The same with prefill chunks in the step (the prefill wrapper runs the own-pages level).
    "mixed": ([140, 40, 133, 150, 30, 70, 80], [1, 9, 1, 1, 30, 1, 1], [0, -1, 0, 0, -1, 1, 1], [8, 4]),
    # Members only, one page of sharing each and members in scattered batch positions.
    "members_only": ([40, 17, 30, 33, 20], [1] * 5, [0, 1, 0, 1, 0], [1, 1]),
}


@pytest.mark.parametrize("name", list(CASCADE_STEPS))
def test_cascade_matches_reference_and_torch_backend(backend_cls, name):
    seq_lens, query_lens, group_of, shared = CASCADE_STEPS[name]
    hq, hkv, d, bs = 9, 3, 64, 16
    scale = 1.0 / math.sqrt(d)
    case = make_case(seq_lens, query_lens, block_size=bs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                     dtype=DTYPE, group_of=group_of, shared_blocks=shared)
    backend = backend_cls(hq, hkv, d, bs, DTYPE, torch.device("cpu"), cascade_min_saved_tokens=0)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    backend.plan(case.layout)
    plan = backend._cascade
    assert plan is not None and plan.num_members == sum(g >= 0 for g in group_of)
    assert plan.saved_tokens == sum((group_of.count(g) - 1) * n * bs for g, n in enumerate(shared))
    out = backend.forward(case.q, case.k, case.v, k_cache, v_cache, scale)
    k_exp, v_exp = case.expected_caches()
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp)
    torch.testing.assert_close(out.double(), reference_attention(case, scale), rtol=2e-2, atol=2e-2)
    ref = TorchAttentionBackend(hq, hkv, d, bs, DTYPE, torch.device("cpu"))
    ref.plan(case.layout)
    ref_out = ref.forward(case.q, case.k, case.v, case.k_cache.clone(), case.v_cache.clone(), scale)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=2e-2, atol=2e-2)
    level = "decode" if max(query_lens) == 1 else "prefill"
    runs = [c for c in fake_flashinfer.calls if c.endswith(".run") or c == "merge_state_in_place"]
    assert runs == [f"{level}.run", "prefill.run", "merge_state_in_place"]  # own pages, prefix, merge


def test_cascade_thresholds_and_switch(backend_cls):
    seq_lens, query_lens, group_of, shared = CASCADE_STEPS["decode"]
    case = make_case(seq_lens, query_lens, block_size=16, num_q_heads=4, num_kv_heads=2, head_dim=32,
                     dtype=DTYPE, group_of=group_of, shared_blocks=shared)
    saved = (2 * 8 + 1 * 4) * 16
    for kwargs, taken in [(dict(), False), (dict(cascade_min_saved_tokens=saved), True),
                          (dict(cascade_min_saved_tokens=saved + 1), False),
                          (dict(cascade=False, cascade_min_saved_tokens=0), False)]:
        backend = backend_cls(4, 2, 32, 16, DTYPE, torch.device("cpu"), **kwargs)
        backend.plan(case.layout)
        assert (backend._cascade is not None) == taken, kwargs
    # A scale change re-plans both levels once, then reuses them.
    backend = backend_cls(4, 2, 32, 16, DTYPE, torch.device("cpu"), cascade_min_saved_tokens=0)
    backend.plan(case.layout)
    fake_flashinfer.calls.clear()
    for _ in range(2):
        out = backend.forward(case.q, case.k, case.v, case.k_cache.clone(), case.v_cache.clone(), 0.3)
    assert fake_flashinfer.calls.count("decode.plan") == fake_flashinfer.calls.count("prefill.plan") == 1
    torch.testing.assert_close(out.double(), reference_attention(case, 0.3), rtol=2e-2, atol=2e-2)
