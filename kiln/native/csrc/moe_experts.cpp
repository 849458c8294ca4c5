/* The CPU kernel of the float IR op fused_moe's experts (`kiln::fused_experts_native`): one call per
 * MoE layer takes the routing (topk_weights, topk_ids [T, k]) and the stacked experts as stored
 * (w13 [E, 2I, H], w2 [E, H, I]), groups the tokens by expert once (a counting sort), gathers each
 * expert's rows, runs gate_up -> SiLU-and-mul -> down, and sums each token's k outputs by their
 * weights in float32 (in ascending expert order, as the reference's index_add_), rounded once.
 *
 * In bfloat16 where the CPU grants AMX tiles, every expert runs on bf16_amx_gemm.c's tile GEMM
 * over the weight as stored, from one row up (it streams the weight at least as fast as the
 * GEMV kernel: docs/measurements.md). Otherwise, where built with AVX-512, an expert of up to
 * rows_max rows runs on rows_gemm.c's multi-row kernel (AVX512-BF16 dot products, or FMA), else
 * one of up to GEMV_ROWS rows on the GEMV kernel; experts of up to GEMV_ROWS rows (a decode's)
 * side by side on the threads (each single-threaded) when there are enough of them; more rows
 * take aten's matmul (oneDNN / MKL, threaded), the row count rounded up as linear_op.cpp's
 * gemm_rows does (bounds oneDNN's primitive cache). No packed copy of the experts is read or needed
 * (kiln/model/layers/moe_cpu.py). */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "dtype.h"
#include "moe_slots.h"
#include "torch_ops.h"

namespace {

/* Up to this many rows an expert's GEMMs are the GEMV kernel's (csrc/gemv.c takes up to 4; a
 * MoE's few rows a step are its common case, where streaming the weight once is the cost), and
 * an expert of this many rows or fewer runs beside the others, each on one thread. */
constexpr int64_t GEMV_ROWS = 4;

/* Up to this many rows an expert's GEMMs are rows_gemm.c's where this build has that kernel for
 * the dtype (rows_isa: kiln_rows_gemm_isa), from one row (it streams the weight faster than the
 * GEMV kernel), more rows aten's: bfloat16 on AVX512-BF16 dot products up to 4 (oneDNN's
 * AVX512-BF16 GEMM faster from 5 rows an expert on a Zen 4); bfloat16 widened to float32
 * (AVX-512F without BF16) at every row count (oneDNN converts there too, and is slower at every
 * size); float32 up to 16 (MKL's SGEMM faster above). Measured: docs/measurements.md. */
int64_t rows_max(int64_t dtype, int64_t rows_isa) {
    if (rows_isa == KILN_ROWS_BF16_DOT) return 4;
    if (rows_isa == KILN_ROWS_AVX512F) return dtype == KILN_F32 ? 16 : INT64_MAX;
    return 0;
}

/* Which kernel runs an expert's GEMMs: `choose_route` (rows_isa: kiln_rows_gemm_isa(dtype)). */
enum Route { ROUTE_GEMV, ROUTE_TILES, ROUTE_ATEN, ROUTE_ROWS, NUM_ROUTES };

int64_t choose_route(int64_t rows, int64_t dtype, bool tiles, int64_t rows_isa) {
    if (dtype == KILN_BF16 && tiles) return ROUTE_TILES;
    if (rows <= rows_max(dtype, rows_isa)) return ROUTE_ROWS;
    return rows <= GEMV_ROWS ? ROUTE_GEMV : ROUTE_ATEN;
}

/* linear_op.cpp's gemm_rows: rows itself up to 32, above that one of 8 steps per power of two. */
int64_t gemm_rows(int64_t rows) {
    if (rows <= 32) return rows;
    const int64_t step = int64_t(1) << (63 - __builtin_clzll(static_cast<uint64_t>(rows)) - 3);
    return (rows + step - 1) / step * step;
}

/* Calls so far and experts run by route (process-wide), for tests to see which kernel ran. */
std::atomic<int64_t> calls{0}, route_calls[NUM_ROUTES];

int64_t call_count() { return calls.load(); }

std::vector<int64_t> route_counts() {
    std::vector<int64_t> counts;
    for (auto &c : route_calls) counts.push_back(c.load());
    return counts;
}

bool tiles_ready() { return kiln_bf16_amx_gemm_ready() != 0; }

int64_t rows_isa(int64_t dtype) { return kiln_rows_gemm_isa(static_cast<int32_t>(dtype)); }

/* x [m, k] @ w [n, k]^T on rows_gemm.c alone (tests: the kernel of this build's tier against
 * torch's matmul at any size). */
at::Tensor rows_gemm(const at::Tensor &x_in, const at::Tensor &w_in) {
    const char *op = "kiln::rows_gemm_native";
    const int32_t dtype = kiln::kernel_dtype(x_in, op);
    TORCH_CHECK_VALUE(x_in.dim() == 2 && w_in.dim() == 2 && w_in.size(1) == x_in.size(1) &&
                          w_in.scalar_type() == x_in.scalar_type(),
                      op, ": x [m, k] ", x_in.sizes(), " and w [n, k] ", w_in.sizes(),
                      " must share k and dtype");
    const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
    at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
    if (out.numel() == 0) return out;
    TORCH_CHECK(x.size(1) > 0 && kiln_rows_gemm_isa(dtype) != KILN_ROWS_NONE, op,
                ": k 0, or this build has no rows kernel for the dtype (no AVX-512)");
    kiln::check_rc(kiln_rows_gemm(x.data_ptr(), w.data_ptr(), out.data_ptr(), w.size(0),
                                  x.size(0), w.size(0), x.size(1), dtype, kiln::threads()),
                   op);
    return out;
}

/* Each expert's rows in the gathered buffers: [start, start + padded), n of them real. */
struct Group {
    int64_t expert, start, n, padded;
    int route;
};

/* One expert's MLP on its gathered rows xs [padded, H] -> ys [padded, H], through gu [padded, 2I]
 * and act [padded, I]; `nthreads` for its kernels (1 inside a parallel region). */
void run_expert(const Group &g, const at::Tensor &xs, const at::Tensor &gu, const at::Tensor &act,
                const at::Tensor &ys, const at::Tensor &w13, const at::Tensor &w2, int32_t dtype,
                int32_t nthreads) {
    const int64_t h = w13.size(2), two_i = w13.size(1), inter = w2.size(2);
    const at::Tensor x = xs.narrow(0, g.start, g.padded), a = act.narrow(0, g.start, g.padded);
    const at::Tensor u = gu.narrow(0, g.start, g.padded), y = ys.narrow(0, g.start, g.padded);
    route_calls[g.route].fetch_add(1, std::memory_order_relaxed);
    if (g.route == ROUTE_TILES) {
        kiln::check_rc(kiln_bf16_amx_gemm(x.data_ptr(), w13[g.expert].data_ptr(), u.data_ptr(),
                                          two_i, g.padded, two_i, h, nthreads),
                       "kiln::fused_experts (gate_up tiles)");
        kiln::check_rc(kiln_silu_and_mul(u.data_ptr(), two_i, a.data_ptr(), g.padded,
                                         static_cast<int32_t>(inter), dtype, nthreads),
                       "kiln::fused_experts (silu_and_mul)");
        kiln::check_rc(kiln_bf16_amx_gemm(a.data_ptr(), w2[g.expert].data_ptr(), y.data_ptr(), h,
                                          g.padded, h, inter, nthreads),
                       "kiln::fused_experts (down tiles)");
        return;
    }
    if (g.route == ROUTE_ROWS) {
        kiln::check_rc(kiln_rows_gemm(x.data_ptr(), w13[g.expert].data_ptr(), u.data_ptr(), two_i,
                                      g.padded, two_i, h, dtype, nthreads),
                       "kiln::fused_experts (gate_up rows)");
        kiln::check_rc(kiln_silu_and_mul(u.data_ptr(), two_i, a.data_ptr(), g.padded,
                                         static_cast<int32_t>(inter), dtype, nthreads),
                       "kiln::fused_experts (silu_and_mul)");
        kiln::check_rc(kiln_rows_gemm(a.data_ptr(), w2[g.expert].data_ptr(), y.data_ptr(), h,
                                      g.padded, h, inter, dtype, nthreads),
                       "kiln::fused_experts (down rows)");
        return;
    }
    if (g.route == ROUTE_GEMV) {
        const int32_t m = static_cast<int32_t>(g.padded);
        kiln::check_rc(kiln_gemv(x.data_ptr(), w13[g.expert].data_ptr(), nullptr, u.data_ptr(), m,
                                 two_i, h, dtype, nthreads), "kiln::fused_experts (gate_up)");
        kiln::check_rc(kiln_silu_and_mul(u.data_ptr(), two_i, a.data_ptr(), m,
                                         static_cast<int32_t>(inter), dtype, nthreads),
                       "kiln::fused_experts (silu_and_mul)");
        kiln::check_rc(kiln_gemv(a.data_ptr(), w2[g.expert].data_ptr(), nullptr, y.data_ptr(), m,
                                 h, inter, dtype, nthreads), "kiln::fused_experts (down)");
        return;
    }
    at::mm_out(const_cast<at::Tensor &>(u), x, w13[g.expert].t());
    kiln::check_rc(kiln_silu_and_mul(u.data_ptr(), two_i, a.data_ptr(), g.padded,
                                     static_cast<int32_t>(inter), dtype, nthreads),
                   "kiln::fused_experts (silu_and_mul)");
    at::mm_out(const_cast<at::Tensor &>(y), a, w2[g.expert].t());
}

at::Tensor fused_experts(const at::Tensor &x_in, const at::Tensor &topk_weights_in,
                         const at::Tensor &topk_ids_in, const at::Tensor &w13_in,
                         const at::Tensor &w2_in) {
    const char *op = "kiln::fused_experts_native";
    calls.fetch_add(1, std::memory_order_relaxed);
    const int32_t dtype = kiln::kernel_dtype(x_in, op);
    TORCH_CHECK_VALUE(x_in.dim() == 2 && w13_in.dim() == 3 && w2_in.dim() == 3 &&
                          topk_ids_in.dim() == 2 && topk_weights_in.sizes() == topk_ids_in.sizes() &&
                          topk_ids_in.size(0) == x_in.size(0) && w13_in.size(2) == x_in.size(1) &&
                          w13_in.size(1) == 2 * w2_in.size(2) && w2_in.size(1) == x_in.size(1) &&
                          w13_in.size(0) == w2_in.size(0),
                      op, ": x [T, H] ", x_in.sizes(), ", topk_weights / topk_ids [T, k] ",
                      topk_weights_in.sizes(), " / ", topk_ids_in.sizes(), ", w13 [E, 2I, H] ",
                      w13_in.sizes(), " and w2 [E, H, I] ", w2_in.sizes(), " do not fit");
    TORCH_CHECK_TYPE(w13_in.scalar_type() == x_in.scalar_type() &&
                         w2_in.scalar_type() == x_in.scalar_type(),
                     op, ": the experts (", w13_in.scalar_type(), ", ", w2_in.scalar_type(),
                     ") must be in x's dtype ", x_in.scalar_type());
    const at::Tensor x = x_in.contiguous(), w13 = w13_in.contiguous(), w2 = w2_in.contiguous();
    const at::Tensor weights = kiln::contiguous_as(topk_weights_in, at::kFloat);
    const at::Tensor ids = kiln::contiguous_as(topk_ids_in, at::kLong);
    const int64_t tokens = x.size(0), h = x.size(1), k = ids.size(1), experts = w13.size(0);
    const int64_t slots = tokens * k;
    at::Tensor out = at::empty({tokens, h}, x.options());
    if (tokens == 0 || h == 0) return out;
    const int64_t *id = ids.data_ptr<int64_t>();
    const std::vector<int64_t> counts = kiln::moe::expert_counts(id, slots, experts, op);
    /* each chosen expert's rows, padded where aten's GEMM takes them */
    std::vector<Group> groups;
    int64_t rows = 0;
    const bool tiles = dtype == KILN_BF16 && tiles_ready();
    const int64_t isa = rows_isa(dtype);
    for (int64_t e = 0; e < experts; ++e) {
        if (counts[e] == 0) continue;  /* no token chose it: never run, its weights never read */
        const int route = static_cast<int>(choose_route(counts[e], dtype, tiles, isa));
        const int64_t padded = route == ROUTE_ATEN ? gemm_rows(counts[e]) : counts[e];
        groups.push_back({e, rows, counts[e], padded, route});
        rows += padded;
    }
    /* slot s (token s / k's choice s % k) -> its row; slots in ascending order within an expert */
    std::vector<int64_t> first_row(experts, 0);
    for (const Group &g : groups) first_row[g.expert] = g.start;
    const std::vector<int64_t> row_of = kiln::moe::slot_rows(id, slots, std::move(first_row));
    const int64_t two_i = w13.size(1), inter = w2.size(2);
    at::Tensor xs = at::empty({rows, h}, x.options());  // [rows, H]: each expert's tokens
    at::Tensor gu = at::empty({rows, two_i}, x.options());
    at::Tensor act = at::empty({rows, inter}, x.options());
    at::Tensor ys = at::empty({rows, h}, x.options());
    kiln::moe::gather_rows(x.data_ptr(), xs.data_ptr(), h * x.element_size(), row_of, k);
    for (const Group &g : groups)  /* the padding rows: zeros, whose outputs nothing reads */
        if (g.padded > g.n) xs.narrow(0, g.start + g.n, g.padded - g.n).zero_();
    std::vector<Group> small, large;
    for (const Group &g : groups)
        (g.route != ROUTE_TILES && g.n <= GEMV_ROWS ? small : large).push_back(g);
    const int32_t nthreads = kiln::threads();
    if (static_cast<int64_t>(small.size()) >= nthreads && nthreads > 1) {
        /* a decode's experts: side by side, each kernel on one thread */
        at::parallel_for(0, static_cast<int64_t>(small.size()), 1, [&](int64_t a, int64_t b) {
            for (int64_t i = a; i < b; ++i) run_expert(small[i], xs, gu, act, ys, w13, w2, dtype, 1);
        });
    } else {
        for (const Group &g : small) run_expert(g, xs, gu, act, ys, w13, w2, dtype, nthreads);
    }
    for (const Group &g : large) run_expert(g, xs, gu, act, ys, w13, w2, dtype, nthreads);
    /* the weighted sum per token, in float32, its slots in ascending expert order */
    kiln::moe::weighted_sum(id, weights.data_ptr<float>(), row_of, tokens, k, h, ys.data_ptr(),
                            out.data_ptr(), dtype);
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) {
    m.def("fused_experts_native(Tensor x, Tensor topk_weights, Tensor topk_ids, Tensor w13, "
          "Tensor w2) -> Tensor");
    m.def("fused_experts_calls() -> int", &call_count);
    m.def("fused_experts_route_counts() -> int[]", &route_counts);
    m.def("fused_experts_route(int rows, int dtype, bool tiles, int rows_isa) -> int",
          &choose_route);
    m.def("fused_experts_rows_isa(int dtype) -> int", &rows_isa);
    m.def("rows_gemm_native(Tensor x, Tensor w) -> Tensor");
    m.def("fused_experts_tiles() -> bool", &tiles_ready);
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
    m.impl("fused_experts_native", &fused_experts);
    m.impl("rows_gemm_native", &rows_gemm);
}
