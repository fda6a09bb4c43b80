"""Prompt scoring in the model runner (SamplingParams.prompt_logprobs, issue 30): a prompt's own
logits at every position (`SequenceChunk.num_scored`, `StepLogits.scored`), over a cache hit
whose K/V is computed again but never rewritten (`SequenceChunk.num_cached`): those pages are
the radix tree's, read by other requests, and must stay bit for bit what they were.

Cached pages are given K/V one unit in the last place away from what this step computes (as a
step of another batch shape may have left them): numerically the same, so the scores still
match transformers, but a rewrite shows bit for bit.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import model_service.attention.flashinfer_backend as fib
from model_service.attention import create_attention_backend
from model_service.attention.base import AttentionBackend
from model_service.attention.torch_backend import TorchAttentionBackend
from model_service.kv_cache import KVCache, KVCacheSpec
from model_service.logprobs import PROMPT_SLICE_ROWS, prompt_positions
from model_service.model_loader import LoadedModel
from model_service.model_runner import ModelRunner, SequenceChunk, StepLogits
from tests.model_service.attention import fake_flashinfer
from tests.model_service.attention.paged_case import PagedCase, make_case, reference_attention

BLOCK = 16
CPU = torch.device("cpu")
TOL = dict(rtol=0.0, atol=1e-5)  # issue 30: log_softmax of transformers' logits within 1e-5 (fp32)


def make_runner(reference: LoadedModel, backend: AttentionBackend | None = None, num_blocks: int = 32) -> ModelRunner:
    """A runner over a copy of the tiny model (the runner rewires its model), float32."""
    cfg = reference.model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv = KVCache(KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, BLOCK, torch.float32),
                 num_blocks, CPU)
    if backend is None:
        backend = create_attention_backend("torch", cfg.num_attention_heads, cfg.num_key_value_heads, head_dim,
                                           BLOCK, torch.float32, CPU)
    return ModelRunner(copy.deepcopy(reference.model), kv, backend, CPU)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def reference_logprobs(reference: LoadedModel, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' own logits at every position of `ids`: [len, vocab] float32."""
    return torch.log_softmax(reference.model(torch.tensor([ids])).logits[0].float(), dim=-1)


def slots(table: list[int], positions: range) -> torch.Tensor:
    pos = torch.tensor(list(positions))
    return torch.tensor(table)[pos // BLOCK] * BLOCK + pos % BLOCK


def cache_rows(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks * block_size, Hkv, D] view of one layer's paged cache."""
    return cache.view(-1, cache.shape[2], cache.shape[3])


def nudge(t: torch.Tensor) -> torch.Tensor:
    """t one unit in the last place larger in magnitude (bit pattern + 1), in place."""
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype]
    t.view(ints).add_(1)
    return t


def nudge_cached(runner: ModelRunner, cached: torch.Tensor) -> None:
    """What another step left at the cached slots: the same K/V up to the last bit."""
    for cache in runner.kv_cache.k + runner.kv_cache.v:
        rows = cache_rows(cache)
        rows[cached] = nudge(rows[cached])


def cached_values(runner: ModelRunner, cached: torch.Tensor) -> list[torch.Tensor]:
    return [cache_rows(c)[cached].clone() for c in runner.kv_cache.k + runner.kv_cache.v]


def assert_logprobs(scored: torch.Tensor | None, want: torch.Tensor, ids: list[int] | None = None) -> None:
    """log_softmax(scored) against transformers': the likely tokens' (top 20 and, given the
    prompt `ids`, each row's next token) within 1e-5; the whole vocabulary within 1e-5 plus
    2 ppm of the value (a tail log-probability of -14 carries float32 rounding of that size)."""
    assert scored is not None and scored.dtype == torch.float32 and scored.shape == want.shape
    got = torch.log_softmax(scored, dim=-1)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-5)
    top = want.topk(20, dim=-1).indices
    torch.testing.assert_close(got.gather(1, top), want.gather(1, top), **TOL)
    if ids is not None:
        nxt = torch.tensor(ids[1:want.shape[0] + 1]).view(-1, 1)
        rows = nxt.shape[0]
        torch.testing.assert_close(got[:rows].gather(1, nxt), want[:rows].gather(1, nxt), **TOL)


@pytest.mark.parametrize("path", ["decoder_forward", "transformers"])
def test_scored_rows_are_transformers_log_softmax(tiny_reference, path):
    ids = prompt(70, seed=1)
    want = reference_logprobs(tiny_reference, ids)  # [70, vocab]
    runner = make_runner(tiny_reference)
    if path == "transformers":
        runner.decoder = None  # transformers' forward, rows through logits_to_keep
    else:
        assert runner.decoder is not None
    step = runner.execute([SequenceChunk(ids, 0, list(range(5)), True, num_scored=70)])
    assert isinstance(step, StepLogits) and step.sampled.shape == (1, want.shape[1])
    assert_logprobs(step.scored, want, ids)
    torch.testing.assert_close(torch.log_softmax(step.sampled.float(), dim=-1)[0], want[-1], **TOL)

    # Chunked: the first chunk alone (nothing sampled), the second after a plain prompt in one
    # step, its context read back from the cache.
    runner = make_runner(tiny_reference)
    if path == "transformers":
        runner.decoder = None
    first = runner.execute([SequenceChunk(ids[:40], 0, list(range(5)), False, num_scored=40)])
    assert first.sampled.shape == (0, want.shape[1])
    second = runner.execute([SequenceChunk(prompt(20, seed=2), 0, [10, 11], True),
                             SequenceChunk(ids[40:], 40, list(range(5)), True, num_scored=25)])
    assert second.sampled.shape == (2, want.shape[1])
    assert first.scored is not None and second.scored is not None
    assert_logprobs(torch.cat([first.scored, second.scored]), want[:65], ids)

    # A step without scores returns none, and the same rows to sample: bit for bit on the lean
    # forward (a head call of their own), up to rounding on transformers' (one head call for both).
    runner = make_runner(tiny_reference)
    if path == "transformers":
        runner.decoder = None
    plain = runner.execute([SequenceChunk(ids, 0, list(range(5)), True)])
    assert plain.scored is None
    if path == "transformers":
        torch.testing.assert_close(plain.sampled, step.sampled, **TOL)
    else:
        assert torch.equal(plain.sampled, step.sampled)


def test_prompt_positions_are_each_rows_next_token(tiny_reference):
    ids = prompt(PROMPT_SLICE_ROWS + 40, seed=3)  # more than one slice
    want = reference_logprobs(tiny_reference, ids)
    step = make_runner(tiny_reference).execute(
        [SequenceChunk(ids, 0, list(range(-(-len(ids) // BLOCK))), True, num_scored=len(ids) - 1)])
    assert step.scored is not None
    got = prompt_positions(step.scored, ids[1:], 3)
    assert len(got) == len(ids) - 1
    chosen = want[:-1].gather(1, torch.tensor(ids[1:]).view(-1, 1)).view(-1)
    torch.testing.assert_close(torch.tensor([p.logprob for p in got]), chosen, **TOL)
    assert [p.token_id for p in got] == ids[1:]
    assert [p.rank for p in got] == ((want[:-1] > chosen[:, None]).sum(-1) + 1).tolist()
    top = want[:-1].topk(3, dim=-1)
    assert [[t for t, _ in p.top] for p in got] == top.indices.tolist()
    assert prompt_positions(step.scored[:0], [], 3) == []
    with pytest.raises(ValueError, match="scored rows"):
        prompt_positions(step.scored, ids, 3)


@pytest.mark.parametrize("path", ["alone", "batched", "transformers"])
def test_cached_prefix_is_computed_not_rewritten(tiny_reference, path):
    """alone: the prompt attends over its own new K/V; batched: in one call with another extend,
    over the cache (the cached rows read the cached copies); transformers: the fallback forward."""
    ids = prompt(70, seed=4)
    table = list(range(5))
    runner = make_runner(tiny_reference)
    if path == "transformers":
        runner.decoder = None
    runner.execute([SequenceChunk(ids, 0, table, True)])  # the prompt's K/V, as an earlier request left it
    cached, fresh = slots(table, range(48)), slots(table, range(48, 70))
    fresh_values = cached_values(runner, fresh)
    nudge_cached(runner, cached)
    before = cached_values(runner, cached)
    for cache in runner.kv_cache.k + runner.kv_cache.v:
        cache_rows(cache)[fresh] = float("nan")  # must be written: attention reads them back
    chunks = [SequenceChunk(ids, 0, table, True, num_cached=48, num_scored=70)]
    if path == "batched":
        chunks.insert(0, SequenceChunk(prompt(9, seed=5), 20, [10, 11], True))
    step = runner.execute(chunks)
    for want, got in zip(before, cached_values(runner, cached), strict=True):
        assert torch.equal(got, want), "a cached page was rewritten"
    for want, got in zip(fresh_values, cached_values(runner, fresh), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # written (were NaN), same values
    assert_logprobs(step.scored, reference_logprobs(tiny_reference, ids), ids)


def test_fully_cached_chunk_writes_nothing(tiny_reference):
    ids = prompt(32, seed=6)
    runner = make_runner(tiny_reference)
    runner.execute([SequenceChunk(ids, 0, [0, 1], True)])
    cached = slots([0, 1], range(32))
    nudge_cached(runner, cached)
    before = [c.clone() for c in runner.kv_cache.k + runner.kv_cache.v]
    step = runner.execute([SequenceChunk(ids, 0, [0, 1], True, num_cached=32, num_scored=32)])
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_cache.k + runner.kv_cache.v, strict=True))
    assert_logprobs(step.scored, reference_logprobs(tiny_reference, ids), ids)


def test_mixed_batch_leaves_the_other_rows_alone(tiny_reference):
    """Decodes sharing the scored prompt's cached pages, a plain prompt and the scoring chunk in
    one step: the others' logits are those of the step without it, the shared pages unchanged."""
    a, b = prompt(50, seed=7), prompt(40, seed=8)
    ta, tb = [0, 1, 2, 3], [4, 5, 6]
    shared = slots(ta, range(48))

    def prefilled() -> ModelRunner:
        runner = make_runner(tiny_reference)
        runner.execute([SequenceChunk(a, 0, ta, True), SequenceChunk(b, 0, tb, True)])
        nudge_cached(runner, shared)
        return runner

    scored_ids = a[:48] + prompt(20, seed=9)  # a radix-tree hit on a's first three pages
    scoring = SequenceChunk(scored_ids, 0, ta[:3] + [7, 8], True, num_cached=48, num_scored=68)
    others = [SequenceChunk([17], 50, ta, True), SequenceChunk([23], 40, tb, True),
              SequenceChunk(prompt(30, seed=10), 0, [9, 10], True)]
    without = prefilled().execute(others)
    runner = prefilled()
    before = cached_values(runner, shared)
    step = runner.execute(others[:2] + [scoring] + others[2:])
    for want, got in zip(before, cached_values(runner, shared), strict=True):
        assert torch.equal(got, want), "a shared page was rewritten"
    assert_logprobs(step.scored, reference_logprobs(tiny_reference, scored_ids), scored_ids)
    kept = torch.tensor([0, 1, 3])
    torch.testing.assert_close(step.sampled.index_select(0, kept), without.sampled, **TOL)
    # Scoring only adds rows: the same step without scores samples bit for bit the same logits.
    unscored = prefilled().execute(others[:2] + [scoring._replace(num_scored=0)] + others[2:])
    assert unscored.scored is None and torch.equal(unscored.sampled, step.sampled)


def test_cascade_prefix_copies_survive_a_recomputed_hit(tiny_reference):
    """Decodes attending their shared pages as a cascade keep the pages' copies across a step in
    which a scoring prompt recomputes the same pages (nothing was written to them)."""
    cfg = tiny_reference.model.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim, layers = cfg.hidden_size // hq, cfg.num_hidden_layers
    backend = TorchAttentionBackend(hq, hkv, head_dim, BLOCK, torch.float32, CPU, cascade="always")
    runner = make_runner(tiny_reference, backend)
    base = prompt(48, seed=11)
    a, a2 = base + prompt(5, seed=12), base + prompt(9, seed=13)
    ta, ta2 = [0, 1, 2, 3], [0, 1, 2, 4]
    runner.execute([SequenceChunk(a, 0, ta, True)])
    runner.execute([SequenceChunk(a2[48:], 48, ta2, True)])
    shared = slots(ta, range(48))
    nudge_cached(runner, shared)
    before = cached_values(runner, shared)
    runner.execute([SequenceChunk([5], 53, ta, True), SequenceChunk([6], 57, ta2, True)])
    assert backend.prefix_store.misses == layers  # the cascade ran and kept its copies
    scored_ids = base + prompt(10, seed=14)
    step = runner.execute([SequenceChunk([7], 54, ta, True), SequenceChunk([8], 58, ta2, True),
                           SequenceChunk(scored_ids, 0, [0, 1, 2, 5], True, num_cached=48, num_scored=58)])
    assert backend.prefix_store.hits == layers, "the recomputed hit invalidated the kept prefix copies"
    for want, got in zip(before, cached_values(runner, shared), strict=True):
        assert torch.equal(got, want), "a shared page was rewritten"
    assert_logprobs(step.scored, reference_logprobs(tiny_reference, scored_ids), scored_ids)
    # The decodes read the same prefix as a step without the scoring prompt.
    plain = make_runner(tiny_reference)
    plain.execute([SequenceChunk(a, 0, ta, True)])
    plain.execute([SequenceChunk(a2[48:], 48, ta2, True)])
    plain.execute([SequenceChunk([5], 53, ta, True), SequenceChunk([6], 57, ta2, True)])
    without = plain.execute([SequenceChunk([7], 54, ta, True), SequenceChunk([8], 58, ta2, True)])
    torch.testing.assert_close(step.sampled[:2], without.sampled, **TOL)


def test_bad_counts_are_refused(tiny_reference):
    runner = make_runner(tiny_reference)
    ids = prompt(8, seed=15)
    with pytest.raises(ValueError, match="num_cached"):
        runner.execute([SequenceChunk(ids, 0, [0], True, num_cached=9)])
    with pytest.raises(ValueError, match="num_scored"):
        runner.execute([SequenceChunk(ids, 0, [0], True, num_scored=-1)])


# ------------------------------------------------------------ the backends' write, attention level

def recomputed_case(dtype: torch.dtype, cached: list[int], device: str = "cpu") -> tuple[PagedCase, torch.Tensor]:
    """A mixed step (prompts with and without a prefix, decodes) whose sequence i has its first
    cached[i] new tokens already in the cache (nudged copies). Returns the case with
    layout.written_rows set, and the expected caches' unwritten slots."""
    case = make_case([37, 16, 70, 9, 40], [20, 16, 11, 1, 1], block_size=BLOCK, num_q_heads=4, num_kv_heads=2,
                     head_dim=32, seed=1, dtype=dtype, device=device)
    starts = [0] + torch.cumsum(torch.tensor(case.query_lens), 0).tolist()
    unwritten = torch.tensor([starts[i] + j for i, n in enumerate(cached) for j in range(n)], dtype=torch.long,
                             device=device)
    written = torch.tensor(sorted(set(range(sum(case.query_lens))) - set(unwritten.tolist())), dtype=torch.long,
                           device=device)
    for cache, new in ((case.k_cache, case.k), (case.v_cache, case.v)):
        cache_rows(cache)[case.layout.slot_mapping[unwritten]] = nudge(new[unwritten].clone())
    case.layout.written_rows = written
    return case, unwritten


def assert_backend_writes_only_written_rows(backend: AttentionBackend, case: PagedCase, unwritten: torch.Tensor,
                                            tol: float) -> None:
    scale = 1.0 / math.sqrt(case.q.shape[2])
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    backend.plan(case.layout)
    out = backend.forward(case.q, case.k, case.v, k_cache, v_cache, scale)
    k_exp, v_exp = case.expected_caches()
    keep = case.layout.slot_mapping[unwritten]
    cache_rows(k_exp)[keep] = cache_rows(case.k_cache)[keep]
    cache_rows(v_exp)[keep] = cache_rows(case.v_cache)[keep]
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp), "K/V written outside written_rows"
    torch.testing.assert_close(out.double(), reference_attention(case, scale), rtol=tol, atol=tol)


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("cached", [[12, 16, 0, 0, 1], [0, 0, 11, 0, 0]])
def test_torch_backend_writes_only_written_rows(kernels, cached):
    case, unwritten = recomputed_case(torch.float32, cached)
    backend = TorchAttentionBackend(4, 2, 32, BLOCK, torch.float32, CPU, kernels=kernels)
    assert_backend_writes_only_written_rows(backend, case, unwritten, 1e-5)


def test_torch_backend_single_prompt_attends_its_own_new_kv():
    """One prompt without prefix (the dense-attention path), its first rows cached."""
    case = make_case([40], [40], block_size=BLOCK, num_q_heads=4, num_kv_heads=2, head_dim=32, seed=2)
    unwritten = torch.arange(16)
    cache_rows(case.k_cache)[case.layout.slot_mapping[unwritten]] = nudge(case.k[unwritten].clone())
    cache_rows(case.v_cache)[case.layout.slot_mapping[unwritten]] = nudge(case.v[unwritten].clone())
    case.layout.written_rows = torch.arange(16, 40)
    backend = TorchAttentionBackend(4, 2, 32, BLOCK, torch.float32, CPU)
    assert_backend_writes_only_written_rows(backend, case, unwritten, 1e-5)


@pytest.mark.parametrize("cached", [[12, 16, 0, 0, 1], [20, 16, 11, 1, 1]])
def test_flashinfer_backend_appends_only_written_rows(monkeypatch, cached):
    """The FlashInfer backend's wiring (CPU, the strict fake of tests/model_service/attention):
    only written rows are appended, at their own positions."""
    monkeypatch.setattr(fib, "import_flashinfer", lambda: fake_flashinfer)
    monkeypatch.setattr(fib, "_require_cuda", lambda device: None)
    monkeypatch.setattr(fib.FlashInferAttentionBackend, "workspace_bytes", 1024)
    fake_flashinfer.calls.clear()
    case, unwritten = recomputed_case(torch.bfloat16, cached)
    backend = fib.FlashInferAttentionBackend(4, 2, 32, BLOCK, torch.bfloat16, CPU)
    assert_backend_writes_only_written_rows(backend, case, unwritten, 2e-2)
    assert fake_flashinfer.calls.count("append_paged_kv_cache") == int(sum(cached) < sum(case.query_lens))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cached", [[12, 16, 0, 0, 1], [20, 16, 11, 1, 1]])
def test_real_flashinfer_appends_only_written_rows(cached):
    pytest.importorskip("flashinfer")
    case, unwritten = recomputed_case(torch.bfloat16, cached, device="cuda")
    backend = fib.FlashInferAttentionBackend(4, 2, 32, BLOCK, torch.bfloat16, torch.device("cuda"))
    assert_backend_writes_only_written_rows(backend, case, unwritten, 4e-2)
