"""The lean Llama-family forward (decoder_forward) gives bit for bit transformers' forward."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from model_service import native
from model_service.attention import create_attention_backend
from model_service.decoder_forward import supports
from model_service.kv_cache import KVCache, KVCacheSpec
from model_service.model_runner import ModelRunner, SequenceChunk

BLOCK = 16


def make_runner(model: torch.nn.Module, dtype: torch.dtype, num_blocks: int = 256,
                fp32_gemm: str = "mkl") -> ModelRunner:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    device = torch.device("cpu")
    kv = KVCache(KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, BLOCK, dtype),
                 num_blocks, device)
    backend = create_attention_backend("torch", cfg.num_attention_heads, cfg.num_key_value_heads, head_dim,
                                       BLOCK, dtype, device)
    return ModelRunner(model.to(dtype), kv, backend, device, fp32_gemm)


def steps(vocab: int) -> list[list[SequenceChunk]]:
    """Prefill, cache-hit extends sharing its blocks, cascade decodes, a mixed step, one token."""
    gen = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    prefix = list(range(0, 12))  # 12 blocks: a 180-token prompt
    tables = [prefix[:11] + list(range(20 + 4 * i, 24 + 4 * i)) for i in range(5)]
    out = [[SequenceChunk(ids(180), 0, prefix, True), SequenceChunk(ids(40), 0, list(range(100, 105)), True)]]
    out.append([SequenceChunk(ids(5 + 7 * i), 176, t, True) for i, t in enumerate(tables)])
    lens = [176 + 5 + 7 * i for i in range(5)]
    for s in range(3):
        out.append([SequenceChunk(ids(1), n + s, t, True) for n, t in zip(lens, tables, strict=True)])
    out.append([SequenceChunk(ids(1), n + 3, t, True) for n, t in zip(lens[:3], tables[:3], strict=True)]
               + [SequenceChunk(ids(30), 40, list(range(100, 105)), False), SequenceChunk(ids(9), 0, [110], True)])
    out.append([SequenceChunk(ids(1), lens[4] + 3, tables[4], True)])
    return out


def assert_lean_equals_transformers(runner: ModelRunner, vocab: int) -> None:
    lean = runner.decoder
    assert lean is not None
    # float32 and bfloat16 take the native residual add + RMSNorm, RoPE and SiLU * up wherever the kernels run:
    # these comparisons cover them.
    assert lean.native_norm == lean.native_rope == lean.native_silu_mul == native.available()
    assert lean.native_rope == native.available()
    for chunks in steps(vocab):
        runner.decoder = None  # transformers' forward (writes the same K/V to the same slots)
        want = runner.execute(chunks).sampled
        runner.decoder = lean
        got = runner.execute(chunks).sampled
        assert got.shape == want.shape == (sum(c.needs_logits for c in chunks), vocab)
        assert torch.equal(got, want)


def tiny_llama(**extra) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                                        max_position_embeddings=1024, **extra)).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_llama_is_bitwise_transformers(dtype):
    assert_lean_equals_transformers(make_runner(tiny_llama(), dtype), 512)


def test_llama_with_attention_bias_and_untied_head():
    model = tiny_llama(attention_bias=True, tie_word_embeddings=False)
    assert_lean_equals_transformers(make_runner(model, torch.float32), 512)


def test_tiny_qwen2_is_bitwise_transformers():
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                                         max_position_embeddings=1024)).eval()
    assert_lean_equals_transformers(make_runner(model, torch.float32), 512)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bundled_model_is_bitwise_transformers(reference_model, dtype):
    model = copy.deepcopy(reference_model.model)  # the runner rewires its model
    assert_lean_equals_transformers(make_runner(model, dtype, num_blocks=160), model.config.vocab_size)


def test_other_architectures_keep_transformers_forward():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    assert not supports(gpt2)
    sliding = Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True,
                                           sliding_window=16))
    assert not supports(sliding)
    unfused = tiny_llama()  # before ModelRunner fuses q/k/v and gate/up, the layout is not ours
    assert not supports(unfused)
    runner = make_runner(tiny_llama(), torch.float32)
    assert runner.decoder is not None and supports(runner.model)


def test_fp32_gemm_choice_is_checked_and_onednn_stays_close():
    with pytest.raises(ValueError, match="fp32_gemm"):
        ModelRunner(tiny_llama(), None, None, torch.device("cpu"), "fast")  # type: ignore[arg-type]
    exact = make_runner(tiny_llama(), torch.float32)
    onednn = make_runner(tiny_llama(), torch.float32, fp32_gemm="onednn")
    assert onednn.decoder is not None and onednn.decoder.layers[0].qkv.packed is not None
    assert exact.decoder is not None and exact.decoder.layers[0].qkv.packed is None
    for chunks in steps(512):
        want, got = exact.execute(chunks).sampled, onednn.execute(chunks).sampled
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
