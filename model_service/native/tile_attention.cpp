// radixkv native CPU attention on AMX tiles: the bfloat16 path of radixkv.attend for calls with
// many queries per head (prompts and chunks after a cached prefix), where the CPU has AMX.
//
// Why: a bfloat16 prompt's attention is two products per head (Q K^T, P V) with a softmax between.
// With AVX512-BF16 dot products (attention.cpp) or torch's flash kernel (oneDNN's GEMMs per block)
// the products dominate; on the tile unit a 16 x 16 x 32 product is one instruction, so what is
// left is the softmax in AVX-512, and the kernel is built around keeping that cheap.
//
// Layout. A work item is 16 rows: queries of the query heads that share one KV head, folded
// together (row f: query f % M of head f / M), copied into a zero-padded A tile of Q; keys come in
// blocks of 64 (four 16-key C tiles of S). Before the items run, each (sequence, KV head) has its
// K packed as the B tiles of Q K^T, each tile 1 KB contiguous (pairs of head dims over 16 keys,
// pack_keys), and its V as the B tiles of P V (pairs of keys over head dims: vp[p][d] = (V[2p][d],
// V[2p+1][d])), zero past the sequence's keys, so a block's K and V stream in order and padding
// keys contribute nothing. A cascade decode's prefix pass packs a group's shared prefix the same
// way and runs its members' rows over it (attend_prefix_tiles).
//
// Per item and key block (flash-style online softmax, rows = queries, float32 throughout, base 2):
//   S = Q K^T                                       (tiles: 4 C, 1 A, B tiles rotating)
//   per row: S past the row's last key -> -1e30; m' = max(m, scale2 * max S);
//            P = 2^(scale2 * S - m'); l = l * 2^(m - m') + sum P; P rounded to bfloat16
//   O = O * 2^(m - m') + P V                        (tiles, then one AVX-512 FMA per 16 values)
// with scale2 = scale * log2(e); then o = O / l and lse = ln(2) m + log(l). As in attention.cpp
// and torch's flash kernel, the products are float32 sums of bfloat16 products and P is rounded
// to bfloat16 before P V; the order of the sums is the tile unit's, so results match theirs to
// bfloat16 rounding, not bit for bit.
#include "amx.h"
#include "tile_attention.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

namespace {

using radixkv::LANES;
using radixkv::TILE_BYTES;
using radixkv::TILE_ROWS;

constexpr int64_t KB = 64;           // keys per block: four 16-key C tiles of S
constexpr int64_t PAIR_DIMS = 32;    // head dims per A tile of Q (32 bfloat16)
constexpr int64_t MAX_D = 256;       // head_dim limit (as attention.cpp's)
constexpr int64_t MIN_QUERIES = 16;  // fewer queries per head: attention.cpp's row kernels (or SDPA)
constexpr float FLOOR = -1e30f;      // the running max before any key: finite, so exp(FLOOR - m') is 0, not NaN

std::atomic<bool> allow_tiles{true};

inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

}  // namespace

#ifndef RADIXKV_NO_AMX
namespace {

// r[j] = column j of the 16 x 16 matrix of 32-bit words whose rows r held (unpacks within 128-bit
// lanes, then the lanes regrouped). No gathers: with the Gather Data Sampling mitigation a gather
// costs tens of cycles on Intel CPUs.
inline void transpose_16x16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  __m512i u[16];  // u[4g + e], 128-bit lane L: column 4L + e of rows 4g .. 4g + 3
  for (int g = 0; g < 16; g += 4) {
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44), x1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44), y1 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xEE);
    r[e] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    r[4 + e] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    r[8 + e] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    r[12 + e] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

constexpr int64_t TILE_WORDS = TILE_ROWS * LANES;  // one B tile: 16 rows of 16 words

// K of one (sequence, KV head) as whole B tiles of Q K^T, each 1 KB contiguous (so a block of keys
// streams from memory in order): the tile of keys n0 .. n0 + 15 and head dims d .. d + 31 sits at
// kp + ((n0 / 16) * (D / 32) + d / 32) * 256, its row j = (K[n][d + 2j], K[n][d + 2j + 1]) over the
// 16 keys n. Zero for keys from len to the end of the last 64-key block. k: the head's first key,
// `row` elements between keys.
void pack_keys(const c10::BFloat16* k, int64_t row, int64_t len, int64_t D, uint32_t* kp) {
  const int64_t end = round_up(len, KB);
  __m512i block[16];
  for (int64_t n0 = 0; n0 < end; n0 += LANES)
    for (int64_t d = 0; d < D; d += PAIR_DIMS, kp += TILE_WORDS) {
      for (int64_t i = 0; i < LANES; ++i)
        block[i] = n0 + i < len ? _mm512_loadu_si512(k + (n0 + i) * row + d) : _mm512_setzero_si512();
      transpose_16x16(block);
      for (int64_t j = 0; j < LANES; ++j) _mm512_storeu_si512(kp + j * LANES, block[j]);
    }
}

// V of one (sequence, KV head): vp[p][d] = (V[2p][d], V[2p + 1][d]) for keys < len, zero from
// there to the end of the last 64-key block.
void pack_values(const c10::BFloat16* v, int64_t row, int64_t len, int64_t D, uint32_t* vp) {
  const int64_t end = round_up(len, KB);
  for (int64_t n = 0; n < end; n += 2, vp += D) {
    const auto* lo = reinterpret_cast<const __m256i*>(v + n * row);
    const auto* hi = reinterpret_cast<const __m256i*>(v + (n + 1) * row);
    for (int64_t d = 0; d < D; d += LANES) {
      const __m512i a = n < len ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(lo + d / LANES)) : _mm512_setzero_si512();
      const __m512i b = n + 1 < len ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(hi + d / LANES)) : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + d, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
    }
  }
}

// Every tile 16 rows of 64 bytes: C 0-3, A 4, B 5-7.
RADIXKV_AMX void configure_tiles() {
  radixkv::TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = TILE_ROWS;
    config.colsb[t] = TILE_BYTES;
  }
  radixkv::load_tile_config(config);
}

RADIXKV_AMX void release_tiles() { _tile_release(); }

// A worker's buffers (64-byte aligned rows for the tile loads and stores).
struct Scratch {
  alignas(64) c10::BFloat16 q[TILE_ROWS * MAX_D];  // the item's queries, zero past its rows
  alignas(64) float s[TILE_ROWS * KB];             // S of a block
  alignas(64) c10::BFloat16 p[TILE_ROWS * KB];     // P of a block
  alignas(64) float pv[TILE_ROWS * MAX_D];         // P V of a block
  alignas(64) float o[TILE_ROWS * MAX_D];          // the running O
};

// S[16][64] = Q K^T for keys n0 .. n0 + 63: C tiles 0-3 over D / 32 chunks of head dims.
RADIXKV_AMX inline void scores(const Scratch& w, const uint32_t* kp, int64_t D, int64_t n0, float* s) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t chunks = D / PAIR_DIMS, next = chunks * TILE_WORDS;  // next: the following 16 keys' tile
  const uint32_t* kb = kp + (n0 / LANES) * next;
  for (int64_t c = 0; c < chunks; ++c, kb += TILE_WORDS) {
    _tile_loadd(4, w.q + c * PAIR_DIMS, D * 2);
    _tile_loadd(5, kb, TILE_BYTES);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, kb + next, TILE_BYTES);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, kb + 2 * next, TILE_BYTES);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, kb + 3 * next, TILE_BYTES);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, s, KB * 4);
  _tile_stored(1, s + 16, KB * 4);
  _tile_stored(2, s + 32, KB * 4);
  _tile_stored(3, s + 48, KB * 4);
}

// pv[16][D] = P[16][64] V[64][D] for the block's keys (vb: their pairs), four 16-dim C tiles at a time.
RADIXKV_AMX inline void weighted_values(const Scratch& w, const uint32_t* vb, int64_t D, float* pv) {
  const int64_t v_stride = D * 4, half = TILE_ROWS * D;  // 32 keys: 16 pairs, one B tile
  for (int64_t d = 0; d < D; d += 4 * LANES) {
    const int64_t n = std::min<int64_t>(4, (D - d) / LANES);
    _tile_zero(0);
    if (n > 1) _tile_zero(1);
    if (n > 2) _tile_zero(2);
    if (n > 3) _tile_zero(3);
    for (int64_t h = 0; h < 2; ++h) {
      _tile_loadd(4, w.p + h * 32, KB * 2);
      const uint32_t* b = vb + h * half + d;
      _tile_loadd(5, b, v_stride);
      _tile_dpbf16ps(0, 4, 5);
      if (n > 1) { _tile_loadd(6, b + 16, v_stride); _tile_dpbf16ps(1, 4, 6); }
      if (n > 2) { _tile_loadd(7, b + 32, v_stride); _tile_dpbf16ps(2, 4, 7); }
      if (n > 3) { _tile_loadd(5, b + 48, v_stride); _tile_dpbf16ps(3, 4, 5); }
    }
    _tile_stored(0, pv + d, v_stride);
    if (n > 1) _tile_stored(1, pv + d + 16, v_stride);
    if (n > 2) _tile_stored(2, pv + d + 32, v_stride);
    if (n > 3) _tile_stored(3, pv + d + 48, v_stride);
  }
}

// 2^t for float32 lanes with t <= 0 (a little above from rounding): t = n + f, |f| <= 1/2, 2^f by
// its degree-5 Taylor polynomial (relative error below 3e-7, within 2 ulp); t far below -126
// gives 0. Cheaper than exp_ps: no range clamps, and the scores' scale and log2(e) are one FMA.
inline __m512 exp2_ps(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// The online softmax of one block over the rows, in base 2 (m: running maxima of scale2 * S,
// scale2 = scale * log2(e)): P (bfloat16) into w.p, each row's rescale of O into alpha, the
// rows' partial sums (16 lanes each) carried in l. limits[i]: keys row i sees (0 past the item's
// queries). Keys past a row's limit get a finite -1e30 score, whose 2^ is 0 (no NaN from -inf).
RADIXKV_AMX inline void softmax_block(Scratch& w, const int64_t* limits, int64_t n0, float scale2, float* m,
                                      float* l, float* alpha) {
  alignas(64) float m_new[TILE_ROWS];
  for (int i = 0; i < TILE_ROWS; ++i) {
    const int64_t allowed = limits[i] - n0;
    m_new[i] = m[i];
    if (allowed <= 0) continue;
    float* srow = w.s + i * KB;
    if (allowed < KB)
      for (int j = 0; j < 4; ++j)
        _mm512_store_ps(srow + j * LANES, _mm512_mask_mov_ps(_mm512_set1_ps(FLOOR),
                                                             radixkv::tail_mask(std::max<int64_t>(0, allowed - j * LANES)),
                                                             _mm512_load_ps(srow + j * LANES)));
    const __m512 top = _mm512_max_ps(_mm512_max_ps(_mm512_load_ps(srow), _mm512_load_ps(srow + 16)),
                                     _mm512_max_ps(_mm512_load_ps(srow + 32), _mm512_load_ps(srow + 48)));
    m_new[i] = std::max(m[i], scale2 * _mm512_reduce_max_ps(top));
  }
  const __m512 m_old = _mm512_load_ps(m), m_next = _mm512_load_ps(m_new);
  _mm512_store_ps(alpha, exp2_ps(_mm512_sub_ps(m_old, m_next)));
  _mm512_store_ps(m, m_next);
  const __m512 scale_v = _mm512_set1_ps(scale2);
  for (int i = 0; i < TILE_ROWS; ++i) {
    auto* prow = reinterpret_cast<__m512i*>(w.p + i * KB);
    if (limits[i] <= n0) {  // past this row's keys: P is 0 (alpha is 1: its max stayed)
      _mm512_store_si512(prow, _mm512_setzero_si512());
      _mm512_store_si512(prow + 1, _mm512_setzero_si512());
      continue;
    }
    const float* srow = w.s + i * KB;
    const __m512 mv = _mm512_set1_ps(m_new[i]);
    __m512 p[4];
    for (int j = 0; j < 4; ++j) p[j] = exp2_ps(_mm512_fmsub_ps(_mm512_load_ps(srow + j * LANES), scale_v, mv));
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3]));
    float* lrow = l + i * LANES;
    _mm512_store_ps(lrow, _mm512_fmadd_ps(_mm512_load_ps(lrow), _mm512_set1_ps(alpha[i]), sum));
    _mm512_store_si512(prow, (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
    _mm512_store_si512(prow + 1, (__m512i)_mm512_cvtne2ps_pbh(p[3], p[2]));
  }
}

// The online softmax of the 16 rows in w.q over packed K/V (kp, vp): row i sees keys [0,
// limits[i]). Leaves O unnormalized in w.o, the maxima m (base 2, of scale2 * S) and each row's 16
// partial sums in l.
RADIXKV_AMX void tile_rows_on(Scratch& w, const uint32_t* kp, const uint32_t* vp, int64_t D,
                                const int64_t* limits, float scale2, float* m, float* l);

RADIXKV_AMX void tile_rows(Scratch& w, const uint32_t* kp, const uint32_t* vp, int64_t D,
                             const int64_t* limits, float scale2, float* m, float* l) {
  std::fill(w.o, w.o + TILE_ROWS * D, 0.0f);
  std::fill(m, m + TILE_ROWS, FLOOR);
  std::fill(l, l + TILE_ROWS * LANES, 0.0f);
  tile_rows_on(w, kp, vp, D, limits, scale2, m, l);
}

// One 64-key block (keys n0 ..) for the 16 rows in w: S, the online softmax, P V, and O rescaled
// plus P V.
RADIXKV_AMX inline void tile_block(Scratch& w, const uint32_t* kp, const uint32_t* vp, int64_t D,
                                   const int64_t* limits, int64_t n0, float scale2, float* m, float* l) {
  alignas(64) float alpha[TILE_ROWS];
  scores(w, kp, D, n0, w.s);
  softmax_block(w, limits, n0, scale2, m, l, alpha);
  weighted_values(w, vp + (n0 / 2) * D, D, w.pv);
  for (int i = 0; i < TILE_ROWS; ++i) {
    const __m512 a = _mm512_set1_ps(alpha[i]);
    float* orow = w.o + i * D;
    const float* prow = w.pv + i * D;
    for (int64_t d = 0; d < D; d += LANES)
      _mm512_store_ps(orow + d, _mm512_fmadd_ps(_mm512_load_ps(orow + d), a, _mm512_load_ps(prow + d)));
  }
}

// tile_rows' loop: carries the online softmax state (w.o, m, l) on over more packed keys.
RADIXKV_AMX void tile_rows_on(Scratch& w, const uint32_t* kp, const uint32_t* vp, int64_t D,
                                const int64_t* limits, float scale2, float* m, float* l) {
  const int64_t last = *std::max_element(limits, limits + TILE_ROWS);
  for (int64_t n0 = 0; n0 < last; n0 += KB) tile_block(w, kp, vp, D, limits, n0, scale2, m, l);
}

// Row i of a finished tile: its O (w.o) over the sum of its 16 partial sums (l) into out as
// bfloat16; returns the sum.
RADIXKV_AMX inline float store_row(const Scratch& w, const float* l, int64_t i, int64_t D, c10::BFloat16* out) {
  const float sum = _mm512_reduce_add_ps(_mm512_load_ps(l + i * LANES));
  const __m512 inv = _mm512_set1_ps(1.0f / sum);
  auto* orow = reinterpret_cast<uint16_t*>(out);
  for (int64_t d = 0; d < D; d += LANES)
    radixkv::store_bf16(orow + d, _mm512_mul_ps(_mm512_load_ps(w.o + i * D + d), inv));
  return sum;
}

// One item: rows f0 .. f0 + 15 (fewer at the end) of KV head h of sequence b, where row f is query
// f % M of query head h * r + f / M (the r query heads sharing the KV head, folded into rows).
RADIXKV_AMX void attend_item(const radixkv::TileProblem& P, const c10::BFloat16* q, const uint32_t* kp,
                             const uint32_t* vp, c10::BFloat16* o, float* lse, int64_t b, int64_t h,
                             int64_t f0, Scratch& w) {
  const int64_t D = P.D, r = P.Hq / P.Hkv, R = std::min<int64_t>(TILE_ROWS, r * P.M - f0), len = P.kv_lens[b];
  int64_t limits[TILE_ROWS], out_rows[TILE_ROWS];  // out_rows: the row's index in o [B, Hq, M] order
  for (int64_t i = 0; i < TILE_ROWS; ++i) {
    if (i >= R) {
      limits[i] = 0;
      std::memset(w.q + i * D, 0, D * 2);
      continue;
    }
    const int64_t hq = h * r + (f0 + i) / P.M, pos = (f0 + i) % P.M;
    limits[i] = P.offsets ? std::min(len, P.offsets[b] + pos + 1) : len;
    out_rows[i] = (b * P.Hq + hq) * P.M + pos;
    std::memcpy(w.q + i * D, q + b * P.qs[0] + hq * P.qs[1] + pos * P.qs[2], D * 2);
  }
  alignas(64) float m[TILE_ROWS], l[TILE_ROWS * LANES];
  tile_rows(w, kp, vp, D, limits, P.scale * static_cast<float>(M_LOG2E), m, l);
  for (int64_t i = 0; i < R; ++i) {
    const float sum = store_row(w, l, i, D, o + out_rows[i] * D);
    lse[out_rows[i]] = m[i] * static_cast<float>(M_LN2) + std::log(sum);
  }
}

constexpr int64_t EXTEND_TILES = 4;  // row tiles per attend_extends_tiles item (a prefix block read once for all)

// One item of attend_extends_tiles: folded rows f0 .. f0 + 16 * tiles - 1 (fewer at the end) of
// KV head h of sequence b (row f: new token f % n of query head h * r + f / n, n = its new tokens,
// as attend_item folds them), in up to EXTEND_TILES row tiles ws[t]: over its packed prefix, every
// 64-key block once for all the tiles (every key), then over its own new keys (causal).
RADIXKV_AMX void extend_item(const radixkv::ExtendProblem& P, const c10::BFloat16* q, const uint32_t* own_kp,
                             const uint32_t* own_vp, c10::BFloat16* o, int64_t b, int64_t h, int64_t f0,
                             int64_t tiles, Scratch* ws) {
  const int64_t D = P.D, r = P.Hq / P.Hkv, n = P.lens[b];
  const int64_t rows = std::min<int64_t>(tiles * TILE_ROWS, r * n - f0);
  tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
  int64_t prefix_limits[EXTEND_TILES][TILE_ROWS], own_limits[EXTEND_TILES][TILE_ROWS], out_rows[EXTEND_TILES][TILE_ROWS];
  alignas(64) float m[EXTEND_TILES][TILE_ROWS], l[EXTEND_TILES][TILE_ROWS * LANES];
  for (int64_t t = 0; t < tiles; ++t) {
    Scratch& w = ws[t];
    for (int64_t i = 0; i < TILE_ROWS; ++i) {
      const int64_t f = t * TILE_ROWS + i;
      if (f >= rows) {
        prefix_limits[t][i] = own_limits[t][i] = 0;
        std::memset(w.q + i * D, 0, D * 2);
        continue;
      }
      const int64_t hq = h * r + (f0 + f) / n, pos = (f0 + f) % n, token = P.starts[b] + pos;
      prefix_limits[t][i] = P.prefix_lens[b];
      own_limits[t][i] = pos + 1;
      out_rows[t][i] = token * P.os[0] + hq * P.os[1];
      std::memcpy(w.q + i * D, q + token * P.qs[0] + hq * P.qs[1], D * 2);
    }
    std::fill(w.o, w.o + TILE_ROWS * D, 0.0f);
    std::fill(m[t], m[t] + TILE_ROWS, FLOOR);
    std::fill(l[t], l[t] + TILE_ROWS * LANES, 0.0f);
  }
  const float scale2 = P.scale * static_cast<float>(M_LOG2E);
  const int64_t words = P.words[b];
  const uint32_t* kp = P.tiles[b] + h * 2 * words;
  for (int64_t n0 = 0; n0 < P.prefix_lens[b]; n0 += KB)
    for (int64_t t = 0; t < tiles; ++t) tile_block(ws[t], kp, kp + words, D, prefix_limits[t], n0, scale2, m[t], l[t]);
  for (int64_t t = 0; t < tiles; ++t) {
    tile_rows_on(ws[t], own_kp, own_vp, D, own_limits[t], scale2, m[t], l[t]);
    for (int64_t i = 0; i < TILE_ROWS && t * TILE_ROWS + i < rows; ++i)
      store_row(ws[t], l[t], i, D, o + out_rows[t][i]);
  }
}

// A thread's buffer, grown on demand and kept: a new allocation of a few MB per call costs more
// in page faults than the packing that fills it.
struct ThreadBuffer {
  std::unique_ptr<char, decltype(&std::free)> data{nullptr, &std::free};
  int64_t capacity = 0;

  void* get(int64_t bytes) {
    if (bytes > capacity) {
      data.reset(static_cast<char*>(std::aligned_alloc(64, round_up(bytes, 64))));
      TORCH_CHECK(data, "attend: out of memory for packed K/V (", bytes, " bytes)");
      capacity = bytes;
    }
    return data.get();
  }
};

// The calling thread's Scratch (a worker's, in either entry point).
Scratch* thread_scratch() {
  thread_local ThreadBuffer scratch;
  return static_cast<Scratch*>(scratch.get(sizeof(Scratch)));
}

// The calling thread's EXTEND_TILES Scratch (extend_item's row tiles).
Scratch* extend_scratch() {
  thread_local ThreadBuffer scratch;
  return static_cast<Scratch*>(scratch.get(EXTEND_TILES * sizeof(Scratch)));
}

// Runs fn(idx, scratch) for every idx in [0, count) on torch's threads with the tiles configured,
// handing items out one at a time (they differ in size).
template <typename Fn>
void tile_items(int64_t count, Fn&& fn) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count));
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    Scratch* w = thread_scratch();
    configure_tiles();
    for (int64_t worker = begin; worker < end; ++worker)
      for (int64_t idx = next.fetch_add(1); idx < count; idx = next.fetch_add(1)) fn(idx, *w);
    release_tiles();
  });
}

}  // namespace

namespace radixkv {

bool tiles_run(int64_t head_dim) {
  return allow_tiles.load() && has_amx_tiles() && head_dim % PAIR_DIMS == 0 && head_dim <= MAX_D;
}

bool tiles_take(int64_t head_dim, int64_t queries) { return tiles_run(head_dim) && queries >= MIN_QUERIES; }

int64_t prefix_tile_words(int64_t len, int64_t D) { return round_up(len, KB) * D / 2; }

void pack_prefix_tiles(const c10::BFloat16* k, const c10::BFloat16* v, int64_t kv_row, int64_t len, int64_t D,
                       uint32_t* kp, uint32_t* vp) {
  pack_keys(k, kv_row, len, D, kp);
  pack_values(v, kv_row, len, D, vp);
}

void attend_packed_prefix_tiles(const c10::BFloat16* const* queries, int64_t rows, const uint32_t* kp,
                                const uint32_t* vp, int64_t len, int64_t D, float scale, float* ot, int64_t W,
                                float* m, float* l) {
  Scratch* w = thread_scratch();
  configure_tiles();
  alignas(64) float tm[TILE_ROWS], tl[TILE_ROWS * LANES];
  int64_t limits[TILE_ROWS];
  for (int64_t f0 = 0; f0 < rows; f0 += TILE_ROWS) {
    const int64_t R = std::min<int64_t>(TILE_ROWS, rows - f0);
    for (int64_t i = 0; i < TILE_ROWS; ++i) {
      limits[i] = i < R ? len : 0;
      if (i < R) std::memcpy(w->q + i * D, queries[f0 + i], D * 2);
      else std::memset(w->q + i * D, 0, D * 2);
    }
    tile_rows(*w, kp, vp, D, limits, scale * static_cast<float>(M_LOG2E), tm, tl);
    for (int64_t i = 0; i < R; ++i) {  // rows into lanes, the max to natural-log units
      for (int64_t d = 0; d < D; ++d) ot[d * W + f0 + i] = w->o[i * D + d];
      m[f0 + i] = tm[i] * static_cast<float>(M_LN2);
      l[f0 + i] = _mm512_reduce_add_ps(_mm512_load_ps(tl + i * LANES));
    }
  }
  release_tiles();
}

void attend_prefix_tiles(const c10::BFloat16* const* queries, int64_t rows, const c10::BFloat16* k,
                         const c10::BFloat16* v, int64_t kv_row, int64_t len, int64_t D, float scale, float* ot,
                         int64_t W, float* m, float* l) {
  const int64_t words = prefix_tile_words(len, D);
  thread_local ThreadBuffer packed;
  auto* kp = static_cast<uint32_t*>(packed.get(2 * words * 4));
  pack_prefix_tiles(k, v, kv_row, len, D, kp, kp + words);
  attend_packed_prefix_tiles(queries, rows, kp, kp + words, len, D, scale, ot, W, m, l);
}

void attend_tiles(const TileProblem& P, const c10::BFloat16* q, const c10::BFloat16* k, const c10::BFloat16* v,
                  c10::BFloat16* o, float* lse) {
  const int64_t D = P.D, r = P.Hq / P.Hkv, Lp = round_up(P.L, KB), per_head = Lp * D / 2;
  // Packed K and V of every (sequence, KV head), zero past its keys.
  thread_local ThreadBuffer packed;  // the calling thread's; its workers read it
  auto* kp = static_cast<uint32_t*>(packed.get(2 * P.B * P.Hkv * per_head * 4));
  uint32_t* vp = kp + P.B * P.Hkv * per_head;
  at::parallel_for(0, P.B * P.Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / P.Hkv, h = bh % P.Hkv;
      pack_keys(k + b * P.ks[0] + h * P.ks[1], P.ks[2], P.kv_lens[b], D, kp + bh * per_head);
      pack_values(v + b * P.vs[0] + h * P.vs[1], P.vs[2], P.kv_lens[b], D, vp + bh * per_head);
    }
  });
  // Items (16 rows of a KV head's folded queries) handed out one at a time from the last folded
  // rows back: within a query head its latest queries, which under a causal mask read the most
  // keys, go first, and the first head's earliest (the cheapest) last.
  const int64_t tiles = (r * P.M + TILE_ROWS - 1) / TILE_ROWS;
  tile_items(tiles * P.B * P.Hkv, [&](int64_t idx, Scratch& w) {
    const int64_t t = tiles - 1 - idx / (P.B * P.Hkv), bh = idx % (P.B * P.Hkv);
    attend_item(P, q, kp + bh * per_head, vp + bh * per_head, o, lse, bh / P.Hkv, bh % P.Hkv, t * TILE_ROWS, w);
  });
}

void attend_extends_tiles(const ExtendProblem& P, const c10::BFloat16* q, const c10::BFloat16* k,
                          const c10::BFloat16* v, c10::BFloat16* o) {
  const int64_t D = P.D, r = P.Hq / P.Hkv;
  // Each (sequence, KV head)'s new K and V packed as attend_tiles packs a context.
  std::vector<int64_t> offset(P.B + 1, 0);
  for (int64_t b = 0; b < P.B; ++b) offset[b + 1] = offset[b] + prefix_tile_words(P.lens[b], D);
  thread_local ThreadBuffer packed;  // the calling thread's; its workers read it
  auto* own = static_cast<uint32_t*>(packed.get(2 * P.Hkv * offset[P.B] * 4));
  auto own_k = [&](int64_t b, int64_t h) { return own + 2 * (P.Hkv * offset[b] + h * (offset[b + 1] - offset[b])); };
  at::parallel_for(0, P.B * P.Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / P.Hkv, h = bh % P.Hkv, words = offset[b + 1] - offset[b];
      pack_keys(k + P.starts[b] * P.ks[0] + h * P.ks[1], P.ks[0], P.lens[b], D, own_k(b, h));
      pack_values(v + P.starts[b] * P.vs[0] + h * P.vs[1], P.vs[0], P.lens[b], D, own_k(b, h) + words);
    }
  });
  // Items of up to EXTEND_TILES row tiles (each prefix block read once for them), fewer where that
  // would leave the threads fewer than two items each.
  int64_t row_tiles = 0;
  for (int64_t b = 0; b < P.B; ++b) row_tiles += (r * P.lens[b] + TILE_ROWS - 1) / TILE_ROWS * P.Hkv;
  const int64_t per_item = std::clamp<int64_t>(row_tiles / (2 * at::get_num_threads()), 1, EXTEND_TILES);
  std::vector<std::array<int64_t, 3>> items;  // (sequence, KV head, first folded row)
  for (int64_t b = 0; b < P.B; ++b)
    for (int64_t f0 = 0; f0 < r * P.lens[b]; f0 += per_item * TILE_ROWS)
      for (int64_t h = 0; h < P.Hkv; ++h) items.push_back({b, h, f0});
  tile_items(static_cast<int64_t>(items.size()), [&](int64_t idx, Scratch&) {
    const auto [b, h, f0] = items[idx];
    const uint32_t* kp = own_k(b, h);
    extend_item(P, q, kp, kp + (offset[b + 1] - offset[b]), o, b, h, f0, per_item, extend_scratch());
  });
}

}  // namespace radixkv

#else  // a compiler without AMX (build.py): the tiles never take a call

namespace radixkv {
bool tiles_run(int64_t) { return false; }
bool tiles_take(int64_t, int64_t) { return false; }
int64_t prefix_tile_words(int64_t, int64_t) { std::abort(); }
void pack_prefix_tiles(const c10::BFloat16*, const c10::BFloat16*, int64_t, int64_t, int64_t, uint32_t*, uint32_t*) {
  std::abort();
}
void attend_packed_prefix_tiles(const c10::BFloat16* const*, int64_t, const uint32_t*, const uint32_t*, int64_t,
                                int64_t, float, float*, int64_t, float*, float*) {
  std::abort();
}
void attend_prefix_tiles(const c10::BFloat16* const*, int64_t, const c10::BFloat16*, const c10::BFloat16*, int64_t,
                         int64_t, int64_t, float, float*, int64_t, float*, float*) {
  std::abort();
}
void attend_tiles(const TileProblem&, const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*,
                  c10::BFloat16*, float*) {
  std::abort();
}
void attend_extends_tiles(const ExtendProblem&, const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*,
                          c10::BFloat16*) {
  std::abort();
}
}  // namespace radixkv

#endif

namespace {

// Whether bfloat16 calls may take the tiles (tests and the start-up timing compare both paths);
// returns the previous setting.
bool set_attention_tiles(bool enabled) { return allow_tiles.exchange(enabled); }

bool attention_tiles_take(int64_t head_dim, int64_t queries) { return radixkv::tiles_take(head_dim, queries); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixkv, m) {
  m.def("set_attention_tiles(bool enabled) -> bool", set_attention_tiles);
  m.def("attention_tiles_take(int head_dim, int queries) -> bool", attention_tiles_take);
  m.def("attention_tiles_min_queries() -> int", [] { return MIN_QUERIES; });
}
