// torch's Vectorized<float> as its AVX512 build defines it, for the kernels that reproduce torch's
// own vector code bit for bit (prompt_attention.cpp: its exp and reductions; silu_mul.cpp: its
// exp): they compute with the class torch dispatches to on these CPUs. Include it before any ATen
// header, so that the capability is set when ATen's vector headers are first read.
#pragma once

#ifndef CPU_CAPABILITY
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#endif

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

namespace radixkv {

using Vec = at::vec::Vectorized<float>;
static_assert(Vec::size() == 16, "the AVX512 Vectorized<float> has 16 lanes");

}  // namespace radixkv
