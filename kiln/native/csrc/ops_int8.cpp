/* The `native` implementations of the W8A8 int8 IR ops (kiln/ir/quant.py defines each one's
 * result) as torch ops over int8_ops.c's AVX512-VNNI kernels: per-token dynamic quant, alone or
 * after (add +) RMSNorm or SiLU-and-mul; the int8 GEMM with its scales over a weight packed at
 * load into panels (int8_vnni_gemm.c, on AMX-INT8 tiles from kiln_int8_amx_min_rows() rows where
 * the CPU grants them), for every row count, alone or with the SiLU-and-mul and quant after it
 * (int8_gemm_silu_quant.c); and the same GEMM over a weight as stored (the panel
 * GEMM from PANELS_MIN_ROWS rows, oneDNN's int8 GEMM through aten's _int_mm from ONEDNN_MIN_ROWS,
 * the epilogue here after it, the VNNI kernel below). */
#include <ATen/ops/_int_mm.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include "ops_int8.h"
#include "torch_ops.h"

namespace {

using kiln::rows_of;

/* A weight as stored (not packed at load: K not a multiple of 4, or the panel op not the native
 * one): oneDNN's int8 GEMM (its int32 sums exact) and the epilogue here take over from the VNNI
 * kernel at ONEDNN_MIN_ROWS. With VNNI only, the two meet at about 64 rows (a decode step's
 * weights, cold); oneDNN runs AMX tiles where the CPU has them. */
#if defined(__AMX_INT8__)
constexpr int64_t ONEDNN_MIN_ROWS = 16;
#else
constexpr int64_t ONEDNN_MIN_ROWS = 64;
#endif
/* From this many rows (a prefill chunk) the panel GEMM (int8_vnni_gemm.c) over the weight packed
 * for the call: as fast as oneDNN's in its loop, without the pass over int32 sums; below it
 * packing the weight each call does not pay. */
constexpr int64_t PANELS_MIN_ROWS = 1024;
constexpr int32_t NO_BIAS = -1;

void check(int rc, const char *fn) {
    TORCH_CHECK(rc != 4, fn, ": the int8 kernels were built for a CPU without AVX512-VNNI");
    kiln::check_rc(rc, fn);
}

/* x [rows, k] itself, or a copy where its rows share memory (an expanded row: stride(0) below
 * k), which torch 2.13's CPU _int_mm sums wrong; the kernels read strides as given. */
at::Tensor rows_apart(const at::Tensor &x) {
    return x.stride(0) >= x.size(1) ? x : x.contiguous();
}

/* at::empty(sizes, dtype) on the CPU without the dispatcher (~0.4 us a call; a decode step
 * makes some 400 of these ops' results). */
at::Tensor empty_of(at::IntArrayRef sizes, at::ScalarType dtype) {
    return at::Tensor(at::detail::empty_cpu(sizes, dtype, /*pin_memory=*/false,
                                            /*memory_format_opt=*/std::nullopt));
}

std::vector<int64_t> with_last(const at::Tensor &x, int64_t last) {
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = last;
    return shape;
}

std::tuple<at::Tensor, at::Tensor> dynamic_int8_quant(const at::Tensor &x) {
    const int32_t dtype = kiln::kernel_dtype(x, "kiln::dynamic_int8_quant_native");
    const at::Tensor rows = rows_of(x);
    at::Tensor q = empty_of(x.sizes(), at::kChar);
    at::Tensor scale = empty_of(with_last(x, 1), at::kFloat);
    check(kiln_dynamic_int8_quant(rows.data_ptr(), rows.stride(0), q.data_ptr<int8_t>(),
                                  scale.data_ptr<float>(), rows.size(0), rows.size(1), dtype,
                                  kiln::threads()),
          "kiln_dynamic_int8_quant");
    return {q, scale};
}

/* A GEMM op's activations, scales and bias as the kernels read them. */
struct Operands {
    at::Tensor q, scale, w_scale, bias;
    int32_t bias_code = NO_BIAS, out_code;

    Operands(const at::Tensor &q_in, const at::Tensor &scale_in, const at::Tensor &w_scale_in,
             const std::optional<at::Tensor> &bias_in, at::ScalarType out_dtype, const char *op)
        : q(q_in.stride(-1) == 1 ? q_in : q_in.contiguous()),
          scale(kiln::contiguous_as(scale_in, at::kFloat)),
          w_scale(kiln::contiguous_as(w_scale_in, at::kFloat)),
          out_code(kiln::dtype_code(out_dtype)) {
        TORCH_CHECK_TYPE(out_code >= 0, op, ": out_dtype ", out_dtype);
        if (bias_in) {
            bias = bias_in->contiguous();
            bias_code = kiln::kernel_dtype(bias, (std::string(op) + " (bias)").c_str());
        }
    }
    const void *bias_ptr() const { return bias.defined() ? bias.data_ptr() : nullptr; }
};

}  // namespace

namespace kiln {

at::Tensor int8_scaled_mm(const at::Tensor &q_in, const at::Tensor &scale_in,
                          const at::Tensor &w_q_in, const at::Tensor &w_scale_in,
                          const std::optional<at::Tensor> &bias_in, at::ScalarType out_dtype) {
    TORCH_CHECK_VALUE(q_in.dim() == 2 && w_q_in.dim() == 2 && q_in.scalar_type() == at::kChar &&
                          w_q_in.scalar_type() == at::kChar,
                      "kiln::int8_scaled_mm_native: q and w_q must be int8 matrices");
    const int64_t m = q_in.size(0), k = q_in.size(1), n = w_q_in.size(0);
    TORCH_CHECK_VALUE(w_q_in.size(1) == k && scale_in.numel() == m && w_scale_in.numel() == n &&
                          (!bias_in || bias_in->numel() == n),
                      "kiln::int8_scaled_mm_native: q ", q_in.sizes(), ", scale ",
                      scale_in.sizes(), ", w_q ", w_q_in.sizes(), ", w_scale ",
                      w_scale_in.sizes(), " do not fit together");
    const Operands ops(q_in, scale_in, w_scale_in, bias_in, out_dtype, "kiln::int8_scaled_mm_native");
    const at::Tensor &q = ops.q, &scale = ops.scale, &w_scale = ops.w_scale;
    const void *b = ops.bias_ptr();
    const int32_t bias_code = ops.bias_code, out_code = ops.out_code;
    const at::Tensor w_q = w_q_in.stride(-1) == 1 ? w_q_in : w_q_in.contiguous();
    at::Tensor out = empty_of({m, n}, out_dtype);
    if (m >= PANELS_MIN_ROWS && k > 0 && k % 4 == 0) {
        check(kiln_int8_gemm_panels(q.data_ptr<int8_t>(), q.stride(0), scale.data_ptr<float>(),
                                    w_q.data_ptr<int8_t>(), w_q.stride(0),
                                    w_scale.data_ptr<float>(), b, bias_code, out.data_ptr(), n, m,
                                    n, k, out_code, kiln::threads()),
              "kiln_int8_gemm_panels");
        return out;
    }
    if (m >= ONEDNN_MIN_ROWS && k > 1) { /* (torch 2.13's CPU _int_mm is wrong for k == 1) */
        const at::Tensor acc = at::_int_mm(rows_apart(q), rows_apart(w_q).t());  // [M, N] int32
        check(kiln_int8_scale(acc.data_ptr<int32_t>(), acc.stride(0), scale.data_ptr<float>(),
                              w_scale.data_ptr<float>(), b, bias_code, out.data_ptr(), n, m, n,
                              out_code, kiln::threads()),
              "kiln_int8_scale");
        return out;
    }
    check(kiln_int8_gemm(q.data_ptr<int8_t>(), q.stride(0), scale.data_ptr<float>(),
                         w_q.data_ptr<int8_t>(), w_q.stride(0), w_scale.data_ptr<float>(), b,
                         bias_code, out.data_ptr(), n, m, n, k, out_code, kiln::threads()),
          "kiln_int8_gemm");
    return out;
}

}  // namespace kiln

namespace {

/* The weight packed at load, w_panels uint8 [ceil(N / 64), K / 4, 64, 4] (kiln/ir/int8_panels.py)
 * with N the length of w_scale, checked against q [M, K] and the scales and 64-byte aligned for
 * the kernels' aligned loads (at::empty's storage is, a view's may not be). */
at::Tensor checked_panels(const at::Tensor &q_in, const at::Tensor &scale_in,
                          const at::Tensor &w_panels_in, const at::Tensor &w_scale_in,
                          const std::optional<at::Tensor> &bias_in, const char *op) {
    TORCH_CHECK_VALUE(q_in.dim() == 2 && q_in.scalar_type() == at::kChar &&
                          w_panels_in.dim() == 4 && w_panels_in.scalar_type() == at::kByte,
                      op, ": q must be an int8 matrix and w_panels uint8 [panels, K / 4, 64, 4]");
    const int64_t m = q_in.size(0), k = q_in.size(1), n = w_scale_in.numel();
    TORCH_CHECK_VALUE(k % 4 == 0 && w_panels_in.size(0) == (n + 63) / 64 &&
                          w_panels_in.size(1) == k / 4 && w_panels_in.size(2) == 64 &&
                          w_panels_in.size(3) == 4 && scale_in.numel() == m &&
                          (!bias_in || bias_in->numel() == n),
                      op, ": q ", q_in.sizes(), ", scale ", scale_in.sizes(), ", w_panels ",
                      w_panels_in.sizes(), ", w_scale ", w_scale_in.sizes(),
                      " do not fit together");
    const bool aligned = w_panels_in.is_contiguous() &&
                         reinterpret_cast<uintptr_t>(w_panels_in.data_ptr()) % 64 == 0;
    const at::Tensor w_panels =
        aligned ? w_panels_in : w_panels_in.clone(at::MemoryFormat::Contiguous);
    TORCH_CHECK(reinterpret_cast<uintptr_t>(w_panels.data_ptr()) % 64 == 0, op,
                ": could not align the panels to 64 bytes");
    return w_panels;
}

/* int8_scaled_mm over the weight packed at load (checked_panels). */
at::Tensor int8_scaled_mm_panels(const at::Tensor &q_in, const at::Tensor &scale_in,
                                 const at::Tensor &w_panels_in, const at::Tensor &w_scale_in,
                                 const std::optional<at::Tensor> &bias_in,
                                 at::ScalarType out_dtype) {
    const char *op = "kiln::int8_scaled_mm_panels_native";
    const at::Tensor w_panels =
        checked_panels(q_in, scale_in, w_panels_in, w_scale_in, bias_in, op);
    const Operands ops(q_in, scale_in, w_scale_in, bias_in, out_dtype, op);
    const int64_t m = q_in.size(0), k = q_in.size(1), n = w_scale_in.numel();
    at::Tensor out = empty_of({m, n}, out_dtype);
    check(kiln_int8_gemm_packed(ops.q.data_ptr<int8_t>(), ops.q.stride(0),
                                ops.scale.data_ptr<float>(), w_panels.data_ptr<uint8_t>(),
                                ops.w_scale.data_ptr<float>(), ops.bias_ptr(), ops.bias_code,
                                out.data_ptr(), n, m, n, k, ops.out_code, kiln::threads()),
          "kiln_int8_gemm_packed");
    return out;
}

/* dynamic_int8_quant(silu_and_mul(int8_scaled_mm_panels(...))): q int8 [M, N / 2], scale
 * float32 [M, 1]; out_dtype is the GEMM's and the activation's. */
std::tuple<at::Tensor, at::Tensor> int8_scaled_mm_panels_silu_quant(
    const at::Tensor &q_in, const at::Tensor &scale_in, const at::Tensor &w_panels_in,
    const at::Tensor &w_scale_in, const std::optional<at::Tensor> &bias_in,
    at::ScalarType out_dtype) {
    const char *op = "kiln::int8_scaled_mm_panels_silu_quant_native";
    const at::Tensor w_panels =
        checked_panels(q_in, scale_in, w_panels_in, w_scale_in, bias_in, op);
    const int64_t m = q_in.size(0), k = q_in.size(1), n = w_scale_in.numel();
    TORCH_CHECK_VALUE(n % 2 == 0, op, ": the weight's ", n, " channels must be even [gate | up]");
    const Operands ops(q_in, scale_in, w_scale_in, bias_in, out_dtype, op);
    at::Tensor q = empty_of({m, n / 2}, ops.q.scalar_type());
    at::Tensor scale = empty_of({m, 1}, at::kFloat);
    check(kiln_int8_gemm_silu_quant(ops.q.data_ptr<int8_t>(), ops.q.stride(0),
                                    ops.scale.data_ptr<float>(), w_panels.data_ptr<uint8_t>(),
                                    ops.w_scale.data_ptr<float>(), ops.bias_ptr(), ops.bias_code,
                                    q.data_ptr<int8_t>(), scale.data_ptr<float>(), m, n, k,
                                    ops.out_code, kiln::threads()),
          "kiln_int8_gemm_silu_quant");
    return {q, scale};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_quant(
    const at::Tensor &x, const std::optional<at::Tensor> &residual, const at::Tensor &weight,
    double eps) {
    const int32_t dtype = kiln::kernel_dtype(x, "kiln::rms_norm_dynamic_int8_quant_native");
    TORCH_CHECK_VALUE(weight.numel() == x.size(-1), "rms_norm quant: weight has ", weight.numel(),
                      " values for hidden size ", x.size(-1));
    TORCH_CHECK_VALUE(!residual || residual->sizes().equals(x.sizes()),
                      "rms_norm quant: residual shape ", residual ? residual->sizes() : x.sizes(),
                      " != x shape ", x.sizes());
    const at::Tensor rows = rows_of(x), w = kiln::contiguous_as(weight, x.scalar_type());
    at::Tensor res_rows, res_out;
    if (residual) {
        res_rows = rows_of(*residual);
        res_out = empty_of(x.sizes(), x.scalar_type());
    }
    at::Tensor q = empty_of(x.sizes(), at::kChar);
    at::Tensor scale = empty_of(with_last(x, 1), at::kFloat);
    check(kiln_rms_norm_int8_quant(rows.data_ptr(), rows.stride(0),
                                   residual ? res_rows.data_ptr() : nullptr,
                                   residual ? res_rows.stride(0) : 0,
                                   residual ? res_out.data_ptr() : nullptr, w.data_ptr(),
                                   q.data_ptr<int8_t>(), scale.data_ptr<float>(), rows.size(0),
                                   static_cast<int32_t>(rows.size(1)), static_cast<float>(eps),
                                   dtype, kiln::threads()),
          "kiln_rms_norm_int8_quant");
    return {q, scale, res_out};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_quant(const at::Tensor &x, const at::Tensor &weight,
                                                  double eps) {
    auto [q, scale, unused] = norm_quant(x, std::nullopt, weight, eps);
    return {q, scale};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_quant(const at::Tensor &x,
                                                                  const at::Tensor &residual,
                                                                  const at::Tensor &weight,
                                                                  double eps) {
    return norm_quant(x, residual, weight, eps);
}

}  // namespace

namespace kiln {

std::tuple<at::Tensor, at::Tensor> silu_and_mul_quant(const at::Tensor &x) {
    const int32_t dtype = kiln::kernel_dtype(x, "kiln::silu_and_mul_dynamic_int8_quant_native");
    TORCH_CHECK_VALUE(x.size(-1) % 2 == 0, "silu_and_mul quant: the last dimension (",
                      x.size(-1), ") must be even [gate | up]");
    const at::Tensor rows = rows_of(x);
    const int64_t d = rows.size(1) / 2;
    at::Tensor q = empty_of(with_last(x, d), at::kChar);
    at::Tensor scale = empty_of(with_last(x, 1), at::kFloat);
    check(kiln_silu_and_mul_int8_quant(rows.data_ptr(), rows.stride(0), q.data_ptr<int8_t>(),
                                       scale.data_ptr<float>(), rows.size(0),
                                       static_cast<int32_t>(d), dtype, kiln::threads()),
          "kiln_silu_and_mul_int8_quant");
    return {q, scale};
}

}  // namespace kiln

namespace {

/* "avx512_vnni" when the kernels were built with those instructions ("amx_int8+avx512_vnni"
 * where the packed GEMM also runs on AMX tiles), else "". */
std::string isa() {
    if (kiln_int8_isa() != 1) return "";
    return kiln_int8_amx_min_rows() ? "amx_int8+avx512_vnni" : "avx512_vnni";
}
int64_t amx_min_rows() { return kiln_int8_amx_min_rows(); }
int64_t onednn_min_rows() { return ONEDNN_MIN_ROWS; }
int64_t panels_min_rows() { return PANELS_MIN_ROWS; }
int64_t silu_quant_min_rows() { return kiln_int8_gemm_silu_quant_min_rows(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) {
    m.def("int8_isa() -> str", &isa);
    m.def("int8_onednn_min_rows() -> int", &onednn_min_rows);
    m.def("int8_amx_min_rows() -> int", &amx_min_rows);
    m.def("int8_panels_min_rows() -> int", &panels_min_rows);
    m.def("int8_mm_silu_quant_min_rows() -> int", &silu_quant_min_rows);
    /* the IR ops' schemas (kiln/ir/quant.py) */
    m.def("dynamic_int8_quant_native(Tensor x) -> (Tensor, Tensor)");
    m.def("int8_scaled_mm_native(Tensor q, Tensor scale, Tensor w_q, Tensor w_scale, "
          "Tensor? bias, ScalarType out_dtype) -> Tensor");
    m.def("int8_scaled_mm_panels_native(Tensor q, Tensor scale, Tensor w_panels, Tensor w_scale, "
          "Tensor? bias, ScalarType out_dtype) -> Tensor");
    m.def("rms_norm_dynamic_int8_quant_native(Tensor x, Tensor weight, float eps) -> "
          "(Tensor, Tensor)");
    m.def("fused_add_rms_norm_dynamic_int8_quant_native(Tensor x, Tensor residual, "
          "Tensor weight, float eps) -> (Tensor, Tensor, Tensor)");
    m.def("silu_and_mul_dynamic_int8_quant_native(Tensor x) -> (Tensor, Tensor)");
    m.def("int8_scaled_mm_panels_silu_quant_native(Tensor q, Tensor scale, Tensor w_panels, "
          "Tensor w_scale, Tensor? bias, ScalarType out_dtype) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
    m.impl("dynamic_int8_quant_native", &dynamic_int8_quant);
    m.impl("int8_scaled_mm_native", &kiln::int8_scaled_mm);
    m.impl("int8_scaled_mm_panels_native", &int8_scaled_mm_panels);
    m.impl("rms_norm_dynamic_int8_quant_native", &rms_norm_quant);
    m.impl("fused_add_rms_norm_dynamic_int8_quant_native", &add_rms_norm_quant);
    m.impl("silu_and_mul_dynamic_int8_quant_native", &kiln::silu_and_mul_quant);
    m.impl("int8_scaled_mm_panels_silu_quant_native", &int8_scaled_mm_panels_silu_quant);
}
