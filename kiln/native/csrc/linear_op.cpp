/* The CPU kernel of the IR op `linear` (`kiln::linear_native`): per call it picks the GGUF blocks
 * kernel, the GEMV kernel or oneDNN's packed GEMM from what the layer holds beside its dense
 * weight (kiln/model/layers/cpu_gemm.py) and hands over with it: a oneDNN-packed copy, the GGUF
 * blocks in the kernel's layout, and a plan, int64 [gemv_rows, qtype, block_rows, limbs] (up to
 * how many rows the GEMV kernel takes the dense weight, 0: never; the blocks' ggml type; up to
 * how many rows the blocks serve, 0: never; float32 x's int8 limbs in their kernel). In C++
 * because a decode step makes ~120 of these calls, and the dispatcher reaches a C++ kernel in
 * ~1.5 us against ~8 us through a Python kernel (measured on 2 cores). Also the CPU kernels of
 * `kiln::add_rms_norm_linear` and `kiln::silu_mul_linear`, what compiled graphs fold into a
 * linear from before it (a residual add and RMSNorm; SiLU-and-mul). */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "gguf_sizes.h"
#include "torch_ops.h"

namespace {

using OptTensor = std::optional<at::Tensor>;

/* Calls by path (blocks, GEMV, packed, dense), for tests and benchmarks to see the choice. */
enum { PATH_BLOCKS, PATH_GEMV, PATH_PACKED, PATH_DENSE, NUM_PATHS };
std::atomic<int64_t> path_calls[NUM_PATHS];

void count(int path) { path_calls[path].fetch_add(1, std::memory_order_relaxed); }

/* The plan's fields; a plan that is not int64 [4] plans nothing (dense). */
struct Plan {
    int64_t gemv_rows = 0, qtype = 0, block_rows = 0, limbs = 3;
};

Plan read_plan(const OptTensor &plan) {
    Plan p;
    if (plan && plan->scalar_type() == at::kLong && plan->numel() == 4 && plan->is_contiguous()) {
        const int64_t *v = plan->data_ptr<int64_t>();
        p = Plan{v[0], v[1], v[2], v[3] == 2 ? 2 : 3};
    }
    return p;
}

at::Tensor packed_gemm(const at::Tensor &x, const at::Tensor &packed, int64_t out_features,
                       const std::optional<at::Tensor> &bias) {
    static const c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    std::vector<c10::IValue> stack{x.reshape({-1, x.size(-1)}), packed, bias,
                                   std::string("none"), c10::List<std::optional<at::Scalar>>(),
                                   std::optional<std::string>("")};
    op.callBoxed(&stack);
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = out_features;
    return stack[0].toTensor().view(shape);
}

at::Tensor linear_cpu(const at::Tensor &x, const at::Tensor &weight, const OptTensor &bias,
                      const OptTensor &packed, const OptTensor &blocks, const OptTensor &plan) {
    const int64_t k = x.size(-1), n = weight.size(0);
    /* A bias the kernels cannot read as n values of x's dtype (broadcast, strided, too short)
     * gets aten's semantics, errors included. */
    const bool bias_ok = !bias || (bias->dim() == 1 && bias->size(0) == n &&
                                   bias->is_contiguous() && bias->scalar_type() == x.scalar_type());
    const int32_t dtype = kiln::dtype_code(x.scalar_type());
    if (!plan || x.scalar_type() != weight.scalar_type() || !bias_ok || dtype < 0 ||
        weight.dim() != 2 || weight.size(1) != k) {
        count(PATH_DENSE);
        return at::linear(x, weight, bias);
    }
    const Plan p = read_plan(plan);
    const int64_t rows = k > 0 ? x.numel() / k : 0;
    const bool use_blocks = blocks && rows <= p.block_rows &&
                            kiln::gguf_blocks_fit(*blocks, static_cast<int32_t>(p.qtype), n, k);
    const bool use_gemv = !use_blocks && rows <= p.gemv_rows && weight.is_contiguous();
    if (rows > 0 && (use_blocks || use_gemv)) {
        const at::Tensor xc = x.contiguous();
        std::vector<int64_t> shape = x.sizes().vec();
        shape.back() = n;
        at::Tensor out = at::empty(shape, x.options());
        const void *b = bias ? bias->data_ptr() : nullptr;
        int rc;
        if (use_blocks) {
            count(PATH_BLOCKS);
            rc = kiln_gguf_matmul(xc.data_ptr(), blocks->data_ptr<uint8_t>(),
                                  static_cast<int32_t>(p.qtype), b, out.data_ptr(),
                                  static_cast<int32_t>(rows), n, k, dtype,
                                  static_cast<int32_t>(p.limbs), kiln::threads());
        } else {
            count(PATH_GEMV);
            rc = kiln_gemv(xc.data_ptr(), weight.data_ptr(), b, out.data_ptr(),
                           static_cast<int32_t>(rows), n, k, dtype, kiln::threads());
        }
        TORCH_CHECK(rc == 0, "kiln::linear: the ", use_blocks ? "GGUF blocks" : "GEMV",
                    " kernel failed with code ", rc, " on x ", x.sizes(), ", weight ",
                    weight.sizes());
        return out;
    }
    if (packed && packed->scalar_type() == weight.scalar_type()) {
        count(PATH_PACKED);
        return packed_gemm(x, *packed, n, bias);
    }
    count(PATH_DENSE);
    return at::linear(x, weight, bias);
}

/* (linear(rms_norm(a + b) * norm_weight), a + b): a residual add and the RMSNorm after it,
 * done here instead of in one of Inductor's kernels before the linear (compiled graphs only:
 * kiln/compilation/passes/fuse_rms_norm_linear.py). The same float32 operations in the same
 * order per element as the IR reference; the sum of squares is summed in another order. */
std::tuple<at::Tensor, at::Tensor> add_rms_norm_linear(const at::Tensor &a, const at::Tensor &b,
                                                       const at::Tensor &norm_weight, double eps,
                                                       const at::Tensor &weight,
                                                       const OptTensor &bias,
                                                       const OptTensor &packed,
                                                       const OptTensor &blocks,
                                                       const OptTensor &plan) {
    const int64_t h = a.size(-1);
    const bool direct = a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat &&
                        norm_weight.scalar_type() == at::kFloat && a.sizes().equals(b.sizes()) &&
                        norm_weight.dim() == 1 && norm_weight.size(0) == h && h > 0;
    if (!direct) { /* the IR reference (kiln/ir/layer_ops.py), in aten: norm in float32 */
        at::Tensor residual = at::add(a, b);
        const at::Tensor r32 = residual.to(at::kFloat);
        at::Tensor normed = at::mul(norm_weight, at::mul(r32, at::rsqrt(at::add(
            at::mean(at::pow(r32, 2), {-1}, true), eps))).to(residual.scalar_type()));
        return {linear_cpu(normed, weight, bias, packed, blocks, plan), residual};
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
    return {linear_cpu(normed, weight, bias, packed, blocks, plan), residual};
}

/* linear(silu(x[..., :d]) * x[..., d:]): the SiLU-and-mul before a down projection, done by
 * layer_ops.c's kernel (the eager forward's) instead of one of Inductor's kernels (compiled
 * graphs only: kiln/compilation/passes/fuse_silu_mul_linear.py). */
at::Tensor silu_mul_linear(const at::Tensor &x, const at::Tensor &weight, const OptTensor &bias,
                           const OptTensor &packed, const OptTensor &blocks,
                           const OptTensor &plan) {
    const int64_t d = x.size(-1) / 2;
    const int32_t dtype = kiln::dtype_code(x.scalar_type());
    if (dtype < 0 || x.size(-1) != 2 * d || d == 0 || x.stride(-1) != 1)
        return linear_cpu(at::mul(at::silu(x.narrow(-1, 0, d)), x.narrow(-1, d, d)), weight,
                          bias, packed, blocks, plan);
    const at::Tensor rows = x.reshape({-1, 2 * d});
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = d;
    at::Tensor act = at::empty(shape, x.options());
    kiln::check_rc(kiln_silu_and_mul(rows.data_ptr(), rows.stride(0), act.data_ptr(),
                                     rows.size(0), static_cast<int32_t>(d), dtype,
                                     kiln::threads()),
                   "kiln::silu_mul_linear (kiln_silu_and_mul)");
    return linear_cpu(act, weight, bias, packed, blocks, plan);
}

std::vector<int64_t> path_counts() {
    std::vector<int64_t> counts;
    for (auto &c : path_calls) counts.push_back(c.load());
    return counts;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) {
    m.def("linear_native(Tensor x, Tensor weight, Tensor? bias=None, Tensor? packed=None, "
          "Tensor? blocks=None, Tensor? plan=None) -> Tensor");
    m.def("linear_path_counts() -> int[]", &path_counts);
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
    m.impl("linear_native", &linear_cpu);
    m.impl("add_rms_norm_linear", &add_rms_norm_linear);
    m.impl("silu_mul_linear", &silu_mul_linear);
}

/* oneDNN's packed copy is an MKLDNN tensor: a call holding one dispatches here. */
TORCH_LIBRARY_IMPL(kiln, MkldnnCPU, m) {
    m.impl("linear_native", &linear_cpu);
    m.impl("add_rms_norm_linear", &add_rms_norm_linear);
    m.impl("silu_mul_linear", &silu_mul_linear);
}
