"""Grammar-guided decoding: a matcher per request and the token masks of a batch.

`GrammarCompiler` holds the llguidance view of the model's tokenizer (built once, ~0.3 s for a
49k vocabulary) and checks each distinct grammar once (cached); `compile` gives a request its
`Guide` (an LLMatcher: ~0.5 ms). Each step, `TokenMasks.fill` computes the allowed next tokens of
every guided row into one int32 bitmask (llguidance's Rust code, the GIL released, so it can run
on another thread while the forward pass runs), and `TokenMasks.apply` sets the logits of the
tokens a row may not take to -inf before sampling: one vectorised op over the batch, never a
Python loop over the vocabulary. After sampling, `Guide.accept` advances the matcher; a guide
that `finished` (the grammar is complete and only end-of-sequence may follow) ends its request.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import llguidance
import llguidance.hf
import torch

from model_service.structured.spec import StructuredSpec, grammar_of


class Guide:
    """One request's matcher: what its output may continue with."""

    __slots__ = ("matcher", "vocab_size")

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size  # the width of the masks it fills

    def accept(self, token: int) -> bool:
        """Advance past `token` (the sampled one, which the mask allowed); False if the grammar
        rejects it (then the guide is finished: nothing valid can follow)."""
        return bool(self.matcher.consume_token(token))

    @property
    def finished(self) -> bool:
        """The grammar is complete (or failed): the request must end here."""
        return self.matcher.is_stopped() or self.matcher.is_error()

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""


class GrammarCompiler:
    """Guides for one tokenizer and vocabulary (`vocab_size`: the model's logits width)."""

    def __init__(self, hf_tokenizer: object, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                                      eos_token=list(eos_token_ids) or None)
        self._checked = functools.lru_cache(maxsize=512)(self._check)

    def _check(self, spec: StructuredSpec) -> str:
        grammar = grammar_of(spec)
        problem = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if problem:
            raise ValueError(f"the {spec.kind} does not compile: {problem.strip().splitlines()[0]}")
        return grammar

    def compile(self, spec: StructuredSpec) -> Guide:
        """A fresh guide for `spec`; ValueError with the grammar's error when it is not valid."""
        matcher = llguidance.LLMatcher(self.tokenizer, self._checked(spec))
        if matcher.is_error():
            raise ValueError(f"the {spec.kind} does not compile: {matcher.get_error()}")
        return Guide(matcher, self.vocab_size)


def _bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """`rows` contiguous int32 bitmask rows of `vocab_size` bits, every token allowed (as
    llguidance.torch allocates them; that module is not imported: it imports torch's compiler
    stack, a second of every replica's start-up, for a kernel this file does not use)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


class TokenMasks:
    """The bitmask of a batch's guided rows (kept between steps; grown on demand)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._bits = _bitmask(1, vocab_size)

    def fill(self, guides: Sequence[Guide]) -> torch.Tensor:
        """Row i of the result: the tokens guides[i] allows next (an int32 bitmask)."""
        if self._bits.shape[0] < len(guides):
            self._bits = _bitmask(len(guides), self.vocab_size)
        bits = self._bits[:len(guides)]
        row_bytes = bits.shape[1] * bits.element_size()
        for i, guide in enumerate(guides):  # a loop over guided rows (the work is in Rust)
            guide.matcher.unsafe_compute_mask_ptr(bits[i].data_ptr(), row_bytes)
        return bits

    @staticmethod
    def apply(logits: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor) -> None:
        """logits[rows[i]] keeps only what bits[i] allows (-inf elsewhere), in place."""
        if rows.numel() == 0:
            return
        # Eager tensor ops, not llguidance.torch's apply (a torch.compile kernel: its first call
        # compiles C++ for ~1.6 s on the engine thread, and needs a compiler on the machine).
        bits = bits.to(logits.device)
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((bits.unsqueeze(-1) >> shifts) & 1).view(bits.shape[0], -1)  # [rows, 32 * words]
        vocab = logits.shape[1]
        if allowed.shape[1] < vocab:  # tokens past the mask's words are never allowed
            allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
        picked = logits.index_select(0, rows)
        picked.masked_fill_(allowed[:, :vocab] == 0, float("-inf"))
        logits.index_copy_(0, rows, picked)
