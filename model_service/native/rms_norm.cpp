// radixkv native CPU RMSNorm for float32 and bfloat16 rows, bit for bit what transformers'
// LlamaRMSNorm computes with torch's CPU kernels, with the residual add before it fused in.
// Registered as torch.ops.radixkv.add_rms_norm (model_service/native/__init__.py).
//
//   y += residual                                  (optional, in place: the new hidden state)
//   variance = y.pow(2).mean(-1, keepdim=True)     (torch: sum, then div_ by H)
//   out = (y * (variance + eps).rsqrt()) * weight
//
// In bfloat16 as LlamaRMSNorm runs it: the residual sum rounded to bfloat16, the row widened to
// float32 for the variance and the scaling, that result rounded to bfloat16, times the bfloat16
// weight rounded again (decoder_forward._rms_norm).
//
// Why: in a decode step these are six or seven tiny torch ops per norm (two norms a layer), each
// paying dispatch and a parallel region, a visible share of the step in all.
//
// The sum of squares follows torch 2.13's `cascade_sum` for a contiguous inner reduction
// (ATen/native/cpu/SumKernel.cpp, vectorized_inner_sum), as built for AVX2 (torch registers no
// AVX-512 build of its reductions, so AVX-512 CPUs run that one): 8-lane vectors of squares, viewed as
// rows of 4 vectors; 4 vector accumulators summed in cascade levels (multi_row_sum: level_step =
// 2^max(4, ceil(log2(rows)) / 4), 4 levels); leftover vectors into the first accumulator; the 4
// added left to right; then a scalar: the tail elements past the last whole vector, then the 8
// lanes, in order. The mean divides by H; rsqrt is 1 / sqrt (both correctly rounded). Whether this
// is the torch the service runs is probed at load (decoder_forward.native_norm_matches); else torch's
// ops are kept.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

using radixkv::LANES;
constexpr int64_t SUM_LANES = 8;   // torch's sum kernel is its AVX2 build (reductions register no AVX-512 one)
constexpr int64_t ILP = 4;         // row_sum's ilp_factor
constexpr int64_t NUM_LEVELS = 4;  // multi_row_sum's levels

int64_t ceil_log2(int64_t x) {  // c10::utils::CeilLog2 (ATen/native/cpu/utils.h)
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

// v * v rounded on its own, as torch's pow(2) tensor holds it (build.py's -ffp-contract=off keeps
// g++ from contracting it with the add that follows into an FMA).
inline __m256 square(const float* p) {
  const __m256 v = _mm256_loadu_ps(p);
  return _mm256_mul_ps(v, v);
}

// sum(x[i]^2 for i < H) in torch's order (see the top of the file).
float sum_of_squares(const float* x, int64_t H) {
  auto scalar_square = [&](int64_t e) {
    return x[e] * x[e];  // rounded on its own (see square)
  };
  if (H < SUM_LANES) {  // torch's scalar_inner_sum: row_sum over elements (under 16 rows of 4: no levels)
    float partial[ILP] = {0.0f, 0.0f, 0.0f, 0.0f};
    const int64_t rows = H / ILP;
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t k = 0; k < ILP; ++k) partial[k] += scalar_square(i * ILP + k);
    for (int64_t e = rows * ILP; e < H; ++e) partial[0] += scalar_square(e);
    for (int64_t k = 1; k < ILP; ++k) partial[0] += partial[k];
    return partial[0];
  }
  const int64_t vec_size = H / SUM_LANES, size_ilp = vec_size / ILP;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(size_ilp) / NUM_LEVELS);
  const int64_t level_step = int64_t{1} << level_power, level_mask = level_step - 1;
  __m256 acc[NUM_LEVELS][ILP];
  for (auto& level : acc)
    for (auto& a : level) a = _mm256_setzero_ps();
  auto load = [&](int64_t i, int64_t k) { return square(x + (i * ILP + k) * SUM_LANES); };
  int64_t i = 0;
  while (i + level_step <= size_ilp) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int64_t k = 0; k < ILP; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], load(i, k));
    for (int64_t j = 1; j < NUM_LEVELS; ++j) {
      for (int64_t k = 0; k < ILP; ++k) {
        acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = _mm256_setzero_ps();
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size_ilp; ++i)
    for (int64_t k = 0; k < ILP; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], load(i, k));
  for (int64_t j = 1; j < NUM_LEVELS; ++j)
    for (int64_t k = 0; k < ILP; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
  __m256 partial = acc[0][0];
  for (int64_t v = size_ilp * ILP; v < vec_size; ++v) partial = _mm256_add_ps(partial, square(x + v * SUM_LANES));
  for (int64_t k = 1; k < ILP; ++k) partial = _mm256_add_ps(partial, acc[0][k]);
  float total = 0.0f;
  for (int64_t e = vec_size * SUM_LANES; e < H; ++e) total += scalar_square(e);
  alignas(32) float lanes[SUM_LANES];
  _mm256_store_ps(lanes, partial);
  for (float lane : lanes) total += lane;
  return total;
}

// One row: y += residual (if any), out = (y * rsqrt(mean(y^2) + eps)) * weight.
void norm_row(float* y, const float* residual, const float* weight, float* out, int64_t H, float eps) {
  if (residual != nullptr) {
    int64_t e = 0;
    for (; e + LANES <= H; e += LANES)
      _mm512_storeu_ps(y + e, _mm512_add_ps(_mm512_loadu_ps(y + e), _mm512_loadu_ps(residual + e)));
    for (; e < H; ++e) y[e] += residual[e];
  }
  const float variance = sum_of_squares(y, H) / static_cast<float>(H);
  const float scale = 1.0f / std::sqrt(variance + eps);
  const __m512 s = _mm512_set1_ps(scale);
  int64_t e = 0;
  for (; e + LANES <= H; e += LANES)
    _mm512_storeu_ps(out + e, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(y + e), s), _mm512_loadu_ps(weight + e)));
  for (; e < H; ++e) out[e] = (y[e] * scale) * weight[e];
}

// The bfloat16 row (uint16_t bits): y += residual rounded to bf16; the float32 row in `wide`.
void norm_row_bf16(uint16_t* y, const uint16_t* residual, const uint16_t* weight, uint16_t* out, int64_t H, float eps,
                   float* wide) {
  int64_t e = 0;
  for (; e + LANES <= H; e += LANES) {
    __m512 v = radixkv::load_bf16(y + e);
    if (residual != nullptr) {
      v = radixkv::round_bf16(_mm512_add_ps(v, radixkv::load_bf16(residual + e)));
      radixkv::store_bf16(y + e, v);
    }
    _mm512_storeu_ps(wide + e, v);
  }
  for (; e < H; ++e) {
    float v = radixkv::bf16_to_float(y[e]);
    if (residual != nullptr) {
      y[e] = radixkv::float_to_bf16(v + radixkv::bf16_to_float(residual[e]));
      v = radixkv::bf16_to_float(y[e]);
    }
    wide[e] = v;
  }
  const float variance = sum_of_squares(wide, H) / static_cast<float>(H);
  const float scale = 1.0f / std::sqrt(variance + eps);
  const __m512 s = _mm512_set1_ps(scale);
  for (e = 0; e + LANES <= H; e += LANES) {
    const __m512 normed = radixkv::round_bf16(_mm512_mul_ps(_mm512_loadu_ps(wide + e), s));
    radixkv::store_bf16(out + e, _mm512_mul_ps(radixkv::load_bf16(weight + e), normed));
  }
  for (; e < H; ++e)
    out[e] = radixkv::float_to_bf16(radixkv::bf16_to_float(weight[e]) * radixkv::round_bf16(wide[e] * scale));
}

// y [T, H] float32 or bfloat16 contiguous, updated in place with residual [T, H] (if given); weight [H].
// Returns the normalized rows [T, H].
at::Tensor add_rms_norm(at::Tensor y, const std::optional<at::Tensor>& residual, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(y.device().is_cpu() && weight.device().is_cpu(), "add_rms_norm takes CPU tensors");
  const auto dtype = y.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && weight.scalar_type() == dtype,
              "add_rms_norm takes float32 or bfloat16 tensors, y and weight of one dtype");
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous(), "y must be a contiguous [rows, hidden] tensor");
  const int64_t T = y.size(0), H = y.size(1);
  TORCH_CHECK(H >= 1, "hidden size must be >= 1");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H && weight.is_contiguous(), "weight must be a contiguous [", H,
              "] tensor");
  if (residual.has_value()) {
    TORCH_CHECK(residual->device().is_cpu() && residual->scalar_type() == dtype && residual->is_contiguous() &&
                    residual->sizes() == y.sizes(),
                "residual must be a contiguous tensor of y's dtype and shape");
  }
  at::Tensor out = at::empty({T, H}, y.options());
  const float e = static_cast<float>(eps);
  const int64_t grain = std::max<int64_t>(1, 32768 / H);  // small inputs: one thread, no parallel region
  if (dtype == at::kBFloat16) {
    auto bits = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<c10::BFloat16>()); };
    uint16_t* yp = bits(y);
    const uint16_t* rp = residual.has_value() ? bits(*residual) : nullptr;
    const uint16_t* wp = bits(weight);
    uint16_t* op = bits(out);
    at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> wide(H);
      for (int64_t t = begin; t < end; ++t)
        norm_row_bf16(yp + t * H, rp == nullptr ? nullptr : rp + t * H, wp, op + t * H, H, e, wide.data());
    });
    return out;
  }
  const float* rp = residual.has_value() ? residual->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      norm_row(yp + t * H, rp == nullptr ? nullptr : rp + t * H, wp, op + t * H, H, e);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixkv, m) {
  m.def("add_rms_norm(Tensor(a!) y, Tensor? residual, Tensor weight, float eps) -> Tensor");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
}
