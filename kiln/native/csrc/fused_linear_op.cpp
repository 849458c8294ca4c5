/* The CPU kernels of the fused ops compiled graphs fold into a linear from before it: a residual
 * add and RMSNorm (`kiln::add_rms_norm_linear`, `_gguf_linear`), SiLU-and-mul (`silu_mul_...`). */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>

#include "linear_cpu.h"
#include "torch_ops.h"

namespace {

using namespace kiln::linear;

/* (rms_norm(a + b) * norm_weight, a + b): a residual add and the RMSNorm after it, done here
 * before a linear instead of in one of Inductor's kernels (compiled graphs only:
 * kiln/compilation/passes/fuse_rms_norm_linear.py). The same float32 operations in the same
 * order per element as the IR reference; the sum of squares is summed in another order. */
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor &a, const at::Tensor &b,
                                                const at::Tensor &norm_weight, double eps) {
    const int64_t h = a.size(-1);
    const bool direct = a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat &&
                        norm_weight.scalar_type() == at::kFloat && a.sizes().equals(b.sizes()) &&
                        norm_weight.dim() == 1 && norm_weight.size(0) == h && h > 0;
    if (!direct) { /* the IR reference (kiln/ir/layer_ops.py), in aten: norm in float32 */
        at::Tensor residual = at::add(a, b);
        const at::Tensor r32 = residual.to(at::kFloat);
        at::Tensor normed = at::mul(norm_weight, at::mul(r32, at::rsqrt(at::add(
            at::mean(at::pow(r32, 2), {-1}, true), eps))).to(residual.scalar_type()));
        return {normed, residual};
    }
    const at::Tensor ac = a.contiguous(), bc = b.contiguous(), wc = norm_weight.contiguous();
    at::Tensor residual = at::empty(a.sizes(), a.options());
    at::Tensor normed = at::empty(a.sizes(), a.options());
    const float *pa = ac.data_ptr<float>(), *pb = bc.data_ptr<float>(), *pw = wc.data_ptr<float>();
    float *pr = residual.data_ptr<float>(), *pn = normed.data_ptr<float>();
    const float feps = static_cast<float>(eps), fh = static_cast<float>(h);
    /* Rows apart: serial for a decode's few rows, in parallel for a prefill's thousands. */
    at::parallel_for(0, a.numel() / h, 64, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            const int64_t o = r * h;
            float ss = 0.f;
            for (int64_t i = 0; i < h; ++i) {
                const float v = pa[o + i] + pb[o + i];
                pr[o + i] = v;
                ss += v * v;
            }
            const float scale = 1.f / std::sqrt(ss / fh + feps);
            for (int64_t i = 0; i < h; ++i) pn[o + i] = pw[i] * (pr[o + i] * scale);
        }
    });
    return {normed, residual};
}

/* silu(x[..., :d]) * x[..., d:]: the SiLU-and-mul before a down projection, done by
 * layer_ops.c's kernel (the eager forward's) instead of one of Inductor's kernels (compiled
 * graphs only: kiln/compilation/passes/fuse_silu_mul_linear.py). */
at::Tensor silu_mul(const at::Tensor &x) {
    const int64_t d = x.size(-1) / 2;
    const int32_t dtype = kiln::dtype_code(x.scalar_type());
    if (dtype < 0 || x.size(-1) != 2 * d || d == 0 || x.stride(-1) != 1)
        return at::mul(at::silu(x.narrow(-1, 0, d)), x.narrow(-1, d, d));
    const at::Tensor rows = x.reshape({-1, 2 * d});
    at::Tensor act = out_like(x, d);
    kiln::check_rc(kiln_silu_and_mul(rows.data_ptr(), rows.stride(0), act.data_ptr(),
                                     rows.size(0), static_cast<int32_t>(d), dtype,
                                     kiln::threads()),
                   "kiln::silu_mul_linear (kiln_silu_and_mul)");
    return act;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_linear(
    const at::Tensor &a, const at::Tensor &b, const at::Tensor &norm_weight, double eps,
    const at::Tensor &weight, const OptTensor &bias, const OptTensor &packed,
    const OptTensor &plan) {
    auto [normed, residual] = add_rms_norm(a, b, norm_weight, eps);
    return {linear_cpu(normed, weight, bias, packed, plan), residual};
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_gguf_linear(
    const at::Tensor &a, const at::Tensor &b, const at::Tensor &norm_weight, double eps,
    const at::Tensor &blocks, int64_t qtype, int64_t out_features, const OptTensor &bias,
    const OptTensor &weight, const OptTensor &packed, const OptTensor &plan) {
    auto [normed, residual] = add_rms_norm(a, b, norm_weight, eps);
    return {gguf_linear_cpu(normed, blocks, qtype, out_features, bias, weight, packed, plan),
            residual};
}

at::Tensor silu_mul_linear(const at::Tensor &x, const at::Tensor &weight, const OptTensor &bias,
                           const OptTensor &packed, const OptTensor &plan) {
    return linear_cpu(silu_mul(x), weight, bias, packed, plan);
}

at::Tensor silu_mul_gguf_linear(const at::Tensor &x, const at::Tensor &blocks, int64_t qtype,
                                int64_t out_features, const OptTensor &bias,
                                const OptTensor &weight, const OptTensor &packed,
                                const OptTensor &plan) {
    return gguf_linear_cpu(silu_mul(x), blocks, qtype, out_features, bias, weight, packed, plan);
}

}  // namespace

/* CPU, and MkldnnCPU: oneDNN's packed copy is an MKLDNN tensor, and a call holding one
 * dispatches there. */
#define KILN_FUSED_LINEAR_IMPLS(m)                                 \
    m.impl("add_rms_norm_linear", &add_rms_norm_linear);           \
    m.impl("add_rms_norm_gguf_linear", &add_rms_norm_gguf_linear); \
    m.impl("silu_mul_linear", &silu_mul_linear);                   \
    m.impl("silu_mul_gguf_linear", &silu_mul_gguf_linear)

TORCH_LIBRARY_IMPL(kiln, CPU, m) { KILN_FUSED_LINEAR_IMPLS(m); }

TORCH_LIBRARY_IMPL(kiln, MkldnnCPU, m) { KILN_FUSED_LINEAR_IMPLS(m); }
