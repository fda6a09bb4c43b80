// radixkv native CPU rotary position embedding for float32 and bfloat16, bit for bit the torch ops
// the decoder forward runs (model_service/decoder_forward.py `_rotate`):
//
//   out = x * cos + cat(x[..., D/2:], x[..., :D/2]) * signed_sin     (each product and the sum rounded)
//
// (in bfloat16 each op computes in float32 and rounds its result to bfloat16, as torch's do)
//
// where signed_sin is transformers' sin with its first half negated, so that the second product is
// rotate_half(x) * sin exactly. Registered as torch.ops.radixkv.rope (native/__init__.py).
//
// Why: in a decode step that is four torch ops per layer (cat, two products, an add), each a small
// dispatch and a parallel region, a visible share of the step in all.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace {

using radixkv::LANES;

// a * b rounded on its own, as torch's separate ops round it (build.py's -ffp-contract=off keeps
// g++ from contracting it with the add that follows into an FMA).
inline __m512 product(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }

inline float product(float a, float b) { return a * b; }

// Element access per dtype: float32 as is; bfloat16 (uint16_t bits) widened, and each op's result
// rounded to bfloat16 (Round) before the next op reads it.
inline __m512 load(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load(const uint16_t* p) { return radixkv::load_bf16(p); }
inline void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store(uint16_t* p, __m512 v) { radixkv::store_bf16(p, v); }
inline float widen(float v) { return v; }
inline float widen(uint16_t v) { return radixkv::bf16_to_float(v); }
inline void put(float* p, float v) { *p = v; }
inline void put(uint16_t* p, float v) { *p = radixkv::float_to_bf16(v); }
template <typename T> inline __m512 rounded(__m512 v) { return std::is_same_v<T, float> ? v : radixkv::round_bf16(v); }
template <typename T> inline float rounded(float v) { return std::is_same_v<T, float> ? v : radixkv::round_bf16(v); }

// One head's row: out[d] = x[d] * c[d] + x[(d + half) % D] * s[d].
template <typename T>
void rotate_row(const T* x, const T* c, const T* s, T* out, int64_t D) {
  const int64_t half = D / 2;
  if (half % LANES == 0) {
    for (int64_t d = 0; d < D; d += LANES) {
      const int64_t other = d < half ? d + half : d - half;
      const __m512 a = rounded<T>(product(load(x + d), load(c + d)));
      const __m512 b = rounded<T>(product(load(x + other), load(s + d)));
      store(out + d, _mm512_add_ps(a, b));
    }
    return;
  }
  for (int64_t d = 0; d < D; ++d) {
    const float a = rounded<T>(product(widen(x[d]), widen(c[d])));
    const float b = rounded<T>(product(widen(x[d < half ? d + half : d - half]), widen(s[d])));
    put(out + d, a + b);
  }
}

template <typename T>
void rope_rows(const T* xp, const T* cp, const T* sp, T* op, int64_t T_, int64_t H, int64_t D, int64_t ts,
               int64_t hs) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, H * D));  // small steps: one thread
  at::parallel_for(0, T_, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < H; ++h) rotate_row(xp + t * ts + h * hs, cp + t * D, sp + t * D, op + (t * H + h) * D, D);
  });
}

// x [T, H, D] float32 or bfloat16 with a contiguous last dimension (any token and head strides, as a slice of
// the fused q/k/v product is); cos, signed_sin [T, D] contiguous. Returns out [T, H, D] contiguous.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu() && signed_sin.device().is_cpu(), "rope takes CPU tensors");
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && cos.scalar_type() == dtype &&
                  signed_sin.scalar_type() == dtype,
              "rope takes float32 or bfloat16 tensors, all of one dtype");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [tokens, heads, head_dim] with a contiguous last dimension");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  TORCH_CHECK(D % 2 == 0, "head_dim must be even, got ", D);
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == T && cos.size(1) == D && cos.is_contiguous() &&
                  signed_sin.sizes() == cos.sizes() && signed_sin.is_contiguous(),
              "cos and signed_sin must be contiguous [", T, ", ", D, "] tensors");
  at::Tensor out = at::empty({T, H, D}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t ts = x.stride(0), hs = x.stride(1);
  if (dtype == at::kFloat) {
    rope_rows(x.data_ptr<float>(), cos.data_ptr<float>(), signed_sin.data_ptr<float>(), out.data_ptr<float>(), T, H,
              D, ts, hs);
  } else {
    auto bits = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<c10::BFloat16>()); };
    rope_rows<uint16_t>(bits(x), bits(cos), bits(signed_sin), bits(out), T, H, D, ts, hs);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixkv, m) {
  m.def("rope(Tensor x, Tensor cos, Tensor signed_sin) -> Tensor");
  m.impl("rope", c10::DispatchKey::CPU, TORCH_FN(rope));
}
