"""Native CPU kernels (C++, AVX-512) the torch attention backend uses where they run.

`attend` is softmax attention with its log-sum-exp over K/V with per-sequence key lengths and
optional causal offsets (attention.cpp says how it works; bfloat16 calls with many queries per head
run on AMX tiles where the CPU has them, tile_attention.cpp). The library is built by `make install`
(`python -m model_service.native.build`) and loaded here on first use when the CPU has AVX-512
(torch's "AVX512" capability); `unavailable_reason()` says why not otherwise. Whether a kernel
is used is the registry's answer (registry.py: loaded and its probe matches torch); callers ask it
and keep torch's kernels otherwise. `python -m model_service.native.check` prints what runs here.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

# head_dim must be a multiple of this and at most MAX_HEAD_DIM; at most MAX_GROUP query heads per KV head.
HEAD_DIM_MULTIPLE = 16
MAX_HEAD_DIM = 256
MAX_GROUP = 64
# attend_paged and attend_cascade: at most this many query heads per KV head (rows of a decode item).
MAX_CASCADE_GROUP = 8
DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def unavailable_reason() -> str | None:
    """None when the kernels are loaded, else why they are not."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX512", "AMX"):
        return f"this CPU has no AVX-512 (torch reports {capability})"
    from model_service.native.build import library_path  # importing build here would shadow `-m ...build`

    path = library_path()
    if not path.exists():
        return f"not built ({path.name} missing: run `make install` or `python -m model_service.native.build`)"
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as error:
        return f"could not load {path.name}: {error}"
    return None


def available() -> bool:
    return unavailable_reason() is None


def supports(dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int, device: torch.device) -> bool:
    """Whether `attend` takes this model's attention shapes (and the library is loaded)."""
    return (device.type == "cpu" and dtype in DTYPES and head_dim % HEAD_DIM_MULTIPLE == 0
            and head_dim <= MAX_HEAD_DIM and num_q_heads % num_kv_heads == 0
            and num_q_heads // num_kv_heads <= MAX_GROUP and available())


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lens: torch.Tensor,
           causal_offsets: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with log-sum-exp. q [B, Hq, M, D]; k, v [B, Hkv, L, D] (last dim contiguous);
    kv_lens int64 [B] in [1, L]; causal_offsets int64 [B] or None: query i of sequence b sees keys
    j < min(kv_lens[b], causal_offsets[b] + i + 1), else the first kv_lens[b]. Query head h reads KV
    head h // (Hq / Hkv). Returns o [B, Hq, M, D] in q's dtype and lse [B, Hq, M] float32."""
    return torch.ops.radixkv.attend(q, k, v, kv_lens, causal_offsets, scale)


def attend_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 starts: torch.Tensor, kv_lens: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend` for decodes, reading K/V in place from the paged caches [num_blocks, block_size,
    Hkv, D] (no gathered copy). q [B, Hq, M, D] with (Hq / Hkv) * M <= 8; block_tables int64
    [B, width]; sequence b attends over its tokens starts[b] .. starts[b] + kv_lens[b] - 1 (int64
    [B] each). Every block read is checked to exist. Returns o [B, Hq, M, D] and lse [B, Hq, M]."""
    return torch.ops.radixkv.attend_paged(q, k_cache, v_cache, block_tables, starts, kv_lens, scale)


def attend_cascade(q: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor, prefix_lens: torch.Tensor,
                   members: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                   starts: torch.Tensor, kv_lens: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention with shared prefixes in one call (FlashInfer's cascade, fused).

    q [n, Hq, D] contiguous: one new token per sequence, (Hq / Hkv) <= 8. prefix_k, prefix_v
    [G, Hkv, Lp, D] contiguous: group g's shared prefix in its first prefix_lens[g] positions
    (int64 [G]). members int64 [G, gm]: the rows of q in group g, -1 past its size. A member's own
    keys, and a sequence in no group's whole context, are read in place from the paged caches
    [num_blocks, block_size, Hkv, D]: tokens starts[i] .. starts[i] + kv_lens[i] - 1 of row i of
    block_tables (int64 [n, width], [n], [n]). Each group's prefix K/V is read once for all of its
    members' query heads; each member's softmax then continues over its own keys, so no partial
    results are merged. Returns o [n, Hq, D] in q's dtype and lse [n, Hq] float32."""
    return torch.ops.radixkv.attend_cascade(q, prefix_k, prefix_v, prefix_lens, members, k_cache, v_cache,
                                            block_tables, starts, kv_lens, scale)


def pack_prefix_tiles(prefix_k: torch.Tensor, prefix_v: torch.Tensor, prefix_lens: torch.Tensor) -> torch.Tensor:
    """bfloat16 prefixes [G, Hkv, Lp, D] (contiguous; lengths int64 [G]) packed once into the
    layout the AMX tiles read (tile_attention.cpp), for `attend_cascade_tiles` to attend over
    step after step without packing them again. Only where `cascade_on_tiles(D)`. Returns int32
    [G, Hkv, 2, words]; slice g is group g's packed prefix."""
    return torch.ops.radixkv.pack_prefix_tiles(prefix_k, prefix_v, prefix_lens)


def attend_cascade_tiles(q: torch.Tensor, prefix_tiles: list[torch.Tensor], prefix_lens: torch.Tensor,
                         members: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, starts: torch.Tensor, kv_lens: torch.Tensor,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend_cascade` (bfloat16) over prefixes `pack_prefix_tiles` packed, one int32 [Hkv, 2,
    words] per group (slices of one or of several packings): bit for bit the result attend_cascade
    gives on the tiles for the same K/V, without repacking the prefixes per call."""
    return torch.ops.radixkv.attend_cascade_tiles(q, prefix_tiles, prefix_lens, members, k_cache, v_cache,
                                                  block_tables, starts, kv_lens, scale)


def attend_extends_tiles(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
                         lens: torch.Tensor, prefix_tiles: list[torch.Tensor], prefix_lens: torch.Tensor, scale: float,
                         out: torch.Tensor) -> None:
    """Chunks of new tokens after cached prefixes that `pack_prefix_tiles` packed (one int32 [Hkv,
    2, words] per sequence), on AMX tiles: sequence b's lens[b] new tokens are rows starts[b] ..
    of q [T, Hq, D] and k, v [T, Hkv, D] (bfloat16, last dimension contiguous; int64 [B] each);
    each attends over its whole prefix of prefix_lens[b] keys and its new tokens up to itself.
    Writes those rows of out [T, Hq, D], in one pass (no partial results merged)."""
    torch.ops.radixkv.attend_extends_tiles(q, k, v, starts, lens, prefix_tiles, prefix_lens, scale, out)


def cascade_on_tiles(head_dim: int) -> bool:
    """Whether bfloat16 cascade prefixes of this head_dim run on AMX tiles here (and so may be
    packed once with `pack_prefix_tiles`)."""
    return attention_tiles_min_queries(head_dim) is not None


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k_cache.view(-1, Hkv, D).index_copy_(0, slots, k), and the same for v, in one call. k, v
    [T, Hkv, D] with each token's values contiguous (`takes_kv_rows`); caches [num_blocks,
    block_size, Hkv, D] contiguous of k's dtype; slots int64 [T], each checked to be in the cache."""
    torch.ops.radixkv.write_kv(k, v, k_cache, v_cache, slots)


def takes_kv_rows(t: torch.Tensor) -> bool:
    """Whether `write_kv` takes t [T, Hkv, D] as is (each token's Hkv x D values contiguous)."""
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of a float32 CPU matrix [rows, n] (last dim contiguous, n >= 1),
    bit for bit: the first index of the maximum, a NaN counting as the maximum. int64 [rows]."""
    return torch.ops.radixkv.argmax_rows(x)


def add_rms_norm(y: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm of float32 or bfloat16 rows in torch's own order and roundings (rms_norm.cpp),
    after `y += residual` in place when residual is given. y [T, H] contiguous (and residual like
    it), weight [H], all of one dtype. Returns the normalized rows [T, H]; y then holds the sum."""
    return torch.ops.radixkv.add_rms_norm(y, residual, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + cat(x2, x1) * signed_sin for float32 or bfloat16 x [T, H, D] (last dim contiguous)
    and contiguous cos, signed_sin [T, D] of x's dtype, each product and the sum rounded as torch's
    ops round them (rope.cpp). Returns a new contiguous [T, H, D]."""
    return torch.ops.radixkv.rope(x, cos, signed_sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up for float32 or bfloat16 gate, up [T, n] of one dtype with contiguous rows
    (any row stride), each op rounded as torch's two ops round it (silu_mul.cpp). Returns a new
    contiguous [T, n]."""
    return torch.ops.radixkv.silu_mul(gate, up)


def attention_tiles_min_queries(head_dim: int) -> int | None:
    """The fewest queries per head at which bfloat16 `attend` calls run on AMX tiles here
    (tile_attention.cpp), None where they never do (no AMX, a head_dim the tiles do not take, or
    turned off by `without_attention_tiles`)."""
    least = int(torch.ops.radixkv.attention_tiles_min_queries())
    return least if torch.ops.radixkv.attention_tiles_take(head_dim, least) else None


@contextlib.contextmanager
def without_attention_tiles() -> Iterator[None]:
    """Within: bfloat16 `attend` calls run on the row kernels even where AMX tiles would take them
    (tests, and the start-up timing of the calls the tiles do not take)."""
    previous = torch.ops.radixkv.set_attention_tiles(False)
    try:
        yield
    finally:
        torch.ops.radixkv.set_attention_tiles(previous)


def has_bf16_dot_products() -> bool:
    """Whether this CPU has AVX512-BF16: bfloat16 attention then runs on its dot products (else float32
    FMAs), and the bfloat16 dot-product linear (linear/dot.py) can run."""
    return bool(torch.ops.radixkv.has_bf16_dot_products())


@contextlib.contextmanager
def without_bf16_dot_products() -> Iterator[None]:
    """Within: bfloat16 inputs take the float32-FMA path even where AVX512-BF16 runs (tests)."""
    previous = torch.ops.radixkv.set_bf16_dot_products(False)
    try:
        yield
    finally:
        torch.ops.radixkv.set_bf16_dot_products(previous)
