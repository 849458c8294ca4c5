/* The `native` implementations of the IR's per-layer ops (kiln/ir/layer_ops.py defines what each
 * computes): RMSNorm with and without the residual add, SiLU-and-mul and rotary (neox and gpt-j
 * layouts), as torch ops over layer_ops.c's and rotary.c's kernels, plus in-place forms of the
 * residual-add norm and rotary for compiled graphs whose inputs are theirs to overwrite
 * (kiln/compilation/passes/reinplace_ir_ops.py). A decode step calls these ~100 times: the
 * wrappers make no dispatcher call a tensor already in the kernel's layout does not need. */
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "torch_ops.h"

namespace {

using kiln::rows_of;

void check_norm_args(const at::Tensor &x, const at::Tensor &weight, const char *op) {
    /* The kernel reads `hidden` weights a row: a shorter weight it would read past its end. */
    TORCH_CHECK_VALUE(weight.numel() == x.size(-1), op, ": weight has ", weight.numel(),
                      " values for hidden size ", x.size(-1));
    TORCH_CHECK_TYPE(weight.scalar_type() == x.scalar_type(), op, ": weight ",
                     weight.scalar_type(), " and x ", x.scalar_type(), " differ");
}

at::Tensor rms_norm(const at::Tensor &x, const at::Tensor &weight, double eps) {
    check_norm_args(x, weight, "kiln::rms_norm_native");
    const int32_t dtype = kiln::kernel_dtype(x, "kiln::rms_norm_native");
    const at::Tensor rows = rows_of(x), w = weight.contiguous();
    const int64_t hidden = rows.size(1);
    at::Tensor out = kiln::empty_cpu_like(x.sizes(), x);
    kiln::check_rc(kiln_rms_norm(rows.data_ptr(), rows.stride(0), nullptr, 0, nullptr,
                                 w.data_ptr(), out.data_ptr(), hidden, rows.size(0),
                                 static_cast<int32_t>(hidden), static_cast<float>(eps), dtype,
                                 kiln::threads()),
                   "kiln_rms_norm");
    return out;
}

void check_fused_args(const at::Tensor &x, const at::Tensor &residual, const at::Tensor &weight,
                      const char *op) {
    check_norm_args(x, weight, op);
    TORCH_CHECK_VALUE(residual.sizes().equals(x.sizes()), op, ": residual shape ",
                      residual.sizes(), " != x shape ", x.sizes());
    TORCH_CHECK_TYPE(residual.scalar_type() == x.scalar_type(), op, ": residual ",
                     residual.scalar_type(), " and x ", x.scalar_type(), " differ");
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor &x,
                                                      const at::Tensor &residual,
                                                      const at::Tensor &weight, double eps) {
    check_fused_args(x, residual, weight, "kiln::fused_add_rms_norm_native");
    const int32_t dtype = kiln::kernel_dtype(x, "kiln::fused_add_rms_norm_native");
    const at::Tensor rows = rows_of(x), res = rows_of(residual), w = weight.contiguous();
    const int64_t hidden = rows.size(1);
    at::Tensor out = kiln::empty_cpu_like(x.sizes(), x);
    at::Tensor total = kiln::empty_cpu_like(x.sizes(), x);
    kiln::check_rc(kiln_rms_norm(rows.data_ptr(), rows.stride(0), res.data_ptr(), res.stride(0),
                                 total.data_ptr(), w.data_ptr(), out.data_ptr(), hidden,
                                 rows.size(0), static_cast<int32_t>(hidden),
                                 static_cast<float>(eps), dtype, kiln::threads()),
                   "kiln_rms_norm");
    return {out, total};
}

/* In place: residual = x + residual, then x = rms_norm(residual). Both [T, hidden] with
 * contiguous columns, residual's rows contiguous too (the kernel writes the sum in rows of
 * `hidden`); no copy may stand in for them, so any other layout is an error. */
void fused_add_rms_norm_(const at::Tensor &x, const at::Tensor &residual,
                         const at::Tensor &weight, double eps) {
    const char *op = "kiln::fused_add_rms_norm_native_";
    check_fused_args(x, residual, weight, op);
    const int32_t dtype = kiln::kernel_dtype(x, op);
    // one row: its row stride is never read (reinplace_ir_ops takes any there)
    TORCH_CHECK_VALUE(x.dim() == 2 && x.stride(1) == 1 && residual.stride(1) == 1 &&
                          (x.size(0) <= 1 || residual.stride(0) == x.size(1)),
                      op, ": x ", x.sizes(), " (strides ", x.strides(), ") and residual (strides ",
                      residual.strides(), ") must be [T, hidden] rows, residual's contiguous");
    const at::Tensor w = weight.contiguous();
    const int64_t hidden = x.size(1);
    kiln::check_rc(kiln_rms_norm(x.data_ptr(), x.stride(0), residual.data_ptr(), hidden,
                                 residual.data_ptr(), w.data_ptr(), x.data_ptr(), x.stride(0),
                                 x.size(0), static_cast<int32_t>(hidden), static_cast<float>(eps),
                                 dtype, kiln::threads()),
                   "kiln_rms_norm");
}

at::Tensor silu_and_mul(const at::Tensor &x) {
    const int32_t dtype = kiln::kernel_dtype(x, "kiln::silu_and_mul_native");
    TORCH_CHECK_VALUE(x.size(-1) % 2 == 0, "kiln::silu_and_mul_native: the last dimension (",
                      x.size(-1), ") must be even [gate | up]");
    const at::Tensor rows = rows_of(x);
    const int64_t d = rows.size(1) / 2;
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = d;
    at::Tensor out = kiln::empty_cpu_like(shape, x);
    kiln::check_rc(kiln_silu_and_mul(rows.data_ptr(), rows.stride(0), out.data_ptr(),
                                     rows.size(0), static_cast<int32_t>(d), dtype,
                                     kiln::threads()),
                   "kiln_silu_and_mul");
    return out;
}

void check_rotary_args(const at::Tensor &q, const at::Tensor &k, int64_t head_size,
                       const char *op) {
    TORCH_CHECK_VALUE(head_size > 0 && head_size % 2 == 0, op, ": head_size must be even, got ",
                      head_size);
    TORCH_CHECK_VALUE(q.dim() == 2 && k.dim() == 2 && q.scalar_type() == k.scalar_type() &&
                          q.size(0) == k.size(0) && q.size(1) % head_size == 0 &&
                          k.size(1) % head_size == 0,
                      op, ": q ", q.sizes(), " and k ", k.sizes(), " must be [T, heads * ",
                      head_size, "] of one dtype");
}

/* positions as int64 and the cache as float32, both contiguous, checked against q's tokens. */
std::tuple<at::Tensor, at::Tensor> rotary_tables(const at::Tensor &positions,
                                                 const at::Tensor &cos_sin_cache,
                                                 const at::Tensor &q, int64_t head_size,
                                                 const char *op) {
    at::Tensor pos = kiln::contiguous_as(positions, at::kLong);
    at::Tensor cache = kiln::contiguous_as(cos_sin_cache, at::kFloat);
    TORCH_CHECK_VALUE(pos.numel() == q.size(0) && cache.dim() == 2 && cache.size(1) == head_size,
                      op, ": ", pos.numel(), " positions for ", q.size(0),
                      " tokens, cos_sin_cache ", cache.sizes());
    return {pos, cache};
}

void run_rotary(const at::Tensor &pos, const at::Tensor &q, const at::Tensor &k,
                const at::Tensor &q_out, const at::Tensor &k_out, const at::Tensor &cache,
                int64_t head_size, bool is_neox, int32_t dtype, const char *op) {
    const int rc = kiln_rotary(pos.data_ptr<int64_t>(), q.data_ptr(), q.stride(0), k.data_ptr(),
                               k.stride(0), q_out.data_ptr(), q_out.stride(0), k_out.data_ptr(),
                               k_out.stride(0), cache.data_ptr<float>(), cache.size(0),
                               q.size(0), static_cast<int32_t>(q.size(1) / head_size),
                               static_cast<int32_t>(k.size(1) / head_size),
                               static_cast<int32_t>(head_size), is_neox ? 1 : 0, dtype,
                               kiln::threads());
    TORCH_CHECK_INDEX(rc != 1, op, ": a position is outside [0, ", cache.size(0),
                      ") (the rope cache's max_position_embeddings)");
    kiln::check_rc(rc, "kiln_rotary");
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor &positions, const at::Tensor &q,
                                          const at::Tensor &k, const at::Tensor &cos_sin_cache,
                                          int64_t head_size, bool is_neox) {
    const char *op = "kiln::rotary_embedding_native";
    check_rotary_args(q, k, head_size, op);
    const int32_t dtype = kiln::kernel_dtype(q, op);
    const at::Tensor qr = rows_of(q), kr = rows_of(k);
    const auto [pos, cache] = rotary_tables(positions, cos_sin_cache, q, head_size, op);
    at::Tensor q_out = kiln::empty_cpu_like(qr.sizes(), q);
    at::Tensor k_out = kiln::empty_cpu_like(kr.sizes(), k);
    run_rotary(pos, qr, kr, q_out, k_out, cache, head_size, is_neox, dtype, op);
    return {q_out, k_out};
}

/* In place: q and k rotated where they lie ([T, heads * hd] with contiguous columns, any row
 * stride: the q/k column ranges of a QKV projection's output). */
void rotary_(const at::Tensor &positions, const at::Tensor &q, const at::Tensor &k,
             const at::Tensor &cos_sin_cache, int64_t head_size, bool is_neox) {
    const char *op = "kiln::rotary_embedding_native_";
    check_rotary_args(q, k, head_size, op);
    const int32_t dtype = kiln::kernel_dtype(q, op);
    TORCH_CHECK_VALUE(q.stride(1) == 1 && k.stride(1) == 1, op,
                      ": q and k need contiguous columns, got strides ", q.strides(), " and ",
                      k.strides());
    const auto [pos, cache] = rotary_tables(positions, cos_sin_cache, q, head_size, op);
    run_rotary(pos, q, k, q, k, cache, head_size, is_neox, dtype, op);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) {
    m.def("rms_norm_native(Tensor x, Tensor weight, float eps) -> Tensor");
    m.def("fused_add_rms_norm_native(Tensor x, Tensor residual, Tensor weight, float eps) -> "
          "(Tensor, Tensor)");
    m.def("fused_add_rms_norm_native_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, "
          "float eps) -> ()");
    m.def("silu_and_mul_native(Tensor x) -> Tensor");
    m.def("rotary_embedding_native(Tensor positions, Tensor q, Tensor k, Tensor cos_sin_cache, "
          "int head_size, bool is_neox) -> (Tensor, Tensor)");
    m.def("rotary_embedding_native_(Tensor positions, Tensor(a!) q, Tensor(b!) k, "
          "Tensor cos_sin_cache, int head_size, bool is_neox) -> ()");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
    m.impl("rms_norm_native", &rms_norm);
    m.impl("fused_add_rms_norm_native", &fused_add_rms_norm);
    m.impl("fused_add_rms_norm_native_", &fused_add_rms_norm_);
    m.impl("silu_and_mul_native", &silu_and_mul);
    m.impl("rotary_embedding_native", &rotary);
    m.impl("rotary_embedding_native_", &rotary_);
}
