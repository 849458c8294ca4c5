/* Rows of a weight's GGUF blocks in the kernel's layout (gguf_blocks.h), dequantized: the lookup
 * of an embedding whose table is a tied LM head's blocks, so that no dense copy of it is kept. */
#include <stdint.h>
#include <string.h>

#include "dtype.h"
#include "gguf_blocks.h"
#include "kernels.h"

/* Row c (of its group's GROUP_ROWS) of one 32-value kernel block at o, dequantized as
 * gguf_layout.dequantize does: a q + b, or a q, in float32. The product and the sum are rounded
 * apart, as torch's two ops are (a fused multiply-add would round once and differ). */
__attribute__((optimize("fp-contract=off"))) static void decode(const uint8_t *o, int32_t qtype,
                                                                 int c, float *out) {
    const int wide = qtype == GGML_Q8_0 || qtype == GGML_Q6_K; /* a byte per value */
    const int scales = qtype == GGML_Q8_0 ? 1 : 2;
    const uint8_t *values = o + 4 * GROUP_ROWS * scales;
    float a, b = 0.0f;
    memcpy(&a, o + 4 * c, 4);
    if (scales == 2) memcpy(&b, o + 4 * GROUP_ROWS + 4 * c, 4);
    int32_t q[QK];
    if (wide) {
        const int32_t offset = qtype == GGML_Q8_0 ? 128 : 32;
        for (int t = 0; t < QK; ++t) q[t] = values[(t / 4) * 64 + 4 * c + t % 4] - offset;
    } else {
        for (int t = 0; t < QK / 2; ++t) {
            const uint8_t v = values[(t / 4) * 64 + 4 * c + t % 4];
            q[t] = v & 15;
            q[t + QK / 2] = v >> 4;
        }
        if (qtype == GGML_Q5_K) { /* bit 4 c + i of mask j: value 4 j + i's fifth bit */
            const uint8_t *masks = values + GROUP_ROWS * QK / 2;
            for (int t = 0; t < QK; ++t) {
                const int bit = 4 * c + t % 4;
                q[t] |= ((masks[8 * (t / 4) + bit / 8] >> (bit % 8)) & 1) << 4;
            }
        }
    }
    if (qtype == GGML_Q6_K) { /* a scale per 16 values */
        for (int t = 0; t < QK; ++t) out[t] = (t < QK / 2 ? a : b) * (float)q[t];
    } else if (scales == 2) {
        for (int t = 0; t < QK; ++t) {
            const float product = a * (float)q[t];
            out[t] = product + b;
        }
    } else {
        for (int t = 0; t < QK; ++t) out[t] = a * (float)q[t];
    }
}

/* out [n, in_features] (dtype) = rows ids[0..n) of the [rows, in_features] weight whose blocks
 * (qtype, kernel layout: rows rounded up to whole groups) are at `blocks`. 1 for a type the
 * layout does not hold or a width that is not whole blocks. The ids are not checked here: the
 * caller (ops_gguf.cpp) refuses any outside the weight's rows by name. */
int kiln_gguf_rows(const uint8_t *blocks, int32_t qtype, int64_t in_features,
                   const int64_t *ids, int64_t n, void *out, int32_t dtype, int32_t num_threads) {
    const int per_file_block = gguf_block_values(qtype);
    if (gguf_block_bytes(qtype) == 0 || in_features <= 0 || in_features % per_file_block)
        return 1;
    const int64_t nb = in_features / QK; /* 32-value kernel blocks a row */
    const int64_t bb = gguf_kernel_block_bytes(qtype) / (per_file_block / QK);
    const int64_t group_bytes = GROUP_ROWS * nb * bb;
#pragma omp parallel for num_threads(num_threads) if (n * in_features >= (1 << 16))
    for (int64_t i = 0; i < n; ++i) {
        const uint8_t *group = blocks + ids[i] / GROUP_ROWS * group_bytes;
        const int c = (int)(ids[i] % GROUP_ROWS);
        float values[QK];
        for (int64_t j = 0; j < nb; ++j) {
            decode(group + j * GROUP_ROWS * bb, qtype, c, values);
            for (int t = 0; t < QK; ++t) store_elem(out, i * in_features + j * QK + t, values[t],
                                                    dtype);
        }
    }
    return 0;
}
