"""Host-side index helpers shared by the attention backends' plan() (no Python loops)."""

from __future__ import annotations

import torch


def segments(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged segments -> (segment of each element, offset of each element in its segment).

    `lengths`: [n] int, zero allowed. Returns two int64 tensors of [lengths.sum()], on lengths'
    device. Same result as `repeat_interleave(arange(n), lengths)`, which on CPU opens a parallel
    region for any size: with two threads it waits for the other thread to wake (a millisecond
    or more per call while anything else runs, microseconds here).
    """
    lengths = lengths.long()
    ends = torch.cumsum(lengths, 0)  # [n]
    total = int(ends[-1]) if ends.numel() else 0
    elems = torch.arange(total, device=lengths.device)
    seg = torch.searchsorted(ends, elems, right=True)  # [total]
    return seg, elems - (ends - lengths)[seg]


def shared_prefix_groups(tables: torch.Tensor, num_shareable: torch.Tensor,
                         min_shared: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Group sequences whose block tables start with the same physical blocks (host tensors).

    `tables`: [n, width] block ids (>= 0); `num_shareable`: [n] how many leading blocks of each
    row may be shared (e.g. full blocks before the one a decode token is written to). A radix
    tree shares a prefix by handing out the same physical ids, so equal leading ids mean equal
    K/V. Returns `(group [n] int64, shared [num_groups] int64)`: each sequence's group (-1:
    none) and the leading blocks common to all members of each group. Every group has >= 2
    members and shares >= `min_shared` blocks.

    Rows are sorted lexicographically (over their shareable part), so any set of sequences
    sharing a prefix is a contiguous run whose common prefix is the minimum of the neighbours'
    common prefixes. The partition is the one a single cutoff gives (join neighbours sharing
    >= c blocks), with c chosen to maximise the blocks not re-read, sum (size - 1) * shared:
    4 groups x 8 sharing 64 blocks below a 4-block system prompt common to all 32 become the
    4 groups, not one group sharing 4 blocks.
    """
    n, width = tables.shape
    none = (torch.full((n,), -1, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    shareable = num_shareable.long().clamp(0, width)
    if n < 2 or int(shareable.max()) < max(min_shared, 1):
        return none
    width = int(shareable.max())
    keyed = torch.where(torch.arange(width)[None, :] < shareable[:, None], tables[:, :width].long(), -1)
    _, rank = torch.unique(keyed, dim=0, return_inverse=True)  # lexicographic rank of each row
    order = torch.argsort(rank, stable=True)  # [n]
    rows = keyed[order]
    same = (rows[1:] == rows[:-1]) & (rows[1:] >= 0)  # [n - 1, width], -1 marks unshareable
    common = same.long().cumprod(1).sum(1)  # [n - 1] leading blocks shared by neighbours k, k + 1
    cutoffs = torch.unique(common[common >= min_shared])  # [C]
    if cutoffs.numel() == 0:
        return none
    joined = common[None, :] >= cutoffs[:, None]  # [C, n - 1]
    starts = joined.clone()
    starts[:, 1:] &= ~joined[:, :-1]
    run = torch.cumsum(starts.long(), 1) - 1  # [C, n - 1] run (group) of each joined pair
    num_c = cutoffs.numel()
    slot = (torch.arange(num_c)[:, None] * n + run)[joined]  # run ids are < n per cutoff
    big = torch.iinfo(torch.long).max
    run_min = torch.full((num_c * n,), big).scatter_reduce(0, slot, common.expand(num_c, -1)[joined], "amin")
    run_pairs = torch.zeros(num_c * n, dtype=torch.long).scatter_add_(0, slot, torch.ones_like(slot))
    saved = (torch.where(run_pairs > 0, run_min, 0) * run_pairs).view(num_c, n).sum(1)  # [C]
    best = int(torch.argmax(saved))
    on, run_best = joined[best], run[best]  # [n - 1]
    sorted_group = torch.full((n,), -1, dtype=torch.long)
    sorted_group[:-1][on] = run_best[on]
    sorted_group[1:][on] = run_best[on]
    num_groups = int(run_best[on].max()) + 1
    group = torch.empty(n, dtype=torch.long)
    group[order] = sorted_group
    return group, run_min.view(num_c, n)[best, :num_groups].clone()
