/* A KV cache tensor and a step's metadata tensors as the attention kernels' C structs, checked
 * (KilnKvCache, KilnAttnStep): what attention_op.cpp hands paged_attention.c and the prefill. */
#ifndef KILN_ATTENTION_ARGS_H
#define KILN_ATTENTION_ARGS_H

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <utility>

#include "dtype.h"
#include "torch_ops.h"

namespace kiln::attn {

inline void check_int(const char *name, const at::Tensor &t, at::ScalarType dtype) {
    TORCH_CHECK_VALUE(t.scalar_type() == dtype && t.stride(-1) == 1 && t.device().is_cpu(),
                      "paged_attention: ", name, " must be CPU ", dtype,
                      " with contiguous rows, got ", t.scalar_type(), " with strides ",
                      t.strides());
}

/* A KV cache element's code (dtype.h): float32, bfloat16, an fp8 (--kv-cache-dtype); -1 else. */
inline int32_t cache_code(at::ScalarType t) {
    if (t == at::kFloat8_e4m3fn) return KILN_FP8E4M3;
    if (t == at::kFloat8_e5m2) return KILN_FP8E5M2;
    return kiln::dtype_code(t);
}

inline int32_t cache_dtype(const at::Tensor &kv_cache) {
    const int32_t code = cache_code(kv_cache.scalar_type());
    TORCH_CHECK_TYPE(code >= 0, "paged_attention: the KV cache must be float32, bfloat16, "
                     "float8_e4m3fn or float8_e5m2, got ", kv_cache.scalar_type());
    return code;
}

/* kv_cache [2, num_blocks, block_size, nkv, hd] as the kernel reads it (pointers into it). An
 * fp8 cache's query dtype is left unset (-1): for_query sets it. */
inline KilnKvCache cache_struct(const at::Tensor &kv_cache) {
    TORCH_CHECK_VALUE(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
                      "paged_attention: the KV cache must be contiguous [2, num_blocks, "
                      "block_size, num_kv_heads, head_size], got ", kv_cache.sizes());
    const int32_t kv_dtype = cache_dtype(kv_cache);
    const int64_t half = kv_cache[0].numel() * kv_cache.element_size();
    char *base = static_cast<char *>(kv_cache.data_ptr());
    return KilnKvCache{base, base + half, kv_cache.size(1) * kv_cache.size(2),
                       static_cast<int32_t>(kv_cache.size(3)),
                       static_cast<int32_t>(kv_cache.size(4)),
                       static_cast<int32_t>(kv_cache.size(2)),
                       kv_dtype <= KILN_BF16 ? kv_dtype : -1, kv_dtype, 1.f, 1.f};
}

/* x finite and > 0, from its bits: -ffast-math folds std::isfinite and NaN compares away. */
inline bool finite_positive(double x) {
    uint64_t bits;
    std::memcpy(&bits, &x, sizeof bits); /* std::bit_cast is C++20; torch 2.11 may build C++17 */
    return bits != 0 && (bits >> 63) == 0 && ((bits >> 52) & 0x7ff) != 0x7ff;
}

/* cache_struct with an fp8 cache's per-tensor scales (a checkpoint's k_scale / v_scale); a
 * float32 / bfloat16 cache keeps 1 (it stores K/V as they are). */
inline KilnKvCache scaled_cache(const at::Tensor &kv_cache, double k_scale, double v_scale) {
    TORCH_CHECK_VALUE(finite_positive(k_scale) && finite_positive(v_scale),
                      "paged_attention: k_scale and v_scale must be finite and > 0, got ",
                      k_scale, " and ", v_scale);
    KilnKvCache cache = cache_struct(kv_cache);
    if (cache.kv_dtype > KILN_BF16) {
        cache.k_scale = static_cast<float>(k_scale);
        cache.v_scale = static_cast<float>(v_scale);
    }
    return cache;
}

/* Whether a query of `dtype` attends over this cache: the cache's own dtype, or (an fp8 cache)
 * float32 or bfloat16. */
inline bool serves_query(const KilnKvCache &cache, at::ScalarType dtype) {
    const int32_t code = kiln::dtype_code(dtype);
    return code >= 0 && (cache.dtype < 0 || cache.dtype == code);
}

/* cache with the query's dtype set (an fp8 cache computes in it), after serves_query. */
inline KilnKvCache for_query(KilnKvCache cache, at::ScalarType dtype, const char *op) {
    TORCH_CHECK_TYPE(serves_query(cache, dtype), op, ": q is ", dtype, ", the KV cache another "
                     "dtype");
    cache.dtype = kiln::dtype_code(dtype);
    return cache;
}

/* One step's metadata and the tensors it points into (held: the plan outlives no tensor). */
struct StepPlan {
    at::Tensor block_table, query_start, seq_lens, reqs, slots;
    KilnAttnStep args{};
    int64_t num_actual = 0;

    StepPlan(at::Tensor bt, at::Tensor qs, at::Tensor sl, at::Tensor r, at::Tensor slot,
             int64_t num_tokens, int64_t max_seq_len, int64_t block_size)
        : block_table(std::move(bt)), query_start(std::move(qs)), seq_lens(std::move(sl)),
          reqs(std::move(r)), slots(std::move(slot)) {
        check_int("block_table", block_table, at::kInt);
        check_int("query_start_loc", query_start, at::kInt);
        check_int("seq_lens", seq_lens, at::kInt);
        check_int("reqs", reqs, at::kInt);
        check_int("slot_mapping", slots, at::kLong);
        TORCH_CHECK_VALUE(block_table.dim() == 2 && max_seq_len <= block_table.size(1) * block_size,
                          "paged_attention: max_seq_len ", max_seq_len, " needs more blocks than "
                          "the block table's ", block_table.size(-1), " columns");
        TORCH_CHECK_VALUE(slots.is_contiguous() && 0 <= num_tokens && num_tokens <= slots.numel(),
                          "paged_attention: slot_mapping must be contiguous with one slot per "
                          "token (", num_tokens, "), got ", slots.sizes());
        args = KilnAttnStep{block_table.data_ptr<int32_t>(), block_table.stride(0),
                            query_start.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                            reqs.data_ptr<int32_t>(), slots.data_ptr<int64_t>(), num_tokens,
                            static_cast<int32_t>(reqs.numel()),
                            static_cast<int32_t>(max_seq_len)};
    }
};

}  // namespace kiln::attn

#endif  // KILN_ATTENTION_ARGS_H
