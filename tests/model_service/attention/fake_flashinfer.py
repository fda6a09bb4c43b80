"""A strict CPU stand-in for the parts of flashinfer-python 0.7.x the backend calls.

Signatures follow flashinfer 0.7.2 (`BatchPrefillWithPagedKVCacheWrapper.plan/run`,
`BatchDecodeWithPagedKVCacheWrapper.plan/run` with `return_lse`, `append_paged_kv_cache`,
`merge_state_in_place`; log-sum-exps are base 2, as FlashInfer's are); the semantics are
the documented ones, computed naively per sequence. It checks what the real kernels silently
get wrong: int32 index arrays, `1 <= last_page_len <= page_size`, the planned dtypes, the
NHD layout, positional arguments the 0.7 decode plan() deprecates. It lets the backend's
plan/forward wiring run without a GPU; it says nothing about the real kernels.
"""

from __future__ import annotations

import math

import torch

calls: list[str] = []  # names of the calls made, for assertions on the call pattern


def _check_int32(**arrays: torch.Tensor) -> None:
    for name, arr in arrays.items():
        assert arr.dtype == torch.int32, f"{name} must be int32, got {arr.dtype}"
        assert arr.dim() == 1, f"{name} must be 1-D"


def _check_table(indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
                 page_size: int) -> None:
    _check_int32(indptr=indptr, indices=indices, last_page_len=last_page_len)
    assert indptr.shape[0] == last_page_len.shape[0] + 1
    assert int(indptr[0]) == 0 and int(indptr[-1]) == indices.shape[0]
    assert bool(((last_page_len >= 1) & (last_page_len <= page_size)).all()), "1 <= last_page_len <= page_size"


def _context(cache: torch.Tensor, pages: torch.Tensor, kv_len: int) -> torch.Tensor:
    """[kv_len, Hkv, D] of one sequence from an NHD cache [num_pages, page_size, Hkv, D]."""
    return cache[pages.long()].reshape(-1, cache.shape[2], cache.shape[3])[:kv_len]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q [ql, Hq, D], k/v [kv, Hkv, D] -> ([ql, Hq, D], base-2 lse [ql, Hq] float32),
    bottom-right aligned causal mask."""
    group = q.shape[1] // k.shape[1]
    qq = q.double().transpose(0, 1)  # [Hq, ql, D]
    kk = k.double().repeat_interleave(group, 1).transpose(0, 1)
    vv = v.double().repeat_interleave(group, 1).transpose(0, 1)
    s = qq @ kk.transpose(1, 2) * scale  # [Hq, ql, kv]
    if causal:
        ql, kv = q.shape[0], k.shape[0]
        q_pos = torch.arange(kv - ql, kv)[:, None]
        s = s.masked_fill(torch.arange(kv)[None, :] > q_pos, float("-inf"))
    lse2 = (torch.logsumexp(s, -1) / math.log(2)).transpose(0, 1).float()  # [ql, Hq]
    return (s.softmax(-1) @ vv).transpose(0, 1).to(q.dtype), lse2


def _result(out: torch.Tensor, lse: torch.Tensor, return_lse: bool):
    assert lse.dtype == torch.float32
    return (out, lse) if return_lse else out


class _Wrapper:
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 **kwargs) -> None:
        assert float_workspace_buffer.dtype == torch.uint8
        assert kv_layout == "NHD"
        assert not use_cuda_graph
        self.kwargs = kwargs
        self.planned: dict | None = None

    def _unpack(self, q: torch.Tensor, paged_kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.planned is not None, "run() before plan()"
        k_cache, v_cache = paged_kv_cache
        assert q.dtype == self.planned["q_data_type"], "q dtype differs from the planned q_data_type"
        assert k_cache.dtype == v_cache.dtype == self.planned["kv_data_type"]
        assert k_cache.shape[1] == self.planned["page_size"]
        assert q.shape[1] == self.planned["num_qo_heads"] and k_cache.shape[2] == self.planned["num_kv_heads"]
        assert q.stride(-1) == 1 and k_cache.stride(-1) == 1
        return k_cache, v_cache


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None,
             causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None,
             window_left=-1, logits_soft_cap=None, rope_scale=None, rope_theta=None,
             q_data_type="float16", kv_data_type=None, **kwargs) -> None:
        calls.append("prefill.plan")
        _check_int32(qo_indptr=qo_indptr)
        _check_table(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size)
        assert pos_encoding_mode == "NONE" and custom_mask is None and packed_custom_mask is None
        self.planned = dict(qo_indptr=qo_indptr.cpu(), indptr=paged_kv_indptr.cpu(), indices=paged_kv_indices,
                            last=paged_kv_last_page_len.cpu(), num_qo_heads=num_qo_heads,
                            num_kv_heads=num_kv_heads, page_size=page_size, causal=causal,
                            sm_scale=sm_scale if sm_scale is not None else 1 / math.sqrt(head_dim_qk),
                            q_data_type=q_data_type, kv_data_type=kv_data_type or q_data_type)

    def run(self, q, paged_kv_cache, *args, return_lse: bool = False, **kwargs):
        calls.append("prefill.run")
        assert not args, "0.7 takes run() options by keyword"
        k_cache, v_cache = self._unpack(q, paged_kv_cache)
        p = self.planned
        assert q.shape[0] == int(p["qo_indptr"][-1])
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32)
        for i in range(len(p["last"])):
            pages = p["indices"][p["indptr"][i]:p["indptr"][i + 1]]
            kv_len = (len(pages) - 1) * p["page_size"] + int(p["last"][i])
            a, b = int(p["qo_indptr"][i]), int(p["qo_indptr"][i + 1])
            out[a:b], lse[a:b] = _attend(q[a:b], _context(k_cache, pages, kv_len),
                                         _context(v_cache, pages, kv_len), p["sm_scale"], p["causal"])
        return _result(out, lse, return_lse)


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             *deprecated_positional_args, **kwargs) -> None:
        calls.append("decode.plan")
        assert not deprecated_positional_args, "0.7 deprecates positional optional plan() args"
        allowed = {"pos_encoding_mode", "window_left", "logits_soft_cap", "q_data_type", "kv_data_type",
                   "o_data_type", "data_type", "sm_scale", "rope_scale", "rope_theta", "non_blocking",
                   "block_tables", "seq_lens", "fixed_split_size", "disable_split_kv", "q_len_per_req"}
        assert set(kwargs) <= allowed, set(kwargs) - allowed
        assert kwargs.get("pos_encoding_mode", "NONE") == "NONE"
        _check_table(indptr, indices, last_page_len, page_size)
        q_dtype = kwargs.get("q_data_type", "float16")
        self.planned = dict(indptr=indptr.cpu(), indices=indices, last=last_page_len.cpu(),
                            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, page_size=page_size,
                            sm_scale=kwargs.get("sm_scale") or 1 / math.sqrt(head_dim), q_data_type=q_dtype,
                            kv_data_type=kwargs.get("kv_data_type") or q_dtype)

    def run(self, q, paged_kv_cache, *args, return_lse: bool = False, **kwargs):
        calls.append("decode.run")
        assert not args, "0.7 takes run() options by keyword"
        k_cache, v_cache = self._unpack(q, paged_kv_cache)
        p = self.planned
        assert q.shape[0] == len(p["last"]), "decode takes one query per sequence"
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32)
        for i in range(len(p["last"])):
            pages = p["indices"][p["indptr"][i]:p["indptr"][i + 1]]
            kv_len = (len(pages) - 1) * p["page_size"] + int(p["last"][i])
            out[i:i + 1], lse[i:i + 1] = _attend(q[i:i + 1], _context(k_cache, pages, kv_len),
                                                 _context(v_cache, pages, kv_len), p["sm_scale"], causal=False)
        return _result(out, lse, return_lse)


def merge_state_in_place(v, s, v_other, s_other, mask=None) -> None:
    """(v, s) <- merge of (v, s) and (v_other, s_other); s base-2 log-sum-exps, float32."""
    calls.append("merge_state_in_place")
    assert mask is None
    assert v.shape == v_other.shape and v.dim() == 3 and s.shape == s_other.shape == v.shape[:2]
    assert s.dtype == s_other.dtype == torch.float32 and v.dtype == v_other.dtype
    assert v.is_contiguous() and s.is_contiguous(), "merged in place: must be plain (contiguous) views"
    s_max = torch.maximum(s, s_other)
    w, w_other = torch.exp2(s - s_max), torch.exp2(s_other - s_max)
    total = w + w_other
    v.copy_(((v.double() * (w / total)[..., None] + v_other.double() * (w_other / total)[..., None])).to(v.dtype))
    s.copy_(s_max + torch.log2(total))


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices,
                          kv_indptr, kv_last_page_len, kv_layout="NHD") -> None:
    calls.append("append_paged_kv_cache")
    assert kv_layout == "NHD"
    k_cache, v_cache = paged_kv_cache
    page_size = k_cache.shape[1]
    _check_int32(batch_indices=batch_indices, positions=positions)
    _check_table(kv_indptr, kv_indices, kv_last_page_len, page_size)
    for t in (batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len):
        assert t.is_contiguous() and t.device == append_key.device  # CHECK_INPUT + CHECK_DEVICE
    assert append_key.stride(-1) == 1 and append_value.stride(-1) == 1
    b, pos = batch_indices.long(), positions.long()
    page = kv_indices.long()[kv_indptr.long()[b] + pos // page_size]
    k_cache[page, pos % page_size] = append_key
    v_cache[page, pos % page_size] = append_value
