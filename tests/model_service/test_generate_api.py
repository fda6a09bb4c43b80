"""Tokenize, ModelInfo, chat input, finish reasons (stop strings, stop token ids, max_tokens) and
seeded sampling through the real gRPC API."""

from __future__ import annotations

import pytest

from protos import cache_pb2_grpc, model_pb2, model_pb2_grpc
from tests.model_service.checks import wait_until_idle
from tests.model_service.generation import generate, greedy
from tests.services import SHARED_NUM_BLOCKS, SHARED_POOL_ID

VOCAB_LAST = 49151  # a token id that never comes up in these short generations
PROMPT = "The capital of France is"
CHAT = [("system", "You are a concise assistant."), ("user", "Name three colours of the rainbow.")]


def chat_proto() -> model_pb2.ChatMessages:
    return model_pb2.ChatMessages(messages=[model_pb2.ChatMessage(role=r, content=c) for r, c in CHAT])


def test_model_info_agrees_with_the_tokenizer_and_the_cache(model_stub: model_pb2_grpc.ModelServiceStub,
                                                            cache_stub: cache_pb2_grpc.CacheManagerStub,
                                                            reference_model) -> None:
    info = model_stub.ModelInfo(model_pb2.ModelInfoRequest(), timeout=30)
    tokenizer = reference_model.tokenizer
    config = reference_model.model.config
    assert info.vocab_size == reference_model.vocab_size == len(tokenizer)
    assert info.max_context_tokens == 8192
    assert tokenizer.eos_token_id in info.eos_token_ids
    assert list(info.eos_token_ids) == reference_model.eos_token_ids
    assert info.model_fingerprint == reference_model.fingerprint
    assert (info.num_layers, info.num_kv_heads) == (config.num_hidden_layers, config.num_key_value_heads)
    assert info.head_dim == config.hidden_size // config.num_attention_heads
    assert (info.block_size, info.num_blocks, info.pool_id) == (16, SHARED_NUM_BLOCKS, SHARED_POOL_ID)
    assert (info.device, info.dtype, info.attention_backend) == ("cpu", "float32", "torch")
    stats = wait_until_idle(cache_stub, info.pool_id)  # also waits for the pool to be registered
    assert stats.model_fingerprint == info.model_fingerprint
    assert (stats.num_blocks, stats.block_size) == (info.num_blocks, info.block_size)


@pytest.mark.parametrize("text", [PROMPT, "naïve café — 東京 🚀", "  leading spaces\nand\ttabs"])
def test_tokenize_text_equals_the_tokenizer(model_stub, reference_model, text: str) -> None:
    tokenizer = reference_model.tokenizer
    reply = model_stub.Tokenize(model_pb2.TokenizeRequest(text=text), timeout=30)
    expected = tokenizer(text).input_ids
    assert list(reply.token_ids) == expected
    assert list(reply.tokens) == tokenizer.convert_ids_to_tokens(expected)


def _chat_template_ids(tokenizer) -> list[int]:
    """The chat rendered as text by the model's template, then tokenized (no special tokens added)."""
    text = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in CHAT], add_generation_prompt=True,
                                         tokenize=False)
    assert text.rstrip().endswith("assistant")
    return tokenizer(text, add_special_tokens=False).input_ids


def test_tokenize_chat_equals_the_chat_template(model_stub, reference_model) -> None:
    reply = model_stub.Tokenize(model_pb2.TokenizeRequest(chat=chat_proto()), timeout=30)
    assert list(reply.token_ids) == _chat_template_ids(reference_model.tokenizer)


def test_generate_chat_equals_generate_template_token_ids(model_stub, cache_stub, reference_model) -> None:
    sampling = model_pb2.SamplingParams(temperature=0.0, max_tokens=8)
    messages = list(model_stub.Generate(model_pb2.GenerateRequest(chat=chat_proto(), sampling=sampling), timeout=120))
    chat_tokens = [t for m in messages for t in m.token_ids]
    ids = _chat_template_ids(reference_model.tokenizer)
    by_ids = greedy(model_stub, ids, 8)
    assert chat_tokens == by_ids.token_ids
    assert "".join(m.text for m in messages) == by_ids.text
    assert messages[-1].usage.prompt_tokens == len(ids)
    wait_until_idle(cache_stub, SHARED_POOL_ID)


# ---------------------------------------------------------------- finish reasons

@pytest.fixture(scope="module")
def free_run(model_stub):
    """16 greedy tokens of PROMPT past any end-of-sequence token: what the stop tests cut."""
    g = generate(model_stub, prompt=PROMPT, temperature=0.0, max_tokens=16, ignore_eos=True)
    assert len(g.token_ids) == 16
    return g


def test_length_when_max_tokens_is_reached(model_stub, cache_stub, free_run, reference_model) -> None:
    g = generate(model_stub, prompt=PROMPT, temperature=0.0, max_tokens=5, ignore_eos=True)
    assert g.token_ids == free_run.token_ids[:5]
    final = g.final
    assert final.finish_reason == model_pb2.FINISH_REASON_LENGTH
    assert final.matched_stop == ""
    assert final.usage.completion_tokens == 5
    assert final.usage.prompt_tokens == len(reference_model.tokenizer(PROMPT).input_ids)
    assert all(m.finish_reason == model_pb2.FINISH_REASON_UNSPECIFIED for m in g.messages[:-1])
    wait_until_idle(cache_stub, SHARED_POOL_ID)


def _stop_string(text: str) -> str:
    """A word from the second half of `text` (so generation runs a while before it)."""
    words = [w for w in text[len(text) // 3:].split() if w.isalpha() and len(w) >= 3]
    assert words, f"no word to stop at in {text!r}"
    return words[0]


def test_stop_string_ends_generation_and_is_not_returned(model_stub, cache_stub, free_run) -> None:
    stop = _stop_string(free_run.text)
    cut = free_run.text.index(stop)
    g = generate(model_stub, prompt=PROMPT, temperature=0.0, max_tokens=16, ignore_eos=True,
                 stop=["no such text here", stop])
    assert g.final.finish_reason == model_pb2.FINISH_REASON_STOP
    assert g.final.matched_stop == stop
    assert g.text == free_run.text[:cut]
    assert stop not in g.text
    assert len(g.token_ids) < len(free_run.token_ids)
    assert g.token_ids == free_run.token_ids[:len(g.token_ids)]
    assert g.final.usage.completion_tokens == len(g.token_ids)
    wait_until_idle(cache_stub, SHARED_POOL_ID)


def test_stop_token_id_ends_generation_and_is_not_in_the_text(model_stub, cache_stub, free_run,
                                                              reference_model) -> None:
    stop_token = free_run.token_ids[4]
    first = free_run.token_ids.index(stop_token)
    g = generate(model_stub, prompt=PROMPT, temperature=0.0, max_tokens=16, ignore_eos=True,
                 stop_token_ids=[VOCAB_LAST, stop_token])
    assert g.token_ids == free_run.token_ids[:first + 1]  # the stop token is in the ids ...
    assert g.final.finish_reason == model_pb2.FINISH_REASON_STOP
    assert g.final.matched_stop == str(stop_token)
    # ... but not in the text.
    assert g.text == reference_model.tokenizer.decode(free_run.token_ids[:first], skip_special_tokens=True)
    wait_until_idle(cache_stub, SHARED_POOL_ID)



# ---------------------------------------------------------------- seeds

def _sampled(stub, seed: int) -> list[int]:
    g = generate(stub, prompt="Once upon a time", temperature=0.8, seed=seed, max_tokens=12, ignore_eos=True)
    assert len(g.token_ids) == 12
    return g.token_ids


def test_same_seed_same_tokens_other_seed_differs(model_stub, cache_stub) -> None:
    first = _sampled(model_stub, 1234)
    assert _sampled(model_stub, 1234) == first
    assert _sampled(model_stub, 98765) != first  # 12 tokens at temperature 0.8: equal only by a fluke
    wait_until_idle(cache_stub, SHARED_POOL_ID)
