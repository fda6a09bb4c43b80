"""The CPU linear-layer paths for short inputs compute what `F.linear` computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from model_service import short_gemm, short_gemm_tuning
from model_service.short_gemm import (
    MAX_ROWS,
    MIN_ROWS,
    MIN_SPLIT_ELEMENTS,
    ShortInputLinear,
    ShortInputPaths,
    short_linear,
    single_token_step,
    use_short_input_gemm,
)

# SmolLM2-135M shapes (in, out): fused q/k/v, o, fused gate/up, down, lm_head.
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]


@pytest.fixture(autouse=True)
def both_paths_on(monkeypatch):
    """These tests check the paths themselves, whatever a ModelRunner in this process chose."""
    monkeypatch.setattr(short_gemm, "paths", ShortInputPaths(transposed=True, split_one_row=True))


def _weights(in_features: int, out_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g) * in_features ** -0.5
    bias = torch.randn(out_features, generator=g)
    return weight, bias


@pytest.mark.parametrize("rows", [MIN_ROWS, 32, 100, MAX_ROWS])
@pytest.mark.parametrize("shape", SHAPES)
def test_transposed_product_is_bitwise_f_linear(rows: int, shape: tuple[int, int]) -> None:
    weight, bias = _weights(*shape, seed=rows)
    x = torch.randn(1, rows, shape[0])  # [1, T, in] as the model passes it
    assert torch.equal(short_linear(x, weight), F.linear(x, weight))
    assert torch.equal(short_linear(x, weight, bias), F.linear(x, weight, bias))


@pytest.mark.parametrize("shape", SHAPES)
def test_single_token_split_is_bitwise_f_linear(shape: tuple[int, int]) -> None:
    weight, bias = _weights(*shape, seed=1)
    x = torch.randn(1, 1, shape[0])
    threads = torch.get_num_threads()
    with single_token_step():
        out, out_bias = short_linear(x, weight), short_linear(x, weight, bias)
    assert torch.get_num_threads() == threads
    assert out.shape == (1, 1, shape[1])
    assert torch.equal(out, F.linear(x, weight))
    assert torch.equal(out_bias, F.linear(x, weight, bias))


def test_split_applies_to_large_weights_and_threads_come_back_after_an_error() -> None:
    assert SHAPES[0][0] * SHAPES[0][1] >= MIN_SPLIT_ELEMENTS  # the split path is really exercised
    threads = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="boom"), single_token_step():
        if threads > 1 and torch.get_num_interop_threads() > 1:
            assert torch.get_num_threads() == 1
        raise RuntimeError("boom")
    assert torch.get_num_threads() == threads


@pytest.mark.parametrize("rows", [2, 5, 15])
def test_few_rows_of_a_logits_projection_stay_within_rounding(rows: int) -> None:
    weight, _ = _weights(576, 49152, seed=rows)
    x = torch.randn(rows, 576)
    torch.testing.assert_close(short_linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    narrow, _ = _weights(576, 960, seed=rows)  # not a logits projection: plain F.linear
    assert torch.equal(short_linear(x, narrow), F.linear(x, narrow))


def test_long_inputs_and_other_dtypes_take_f_linear() -> None:
    weight, _ = _weights(576, 960, seed=3)
    x = torch.randn(MAX_ROWS + 1, 576)
    assert torch.equal(short_linear(x, weight), F.linear(x, weight))
    x16, w16 = x[:32].to(torch.bfloat16), weight.to(torch.bfloat16)
    assert torch.equal(short_linear(x16, w16), F.linear(x16, w16))


def test_switching_keeps_parameters_and_weight_tying() -> None:
    embed = nn.Embedding(100, 8)
    model = nn.ModuleDict({"embed": embed, "proj": nn.Linear(8, 8), "head": nn.Linear(8, 100, bias=False)})
    model["head"].weight = embed.weight  # tied, as in SmolLM2
    params = {name: p.data_ptr() for name, p in model.named_parameters()}
    assert use_short_input_gemm(model) == 2
    assert all(isinstance(model[n], ShortInputLinear) for n in ("proj", "head"))
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == params
    assert model["head"].weight is embed.weight
    x = torch.randn(20, 8)
    torch.testing.assert_close(model["proj"](x), F.linear(x, model["proj"].weight, model["proj"].bias))


@pytest.mark.parametrize(("times", "transposed", "split"), [
    ((1.0, 0.5, 1.0, 0.5), True, True),  # (F.linear, transposed, one-row F.linear, one-row split) s
    ((1.0, 0.98, 1.0, 1.2), False, False),  # within MIN_GAIN, or slower: F.linear
    ((1.0, 1.5, 1.0, 0.9), False, True),
])
def test_a_path_is_kept_only_where_it_is_clearly_faster(monkeypatch, times, transposed, split):
    calls = iter(times)
    monkeypatch.setattr(short_gemm_tuning, "_pass_s", lambda *args: next(calls))
    chosen = short_gemm_tuning.choose_paths([torch.zeros(8, 4)], repeats=1)
    assert chosen == ShortInputPaths(transposed=transposed, split_one_row=split)
    assert short_gemm.paths == chosen


def test_paths_off_are_f_linear_and_one_thread_steps_are_not_entered(monkeypatch):
    monkeypatch.setattr(short_gemm, "paths", ShortInputPaths(transposed=False, split_one_row=False))
    weight, _ = _weights(576, 3072, seed=2)
    x = torch.randn(1, 32, 576)
    assert torch.equal(short_linear(x, weight), F.linear(x, weight))
    threads = torch.get_num_threads()
    with single_token_step():
        assert torch.get_num_threads() == threads and short_gemm._split_parts == 0


def test_choosing_times_the_model_weights_and_sets_the_paths():
    model = nn.Sequential(nn.Linear(64, 256, bias=False), nn.Linear(256, 64))
    use_short_input_gemm(model)
    weights = short_gemm_tuning.linear_weights(model)
    assert [tuple(w.shape) for w in weights] == [(256, 64), (64, 256)]
    chosen = short_gemm_tuning.choose_paths(weights, repeats=1)
    assert short_gemm.paths is chosen
