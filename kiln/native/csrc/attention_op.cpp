/* The CPU paged-attention and prefill kernels as torch ops called with their tensors
 * (`kiln::paged_attention`, `kiln::prefill_attention`, their queries) and the calls into them. */
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "attention_args.h"
#include "attention_run.h"
#include "torch_ops.h"

namespace {

using namespace kiln::attn;

void check_rows(const char *name, const at::Tensor &t, at::ScalarType dtype, int64_t width,
                int64_t num_tokens) {
    TORCH_CHECK_VALUE(t.scalar_type() == dtype && t.dim() == 2 && t.size(1) == width &&
                          t.stride(1) == 1 && t.size(0) >= num_tokens,
                      "paged_attention: ", name, " must be ", dtype, " [>= ", num_tokens,
                      ", ", width, "] with contiguous rows, got ", t.scalar_type(), " ",
                      t.sizes(), " strides ", t.strides());
}

/* Each of plan's requests is one of the step's: the prefill kernel reads their rows unchecked. */
void check_requests(const StepPlan &plan, const char *op) {
    const int64_t num_reqs = plan.seq_lens.numel();
    const int32_t *r = plan.reqs.data_ptr<int32_t>();
    for (int64_t i = 0; i < plan.reqs.numel(); ++i)
        TORCH_CHECK_INDEX(0 <= r[i] && r[i] < num_reqs && r[i] < plan.block_table.size(0) &&
                              r[i] + 1 < plan.query_start.numel(),
                          op, ": request ", r[i], " is outside the step's ", num_reqs,
                          " requests");
}

}  // namespace

namespace kiln::attn {

void run_kernel(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                const at::Tensor &out, const KilnKvCache &layer_cache, const KilnAttnStep &step,
                double scale, int64_t window, double softcap, c10::string_view layer) {
    const at::ScalarType dtype = q.scalar_type();
    const KilnKvCache cache = for_query(layer_cache, dtype, "paged_attention");
    const int64_t width = q.size(-1), kv_width = int64_t{cache.num_kv_heads} * cache.head_size;
    check_rows("q", q, dtype, width, step.num_tokens);
    check_rows("k", k, dtype, kv_width, step.num_tokens);
    check_rows("v", v, dtype, kv_width, step.num_tokens);
    check_rows("out", out, dtype, width, step.num_tokens);
    TORCH_CHECK_VALUE(width % cache.head_size == 0, "paged_attention: q's width ", width,
                      " is not whole heads of ", cache.head_size, " values");
    const int rc = kiln_paged_attention(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0),
                                        v.data_ptr(), v.stride(0), out.data_ptr(), out.stride(0),
                                        static_cast<int32_t>(width / cache.head_size),
                                        static_cast<float>(scale), static_cast<int32_t>(window),
                                        static_cast<float>(softcap), &cache, &step,
                                        kiln::threads());
    TORCH_CHECK_INDEX(!(rc & KILN_ATTN_BAD_SLOT), "paged_attention (", layer,
                      "): a slot is outside [-1, ", cache.num_slots,
                      ") (the cache's blocks x block_size); nothing was written");
    TORCH_CHECK(rc == 0, "paged_attention (", layer, "): the CPU kernel failed with code ", rc,
                ":", (rc & KILN_ATTN_BAD_LENGTHS) ? " a seq_len above max_seq_len or below its "
                "query length" : "", (rc & KILN_ATTN_NO_MEMORY) ? " out of memory" : "",
                (rc & KILN_ATTN_BAD_HEADS) ? " num_heads not a multiple of num_kv_heads" : "");
}

StepPlan prefill_plan(const at::Tensor &block_table, const at::Tensor &query_start_loc,
                      const at::Tensor &seq_lens, const at::Tensor &reqs, int64_t max_seq_len,
                      int64_t block_size, const char *op) {
    StepPlan plan(block_table, query_start_loc, seq_lens, reqs,
                  at::Tensor(at::detail::empty_cpu({0}, at::kLong, false, std::nullopt)), 0,
                  max_seq_len, block_size);
    check_requests(plan, op);
    return plan;
}

void run_prefill(const at::Tensor &q, const at::Tensor &out, const KilnKvCache &cache,
                 const KilnAttnStep &step, double scale, int64_t window, double softcap,
                 int64_t path) {
    const at::ScalarType dtype = q.scalar_type();
    const int64_t width = q.size(-1), rows = q.dim() == 2 ? q.size(0) : 0;
    check_rows("q", q, dtype, width, rows);
    check_rows("out", out, dtype, width, rows);
    TORCH_CHECK_VALUE(width % cache.head_size == 0, "prefill_attention: q's width ", width,
                      " is not whole heads of ", cache.head_size, " values");
    const int rc = kiln_prefill_attention(
        q.data_ptr(), q.stride(0), out.data_ptr(), out.stride(0), rows,
        static_cast<int32_t>(width / cache.head_size), static_cast<float>(scale),
        static_cast<int32_t>(window), static_cast<float>(softcap), &cache, &step,
        static_cast<int32_t>(path), kiln::threads());
    TORCH_CHECK(rc == 0, "prefill_attention: the CPU kernel failed with code ", rc, ":",
                (rc & KILN_ATTN_BAD_LENGTHS) ? " a query outside q's rows, or a seq_len above "
                "max_seq_len or below its query length" : "",
                (rc & KILN_ATTN_NO_MEMORY) ? " out of memory" : "",
                (rc & KILN_ATTN_BAD_HEADS) ? " num_heads not a multiple of num_kv_heads" : "");
}

}  // namespace kiln::attn

namespace {

using namespace kiln::attn;

void paged_attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                     const at::Tensor &out, const at::Tensor &kv_cache, double scale,
                     const at::Tensor &block_table, const at::Tensor &query_start_loc,
                     const at::Tensor &seq_lens, const at::Tensor &reqs,
                     const at::Tensor &slot_mapping, int64_t num_tokens, int64_t max_seq_len,
                     int64_t window, double softcap, double k_scale, double v_scale) {
    const KilnKvCache cache = scaled_cache(kv_cache, k_scale, v_scale);
    const StepPlan plan(block_table, query_start_loc, seq_lens, reqs, slot_mapping, num_tokens,
                        max_seq_len, cache.block_size);
    run_kernel(q, k, v, out, cache, plan.args, scale, window, softcap, "paged_attention");
}

void prefill_attention(const at::Tensor &q, const at::Tensor &out, const at::Tensor &kv_cache,
                       double scale, const at::Tensor &block_table,
                       const at::Tensor &query_start_loc, const at::Tensor &seq_lens,
                       const at::Tensor &reqs, int64_t max_seq_len, int64_t path, int64_t window,
                       double softcap, double k_scale, double v_scale) {
    TORCH_CHECK_VALUE(path >= KILN_PREFILL_BEST && path <= KILN_PREFILL_PORTABLE,
                      "prefill_attention: path ", path, " is not 0 (best), 1 (avx512) or 2 "
                      "(portable)");
    const KilnKvCache cache = for_query(scaled_cache(kv_cache, k_scale, v_scale),
                                        q.scalar_type(), "prefill_attention");
    const StepPlan plan = prefill_plan(block_table, query_start_loc, seq_lens, reqs,
                                       max_seq_len, cache.block_size, "prefill_attention");
    run_prefill(q, out, cache, plan.args, scale, window, softcap, path);
}

bool prefill_attention_simd(at::ScalarType dtype, int64_t head_size) {
    return kiln_prefill_attention_simd(kiln::dtype_code(dtype), static_cast<int32_t>(head_size));
}

/* dtype: the cache's (bfloat16 queries over an fp8 cache take them too) */
bool paged_attention_bf16_dot(at::ScalarType dtype, int64_t head_size) {
    return kiln_paged_attention_bf16_dot(cache_code(dtype), static_cast<int32_t>(head_size));
}

/* The threads a KV cache write of num_tokens rows of row_bytes takes (kv_cache_write.c). */
int64_t kv_cache_write_threads(int64_t num_tokens, int64_t row_bytes, int64_t num_threads) {
    return kiln_kv_cache_write_threads(num_tokens, row_bytes, static_cast<int32_t>(num_threads));
}

int64_t kv_cache_parallel_writes() { return kiln_kv_cache_parallel_writes(); }

bool prefill_attention_amx(at::ScalarType dtype, int64_t head_size) {
    return kiln_prefill_attention_amx(kiln::dtype_code(dtype), static_cast<int32_t>(head_size));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) {
    m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor kv_cache, "
          "float scale, Tensor block_table, Tensor query_start_loc, Tensor seq_lens, "
          "Tensor reqs, Tensor slot_mapping, int num_tokens, int max_seq_len, int window=0, "
          "float softcap=0., float k_scale=1., float v_scale=1.) -> ()");
    m.def("prefill_attention(Tensor q, Tensor(a!) out, Tensor kv_cache, float scale, "
          "Tensor block_table, Tensor query_start_loc, Tensor seq_lens, Tensor reqs, "
          "int max_seq_len, int path=0, int window=0, float softcap=0., float k_scale=1., "
          "float v_scale=1.) -> ()");
    m.def("paged_attention_bf16_dot(ScalarType dtype, int head_size) -> bool",
          &paged_attention_bf16_dot);
    m.def("kv_cache_write_threads(int num_tokens, int row_bytes, int num_threads) -> int",
          &kv_cache_write_threads);
    m.def("kv_cache_parallel_writes() -> int", &kv_cache_parallel_writes);
    m.def("prefill_attention_simd(ScalarType dtype, int head_size) -> bool",
          &prefill_attention_simd);
    m.def("prefill_attention_amx(ScalarType dtype, int head_size) -> bool",
          &prefill_attention_amx);
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
    m.impl("paged_attention", &paged_attention);
    m.impl("prefill_attention", &prefill_attention);
}
