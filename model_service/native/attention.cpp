// radixkv native CPU attention: softmax attention with its log-sum-exp over strided K/V with
// per-sequence key lengths and optional causal offsets, AVX-512 float32 arithmetic for float32 and
// bfloat16 inputs. Registered as torch.ops.radixkv.attend (model_service/native/__init__.py).
//
// Why: torch's CPU flash-attention kernel runs its products through cpublas (MKL), which on CPUs it
// does not recognise (AMD EPYC among them) takes a generic path for both dtypes,
// and packs K/V per (sequence, query head). Here the r query heads of a KV head and a block of
// queries form the rows of one work item, so every K/V row is read once per item; rows sit in the
// vector lanes: Q is transposed once per item ([D][rows]) and every key of K is broadcast, so K and
// V are read in place, row-major (bfloat16 rows are widened to float32 per chunk of keys).
//
// Per item, keys in chunks of KC (flash-style online softmax):
//   S^T[key][row] = scale * sum_d K[key][d] * Qt[d][row]                  (masked: -inf)
//   m' = max(m, max_key S^T);  P = exp(S^T - m');  l = l * exp(m - m') + sum_key P
//   Ot[d][row] = Ot[d][row] * exp(m - m') + sum_key V[key][d] * P[key][row]
// then o = Ot / l and lse = m + log(l). Products and sums in float32 (bfloat16 values are exact in
// float32); for bfloat16 inputs P is rounded to bfloat16 before P·V, as in torch's flash kernel,
// so that results stay as close as they can to transformers' bfloat16 attention.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd.h"
#include "tile_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr int KC = 64;         // keys per chunk
using radixkv::LANES;
using radixkv::has_bf16_dot_products;
constexpr int MAX_ROWS = 64;   // query rows of a work item (4 vectors)
constexpr int MAX_D = 256;     // head_dim limit (a multiple of 16)
constexpr int SMALL_ROWS = 8;  // work items of at most this many rows take the keys-in-lanes kernel

// exp(x) for float32 lanes (Cephes expf polynomial, about 1 ulp); -inf and very negative x give 0.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
  p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// x rounded to bfloat16 precision (to nearest even), kept in float32 lanes.
inline __m512 round_to_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// The probabilities P·V multiplies: for bfloat16 inputs rounded to bfloat16, as torch's flash
// kernel (and so transformers' sdpa attention) does; their sum stays unrounded in both.
template <typename T>
inline __m512 pv_weight(__m512 p) {
  if constexpr (std::is_same_v<T, float>) return p;
  else return round_to_bf16(p);
}

// Brings the cache line holding p into L1. Not _mm_prefetch: GCC 12 at -O1..-O3 left none of its
// __builtin_prefetch calls in these kernels (objdump; small functions keep theirs), so the kernels
// ran without any; tests/model_service/attention/test_native_attention.py checks the built library for them. With
// them, cascade prefixes, whose K/V is read cold, wait far less on memory.
inline void prefetch_line(const char* p) { asm volatile("prefetcht0 %0" : : "m"(*p)); }

// Brings the cache line holding p into L2 only. A whole next chunk of K and V (32 KB in float32)
// is as large as L1: asked into L1 it evicted the chunk being computed, and cold float32 cascade
// prefixes streamed no faster than with no prefetch at all; into L2 a decode step's prefix pass
// took about two thirds of the time (AMD EPYC Zen 4).
inline void prefetch_line_l2(const char* p) { asm volatile("prefetcht1 %0" : : "m"(*p)); }

// Asks for rows [0, n) of a [n, D] block (rows `stride` elements apart) to be brought into L2:
// the next chunk's K and V while this one is computed (the kernels are otherwise bound by
// memory latency, not bandwidth, on K/V read once per step).
template <typename T>
inline void prefetch_rows(const T* src, int64_t stride, int n, int D) {
  const int bytes = D * static_cast<int>(sizeof(T));
  for (int j = 0; j < n; ++j) {
    const char* row = reinterpret_cast<const char*>(src + j * stride);
    for (int off = 0; off < bytes; off += 64) prefetch_line_l2(row + off);
  }
}

// rows [0, n) of a [n, D] block (row stride `stride` elements) widened to float32 [n, D].
template <typename T>
inline void widen_rows(const T* src, int64_t stride, int n, int D, float* dst) {
  for (int j = 0; j < n; ++j) {
    const T* s = src + j * stride;
    float* o = dst + j * D;
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(o, s, sizeof(float) * D);
    } else {
      for (int d = 0; d < D; d += LANES) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + d));
        _mm512_storeu_ps(o + d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
      }
    }
  }
}

// st[t][:] = scale * sum_d k[t][d] * qt[d][:] for T keys (k rows `ks` apart), RV row vectors.
template <int RV, int T>
inline void qk_tile(const float* qt, int D, const float* k, int64_t ks, float* st, float scale) {
  __m512 acc[T][RV];
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < RV; ++v) acc[t][v] = _mm512_setzero_ps();
  for (int d = 0; d < D; ++d) {
    __m512 q[RV];
    for (int v = 0; v < RV; ++v) q[v] = _mm512_loadu_ps(qt + d * RV * LANES + v * LANES);
    for (int t = 0; t < T; ++t) {
      const __m512 kb = _mm512_set1_ps(k[t * ks + d]);
      for (int v = 0; v < RV; ++v) acc[t][v] = _mm512_fmadd_ps(kb, q[v], acc[t][v]);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < RV; ++v) _mm512_storeu_ps(st + t * RV * LANES + v * LANES, _mm512_mul_ps(acc[t][v], s));
}

// ot[d0 + t][:] += sum_j vrows[j][d0 + t] * p[j][:] for T columns of V, n keys (V rows `vs` apart).
template <int RV, int T>
inline void pv_tile(const float* p, int n, const float* vrows, int64_t vs, int d0, float* ot) {
  __m512 acc[T][RV];
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < RV; ++v) acc[t][v] = _mm512_loadu_ps(ot + (d0 + t) * RV * LANES + v * LANES);
  for (int j = 0; j < n; ++j) {
    __m512 pj[RV];
    for (int v = 0; v < RV; ++v) pj[v] = _mm512_loadu_ps(p + j * RV * LANES + v * LANES);
    const float* vr = vrows + j * vs + d0;
    for (int t = 0; t < T; ++t) {
      const __m512 vb = _mm512_set1_ps(vr[t]);
      for (int v = 0; v < RV; ++v) acc[t][v] = _mm512_fmadd_ps(vb, pj[v], acc[t][v]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < RV; ++v) _mm512_storeu_ps(ot + (d0 + t) * RV * LANES + v * LANES, acc[t][v]);
}

// Sums of 16 vectors: lane j of the result = the sum of v[j]'s lanes (a transposing add tree).
inline __m512 sum16(const __m512* v) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 y2 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y1, y2, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(y1, y2, _MM_SHUFFLE(3, 1, 3, 1)));
}

// The AVX512-BF16 tiles (qk_tile_dp, pv_tile_dp, pair_probabilities) are RADIXKV_BF16 (simd.h):
// the only code compiled for that extension, reached only through attend_rows_dp and
// cascade_rows_dp, which run only where has_bf16_dot_products() is true.
// bfloat16 pairs: a 32-bit word holds two bfloat16 values (low half first), the operand layout of
// AVX512-BF16's dot product (lane i: a.lo*b.lo + a.hi*b.hi, products exact, sums in float32).
inline uint32_t load_pair(const c10::BFloat16* p) {
  uint32_t word;
  std::memcpy(&word, p, sizeof(word));
  return word;
}

// st[t][:] = scale * sum_d k[t][d] * q[:][d] for T bfloat16 keys (rows `ks` apart); qtp[d/2][row]
// holds the pairs (q[row][d], q[row][d+1]).
#ifndef RADIXKV_NO_BF16
template <int RV, int T>
RADIXKV_BF16 inline void qk_tile_dp(const uint32_t* qtp, int D, const c10::BFloat16* k, int64_t ks, float* st, float scale) {
  __m512 acc[T][RV];
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < RV; ++v) acc[t][v] = _mm512_setzero_ps();
  for (int dp = 0; dp < D / 2; ++dp) {
    __m512bh q[RV];
    for (int v = 0; v < RV; ++v) q[v] = (__m512bh)_mm512_loadu_si512(qtp + dp * RV * LANES + v * LANES);
    for (int t = 0; t < T; ++t) {
      const __m512bh kb = (__m512bh)_mm512_set1_epi32(static_cast<int>(load_pair(k + t * ks + 2 * dp)));
      for (int v = 0; v < RV; ++v) acc[t][v] = _mm512_dpbf16_ps(acc[t][v], q[v], kb);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < RV; ++v) _mm512_storeu_ps(st + t * RV * LANES + v * LANES, _mm512_mul_ps(acc[t][v], s));
}

// ot[d0 + t][:] += sum_j V[j][d0 + t] * P[j][:] over key pairs: pp[j/2][row] = (P[j][row],
// P[j+1][row]), vp[j/2][d] = (V[j][d], V[j+1][d]).
template <int RV, int T>
RADIXKV_BF16 inline void pv_tile_dp(const uint32_t* pp, int npairs, const uint32_t* vp, int D, int d0, float* ot) {
  __m512 acc[T][RV];
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < RV; ++v) acc[t][v] = _mm512_loadu_ps(ot + (d0 + t) * RV * LANES + v * LANES);
  for (int jp = 0; jp < npairs; ++jp) {
    __m512bh pj[RV];
    for (int v = 0; v < RV; ++v) pj[v] = (__m512bh)_mm512_loadu_si512(pp + jp * RV * LANES + v * LANES);
    const uint32_t* vr = vp + jp * D + d0;
    for (int t = 0; t < T; ++t) {
      const __m512bh vb = (__m512bh)_mm512_set1_epi32(static_cast<int>(vr[t]));
      for (int v = 0; v < RV; ++v) acc[t][v] = _mm512_dpbf16_ps(acc[t][v], pj[v], vb);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < RV; ++v) _mm512_storeu_ps(ot + (d0 + t) * RV * LANES + v * LANES, acc[t][v]);
}

#else  // a compiler without AVX512-BF16 (build.py): the tiles are never called
template <int RV, int T>
inline void qk_tile_dp(const uint32_t*, int, const c10::BFloat16*, int64_t, float*, float) { std::abort(); }
template <int RV, int T>
inline void pv_tile_dp(const uint32_t*, int, const uint32_t*, int, int, float*) { std::abort(); }
#endif

// vp[j/2][d] = (V[j][d], V[j+1][d]) for rows [0, n) of V (rows `vs` apart; an odd n pairs the last
// row with zeros).
inline void pair_rows(const c10::BFloat16* v, int64_t vs, int n, int D, uint32_t* vp) {
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  for (int j = 0; j < n; j += 2) {
    const c10::BFloat16* a = v + j * vs;
    const c10::BFloat16* b = a + vs;
    uint32_t* out = vp + (j / 2) * D;
    for (int d = 0; d < D; d += 2 * LANES) {
      const __mmask32 valid = D - d >= 2 * LANES ? ~__mmask32(0) : __mmask32((1u << (D - d)) - 1);
      const __m512i ra = _mm512_maskz_loadu_epi16(valid, a + d);
      const __m512i rb = j + 1 < n ? _mm512_maskz_loadu_epi16(valid, b + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + d, _mm512_permutex2var_epi16(ra, lo, rb));
      if (D - d > LANES) _mm512_storeu_si512(out + d + LANES, _mm512_permutex2var_epi16(ra, hi, rb));
    }
  }
}

#ifndef RADIXKV_NO_BF16
// pp[j/2][row] = (P[j][row], P[j+1][row]) as bfloat16 (to nearest even) for keys [0, n) of a
// [n][W] float32 block (an odd n pairs the last key with zeros).
template <int RV>
RADIXKV_BF16 inline void pair_probabilities(const float* st, int n, uint32_t* pp) {
  alignas(64) static const uint16_t idx[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                               8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(idx);
  constexpr int W = RV * LANES;
  for (int j = 0; j < n; j += 2)
    for (int v = 0; v < RV; ++v) {
      const __m512 a = _mm512_loadu_ps(st + j * W + v * LANES);
      const __m512 b = j + 1 < n ? _mm512_loadu_ps(st + (j + 1) * W + v * LANES) : _mm512_setzero_ps();
      const __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // [a as bf16 x16, b as bf16 x16]
      _mm512_storeu_si512(pp + (j / 2) * W + v * LANES, _mm512_permutexvar_epi16(interleave, ab));
    }
}
#else  // a compiler without AVX512-BF16 (build.py): never called
template <int RV>
inline void pair_probabilities(const float*, int, uint32_t*) { std::abort(); }
#endif
std::atomic<bool> allow_bf16_dot_products{true};

struct Problem {
  int64_t B, Hq, Hkv, M, L, D, r;
  int64_t qb, nqb;  // queries per work item, work items per (sequence, KV head)
  int64_t qs[3], ks[3], vs[3];  // strides (elements) of the first three dims of q, k, v
  const int64_t* kv_lens;
  const int64_t* offsets;  // nullptr: not causal
  float scale;
  bool small;  // rows per item <= SMALL_ROWS: attend_item_small
  // Paged K/V (attend_paged, small items only): key j of sequence b is token starts[b] + j of its
  // block table row; k and v point at caches [num_blocks, block_size, Hkv, D].
  const int64_t* tables = nullptr;  // [B, table_width]
  const int64_t* starts = nullptr;  // [B]
  int64_t table_width = 0, block_size = 0;
  bool dot_products;  // bfloat16 and AVX512-BF16: attend_item<..., DP = true>
};

struct Scratch {
  std::vector<float> qt, st, ot, kf, vf;
  std::vector<uint32_t> pairs;  // bfloat16 probability pairs (dot-product path)
  std::vector<float> member_q, member_o;  // a cascade member's rows [SMALL_ROWS][D] (attend_cascade)
  explicit Scratch(int64_t D)
      : qt(D * MAX_ROWS), st(KC * MAX_ROWS), ot(D * MAX_ROWS), kf(KC * D), vf(KC * D), pairs(KC / 2 * MAX_ROWS),
        member_q(SMALL_ROWS * D), member_o(SMALL_ROWS * D) {}
};

// The key loop of a row-lanes work item: keys [0, max_limit) of K/V rows `krs`/`vrs` elements
// apart from kbase/vbase, row `row` seeing keys < limit[row], on top of the state (Qt `qt`,
// accumulator `ot` [D][W], running max `m` and sum `l` per row) the caller set up.
template <typename T, int RV, bool DP>
inline void rows_over_keys(const Problem& P, const T* kbase, int64_t krs, const T* vbase, int64_t vrs,
                           const int32_t* limit, int32_t max_limit, int32_t min_limit, float* qt, float* ot,
                           __m512* m, __m512* l, Scratch& s) {
  constexpr int W = RV * LANES;
  const int D = static_cast<int>(P.D);
  uint32_t* qtp = reinterpret_cast<uint32_t*>(qt);
  float* st = s.st.data();
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i lim_v[RV];
  for (int vv = 0; vv < RV; ++vv) lim_v[vv] = _mm512_loadu_si512(limit + vv * LANES);
  constexpr int TQ = RV == 4 ? 6 : 8;
  constexpr int TV = RV == 4 ? 4 : 8;
  for (int c0 = 0; c0 < max_limit; c0 += KC) {
    const int n = std::min<int>(KC, max_limit - c0);
    // K and V rows of the next chunk: a burst before a DP chunk, else a tile's worth per QK tile.
    const int next = c0 + KC < max_limit ? std::min<int>(KC, max_limit - c0 - KC) : 0;
    auto prefetch_next = [&](int from, int count) {  // rows [from, from + count) of the next chunk
      if (count <= 0) return;
      prefetch_rows(kbase + (c0 + KC + from) * krs, krs, count, D);
      prefetch_rows(vbase + (c0 + KC + from) * vrs, vrs, count, D);
    };
    const float* kc;
    const float* vc;
    int64_t kstride = 0, vstride = 0;
    int j = 0;
    if constexpr (DP) {
      prefetch_next(0, next);
      const T* kr = kbase + c0 * krs;
      for (; j + TQ <= n; j += TQ) qk_tile_dp<RV, TQ>(qtp, D, kr + j * krs, krs, st + j * W, P.scale);
      for (; j < n; ++j) qk_tile_dp<RV, 1>(qtp, D, kr + j * krs, krs, st + j * W, P.scale);
      pair_rows(vbase + c0 * vrs, vrs, n, D, reinterpret_cast<uint32_t*>(s.vf.data()));
      kc = vc = nullptr;
    } else {
      if constexpr (std::is_same_v<T, float>) {
        kc = kbase + c0 * krs;
        vc = vbase + c0 * vrs;
        kstride = krs;
        vstride = vrs;
      } else {
        widen_rows(kbase + c0 * krs, krs, n, D, s.kf.data());
        widen_rows(vbase + c0 * vrs, vrs, n, D, s.vf.data());
        kc = s.kf.data();
        vc = s.vf.data();
        kstride = vstride = D;
      }
      for (; j + TQ <= n; j += TQ) {
        prefetch_next(j, std::min(TQ, next - j));
        qk_tile<RV, TQ>(qt, D, kc + j * kstride, kstride, st + j * W, P.scale);
      }
      for (; j < n; ++j) qk_tile<RV, 1>(qt, D, kc + j * kstride, kstride, st + j * W, P.scale);
      prefetch_next(j, next - j);
    }
    if (c0 + n > min_limit) {  // some row's keys end inside this chunk
      for (j = 0; j < n; ++j) {
        const __m512i pos = _mm512_set1_epi32(c0 + j);
        for (int vv = 0; vv < RV; ++vv) {
          const __mmask16 past = _mm512_cmpge_epi32_mask(pos, lim_v[vv]);
          float* sj = st + j * W + vv * LANES;
          _mm512_storeu_ps(sj, _mm512_mask_blend_ps(past, _mm512_loadu_ps(sj), neg_inf));
        }
      }
    }
    bool rescale = false;
    __m512 alpha[RV];
    for (int vv = 0; vv < RV; ++vv) {
      __m512 mc = m[vv];
      for (j = 0; j < n; ++j) mc = _mm512_max_ps(mc, _mm512_loadu_ps(st + j * W + vv * LANES));
      // Rows that saw no key yet keep -inf: subtract 0 there (exp(-inf) = 0, never NaN).
      const __m512 safe = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mc, neg_inf, _CMP_EQ_OQ), mc, _mm512_setzero_ps());
      alpha[vv] = exp_ps(_mm512_sub_ps(m[vv], safe));
      rescale |= _mm512_cmp_ps_mask(mc, m[vv], _CMP_NEQ_UQ) != 0;
      __m512 sum = _mm512_setzero_ps();
      for (j = 0; j < n; ++j) {
        float* sj = st + j * W + vv * LANES;
        const __m512 p = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sj), safe));
        _mm512_storeu_ps(sj, pv_weight<T>(p));
        sum = _mm512_add_ps(sum, p);
      }
      l[vv] = _mm512_fmadd_ps(l[vv], alpha[vv], sum);
      m[vv] = mc;
    }
    if (rescale) {  // (the first chunk too: the caller may pass an accumulator in)
      for (int d = 0; d < D; ++d)
        for (int vv = 0; vv < RV; ++vv) {
          float* od = ot + d * W + vv * LANES;
          _mm512_storeu_ps(od, _mm512_mul_ps(_mm512_loadu_ps(od), alpha[vv]));
        }
    }
    if constexpr (DP) {
      uint32_t* pp = s.pairs.data();
      pair_probabilities<RV>(st, n, pp);
      const uint32_t* vp = reinterpret_cast<const uint32_t*>(s.vf.data());
      for (int d0 = 0; d0 < D; d0 += TV) pv_tile_dp<RV, TV>(pp, (n + 1) / 2, vp, D, d0, ot);
    } else {
      for (int d0 = 0; d0 < D; d0 += TV) pv_tile<RV, TV>(st, n, vc, vstride, d0, ot);
    }
  }
}

// A fresh row-lanes state: Qt [D][W] and the accumulator Ot [D][W] zeroed (padding rows stay
// zero queries), running max -inf and sum 0 per row.
template <int RV>
inline void start_rows(int D, float* qt, float* ot, __m512* m, __m512* l) {
  constexpr int W = RV * LANES;
  std::fill(qt, qt + D * W, 0.0f);
  std::fill(ot, ot + D * W, 0.0f);
  for (int vv = 0; vv < RV; ++vv) {
    m[vv] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    l[vv] = _mm512_setzero_ps();
  }
}

// Query row `row` of a row-lanes item into Qt: float32 Qt[d][row], or (DP) bfloat16 pairs Qt[d/2][row].
template <typename T, bool DP>
inline void put_query_row(const T* qrow, int D, int W, int row, float* qt) {
  if constexpr (DP) {
    uint32_t* qtp = reinterpret_cast<uint32_t*>(qt);
    for (int d = 0; d < D; d += 2) qtp[(d / 2) * W + row] = load_pair(qrow + d);
  } else {
    for (int d = 0; d < D; ++d) qt[d * W + row] = static_cast<float>(qrow[d]);
  }
}

// One work item: sequence b, KV head h, queries [i0, i0 + nq) of the r query heads h*r .. h*r+r-1.
// Row j * nq + ii is query head h*r + j, query i0 + ii.
// DP: bfloat16 inputs on a CPU with AVX512-BF16: products as bfloat16 dot products on pairs (K and
// Q pairs along D, P and V pairs along the keys), K read in place; else float32 FMAs.
template <typename T, int RV, bool DP>
void attend_item(const Problem& P, const T* q, const T* k, const T* v, T* o, float* lse, int64_t b, int64_t h,
                 int64_t i0, int64_t nq, Scratch& s) {
  constexpr int W = RV * LANES;
  const int D = static_cast<int>(P.D);
  const int rows = static_cast<int>(P.r * nq);
  const int64_t kv_len = P.kv_lens[b];
  alignas(64) int32_t limit[W];
  int32_t max_limit = 0, min_limit = std::numeric_limits<int32_t>::max();
  for (int row = 0; row < W; ++row) {
    int64_t lim = kv_len;
    if (row < rows && P.offsets != nullptr) lim = std::min<int64_t>(kv_len, P.offsets[b] + i0 + row % nq + 1);
    limit[row] = static_cast<int32_t>(lim);
    if (row < rows) {  // padding rows (zero queries, never written) read whatever the others read
      max_limit = std::max<int32_t>(max_limit, limit[row]);
      min_limit = std::min<int32_t>(min_limit, limit[row]);
    }
  }
  float* qt = s.qt.data();
  float* ot = s.ot.data();
  __m512 m[RV], l[RV];
  start_rows<RV>(D, qt, ot, m, l);
  for (int row = 0; row < rows; ++row) {
    const int64_t hq = h * P.r + row / nq, i = i0 + row % nq;
    put_query_row<T, DP>(q + b * P.qs[0] + hq * P.qs[1] + i * P.qs[2], D, W, row, qt);
  }
  rows_over_keys<T, RV, DP>(P, k + b * P.ks[0] + h * P.ks[1], P.ks[2], v + b * P.vs[0] + h * P.vs[1], P.vs[2], limit,
                            max_limit, min_limit, qt, ot, m, l, s);
  alignas(64) float mv[W], lv[W];
  for (int vv = 0; vv < RV; ++vv) {
    _mm512_store_ps(mv + vv * LANES, m[vv]);
    _mm512_store_ps(lv + vv * LANES, l[vv]);
  }
  for (int row = 0; row < rows; ++row) {
    const int64_t hq = h * P.r + row / nq, i = i0 + row % nq;
    const float inv = 1.0f / lv[row];
    T* orow = o + ((b * P.Hq + hq) * P.M + i) * P.D;
    for (int d = 0; d < D; ++d) orow[d] = static_cast<T>(ot[d * W + row] * inv);
    lse[(b * P.Hq + hq) * P.M + i] = mv[row] + std::log(lv[row]);
  }
}

// Element offset of key `pos` of sequence b, KV head h, in k (ks) or v (vs): strided or paged.
inline int64_t row_offset(const Problem& P, const int64_t* strides, int64_t b, int64_t h, int64_t pos) {
  if (P.tables == nullptr) return b * strides[0] + h * strides[1] + pos * strides[2];
  const int64_t token = P.starts[b] + pos;
  const int64_t slot = P.tables[b * P.table_width + token / P.block_size] * P.block_size + token % P.block_size;
  return (slot * P.Hkv + h) * P.D;
}

// Pointers to the K (or V: `base`, `strides`) rows of keys [first, first + n) of sequence b, KV
// head h: strided, or paged with one table lookup per block.
template <typename T>
inline void key_rows(const Problem& P, const T* base, const int64_t* strides, int64_t b, int64_t h, int first, int n,
                     const T** rows) {
  if (P.tables == nullptr) {
    const T* p = base + b * strides[0] + h * strides[1] + first * strides[2];
    for (int j = 0; j < n; ++j) rows[j] = p + j * strides[2];
    return;
  }
  const int64_t bs = P.block_size, rs = P.Hkv * P.D;
  const int64_t* table = P.tables + b * P.table_width;
  int64_t token = P.starts[b] + first;
  for (int j = 0; j < n;) {
    const int64_t off = token % bs;
    const int count = static_cast<int>(std::min<int64_t>(n - j, bs - off));
    const T* row = base + ((table[token / bs] * bs + off) * P.Hkv + h) * P.D;
    for (int t = 0; t < count; ++t) rows[j + t] = row + t * rs;
    j += count;
    token += count;
  }
}

// Brings K and V rows of keys [first, first + n) of sequence b, KV head h (strided or paged) into
// L2 (a chunk ahead, as prefetch_rows).
template <typename T>
inline void prefetch_keys(const Problem& P, const T* k, const T* v, int64_t b, int64_t h, int first, int n) {
  const int bytes = static_cast<int>(P.D * sizeof(T));
  for (int j = first; j < first + n; ++j) {
    const char* kr = reinterpret_cast<const char*>(k + row_offset(P, P.ks, b, h, j));
    const char* vr = reinterpret_cast<const char*>(v + row_offset(P, P.vs, b, h, j));
    for (int off = 0; off < bytes; off += 64) {
      prefetch_line_l2(kr + off);
      prefetch_line_l2(vr + off);
    }
  }
}

// The online softmax of one keys-in-lanes row over a chunk: its scores sc [groups * 16] become the
// P·V weights, its running max m and sum l move on, and its accumulator ot [D] is rescaled when
// the max moved (the first chunk too: a state may carry an accumulator in).
template <typename T>
inline void softmax_row(float* sc, int groups, int D, float* ot, float& m, float& l) {
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int g = 0; g < groups; ++g) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sc + g * LANES));
  const float mc = std::max(m, _mm512_reduce_max_ps(mx));
  const float safe = std::isinf(mc) ? 0.0f : mc;  // a row with no key yet: exp(-inf) = 0
  const float alpha = std::exp(m - safe);
  const __m512 sv = _mm512_set1_ps(safe);
  __m512 sum = _mm512_setzero_ps();
  for (int g = 0; g < groups; ++g) {
    float* sg = sc + g * LANES;
    const __m512 p = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sg), sv));
    _mm512_storeu_ps(sg, pv_weight<T>(p));
    sum = _mm512_add_ps(sum, p);
  }
  l = std::fma(l, alpha, _mm512_reduce_add_ps(sum));  // one rounding (an FMA since it was written)
  if (mc != m) {
    const __m512 a = _mm512_set1_ps(alpha);
    for (int d = 0; d < D; d += LANES) _mm512_storeu_ps(ot + d, _mm512_mul_ps(_mm512_loadu_ps(ot + d), a));
  }
  m = mc;
}

#include "decode_keys.h"

// A work item of R <= 8 rows (a decode: the r query heads of a KV head), keys in the vector lanes:
// a score is a dot product along D (16 keys' partial sums added up by sum16), and P·V broadcasts
// each key's probability over its V row. With few rows this reads K/V once and wastes no lanes.
//
// The key loop of a keys-in-lanes work item of R rows: keys [0, max_limit) of sequence b, KV head
// h (strided or paged: row_offset), row `row` seeing keys < limit[row], on top of the state the
// caller set up: queries qf [R][D] float32, accumulator ot [R][D], running max m and sum l.
// Head sizes 64 and 128 (float32, or bfloat16 with DP) take decode_keys.h's decode_over_keys.
template <typename T, int R, bool DP = false>
inline void small_over_keys(const Problem& P, const T* k, const T* v, int64_t b, int64_t h, const int32_t* limit,
                            int32_t max_limit, const float* qf, float* ot, float* m, float* l, Scratch& s) {
  if constexpr (std::is_same_v<T, float> || DP) {
    if (P.D == 64) return decode_over_keys<T, R, 4, DP>(P, k, v, b, h, limit, max_limit, qf, ot, m, l, s);
    if (P.D == 128) return decode_over_keys<T, R, 8, DP>(P, k, v, b, h, limit, max_limit, qf, ot, m, l, s);
  }
  constexpr int DB = R <= 4 ? 4 : 2;  // output vectors per row and d-block in registers
  const int D = static_cast<int>(P.D);
  float* sc = s.st.data();  // [R][KC] scores, then probabilities
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // The rows of a chunk, read in place (float32) or widened into the scratch (bfloat16).
  const float* krow[KC];
  const float* vrow[KC];
  for (int c0 = 0; c0 < max_limit; c0 += KC) {
    const int n = std::min<int>(KC, max_limit - c0);
    const int next = std::min<int>(KC, max_limit - c0 - KC);  // <= 0 at the last chunk
    prefetch_keys(P, k, v, b, h, c0 + KC, next);
    for (int j = 0; j < n; ++j) {
      const T* kr = k + row_offset(P, P.ks, b, h, c0 + j);
      const T* vr = v + row_offset(P, P.vs, b, h, c0 + j);
      if constexpr (std::is_same_v<T, float>) {
        krow[j] = kr;
        vrow[j] = vr;
      } else {
        widen_rows(kr, 0, 1, D, s.kf.data() + j * D);
        widen_rows(vr, 0, 1, D, s.vf.data() + j * D);
        krow[j] = s.kf.data() + j * D;
        vrow[j] = s.vf.data() + j * D;
      }
    }
    const int groups = (n + LANES - 1) / LANES;
    const __m512 scale = _mm512_set1_ps(P.scale);
    for (int row = 0; row < R; ++row) {
      const float* qr = qf + row * D;
      for (int g = 0; g < groups; ++g) {
        __m512 acc[LANES];
        for (int j = 0; j < LANES; ++j) {
          const int key = g * LANES + j;
          acc[j] = _mm512_setzero_ps();
          if (key < n) {
            const float* kr = krow[key];
            for (int d = 0; d < D; d += LANES)
              acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(qr + d), _mm512_loadu_ps(kr + d), acc[j]);
          }
        }
        __m512 sv = _mm512_mul_ps(sum16(acc), scale);
        const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32(c0 + g * LANES), iota);
        const __mmask16 past = _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(std::min(limit[row], c0 + n)));
        _mm512_storeu_ps(sc + row * KC + g * LANES, _mm512_mask_blend_ps(past, sv, neg_inf));
      }
      softmax_row<T>(sc + row * KC, groups, D, ot + row * D, m[row], l[row]);
    }
    for (int d0 = 0; d0 < D; d0 += DB * LANES) {
      const int nb = std::min<int>(DB, (D - d0) / LANES);
      __m512 acc[R][DB];
      for (int row = 0; row < R; ++row)
        for (int t = 0; t < DB; ++t)
          acc[row][t] = t < nb ? _mm512_loadu_ps(ot + row * D + d0 + t * LANES) : _mm512_setzero_ps();
      for (int j = 0; j < n; ++j) {
        const float* vr = vrow[j] + d0;
        __m512 vv[DB];
        for (int t = 0; t < DB; ++t) vv[t] = t < nb ? _mm512_loadu_ps(vr + t * LANES) : _mm512_setzero_ps();
        for (int row = 0; row < R; ++row) {
          const __m512 pb = _mm512_set1_ps(sc[row * KC + j]);
          for (int t = 0; t < DB; ++t) acc[row][t] = _mm512_fmadd_ps(pb, vv[t], acc[row][t]);
        }
      }
      for (int row = 0; row < R; ++row)
        for (int t = 0; t < nb; ++t) _mm512_storeu_ps(ot + row * D + d0 + t * LANES, acc[row][t]);
    }
  }
}

// o = ot / l and lse = m + log(l) of the R rows of a keys-in-lanes item (row -> query head
// h * r + row / nq, query i0 + row % nq).
template <typename T, int R>
inline void finish_small(const Problem& P, T* o, float* lse, int64_t b, int64_t h, int64_t i0, int64_t nq,
                         const float* ot, const float* m, const float* l) {
  const int D = static_cast<int>(P.D);
  for (int row = 0; row < R; ++row) {
    const int64_t hq = h * P.r + row / nq, i = i0 + row % nq;
    const float inv = 1.0f / l[row];
    T* orow = o + ((b * P.Hq + hq) * P.M + i) * P.D;
    for (int d = 0; d < D; ++d) orow[d] = static_cast<T>(ot[row * D + d] * inv);
    lse[(b * P.Hq + hq) * P.M + i] = m[row] + std::log(l[row]);
  }
}

template <typename T, int R, bool DP>
void attend_item_small(const Problem& P, const T* q, const T* k, const T* v, T* o, float* lse, int64_t b,
                       int64_t h, int64_t i0, int64_t nq, Scratch& s) {
  const int D = static_cast<int>(P.D);
  const int64_t kv_len = P.kv_lens[b];
  int32_t limit[R];
  int32_t max_limit = 0;
  float* qf = s.qt.data();  // [R][D]
  for (int row = 0; row < R; ++row) {
    const int64_t hq = h * P.r + row / nq, i = i0 + row % nq;
    int64_t lim = kv_len;
    if (P.offsets != nullptr) lim = std::min<int64_t>(kv_len, P.offsets[b] + i + 1);
    limit[row] = static_cast<int32_t>(lim);
    max_limit = std::max<int32_t>(max_limit, limit[row]);
    const T* qrow = q + b * P.qs[0] + hq * P.qs[1] + i * P.qs[2];
    for (int d = 0; d < D; ++d) qf[row * D + d] = static_cast<float>(qrow[d]);
  }
  float* ot = s.ot.data();  // [R][D]
  std::fill(ot, ot + R * D, 0.0f);
  float m[R], l[R];
  for (int row = 0; row < R; ++row) {
    m[row] = -std::numeric_limits<float>::infinity();
    l[row] = 0.0f;
  }
  small_over_keys<T, R, DP>(P, k, v, b, h, limit, max_limit, qf, ot, m, l, s);
  finish_small<T, R>(P, o, lse, b, h, i0, nq, ot, m, l);
}

template <typename T, bool DP = false>
void attend_small(const Problem& P, const T* q, const T* k, const T* v, T* o, float* lse, int64_t b, int64_t h,
                  int64_t i0, int64_t nq, Scratch& s) {
  switch (P.r * nq) {
    case 1: return attend_item_small<T, 1, DP>(P, q, k, v, o, lse, b, h, i0, nq, s);
    case 2: return attend_item_small<T, 2, DP>(P, q, k, v, o, lse, b, h, i0, nq, s);
    case 3: return attend_item_small<T, 3, DP>(P, q, k, v, o, lse, b, h, i0, nq, s);
    case 4: return attend_item_small<T, 4, DP>(P, q, k, v, o, lse, b, h, i0, nq, s);
    case 5: return attend_item_small<T, 5, DP>(P, q, k, v, o, lse, b, h, i0, nq, s);
    case 6: return attend_item_small<T, 6, DP>(P, q, k, v, o, lse, b, h, i0, nq, s);
    case 7: return attend_item_small<T, 7, DP>(P, q, k, v, o, lse, b, h, i0, nq, s);
    default: return attend_item_small<T, 8, DP>(P, q, k, v, o, lse, b, h, i0, nq, s);
  }
}

template <typename T, bool DP>
void attend_rows(const Problem& P, const T* q, const T* k, const T* v, T* o, float* lse, int64_t b, int64_t h,
                 int64_t i0, int64_t nq, int64_t rows, Scratch& s) {
  if (rows <= 16) attend_item<T, 1, DP>(P, q, k, v, o, lse, b, h, i0, nq, s);
  else if (rows <= 32) attend_item<T, 2, DP>(P, q, k, v, o, lse, b, h, i0, nq, s);
  else if (rows <= 48) attend_item<T, 3, DP>(P, q, k, v, o, lse, b, h, i0, nq, s);
  else attend_item<T, 4, DP>(P, q, k, v, o, lse, b, h, i0, nq, s);
}

// attend_rows' dot-product path as one function compiled for AVX512-BF16: flatten inlines the whole
// call tree (the DP = true instantiations and the tiles) into it, so only this code may use it.
#ifndef RADIXKV_NO_BF16
RADIXKV_BF16 __attribute__((flatten))
#endif
void attend_rows_dp(const Problem& P, const c10::BFloat16* q, const c10::BFloat16* k, const c10::BFloat16* v,
                    c10::BFloat16* o, float* lse, int64_t b, int64_t h, int64_t i0, int64_t nq, int64_t rows,
                    Scratch& s) {
  attend_rows<c10::BFloat16, true>(P, q, k, v, o, lse, b, h, i0, nq, rows, s);
}

// attend_small's dot-product path, compiled for AVX512-BF16 (see attend_rows_dp).
#ifndef RADIXKV_NO_BF16
RADIXKV_BF16 __attribute__((flatten))
#endif
void attend_small_dp(const Problem& P, const c10::BFloat16* q, const c10::BFloat16* k, const c10::BFloat16* v,
                     c10::BFloat16* o, float* lse, int64_t b, int64_t h, int64_t i0, int64_t nq, Scratch& s) {
  attend_small<c10::BFloat16, true>(P, q, k, v, o, lse, b, h, i0, nq, s);
}

// A decode item: attend_small, on the dot-product path where it runs.
template <typename T>
void attend_decode(const Problem& P, const T* q, const T* k, const T* v, T* o, float* lse, int64_t b, int64_t h,
                   int64_t i0, int64_t nq, Scratch& s) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (P.dot_products) return attend_small_dp(P, q, k, v, o, lse, b, h, i0, nq, s);
  }
  attend_small<T>(P, q, k, v, o, lse, b, h, i0, nq, s);
}

// Brings the first keys of sequence b, KV head h into the cache: a decode's own keys are a few
// dozen cold rows, too few for the in-loop prefetch of the next chunk to cover (paged suffixes:
// about 3x slower from DRAM than from the cache), so they are asked for one item (or cascade
// member) ahead.
template <typename T>
void prefetch_first_keys(const Problem& P, const T* k, const T* v, int64_t b, int64_t h) {
  prefetch_keys(P, k, v, b, h, 0, static_cast<int>(std::min<int64_t>(KC, P.kv_lens[b])));
}

// Runs fn(idx, workers, scratch) for every idx in [0, count) on torch's threads, handing items out
// one at a time (they differ in size); each thread has its own scratch.
template <typename Fn>
void parallel_items(int64_t count, int64_t D, Fn&& fn) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count));
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(D);
    for (int64_t w = begin; w < end; ++w)
      for (int64_t idx = next.fetch_add(1); idx < count; idx = next.fetch_add(1)) fn(idx, workers, scratch);
  });
}

// ---------------------------------------------------------------- cascade decode, fused
// FlashInfer's shared-prefix (cascade) attention in one pass per (group, KV head): the r query
// heads of every member of a group form the rows of one row-lanes item over the group's prefix
// K/V (read once), then each member's rows carry their softmax state (running max, sum,
// accumulator) on over the member's own blocks in the paged cache (a keys-in-lanes item). The
// online softmax continues where the prefix ended, so nothing is merged afterwards and no query
// or result is copied between calls.
struct Cascade {
  const int64_t* members;      // [G, gm] decode positions of each group's members, -1 past its size
  const int64_t* prefix_lens;  // [G]
  int64_t G, gm, Lp;           // groups, member slots, prefix K/V length dimension
  // attend_cascade_tiles: group g's prefix packed for the tiles at tiles[g], per KV head K then V
  // of tile_words[g] words each; empty: the prefixes are prefix_k / prefix_v.
  std::vector<const uint32_t*> tiles;
  std::vector<int64_t> tile_words;
};

struct CascadeItem {
  int64_t g;      // group, or -1: an ungrouped sequence (its whole context from the cache)
  int64_t h;      // KV head
  int64_t first;  // first member slot (g >= 0) or the sequence (g < 0)
  int64_t count;  // member slots of this item
};

// One member's R = r rows after the prefix: state taken from lanes row0 .. row0 + R - 1 of the
// prefix item ([D][W] accumulator `pot`, maxima `pm`, sums `pl`), continued over keys
// [0, kv_lens[seq]) of its table row from starts[seq]; writes o and lse of its rows.
template <typename T, int R, bool DP>
void continue_member(const Problem& P, const T* q, const T* k, const T* v, T* o, float* lse, int64_t seq, int64_t h,
                     const float* pot, int W, int row0, const float* pm, const float* pl, Scratch& s) {
  const int D = static_cast<int>(P.D);
  float* qf = s.member_q.data();  // [R][D]
  float* ot = s.member_o.data();  // [R][D]
  float m[R], l[R];
  int32_t limit[R];
  const int32_t len = static_cast<int32_t>(P.kv_lens[seq]);
  for (int j = 0; j < R; ++j) {
    m[j] = pm[row0 + j];
    l[j] = pl[row0 + j];
    limit[j] = len;
    const T* qrow = q + (seq * P.Hq + h * P.r + j) * D;
    for (int d = 0; d < D; ++d) {
      qf[j * D + d] = static_cast<float>(qrow[d]);
      ot[j * D + d] = pot[d * W + row0 + j];
    }
  }
  small_over_keys<T, R, DP>(P, k, v, seq, h, limit, len, qf, ot, m, l, s);
  finish_small<T, R>(P, o, lse, seq, h, 0, 1, ot, m, l);
}

template <typename T, bool DP>
void continue_member_rows(const Problem& P, const T* q, const T* k, const T* v, T* o, float* lse, int64_t seq,
                          int64_t h, const float* pot, int W, int row0, const float* pm, const float* pl, Scratch& s) {
  switch (P.r) {
    case 1: return continue_member<T, 1, DP>(P, q, k, v, o, lse, seq, h, pot, W, row0, pm, pl, s);
    case 2: return continue_member<T, 2, DP>(P, q, k, v, o, lse, seq, h, pot, W, row0, pm, pl, s);
    case 3: return continue_member<T, 3, DP>(P, q, k, v, o, lse, seq, h, pot, W, row0, pm, pl, s);
    case 4: return continue_member<T, 4, DP>(P, q, k, v, o, lse, seq, h, pot, W, row0, pm, pl, s);
    case 5: return continue_member<T, 5, DP>(P, q, k, v, o, lse, seq, h, pot, W, row0, pm, pl, s);
    case 6: return continue_member<T, 6, DP>(P, q, k, v, o, lse, seq, h, pot, W, row0, pm, pl, s);
    case 7: return continue_member<T, 7, DP>(P, q, k, v, o, lse, seq, h, pot, W, row0, pm, pl, s);
    default: return continue_member<T, 8, DP>(P, q, k, v, o, lse, seq, h, pot, W, row0, pm, pl, s);
  }
}

// Group g, KV head h, member slots [first, first + count): the prefix pass, then each member.
template <typename T, int RV, bool DP>
void cascade_item(const Problem& P, const Cascade& C, const T* q, const T* pk, const T* pv, const T* k, const T* v,
                  T* o, float* lse, const CascadeItem& item, Scratch& s) {
  constexpr int W = RV * LANES;
  const int D = static_cast<int>(P.D);
  const int r = static_cast<int>(P.r);
  const int rows = static_cast<int>(item.count) * r;
  const int64_t* members = C.members + item.g * C.gm + item.first;
  const int32_t plen = static_cast<int32_t>(C.prefix_lens[item.g]);
  float* ot = s.ot.data();  // the prefix pass's accumulator, [D][W], row = slot * r + j
  alignas(64) float mv[W], lv[W];
  const int64_t head = (item.g * P.Hkv + item.h) * C.Lp * D;
  auto query = [&](int row) { return q + (members[row / r] * P.Hq + item.h * r + row % r) * D; };
  prefetch_first_keys(P, k, v, members[0], item.h);  // lands in L2 while the prefix streams by
  bool tiled = false;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // The prefix on AMX tiles (tile_attention.cpp), packed by this call or once before it: the
    // same state after.
    if (!C.tiles.empty() || (DP && radixkv::tiles_run(D))) {
      const c10::BFloat16* queries[W];
      for (int row = 0; row < rows; ++row) queries[row] = query(row);
      if (!C.tiles.empty()) {
        const int64_t words = C.tile_words[item.g];
        const uint32_t* kp = C.tiles[item.g] + item.h * 2 * words;
        radixkv::attend_packed_prefix_tiles(queries, rows, kp, kp + words, plen, D, P.scale, ot, W, mv, lv);
      } else {
        radixkv::attend_prefix_tiles(queries, rows, pk + head, pv + head, D, plen, D, P.scale, ot, W, mv, lv);
      }
      tiled = true;
    }
  }
  if (!tiled) {
    alignas(64) int32_t limit[W];
    std::fill(limit, limit + W, plen);
    float* qt = s.qt.data();
    __m512 m[RV], l[RV];
    start_rows<RV>(D, qt, ot, m, l);
    for (int row = 0; row < rows; ++row) put_query_row<T, DP>(query(row), D, W, row, qt);
    rows_over_keys<T, RV, DP>(P, pk + head, D, pv + head, D, limit, plen, plen, qt, ot, m, l, s);
    for (int vv = 0; vv < RV; ++vv) {
      _mm512_store_ps(mv + vv * LANES, m[vv]);
      _mm512_store_ps(lv + vv * LANES, l[vv]);
    }
  }
  for (int64_t slot = 0; slot < item.count; ++slot) {
    if (slot + 1 < item.count) prefetch_first_keys(P, k, v, members[slot + 1], item.h);
    continue_member_rows<T, DP>(P, q, k, v, o, lse, members[slot], item.h, ot, W, static_cast<int>(slot) * r, mv, lv, s);
  }
}

template <typename T, bool DP>
void cascade_rows(const Problem& P, const Cascade& C, const T* q, const T* pk, const T* pv, const T* k, const T* v,
                  T* o, float* lse, const CascadeItem& item, Scratch& s) {
  const int64_t rows = item.count * P.r;
  if (rows <= 16) cascade_item<T, 1, DP>(P, C, q, pk, pv, k, v, o, lse, item, s);
  else if (rows <= 32) cascade_item<T, 2, DP>(P, C, q, pk, pv, k, v, o, lse, item, s);
  else if (rows <= 48) cascade_item<T, 3, DP>(P, C, q, pk, pv, k, v, o, lse, item, s);
  else cascade_item<T, 4, DP>(P, C, q, pk, pv, k, v, o, lse, item, s);
}

// cascade_rows' dot-product path, compiled for AVX512-BF16 (see attend_rows_dp).
#ifndef RADIXKV_NO_BF16
RADIXKV_BF16 __attribute__((flatten))
#endif
void cascade_rows_dp(const Problem& P, const Cascade& C, const c10::BFloat16* q, const c10::BFloat16* pk,
                     const c10::BFloat16* pv, const c10::BFloat16* k, const c10::BFloat16* v, c10::BFloat16* o,
                     float* lse, const CascadeItem& item, Scratch& s) {
  cascade_rows<c10::BFloat16, true>(P, C, q, pk, pv, k, v, o, lse, item, s);
}

template <typename T>
void run_cascade(const Problem& P, const Cascade& C, const std::vector<CascadeItem>& items, const T* q, const T* pk,
                 const T* pv, const T* k, const T* v, T* o, float* lse) {
  parallel_items(static_cast<int64_t>(items.size()), P.D, [&](int64_t idx, int64_t, Scratch& scratch) {
    const CascadeItem& item = items[idx];
    if (item.g < 0) {  // an ungrouped sequence: a keys-in-lanes item over its whole context
      attend_decode<T>(P, q, k, v, o, lse, item.first, item.h, 0, 1, scratch);
    } else if (P.dot_products) {
      if constexpr (std::is_same_v<T, c10::BFloat16>) cascade_rows_dp(P, C, q, pk, pv, k, v, o, lse, item, scratch);
    } else {
      cascade_rows<T, false>(P, C, q, pk, pv, k, v, o, lse, item, scratch);
    }
  });
}

template <typename T>
void run(const Problem& P, const T* q, const T* k, const T* v, T* o, float* lse) {
  const int64_t per_seq = P.Hkv * P.nqb;
  const int64_t items = P.B * per_seq;
  parallel_items(items, P.D, [&](int64_t idx, int64_t workers, Scratch& scratch) {
    // Latest query blocks first (under a causal mask they read the most keys).
    const int64_t blk = P.nqb - 1 - idx / (P.B * P.Hkv);
    const int64_t b = (idx % (P.B * P.Hkv)) / P.Hkv, h = idx % P.Hkv;
    const int64_t i0 = blk * P.qb, nq = std::min<int64_t>(P.qb, P.M - i0);
    const int64_t rows = P.r * nq;
    if (P.small && idx + workers < items) {  // likely this thread's next item
      const int64_t after = idx + workers;
      prefetch_first_keys(P, k, v, (after % (P.B * P.Hkv)) / P.Hkv, after % P.Hkv);
    }
    if (P.small) attend_decode<T>(P, q, k, v, o, lse, b, h, i0, nq, scratch);
    else if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (P.dot_products) attend_rows_dp(P, q, k, v, o, lse, b, h, i0, nq, rows, scratch);
      else attend_rows<T, false>(P, q, k, v, o, lse, b, h, i0, nq, rows, scratch);
    } else {
      attend_rows<T, false>(P, q, k, v, o, lse, b, h, i0, nq, rows, scratch);
    }
  });
}

// The problem's sizes from q [B, Hq, M, D] and the number of KV heads, checked.
Problem heads(const at::Tensor& q, int64_t num_kv_heads) {
  Problem P{};
  P.B = q.size(0);
  P.Hq = q.size(1);
  P.M = q.size(2);
  P.D = q.size(3);
  P.Hkv = num_kv_heads;
  TORCH_CHECK(P.Hkv > 0 && P.Hq % P.Hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(P.D % LANES == 0 && P.D <= MAX_D, "head_dim must be a multiple of 16, at most ", MAX_D);
  P.r = P.Hq / P.Hkv;
  return P;
}

// bfloat16 calls tiles_take() takes, on AMX tiles (tile_attention.cpp).
void run_tiles(const Problem& P, const c10::BFloat16* q, const c10::BFloat16* k, const c10::BFloat16* v,
               c10::BFloat16* o, float* lse) {
  radixkv::TileProblem T{P.B, P.Hq, P.Hkv, P.M, P.L, P.D, P.kv_lens, P.offsets, {}, {}, {}, P.scale};
  for (int i = 0; i < 3; ++i) {
    T.qs[i] = P.qs[i];
    T.ks[i] = P.ks[i];
    T.vs[i] = P.vs[i];
  }
  radixkv::attend_tiles(T, q, k, v, o, lse);
}

// Allocates o [B, Hq, M, D] (q's dtype) and lse [B, Hq, M] float32 and runs the planned problem
// (on AMX tiles where `tiles`).
std::tuple<at::Tensor, at::Tensor> launch(const Problem& P, const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, bool tiles) {
  at::Tensor o = at::empty({P.B, P.Hq, P.M, P.D}, q.options());
  at::Tensor lse = at::empty({P.B, P.Hq, P.M}, q.options().dtype(at::kFloat));
  if (o.numel() == 0) return {o, lse};
  if (q.scalar_type() == at::kFloat) {
    run<float>(P, q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), o.data_ptr<float>(),
               lse.data_ptr<float>());
  } else {
    using BF = c10::BFloat16;
    (tiles ? run_tiles : run<BF>)(P, q.data_ptr<BF>(), k.data_ptr<BF>(), v.data_ptr<BF>(), o.data_ptr<BF>(),
                                  lse.data_ptr<float>());
  }
  return {o, lse};
}

void check_layout(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 4, name, " must be 4-D [batch, heads, len, head_dim], got ", t.dim(), "-D");
  TORCH_CHECK(t.stride(3) == 1, name, "'s last dimension must be contiguous");
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

// q [B, Hq, M, D]; k, v [B, Hkv, L, D] (last dim contiguous, other strides free); kv_lens int64 [B]
// in [1, L]; causal_offsets int64 [B] >= 0 or None: query i of sequence b sees keys
// j < min(kv_lens[b], causal_offsets[b] + i + 1). Returns o [B, Hq, M, D] (q's dtype, contiguous)
// and lse [B, Hq, M] float32 (natural log of the sum of exp of the scaled scores).
std::tuple<at::Tensor, at::Tensor> attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                          const at::Tensor& kv_lens, const std::optional<at::Tensor>& causal_offsets,
                                          double scale) {
  check_layout(q, "q");
  check_layout(k, "k");
  check_layout(v, "v");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), "q, k, v dtypes differ");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "dtype must be float32 or bfloat16");
  TORCH_CHECK(k.sizes() == v.sizes(), "k and v shapes differ");
  Problem P = heads(q, k.size(1));
  P.L = k.size(2);
  TORCH_CHECK(k.size(0) == P.B && k.size(3) == P.D, "k must be [", P.B, ", Hkv, L, ", P.D, "]");
  TORCH_CHECK(P.r <= MAX_ROWS, "at most ", MAX_ROWS, " query heads per KV head");
  TORCH_CHECK(kv_lens.scalar_type() == at::kLong && kv_lens.is_contiguous() && kv_lens.numel() == P.B,
              "kv_lens must be contiguous int64 [batch]");
  P.kv_lens = kv_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < P.B; ++b)
    TORCH_CHECK(P.kv_lens[b] >= 1 && P.kv_lens[b] <= P.L, "kv_lens[", b, "]=", P.kv_lens[b], " not in [1, ", P.L, "]");
  P.offsets = nullptr;
  if (causal_offsets.has_value()) {
    const at::Tensor& off = *causal_offsets;
    TORCH_CHECK(off.scalar_type() == at::kLong && off.is_contiguous() && off.numel() == P.B,
                "causal_offsets must be contiguous int64 [batch]");
    P.offsets = off.data_ptr<int64_t>();
    for (int64_t b = 0; b < P.B; ++b) TORCH_CHECK(P.offsets[b] >= 0, "causal_offsets must be >= 0");
  }
  // Items of at most SMALL_ROWS rows (decodes) put keys in the lanes, larger ones query rows.
  P.small = P.r * P.M <= SMALL_ROWS;
  P.qb = P.small ? P.M : std::max<int64_t>(1, std::min<int64_t>(P.M, MAX_ROWS / P.r));
  P.nqb = (P.M + P.qb - 1) / P.qb;
  for (int i = 0; i < 3; ++i) {
    P.qs[i] = q.stride(i);
    P.ks[i] = k.stride(i);
    P.vs[i] = v.stride(i);
  }
  P.scale = static_cast<float>(scale);
  P.dot_products = q.scalar_type() == at::kBFloat16 && has_bf16_dot_products() && allow_bf16_dot_products.load();
  return launch(P, q, k, v, P.dot_products && radixkv::tiles_take(P.D, P.M));
}

// Reads sequence b's keys from the paged caches: tokens starts[b] .. starts[b] + kv_lens[b] - 1 of
// its block table row. Checks every block a sequence reads exists (no read out of the caches).
void set_paged(Problem& P, const at::Tensor& block_tables, const at::Tensor& starts, const at::Tensor& kv_lens,
               int64_t num_blocks) {
  for (const auto* t : {&block_tables, &starts, &kv_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "block_tables, starts, kv_lens must be contiguous int64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == P.B, "block_tables must be [batch, width]");
  TORCH_CHECK(starts.numel() == P.B && kv_lens.numel() == P.B, "starts and kv_lens must be [batch]");
  P.tables = block_tables.data_ptr<int64_t>();
  P.table_width = block_tables.size(1);
  P.starts = starts.data_ptr<int64_t>();
  P.kv_lens = kv_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < P.B; ++b) {
    const int64_t first = P.starts[b], len = P.kv_lens[b];
    TORCH_CHECK(first >= 0 && len >= 1, "sequence ", b, ": starts must be >= 0 and kv_lens >= 1");
    const int64_t last_col = (first + len - 1) / P.block_size;
    TORCH_CHECK(last_col < P.table_width, "sequence ", b, " needs block column ", last_col, ", the table has ",
                P.table_width);
    for (int64_t c = first / P.block_size; c <= last_col; ++c) {
      const int64_t blk = P.tables[b * P.table_width + c];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "sequence ", b, " block ", blk, " not in [0, ", num_blocks, ")");
    }
  }
}

void check_caches(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  check_layout(k_cache, "k_cache");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must be contiguous [num_blocks, block_size, Hkv, D] of one shape");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q, k_cache, v_cache dtypes differ");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "dtype must be float32 or bfloat16");
}

// Decode attention straight from the paged caches, no gathered copy: q [B, Hq, M, D] with
// (Hq / Hkv) * M <= 8 rows per KV head (decodes); k_cache, v_cache [num_blocks, block_size, Hkv, D]
// contiguous; block_tables int64 [B, width]; starts, kv_lens int64 [B]: sequence b attends over the
// tokens starts[b] .. starts[b] + kv_lens[b] - 1 of its table row. Returns (o, lse) as attend().
std::tuple<at::Tensor, at::Tensor> attend_paged(const at::Tensor& q, const at::Tensor& k_cache,
                                                const at::Tensor& v_cache, const at::Tensor& block_tables,
                                                const at::Tensor& starts, const at::Tensor& kv_lens, double scale) {
  check_layout(q, "q");
  check_caches(q, k_cache, v_cache);
  Problem P = heads(q, k_cache.size(2));
  const int64_t num_blocks = k_cache.size(0);
  P.block_size = k_cache.size(1);
  TORCH_CHECK(k_cache.size(3) == P.D, "k_cache head_dim ", k_cache.size(3), " != q's ", P.D);
  TORCH_CHECK(P.r * P.M <= SMALL_ROWS, "attend_paged takes at most ", SMALL_ROWS, " query rows per KV head");
  set_paged(P, block_tables, starts, kv_lens, num_blocks);
  P.offsets = nullptr;
  P.small = true;
  P.qb = P.M;
  P.nqb = 1;
  for (int i = 0; i < 3; ++i) P.qs[i] = q.stride(i);
  P.scale = static_cast<float>(scale);
  P.dot_products = q.scalar_type() == at::kBFloat16 && has_bf16_dot_products() && allow_bf16_dot_products.load();
  return launch(P, q, k_cache, v_cache, false);
}

// A cascade call's problem, checked: everything but the prefixes' K/V (G groups, Lp positions).
struct CascadeCall {
  Problem P;
  Cascade C;
  std::vector<CascadeItem> items;
};

CascadeCall cascade_call(const at::Tensor& q, int64_t G, int64_t Lp, const at::Tensor& prefix_lens,
                         const at::Tensor& members, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_tables, const at::Tensor& starts, const at::Tensor& kv_lens,
                         double scale) {
  const at::Tensor q4 = q.unsqueeze(2);  // [n, Hq, 1, D]
  CascadeCall call{heads(q4, k_cache.size(2)), Cascade{}, {}};
  Problem& P = call.P;
  Cascade& C = call.C;
  TORCH_CHECK(P.r <= SMALL_ROWS, "attend_cascade takes at most ", SMALL_ROWS, " query heads per KV head");
  TORCH_CHECK(k_cache.size(3) == P.D, "k_cache head_dim ", k_cache.size(3), " != q's ", P.D);
  C.G = G;
  C.Lp = Lp;
  TORCH_CHECK(prefix_lens.scalar_type() == at::kLong && prefix_lens.is_contiguous() && prefix_lens.numel() == C.G,
              "prefix_lens must be contiguous int64 [groups]");
  TORCH_CHECK(members.scalar_type() == at::kLong && members.is_contiguous() && members.dim() == 2 &&
                  members.size(0) == C.G,
              "members must be contiguous int64 [groups, max members]");
  C.gm = members.size(1);
  C.members = members.data_ptr<int64_t>();
  C.prefix_lens = prefix_lens.data_ptr<int64_t>();
  P.block_size = k_cache.size(1);
  set_paged(P, block_tables, starts, kv_lens, k_cache.size(0));
  P.qs[0] = P.Hq * P.D;
  P.qs[1] = P.qs[2] = P.D;
  P.offsets = nullptr;
  P.small = true;
  P.qb = 1;
  P.nqb = 1;
  P.scale = static_cast<float>(scale);
  P.dot_products = q.scalar_type() == at::kBFloat16 && has_bf16_dot_products() && allow_bf16_dot_products.load();
  // Work items: each group's members in slots of at most MAX_ROWS rows (largest first), then the
  // sequences in no group.
  std::vector<char> grouped(P.B, 0);
  std::vector<CascadeItem>& items = call.items;
  const int64_t per_item = MAX_ROWS / P.r;
  for (int64_t g = 0; g < C.G; ++g) {
    TORCH_CHECK(C.prefix_lens[g] >= 1 && C.prefix_lens[g] <= C.Lp, "prefix_lens[", g, "]=", C.prefix_lens[g],
                " not in [1, ", C.Lp, "]");
    int64_t size = 0;
    while (size < C.gm && C.members[g * C.gm + size] >= 0) ++size;
    for (int64_t i = size; i < C.gm; ++i)
      TORCH_CHECK(C.members[g * C.gm + i] < 0, "members: group ", g, " has a member after its -1 padding");
    TORCH_CHECK(size >= 1, "members: group ", g, " has no member");
    for (int64_t i = 0; i < size; ++i) {
      const int64_t seq = C.members[g * C.gm + i];
      TORCH_CHECK(seq < P.B, "members: position ", seq, " not in [0, ", P.B, ")");
      TORCH_CHECK(!grouped[seq], "members: position ", seq, " is in more than one group slot");
      grouped[seq] = 1;
    }
    for (int64_t first = 0; first < size; first += per_item)
      for (int64_t h = 0; h < P.Hkv; ++h) items.push_back({g, h, first, std::min(per_item, size - first)});
  }
  std::stable_sort(items.begin(), items.end(), [&](const CascadeItem& a, const CascadeItem& b) {
    return C.prefix_lens[a.g] * a.count > C.prefix_lens[b.g] * b.count;
  });
  for (int64_t b = 0; b < P.B; ++b)
    if (!grouped[b])
      for (int64_t h = 0; h < P.Hkv; ++h) items.push_back({-1, h, b, 1});
  return call;
}

// Runs a checked cascade call; pk, pv: the prefixes' K/V (nullptr where C.tiles holds them).
std::tuple<at::Tensor, at::Tensor> launch_cascade(const CascadeCall& call, const at::Tensor& q, const void* pk,
                                                  const void* pv, const at::Tensor& k_cache,
                                                  const at::Tensor& v_cache) {
  const Problem& P = call.P;
  at::Tensor o = at::empty({P.B, P.Hq, P.D}, q.options());
  at::Tensor lse = at::empty({P.B, P.Hq}, q.options().dtype(at::kFloat));
  if (o.numel() == 0) return {o, lse};
  if (q.scalar_type() == at::kFloat) {
    run_cascade<float>(P, call.C, call.items, q.data_ptr<float>(), static_cast<const float*>(pk),
                       static_cast<const float*>(pv), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                       o.data_ptr<float>(), lse.data_ptr<float>());
  } else {
    using BF = c10::BFloat16;
    run_cascade<BF>(P, call.C, call.items, q.data_ptr<BF>(), static_cast<const BF*>(pk), static_cast<const BF*>(pv),
                    k_cache.data_ptr<BF>(), v_cache.data_ptr<BF>(), o.data_ptr<BF>(), lse.data_ptr<float>());
  }
  return {o, lse};
}

// Cascade decode attention (see run_cascade): q [n, Hq, D] contiguous, one new token per decode
// sequence; prefix_k, prefix_v [G, Hkv, Lp, D] contiguous, group g's shared prefix in its first
// prefix_lens[g] positions; members int64 [G, gm]: the decode positions (rows of q) of group g's
// members, -1 past its size, each position in at most one group; k_cache, v_cache [num_blocks,
// block_size, Hkv, D]; block_tables [n, width], starts, kv_lens int64 [n]: sequence i's own keys
// are its tokens starts[i] .. starts[i] + kv_lens[i] - 1 (a member: after its group's prefix; a
// sequence in no group: its whole context). Returns o [n, Hq, D] (q's dtype) and lse [n, Hq].
std::tuple<at::Tensor, at::Tensor> attend_cascade(const at::Tensor& q, const at::Tensor& prefix_k,
                                                  const at::Tensor& prefix_v, const at::Tensor& prefix_lens,
                                                  const at::Tensor& members, const at::Tensor& k_cache,
                                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                                  const at::Tensor& starts, const at::Tensor& kv_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.device().is_cpu(), "q must be a contiguous CPU [n, Hq, D]");
  check_caches(q, k_cache, v_cache);
  TORCH_CHECK(prefix_k.dim() == 4 && prefix_k.is_contiguous() && prefix_v.is_contiguous() &&
                  prefix_k.sizes() == prefix_v.sizes(),
              "prefix_k and prefix_v must be contiguous [groups, Hkv, len, D] of one shape");
  const CascadeCall call = cascade_call(q, prefix_k.size(0), prefix_k.size(2), prefix_lens, members, k_cache, v_cache,
                                        block_tables, starts, kv_lens, scale);
  TORCH_CHECK(prefix_k.scalar_type() == q.scalar_type() && prefix_v.scalar_type() == q.scalar_type(),
              "prefix_k, prefix_v dtypes differ from q's");
  TORCH_CHECK(prefix_k.size(1) == call.P.Hkv && prefix_k.size(3) == call.P.D, "prefix_k must be [groups, ",
              call.P.Hkv, ", len, ", call.P.D, "]");
  return launch_cascade(call, q, prefix_k.data_ptr(), prefix_v.data_ptr(), k_cache, v_cache);
}

// The cascade prefixes packed once for the AMX tiles, to be attended by attend_cascade_tiles
// while they stay valid: prefix_k, prefix_v bfloat16 [G, Hkv, Lp, D] contiguous, prefix_lens
// int64 [G] (each in [0, Lp]). Returns int32 [G, Hkv, 2, radixkv::prefix_tile_words(Lp, D)]: per
// (group, KV head) K then V in the tiles' layout, zero past the group's length to its 64-key block.
at::Tensor pack_prefix_tiles(const at::Tensor& prefix_k, const at::Tensor& prefix_v, const at::Tensor& prefix_lens) {
  TORCH_CHECK(prefix_k.dim() == 4 && prefix_k.is_contiguous() && prefix_v.is_contiguous() &&
                  prefix_k.sizes() == prefix_v.sizes() && prefix_k.device().is_cpu(),
              "prefix_k and prefix_v must be contiguous CPU [groups, Hkv, len, D] of one shape");
  TORCH_CHECK(prefix_k.scalar_type() == at::kBFloat16 && prefix_v.scalar_type() == at::kBFloat16,
              "pack_prefix_tiles takes bfloat16 prefixes");
  const int64_t G = prefix_k.size(0), Hkv = prefix_k.size(1), Lp = prefix_k.size(2), D = prefix_k.size(3);
  TORCH_CHECK(radixkv::tiles_run(D), "pack_prefix_tiles: attention on AMX tiles does not run here for head_dim ", D,
              " (no AMX, a head_dim that is not a multiple of 32 up to 256, or turned off)");
  TORCH_CHECK(prefix_lens.scalar_type() == at::kLong && prefix_lens.is_contiguous() && prefix_lens.numel() == G,
              "prefix_lens must be contiguous int64 [groups]");
  const int64_t* lens = prefix_lens.data_ptr<int64_t>();
  for (int64_t g = 0; g < G; ++g)
    TORCH_CHECK(lens[g] >= 0 && lens[g] <= Lp, "prefix_lens[", g, "]=", lens[g], " not in [0, ", Lp, "]");
  const int64_t words = radixkv::prefix_tile_words(Lp, D);
  at::Tensor tiles = at::empty({G, Hkv, 2, words}, prefix_k.options().dtype(at::kInt));
  const auto* k = prefix_k.data_ptr<c10::BFloat16>();
  const auto* v = prefix_v.data_ptr<c10::BFloat16>();
  auto* out = reinterpret_cast<uint32_t*>(tiles.data_ptr<int32_t>());
  at::parallel_for(0, G * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t gh = begin; gh < end; ++gh)
      radixkv::pack_prefix_tiles(k + gh * Lp * D, v + gh * Lp * D, D, lens[gh / Hkv], D, out + gh * 2 * words,
                                 out + gh * 2 * words + words);
  });
  return tiles;
}

// prefix_tiles[i] checked to be pack_prefix_tiles' int32 [Hkv, 2, words] for one prefix; returns
// how many keys it holds (words in whole 64-key blocks).
int64_t packed_prefix_keys(at::TensorList prefix_tiles, int64_t i, int64_t Hkv, int64_t D) {
  const at::Tensor& t = prefix_tiles[i];
  const int64_t block_words = radixkv::prefix_tile_words(1, D);  // one 64-key block
  TORCH_CHECK(t.scalar_type() == at::kInt && t.is_contiguous() && t.device().is_cpu() && t.dim() == 3 &&
                  t.size(0) == Hkv && t.size(1) == 2 && t.size(2) > 0 && t.size(2) % block_words == 0,
              "prefix_tiles[", i, "] must be pack_prefix_tiles' int32 [", Hkv, ", 2, a multiple of ", block_words,
              "] for one prefix");
  return t.size(2) / block_words * 64;
}

// attend_cascade over prefixes pack_prefix_tiles packed, one tensor per group (prefix_tiles[g]:
// int32 [Hkv, 2, words], words at least prefix_tile_words(prefix_lens[g], D), e.g. a group's slice
// of pack_prefix_tiles' result): bit for bit the result attend_cascade gives on the tiles for the
// same K/V; bfloat16 only, where the tiles run.
std::tuple<at::Tensor, at::Tensor> attend_cascade_tiles(const at::Tensor& q, at::TensorList prefix_tiles,
                                                        const at::Tensor& prefix_lens, const at::Tensor& members,
                                                        const at::Tensor& k_cache, const at::Tensor& v_cache,
                                                        const at::Tensor& block_tables, const at::Tensor& starts,
                                                        const at::Tensor& kv_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.device().is_cpu(), "q must be a contiguous CPU [n, Hq, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16, "attend_cascade_tiles takes bfloat16 q");
  check_caches(q, k_cache, v_cache);
  const int64_t D = q.size(2), Hkv = k_cache.size(2), G = static_cast<int64_t>(prefix_tiles.size());
  TORCH_CHECK(radixkv::tiles_run(D), "attend_cascade_tiles: attention on AMX tiles does not run here for head_dim ", D);
  std::vector<int64_t> holds(G);  // keys each prefix's packing holds
  int64_t Lp = 1;
  for (int64_t g = 0; g < G; ++g) Lp = std::max(Lp, holds[g] = packed_prefix_keys(prefix_tiles, g, Hkv, D));
  CascadeCall call = cascade_call(q, G, Lp, prefix_lens, members, k_cache, v_cache, block_tables, starts, kv_lens,
                                  scale);
  for (int64_t g = 0; g < G; ++g) {
    TORCH_CHECK(call.C.prefix_lens[g] <= holds[g], "prefix_lens[", g, "]=", call.C.prefix_lens[g],
                " is longer than prefix_tiles[", g, "] holds");
    call.C.tiles.push_back(reinterpret_cast<const uint32_t*>(prefix_tiles[g].data_ptr<int32_t>()));
    call.C.tile_words.push_back(prefix_tiles[g].size(2));
  }
  return launch_cascade(call, q, nullptr, nullptr, k_cache, v_cache);
}

// Chunks of new tokens whose cached prefixes pack_prefix_tiles packed (one tensor per sequence, as
// attend_cascade_tiles takes them): sequence b's lens[b] new tokens are rows starts[b] .. of q
// [T, Hq, D], k, v [T, Hkv, D] (bfloat16, last dimension contiguous); each attends over its whole
// prefix (prefix_lens[b] keys) and its new tokens up to itself, on AMX tiles, into the same rows of
// out [T, Hq, D] (other rows untouched).
void attend_extends_tiles(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& starts,
                          const at::Tensor& lens, at::TensorList prefix_tiles, const at::Tensor& prefix_lens,
                          double scale, at::Tensor& out) {
  auto rows = [](const at::Tensor& t) {
    return t.dim() == 3 && t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.stride(2) == 1;
  };
  TORCH_CHECK(rows(q) && rows(k) && rows(v) && rows(out), "q, k, v and out must be bfloat16 CPU [T, heads, D] "
              "with the last dimension contiguous");
  const int64_t T = q.size(0), Hq = q.size(1), Hkv = k.size(1), D = q.size(2);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == T && k.size(2) == D && out.sizes() == q.sizes(),
              "k, v must be [", T, ", Hkv, ", D, "] and out q's shape");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(radixkv::tiles_run(D), "attend_extends_tiles: attention on AMX tiles does not run here for head_dim ", D);
  const int64_t B = static_cast<int64_t>(prefix_tiles.size());
  for (const at::Tensor* t : {&starts, &lens, &prefix_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1 && t->numel() == B,
                "starts, lens and prefix_lens must be contiguous int64 [", B, "] (one per prefix_tiles)");
  const int64_t *st = starts.data_ptr<int64_t>(), *ln = lens.data_ptr<int64_t>(), *pl = prefix_lens.data_ptr<int64_t>();
  std::vector<const uint32_t*> tiles(B);
  std::vector<int64_t> words(B);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ln[b] >= 1 && st[b] >= 0 && st[b] <= T - ln[b], "sequence ", b, ": rows ", st[b], " + ", ln[b],
                " not within q's ", T);
    TORCH_CHECK(pl[b] >= 0 && pl[b] <= packed_prefix_keys(prefix_tiles, b, Hkv, D), "prefix_lens[", b, "]=", pl[b],
                " is not within what prefix_tiles[", b, "] holds");
    tiles[b] = reinterpret_cast<const uint32_t*>(prefix_tiles[b].data_ptr<int32_t>());
    words[b] = prefix_tiles[b].size(2);
  }
  if (B == 0) return;
  radixkv::ExtendProblem P{B, Hq, Hkv, D, st, ln, pl, tiles.data(), words.data(),
                           {q.stride(0), q.stride(1)}, {k.stride(0), k.stride(1)}, {v.stride(0), v.stride(1)},
                           {out.stride(0), out.stride(1)}, static_cast<float>(scale)};
  using BF = c10::BFloat16;
  radixkv::attend_extends_tiles(P, q.data_ptr<BF>(), k.data_ptr<BF>(), v.data_ptr<BF>(), out.data_ptr<BF>());
}

// Whether bfloat16 inputs may take the AVX512-BF16 path (tests turn it off to check the other one);
// returns the previous setting.
bool set_bf16_dot_products(bool enabled) { return allow_bf16_dot_products.exchange(enabled); }

}  // namespace

TORCH_LIBRARY(radixkv, m) {
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor kv_lens, Tensor? causal_offsets, float scale) -> (Tensor, Tensor)");
  m.impl("attend", c10::DispatchKey::CPU, TORCH_FN(attend));
  m.def("attend_paged(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor starts, Tensor kv_lens, "
        "float scale) -> (Tensor, Tensor)");
  m.impl("attend_paged", c10::DispatchKey::CPU, TORCH_FN(attend_paged));
  m.def("attend_cascade(Tensor q, Tensor prefix_k, Tensor prefix_v, Tensor prefix_lens, Tensor members, "
        "Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor starts, Tensor kv_lens, float scale) "
        "-> (Tensor, Tensor)");
  m.impl("attend_cascade", c10::DispatchKey::CPU, TORCH_FN(attend_cascade));
  m.def("pack_prefix_tiles(Tensor prefix_k, Tensor prefix_v, Tensor prefix_lens) -> Tensor");
  m.impl("pack_prefix_tiles", c10::DispatchKey::CPU, TORCH_FN(pack_prefix_tiles));
  m.def("attend_cascade_tiles(Tensor q, Tensor[] prefix_tiles, Tensor prefix_lens, Tensor members, Tensor k_cache, "
        "Tensor v_cache, Tensor block_tables, Tensor starts, Tensor kv_lens, float scale) -> (Tensor, Tensor)");
  m.impl("attend_cascade_tiles", c10::DispatchKey::CPU, TORCH_FN(attend_cascade_tiles));
  m.def("attend_extends_tiles(Tensor q, Tensor k, Tensor v, Tensor starts, Tensor lens, Tensor[] prefix_tiles, "
        "Tensor prefix_lens, float scale, Tensor(a!) out) -> ()");
  m.impl("attend_extends_tiles", c10::DispatchKey::CPU, TORCH_FN(attend_extends_tiles));
  m.def("set_bf16_dot_products(bool enabled) -> bool", set_bf16_dot_products);
  m.def("has_bf16_dot_products() -> bool", radixkv::has_bf16_dot_products);
}
