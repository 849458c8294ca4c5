/* The `native` implementation of the IR op int4_weight_linear (kiln/ir/int4.py defines its
 * result) over int4_linear.c: up to kiln_int4_gemv_row_limit rows the in-register GEMV (8 rows a
 * pass); more rows (prefill), or groups not of 32s, dequantize a tile of weight rows at a time
 * into x's dtype and multiply it with aten's mm (MKL / oneDNN), so each weight is unpacked once
 * per call, not once per row. */
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "torch_ops.h"

namespace {

/* Bytes of dequantized weight a tile holds: a small model's whole weight (one GEMM: the fastest),
 * a large one's in parts, so that a call never holds a float copy of a large weight. */
constexpr int64_t TILE_BYTES = 32 << 20;

int32_t scale_code(const at::Tensor &s) {
    switch (s.scalar_type()) {
        case at::kFloat: return 0;
        case at::kBFloat16: return 1;
        case at::kHalf: return 2;
        default: TORCH_CHECK_TYPE(false, "kiln::int4_weight_linear_native: scales must be "
                                  "float32, bfloat16 or float16, got ", s.scalar_type());
    }
    return -1;
}

at::Tensor int4_linear(const at::Tensor &x, const at::Tensor &w_packed, const at::Tensor &scales,
                       const std::optional<at::Tensor> &zeros, int64_t group_size,
                       const std::optional<at::Tensor> &bias) {
    const char *op = "kiln::int4_weight_linear_native";
    const int32_t dtype = kiln::kernel_dtype(x, op);
    const int64_t k = x.size(-1), n = w_packed.size(0);
    TORCH_CHECK_VALUE(w_packed.dim() == 2 && w_packed.scalar_type() == at::kInt &&
                          w_packed.size(1) * 8 == k && w_packed.is_contiguous(),
                      op, ": w_packed must be contiguous int32 [n, ", k / 8, "], got ",
                      w_packed.scalar_type(), " ", w_packed.sizes());
    TORCH_CHECK_VALUE(group_size > 0 && group_size % 2 == 0 && k % group_size == 0, op,
                      ": group_size ", group_size, " must be an even divisor of ", k);
    const int64_t groups = k / group_size;
    TORCH_CHECK_VALUE(scales.dim() == 2 && scales.size(0) == n && scales.size(1) == groups &&
                          scales.is_contiguous(),
                      op, ": scales must be contiguous [", n, ", ", groups, "], got ",
                      scales.sizes());
    const int32_t s_code = scale_code(scales);
    const uint8_t *z = nullptr;
    if (zeros) {
        TORCH_CHECK_VALUE(zeros->scalar_type() == at::kByte && zeros->is_contiguous() &&
                              zeros->sizes() == scales.sizes(),
                          op, ": zeros must be contiguous uint8 shaped as scales");
        z = zeros->data_ptr<uint8_t>();
    }
    TORCH_CHECK_VALUE(!bias || (bias->numel() == n && bias->scalar_type() == x.scalar_type()),
                      op, ": bias must be ", n, " values of x's dtype");
    const at::Tensor rows = x.reshape({-1, k}).contiguous();  // [m, k]
    const int64_t m = rows.size(0);
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = n;
    at::Tensor out = at::empty({m, n}, x.options());
    const auto *w = reinterpret_cast<const uint8_t *>(w_packed.data_ptr<int32_t>());
    if (m == 0 || n == 0) return out.view(shape);
    if (group_size % 32 == 0 && m <= kiln_int4_gemv_row_limit(dtype)) {
        const at::Tensor b = bias ? bias->contiguous() : at::Tensor();
        const int64_t elem = x.element_size();
        for (int64_t r0 = 0; r0 < m; r0 += KILN_INT4_GEMV_MAX_ROWS) {  // [<= 8, k] a pass
            const int64_t r = std::min<int64_t>(KILN_INT4_GEMV_MAX_ROWS, m - r0);
            kiln::check_rc(kiln_int4_gemv(static_cast<const char *>(rows.data_ptr()) + r0 * k * elem,
                                          w, scales.data_ptr(), s_code, z,
                                          b.defined() ? b.data_ptr() : nullptr,
                                          static_cast<char *>(out.data_ptr()) + r0 * n * elem,
                                          static_cast<int32_t>(r), n, k, group_size, dtype,
                                          kiln::threads()),
                           "kiln_int4_gemv");
        }
        return out.view(shape);
    }
    const int64_t elem = x.element_size();
    const int64_t tile_rows = std::min(n, std::max<int64_t>(16, TILE_BYTES / (k * elem) / 16 * 16));
    at::Tensor tile = at::empty({tile_rows, k}, x.options());  // [tile_rows, k]
    for (int64_t r0 = 0; r0 < n; r0 += tile_rows) {
        const int64_t r = std::min(tile_rows, n - r0);
        kiln::check_rc(kiln_int4_dequant(w, scales.data_ptr(), s_code, z, r0, r, k, group_size,
                                         tile.data_ptr(), dtype, kiln::threads()),
                       "kiln_int4_dequant");
        const at::Tensor weight = tile.narrow(0, 0, r).t();  // [k, r]
        if (r == n) {
            at::mm_out(out, rows, weight);
        } else {  // a GEMM into a strided slice of out runs far slower than this copy
            out.narrow(1, r0, r).copy_(at::mm(rows, weight));
        }
    }
    if (bias) out.add_(*bias);
    return out.view(shape);
}

int64_t simd() { return kiln_int4_simd(); }

int64_t gemv_row_limit(bool float32) { return kiln_int4_gemv_row_limit(float32 ? 0 : 1); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) {
    m.def("int4_simd() -> int", &simd);
    m.def("int4_gemv_row_limit(bool float32) -> int", &gemv_row_limit);
    m.def("int4_weight_linear_native(Tensor x, Tensor w_packed, Tensor scales, Tensor? zeros, "
          "int group_size, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("int4_weight_linear_native", &int4_linear); }
