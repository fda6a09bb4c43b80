// What every radixkv native kernel shares: the vector width and the target attribute of the
// AVX512-BF16 code. Included by each .cpp file (build.py and the Makefile hash headers too, so a
// change here rebuilds the library).
//
// Rounding: build.py compiles with -ffp-contract=off, so `a * b + c` written with separate
// intrinsics or in scalar C++ is a rounded product and a rounded sum, as torch's separate ops
// compute it; only the explicit FMA intrinsics (_mm512_fmadd_ps, ...) fuse. Kernels that must be
// bitwise torch rely on that; tests/model_service/test_native_build.py checks the flag is there.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace radixkv {

constexpr int64_t LANES = 16;  // float32 lanes of a 512-bit vector

// Lanes [0, remaining) of a 16-lane vector (all of them from 16 on).
inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= LANES ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << remaining) - 1u);
}

// bfloat16 <-> float32 in AVX-512 F/BW, as torch's AVX512 vector code converts (ATen's
// cvtbf16_fp32 / cvtfp32_bf16): widening is exact; narrowing rounds to nearest even, NaN to 0xffff.
inline __m512 load_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

inline __m256i to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  rounded = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), _mm512_set1_epi32(0xffff), rounded);
  return _mm512_cvtepi32_epi16(rounded);
}

inline void store_bf16(uint16_t* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v)); }

// v rounded to bfloat16 and widened back: a bf16 tensor op's result, as float32 for the next op.
inline __m512 round_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}

// The scalar forms (c10::BFloat16's: round to nearest even; NaN to 0x7fc0 there, never met here).
inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  if (f != f) return 0x7fc0;
  uint32_t bits;
  __builtin_memcpy(&bits, &f, 4);
  return static_cast<uint16_t>((bits + ((bits >> 16) & 1u) + 0x7fffu) >> 16);
}

inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

}  // namespace radixkv

// AVX512-BF16 code: the library is compiled for AVX-512 F/BW/VL/DQ only, and functions with this
// attribute may use AVX512-BF16 instructions too. They run only where has_bf16_dot_products()
// (below) found the instructions on this CPU. A compiler without AVX512-BF16 support
// builds with RADIXKV_NO_BF16 (build.py): the dot-product path is then left out entirely.
#ifndef RADIXKV_NO_BF16
#define RADIXKV_BF16 __attribute__((target("avx512bf16")))
#endif

namespace radixkv {

// Whether this CPU runs AVX512-BF16, so that RADIXKV_BF16 functions may be called.
inline bool has_bf16_dot_products() {
#ifndef RADIXKV_NO_BF16
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

}  // namespace radixkv
