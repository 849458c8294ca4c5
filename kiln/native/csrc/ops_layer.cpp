/* The `native` implementations of the IR's per-layer ops (kiln/ir/layer_ops.py defines what each
 * computes): RMSNorm with and without the residual add, SiLU-and-mul and rotary (neox and gpt-j
 * layouts), as torch ops over layer_ops.c's kernels. A decode step calls these ~100 times: from Python the
 * dispatcher reaches them directly, with no Python between it and the kernel. */
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <tuple>

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
    at::Tensor out = at::empty(x.sizes(), x.options());
    kiln::check_rc(kiln_rms_norm(rows.data_ptr(), rows.stride(0), nullptr, 0, nullptr,
                                 w.data_ptr(), out.data_ptr(), hidden, rows.size(0),
                                 static_cast<int32_t>(hidden), static_cast<float>(eps), dtype,
                                 kiln::threads()),
                   "kiln_rms_norm");
    return out;
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor &x,
                                                      const at::Tensor &residual,
                                                      const at::Tensor &weight, double eps) {
    check_norm_args(x, weight, "kiln::fused_add_rms_norm_native");
    TORCH_CHECK_VALUE(residual.sizes().equals(x.sizes()),
                      "kiln::fused_add_rms_norm_native: residual shape ", residual.sizes(),
                      " != x shape ", x.sizes());
    TORCH_CHECK_TYPE(residual.scalar_type() == x.scalar_type(),
                     "kiln::fused_add_rms_norm_native: residual ", residual.scalar_type(),
                     " and x ", x.scalar_type(), " differ");
    const int32_t dtype = kiln::kernel_dtype(x, "kiln::fused_add_rms_norm_native");
    const at::Tensor rows = rows_of(x), res = rows_of(residual), w = weight.contiguous();
    const int64_t hidden = rows.size(1);
    at::Tensor out = at::empty(x.sizes(), x.options());
    at::Tensor total = at::empty(x.sizes(), x.options());
    kiln::check_rc(kiln_rms_norm(rows.data_ptr(), rows.stride(0), res.data_ptr(), res.stride(0),
                                 total.data_ptr(), w.data_ptr(), out.data_ptr(), hidden,
                                 rows.size(0), static_cast<int32_t>(hidden),
                                 static_cast<float>(eps), dtype, kiln::threads()),
                   "kiln_rms_norm");
    return {out, total};
}

at::Tensor silu_and_mul(const at::Tensor &x) {
    const int32_t dtype = kiln::kernel_dtype(x, "kiln::silu_and_mul_native");
    TORCH_CHECK_VALUE(x.size(-1) % 2 == 0, "kiln::silu_and_mul_native: the last dimension (",
                      x.size(-1), ") must be even [gate | up]");
    const at::Tensor rows = rows_of(x);
    const int64_t d = rows.size(1) / 2;
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = d;
    at::Tensor out = at::empty(shape, x.options());
    kiln::check_rc(kiln_silu_and_mul(rows.data_ptr(), rows.stride(0), out.data_ptr(),
                                     rows.size(0), static_cast<int32_t>(d), dtype,
                                     kiln::threads()),
                   "kiln_silu_and_mul");
    return out;
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor &positions, const at::Tensor &q,
                                          const at::Tensor &k, const at::Tensor &cos_sin_cache,
                                          int64_t head_size, bool is_neox) {
    TORCH_CHECK_VALUE(head_size > 0 && head_size % 2 == 0,
                      "kiln::rotary_embedding_native: head_size must be even, got ", head_size);
    TORCH_CHECK_VALUE(q.dim() == 2 && k.dim() == 2 && q.scalar_type() == k.scalar_type() &&
                          q.size(0) == k.size(0) && q.size(1) % head_size == 0 &&
                          k.size(1) % head_size == 0,
                      "kiln::rotary_embedding_native: q ", q.sizes(), " and k ", k.sizes(),
                      " must be [T, heads * ", head_size, "] of one dtype");
    const int32_t dtype = kiln::kernel_dtype(q, "kiln::rotary_embedding_native");
    const at::Tensor qr = rows_of(q), kr = rows_of(k);
    const at::Tensor pos = positions.to(at::kLong).contiguous();
    const at::Tensor cache = cos_sin_cache.to(at::kFloat).contiguous();
    TORCH_CHECK_VALUE(pos.numel() == q.size(0) && cache.dim() == 2 && cache.size(1) == head_size,
                      "kiln::rotary_embedding_native: ", pos.numel(), " positions for ",
                      q.size(0), " tokens, cos_sin_cache ", cache.sizes());
    at::Tensor q_out = at::empty(qr.sizes(), q.options());
    at::Tensor k_out = at::empty(kr.sizes(), k.options());
    const int rc = kiln_rotary(pos.data_ptr<int64_t>(), qr.data_ptr(), qr.stride(0),
                               kr.data_ptr(), kr.stride(0), q_out.data_ptr(), k_out.data_ptr(),
                               cache.data_ptr<float>(), cache.size(0), qr.size(0),
                               static_cast<int32_t>(qr.size(1) / head_size),
                               static_cast<int32_t>(kr.size(1) / head_size),
                               static_cast<int32_t>(head_size), is_neox ? 1 : 0, dtype,
                               kiln::threads());
    TORCH_CHECK_INDEX(rc != 1, "kiln::rotary_embedding_native: a position is outside [0, ",
                      cache.size(0), ") (the rope cache's max_position_embeddings)");
    kiln::check_rc(rc, "kiln_rotary");
    return {q_out, k_out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) {
    m.def("rms_norm_native(Tensor x, Tensor weight, float eps) -> Tensor");
    m.def("fused_add_rms_norm_native(Tensor x, Tensor residual, Tensor weight, float eps) -> "
          "(Tensor, Tensor)");
    m.def("silu_and_mul_native(Tensor x) -> Tensor");
    m.def("rotary_embedding_native(Tensor positions, Tensor q, Tensor k, Tensor cos_sin_cache, "
          "int head_size, bool is_neox) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
    m.impl("rms_norm_native", &rms_norm);
    m.impl("fused_add_rms_norm_native", &fused_add_rms_norm);
    m.impl("silu_and_mul_native", &silu_and_mul);
    m.impl("rotary_embedding_native", &rotary);
}
