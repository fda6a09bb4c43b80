"""Paged attention on CUDA with FlashInfer (written against flashinfer-python 0.7.x).

`plan()` (once per step) turns the `BatchLayout` into FlashInfer's CSR page table
(`build_paged_kv_table`, CPU-testable): `qo_indptr`, `paged_kv_indptr`, `paged_kv_indices`,
`paged_kv_last_page_len` — all int32, since int64 index arrays give silently wrong results —
and the append coordinates `get_batch_indices_positions` would give. It then plans the decode
wrapper when every sequence has one new token, else the prefill wrapper with `causal=True`.
`forward()` (once per layer) appends the layer's K/V with `append_paged_kv_cache` and runs
the planned wrapper.

The cache is the `(k_cache, v_cache)` pair of `[num_blocks, block_size, num_kv_heads, head_dim]`
tensors ("NHD"). The package is imported lazily, so this module imports without it.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import NamedTuple

import torch

from model_service.attention.base import AttentionBackend, BatchLayout
from model_service.attention.indexing import segments

WORKSPACE_BYTES = 128 * 1024 * 1024
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# Group sizes FlashInfer's CUDA-core decode kernels are compiled for; others need tensor cores.
_CUDA_CORE_DECODE_GROUP_SIZES = (1, 2, 3, 4, 6, 8, 16)
_EMPTY_I32 = torch.empty(0, dtype=torch.int32)


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


class FlashInferAttentionBackend(AttentionBackend):
    """FlashInfer paged prefill/decode wrappers over the shared NHD KV cache (CUDA only)."""

    name = "flashinfer"
    workspace_bytes = WORKSPACE_BYTES  # FlashInfer's recommended float workspace

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, sm_scale: float | None = None) -> None:
        """`sm_scale` is the softmax scale planned ahead (default 1/sqrt(head_dim)); a
        different `scale` passed to `forward()` re-plans once and becomes the new default."""
        super().__init__(num_q_heads, num_kv_heads, head_dim, block_size, dtype, device)
        _require_cuda(device)
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"the flashinfer attention backend supports float16/bfloat16, got {dtype}")
        if num_q_heads % num_kv_heads != 0:
            raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self._fi = import_flashinfer()
        # One zeroed workspace shared by both wrappers: only one of them runs in a step.
        self._workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=device)
        self._prefill = self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, kv_layout="NHD")
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
        self._use_decode = layout.is_decode
        self._plan_wrapper(self._sm_scale)
        self._planned = True

    def _plan_wrapper(self, scale: float) -> None:
        common = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=scale)
        if self._use_decode:
            self._decode.plan(
                self._kv_indptr_host, self._kv_indices, self._last_page_len_host,
                self.num_q_heads, self.num_kv_heads, self.head_dim, self.block_size,
                pos_encoding_mode="NONE", **common,
            )
        else:
            self._prefill.plan(
                self._qo_indptr_host, self._kv_indptr_host, self._kv_indices, self._last_page_len_host,
                self.num_q_heads, self.num_kv_heads, self.head_dim, self.block_size,
                causal=True, pos_encoding_mode="NONE", **common,
            )
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
        self._fi.append_paged_kv_cache(
            _last_dim_contiguous(k), _last_dim_contiguous(v), self._batch_indices, self._positions,
            (k_cache, v_cache), self._kv_indices, self._kv_indptr, self._last_page_len, kv_layout="NHD",
        )
        if scale != self._planned_scale:
            # The scale is baked into the plan; models use one scale, so this happens once.
            self._sm_scale = scale
            self._plan_wrapper(scale)
        wrapper = self._decode if self._use_decode else self._prefill
        return wrapper.run(_last_dim_contiguous(q), (k_cache, v_cache))


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
