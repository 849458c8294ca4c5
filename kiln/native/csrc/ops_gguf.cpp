/* GGUF blocks and the dense GEMV kernel as torch ops: the blocks' sizes (gguf_blocks.h), their
 * conversion into the kernel's layout (gguf_layout.c), the blocks matmul itself (gguf_matmul.c),
 * the lookup of their rows (gguf_rows.c) and the GEMV (gemv.c), called alone; `kiln::linear_native` (linear_op.cpp) picks between them
 * per call. */
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "gguf_sizes.h"
#include "torch_ops.h"

namespace {

/* (vector code compiled in, block bytes, block values, kernel block bytes, group rows) */
std::vector<int64_t> info(int64_t qtype) {
    const int32_t t = static_cast<int32_t>(qtype);
    return {kiln_gguf_simd(), kiln_gguf_block_bytes(t), kiln_gguf_block_values(t),
            kiln_gguf_kernel_block_bytes(t), kiln_gguf_group_rows()};
}

at::Tensor to_kernel_layout(const at::Tensor &rows, int64_t qtype) {
    const int32_t t = static_cast<int32_t>(qtype);
    const int64_t per_block = kiln_gguf_block_bytes(t);
    TORCH_CHECK_VALUE(rows.scalar_type() == at::kByte && rows.dim() == 2 && per_block > 0 &&
                          rows.size(1) % per_block == 0 && rows.is_contiguous(),
                      "expected contiguous uint8 [out, row_bytes] blocks of ggml type ", qtype,
                      ", got ", rows.scalar_type(), " ", rows.sizes());
    const int64_t in_features = rows.size(1) / per_block * kiln_gguf_block_values(t);
    at::Tensor out = at::empty(kiln::gguf_kernel_shape(t, rows.size(0), in_features),
                               rows.options());
    const int rc = kiln_gguf_to_kernel_layout(rows.data_ptr<uint8_t>(), t, rows.size(0),
                                              rows.size(1) / per_block, out.data_ptr<uint8_t>());
    TORCH_CHECK(rc == 0, "kiln_gguf_to_kernel_layout failed with code ", rc,
                " (1: a type it does not read, 3: out of memory)");
    return out;
}

at::Tensor gguf_matmul(const at::Tensor &x, const at::Tensor &blocks, int64_t qtype,
                       int64_t out_features, const std::optional<at::Tensor> &bias,
                       int64_t limbs) {
    const int32_t dtype = kiln::kernel_dtype(x, "kiln::gguf_matmul");
    const int64_t k = x.size(-1);
    TORCH_CHECK_VALUE(kiln::gguf_blocks_fit(blocks, static_cast<int32_t>(qtype), out_features, k),
                      "kiln::gguf_matmul: blocks ", blocks.sizes(), " are not the kernel layout "
                      "of a [", out_features, ", ", k, "] weight of ggml type ", qtype,
                      " (see gguf_matmul.kernel_blocks)");
    TORCH_CHECK_VALUE(!bias || (bias->numel() == out_features &&
                                bias->scalar_type() == x.scalar_type()),
                      "kiln::gguf_matmul: bias must be ", out_features, " values of x's dtype");
    TORCH_CHECK_VALUE(limbs == 2 || limbs == 3, "kiln::gguf_matmul: limbs must be 2 or 3");
    const at::Tensor xc = x.contiguous();
    const at::Tensor b = bias ? bias->contiguous() : at::Tensor();
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = out_features;
    at::Tensor out = at::empty(shape, x.options());
    const int rc = kiln_gguf_matmul(xc.data_ptr(), blocks.data_ptr<uint8_t>(),
                                    static_cast<int32_t>(qtype), b.defined() ? b.data_ptr() : nullptr,
                                    out.data_ptr(), static_cast<int32_t>(k ? x.numel() / k : 0),
                                    out_features, k, dtype, static_cast<int32_t>(limbs),
                                    kiln::threads());
    TORCH_CHECK(rc == 0, "kiln_gguf_matmul failed with code ", rc,
                " (1: no rows, or a bad type or width)");
    return out;
}

/* Rows `ids` of the [num_embeddings, embedding_dim] weight whose kernel-layout blocks these are,
 * dequantized into dtype: [*ids.shape, embedding_dim] (the IR op gguf_embedding). */
at::Tensor gguf_embedding(const at::Tensor &ids, const at::Tensor &blocks, int64_t qtype,
                          int64_t num_embeddings, int64_t embedding_dim, at::ScalarType dtype) {
    TORCH_CHECK_VALUE(kiln::gguf_blocks_fit(blocks, static_cast<int32_t>(qtype), num_embeddings,
                                            embedding_dim),
                      "kiln::gguf_embedding: blocks ", blocks.sizes(), " are not the kernel "
                      "layout of a [", num_embeddings, ", ", embedding_dim, "] weight of ggml "
                      "type ", qtype);
    TORCH_CHECK_VALUE(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt,
                      "kiln::gguf_embedding: ids must be int64 or int32, got ", ids.scalar_type());
    at::Tensor out = at::empty({ids.numel(), embedding_dim}, blocks.options().dtype(dtype));
    const int32_t code = kiln::kernel_dtype(out, "kiln::gguf_embedding");
    const at::Tensor flat = ids.to(at::kLong).contiguous();
    const int64_t n = flat.numel(), *id = flat.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i)
        TORCH_CHECK_INDEX(id[i] >= 0 && id[i] < num_embeddings, "kiln::gguf_embedding: token id ",
                          id[i], " is outside the vocabulary [0, ", num_embeddings, ")");
    kiln::check_rc(kiln_gguf_rows(blocks.data_ptr<uint8_t>(), static_cast<int32_t>(qtype),
                                  embedding_dim, id, n, out.data_ptr(), code,
                                  kiln::threads()),
                   "kiln_gguf_rows");
    std::vector<int64_t> shape = ids.sizes().vec();
    shape.push_back(embedding_dim);
    return out.view(shape);
}

at::Tensor gemv(const at::Tensor &x, const at::Tensor &weight,
                const std::optional<at::Tensor> &bias) {
    const int32_t dtype = kiln::kernel_dtype(x, "kiln::gemv");
    const int64_t k = x.size(-1), n = weight.size(0);
    TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) == k && weight.is_contiguous() &&
                          weight.scalar_type() == x.scalar_type() && k > 0,
                      "kiln::gemv: weight ", weight.scalar_type(), " ", weight.sizes(),
                      " must be contiguous [n, ", k, "] of x's dtype");
    TORCH_CHECK_VALUE(!bias || (bias->numel() == n && bias->scalar_type() == x.scalar_type()),
                      "kiln::gemv: bias must be ", n, " values of x's dtype");
    const at::Tensor xc = x.contiguous();
    const at::Tensor b = bias ? bias->contiguous() : at::Tensor();
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = n;
    at::Tensor out = at::empty(shape, x.options());
    kiln::check_rc(kiln_gemv(xc.data_ptr(), weight.data_ptr(), b.defined() ? b.data_ptr() : nullptr,
                             out.data_ptr(), static_cast<int32_t>(x.numel() / k), n, k, dtype,
                             kiln::threads()),
                   "kiln_gemv");
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) {
    m.def("gguf_info(int qtype) -> int[]", &info);
    m.def("gguf_to_kernel_layout(Tensor rows, int qtype) -> Tensor");
    m.def("gguf_matmul(Tensor x, Tensor blocks, int qtype, int out_features, Tensor? bias, "
          "int limbs) -> Tensor");
    m.def("gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
    m.def("gguf_embedding_native(Tensor ids, Tensor blocks, int qtype, int num_embeddings, "
          "int embedding_dim, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
    m.impl("gguf_to_kernel_layout", &to_kernel_layout);
    m.impl("gguf_matmul", &gguf_matmul);
    m.impl("gemv", &gemv);
    m.impl("gguf_embedding_native", &gguf_embedding);
}
