"""Reference paged attention in plain PyTorch (CPU and CUDA).

Per layer: scatter the step's new K/V into their slots, gather the context K/V the step
attends over, and attend batched over sequences (padded, with masks).

A step is split into a decode part (sequences with one new token) and an extend part
(several new tokens: prefill, or a prefill chunk after a cached prefix), attended separately
so that a long prefill chunk does not pad every decode row of a mixed batch to its length.

Decode. K/V are gathered token by token (rows of `cache.view(-1, head_dim)`) straight into a
contiguous head-major `[seqs, kv_heads, len, head_dim]` buffer: SDPA runs 1.5-2x as fast on it
as on the transposed view of a block-by-block gather, which more than pays for the finer
gather. Padding positions of shorter contexts gather the sequence's own last token (finite:
it is written before the gather) and are masked, so stale slots are never read and nothing
needs zeroing. Decode sequences whose
block tables start with the same physical blocks (a radix tree's shared prefix; see
`shared_prefix_groups`) attend as a cascade, as FlashInfer does:

- the shared prefix once per group: all group members' queries (x the query heads of each KV
  head) in one matmul over the prefix K/V, every group in one padded call;
- each member's own suffix (the blocks after the shared ones, ragged, one padded call);
- both partial results merged exactly with their log-sum-exp (FlashInfer's `merge_state`):
  `lse = logaddexp(lse1, lse2)`, `o = o1 * exp(lse1 - lse) + o2 * exp(lse2 - lse)`.

With the native kernels (AVX-512 CPUs, `kernels="auto"`) the three are one call,
`native.attend_cascade`: per (group, KV head) the members' query heads go over the prefix K/V
once, then each member's softmax state (running max, sum, accumulator) continues over its own
blocks read in place from the paged cache, so there is nothing to merge and no query or result
is copied between calls; ungrouped decode sequences are items of the same call.

The prefixes' gathered copies are kept across steps while their blocks are unwritten
(`PrefixKVStore`): a group decoding for many steps gathers its prefix once per layer, not once
per layer and step. Where bf16 prefixes run on AMX tiles they are kept packed for the tiles
instead, prefix by prefix (`PackedPrefixes`: packed once by `native.pack_prefix_tiles`, read by
`native.attend_cascade_tiles`), so groups that come and go keep theirs.

Whether a step's groups are worth it, and whether the suffixes and the ungrouped contexts go
in one padded call or two, is decided in plan() by a cost model (K/V tokens read, padding
included; see CASCADE_FIXED_TOKENS). Ungrouped decode sequences of a step without cascade are
one SDPA call over their whole contexts (with GQA; a single sequence makes exactly the call
dense attention makes, on the same contiguous layout).

Extend: queries padded to the longest chunk, a causal mask offset by each cached prefix, K/V
gathered block by block. A single sequence without cached prefix attends over its own new
K/V with `is_causal=True`, exactly the call dense attention makes (in bf16 through the native
kernel, or torch's SDPA where a timing run at start found it faster: prompt_timing.py; bf16
chunks after a cached prefix likewise, timed apart). bf16 prompts and chunks of 16 or more
queries per head take the native kernel wherever it runs them on AMX tiles. There, a chunk after
a cached prefix of PACKED_EXTEND_MIN_BLOCKS+ whole blocks attends over that prefix packed for the
tiles instead (`PackedPrefixes`, the cascade's copies: a cache hit joining its group reads the
group's packed prefix), then over its own new K/V, in one call (`native.attend_extends_tiles`).

Tokens recomputed over a cache hit (`BatchLayout.written_rows` leaves them out) keep their
cached K/V: only the other rows are written, and only those slots invalidate kept prefix
copies. Every path stays exact: a prompt attending its own new K/V uses its fresh values, every
gather reads the cache after the write (the cached tokens' cached values, the same model's).

Everything shared by the layers (gather indices, group membership, query/output permutations,
additive masks) is built once in `plan()`; `forward()` per layer only writes K/V, gathers into
a grow-only scratch buffer, and runs the matmuls / SDPA.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model_service import native
from model_service.attention.base import AttentionBackend, BatchLayout
from model_service.attention.indexing import segments, shared_prefix_groups
from model_service.attention.merge_state import attention_with_lse, merge_states
from model_service.attention.packed_prefixes import PackedPrefixes
from model_service.attention.prefix_store import PREFIX_STORE_MAX_BYTES, PrefixCopy, PrefixKVStore
from model_service.attention.prompt_timing import sdpa_faster_for_bf16_extends, sdpa_faster_for_bf16_prompts
from model_service.native import prompt_attention, registry

# Cascade cost model (bench/attention_bench.py measures it). Decode cost ~ K/V tokens gathered
# and attended, padding included: without cascade every decode row pads to the longest context;
# with it, each group's prefix once (padded to the longest shared prefix) plus every member's
# suffix. The cascade is used when it costs less, with CASCADE_FIXED_TOKENS added for its extra
# calls, and SPLIT_FIXED_TOKENS more when the suffixes and the ungrouped contexts are attended
# in two calls instead of one padded call (chosen by the same model). A group needs >= 2 members
# sharing >= CASCADE_MIN_SHARED_BLOCKS full blocks.
CASCADE_MIN_SHARED_BLOCKS = 1
CASCADE_FIXED_TOKENS = 1024
SPLIT_FIXED_TOKENS = 512
CASCADE_MODES = ("auto", "always", "never")
KERNEL_MODES = ("auto", "torch")
# An extend chunk of at least this many tokens is attended in an SDPA call of its own: padded
# into one call with the others, every short chunk (a cache hit's few tokens) would be padded
# to its length, and a step with a prompt and a few hits would attend as if all were prompts.
EXTEND_ALONE_TOKENS = 128
# bf16 on AMX tiles: chunks after a cached prefix of at least this many whole blocks attend over
# the prefix packed for the tiles (PackedPrefixes: shared with the cascade and kept across steps).
PACKED_EXTEND_MIN_BLOCKS = 4


@dataclass(slots=True)
class _Group:
    """Plan of one SDPA call over a subset of the step's sequences (block-by-block gather)."""

    num_seqs: int
    max_query_len: int
    # Packed token indices of this group's tokens, in packed order; None = all tokens.
    rows: torch.Tensor | None  # [group_tokens] int64
    # Index into the group's tokens that builds the padded query [num_seqs * max_query_len];
    # None when no padding is needed (one sequence, or every query_len == 1).
    q_pad_index: torch.Tensor | None  # [num_seqs * max_query_len] int64
    # Index into padded output rows that picks the group's tokens back; None when unpadded.
    out_index: torch.Tensor | None  # [group_tokens] int64
    # Physical blocks to gather, num_ctx_blocks per sequence; None = the new K/V are the
    # whole context (single sequence without cached prefix): no gather at all.
    block_ids: torch.Tensor | None  # [num_seqs * num_ctx_blocks] int64
    num_ctx_blocks: int
    kv_len: int  # padded context length (longest context in the group)
    attn_mask: torch.Tensor | None  # [num_seqs, 1, max_query_len, kv_len] additive (0 / -inf)
    # Gathered rows past a sequence's end (stale slots, padding blocks), zeroed after each
    # gather: masked keys still enter the matmuls, and 0 * NaN from a stale slot is NaN.
    pad_rows: torch.Tensor | None  # [num_padded] int64 rows of the [num_seqs * span] buffer
    is_causal: bool
    # The same masks for the native kernel (host int64): context length of each sequence, and
    # for several new tokens the cached prefix before them (query j sees keys < prefix + j + 1).
    kv_lens: torch.Tensor | None = None  # [num_seqs]
    causal_offsets: torch.Tensor | None = None  # [num_seqs]; None: one new token each


@dataclass(slots=True)
class _RowGather:
    """K/V of `num_segs` token ranges, gathered into a contiguous [num_segs, Hkv, kv_len, D]."""

    # Rows of `cache.view(-1, head_dim)` (slot * Hkv + kv head) in (segment, head, position)
    # order; positions past a segment's length repeat its last token.
    rows: torch.Tensor  # [num_segs * Hkv * kv_len] int64
    num_segs: int
    kv_len: int
    attn_mask: torch.Tensor | None  # [num_segs, 1, 1, kv_len] additive; None: all segments full
    lengths: torch.Tensor  # [num_segs] int64 on the host: each segment's tokens (the native kernel's mask)
    # The same segments as the native paged kernel reads them in place (host int64): each
    # segment's block table row and its first position there.
    tables: torch.Tensor  # [num_segs, width]
    starts: torch.Tensor  # [num_segs]
    offset: int = 0  # first row of this gather in the step's decode gather

    @property
    def num_rows(self) -> int:
        return int(self.rows.shape[0])


@dataclass(slots=True)
class _Cascade:
    """Decode sequences sharing prefix blocks: prefix once per group, suffix per member, merged."""

    members: torch.Tensor  # [num_members] decode positions of the grouped sequences, by group
    num_groups: int
    max_members: int  # group size the prefix queries are padded to
    # Prefix queries [G, Hkv, max_members * r] = q[prefix_q_seq, prefix_q_head] (decode position,
    # query head): KV head h of group g reads the r query heads h * r + j of each member, slots
    # past a group's size repeat its first member (computed, never read back).
    prefix_q_seq: torch.Tensor
    prefix_q_head: torch.Tensor
    # Each member's prefix result: o_prefix[pick_group, pick_head, pick_slot] -> [members, Hkv, r].
    pick_group: torch.Tensor
    pick_head: torch.Tensor
    pick_slot: torch.Tensor
    prefix: _RowGather  # one segment per group: its shared blocks (gathered apart, see PrefixKVStore)
    # Suffix call. combined: one segment per decode sequence in decode order, a member's being
    # its context after the shared blocks, an ungrouped one's its whole context (one padded
    # call for both); else one segment per member (members order), ungrouped ones go `plain`.
    rest: _RowGather
    combined: bool
    prefix_key: tuple  # (shared blocks per group, their block ids): what `prefix` reads
    prefix_blocks: torch.Tensor  # [sum(shared)] int64 those block ids
    group_blocks: list[tuple[int, ...]]  # each group's shared blocks (what PackedPrefixes keys by)
    # The fused native kernel's view (host int64): group g's members' decode positions, -1 past
    # its size; every decode sequence's block table row, first own position (after its group's
    # prefix, 0 when in no group) and own tokens from there.
    group_members: torch.Tensor  # [G, max_members]
    seq_tables: torch.Tensor  # [num_seqs, width]
    seq_starts: torch.Tensor  # [num_seqs]
    seq_lens: torch.Tensor  # [num_seqs]


@dataclass(slots=True)
class _PackedExtends:
    """Chunks after a cached prefix that attend over the prefix packed for the AMX tiles."""

    starts: torch.Tensor  # [n] int64 host: each chunk's first packed token
    lens: torch.Tensor  # [n] int64 host: its new tokens
    prefix: _RowGather  # each chunk's cached prefix (whole blocks), gathered when not kept packed
    prefix_blocks: list[tuple[int, ...]]  # those blocks (what PackedPrefixes keys by)


@dataclass(slots=True)
class _Decode:
    """Plan of the step's decode sequences (one new token each)."""

    num_seqs: int
    rows: torch.Tensor | None  # packed tokens of the decode sequences, None = all tokens
    gather_rows: torch.Tensor  # [total] the cache rows read besides the cascade prefixes, back to back
    plain: _RowGather | None  # ungrouped sequences, one SDPA call over their whole contexts
    plain_seqs: torch.Tensor | None  # their decode positions; None = all decode sequences
    cascade: _Cascade | None


class TorchAttentionBackend(AttentionBackend):
    """Paged attention with `torch.nn.functional.scaled_dot_product_attention` and matmuls.

    `cascade`: "auto" (default) attends decode sequences sharing prefix blocks as a cascade
    when the cost model above says it is cheaper, "always" whenever such groups exist, "never"
    not at all. `prefix_store_bytes` bounds the copies of cascade prefixes kept across steps
    (`PrefixKVStore`; 0 gathers them in every layer of every step). `decode_gather="blocks"`
    plans decode sequences like extend ones (block-by-block gather, SDPA on a transposed view,
    no cascade), the path before the cascade, kept for comparisons (bench/attention_bench.py).

    `kernels`: "auto" (default) attends with model_service/native's kernel where it is built and
    runs (AVX-512 CPUs; `native.unavailable_reason()`): cascade prefixes and suffixes, extend
    chunks, decodes, and in 16-bit dtypes single sequences too. In float32 a step of one
    sequence (a prompt without cached prefix, or one decode) keeps torch's result: bitwise dense
    attention, as transformers computes it; such prompts take native/prompt_attention's kernel,
    which sums in torch's order (probed at first use; lengths it does not take keep torch's
    call). "torch" never uses the native kernels.
    """

    name = "torch"

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, *, cascade: str = "auto",
                 min_shared_blocks: int = CASCADE_MIN_SHARED_BLOCKS, decode_gather: str = "rows",
                 prefix_store_bytes: int = PREFIX_STORE_MAX_BYTES, kernels: str = "auto") -> None:
        super().__init__(num_q_heads, num_kv_heads, head_dim, block_size, dtype, device)
        if num_q_heads % num_kv_heads != 0:
            raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        if decode_gather not in ("rows", "blocks"):
            raise ValueError(f"decode_gather must be 'rows' or 'blocks', got {decode_gather!r}")
        if cascade not in CASCADE_MODES:
            raise ValueError(f"cascade must be one of {', '.join(CASCADE_MODES)}, got {cascade!r}")
        if kernels not in KERNEL_MODES:
            raise ValueError(f"kernels must be one of {', '.join(KERNEL_MODES)}, got {kernels!r}")
        self._enable_gqa = num_q_heads != num_kv_heads
        # The kernels' contracts and start-up probes: model_service/native/registry.py.
        self.native = (kernels == "auto" and native.supports(dtype, num_q_heads, num_kv_heads, head_dim, device)
                       and registry.active("attention", num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                           head_dim=head_dim))
        self.native_kv_write = self.native and registry.active("kv_write", num_kv_heads=num_kv_heads,
                                                               head_dim=head_dim)
        # Fresh float32 prompts: the native kernel bitwise torch's call (where `_prompt_kernel_for` says so).
        self.prompt_kernel = kernels == "auto" and prompt_attention.supports(dtype, num_q_heads, num_kv_heads,
                                                                             head_dim, device)
        # bf16 calls of at least this many queries per head run on the native kernel's AMX tiles
        # (faster than torch's SDPA and the row kernels wherever the CPU has them); None: never.
        self.bf16_tiles_from = (native.attention_tiles_min_queries(head_dim)
                                if self.native and dtype == torch.bfloat16 and device.type == "cpu" else None)
        # Other fresh bf16 prompts: torch's SDPA where a timing run found it faster here, else native.
        self.bf16_prompts_on_sdpa = (self.native and dtype == torch.bfloat16 and device.type == "cpu"
                                     and sdpa_faster_for_bf16_prompts(num_q_heads, num_kv_heads, head_dim))
        # bf16 chunks after a cached prefix (several new tokens): likewise, timed on their own shape.
        self.bf16_extends_on_sdpa = (self.native and dtype == torch.bfloat16 and device.type == "cpu"
                                     and sdpa_faster_for_bf16_extends(num_q_heads, num_kv_heads, head_dim))
        self.cascade = cascade if decode_gather == "rows" else "never"
        self.min_shared_blocks = max(1, min_shared_blocks)
        self.decode_gather = decode_gather
        self._slot_mapping: torch.Tensor | None = None
        # The packed tokens whose K/V is written and their slots (layout.written_rows): None and
        # the whole slot mapping, unless the step recomputes cached tokens (their K/V stays).
        self._written: torch.Tensor | None = None
        self._write_slots: torch.Tensor | None = None
        self._decode: _Decode | None = None
        self._groups: list[_Group] = []
        self._num_tokens = 0
        # Gather destinations, flat and grow-only: shared by every layer and group of a step and
        # kept across steps (a fresh large CPU allocation per layer costs page faults).
        self._k_scratch: torch.Tensor | None = None  # allocated by plan()
        self._v_scratch: torch.Tensor | None = None
        self.prefix_store = PrefixKVStore(prefix_store_bytes)
        # bf16 on AMX tiles: cascade prefixes kept packed for the tiles, prefix by prefix.
        self.packed_prefixes = (PackedPrefixes(block_size, prefix_store_bytes)
                                if self.bf16_tiles_from is not None else None)
        self._packed_tiles = False  # this step reads prefixes packed for the tiles (set by plan())

    # ------------------------------------------------------------------ plan
    def plan(self, layout: BatchLayout) -> None:
        """Build gather indices, groups, permutations and masks shared by all layers of the step."""
        query_lens = layout.query_lens_cpu
        seq_lens = layout.seq_lens_cpu
        if not seq_lens or len(query_lens) != len(seq_lens):
            raise ValueError("a step needs at least one sequence and one query length per sequence")
        if any(q < 1 or q > s for q, s in zip(query_lens, seq_lens, strict=True)):
            raise ValueError("every sequence needs 1 <= query_len <= seq_len")
        self._slot_mapping = layout.slot_mapping.to(device=self.device, dtype=torch.long)
        self._num_tokens = layout.num_tokens
        if sum(query_lens) != self._num_tokens:
            raise ValueError(f"query lengths sum to {sum(query_lens)}, slot_mapping has {self._num_tokens}")
        self._written, self._write_slots = None, self._slot_mapping
        if layout.written_rows is not None:
            self._written = layout.written_rows.to(device=self.device, dtype=torch.long)
            self._write_slots = self._slot_mapping.index_select(0, self._written)

        qlens = torch.tensor(query_lens, dtype=torch.long)  # [batch]
        slens = torch.tensor(seq_lens, dtype=torch.long)  # [batch]
        is_decode = qlens == 1  # [batch]
        num_decode = int(is_decode.sum())
        batch = len(query_lens)
        self._decode, self._groups, self._packed_extends = None, [], None
        # Asked per step: tests and the start-up timing turn the tiles off for a while.
        self._packed_tiles = self.packed_prefixes is not None and native.cascade_on_tiles(self.head_dim)
        if num_decode == batch or num_decode == 0:
            if num_decode and self.decode_gather == "rows":
                self._decode = self._plan_decode(layout, None, slens, None)
            elif num_decode:
                self._groups = [self._plan_group(layout, None, qlens, slens)]
            else:
                self._groups = self._plan_extends(layout, torch.arange(batch), qlens, slens)
        else:
            # Mixed step: decode rows and extend rows are attended separately.
            starts = torch.cumsum(qlens, 0) - qlens  # [batch]
            token_seq, _ = segments(qlens)  # [num_tokens] sequence of each packed token
            dec_idx = torch.nonzero(is_decode).flatten()  # [num_decode]
            ext_idx = torch.nonzero(~is_decode).flatten()  # [batch - num_decode]
            dec_rows = starts[dec_idx]  # packed token of each decode sequence
            ext_rows = torch.nonzero(~is_decode[token_seq]).flatten()  # packed tokens of extend sequences
            if self.decode_gather == "rows":
                self._decode = self._plan_decode(layout, dec_idx, slens[dec_idx], dec_rows)
            else:
                self._groups.append(self._plan_group(layout, dec_idx, qlens[dec_idx], slens[dec_idx], dec_rows))
            self._groups += self._plan_extends(layout, ext_idx, qlens, slens, ext_rows)
        # One scratch for the step: the decode gathers side by side, each extend group's gather
        # from the start (run one after another, each consumed before the next one).
        need = [g.num_seqs * g.num_ctx_blocks * self.block_size * self.num_kv_heads * self.head_dim
                for g in self._groups]
        c = self._decode.cascade if self._decode is not None else None
        if self._decode is not None:  # the prefixes' rows after the others, for when they are not kept
            rows = int(self._decode.gather_rows.shape[0]) + (c.prefix.num_rows if c is not None else 0)
            need.append(rows * self.head_dim)
        if self._packed_extends is not None:  # their prefixes not kept packed, gathered from the start
            need.append(self._packed_extends.prefix.num_rows * self.head_dim)
        # Only slots really written invalidate kept prefixes (a recomputed hit's cached ones are not).
        if self.packed_prefixes is not None:
            self.packed_prefixes.begin_step(self._write_slots)
        if c is not None and not self._packed_tiles:
            self.prefix_store.begin_step(c.prefix_key, c.prefix_blocks, self._write_slots, self.block_size)
        else:
            self.prefix_store.begin_step(None, None, self._write_slots, self.block_size)
        numel = max(need, default=0)
        if self._k_scratch is None or self._k_scratch.numel() < numel:
            self._k_scratch = torch.empty(numel, dtype=self.dtype, device=self.device)
            self._v_scratch = torch.empty(numel, dtype=self.dtype, device=self.device)

    def _take_packed_extends(self, layout: BatchLayout, seq_idx: torch.Tensor, qlens: torch.Tensor,
                             slens: torch.Tensor) -> torch.Tensor:
        """Plans, as `self._packed_extends`, the extend sequences `seq_idx` that attend over their
        cached prefix packed for the AMX tiles (bf16 where the tiles run, a prefix of whole blocks,
        at least PACKED_EXTEND_MIN_BLOCKS, and no cached token recomputed in the step); returns the
        others."""
        if not self._packed_tiles or self._written is not None:
            return seq_idx
        prefix = slens[seq_idx] - qlens[seq_idx]  # [n] cached tokens
        bs = self.block_size
        take = (prefix >= PACKED_EXTEND_MIN_BLOCKS * bs) & (prefix % bs == 0)
        if not bool(take.any()):
            return seq_idx
        seqs, lengths = seq_idx[take], prefix[take]
        tables = layout.block_tables.index_select(0, seqs.to(layout.block_tables.device)).to("cpu", torch.long)
        gather = self._row_gather(tables, torch.zeros_like(lengths), lengths)
        blocks = [tuple(row[:n // bs]) for row, n in zip(tables.tolist(), lengths.tolist(), strict=True)]
        starts = (torch.cumsum(qlens, 0) - qlens)[seqs]
        self._packed_extends = _PackedExtends(starts.contiguous(), qlens[seqs].contiguous(), gather, blocks)
        return seq_idx[~take]

    def _plan_extends(self, layout: BatchLayout, seq_idx: torch.Tensor, qlens: torch.Tensor,
                      slens: torch.Tensor, rows: torch.Tensor | None = None) -> list[_Group]:
        """SDPA calls for the extend sequences `seq_idx` (of all `qlens`/`slens`; `rows`: their
        packed tokens, None when they are all the step's tokens): one padded call for the chunks
        under EXTEND_ALONE_TOKENS, one call each for the longer ones. Those that attend over a
        prefix packed for the AMX tiles are planned apart first (`_take_packed_extends`)."""
        rest = self._take_packed_extends(layout, seq_idx, qlens, slens)
        if rest.numel() == 0:
            return []
        if rest.numel() < seq_idx.numel():
            seq_idx, rows = rest, _rows_of(rest, qlens)
        q = qlens[seq_idx]
        alone = q >= EXTEND_ALONE_TOKENS
        num_calls = int(alone.sum()) + int(not bool(alone.all()))
        if num_calls == 1:
            if rows is None:
                return [self._plan_group(layout, None, qlens, slens)]
            return [self._plan_group(layout, seq_idx, q, slens[seq_idx], rows)]
        if rows is None:
            rows = torch.arange(int(qlens.sum()))
        starts = torch.cumsum(q, 0) - q  # [n] first token of each sequence within `rows`
        parts = [torch.nonzero(~alone).flatten()] + [i.view(1) for i in torch.nonzero(alone).flatten()]
        groups = []
        for part in parts:
            if part.numel() == 0:
                continue
            tok_seq, tok_offset = segments(q[part])  # [part tokens] each
            part_rows = rows[starts[part][tok_seq] + tok_offset]
            groups.append(self._plan_group(layout, seq_idx[part], q[part], slens[seq_idx[part]], part_rows))
        return groups

    def _plan_decode(self, layout: BatchLayout, seq_idx: torch.Tensor | None, slens: torch.Tensor,
                     rows: torch.Tensor | None) -> _Decode:
        """Plan the decode sequences `seq_idx` (None = all): cascade groups and plain SDPA."""
        dev, bs, hkv = self.device, self.block_size, self.num_kv_heads
        n = int(slens.shape[0])
        nb = -(-int(slens.max()) // bs)
        tables = layout.block_tables
        if nb > tables.shape[1]:
            raise ValueError(f"a sequence of {int(slens.max())} tokens needs {nb} blocks, "
                             f"block_tables has {tables.shape[1]}")
        if seq_idx is not None:
            tables = tables.index_select(0, seq_idx.to(tables.device))
        tables = tables[:, :nb].to("cpu", torch.long)  # [n, nb]

        group = shared = None
        if self.cascade != "never" and n >= 2:
            # Shareable: full blocks before the one this step's token is written to.
            group, shared = shared_prefix_groups(tables, (slens - 1) // bs, self.min_shared_blocks)
        combined = False
        if group is not None and shared is not None and shared.numel():
            combined, worth = self._cascade_cost(group, shared, slens)
            if not (worth or self.cascade == "always"):
                group = shared = None
        if group is None or shared is None or shared.numel() == 0:
            plain = self._row_gather(tables, torch.zeros(n, dtype=torch.long), slens)
            return _Decode(num_seqs=n, rows=_to(rows, dev), gather_rows=plain.rows, plain=plain,
                           plain_seqs=None, cascade=None)

        num_groups = int(shared.shape[0])
        sizes = torch.bincount(group[group >= 0], minlength=num_groups)  # [G]
        first = torch.cumsum(sizes, 0) - sizes  # [G] first member of each group in `members`
        members = torch.argsort(torch.where(group >= 0, group, num_groups), stable=True)[:int(sizes.sum())]
        member_group = group[members]  # [num_members]
        rank = torch.arange(members.shape[0]) - first[member_group]  # [num_members] rank in its group
        gm, r = int(sizes.max()), self.num_q_heads // hkv
        # Prefix query slot (g, h, m * r + j) <- member first[g] + min(m, size - 1), head h * r + j.
        slot_member = first[:, None] + torch.minimum(torch.arange(gm)[None, :], sizes[:, None] - 1)  # [G, gm]
        prefix_q_seq = members[slot_member][:, None, :, None].expand(num_groups, hkv, gm, r)
        prefix_q_head = (torch.arange(hkv)[:, None, None] * r + torch.arange(r)[None, None, :]).expand(hkv, gm, r)
        pick_head = torch.arange(hkv)[None, :, None]  # [1, Hkv, 1]
        pick_slot = (rank[:, None, None] * r + torch.arange(r)[None, None, :])  # [members, 1, r]

        prefix_len = shared * bs  # [G] tokens
        # Group g's prefix: its first member's leading blocks (identical for every member).
        prefix = self._row_gather(tables[members[first]], torch.zeros(num_groups, dtype=torch.long), prefix_len)
        start = torch.where(group >= 0, prefix_len[group.clamp(min=0)], 0)  # [n] first position after the prefix
        plain = plain_seqs = None
        if combined:
            parts = [self._row_gather(tables, start, slens - start)]
        else:
            parts = [self._row_gather(tables[members], start[members], slens[members] - start[members])]
            ungrouped = torch.nonzero(group < 0).flatten()
            if ungrouped.numel():
                plain = self._row_gather(tables[ungrouped], torch.zeros(ungrouped.shape[0], dtype=torch.long),
                                         slens[ungrouped])
                plain_seqs = ungrouped
                parts.append(plain)
        offset = 0
        for part in parts + [prefix]:  # the prefixes last: gathered apart, or not at all
            part.offset = offset
            offset += part.num_rows
        # The prefixes' identity for the store: each group's shared blocks (what its rows read).
        prefix_tables = tables[members[first], :int(shared.max())]  # [G, max shared]
        has_block = torch.arange(prefix_tables.shape[1])[None, :] < shared[:, None]
        prefix_blocks = prefix_tables[has_block]  # [sum(shared)]
        shared_list, block_list = shared.tolist(), prefix_blocks.tolist()
        prefix_key = (tuple(shared_list), tuple(block_list))
        ends = list(itertools.accumulate(shared_list))
        group_blocks = [tuple(block_list[end - size:end]) for size, end in zip(shared_list, ends, strict=True)]
        cascade = _Cascade(
            members=_to(members, dev), num_groups=num_groups, max_members=gm,
            prefix_q_seq=_to(prefix_q_seq.reshape(num_groups, hkv, gm * r), dev),
            prefix_q_head=_to(prefix_q_head.reshape(1, hkv, gm * r), dev),
            pick_group=_to(member_group[:, None, None], dev), pick_head=_to(pick_head, dev),
            pick_slot=_to(pick_slot, dev), prefix=prefix, rest=parts[0], combined=combined,
            prefix_key=prefix_key, prefix_blocks=_to(prefix_blocks, dev), group_blocks=group_blocks,
            group_members=torch.where(torch.arange(gm)[None, :] < sizes[:, None], members[slot_member], -1),
            seq_tables=tables.contiguous(), seq_starts=start.contiguous(), seq_lens=(slens - start).contiguous())
        return _Decode(num_seqs=n, rows=_to(rows, dev), gather_rows=torch.cat([p.rows for p in parts]),
                       plain=plain, plain_seqs=_to(plain_seqs, dev), cascade=cascade)

    def _cascade_cost(self, group: torch.Tensor, shared: torch.Tensor, slens: torch.Tensor) -> tuple[bool, bool]:
        """(one combined suffix call?, cascade cheaper than none?) by the cost model above.

        group [n], shared [G] (blocks), slens [n]: host int64. Costs are K/V tokens gathered and
        attended, padding included.
        """
        grouped = group >= 0
        prefix_len = shared * self.block_size  # [G]
        rest = slens - torch.where(grouped, prefix_len[group.clamp(min=0)], 0)  # [n] suffix or whole context
        n, num_members = int(slens.shape[0]), int(grouped.sum())
        combined_cost = n * int(rest.max())
        split_cost = num_members * int(rest[grouped].max())
        if num_members < n:
            split_cost += (n - num_members) * int(slens[~grouped].max()) + SPLIT_FIXED_TOKENS
        cascade_cost = (CASCADE_FIXED_TOKENS + int(shared.shape[0]) * int(prefix_len.max())
                        + min(combined_cost, split_cost))
        return combined_cost <= split_cost, cascade_cost < n * int(slens.max())

    def _row_gather(self, tables: torch.Tensor, start: torch.Tensor, length: torch.Tensor) -> _RowGather:
        """Gather plan of positions start[i] : start[i] + length[i] of table row i.

        `tables` [m, nb], `start` [m] (block-aligned), `length` [m] (>= 1): host int64. Built
        per block, so that only three ops touch tensors of the gather's size.
        """
        bs, hkv = self.block_size, self.num_kv_heads
        m, span = int(length.shape[0]), int(length.max())
        nbs = -(-span // bs)
        first = start // bs  # [m]
        last = (start + length - 1) // bs  # [m] block column of each segment's last token
        cols = torch.minimum(first[:, None] + torch.arange(nbs)[None, :], last[:, None])  # [m, nbs]
        base = tables.gather(1, cols) * (bs * hkv)  # [m, nbs] row of slot 0, head 0 of each block
        within = torch.arange(bs)[None, :] * hkv + torch.arange(hkv)[:, None]  # [Hkv, bs]
        rows = (base[:, None, :, None] + within[None, :, None, :]).view(m, hkv, nbs * bs)[:, :, :span]
        attn_mask = None
        if bool((length != span).any()):
            valid = torch.arange(span)[None, :] < length[:, None]  # [m, span]
            # Positions past a segment's end read its last token (finite), masked out.
            last_row = tables.gather(1, last[:, None]) * (bs * hkv) + ((start + length - 1) % bs)[:, None] * hkv
            rows = torch.where(valid[:, None, :], rows, last_row[:, :, None] + torch.arange(hkv)[None, :, None])
            attn_mask = self._additive(valid)[:, None, None, :]  # [m, 1, 1, span]
        return _RowGather(rows=rows.reshape(-1).to(self.device, non_blocking=True), num_segs=m, kv_len=span,
                          attn_mask=_to(attn_mask, self.device), lengths=length.contiguous(),
                          tables=tables.contiguous(), starts=start.contiguous())

    def _plan_group(self, layout: BatchLayout, seq_idx: torch.Tensor | None, qlens: torch.Tensor,
                    slens: torch.Tensor, rows: torch.Tensor | None = None) -> _Group:
        """Plan one SDPA call for the sequences `seq_idx` (None = all, in order), block-by-block gather."""
        dev = self.device
        n = int(qlens.shape[0])
        max_q = int(qlens.max())
        kv_len = int(slens.max())
        prefix = slens - qlens  # [n] cached tokens before this step's tokens

        # Single sequence, nothing cached: the new K/V are the entire context.
        if n == 1 and int(prefix[0]) == 0:
            return _Group(num_seqs=1, max_query_len=max_q, rows=_to(rows, dev), q_pad_index=None,
                          out_index=None, block_ids=None, num_ctx_blocks=0, kv_len=kv_len,
                          attn_mask=None, pad_rows=None, is_causal=max_q > 1, kv_lens=slens.contiguous(),
                          causal_offsets=prefix.contiguous() if max_q > 1 else None)

        nb = -(-kv_len // self.block_size)
        tables = layout.block_tables
        if nb > tables.shape[1]:
            raise ValueError(f"a sequence of {kv_len} tokens needs {nb} blocks, block_tables has {tables.shape[1]}")
        if seq_idx is not None:
            tables = tables.index_select(0, seq_idx.to(tables.device))
        block_ids = tables[:, :nb].reshape(-1).to(device=dev, dtype=torch.long)  # [n * nb]

        q_pad_index = out_index = None
        if n > 1 and max_q > 1:
            starts = torch.cumsum(qlens, 0) - qlens  # [n] within the group's tokens
            j = torch.arange(max_q)
            q_pad_index = (starts[:, None] + torch.minimum(j[None, :], qlens[:, None] - 1)).reshape(-1)
            tok_seq, tok_offset = segments(qlens)  # [group_tokens] each
            out_index = tok_seq * max_q + tok_offset

        attn_mask = None
        pos = torch.arange(kv_len)  # [kv_len]
        if max_q > 1:
            # Query j of sequence b sits at position prefix_b + j and sees keys up to there.
            # Padded query rows see the whole context (never an empty row) and are dropped.
            q_pos = prefix[:, None] + torch.arange(max_q)[None, :]  # [n, max_q]
            last_key = torch.minimum(q_pos, slens[:, None] - 1)  # [n, max_q]
            attn_mask = self._additive(pos[None, None, :] <= last_key[:, :, None])[:, None]  # [n, 1, max_q, kv_len]
            if self._extend_on_sdpa(max_q):  # for the query heads of a KV head folded into rows (_attend)
                attn_mask = attn_mask.repeat(1, 1, self.num_q_heads // self.num_kv_heads, 1)  # [n, 1, r * max_q, kv_len]
        elif bool((slens != kv_len).any()):
            attn_mask = self._additive(pos[None, :] < slens[:, None])[:, None, None, :]  # [n, 1, 1, kv_len]

        pad_rows = None
        if bool((slens < kv_len).any()):  # gathered positions past a sequence's end
            pad_seq, pad_pos = (pos[None, :] >= slens[:, None]).nonzero(as_tuple=True)  # [num_padded] each
            pad_rows = pad_seq * (nb * self.block_size) + pad_pos

        return _Group(
            num_seqs=n, max_query_len=max_q, rows=_to(rows, dev), q_pad_index=_to(q_pad_index, dev),
            out_index=_to(out_index, dev), block_ids=block_ids, num_ctx_blocks=nb, kv_len=kv_len,
            attn_mask=_to(attn_mask, dev), pad_rows=_to(pad_rows, dev), is_causal=False,
            kv_lens=slens.contiguous(), causal_offsets=prefix.contiguous() if max_q > 1 else None,
        )

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """Bool mask -> additive mask in the model dtype (SDPA converts bool masks every call)."""
        zero = torch.zeros((), dtype=self.dtype)
        return torch.where(allowed, zero, torch.full((), float("-inf"), dtype=self.dtype))

    # --------------------------------------------------------------- forward
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """Write k/v into the planned slots, then attend (see `AttentionBackend.forward`)."""
        if self._slot_mapping is None:
            raise RuntimeError("plan() must be called before forward()")
        if q.shape[0] != self._num_tokens:
            raise ValueError(f"q has {q.shape[0]} tokens, the plan has {self._num_tokens}")
        d = self._decode
        stored = None
        if d is not None and d.cascade is not None and not self._packed_tiles:
            stored = self.prefix_store.lookup(k_cache, v_cache)  # before this step's write
        if self.packed_prefixes is not None:
            self.packed_prefixes.before_write(k_cache, v_cache)
        k_new, v_new, slots = k, v, self._write_slots
        if self._written is not None:  # tokens recomputed over a cache hit: their cached K/V stays as is
            k_new, v_new = k.index_select(0, self._written), v.index_select(0, self._written)
        assert slots is not None
        if slots.numel() == 0:
            pass
        elif self.native_kv_write and native.takes_kv_rows(k_new) and native.takes_kv_rows(v_new):
            native.write_kv(k_new, v_new, k_cache, v_cache, slots)
        else:  # [num_blocks * block_size, num_kv_heads, head_dim] views of the paged cache
            k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, k_new)
            v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, v_new)
        if self.packed_prefixes is not None:
            self.packed_prefixes.after_write(k_cache, v_cache)

        packed = self._packed_extends
        if d is not None and not self._groups and packed is None:
            return self._attend_decode(d, q, k_cache, v_cache, scale, stored)
        if d is None and len(self._groups) == 1 and packed is None:
            return self._attend(self._groups[0], q, k, v, k_cache, v_cache, scale)
        out = q.new_empty(q.shape[0], self.num_q_heads, self.head_dim)  # [num_tokens, Hq, D]
        if d is not None:
            assert d.rows is not None
            out.index_copy_(0, d.rows, self._attend_decode(d, q.index_select(0, d.rows), k_cache, v_cache, scale,
                                                            stored))
        for group in self._groups:
            rows = group.rows
            assert rows is not None
            if group.block_ids is None:  # attends over its own new K/V
                gk, gv = k.index_select(0, rows), v.index_select(0, rows)
            else:  # reads K/V from the cache
                gk, gv = k, v
            out.index_copy_(0, rows, self._attend(group, q.index_select(0, rows), gk, gv, k_cache, v_cache, scale))
        if packed is not None:  # last: its gather takes the scratch from the start
            assert self.packed_prefixes is not None
            tiles = self.packed_prefixes.tiles(k_cache, v_cache, packed.prefix_blocks, packed.prefix.lengths,
                                               self._prefix_gather(packed.prefix, k_cache, v_cache))
            native.attend_extends_tiles(q, k, v, packed.starts, packed.lens, tiles, packed.prefix.lengths, scale, out)
        return out

    def _attend_decode(self, d: _Decode, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       scale: float, stored: PrefixCopy | None = None) -> torch.Tensor:
        """Decode attention. q: [num_decode, Hq, D] in decode order; returns the same shape.
        stored: this layer's still valid copy of the cascade prefixes, if the store has one."""
        assert self._k_scratch is not None and self._v_scratch is not None
        hd = self.head_dim
        hkv, r = self.num_kv_heads, self.num_q_heads // self.num_kv_heads
        c = d.cascade
        # The native kernel reads the suffixes and ungrouped contexts in place from the paged
        # cache; float32 single decodes keep torch's call (bitwise dense attention) on a gather.
        paged = self.native and not (c is None and d.num_seqs == 1 and q.dtype == torch.float32)
        if not paged:  # every other K/V row the decode part reads, in one gather each (K, V)
            total = int(d.gather_rows.shape[0])
            k_rows = self._k_scratch[:total * hd].view(total, hd)
            v_rows = self._v_scratch[:total * hd].view(total, hd)
            torch.index_select(k_cache.view(-1, hd), 0, d.gather_rows, out=k_rows)
            torch.index_select(v_cache.view(-1, hd), 0, d.gather_rows, out=v_rows)

        def attend_rows(g: _RowGather, q_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """q_rows [num_segs, Hkv, r, D] over the segments of g -> (o, lse)."""
            if paged:
                return native.attend_paged(q_rows, k_cache, v_cache, g.tables, g.starts, g.lengths, scale)
            shape = (g.num_segs, hkv, g.kv_len, hd)  # [num_segs, Hkv, kv_len, D] each
            keys = k_rows[g.offset:g.offset + g.num_rows].view(shape)
            values = v_rows[g.offset:g.offset + g.num_rows].view(shape)
            if g is d.plain:
                return self._attend_plain(g, q_rows.reshape(-1, self.num_q_heads, hd), keys, values, scale), None
            return self._attend_lse(q_rows, keys, values, g, scale)

        if c is None:
            assert d.plain is not None
            out, _ = attend_rows(d.plain, q.reshape(-1, hkv, r, hd))
            return out.reshape(q.shape)
        if paged and r <= native.MAX_CASCADE_GROUP:  # one fused call: prefixes, own blocks, ungrouped
            if self._packed_tiles:
                tiles = self._prefix_tiles(c, k_cache, v_cache)
                out, _ = native.attend_cascade_tiles(q.contiguous(), tiles, c.prefix.lengths, c.group_members,
                                                     k_cache, v_cache, c.seq_tables, c.seq_starts, c.seq_lens, scale)
                return out
            prefix_k, prefix_v = self._prefix_kv(c.prefix, k_cache, v_cache, stored)  # [G, Hkv, len, D] each
            out, _ = native.attend_cascade(q.contiguous(), prefix_k, prefix_v, c.prefix.lengths, c.group_members,
                                           k_cache, v_cache, c.seq_tables, c.seq_starts, c.seq_lens, scale)
            return out
        prefix_k, prefix_v = self._prefix_kv(c.prefix, k_cache, v_cache, stored)
        # Prefix: the r heads of every member of group g that read KV head h form one query block.
        qg = q[c.prefix_q_seq, c.prefix_q_head]  # [G, Hkv, max_members * r, D]
        o_pre, lse_pre = self._attend_lse(qg, prefix_k, prefix_v, c.prefix, scale)  # [G, Hkv, gm*r, (D)]
        o_pre = o_pre[c.pick_group, c.pick_head, c.pick_slot]  # [members, Hkv, r, D]
        lse_pre = lse_pre[c.pick_group, c.pick_head, c.pick_slot]  # [members, Hkv, r]
        # The rest: members over their own blocks after the shared ones (query head h * r + j
        # reads KV head h), in the combined call ungrouped sequences over their whole context.
        if c.combined:
            o_rest, lse_rest = attend_rows(c.rest, q.reshape(-1, hkv, r, hd))
            out = o_rest.reshape(d.num_seqs, self.num_q_heads, hd)  # ungrouped rows are final
            o_suf, lse_suf = o_rest.index_select(0, c.members), lse_rest.index_select(0, c.members)
        else:
            q_suf = q.index_select(0, c.members).view(-1, hkv, r, hd)  # [members, Hkv, r, D]
            o_suf, lse_suf = attend_rows(c.rest, q_suf)
            out = q.new_empty(d.num_seqs, self.num_q_heads, hd)
            if d.plain is not None:
                assert d.plain_seqs is not None
                plain_o, _ = attend_rows(d.plain, q.index_select(0, d.plain_seqs).view(-1, hkv, r, hd))
                out.index_copy_(0, d.plain_seqs, plain_o.reshape(-1, self.num_q_heads, hd))
        merged = merge_states(o_pre, lse_pre, o_suf, lse_suf)  # [members, Hkv, r, D]
        return out.index_copy_(0, c.members, merged.view(-1, self.num_q_heads, hd))

    def _on_tiles(self, max_q: int) -> bool:
        """Whether a bf16 call of `max_q` queries per head runs on the native kernel's AMX tiles."""
        return self.bf16_tiles_from is not None and max_q >= self.bf16_tiles_from

    def _extend_on_sdpa(self, max_q: int) -> bool:
        """Whether a bf16 chunk of `max_q` queries after a cached prefix goes to torch's SDPA."""
        return self.bf16_extends_on_sdpa and max_q > 1 and not self._on_tiles(max_q)

    def _use_native(self, one_sequence: bool, dtype: torch.dtype) -> bool:
        """Whether a call goes to the native kernel: not in float32 when it attends one sequence over
        its whole context (torch's call is then bitwise the dense attention transformers computes)."""
        return self.native and not (one_sequence and dtype == torch.float32)

    def _prompt_kernel_for(self, length: int, scale: float) -> bool:
        """Whether a fresh float32 prompt of `length` tokens takes the native kernel that is bitwise
        torch's call (the registry's probe, once per scale and thread count, on the first such prompt)."""
        return (self.prompt_kernel and prompt_attention.takes_length(length)
                and registry.active("prompt_attention", num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads,
                                    head_dim=self.head_dim, scale=scale))

    def _attend_lse(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, g: _RowGather,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention with log-sum-exp of q [num_segs, Hkv, rows, D] over the gathered segments of `g`."""
        if self.native:
            return native.attend(q, keys, values, g.lengths, None, scale)
        return attention_with_lse(q, keys, values, g.attn_mask, scale)

    def _prefix_kv(self, g: _RowGather, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   stored: PrefixCopy | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The cascade prefixes' K/V [G, Hkv, len, D]: the store's copy, else gathered (into
        buffers the store keeps when it has room, else into the scratch after the other rows)."""
        if stored is not None:
            self.prefix_store.hits += 1
            self.prefix_store.keep(k_cache, v_cache, stored.k, stored.v)  # our write moved the versions
            return stored.k, stored.v
        self.prefix_store.misses += 1
        shape = (g.num_segs, self.num_kv_heads, g.kv_len, self.head_dim)
        buffers = self.prefix_store.allocate(k_cache, v_cache, shape)
        keep = buffers is not None
        if buffers is None:
            assert self._k_scratch is not None and self._v_scratch is not None
            lo, hi = g.offset * self.head_dim, (g.offset + g.num_rows) * self.head_dim
            buffers = self._k_scratch[lo:hi].view(shape), self._v_scratch[lo:hi].view(shape)
        pk, pv = buffers
        torch.index_select(k_cache.view(-1, self.head_dim), 0, g.rows, out=pk.view(-1, self.head_dim))
        torch.index_select(v_cache.view(-1, self.head_dim), 0, g.rows, out=pv.view(-1, self.head_dim))
        if keep:
            self.prefix_store.keep(k_cache, v_cache, pk, pv)
        return pk, pv

    def _prefix_tiles(self, c: _Cascade, k_cache: torch.Tensor, v_cache: torch.Tensor) -> list[torch.Tensor]:
        """Each group's prefix packed for the AMX tiles (`PackedPrefixes`): kept copies, the others
        gathered into the scratch and packed."""
        assert self.packed_prefixes is not None
        return self.packed_prefixes.tiles(k_cache, v_cache, c.group_blocks, c.prefix.lengths,
                                          self._prefix_gather(c.prefix, k_cache, v_cache))

    def _prefix_gather(self, g: _RowGather, k_cache: torch.Tensor,
                       v_cache: torch.Tensor) -> Callable[[list[int]], tuple[torch.Tensor, torch.Tensor]]:
        """PackedPrefixes' gather of some of g's segments: their K/V [m, Hkv, kv_len, D] in the
        scratch from g's offset."""
        def gather(segs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            assert self._k_scratch is not None and self._v_scratch is not None
            rows = g.rows.view(g.num_segs, -1)[segs].reshape(-1)
            shape = (len(segs), self.num_kv_heads, g.kv_len, self.head_dim)
            lo, hi = g.offset * self.head_dim, (g.offset + rows.numel()) * self.head_dim
            pk, pv = self._k_scratch[lo:hi].view(shape), self._v_scratch[lo:hi].view(shape)
            torch.index_select(k_cache.view(-1, self.head_dim), 0, rows, out=pk.view(-1, self.head_dim))
            torch.index_select(v_cache.view(-1, self.head_dim), 0, rows, out=pv.view(-1, self.head_dim))
            return pk, pv

        return gather

    def _attend_plain(self, g: _RowGather, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      scale: float) -> torch.Tensor:
        """One query per segment over its gathered context. q: [n, Hq, D] -> [n, Hq, D]."""
        hkv, r = self.num_kv_heads, self.num_q_heads // self.num_kv_heads
        if self._use_native(g.num_segs == 1, q.dtype):
            out, _ = native.attend(q.reshape(-1, hkv, r, self.head_dim), keys, values, g.lengths, None, scale)
            return out.view(q.shape)  # [n, Hkv, r, D] -> [n, Hq, D]
        if q.dtype in (torch.bfloat16, torch.float16) and q.device.type == "cpu":
            # The r query heads of each KV head as r query rows: torch's 16-bit CPU flash kernel
            # packs K/V per (sequence, query head), so GQA's one row per head packs every KV head
            # r times over.
            # float32 keeps the GQA call below: for one sequence it is the call dense attention makes.
            out = F.scaled_dot_product_attention(q.reshape(-1, hkv, r, self.head_dim), keys, values,
                                                 attn_mask=g.attn_mask, scale=scale)  # [n, Hkv, r, D]
            return out.reshape(q.shape)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=g.attn_mask, scale=scale,
                                             enable_gqa=self._enable_gqa)  # [n, Hq, 1, D]
        return out.squeeze(2)

    def _attend(self, g: _Group, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """SDPA for one block-gathered group. q: [group_tokens, Hq, D]; returns [group_tokens, Hq, D]."""
        n, max_q = g.num_seqs, g.max_query_len
        extend_on_sdpa = g.block_ids is not None and self._extend_on_sdpa(max_q)
        if g.block_ids is None:
            keys = k.transpose(0, 1).unsqueeze(0)  # [1, Hkv, T, D]
            values = v.transpose(0, 1).unsqueeze(0)
        else:
            assert self._k_scratch is not None and self._v_scratch is not None
            span = g.num_ctx_blocks * self.block_size
            shape = (n * g.num_ctx_blocks, self.block_size, self.num_kv_heads, self.head_dim)
            numel = math.prod(shape)
            k_buf = self._k_scratch[:numel].view(shape)  # [n * nb, bs, Hkv, D]
            v_buf = self._v_scratch[:numel].view(shape)
            torch.index_select(k_cache, 0, g.block_ids, out=k_buf)
            torch.index_select(v_cache, 0, g.block_ids, out=v_buf)
            if g.pad_rows is not None and (not self.native or extend_on_sdpa):  # the native kernel reads no padding
                k_buf.view(-1, self.num_kv_heads, self.head_dim).index_fill_(0, g.pad_rows, 0.0)
                v_buf.view(-1, self.num_kv_heads, self.head_dim).index_fill_(0, g.pad_rows, 0.0)
            keys = k_buf.view(n, span, self.num_kv_heads, self.head_dim)[:, :g.kv_len].transpose(1, 2)
            values = v_buf.view(n, span, self.num_kv_heads, self.head_dim)[:, :g.kv_len].transpose(1, 2)
            # keys, values: [n, Hkv, kv_len, D]
        if max_q == 1:
            queries = q.unsqueeze(2)  # [n, Hq, 1, D]
        elif g.q_pad_index is None:
            queries = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]
        else:
            queries = q.index_select(0, g.q_pad_index).view(n, max_q, self.num_q_heads, self.head_dim)
            queries = queries.transpose(1, 2)  # [n, Hq, max_q, D]
        fresh_prompt = g.block_ids is None and g.is_causal and g.attn_mask is None
        if fresh_prompt and self.bf16_prompts_on_sdpa and q.dtype == torch.bfloat16 and not self._on_tiles(max_q):
            out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale,
                                                 enable_gqa=self._enable_gqa)
        elif extend_on_sdpa:
            # The r query heads of each KV head as r blocks of query rows (torch's 16-bit CPU flash
            # kernel packs K/V per query head: GQA would pack every KV head r times over).
            hkv, r = self.num_kv_heads, self.num_q_heads // self.num_kv_heads
            folded = queries.reshape(n, hkv, r * max_q, self.head_dim)
            out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=g.attn_mask, scale=scale)
            out = out.view(n, self.num_q_heads, max_q, self.head_dim)
        elif self._use_native(g.block_ids is None, q.dtype):
            assert g.kv_lens is not None
            out, _ = native.attend(queries, keys, values, g.kv_lens, g.causal_offsets, scale)
        elif fresh_prompt and self._prompt_kernel_for(keys.shape[2], scale):
            out = prompt_attention.prompt_attention(queries, keys, values, scale)  # bitwise the call below
        else:
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=g.attn_mask,
                                                 is_causal=g.is_causal, scale=scale, enable_gqa=self._enable_gqa)
        # out: [n, Hq, max_q, D] -> [n * max_q, Hq, D]
        out = out.transpose(1, 2).reshape(n * max_q, self.num_q_heads, self.head_dim)
        if g.out_index is not None:
            out = out.index_select(0, g.out_index)  # [group_tokens, Hq, D]
        return out


def _rows_of(seqs: torch.Tensor, qlens: torch.Tensor) -> torch.Tensor:
    """The packed tokens of sequences `seqs` (ascending) of a step whose query lengths are `qlens`."""
    token_seq, _ = segments(qlens)
    keep = torch.zeros(qlens.shape[0], dtype=torch.bool)
    keep[seqs] = True
    return torch.nonzero(keep[token_seq]).flatten()


def _to(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device, non_blocking=True)
