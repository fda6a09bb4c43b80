"""Tests for model_service.sampler: greedy exactness, top-k/top-p, distribution, seeding, validation."""

from __future__ import annotations

import math

import pytest
import torch

from model_service.sampler import Sampler, SamplingOptions, make_generator

VOCAB = 1000


@pytest.fixture(scope="module")
def sampler() -> Sampler:
    return Sampler()


def random_logits(batch: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3.0


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


def test_greedy_is_argmax(sampler: Sampler) -> None:
    logits = random_logits(16)
    out = sampler.sample(logits, [SamplingOptions(temperature=0.0)] * 16, [None] * 16)
    assert out.dtype == torch.int64 and out.shape == (16,)
    assert torch.equal(out, logits.argmax(dim=-1))


def test_greedy_ties_pick_first_index_like_torch_argmax(sampler: Sampler) -> None:
    logits = torch.zeros(3, 8)
    logits[0, [2, 5]] = 1.0
    logits[1, [7, 0]] = 4.0
    options = [SamplingOptions(temperature=0.0)] * 3
    out = sampler.sample(logits, options, [None] * 3)
    assert out.tolist() == [2, 0, 0] == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_greedy_on_16_bit_logits_is_their_argmax(sampler: Sampler, dtype: torch.dtype) -> None:
    """The model service hands over logits in the model's dtype: same picks, ties included."""
    logits = random_logits(16).to(dtype)
    logits[3, [10, 20]] = logits[3].max() + 1  # a tie: the first index wins
    options = [SamplingOptions(temperature=0.0)] * 16
    out = sampler.sample(logits, options, [None] * 16)
    assert torch.equal(out, logits.argmax(dim=-1)) and int(out[3]) == 10
    mixed = sampler.sample(logits, options[:8] + [SamplingOptions(temperature=0.7, seed=1)] * 8, [None] * 16)
    assert torch.equal(mixed[:8], logits[:8].argmax(dim=-1))


def test_all_greedy_batch_is_one_argmax_without_sorting_or_random_draws(
        sampler: Sampler, monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args, **kwargs):
        raise AssertionError("the all-greedy fast path must not sort")

    monkeypatch.setattr(torch.Tensor, "sort", forbidden)
    monkeypatch.setattr(torch.Tensor, "topk", forbidden)
    generator = make_generator(7, "cpu")
    state = generator.get_state()
    logits = random_logits(4)
    options = [SamplingOptions(temperature=0.0, seed=7), SamplingOptions(temperature=2.0, top_k=1),
               SamplingOptions(temperature=0.0), SamplingOptions(temperature=0.0, top_p=0.5)]
    out = sampler.sample(logits, options, [generator, None, None, None])
    assert torch.equal(out, logits.argmax(dim=-1))
    assert torch.equal(generator.get_state(), state)


def test_greedy_rows_in_a_mixed_batch_are_argmax(sampler: Sampler) -> None:
    logits = random_logits(6)
    options = [SamplingOptions(temperature=0.0 if i % 2 == 0 else 1.5, seed=i) for i in range(6)]
    generators = [make_generator(i, "cpu") for i in range(6)]
    out = sampler.sample(logits, options, generators)
    assert out[0::2].tolist() == logits[0::2].argmax(dim=-1).tolist()


@pytest.mark.parametrize("temperature", [0.05, 0.7, 1.0, 5.0, 100.0])
def test_top_k_1_is_greedy_at_any_temperature(sampler: Sampler, temperature: float) -> None:
    logits = random_logits(32, seed=1)
    options = [SamplingOptions(temperature=temperature, top_k=1, seed=i) for i in range(32)]
    out = sampler.sample(logits, options, [make_generator(i, "cpu") for i in range(32)])
    assert torch.equal(out, logits.argmax(dim=-1))


def test_tiny_top_p_keeps_only_the_top_token(sampler: Sampler) -> None:
    logits = random_logits(64, vocab=50, seed=2) * 0.1  # nearly flat: plenty of other candidates
    options = [SamplingOptions(temperature=3.0, top_p=1e-6)] * 64
    torch.manual_seed(0)
    for _ in range(5):
        assert torch.equal(sampler.sample(logits, options, [None] * 64), logits.argmax(dim=-1))


def test_very_low_temperature_is_finite_and_picks_the_max(sampler: Sampler) -> None:
    logits = random_logits(16, seed=3)
    options = [SamplingOptions(temperature=1e-4, seed=i) for i in range(16)]
    out = sampler.sample(logits, options, [make_generator(i, "cpu") for i in range(16)])
    assert torch.equal(out, logits.argmax(dim=-1))


@pytest.mark.parametrize("temperature", [1e-38, 1e-30, 1e-7, 9.9e-6])
def test_tiny_positive_temperature_is_greedy(sampler: Sampler, temperature: float) -> None:
    """Regression: temperature=1e-38 passed validation, logits / t overflowed to inf, the softmax
    was NaN and argmax picked token 0. Temperatures below 1e-5 are greedy (as vLLM does)."""
    logits = random_logits(16, seed=5)
    logits[:, 0] = logits.min() - 1.0  # token 0 is never the right answer
    options = [SamplingOptions(temperature=temperature, seed=i) for i in range(16)]
    generators = [make_generator(i, "cpu") for i in range(16)]
    states = [g.get_state() for g in generators]
    out = sampler.sample(logits, options, generators)
    assert torch.equal(out, logits.argmax(dim=-1))
    assert all(opt.is_greedy for opt in options)
    assert all(torch.equal(g.get_state(), s) for g, s in zip(generators, states, strict=True))  # no draws
    mixed = options[:8] + [SamplingOptions(temperature=1.0, seed=i) for i in range(8)]
    assert torch.equal(sampler.sample(logits, mixed, [make_generator(i, "cpu") for i in range(16)])[:8],
                       logits[:8].argmax(dim=-1))


def test_greedy_threshold_is_exactly_1e_5() -> None:
    assert SamplingOptions(temperature=9.99e-6).is_greedy
    assert not SamplingOptions(temperature=1e-5).is_greedy


def test_top_k_never_samples_outside_the_k_best(sampler: Sampler) -> None:
    logits = random_logits(1, seed=4).expand(2000, VOCAB)
    allowed = set(logits[0].topk(3).indices.tolist())
    torch.manual_seed(1)
    out = sampler.sample(logits, [SamplingOptions(temperature=10.0, top_k=3)] * 2000, [None] * 2000)
    assert set(out.tolist()) == allowed  # all three show up, nothing else


def test_top_k_larger_than_vocab_is_no_filter(sampler: Sampler) -> None:
    logits = torch.zeros(4000, 4)
    torch.manual_seed(2)
    out = sampler.sample(logits, [SamplingOptions(top_k=1000)] * 4000, [None] * 4000)
    assert set(out.tolist()) == {0, 1, 2, 3}


def assert_close_to(tokens: torch.Tensor, expected: list[float], tolerance: float = 0.015) -> None:
    observed = frequencies(tokens, len(expected))
    assert torch.allclose(observed, torch.tensor(expected, dtype=torch.float64), atol=tolerance), \
        (observed.tolist(), expected)


def test_distribution_matches_softmax_with_temperature_seeded(sampler: Sampler) -> None:
    """One seeded generator shared by 20k rows: empirical frequencies ~ softmax(logits / T)."""
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    temperature = 0.7
    n = 20_000
    generator = make_generator(1234, "cpu")
    options = [SamplingOptions(temperature=temperature)] * n
    out = sampler.sample(base.expand(n, 5), options, [generator] * n)
    assert_close_to(out, torch.softmax(base / temperature, dim=0).tolist())


def test_distribution_matches_softmax_global_rng(sampler: Sampler) -> None:
    base = torch.tensor([0.3, -0.2, 1.1, 0.0])
    n = 20_000
    with torch.random.fork_rng():
        torch.manual_seed(99)
        out = sampler.sample(base.expand(n, 4), [SamplingOptions(temperature=1.3)] * n, [None] * n)
    assert_close_to(out, torch.softmax(base / 1.3, dim=0).tolist())


def test_top_k_and_top_p_renormalise(sampler: Sampler) -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(20_000, 4)
    torch.manual_seed(3)
    top_k = sampler.sample(logits, [SamplingOptions(top_k=2)] * 20_000, [None] * 20_000)
    assert_close_to(top_k, [0.625, 0.375, 0.0, 0.0])
    # top_p 0.7: 0.5 < 0.7 so token 1 is needed too; the mass before token 2 (0.8) >= 0.7 drops it.
    top_p = sampler.sample(logits, [SamplingOptions(top_p=0.7)] * 20_000, [None] * 20_000)
    assert_close_to(top_p, [0.625, 0.375, 0.0, 0.0])
    # top_p 0.5: the top token alone reaches it.
    only_top = sampler.sample(logits[:2_000], [SamplingOptions(top_p=0.5)] * 2_000, [None] * 2_000)
    assert set(only_top.tolist()) == {0}
    # top_k 3 first, then top_p 0.9 of the renormalised [0.526, 0.316, 0.158]: keeps all three.
    both = sampler.sample(logits, [SamplingOptions(top_k=3, top_p=0.9)] * 20_000, [None] * 20_000)
    assert_close_to(both, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])


def run_request(sampler: Sampler, request_logits: torch.Tensor, options: SamplingOptions,
                others: list[tuple[torch.Tensor, SamplingOptions]], position: int,
                steps: int = 12) -> list[int]:
    """Samples `steps` tokens for one request placed at `position` among `others` (fresh seeded
    generators for everyone) and returns the request's tokens."""
    generator = make_generator(options.seed, "cpu")
    other_generators = [make_generator(opt.seed, "cpu") for _, opt in others]
    tokens = []
    for _ in range(steps):
        rows = [logits for logits, _ in others]
        rows.insert(position, request_logits)
        batch_options = [opt for _, opt in others]
        batch_options.insert(position, options)
        generators = list(other_generators)
        generators.insert(position, generator)
        tokens.append(int(sampler.sample(torch.stack(rows), batch_options, generators)[position]))
    return tokens


@pytest.mark.parametrize("options", [
    SamplingOptions(temperature=1.0, seed=1234),
    SamplingOptions(temperature=0.8, top_k=50, seed=1234),
    SamplingOptions(temperature=1.2, top_p=0.9, seed=1234),
    SamplingOptions(temperature=0.9, top_k=40, top_p=0.95, seed=2**64 - 1),
])
def test_same_seed_same_tokens_regardless_of_batch(sampler: Sampler, options: SamplingOptions) -> None:
    request_logits = random_logits(1, seed=10)[0]
    others_a = [(random_logits(1, seed=11)[0], SamplingOptions(temperature=0.0)),
                (random_logits(1, seed=12)[0], SamplingOptions(temperature=1.0, top_k=5, seed=5)),
                (random_logits(1, seed=13)[0], SamplingOptions(temperature=0.5, top_p=0.3)),
                (random_logits(1, seed=14)[0], SamplingOptions(temperature=2.0, top_k=900, top_p=0.99,
                                                                  seed=6))]
    others_b = [(random_logits(1, seed=15)[0], SamplingOptions(temperature=1.0))]
    alone = run_request(sampler, request_logits, options, [], 0)
    assert len(set(alone)) > 1  # really sampling, not collapsing to one token
    assert run_request(sampler, request_logits, options, others_a, 0) == alone
    assert run_request(sampler, request_logits, options, others_a, 2) == alone
    assert run_request(sampler, request_logits, options, others_a, 4) == alone
    assert run_request(sampler, request_logits, options, others_b, 1) == alone


def test_different_seeds_differ(sampler: Sampler) -> None:
    logits = random_logits(1, seed=20)[0] * 0.2
    runs = {seed: run_request(sampler, logits, SamplingOptions(temperature=1.0, seed=seed), [], 0, steps=20)
            for seed in (1, 2, 3)}
    assert runs[1] != runs[2] and runs[1] != runs[3] and runs[2] != runs[3]


def test_make_generator() -> None:
    assert make_generator(None, "cpu") is None
    a, b = make_generator(42, "cpu"), make_generator(42, torch.device("cpu"))
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))
    with pytest.raises(ValueError, match="seed"):
        make_generator(-1, "cpu")


def test_from_params_defaults_unset_to_one() -> None:
    options = SamplingOptions.from_params()
    assert (options.temperature, options.top_p, options.top_k, options.seed) == (1.0, 1.0, 0, None)
    assert not options.is_greedy
    assert SamplingOptions.from_params(temperature=0.0, top_p=0.5, top_k=3, seed=9) == \
        SamplingOptions(temperature=0.0, top_p=0.5, top_k=3, seed=9)
    assert SamplingOptions.from_params(temperature=0.0).is_greedy


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_p": 1.0001}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"seed": -3}, "seed"),
    ({"seed": 2**64}, "seed"),
])
def test_validation_errors(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingOptions(**kwargs)


def test_from_params_validates() -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingOptions.from_params(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingOptions.from_params(top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingOptions.from_params(top_k=-2)


def test_validate_catches_mutation() -> None:
    options = SamplingOptions()
    options.top_p = 2.0
    with pytest.raises(ValueError, match="top_p"):
        options.validate()


def test_sample_checks_shapes(sampler: Sampler) -> None:
    with pytest.raises(ValueError, match="one option"):
        sampler.sample(torch.zeros(2, 5), [SamplingOptions()], [None, None])
    with pytest.raises(ValueError, match="batch, vocab"):
        sampler.sample(torch.zeros(5), [SamplingOptions()], [None])
