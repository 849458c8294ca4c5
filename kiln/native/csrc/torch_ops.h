/* What the C++ torch ops share: the kernels' dtype code of a tensor, a tensor as rows with
 * contiguous columns, and a kernel's result code as a torch error. */
#ifndef KILN_TORCH_OPS_H
#define KILN_TORCH_OPS_H

#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>

#include "kernels.h"

namespace kiln {

/* 0 float32, 1 bfloat16 (dtype.h); -1: no kernel reads this dtype. */
inline int32_t dtype_code(c10::ScalarType t) {
    return t == c10::kFloat ? 0 : t == c10::kBFloat16 ? 1 : -1;
}

inline int32_t kernel_dtype(const at::Tensor &t, const char *op) {
    const int32_t code = dtype_code(t.scalar_type());
    TORCH_CHECK_TYPE(code >= 0, op, ": the CPU kernels take float32 or bfloat16, got ",
                     t.scalar_type());
    return code;
}

/* t [..., last] as [rows, last] with contiguous columns (a view when it can be). A 2-D tensor
 * that already is one comes back as it is: reshape and contiguous are dispatcher calls
 * (~0.5 us each), and most calls need neither. */
inline at::Tensor rows_of(const at::Tensor &t) {
    if (t.dim() == 2 && t.stride(1) == 1 && t.size(1) != 0) return t;
    at::Tensor r = t.reshape({-1, t.size(-1)});
    return r.stride(-1) == 1 ? r : r.contiguous();
}

/* t.to(dtype).contiguous(), without a dispatcher call when t already is that. */
inline at::Tensor contiguous_as(const at::Tensor &t, c10::ScalarType dtype) {
    if (t.scalar_type() == dtype && t.is_contiguous()) return t;
    return t.to(dtype).contiguous();
}

/* at::empty(sizes, like's dtype) on the CPU, allocated directly: what at::empty would reach
 * through the dispatcher (~0.4 us a call) for the CPU tensors these kernels take. */
inline at::Tensor empty_cpu_like(at::IntArrayRef sizes, const at::Tensor &like) {
    return at::Tensor(at::detail::empty_cpu(sizes, like.scalar_type(), /*pin_memory=*/false,
                                            /*memory_format_opt=*/std::nullopt));
}

inline int32_t threads() { return static_cast<int32_t>(at::get_num_threads()); }

/* 1 = bad shapes or indices, 2 = out of memory (the codes every kernel shares). */
inline void check_rc(int rc, const char *fn) {
    TORCH_CHECK(rc == 0, fn, " failed with code ", rc,
                " (1 = bad shapes or indices, 2 = out of memory)");
}

}  // namespace kiln

#endif
