// The key loop of a decode work item (keys in the vector lanes) for head_dim D = DV * 16 known at
// compile time (64 and 128: the models' sizes), included by attention.cpp after the helpers it
// uses (Problem, Scratch, sum16, softmax_row, key_rows, prefetch_line).
//
// Why a second kernel beside attention.cpp's generic small_over_keys: a decode reads every K/V row
// of its context once per layer, so the loop must hide memory latency behind arithmetic. Here the
// query row sits in registers (D known), each 16-key group's scores are 16 independent chains
// summed by one transposing add tree, row pointers come one table lookup per block, and while a
// key's score is computed one row of the group PREFETCH_GROUPS ahead is fetched, K and V: a
// steady trickle the miss buffers take (a whole chunk asked for at once fills them and stalls the
// loads that need their data now).
//
// DP (bfloat16 on a CPU with AVX512-BF16): scores are bfloat16 dot products of the query and the
// key rows read in place (no widening), and P·V runs as dot products over key pairs: two V rows
// interleaved by unpacklo/unpackhi (per 128-bit lane), each pair of probabilities broadcast. The
// accumulator's lanes then hold d in the unpack order; it is permuted in on entry and back out
// on exit (continued cascade states stay in the natural order between calls).
#pragma once

namespace {

// Permutes a [R][D] accumulator between the natural order and the unpack order of the DP path
// (`to_unpack`): per 32 values, unpacked lane i of the low vector is d = 8 * (i / 4) + i % 4, of the
// high one d = 8 * (i / 4) + 4 + i % 4.
inline void permute_unpack_order(float* ot, int rows, int D, bool to_unpack) {
  alignas(64) float tmp[32];
  for (int row = 0; row < rows; ++row)
    for (int d0 = 0; d0 < D; d0 += 32) {
      float* x = ot + row * D + d0;
      for (int i = 0; i < 16; ++i) {
        const int lo = 8 * (i / 4) + i % 4, hi = lo + 4;
        if (to_unpack) {
          tmp[i] = x[lo];
          tmp[16 + i] = x[hi];
        } else {
          tmp[lo] = x[i];
          tmp[hi] = x[16 + i];
        }
      }
      std::memcpy(x, tmp, sizeof(tmp));
    }
}

template <typename T>
inline void prefetch_key_rows(const T* const* rows, int n, int row_bytes) {
  for (int j = 0; j < n; ++j)
    for (int off = 0; off < row_bytes; off += 64) prefetch_line(reinterpret_cast<const char*>(rows[j]) + off);
}

// The DP path's AVX512-BF16 pieces (RADIXKV_BF16, simd.h): inlined into attend_small_dp and
// cascade_rows_dp (attention.cpp), the only callers that run them.
#ifndef RADIXKV_NO_BF16
// q·k as bfloat16 dot products: qv holds the query's pairs along D, kr the key row in place.
template <int DV>
RADIXKV_BF16 inline __m512 dp_key_dot(const __m512* qv, const c10::BFloat16* kr) {
  __m512 acc = _mm512_setzero_ps();
  for (int t = 0; t < DV / 2; ++t) acc = _mm512_dpbf16_ps(acc, (__m512bh)qv[t], (__m512bh)_mm512_loadu_si512(kr + 32 * t));
  return acc;
}

// R query rows qf [R][D] (float32 holding bfloat16 values) as bfloat16 pairs along D into qbuf.
RADIXKV_BF16 inline void dp_query_pairs(const float* qf, int rows, int D, float* qbuf) {
  for (int row = 0; row < rows; ++row)
    for (int d = 0; d < D; d += 2 * LANES)
      _mm512_storeu_si512(qbuf + row * D + d / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(qf + row * D + d + LANES),
                                                                               _mm512_loadu_ps(qf + row * D + d)));
}

// Probabilities sc[row][0..n) (already bfloat16 values; sc[row][n] = 0 when n is odd) as pairs
// pp[row][j / 2] = (P[j], P[j + 1]).
template <int R>
RADIXKV_BF16 inline void dp_probability_pairs(const float* sc, int n, uint32_t (*pp)[KC / 2]) {
  for (int row = 0; row < R; ++row)
    for (int j = 0; j < n; j += 2 * LANES)
      _mm512_storeu_si512(reinterpret_cast<uint16_t*>(pp[row]) + j,
                          (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(sc + row * KC + j + LANES),
                                                       _mm512_loadu_ps(sc + row * KC + j)));
}

// acc[row][t] += sum over key pairs of (P[j], P[j+1]) . (V[j][d], V[j+1][d]) for the DB accumulator
// vectors of d0 (unpack order); vr: this chunk's V rows, n keys.
template <int R, int DB>
RADIXKV_BF16 inline void dp_pv_pass(const c10::BFloat16* const* vr, int n, int d0, const uint32_t (*pp)[KC / 2],
                                    __m512 (*acc)[DB]) {
  alignas(64) static const c10::BFloat16 zero_row[MAX_D] = {};
  for (int jp = 0; jp < (n + 1) / 2; ++jp) {
    const c10::BFloat16* va = vr[2 * jp] + d0;
    const c10::BFloat16* vb = 2 * jp + 1 < n ? vr[2 * jp + 1] + d0 : zero_row;
    __m512i vv[DB];
    for (int t = 0; t < DB / 2; ++t) {
      const __m512i a = _mm512_loadu_si512(va + 32 * t), b = _mm512_loadu_si512(vb + 32 * t);
      vv[2 * t] = _mm512_unpacklo_epi16(a, b);
      vv[2 * t + 1] = _mm512_unpackhi_epi16(a, b);
    }
    for (int row = 0; row < R; ++row) {
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[row][jp]));
      for (int t = 0; t < DB; ++t) acc[row][t] = _mm512_dpbf16_ps(acc[row][t], pb, (__m512bh)vv[t]);
    }
  }
}
#else  // a compiler without AVX512-BF16 (build.py): never called
template <int DV>
inline __m512 dp_key_dot(const __m512*, const c10::BFloat16*) { std::abort(); }
inline void dp_query_pairs(const float*, int, int, float*) { std::abort(); }
template <int R>
inline void dp_probability_pairs(const float*, int, uint32_t (*)[KC / 2]) { std::abort(); }
template <int R, int DB>
inline void dp_pv_pass(const c10::BFloat16* const*, int, int, const uint32_t (*)[KC / 2], __m512 (*)[DB]) { std::abort(); }
#endif

// Scores of 16 keys (rows kr[0..15], `count` of them real) against one query row: scale * q·k,
// keys at or past `limit` (absolute `pos0` is the first key's position) -inf.
// With `ak`, `av` (the next group's rows, `ahead` of them), each key's turn also fetches one of theirs.
template <typename T, int DV, bool DP>
inline __m512 group_scores(const __m512* qv, const T* const* kr, int count, int pos0, int limit, __m512 scale,
                           const T* const* ak = nullptr, const T* const* av = nullptr, int ahead = 0) {
  constexpr int ROW_BYTES = DV * LANES * static_cast<int>(sizeof(T));
  __m512 acc[LANES];
  for (int j = 0; j < LANES; ++j) {
    acc[j] = _mm512_setzero_ps();
    if (j < ahead) {
      for (int off = 0; off < ROW_BYTES; off += 64) {
        prefetch_line(reinterpret_cast<const char*>(ak[j]) + off);
        prefetch_line(reinterpret_cast<const char*>(av[j]) + off);
      }
    }
    if (j >= count) continue;
    if constexpr (DP) {
      acc[j] = dp_key_dot<DV>(qv, kr[j]);
    } else {
      for (int t = 0; t < DV; ++t)
        acc[j] = _mm512_fmadd_ps(qv[t], _mm512_loadu_ps(reinterpret_cast<const float*>(kr[j]) + LANES * t), acc[j]);
    }
  }
  const __m512 sv = _mm512_mul_ps(sum16(acc), scale);
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32(pos0), iota);
  const __mmask16 past = _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(std::min(limit, pos0 + count)));
  return _mm512_mask_blend_ps(past, sv, _mm512_set1_ps(-std::numeric_limits<float>::infinity()));
}

// decode_over_keys: small_over_keys (attention.cpp) for D = DV * 16; T float32 (rows read in
// place), or bfloat16 with DP. Same contract: qf [R][D] float32 queries, ot [R][D] accumulator,
// m, l per row, rows seeing keys < limit[row] of [0, max_limit).
#ifndef PREFETCH_GROUPS
#define PREFETCH_GROUPS 3
#endif
template <typename T, int R, int DV, bool DP>
inline void decode_over_keys(const Problem& P, const T* k, const T* v, int64_t b, int64_t h, const int32_t* limit,
                             int32_t max_limit, const float* qf, float* ot, float* m, float* l, Scratch& s) {
  static_assert(std::is_same_v<T, float> || DP, "bfloat16 without DP takes small_over_keys");
  constexpr int D = DV * LANES;
  constexpr int DB = R <= 4 ? (DV < 4 ? DV : 4) : (DV < 2 ? DV : 2);  // accumulator vectors per row in a pass
  const int row_bytes = D * static_cast<int>(sizeof(T));
  float* sc = s.st.data();  // [R][KC] scores, then probabilities (P·V weights)
  const __m512 scale = _mm512_set1_ps(P.scale);
  // Queries in registers' layout: float32 vectors, or (DP) bfloat16 pairs along D.
  alignas(64) float qbuf[R * D];
  if constexpr (DP) {
    dp_query_pairs(qf, R, D, qbuf);
    permute_unpack_order(ot, R, D, true);
  } else {
    std::memcpy(qbuf, qf, sizeof(qbuf));
  }
  const T* rows[2][2][KC];  // [this chunk, next][K, V][key]
  const int first = std::min<int>(KC, max_limit);
  key_rows(P, k, P.ks, b, h, 0, first, rows[0][0]);
  key_rows(P, v, P.vs, b, h, 0, first, rows[0][1]);
  prefetch_key_rows(rows[0][0], std::min<int>(first, PREFETCH_GROUPS * LANES), row_bytes);
  prefetch_key_rows(rows[0][1], std::min<int>(first, PREFETCH_GROUPS * LANES), row_bytes);
  for (int c0 = 0, cur = 0; c0 < max_limit; c0 += KC, cur ^= 1) {
    const int n = std::min<int>(KC, max_limit - c0);
    const int next = std::min<int>(KC, max_limit - c0 - KC);  // <= 0 at the last chunk
    if (next > 0) {
      key_rows(P, k, P.ks, b, h, c0 + KC, next, rows[cur ^ 1][0]);
      key_rows(P, v, P.vs, b, h, c0 + KC, next, rows[cur ^ 1][1]);
    }
    const T* const* kr = rows[cur][0];
    const T* const* vr = rows[cur][1];
    const int groups = (n + LANES - 1) / LANES;
    // Scores, a 16-key group at a time for every row; the group after it (this chunk's or the
    // next chunk's first) is fetched meanwhile, K and V.
    for (int g = 0; g < groups; ++g) {
      const int count = std::min<int>(LANES, n - g * LANES);
      const int ga = g + PREFETCH_GROUPS;  // the group fetched meanwhile: this chunk's or the next's
      const T* const* ak = kr + ga * LANES;
      const T* const* av = vr + ga * LANES;
      int ahead = std::min<int>(LANES, n - ga * LANES);
      if (ga >= groups) {
        const int gn = ga - KC / LANES;
        ak = rows[cur ^ 1][0] + gn * LANES;
        av = rows[cur ^ 1][1] + gn * LANES;
        ahead = gn < 0 ? 0 : std::min<int>(next - gn * LANES, LANES);
      }
      for (int row = 0; row < R; ++row) {
        __m512 qv[DV];
        for (int t = 0; t < DV; ++t) qv[t] = _mm512_loadu_ps(qbuf + row * D + t * LANES);
        _mm512_storeu_ps(sc + row * KC + g * LANES,
                         group_scores<T, DV, DP>(qv, kr + g * LANES, count, c0 + g * LANES, limit[row], scale,
                                                 ak, av, row == 0 ? ahead : 0));
      }
    }
    // Online softmax per row.
    for (int row = 0; row < R; ++row) {
      softmax_row<T>(sc + row * KC, groups, D, ot + row * D, m[row], l[row]);
      if (n % 2) sc[row * KC + n] = 0.0f;  // the DP path's last pair: (p, 0)
    }
    // P·V.
    if constexpr (DP) {
      alignas(64) uint32_t pp[R][KC / 2];
      dp_probability_pairs<R>(sc, n, pp);
      for (int d0 = 0; d0 < D; d0 += DB * LANES) {  // DB accumulator vectors: DB / 2 source vectors
        __m512 acc[R][DB];
        for (int row = 0; row < R; ++row)
          for (int t = 0; t < DB; ++t) acc[row][t] = _mm512_loadu_ps(ot + row * D + d0 + t * LANES);
        dp_pv_pass<R, DB>(vr, n, d0, pp, acc);
        for (int row = 0; row < R; ++row)
          for (int t = 0; t < DB; ++t) _mm512_storeu_ps(ot + row * D + d0 + t * LANES, acc[row][t]);
      }
    } else {
      for (int d0 = 0; d0 < D; d0 += DB * LANES) {
        __m512 acc[R][DB];
        for (int row = 0; row < R; ++row)
          for (int t = 0; t < DB; ++t) acc[row][t] = _mm512_loadu_ps(ot + row * D + d0 + t * LANES);
        for (int j = 0; j < n; ++j) {
          const float* vrow = reinterpret_cast<const float*>(vr[j]) + d0;
          __m512 vv[DB];
          for (int t = 0; t < DB; ++t) vv[t] = _mm512_loadu_ps(vrow + t * LANES);
          for (int row = 0; row < R; ++row) {
            const __m512 pb = _mm512_set1_ps(sc[row * KC + j]);
            for (int t = 0; t < DB; ++t) acc[row][t] = _mm512_fmadd_ps(pb, vv[t], acc[row][t]);
          }
        }
        for (int row = 0; row < R; ++row)
          for (int t = 0; t < DB; ++t) _mm512_storeu_ps(ot + row * D + d0 + t * LANES, acc[row][t]);
      }
    }
  }
  if constexpr (DP) permute_unpack_order(ot, R, D, false);
}

}  // namespace
