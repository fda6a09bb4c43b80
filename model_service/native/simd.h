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
