"""Grammar-guided decoding (model_service/structured/): every kind constrains the output to what
it names, bad grammars are refused with their error, masks touch only guided rows."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from model_service.structured import GrammarCompiler, StructuredSpec, TokenMasks, spec_from_proto
from protos import model_pb2
from tests.model_service.tokenizer_fixture import load_smollm2_tokenizer


@pytest.fixture(scope="module")
def tokenizer(request):
    return load_smollm2_tokenizer(request.config.cache.mkdir("smollm2-tokenizer"))


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def decode(compiler: GrammarCompiler, tokenizer, spec: StructuredSpec, seed: int, max_steps: int = 400) -> str:
    """Sample through the guide from random logits (what a model would do, minus its preferences)
    until the grammar finishes; the text of the tokens before end-of-sequence."""
    guide = compiler.compile(spec)
    masks = TokenMasks(compiler.vocab_size)
    gen = torch.Generator().manual_seed(seed)
    eos = tokenizer.eos_token_id
    # A model closes what it opened; random logits would wander (any key, any string): favour
    # the end-of-sequence token and the tokens that close strings and structures.
    closing = [eos] + [tokenizer.convert_tokens_to_ids(t) for t in ('"', '"}', '}', ']', '",', '":')]
    out: list[int] = []
    for _ in range(max_steps):
        logits = torch.randn(1, compiler.vocab_size, generator=gen)
        logits[0, closing] += 6.0
        bits = masks.fill([guide])
        TokenMasks.apply(logits, torch.tensor([0]), bits)
        token = int(logits.argmax())
        assert guide.accept(token), "a token the mask allowed was rejected"
        if token == eos:
            break
        out.append(token)
        if guide.finished:
            break
    assert guide.finished, f"the grammar did not finish in {max_steps} tokens: {tokenizer.decode(out)!r}"
    return tokenizer.decode(out)


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"type": "number"}, "maxItems": 4},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["a", "b", "c"]},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                                               "maxItems": 3}},
     "required": ["ok", "kind"], "additionalProperties": False},
]


@pytest.mark.parametrize("schema", SCHEMAS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_output_parses_and_validates(compiler, tokenizer, schema, seed) -> None:
    text = decode(compiler, tokenizer, StructuredSpec("json_schema", json.dumps(schema)), seed)
    jsonschema.validate(json.loads(text), schema)


def test_json_object_is_an_object(compiler, tokenizer) -> None:
    for seed in range(3):
        assert isinstance(json.loads(decode(compiler, tokenizer, StructuredSpec("json_object"), seed)), dict)


def test_regex_choice_and_grammars(compiler, tokenizer) -> None:
    for seed in range(3):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", decode(compiler, tokenizer,
                                                          StructuredSpec("regex", "[0-9]{3}-[a-z]{2,4}"), seed))
        choices = ("red", "green", "dark blue")
        assert decode(compiler, tokenizer, StructuredSpec("choice", choices=choices), seed) in choices
        lark = 'start: expr\nexpr: NUM | "(" expr OP expr ")"\nOP: "+" | "*"\nNUM: /[0-9]{1,2}/'
        assert re.fullmatch(r"[0-9()+*]+", decode(compiler, tokenizer, StructuredSpec("grammar", lark), seed))
        gbnf = 'root ::= "yes" | "no" | "maybe"'
        assert decode(compiler, tokenizer, StructuredSpec("grammar", gbnf), seed) in ("yes", "no", "maybe")


@pytest.mark.parametrize(("spec", "message"), [
    (StructuredSpec("json_schema", "{not json"), "not valid JSON"),
    (StructuredSpec("json_schema", "[1, 2]"), "must be an object"),
    (StructuredSpec("regex", "a(b"), "regex"),
    (StructuredSpec("grammar", "start: undefined_rule"), "does not compile"),
])
def test_bad_grammars_are_refused_with_their_error(compiler, spec, message) -> None:
    with pytest.raises(ValueError, match=message):
        compiler.compile(spec)


def test_bad_specs_are_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        StructuredSpec("yaml", "x")
    with pytest.raises(ValueError, match="choice needs"):
        StructuredSpec("choice")
    with pytest.raises(ValueError, match="empty"):
        StructuredSpec("regex", "  ")
    with pytest.raises(ValueError, match="more than"):
        StructuredSpec("regex", "a" * (70 << 10))


def test_masks_touch_only_the_guided_rows(compiler) -> None:
    guide = compiler.compile(StructuredSpec("choice", choices=("yes", "no")))
    logits = torch.randn(3, compiler.vocab_size)
    before = logits.clone()
    bits = TokenMasks(compiler.vocab_size).fill([guide])
    TokenMasks.apply(logits, torch.tensor([1]), bits)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = torch.isfinite(logits[1]).nonzero().flatten()
    assert 0 < allowed.numel() < 10 and torch.equal(logits[1, allowed], before[1, allowed])


def test_specs_from_the_proto() -> None:
    assert spec_from_proto(model_pb2.StructuredOutput()) is None
    assert spec_from_proto(model_pb2.StructuredOutput(json_object=True)) == StructuredSpec("json_object")
    assert spec_from_proto(model_pb2.StructuredOutput(json_schema="{}")) == StructuredSpec("json_schema", "{}")
    assert spec_from_proto(model_pb2.StructuredOutput(regex="a+")) == StructuredSpec("regex", "a+")
    assert spec_from_proto(model_pb2.StructuredOutput(grammar="start: /a/")) == StructuredSpec("grammar", "start: /a/")
    assert spec_from_proto(model_pb2.StructuredOutput(choice=model_pb2.Choices(choices=["x", "y"]))) \
        == StructuredSpec("choice", choices=("x", "y"))
    with pytest.raises(ValueError, match="choice needs"):
        spec_from_proto(model_pb2.StructuredOutput(choice=model_pb2.Choices()))


def test_guided_decoding_masks_advances_and_ends(compiler, tokenizer) -> None:
    from dataclasses import dataclass

    from model_service.structured.decoding import GuidedDecoding

    @dataclass
    class Row:
        guide: object = None

    rows = [Row(), Row(compiler.compile(StructuredSpec("choice", choices=("alpha", "beta")))), Row()]
    decoding = GuidedDecoding()
    gen = torch.Generator().manual_seed(3)
    out: list[int] = []
    try:
        for _ in range(20):
            masks = decoding.start(rows)
            logits = torch.randn(3, compiler.vocab_size, generator=gen)
            free = logits[[0, 2]].clone()
            decoding.apply(logits, rows, masks)
            assert torch.equal(logits[[0, 2]], free)  # unguided rows untouched
            tokens = logits.argmax(-1).tolist()
            done = decoding.advance(rows, tokens)
            assert done[0] is False and done[2] is False
            out.append(tokens[1])
            if done[1]:
                break
        assert tokenizer.decode(out).replace(tokenizer.eos_token, "") in ("alpha", "beta")
        assert decoding.start([Row(), Row()]) is None
    finally:
        decoding.close()


@pytest.mark.parametrize("vocab", [64, 70, 100])  # whole words, a partial last word, tokens past the mask
def test_mask_application_equals_llguidance_without_compiling(vocab) -> None:
    """TokenMasks.apply is eager tensor ops with llguidance's own semantics (its helper is a
    torch.compile kernel: a compile on first use)."""
    import llguidance.torch

    gen = torch.Generator().manual_seed(vocab)
    bits = torch.randint(-2**31, 2**31 - 1, (3, 3), generator=gen, dtype=torch.int32)[:, :-(-min(vocab, 96) // 32)]
    logits = torch.randn(4, vocab, generator=gen)
    ours = logits.clone()
    TokenMasks.apply(ours, torch.tensor([0, 2, 3]), bits)
    theirs = logits[[0, 2, 3]].clone()
    llguidance.torch.apply_token_bitmask_inplace(theirs, bits)
    assert torch.equal(ours[[0, 2, 3]], theirs) and torch.equal(ours[1], logits[1])
    assert torch.isinf(ours[[0, 2, 3]]).any()
