// radixkv native CPU rotary position embedding for float32, bit for bit the torch ops the decoder
// forward runs (model_service/decoder_forward.py `_rotate`):
//
//   out = x * cos + cat(x[..., D/2:], x[..., :D/2]) * signed_sin     (each product and the sum rounded)
//
// where signed_sin is transformers' sin with its first half negated, so that the second product is
// rotate_half(x) * sin exactly. Registered as torch.ops.radixkv.rope (native/__init__.py).
//
// Why: in a decode step that is four torch ops per layer (cat, two products, an add), each a small
// dispatch and a parallel region, a visible share of the step in all.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <cstdint>

namespace {

using radixkv::LANES;

// a * b rounded on its own, as torch's separate ops round it (build.py's -ffp-contract=off keeps
// g++ from contracting it with the add that follows into an FMA).
inline __m512 product(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }

inline float product(float a, float b) { return a * b; }

// One head's row: out[d] = x[d] * c[d] + x[(d + half) % D] * s[d].
void rotate_row(const float* x, const float* c, const float* s, float* out, int64_t D) {
  const int64_t half = D / 2;
  if (half % LANES == 0) {
    for (int64_t d = 0; d < D; d += LANES) {
      const int64_t other = d < half ? d + half : d - half;
      const __m512 a = product(_mm512_loadu_ps(x + d), _mm512_loadu_ps(c + d));
      const __m512 b = product(_mm512_loadu_ps(x + other), _mm512_loadu_ps(s + d));
      _mm512_storeu_ps(out + d, _mm512_add_ps(a, b));
    }
    return;
  }
  for (int64_t d = 0; d < D; ++d) out[d] = product(x[d], c[d]) + product(x[d < half ? d + half : d - half], s[d]);
}

// x [T, H, D] float32 with a contiguous last dimension (any token and head strides, as a slice of
// the fused q/k/v product is); cos, signed_sin [T, D] contiguous. Returns out [T, H, D] contiguous.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu() && signed_sin.device().is_cpu(), "rope takes CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && signed_sin.scalar_type() == at::kFloat,
              "rope takes float32 tensors");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [tokens, heads, head_dim] with a contiguous last dimension");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  TORCH_CHECK(D % 2 == 0, "head_dim must be even, got ", D);
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == T && cos.size(1) == D && cos.is_contiguous() &&
                  signed_sin.sizes() == cos.sizes() && signed_sin.is_contiguous(),
              "cos and signed_sin must be contiguous [", T, ", ", D, "] tensors");
  at::Tensor out = at::empty({T, H, D}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = signed_sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ts = x.stride(0), hs = x.stride(1);
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, H * D));  // small steps: one thread
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < H; ++h) rotate_row(xp + t * ts + h * hs, cp + t * D, sp + t * D, op + (t * H + h) * D, D);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixkv, m) {
  m.def("rope(Tensor x, Tensor cos, Tensor signed_sin) -> Tensor");
  m.impl("rope", c10::DispatchKey::CPU, TORCH_FN(rope));
}
