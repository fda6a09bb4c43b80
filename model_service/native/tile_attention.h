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

// Whether bfloat16 attention of this head_dim runs on tiles here: this CPU and process can use
// AMX, the path is allowed (set_attention_tiles) and head_dim is a multiple of 32 up to 256.
bool tiles_run(int64_t head_dim);

// Whether the tiles take an attend call of M queries per head (tiles_run, and enough queries).
bool tiles_take(int64_t head_dim, int64_t queries);

// A cascade decode's prefix pass on tiles (tiles_run must hold): `rows` bfloat16 query rows
// (each D values at queries[i]) over the first `len` keys of one head's K/V (rows `kv_row`
// elements apart), no mask. Leaves the online softmax's state for the caller to continue over
// more keys, as attention.cpp's row kernels keep it: ot [D][W] (row i in lane i, unnormalized),
// m (running maxima of the scaled scores) and l (sums of exp(score - m)) per row.
void attend_prefix_tiles(const c10::BFloat16* const* queries, int64_t rows, const c10::BFloat16* k,
                         const c10::BFloat16* v, int64_t kv_row, int64_t len, int64_t D, float scale, float* ot,
                         int64_t W, float* m, float* l);

// A prefix packed once for the tiles, to be attended over by many calls (a cascade prefix kept
// across decode steps): K as the B tiles of Q K^T, then V as the B tiles of P V, each
// prefix_tile_words(len, D) 32-bit words (len rounded up to the 64-key block, zero past len).
int64_t prefix_tile_words(int64_t len, int64_t D);
void pack_prefix_tiles(const c10::BFloat16* k, const c10::BFloat16* v, int64_t kv_row, int64_t len, int64_t D,
                       uint32_t* kp, uint32_t* vp);

// attend_prefix_tiles over a prefix pack_prefix_tiles packed (kp, vp): the same result, bit for bit.
void attend_packed_prefix_tiles(const c10::BFloat16* const* queries, int64_t rows, const uint32_t* kp,
                                const uint32_t* vp, int64_t len, int64_t D, float scale, float* ot, int64_t W,
                                float* m, float* l);

void attend_tiles(const TileProblem& P, const c10::BFloat16* q, const c10::BFloat16* k, const c10::BFloat16* v,
                  c10::BFloat16* o, float* lse);

// Chunks of new tokens after cached prefixes packed once (pack_prefix_tiles): sequence b's lens[b]
// new tokens are rows starts[b] .. of q [T, Hq, D], k, v [T, Hkv, D] (token and head strides
// qs, ks, vs; the last dimension contiguous), its prefix of prefix_lens[b] keys is tiles[b]
// ([Hkv][2][words[b]] words); each new token attends over the whole prefix and the new tokens up
// to itself. o: rows starts[b] + i of a [T, Hq, D] output (strides os), the others untouched.
struct ExtendProblem {
  int64_t B, Hq, Hkv, D;
  const int64_t* starts;
  const int64_t* lens;
  const int64_t* prefix_lens;
  const uint32_t* const* tiles;
  const int64_t* words;
  int64_t qs[2], ks[2], vs[2], os[2];
  float scale;
};

void attend_extends_tiles(const ExtendProblem& P, const c10::BFloat16* q, const c10::BFloat16* k,
                          const c10::BFloat16* v, c10::BFloat16* o);

}  // namespace radixkv
