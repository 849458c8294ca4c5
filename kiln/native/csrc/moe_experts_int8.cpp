/* The CPU kernel of the W8A8 int8 MoE IR ops' experts (`kiln::fused_experts_int8_native`), the
 * int8 counterpart of moe_experts.cpp: one call per layer takes the routing (topk_weights,
 * topk_ids [T, k]) and the int8 experts, packed at load into VNNI panels (`panels`: w13 uint8
 * [E, ceil(2I / 64), H / 4, 64, 4], w2 uint8 [E, ceil(H / 64), I / 4, 64, 4]) or as stored (w13
 * int8 [E, 2I, H], w2 int8 [E, H, I]), with float32 scales per expert and channel (w13_scale
 * [E, 2I], w2_scale [E, H]). Each token's row is quantized once (per-token quant treats each row
 * alone, so its expert copies hold what the reference's quant of them holds), grouped by expert,
 * each routed expert runs the dense int8 MLP's kernels on its rows (panels: gate_up GEMM +
 * SiLU-and-mul + quant in one, the down GEMM; as stored: ops_int8.cpp's ops), and each token's
 * k outputs are summed in float32 in the reference's order (moe_slots.h): bit for bit the
 * reference's result, as the dense int8 MLP's ops are (a row's int32 sums are exact and do not
 * depend on which rows share its call, nor on the threads).
 *
 * Experts of up to SIDE_BY_SIDE_ROWS rows (a decode's) run side by side on the threads, each
 * single-threaded, when there are enough of them: their GEMMs are too small to split. */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <vector>

#include "moe_slots.h"
#include "ops_int8.h"
#include "torch_ops.h"

namespace {

/* Up to this many rows an expert runs on one thread beside the others (below AMX's 12 rows:
 * the VNNI kernel, which splits a few rows' GEMM by channels otherwise). */
constexpr int64_t SIDE_BY_SIDE_ROWS = 4;
constexpr int32_t NO_BIAS = -1;

/* Calls so far (process-wide), for tests to see that one call ran a layer. */
std::atomic<int64_t> calls{0};

int64_t call_count() { return calls.load(); }

void check(int rc, const char *fn) {
    TORCH_CHECK(rc != 4, fn, ": the int8 kernels were built for a CPU without AVX512-VNNI");
    kiln::check_rc(rc, fn);
}

/* Each expert's rows in the gathered buffers: [start, start + n). */
struct Group {
    int64_t expert, start, n;
};

/* The buffers every expert's rows live in, row r of each one slot's. */
struct Rows {
    const int8_t *q;   /* [rows, H]: the tokens' quantized rows */
    const float *s;    /* [rows] their scales */
    int8_t *act;       /* [rows, I]: the quantized SiLU-and-mul (panels only) */
    float *act_s;      /* [rows] */
    char *ys;          /* [rows, H] in x's dtype: each expert's output */
};

/* One expert on the panels: gate_up GEMM + SiLU-and-mul + quant, down GEMM. */
void run_panels(const Group &g, const Rows &r, const at::Tensor &w13, const float *w13_scale,
                const at::Tensor &w2, const float *w2_scale, int64_t h, int64_t inter,
                int32_t dtype, size_t es, int32_t nthreads) {
    const uint8_t *p13 = w13.data_ptr<uint8_t>() + g.expert * w13.stride(0);
    const uint8_t *p2 = w2.data_ptr<uint8_t>() + g.expert * w2.stride(0);
    check(kiln_int8_gemm_silu_quant(r.q + g.start * h, h, r.s + g.start, p13,
                                    w13_scale + g.expert * 2 * inter, nullptr, NO_BIAS,
                                    r.act + g.start * inter, r.act_s + g.start, g.n, 2 * inter, h,
                                    dtype, nthreads),
          "kiln::fused_experts_int8 (gate_up + silu_and_mul + quant)");
    check(kiln_int8_gemm_packed(r.act + g.start * inter, inter, r.act_s + g.start, p2,
                                w2_scale + g.expert * h, nullptr, NO_BIAS, r.ys + g.start * h * es,
                                h, g.n, h, inter, dtype, nthreads),
          "kiln::fused_experts_int8 (down)");
}

/* One expert stored as int8 [N, K]: the dense int8 ops, on the kernel its row count takes. */
void run_stored(const Group &g, const at::Tensor &qs, const at::Tensor &ss, const at::Tensor &ys,
                const at::Tensor &w13, const at::Tensor &w13_scale, const at::Tensor &w2,
                const at::Tensor &w2_scale, at::ScalarType dtype) {
    const at::Tensor gate_up = kiln::int8_scaled_mm(qs.narrow(0, g.start, g.n),
                                                    ss.narrow(0, g.start, g.n), w13[g.expert],
                                                    w13_scale[g.expert], std::nullopt, dtype);
    const auto [act, act_s] = kiln::silu_and_mul_quant(gate_up);
    const at::Tensor y = kiln::int8_scaled_mm(act, act_s, w2[g.expert], w2_scale[g.expert],
                                              std::nullopt, dtype);  // [n, H]
    std::memcpy(static_cast<char *>(ys.data_ptr()) + g.start * y.size(1) * y.element_size(),
                y.data_ptr(), y.numel() * y.element_size());
}

/* The experts' [E, N, K] sizes (N: the scale's channels) checked against x and each other. */
void check_shapes(const at::Tensor &x, const at::Tensor &w13, const at::Tensor &w13_scale,
                  const at::Tensor &w2, const at::Tensor &w2_scale, bool panels, const char *op) {
    const int64_t h = x.size(1), experts = w13.size(0), two_i = w13_scale.size(-1);
    const int64_t inter = two_i / 2;
    bool fits = w13_scale.dim() == 2 && w2_scale.dim() == 2 && w13_scale.size(0) == experts &&
                w2.size(0) == experts && w2_scale.size(0) == experts && w2_scale.size(1) == h &&
                two_i % 2 == 0;
    if (panels) {
        fits = fits && w13.dim() == 5 && w2.dim() == 5 && w13.scalar_type() == at::kByte &&
               w2.scalar_type() == at::kByte && h % 4 == 0 && inter % 4 == 0 &&
               w13.sizes().equals({experts, (two_i + 63) / 64, h / 4, 64, 4}) &&
               w2.sizes().equals({experts, (h + 63) / 64, inter / 4, 64, 4});
    } else {
        fits = fits && w13.dim() == 3 && w2.dim() == 3 && w13.scalar_type() == at::kChar &&
               w2.scalar_type() == at::kChar && w13.sizes().equals({experts, two_i, h}) &&
               w2.sizes().equals({experts, h, inter});
    }
    TORCH_CHECK_VALUE(fits, op, ": x ", x.sizes(), ", w13 ", w13.sizes(), " (", w13.scalar_type(),
                      "), w13_scale ", w13_scale.sizes(), ", w2 ", w2.sizes(), " (",
                      w2.scalar_type(), ") and w2_scale ", w2_scale.sizes(), " do not fit (",
                      panels ? "panels: uint8 [E, ceil(N / 64), K / 4, 64, 4]"
                             : "as stored: int8 [E, N, K]",
                      ", w13 N = 2I, K = H; w2 N = H, K = I)");
}

/* The panels contiguous and 64-byte aligned for the kernels' aligned loads (each expert's then
 * is: its bytes are a multiple of 256). */
at::Tensor aligned_panels(const at::Tensor &w) {
    if (w.is_contiguous() && reinterpret_cast<uintptr_t>(w.data_ptr()) % 64 == 0) return w;
    at::Tensor copy = w.clone(at::MemoryFormat::Contiguous);
    TORCH_CHECK(reinterpret_cast<uintptr_t>(copy.data_ptr()) % 64 == 0,
                "kiln::fused_experts_int8_native: could not align the panels to 64 bytes");
    return copy;
}

at::Tensor fused_experts_int8(const at::Tensor &x_in, const at::Tensor &topk_weights_in,
                              const at::Tensor &topk_ids_in, const at::Tensor &w13_in,
                              const at::Tensor &w13_scale_in, const at::Tensor &w2_in,
                              const at::Tensor &w2_scale_in, bool panels) {
    const char *op = "kiln::fused_experts_int8_native";
    calls.fetch_add(1, std::memory_order_relaxed);
    const int32_t dtype = kiln::kernel_dtype(x_in, op);
    TORCH_CHECK_VALUE(x_in.dim() == 2 && topk_ids_in.dim() == 2 &&
                          topk_weights_in.sizes() == topk_ids_in.sizes() &&
                          topk_ids_in.size(0) == x_in.size(0),
                      op, ": x [T, H] ", x_in.sizes(), " and topk_weights / topk_ids [T, k] ",
                      topk_weights_in.sizes(), " / ", topk_ids_in.sizes(), " do not fit");
    check_shapes(x_in, w13_in, w13_scale_in, w2_in, w2_scale_in, panels, op);
    const at::Tensor x = x_in.contiguous();
    const at::Tensor w13 = panels ? aligned_panels(w13_in) : w13_in.contiguous();
    const at::Tensor w2 = panels ? aligned_panels(w2_in) : w2_in.contiguous();
    const at::Tensor w13_scale = kiln::contiguous_as(w13_scale_in, at::kFloat);
    const at::Tensor w2_scale = kiln::contiguous_as(w2_scale_in, at::kFloat);
    const at::Tensor weights = kiln::contiguous_as(topk_weights_in, at::kFloat);
    const at::Tensor ids = kiln::contiguous_as(topk_ids_in, at::kLong);
    const int64_t tokens = x.size(0), h = x.size(1), k = ids.size(1), experts = w13.size(0);
    const int64_t inter = w13_scale.size(1) / 2, slots = tokens * k;
    at::Tensor out = at::empty({tokens, h}, x.options());
    if (tokens == 0 || h == 0) return out;
    const int64_t *id = ids.data_ptr<int64_t>();
    const std::vector<int64_t> counts = kiln::moe::expert_counts(id, slots, experts, op);
    std::vector<Group> groups;
    std::vector<int64_t> first_row(experts, 0);
    for (int64_t e = 0, rows = 0; e < experts; ++e) {
        if (counts[e] == 0) continue;  /* no token chose it: never run, its weights never read */
        groups.push_back({e, rows, counts[e]});
        first_row[e] = rows;
        rows += counts[e];
    }
    const std::vector<int64_t> row_of = kiln::moe::slot_rows(id, slots, std::move(first_row));
    const int32_t nthreads = kiln::threads();
    /* each token quantized once, its rows then gathered per expert: [slots, H] and [slots] */
    at::Tensor qx = at::empty({tokens, h}, x.options().dtype(at::kChar));
    at::Tensor sx = at::empty({tokens}, x.options().dtype(at::kFloat));
    check(kiln_dynamic_int8_quant(x.data_ptr(), h, qx.data_ptr<int8_t>(), sx.data_ptr<float>(),
                                  tokens, h, dtype, nthreads),
          "kiln::fused_experts_int8 (quant)");
    at::Tensor qs = at::empty({slots, h}, qx.options()), ss = at::empty({slots}, sx.options());
    kiln::moe::gather_rows(qx.data_ptr(), qs.data_ptr(), h, row_of, k);
    kiln::moe::gather_rows(sx.data_ptr(), ss.data_ptr(), sizeof(float), row_of, k);
    at::Tensor ys = at::empty({slots, h}, x.options());
    if (panels) {
        at::Tensor act = at::empty({slots, inter}, qx.options());
        at::Tensor act_s = at::empty({slots}, sx.options());
        const Rows r{qs.data_ptr<int8_t>(), ss.data_ptr<float>(), act.data_ptr<int8_t>(),
                     act_s.data_ptr<float>(), static_cast<char *>(ys.data_ptr())};
        const float *s13 = w13_scale.data_ptr<float>(), *s2 = w2_scale.data_ptr<float>();
        const size_t es = x.element_size();
        std::vector<Group> small, large;
        for (const Group &g : groups) (g.n <= SIDE_BY_SIDE_ROWS ? small : large).push_back(g);
        if (static_cast<int64_t>(small.size()) >= nthreads && nthreads > 1) {
            at::parallel_for(0, static_cast<int64_t>(small.size()), 1, [&](int64_t a, int64_t b) {
                for (int64_t i = a; i < b; ++i)
                    run_panels(small[i], r, w13, s13, w2, s2, h, inter, dtype, es, 1);
            });
        } else {
            for (const Group &g : small)
                run_panels(g, r, w13, s13, w2, s2, h, inter, dtype, es, nthreads);
        }
        for (const Group &g : large)
            run_panels(g, r, w13, s13, w2, s2, h, inter, dtype, es, nthreads);
    } else {
        for (const Group &g : groups)
            run_stored(g, qs, ss, ys, w13, w13_scale, w2, w2_scale, x.scalar_type());
    }
    kiln::moe::weighted_sum(id, weights.data_ptr<float>(), row_of, tokens, k, h, ys.data_ptr(),
                            out.data_ptr(), dtype);
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) {
    m.def("fused_experts_int8_native(Tensor x, Tensor topk_weights, Tensor topk_ids, "
          "Tensor w13, Tensor w13_scale, Tensor w2, Tensor w2_scale, bool panels) -> Tensor");
    m.def("fused_experts_int8_calls() -> int", &call_count);
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("fused_experts_int8_native", &fused_experts_int8); }
