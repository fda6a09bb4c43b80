"""Runs the transformers model over a packed batch, with our paged KV cache behind its attention.

The KV cache is ours: a function registered in transformers' `AttentionInterface` receives
q/k/v (RoPE applied) for the packed tokens of all sequences in the step, and hands them to the
attention backend together with this layer's K/V blocks. Every architecture transformers
implements with the functional attention interface (Llama, Qwen2, Mistral, ...) works unchanged.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import NamedTuple

import torch
from transformers import AttentionInterface, PreTrainedModel

from model_service.attention.base import AttentionBackend, BatchLayout
from model_service.attention.indexing import segments
from model_service.decoder_forward import DecoderForward, supports
from model_service.kv_cache import KVCache
from model_service.linear import plan_model, probe_memo

ATTENTION_NAME = "radixkv_paged"
_CONTEXT_KWARG = "radixkv_context"


class SequenceChunk(NamedTuple):
    """The tokens one sequence computes in this step.

    A prompt whose own log probabilities are wanted (SamplingParams.prompt_logprobs) runs every
    token through the model, its cache hit too: `num_cached` says how many leading tokens' K/V
    is already at their slots (pages other requests may read: computed, never rewritten), and
    `num_scored` how many leading rows' logits come back in `StepLogits.scored`.
    """

    token_ids: list[int]  # this step's tokens; KV is written for each but the first num_cached
    start_position: int  # context position of token_ids[0]
    block_table: list[int]  # covers at least start_position + len(token_ids) tokens
    needs_logits: bool  # True when the last token's logits are sampled this step
    num_cached: int = 0  # leading tokens whose K/V is already in the cache: not written
    num_scored: int = 0  # leading tokens whose logits are returned; row q scores token_ids[q + 1]


class StepLogits(NamedTuple):
    """What one step computed: the rows to sample and the prompt rows scored."""

    sampled: torch.Tensor  # [chunks with needs_logits, vocab] in chunk order, the model's dtype
    # [sum of num_scored, vocab] float32, chunk order then row order; None when no chunk scores.
    scored: torch.Tensor | None


@dataclass(slots=True)
class _ForwardContext:
    backend: AttentionBackend
    kv_cache: KVCache


def _paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function: query [1, Hq, T, D], key/value [1, Hkv, T, D] -> [1, T, Hq, D]."""
    context: _ForwardContext = kwargs[_CONTEXT_KWARG]
    layer = module.layer_idx
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = context.backend.forward(
        query[0].transpose(0, 1),  # [T, Hq, D]
        key[0].transpose(0, 1),  # [T, Hkv, D]
        value[0].transpose(0, 1),
        context.kv_cache.k[layer],
        context.kv_cache.v[layer],
        scale,
    )
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, _paged_attention)


class ModelRunner:
    """Executes one scheduler step: packs chunks, plans attention once, runs all layers."""

    def __init__(self, model: PreTrainedModel, kv_cache: KVCache, backend: AttentionBackend,
                 device: torch.device, fp32_gemm: str = "mkl", linear_kernels: str = "auto",
                 linear_mode: str = "auto") -> None:
        """fp32_gemm: "mkl" (F.linear, float32 output bitwise transformers') or "onednn"
        (weights packed for oneDNN: faster on some CPUs, not bitwise; see linear/packed.py).
        linear_kernels: with "mkl", "auto" computes float32 products of 2+ rows with radixkv's
        AVX-512 kernel where it is bitwise F.linear (linear/blocked.py), "torch" never.
        linear_mode: "exact" refuses every path not verified bit-identical to F.linear for its
        shape, "fast" takes them and says so in the plan; "auto": exact for float32 with "mkl".
        The plan of every product is `self.linears` (linear/planner.py)."""
        self.model = model
        with probe_memo.kept():
            self.linears = plan_model(model, mode=linear_mode, fp32_gemm=fp32_gemm, linear_kernels=linear_kernels)
        self.model.set_attn_implementation(ATTENTION_NAME)
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        self._context = _ForwardContext(backend, kv_cache)
        # Llama-family models run on our own flat forward (bitwise the same, less overhead).
        self.decoder = DecoderForward(model, backend, kv_cache) if supports(model) else None

    def build_layout(self, chunks: list[SequenceChunk]) -> tuple[BatchLayout, torch.Tensor]:
        """Index tensors for the step and the positions [num_tokens] of its tokens; vectorised over tokens."""
        block_size = self.kv_cache.block_size
        query_lens = [len(c.token_ids) for c in chunks]
        seq_lens = [c.start_position + n for c, n in zip(chunks, query_lens, strict=True)]
        max_blocks = max(len(c.block_table) for c in chunks)
        tables = [c.block_table + [0] * (max_blocks - len(c.block_table)) for c in chunks]
        block_tables = torch.tensor(tables, dtype=torch.int32)  # [batch, max_blocks]
        query_lens_t = torch.tensor(query_lens, dtype=torch.int64)
        query_start_loc = torch.zeros(len(chunks) + 1, dtype=torch.int64)
        torch.cumsum(query_lens_t, 0, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        seq_index, _ = segments(query_lens_t)  # [num_tokens] chunk of each token
        starts = torch.tensor([c.start_position for c in chunks], dtype=torch.int64)
        positions = torch.arange(num_tokens) - query_start_loc[:-1][seq_index] + starts[seq_index]
        slot_mapping = block_tables[seq_index, positions // block_size].to(torch.int64) * block_size \
            + positions % block_size
        written_rows = None
        if any(c.num_cached for c in chunks):
            written_rows = _written_rows(chunks, query_lens_t, seq_index, positions - starts[seq_index])
        return BatchLayout(
            query_start_loc=query_start_loc.to(torch.int32).to(self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            block_tables=block_tables.to(self.device),
            slot_mapping=slot_mapping.to(self.device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            written_rows=None if written_rows is None else written_rows.to(self.device),
        ), positions

    @torch.inference_mode()
    def execute(self, chunks: list[SequenceChunk]) -> StepLogits:
        """Runs the model. `sampled`: logits [num chunks needing logits, vocab] in chunk order, in
        the model's dtype (the sampler upcasts the rows it samples; greedy argmax needs no copy);
        `scored`: the float32 logits of every chunk's first num_scored rows, None when none scores."""
        layout, positions = self.build_layout(chunks)
        self.backend.plan(layout)
        input_ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.int64, device=self.device)
        last_index = layout.query_start_loc[1:].to(torch.int64) - 1
        keep = torch.tensor([c.needs_logits for c in chunks], device=self.device)
        scored_index = None
        if any(c.num_scored for c in chunks):
            scored_index = _scored_rows(chunks, layout.query_lens_cpu).to(self.device)
        # One token on CPU: one intra-op thread, large matrix-vector products split across cores.
        single = layout.num_tokens == 1 and self.device.type == "cpu"
        with self.linears.single_token_step() if single else contextlib.nullcontext():
            if self.decoder is not None:
                sampled, scored = self.decoder.forward(input_ids, positions.to(self.device), last_index[keep],
                                                       scored_index)
                return StepLogits(sampled, scored)
            logits_index = last_index[keep]
            # One head call over both rows: the model applies its own head (and whatever follows it).
            # The sampled rows may then differ in the last bits from a step without scores.
            if scored_index is not None:
                logits_index = torch.cat([logits_index, scored_index])
            output = self.model(
                input_ids=input_ids.unsqueeze(0),  # [1, num_tokens]
                position_ids=positions.to(self.device).unsqueeze(0),  # [1, num_tokens]
                use_cache=False,
                logits_to_keep=logits_index,
                **{_CONTEXT_KWARG: self._context},
            )
        logits = output.logits[0]  # [num_logits (+ num_scored), vocab]
        if scored_index is None:
            return StepLogits(logits, None)
        num_sampled = logits.shape[0] - scored_index.shape[0]
        return StepLogits(logits[:num_sampled], logits[num_sampled:].float())


def _written_rows(chunks: list[SequenceChunk], query_lens: torch.Tensor, seq_index: torch.Tensor,
                  offsets: torch.Tensor) -> torch.Tensor:
    """Packed rows whose K/V is written: all but each chunk's first num_cached. offsets [num_tokens]:
    each token's index within its chunk. Raises ValueError for a num_cached out of range."""
    cached = torch.tensor([c.num_cached for c in chunks], dtype=torch.int64)  # [batch]
    if bool(((cached < 0) | (cached > query_lens)).any()):
        raise ValueError("every chunk needs 0 <= num_cached <= len(token_ids)")
    return torch.nonzero(offsets >= cached[seq_index]).flatten()  # [num_written] int64


def _scored_rows(chunks: list[SequenceChunk], query_lens: list[int]) -> torch.Tensor:
    """Packed rows whose logits are scored: each chunk's first num_scored, in order. [sum] int64."""
    scored = torch.tensor([c.num_scored for c in chunks], dtype=torch.int64)  # [batch]
    lens = torch.tensor(query_lens, dtype=torch.int64)
    if bool(((scored < 0) | (scored > lens)).any()):
        raise ValueError("every chunk needs 0 <= num_scored <= len(token_ids)")
    starts = torch.cumsum(lens, 0) - lens  # [batch] first packed row of each chunk
    seq, _ = segments(scored)  # [num_scored] chunk of each row
    first = torch.cumsum(scored, 0) - scored  # [batch] first scored row of each chunk, among scored rows
    return starts[seq] + torch.arange(int(scored.sum())) - first[seq]
