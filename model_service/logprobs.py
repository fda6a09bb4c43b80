"""Log probabilities of generated tokens (SamplingParams.logprobs): the model's own distribution,
log_softmax of the raw logits, for the chosen token (with its rank) and the top-k alternatives.

`positions` works on the rows of a batch that asked for them, in one pass of tensor ops (no loop
over the vocabulary); `prompt_positions` on a prompt's scored rows (SamplingParams.prompt_logprobs),
in bounded slices; `TokenTexts` gives each token id's text and bytes as it decodes
alone, computed once per id and kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from model_service.model_runner import SequenceChunk
    from model_service.request import Request


class Position(NamedTuple):
    """One generated position: the chosen token's log probability and rank, and the top
    alternatives as (token id, log probability), most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


def positions(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[Position]:
    """Row i of `logits` [rows, vocab] (any float dtype: computed in float32) as the Position of
    its chosen token tokens[i], with its ks[i] most likely alternatives."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, dtype=torch.int64, device=logprobs.device).view(-1, 1))
    ranks = (logprobs > chosen).sum(dim=-1).add_(1).tolist()
    k = min(max(ks), logprobs.shape[-1])
    top = logprobs.topk(k, dim=-1) if k > 0 else None
    top_ids = top.indices.tolist() if top is not None else [[] for _ in tokens]
    top_values = top.values.tolist() if top is not None else [[] for _ in tokens]
    return [Position(t, lp, rank, list(zip(ids[:n], values[:n], strict=True)))
            for t, lp, rank, ids, values, n in zip(tokens, chosen.view(-1).tolist(), ranks, top_ids, top_values, ks,
                                                   strict=True)]


PROMPT_SLICE_ROWS = 256  # rows of a prompt's scores turned into positions at once (bounds the float32 copies)


def prompt_positions(scored: torch.Tensor, next_tokens: list[int], k: int) -> list[Position]:
    """A prompt's positions from its scored rows (`StepLogits.scored`): row i [rows, vocab] as the
    Position of next_tokens[i] (the prompt token after the row's own) with its k most likely
    alternatives, PROMPT_SLICE_ROWS rows at a time so that a long prompt's log_softmax and
    comparisons stay a bounded copy."""
    if scored.shape[0] != len(next_tokens):
        raise ValueError(f"{scored.shape[0]} scored rows for {len(next_tokens)} tokens")
    out: list[Position] = []
    for lo in range(0, len(next_tokens), PROMPT_SLICE_ROWS):
        hi = min(lo + PROMPT_SLICE_ROWS, len(next_tokens))
        out += positions(scored[lo:hi], next_tokens[lo:hi], [k] * (hi - lo))
    return out


def record_prompt_scores(requests: Sequence[Request], chunks: Sequence[SequenceChunk], scored: torch.Tensor) -> None:
    """Keeps the prompt positions a step scored (`StepLogits.scored`) in each request's
    prompt_positions, for its first output; positions scored before (a preempted request
    recomputing its prompt) are not scored twice."""
    offset = 0
    for request, chunk in zip(requests, chunks, strict=True):
        if not chunk.num_scored:
            continue
        rows = scored[offset:offset + chunk.num_scored]
        offset += chunk.num_scored
        first = max(chunk.start_position, request.num_scored_tokens)
        end = chunk.start_position + chunk.num_scored
        if end > first and request.prompt_logprobs is not None:
            request.prompt_positions += prompt_positions(
                rows[first - chunk.start_position:], request.prompt_token_ids[first + 1:end + 1],
                request.prompt_logprobs)
            request.num_scored_tokens = end


def take_prompt_logprobs(request: Request) -> list[Position] | None:
    """The prompt's positions for the first output of choice 0 of a request that asked for them
    (None otherwise): entry 0, which nothing precedes to score it with, has rank 0."""
    if request.prompt_logprobs is None or len(request.output_token_ids) != 1 or request.index:
        return None
    scored, request.prompt_positions = request.prompt_positions, []
    return [Position(request.prompt_token_ids[0], 0.0, 0, []), *scored]


class TokenTexts:
    """Token id -> (text, bytes), each as the token decodes alone (a piece of a multi-byte
    character decodes to U+FFFD; its bytes are exact where the tokenizer is byte-level)."""

    def __init__(self, tokenizer: object) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}
        self._byte_decoder = _byte_decoder(tokenizer)

    def get(self, token_id: int) -> tuple[str, bytes]:
        found = self._cache.get(token_id)
        if found is None:
            text = self._tokenizer.decode([token_id])  # type: ignore[attr-defined]
            raw = self._raw_bytes(token_id)
            found = (text, raw if raw is not None else text.encode())
            self._cache[token_id] = found
        return found

    def _raw_bytes(self, token_id: int) -> bytes | None:
        if self._byte_decoder is None:
            return None
        piece = self._tokenizer.convert_ids_to_tokens(token_id)  # type: ignore[attr-defined]
        if not isinstance(piece, str) or any(ch not in self._byte_decoder for ch in piece):
            return None  # a special or added token: its text is its bytes
        return bytes(self._byte_decoder[ch] for ch in piece)


def _byte_decoder(tokenizer: object) -> dict[str, int] | None:
    """GPT-2's byte-level alphabet (printable stand-ins for the 256 bytes), inverted, when the
    tokenizer is byte-level BPE; None otherwise."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    pre = getattr(backend, "pre_tokenizer", None)
    if pre is None or "ByteLevel" not in repr(pre):
        return None
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}
