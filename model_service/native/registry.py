"""The one contract of radixkv's native kernels: what each reproduces, how that is checked, and
whether it runs here.

Every kernel has an entry (`KERNELS`): its torch.ops names, the torch op(s) it stands in for, its
contract (bitwise, or within a tolerance) and a probe that runs it against that reference on
seeded random inputs. A kernel is *active* where the library is loaded (`native.unavailable_reason`)
and its probe passes; callers ask `active(name, **shape)` instead of probing themselves, and keep
torch's ops otherwise. Probes that depend on a model's shapes take them as keyword arguments (the
defaults are SmolLM2-135M's, what `python -m model_service.native.check` reports).

Probe results are cached per (kernel, shape) under a key of everything a summation order can
depend on: the library's hash (sources, flags, torch version), torch's version, this CPU's model
and flags, and torch's thread count. The cache lives in memory and in `_build/probes.json` next to
the library, so a model service starting again on the same machine does not re-run them.

The float32 linear kernel (`linear`) is verified per weight shape by its user at load (which
block order and short-row splits reproduce MKL's bits: model_service/linear/blocked.py); the
registry reports whether it is loaded (`active("linear")`) and lends that check its cache key
(`cache_key`), so a per-shape result is keyed like the probes here.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from model_service import native

Probe = Callable[..., str | None]  # keyword shape arguments -> None (matches) or what differed


@dataclass(frozen=True, slots=True)
class Kernel:
    """One native kernel's contract."""

    name: str
    ops: tuple[str, ...]  # torch.ops.radixkv.<op>
    reference: str  # the torch op(s) whose result it gives
    contract: str  # "bitwise", or the tolerance it is held to
    probe: Probe | None  # None: verified by its user per shape (see `linear`)
    used_by: str  # where the model service asks for it
    # Why a probe mismatch is expected on this CPU (its reference sums in an order the kernel does
    # not reproduce here), or None: a mismatch then is a defect, and RADIXKV_REQUIRE_NATIVE fails it.
    expected_mismatch: Callable[[], str | None] | None = None


@dataclass(frozen=True, slots=True)
class Status:
    """Whether a kernel runs here and, if not, why (`reason`: not loaded, or the probe's finding)."""

    kernel: Kernel
    active: bool
    reason: str  # "" when active
    expected: str = ""  # inactive as expected on this CPU (Kernel.expected_mismatch): why


# ---- probes: each returns None when the kernel gives its reference's result, else the first difference


def _differs(got: torch.Tensor, want: torch.Tensor, what: str) -> str | None:
    if torch.equal(got, want):
        return None
    mismatched = int((got != want).sum()) if got.shape == want.shape else -1
    return f"{what}: {mismatched} of {want.numel()} values differ from torch's"


def _probe_attention(num_q_heads: int = 9, num_kv_heads: int = 3, head_dim: int = 64) -> str | None:
    """attend against scaled_dot_product_attention (float32; float32 accumulation, so 1e-4)."""
    gen = torch.Generator().manual_seed(1)
    for length, queries in ((37, 1), (200, 5)):
        q = torch.randn(2, num_q_heads, queries, head_dim, generator=gen)
        k, v = (torch.randn(2, num_kv_heads, length, head_dim, generator=gen) for _ in range(2))
        offsets = torch.full((2,), length - queries, dtype=torch.int64)
        got, _ = native.attend(q, k, v, torch.full((2,), length, dtype=torch.int64), offsets, head_dim ** -0.5)
        r = num_q_heads // num_kv_heads
        mask = torch.ones(queries, length, dtype=torch.bool).tril(length - queries)
        want = F.scaled_dot_product_attention(q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1),
                                              attn_mask=mask, scale=head_dim ** -0.5)
        error = float((got - want).abs().max())
        if not error <= 1e-4:
            return f"attend differs from scaled_dot_product_attention by {error:.3g} (> 1e-4) at {length} keys"
    if native.attention_tiles_min_queries(head_dim) is not None:
        return _probe_attention_tiles(num_q_heads, num_kv_heads, head_dim)
    return None


def _probe_attention_tiles(num_q_heads: int, num_kv_heads: int, head_dim: int) -> str | None:
    """attend's bfloat16 AMX tile path (a causal chunk after a cached prefix, a fresh prompt)
    against float32 attention of the same bfloat16 values: within the rounding of a bfloat16
    result (2^-8 relative, of values of magnitude up to ~3 here) and of the bfloat16 probabilities."""
    gen = torch.Generator().manual_seed(2)
    r = num_q_heads // num_kv_heads
    for length, queries in ((300, 40), (77, 77)):
        q = torch.randn(2, num_q_heads, queries, head_dim, generator=gen).bfloat16()
        k, v = (torch.randn(2, num_kv_heads, length, head_dim, generator=gen).bfloat16() for _ in range(2))
        offsets = torch.full((2,), length - queries, dtype=torch.int64)
        got, _ = native.attend(q, k, v, torch.full((2,), length, dtype=torch.int64), offsets, head_dim ** -0.5)
        mask = torch.ones(queries, length, dtype=torch.bool).tril(length - queries)
        want = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(r, 1),
                                              v.float().repeat_interleave(r, 1), attn_mask=mask, scale=head_dim ** -0.5)
        error = float((got.float() - want).abs().max())
        if not error <= 3e-2:
            return f"attend's AMX tiles differ from float32 attention by {error:.3g} (> 3e-2) at {length} keys"
    return None


def _probe_prompt_attention(num_q_heads: int = 9, num_kv_heads: int = 3, head_dim: int = 64,
                            scale: float = 0.125) -> str | None:
    """prompt_attention against F.scaled_dot_product_attention(is_causal=True), bit for bit, on
    seeded random prompts of every PROBE_LENGTHS length it takes."""
    from model_service.native import prompt_attention as pa  # (imports this package)

    if not pa.takes_head_dim(head_dim):
        return f"head_dim {head_dim} is over {pa.MAX_HEAD_DIM}"
    gen = torch.Generator().manual_seed(20241203)
    for length in pa.PROBE_LENGTHS:
        if not pa.takes_length(length):
            continue
        q, k, v = (torch.randn(length, heads, head_dim, generator=gen).transpose(0, 1).unsqueeze(0)
                   for heads in (num_q_heads, num_kv_heads, num_kv_heads))
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                  enable_gqa=num_q_heads != num_kv_heads)
        found = _differs(pa.prompt_attention(q, k, v, scale), expected, f"{length}-token prompt")
        if found:
            return found
    return None


def _probe_kv_write(num_kv_heads: int = 3, head_dim: int = 64) -> str | None:
    """write_kv against two index_copy_ calls."""
    gen = torch.Generator().manual_seed(2)
    for dtype in native.DTYPES:
        caches = [torch.randn(6, 16, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2)]
        k, v = (torch.randn(20, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
        slots = torch.randperm(96, generator=gen)[:20]
        want = [c.clone() for c in caches]
        for cache, rows in zip(want, (k, v), strict=True):
            cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, rows)
        native.write_kv(k, v, caches[0], caches[1], slots)
        for got, expected, what in zip(caches, want, ("k", "v"), strict=True):
            found = _differs(got, expected, f"{dtype} {what} cache")
            if found:
                return found
    return None


def _probe_argmax(vocab: int = 49152) -> str | None:
    """argmax_rows against torch.argmax(dim=-1), ties and NaNs included."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, vocab, generator=gen)
    x[1, 5:9] = x[1].max() + 1  # a tie: the first index wins
    x[2, vocab // 2] = math.nan
    x[3, -3:] = math.inf
    x[4] = -math.inf
    return _differs(native.argmax_rows(x), x.argmax(dim=-1), "argmax")


def _probe_rms_norm(hidden_size: int = 576, eps: float = 1e-5, dtype: str = "float32") -> str | None:
    """add_rms_norm against `y += residual` then LlamaRMSNorm's ops (decoder_forward._rms_norm), in
    `dtype` (float32 or bfloat16): torch's sum order is an observation about this torch build, so
    it is checked on random rows."""
    from model_service.decoder_forward import _rms_norm  # (imports this package)

    g = torch.Generator().manual_seed(0)
    kind = getattr(torch, dtype)
    with torch.inference_mode():
        for rows in (1, 3, 32, 257):
            y, residual = ((torch.randn(rows, hidden_size, generator=g) * 4).to(kind) for _ in range(2))  # [rows, hidden]
            weight = torch.randn(hidden_size, generator=g).to(kind)
            want_sum = y + residual
            want = _rms_norm(want_sum.clone(), weight, eps)
            got = native.add_rms_norm(y, residual, weight, eps)
            found = _differs(got, want, f"{rows} rows") or _differs(y, want_sum, f"{rows} rows' residual sum")
            if found:
                return found
    return None


def _probe_rope(head_dim: int = 64, num_heads: int = 15, dtype: str = "float32") -> str | None:
    """rope against x * cos + cat(x2, x1) * signed_sin in torch's ops (decoder_forward.torch_rope), in
    `dtype` (float32 or bfloat16)."""
    from model_service.decoder_forward import torch_rope  # (imports this package)

    gen = torch.Generator().manual_seed(4)
    kind = getattr(torch, dtype)
    for tokens in (1, 33):
        x = (torch.randn(tokens, num_heads, head_dim, generator=gen) * 8).to(kind)
        angles = torch.rand(tokens, head_dim, generator=gen) * 100
        cos, signed_sin = angles.cos().to(kind), angles.sin().to(kind)
        found = _differs(native.rope(x, cos, signed_sin), torch_rope(x, cos, signed_sin), f"{tokens} tokens")
        if found:
            return found
    return None


def _probe_silu_mul(intermediate_size: int = 1536, dtype: str = "float32") -> str | None:
    """silu_mul against F.silu(gate).mul_(up) (decoder_forward) on halves of a fused gate/up
    product, in `dtype`: the exp torch's silu vectorizes with is an observation about this build."""
    gen = torch.Generator().manual_seed(6)
    kind = getattr(torch, dtype)
    with torch.inference_mode():
        for rows in (1, 3, 33, 65):  # 65: a parallel split inside a row
            fused = (torch.randn(rows, 2 * intermediate_size, generator=gen) * 6).to(kind)
            gate, up = fused.chunk(2, dim=-1)
            found = _differs(native.silu_mul(gate, up), F.silu(gate).mul_(up), f"{rows} rows")
            if found:
                return found
    return None


def cpu_vendor() -> str:
    """This CPU's vendor id (GenuineIntel, AuthenticAMD, ...; "" where /proc/cpuinfo has none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def _mkl_intel_kernels() -> str | None:
    """prompt_attention and linear reproduce the order of the generic path MKL takes on CPUs it does
    not recognise (AMD's); on Intel CPUs MKL runs its own kernels, which sum in other orders."""
    if cpu_vendor() == "GenuineIntel":
        return "MKL runs its Intel kernels here, not the generic path whose order the kernel reproduces"
    return None


KERNELS: dict[str, Kernel] = {k.name: k for k in (
    Kernel("attention", ("attend", "attend_paged", "attend_cascade"),
           "F.scaled_dot_product_attention, with its log-sum-exp", "float32 accumulation: within 1e-4",
           _probe_attention, "model_service/attention/torch_backend.py"),
    Kernel("prompt_attention", ("prompt_attention",), "F.scaled_dot_product_attention(is_causal=True)", "bitwise",
           _probe_prompt_attention, "model_service/attention/torch_backend.py (float32 fresh prompts)",
           _mkl_intel_kernels),
    Kernel("linear", ("blocked_linear",), "F.linear (MKL sgemm)", "bitwise, verified per weight shape at load",
           None, "model_service/linear/blocked.py", _mkl_intel_kernels),
    Kernel("kv_write", ("write_kv",), "two index_copy_ into the paged caches", "bitwise",
           _probe_kv_write, "model_service/attention/torch_backend.py"),
    Kernel("argmax", ("argmax_rows",), "torch.argmax(dim=-1)", "bitwise", _probe_argmax,
           "model_service/sampler.py"),
    Kernel("rms_norm", ("add_rms_norm",), "residual add + LlamaRMSNorm (decoder_forward._rms_norm)",
           "bitwise, float32 and bfloat16",
           _probe_rms_norm, "model_service/decoder_forward.py"),
    Kernel("rope", ("rope",), "x * cos + rotate_half(x) * sin (decoder_forward.torch_rope)",
           "bitwise, float32 and bfloat16",
           _probe_rope, "model_service/decoder_forward.py"),
    Kernel("silu_mul", ("silu_mul",), "F.silu(gate) * up (decoder_forward)", "bitwise, float32 and bfloat16",
           _probe_silu_mul, "model_service/decoder_forward.py"),
)}

CACHE_FILE = "probes.json"
_memory: dict[str, str | None] = {}  # cache key -> probe finding (None: matches)
# (name, shape, threads) -> Status: what `status` answers without hashing the library again (callers
# on hot paths, e.g. the sampler per step, ask every time).
_answers: dict[tuple[object, ...], Status] = {}


def cpu_description() -> tuple[str, tuple[str, ...]]:
    """This CPU's model name and the feature flags the kernels care about (Linux /proc/cpuinfo)."""
    from model_service.native.build import cpu_flags  # importing build here would shadow `-m ...build`

    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    relevant = tuple(sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx"))))
    return model, relevant


def cache_key(name: str, **shape: object) -> str:
    """The key a probe result (or a per-shape check) of kernel `name` is cached under."""
    from model_service.native.build import library_path

    model, flags = cpu_description()
    fingerprint = hashlib.sha256(f"{model}|{' '.join(flags)}".encode()).hexdigest()[:12]
    args = ",".join(f"{k}={shape[k]!r}" for k in sorted(shape))
    return (f"{name}({args})|{library_path().stem}|torch {torch.__version__}|cpu {fingerprint}"
            f"|{torch.get_num_threads()} threads")


def _cache_path() -> Path:
    from model_service.native.build import library_path

    return library_path().parent / CACHE_FILE


def _read_disk() -> dict[str, str | None]:
    try:
        found = json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _write_disk(key: str, finding: str | None) -> None:
    """Adds one result to probes.json (atomically; a race with another process loses at most an
    entry, which is then probed again)."""
    path = _cache_path()
    entries = _read_disk()
    entries[key] = finding
    try:
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".probes-", delete=False) as out:
            json.dump(entries, out, indent=0, sort_keys=True)
        os.replace(out.name, path)
    except OSError:
        pass  # a read-only install: the result stays cached in memory


def clear_cache() -> None:
    """Forgets every cached probe result, in memory and on disk (tests; `check --fresh`)."""
    _memory.clear()
    _answers.clear()
    _cache_path().unlink(missing_ok=True)


def status(name: str, **shape: object) -> Status:
    """Whether kernel `name` runs here for this shape (probing it on first ask), and why not."""
    question = (name, *sorted(shape.items()), torch.get_num_threads())
    answer = _answers.get(question)
    if answer is None:
        answer = _answers[question] = _status(KERNELS[name], shape)
    return answer


def _status(kernel: Kernel, shape: dict[str, object]) -> Status:
    name = kernel.name
    unavailable = native.unavailable_reason()
    if unavailable is not None:
        return Status(kernel, False, f"not loaded: {unavailable}")
    if kernel.probe is None:
        return Status(kernel, True, "")
    key = cache_key(name, **shape)
    if key not in _memory:
        disk = _read_disk()
        if key in disk:
            _memory[key] = disk[key]
        else:
            try:
                with torch.inference_mode():
                    _memory[key] = kernel.probe(**shape)
            except RuntimeError as error:  # a kernel that refuses the probe's inputs
                _memory[key] = f"raised {error}"
            _write_disk(key, _memory[key])
    finding = _memory[key]
    if finding is None:
        return Status(kernel, True, "")
    expected = (kernel.expected_mismatch() if kernel.expected_mismatch is not None else None) or ""
    return Status(kernel, False, f"probe mismatch: {finding}", expected)


def active(name: str, **shape: object) -> bool:
    """Whether kernel `name` is loaded and its probe passes for this shape (see `status`)."""
    return status(name, **shape).active


def attention_tiles(head_dim: int = 64) -> str:
    """Whether bfloat16 attention of many queries (prompts, chunks) runs on AMX tiles here, and if not why."""
    if native.unavailable_reason() is not None:
        return "no (library not loaded)"
    least = native.attention_tiles_min_queries(head_dim)
    if least is not None:
        return f"yes ({least}+ queries per head)"
    _, flags = cpu_description()
    if "amx_bf16" not in flags:
        return "no (this CPU has no AMX)"
    return "no (compiled without AMX, or Linux refused the tile state)"


def bf16_dot_products() -> str:
    """Whether bfloat16 attention and dot_linear run on AVX512-BF16 dot products here, and if not why."""
    if native.unavailable_reason() is not None:
        return "no (library not loaded)"
    if native.has_bf16_dot_products():
        return "yes"
    _, flags = cpu_description()
    return "no (compiled without it)" if "avx512_bf16" in flags else "no (this CPU has no AVX512-BF16)"
