"""Paged attention on CUDA with FlashInfer (written against flashinfer-python 0.7.x).

`plan()` (once per step) turns the `BatchLayout` into FlashInfer's CSR page table
(`build_paged_kv_table`, CPU-testable): `qo_indptr`, `paged_kv_indptr`, `paged_kv_indices`,
`paged_kv_last_page_len` — all int32, since int64 index arrays give silently wrong results —
and the append coordinates `get_batch_indices_positions` would give. It then plans the decode
wrapper when every sequence has one new token, else the prefill wrapper with `causal=True`.
`forward()` (once per layer) appends the layer's K/V with `append_paged_kv_cache` (only the
layout's `written_rows` when it names them: a recomputed cache hit's pages stay as they are;
the wrappers then read those tokens' cached K/V) and runs the planned wrapper.

Shared prefixes (cascade). When decode sequences' block tables start with the same physical
blocks (a radix tree's shared prefix, found by `shared_prefix_groups`), the step runs as two
levels merged with `flashinfer.merge_state_in_place`, as `MultiLevelCascadeAttentionWrapper`
does: a non-causal `BatchPrefillWithPagedKVCacheWrapper` over the shared pages with each
group's members as one multi-query request (the prefix K/V is read once per group), and the
usual decode/prefill wrapper over every sequence's own pages (members without the shared
ones). Unlike `MultiLevelCascadeAttentionWrapper`, which needs every query at every level,
sequences outside any group (and prefill chunks of a mixed step) simply have no prefix level.
Queries are permuted so that members come first, grouped; outputs are permuted back.

The cache is the `(k_cache, v_cache)` pair of `[num_blocks, block_size, num_kv_heads, head_dim]`
tensors ("NHD"). The package is imported lazily, so this module imports without it.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import NamedTuple

import torch

from model_service.attention.base import AttentionBackend, BatchLayout
from model_service.attention.indexing import segments, shared_prefix_groups

WORKSPACE_BYTES = 128 * 1024 * 1024
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# Group sizes FlashInfer's CUDA-core decode kernels are compiled for; others need tensor cores.
_CUDA_CORE_DECODE_GROUP_SIZES = (1, 2, 3, 4, 6, 8, 16)
_EMPTY_I32 = torch.empty(0, dtype=torch.int32)
# The cascade is planned when it spares at least this many prefix tokens of K/V reads per
# layer, sum over groups of (members - 1) * shared tokens (not measured on a GPU yet: the
# torch backend's CPU measurements put the break-even there; see bench/attention_bench.py).
CASCADE_MIN_SAVED_TOKENS = 1024


def import_flashinfer() -> ModuleType:
    """Import `flashinfer`, or raise ImportError saying how to install it."""
    try:
        import flashinfer
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the flashinfer attention backend needs the 'flashinfer-python' package "
            "(pip install 'radixkv[gpu]' or pip install flashinfer-python); "
            "use --attention torch otherwise"
        ) from exc
    return flashinfer


class PagedKVTable(NamedTuple):
    """A step in FlashInfer's CSR page-table format. Every array is int32 (int64 index arrays
    make FlashInfer's kernels read garbage without an error)."""

    qo_indptr: torch.Tensor  # [batch + 1] host, query tokens of sequence i: qo_indptr[i]:qo_indptr[i+1]
    kv_indptr: torch.Tensor  # [batch + 1] host, pages of sequence i: kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    kv_indices: torch.Tensor  # [total_pages] on block_tables' device, physical block ids in context order
    kv_last_page_len: torch.Tensor  # [batch] host, tokens in each sequence's last page, 1..page_size
    batch_indices: torch.Tensor  # [num_tokens] host, sequence of each new token
    positions: torch.Tensor  # [num_tokens] host, context position of each new token


def build_paged_kv_table(layout: BatchLayout, block_size: int) -> PagedKVTable:
    """Convert a `BatchLayout` to FlashInfer's page table (CSR) and append coordinates.

    `batch_indices`/`positions` are what `flashinfer.get_batch_indices_positions(qo_indptr,
    seq_lens, num_tokens)` returns (new tokens are the last ones of each context), computed
    here on the host from the layout's host lists: no device round trip, no Triton kernel.
    """
    query_lens, seq_lens = layout.query_lens_cpu, layout.seq_lens_cpu
    batch = len(seq_lens)
    if batch == 0 or len(query_lens) != batch:
        raise ValueError("a step needs at least one sequence and one query length per sequence")
    if any(q < 1 or q > s for q, s in zip(query_lens, seq_lens, strict=True)):
        raise ValueError("every sequence needs 1 <= query_len <= seq_len")
    qlens = torch.tensor(query_lens, dtype=torch.int32)  # [batch]
    slens = torch.tensor(seq_lens, dtype=torch.int32)  # [batch]
    num_pages = (slens + (block_size - 1)) // block_size  # [batch]
    qo_indptr = _indptr(qlens)
    kv_indptr = _indptr(num_pages)
    last_page_len = slens - (num_pages - 1) * block_size  # [batch], in 1..block_size

    # kv_indices: block_tables[i, :num_pages[i]] for every i, concatenated (gathered on the
    # tables' own device, so CUDA tables need no host copy).
    tables = layout.block_tables
    width = tables.shape[1]
    if int(num_pages.max()) > width:
        raise ValueError(f"a sequence needs {int(num_pages.max())} blocks, block_tables has {width}")
    page_seq, page_in_seq = segments(num_pages)  # [total_pages] each
    flat = (page_seq * width + page_in_seq).to(tables.device, non_blocking=True)
    kv_indices = tables.reshape(-1).index_select(0, flat).to(torch.int32).contiguous()

    token_seq, token_in_seq = segments(qlens)  # [num_tokens] each
    positions = (slens - qlens).long()[token_seq] + token_in_seq  # [num_tokens]
    return PagedKVTable(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                        kv_last_page_len=last_page_len.to(torch.int32),
                        batch_indices=token_seq.to(torch.int32), positions=positions.to(torch.int32))


class CascadePlan(NamedTuple):
    """A step's two-level plan: shared prefixes per group, then every sequence's own pages.

    Sequences are permuted: the members of group 0, of group 1, ..., then all others in batch
    order. Both levels' arrays are int32 in that order (host, but kv_indices on the tables'
    device). Members are decode sequences, so the first `num_members` permuted tokens are
    theirs, group by group.
    """

    seq_perm: torch.Tensor  # [batch] host int64, batch index of each permuted sequence
    token_perm: torch.Tensor  # [num_tokens] host int64, packed token of each permuted token
    token_inv: torch.Tensor  # [num_tokens] host int64, permuted position of each packed token
    num_members: int
    saved_tokens: int  # sum over groups of (members - 1) * shared tokens
    prefix: PagedKVTable  # one request per group (its members' queries), its shared pages
    rest: PagedKVTable  # one per sequence (permuted), members' pages after the shared ones


def plan_cascade(layout: BatchLayout, block_size: int, table: PagedKVTable,
                 min_saved_tokens: int = CASCADE_MIN_SAVED_TOKENS) -> CascadePlan | None:
    """The two-level plan of a step, or None when no decode sequences share prefix pages
    worth it. `table` is `build_paged_kv_table(layout, block_size)` (host work only but for
    one host copy of the block tables and the kv_indices gathers on their device)."""
    qlens = torch.tensor(layout.query_lens_cpu, dtype=torch.long)  # [batch]
    slens = torch.tensor(layout.seq_lens_cpu, dtype=torch.long)
    decode = torch.nonzero(qlens == 1).flatten()  # [num_decode]
    if decode.numel() < 2:
        return None
    tables = layout.block_tables
    num_pages = (slens + block_size - 1) // block_size  # [batch]
    host_tables = tables[:, :int(num_pages.max())].to("cpu", torch.long)
    # Shareable: full pages before the one this step's token is appended to.
    group, shared = shared_prefix_groups(host_tables[decode], (slens[decode] - 1) // block_size)
    if shared.numel() == 0:
        return None
    sizes = torch.bincount(group[group >= 0], minlength=shared.shape[0])  # [G]
    saved = int(((sizes - 1) * shared).sum()) * block_size
    if saved < min_saved_tokens:
        return None
    num_groups = int(shared.shape[0])
    grouped = torch.argsort(torch.where(group >= 0, group, num_groups), stable=True)[:int(sizes.sum())]
    members = decode[grouped]  # [num_members] batch index, by group
    is_member = torch.zeros(qlens.shape[0], dtype=torch.bool)
    is_member[members] = True
    seq_perm = torch.cat([members, torch.nonzero(~is_member).flatten()])  # [batch]
    skip = torch.zeros_like(slens)
    skip[members] = shared[group[grouped]]  # [batch] shared pages each sequence leaves to the prefix level

    rest_pages = (num_pages - skip)[seq_perm]  # [batch] >= 1: a member's last page is its own
    first = torch.cumsum(sizes, 0) - sizes
    leaders = members[first]  # [G] a member per group, whose first pages are the group's
    width = tables.shape[1]

    def gather_pages(rows: torch.Tensor, start: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        page_seq, page_in_seq = segments(count)  # [total] each
        flat = rows[page_seq] * width + start[page_seq] + page_in_seq
        return tables.reshape(-1).index_select(0, flat.to(tables.device, non_blocking=True)).to(torch.int32)

    qsl = torch.cumsum(qlens, 0) - qlens  # [batch] first packed token of each sequence
    tok_seq, tok_in_seq = segments(qlens[seq_perm])  # [num_tokens] each, permuted order
    token_perm = qsl[seq_perm][tok_seq] + tok_in_seq
    token_inv = torch.empty_like(token_perm)
    token_inv[token_perm] = torch.arange(token_perm.shape[0])
    rest = PagedKVTable(
        qo_indptr=_indptr(qlens[seq_perm]), kv_indptr=_indptr(rest_pages),
        kv_indices=gather_pages(seq_perm, skip[seq_perm], rest_pages).contiguous(),
        kv_last_page_len=table.kv_last_page_len[seq_perm].contiguous(),
        batch_indices=_EMPTY_I32, positions=_EMPTY_I32)
    prefix = PagedKVTable(
        qo_indptr=_indptr(sizes), kv_indptr=_indptr(shared),
        kv_indices=gather_pages(leaders, torch.zeros_like(shared), shared).contiguous(),
        kv_last_page_len=torch.full((num_groups,), block_size, dtype=torch.int32),
        batch_indices=_EMPTY_I32, positions=_EMPTY_I32)
    return CascadePlan(seq_perm=seq_perm, token_perm=token_perm, token_inv=token_inv,
                       num_members=int(members.shape[0]), saved_tokens=saved, prefix=prefix, rest=rest)


class FlashInferAttentionBackend(AttentionBackend):
    """FlashInfer paged prefill/decode wrappers over the shared NHD KV cache (CUDA only)."""

    name = "flashinfer"
    workspace_bytes = WORKSPACE_BYTES  # FlashInfer's recommended float workspace

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, sm_scale: float | None = None, *,
                 cascade: bool = True, cascade_min_saved_tokens: int = CASCADE_MIN_SAVED_TOKENS) -> None:
        """`sm_scale` is the softmax scale planned ahead (default 1/sqrt(head_dim)); a
        different `scale` passed to `forward()` re-plans once and becomes the new default.
        `cascade`: attend shared prefixes once per group (see the module doc) when that spares
        at least `cascade_min_saved_tokens` tokens of K/V reads per layer."""
        super().__init__(num_q_heads, num_kv_heads, head_dim, block_size, dtype, device)
        _require_cuda(device)
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"the flashinfer attention backend supports float16/bfloat16, got {dtype}")
        if num_q_heads % num_kv_heads != 0:
            raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self._fi = import_flashinfer()
        # One zeroed float workspace shared by the wrappers: they run one after another on one
        # stream (as MultiLevelCascadeAttentionWrapper's levels share theirs).
        self._workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=device)
        self._prefill = self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, kv_layout="NHD")
        # The cascade's prefix level: each group's members as one multi-query, non-causal request.
        self._shared_prefix = self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, kv_layout="NHD")
        self.cascade = cascade
        self.cascade_min_saved_tokens = cascade_min_saved_tokens
        self._cascade: CascadePlan | None = None
        self._token_perm = self._token_inv = _EMPTY_I32
        group_size = num_q_heads // num_kv_heads
        self._decode = self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, kv_layout="NHD",
            use_tensor_cores=group_size > 4 or group_size not in _CUDA_CORE_DECODE_GROUP_SIZES,
        )
        self._sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
        self._planned = False
        self._planned_scale: float | None = None
        self._use_decode = False
        self._num_tokens = 0
        # Set by plan(): host int32 CSR arrays for the wrappers' plan(), device int32 copies
        # for append_paged_kv_cache, and the per-token append coordinates.
        self._qo_indptr_host = self._kv_indptr_host = self._last_page_len_host = _EMPTY_I32
        self._kv_indices = self._kv_indptr = self._last_page_len = _EMPTY_I32
        self._batch_indices = self._positions = _EMPTY_I32
        # layout.written_rows on the device: the packed tokens appended (None: all of them).
        self._written: torch.Tensor | None = None

    def plan(self, layout: BatchLayout) -> None:
        """Build the int32 page table and append coordinates, then plan the wrapper."""
        table = build_paged_kv_table(layout, self.block_size)
        dev = self.device
        self._num_tokens = layout.num_tokens
        # Host int32 arrays for the wrappers' plan() (it reads them on the host anyway).
        self._qo_indptr_host = table.qo_indptr
        self._kv_indptr_host = table.kv_indptr
        self._last_page_len_host = table.kv_last_page_len
        # Device int32 arrays for append_paged_kv_cache and run().
        self._kv_indices = table.kv_indices.to(dev, non_blocking=True)
        self._kv_indptr = table.kv_indptr.to(dev, non_blocking=True)
        self._last_page_len = table.kv_last_page_len.to(dev, non_blocking=True)
        self._batch_indices = table.batch_indices.to(dev, non_blocking=True)
        self._positions = table.positions.to(dev, non_blocking=True)
        self._written = None
        if layout.written_rows is not None:  # recomputed cached tokens: their K/V is not appended again
            self._written = layout.written_rows.to(dev, torch.long)
            self._batch_indices = self._batch_indices.index_select(0, self._written)
            self._positions = self._positions.index_select(0, self._written)
        self._use_decode = layout.is_decode
        self._cascade = None
        if self.cascade:
            self._cascade = plan_cascade(layout, self.block_size, table, self.cascade_min_saved_tokens)
        if self._cascade is not None:
            self._token_perm = self._cascade.token_perm.to(dev, non_blocking=True)
            self._token_inv = self._cascade.token_inv.to(dev, non_blocking=True)
        self._plan_wrapper(self._sm_scale)
        self._planned = True

    def _plan_wrapper(self, scale: float) -> None:
        common = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=scale)
        heads = (self.num_q_heads, self.num_kv_heads, self.head_dim, self.block_size)
        # Without cascade the attention runs over the append table; with it, over the
        # permuted sequences' own pages (the shared ones go to the prefix level).
        attend = self._cascade.rest if self._cascade is not None else PagedKVTable(
            self._qo_indptr_host, self._kv_indptr_host, self._kv_indices, self._last_page_len_host,
            _EMPTY_I32, _EMPTY_I32)
        kv_indices = attend.kv_indices.to(self.device, non_blocking=True)
        if self._use_decode:
            self._decode.plan(attend.kv_indptr, kv_indices, attend.kv_last_page_len, *heads,
                              pos_encoding_mode="NONE", **common)
        else:
            self._prefill.plan(attend.qo_indptr, attend.kv_indptr, kv_indices, attend.kv_last_page_len, *heads,
                               causal=True, pos_encoding_mode="NONE", **common)
        if self._cascade is not None:
            pre = self._cascade.prefix
            self._shared_prefix.plan(pre.qo_indptr, pre.kv_indptr, pre.kv_indices.to(self.device, non_blocking=True),
                                     pre.kv_last_page_len, *heads, causal=False, pos_encoding_mode="NONE", **common)
        self._planned_scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """Append k/v into the paged cache and run the planned wrapper.

        q: [num_tokens, Hq, D]; k, v: [num_tokens, Hkv, D]; returns [num_tokens, Hq, D].
        """
        if not self._planned:
            raise RuntimeError("plan() must be called before forward()")
        if q.shape[0] != self._num_tokens:
            raise ValueError(f"q has {q.shape[0]} tokens, the plan has {self._num_tokens}")
        if self._written is not None:
            k, v = k.index_select(0, self._written), v.index_select(0, self._written)
        if k.shape[0]:
            self._fi.append_paged_kv_cache(
                _last_dim_contiguous(k), _last_dim_contiguous(v), self._batch_indices, self._positions,
                (k_cache, v_cache), self._kv_indices, self._kv_indptr, self._last_page_len, kv_layout="NHD",
            )
        if scale != self._planned_scale:
            # The scale is baked into the plan; models use one scale, so this happens once.
            self._sm_scale = scale
            self._plan_wrapper(scale)
        wrapper = self._decode if self._use_decode else self._prefill
        if self._cascade is None:
            return wrapper.run(_last_dim_contiguous(q), (k_cache, v_cache))
        # Cascade: own pages for every (permuted) sequence, the shared prefix once per group for
        # the members (the first num_members permuted tokens), merged by log-sum-exp in place.
        qp = q.index_select(0, self._token_perm)  # [num_tokens, Hq, D] contiguous
        out, lse = wrapper.run(qp, (k_cache, v_cache), return_lse=True)
        m = self._cascade.num_members
        o_pre, lse_pre = self._shared_prefix.run(qp[:m], (k_cache, v_cache), return_lse=True)
        self._fi.merge_state_in_place(out[:m], lse[:m], o_pre, lse_pre)
        return out.index_select(0, self._token_inv)


def _require_cuda(device: torch.device) -> None:
    if device.type != "cuda":
        raise ValueError(f"the flashinfer attention backend needs a CUDA device, got {device}")


def _indptr(lengths: torch.Tensor) -> torch.Tensor:
    """[n] lengths -> [n + 1] int32 exclusive prefix sums starting at 0."""
    out = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(lengths, 0)
    return out


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()
