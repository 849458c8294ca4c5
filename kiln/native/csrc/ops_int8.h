/* The int8 torch ops of ops_int8.cpp that other C++ ops call whole (moe_experts_int8.cpp runs an
 * expert stored as int8 [N, K] through them, so its values are the dense int8 MLP's). */
#ifndef KILN_OPS_INT8_H
#define KILN_OPS_INT8_H

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace kiln {

/* kiln::int8_scaled_mm_native: q int8 [M, K] (scale [M]) x w_q int8 [N, K] (w_scale [N]) ->
 * [M, N] in out_dtype, on the kernel its row count takes. */
at::Tensor int8_scaled_mm(const at::Tensor &q_in, const at::Tensor &scale_in,
                          const at::Tensor &w_q_in, const at::Tensor &w_scale_in,
                          const std::optional<at::Tensor> &bias_in, at::ScalarType out_dtype);

/* kiln::silu_and_mul_dynamic_int8_quant_native: x [..., 2d] -> q int8 [..., d], scale [..., 1]. */
std::tuple<at::Tensor, at::Tensor> silu_and_mul_quant(const at::Tensor &x);

}  // namespace kiln

#endif
