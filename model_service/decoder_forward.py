"""A lean forward pass for Llama-family decoders over a step's packed tokens.

transformers' module tree costs a decode step more than its arithmetic: per layer a dozen
module calls with keyword plumbing, output dataclasses, decorators and a causal mask built per
step that our paged attention never reads. For the bundled 30-layer model at 16-32 decode rows
that is about a third of the step on 2 cores. This module runs the same model from its own
weights in one flat loop, nano-vllm style, for the architectures whose layer is exactly
Llama's (`SUPPORTED_MODEL_TYPES`); any other model keeps transformers' forward.

Bitwise the same as transformers: every op transformers runs on a value is run here on the same
value in the same order and dtype (RMSNorm in float32 as `LlamaRMSNorm`, RoPE from the model's
own rotary module, `q * cos + rotate_half(q) * sin`, SiLU(gate) * up, residual adds), only on a
`[num_tokens, ...]` layout instead of `[1, heads, num_tokens, ...]`, which elementwise ops do
not see. Two rewrites are exact by IEEE arithmetic: RoPE is applied to q and k in one call
(elementwise over the heads of both), and `rotate_half(x) * sin` is computed as
`cat(x2, x1) * cat(-sin1, sin2)` (negation commutes exactly with rounding). Residual adds are
done in place (a + b == b + a bit for bit), as are RMSNorm's scaling by its weight and the
product with `up` (products commute too). In float32 each residual add and the RMSNorm after it
are one native call (`native.add_rms_norm`, which sums the squares in torch's own order), as is
RoPE (`native.rope`: the same products and sum, rounded the same way), each where its probe in
model_service/native/registry.py matches torch's ops at load (else torch's ops); the last add and the final norm run only on the rows whose logits are wanted (both
are per row). The products are the model's own (fused q/k/v and
gate/up, each product through its load-time plan: `linear.PlannedProduct`). The greedy-identity
tests run the service on this path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model_service import native
from model_service.attention.base import AttentionBackend
from model_service.kv_cache import KVCache
from model_service.linear import PlannedLinear, PlannedProduct
from model_service.linear.fused import FusedSlice
from model_service.native import registry

# Model types whose decoder layer is Llama's: pre-norm RMSNorm, q/k/v (bias optional), RoPE,
# attention, o_proj, residual, RMSNorm, gate/up/down MLP, residual. Sliding-window configs are
# excluded (the paged attention attends over the whole context either way).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")


@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor  # [hidden]
    input_eps: float
    qkv: PlannedProduct  # [Hq * D + 2 * Hkv * D, hidden]
    o_proj: PlannedProduct
    post_norm: torch.Tensor
    post_eps: float
    gate_up: PlannedProduct  # [2 * intermediate, hidden]
    down: PlannedProduct
    act: Callable[[torch.Tensor], torch.Tensor]
    scale: float


def _linear(module: nn.Module) -> PlannedProduct:
    """The planned product of a layer (linear/planner.py put one on every linear layer)."""
    if isinstance(module, FusedSlice):
        return module.group.product
    if not isinstance(module, PlannedLinear):
        raise TypeError(f"expected a planned linear layer, got {type(module).__name__}")
    return module.product


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward, op for op (in place where that allocates less: same values)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)  # [T, 1]
    x = x * variance.add_(eps).rsqrt_()
    if dtype == torch.float32 and weight.dtype == torch.float32:
        return x.mul_(weight)  # weight * x, bit for bit
    return weight * x.to(dtype)


def torch_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin in torch's ops. x [T, H, D]; cos, signed_sin [T, D] (the
    signed sin: first half negated) -> new [T, H, D]."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # rotate_half(x) up to sign
    out = x * cos.unsqueeze(1)
    return out.add_(swapped.mul_(signed_sin.unsqueeze(1)))


def _activation(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP's activation: F.silu itself for SiLU modules (their forward is just that call)."""
    if type(module) is nn.SiLU or (type(module).__name__ == "SiLUActivation"
                                   and type(module).forward.__module__.startswith("transformers.")):
        return F.silu
    return module


def supports(model: nn.Module) -> bool:
    """True when `model` (after linear.plan_model) can run on `DecoderForward`."""
    config = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    if config is None or inner is None or getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    if getattr(config, "use_sliding_window", False) or (
            config.model_type == "mistral" and getattr(config, "sliding_window", None)):
        return False
    if not isinstance(getattr(model, "lm_head", None), PlannedLinear):
        return False
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if type(layer.input_layernorm).__name__ not in _RMS_NORMS or \
                type(layer.post_attention_layernorm).__name__ not in _RMS_NORMS:
            return False
        # q/k/v and gate/up must be fused groups in that order (one product each).
        fused = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")] + \
            [getattr(mlp, n, None) for n in ("gate_proj", "up_proj")]
        if not all(isinstance(m, FusedSlice) for m in fused):
            return False
        if fused[0].group is not fused[2].group or fused[3].group is not fused[4].group:
            return False
        if not hasattr(mlp, "act_fn") or not isinstance(attn.o_proj, PlannedLinear) or \
                not isinstance(mlp.down_proj, PlannedLinear):
            return False
    return type(inner.norm).__name__ in _RMS_NORMS


class DecoderForward:
    """Runs a supported causal LM (see `supports`) over packed tokens with paged attention."""

    def __init__(self, model: nn.Module, backend: AttentionBackend, kv_cache: KVCache) -> None:
        inner = model.model
        config = model.config
        self.embed = inner.embed_tokens.weight.detach()  # [vocab, hidden]
        self.rotary = inner.rotary_emb
        self.norm = inner.norm.weight.detach()
        self.norm_eps = float(inner.norm.variance_epsilon)
        self.lm_head = _linear(model.lm_head)
        self.backend = backend
        self.kv_cache = kv_cache
        first = inner.layers[0].self_attn
        self.head_dim = int(first.head_dim)
        hidden_size = int(self.embed.shape[1])
        self.num_q_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.layers = [
            _Layer(
                input_norm=layer.input_layernorm.weight.detach(),
                input_eps=float(layer.input_layernorm.variance_epsilon),
                qkv=_linear(layer.self_attn.q_proj), o_proj=_linear(layer.self_attn.o_proj),
                post_norm=layer.post_attention_layernorm.weight.detach(),
                post_eps=float(layer.post_attention_layernorm.variance_epsilon),
                gate_up=_linear(layer.mlp.gate_proj), down=_linear(layer.mlp.down_proj),
                act=_activation(layer.mlp.act_fn), scale=float(layer.self_attn.scaling),
            )
            for layer in inner.layers
        ]
        # Residual add + RMSNorm, RoPE and SiLU(gate) * up, in one native call each where that is
        # bitwise torch's ops (float32 and bfloat16: the registry's probes, per dtype).
        norms = [(w, e) for layer in self.layers for w, e in ((layer.input_norm, layer.input_eps),
                                                              (layer.post_norm, layer.post_eps))]
        norms.append((self.norm, self.norm_eps))
        dtype = self.embed.dtype
        kernel_dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(dtype)
        on_cpu = self.embed.device.type == "cpu" and kernel_dtype is not None
        shape = {} if dtype == torch.float32 else {"dtype": kernel_dtype}  # float32: the probes' default keys
        self.native_rope = on_cpu and registry.active("rope", head_dim=self.head_dim, **shape)
        self.native_norm = (on_cpu and all(w.dtype == dtype and w.is_contiguous() for w, _ in norms)
                            and all(registry.active("rms_norm", hidden_size=hidden_size, eps=e, **shape)
                                    for e in {e for _, e in norms}))
        intermediate = {int(layer.gate_up.plan.shape[0]) // 2 for layer in self.layers}
        self.native_silu_mul = on_cpu and all(layer.act is F.silu for layer in self.layers) and all(
            registry.active("silu_mul", intermediate_size=n, **shape) for n in intermediate)

    def _add_norm(self, y: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                  eps: float) -> torch.Tensor:
        """y += residual (in place, when given), then RMSNorm(y) * weight as `_rms_norm` does."""
        if self.native_norm and y.is_contiguous() and (residual is None or residual.is_contiguous()):
            return native.add_rms_norm(y, residual, weight, eps)
        if residual is not None:
            y.add_(residual)  # a + b == b + a bit for bit
        return _rms_norm(y, weight, eps)

    def _rope_tables(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos [T, D] and the signed sin [T, D] (first half negated) for `_rotate`."""
        cos, sin = self.rotary(hidden.unsqueeze(0), positions.unsqueeze(0))  # [1, T, D] each
        half = self.head_dim // 2
        signed_sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
        return cos[0].contiguous(), signed_sin

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """x * cos + rotate_half(x) * sin. x: [T, H, D] -> new [T, H, D]; one native call where probed."""
        if self.native_rope and x.dtype == cos.dtype == self.embed.dtype:
            return native.rope(x, cos, signed_sin)
        return torch_rope(x, cos, signed_sin)

    def _activate(self, layer: _Layer, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up: one native call for SiLU where probed, else torch's ops (in place where
        that allocates less: same values)."""
        if self.native_silu_mul and gate.dtype == self.embed.dtype:
            return native.silu_mul(gate, up)
        return layer.act(gate).mul_(up) if layer.act is F.silu else layer.act(gate) * up

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_index: torch.Tensor,
                scored_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, positions: [T] int64; logits_index: [K] rows whose logits are sampled;
        scored_index: [S] rows whose logits are scored (a prompt's own), or None.
        Returns (logits [K, vocab] in the model's dtype, scored [S, vocab] float32 or None)."""
        hq, hkv, d = self.num_q_heads, self.num_kv_heads, self.head_dim
        num_tokens = int(input_ids.shape[0])
        hidden = F.embedding(input_ids, self.embed)  # [T, hidden]
        cos, signed_sin = self._rope_tables(hidden, positions)
        k_caches, v_caches = self.kv_cache.k, self.kv_cache.v
        first = self.layers[0]
        x = self._add_norm(hidden, None, first.input_norm, first.input_eps)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(x).view(num_tokens, hq + 2 * hkv, d)  # [T, Hq + 2 Hkv, D]
            qk = self._rotate(qkv[:, :hq + hkv], cos, signed_sin)  # [T, Hq + Hkv, D]
            attn = self.backend.forward(qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv:], k_caches[i], v_caches[i],
                                        layer.scale)  # [T, Hq, D]
            out = layer.o_proj(attn.reshape(num_tokens, hq * d))  # [T, hidden]
            x = self._add_norm(out, hidden, layer.post_norm, layer.post_eps)
            hidden = out  # o_proj(attn) + the residual
            gate, up = layer.gate_up(x).chunk(2, dim=-1)  # [T, intermediate] each
            act = self._activate(layer, gate, up)  # [T, intermediate]
            out = layer.down(act)
            if i < last:
                x = self._add_norm(out, hidden, self.layers[i + 1].input_norm, self.layers[i + 1].input_eps)
                hidden = out
        # The last residual add and the final norm are per row: only the rows whose logits are wanted.
        x = self._add_norm(out.index_select(0, logits_index), hidden.index_select(0, logits_index),
                           self.norm, self.norm_eps)
        logits = self.lm_head(x)  # [K, vocab]
        if scored_index is None:
            return logits, None
        # A head call of its own: the sampled rows' product stays the one a step without scores makes.
        x = self._add_norm(out.index_select(0, scored_index), hidden.index_select(0, scored_index),
                           self.norm, self.norm_eps)
        return logits, self.lm_head(x).float()  # [S, vocab]
