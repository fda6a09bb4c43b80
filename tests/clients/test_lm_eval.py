"""lm-evaluation-harness (`lm-eval`) against the router's OpenAI door over the bundled model: its
`local-completions` model (token-id prompts, as lm-eval sends them by default; loglikelihoods
from `echo` + `logprobs` + `max_tokens: 1`) on the repo's own tasks (testing/lm_eval_tasks/: a
multiple-choice loglikelihood task and a generate-until task, local files only) scores what
lm-eval's `hf` backend scores on the same model folder in float32, run in the same test: the same
accuracies and exact match, the same generated text, every choice's loglikelihood within 1e-4."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lm_eval
import pytest
from lm_eval.tasks import TaskManager

from tests.clients.conftest import Door

pytestmark = pytest.mark.timeout(600)

TASKS_DIR = Path(__file__).resolve().parents[2] / "testing" / "lm_eval_tasks"
MC, GEN = "radixkv_mc", "radixkv_gen"
# Per-choice loglikelihood sums (a few tokens each): the door's come from the model service's fp32
# forward (its own kernels, batched), hf's from transformers'; they differ by summation order only
# (seen: at most 2e-5, as much as hf batched vs unbatched differ from each other).
LOGLIKELIHOOD_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def task_manager() -> TaskManager:
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


def evaluate(model: str, model_args: dict[str, Any], task: str, task_manager: TaskManager,
             batch_size: int = 1) -> dict[str, Any]:
    """lm-eval's own entry point (what `lm-eval run` runs), with every sample logged. Greedy and
    zero-shot: no seed matters, so it leaves this process's global random generators alone."""
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], task_manager=task_manager,
                                      batch_size=batch_size, log_samples=True, bootstrap_iters=0,
                                      random_seed=None, numpy_random_seed=None, torch_random_seed=None)
    assert results is not None
    return results


def hf(model_dir: Path, task: str, task_manager: TaskManager, batch_size: int) -> dict[str, Any]:
    """lm-eval's `hf` backend (transformers in this process, fp32, CPU): the reference."""
    return evaluate("hf", {"pretrained": str(model_dir), "dtype": "float32", "device": "cpu"}, task, task_manager,
                    batch_size)


def door_args(door: Door, model_dir: Path) -> dict[str, Any]:
    """`local-completions` as a user points it at an OpenAI-compatible server: the completions URL,
    the model's own tokenizer (lm-eval's default `tokenized_requests`: prompts go as token ids)."""
    return {"model": door.model, "base_url": door.base_url + "/completions", "tokenizer": str(model_dir),
            "tokenizer_backend": "huggingface", "num_concurrent": 4, "max_retries": 1, "timeout": 120}


def by_doc(results: dict[str, Any], task: str) -> dict[int, dict[str, Any]]:
    return {sample["doc_id"]: sample for sample in results["samples"][task]}


def test_generate_until_scores_equal_hf(bundled_door: Door, bundled_model_dir: Path,
                                        task_manager: TaskManager) -> None:
    reference = hf(bundled_model_dir, GEN, task_manager, batch_size=1)  # unpadded: the same greedy path
    door = evaluate("local-completions", door_args(bundled_door, bundled_model_dir), GEN, task_manager)
    want, got = by_doc(reference, GEN), by_doc(door, GEN)
    assert got.keys() == want.keys() and len(got) >= 5
    for doc_id, sample in want.items():  # greedy: the same text, token for token
        assert got[doc_id]["resps"] == sample["resps"], (doc_id, sample["doc"])
    assert door["results"][GEN]["exact_match,first_word"] == reference["results"][GEN]["exact_match,first_word"]


def test_loglikelihood_scores_equal_hf(bundled_door: Door, bundled_model_dir: Path,
                                       task_manager: TaskManager) -> None:
    # Batched: right padding leaves a causal model's scores of the real tokens as they are.
    reference = hf(bundled_model_dir, MC, task_manager, batch_size=8)
    door = evaluate("local-completions", door_args(bundled_door, bundled_model_dir), MC, task_manager)
    want, got = by_doc(reference, MC), by_doc(door, MC)
    assert got.keys() == want.keys() and len(got) >= 10
    for doc_id, sample in want.items():
        # resps: one [(loglikelihood, is_greedy)] per choice
        hf_pairs = [resp[0] for resp in sample["resps"]]
        door_pairs = [resp[0] for resp in got[doc_id]["resps"]]
        assert len(door_pairs) == len(hf_pairs)
        for (hf_ll, hf_greedy), (door_ll, door_greedy) in zip(hf_pairs, door_pairs, strict=True):
            assert math.isclose(door_ll, hf_ll, rel_tol=0, abs_tol=LOGLIKELIHOOD_TOLERANCE), (doc_id, sample["doc"])
            assert door_greedy == hf_greedy, (doc_id, sample["doc"])
    for metric in ("acc,none", "acc_norm,none"):
        assert door["results"][MC][metric] == reference["results"][MC][metric], metric
