/* The CPU kernels of the IR ops `linear` and `gguf_linear`, each call on the path its rows and
 * the layer's copies choose (`kiln::linear_native`, `kiln::gguf_linear_native`).
 *
 * `linear_native`: the GEMV kernel or oneDNN's packed GEMM on the dense weight, else aten;
 * `gguf_linear_native`: the GGUF blocks kernel, or the dense copy's kernels above the blocks'
 * row limit. Each chooses per call from what the layer holds and hands over
 * (kiln/model/layers/cpu_gemm.py): a oneDNN-packed copy, the blocks in the kernel's layout, and
 * a plan, int64 [gemv_rows, block_rows, limbs] (up to how many rows the GEMV kernel takes the
 * dense weight, 0: never; up to how many the blocks serve; float32 x's int8 limbs in their
 * kernel). One rule picks: `choose_path`. In C++ because a decode step makes ~120 of these
 * calls, and the dispatcher reaches a C++ kernel in ~1.5 us against ~8 us through a Python
 * kernel (measured on 2 cores). The fused ops that end in either linear: fused_linear_op.cpp. */
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <atomic>
#include <optional>
#include <vector>

#include "gguf_sizes.h"
#include "linear_cpu.h"
#include "torch_ops.h"

namespace {

using namespace kiln::linear;

/* Calls by path (blocks, GEMV, packed, dense), for tests and benchmarks to see the choice. */
enum { PATH_BLOCKS, PATH_GEMV, PATH_PACKED, PATH_DENSE, NUM_PATHS };
std::atomic<int64_t> path_calls[NUM_PATHS];

void count(int path) { path_calls[path].fetch_add(1, std::memory_order_relaxed); }

/* The plan's fields; a plan that is not int64 [3] plans nothing (no GEMV, no blocks beside a
 * dense copy, 3 limbs). */
struct Plan {
    int64_t gemv_rows = 0, block_rows = 0, limbs = 3;
};

Plan read_plan(const OptTensor &plan) {
    Plan p;
    if (plan && plan->scalar_type() == at::kLong && plan->numel() == 3 && plan->is_contiguous()) {
        const int64_t *v = plan->data_ptr<int64_t>();
        p = Plan{v[0], v[1], v[2] == 2 ? 2 : 3};
    }
    return p;
}

/* Which kernel serves a call of `rows` rows, given what it holds: the blocks (if they can
 * serve the call) up to the plan's block_rows, or at every row count without a dense copy;
 * else the GEMV kernel up to gemv_rows (rows > 0), else the packed copy, else aten. */
int choose_path(int64_t rows, bool blocks, bool dense, bool packed, const Plan &p) {
    if (blocks && (rows <= p.block_rows || (!dense && !packed))) return PATH_BLOCKS;
    if (dense && rows > 0 && rows <= p.gemv_rows) return PATH_GEMV;
    if (packed) return PATH_PACKED;
    if (dense) return PATH_DENSE;
    return -1;  /* nothing serves it */
}

int64_t linear_path(int64_t rows, bool blocks, bool dense, bool packed, const OptTensor &plan) {
    return choose_path(rows, blocks, dense, packed, read_plan(plan));
}

/* The row count oneDNN is asked for: rows itself up to 32, above that rounded up to one of 8
 * steps per power of two (at most 12.5% padding). oneDNN and ideep each cache a primitive per
 * shape (1024 of them, ~0.4 MB each): a server whose steps carry ever-new token counts filled
 * both caches, ~400 MB the process never gave back; rounded, a weight has ~100 shapes up to
 * 8192 rows. */
int64_t gemm_rows(int64_t rows) {
    if (rows <= 32) return rows;
    const int64_t step = int64_t(1) << (63 - __builtin_clzll(static_cast<uint64_t>(rows)) - 3);
    return (rows + step - 1) / step * step;
}

at::Tensor packed_gemm(const at::Tensor &x, const at::Tensor &packed, int64_t out_features,
                       const std::optional<at::Tensor> &bias) {
    static const c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    at::Tensor x2 = x.reshape({-1, x.size(-1)});
    const int64_t rows = x2.size(0), padded = gemm_rows(rows);
    if (padded != rows) {
        at::Tensor grown = at::empty({padded, x2.size(1)}, x2.options());
        grown.narrow(0, 0, rows).copy_(x2);
        grown.narrow(0, rows, padded - rows).zero_();
        x2 = grown;
    }
    std::vector<c10::IValue> stack{x2, packed, bias,
                                   std::string("none"), c10::List<std::optional<at::Scalar>>(),
                                   std::optional<std::string>("")};
    op.callBoxed(&stack);
    at::Tensor out = stack[0].toTensor();
    /* the first rows of a contiguous result: still contiguous */
    if (padded != rows) out = out.narrow(0, 0, rows);
    /* A compiled graph's x is 2-D: the result as it is, without the view's dispatch (with the
     * narrow's, ~4 aten calls a linear, ~120 linears a decode step). */
    if (x.dim() == 2) return out;
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = out_features;
    return out.view(shape);
}

/* A bias the kernels read as n values of x's dtype (else aten's semantics, errors included). */
bool bias_fits(const OptTensor &bias, int64_t n, at::ScalarType dtype) {
    return !bias || (bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous() &&
                     bias->scalar_type() == dtype);
}

/* The kernels read x's and the weight's memory: a meta tensor (a layer's let-go dense copy,
 * cpu_gemm.release_dense_copies) reaching them would be a null pointer. */
void check_on_cpu(const at::Tensor &x, const OptTensor &weight, const char *op) {
    TORCH_CHECK_VALUE(x.is_cpu() && (!weight || weight->is_cpu()), op, ": x (", x.device(),
                      ") and the dense weight (", weight ? weight->device() : x.device(),
                      ") must be CPU tensors");
}

}  // namespace

namespace kiln::linear {

at::Tensor out_like(const at::Tensor &x, int64_t n) {
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = n;
    return at::empty(shape, x.options());
}

at::Tensor linear_cpu(const at::Tensor &x, const at::Tensor &weight, const OptTensor &bias,
                      const OptTensor &packed, const OptTensor &plan) {
    check_on_cpu(x, weight, "kiln::linear");
    const int64_t k = x.size(-1), n = weight.size(0);
    const int32_t dtype = kiln::dtype_code(x.scalar_type());
    if (!plan || x.scalar_type() != weight.scalar_type() || !bias_fits(bias, n, x.scalar_type()) ||
        dtype < 0 || weight.dim() != 2 || weight.size(1) != k) {
        count(PATH_DENSE);
        return at::linear(x, weight, bias);
    }
    const int64_t rows = k > 0 ? x.numel() / k : 0;
    const bool has_packed = packed && packed->scalar_type() == weight.scalar_type();
    int path = choose_path(rows, false, true, has_packed, read_plan(plan));
    if (path == PATH_GEMV && !weight.is_contiguous()) path = has_packed ? PATH_PACKED : PATH_DENSE;
    count(path);
    if (path == PATH_GEMV) {
        const at::Tensor xc = x.contiguous();
        at::Tensor out = out_like(x, n);
        const int rc = kiln_gemv(xc.data_ptr(), weight.data_ptr(), bias ? bias->data_ptr() : nullptr,
                                 out.data_ptr(), static_cast<int32_t>(rows), n, k, dtype,
                                 kiln::threads());
        TORCH_CHECK(rc == 0, "kiln::linear: the GEMV kernel failed with code ", rc, " on x ",
                    x.sizes(), ", weight ", weight.sizes());
        return out;
    }
    if (path == PATH_PACKED) return packed_gemm(x, *packed, n, bias);
    return at::linear(x, weight, bias);
}

at::Tensor gguf_linear_cpu(const at::Tensor &x, const at::Tensor &blocks, int64_t qtype,
                           int64_t out_features, const OptTensor &bias, const OptTensor &weight,
                           const OptTensor &packed, const OptTensor &plan) {
    check_on_cpu(x, weight, "kiln::gguf_linear");
    const int64_t k = x.size(-1), n = out_features;
    const int32_t dtype = kiln::dtype_code(x.scalar_type());
    /* the blocks kernel reads n contiguous values of x's dtype: a strided bias is copied */
    const OptTensor b = bias ? OptTensor(bias->contiguous()) : OptTensor();
    const bool blocks_ok = dtype >= 0 && bias_fits(b, n, x.scalar_type()) &&
                           kiln::gguf_blocks_fit(blocks, static_cast<int32_t>(qtype), n, k);
    const int64_t rows = k > 0 ? x.numel() / k : 0;
    const Plan p = read_plan(plan);
    const bool has_packed = packed && packed->scalar_type() == x.scalar_type();
    const int path = choose_path(rows, blocks_ok, weight.has_value(), has_packed, p);
    if (path == PATH_PACKED && !weight) { /* the layer let its dense copy go (cpu_gemm.py) */
        TORCH_CHECK_VALUE(bias_fits(bias, n, x.scalar_type()), "kiln::gguf_linear: bias ",
                          bias->sizes(), " is not ", n, " values of x's dtype ", x.scalar_type());
        count(PATH_PACKED);
        return packed_gemm(x, *packed, n, bias);
    }
    if (path != PATH_BLOCKS) {
        TORCH_CHECK_VALUE(weight, "kiln::gguf_linear: blocks ", blocks.sizes(), " are not the kernel "
                          "layout of a [", n, ", ", k, "] weight of ggml type ", qtype, " for x ",
                          x.scalar_type(), " (and bias), and there is no dense weight");
        return linear_cpu(x, *weight, bias, packed, plan);
    }
    count(PATH_BLOCKS);
    at::Tensor out = out_like(x, n);
    if (rows == 0) return out;
    const at::Tensor xc = x.contiguous();
    const int rc = kiln_gguf_matmul(xc.data_ptr(), blocks.data_ptr<uint8_t>(),
                                    static_cast<int32_t>(qtype), b ? b->data_ptr() : nullptr,
                                    out.data_ptr(), static_cast<int32_t>(rows), n, k, dtype,
                                    static_cast<int32_t>(p.limbs), kiln::threads());
    TORCH_CHECK(rc == 0, "kiln::gguf_linear: the GGUF blocks kernel failed with code ", rc,
                " on x ", x.sizes(), ", blocks ", blocks.sizes());
    return out;
}

}  // namespace kiln::linear

namespace {

std::vector<int64_t> path_counts() {
    std::vector<int64_t> counts;
    for (auto &c : path_calls) counts.push_back(c.load());
    return counts;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) {
    m.def("linear_native(Tensor x, Tensor weight, Tensor? bias=None, Tensor? packed=None, "
          "Tensor? plan=None) -> Tensor");
    m.def("gguf_linear_native(Tensor x, Tensor blocks, int qtype, int out_features, "
          "Tensor? bias=None, Tensor? weight=None, Tensor? packed=None, Tensor? plan=None) -> "
          "Tensor");
    m.def("linear_path_counts() -> int[]", &path_counts);
    m.def("linear_path(int rows, bool blocks, bool dense, bool packed, Tensor? plan) -> int",
          &linear_path);
}

/* CPU, and MkldnnCPU: oneDNN's packed copy is an MKLDNN tensor, and a call holding one
 * dispatches there. */
#define KILN_LINEAR_IMPLS(m)                        \
    m.impl("linear_native", &linear_cpu);           \
    m.impl("gguf_linear_native", &gguf_linear_cpu)

TORCH_LIBRARY_IMPL(kiln, CPU, m) { KILN_LINEAR_IMPLS(m); }

TORCH_LIBRARY_IMPL(kiln, MkldnnCPU, m) { KILN_LINEAR_IMPLS(m); }
