"""The load-time plan of the linear layers (model_service/linear): exact mode takes only paths
verified bit-identical to F.linear, fast mode says where it does not, timing never decides bits."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from prometheus_client import generate_latest
from transformers import LlamaConfig, LlamaForCausalLM

from model_service.linear import PlannedLinear, plan_model, resolve_mode
from model_service.linear.plan import RowRange, merge_rows, table
from model_service.linear.short import MAX_ROWS, split_parts
from model_service.linear.tuning import Timing
from model_service.linear.verify import Verifier
from model_service.metrics import ModelMetrics

VOCAB, HIDDEN = 1024, 64  # lm_head [1024, 64]: a logits projection, a transposed candidate from 2 rows


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        initializer_range=0.2, max_position_embeddings=256)).eval()


class FailsFor(Verifier):
    """The real checks, except that the transposed path is found to differ for one shape."""

    def __init__(self, shape: tuple[int, int]) -> None:
        super().__init__()
        self.shape = shape
        self.asked: list[tuple[int, ...]] = []

    def transposed(self, weight, bias, rows):
        if tuple(weight.shape) == self.shape:
            self.asked.append(rows)
            return False
        return super().transposed(weight, bias, rows)


def _lm_head_plan(linears):
    return next(p for p in linears.plans if p.name == "lm_head")


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False).logits


def test_exact_mode_refuses_an_unverified_path_and_stays_bitwise_transformers():
    reference = tiny_llama()
    model = copy.deepcopy(reference)
    verifier = FailsFor((VOCAB, HIDDEN))
    # torch kernels only: the transposed product is the first candidate from 2 rows.
    linears = plan_model(model, mode="exact", linear_kernels="torch", timing=Timing(True, True), verifier=verifier)
    assert linears.mode == "exact" and verifier.asked  # the lm_head's transposed product was checked...
    head = _lm_head_plan(linears)
    assert not head.uses("transposed") and head.exact  # ...and refused at every row count
    refused = head.range_for(2)
    assert refused.path == "F.linear" and "refused (not bit-identical here): transposed" in refused.why
    others = [p for p in linears.plans if p.name != "lm_head"]
    assert all(p.uses("transposed") and p.exact for p in others)  # verified elsewhere: taken
    assert all(r.verified for p in linears.plans for r in p.ranges)
    assert "NO" not in linears.table()
    for rows in (1, 2, 3, 17, 40):
        ids = torch.randint(0, VOCAB, (1, rows), generator=torch.Generator().manual_seed(rows))
        assert torch.equal(_logits(model, ids), _logits(reference, ids)), rows


def test_exact_mode_with_the_real_checks_is_bitwise_transformers_at_every_row_count():
    """The transposed product offered from 2 rows (as a timing run may offer it), the real checks:
    on 2 Zen 5 cores MKL sums 2-11 rows of this lm_head in another order than F.linear, which
    the unplanned code took (greedy logits 1e-6 apart at 3 and 5 rows); exact mode refuses it."""
    reference = tiny_llama()
    model = copy.deepcopy(reference)
    linears = plan_model(model, mode="exact", linear_kernels="torch", timing=Timing(True, True), verifier=Verifier())
    assert all(p.exact for p in linears.plans)
    for rows in range(1, 18):
        ids = torch.randint(0, VOCAB, (1, rows), generator=torch.Generator().manual_seed(rows))
        assert torch.equal(_logits(model, ids), _logits(reference, ids)), rows


def test_fast_mode_takes_the_unverified_path_and_says_so():
    model = tiny_llama()
    linears = plan_model(model, mode="fast", linear_kernels="torch", timing=Timing(True, True),
                         verifier=FailsFor((VOCAB, HIDDEN)))
    head = _lm_head_plan(linears)
    taken = head.range_for(2)
    assert taken.path == "transposed" and not taken.verified and "fast mode" in taken.why
    longer = head.range_for(MAX_ROWS)  # probed at a sample of row counts from 16
    assert (longer.first, longer.last, longer.path, longer.verified) == (16, MAX_ROWS, "transposed", False)
    assert not head.exact
    text = linears.table()
    assert "lm_head" in text and "NO" in text and "fast mode" in text
    x = torch.randn(5, HIDDEN)
    torch.testing.assert_close(model.lm_head(x), F.linear(x, model.lm_head.weight), rtol=1e-5, atol=1e-5)
    metrics = ModelMetrics()
    metrics.set_linear_plan(linears.plans)
    exported = generate_latest(metrics.registry).decode()
    assert (f'radixkv_model_linear_plan_weights{{dtype="float32",mode="fast",path="transposed",rows="2-15",'
            f'shape="{VOCAB}x{HIDDEN}",verified="no"}} 1.0') in exported


@pytest.mark.parametrize("timing", [Timing(t, s) for t, s in itertools.product((True, False), repeat=2)])
def test_no_timing_run_makes_an_exact_plan_take_an_unverified_path(timing):
    """Whatever the timing run says, an exact plan's paths are verified ones and its products
    give F.linear's bits; timing can only take a verified path away."""
    model = tiny_llama()
    linears = plan_model(model, mode="exact", linear_kernels="torch", timing=timing, verifier=FailsFor((VOCAB, HIDDEN)))
    assert all(p.exact for p in linears.plans)
    assert not _lm_head_plan(linears).uses("transposed")
    g = torch.Generator().manual_seed(1)
    for product in linears.products:
        for rows in (1, 2, 7, 16, 33, MAX_ROWS + 3):
            x = torch.randn(rows, product.weight.shape[1], generator=g)
            with linears.single_token_step() if rows == 1 else torch.inference_mode():
                got = product(x)
            assert torch.equal(got, F.linear(x, product.weight, product.bias)), (product.plan.name, rows)
    offered = [p.plan for p in linears.products if p.plan.name != "lm_head"]
    assert all(p.uses("transposed") == timing.transposed for p in offered)


def test_default_float32_plan_is_exact_and_every_range_verified():
    """With the real checks (and the blocked kernel where it runs), the default plan is exact."""
    model = tiny_llama()
    reference = copy.deepcopy(model)
    linears = plan_model(model)
    assert linears.mode == "exact" and all(p.exact for p in linears.plans)
    assert isinstance(model.lm_head, PlannedLinear)
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(model, ids), _logits(reference, ids))


def test_one_row_takes_the_split_path_only_in_one_token_steps():
    if split_parts() < 2:
        pytest.skip("one core: nothing to split across")
    weight = torch.nn.Linear(512, 1024, bias=False)  # 512K elements: a split candidate
    model = torch.nn.Sequential(weight)
    linears = plan_model(model, timing=Timing(transposed=False, split_one_row=True))
    plan = linears.plans[0]
    assert plan.range_for(1).path == "split" and plan.range_for(1).verified and linears.step.enabled
    x = torch.randn(1, 512)
    parts = split_parts()
    with linears.single_token_step():
        assert linears.step.parts == parts and torch.get_num_threads() == 1
        assert torch.equal(model(x), F.linear(x, weight.weight))
    assert linears.step.parts == 0 and torch.equal(model(x), F.linear(x, weight.weight))


def test_modes_resolve_by_dtype_and_fp32_gemm():
    assert resolve_mode("auto", torch.float32, "mkl") == "exact"
    assert resolve_mode("auto", torch.bfloat16, "mkl") == "fast"  # bf16 keeps oneDNN's packed products
    assert resolve_mode("auto", torch.float32, "onednn") == "fast"
    assert resolve_mode("exact", torch.bfloat16, "mkl") == "exact"
    with pytest.raises(ValueError, match="exact refuses --fp32-gemm onednn"):
        resolve_mode("exact", torch.float32, "onednn")
    with pytest.raises(ValueError, match="linear_mode"):
        resolve_mode("quick", torch.float32, "mkl")
    with pytest.raises(ValueError, match="fp32_gemm"):
        resolve_mode("auto", torch.float32, "fast")


def test_rows_merge_into_ranges_and_the_table_groups_shapes():
    per_row = [("F.linear", True, "ref")] + [("transposed", True, "t")] * 3 + [("F.linear", True, "ref")]
    ranges = merge_rows(per_row, ("blocked", True, "b"))
    assert ranges == (RowRange(1, 1, "F.linear", True, "ref"), RowRange(2, 4, "transposed", True, "t"),
                      RowRange(5, 5, "F.linear", True, "ref"), RowRange(6, None, "blocked", True, "b"))
    model = tiny_llama()
    text = table(plan_model(model, timing=Timing(False, False)).plans)
    assert "2 x model.layers.*.mlp.down_proj" in text and "lm_head" in text
    assert text.splitlines()[0].split()[:3] == ["weights", "shape", "dtype"]


def test_the_flag_refuses_exact_mode_with_onednn_before_loading_anything(capsys):
    from model_service.__main__ import build_parser, main

    assert build_parser().parse_args([]).linear_mode == "auto"
    with pytest.raises(SystemExit) as exited:
        main(["--linear-mode", "exact", "--fp32-gemm", "onednn", "--port", "0"])
    assert exited.value.code == 2 and "exact refuses --fp32-gemm onednn" in capsys.readouterr().err
