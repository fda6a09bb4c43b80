// The AMX tile path of radixkv.attend for bfloat16 (tile_attention.cpp): attention.cpp checks the
// call and hands the problem over here where tiles_take() says the tiles run it.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace radixkv {

// One attend call: q [B, Hq, M, D], k, v [B, Hkv, L, D] with the strides of their first three
// dimensions (elements; the last dimension is contiguous), key lengths per sequence and, when
// causal, the position of each sequence's first query (query i sees keys j < min(kv_lens[b],
// offsets[b] + i + 1)); o [B, Hq, M, D] and lse [B, Hq, M] are contiguous.
struct TileProblem {
  int64_t B, Hq, Hkv, M, L, D;
  const int64_t* kv_lens;
  const int64_t* offsets;  // nullptr: every query sees its sequence's kv_lens keys
  int64_t qs[3], ks[3], vs[3];
  float scale;
};

// Whether the tiles take a bfloat16 call of this head_dim and M queries per head: this CPU and
// process can use AMX, the path is allowed (set_attention_tiles) and the shapes fit it.
bool tiles_take(int64_t head_dim, int64_t queries);

void attend_tiles(const TileProblem& P, const c10::BFloat16* q, const c10::BFloat16* k, const c10::BFloat16* v,
                  c10::BFloat16* o, float* lse);

}  // namespace radixkv
