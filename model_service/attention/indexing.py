"""Host-side index helpers shared by the attention backends' plan() (no Python loops)."""

from __future__ import annotations

import torch


def segments(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged segments -> (segment of each element, offset of each element in its segment).

    `lengths`: [n] int, zero allowed. Returns two int64 tensors of [lengths.sum()]. Same
    result as `repeat_interleave(arange(n), lengths)`, which is several times slower on CPU.
    """
    lengths = lengths.long()
    ends = torch.cumsum(lengths, 0)  # [n]
    total = int(ends[-1]) if ends.numel() else 0
    elems = torch.arange(total)
    seg = torch.searchsorted(ends, elems, right=True)  # [total]
    return seg, elems - (ends - lengths)[seg]
