"""model_service/logprobs.py: log_softmax of the raw logits, ranks, top-k; token texts and bytes."""

from __future__ import annotations

import pytest
import torch

from model_service.logprobs import TokenTexts, positions
from tests.model_service.tokenizer_fixture import load_smollm2_tokenizer


def test_positions_match_log_softmax_ranks_and_topk() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=gen)
    tokens = [5, 17, 299, 0]
    out = positions(logits, tokens, [3, 3, 3, 3])
    reference = torch.log_softmax(logits, dim=-1)
    for i, t in enumerate(tokens):
        assert out[i].token_id == t
        assert out[i].logprob == pytest.approx(float(reference[i, t]), abs=1e-6)
        assert out[i].rank == int((reference[i] > reference[i, t]).sum()) + 1
        values, ids = reference[i].topk(3)
        assert [tid for tid, _ in out[i].top] == ids.tolist()
        assert [lp for _, lp in out[i].top] == pytest.approx(values.tolist(), abs=1e-6)
    greedy = positions(logits, logits.argmax(-1).tolist(), [0, 0, 0, 0])
    assert [p.rank for p in greedy] == [1, 1, 1, 1] and [p.top for p in greedy] == [[], [], [], []]
    mixed = positions(logits, tokens, [2, 0, 1, 3])  # each row its own number of alternatives
    assert [len(p.top) for p in mixed] == [2, 0, 1, 3]
    half = positions(logits.bfloat16(), tokens, [1, 1, 1, 1])  # 16-bit logits are computed in float32
    assert len(half[0].top) == 1


@pytest.fixture(scope="module")
def tokenizer(request):
    return load_smollm2_tokenizer(request.config.cache.mkdir("smollm2-tokenizer"))


def test_token_texts_and_exact_bytes(tokenizer) -> None:
    texts = TokenTexts(tokenizer)
    ids = tokenizer("naïve café — 東京 🚀 hello").input_ids
    joined = b"".join(texts.get(i)[1] for i in ids)
    assert joined.decode() == tokenizer.decode(ids)  # the bytes of the tokens are the text's
    assert texts.get(ids[-1])[0] == tokenizer.decode([ids[-1]])
    eos = tokenizer.eos_token_id
    assert texts.get(eos) == (tokenizer.decode([eos]), tokenizer.decode([eos]).encode())


def test_greedy_logprobs_equal_transformers_log_softmax(model_stub, reference_model) -> None:
    """Through the real gRPC API: each generated token's logprob and its top-5 are log_softmax of
    transformers' logits at that position (fp32, within 1e-5); the chosen token is rank 1."""
    from protos import model_pb2

    tokenizer, model = reference_model.tokenizer, reference_model.model
    prompt = tokenizer("The lighthouse keeper wrote in the log that").input_ids
    request = model_pb2.GenerateRequest(sampling=model_pb2.SamplingParams(temperature=0.0, max_tokens=12, logprobs=5))
    request.token_ids.ids.extend(prompt)
    messages = list(model_stub.Generate(request, timeout=300))
    out = [t for m in messages for t in m.token_ids]
    positions = [p for m in messages for p in m.logprobs]
    assert len(positions) == len(out) == 12
    with torch.no_grad():  # transformers' own greedy generate(), its raw logits at each step
        theirs = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert theirs.sequences[0, len(prompt):].tolist() == out
    reference = torch.log_softmax(torch.cat(theirs.logits).float(), dim=-1)
    for i, (token, p) in enumerate(zip(out, positions, strict=True)):
        assert p.chosen.token_id == token and p.chosen.rank == 1
        assert p.chosen.logprob == pytest.approx(float(reference[i, token]), abs=1e-5)
        values, ids = reference[i].topk(5)
        assert [t.token_id for t in p.top] == ids.tolist()
        assert [t.logprob for t in p.top] == pytest.approx(values.tolist(), abs=1e-5)
        assert [t.rank for t in p.top] == [1, 2, 3, 4, 5]
        assert p.chosen.token == tokenizer.decode([token])
    no = model_pb2.GenerateRequest(sampling=model_pb2.SamplingParams(temperature=0.0, max_tokens=2))
    no.token_ids.ids.extend(prompt)
    assert all(not m.logprobs for m in model_stub.Generate(no, timeout=300))


def test_logprobs_out_of_range_is_invalid_argument(model_stub) -> None:
    import grpc

    from protos import model_pb2

    request = model_pb2.GenerateRequest(prompt="x", sampling=model_pb2.SamplingParams(logprobs=21))
    with pytest.raises(grpc.RpcError) as caught:
        list(model_stub.Generate(request, timeout=60))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logprobs" in caught.value.details()
