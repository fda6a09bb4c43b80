// radixkv native CPU kernel: causal self-attention of one float32 sequence, summed in exactly the
// order torch's CPU flash-attention kernel sums it (torch 2.13, AVX512 dispatch, MKL products), so
// the result is bitwise F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True):
// the call transformers makes for a prompt. Registered as torch.ops.radixkv.prompt_attention.
//
// Why: that call is a fresh prompt's whole attention; the model service keeps it bitwise so that
// greedy output stays transformers' own, but torch's kernel runs its products through MKL's generic
// path on CPUs MKL does not recognise (AMD EPYC among them) and computes whole 512-key blocks past
// the causal edge. This kernel computes the same sums
// with AVX-512 micro-kernels and stops at the causal edge.
//
// torch's order, per query row i (kv blocks of 512 keys at n = 0, 512, ... <= i; kvb = min(512, T - n);
// keys past i are -inf):
//   s[c]   = FMA chain from 0 over d of q[i][d] * k[n+c][d]          (MKL, head_dim <= 192: one chain)
//   s[c]  *= scale;  mb = max(m, max_c s[c])
//   p[c]   = exp_u20(s[c] - mb) over the 16-lane chunks of kvb, std::exp on the kvb % 16 tail;
//   sum    = reduce_all(vector lane sums) + tail terms in order
//   e      = std::exp(m - mb);  l = sum + e * l;  m = mb;  dst *= e (n > 0)
//   dst    = (n > 0 ? dst : 0) + P.V, MKL's k blocking of kvb: one chain (kvb <= 192), two halves
//            (even kvb <= 384; odd: halves of kvb - 1, then the last key), or 192-key blocks;
//            each block a FMA chain from 0, added to dst left to right
//   out[i] = dst * (1 / l)
// Whether this matches the running torch and MKL is probed at load against torch on many lengths
// (model_service/native/prompt_attention.py); where it does not, the model service keeps torch's call.
//
// Rows are independent in that order, so work items are (query head, 8 aligned rows), latest rows
// first; K is transposed once per call ([Hkv][D][T]) so QK^T puts 16 keys in a vector.

#include "torch_vec.h"  // first: it sets torch's AVX512 capability for the ATen headers

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>

namespace {

using radixkv::LANES;
using radixkv::Vec;
constexpr int64_t KV_SPLIT = 512;   // torch's kv_split_size
constexpr int64_t MKL_KC = 192;     // MKL's k block
constexpr int64_t TILE = 8;         // query rows of a work item
constexpr int64_t MAX_D = 192;      // head_dim: one MKL chain for q.k
constexpr int64_t P_LD = KV_SPLIT + LANES;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct Problem {
  int64_t T, D, Hq, Hkv, r;
  const float* q;
  int64_t q_row, q_head;  // strides of q over rows and heads
  const float* v;
  int64_t v_row, v_head;
  const float* kt;  // [Hkv][D][Tp] transposed keys, zero padded to Tp
  int64_t Tp;
  float* out;  // [T][Hq][D]
  float scale;
};

// MKL's k blocks for a product of inner size K (block ends, left to right); at most 4.
inline int k_blocks(int64_t K, int64_t* ends) {
  if (K <= MKL_KC) {
    ends[0] = K;
    return 1;
  }
  if (K <= 2 * MKL_KC) {
    if (K % 2 == 0) {
      ends[0] = K / 2;
      ends[1] = K;
      return 2;
    }
    ends[0] = (K - 1) / 2;
    ends[1] = K - 1;
    ends[2] = K;
    return 3;
  }
  int n = 0;
  for (int64_t e = MKL_KC; e < K; e += MKL_KC) ends[n++] = e;
  ends[n++] = K;
  return n;
}

// s[r][c0 + 16 j + lane] = FMA chain over d of q[r][d] * kt[d][c0 + 16 j + lane], R rows x NS vectors.
template <int R, int NS>
inline void qk_micro(const Problem& P, const float* q, const float* kt, int64_t c0, float* s) {
  __m512 acc[R][NS];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NS; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < P.D; ++d) {
    __m512 kv[NS];
    for (int j = 0; j < NS; ++j) kv[j] = _mm512_loadu_ps(kt + d * P.Tp + c0 + LANES * j);
    for (int i = 0; i < R; ++i) {
      const __m512 qv = _mm512_set1_ps(q[i * P.q_row + d]);
      for (int j = 0; j < NS; ++j) acc[i][j] = _mm512_fmadd_ps(qv, kv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NS; ++j) _mm512_storeu_ps(s + i * P_LD + c0 + LANES * j, acc[i][j]);
}

// acc = FMA chain over c in [c0, c1) of p[r][c] * v[c][d0 : d0 + 16 NV]; dst = first ? acc : dst + acc.
template <int R, int NV>
inline void pv_micro(const Problem& P, const float* p, const float* v, int64_t c0, int64_t c1, int64_t d0,
                     float* dst, bool first) {
  __m512 acc[R][NV];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t c = c0; c < c1; ++c) {
    __m512 vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = _mm512_loadu_ps(v + c * P.v_row + d0 + LANES * j);
    for (int i = 0; i < R; ++i) {
      const __m512 pv = _mm512_set1_ps(p[i * P_LD + c]);
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_fmadd_ps(pv, vv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) {
      float* out = dst + i * MAX_D + d0 + LANES * j;
      _mm512_storeu_ps(out, first ? acc[i][j] : _mm512_add_ps(_mm512_loadu_ps(out), acc[i][j]));
    }
}

template <int R>
void qk_rows(const Problem& P, const float* q, const float* kt, int64_t cols, float* s) {
  int64_t c = 0;
  for (; c + 3 * LANES <= cols; c += 3 * LANES) qk_micro<R, 3>(P, q, kt, c, s);
  if (cols - c == 2 * LANES) qk_micro<R, 2>(P, q, kt, c, s);
  else if (cols - c == LANES) qk_micro<R, 1>(P, q, kt, c, s);
}

template <int R>
void pv_cols(const Problem& P, const float* p, const float* v, int64_t c0, int64_t c1, float* dst, bool first) {
  int64_t d = 0;
  for (; d + 4 * LANES <= P.D; d += 4 * LANES) pv_micro<R, 4>(P, p, v, c0, c1, d, dst, first);
  for (; d < P.D; d += LANES) pv_micro<R, 1>(P, p, v, c0, c1, d, dst, first);
}

// Rows in groups of at most 4 (4 x 4 accumulators).
template <int R>
void pv_rows(const Problem& P, const float* p, const float* v, int64_t c0, int64_t c1, float* dst, bool first) {
  if constexpr (R > 4) {
    pv_cols<4>(P, p, v, c0, c1, dst, first);
    pv_cols<R - 4>(P, p + 4 * P_LD, v, c0, c1, dst + 4 * MAX_D, first);
  } else {
    pv_cols<R>(P, p, v, c0, c1, dst, first);
  }
}

// One work item: query head h, rows i0 .. i0 + R - 1 (i0 a multiple of TILE).
template <int R>
void item(const Problem& P, int64_t h, int64_t i0, float* s, float* dst) {
  const int64_t hk = h / P.r;
  const float* q = P.q + h * P.q_head + i0 * P.q_row;
  const float* kt = P.kt + hk * P.D * P.Tp;
  float mx[R], sm[R];
  for (int i = 0; i < R; ++i) {
    mx[i] = NEG_INF;
    sm[i] = 0.f;
  }
  const int64_t last = i0 + R - 1;
  for (int64_t n = 0; n <= last; n += KV_SPLIT) {
    const int64_t kvb = std::min<int64_t>(KV_SPLIT, P.T - n);
    const int64_t L = std::min(kvb, last - n + 1);  // keys any row of the tile sees in this block
    const int64_t cols = (L + LANES - 1) / LANES * LANES;
    qk_rows<R>(P, q, kt + n, cols, s);
    const int64_t nvec = kvb / LANES * LANES;  // torch's vector part of the block; the rest is its scalar tail
    for (int i = 0; i < R; ++i) {
      float* row = s + i * P_LD;
      const int64_t lim = std::min(kvb, i0 + i - n + 1) - 1;  // last key row i sees
      // scale, keys past `lim` -> -inf, block max
      __m512 vmax_block = _mm512_set1_ps(NEG_INF);
      for (int64_t c = 0; c < cols; c += LANES) {
        __m512 x = _mm512_mul_ps(_mm512_loadu_ps(row + c), _mm512_set1_ps(P.scale));
        if (c + LANES - 1 > lim) {
          const int64_t keep = std::clamp<int64_t>(lim - c + 1, 0, LANES - 1);
          x = _mm512_mask_blend_ps(static_cast<__mmask16>((1u << keep) - 1), _mm512_set1_ps(NEG_INF), x);
        }
        vmax_block = _mm512_max_ps(vmax_block, x);
        _mm512_storeu_ps(row + c, x);
      }
      const float bm = _mm512_reduce_max_ps(vmax_block);
      const float m_new = mx[i] > bm ? mx[i] : bm;
      const Vec vmax(m_new);
      Vec vsum(0.f);
      int64_t c = 0;
      for (; c < std::min(nvec, cols); c += LANES) {
        const Vec e = (Vec::loadu(row + c) - vmax).exp_u20();
        vsum += e;
        e.store(row + c);
      }
      float tmp_sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, vsum);
      for (; c < cols; ++c) {
        const float e = c <= lim ? static_cast<float>(::exp(static_cast<double>(row[c] - m_new))) : 0.f;
        tmp_sum += e;
        row[c] = e;
      }
      const float e_old = std::exp(mx[i] - m_new);
      sm[i] = std::fma(e_old, sm[i], tmp_sum);  // torch's `tmp_sum + exp_tmp * qk_sum`, which g++ contracts
      mx[i] = m_new;
      if (n > 0) {
        float* d = dst + i * MAX_D;
        for (int64_t j = 0; j < P.D; j += LANES) (Vec::loadu(d + j) * Vec(e_old)).store(d + j);
      }
    }
    int64_t ends[8];
    const int nb = k_blocks(kvb, ends);
    const float* v = P.v + hk * P.v_head + n * P.v_row;
    int64_t b0 = 0;
    for (int b = 0; b < nb; ++b) {
      const int64_t b1 = std::min(ends[b], L);
      if (b0 < b1) pv_rows<R>(P, s, v, b0, b1, dst, n == 0 && b == 0);
      b0 = ends[b];
    }
  }
  for (int i = 0; i < R; ++i) {
    const float inv = 1 / sm[i];
    float* out = P.out + ((i0 + i) * P.Hq + h) * P.D;
    for (int64_t j = 0; j < P.D; j += LANES) (Vec::loadu(dst + i * MAX_D + j) * Vec(inv)).store(out + j);
  }
}

void run(const Problem& P) {
  const int64_t tiles = (P.T + TILE - 1) / TILE;
  const int64_t items = tiles * P.Hq;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float s[TILE * P_LD];
    alignas(64) float dst[TILE * MAX_D];
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t idx = next.fetch_add(1); idx < items; idx = next.fetch_add(1)) {
        const int64_t tile = tiles - 1 - idx / P.Hq, h = idx % P.Hq;  // latest rows first
        const int64_t i0 = tile * TILE;
        switch (std::min<int64_t>(TILE, P.T - i0)) {
          case 1: item<1>(P, h, i0, s, dst); break;
          case 2: item<2>(P, h, i0, s, dst); break;
          case 3: item<3>(P, h, i0, s, dst); break;
          case 4: item<4>(P, h, i0, s, dst); break;
          case 5: item<5>(P, h, i0, s, dst); break;
          case 6: item<6>(P, h, i0, s, dst); break;
          case 7: item<7>(P, h, i0, s, dst); break;
          default: item<8>(P, h, i0, s, dst); break;
        }
      }
    }
  });
}

// q [1, Hq, T, D], k, v [1, Hkv, T, D] float32, last dim contiguous, other strides free (the
// transposed views of [T, H, D] rows); T >= 1, Hq a multiple of Hkv, D a multiple of 16 up to 192.
// Returns o [1, Hq, T, D] (a view of a [1, T, Hq, D] tensor, as torch's kernel returns it).
at::Tensor prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  for (const auto* t : {&q, &k, &v}) {
    TORCH_CHECK(t->dim() == 4 && t->size(0) == 1, "q, k, v must be [1, heads, T, head_dim]");
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(), "q, k, v must be float32 CPU tensors");
    TORCH_CHECK(t->stride(3) == 1, "the last dimension of q, k, v must be contiguous");
  }
  TORCH_CHECK(k.sizes() == v.sizes(), "k and v shapes differ");
  Problem P{};
  P.Hq = q.size(1);
  P.T = q.size(2);
  P.D = q.size(3);
  P.Hkv = k.size(1);
  TORCH_CHECK(k.size(2) == P.T && k.size(3) == P.D, "k must be [1, Hkv, ", P.T, ", ", P.D, "]");
  TORCH_CHECK(P.Hkv > 0 && P.Hq % P.Hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(P.D % LANES == 0 && P.D <= MAX_D, "head_dim must be a multiple of 16, at most ", MAX_D);
  P.r = P.Hq / P.Hkv;
  at::Tensor out = at::empty({1, P.T, P.Hq, P.D}, q.options());
  if (P.T == 0) return out.transpose(1, 2);
  P.Tp = (P.T + 3 * LANES - 1) / LANES * LANES;
  at::Tensor kt = at::zeros({P.Hkv, P.D, P.Tp}, q.options());
  float* ktp = kt.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const int64_t k_row = k.stride(2), k_head = k.stride(1);
  at::parallel_for(0, P.Hkv * P.T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t x = begin; x < end; ++x) {
      const int64_t h = x / P.T, t = x % P.T;
      for (int64_t d = 0; d < P.D; ++d) ktp[(h * P.D + d) * P.Tp + t] = kp[h * k_head + t * k_row + d];
    }
  });
  P.q = q.data_ptr<float>();
  P.q_row = q.stride(2);
  P.q_head = q.stride(1);
  P.v = v.data_ptr<float>();
  P.v_row = v.stride(2);
  P.v_head = v.stride(1);
  P.kt = ktp;
  P.out = out.data_ptr<float>();
  P.scale = static_cast<float>(scale);
  run(P);
  return out.transpose(1, 2);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixkv, m) {
  m.def("prompt_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
  m.impl("prompt_attention", c10::DispatchKey::CPU, TORCH_FN(prompt_attention));
}
