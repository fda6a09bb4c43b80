"""Attention that also returns its log-sum-exp, and the exact merge of two partial results.

The cascade (shared-prefix) decode path attends a group's queries over the shared prefix once
and each query over its own suffix, then merges the two with their log-sum-exp, as FlashInfer's
`merge_state` does.
"""

from __future__ import annotations

import torch


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention and its log-sum-exp (natural log), no causal mask.

    q: [B, H, M, D]; k, v: [B, H, L, D] contiguous; attn_mask: additive, broadcastable to
    [B, H, M, L], no row fully masked. Returns o [B, H, M, D], lse [B, H, M]. On CPU this is
    torch's flash kernel, which returns the log-sum-exp (one fused call); else two bmm.
    """
    if q.device.type == "cpu" and _FLASH_CPU is not None:
        out, lse = _FLASH_CPU(q, k, v, attn_mask=attn_mask, scale=scale)
        return out, lse
    return attention_with_lse_matmul(q, k, v, attn_mask, scale)


def attention_with_lse_matmul(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              attn_mask: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention_with_lse` with two matmuls and an explicit softmax (any device; the softmax in
    float32 for 16-bit inputs). Returns o in q's dtype, lse in float32."""
    s = torch.matmul(q, k.transpose(-1, -2))  # [B, H, M, L]
    if s.dtype in _HALF:
        s = s.float()
    s.mul_(scale)
    if attn_mask is not None:
        s.add_(attn_mask)
    m = s.amax(-1, keepdim=True)  # [B, H, M, 1]
    s.sub_(m).exp_()
    denom = s.sum(-1, keepdim=True)
    out = torch.matmul(s.to(v.dtype), v).to(s.dtype).div_(denom).to(q.dtype)
    return out, (m + denom.log()).squeeze(-1)


_HALF = (torch.float16, torch.bfloat16)
# torch's CPU flash attention returning (out, logsumexp); private, so optional.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def merge_states(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
                  lse2: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from the parts (FlashInfer's merge_state).

    o: [..., D], lse: [...] natural-log log-sum-exp of each part's scaled scores. With
    lse = logaddexp(lse1, lse2): o = o1 * exp(lse1 - lse) + o2 * exp(lse2 - lse), written as
    o2 + w * (o1 - o2) with w = exp(lse1 - lse) = sigmoid(lse1 - lse2).
    """
    w = torch.sigmoid(lse1 - lse2).unsqueeze(-1)
    if o1.dtype not in _HALF:
        return torch.lerp(o2, o1, w.to(o1.dtype))
    return torch.lerp(o2.float(), o1.float(), w.float()).to(o1.dtype)
