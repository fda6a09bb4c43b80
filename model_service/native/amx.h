// AMX tiles, shared by the kernels that use them (dot_linear.cpp, tile_attention.cpp): the target
// attribute, the tile configuration's layout and whether this CPU and process may use the tiles.
// Compiled out under RADIXKV_NO_AMX (build.py: a compiler that cannot target AMX, or one without
// AVX512-BF16, which the tile paths round their results with); has_amx_tiles() is then false.
#pragma once

#include "simd.h"

#include <cstdint>

#if defined(RADIXKV_NO_BF16) && !defined(RADIXKV_NO_AMX)
#define RADIXKV_NO_AMX
#endif

#ifndef RADIXKV_NO_AMX
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define RADIXKV_AMX __attribute__((target("amx-tile,amx-bf16,avx512bf16")))
#endif

namespace radixkv {

constexpr int TILE_ROWS = 16;   // rows of a tile; k pairs of a B tile
constexpr int TILE_BYTES = 64;  // bytes of a tile row: 16 float32, 32 bfloat16, 16 bfloat16 pairs

// The 64-byte tile configuration (palette 1): per tile its rows and bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#ifndef RADIXKV_NO_AMX
// Whether the CPU has AMX tiles with bf16 products and Linux lets this process use them (the
// permission is asked once; oneDNN asks for the same).
inline bool amx_usable() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!(d & (1u << 24)) || !(d & (1u << 22))) return false;  // AMX-TILE, AMX-BF16
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

inline bool has_amx_tiles() {
  static const bool usable = amx_usable() && has_bf16_dot_products();
  return usable;
}

// Loads `config`. The barrier keeps the stores that filled it: GCC 12 dropped the rows and
// colsb stores of a configuration filled in a loop (ldtilecfg then loaded an empty one and the
// first tile instruction faulted).
RADIXKV_AMX inline void load_tile_config(const TileConfig& config) {
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}
#else
inline bool has_amx_tiles() { return false; }
#endif

}  // namespace radixkv
