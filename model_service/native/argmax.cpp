// radixkv native CPU argmax over the rows of a float32 matrix: torch.argmax(x, dim=-1) exactly
// (the first index of the maximum; a NaN counts as the maximum, the first NaN wins), registered
// as torch.ops.radixkv.argmax_rows (model_service/native/__init__.py).
//
// Why: greedy sampling takes the argmax of every decode row's logits each step; torch's CPU argmax
// reduces index-value pairs one element at a time, a visible share of a decode step over a
// vocabulary-wide row. Here a row is read twice with AVX-512: its maximum (and
// whether it holds a NaN), then the first position equal to it (the row is in L2 by then).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd.h"

#include <cstdint>
#include <limits>

namespace {

using radixkv::LANES;
using radixkv::tail_mask;

// The first i in [0, n) with x[i] == value (value NaN: the first NaN); n when there is none.
int64_t first_equal(const float* x, int64_t n, float value, bool nan) {
  const __m512 v = _mm512_set1_ps(value);
  for (int64_t i = 0; i < n; i += LANES) {
    const __mmask16 valid = tail_mask(n - i);
    const __m512 xv = _mm512_maskz_loadu_ps(valid, x + i);
    const __mmask16 hit = nan ? _mm512_mask_cmp_ps_mask(valid, xv, xv, _CMP_UNORD_Q)
                              : _mm512_mask_cmp_ps_mask(valid, xv, v, _CMP_EQ_OQ);
    if (hit) return i + static_cast<int64_t>(__builtin_ctz(hit));
  }
  return n;
}

int64_t argmax_row(const float* x, int64_t n) {
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += LANES) {
    const __mmask16 valid = tail_mask(n - i);
    const __m512 xv = _mm512_mask_loadu_ps(best, valid, x + i);  // lanes past the end repeat best
    nan |= _mm512_cmp_ps_mask(xv, xv, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, xv);
  }
  if (nan) return first_equal(x, n, 0.0f, true);
  return first_equal(x, n, _mm512_reduce_max_ps(best), false);
}

// x [rows, n] float32, last dim contiguous, n >= 1. Returns int64 [rows].
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "x must be a float32 CPU tensor");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be 2-D [rows, n] with a contiguous last dimension");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  TORCH_CHECK(n >= 1, "argmax of an empty row");
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * stride, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixkv, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.impl("argmax_rows", c10::DispatchKey::CPU, TORCH_FN(argmax_rows));
}
