"""Logits processors for a batch of requests: logit_bias, repetition / presence / frequency
penalties and min_tokens, applied to the logits before the sampler picks (model_service/sampler.py).

Semantics (`radixkv.v1.SamplingParams`), in this order:

1. `logit_bias`: each listed token's logit plus its bias (OpenAI).
2. `repetition_penalty` p (transformers' RepetitionPenaltyLogitsProcessor, CTRL): the logit x of
   every token that occurs in the prompt or among the generated tokens becomes x / p when x > 0,
   x * p otherwise.
3. `presence_penalty` and `frequency_penalty` (OpenAI, over the generated tokens only):
   x - presence * (count > 0) - frequency * count.
4. `min_tokens`: while fewer tokens than that were generated, the request's end tokens (the
   model's end-of-sequence tokens unless `ignore_eos`, and its `stop_token_ids`) are -inf.

Every step costs tensor ops over the batch, never a Python loop over tokens or the vocabulary.
Only requests that use a processor pay anything; a batch without any gets its logits back
untouched (so greedy rows keep the plain argmax fast path).

State: the penalties need the counts of the generated tokens and the set of tokens seen (prompt
and generated). They live in `PenaltyTable`: one row per request that uses a penalty, handed out
at its first sampled step (built from its tokens so far with one scatter each), updated with one
scatter for the whole batch after every step, and given back when the request finishes. A step
finds the seen tokens of its penalty rows (one pass over their bool rows) and processes only
those logits, so its cost grows with the tokens seen, not with the vocabulary times the rows. A preempted request
keeps its row while it waits (its generated tokens, which are what count, do not change); when
the table is full, rows of requests that are not running are reclaimed and rebuilt from their
tokens if they come back, so the table never needs more rows than the scheduler runs at once.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from model_service.attention.indexing import segments
from model_service.request import Request, RequestStatus

__all__ = ["LogitsProcessors", "PenaltyTable", "ProcessorState"]

_FIRST_ROWS = 4  # penalty rows allocated at first use (then doubled up to max_num_seqs)


@dataclass(slots=True)
class ProcessorState:
    """What one request's processors keep between steps (on `Request.processors`), built at its
    first sampled step: its logit_bias and end tokens as device tensors, and its penalty row."""

    bias_ids: torch.Tensor | None  # int64 [n] (None: no logit_bias)
    bias_values: torch.Tensor | None  # float32 [n]
    end_ids: torch.Tensor | None  # int64 [m]: the tokens min_tokens holds back (None: min_tokens off)
    slot: int = -1  # its row of the PenaltyTable (-1: none)
    counted: int = 0  # generated tokens its row counts (checked against the request every step)


class PenaltyTable:
    """Token counts of the generated tokens ([rows, vocab] int32) and the tokens seen, in the
    prompt or generated ([rows, vocab] bool), of the requests that use penalties, one row each.
    Allocated at the first request that needs a row and doubled as needed up to `capacity` rows
    (the scheduler's max_num_seqs); beyond that only if every holder is running."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.counts: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None
        self._owners: list[Request | None] = []
        self._free: list[int] = []

    @property
    def num_used(self) -> int:
        return len(self._owners) - len(self._free)

    def assign(self, request: Request, state: ProcessorState, vocab: int, device: torch.device) -> None:
        """Gives `request` a row holding its prompt tokens and the counts of its generated tokens."""
        if self.counts is None:
            self.counts = torch.zeros(0, vocab, dtype=torch.int32, device=device)
            self.seen = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        if not self._free:
            rows = len(self._owners)
            if rows < self.capacity:
                self._grow(min(max(2 * rows, _FIRST_ROWS), self.capacity) - rows)
            else:
                self._reclaim()
        slot = self._free.pop()
        self._owners[slot] = request
        state.slot = slot
        self.rebuild(request, state)

    def rebuild(self, request: Request, state: ProcessorState) -> None:
        """Rebuilds `request`'s row from its tokens (one scatter each for prompt and output)."""
        assert self.counts is not None and self.seen is not None
        counts, seen = self.counts[state.slot], self.seen[state.slot]
        counts.zero_()
        seen.zero_()
        seen.index_fill_(0, torch.tensor(request.prompt_token_ids, dtype=torch.long, device=seen.device), True)
        if request.output_token_ids:
            out = torch.tensor(request.output_token_ids, dtype=torch.long, device=counts.device)
            counts.index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
            seen.index_fill_(0, out, True)
        state.counted = len(request.output_token_ids)

    def release(self, request: Request, state: ProcessorState) -> None:
        """Gives the request's row back (no-op without one)."""
        if state.slot >= 0 and self._owners[state.slot] is request:
            self._owners[state.slot] = None
            self._free.append(state.slot)
        state.slot = -1

    def _reclaim(self) -> None:
        """Frees the rows of requests that are not running (preempted ones waiting to be
        recomputed; they get a fresh row when they next sample); doubles the table when every
        holder runs (only if the scheduler ran more requests than `capacity`)."""
        for slot, owner in enumerate(self._owners):
            if owner is not None and owner.status is not RequestStatus.RUNNING:
                state = owner.processors
                if state is not None:
                    state.slot = -1
                self._owners[slot] = None
                self._free.append(slot)
        if not self._free:
            self._grow(len(self._owners))

    def _grow(self, more: int) -> None:
        assert self.counts is not None and self.seen is not None
        rows = len(self._owners)
        self.counts = torch.cat([self.counts, self.counts.new_zeros(more, self.counts.shape[1])])
        self.seen = torch.cat([self.seen, self.seen.new_zeros(more, self.seen.shape[1])])
        self._owners.extend([None] * more)
        self._free.extend(range(rows + more - 1, rows - 1, -1))


class LogitsProcessors:
    """Applies the requests' logits processors to a logits batch and keeps their state. Used by
    the engine thread only: `apply` before sampling, `record` with the sampled tokens, `release`
    when a request finishes."""

    def __init__(self, eos_token_ids: Collection[int], capacity: int) -> None:
        """`eos_token_ids`: the model's end-of-sequence tokens (min_tokens holds them back unless
        the request ignores eos); `capacity`: penalty rows to allocate (the scheduler's max_num_seqs)."""
        self.eos_token_ids = sorted(eos_token_ids)
        self.table = PenaltyTable(capacity)

    # Inference mode: the model runner's logits are inference tensors, which may be updated in
    # place only inside it (and the table, created inside it, stays usable only there too).
    @torch.inference_mode()
    def apply(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """Returns the logits with row i processed for `requests[i]`. Without any processor in the
        batch, `logits` itself (untouched); otherwise a float32 tensor (`logits` itself, modified
        in place, when it already is float32) whose rows without processors are unchanged."""
        if not any(r.sampling.uses_processors for r in requests):
            return logits
        logits = logits.float()
        vocab, device = logits.shape[1], logits.device
        bias_rows: list[int] = []
        bias_ids: list[torch.Tensor] = []
        bias_values: list[torch.Tensor] = []
        penalty_rows: list[int] = []
        slots: list[int] = []
        end_rows: list[int] = []
        end_ids: list[torch.Tensor] = []
        for i, request in enumerate(requests):
            options = request.sampling
            if not options.uses_processors:
                continue
            state = request.processors
            if state is None:
                state = request.processors = self._new_state(request, device)
            if state.bias_ids is not None:
                bias_rows.append(i)
                bias_ids.append(state.bias_ids)
                bias_values.append(state.bias_values)
            if options.uses_penalties:
                if state.slot < 0:
                    self.table.assign(request, state, vocab, device)
                elif state.counted != len(request.output_token_ids):  # tokens changed behind our back
                    self.table.rebuild(request, state)
                penalty_rows.append(i)
                slots.append(state.slot)
            if state.end_ids is not None and len(request.output_token_ids) < options.min_tokens:
                end_rows.append(i)
                end_ids.append(state.end_ids)

        if bias_rows:  # 1. logit_bias: one scatter for every biased row
            rows = _repeat_rows(bias_rows, bias_ids, device)
            logits.index_put_((rows, torch.cat(bias_ids)), torch.cat(bias_values), accumulate=True)
        if penalty_rows:  # 2. and 3.: the seen tokens of every penalty row, processed together
            self._penalize(logits, penalty_rows, slots, [requests[i].sampling for i in penalty_rows])
        if end_rows:  # 4. min_tokens: the end tokens of rows still short of it
            rows = _repeat_rows(end_rows, end_ids, device)
            logits.index_put_((rows, torch.cat(end_ids)), torch.tensor(-math.inf, device=device))
        return logits

    def _penalize(self, logits: torch.Tensor, rows: list[int], slots: list[int], options: list) -> None:
        """Repetition, then presence / frequency penalties, on the seen tokens of the penalty rows
        only (every other logit is left as it is by both rules)."""
        table = self.table
        assert table.counts is not None and table.seen is not None
        device = logits.device
        slot_index = torch.tensor(slots, dtype=torch.long, device=device)
        row_pos, token = table.seen.index_select(0, slot_index).nonzero(as_tuple=True)
        batch_row = torch.tensor(rows, dtype=torch.long, device=device).index_select(0, row_pos)
        scores = logits[batch_row, token]
        repetition = [o.repetition_penalty for o in options]
        if any(p != 1.0 for p in repetition):
            penalty = torch.tensor(repetition, dtype=torch.float32, device=device).index_select(0, row_pos)
            # As transformers: x * p where x < 0, x / p otherwise (rows with p == 1 stay exact).
            scores = torch.where(scores < 0, scores * penalty, scores / penalty)
        presence = [o.presence_penalty for o in options]
        frequency = [o.frequency_penalty for o in options]
        if any(f != 0.0 for f in presence + frequency):
            counts = table.counts[slot_index.index_select(0, row_pos), token]  # 0 for prompt-only tokens
            if any(f != 0.0 for f in frequency):
                scores = scores - torch.tensor(frequency, dtype=torch.float32, device=device)[row_pos] * counts
            if any(p != 0.0 for p in presence):
                scores = scores - torch.tensor(presence, dtype=torch.float32, device=device)[row_pos] * (counts > 0)
        logits.index_put_((batch_row, token), scores)

    @torch.inference_mode()
    def record(self, requests: Sequence[Request], tokens: torch.Tensor) -> None:
        """Counts the tokens just sampled (`tokens[i]` for `requests[i]`, before they are appended
        to the requests) in the penalty rows: one scatter for the batch."""
        slots: list[int] = []
        rows: list[int] = []
        for i, request in enumerate(requests):
            state = request.processors
            if state is not None and state.slot >= 0:
                slots.append(state.slot)
                rows.append(i)
                state.counted += 1
        if not slots:
            return
        counts = self.table.counts
        assert counts is not None
        device = counts.device
        picked = tokens.to(device).index_select(0, torch.tensor(rows, dtype=torch.long, device=device))
        slot_index = torch.tensor(slots, dtype=torch.long, device=device)
        counts.index_put_((slot_index, picked), torch.ones_like(picked, dtype=torch.int32), accumulate=True)
        assert self.table.seen is not None
        self.table.seen.index_put_((slot_index, picked), torch.tensor(True, device=device))

    def release(self, request: Request) -> None:
        """Forgets a finished request's state (its penalty row goes back to the table)."""
        state = request.processors
        if state is not None:
            self.table.release(request, state)
            request.processors = None

    def _new_state(self, request: Request, device: torch.device) -> ProcessorState:
        options = request.sampling
        bias_ids = bias_values = end_ids = None
        if options.logit_bias:
            bias_ids = torch.tensor(list(options.logit_bias), dtype=torch.long, device=device)
            bias_values = torch.tensor(list(options.logit_bias.values()), dtype=torch.float32, device=device)
        if options.min_tokens > 0:
            ends = set(request.stop_token_ids)
            if not request.ignore_eos:
                ends.update(self.eos_token_ids)
            if ends:
                end_ids = torch.tensor(sorted(ends), dtype=torch.long, device=device)
        return ProcessorState(bias_ids, bias_values, end_ids)


def _repeat_rows(rows: list[int], per_row: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The row index of every entry of `torch.cat(per_row)`: rows[j] repeated len(per_row[j]) times."""
    lengths = torch.tensor([len(t) for t in per_row], dtype=torch.long, device=device)
    return torch.tensor(rows, dtype=torch.long, device=device)[segments(lengths)[0]]
