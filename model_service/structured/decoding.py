"""The engine's side of structured outputs: each step, the token masks of the guided rows are
computed on a worker thread while the forward pass runs (`start`), applied to the logits before
the sampling controls (`apply`), and the guides advance by the sampled tokens (`advance`)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from model_service.structured.guide import Guide, TokenMasks


class Guided(Protocol):
    guide: Guide | None


class GuidedDecoding:
    """Masks for the guided rows of each batch (one engine; its methods run on the engine thread)."""

    def __init__(self) -> None:
        self._masks: TokenMasks | None = None  # made for the first guided row's vocabulary
        self._worker: ThreadPoolExecutor | None = None

    def start(self, rows: Sequence[Guided]) -> Future[torch.Tensor] | None:
        """Begin computing the masks of `rows`' guided requests (None: no row is guided)."""
        guides = [r.guide for r in rows if r.guide is not None]
        if not guides:
            return None
        if self._masks is None or self._worker is None:
            self._masks = TokenMasks(guides[0].vocab_size)
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="radixkv-grammar")
        return self._worker.submit(self._masks.fill, guides)

    @staticmethod
    def apply(logits: torch.Tensor, rows: Sequence[Guided], masks: Future[torch.Tensor] | None) -> None:
        """Only what each guided row's grammar allows keeps a finite logit (in place)."""
        if masks is None:
            return
        index = torch.tensor([i for i, r in enumerate(rows) if r.guide is not None], dtype=torch.long,
                             device=logits.device)
        TokenMasks.apply(logits, index, masks.result())

    @staticmethod
    def advance(rows: Sequence[Guided], tokens: Sequence[int]) -> list[bool]:
        """Each guided row takes its token; True where its grammar is now complete (or broken)."""
        done = []
        for row, token in zip(rows, tokens, strict=True):
            guide = row.guide
            done.append(guide is not None and (not guide.accept(token) or guide.finished))
        return done

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=False)
