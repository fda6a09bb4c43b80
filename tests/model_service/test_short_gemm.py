"""The CPU linear-layer paths for short inputs (model_service/linear/short.py, tuning.py) compute
what `F.linear` computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from model_service.linear import PlannedLinear, plan_model, tuning
from model_service.linear.short import (
    MAX_ROWS,
    MIN_ROWS,
    MIN_SPLIT_ELEMENTS,
    SingleTokenStep,
    split_linear,
    split_parts,
    transposed_linear,
    transposed_rows,
)
from model_service.linear.tuning import Timing, time_paths

# SmolLM2-135M shapes (in, out): fused q/k/v, o, fused gate/up, down, lm_head.
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]


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
    assert torch.equal(transposed_linear(x, weight), F.linear(x, weight))
    assert torch.equal(transposed_linear(x, weight, bias), F.linear(x, weight, bias))


@pytest.mark.parametrize("shape", SHAPES)
def test_single_token_split_is_bitwise_f_linear(shape: tuple[int, int]) -> None:
    weight, bias = _weights(*shape, seed=1)
    x = torch.randn(1, 1, shape[0])
    threads = torch.get_num_threads()
    step = SingleTokenStep(enabled=True)
    with step.enter():
        parts = max(step.parts, 2)
        out, out_bias = split_linear(x, weight, None, parts), split_linear(x, weight, bias, parts)
    assert torch.get_num_threads() == threads
    assert out.shape == (1, 1, shape[1])
    assert torch.equal(out, F.linear(x, weight))
    assert torch.equal(out_bias, F.linear(x, weight, bias))


def test_split_applies_to_large_weights_and_threads_come_back_after_an_error() -> None:
    assert SHAPES[0][0] * SHAPES[0][1] >= MIN_SPLIT_ELEMENTS  # the split path is really exercised
    threads = torch.get_num_threads()
    step = SingleTokenStep(enabled=True)
    with pytest.raises(RuntimeError, match="boom"), step.enter():
        if split_parts() > 1:
            assert torch.get_num_threads() == 1 and step.parts == split_parts()
        raise RuntimeError("boom")
    assert torch.get_num_threads() == threads and step.parts == 0


@pytest.mark.parametrize("rows", [2, 5, 15])
def test_few_rows_of_a_logits_projection_stay_within_rounding(rows: int) -> None:
    weight, _ = _weights(576, 49152, seed=rows)
    x = torch.randn(rows, 576)
    torch.testing.assert_close(transposed_linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    narrow, _ = _weights(576, 960, seed=rows)  # not a logits projection: not a candidate below MIN_ROWS
    assert rows in transposed_rows(weight) and rows not in transposed_rows(narrow)


def test_long_inputs_and_other_dtypes_are_not_candidates() -> None:
    weight, _ = _weights(576, 960, seed=3)
    assert MAX_ROWS in transposed_rows(weight) and MAX_ROWS + 1 not in transposed_rows(weight)
    assert len(transposed_rows(weight.to(torch.bfloat16))) == 0


def test_planned_layers_keep_parameters_and_weight_tying() -> None:
    embed = nn.Embedding(100, 8)
    model = nn.ModuleDict({"embed": embed, "proj": nn.Linear(8, 8), "head": nn.Linear(8, 100, bias=False)})
    model["head"].weight = embed.weight  # tied, as in SmolLM2
    params = {name: p.data_ptr() for name, p in model.named_parameters()}
    linears = plan_model(model, timing=Timing())
    assert len(linears.products) == 2
    assert all(isinstance(model[n], PlannedLinear) for n in ("proj", "head"))
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == params
    assert model["head"].weight is embed.weight
    x = torch.randn(20, 8)
    assert torch.equal(model["proj"](x), F.linear(x, model["proj"].weight, model["proj"].bias))


@pytest.mark.parametrize(("times", "transposed", "split"), [
    ((1.0, 0.5, 1.0, 0.5), True, True),  # (F.linear, transposed, one-row F.linear, one-row split) s
    ((1.0, 0.98, 1.0, 1.2), False, False),  # within MIN_GAIN, or slower: F.linear
    ((1.0, 1.5, 1.0, 0.9), False, True),
])
def test_a_path_is_offered_only_where_it_is_clearly_faster(monkeypatch, times, transposed, split):
    calls = iter(times)
    monkeypatch.setattr(tuning, "timed", {})  # what earlier timing runs of this process found
    monkeypatch.setattr(tuning, "_pass_s", lambda *args: next(calls))
    monkeypatch.setattr(tuning, "_split_pass_s", lambda *args: next(calls))
    monkeypatch.setattr(tuning, "split_parts", lambda: 2)
    assert time_paths([torch.zeros(8, 4)], repeats=1) == Timing(transposed=transposed, split_one_row=split)


def test_a_disabled_step_keeps_the_threads():
    step = SingleTokenStep(enabled=False)
    threads = torch.get_num_threads()
    with step.enter():
        assert torch.get_num_threads() == threads and step.parts == 0


def test_timing_runs_over_the_model_weights():
    model = nn.Sequential(nn.Linear(64, 256, bias=False), nn.Linear(256, 64))
    linears = plan_model(model)
    assert [p.plan.shape for p in linears.products] == [(256, 64), (64, 256)]
    assert isinstance(linears.timing, Timing)
    assert isinstance(time_paths([p.weight for p in linears.products], repeats=1), Timing)
