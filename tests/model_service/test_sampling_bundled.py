"""The sampling controls of issue 30 on the bundled model through the real service, against
transformers' own generate(): greedy with a repetition penalty token for token, and min_tokens
keeping the end-of-sequence token away (transformers' min_new_tokens)."""

from __future__ import annotations

import pytest
import torch

from model_service.model_loader import LoadedModel
from protos import model_pb2_grpc
from tests.model_service.generation import SHORT_PROMPTS, generate

MAX_TOKENS = 24


@torch.inference_mode()
def reference(loaded: LoadedModel, prompt: list[int], max_tokens: int, **options) -> list[int]:
    ids = torch.tensor([prompt])
    out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                                pad_token_id=loaded.tokenizer.pad_token_id or 0, **options)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("text", SHORT_PROMPTS[:2])
def test_greedy_repetition_penalty_equals_transformers(model_stub: model_pb2_grpc.ModelServiceStub,
                                                       reference_model: LoadedModel, text: str) -> None:
    prompt = list(reference_model.tokenizer(text).input_ids)
    served = generate(model_stub, prompt, temperature=0.0, max_tokens=MAX_TOKENS, repetition_penalty=1.3).token_ids
    assert served == reference(reference_model, prompt, MAX_TOKENS, repetition_penalty=1.3)
    assert served != reference(reference_model, prompt, MAX_TOKENS)  # the penalty mattered


def test_min_tokens_keeps_eos_away(model_stub: model_pb2_grpc.ModelServiceStub, reference_model: LoadedModel) -> None:
    tokenizer = reference_model.tokenizer
    messages = [{"role": "user", "content": "Answer with one word: is the sky blue?"}]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=True).input_ids)
    eos = set(reference_model.eos_token_ids)
    plain = generate(model_stub, prompt, temperature=0.0, max_tokens=MAX_TOKENS).token_ids
    assert plain[-1] in eos and len(plain) < 14  # ends early on its own
    held = generate(model_stub, prompt, temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=14)
    assert not eos & set(held.token_ids[:14]) and len(held.token_ids) > 14
    assert held.token_ids == reference(reference_model, prompt, MAX_TOKENS, min_new_tokens=14)
