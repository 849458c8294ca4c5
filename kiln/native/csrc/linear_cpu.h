/* The linear ops' CPU kernels linear_op.cpp defines, for the fused ops that end in one
 * (fused_linear_op.cpp): `linear_cpu`, `gguf_linear_cpu`, and their output tensor. */
#ifndef KILN_LINEAR_CPU_H
#define KILN_LINEAR_CPU_H

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace kiln::linear {

using OptTensor = std::optional<at::Tensor>;

/* An empty tensor of x's shape, dtype and device with n values in its last dimension. */
at::Tensor out_like(const at::Tensor &x, int64_t n);

/* `kiln::linear_native`: x @ weight.T + bias on the path chosen for x's rows (linear_op.cpp). */
at::Tensor linear_cpu(const at::Tensor &x, const at::Tensor &weight, const OptTensor &bias,
                      const OptTensor &packed, const OptTensor &plan);

/* `kiln::gguf_linear_native`: the same over a GGUF weight's blocks (or its dense copy). */
at::Tensor gguf_linear_cpu(const at::Tensor &x, const at::Tensor &blocks, int64_t qtype,
                           int64_t out_features, const OptTensor &bias, const OptTensor &weight,
                           const OptTensor &packed, const OptTensor &plan);

}  // namespace kiln::linear

#endif  // KILN_LINEAR_CPU_H
