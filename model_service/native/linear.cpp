// radixkv native CPU kernel: float32 linear layers (x @ W.T) summed in a fixed, blocked order.
//
// out[m, n] is computed as MKL's sgemm computes it on the machines we measured (2 AMD EPYC cores,
// torch 2.13's MKL, 4 or more rows): the K products are split into blocks of `block` consecutive
// k; inside a block a float32 FMA chain from 0 in k order; the block sums are added left to right
// (c = c + block_sum). With that order the result is bitwise F.linear's, which is what lets the
// model service keep greedy output identical to transformers' while computing the products with
// AVX-512 at several times the speed of MKL's generic path (MKL dispatches by CPU vendor).
// Whether the order matches this machine's MKL is probed at load (model_service/linear/blocked.py);
// where it does not, the model service keeps F.linear.
//
// A product of few rows takes another order in MKL's generic path (2-3 rows; with 2 threads also
// the 1-3 rows left after 4-row tiles of 5-11 rows): per output, four partial sums, partial l over
// k = l, l + 4, l + 8, ... (each product rounded, then added: no FMA), combined as (p0 + p2) +
// (p1 + p3). Rows from `blocked_rows` on are summed in that order ("four-lane"), so that every row
// count the probe accepts is bitwise F.linear too.
//
// Layout: the weight is packed once into stripes of 16 output features, [ceil(N/16), K, 16] (zero
// padded), so a vector load reads 16 outputs' weights for one k. A micro-kernel keeps up to 8 rows x
// 3 stripes (24 zmm accumulators) over one k block; work items are (row tile, 3-stripe panel)
// pairs, scheduled dynamically on torch's OpenMP threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace {

using radixkv::LANES;  // output features per stripe (one zmm of float32)
constexpr int MAX_MR = 8;      // rows per micro-kernel
constexpr int MAX_NS = 3;      // stripes per micro-kernel (and per work item)
constexpr int64_t PREFETCH_K = 32;  // the first rows of a tile prefetch the weight this many k ahead
constexpr int64_t ROW_TILE = 64;  // rows per work item: its C tile (64 x 48 floats) stays in L1

// C[0:MR, 0:16*NS] (+)= x[0:MR, k0:k1] . W[k0:k1, stripes]: FMA chains from 0 over k in order, then
// stored (first block) or added to C. `last_mask`: the valid lanes of the last stripe. PREFETCH: the
// weight PREFETCH_K k ahead; else the stripes in bit mask `ahead_stripes` of another block of k1 - k0
// k at `ahead` (stripes stripe_stride apart), a line per k.
template <int MR, int NS, bool PREFETCH>
inline void micro(const float* x, int64_t ldx, const float* w, int64_t stripe_stride, int64_t k0, int64_t k1,
                  float* c, int64_t ldc, bool first, __mmask16 last_mask, const float* ahead, int ahead_stripes) {
  __m512 acc[MR][NS];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 3
    for (int s = 0; s < NS; ++s) acc[m][s] = _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; ++k) {
    __m512 wv[NS];
#pragma GCC unroll 3
    for (int s = 0; s < NS; ++s) {
      wv[s] = _mm512_loadu_ps(w + s * stripe_stride + k * LANES);
      if constexpr (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(w + s * stripe_stride + (k + PREFETCH_K) * LANES), _MM_HINT_T0);
      else if (ahead_stripes >> s & 1) _mm_prefetch(reinterpret_cast<const char*>(ahead + s * stripe_stride + (k - k0) * LANES), _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
#pragma GCC unroll 3
      for (int s = 0; s < NS; ++s) acc[m][s] = _mm512_fmadd_ps(xb, wv[s], acc[m][s]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 3
    for (int s = 0; s < NS; ++s) {
      const __mmask16 mask = s == NS - 1 ? last_mask : static_cast<__mmask16>(0xFFFF);
      float* cp = c + m * ldc + s * LANES;
      const __m512 sum = first ? acc[m][s] : _mm512_add_ps(_mm512_maskz_loadu_ps(mask, cp), acc[m][s]);
      _mm512_mask_storeu_ps(cp, mask, sum);
    }
  }
}

// C[0:MR, 0:16] = x[0:MR, 0:K] . W[0:K, one stripe] in the four-lane order (K a multiple of 4).
template <int MR>
void micro_four_lane(const float* x, int64_t ldx, const float* w, int64_t K, float* c, __mmask16 mask, int64_t ldc) {
  __m512 acc[MR][4];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int l = 0; l < 4; ++l) acc[m][l] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 4) {
#pragma GCC unroll 4
    for (int l = 0; l < 4; ++l) {
      const __m512 wv = _mm512_loadu_ps(w + (k + l) * LANES);
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        // the product is rounded on its own: -ffp-contract=off (build.py) keeps it out of an FMA
        const __m512 p = _mm512_mul_ps(_mm512_set1_ps(x[m * ldx + k + l]), wv);
        acc[m][l] = _mm512_add_ps(acc[m][l], p);
      }
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) {
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][2]), _mm512_add_ps(acc[m][1], acc[m][3]));
    _mm512_mask_storeu_ps(c + m * ldc, mask, sum);
  }
}

using FourLane = void (*)(const float*, int64_t, const float*, int64_t, float*, __mmask16, int64_t);

FourLane pick_four_lane(int mr) {
  switch (mr) {
    case 1: return micro_four_lane<1>;
    case 2: return micro_four_lane<2>;
    default: return micro_four_lane<3>;
  }
}

using Micro = void (*)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, float*, int64_t, bool,
                       __mmask16, const float*, int);

template <int MR, bool PF>
Micro pick_ns(int ns) {
  switch (ns) {
    case 1: return micro<MR, 1, PF>;
    case 2: return micro<MR, 2, PF>;
    default: return micro<MR, 3, PF>;
  }
}

template <bool PF>
Micro pick_mr(int mr, int ns) {
  switch (mr) {
    case 1: return pick_ns<1, PF>(ns);
    case 2: return pick_ns<2, PF>(ns);
    case 3: return pick_ns<3, PF>(ns);
    case 4: return pick_ns<4, PF>(ns);
    case 5: return pick_ns<5, PF>(ns);
    case 6: return pick_ns<6, PF>(ns);
    case 7: return pick_ns<7, PF>(ns);
    default: return pick_ns<8, PF>(ns);
  }
}

Micro pick(int mr, int ns, bool prefetch) { return prefetch ? pick_mr<true>(mr, ns) : pick_mr<false>(mr, ns); }

// x [M, K] (last dim contiguous); packed [ceil(N/16), K, 16] contiguous float32 (pack_linear_weight
// in model_service/linear/blocked.py); block: k per block (>= 1); rows from blocked_rows on (clamped to
// [0, M]) in the four-lane order (then K must be a multiple of 4). Returns x @ W.T as [M, N].
at::Tensor blocked_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, int64_t block,
                          int64_t blocked_rows) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "x and packed must be CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "x and packed must be float32");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be 2-D [rows, in] with a contiguous last dimension");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == LANES && packed.is_contiguous(),
              "packed must be a contiguous [stripes, in, 16] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, S = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "packed has in_features ", packed.size(1), ", x has ", K);
  TORCH_CHECK(N >= 1 && (N + LANES - 1) / LANES == S, "out_features ", N, " does not fit ", S, " stripes");
  TORCH_CHECK(block >= 1, "block must be >= 1");
  blocked_rows = std::clamp<int64_t>(blocked_rows, 0, M);
  TORCH_CHECK(blocked_rows == M || K % 4 == 0, "four-lane rows need in_features divisible by 4, got ", K);
  at::Tensor out = at::empty({M, N}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (M == 0) return out;
  if (K == 0) return out.zero_();
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* cp = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), stripe_stride = K * LANES;
  const int64_t panels = (S + MAX_NS - 1) / MAX_NS, row_tiles = (M + ROW_TILE - 1) / ROW_TILE;
  const int64_t items = panels * row_tiles;
  const int tail = static_cast<int>(N - (S - 1) * LANES);  // valid lanes of the last stripe, 1..16
  const __mmask16 tail_mask = static_cast<__mmask16>((1u << tail) - 1u);
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t worker = begin; worker < end; ++worker) {
      for (int64_t idx = next.fetch_add(1); idx < items; idx = next.fetch_add(1)) {
        const int64_t panel = idx % panels, tile = idx / panels;
        const int64_t s0 = panel * MAX_NS, ns = std::min<int64_t>(MAX_NS, S - s0);
        const __mmask16 last_mask = s0 + ns == S ? tail_mask : static_cast<__mmask16>(0xFFFF);
        const int64_t m_begin = tile * ROW_TILE, m_all = std::min(M, m_begin + ROW_TILE);
        const int64_t m_end = std::clamp(blocked_rows, m_begin, m_all);  // rows of this tile in the blocked order
        const float* w = wp + s0 * stripe_stride;
        // A decode-sized product (one row tile) reads each weight once, from DRAM: the first pass of
        // rows over a k block waits for it. The later passes (which find the block in L1) ask for
        // the next block (or the panel this thread will likely take next), one stripe each, so the
        // first pass finds it in the cache. Taller products re-read each panel per row tile and gain
        // nothing.
        const int64_t passes = (m_end - m_begin + MAX_MR - 1) / MAX_MR;
        const float* next_item = idx + workers < items ? wp + (idx + workers) % panels * MAX_NS * stripe_stride : nullptr;
        for (int64_t k0 = 0; k0 < K; k0 += block) {
          const int64_t k1 = std::min(K, k0 + block);
          const float* ahead = row_tiles > 1 ? nullptr : k1 < K ? w + k1 * LANES : next_item;
          for (int64_t m0 = m_begin, pass = 0; m0 < m_end; m0 += MAX_MR, ++pass) {
            const int mr = static_cast<int>(std::min<int64_t>(MAX_MR, m_end - m0));
            int stripes = 0;  // the next block's stripes this pass asks for: stripe s in pass 1 + s % (passes - 1)
            if (pass > 0 && ahead != nullptr)
              for (int64_t st = 0; st < MAX_NS; ++st) if (1 + st % (passes - 1) == pass) stripes |= 1 << st;
            pick(mr, static_cast<int>(ns), pass == 0)(xp + m0 * ldx, ldx, w, stripe_stride, k0, k1, cp + m0 * N + s0 * LANES, N,
                                           k0 == 0, last_mask, ahead, stripes);
          }
        }
        for (int64_t m0 = m_end; m0 < m_all; m0 += 3) {
          const FourLane four = pick_four_lane(static_cast<int>(std::min<int64_t>(3, m_all - m0)));
          for (int64_t s = 0; s < ns; ++s)
            four(xp + m0 * ldx, ldx, w + s * stripe_stride, K, cp + m0 * N + (s0 + s) * LANES,
                 s == ns - 1 ? last_mask : static_cast<__mmask16>(0xFFFF), N);
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixkv, m) {
  m.def("blocked_linear(Tensor x, Tensor packed, int out_features, int block, int blocked_rows) -> Tensor");
  m.impl("blocked_linear", c10::DispatchKey::CPU, TORCH_FN(blocked_linear));
}
