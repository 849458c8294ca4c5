/* The CPU kernel of the `kiln::linear` op: per call it picks, for the weight at hand, the GGUF
 * blocks kernel, the GEMV kernel or oneDNN's packed GEMM, from what was attached to the weight
 * once at load (kiln/model/layers/cpu_gemm.py). In C++ because a decode step makes ~120 of these
 * calls, and the dispatcher reaches a C++ kernel in ~1.5 us against ~8 us through a Python
 * kernel and ctypes (measured on 2 cores). The C kernels come as function pointers from their
 * own builds (kiln/native/gemv.py, gguf_matmul.py), so each is compiled once. Also the CPU
 * kernels of `kiln::add_rms_norm_linear` and `kiln::silu_mul_linear`, what compiled graphs fold
 * into a linear from before it (a residual add and RMSNorm; SiLU-and-mul). */
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
#include <tuple>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <vector>

#include "aten_dtype.h"

namespace {

/* csrc/gemv.c's kiln_gemv and csrc/gguf_matmul.c's kiln_gguf_matmul: 0 on success. */
using GemvFn = int (*)(const void *x, const void *weight, const void *bias, void *out, int32_t m,
                       int64_t n, int64_t k, int32_t dtype, int32_t num_threads);
using GgufFn = int (*)(const void *x, const uint8_t *blocks, int32_t qtype, const void *bias,
                       void *out, int32_t m, int64_t n, int64_t k, int32_t dtype,
                       int32_t f32_limbs, int32_t num_threads);
/* csrc/layer_ops.c's kiln_silu_and_mul. */
using SiluMulFn = int (*)(const void *x, int64_t x_stride, void *out, int64_t rows, int32_t d,
                          int32_t dtype, int32_t num_threads);

/* What a weight carries besides its dense values. */
struct Attached {
    /* The weight it was attached to: its storage (held weakly, so it cannot be mistaken for a
     * later storage at the same address after being freed, say by `module.to(dtype)`), shape,
     * strides and dtype (a view such as weight.t() shares the address, and of a square weight
     * the shape too). */
    c10::weak_intrusive_ptr<c10::StorageImpl> storage{c10::weak_intrusive_ptr<c10::StorageImpl>(
        c10::intrusive_ptr<c10::StorageImpl>())};
    std::vector<int64_t> sizes, strides;
    at::ScalarType dtype = at::kFloat;
    at::Tensor packed;       /* oneDNN's blocked copy; undefined: none */
    int64_t gemv_rows = 0;   /* up to how many rows the GEMV kernel takes it; 0: never */
    at::Tensor blocks;       /* the GGUF blocks, gguf_matmul.kernel_shape, uint8; undefined: none */
    int64_t qtype = 0;       /* their ggml type id */
    int64_t block_rows = 0;  /* up to how many rows they beat the dense weight; 0: never */
    int64_t limbs = 3;       /* float32 x's limbs in their kernel (gguf_matmul.c) */
};

std::shared_mutex registry_mutex;
std::unordered_map<const void *, Attached> registry;  /* by the dense weight's data pointer */
std::atomic<GemvFn> gemv_fn{nullptr};
std::atomic<GgufFn> gguf_fn{nullptr};
std::atomic<SiluMulFn> silu_mul_fn{nullptr};
/* Calls by path (blocks, GEMV, packed, dense), for tests and benchmarks to see the choice. */
enum { PATH_BLOCKS, PATH_GEMV, PATH_PACKED, PATH_DENSE, NUM_PATHS };
std::atomic<int64_t> path_calls[NUM_PATHS];

void count(int path) { path_calls[path].fetch_add(1, std::memory_order_relaxed); }

bool is_for(const Attached &a, const at::Tensor &weight) {
    return a.storage._unsafe_get_target() == weight.storage().unsafeGetStorageImpl() &&
           a.dtype == weight.scalar_type() && weight.sizes().equals(a.sizes) &&
           weight.strides().equals(a.strides);
}

/* The registry entry for weight, (re)started when it was another weight's. Lock held. */
Attached &entry_for(const at::Tensor &weight) {
    Attached &a = registry[weight.data_ptr()];
    if (!is_for(a, weight)) {
        a = Attached();
        a.storage = weight.storage().getWeakStorageImpl();
        a.sizes = weight.sizes().vec();
        a.strides = weight.strides().vec();
        a.dtype = weight.scalar_type();
    }
    return a;
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

at::Tensor linear_cpu(const at::Tensor &x, const at::Tensor &weight,
                      const std::optional<at::Tensor> &bias) {
    struct {
        at::Tensor packed, blocks;
        int64_t gemv_rows = 0, qtype = 0, block_rows = 0, limbs = 3;
    } a;
    bool found;
    {
        std::shared_lock lock(registry_mutex);
        auto it = registry.find(weight.data_ptr());
        found = it != registry.end() && is_for(it->second, weight);
        if (found) { /* what the call picks from, not the identity (its shape is a vector) */
            const Attached &e = it->second;
            a.packed = e.packed, a.blocks = e.blocks;
            a.gemv_rows = e.gemv_rows, a.qtype = e.qtype, a.block_rows = e.block_rows;
            a.limbs = e.limbs;
        }
    }
    const int64_t k = x.size(-1), n = weight.size(0);
    /* A bias the kernels cannot read as n values of x's dtype (broadcast, strided, too short)
     * gets aten's semantics, errors included. */
    const bool bias_ok = !bias || (bias->dim() == 1 && bias->size(0) == n &&
                                   bias->is_contiguous() && bias->scalar_type() == x.scalar_type());
    if (!found || x.scalar_type() != weight.scalar_type() || !bias_ok) {
        count(PATH_DENSE);
        return at::linear(x, weight, bias);
    }
    const int64_t rows = k > 0 ? x.numel() / k : 0;
    const int32_t dtype = kiln_dtype_code(x.scalar_type());
    GgufFn gguf = gguf_fn.load(std::memory_order_relaxed);
    GemvFn gemv = gemv_fn.load(std::memory_order_relaxed);
    const bool blocks = a.blocks.defined() && gguf && rows <= a.block_rows;
    if (rows > 0 && dtype >= 0 && (blocks || (gemv && rows <= a.gemv_rows))) {
        const at::Tensor xc = x.contiguous();
        std::vector<int64_t> shape = x.sizes().vec();
        shape.back() = n;
        at::Tensor out = at::empty(shape, x.options());
        const void *b = bias ? bias->data_ptr() : nullptr;
        const int threads = at::get_num_threads();
        int rc;
        if (blocks) {
            count(PATH_BLOCKS);
            rc = gguf(xc.data_ptr(), static_cast<const uint8_t *>(a.blocks.data_ptr()),
                      static_cast<int32_t>(a.qtype), b, out.data_ptr(),
                      static_cast<int32_t>(rows), n, k, dtype, static_cast<int32_t>(a.limbs),
                      threads);
        } else {
            count(PATH_GEMV);
            rc = gemv(xc.data_ptr(), weight.data_ptr(), b, out.data_ptr(),
                      static_cast<int32_t>(rows), n, k, dtype, threads);
        }
        TORCH_CHECK(rc == 0, "kiln::linear: the ", blocks ? "GGUF blocks" : "GEMV",
                    " kernel failed with code ", rc, " on x ", x.sizes(), ", weight ",
                    weight.sizes());
        return out;
    }
    if (a.packed.defined()) {
        count(PATH_PACKED);
        return packed_gemm(x, a.packed, n, bias);
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
                                                       const std::optional<at::Tensor> &bias) {
    const int64_t h = a.size(-1);
    const bool direct = a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat &&
                        norm_weight.scalar_type() == at::kFloat && a.sizes().equals(b.sizes()) &&
                        norm_weight.dim() == 1 && norm_weight.size(0) == h && h > 0;
    if (!direct) { /* the IR reference (kiln/ir/layer_ops.py), in aten: norm in float32 */
        at::Tensor residual = at::add(a, b);
        const at::Tensor r32 = residual.to(at::kFloat);
        at::Tensor normed = at::mul(norm_weight, at::mul(r32, at::rsqrt(at::add(
            at::mean(at::pow(r32, 2), {-1}, true), eps))).to(residual.scalar_type()));
        return {linear_cpu(normed, weight, bias), residual};
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
    return {linear_cpu(normed, weight, bias), residual};
}

/* linear(silu(x[..., :d]) * x[..., d:]): the SiLU-and-mul before a down projection, done by
 * csrc/layer_ops.c's kernel (the eager forward's) instead of one of Inductor's kernels
 * (compiled graphs only: kiln/compilation/passes/fuse_silu_mul_linear.py). */
at::Tensor silu_mul_linear(const at::Tensor &x, const at::Tensor &weight,
                           const std::optional<at::Tensor> &bias) {
    const int64_t d = x.size(-1) / 2;
    const int32_t dtype = kiln_dtype_code(x.scalar_type());
    SiluMulFn silu_mul = silu_mul_fn.load(std::memory_order_relaxed);
    if (!silu_mul || dtype < 0 || x.size(-1) != 2 * d || d == 0 || x.stride(-1) != 1)
        return linear_cpu(at::mul(at::silu(x.narrow(-1, 0, d)), x.narrow(-1, d, d)), weight,
                          bias);
    const at::Tensor rows = x.reshape({-1, 2 * d});
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = d;
    at::Tensor act = at::empty(shape, x.options());
    const int rc = silu_mul(rows.data_ptr(), rows.stride(0), act.data_ptr(), rows.size(0),
                            static_cast<int32_t>(d), dtype, at::get_num_threads());
    TORCH_CHECK(rc == 0, "kiln::silu_mul_linear: the SiLU-and-mul kernel failed with code ", rc);
    return linear_cpu(act, weight, bias);
}

void attach_packed(const at::Tensor &weight, const at::Tensor &packed, int64_t gemv_rows) {
    std::unique_lock lock(registry_mutex);
    Attached &a = entry_for(weight);
    a.packed = packed;
    a.gemv_rows = gemv_rows;
}

void attach_blocks(const at::Tensor &weight, const at::Tensor &blocks, int64_t qtype,
                   int64_t max_rows, int64_t limbs) {
    TORCH_CHECK(limbs == 2 || limbs == 3, "attach_blocks: limbs must be 2 or 3, got ", limbs);
    std::unique_lock lock(registry_mutex);
    Attached &a = entry_for(weight);
    a.blocks = blocks;
    a.qtype = qtype;
    a.block_rows = max_rows;
    a.limbs = limbs;
}

/* The weight whose storage was `storage` is gone: forget its entry, unless the address has
 * been taken over since by another weight's (whose storage differs: the entry's weak reference
 * keeps a dead storage's object, so no live one can share its address). */
void detach(int64_t address, int64_t storage) {
    std::unique_lock lock(registry_mutex);
    auto it = registry.find(reinterpret_cast<const void *>(address));
    if (it != registry.end() &&
        it->second.storage._unsafe_get_target() == reinterpret_cast<c10::StorageImpl *>(storage))
        registry.erase(it);
}

std::vector<int64_t> attached(const at::Tensor &weight) {
    std::shared_lock lock(registry_mutex);
    auto it = registry.find(weight.data_ptr());
    if (it == registry.end() || !is_for(it->second, weight)) return {0, 0, 0, 0, 0, 0};
    const Attached &a = it->second;
    return {a.packed.defined(), a.gemv_rows, a.blocks.defined(), a.qtype, a.block_rows,
            a.blocks.defined() ? a.limbs : 0};
}

void set_kernels(int64_t gemv, int64_t gguf, int64_t silu_mul) {
    gemv_fn.store(reinterpret_cast<GemvFn>(gemv));
    gguf_fn.store(reinterpret_cast<GgufFn>(gguf));
    silu_mul_fn.store(reinterpret_cast<SiluMulFn>(silu_mul));
}

int64_t num_attached() {
    std::shared_lock lock(registry_mutex);
    return static_cast<int64_t>(registry.size());
}

std::vector<int64_t> path_counts() {
    std::vector<int64_t> counts;
    for (auto &c : path_calls) counts.push_back(c.load());
    return counts;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) {
    m.def("_cpu_linear_attach_packed(Tensor weight, Tensor packed, int gemv_rows) -> ()",
          &attach_packed);
    m.def("_cpu_linear_attach_blocks(Tensor weight, Tensor blocks, int qtype, int max_rows, "
          "int limbs=3) -> ()",
          &attach_blocks);
    m.def("_cpu_linear_detach(int address, int storage) -> ()", &detach);
    m.def("_cpu_linear_attached(Tensor weight) -> int[]", &attached);
    m.def("_cpu_linear_num_attached() -> int", &num_attached);
    m.def("_cpu_linear_set_kernels(int gemv, int gguf, int silu_mul) -> ()", &set_kernels);
    m.def("_cpu_linear_path_counts() -> int[]", &path_counts);
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
    m.impl("linear_native", &linear_cpu);
    m.impl("add_rms_norm_linear", &add_rms_norm_linear);
    m.impl("silu_mul_linear", &silu_mul_linear);
}
