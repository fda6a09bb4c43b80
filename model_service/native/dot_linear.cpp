// radixkv native bfloat16 linear for few rows: y [M, N] = x [M, K] @ W [N, K]^T as AVX512-BF16
// dot products (float32 sums, the result rounded to bfloat16 once, to nearest even).
// Registered as torch.ops.radixkv.dot_linear (model_service/linear/dot.py packs and plans it).
//
// Why: a decode step multiplies a few rows by every weight, so it is bound by streaming the
// weights from memory; oneDNN's bfloat16 kernel on these shapes reached about two thirds of the
// memory bandwidth at 16 rows. Here the weight is packed once as stripes of 16 output features,
// k-pair-major ([N / 16][K / 2][16] pairs: one cache line per k pair and stripe), read
// sequentially, three stripes at a time; each row's k pair is broadcast and multiplied into the
// 16 lanes of each stripe with one dot-product instruction (two products, exact, added in float32).
// Rows come 8 at a time (24 accumulators); the three stripes' panel stays in L2 across row tiles.
//
// On CPUs with AMX the same packed weight feeds the tile unit directly: 16 k pairs of one stripe
// are 16 consecutive 64-byte lines, one B tile in AMX's pair-interleaved layout, so up to 16 rows
// times 4 stripes take one TDPBF16PS per stripe and 32 k (where the dot-product instruction would
// take 16 rows x 16 pairs' worth of instructions). The caller picks the tiles (`use_tiles`) where
// has_amx_tiles() and in % 32 == 0; the timing run in model_service/linear/tuning.py decides up to
// how many rows either beats oneDNN.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "amx.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int MR = 8;  // rows per micro tile
constexpr int NR = 3;  // stripes (of 16 features) per micro tile
using radixkv::TILE_ROWS;  // rows of x per AMX A tile; k pairs per B tile

// The rows of x the tiles run over (tile_stripes): up to 32 as they are, more padded to whole tiles.
inline int64_t tile_input_rows(int64_t M) {
  return M <= 2 * TILE_ROWS ? M : (M + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
}

#ifndef RADIXKV_NO_BF16
// Rows [0, R) of x (pairs, `xs` pairs per row) times stripes [0, S) of w (each `kp` pairs of 16
// lanes, `ws` uint32 apart) into y (bfloat16, `ys` elements per row).
template <int R, int S>
RADIXKV_BF16 inline void micro(const uint32_t* x, int64_t xs, const uint32_t* w, int64_t ws, int64_t kp,
                               c10::BFloat16* y, int64_t ys) {
  __m512 acc[R][S];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < S; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kp; ++p) {
    __m512bh wv[S];
    for (int j = 0; j < S; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * ws + p * radixkv::LANES);
    for (int i = 0; i < R; ++i) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[i * xs + p]));
      for (int j = 0; j < S; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, wv[j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < S; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i * ys + j * radixkv::LANES),
                          (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
}

template <int S>
RADIXKV_BF16 inline void rows_tile(int rows, const uint32_t* x, int64_t xs, const uint32_t* w, int64_t ws,
                                   int64_t kp, c10::BFloat16* y, int64_t ys) {
  switch (rows) {
    case 1: return micro<1, S>(x, xs, w, ws, kp, y, ys);
    case 2: return micro<2, S>(x, xs, w, ws, kp, y, ys);
    case 3: return micro<3, S>(x, xs, w, ws, kp, y, ys);
    case 4: return micro<4, S>(x, xs, w, ws, kp, y, ys);
    case 5: return micro<5, S>(x, xs, w, ws, kp, y, ys);
    case 6: return micro<6, S>(x, xs, w, ws, kp, y, ys);
    case 7: return micro<7, S>(x, xs, w, ws, kp, y, ys);
    default: return micro<8, S>(x, xs, w, ws, kp, y, ys);
  }
}

// Stripes [s0, s1) for every row: NR stripes at a time, each over all row tiles.
RADIXKV_BF16 __attribute__((flatten)) void stripes(const uint32_t* x, int64_t M, int64_t kp, const uint32_t* w,
                                                   int64_t s0, int64_t s1, c10::BFloat16* y, int64_t N) {
  const int64_t ws = kp * radixkv::LANES;
  for (int64_t s = s0; s < s1; s += NR) {
    const int64_t count = std::min<int64_t>(NR, s1 - s);
    for (int64_t m = 0; m < M; m += MR) {
      const int rows = static_cast<int>(std::min<int64_t>(MR, M - m));
      const uint32_t* xr = x + m * kp;
      c10::BFloat16* yr = y + m * N + s * radixkv::LANES;
      const uint32_t* ws0 = w + s * ws;
      if (count == 3) rows_tile<3>(rows, xr, kp, ws0, ws, kp, yr, N);
      else if (count == 2) rows_tile<2>(rows, xr, kp, ws0, ws, kp, yr, N);
      else rows_tile<1>(rows, xr, kp, ws0, ws, kp, yr, N);
    }
  }
}
#else  // a compiler without AVX512-BF16 (build.py): the op refuses to run
void stripes(const uint32_t*, int64_t, int64_t, const uint32_t*, int64_t, int64_t, c10::BFloat16*, int64_t) {
  std::abort();
}
#endif

#ifndef RADIXKV_NO_AMX
using radixkv::has_amx_tiles;
using radixkv::TILE_BYTES;
using radixkv::TileConfig;
constexpr int TILE_STRIPES = 4;  // stripes per group of up to 16 rows (C tiles 0-3)

// Rows [0, R) (R <= 16) of x times S (<= 4) stripes starting at w, into y. The A tile is read
// from x in place (rows `xs` pairs apart), each B tile from the packed stripe (64-byte lines).
template <int S>
RADIXKV_AMX inline void tile_group(const uint32_t* x, int64_t xs, const uint32_t* w, int64_t ws, int64_t kp,
                                   float* c, c10::BFloat16* y, int64_t ys, int R) {
  if (S > 0) _tile_zero(0);
  if (S > 1) _tile_zero(1);
  if (S > 2) _tile_zero(2);
  if (S > 3) _tile_zero(3);
  const int64_t x_stride = xs * 4, w_stride = TILE_BYTES;
  for (int64_t p = 0; p < kp; p += TILE_ROWS) {
    _tile_loadd(4, x + p, x_stride);
    _tile_loadd(5, w + p * radixkv::LANES, w_stride);
    _tile_dpbf16ps(0, 4, 5);
    if (S > 1) { _tile_loadd(6, w + ws + p * radixkv::LANES, w_stride); _tile_dpbf16ps(1, 4, 6); }
    if (S > 2) { _tile_loadd(5, w + 2 * ws + p * radixkv::LANES, w_stride); _tile_dpbf16ps(2, 4, 5); }
    if (S > 3) { _tile_loadd(6, w + 3 * ws + p * radixkv::LANES, w_stride); _tile_dpbf16ps(3, 4, 6); }
  }
  // c: [S][16 rows][16] float32 scratch, then rounded once to bfloat16 into y.
  if (S > 0) _tile_stored(0, c, TILE_BYTES);
  if (S > 1) _tile_stored(1, c + 256, TILE_BYTES);
  if (S > 2) _tile_stored(2, c + 512, TILE_BYTES);
  if (S > 3) _tile_stored(3, c + 768, TILE_BYTES);
  for (int j = 0; j < S; ++j)
    for (int i = 0; i < R; ++i)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i * ys + j * radixkv::LANES),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(c + j * 256 + i * radixkv::LANES)));
}

// Rows [0, 16 + R1) (0 < R1 <= 16) of x times S (<= 2) stripes: two A tiles (4, 5) share each B
// tile (6, 7), so the weight streams once for up to 32 rows. C tiles: 0, 1 rows 0-15; 2, 3 the rest.
template <int S>
RADIXKV_AMX inline void tile_group_32(const uint32_t* x, int64_t xs, const uint32_t* w, int64_t ws, int64_t kp,
                                      float* c, c10::BFloat16* y, int64_t ys, int R1) {
  _tile_zero(0);
  _tile_zero(2);
  if (S > 1) { _tile_zero(1); _tile_zero(3); }
  const int64_t x_stride = xs * 4;
  const uint32_t* x1 = x + TILE_ROWS * xs;
  for (int64_t p = 0; p < kp; p += TILE_ROWS) {
    _tile_loadd(4, x + p, x_stride);
    _tile_loadd(5, x1 + p, x_stride);
    _tile_loadd(6, w + p * radixkv::LANES, TILE_BYTES);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if (S > 1) {
      _tile_loadd(7, w + ws + p * radixkv::LANES, TILE_BYTES);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, TILE_BYTES);
  _tile_stored(2, c + 512, TILE_BYTES);
  if (S > 1) { _tile_stored(1, c + 256, TILE_BYTES); _tile_stored(3, c + 768, TILE_BYTES); }
  for (int j = 0; j < S; ++j)
    for (int i = 0; i < TILE_ROWS + R1; ++i) {
      const float* row = c + (i < TILE_ROWS ? j * 256 + i * radixkv::LANES : 512 + j * 256 + (i - TILE_ROWS) * radixkv::LANES);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i * ys + j * radixkv::LANES),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row)));
    }
}

// Loads the tile configuration for `rows` (1-32) rows: up to 16 as tile_group's (C 0-3, A 4, B 5
// and 6), more as tile_group_32's (C 0-3, A 4 and 5, B 6 and 7).
RADIXKV_AMX inline void configure_tiles(int rows) {
  TileConfig config;
  const int r0 = std::min(rows, TILE_ROWS), r1 = rows - r0;
  for (int t = 0; t < 8; ++t) config.colsb[t] = TILE_BYTES;
  if (r1 == 0) {
    for (int t = 0; t < 5; ++t) config.rows[t] = r0;
    config.rows[5] = config.rows[6] = TILE_ROWS;
    config.colsb[7] = 0;
  } else {
    config.rows[0] = config.rows[1] = config.rows[4] = TILE_ROWS;
    config.rows[2] = config.rows[3] = config.rows[5] = r1;
    config.rows[6] = config.rows[7] = TILE_ROWS;
  }
  radixkv::load_tile_config(config);
}

// Stripes [s0, s1) for every row on the tile unit. Up to 32 rows: one group of rows, 16 rows x 4
// stripes or 32 rows x 2 stripes at a time. More: x's rows come padded to a multiple of 16
// (dot_linear), so every tile is 16 rows under one configuration, and each block of 4 stripes
// goes through every group of 32 rows while it sits in L2: the weight streams from memory once
// whatever the rows (row groups outside the stripes would stream it once per 32 rows).
RADIXKV_AMX __attribute__((flatten)) void tile_stripes(const uint32_t* x, int64_t M, int64_t kp, const uint32_t* w,
                                                       int64_t s0, int64_t s1, c10::BFloat16* y, int64_t N) {
  const int64_t ws = kp * radixkv::LANES;
  alignas(64) float c[TILE_STRIPES * TILE_ROWS * radixkv::LANES];
  const int64_t padded = tile_input_rows(M);
  configure_tiles(static_cast<int>(std::min<int64_t>(M, 2 * TILE_ROWS)));
  for (int64_t s = s0; s < s1; s += TILE_STRIPES) {
    const int64_t count = std::min<int64_t>(TILE_STRIPES, s1 - s);
    const uint32_t* wr = w + s * ws;
    for (int64_t m = 0; m < padded; m += 2 * TILE_ROWS) {
      const int rows = static_cast<int>(std::min<int64_t>(2 * TILE_ROWS, M - m));  // rows written
      const uint32_t* xr = x + m * kp;
      c10::BFloat16* yr = y + m * N + s * radixkv::LANES;
      if (padded - m > TILE_ROWS) {
        for (int64_t t = 0; t < count; t += 2) {
          if (count - t >= 2) tile_group_32<2>(xr, kp, wr + t * ws, ws, kp, c, yr + t * radixkv::LANES, N, rows - TILE_ROWS);
          else tile_group_32<1>(xr, kp, wr + t * ws, ws, kp, c, yr + t * radixkv::LANES, N, rows - TILE_ROWS);
        }
      } else if (count == 4) tile_group<4>(xr, kp, wr, ws, kp, c, yr, N, rows);
      else if (count == 3) tile_group<3>(xr, kp, wr, ws, kp, c, yr, N, rows);
      else if (count == 2) tile_group<2>(xr, kp, wr, ws, kp, c, yr, N, rows);
      else tile_group<1>(xr, kp, wr, ws, kp, c, yr, N, rows);
    }
  }
  _tile_release();
}
#else  // a compiler without AMX (build.py): the tiles are never used
using radixkv::has_amx_tiles;
void tile_stripes(const uint32_t*, int64_t, int64_t, const uint32_t*, int64_t, int64_t, c10::BFloat16*, int64_t) {
  std::abort();
}
#endif

// x [M, K] bfloat16 contiguous; packed int32 [N / 16, K / 2, 16] (dot.py's pack: lane l of stripe
// s at pair p holds (W[16 s + l][2 p], W[16 s + l][2 p + 1])). Returns y [M, N] bfloat16.
// use_tiles: on AMX (has_amx_tiles(), K % 32 == 0), else AVX512-BF16 dot products.
at::Tensor dot_linear(const at::Tensor& x, const at::Tensor& packed, bool use_tiles) {
  TORCH_CHECK(radixkv::has_bf16_dot_products(), "dot_linear needs a CPU with AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "x must be a contiguous bfloat16 CPU [rows, in]");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kInt &&
                  packed.size(2) == radixkv::LANES,
              "packed must be contiguous int32 [out / 16, in / 2, 16]");
  TORCH_CHECK(x.size(1) == 2 * packed.size(1), "x has ", x.size(1), " features, the weight ", 2 * packed.size(1));
  const int64_t M = x.size(0), kp = packed.size(1), S = packed.size(0), N = S * radixkv::LANES;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const auto* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<c10::BFloat16>());
  const auto* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  auto* yp = y.data_ptr<c10::BFloat16>();
  if (kp == 0) return y.zero_();
  at::Tensor padded;  // more than 32 rows on the tiles: x's rows padded to whole tiles (tile_stripes)
  if (use_tiles) {
    TORCH_CHECK(has_amx_tiles(), "dot_linear: this CPU (or process) cannot use AMX tiles");
    TORCH_CHECK(kp % TILE_ROWS == 0, "dot_linear: AMX tiles need in % 32 == 0, got ", 2 * kp);
    if (tile_input_rows(M) != M) {
      padded = at::zeros({tile_input_rows(M), x.size(1)}, x.options());
      padded.narrow(0, 0, M).copy_(x);
      xp = reinterpret_cast<const uint32_t*>(padded.data_ptr<c10::BFloat16>());
    }
  }
  // Whole groups of stripes per thread (a thread's stripes are contiguous in memory).
  const int64_t group = use_tiles ? 4 : NR, groups = (S + group - 1) / group;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    const int64_t s0 = g0 * group, s1 = std::min<int64_t>(S, g1 * group);
    if (use_tiles) tile_stripes(xp, M, kp, wp, s0, s1, yp, N);
    else stripes(xp, M, kp, wp, s0, s1, yp, N);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixkv, m) {
  m.def("dot_linear(Tensor x, Tensor packed, bool use_tiles=False) -> Tensor");
  m.impl("dot_linear", c10::DispatchKey::CPU, TORCH_FN(dot_linear));
  m.def("has_amx_tiles() -> bool", has_amx_tiles);
}
