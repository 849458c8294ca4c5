/* The shape of a weight's GGUF blocks in the kernel's layout, for the C++ ops that take them. */
#ifndef KILN_GGUF_SIZES_H
#define KILN_GGUF_SIZES_H

#include <ATen/core/Tensor.h>

#include <vector>

#include "kernels.h"

namespace kiln {

/* [out_features rounded up to whole groups, kernel row bytes]; {0, 0} for a type the kernel
 * does not read or a width that is not whole blocks. */
inline std::vector<int64_t> gguf_kernel_shape(int32_t qtype, int64_t out_features,
                                              int64_t in_features) {
    const int64_t values = kiln_gguf_block_values(qtype), group = kiln_gguf_group_rows();
    if (values <= 0 || in_features % values != 0) return {0, 0};
    return {(out_features + group - 1) / group * group,
            in_features / values * kiln_gguf_kernel_block_bytes(qtype)};
}

/* blocks are uint8 in the kernel's layout of an [out_features, in_features] weight (the kernel
 * reads the whole shape without bounds: anything else must not reach it). */
inline bool gguf_blocks_fit(const at::Tensor &blocks, int32_t qtype, int64_t out_features,
                            int64_t in_features) {
    const std::vector<int64_t> want = gguf_kernel_shape(qtype, out_features, in_features);
    return want[0] > 0 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
           blocks.dim() == 2 && blocks.size(0) == want[0] && blocks.size(1) == want[1];
}

}  // namespace kiln

#endif
