// radixkv native CPU K/V write: a step's new K and V rows into their slots of the paged caches,
// registered as torch.ops.radixkv.write_kv (model_service/native/__init__.py).
//
// Why: two index_copy_ calls per layer each pay dispatch and setup, far more than their few KB of
// copies cost in a decode step; this is one call that copies each token's K and V
// rows (Hkv x D contiguous values each) with memcpy, checking every slot first.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

// k, v [T, Hkv, D] (each token's Hkv x D values contiguous); k_cache, v_cache [num_blocks,
// block_size, Hkv, D] contiguous, of k's dtype; slots int64 [T]: token t goes to slot slots[t]
// (block slots[t] / block_size, position slots[t] % block_size).
void write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& slots) {
  TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  slots.device().is_cpu(),
              "write_kv takes CPU tensors");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "k and v must be [tokens, kv_heads, head_dim] of one shape");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "the caches must be contiguous [num_blocks, block_size, kv_heads, head_dim] of one shape");
  const int64_t T = k.size(0), H = k.size(1), D = k.size(2);
  TORCH_CHECK(k_cache.size(2) == H && k_cache.size(3) == D, "k has ", H, " heads of ", D, ", the cache ",
              k_cache.size(2), " of ", k_cache.size(3));
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type(),
              "k, v and the caches must have one dtype");
  for (const at::Tensor* t : {&k, &v})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == D, "each token's k and v values must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == T && slots.is_contiguous(),
              "slots must be a contiguous int64 [tokens] tensor");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " of token ", t, " is outside the cache (",
                num_slots, " slots)");
  const int64_t row_bytes = H * D * static_cast<int64_t>(k.element_size());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t ks = k.stride(0) * k.element_size(), vs = v.stride(0) * v.element_size();
  at::parallel_for(0, T, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kc + sp[t] * row_bytes, kp + t * ks, row_bytes);
      std::memcpy(vc + sp[t] * row_bytes, vp + t * vs, row_bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixkv, m) {
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
  m.impl("write_kv", c10::DispatchKey::CPU, TORCH_FN(write_kv));
}
