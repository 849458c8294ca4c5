/* The `native` implementations of the LayerNorm families' IR ops (kiln/ir/layer_norm.py,
 * kiln/ir/layer_ops.py's gelu): LayerNorm with or without a bias, and with the residual add
 * before it, and GELU (erf or tanh form), as torch ops over layer_norm.c's kernels. */
#include <ATen/ops/gelu.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

#include "torch_ops.h"

namespace {

using kiln::rows_of;

/* weight (and bias) [hidden] of x's dtype: the kernel reads `hidden` of each. */
void check_layer_norm_args(const at::Tensor &x, const at::Tensor &weight,
                           const std::optional<at::Tensor> &bias, const char *op) {
    TORCH_CHECK_VALUE(x.dim() >= 1 && weight.numel() == x.size(-1), op, ": weight has ",
                      weight.numel(), " values for hidden size ", x.dim() ? x.size(-1) : 0);
    TORCH_CHECK_TYPE(weight.scalar_type() == x.scalar_type(), op, ": weight ",
                     weight.scalar_type(), " and x ", x.scalar_type(), " differ");
    if (bias) {
        TORCH_CHECK_VALUE(bias->numel() == x.size(-1), op, ": bias has ", bias->numel(),
                          " values for hidden size ", x.size(-1));
        TORCH_CHECK_TYPE(bias->scalar_type() == x.scalar_type(), op, ": bias ",
                         bias->scalar_type(), " and x ", x.scalar_type(), " differ");
    }
}

void run_layer_norm(const at::Tensor &rows, const at::Tensor *residual, at::Tensor *total,
                    const at::Tensor &weight, const std::optional<at::Tensor> &bias,
                    at::Tensor &out, double eps, int32_t dtype) {
    const at::Tensor w = weight.contiguous();
    const std::optional<at::Tensor> b = bias ? std::optional<at::Tensor>(bias->contiguous())
                                             : std::nullopt;
    const int64_t hidden = rows.size(1);
    kiln::check_rc(kiln_layer_norm(rows.data_ptr(), rows.stride(0),
                                   residual ? residual->data_ptr() : nullptr,
                                   residual ? residual->stride(0) : 0,
                                   total ? total->data_ptr() : nullptr, w.data_ptr(),
                                   b ? b->data_ptr() : nullptr, out.data_ptr(), hidden,
                                   rows.size(0), static_cast<int32_t>(hidden),
                                   static_cast<float>(eps), dtype, kiln::threads()),
                   "kiln_layer_norm");
}

at::Tensor layer_norm(const at::Tensor &x, const at::Tensor &weight,
                      const std::optional<at::Tensor> &bias, double eps) {
    const char *op = "kiln::layer_norm_native";
    check_layer_norm_args(x, weight, bias, op);
    const int32_t dtype = kiln::kernel_dtype(x, op);
    at::Tensor out = kiln::empty_cpu_like(x.sizes(), x);
    if (x.numel() == 0) return out;
    run_layer_norm(rows_of(x), nullptr, nullptr, weight, bias, out, eps, dtype);
    return out;
}

std::tuple<at::Tensor, at::Tensor> fused_add_layer_norm(const at::Tensor &x,
                                                        const at::Tensor &residual,
                                                        const at::Tensor &weight,
                                                        const std::optional<at::Tensor> &bias,
                                                        double eps) {
    const char *op = "kiln::fused_add_layer_norm_native";
    check_layer_norm_args(x, weight, bias, op);
    TORCH_CHECK_VALUE(residual.sizes().equals(x.sizes()), op, ": residual shape ",
                      residual.sizes(), " != x shape ", x.sizes());
    TORCH_CHECK_TYPE(residual.scalar_type() == x.scalar_type(), op, ": residual ",
                     residual.scalar_type(), " and x ", x.scalar_type(), " differ");
    const int32_t dtype = kiln::kernel_dtype(x, op);
    at::Tensor out = kiln::empty_cpu_like(x.sizes(), x);
    at::Tensor total = kiln::empty_cpu_like(x.sizes(), x);
    if (x.numel() == 0) return {out, total};
    const at::Tensor res = rows_of(residual);
    run_layer_norm(rows_of(x), &res, &total, weight, bias, out, eps, dtype);
    return {out, total};
}

at::Tensor gelu(const at::Tensor &x, c10::string_view approximate) {
    const char *op = "kiln::gelu_native";
    const int32_t dtype = kiln::kernel_dtype(x, op);
    TORCH_CHECK_VALUE(approximate == "none" || approximate == "tanh", op,
                      ": approximate must be 'none' or 'tanh', got '", std::string(approximate),
                      "'");
    /* The erf form is torch's own: its inline vector erf ran 2x the loop over libmvec's erfcf
     * layer_norm.c had (256x8192 float32 and bfloat16, one thread's CPU time); the tanh form
     * is 2.5x faster here than torch's. */
    if (approximate == "none") return at::gelu(x, "none");
    at::Tensor out = kiln::empty_cpu_like(x.sizes(), x);
    if (x.numel() == 0) return out;
    const at::Tensor rows = rows_of(x);
    kiln::check_rc(kiln_gelu_tanh(rows.data_ptr(), rows.stride(0), out.data_ptr(),
                                  rows.size(0), static_cast<int32_t>(rows.size(1)), dtype,
                                  kiln::threads()),
                   "kiln_gelu_tanh");
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) {
    m.def("layer_norm_native(Tensor x, Tensor weight, Tensor? bias, float eps) -> Tensor");
    m.def("fused_add_layer_norm_native(Tensor x, Tensor residual, Tensor weight, Tensor? bias, "
          "float eps) -> (Tensor, Tensor)");
    m.def("gelu_native(Tensor x, str approximate) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
    m.impl("layer_norm_native", &layer_norm);
    m.impl("fused_add_layer_norm_native", &fused_add_layer_norm);
    m.impl("gelu_native", &gelu);
}
