// radixkv native CPU SwiGLU activation for float32 and bfloat16, bit for bit the two torch ops the
// decoder forward runs (model_service/decoder_forward.py):
//
//   act = F.silu(gate).mul_(up)        silu(x) = x / (1 + exp(-x)), each op's result rounded
//
// Registered as torch.ops.radixkv.silu_mul (native/__init__.py).
//
// Why: in a prefill step those are two passes over [tokens, intermediate] (the larger of the
// model's activations) through a strided view of the fused gate/up product, each a parallel region
// writing a fresh tensor: on the AMX Xeon a tenth of a bf16 prefill step.
//
// torch's order: the silu kernel (ATen/native/cpu/Activation.cpp) computes, over each contiguous
// inner row of the iteration, pairs of Vectorized<scalar_t> (32 floats; 64 bfloat16, each vector
// as two float halves: Loops.h's vectorized_loop) as x / (1 + exp(-x)) with Vectorized<float>::exp
// (Sleef's expf, 1-ulp), and the elements after the last whole pair with the scalar
// float(x) / (1 + std::exp(-float(x))); bf16 results round to nearest even. (A large input is split
// between threads at its midpoint, which for the row lengths of real models falls on a row or a
// pair boundary; the probe runs such a split.) The product is one rounded multiply per element either way. This
// file uses the same Vectorized<float> (the AVX512 build torch dispatches to) and the same split
// per row, so the registry's probe checks it reproduces the torch the service runs.

#include "torch_vec.h"  // first: it sets torch's AVX512 capability for the ATen headers

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

using radixkv::Vec;

inline Vec silu(const Vec& x) { return x / (Vec(1.0f) + x.neg().exp()); }

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

// One row of n elements: out = silu(gate) * up. torch's step for the dtype: two vectors, 32 floats
// or 64 bfloat16; the elements past the last whole step take the scalar forms.
void row_float(const float* gate, const float* up, float* out, int64_t n) {
  const int64_t whole = n - n % 32;
  for (int64_t i = 0; i < whole; i += 16) (silu(Vec::loadu(gate + i)) * Vec::loadu(up + i)).store(out + i);
  for (int64_t i = whole; i < n; ++i) out[i] = silu(gate[i]) * up[i];
}

void row_bf16(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n) {
  const int64_t whole = n - n % 64;
  for (int64_t i = 0; i < whole; i += 16) {
    alignas(64) float g[16];
    _mm512_store_ps(g, radixkv::load_bf16(gate + i));
    const __m512 act = radixkv::round_bf16(static_cast<__m512>(silu(Vec::loadu(g))));
    radixkv::store_bf16(out + i, _mm512_mul_ps(act, radixkv::load_bf16(up + i)));
  }
  for (int64_t i = whole; i < n; ++i) {
    const float act = radixkv::round_bf16(silu(radixkv::bf16_to_float(gate[i])));
    out[i] = radixkv::float_to_bf16(act * radixkv::bf16_to_float(up[i]));
  }
}

// gate, up [T, n] with contiguous rows (any row stride: halves of the fused gate/up product);
// returns out [T, n] contiguous, of their dtype (float32 or bfloat16).
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.device().is_cpu() && up.device().is_cpu(), "silu_mul takes CPU tensors");
  const auto dtype = gate.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && up.scalar_type() == dtype,
              "silu_mul takes float32 or bfloat16 tensors, gate and up of one dtype");
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.stride(1) == 1 && up.stride(1) == 1,
              "gate and up must be [rows, n] of one shape with contiguous rows");
  const int64_t T = gate.size(0), n = gate.size(1);
  at::Tensor out = at::empty({T, n}, gate.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t gs = gate.stride(0), us = up.stride(0);
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, n));  // small steps: one thread
  if (dtype == at::kFloat) {
    const float* g = gate.data_ptr<float>();
    const float* u = up.data_ptr<float>();
    float* o = out.data_ptr<float>();
    at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) row_float(g + t * gs, u + t * us, o + t * n, n);
    });
  } else {
    auto bits = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<c10::BFloat16>()); };
    const uint16_t* g = bits(gate);
    const uint16_t* u = bits(up);
    uint16_t* o = bits(out);
    at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) row_bf16(g + t * gs, u + t * us, o + t * n, n);
    });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixkv, m) {
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
}
